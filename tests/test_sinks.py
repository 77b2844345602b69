"""Attention sinks (gpt-oss): one logit per head that joins every row's softmax denominator and has no
value. The reference against its definition (a score column appended and dropped), the kernels' path
(forward, backward and the sinks' own gradient) on dense, packed and KV-cache calls against float64,
and the custom operator under torch.compile.
"""

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


def test_reference_is_a_softmax_over_the_scores_and_the_sink():
    """naive_attention with sinks equals softmax over [S, s_h] with the sink's column dropped, and its
    LSE is the log-sum-exp over both; rows with no key get o = 0 and LSE = s_h."""
    q, k, v = (torch.randn(2, 4, 7, 8, dtype=torch.float64) for _ in range(3))
    k, v = k[:, :2, :5], v[:, :2, :5]  # GQA 4:2, N = 7 > M = 5: causal rows 0 and 1 see no key
    sinks = torch.randn(4, dtype=torch.float64) * 3
    o, lse = reference.naive_attention(q, k, v, causal=True, sinks=sinks)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    s = q @ kk.transpose(-1, -2) / 8 ** 0.5
    s = s.masked_fill(~torch.ones(7, 5, dtype=torch.bool).tril(5 - 7), float("-inf"))
    full = torch.cat([s, sinks.view(1, 4, 1, 1).expand(2, 4, 7, 1)], -1)
    p = torch.softmax(full, -1)[..., :-1]
    torch.testing.assert_close(o, p @ vv, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, torch.logsumexp(full, -1), rtol=0, atol=1e-12)
    assert (o[:, :, :2] == 0).all() and torch.equal(lse[:, :, 0], sinks.expand(2, 4))


def test_with_sinks_turns_the_plain_outputs_into_the_sink_outputs():
    """The identity the package runs: o' = o exp(lse - lse'), lse' = logaddexp(lse, s), in float64."""
    from flashattn.autograd import with_sinks

    q, k, v = (torch.randn(2, 4, 9, 8, dtype=torch.float64) for _ in range(3))
    sinks = torch.randn(4, dtype=torch.float64)
    plain = reference.naive_attention(q, k, v, causal=True)
    got = with_sinks(*plain, sinks, packed=False)
    want = reference.naive_attention(q, k, v, causal=True, sinks=sinks)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_sinks_gradient_matches_finite_differences():
    """The sinks' gradient (float64 CPU, the reference path of flashattn.attention) against central
    differences of the loss, and against autograd through the definition."""
    q, k, v = (torch.randn(1, 2, 6, 16, dtype=torch.float64) for _ in range(3))
    sinks = torch.randn(2, dtype=torch.float64, requires_grad=True)
    w = torch.randn(1, 2, 6, 16, dtype=torch.float64)
    loss = (lambda s: (flashattn.attention(q, k, v, causal=True, sinks=s) * w).sum())
    (grad,) = torch.autograd.grad(loss(sinks), sinks)
    eps = 1e-6
    for h in range(2):
        e = torch.zeros(2, dtype=torch.float64)
        e[h] = eps
        fd = (loss(sinks.detach() + e) - loss(sinks.detach() - e)) / (2 * eps)
        assert abs(float(fd) - float(grad[h])) < 1e-7
    assert grad.abs().max() > 1e-3  # the sink moves the loss


