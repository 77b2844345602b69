"""Float8 attention (flashattn.attention_fp8): e4m3 q, k, v with per-(batch, K/V head) descale factors.

The kernel runs under Triton's interpreter here (on the GPU in the gpu-marked tests) and is checked
against float64 attention of the dequantized inputs, entry by entry, with the error bound that
docs/kernels/fp8.md derives for rounding P to float8: |o - o_ref| <= 2^-4 sum_j P_j |v_j| +
2^-18 sum_j |v_j| / l + the bfloat16 rounding of the output. The LSE has no rounding of P in it.
"""

from __future__ import annotations

import math

import pytest
import sympy
import torch

import flashattn
from flashattn import fp8

from devices import DEVICE, cpu_only, gpu, needs_cuda

E4M3 = torch.float8_e4m3fn


def quantize(x: torch.Tensor, heads_kv: int):
    """``(x8, descale)``: x (float64, (B, H, N, D)) over per-(batch, K/V head) factors amax / 448, the
    factor shared by the query heads of a group, as FlashAttention 3's FP8 callers make them."""
    b, h = x.shape[:2]
    amax = x.abs().amax(dim=(2, 3)).view(b, heads_kv, h // heads_kv).amax(-1).clamp_min(1e-12)
    descale = (amax / 448.0).float()
    per_head = descale.double().repeat_interleave(h // heads_kv, 1)[:, :, None, None]
    return (x / per_head).to(E4M3), descale


def dequantized(x8, descale, heads_kv: int):
    return x8.double() * descale.double().repeat_interleave(x8.shape[1] // heads_kv, 1)[:, :, None, None]


def reference(q, k, v, causal: bool, window=None, scale=None):
    """float64 o, lse and P of the dequantized problem (bottom-right causal and window, as the API)."""
    n, m, d = q.shape[2], k.shape[2], q.shape[3]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) * (1 / math.sqrt(d) if scale is None else scale)
    i = torch.arange(n)[:, None] + (m - n)
    j = torch.arange(m)[None, :]
    visible = torch.ones(n, m, dtype=torch.bool)
    if causal:
        visible &= j <= i
    if window is not None:
        left, right = window
        if left is not None:
            visible &= j >= i - left
        if right is not None:
            visible &= j <= i + right
    s = s.masked_fill(~visible.to(s.device), float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)  # rows with no key: P = 0
    return p @ v, lse, p, v


def assert_within_bound(o, lse, q, k, v, causal, window=None, mma_bits=None):
    """The bound of docs/kernels/fp8.md, entry by entry, and the LSE: to float32 rounding where q . k
    is summed in float32 (the interpreter), else (``mma_bits``) to 2^-mma_bits of the row's largest
    sum_i |q_i k_i| * scale, the width of a float8 tensor-core sum."""
    want, want_lse, p, v_rep = reference(q, k, v, causal, window)
    o = o.double().cpu()
    err = (o - want.cpu()).abs()
    # the subnormal term 2^-18 sum_j |v_j| / l, with l = sum_j exp(s_j - max s) >= 1, taken at l = 1
    bound = (2.0**-4 * (p @ v_rep.abs()) + 2.0**-18 * v_rep.abs().sum(-2, keepdim=True)).cpu()
    bound += 2.0**-8 * want.abs().cpu() + 1e-6  # the bfloat16 output, and float32 sums
    assert torch.isfinite(o).all()
    ratio = (err / bound).max().item()
    assert ratio <= 1.0, f"float8 output off its bound by a factor {ratio:.2f}"
    empty = torch.isinf(want_lse.cpu())
    assert (o[empty] == 0).all()
    lse = lse.double().cpu()
    assert torch.equal(torch.isinf(lse), empty)
    if mma_bits is None:
        torch.testing.assert_close(lse[~empty], want_lse.cpu()[~empty], rtol=2e-6, atol=2e-6)
    else:
        group = q.shape[1] // k.shape[1]
        mass = (q.abs() @ k.repeat_interleave(group, 1).abs().transpose(-1, -2)).amax(-1) / math.sqrt(q.shape[-1])
        lse_err = (lse - want_lse.cpu()).abs()
        assert (lse_err[~empty] <= 2.0**-mma_bits * mass.cpu()[~empty] + 1e-5).all(), lse_err[~empty].max().item()


def problem(b, h_q, h_kv, n, m, d, std=(2.0, 2.0, 1.0), seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(b, h, length, d, generator=g, dtype=torch.float64) * s
          for h, length, s in ((h_q, n, std[0]), (h_kv, m, std[1]), (h_kv, m, std[2]))]
    quantized = [quantize(x, h_kv) for x in xs]
    (q8, dq), (k8, dk), (v8, dv) = [(x.to(device), d.to(device)) for x, d in quantized]
    return q8, k8, v8, dq, dk, dv


CASES = {
    "plain": dict(shape=(2, 4, 4, 40, 72, 64), causal=False),
    "gqa-causal-n-gt-m": dict(shape=(1, 6, 2, 50, 33, 32), causal=True),  # rows 0..16 see no key
    "gqa-causal-n-lt-m": dict(shape=(2, 4, 1, 24, 90, 80), causal=True),  # D = 80: not a power of two
    "window": dict(shape=(1, 2, 2, 64, 64, 64), causal=True, window=(9, 0)),
    "large-logits": dict(shape=(1, 2, 1, 32, 48, 32), causal=False, std=(30.0, 30.0, 5.0)),
}


@cpu_only
@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_kernel_within_the_float8_bound(name):
    case = CASES[name]
    q8, k8, v8, dq, dk, dv = problem(*case["shape"], std=case.get("std", (2.0, 2.0, 1.0)))
    h_kv = case["shape"][2]
    o, lse = flashattn.attention_fp8(q8, k8, v8, dq, dk, dv, causal=case["causal"], window=case.get("window"),
                                     return_lse=True)
    assert o.dtype == torch.bfloat16 and o.shape == q8.shape
    assert_within_bound(o, lse, *(dequantized(x, d, h_kv) for x, d in ((q8, dq), (k8, dk), (v8, dv))),
                        case["causal"], case.get("window"))


@cpu_only
def test_strided_inputs_and_missing_factors():
    """(B, N, H, D) views, factors left out (1), and an output in q's memory layout."""
    q8, k8, v8, dq, dk, dv = problem(1, 4, 2, 36, 36, 64, seed=3)
    qt, kt, vt = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q8, k8, v8))
    o, lse = flashattn.attention_fp8(qt, kt, vt, None, dk, None, causal=True, return_lse=True)
    assert o.stride() == torch.empty_like(qt, dtype=torch.bfloat16).stride()
    ones = torch.ones_like(dq)
    assert_within_bound(o, lse, dequantized(q8, ones, 2), dequantized(k8, dk, 2), dequantized(v8, ones, 2), True)


