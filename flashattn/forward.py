"""The FlashAttention forward kernel in Triton.

One program computes one block of ``BLOCK_M`` query rows of one (batch, query head). It walks the
key blocks that :func:`flashattn.schedule.forward_key_range` names: first the fully visible ones with
no mask, then the masked ones (the causal diagonal and the ragged key edge). It keeps the online
softmax state in base 2 (the row max ``m_i``, the row sum ``l_i`` and the unnormalized output
``acc``, all float32), and ends by normalizing the output and storing the row's log-sum-exp, which
is all the backward pass needs to recompute P.

Shapes: q (B, Hq, N, D); k, v (B, Hkv, M, D); Hq = GROUP * Hkv and query head ``h`` reads key/value
head ``h // GROUP``, so grouped-query attention never materializes repeated K/V.
"""

from __future__ import annotations

import types

import torch
import triton
import triton.language as tl

from flashattn import _config, schedule

# Kernels may read module globals only when they are constexpr; the launchers use ``.value``.
LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): exp(x) == exp2(x * LOG2E)
LN2 = tl.constexpr(0.6931471805599453)  # ln(2): turns a base-2 log-sum-exp back into a natural log


def device_fn(fn):
    """Wrap a plain-arithmetic function of :mod:`flashattn.schedule` with ``triton.jit``.

    The schedule's boundary functions use only + and -, so the kernels run the very functions the
    reference and the site's figures use. ``schedule`` does not import Triton (it must work without
    it), but Triton's interpreter insists on seeing ``triton.language`` in a jitted function's
    globals, so the wrapper gets a copy of the module's globals with it added.
    """
    scope = dict(fn.__globals__, tl=tl)
    clone = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    clone.__doc__, clone.__module__, clone.__qualname__ = fn.__doc__, fn.__module__, fn.__qualname__
    return triton.jit(clone)


_fwd_first_masked_key = device_fn(schedule.fwd_first_masked_key)
_fwd_end_visible_key = device_fn(schedule.fwd_end_visible_key)


@triton.jit
def _clamp(x, lo, hi):
    return tl.minimum(tl.maximum(x, lo), hi)


@triton.jit
def _load_tile(ptrs, mask_rows, mask_d, CHECK_ROWS: tl.constexpr, CHECK_D: tl.constexpr):
    """Load a [rows, BLOCK_D] tile; masks only where the tile can leave the tensor (else full-speed loads)."""
    if CHECK_ROWS:
        if CHECK_D:
            return tl.load(ptrs, mask=mask_rows[:, None] & mask_d[None, :], other=0.0)
        else:
            return tl.load(ptrs, mask=mask_rows[:, None], other=0.0)
    else:
        if CHECK_D:
            return tl.load(ptrs, mask=mask_d[None, :], other=0.0)
        else:
            return tl.load(ptrs)


@triton.jit
def _load_tile_t(ptrs, mask_rows, mask_d, CHECK_ROWS: tl.constexpr, CHECK_D: tl.constexpr):
    """Like :func:`_load_tile` for a transposed [BLOCK_D, rows] view of the same memory."""
    if CHECK_ROWS:
        if CHECK_D:
            return tl.load(ptrs, mask=mask_d[:, None] & mask_rows[None, :], other=0.0)
        else:
            return tl.load(ptrs, mask=mask_rows[None, :], other=0.0)
    else:
        if CHECK_D:
            return tl.load(ptrs, mask=mask_d[:, None], other=0.0)
        else:
            return tl.load(ptrs)


