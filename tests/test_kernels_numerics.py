"""The Triton kernels' results against the float64 reference.

The forward and backward launchers run ragged, causal, grouped-query and transposed problems and are
compared with float64: a kernel passes when its error is at most twice the error PyTorch's own
low-precision computation makes, plus a small floor (:func:`flashattn.testing.assert_close_ratio`);
NaN or inf where the reference is finite never passes. Also here: the causal diagonal at every offset
against the key blocks, rows that see no key, padding past N and M that holds huge values or NaN,
stores that stay inside their outputs and keep the input's layout, two backward passes bitwise equal,
every output element written, and linear memory at N = 131072. Without CUDA the kernels run under
Triton's CPU interpreter on small shapes (CI); with CUDA the tests marked ``gpu`` run at realistic sizes.
"""

from __future__ import annotations

import pytest
import torch

from flashattn.backward import launch_backward as attention_backward
from flashattn.forward import launch_forward as attention_forward
from flashattn.problem import Problem
from flashattn.testing import rel_err

from devices import DEVICE, HAS_CUDA, cpu_only, gpu, needs_cuda
from kernel_cases import _check_against_reference, _empty_rows_are_zero, _inputs


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
        m.setattr(fwd_mod, "output_like", lambda x, d_v, dtype=None: guarded(x))  # o: D_v = D, q's dtype here
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


def test_outputs_keep_the_input_layout():
    """A (B, N, H, D) view gives o and dq in (B, N, H, D) memory too: no hidden transposing copy."""
    b, h, n, d = (2, 4, 256, 64) if HAS_CUDA else (1, 2, 20, 16)
    q, k, v, do = _inputs(b, h, h, n, n, d, torch.float16, layout="bnhd")
    o, lse = attention_forward(q, k, v, Problem.of(q, k, False, d ** -0.5))
    dq, dk, dv = attention_backward(do, q, k, v, o, lse, Problem.of(q, k, False, d ** -0.5))
    for x, ref in ((o, q), (dq, q), (dk, k), (dv, v)):
        assert x.stride() == ref.stride()


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


@gpu
@needs_cuda
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_causal_offset_at_every_residue(d):
    """The GPU tiles' version of test_interpreter_causal_offset_at_every_residue: the causal offset
    M - N at every residue modulo 128, the largest key block of the GPU tables, against float64."""
    for m in range(2, 260):  # M - N from -128 to 129
        q, k, v, do = _inputs(1, 2, 1, 130, m, d, torch.bfloat16, seed=m)
        _check_against_reference(q, k, v, do, True, d ** -0.5)


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