def test_v_laid_out_keys_last_is_read_in_place():
    """tensors.keys_last: a v whose keys are contiguous (quantized as (B, H, D, M) and transposed) is
    the kernel's operand as it is, no copy; any other v is copied into that layout."""
    from flashattn import tensors

    vt = torch.randn(2, 3, 64, 48).to(E4M3)  # (B, H, D, M), M a multiple of 16 bytes
    v = vt.transpose(2, 3)  # (B, H, M, D) with the keys contiguous
    seen = tensors.keys_last(v)
    assert seen.data_ptr() == vt.data_ptr() and seen.shape == (2, 3, 64, 48)
    copied = tensors.keys_last(v.contiguous())
    assert copied.data_ptr() != vt.data_ptr() and copied.stride(-1) == 1
    assert torch.equal(copied.view(torch.uint8), vt.view(torch.uint8))
    odd = torch.randn(1, 2, 64, 40).to(E4M3).transpose(2, 3)  # rows of 40 bytes: not 16-byte aligned
    assert tensors.keys_last(odd).data_ptr() != odd.data_ptr()


@cpu_only
def test_v_keys_last_gives_the_same_bits():
    """attention_fp8 on a v laid out keys last (read in place) returns bitwise what it returns on the
    same values laid out (B, H, M, D) (copied into that layout first)."""
    q8, k8, v8, dq, dk, dv = problem(1, 4, 2, 40, 64, 32, seed=5)
    v_keys_last = v8.transpose(2, 3).contiguous().transpose(2, 3)
    assert v_keys_last.stride(-2) == 1
    o, lse = flashattn.attention_fp8(q8, k8, v8, dq, dk, dv, causal=True, return_lse=True)
    o2, lse2 = flashattn.attention_fp8(q8, k8, v_keys_last, dq, dk, dv, causal=True, return_lse=True)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)


