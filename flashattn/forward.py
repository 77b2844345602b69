"""The FlashAttention forward kernel in Triton.

One program computes one block of ``BLOCK_M`` query rows of one (batch, query head). It walks the
key blocks that :func:`flashattn.schedule.forward_key_range` names: first the fully visible ones with
no mask, then the masked ones (the causal diagonal and the ragged key edge). It keeps the online
softmax state in base 2 (the row max ``m_i``, the row sum ``l_i`` and the unnormalized output
``acc``, all float32), and ends by normalizing the output and storing the row's log-sum-exp, which
is all the backward pass needs to recompute P.

Shapes: q (B, Hq, N, D); k, v (B, Hkv, M, D); Hq = GROUP * Hkv and query head ``h`` reads key/value
head ``h // GROUP``, so grouped-query attention never materializes repeated K/V.

Tiles are read through tensor descriptors: the launcher describes each input as the 4-d tensor
(B, H, N, D) it is, with its real strides and a block shape of [1, 1, rows, BLOCK_D], and
``desc.load([b, h, row, 0])`` returns one [rows, BLOCK_D] tile of one head. On Hopper that is one
TMA copy issued by the hardware instead of one address per thread and element, so the registers
that used to hold pointer tiles are free for the softmax. Rows past N or M and columns past D come
back as zeros (the bounds are per dimension, so a tile never runs into the next head); the masks
below still decide what a score means, the zeros only keep the loads in bounds. Older GPUs get the
same code lowered to ordinary loads by Triton. Stores stay plain masked stores: they happen once
per program.
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
_launch_order = device_fn(schedule.launch_order)


@triton.jit
def _clamp(x, lo, hi):
    return tl.minimum(tl.maximum(x, lo), hi)


@triton.jit
def _key_walk(start_m, N_CTX_Q, N_CTX_K, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The key blocks of the query block starting at ``start_m``, from the schedule: those starting in
    [0, full_end) are visible to every row, [full_end, hi) straddle the causal diagonal or the ragged
    key edge, and [hi, M) are never visited. Shared by the forward and the dQ kernel."""
    if CAUSAL:
        full_end = _clamp(_fwd_first_masked_key(start_m, N_CTX_Q, N_CTX_K), 0, N_CTX_K)
        hi = _clamp(_fwd_end_visible_key(start_m, BLOCK_M, N_CTX_Q, N_CTX_K), 0, N_CTX_K)
    else:
        full_end = N_CTX_K
        hi = N_CTX_K
    full_end = full_end // BLOCK_N * BLOCK_N  # operands are >= 0, so // is a floor in Triton too
    return full_end, hi


@triton.jit
def _causal_program(heads_per_group):
    """(rank, batch * head) of this program in the schedule's longest-first launch order.

    The grid is (blocks, batch * heads); its programs launch in the order of the linear index below.
    Shared by the three causal kernels; rank 0 is the block with the most tiles to walk.
    """
    n_blocks = tl.num_programs(0)
    pid = tl.program_id(1) * n_blocks + tl.program_id(0)
    return _launch_order(pid, n_blocks, heads_per_group)


# --8<-- [start:fwd-inner]
@triton.jit
def _fwd_inner(
    acc, l_i, m_i, b_q, k_desc, v_desc, i_b, i_hkv,  #
    offs_m, offs_n, lo, hi, N_CTX_Q, N_CTX_K, qk_scale,  #
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Fold the key blocks starting in [lo, hi) into the online-softmax state of one query block."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n  # [BLOCK_N]
        b_k = k_desc.load([i_b, i_hkv, start_n, 0]).reshape(BLOCK_N, BLOCK_D)  # [BLOCK_N, BLOCK_D]
        # [BLOCK_M, BLOCK_N]: raw scores q . k; the base-2 scale c = scale * log2(e) comes next
        qk = tl.dot(b_q, tl.trans(b_k))
        # --8<-- [start:fwd-masks]
        if MASKED:
            # Out-of-range keys go to -inf *before* the row max: a zero-padded key would score 0,
            # add 2^(-m) to l_i and become the max of a row whose real scores are all negative.
            visible = cols[None, :] < N_CTX_K
            if CAUSAL:
                # bottom-right alignment: query i sees key j when j <= i + (M - N)
                visible = visible & (cols[None, :] <= offs_m[:, None] + (N_CTX_K - N_CTX_Q))
            s = tl.where(visible, qk * qk_scale, float("-inf"))  # base-2 scores
        # --8<-- [end:fwd-masks]
        # --8<-- [start:fwd-online-update]
        if MASKED:
            m_new = tl.maximum(m_i, tl.max(s, 1))  # [BLOCK_M]
            # A row that has seen only masked keys has m_new = -inf and -inf - (-inf) = NaN;
            # any finite pivot is exact, so such rows pivot at 0 and keep p = exp2(-inf) = 0.
            m_pivot = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_pivot[:, None])  # [BLOCK_M, BLOCK_N], every entry <= 1
        else:
            # Every score of an unmasked tile is finite, and c >= 0 (the API checks the scale), so
            # max(c * qk) = c * max(qk) exactly and the scale joins the subtraction in one fused
            # multiply-add per score instead of a multiply and a subtract.
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)  # [BLOCK_M]
            m_pivot = m_new
            p = tl.exp2(qk * qk_scale - m_pivot[:, None])  # [BLOCK_M, BLOCK_N]
        alpha = tl.exp2(m_i - m_pivot)  # [BLOCK_M]: rescales the old state to the new pivot
        l_i = l_i * alpha + tl.sum(p, 1)
        b_v = v_desc.load([i_b, i_hkv, start_n, 0]).reshape(BLOCK_N, BLOCK_D)  # [BLOCK_N, BLOCK_D]
        # P is rounded to the input dtype so the second matmul runs on the tensor cores too
        acc = acc * alpha[:, None] + tl.dot(p.to(b_v.dtype), b_v)
        m_i = m_new
        # --8<-- [end:fwd-online-update]
    return acc, l_i, m_i