# --8<-- [start:fwd-inner]
@triton.jit
def _fwd_inner(
    acc, l_i, m_i, b_q,  #
    p_kt, p_v, stride_kn, stride_vn,  #
    offs_m, offs_n, mask_d,  #
    lo, hi, N_CTX_Q, N_CTX_K, qk_scale,  #
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, EVEN_D: tl.constexpr,  #
    BLOCK_N: tl.constexpr,
):
    """Fold the key blocks starting in [lo, hi) into the online-softmax state of one query block."""
    p_kt += lo * stride_kn
    p_v += lo * stride_vn
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n  # [BLOCK_N]
        # [BLOCK_D, BLOCK_N]: K^T, read straight from K's memory by swapping the offset axes
        b_kt = _load_tile_t(p_kt, cols < N_CTX_K, mask_d, MASKED, not EVEN_D)
        # [BLOCK_M, BLOCK_N]: base-2 scores, scale * log2(e) folded into one multiply
        s = tl.dot(b_q, b_kt) * qk_scale
        # --8<-- [start:fwd-masks]
        if MASKED:
            # Out-of-range keys go to -inf *before* the row max: a zero-padded key would score 0,
            # add 2^(-m) to l_i and become the max of a row whose real scores are all negative.
            visible = cols[None, :] < N_CTX_K
            if CAUSAL:
                # bottom-right alignment: query i sees key j when j <= i + (M - N)
                visible = visible & (cols[None, :] <= offs_m[:, None] + (N_CTX_K - N_CTX_Q))
            s = tl.where(visible, s, float("-inf"))
        # --8<-- [end:fwd-masks]
        # --8<-- [start:fwd-online-update]
        m_new = tl.maximum(m_i, tl.max(s, 1))  # [BLOCK_M]
        if MASKED:
            # A row that has seen only masked keys has m_new = -inf and -inf - (-inf) = NaN;
            # any finite pivot is exact, so such rows pivot at 0 and keep p = exp2(-inf) = 0.
            m_pivot = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_pivot = m_new  # an unmasked tile has a finite score in every row
        alpha = tl.exp2(m_i - m_pivot)  # [BLOCK_M]: rescales the old state to the new pivot
        p = tl.exp2(s - m_pivot[:, None])  # [BLOCK_M, BLOCK_N], every entry <= 1
        l_i = l_i * alpha + tl.sum(p, 1)
        # [BLOCK_N, BLOCK_D]
        b_v = _load_tile(p_v, cols < N_CTX_K, mask_d, MASKED, not EVEN_D)
        # P is rounded to the input dtype so the second matmul runs on the tensor cores too
        acc = acc * alpha[:, None] + tl.dot(p.to(b_v.dtype), b_v)
        m_i = m_new
        # --8<-- [end:fwd-online-update]
        p_kt += BLOCK_N * stride_kn
        p_v += BLOCK_N * stride_vn
    return acc, l_i, m_i
# --8<-- [end:fwd-inner]


# --8<-- [start:fwd-kernel]
@triton.jit
def _attn_fwd_kernel(
    Q, K, V, O, LSE,  #
    stride_qb, stride_qh, stride_qn,  #
    stride_kb, stride_kh, stride_kn,  #
    stride_vb, stride_vh, stride_vn,  #
    stride_ob, stride_oh, stride_on,  #
    H_Q, GROUP, N_CTX_Q, N_CTX_K, qk_scale,  #
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,  #
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    i_m = tl.program_id(0)  # query block
    if CAUSAL:
        # Causal rows late in the sequence see the most keys: launch those blocks first, so the
        # short ones fill the gaps at the end of the grid instead of the long ones trailing alone.
        i_m = tl.num_programs(0) - 1 - i_m
    i_bh = tl.program_id(1)  # batch * query head
    i_b = i_bh // H_Q
    i_hq = i_bh % H_Q
    i_hkv = i_hq // GROUP  # the K/V head this query head shares with its group
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D

    start_m = i_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D], padded to a power of two
    mask_m = offs_m < N_CTX_Q
    mask_d = offs_d < HEAD_DIM

    # 64-bit base offsets: B * H * N * D can pass 2^31 elements
    p_q = Q + i_b.to(tl.int64) * stride_qb + i_hq.to(tl.int64) * stride_qh \
        + offs_m[:, None] * stride_qn + offs_d[None, :]
    p_kt = K + i_b.to(tl.int64) * stride_kb + i_hkv.to(tl.int64) * stride_kh \
        + offs_n[None, :] * stride_kn + offs_d[:, None]
    p_v = V + i_b.to(tl.int64) * stride_vb + i_hkv.to(tl.int64) * stride_vh \
        + offs_n[:, None] * stride_vn + offs_d[None, :]

    b_q = _load_tile(p_q, mask_m, mask_d, True, not EVEN_D)  # [BLOCK_M, BLOCK_D]
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running row max, base 2
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running row sum of exp2(s - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)  # running unnormalized P V

    # The block schedule: key blocks in [0, full_end) are visible to every row of this query block,
    # [full_end, hi) straddle the causal diagonal or the ragged key edge, [hi, M) are never visited.
    if CAUSAL:
        full_end = _clamp(_fwd_first_masked_key(start_m, N_CTX_Q, N_CTX_K), 0, N_CTX_K)
        hi = _clamp(_fwd_end_visible_key(start_m, BLOCK_M, N_CTX_Q, N_CTX_K), 0, N_CTX_K)
    else:
        full_end = N_CTX_K
        hi = N_CTX_K
    full_end = full_end // BLOCK_N * BLOCK_N  # operands are >= 0, so // is a floor in Triton too

    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, b_q, p_kt, p_v, stride_kn, stride_vn,
                               offs_m, offs_n, mask_d, 0, full_end, N_CTX_Q, N_CTX_K, qk_scale,
                               False, CAUSAL, EVEN_D, BLOCK_N)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, b_q, p_kt, p_v, stride_kn, stride_vn,
                               offs_m, offs_n, mask_d, full_end, hi, N_CTX_Q, N_CTX_K, qk_scale,
                               True, CAUSAL, EVEN_D, BLOCK_N)

    # --8<-- [start:fwd-lse-epilogue]
    # l_i >= 1 for every row that saw a key (its max contributes exp2(0) = 1), so l_i == 0 marks the
    # rows that saw none: they store o = 0 and lse = -inf instead of 0/0.
    empty = l_i == 0.0
    b_o = acc / tl.where(empty, 1.0, l_i)[:, None]  # [BLOCK_M, BLOCK_D]
    # lse = ln(sum exp(s)) = (m_i + log2(l_i)) * ln 2, with m_i the base-2 max
    b_lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * LN2)  # [BLOCK_M]
    p_o = O + i_b.to(tl.int64) * stride_ob + i_hq.to(tl.int64) * stride_oh \
        + offs_m[:, None] * stride_on + offs_d[None, :]
    if EVEN_D:
        tl.store(p_o, b_o.to(O.dtype.element_ty), mask=mask_m[:, None])
    else:
        tl.store(p_o, b_o.to(O.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])
    p_lse = LSE + i_bh.to(tl.int64) * N_CTX_Q + offs_m  # lse is a fresh contiguous (B, Hq, N)
    tl.store(p_lse, b_lse, mask=mask_m)
    # --8<-- [end:fwd-lse-epilogue]