@cpu_only
@pytest.mark.parametrize("causal", [False, True])
def test_equal_scores_leave_nothing_to_round(causal):
    """With every key equal, each visible key's P is exp2(0) = 1, which float8 holds exactly, so the
    output is v's factor times the mean of the visible float8 values to the bfloat16 rounding alone:
    a wrong factor anywhere shows here, where the general bound is looser than a per cent."""
    q8, k8, v8, dq, dk, dv = problem(2, 4, 2, 24, 40, 64, seed=9)
    k8 = k8[:, :, :1].expand_as(k8).contiguous()
    o, lse = flashattn.attention_fp8(q8, k8, v8, dq, dk, dv, causal=causal, return_lse=True)
    want, want_lse, _, _ = reference(*(dequantized(x, d, 2) for x, d in ((q8, dq), (k8, dk), (v8, dv))), causal)
    err = (o.double().cpu() - want.cpu()).abs()
    assert (err <= 2.0**-8 * want.abs().cpu() + 1e-6).all(), err.max().item()
    torch.testing.assert_close(lse.double().cpu(), want_lse.cpu(), rtol=2e-6, atol=2e-6)


@cpu_only
def test_repeated_calls_are_bitwise_equal():
    q8, k8, v8, dq, dk, dv = problem(1, 2, 1, 40, 40, 32, seed=5)
    first = flashattn.attention_fp8(q8, k8, v8, dq, dk, dv, causal=True)
    again = flashattn.attention_fp8(q8, k8, v8, dq, dk, dv, causal=True)
    assert torch.equal(first, again)


