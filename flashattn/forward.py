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

import torch
import triton
import triton.language as tl

from flashattn import _config, hopper
from flashattn.device_helpers import (
    LN2, LOG2E, dropout_keep, forward_key_range, packed_tile, program_tile, score_mods, tile_mask,
    window_key_range,
)
from flashattn.launch import launch, recording, replay
from flashattn.tensors import (
    addressable, Descriptors, heads_first, interpreter_needs_float32, keys_last, tile_offsets,
)
from flashattn.problem import Problem, dense_like, output_like, seed_halves, variant_abi

# float8 P is rounded after this factor and the output divided by it (a power of two: both exact)
FP8_P_SCALE = tl.constexpr(256.0)
# Triton's interpreter (3.9) rounds float32 to float8 without carrying a rounded-up mantissa into the
# exponent (126.0 becomes 64.0); under it P is first rounded to float8's 4 significant bits in float32,
# which the conversion then keeps exactly. GPUs convert in hardware and skip this.
_FP8_ROUND_IN_FLOAT32 = tl.constexpr(_config.is_interpreter())


# --8<-- [start:fwd-inner]
@triton.jit
def _fwd_inner(
    acc, l_i, m_i, b_q, k_desc, v_desc, i_b, i_hkv,  #
    offs_m, offs_n, key0, lo, hi, N_CTX_Q, N_CTX_K, qk_scale,  #
    win_left, win_right, cap_in, cap_out, slope2, seed_lo, seed_hi, i_drop, drop_threshold,  #
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,  #
    HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
    BLOCK_DV: tl.constexpr, FP8: tl.constexpr,
):
    """Fold the key blocks starting in [lo, hi) into the online-softmax state of one query block.
    ``key0`` is the row of k that holds key 0 of the sequence (0 for dense tensors) and ``i_drop`` the
    dropout mask's (sequence or batch) * Hq + head counter: the mask is drawn in sequence-local indices."""
    MODS: tl.constexpr = SOFTCAP or ALIBI
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n  # [BLOCK_N]
        b_k = k_desc.load([i_b, i_hkv, start_n, 0]).reshape(BLOCK_N, BLOCK_D)  # [BLOCK_N, BLOCK_D]
        # [BLOCK_M, BLOCK_N]: raw scores q . k; the base-2 scale c = scale * log2(e) comes next
        qk = tl.dot(b_q, tl.trans(b_k))
        if MODS:
            # softcap and ALiBi act on every score, masked tile or not (the score-mods section)
            qk, _ = score_mods(qk, offs_m[:, None], cols[None, :], N_CTX_Q, N_CTX_K, qk_scale,
                               cap_in, cap_out, slope2, SOFTCAP, ALIBI)
        # --8<-- [start:fwd-masks]
        if MASKED:
            # Out-of-range and (causal) future keys go to -inf *before* the row max: a zero-padded
            # key would score 0, count in l_i (exp2(0 - m_i) in its shifted units, 1 in the plain
            # sum) and become the max of a row whose real scores are all negative. The schedule's
            # visibility test, compiled: j < M, and j <= i + (M - N) when causal (and inside the
            # window when there is one).
            mask = tile_mask(offs_m[:, None], cols[None, :], N_CTX_Q, N_CTX_K, win_left, win_right,
                             CAUSAL, HAS_WINDOW)
            if MODS:
                s = tl.where(mask, qk, float("-inf"))  # already base 2
            else:
                s = tl.where(mask, qk * qk_scale, float("-inf"))  # base-2 scores
        # --8<-- [end:fwd-masks]
        # --8<-- [start:fwd-online-update]
        if MASKED:
            m_new = tl.maximum(m_i, tl.max(s, 1))  # [BLOCK_M]
            # A row that has seen only masked keys has m_new = -inf and -inf - (-inf) = NaN;
            # any finite pivot is exact, so such rows pivot at 0 and keep p = exp2(-inf) = 0.
            m_pivot = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_pivot[:, None])  # [BLOCK_M, BLOCK_N], every entry <= 1
        elif MODS:
            m_new = tl.maximum(m_i, tl.max(qk, 1))  # [BLOCK_M]; qk holds base-2 scores here
            m_pivot = m_new
            p = tl.exp2(qk - m_pivot[:, None])  # [BLOCK_M, BLOCK_N]
        else:
            # Every score of an unmasked tile is finite, and c >= 0 (the API checks the scale), so
            # max(c * qk) = c * max(qk) exactly and the scale joins the subtraction in one fused
            # multiply-add per score instead of a multiply and a subtract.
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)  # [BLOCK_M]
            m_pivot = m_new
            p = tl.exp2(qk * qk_scale - m_pivot[:, None])  # [BLOCK_M, BLOCK_N]
        alpha = tl.exp2(m_i - m_pivot)  # [BLOCK_M]: rescales the old state to the new pivot
        l_i = l_i * alpha + tl.sum(p, 1)
        # --8<-- [start:fwd-dropout]
        if DROPOUT:
            # l_i above summed every entry: the softmax normalizes before dropout. Only P V sees the
            # dropped P; the kept entries' 1 / (1 - p) joins once, in the epilogue.
            keep = dropout_keep(seed_lo, seed_hi, i_drop, offs_m, start_n - key0, drop_threshold, BLOCK_N)
            p = tl.where(keep, p, 0.0)
        # --8<-- [end:fwd-dropout]
        if FP8:
            # v arrives transposed, (B, Hkv, D, M): keys contiguous, the order in which the float8
            # tensor cores read the P V product's second operand
            b_v = tl.trans(v_desc.load([i_b, i_hkv, 0, start_n]).reshape(BLOCK_DV, BLOCK_N))
        else:
            b_v = v_desc.load([i_b, i_hkv, start_n, 0]).reshape(BLOCK_N, BLOCK_DV)  # [BLOCK_N, BLOCK_DV]
        # P is rounded to the input dtype so the second matmul runs on the tensor cores too
        if FP8:
            # e4m3 keeps 3 mantissa bits from 2^-6 up: P (<= 1) scaled by 2^8 before the rounding
            # stays normal down to 2^-14; the epilogue divides the 2^8 back out (docs/kernels/fp8.md)
            p = p * FP8_P_SCALE
            if _FP8_ROUND_IN_FLOAT32:
                split = p * 1048577.0  # 2^20 + 1: Veltkamp's split keeps 24 - 20 = 4 significant bits
                p = split - (split - p)
        acc = acc * alpha[:, None] + tl.dot(p.to(b_v.dtype), b_v)
        m_i = m_new
        # --8<-- [end:fwd-online-update]
    return acc, l_i, m_i