# --8<-- [end:fwd-kernel]


def _head_dim_block(d: int) -> int:
    # tl.dot and tl.arange want power-of-two extents (and at least 16); the padding is masked.
    return max(16, triton.next_power_of_2(d))


def _interpreter_needs_float32(x: torch.Tensor) -> bool:
    # Triton's CPU interpreter (3.9) multiplies bfloat16 tiles in tl.dot as raw 16-bit integers, so on
    # the CPU a bfloat16 problem runs in float32 and its results are rounded back. GPUs never take this.
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and _config.is_interpreter()


def _addressable(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when the kernels can address it, else a contiguous copy.

    Any batch and head strides work (their offsets are 64-bit). A strided head dim would break
    16-byte loads, and the row offsets inside one head are 32-bit: a view whose rows are so far
    apart that (rows - 1) * row stride passes 2^31 is copied to (B, H, N, D), where it is N * D.
    """
    rows, row_stride = x.shape[-2], x.stride(-2)
    if x.stride(-1) == 1 and (rows - 1) * row_stride + x.shape[-1] < 2**31:
        return x
    return x.contiguous()


# --8<-- [start:fwd-launch]
def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """Run the forward kernel. Returns ``(o, lse)``: o like q, lse float32 (B, Hq, N), natural log.

    Inputs are validated by :mod:`flashattn.api`; any outer strides are used as they are.
    """
    if _interpreter_needs_float32(q):
        o, lse = attention_forward(q.float(), k.float(), v.float(), causal, scale)
        return o.to(q.dtype), lse
    q, k, v = (_addressable(x) for x in (q, k, v))
    batch, h_q, n, d = q.shape
    h_kv, m = k.shape[1], k.shape[2]
    block_d = _head_dim_block(d)
    o = torch.empty_like(q)  # keeps q's memory layout, e.g. (B, N, H, D) for a transposed view
    if o.stride(-1) != 1:
        o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, h_q, n), dtype=torch.float32, device=q.device)
    if n == 0:
        return o, lse

    def launch(cfg: _config.KernelConfig):
        grid = (triton.cdiv(n, cfg.block_m), batch * h_q)
        _attn_fwd_kernel[grid](
            q, k, v, o, lse,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            o.stride(0), o.stride(1), o.stride(2),
            h_q, h_q // h_kv, n, m, scale * LOG2E.value,
            CAUSAL=causal, HEAD_DIM=d, BLOCK_D=block_d,
            **cfg.launch_kwargs(),
        )

    cfg = _config.choose("fwd", block_d, q.device, causal, (n, m, d, causal, q.dtype), launch)
    launch(cfg)
    return o, lse
# --8<-- [end:fwd-launch]