def _dense_case(dtype, b, h_q, h_kv, n, m, d, options, std=1.0, seed=0):
    q, k, v = _randn(b, h_q, n, d, dtype=dtype, seed=seed, std=std), _randn(b, h_kv, m, d, dtype=dtype, seed=seed + 1,
                                                                             std=std), _randn(b, h_kv, m, d, dtype=dtype,
                                                                                               seed=seed + 2)
    sinks = _randn(h_q, dtype=torch.float32, seed=seed + 3, std=2.0)
    do, dlse = _randn(b, h_q, n, d, dtype=dtype, seed=seed + 4), _randn(b, h_q, n, dtype=torch.float32, seed=seed + 5)
    leaves = [x.detach().requires_grad_() for x in (q, k, v, sinks)]
    o, lse = flashattn.attention(*leaves[:3], sinks=leaves[3], return_lse=True, **options)
    got = (o, lse, *torch.autograd.grad([o, lse], leaves, [do, dlse]))
    causal = options.get("causal", False)
    variants = {key: val for key, val in options.items() if key != "causal"}
    refs = []
    for ref_dtype in (torch.float64, dtype):
        ref_leaves = [x.detach().to(ref_dtype if i < 3 else torch.float64).requires_grad_()
                      for i, x in enumerate((q, k, v, sinks))]
        o_r, lse_r = reference.naive_attention(*ref_leaves[:3], causal=causal, sinks=ref_leaves[3], **variants)
        grads = torch.autograd.grad([o_r, lse_r], ref_leaves, [do.to(ref_dtype), dlse.to(lse_r.dtype)])
        refs.append((o_r, lse_r, *grads))
    for name, g, r, lp in zip(("o", "lse", "dq", "dk", "dv", "dsinks"), got, *refs):
        assert g.shape == r.shape and torch.isfinite(g).all(), name
        assert_close_ratio(name, g.detach(), r.detach(), lp.detach(), floor=1e-4 if name == "dsinks" else 1e-5)


DENSE = [  # (name, B, Hq, Hkv, N, M, D, options)
    ("plain-gqa", 2, 4, 2, 33, 40, 24, {}),
    ("causal-empty-rows", 1, 2, 1, 45, 20, 40, dict(causal=True)),
    ("window-softcap-dropout", 2, 2, 2, 37, 37, 16, dict(causal=True, window=(9, 0), softcap=3.0, dropout_p=0.2,
                                                           seed=11)),
    ("window-gqa-d80", 1, 4, 2, 40, 52, 80, dict(causal=True, window=(7, 0))),
]


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", DENSE, ids=[c[0] for c in DENSE])
def test_interpreter_dense_with_sinks_matches_float64(case, dtype):
    _dense_case(dtype, *case[1:])


@cpu_only
def test_interpreter_packed_with_sinks_matches_float64():
    lens_q, lens_k = [5, 0, 30, 9], [7, 3, 30, 0]
    q, k, v = _randn(44, 4, 16), _randn(40, 2, 16, seed=1), _randn(40, 2, 16, seed=2)
    sinks, do = _randn(4, dtype=torch.float32, seed=3, std=2.0), _randn(44, 4, 16, seed=4)
    leaves = [x.detach().requires_grad_() for x in (q, k, v, sinks)]
    o = flashattn.attention_varlen(*leaves[:3], _cu(lens_q), _cu(lens_k), 30, 30, causal=True, window=(6, 0),
                                   sinks=leaves[3])
    got = (o, *torch.autograd.grad(o, leaves, do))
    refs = []
    for ref_dtype in (torch.float64, torch.float16):
        ref_leaves = [x.detach().to(ref_dtype if i < 3 else torch.float64).requires_grad_()
                      for i, x in enumerate((q, k, v, sinks))]
        o_r, _ = reference.varlen_attention(*ref_leaves[:3], _cu(lens_q), _cu(lens_k), True, window=(6, 0),
                                            sinks=ref_leaves[3])
        refs.append((o_r, *torch.autograd.grad(o_r, ref_leaves, do.to(ref_dtype))))
    for name, g, r, lp in zip(("o", "dq", "dk", "dv", "dsinks"), got, *refs):
        assert_close_ratio(name, g.detach(), r.detach(), lp.detach(), floor=1e-4 if name == "dsinks" else 1e-5)
    # a sequence without keys: o = 0 and the rows' LSE is the sink
    _, lse = flashattn.attention_varlen(q, k, v, _cu(lens_q), _cu(lens_k), 30, 30, sinks=sinks, return_lse=True)
    assert torch.equal(lse[:, 35:44], sinks[:, None].expand(4, 9))


