"""Split head dims: values whose head dim D_v differs from the queries' and keys' D (e.g. 192 / 128 in
DeepSeek's MLA prefill). q, k (.., D), v (.., D_v), o (.., D_v); forward and backward, dense and
packed, against float64."""

from __future__ import annotations

import itertools

import pytest
import torch

import flashattn
from flashattn import reference
from flashattn.testing import assert_close_ratio

from devices import DEVICE, cpu_only, gpu, needs_cuda


def _randn(*shape, dtype=torch.float16, seed=0, std=1.0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(*shape, dtype=dtype, device=DEVICE, generator=gen) * std


def _cu(lengths):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=DEVICE)


def _compare(got, run_reference, leaves, grads_in, dtype):
    """got = (o, lse?, dq, dk, dv); run_reference(leaves) -> (o, lse) of the definition."""
    refs = []
    for ref_dtype in (torch.float64, dtype):
        ref_leaves = [x.detach().to(ref_dtype).requires_grad_() for x in leaves]
        o, lse = run_reference(ref_leaves)
        grads = torch.autograd.grad([o, lse], ref_leaves, [g.to(o.dtype if i == 0 else lse.dtype)
                                                           for i, g in enumerate(grads_in)])
        refs.append((o, lse, *grads))
    for name, g, r, lp in zip(("o", "lse", "dq", "dk", "dv"), got, *refs):
        assert g.shape == r.shape, name
        assert not torch.isnan(g).any(), name  # (lse is -inf on rows that see no key)
        assert_close_ratio(name, g.detach(), r.detach(), lp.detach())


def _dense(b, h_q, h_kv, n, m, d, d_v, dtype, layout="bhnd", std=1.0, **options):
    q = _randn(b, h_q, n, d, dtype=dtype, std=std)
    k = _randn(b, h_kv, m, d, dtype=dtype, seed=1, std=std)
    v = _randn(b, h_kv, m, d_v, dtype=dtype, seed=2)
    if layout == "bnhd":  # (B, N, H, D) storage seen as (B, H, N, D): no tensor is contiguous
        q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    o, lse = flashattn.attention(*leaves, return_lse=True, **options)
    assert o.shape == (b, h_q, n, d_v) and o.dtype == dtype
    do = _randn(*o.shape, dtype=dtype, seed=3)
    dlse = torch.where(torch.isfinite(lse), _randn(*lse.shape, dtype=torch.float32, seed=4), 0.0)
    got = (o, lse, *torch.autograd.grad([o, lse], leaves, [do, dlse]))
    causal = options.pop("causal", False)
    _compare(got, lambda xs: reference.naive_attention(*xs, causal=causal, **options), (q, k, v), (do, dlse), dtype)


DENSE = [  # (name, B, Hq, Hkv, N, M, D, D_v, layout, options)
    ("mla-like-causal", 2, 4, 2, 45, 45, 48, 32, "bhnd", dict(causal=True)),
    ("dv-wider-n-ne-m", 1, 2, 2, 33, 50, 24, 40, "bnhd", {}),
    ("causal-empty-rows", 1, 4, 1, 40, 17, 40, 24, "bhnd", dict(causal=True)),
    ("variants", 2, 2, 1, 37, 37, 40, 16, "bhnd", dict(causal=True, window=(7, 0), softcap=3.0,
                                                       alibi_slopes=torch.rand(2), dropout_p=0.15, seed=9)),
]


@cpu_only
@pytest.mark.parametrize("case", DENSE, ids=[c[0] for c in DENSE])
def test_interpreter_dense_split_head_dims_match_float64(case):
    _, b, h_q, h_kv, n, m, d, d_v, layout, options = case
    options = {key: (val.to(DEVICE) if isinstance(val, torch.Tensor) else val) for key, val in options.items()}
    _dense(b, h_q, h_kv, n, m, d, d_v, torch.float16, layout, **options)


def _packed(lens_q, lens_k, h_q, h_kv, d, d_v, dtype, **options):
    q = _randn(sum(lens_q), h_q, d, dtype=dtype)
    k, v = _randn(sum(lens_k), h_kv, d, dtype=dtype, seed=1), _randn(sum(lens_k), h_kv, d_v, dtype=dtype, seed=2)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    o, lse = flashattn.attention_varlen(*leaves, cu_q, cu_k, max(lens_q), max(lens_k), return_lse=True, **options)
    assert o.shape == (sum(lens_q), h_q, d_v)
    do = _randn(*o.shape, dtype=dtype, seed=3)
    dlse = torch.where(torch.isfinite(lse), _randn(*lse.shape, dtype=torch.float32, seed=4), 0.0)
    got = (o, lse, *torch.autograd.grad([o, lse], leaves, [do, dlse]))
    causal = options.pop("causal", False)
    _compare(got, lambda xs: reference.varlen_attention(*xs, cu_q, cu_k, causal, **options), (q, k, v), (do, dlse),
             dtype)


@cpu_only
def test_interpreter_packed_split_head_dims_match_float64():
    _packed([5, 0, 30, 9], [7, 3, 30, 0], 4, 2, 48, 32, torch.float16, causal=True, window=(8, 0))


def test_reference_path_and_compiled_operator_take_split_head_dims():
    """float32 CPU (the reference backend) eagerly and under torch.compile(fullgraph=True): same
    output, of v's head dim, and same gradients."""
    q, k, v = torch.randn(2, 4, 9, 24), torch.randn(2, 2, 11, 24), torch.randn(2, 2, 11, 16)
    fn = lambda a, b, c: flashattn.attention(a, b, c, causal=True)  # noqa: E731
    runs = []
    for f in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        o = f(*xs)
        runs.append((o.detach(), *torch.autograd.grad(o.square().sum(), xs)))
    assert runs[0][0].shape == (2, 4, 9, 16)
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    want = reference.naive_attention(q.double(), k.double(), v.double(), causal=True)[0]
    torch.testing.assert_close(runs[0][0].double(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("v_shape, words", [
    ((1, 2, 7, 8), "head dim D_v of v must be between"),
    ((1, 2, 6, 16), "same shape"),
])
def test_bad_value_shapes_are_refused(v_shape, words):
    q, k = torch.randn(1, 2, 5, 32), torch.randn(1, 2, 7, 32)
    with pytest.raises(ValueError, match=words):
        flashattn.attention(q, k, torch.randn(*v_shape))


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", [
    ("deepseek-192-128-causal", 2, 16, 16, 1024, 1024, 192, 128, "bnhd", dict(causal=True)),
    ("128-64-gqa", 2, 8, 2, 700, 900, 128, 64, "bhnd", {}),
    ("64-128-window", 1, 4, 4, 2048, 2048, 64, 128, "bhnd", dict(causal=True, window=(255, 0))),
], ids=lambda c: c[0])
def test_gpu_dense_split_head_dims_match_float64(case, dtype):
    _, b, h_q, h_kv, n, m, d, d_v, layout, options = case
    _dense(b, h_q, h_kv, n, m, d, d_v, dtype, layout, **options)


@gpu
@needs_cuda
def test_gpu_packed_split_head_dims_match_float64():
    _packed([300, 0, 1500, 77], [300, 20, 1500, 0], 16, 16, 192, 128, torch.bfloat16, causal=True)