# --8<-- [end:fwd-inner]


# --8<-- [start:fwd-kernel]
@triton.jit(do_not_specialize=["seed_lo", "seed_hi"])
def _attn_fwd_kernel(
    q_desc, k_desc, v_desc, O, LSE,  #
    stride_ob, stride_oh, stride_on,  #
    H_Q, GROUP, N_CTX_Q, N_CTX_K, qk_scale, N_BLOCKS, HEADS_PER_GROUP,  #
    CU_SEQLENS_Q, CU_SEQLENS_K, TILE_OFFSETS, N_SEQS,  #
    win_left, win_right, cap_in, cap_out, SLOPES, stride_slope_b, seed_lo, seed_hi, drop_threshold, inv_keep,  #
    SINKS,  # per-head sink logits (Hq,), read with HAS_SINKS
    DESCALES,  # float32 (3, B, Hkv): the descale factors of q, k and v, read with DESCALE
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,  #
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,  #
    HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
    VARLEN: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_SINKS: tl.constexpr,
    DESCALE: tl.constexpr,
):
    # Causal rows late in the sequence see the most keys: those blocks launch first, so the short
    # ones fill the gaps at the end of the grid instead of the long ones trailing alone.
    i_m, i_bh = program_tile(N_BLOCKS, HEADS_PER_GROUP, CAUSAL)  # query block, batch * query head
    i_b = i_bh // H_Q
    i_hq = i_bh % H_Q
    i_hkv = i_hq // GROUP  # the K/V head this query head shares with its group
    EVEN_DV: tl.constexpr = HEAD_DIM_V == BLOCK_DV  # v's and o's head dim (D_v, D unless split)
    # --8<-- [start:fwd-descale]
    if DESCALE:
        # float8 q, k, v hold x / descale_x per (batch, K/V head): q's and k's factors multiply every
        # score, so they join the score scale; v's multiplies the output (docs/kernels/fp8.md)
        per_tensor = N_SEQS * (H_Q // GROUP)  # B * Hkv factors each
        d_row = DESCALES + i_b * (H_Q // GROUP) + i_hkv
        qk_scale = qk_scale * tl.load(d_row) * tl.load(d_row + per_tensor)
        o_scale = tl.load(d_row + 2 * per_tensor) / FP8_P_SCALE
    # --8<-- [end:fwd-descale]

    start_m = i_m * BLOCK_M
    q_row = start_m  # the tile's first row in q and o
    i_seq = i_b  # whose ALiBi slopes and dropout draws: the batch entry, or the packed sequence
    k_start = 0  # the row of k that holds the sequence's key 0
    # --8<-- [start:fwd-varlen-prologue]
    if VARLEN:
        # Packed sequences, viewed as B = 1: i_m is a tile of this head's packed query rows, and
        # packed_tile finds its sequence. From here on N_CTX_Q and N_CTX_K are that sequence's
        # lengths and start_m, the masks and the schedule are local to it: one ordinary (n_i, m_i)
        # problem whose rows begin at q_start of q and whose keys begin at k_start of k.
        lse_row = i_hq.to(tl.int64) * N_CTX_Q  # lse is (Hq, total_q); N_CTX_Q arrives as total_q
        i_seq, start_m, q_start, k_start, N_CTX_Q, N_CTX_K = packed_tile(
            i_m, BLOCK_M, TILE_OFFSETS, CU_SEQLENS_Q, CU_SEQLENS_K, N_SEQS)
        if start_m >= N_CTX_Q:
            return  # a spare program: every tile is taken
        q_row = q_start + start_m
        lse_row += q_start
    # --8<-- [end:fwd-varlen-prologue]
    offs_m = start_m + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_dv = tl.arange(0, BLOCK_DV)  # [BLOCK_DV]: o's columns, padded to a power of two
    mask_m = offs_m < N_CTX_Q
    mask_dv = offs_dv < HEAD_DIM_V

    # a packed tile's rows past its sequence are the next sequence's: read, masked, never stored
    b_q = q_desc.load([i_b, i_hq, q_row, 0]).reshape(BLOCK_M, BLOCK_D)  # [BLOCK_M, BLOCK_D]
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running row max, base 2
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running row sum of exp2(s - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)  # running unnormalized P V
    slope2 = 0.0
    if ALIBI:  # this head's slope, in base-2 units
        slope2 = tl.load(SLOPES + i_seq * stride_slope_b + i_hq) * LOG2E
    i_drop = i_seq * H_Q + i_hq  # i_bh for dense tensors: a sequence draws the mask of that batch entry

    if HAS_WINDOW:
        # Key blocks in [lo, full_start) cross the window's left edge, [full_start, full_end) lie
        # inside it for every row, [full_end, hi) cross its right edge; the rest is never visited.
        lo, full_start, full_end, hi = window_key_range(start_m, BLOCK_M, BLOCK_N, N_CTX_Q, N_CTX_K,
                                                        win_left, win_right)
    else:
        # The block schedule: key blocks in [0, full_end) are visible to every row of this query block,
        # [full_end, hi) straddle the causal diagonal or the ragged key edge, [hi, M) are never visited.
        full_end, hi = forward_key_range(start_m, BLOCK_M, BLOCK_N, N_CTX_Q, N_CTX_K, CAUSAL)
        lo = 0
        full_start = 0
    if VARLEN:
        # The loops walk k's packed rows from the sequence's first key; offs_n shifted back by as
        # much keeps each key index (start_n + offs_n) local to the sequence for the masks.
        lo, full_start, full_end, hi = lo + k_start, full_start + k_start, full_end + k_start, hi + k_start
        offs_n -= k_start

    if HAS_WINDOW:
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, b_q, k_desc, v_desc, i_b, i_hkv, offs_m, offs_n, k_start,
                                   lo, full_start, N_CTX_Q, N_CTX_K, qk_scale,
                                   win_left, win_right, cap_in, cap_out, slope2, seed_lo, seed_hi, i_drop,
                                   drop_threshold, True, CAUSAL, BLOCK_N, BLOCK_D,
                                   HAS_WINDOW, SOFTCAP, ALIBI, DROPOUT, BLOCK_DV, DESCALE)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, b_q, k_desc, v_desc, i_b, i_hkv, offs_m, offs_n, k_start,
                               full_start, full_end, N_CTX_Q, N_CTX_K, qk_scale,
                               win_left, win_right, cap_in, cap_out, slope2, seed_lo, seed_hi, i_drop,
                               drop_threshold, False, CAUSAL, BLOCK_N, BLOCK_D,
                               HAS_WINDOW, SOFTCAP, ALIBI, DROPOUT, BLOCK_DV, DESCALE)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, b_q, k_desc, v_desc, i_b, i_hkv, offs_m, offs_n, k_start,
                               full_end, hi, N_CTX_Q, N_CTX_K, qk_scale,
                               win_left, win_right, cap_in, cap_out, slope2, seed_lo, seed_hi, i_drop,
                               drop_threshold, True, CAUSAL, BLOCK_N, BLOCK_D,
                               HAS_WINDOW, SOFTCAP, ALIBI, DROPOUT, BLOCK_DV, DESCALE)

    # --8<-- [start:fwd-sinks]
    if HAS_SINKS:
        # The head's sink logit joins the denominator as one more base-2 score with no value
        # (docs/math/sinks.md): the pivot becomes max(m_i, sink), the old state rescales to it, and the
        # sink adds exp2(sink - pivot) to l_i. A row with no key and a sink of -inf keeps l_i = 0.
        sink2 = tl.load(SINKS + i_hq).to(tl.float32) * LOG2E
        m_new = tl.maximum(m_i, sink2)
        m_pivot = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_pivot)
        l_i = l_i * alpha + tl.exp2(sink2 - m_pivot)
        acc = acc * alpha[:, None]
        m_i = m_new
    # --8<-- [end:fwd-sinks]
    # --8<-- [start:fwd-lse-epilogue]
    # l_i >= 1 for every row that saw a key (its max contributes exp2(0) = 1), so l_i == 0 marks the
    # rows that saw none: they store o = 0 and lse = -inf instead of 0/0.
    empty = l_i == 0.0
    b_o = acc / tl.where(empty, 1.0, l_i)[:, None]  # [BLOCK_M, BLOCK_DV]
    if DROPOUT:
        b_o = b_o * inv_keep  # the kept entries of P, scaled by 1 / (1 - p)
    if DESCALE:
        b_o = b_o * o_scale  # v's factor, and P's 2^8 divided back out
    # lse = ln(sum exp(s)) = (m_i + log2(l_i)) * ln 2, with m_i the base-2 max
    b_lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * LN2)  # [BLOCK_M]
    # 64-bit base, 32-bit offsets inside the tile: a (B, N, H, D) output can hold more than 2^31 elements
    p_o = O + i_b.to(tl.int64) * stride_ob + i_hq.to(tl.int64) * stride_oh + q_row.to(tl.int64) * stride_on \
        + tl.arange(0, BLOCK_M)[:, None] * stride_on + offs_dv[None, :]
    if EVEN_DV:
        tl.store(p_o, b_o.to(O.dtype.element_ty), mask=mask_m[:, None])
    else:
        tl.store(p_o, b_o.to(O.dtype.element_ty), mask=mask_m[:, None] & mask_dv[None, :])
    if VARLEN:
        p_lse = LSE + lse_row + offs_m
    else:
        # computed here, not in the prologue: a 64-bit value live across the key loop costs registers
        p_lse = LSE + i_bh.to(tl.int64) * N_CTX_Q + offs_m  # lse is a fresh contiguous (B, Hq, N)
    tl.store(p_lse, b_lse, mask=mask_m)  # mask_m: rows of this sequence (of this head) only
    # --8<-- [end:fwd-lse-epilogue]