def test_reference_path_without_the_interpreter(monkeypatch):
    """CPU tensors with the interpreter off: the dequantized values through the float32 reference."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q8, k8, v8, dq, dk, dv = problem(2, 4, 2, 20, 30, 32, seed=7, device="cpu")
    o, lse = flashattn.attention_fp8(q8, k8, v8, dq, dk, dv, causal=True, return_lse=True)
    want, want_lse, _, _ = reference(*(dequantized(x, d, 2) for x, d in ((q8, dq), (k8, dk), (v8, dv))), True)
    assert o.dtype == torch.bfloat16
    torch.testing.assert_close(o.double(), want, rtol=2**-8, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)


def test_the_contract_errors():
    q8, k8, v8, dq, dk, dv = problem(1, 2, 1, 8, 8, 32, device="cpu")
    call = flashattn.attention_fp8
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        call(q8.to(torch.bfloat16), k8.to(torch.bfloat16), v8.to(torch.bfloat16))
    with pytest.raises(TypeError, match="one dtype"):
        call(q8, k8.to(torch.bfloat16), v8)
    with pytest.raises(ValueError, match="head dims from 32"):
        call(q8[..., :16], k8[..., :16], v8[..., :16])
    with pytest.raises(ValueError, match=r"shape \(B, Hkv\)"):
        call(q8, k8, v8, dq.expand(1, 2))
    with pytest.raises(TypeError, match="float32"):
        call(q8, k8, v8, dq.double())
    with pytest.raises(TypeError, match="causal must be a bool"):
        call(q8, k8, v8, causal=1)
    with pytest.raises(ValueError, match="multiple"):
        call(q8, k8[:, :1].expand(1, 3, 8, 32)[:, :3], v8[:, :1].expand(1, 3, 8, 32)[:, :3])
    with pytest.raises(ValueError, match="scale must be finite"):
        call(q8, k8, v8, scale=-1.0)
    with pytest.raises(ValueError, match="at least one"):
        call(q8[:, :, :0], k8, v8)


def test_descale_factors_fold_into_the_score_scale_and_the_output():
    """The identity the kernel runs, in exact arithmetic: softmax(tau (a q) . (b k)) (c v) equals
    c softmax((tau a b) q . k) v, for every (a, b, c, tau) and a small problem of symbols."""
    a, b, c, tau = sympy.symbols("a b c tau", positive=True)
    q = sympy.Matrix(2, 2, sympy.symbols("q0:4"))
    k = sympy.Matrix(3, 2, sympy.symbols("k0:6"))
    v = sympy.Matrix(3, 2, sympy.symbols("v0:6"))

    def attention(q, k, v, scale):
        s = (q * k.T) * scale
        rows = []
        for i in range(s.rows):
            e = [sympy.exp(s[i, j]) for j in range(s.cols)]
            total = sum(e)
            rows.append([x / total for x in e])
        return sympy.Matrix(rows) * v

    lhs = attention(a * q, b * k, c * v, tau)
    rhs = c * attention(q, k, v, tau * a * b)
    assert sympy.simplify(lhs - rhs) == sympy.zeros(2, 2)


@gpu
@needs_cuda
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 8, 2, 1000, 1500, 128), (1, 4, 4, 777, 777, 64), (1, 8, 1, 512, 300, 256)])
def test_gpu_kernel_within_the_float8_bound(shape, causal):
    q8, k8, v8, dq, dk, dv = problem(*shape, seed=11)
    o, lse = flashattn.attention_fp8(q8, k8, v8, dq, dk, dv, causal=causal, return_lse=True)
    torch.cuda.synchronize()
    h_kv = shape[2]
    # Hopper's float8 MMA sums q . k narrower than float32: in this test's first GPU run the LSE was
    # off by up to 0.0106, at most 0.64 x 2^-11 of the smallest row mass of its case; the check allows 2^-10
    assert_within_bound(o, lse, *(dequantized(x, d, h_kv).cpu() for x, d in ((q8, dq), (k8, dk), (v8, dv))), causal,
                        mma_bits=10)
    again = flashattn.attention_fp8(q8, k8, v8, dq, dk, dv, causal=causal)
    assert torch.equal(o, again)
    assert fp8.OUT_DTYPE == o.dtype


def _gluon_fp8_or_skip():
    from flashattn import hopper

    if torch.cuda.get_device_capability() != (9, 0) or not hopper.fwd.available():
        pytest.skip("the Gluon forward needs an sm_90 GPU and Triton 3.6")
    return hopper.fwd


@gpu
@needs_cuda
@pytest.mark.parametrize("walk", ["default", "one-tile-per-cta"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 8, 2, 1000, 1500, 128), (1, 4, 4, 777, 777, 64), (1, 6, 3, 300, 4100, 128)])
def test_gpu_gluon_kernel_within_the_float8_bound(shape, causal, walk):
    """The Gluon forward's float8 path (V keys last, P through shared memory, 2^8 folded into the
    pivot), called directly so that small shapes take it too, within the same bound."""
    from flashattn import tensors

    fwd = _gluon_fp8_or_skip()
    q8, k8, v8, dq, dk, dv = problem(*shape, seed=12)
    descales = torch.stack((dq, dk, dv)).contiguous()
    knobs = {} if walk == "default" else dict(persistent=False)
    o, lse = fwd.forward(q8, k8, tensors.keys_last(v8), causal, None, descales=descales, **knobs)
    torch.cuda.synchronize()
    assert o.dtype == torch.bfloat16
    h_kv = shape[2]
    assert_within_bound(o, lse, *(dequantized(x, d, h_kv).cpu() for x, d in ((q8, dq), (k8, dk), (v8, dv))), causal,
                        mma_bits=10)
    again, _ = fwd.forward(q8, k8, tensors.keys_last(v8), causal, None, descales=descales, **knobs)
    assert torch.equal(o, again)


@gpu
@needs_cuda
def test_gpu_attention_fp8_dispatches_large_problems_to_gluon(monkeypatch):
    """attention_fp8 on a problem past the Gluon bar runs the Gluon kernel (and its result is within
    the bound); with Gluon turned off it runs the portable kernel."""
    from flashattn import _config

    fwd = _gluon_fp8_or_skip()
    calls = []
    real = fwd.forward
    monkeypatch.setattr(fwd, "forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    shape = (2, 8, 2, 1024, 2048, 128)  # 2^32 of work, past the bar without a mask
    q8, k8, v8, dq, dk, dv = problem(*shape, seed=13)
    o, lse = flashattn.attention_fp8(q8, k8, v8, dq, dk, dv, return_lse=True)
    assert calls == [1]
    deq = [dequantized(x, d, shape[2]).cpu() for x, d in ((q8, dq), (k8, dk), (v8, dv))]
    assert_within_bound(o, lse, *deq, False, mma_bits=10)
    with _config.tuning(gluon=False):
        o2, lse2 = flashattn.attention_fp8(q8, k8, v8, dq, dk, dv, return_lse=True)
    assert calls == [1]
    assert_within_bound(o2, lse2, *deq, False, mma_bits=10)


def test_benchmark_table_reads_its_rows():
    from benchmarks import fp8 as bench

    row = {"B": 4, "H": 16, "N": 4096, "D": 128, "causal": False,
           "flashattn_bf16": {"ms": 1.0, "tflops": 500.0, "max_err": 1e-4},
           "flashattn_fp8": {"ms": 2.0, "tflops": 250.0, "max_err": 3e-3},
           "flashattn_fp8_v_keys_last": {"ms": 0.8, "tflops": 625.0, "max_err": 3e-3},
           "sdpa_cudnn_bf16": {"ms": 1.1, "tflops": 450.0, "max_err": 1e-4},
           "sdpa_cudnn_fp8": {"error": "RuntimeError: No available kernel."}}
    table = bench.markdown({"environment": {"gpu": "G", "torch": "t", "triton": "x"}, "rows": [row]})
    assert ("| 128 | 4096 | False | 1.000 (500) | 2.000 (250) | 0.800 (625) | 0.50x (1.25x) | 3.00e-03 | 1.00e-04 | "
            "1.100 (450) | 0.55x (1.38x) | refused |") in table