# --8<-- [end:fwd-inner]


# --8<-- [start:fwd-kernel]
@triton.jit
def _attn_fwd_kernel(
    q_desc, k_desc, v_desc, O, LSE,  #
    stride_ob, stride_oh, stride_on,  #
    H_Q, GROUP, N_CTX_Q, N_CTX_K, qk_scale, HEADS_PER_GROUP,  #
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,  #
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    if CAUSAL:
        # Causal rows late in the sequence see the most keys: those blocks launch first, so the
        # short ones fill the gaps at the end of the grid instead of the long ones trailing alone.
        rank, i_bh = _causal_program(HEADS_PER_GROUP)
        i_m = tl.num_programs(0) - 1 - rank  # query block
    else:
        i_m = tl.program_id(0)  # query block
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

    b_q = q_desc.load([i_b, i_hq, start_m, 0]).reshape(BLOCK_M, BLOCK_D)  # [BLOCK_M, BLOCK_D]
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running row max, base 2
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running row sum of exp2(s - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)  # running unnormalized P V

    # The block schedule: key blocks in [0, full_end) are visible to every row of this query block,
    # [full_end, hi) straddle the causal diagonal or the ragged key edge, [hi, M) are never visited.
    full_end, hi = _key_walk(start_m, N_CTX_Q, N_CTX_K, CAUSAL, BLOCK_M, BLOCK_N)

    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, b_q, k_desc, v_desc, i_b, i_hkv, offs_m, offs_n,
                               0, full_end, N_CTX_Q, N_CTX_K, qk_scale, False, CAUSAL, BLOCK_N, BLOCK_D)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, b_q, k_desc, v_desc, i_b, i_hkv, offs_m, offs_n,
                               full_end, hi, N_CTX_Q, N_CTX_K, qk_scale, True, CAUSAL, BLOCK_N, BLOCK_D)

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


def _describable(x: torch.Tensor) -> bool:
    """Whether a tensor descriptor (a TMA copy on Hopper) may read ``x`` in place: the head dim
    contiguous, and the start and every other stride a multiple of 16 bytes."""
    size = x.element_size()
    return (x.stride(-1) == 1 and x.data_ptr() % 16 == 0
            and all(st * size % 16 == 0 for st in x.stride()[:-1]))


def _addressable(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when the kernels can read it through tensor descriptors, else an aligned copy.

    Any layout whose strides are multiples of 16 bytes is read in place: (B, H, N, D), the
    (B, N, H, D) view of ``flash_attn_func``, slices of a larger buffer. Anything else (a strided
    head dim, an odd start, or rows of D elements that are not a multiple of 16 bytes, like
    D = 20 in fp16) is copied into a (B, H, N, D') buffer whose rows are padded to 16 bytes; the
    returned view still has D columns, so the padding is never read.
    """
    if _describable(x):
        return x
    per_16_bytes = 16 // x.element_size()
    padded_d = -(-x.shape[-1] // per_16_bytes) * per_16_bytes
    buffer = torch.empty((*x.shape[:-1], padded_d), dtype=x.dtype, device=x.device)
    view = buffer[..., : x.shape[-1]]
    view.copy_(x)
    return view


def tile_desc(x: torch.Tensor, rows: int, block_d: int):
    """A tensor descriptor of the (B, H, L, D) tensor ``x`` that reads [rows, block_d] tiles of one head.

    Made on the host per launch, so no program spends time building one; ``x`` must pass
    :func:`_describable` (the launchers call :func:`_addressable` first).
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(x, list(x.shape), list(x.stride()), [1, 1, rows, block_d])


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
            tile_desc(q, cfg.block_m, block_d), tile_desc(k, cfg.block_n, block_d), tile_desc(v, cfg.block_n, block_d),
            o, lse,
            o.stride(0), o.stride(1), o.stride(2),
            h_q, h_q // h_kv, n, m, scale * LOG2E.value, _config.heads_per_group(grid, q.device, causal),
            CAUSAL=causal, HEAD_DIM=d, BLOCK_D=block_d,
            **cfg.launch_kwargs(),
        )

    cfg = _config.choose("fwd", block_d, q.device, causal, (n, m, d, causal, q.dtype), launch)
    launch(cfg)
    return o, lse
# --8<-- [end:fwd-launch]