# --8<-- [end:fwd-kernel]


def _output_dtype(problem: Problem) -> torch.dtype | None:
    """The output's dtype where it is not q's: bfloat16 for float8 inputs, float32 under Triton's
    interpreter, whose float32 -> bfloat16 conversion truncates (flashattn.fp8 rounds it then)."""
    if not problem.descale:
        return None
    return torch.float32 if _config.is_interpreter() else torch.bfloat16


def forward_key(q, k, v, problem: Problem, alibi_slopes=None):
    """The key of a :func:`launch_forward` call, or None for one that is never replayed. A call with
    the key of an earlier one (the problem, device, layouts, which of q, k, v are one tensor, as in
    self-attention of x with itself) repeats that call's launches with its own tensors: no config
    lookup, descriptor object or argument binding (flashattn.launch.Recipe). A tensor subclass takes
    the full path: its outputs are of the subclass (empty_like), a replay's are not."""
    if problem.varlen or problem.descale or type(q) is not torch.Tensor:  # float8: v may be copied per call (keys_last)
        return None
    return (problem, q.device, q.stride(), k.stride(), v.stride(), alibi_slopes is not None and alibi_slopes.dim(),
            (k is q, v is q, v is k))


def replay_forward(q, k, v, problem: Problem, alibi_slopes=None, seed: int = 0, sinks=None):
    """``(o, lse)`` of :func:`launch_forward` from the recipe an earlier call with this key left, or None
    where there is none: the caller made q's device the current one and runs the dense kernels."""
    return replay(forward_key(q, k, v, problem, alibi_slopes), (q, k, v, alibi_slopes, sinks),
                  seed_halves(problem, seed))