def test_compiled_call_with_sinks_equals_the_eager_one():
    """Under torch.compile(fullgraph=True) the custom operator takes the sinks and sends their gradient
    back (float32 CPU: the reference backend)."""
    q, k, v = (torch.randn(2, 4, 12, 16) for _ in range(3))
    sinks = torch.randn(4)
    leaves = lambda: [x.clone().requires_grad_() for x in (q, k, v, sinks)]  # noqa: E731
    fn = lambda a, b, c, s: flashattn.attention(a, b, c, causal=True, sinks=s)  # noqa: E731
    runs = []
    for f in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
        xs = leaves()
        o = f(*xs)
        runs.append((o.detach(), *torch.autograd.grad(o.square().sum(), xs)))
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sinks, error, words", [
    (torch.zeros(3), ValueError, r"\(Hq,\) = \(4,\)"),
    (torch.zeros(4, dtype=torch.int32), TypeError, "floating-point"),
    ([0.0] * 4, TypeError, "floating-point"),
])
def test_bad_sinks_are_refused(sinks, error, words):
    q, k, v = (torch.randn(1, 4, 5, 16) for _ in range(3))
    with pytest.raises(error, match=words):
        flashattn.attention(q, k, v, sinks=sinks)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", [
    ("gqa-causal", 2, 32, 8, 1024, 1024, 64, dict(causal=True)),
    ("window", 1, 8, 8, 2048, 2048, 128, dict(causal=True, window=(127, 0))),
    ("n-ne-m-large-logits", 2, 4, 2, 700, 333, 96, {}),
], ids=lambda c: c[0])
def test_gpu_dense_with_sinks_matches_float64(case, dtype):
    _dense_case(dtype, *case[1:], std=2.0 if "large" in case[0] else 1.0)


@gpu
@needs_cuda
def test_gpu_packed_and_cache_with_sinks_match_float64():
    lens = [300, 0, 1200, 77]
    q, k, v = _randn(sum(lens), 8, 64, dtype=torch.bfloat16), _randn(sum(lens), 2, 64, dtype=torch.bfloat16, seed=1), \
        _randn(sum(lens), 2, 64, dtype=torch.bfloat16, seed=2)
    sinks = _randn(8, dtype=torch.float32, seed=3, std=2.0)
    o = flashattn.attention_varlen(q, k, v, _cu(lens), _cu(lens), 1200, 1200, causal=True, sinks=sinks)
    o_r = reference.varlen_attention(q.double(), k.double(), v.double(), _cu(lens), _cu(lens), True,
                                     sinks=sinks.double())[0]
    o_l = reference.varlen_attention(q, k, v, _cu(lens), _cu(lens), True, sinks=sinks.to(torch.bfloat16))[0]
    assert_close_ratio("o", o, o_r, o_l)
    # decoding: one query against a cache of 4k keys, the split-KV kernels then the sinks
    qd, kc, vc = _randn(3, 1, 8, 64, dtype=torch.bfloat16, seed=5), _randn(3, 4096, 2, 64, dtype=torch.bfloat16, seed=6), \
        _randn(3, 4096, 2, 64, dtype=torch.bfloat16, seed=7)
    lengths = torch.tensor([4096, 1000, 17], dtype=torch.int32, device=DEVICE)
    with torch.no_grad():
        od = flashattn.attention_with_kvcache(qd, kc, vc, cache_seqlens=lengths, sinks=sinks)
    ref = reference.kvcache_options_reference(qd.double(), kc.double(), vc.double(), lengths.cpu(), sinks=sinks.double())
    low = reference.kvcache_options_reference(qd, kc, vc, lengths.cpu(), sinks=sinks.to(torch.bfloat16))
    assert_close_ratio("o", od, ref[0], low[0])


