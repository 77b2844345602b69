"""The Triton kernels against the float64 reference.

Without CUDA the kernels run under Triton's CPU interpreter on small shapes (CI); with CUDA the tests
marked ``gpu`` run the same checks at realistic sizes. A kernel passes when its error against float64
is at most twice the error PyTorch's own low-precision computation makes, plus a small floor
(:func:`flashattn.testing.assert_close_ratio`); NaN or inf where the reference is finite never passes.
"""

from __future__ import annotations

import collections

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashattn
from flashattn import _config
from flashattn.backward import launch_backward as attention_backward
from flashattn.forward import launch_forward as attention_forward
from flashattn.problem import Problem
from flashattn.reference import naive_attention
from flashattn.testing import assert_close_ratio, random_qkv, rel_err

from devices import DEVICE, HAS_CUDA, cpu_only, gpu, needs_cuda


def _inputs(b, h_q, h_kv, n, m, d, dtype, *, layout="bhnd", std=1.0, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q, k, v = random_qkv(b, h_q, h_kv, n, m, d, dtype=dtype, device=DEVICE, layout=layout, generator=gen, std=std)
    do = torch.randn(q.shape, dtype=dtype, device=DEVICE, generator=gen)
    return q, k, v, do


def _references(q, k, v, do, causal, scale):
    """(float64 outputs, PyTorch low-precision outputs): each is (o, lse, dq, dk, dv)."""
    out = []
    for dtype in (torch.float64, q.dtype):
        qr, kr, vr = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
        o, lse = naive_attention(qr, kr, vr, causal=causal, scale=scale)
        o.backward(do.to(dtype))
        out.append((o.detach(), lse.detach(), qr.grad, kr.grad, vr.grad))
    return out


def _check_against_reference(q, k, v, do, causal, scale, *, floor=1e-5):
    """Run forward and backward kernels, assert the error ratio for each output, return the errors."""
    o, lse = attention_forward(q, k, v, Problem.of(q, k, causal, scale))
    dq, dk, dv = attention_backward(do, q, k, v, o, lse, Problem.of(q, k, causal, scale))
    assert o.shape == q.shape and o.dtype == q.dtype
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    for name, x in (("o", o), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.isfinite(x).all(), f"{name}: NaN or inf"
    assert not torch.isnan(lse).any(), "lse: NaN"
    ref, lowp = _references(q, k, v, do, causal, scale)
    errors = {}
    for name, out, r, lp in zip(("o", "lse", "dq", "dk", "dv"), (o, lse, dq, dk, dv), ref, lowp):
        errors[name], _ = assert_close_ratio(name, out, r, lp, floor=floor)
    return errors, (o, lse, dq, dk, dv)


def _empty_rows_are_zero(causal, n, m, o, lse, dq):
    """Rows with no visible key (causal, N > M): o = 0, lse = -inf, dq = 0."""
    if causal and n > m:
        empty = slice(0, n - m)
        assert (o[:, :, empty] == 0).all()
        assert (lse[:, :, empty] == float("-inf")).all()
        assert (dq[:, :, empty] == 0).all()
        assert torch.isfinite(lse[:, :, n - m:]).all()


# ----------------------------------------------------------------------------------------------
# Interpreter (CPU) tests: small shapes, the block sizes of flashattn._config's interpreter entry
# (BLOCK_M = 32, BLOCK_N = 16 forward and dQ; 16 x 32 dK/dV), so every case walks several blocks.
# ----------------------------------------------------------------------------------------------

# (B, Hq, Hkv, N, M, D, causal, layout)
CPU_CASES = [
    (1, 2, 2, 37, 53, 24, False, "bhnd"),  # ragged N and M, N < M
    (1, 2, 2, 37, 53, 24, True, "bhnd"),  # causal N < M: every query also sees the prefix
    (1, 2, 1, 70, 29, 16, True, "bhnd"),  # causal N > M: the first 41 rows see no key; GQA 2
    (2, 4, 1, 45, 45, 72, True, "bhnd"),  # GQA 4 (multi-query), D = 72 padded to 128
    (1, 2, 2, 50, 19, 128, False, "bnhd"),  # N > M non-causal, (B, N, H, D) transposed views
    (1, 4, 2, 33, 64, 128, True, "bnhd"),  # non-contiguous, GQA 2, N < M causal
    (1, 1, 1, 1, 1, 16, True, "bhnd"),  # the smallest problem
    (1, 2, 1, 1, 40, 24, True, "bhnd"),  # decoding: one query over a KV cache
    (1, 2, 2, 64, 48, 16, True, "bhnd"),  # N > M causal: rows 0-15 see no key; M = 48 splits dK/dV's 32-key block
]


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: "B{}-H{}x{}-N{}-M{}-D{}-{}-{}".format(
    c[0], c[1], c[2], c[3], c[4], c[5], "causal" if c[6] else "full", c[7]))
def test_interpreter_matches_float64(case, dtype):
    b, h_q, h_kv, n, m, d, causal, layout = case
    q, k, v, do = _inputs(b, h_q, h_kv, n, m, d, dtype, layout=layout)
    scale = d ** -0.5
    _, (o, lse, dq, _, _) = _check_against_reference(q, k, v, do, causal, scale)
    _empty_rows_are_zero(causal, n, m, o, lse, dq)


@cpu_only
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_interpreter_stores_stay_inside_their_outputs(causal, monkeypatch):
    """Each output the kernels store (o; dq, dk, dv) is given inside a larger buffer, with a guard row
    after every head's rows and guard columns past D (here 24, padded to 32 in the kernels), all holding
    a sentinel: after forward and backward the guards still hold it, and the results equal those in
    plain outputs bit for bit. A store of a padded row or column, or through another tensor's strides,
    would land in a guard (under the interpreter such a store otherwise only corrupts the heap)."""
    from flashattn import backward as bwd_mod, forward as fwd_mod

    buffers = []

    def guarded(x):
        *lead, rows, d = x.shape
        buf = torch.full((*lead, rows + 1, d + 8), 7.0, dtype=x.dtype, device=x.device)
        buffers.append((buf, rows, d))
        return buf[..., :rows, :d]

    q, k, v, do = _inputs(1, 2, 1, 37, 53, 24, torch.float16)
    p = Problem.of(q, k, causal, 24 ** -0.5)
    with monkeypatch.context() as m:  # guarded first: a stray store lands in a guard, not in the heap
        m.setattr(fwd_mod, "dense_like", guarded)
        m.setattr(bwd_mod, "dense_like", guarded)
        o, lse = attention_forward(q, k, v, p)
        outs = (o, *attention_backward(do, q, k, v, o, lse, p))
    assert len(buffers) == 4 and all(x.stride(-2) == 32 for x in outs)  # o, dq, dk, dv, each in a guarded buffer
    for buf, rows, d in buffers:
        assert (buf[..., rows:, :] == 7).all() and (buf[..., d:] == 7).all()
    plain_o, plain_lse = attention_forward(q, k, v, p)
    plain = (plain_o, *attention_backward(do, q, k, v, plain_o, plain_lse, p))
    assert all(torch.equal(a, b) for a, b in zip(outs, plain)) and torch.equal(lse, plain_lse)


@cpu_only
def test_interpreter_causal_offset_at_every_residue():
    """The causal diagonal at every offset M - N against the kernels' key blocks (16 keys forward and
    dQ, 32 dK/dV): the last full block and the first masked one move with (M - N) mod the block, and
    a bound off by one key shows up at one residue only, so each residue is run, against float64."""
    for m in range(2, 51):  # M - N from -16 to 32
        q, k, v, do = _inputs(1, 1, 1, 18, m, 16, torch.float16, seed=m)
        _check_against_reference(q, k, v, do, True, 0.25)


@cpu_only
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_interpreter_large_logits(causal):
    """Scores scale * q.k near 100 (144 in base 2): exp2 overflows fp32 unless every max is subtracted."""
    q, k, v, do = _inputs(1, 2, 1, 41, 37, 32, torch.float16, std=4.5, seed=3)
    scale = 32 ** -0.5
    s = scale * (q.double() @ k.double().repeat_interleave(2, dim=1).transpose(-1, -2))
    assert s.abs().max() > 60, "inputs do not produce large logits"
    _check_against_reference(q, k, v, do, causal, scale)


@cpu_only
def test_interpreter_custom_scale_and_zero_scale():
    q, k, v, do = _inputs(1, 2, 2, 20, 27, 40, torch.float16, seed=5)
    _check_against_reference(q, k, v, do, True, 0.37)
    _check_against_reference(q, k, v, do, False, 0.0)  # uniform attention: every key weighs 1/M


def _dirty_views(b, h_q, h_kv, n, m, d, dtype, fill, seed=0):
    """q, k, v, do as views into larger buffers whose rows past N (q, do) or M (k, v) hold ``fill``."""
    pad = 40  # more than a block, so any unmasked tile past the edge lands in the dirt
    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def make(h, length):
        buf = torch.randn(b, h, length + pad, d, dtype=dtype, device=DEVICE, generator=gen)
        buf[:, :, length:] = fill
        return buf[:, :, :length]

    return make(h_q, n), make(h_kv, m), make(h_kv, m), make(h_q, n)


@pytest.mark.parametrize("fill", [1.0e4, float("nan")], ids=["huge", "nan"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dirty_padding_never_reaches_the_gradients(causal, fill):
    """Rows past N (and keys past M) must contribute exactly nothing, whatever memory holds there.

    SPEC 7d: if the dK/dV loop let the padding rows of a ragged last query block take part unmasked,
    a "dirty" row of Q (here 1e4 in every entry, so its base-2 scores run far above 128) would make
    the recomputed P overflow to inf, and dS = P * (dP - D) = inf * 0 = NaN would reach dK through
    dS^T Q. The inputs here are views into larger buffers whose rows past N (for Q, dO) and past M
    (for K, V) are filled with such huge values or with NaN, so a kernel that reads or keeps any of
    them fails this test with NaN or a wrong answer. The kernels' tensor descriptors end at row N
    (or M), so those rows read as zeros, *and* their P is zeroed explicitly, so neither defence relies
    on the padding happening to be zero.
    """
    b, h_q, h_kv, n, m, d = 1, 2, 1, 45, 37, 32
    if HAS_CUDA:
        n, m = 1000, 777
    q, k, v, do = _dirty_views(b, h_q, h_kv, n, m, d, torch.float16, fill)
    assert not q.is_contiguous()
    _check_against_reference(q, k, v, do, causal, d ** -0.5)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_public_api_reaches_the_kernels(causal, monkeypatch):
    """flashattn.attention, through torch.autograd, calls these very kernels forward and backward."""
    calls = {"fwd": 0, "bwd": 0}
    fwd, bwd = flashattn.forward.launch_forward, flashattn.backward.launch_backward

    def counting_fwd(*args):
        calls["fwd"] += 1
        return fwd(*args)

    def counting_bwd(*args):
        calls["bwd"] += 1
        return bwd(*args)

    monkeypatch.setattr(flashattn.forward, "attention_forward", counting_fwd)
    monkeypatch.setattr(flashattn.backward, "attention_backward", counting_bwd)
    b, h_q, h_kv, n, m, d = (2, 4, 2, 300, 257, 64) if HAS_CUDA else (1, 2, 1, 21, 30, 16)
    q, k, v, do = _inputs(b, h_q, h_kv, n, m, d, torch.float16, seed=7)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    o, lse = flashattn.attention(qg, kg, vg, causal=causal, return_lse=True)
    o.backward(do)
    assert calls == {"fwd": 1, "bwd": 1}
    # the same numbers as calling the launchers directly
    problem = Problem.of(q, k, causal, d ** -0.5)
    o_k, lse_k = fwd(q, k, v, problem)
    dq_k, dk_k, dv_k = bwd(do, q, k, v, o_k, lse_k, problem)
    assert torch.equal(o, o_k) and torch.equal(lse, lse_k)
    assert torch.equal(qg.grad, dq_k) and torch.equal(kg.grad, dk_k) and torch.equal(vg.grad, dv_k)
    # and flash_attn_func's (B, N, H, D) layout reaches them too
    out = flashattn.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal)
    assert torch.equal(out.transpose(1, 2), o_k)


def _misaligned_views(b, h, n, d, dtype, seed=0):
    """Inputs a tensor descriptor cannot read in place, each a different way."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    odd_start = torch.randn(b * h * n * d + 1, dtype=dtype, device=DEVICE, generator=gen)[1:].view(b, h, n, d)
    strided_d = torch.randn(b, h, n, 2 * d, dtype=dtype, device=DEVICE, generator=gen)[..., ::2]
    odd_rows = torch.randn(b, h, n, d + 1, dtype=dtype, device=DEVICE, generator=gen)[..., :d]  # row stride d + 1
    return odd_start, strided_d, odd_rows


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_inputs_descriptors_cannot_read_are_copied(causal):
    """TMA needs a 16-byte aligned start and 16-byte multiples for every stride but the last.

    Inputs that break this (an odd start, a strided head dim, rows of an odd number of elements) are
    copied into padded buffers before the launch; the results must be as exact as for any input.
    D = 20 in fp16 is a 40-byte row: even the contiguous tensor needs the padded copy.
    """
    from flashattn.tensors import addressable as _addressable, describable as _describable

    b, h, n, d = (1, 4, 1000, 64) if HAS_CUDA else (1, 2, 37, 16)
    views = _misaligned_views(b, h, n, d, torch.float16)
    assert not any(_describable(x) for x in views)
    q, k, v = views
    do = torch.randn(q.shape, dtype=q.dtype, device=DEVICE)
    _check_against_reference(q, k, v, do, causal, d ** -0.5)
    for x in views:
        copy = _addressable(x)
        assert _describable(copy) and torch.equal(copy, x)

    q, k, v, do = _inputs(1, 2, 1, 300 if HAS_CUDA else 29, 200 if HAS_CUDA else 23, 20, torch.float16, seed=23)
    assert not _describable(q) and q.is_contiguous()
    _check_against_reference(q, k, v, do, causal, 20 ** -0.5)
    aligned = torch.randn(1, 2, 8, 64, dtype=torch.float16, device=DEVICE)
    assert _describable(aligned) and _addressable(aligned) is aligned  # no copy when none is needed


def test_fast_descriptor_is_the_checked_one(monkeypatch):
    """Off the interpreter, tile_desc fills Triton's TensorDescriptor in without its constructor's
    checks; every field must equal what the checking constructor makes, for dense and strided views."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from flashattn import _config, tensors
    from flashattn import launch as launch_mod

    assert tensors._descriptor_defaults() is not None  # this Triton takes the fast path
    base = torch.randn(2, 24, 3, 64, dtype=torch.float16)
    views = (torch.randn(2, 3, 24, 64, dtype=torch.float16), base.transpose(1, 2), base[:, 8:].transpose(1, 2))
    monkeypatch.setattr(_config, "is_interpreter", lambda: False)
    for x in views:
        assert tensors.describable(x)
        fast = tensors.tile_desc(x, 16, 64)
        checked = TensorDescriptor(x, list(x.shape), list(x.stride()), [1, 1, 16, 64])
        assert type(fast) is TensorDescriptor and fast.base is x
        assert {k: v for k, v in vars(fast).items() if k not in ("base", "flashattn_key")} == {
            k: v for k, v in vars(checked).items() if k != "base"}
        assert fast.flashattn_key == tensors._descriptor_key(checked)  # the launch cache's key of it
    desc = tensors.Descriptors(64)
    q = views[0]
    assert desc(q, 16) is desc(q, 16) and desc(q, 32) is not desc(q, 16)
    assert desc(views[1], 16) is not desc(q, 16)


def test_launch_signature_separates_what_triton_specializes_on(monkeypatch):
    """The key of the compiled-kernel cache changes with everything a compiled kernel depends on (an
    integer's value, a tensor's dtype and 16-byte alignment, a descriptor's shape, strides and block,
    a constexpr, an option, the device) and with nothing else (a float's value, an unspecialized
    integer within 32 bits, a tensor's data beyond its alignment)."""
    from types import SimpleNamespace

    from flashattn import device_helpers, tensors
    from flashattn import launch as launch_mod

    monkeypatch.setattr(launch_mod, "_current_device", lambda: 0)
    kernel = SimpleNamespace(params=[SimpleNamespace(num=3, do_not_specialize=True)])
    buf = torch.zeros(64, dtype=torch.float16)
    x = torch.zeros(2, 3, 8, 16, dtype=torch.float16)
    desc = tensors.tile_desc(x, 8, 16, checked=True)

    def key(args=None, constexprs=None, options=None):
        args = args if args is not None else (desc, buf, 7, 5, 0.5)
        return launch_mod._signature(kernel, args, constexprs or {"C": True}, options or {"num_warps": 4})

    base = key()
    assert key() == base
    assert key((desc, buf, 7, 6, 0.25)) == base  # unspecialized int (position 3) and float values
    assert key((desc, buf, 7, 2**40, 0.5)) != base  # ... but not its width
    assert key((desc, buf, 8, 5, 0.5)) != base  # a specialized int
    assert key((desc, buf[8:], 7, 5, 0.5)) == base  # 16 bytes further: same alignment
    assert key((desc, buf[1:], 7, 5, 0.5)) != base  # 2 bytes further: not 16-byte aligned
    assert key((desc, buf.float(), 7, 5, 0.5)) != base  # another dtype
    y = torch.zeros(2, 3, 16, 16, dtype=torch.float16)
    assert key((tensors.tile_desc(y, 8, 16, checked=True), buf, 7, 5, 0.5)) != base  # another shape
    assert key((tensors.tile_desc(x, 4, 16, checked=True), buf, 7, 5, 0.5)) != base  # another block
    z = torch.zeros(2, 8, 3, 16, dtype=torch.float16).transpose(1, 2)
    assert key((tensors.tile_desc(z, 8, 16, checked=True), buf, 7, 5, 0.5)) != base  # other strides
    assert key(constexprs={"C": False}) != base and key(options={"num_warps": 8}) != base
    assert key((desc, buf, True, 5, 0.5)) != key((desc, buf, 1, 5, 0.5))  # a bool is not the int it equals
    # a descriptor made elsewhere (no key stored by tile_desc) is keyed the same
    from triton.tools.tensor_descriptor import TensorDescriptor
    assert key((TensorDescriptor(x, list(x.shape), list(x.stride()), [1, 1, 8, 16]), buf, 7, 5, 0.5)) == base
    monkeypatch.setattr(launch_mod, "_current_device", lambda: 1)
    assert key() != base


def test_second_stream_only_for_long_backwards():
    """dQ runs beside dK/dV only when the work is large enough for the overlap to pay."""
    from flashattn.backward import OVERLAP_MIN_WORK, worth_a_second_stream

    def problem(b, h, n, d):
        q = torch.empty(b, h, n, d, device="meta")
        return Problem.of(q, q, True, None)

    assert not worth_a_second_stream(problem(1, 16, 512, 64))  # a short call: one stream
    assert not worth_a_second_stream(problem(8, 16, 512, 128))  # the latency section's longest ones too
    assert not worth_a_second_stream(problem(8, 16, 1024, 64))
    assert worth_a_second_stream(problem(32, 32, 512, 64))  # the grid's shortest setting keeps it
    assert worth_a_second_stream(problem(1, 16, 16384, 128))
    assert 1 * 16 * 512 * 512 * 64 < OVERLAP_MIN_WORK <= 32 * 32 * 512 * 512 * 64


def test_outputs_keep_the_input_layout():
    """A (B, N, H, D) view gives o and dq in (B, N, H, D) memory too: no hidden transposing copy."""
    b, h, n, d = (2, 4, 256, 64) if HAS_CUDA else (1, 2, 20, 16)
    q, k, v, do = _inputs(b, h, h, n, n, d, torch.float16, layout="bnhd")
    o, lse = attention_forward(q, k, v, Problem.of(q, k, False, d ** -0.5))
    dq, dk, dv = attention_backward(do, q, k, v, o, lse, Problem.of(q, k, False, d ** -0.5))
    for x, ref in ((o, q), (dq, q), (dk, k), (dv, v)):
        assert x.stride() == ref.stride()


def test_hopper_table_picks_the_forward_tile_by_variant(monkeypatch):
    """On sm_90 the D = 128 forward takes one warpgroup and two stages, except with a window, which
    keeps the two-warpgroup tile, and with dropout, which takes 64 x 64 tiles (both measured); other
    GPUs read their own table. The choice is the host's, so it is checked here with the capability
    and the interpreter switch stubbed."""
    from flashattn import _config

    monkeypatch.setattr(_config, "is_interpreter", lambda: False)
    cuda = torch.device("cuda", 0)

    def get(kernel, d, causal=False, n=4096, **variants):
        return _config.get_config(kernel, Problem(1, 8, 8, n, n, d, torch.float16, causal, d ** -0.5, **variants), cuda)

    def fwd(d, causal=False, n=4096, **variants):
        return get("fwd", d, causal, n, **variants)

    monkeypatch.setattr(_config, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(_config, "_sm_count", lambda index: 132)  # 256 programs and more here: a full grid
    one_warpgroup, two_warpgroups = _config.KernelConfig(128, 64, 4, 2), _config.KernelConfig(128, 128, 8, 3)
    small = _config.KernelConfig(64, 64, 4, 2)
    assert fwd(128) == fwd(128, causal=True) == one_warpgroup
    assert fwd(128, softcap=30.0) == fwd(128, alibi=True) == one_warpgroup
    assert fwd(128, window=(256, 256)) == two_warpgroups
    assert fwd(128, dropout_p=0.1) == fwd(128, causal=True, dropout_p=0.1) == small
    assert fwd(128, dropout_p=0.1, window=(256, 256)) == small  # dropout's tiles come first
    assert fwd(64) == fwd(64, causal=True, n=4096) == _config.KernelConfig(64, 128, 4, 2)
    assert fwd(64, causal=True, n=1024) == _config.KernelConfig(64, 64, 4, 2)
    assert fwd(64, causal=True, n=1025) == fwd(64, causal=True, n=2048) == _config.KernelConfig(64, 128, 4, 2)
    assert fwd(64, dropout_p=0.1) == fwd(32, dropout_p=0.1) == small
    assert fwd(256, dropout_p=0.1) == fwd(256)  # D = 256 keeps its tile
    assert get("bwd_dkdv", 128, dropout_p=0.1) == get("bwd_dkdv", 128, causal=True, dropout_p=0.1) \
        == _config.KernelConfig(32, 128, 8, 3)
    # the causal dK/dV kernel's single loop takes the non-causal tiles from D = 128 up
    assert get("bwd_dkdv", 128) == get("bwd_dkdv", 128, causal=True) == _config.KernelConfig(64, 128, 8, 3)
    # D = 256: dV and dK in two launches on 128-row key blocks
    assert get("bwd_dkdv", 256) == get("bwd_dkdv", 256, causal=True) == _config.KernelConfig(32, 128, 8, 3, True)
    assert get("bwd_dkdv", 64, causal=True) == _config.KernelConfig(32, 64, 4, 3)
    assert get("bwd_dq", 256) == get("bwd_dq", 256, causal=True) == _config.KernelConfig(64, 32, 4, 3)
    # dropout: two stages in the two launches at D = 256, and its own dQ tile
    assert get("bwd_dkdv", 256, causal=True, dropout_p=0.1) == get("bwd_dkdv", 256, dropout_p=0.1) \
        == _config.KernelConfig(32, 128, 8, 2, True)
    assert get("bwd_dq", 256, dropout_p=0.1) == _config.KernelConfig(128, 64, 8, 1)
    assert get("bwd_dq", 128, dropout_p=0.1) == get("bwd_dq", 128)
    assert get("bwd_dq", 64, dropout_p=0.1) == _config.KernelConfig(64, 128, 4, 2) != get("bwd_dq", 64)
    monkeypatch.setattr(_config, "_capability", lambda index: (8, 0))
    assert fwd(128) == fwd(128, dropout_p=0.1) == _config._DEFAULT[("fwd", 128)]


def test_small_grids_take_smaller_tiles_on_hopper(monkeypatch):
    """Where the table tile's programs would leave SMs idle (fewer than the SMs for the forward,
    than half of them for the backward's kernels), the Hopper table gives 64 x 64 tiles: counted per
    query block of a query head (forward, dQ) or per key block of a K/V head (dK/dV). The D = 256
    forward's share depends on the mask (half the SMs without it, all of them with the causal mask).
    Not for variants with their own tiles, packed sequences, the D = 256 backward, or the D <= 64
    forward (64 rows already)."""
    from flashattn import _config

    monkeypatch.setattr(_config, "is_interpreter", lambda: False)
    monkeypatch.setattr(_config, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(_config, "_sm_count", lambda index: 132)
    cuda = torch.device("cuda", 0)

    def get(kernel, b, h_q, h_kv, n, d, causal=False, **variants):
        return _config.get_config(kernel, Problem(b, h_q, h_kv, n, n, d, torch.float16, causal, d ** -0.5, **variants), cuda)

    fwd_small, bwd_small = _config.KernelConfig(64, 64, 4, 2), _config.KernelConfig(64, 64, 4, 3)
    table = {kernel: _config.resolve(_config._SM90[(kernel, 128)], False, 4096) for kernel in ("fwd", "bwd_dkdv", "bwd_dq")}
    # forward, 128-row tiles: 8 blocks x 16 heads = 128 < 132 programs; 17 heads make 136
    assert get("fwd", 1, 16, 16, 1024, 128) == get("fwd", 1, 16, 16, 512, 96, causal=True) == fwd_small
    assert get("fwd", 1, 17, 17, 1024, 128) == table["fwd"]
    # backward: 4 blocks x 16 heads = 64 < 66 programs; at N = 1024 128 are too many
    assert get("bwd_dq", 1, 16, 16, 512, 128) == get("bwd_dkdv", 1, 16, 16, 512, 128) == bwd_small
    assert get("bwd_dq", 1, 16, 16, 1024, 128) == table["bwd_dq"]
    assert get("bwd_dkdv", 1, 16, 16, 1024, 128) == table["bwd_dkdv"]
    # dK/dV counts K/V heads: 32 key blocks x 2 heads under GQA; dQ the 16 query heads (512 programs)
    assert get("bwd_dkdv", 1, 16, 2, 4096, 128) == bwd_small and get("bwd_dq", 1, 16, 2, 4096, 128) == table["bwd_dq"]
    # D <= 64: dQ's 128-row tile only; the forward and dK/dV keep the table's
    assert get("bwd_dq", 1, 16, 16, 512, 64) == get("bwd_dq", 2, 4, 4, 300, 40) == bwd_small
    assert get("fwd", 1, 16, 16, 512, 64) == _config.KernelConfig(64, 128, 4, 2)
    assert get("bwd_dkdv", 1, 16, 16, 512, 64, causal=True) == _config.KernelConfig(32, 64, 4, 3)
    # variants with tiles of their own, and the D = 256 backward, keep them
    assert get("fwd", 1, 2, 2, 512, 128, window=(64, 0)) == _config._SM90_WINDOW[("fwd", 128)]
    assert get("fwd", 1, 2, 2, 512, 128, dropout_p=0.1) == _config._SM90_DROPOUT[("fwd", 128)]
    assert get("bwd_dq", 1, 2, 2, 512, 256) == _config.resolve(_config._SM90[("bwd_dq", 256)], False, 512)
    assert get("bwd_dkdv", 1, 2, 2, 512, 256) == _config.resolve(_config._SM90[("bwd_dkdv", 256)], False, 512)
    # D = 256 forward, 128-row tiles: 8 blocks x 8 heads = 64 < 66 programs either way; 8 x 16 = 128
    # programs swap only with the causal mask, and 136 (17 heads) never
    table256 = _config._SM90[("fwd", 256)]
    assert get("fwd", 1, 8, 8, 1024, 256) == get("fwd", 1, 8, 8, 1024, 256, causal=True) == fwd_small
    assert get("fwd", 1, 16, 16, 1024, 256) == table256 and get("fwd", 1, 16, 16, 1024, 256, causal=True) == fwd_small
    assert get("fwd", 1, 17, 17, 1024, 256, causal=True) == table256
    # softcap and ALiBi take the table's tiles, so its small-grid tiles too
    assert get("fwd", 1, 2, 2, 512, 128, softcap=20.0) == get("fwd", 1, 2, 2, 512, 128, alibi=True) == fwd_small
    # packed sequences keep the fixed table (their problem's n is the longest sequence)
    packed = Problem(2, 4, 4, 300, 300, 128, torch.float16, True, 0.1, varlen=True, total_q=400, total_k=400)
    assert _config.get_config("fwd", packed, cuda) == table["fwd"]
    monkeypatch.setattr(_config, "_capability", lambda index: (8, 0))
    assert get("fwd", 1, 16, 16, 512, 128) == _config._DEFAULT[("fwd", 128)]


@settings(max_examples=200, deadline=None)
@given(b=st.integers(1, 8), h_kv=st.integers(1, 32), group=st.sampled_from([1, 2, 4, 8]), n=st.integers(1, 9000),
       m=st.integers(1, 9000), d=st.sampled_from([16, 32, 40, 64, 72, 96, 128, 160, 256]), causal=st.booleans(),
       sms=st.sampled_from([78, 114, 132]))
def test_small_grid_rule_counts_the_programs_plan_for_launches(b, h_kv, group, n, m, d, causal, sms):
    """The small-grid rule of get_config counts programs as plan_for lays out the table tile's grid:
    it swaps the tile exactly when that grid is below the kernel's share of the SMs, and the tile it
    swaps in never makes fewer programs."""
    from flashattn import _config

    problem = Problem(b, h_kv * group, h_kv, n, m, d, torch.float16, causal, d ** -0.5)
    cuda = torch.device("cuda", 0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_config, "is_interpreter", lambda: False)
        mp.setattr(_config, "_capability", lambda index: (9, 0))
        mp.setattr(_config, "_sm_count", lambda index: sms)
        for kernel in ("fwd", "bwd_dkdv", "bwd_dq"):
            table = _config.resolve(_config._SM90[(kernel, problem.block_d)], causal, n)
            small = _config._SM90_SMALL_GRID.get((kernel, problem.block_d))
            programs = _config.plan_for(kernel, problem, cuda, table).grid
            swap = small is not None and programs < _config.resolve(small[0], causal, n) * sms
            got = _config.get_config(kernel, problem, cuda)
            assert got == (small[1] if swap else table), (kernel, programs)
            assert _config.plan_for(kernel, problem, cuda, got).grid >= programs


def test_every_table_entry_resolves_to_a_launchable_config():
    """Each GPU table entry gives one config per (causal, N); tiles are powers of two and fit the rules."""
    from flashattn import _config

    small_grid = {key: tile for key, (share, tile) in _config._SM90_SMALL_GRID.items()
                  if all(0 < _config.resolve(share, causal, None) <= 1 for causal in (False, True))}
    assert len(small_grid) == len(_config._SM90_SMALL_GRID)
    for table in (_config._SM90, _config._SM90_WINDOW, _config._SM90_DROPOUT, _config._DEFAULT, small_grid):
        for (kernel, block_d), entry in table.items():
            for causal in (False, True):
                for n in (1, 2048, 2049, 16384):
                    cfg = _config.resolve(entry, causal, n)
                    assert isinstance(cfg, _config.KernelConfig), (kernel, block_d, causal, n)
                    for size in (cfg.block_m, cfg.block_n):
                        assert size >= 16 and size & (size - 1) == 0
                    assert not cfg.split or kernel == "bwd_dkdv", (kernel, block_d)  # only dK/dV has parts
                    assert cfg.num_warps in (4, 8) and 1 <= cfg.num_stages <= 4
    by_length = _config.ByLength(2048, _config.KernelConfig(64, 64, 4, 3), _config.KernelConfig(64, 128, 4, 3))
    assert by_length.pick(2048).block_n == 64 and by_length.pick(2049).block_n == 128
    assert by_length.pick(None).block_n == 64


# ----------------------------------------------------------------------------------------------
# GPU tests: realistic sizes, both dtypes.
# ----------------------------------------------------------------------------------------------

# (B, Hq, Hkv, N, M, D, causal, layout, std)
GPU_CASES = [
    (2, 8, 8, 1024, 1024, 128, False, "bhnd", 1.0),  # 128 forward programs: the small-grid tiles on an H200
    (2, 8, 8, 1024, 1024, 128, True, "bhnd", 1.0),
    (4, 16, 4, 1024, 1024, 128, True, "bnhd", 1.0),  # 512: the table's tiles
    (4, 16, 16, 1024, 1024, 128, False, "bhnd", 1.0),
    (2, 8, 2, 2048, 2048, 64, True, "bnhd", 1.0),  # GQA 4, transposed views
    (1, 4, 4, 8192, 8192, 64, True, "bhnd", 1.0),  # N = M = 8k
    (1, 2, 1, 8192, 8192, 128, False, "bhnd", 1.0),
    (1, 4, 2, 4097, 8191, 256, True, "bhnd", 1.0),  # D = 256, ragged, N < M
    (1, 4, 2, 3001, 2999, 256, False, "bnhd", 1.0),
    (1, 8, 2, 8192, 2000, 72, True, "bhnd", 1.0),  # N > M causal: 6192 rows see no key; D = 72
    (2, 4, 4, 1537, 1023, 96, False, "bhnd", 1.0),
    (1, 4, 1, 777, 1333, 80, True, "bnhd", 1.0),  # MQA, D = 80
    (1, 4, 4, 2048, 2048, 16, True, "bhnd", 1.0),  # the smallest head dim
    (1, 4, 4, 2048, 3000, 128, True, "bhnd", 4.5),  # large logits: scale * score up to ~100
    (1, 4, 4, 2048, 2048, 64, False, "bhnd", 4.5),
    (4, 4, 4, 1, 8192, 128, True, "bhnd", 1.0),  # decoding, one query row
]


def _gpu_id(c):
    return "B{}-H{}x{}-N{}-M{}-D{}-{}-{}{}".format(
        c[0], c[1], c[2], c[3], c[4], c[5], "causal" if c[6] else "full", c[7], "-large" if c[8] > 1 else "")


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", GPU_CASES, ids=_gpu_id)
def test_gpu_matches_float64(case, dtype, record_property):
    b, h_q, h_kv, n, m, d, causal, layout, std = case
    q, k, v, do = _inputs(b, h_q, h_kv, n, m, d, dtype, layout=layout, std=std)
    scale = d ** -0.5
    if std > 1:
        s_max = (scale * (q[:, :1].float() @ k[:, :1].float().transpose(-1, -2))).abs().max().item()
        assert s_max > 60, f"inputs do not produce large logits ({s_max:.1f})"
    errors, (o, lse, dq, _, _) = _check_against_reference(q, k, v, do, causal, scale)
    _empty_rows_are_zero(causal, n, m, o, lse, dq)
    for name, err in errors.items():
        record_property(f"rel_err_{name}", err)


SPLIT_CASES = [  # (B, Hq, Hkv, N, M, D), options, layout
    ((2, 4, 2, 37, 53, 40), dict(causal=True), "bnhd"),  # GQA, ragged, N < M, D not a power of two
    ((1, 2, 2, 45, 29, 16), dict(causal=True, window=(9, 2), softcap=5.0), "bhnd"),  # empty rows (N > M)
    ((2, 2, 1, 33, 41, 24), dict(alibi=True), "bhnd"),
    ((1, 2, 2, 40, 40, 32), dict(causal=True, dropout_p=0.25, seed=9), "bnhd"),
    (None, dict(causal=True), "varlen"),  # packed sequences of lengths (q, k): (17, 30), (0, 5), (40, 40)
]
if HAS_CUDA:  # the two tiles of the GPU table's D = 256 entry, and a D = 64 tile, on the same inputs
    SPLIT_CASES = [((1, 4, 2, 300, 517, 256), dict(causal=True), "bnhd"), ((2, 4, 4, 333, 333, 64), {}, "bhnd"),
                   ((1, 2, 2, 400, 257, 256), dict(window=(100, 0), softcap=30.0), "bhnd"),
                   ((1, 2, 2, 256, 256, 256), dict(causal=True, dropout_p=0.1, seed=4), "bhnd")]


@gpu
@needs_cuda
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_causal_offset_at_every_residue(d):
    """The GPU tiles' version of test_interpreter_causal_offset_at_every_residue: the causal offset
    M - N at every residue modulo 128, the largest key block of the GPU tables, against float64."""
    for m in range(2, 260):  # M - N from -128 to 129
        q, k, v, do = _inputs(1, 2, 1, 130, m, d, torch.bfloat16, seed=m)
        _check_against_reference(q, k, v, do, True, d ** -0.5)


def _packed(lens_q, lens_k, dtype, *, seed, std=1.0):
    """q, k, v, dO of packed sequences (D = 32, 4 query heads, 2 K/V heads) and their cu_seqlens."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q, k, v, do = (torch.randn(sum(lens), h, 32, dtype=dtype, device=DEVICE, generator=gen) * std
                   for lens, h in ((lens_q, 4), (lens_k, 2), (lens_k, 2), (lens_q, 4)))
    cu = [torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
          for lens in (lens_q, lens_k)]
    return q, k, v, do, cu


@gpu  # and interpreted on the CPU
@pytest.mark.parametrize("shape, options, layout", SPLIT_CASES, ids=lambda c: str(c))
def test_dkdv_in_two_launches_is_bitwise_one_launch(shape, options, layout):
    """A dK/dV config with ``split`` (dV in one launch, dK in a second, :attr:`_config.Plan.passes`)
    gives the same bits as one launch with the same tiles: each accumulator is the same sum either
    way. Only dK and dV change with the config; dQ is compared too, as a control on the inputs."""
    from flashattn import _config

    dtype = torch.float16  # on the CPU, half-precision tensors are what runs the kernels (interpreted)
    options = dict(options)
    if layout == "varlen":
        lens_q, lens_k = (17, 0, 40), (30, 5, 40)
        q, k, v, do, cu = _packed(lens_q, lens_k, dtype, seed=3)
        call = lambda q, k, v: flashattn.attention_varlen(q, k, v, *cu, max(lens_q), max(lens_k), **options)  # noqa: E731
    else:
        q, k, v, do = _inputs(*shape, dtype, layout=layout, std=2.0, seed=21)
        if options.pop("alibi", False):
            options["alibi_slopes"] = torch.tensor([0.5, 0.125], device=DEVICE)
        call = lambda q, k, v: flashattn.attention(q, k, v, **options)  # noqa: E731
    d = q.shape[-1]
    if not HAS_CUDA:
        tile = _config.KernelConfig(16, 32, 4, 1)
    elif d == 256:
        tile = _config.KernelConfig(32, 128, 8, 2)  # 2 stages: one launch of both needs the shared memory
    else:
        tile = _config.KernelConfig(64, 64, 4, 3)
    grads = []
    for config in (tile, _config.KernelConfig(tile.block_m, tile.block_n, tile.num_warps, tile.num_stages, True)):
        qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
        with torch.autograd.set_multithreading_enabled(False), _config.tuning(bwd_dkdv=config):
            grads.append(torch.autograd.grad(call(qg, kg, vg), (qg, kg, vg), do))
    for name, one, two in zip(("dq", "dk", "dv"), *grads):
        assert torch.isfinite(two).all(), name
        assert torch.equal(one, two), name


def test_a_split_plan_launches_dv_then_dk():
    """``Plan.passes``: one launch with PART 0, or PART 1 (dV) then PART 2 (dK) for a split config."""
    from flashattn import _config

    problem = Problem(1, 2, 2, 64, 64, 32, torch.float16, True, 0.2)
    cpu = torch.device("cpu")
    one = _config.plan_for("bwd_dkdv", problem, cpu, _config.KernelConfig(16, 32, 4, 1))
    two = _config.plan_for("bwd_dkdv", problem, cpu, _config.KernelConfig(16, 32, 4, 1, True))
    assert [c["PART"] for c in one.passes] == [0] and [c["PART"] for c in two.passes] == [1, 2]
    assert all(list(c)[-1] == "PART" and {**c, "PART": 0} == one.constexprs for c in two.passes)
    assert "PART" not in _config.plan_for("bwd_dq", problem, cpu, _config.KernelConfig(16, 32, 4, 1)).constexprs


ROW_STATS_CASES = [
    # (B, Hq, Hkv, N, M, D), layout, options: causal rows with no key, GQA, a D that is no power of two,
    # a transposed layout, large logits, a gradient for the LSE, the variants, packed sequences
    ((2, 4, 2, 37, 21, 40), "bnhd", dict(causal=True, return_lse=True)),
    ((1, 6, 2, 29, 53, 24), "bhnd", dict(window=(9, 3), softcap=5.0, alibi=True, dropout_p=0.25, seed=7)),
    ((1, 2, 2, 48, 48, 80), "bhnd", dict(causal=True, return_lse=True)),
    (None, "varlen", dict(causal=True, return_lse=True)),
]


@gpu  # and interpreted on the CPU
@pytest.mark.parametrize("shape, layout, options", ROW_STATS_CASES, ids=lambda c: str(c))
def test_row_stats_in_dq_give_the_preprocess_kernels_gradients(shape, layout, options, monkeypatch):
    """Where the dQ kernel runs on the current stream it goes first and computes delta and the base-2
    LSE of its own rows (``ROW_STATS``) in place of the preprocess kernel, one launch fewer: the
    gradients are those of the three-kernel path, bitwise under the interpreter (the same float32 row
    sums) and to within a rounding of delta's sum order on a GPU, and the preprocess kernel is not
    launched."""
    from flashattn import backward as bwd_mod

    dtype = torch.float16  # on the CPU, half-precision tensors are what runs the kernels (interpreted)
    options = dict(options)
    return_lse = options.pop("return_lse", False)
    if layout == "varlen":
        lens_q, lens_k = (17, 0, 40, 9), (30, 5, 40, 0)
        q, k, v, do, cu = _packed(lens_q, lens_k, dtype, seed=4, std=3)
        call = lambda q, k, v: flashattn.attention_varlen(q, k, v, *cu, max(lens_q), max(lens_k),  # noqa: E731
                                                          return_lse=return_lse, **options)
    else:
        q, k, v, do = _inputs(*shape, dtype, layout=layout, std=3.0, seed=22)
        if options.pop("alibi", False):
            options["alibi_slopes"] = torch.linspace(0.05, 0.5, shape[1], device=DEVICE)
        call = lambda q, k, v: flashattn.attention(q, k, v, return_lse=return_lse, **options)  # noqa: E731
    launched = []
    launch = bwd_mod.launch
    monkeypatch.setattr(bwd_mod, "launch", lambda kernel, *a, **kw: launched.append(kernel) or launch(kernel, *a, **kw))
    grads = {}
    for row_stats in (False, True):
        qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
        launched.clear()
        with torch.autograd.set_multithreading_enabled(False), _config.tuning(row_stats_in_dq=row_stats):
            out = call(qg, kg, vg)
            if return_lse:  # a loss that uses the LSE too: dLSE folds into delta
                o, lse = out
                gen = torch.Generator(device=DEVICE).manual_seed(5)
                dlse = torch.randn(lse.shape, device=DEVICE, generator=gen).masked_fill(lse == float("-inf"), 0)
                grads[row_stats] = torch.autograd.grad((o, lse), (qg, kg, vg), (do, dlse))
            else:
                grads[row_stats] = torch.autograd.grad(out, (qg, kg, vg), do)
        assert (bwd_mod._bwd_preprocess_kernel in launched) is not row_stats
        assert launched.count(bwd_mod._bwd_dq_kernel) == 1
    for name, three, two in zip(("dq", "dk", "dv"), grads[False], grads[True]):
        assert torch.isfinite(two).all() and torch.isfinite(three).all(), name
        if HAS_CUDA:
            assert rel_err(two, three) < 1e-3, name
        else:
            assert torch.equal(two, three), name


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_backward_is_deterministic(causal, dtype):
    """Two backward passes on the same inputs are bitwise equal (no atomics, fixed reduction order)."""
    q, k, v, do = _inputs(2, 16, 4, 2048, 2048, 128, dtype, seed=11)
    o, lse = attention_forward(q, k, v, Problem.of(q, k, causal, 128 ** -0.5))
    first = attention_backward(do, q, k, v, o, lse, Problem.of(q, k, causal, 128 ** -0.5))
    second = attention_backward(do, q, k, v, o, lse, Problem.of(q, k, causal, 128 ** -0.5))
    for a, b_ in zip(first, second):
        assert torch.equal(a, b_)


@gpu
@needs_cuda
def test_gpu_poisoned_outputs_are_fully_written():
    """Every element of o, lse, dq, dk, dv is written: outputs pre-filled with NaN never survive."""
    q, k, v, do = _inputs(1, 4, 2, 1000, 1100, 72, torch.float16, seed=13)
    torch.cuda.empty_cache()
    filler = [torch.full((1 << 24,), float("nan"), device=DEVICE) for _ in range(4)]  # dirty the allocator
    del filler
    o, lse = attention_forward(q, k, v, Problem.of(q, k, True, 72 ** -0.5))
    grads = attention_backward(do, q, k, v, o, lse, Problem.of(q, k, True, 72 ** -0.5))
    for x in (o, lse, *grads):
        assert not torch.isnan(x).any()


@gpu
@needs_cuda
def test_gpu_long_single_head_runs_in_linear_memory():
    """N = 131072, one head, D = 128: the N x N matrix (32 GiB in fp16) is never allocated."""
    n, d = 131072, 128
    q, k, v, do = _inputs(1, 1, 1, n, n, d, torch.float16, seed=17)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    o, lse = attention_forward(q, k, v, Problem.of(q, k, True, d ** -0.5))
    dq, dk, dv = attention_backward(do, q, k, v, o, lse, Problem.of(q, k, True, d ** -0.5))
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < 64 * n * d, f"extra memory {extra / 2**20:.0f} MiB is not O(N)"
    for x in (o, dq, dk, dv):
        assert torch.isfinite(x).all()
    # spot-check the last 128 rows against the definition over all keys
    rows = torch.arange(n - 128, n, device=DEVICE)
    s = (q[:, :, rows].double() @ k.double().transpose(-1, -2)) * d ** -0.5  # (1, 1, 128, N)
    s = s.masked_fill(torch.arange(n, device=DEVICE)[None, :] > rows[:, None], float("-inf"))
    assert rel_err(o[:, :, rows], torch.softmax(s, dim=-1) @ v.double()) < 1e-2
    assert rel_err(lse[:, :, rows], torch.logsumexp(s, dim=-1)) < 1e-4


@gpu
@needs_cuda
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dq_stream", ["one stream", "side stream"])
def test_gpu_cuda_graph_replay_matches_eager(causal, dq_stream, monkeypatch):
    """Forward and backward captured in one CUDA graph and replayed on new inputs give bitwise the
    results of an eager call on those inputs, with dQ after dK/dV on one stream (this size's path)
    and with dQ on the side stream (the path of large problems, forced here): no call on either
    path synchronizes with the GPU, or the capture would fail."""
    from flashattn import backward

    if dq_stream == "side stream":
        monkeypatch.setattr(backward, "OVERLAP_MIN_WORK", 0)
    shape = (2, 8, 2, 1000, 1000, 64)  # GQA 4, ragged blocks
    q, k, v, do = _inputs(*shape, torch.float16, seed=23)
    sq, sk, sv = (x.clone().requires_grad_() for x in (q, k, v))
    sdo = do.clone()

    def step():
        out = flashattn.attention(sq, sk, sv, causal=causal)
        return (out, *torch.autograd.grad(out, (sq, sk, sv), sdo))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the graph: compiles kernels, creates streams
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()

    fresh = _inputs(*shape, torch.float16, seed=29)
    with torch.no_grad():
        for x, new in zip((sq, sk, sv, sdo), fresh):
            x.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    eager = step()  # the same static tensors, now holding the fresh inputs
    for got, want in zip(captured, eager):
        assert torch.isfinite(got).all()
        assert torch.equal(got, want)


def test_a_recipe_zeroes_a_tile_counter_of_its_own_at_every_replay(monkeypatch):
    """A tile counter a call recorded (Recording.add_counter: the Gluon causal forward's) is made
    again and zeroed at each replay, before the launch that reads it, even when the launch before
    left its counter's memory non-zero, and is not returned; the outputs are allocated in their
    recorded layout and not zeroed. A counter a launch on a side stream drew from keeps no recipe.
    Runs on the CPU: the launch is a stand-in that reads, then dirties, the counter's memory
    (benchmarks.hostcost)."""
    import ctypes
    from types import SimpleNamespace

    from benchmarks.hostcost import _NoLaunch
    from flashattn import device_helpers, tensors
    from flashattn import launch as launch_mod

    seen = []

    class Reading(_NoLaunch):
        def __call__(self, *args):  # the generated launcher's arguments: 12 of its own, then the kernel's
            super().__call__(*args)
            value = ctypes.c_int32.from_address(args[-1])
            seen.append(value.value)
            value.value = 7  # as if the kernel had left it non-zero

    kernel = SimpleNamespace(arg_names=["inp", "out", "counter"])
    direct = Reading(capture=True).direct(kernel)
    monkeypatch.setattr(launch_mod, "_RECIPES", {})
    monkeypatch.setattr(launch_mod, "_stream", lambda device: 0)
    empty = torch.empty_strided
    monkeypatch.setattr(torch, "empty_strided", lambda *a, **k: empty(*a, **k).fill_(7))  # stale memory

    inp = torch.randn(4, 8)
    out, counter = torch.empty(8, 4).t(), tensors.tile_counter(inp.device)  # a transposed output layout
    assert counter.dtype == torch.int32 and counter.tolist() == [0]
    record = launch_mod.Recording("key")
    record.add(kernel, direct, (1, 1, 1), (inp, out, counter))
    record.add_counter(counter)
    record.keep((inp,), (out,))
    recipe = launch_mod._RECIPES["key"]
    assert recipe is not None and recipe.n_counters == 1 and len(recipe.layouts) == 1
    for _ in range(3):
        replayed = launch_mod.replay("key", (torch.randn(4, 8),))
        assert len(replayed) == 1 and replayed[0].shape == (4, 8) and replayed[0].stride() == (1, 4)
        assert (replayed[0] == 7).all()  # an output is the kernel's to write: not zeroed
    assert seen == [0, 0, 0]  # each replay's launch found its counter zeroed

    monkeypatch.setattr(launch_mod, "_RECIPES", {})
    record = launch_mod.Recording("side")
    record.side = object()  # the launch goes to a side stream (on_stream)
    record.add(kernel, direct, (1, 1, 1), (inp, out, counter))
    record.add_counter(counter)
    record.keep((inp,), (out,))
    assert "side" not in launch_mod._RECIPES


def _stub_gluon_forward_launch(monkeypatch, launches: list) -> None:
    """hopper_fwd.forward's host code without a GPU: the kernel, the descriptors and a 132-SM count
    stubbed, each launch's positional arguments appended to ``launches``."""
    from flashattn import _config, hopper_fwd

    monkeypatch.setattr(hopper_fwd, "_get_kernel", lambda: "kernel")
    monkeypatch.setattr(hopper_fwd, "descriptor", lambda t, rows: ("desc", rows))
    monkeypatch.setattr(hopper_fwd, "launch", lambda *a, **k: launches.append(a))
    monkeypatch.setattr(_config, "_sm_count", lambda index: 132)


def _tensors_kept_by_the_package():
    """Tensors reachable from the globals of flashattn's modules (through dicts, lists, tuples, sets
    and objects' attributes, a few levels deep; modules, classes and functions are not followed)."""
    import sys
    import types

    found, seen = [], set()

    def walk(x, depth, path):
        if id(x) in seen or depth > 5:
            return
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            found.append(path)
        elif isinstance(x, dict):
            for k_, v_ in list(x.items()):
                walk(k_, depth + 1, f"{path}[key]")
                walk(v_, depth + 1, f"{path}[{k_!r:.40}]")
        elif isinstance(x, (list, tuple, set, frozenset)):
            for i, v_ in enumerate(list(x)):
                walk(v_, depth + 1, f"{path}[{i}]")
        elif isinstance(x, (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, str, bytes,
                            int, float, bool)) or x is None or callable(x) and not hasattr(x, "__slots__"):
            return
        else:
            for name in (*getattr(type(x), "__slots__", ()), *getattr(x, "__dict__", {})):
                if hasattr(x, name):
                    walk(getattr(x, name), depth + 1, f"{path}.{name}")

    for mod_name, mod in list(sys.modules.items()):
        if mod_name == "flashattn" or mod_name.startswith("flashattn."):
            for name, value in list(vars(mod).items()):
                if not name.startswith("__"):
                    walk(value, 0, f"{mod_name}.{name}")
    return found


def test_calls_keep_no_tensor_past_their_end(monkeypatch):
    """Nothing the package keeps between calls (recipes, plans, caches) holds a tensor: a tensor kept
    past a call lives in whatever memory pool the call allocated from, and under
    torch.compile(mode="reduce-overhead") that can be a CUDA graph's, whose next recording then fails
    (tuning log, "A tile counter per stream, withdrawn"). Forward and backward, decoding steps, first
    and replayed calls, and the Gluon causal forward's host code (its kernel stubbed), on the CPU with
    benchmarks.hostcost's no-op launches."""
    from benchmarks import hostcost
    from flashattn import device_helpers, launch as launch_mod, tensors, hopper_fwd

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the tool refuses the interpreter; kernels count as compiled
    _stub_gluon_forward_launch(monkeypatch, [])
    gen = torch.Generator().manual_seed(3)
    with hostcost.launches_disabled():
        for causal in (False, True):
            for _ in range(3):  # the first call records, the later ones replay
                q, k, v = (torch.randn(2, 4, 96, 64, dtype=torch.float16, generator=gen).requires_grad_()
                           for _ in range(3))
                o, lse = flashattn.attention(q, k, v, causal=causal, return_lse=True)
                torch.autograd.grad((o.float().sum() + lse.sum()), (q, k, v))
        for _ in range(3):  # decoding steps with split-KV scratch, first and replayed
            q = torch.randn(2, 1, 8, 64, dtype=torch.float16, generator=gen)
            cache = [torch.randn(2, 96, 2, 64, dtype=torch.float16, generator=gen) for _ in range(2)]
            flashattn.attention_with_kvcache(q, *cache, cache_seqlens=70, num_splits=2)
        q, k, v = (torch.randn(4, 8, 512, 128, dtype=torch.bfloat16, generator=gen) for _ in range(3))
        record = launch_mod.Recording("gluon")
        hopper_fwd.forward(q, k, v, True, record=record)  # a dynamic walk: its tile counter
        del record, q, k, v, o, lse, cache
        assert launch_mod._RECIPES  # recipes were kept, and hold no tensor
        assert _tensors_kept_by_the_package() == []
    assert _tensors_kept_by_the_package() == []


def test_subclass_and_numpy_arguments_on_the_compiled_path(monkeypatch):
    """On the compiled-kernel path (benchmarks.hostcost's no-op launches, on the CPU): a call with a
    tensor subclass after a plain call of the same problem gets outputs of its subclass, as its first
    call does (a replayed recipe would allocate plain tensors), and a decoding call with numpy integers
    for the lengths and the split count launches like one with Python ints (the launch signature takes
    ints; numpy's crashed its first call)."""
    import numpy as np

    from benchmarks import hostcost
    from flashattn import device_helpers, tensors
    from flashattn import launch as launch_mod

    class Tagged(torch.Tensor):
        pass

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the tool refuses the interpreter; kernels count as compiled
    monkeypatch.setattr(launch_mod, "_RECIPES", {})
    gen = torch.Generator().manual_seed(4)
    with hostcost.launches_disabled():
        q, k, v = (torch.randn(1, 2, 40, 32, dtype=torch.float16, generator=gen) for _ in range(3))
        for _ in range(2):
            assert type(flashattn.attention(q, k, v)) is torch.Tensor
        assert launch_mod._RECIPES  # the plain call's launches were recorded
        for _ in range(2):
            assert type(flashattn.attention(q.as_subclass(Tagged), k, v)) is Tagged
        q = torch.randn(2, 1, 4, 32, dtype=torch.float16, generator=gen)
        cache = [torch.randn(2, 64, 2, 32, dtype=torch.float16, generator=gen) for _ in range(2)]
        launch_mod._RECIPES.clear()
        flashattn.attention_with_kvcache(q, *cache, cache_seqlens=np.int64(40), num_splits=np.int64(2))


def test_plan_cache_is_bounded(monkeypatch):
    """Plans are kept per problem; a loop over ever new lengths starts the cache over instead of
    growing it without bound (as the other per-problem caches do)."""
    from flashattn import _memo

    monkeypatch.setattr(_memo, "LIMIT", 50)
    _config._PLANS.clear()
    for n in range(1, 120):
        p = Problem(1, 2, 2, n, n, 64, torch.float16, False, 0.125)
        _config.plan("fwd", p, torch.device("cpu"), None)
    assert 0 < len(_config._PLANS) <= 50


def test_direct_launch_only_for_the_launcher_it_knows():
    """The direct launch (flashattn.launch._DirectLaunch) is built only from a compiled kernel whose
    launcher has the layout it was written for; anything else keeps Triton's own launch path. A launch
    hook counts as set unless it is None or an empty hook chain."""
    from types import SimpleNamespace

    from flashattn import device_helpers, tensors
    from flashattn import launch as launch_mod

    assert launch_mod._DirectLaunch.of(SimpleNamespace(), 3) is None  # no launcher at all
    fake_run = type("CudaLauncher", (), {"global_scratch_size": 0, "profile_scratch_size": 0})()
    assert launch_mod._DirectLaunch.of(SimpleNamespace(_run=fake_run), 3) is None  # no generated launch function
    assert launch_mod._no_hook(None) and launch_mod._no_hook(SimpleNamespace(calls=[]))
    assert not launch_mod._no_hook(SimpleNamespace(calls=[print])) and not launch_mod._no_hook(print)


# (B, Hq, Hkv, N, M, D, layout, problem keywords, what the second call passes)
REPLAY_CASES = [
    (1, 4, 2, 37, 53, 24, "bhnd", dict(causal=True), "fresh"),  # GQA, ragged N < M
    (2, 2, 2, 40, 40, 64, "bnhd", dict(window=(8, 4)), "fresh"),  # (B, N, H, D) views, a window
    (1, 4, 4, 33, 65, 40, "bhnd", dict(causal=True, softcap=10.0, alibi=True, dropout_p=0.3), "fresh"),
    (1, 2, 2, 48, 48, 32, "bhnd", dict(causal=True), "aliased"),  # q, k and v one tensor
    (1, 2, 2, 48, 48, 32, "bhnd", dict(causal=True), "fresh after aliased"),  # an aliased call's recipe is not it
    (1, 2, 2, 48, 48, 32, "bhnd", dict(), "misaligned"),  # q starts 2 bytes past a 16-byte boundary
    (1, 4, 2, 37, 53, 24, "bhnd", dict(causal=True), "two streams"),  # dQ beside dK/dV, as large problems run
]


@pytest.mark.parametrize("b, h_q, h_kv, n, m, d, layout, kw, second", REPLAY_CASES)
def test_replayed_launches_are_the_full_paths(monkeypatch, b, h_q, h_kv, n, m, d, layout, kw, second):
    """A launcher call repeated from its recipe (flashattn.launch.Recipe) hands the generated C launcher
    exactly what the full path hands it for the same tensors: every pointer, TMA descriptor, integer,
    float and the call's own dropout seed, for the forward and the backward's three kernels (with a
    gradient for the LSE). A call whose input is misaligned takes the full path; calls that pass
    one tensor as q, k and v replay their own recipes, and never lend them to calls of three tensors.

    Runs on the CPU: benchmarks.hostcost makes every compiled-kernel launch a call that keeps its
    arguments, so the two paths' launches can be compared one by one."""
    from benchmarks import hostcost

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the tool refuses the interpreter; kernels count as compiled
    gen = torch.Generator().manual_seed(5)
    alibi = kw.get("alibi", False)
    variants = dict(window=kw.get("window"), softcap=kw.get("softcap", 0.0), alibi=alibi,
                    dropout_p=kw.get("dropout_p", 0.0))

    def make(seed, how="fresh"):
        q, k, v = random_qkv(b, h_q, h_kv, n, m, d, dtype=torch.float16, layout=layout, generator=gen)
        if how == "aliased":
            k = v = q
        elif how == "misaligned":
            q = torch.randn(q.numel() + 1, dtype=torch.float16, generator=gen)[1:].view(q.shape)
        extra = dict(do=torch.randn(q.shape, dtype=torch.float16, generator=gen),
                     dlse=torch.randn(q.shape[:3], generator=gen),
                     slopes=torch.rand(h_q, generator=gen) if alibi else None, seed=seed)
        return q, k, v, extra

    def run(q, k, v, extra):
        problem = Problem.of(q, k, kw.get("causal", False), None, **variants)
        o, lse = attention_forward(q, k, v, problem, extra["slopes"], extra["seed"])
        attention_backward(extra["do"], q, k, v, o, lse, problem, extra["dlse"], extra["slopes"], extra["seed"])

    two_streams = second == "two streams"
    first = make(11, "aliased" if second == "fresh after aliased" else "fresh")
    later = make(2**40 + 12345, "fresh" if two_streams else second.split()[0])  # another seed in both 31-bit halves
    inputs = (*later[:3], later[3]["do"], later[3]["dlse"], later[3]["slopes"])
    # "aliased": a call with q, k and v one tensor (after a fresh first call) records its own recipes,
    # and the later such call replays them; "fresh after aliased": a call of three tensors finds only
    # the recipes of an aliased call, whose k and v slots are q's, and takes the full path
    got = hostcost.replayed_and_full(run, first, later, inputs, second_stream=two_streams,
                                     before_later=(lambda: run(*make(3, "aliased"))) if second == "aliased" else None)
    if two_streams:  # the side stream (1) waits for the current one (0) before dQ, the current one for it after
        streams = [row[0][1] if row[0][0] is str else row[3][1] for row in got[False]]
        assert streams == [0, 0, "wait", 0, 1, "wait"]
        assert got[False][2] == [(str, "wait"), (int, 1), (int, 0)] and got[False][5] == [(str, "wait"), (int, 0), (int, 1)]
        assert got[True] == got[False]
        for path in (True, False):
            got[path] = [row for row in got[path] if row[0][0] is not str]
    # forward, preprocess, dK/dV, dQ beside it; on one stream forward, dQ (with the row statistics), dK/dV
    assert len(got[True]) == len(got[False]) == (4 if two_streams else 3)
    assert len(got["kept"]) == (4 if "aliased" in second else 2)  # the forward's and the backward's, per key
    full_path = second in ("misaligned", "fresh after aliased")
    assert got["keys"] == (len(got[False]) if full_path else 0)  # replayed: no cache key, no binding
    assert got[True] == got[False]


@gpu
@needs_cuda
def test_gpu_fast_path_matches_tritons_launch(monkeypatch):
    """Launching through the fallback (``kernel[grid](...)`` alone, :func:`flashattn.launch.fast_path`
    off) and through the fast path gives bitwise the same results (forward,
    the backward's three kernels, descriptors of every tile shape, a transposed layout, padded D,
    GQA, a window, softcap and dropout), and steps aside while a launch hook is set, so the hook
    still sees every launch."""
    from flashattn import device_helpers, tensors
    from flashattn import launch as launch_mod

    cases = [((2, 4, 4, 300, 300, 64), dict(causal=True), "bhnd"),
             ((1, 8, 2, 128, 513, 40), dict(causal=True), "bhnd"),
             ((2, 4, 4, 257, 100, 128), dict(window=(32, 8)), "bnhd"),
             ((1, 4, 4, 200, 200, 96), dict(causal=True, dropout_p=0.2, seed=7, softcap=20.0), "bhnd"),
             ((1, 4, 4, 256, 256, 256), dict(causal=True), "bnhd")]
    for shape, kw, layout in cases:
        q, k, v, do = _inputs(*shape, torch.bfloat16, layout=layout, seed=31)
        runs = []
        for fast in (False, True):
            with launch_mod.fast_path(fast):
                for _ in range(2):  # the first call of a signature compiles and records, the second replays
                    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
                    o, lse = flashattn.attention(qq, kk, vv, return_lse=True, **kw)
                    runs.append((o, lse, *torch.autograd.grad(o, (qq, kk, vv), do)))
        for run in runs[1:]:
            for a, b in zip(runs[0], run):
                assert torch.isfinite(a).all() or a.dtype == torch.float32
                assert torch.equal(a, b)
    if not any(entry[2] is not None for entry in launch_mod._COMPILED.values()):
        pytest.skip("this Triton's launcher is not the one _DirectLaunch was written for: nothing launched directly")
    q, k, v, _ = _inputs(1, 4, 4, 128, 128, 64, torch.float16, seed=3)
    assert _launches_a_hook_sees(lambda: flashattn.attention(q, k, v, causal=True)) == 1


def _launches_a_hook_sees(fn) -> int:
    """How many launches Triton's launch-enter hook (a profiler's) sees while ``fn()`` runs."""
    from triton import knobs

    seen = []

    def hook(metadata):
        seen.append(metadata)

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        fn()
        torch.cuda.synchronize()
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    return len(seen)


@gpu
@needs_cuda
def test_gpu_replayed_calls_match_the_full_path(monkeypatch):
    """Calls repeated from their recipes (flashattn.launch.Recipe) give bitwise the outputs and
    gradients of the full launch path, in the settings of the direct-launch test plus ALiBi and a
    gradient of the LSE, with another dropout seed on every call, and large calls whose backward runs
    dQ on a second stream and whose kernels are the Gluon ones on an H200; a replayed call makes no
    cache key; and while a launch hook is set the call takes Triton's path, so the hook sees its launch."""
    from flashattn import device_helpers, tensors
    from flashattn import launch as launch_mod

    class NeverKept(dict):
        def __setitem__(self, key, value):  # every call records and keeps nothing: the full path
            pass

    cases = [((2, 4, 4, 300, 300, 64), dict(causal=True), "bhnd"),
             ((1, 8, 2, 128, 513, 40), dict(causal=True), "bhnd"),
             ((2, 4, 4, 257, 100, 128), dict(window=(32, 8)), "bnhd"),
             ((1, 4, 4, 200, 200, 96), dict(causal=True, dropout_p=0.2, softcap=20.0), "bhnd"),
             ((2, 4, 2, 256, 320, 256), dict(causal=True, alibi=True), "bnhd"),
             # large enough for dQ's second stream and, on an H200, the Gluon kernels: the causal
             # forward's tile counter is its stream's, the plain one's walk is static
             ((16, 16, 16, 1024, 1024, 128), dict(causal=True), "bhnd"),
             ((16, 16, 4, 1024, 1024, 128), dict(), "bnhd"),
             ((4, 8, 8, 2048, 2048, 256), dict(causal=True), "bhnd")]
    for shape, kw, layout in cases:
        q, k, v, do = _inputs(*shape, torch.bfloat16, layout=layout, seed=31)
        gen = torch.Generator(device=q.device).manual_seed(1)
        dlse = torch.randn(q.shape[:3], device=q.device, generator=gen)
        if kw.pop("alibi", False):
            kw["alibi_slopes"] = torch.rand(q.shape[1], device=q.device, generator=gen)

        def call(seed):
            qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
            extra = dict(seed=seed) if kw.get("dropout_p") else {}
            o, lse = flashattn.attention(qq, kk, vv, return_lse=True, **kw, **extra)
            return (o, lse, *torch.autograd.grad((o, lse), (qq, kk, vv), (do, dlse)))

        runs = []
        for keep in (False, True):
            monkeypatch.setattr(launch_mod, "_RECIPES", {} if keep else NeverKept())
            call(7), call(8)  # compile, then record
            signatures = []
            with monkeypatch.context() as m:
                m.setattr(launch_mod, "_signature", lambda *a, f=launch_mod._signature: signatures.append(1) or f(*a))
                runs.append(call(2**40 + 9))
            if keep and any(entry[2] is not None for entry in launch_mod._COMPILED.values()):
                assert len([r for r in launch_mod._RECIPES.values() if r is not None]) == 2
                assert signatures == []  # both passes replayed
        for a, b in zip(*runs):
            assert torch.isfinite(a).all() or a.dtype == torch.float32
            assert not torch.isnan(a).any()
            assert torch.equal(a, b)
    if not launch_mod._RECIPES:
        pytest.skip("this Triton's launcher is not the one _DirectLaunch was written for: nothing replayed")
    with torch.no_grad():
        assert _launches_a_hook_sees(lambda: flashattn.attention(q, k, v, **kw)) == 1


def test_autotuning_times_each_candidate_once_and_a_pinned_tile_wins(monkeypatch):
    """With FLASHATTN_AUTOTUNE=1 on a GPU (faked here, timings included) the first call of a problem
    times every candidate of tuning_space, skips one that fails to launch, keeps the fastest and
    reuses it; a tile pinned with tuning() is taken as it is, with nothing timed."""
    import triton.testing

    monkeypatch.setenv("FLASHATTN_AUTOTUNE", "1")
    monkeypatch.setattr(_config, "is_interpreter", lambda: False)
    monkeypatch.setattr(_config, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(_config, "_sm_count", lambda index: 132)
    monkeypatch.setattr(_config, "_TUNED", {})
    gpu0, p = torch.device("cuda", 0), _problem(n=2048, m=2048, d=64, causal=False)
    space = _config.tuning_space("fwd", p, gpu0)
    assert len(space) > 3
    fastest, broken, launched = space[3], space[1], []

    def launch(cfg):
        launched.append(cfg)
        if cfg == broken:
            raise RuntimeError("out of shared memory")

    def bench(fn, **kwargs):
        fn()
        return 1.0 if launched[-1] == fastest else 2.0

    monkeypatch.setattr(triton.testing, "do_bench", bench)
    assert _config.choose("fwd", p, gpu0, launch) == fastest
    assert launched == space
    assert _config.choose("fwd", p, gpu0, launch) == fastest and launched == space  # remembered
    pinned = _config.KernelConfig(32, 32, 2, 1)
    with _config.tuning(fwd=pinned):
        assert _config.choose("fwd", _problem(n=1024, m=1024, d=64, causal=False), gpu0, launch) == pinned
    assert launched == space  # nothing timed under the pin
    monkeypatch.setenv("FLASHATTN_AUTOTUNE", "0")
    assert _config.choose("fwd", _problem(n=512, m=512, d=64), gpu0, launch) == \
        _config.get_config("fwd", _problem(n=512, m=512, d=64), gpu0)
    assert launched == space


@gpu
@needs_cuda
def test_gpu_autotuned_path(monkeypatch):
    """FLASHATTN_AUTOTUNE=1 times the pruned candidates at the first call, then reuses the winner."""
    from flashattn import _config

    monkeypatch.setenv("FLASHATTN_AUTOTUNE", "1")
    monkeypatch.setattr(_config, "_TUNED", {})
    q, k, v, do = _inputs(2, 8, 2, 1500, 1700, 64, torch.float16, seed=19)
    _check_against_reference(q, k, v, do, True, 64 ** -0.5)
    assert {key[0] for key in _config._TUNED} == {"fwd", "bwd_dkdv", "bwd_dq"}
    o, lse = attention_forward(q, k, v, Problem.of(q, k, True, 64 ** -0.5))
    first = attention_backward(do, q, k, v, o, lse, Problem.of(q, k, True, 64 ** -0.5))
    second = attention_backward(do, q, k, v, o, lse, Problem.of(q, k, True, 64 ** -0.5))
    assert all(torch.equal(a, b) for a, b in zip(first, second))


# -- the Hopper kernels in Gluon (flashattn.hopper_fwd, flashattn.hopper_bwd) ---------------------------


def _on_hopper(monkeypatch):
    """Make flashattn._config.gluon_kernel see an sm_90 GPU with Gluon available, on any machine."""
    monkeypatch.setattr(_config, "is_interpreter", lambda: False)
    monkeypatch.setattr(_config, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(_config, "_GLUON", {})


def _problem(b=2, h_q=8, h_kv=8, n=4096, m=4096, d=128, causal=True, **variants):
    q = torch.empty((b, h_q, n, d), dtype=torch.float16, device="meta")
    k = torch.empty((b, h_kv, m, d), dtype=torch.float16, device="meta")
    return Problem.of(q, k, causal, **variants)


def test_gluon_kernels_run_only_where_the_rule_says(monkeypatch):
    """The dispatch rule: plain attention on sm_90 at a head dim the Gluon kernel is built for, with
    at least the kernel's GLUON_MIN_WORK for the mask; never for a variant, packed sequences, a CPU
    tensor, a pinned tile or with Gluon turned off. (The capability and Gluon's presence are faked:
    this runs on any machine.)"""
    _on_hopper(monkeypatch)
    gpu0 = torch.device("cuda", 0)
    big = _problem()  # 2 * 8 * 4096 * 4096 * 128 = 2^35
    assert all(_config.gluon_kernel(kernel, big, gpu0) for kernel in ("fwd", "bwd_dkdv", "bwd_dq"))
    assert not _config.gluon_kernel("fwd", big, torch.device("cpu"))
    # each bar exactly: B * H * N * M * D at the bar runs Gluon, one query row fewer does not
    for (kernel, d), bars in _config.GLUON_MIN_WORK.items():
        for causal, bar in zip((False, True), bars):
            n = bar // (2 * 8 * 4096 * d)  # m = 4096 keys
            assert 2 * 8 * n * 4096 * d == bar
            assert _config.gluon_kernel(kernel, _problem(n=n, m=4096, d=d, causal=causal), gpu0), (kernel, d, causal)
            assert not _config.gluon_kernel(kernel, _problem(n=n - 1, m=4096, d=d, causal=causal), gpu0)
    # the causal bars are above the unmasked ones: at 2^33 the backward runs Gluon without the mask only
    assert _config.gluon_kernel("bwd_dq", _problem(n=1024, causal=False), gpu0)  # 2^33
    assert not _config.gluon_kernel("bwd_dq", _problem(n=1024, causal=True), gpu0)
    assert _config.gluon_kernel("fwd", _problem(n=1024, causal=True), gpu0)
    assert _config.gluon_kernel("fwd", _problem(n=512, causal=False), gpu0)  # 2^32
    assert not _config.gluon_kernel("fwd", _problem(n=512, causal=True), gpu0)
    for kernel in ("bwd_dkdv", "bwd_dq"):  # the backward's unmasked bar is 2^33, its causal one 2^34
        assert not _config.gluon_kernel(kernel, _problem(n=512, causal=False), gpu0)
        assert _config.gluon_kernel(kernel, _problem(n=2048, causal=True), gpu0)
        assert not _config.gluon_kernel(kernel, _problem(n=2047, causal=True), gpu0)
    assert _config.gluon_kernel("fwd", _problem(n=256, causal=False), gpu0)  # 2^31
    assert not _config.gluon_kernel("fwd", _problem(n=255, causal=False), gpu0)
    for d in (64, 72, 96, 256):
        assert not _config.gluon_kernel("bwd_dkdv", _problem(d=d, n=8192), gpu0)
    for d in (64, 72, 96, 160):
        assert not _config.gluon_kernel("bwd_dq", _problem(d=d, n=8192), gpu0)
    # dQ at D = 256: 2^32 without a mask, 2^34 causal (2 * 8 * n * 1024 * 256 = 2^22 n)
    assert _config.gluon_kernel("bwd_dq", _problem(d=256, n=1024, m=1024, causal=False), gpu0)
    assert not _config.gluon_kernel("bwd_dq", _problem(d=256, n=1023, m=1024, causal=False), gpu0)
    assert _config.gluon_kernel("bwd_dq", _problem(d=256, n=4096, m=1024, causal=True), gpu0)
    assert not _config.gluon_kernel("bwd_dq", _problem(d=256, n=4095, m=1024, causal=True), gpu0)
    for d in (64, 72, 96, 160):
        assert not _config.gluon_kernel("fwd", _problem(d=d, n=8192), gpu0)
    assert _config.gluon_kernel("fwd", _problem(d=256, n=1025, m=1025, causal=False), gpu0)  # 2 * 8 * 1025^2 * 256 >= 2^32
    assert not _config.gluon_kernel("fwd", _problem(d=256, n=1024, m=1023, causal=False), gpu0)
    assert _config.gluon_kernel("fwd", _problem(d=256, n=1449, m=1449), gpu0)  # causal: 2 * 8 * 1449^2 * 256 >= 2^33
    assert not _config.gluon_kernel("fwd", _problem(d=256, n=1448, m=1448), gpu0)
    for variant in (dict(window=(128, 0)), dict(softcap=30.0), dict(alibi=True), dict(dropout_p=0.1)):
        assert not _config.gluon_kernel("fwd", _problem(**variant), gpu0), variant
        assert not _config.gluon_kernel("bwd_dkdv", _problem(**variant), gpu0), variant
        assert not _config.gluon_kernel("bwd_dq", _problem(**variant), gpu0), variant
    for scale in (0.0, -0.125):  # the Gluon kernels assume a positive scale (the row maximum's side)
        assert not any(_config.gluon_kernel(kernel, _problem(scale=scale), gpu0) for kernel in ("fwd", "bwd_dkdv", "bwd_dq"))
    assert _config.gluon_kernel("fwd", _problem(scale=1e-3), gpu0)
    with _config.tuning(gluon=False):
        assert not _config.gluon_kernel("fwd", big, gpu0)
    with _config.tuning(fwd=_config.KernelConfig(128, 64, 4, 2)):
        assert not _config.gluon_kernel("fwd", big, gpu0) and _config.gluon_kernel("bwd_dkdv", big, gpu0)
    monkeypatch.setattr(_config, "_capability", lambda index: (8, 0))
    monkeypatch.setattr(_config, "_GLUON", {})
    assert not _config.gluon_kernel("fwd", big, gpu0)  # Ampere: the portable kernels


def test_hopper_forward_is_never_supported_off_hopper():
    """Importing the Gluon module never imports Gluon or touches the driver; it declines CPU tensors
    (and anything but float16/bfloat16, D in {64, 128, 256}, on an sm_90 GPU with Triton 3.6)."""
    from flashattn import hopper_fwd

    q, k, v = random_qkv(1, 2, 2, 8, 8, 64, dtype=torch.float16)
    assert not hopper_fwd.supported(q, k, v, True)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("b, h_q, h_kv, n, m, causal, layout, std", [
    (2, 4, 4, 1000, 1000, False, "bhnd", 1.0),
    (2, 4, 4, 300, 777, True, "bhnd", 1.0),
    (2, 4, 2, 777, 300, True, "bnhd", 1.0),  # GQA, N > M: the first 477 rows see no key
    (1, 8, 2, 1024, 1024, True, "bhnd", 3.0),  # large logits
    (1, 2, 1, 130, 3, False, "bnhd", 1.0),
])
def test_hopper_forward_matches_float64(dtype, d, b, h_q, h_kv, n, m, causal, layout, std):
    from flashattn import hopper_fwd

    q, k, v = random_qkv(b, h_q, h_kv, n, m, d, dtype=dtype, device="cuda", layout=layout, std=std)
    if not hopper_fwd.supported(q, k, v, causal):
        pytest.skip("the Gluon forward runs on sm_90 with Triton 3.6 only")
    o, lse = hopper_fwd.forward(q, k, v, causal)
    o64, lse64 = naive_attention(q.double(), k.double(), v.double(), causal=causal)
    o16, lse16 = naive_attention(q, k, v, causal=causal)
    assert_close_ratio("o", o, o64, o16)
    assert_close_ratio("lse", lse, lse64, lse16.float())


_WALKS = {  # hopper_fwd.forward's knobs for each way of walking the query blocks
    "static": dict(persistent=True, dynamic=False),
    "static, sections of 3": dict(persistent=True, dynamic=False, section=3),
    "dynamic": dict(persistent=True, dynamic=True),
    "dynamic, head by head": dict(persistent=True, dynamic=True, section=1),
    "dynamic, one section": dict(persistent=True, dynamic=True, section=10**6),
    "static, one Q buffer": dict(persistent=True, dynamic=False, q_buffers=1),
    "dynamic, two Q buffers": dict(persistent=True, dynamic=True, q_buffers=2),
}


@gpu
@needs_cuda
@pytest.mark.parametrize("walk", list(_WALKS))
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("b, h_q, h_kv, n, m", [
    (8, 40, 8, 1000, 1000),  # 2560 query blocks, more than any GPU has SMs: every CTA walks many
    (3, 50, 10, 650, 1300),  # N < M, ragged last block
    (4, 36, 36, 1500, 700),  # N > M: under causal the first 800 rows of a head see no key
    (1, 3, 1, 129, 64),      # fewer blocks than SMs; sections larger than B * H
])
def test_hopper_forward_persistent_matches_float64_and_one_cta_per_block(monkeypatch, walk, d, causal, b, h_q, h_kv,
                                                                         n, m):
    """A persistent launch (CTAs walking query blocks, the K/V ring and the Q and O buffers carried
    from block to block; statically or drawing blocks from a counter, in sections of heads, with one
    or two Q buffers) gives the same bits as one CTA per block, and float64's answer, with either
    mask and where blocks have unequal work; a dynamic walk twice in a row gives them again, drawing
    from one counter that no call zeroes (handed to it here): its last draw leaves it at zero."""
    from flashattn import device_helpers, launch as launch_mod, tensors, hopper_fwd

    if _WALKS[walk].get("q_buffers") == 2 and d > 128:
        pytest.skip("two Q buffers fit shared memory up to D = 128")
    q, k, v = random_qkv(b, h_q, h_kv, n, m, d, dtype=torch.bfloat16, device="cuda")
    if not hopper_fwd.supported(q, k, v, causal):
        pytest.skip("the Gluon forward runs on sm_90 with Triton 3.6 only")
    o1, lse1 = hopper_fwd.forward(q, k, v, causal, persistent=False)
    counter = tensors.tile_counter(q.device)
    if _WALKS[walk]["dynamic"]:
        monkeypatch.setattr(tensors, "tile_counter", lambda device: counter)  # one counter for both calls
    for _ in range(2 if _WALKS[walk]["dynamic"] else 1):
        o, lse = hopper_fwd.forward(q, k, v, causal, **_WALKS[walk])
        assert torch.equal(o, o1) and torch.equal(lse, lse1)
        assert counter.item() == 0
    o64, lse64 = naive_attention(q.double(), k.double(), v.double(), causal=causal)
    o16, lse16 = naive_attention(q, k, v, causal=causal)
    assert_close_ratio("o", o, o64, o16)
    assert_close_ratio("lse", lse, lse64, lse16.float())


@gpu
@needs_cuda
def test_hopper_forward_dynamic_walks_on_two_streams_at_once_keep_their_own_counters():
    """Two causal forwards with a dynamic walk running at the same time on two streams (each call
    zeroes a counter of its own) give the bits of one CTA per block."""
    from flashattn import hopper_fwd

    inputs = [random_qkv(4, 32, 8, 2048, 2048, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    if not hopper_fwd.supported(*inputs[0], True):
        pytest.skip("the Gluon forward runs on sm_90 with Triton 3.6 only")
    expected = [hopper_fwd.forward(*x, True, persistent=False) for x in inputs]
    _on_two_streams_at_once(lambda x: hopper_fwd.forward(*x, True, persistent=True, dynamic=True), inputs, expected)


def _on_two_streams_at_once(call, inputs, expected, rounds=3):
    """``call(x)`` for each of ``inputs`` on a stream of its own, all queued before one synchronize,
    ``rounds`` times; each round's results must be bitwise ``expected``'s."""
    streams = [torch.cuda.Stream() for _ in inputs]
    torch.cuda.synchronize()
    for _ in range(rounds):
        outs = []
        for stream, x in zip(streams, inputs):
            with torch.cuda.stream(stream):
                outs.append(call(x))
        torch.cuda.synchronize()
        for got, want in zip(outs, expected):
            assert all(torch.equal(a, b) for a, b in zip(got, want))


def _walk_order(batch_heads, num_mb, causal, section):
    """(head, query block) of each tile in the kernel's order, from its description: under causal,
    sections of ``section`` heads one after another, and within one the blocks by length (longest
    first), the heads in order among blocks of one length; else head by head, blocks in order."""
    tiles = [(h, mb) for h in range(batch_heads) for mb in range(num_mb)]
    if causal:
        tiles.sort(key=lambda t: (t[0] // section, -t[1], t[0]))
    return tiles


@pytest.mark.parametrize("batch_heads, n, m, ctas, section", [
    (16, 16384, 16384, 132, 1), (3, 1000, 1300, 5, 1), (4, 700, 300, 7, 1),
    (256, 1024, 1024, 132, 16), (7, 1000, 900, 11, 3), (5, 640, 640, 3, 8)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_persistent_walk_work_counts_the_key_blocks_each_cta_visits(batch_heads, n, m, ctas, section, causal,
                                                                     dynamic):
    """hopper_fwd.walk_work (the Hopper page's figure and numbers) against a count from the definition:
    a 128-row query block visits every key block up to the last one holding a key that one of its
    rows sees (bottom-right causal alignment); the tiles come in the kernel's order (longest block
    first within sections of heads under causal); a static walk gives CTA p tiles p, p + ctas, ...,
    a dynamic one each tile to the CTA that is free first (lowest number on a tie) when every key
    block takes one unit of time."""
    from flashattn import hopper_fwd
    from flashattn.schedule import is_visible

    num_mb, num_nb = -(-n // 128), -(-m // 128)

    def blocks(mb):  # key blocks up to the last with a visible key for some row of the block
        last = max((j for i in range(mb * 128, min(n, mb * 128 + 128)) for j in range(m)
                    if is_visible(i, j, n, m, causal)), default=-1)
        return last // 128 + 1

    per_block = {mb: blocks(mb) for mb in range(num_mb)} if n * m <= 2_000_000 else {
        mb: min(num_nb, -(-(mb * 128 + 128 + m - n) // 128)) if causal else num_nb for mb in range(num_mb)}
    expected, busy_until = [0] * ctas, [0] * ctas
    for tile, (_, mb) in enumerate(_walk_order(batch_heads, num_mb, causal, section)):
        p = min(range(ctas), key=lambda c: (busy_until[c], c)) if dynamic else tile % ctas
        expected[p] += per_block[mb]
        busy_until[p] += per_block[mb]
    assert hopper_fwd.walk_work(batch_heads, n, m, ctas, causal, dynamic=dynamic, section=section) == expected
    if (batch_heads, n, causal, dynamic) == (16, 16384, True, False):  # the numbers the Hopper page quotes
        work = expected
        assert (work[0], work[64], max(work)) == (1568, 544, 1568)
        assert round(max(work) / (sum(work) / ctas), 2) == 1.57
    if (batch_heads, n, causal, dynamic) == (256, 1024, True, True):
        assert round(max(expected) / (sum(expected) / ctas), 2) == 1.02


@settings(max_examples=200, deadline=None)
@given(ctas=st.integers(1, 8), extra=st.integers(0, 24), seed=st.integers(0, 2**32 - 1))
def test_dynamic_walk_draws_every_tile_once_and_its_last_draw_resets_the_counter(ctas, extra, seed):
    """The Gluon forward's dynamic walk (hopper_fwd._fa_producer), run as a model in which each
    CTA's atomic add is one indivisible step and the CTAs' steps interleave at random: from a zero
    counter, every tile is walked exactly once; the draws number as many as the tiles and return
    0 .. tiles - 1; exactly one CTA resets the counter, after the last draw of the launch; and the
    counter ends at zero, as the next launch on the stream needs (the Hopper page's claim)."""
    import random

    tiles = ctas + extra  # the launcher starts at most one CTA per tile
    counter, taken, draws, resets = [0], [], [], []

    def cta(pid):
        tile, drawn = pid, 0
        while tile < tiles:
            taken.append(tile)
            yield  # the tile's work: other CTAs may draw meanwhile
            drawn = counter[0]
            counter[0] += 1  # gl.atomic_add: read and add in one step
            draws.append(drawn)
            tile = ctas + drawn
            yield
        if drawn == tiles - 1:
            counter[0] = 0  # gl.atomic_xchg(counter_ptr, 0)
            resets.append(len(draws))
        yield

    rng = random.Random(seed)
    live = [cta(pid) for pid in range(ctas)]
    while live:
        walker = rng.choice(live)
        try:
            next(walker)
        except StopIteration:
            live.remove(walker)
    assert sorted(taken) == list(range(tiles))
    assert sorted(draws) == list(range(tiles))
    assert resets == [tiles]  # one reset, made when all the launch's draws had been made
    assert counter == [0]


def test_hopper_forward_walks_persistently_where_it_measured_faster():
    """The default walk: persistent and static without a mask at D <= 128, one CTA per query block
    without a mask at D = 256, persistent and dynamic under causal; sections of about one query
    block per CTA."""
    from flashattn import hopper_fwd

    assert hopper_fwd.schedule_default(64, False) == hopper_fwd.schedule_default(128, False) == (True, False)
    assert hopper_fwd.schedule_default(256, False) == (False, False)
    assert all(hopper_fwd.schedule_default(d, True) == (True, True) for d in (64, 128, 256))
    assert [hopper_fwd.section_default(256, n, 132) for n in (1024, 2048, 4096, 8192, 16384, 65536)] == [
        16, 8, 4, 2, 1, 1]
    assert hopper_fwd.section_default(3, 1024, 132) == 3 and hopper_fwd.section_default(64, 1000, 132) == 16


@pytest.mark.parametrize("d, causal, kw, grid, dynamic, section, qbufs", [
    (128, True, {}, 132, True, 16, 1),                      # 8 blocks per head, 256 heads: sections of 16
    (128, False, {}, 132, False, 1, 2),                     # static walk, next Q in a second buffer
    (64, False, {}, 132, False, 1, 2),
    (128, False, dict(q_buffers=1), 132, False, 1, 1),
    (128, True, dict(q_buffers=2), 132, True, 16, 2),
    (256, False, {}, 2048, False, 1, 1),                    # one CTA per block
    (256, True, dict(section=5), 132, True, 5, 1),          # O staged in the one Q buffer
    (128, True, dict(persistent=False), 2048, False, 1, 1),
    (128, True, dict(pingpong=True), 2048, False, 1, 1),    # ping-pong: one tile per CTA
])
def test_hopper_forward_host_code_launches_the_walk_it_describes(monkeypatch, d, causal, kw, grid, dynamic,
                                                                 section, qbufs):
    """hopper_fwd.forward's host code up to the launch, on the CPU (the kernel, the descriptors and
    the SM count stubbed): the grid, the walk's constexprs (the Q buffers included), the section and
    for a dynamic walk a zeroed counter of its own, which a recording keeps as the call's counter."""
    from flashattn import device_helpers, launch as launch_mod, tensors, hopper_fwd

    launches = []
    _stub_gluon_forward_launch(monkeypatch, launches)
    q, k, v = (torch.randn(32, 8, 1024, d, dtype=torch.bfloat16) for _ in range(3))
    o, lse = hopper_fwd.forward(q, k, v, causal, **kw)
    assert o.shape == q.shape and lse.shape == (32, 8, 1024)
    [(kernel, launched_grid, args, constexprs)] = launches
    assert kernel == "kernel" and launched_grid == grid
    assert constexprs["DYNAMIC"] == dynamic and constexprs["CAUSAL"] == causal and constexprs["QBUFS"] == qbufs
    counter, bh, sect = args[5], args[6], args[11]
    assert bh == 256 and sect == section
    if dynamic:
        assert counter.dtype == torch.int32 and counter.tolist() == [0] and counter is not lse
        record = launch_mod.Recording("key")
        hopper_fwd.forward(q, k, v, causal, record=record, **kw)
        again = launches[-1][2][5]
        assert again.tolist() == [0] and again is not counter  # a counter per call
        assert record.counters == [again]  # a recipe made from it makes each replay's own


@pytest.mark.parametrize("which, d", [("dkdv", 128), ("dq", 128), ("dq", 256)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_hopper_backward_host_code_launches_one_cta_per_block(monkeypatch, which, d, causal):
    """hopper_bwd.dkdv's and hopper_bwd.dq's host code up to the launch, on the CPU (the kernels and
    the descriptors stubbed): one CTA per block of keys (dK/dV) or of 128 query rows (dQ), the scale
    in base 2 and as given, the outputs described for TMA; dQ's K and V tiles of 64 keys, and of 32 at
    D = 256 (what fits shared memory there)."""
    from flashattn import hopper_bwd, hopper_fwd
    from flashattn.constants import LOG2E

    launches = []
    for name in ("_get_kernel", "_get_dq_kernel"):
        monkeypatch.setattr(hopper_bwd, name, lambda: "kernel")
    monkeypatch.setattr(hopper_fwd, "descriptor", lambda t, rows: ("desc", t.data_ptr(), rows))
    monkeypatch.setattr(hopper_fwd, "launch", lambda *a, **k: launches.append(a))
    b, hq, hkv, n, m = 2, 8, 2, 1000, 700
    q, do = (torch.randn(b, hq, n, d, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(b, hkv, m, d, dtype=torch.bfloat16) for _ in range(2))
    lse2, delta = (torch.zeros(b, hq, n) for _ in range(2))
    if which == "dkdv":
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        hopper_bwd.dkdv(q, k, v, do, lse2, delta, dk, dv, causal, 0.125)
        outputs, grid = (dk, dv), -(-m // hopper_bwd.BLOCK_N) * b * hkv
    else:
        dq = torch.empty_like(q)
        hopper_bwd.dq(q, k, v, do, lse2, delta, dq, causal, 0.125)
        outputs, grid = (dq,), -(-n // 128) * b * hq
    [(kernel, launched_grid, args, constexprs)] = launches
    assert kernel == "kernel" and launched_grid == grid and constexprs["CAUSAL"] == causal
    described = {a[1] for a in args if isinstance(a, tuple) and a[0] == "desc"}
    assert {x.data_ptr() for x in (q, k, v, do, *outputs)} <= described
    assert args[-2:] == (0.125 * LOG2E, 0.125) and all(any(a is x for a in args) for x in (lse2, delta))
    if which == "dq":
        keys = {a[2] for a in args if isinstance(a, tuple) and a[0] == "desc" and a[1] in (k.data_ptr(), v.data_ptr())}
        assert keys == {32 if d == 256 else hopper_bwd.DQ_BLOCK_N} and constexprs["BLOCK_N"] == keys.pop()
        assert constexprs["STAGES"] == hopper_bwd.DQ_STAGES


# (B, Hq, Hkv, N, M, causal, layout, logit scale) of the Gluon kernels' float64 checks
_GLUON_CASES = [
    (2, 4, 4, 1000, 1000, False, "bhnd", 1.0),
    (2, 4, 4, 300, 777, True, "bhnd", 1.0),  # N < M: every query also sees the prefix
    (2, 4, 2, 777, 300, True, "bnhd", 1.0),  # GQA, N > M: the first 477 rows see no key
    (1, 8, 2, 1024, 1024, True, "bhnd", 3.0),  # large logits
    (1, 6, 1, 130, 3, False, "bnhd", 1.0),  # multi-query, three keys
]


def _gluon_dispatched(q, k, causal, kernels=("fwd", "bwd_dkdv", "bwd_dq")):
    problem = Problem.of(q, k, causal)
    return {kernel: _config.gluon_kernel(kernel, problem, q.device) for kernel in kernels}


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("b, h_q, h_kv, n, m, causal, layout, std", _GLUON_CASES + [
    (1, 2, 2, 64, 200, True, "bhnd", 1.0),  # one query block, ragged key blocks
])
def test_gluon_kernels_match_float64(monkeypatch, dtype, d, b, h_q, h_kv, n, m, causal, layout, std):
    """The package's forward and backward with the Gluon kernels dispatched at every size (the work
    bar lowered to 0) against float64: ragged N != M, empty causal rows, GQA, transposed layouts."""
    monkeypatch.setattr(_config, "GLUON_MIN_WORK", collections.defaultdict(lambda: (0, 0)))
    # the dK/dV kernel is built for D = 64 too (not dispatched: it loses there); the forward is tested
    # at D = 64 above
    monkeypatch.setattr(_config, "GLUON_HEAD_DIMS", {"fwd": (128, 256), "bwd_dkdv": (64, 128), "bwd_dq": ()})
    monkeypatch.setattr(_config, "_GLUON", {})
    q, k, v, do = _inputs(b, h_q, h_kv, n, m, d, dtype, layout=layout, std=std, seed=n + m + d)
    dispatched = _gluon_dispatched(q, k, causal)
    if not any(dispatched.values()):
        pytest.skip("the Gluon kernels run on sm_90 with Triton 3.6 only")
    assert dispatched == {"fwd": d in (128, 256), "bwd_dkdv": d in (64, 128), "bwd_dq": False}
    _, (o, lse, dq, dk, dv) = _check_against_reference(q, k, v, do, causal, d ** -0.5)
    _empty_rows_are_zero(causal, n, m, o, lse, dq)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("b, h_q, h_kv, n, m, causal, layout, std", _GLUON_CASES + [
    (1, 2, 2, 200, 64, True, "bhnd", 1.0),  # one key block, ragged query blocks
])
def test_gluon_dq_kernel_matches_float64(monkeypatch, dtype, d, b, h_q, h_kv, n, m, causal, layout, std):
    """The Gluon dQ kernel (dispatched at D = 128 and 256 by default; built for D = 64 too) with the
    rest of the backward, against float64: the rule is opened to it at every size for this test."""
    monkeypatch.setattr(_config, "GLUON_MIN_WORK", collections.defaultdict(lambda: (0, 0)))
    monkeypatch.setattr(_config, "GLUON_HEAD_DIMS", {"fwd": (), "bwd_dkdv": (), "bwd_dq": (64, 128, 256)})
    monkeypatch.setattr(_config, "_GLUON", {})
    q, k, v, do = _inputs(b, h_q, h_kv, n, m, d, dtype, layout=layout, std=std, seed=n + 3 * m + d)
    if not _gluon_dispatched(q, k, causal, ("bwd_dq",))["bwd_dq"]:
        pytest.skip("the Gluon kernels run on sm_90 with Triton 3.6 only")
    _, (o, lse, dq, dk, dv) = _check_against_reference(q, k, v, do, causal, d ** -0.5)
    _empty_rows_are_zero(causal, n, m, o, lse, dq)


@gpu
@needs_cuda
def test_gpu_replayed_gluon_causal_forwards_on_two_streams_and_in_a_graph():
    """The public forward's Gluon causal kernel, each call with a tile counter of its own: replayed
    calls on two streams at once, calls on the default stream between the replays of a graph captured
    on a side stream, and the graph's replays all give the bits of the first call."""
    from flashattn import device_helpers, tensors
    from flashattn import launch as launch_mod

    inputs = [_inputs(4, 32, 8, 2048, 2048, 128, torch.bfloat16, seed=41 + i)[:3] for i in range(2)]
    if not _gluon_dispatched(inputs[0][0], inputs[0][1], True, ("fwd",))["fwd"]:
        pytest.skip("the Gluon kernels run on sm_90 with Triton 3.6 only")
    problem = Problem.of(inputs[0][0], inputs[0][1], True)
    expected = [attention_forward(*x, problem) for x in inputs]  # the first records the recipe
    _on_two_streams_at_once(lambda x: attention_forward(*x, problem), inputs, expected)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = attention_forward(*inputs[0], problem)
    for _ in range(2):
        graph.replay()
        eager = attention_forward(*inputs[1], problem)
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(captured, expected[0]))
        assert all(torch.equal(a, b) for a, b in zip(eager, expected[1]))
    assert launch_mod._RECIPES  # the calls were replayed, not only recorded


@gpu
@needs_cuda
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [128, 256])
def test_gluon_kernels_at_the_default_bar_match_float64_and_repeat_bitwise(causal, d):
    """At the real dispatch bars (GLUON_MIN_WORK) the public API runs the Gluon kernels (at D = 256
    the forward and dQ; at D = 128 the forward, dK/dV and dQ): float64 check, two backward passes
    bitwise equal, the same bits under a CUDA graph, and the launcher's direct path still on after them."""
    n = 2897 if d == 128 else 2049  # 2 * 8 * n^2 * d just above the highest bar: 2^34 at D = 128 and 256
    q, k, v, do = _inputs(2, 8, 2, n, n, d, torch.bfloat16, seed=23)
    dispatched = _gluon_dispatched(q, k, causal)
    if not any(dispatched.values()):
        pytest.skip("the Gluon kernels run on sm_90 with Triton 3.6 only")
    assert dispatched == {"fwd": True, "bwd_dkdv": d == 128, "bwd_dq": True}
    _check_against_reference(q, k, v, do, causal, d ** -0.5)
    problem = Problem.of(q, k, causal)
    o, lse = attention_forward(q, k, v, problem)
    first = attention_backward(do, q, k, v, o, lse, problem)
    second = attention_backward(do, q, k, v, o, lse, problem)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        og, lseg = attention_forward(q, k, v, problem)
        grads = attention_backward(do, q, k, v, og, lseg, problem)
    for _ in range(2):  # a replay zeroes the causal forward's tile counter again (a captured memset)
        og.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(og, o) and torch.equal(lseg, lse)
        assert all(torch.equal(a, b) for a, b in zip(grads, first))
    from flashattn import launch as launch_mod

    # no launch fell back to Triton's own path for good
    assert all(entry[1] is not None and entry[2] is not None for entry in launch_mod._COMPILED.values())