# --8<-- [start:fwd-launch]
def launch_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, problem: Problem,
                   alibi_slopes: torch.Tensor | None = None, seed: int = 0, packing=None, sinks=None,
                   descales=None):
    """Run the forward kernel on ``q``'s device. Returns ``(o, lse)``: o like q, lse float32 (B, Hq, N),
    natural log. Inputs are validated by :mod:`flashattn.api`; any outer strides are used as they are.
    ``alibi_slopes`` (float32 (Hq,) or (B, Hq)) when ``problem.alibi``; ``seed`` (0 <= seed < 2^62) of
    the dropout mask when ``problem.dropout_p`` > 0; ``sinks`` (Hq,) when ``problem.sinks``, joined in the
    kernel's epilogue (o and lse are then those with the sinks); ``descales`` float32 (3, B, Hkv),
    contiguous, when ``problem.descale`` (float8 q, k, v; o is then bfloat16, float32 under the
    interpreter).

    Packed sequences (``problem.varlen``): q is (total_q, Hq, D), k and v (total_k, Hkv, D), ``packing``
    is ``(cu_seqlens_q, cu_seqlens_k)`` (int32, on q's device, validated by :mod:`flashattn.varlen`),
    and lse is (Hq, total_q).
    """
    if interpreter_needs_float32(q):
        o, lse = launch_forward(q.float(), k.float(), v.float(), problem, alibi_slopes, seed, packing, sinks)
        return o.to(q.dtype), lse
    p = problem
    key = forward_key(q, k, v, p, alibi_slopes)
    inputs, free = (q, k, v, alibi_slopes, sinks), seed_halves(p, seed)  # float8 calls are never recorded
    replayed = replay(key, inputs, free)
    if replayed is not None:
        return replayed
    record = recording(key)
    if not p.varlen and _config.gluon_kernel("fwd", p, q.device) and hopper.fwd.available():
        # the Hopper forward in Gluon (large plain problems on sm_90, flashattn._config.gluon_kernel);
        # it makes its inputs TMA-readable itself (a copy it makes is no input: then nothing is kept).
        # Float8 inputs take v keys last and give a bfloat16 o (never recorded: forward_key)
        if p.descale:
            o, lse = hopper.fwd.forward(q, k, keys_last(v), p.causal, p.scale,
                                        out=dense_like(q, _output_dtype(p)), descales=descales)
            return o, lse
        o, lse = hopper.fwd.forward(q, k, v, p.causal, p.scale, out=dense_like(q), record=record)
        if record is not None:
            record.keep(inputs, (o, lse), free, shared=(0, 1, 2))
        return o, lse
    if p.varlen:
        o = output_like(q, p.dv)
        lse = torch.empty((p.heads_q, p.total_q), dtype=torch.float32, device=q.device)
        if p.total_q == 0 or p.total_k == 0:  # nothing to launch: no key anywhere gives o = 0, lse = -inf
            return o.zero_(), lse.fill_(float("-inf"))
        q, k, v, o_view = (heads_first(x) for x in (q, k, v, o))  # (1, H, total, D) views
        cu_q, cu_k = packing
        n_q, n_k = p.total_q, p.total_k  # the kernel reads each sequence's lengths from cu_seqlens
        q, k, v = (addressable(x) for x in (q, k, v))
    else:
        # float8 v keys last (B, Hkv, D, M), read in place where it is laid out so (tensors.keys_last)
        q, k, v = addressable(q), addressable(k), keys_last(v) if p.descale else addressable(v)
        # q's memory layout, e.g. (B, N, H, D) for a transposed view
        o = o_view = output_like(q, p.dv, _output_dtype(p))
        lse = torch.empty((p.batch, p.heads_q, p.n), dtype=torch.float32, device=q.device)
        cu_q = cu_k = lse  # never read: VARLEN is off
        n_q, n_k = p.n, p.m

    def run(plan: _config.Plan, record=None):
        cfg = plan.config
        offsets = tile_offsets(cu_q, cfg.block_m) if p.varlen else lse
        desc = Descriptors(p.block_d)
        v_tiles = desc(v, p.block_dv, cfg.block_n) if p.descale else desc(v, cfg.block_n, p.block_dv)
        args = (desc(q, cfg.block_m), desc(k, cfg.block_n), v_tiles, o_view, lse,
                o_view.stride(0), o_view.stride(1), o_view.stride(2),
                p.heads_q, p.group, n_q, n_k, p.qk_scale, plan.n_blocks, plan.heads_per_group,
                cu_q, cu_k, offsets, p.batch, *variant_abi(p, alibi_slopes, seed, lse)[1],
                lse if sinks is None else sinks, lse if descales is None else descales)
        launch(_attn_fwd_kernel, plan.grid, args, plan.constexprs, plan.options, record)

    if p.varlen:  # the fixed table entry: every new total would otherwise be a new plan (and autotuning)
        run(_config.plan_for("fwd", p, q.device, _config.get_config("fwd", p, q.device)))
        return o, lse
    # autotuning (opt-in) times candidate configs through the same launch
    run(_config.plan("fwd", p, q.device, lambda cfg: run(_config.plan_for("fwd", p, q.device, cfg))), record)
    if record is not None:
        record.keep(inputs, (o, lse), free, shared=(0, 1, 2))  # q, k, v: the key says which are one tensor
    return o, lse
# --8<-- [end:fwd-launch]