@cpu_only
def test_interpreter_kernels_join_the_sinks_themselves(monkeypatch):
    """On the kernels' path the forward joins the sinks in its epilogue and the dQ kernel sums the
    sinks' gradient from its row statistics: no PyTorch pass over O or over the rows (with_sinks,
    sinks_grad) runs, and the results still match the float64 definition,
    dense and packed, with sinks of any strides."""
    from flashattn import autograd

    def refuse(*args, **kwargs):
        raise AssertionError("a PyTorch pass over O or the rows ran on the kernels' path")

    monkeypatch.setattr(autograd, "with_sinks", refuse)
    monkeypatch.setattr(autograd, "sinks_grad", refuse)
    _dense_case(torch.float16, 2, 4, 2, 33, 40, 24, dict(causal=True))
    lens = [9, 0, 17]
    q, k, v = _randn(26, 4, 16), _randn(26, 2, 16, seed=1), _randn(26, 2, 16, seed=2)
    do = _randn(26, 4, 16, seed=4)
    base = _randn(8, dtype=torch.float32, seed=3, std=2.0)
    grads = []
    for sinks in (base[::2].detach().requires_grad_(), base[::2].clone().requires_grad_()):  # strided, then not
        o = flashattn.attention_varlen(q, k, v, _cu(lens), _cu(lens), 17, 17, causal=True, sinks=sinks)
        grads.append(torch.autograd.grad(o, sinks, do)[0])
    assert torch.equal(grads[0], grads[1])
    ref_leaves = [x.double().requires_grad_() for x in (q, k, v, base[::2])]
    o_r = reference.varlen_attention(*ref_leaves[:3], _cu(lens), _cu(lens), True, sinks=ref_leaves[3])[0]
    (ref,) = torch.autograd.grad(o_r, ref_leaves[3], do.double())
    low_leaves = [x.detach().requires_grad_() for x in (q, k, v)] + [base[::2].detach().requires_grad_()]
    o_l = reference.varlen_attention(*low_leaves[:3], _cu(lens), _cu(lens), True, sinks=low_leaves[3])[0]
    (low,) = torch.autograd.grad(o_l, low_leaves[3], do)
    assert_close_ratio("dsinks", grads[0], ref, low, floor=1e-4)


@gpu
@needs_cuda
def test_gpu_repeated_calls_take_each_calls_sinks():
    """A repeated call replays the first one's launches (flashattn.launch): the sinks are one of its
    bound inputs, so a second call with other sink values gives that call's result, not the first's."""
    q, k, v = (_randn(2, 8, 512, 64, dtype=torch.bfloat16, seed=s) for s in range(3))
    ref = lambda s: reference.naive_attention(q.double(), k.double(), v.double(), causal=True,  # noqa: E731
                                              sinks=s.double())[0]
    low = lambda s: reference.naive_attention(q, k, v, causal=True, sinks=s.to(torch.bfloat16))[0]  # noqa: E731
    for seed in (10, 11, 12):  # the first call records, the later ones replay
        sinks = _randn(8, dtype=torch.float32, seed=seed, std=3.0)
        assert_close_ratio("o", flashattn.attention(q, k, v, causal=True, sinks=sinks), ref(sinks), low(sinks))


def test_a_sink_of_minus_infinity_on_rows_with_no_key_gives_no_nan():
    """A sink of -inf is no sink: rows that see no key keep o = 0 and lse = -inf, and no gradient is NaN
    (-inf - (-inf) would be), on the reference path and in the identity the other paths use."""
    from flashattn.autograd import sinks_grad, with_sinks

    q, k, v = (torch.randn(1, 2, 6, 16, dtype=torch.float64) for _ in range(3))
    k, v = k[:, :, :3], v[:, :, :3]  # causal, N = 6 > M = 3: rows 0-2 see no key
    sinks = torch.tensor([float("-inf"), 0.5], dtype=torch.float64, requires_grad=True)
    o, lse = flashattn.attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
    (g,) = torch.autograd.grad(o.sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum(), sinks)
    assert not o.isnan().any() and not g.isnan().any()
    assert (o[0, 0, :3] == 0).all() and torch.isinf(lse[0, 0, :3]).all() and g[0] == 0
    o_p, lse_p = reference.naive_attention(q, k, v, causal=True)
    o2, lse2 = with_sinks(o_p, lse_p, sinks.detach(), packed=False)
    assert not o2.isnan().any() and torch.equal(lse2[0, 0, :3], lse_p[0, 0, :3])
    assert not sinks_grad(torch.ones_like(o2), o2, lse2, None, sinks.detach(), False).isnan().any()
