"""The FlashAttention backward pass in Triton: three kernels, no atomics.

1. ``_bwd_preprocess_kernel``: delta = rowsum(dO * O), one float per query row (the papers' D). By the
   delta identity it equals rowsum(P * dP), so dS = P * (dP - delta) never needs a reduction over the keys. The same pass
   turns the forward's natural-log LSE into base 2 once per row, so the loops below never do.
2. ``_bwd_dkdv_kernel``: one program per key block of one K/V head. It loops over the query heads of
   its group and, for each, over the query blocks that can see the key block, recomputing
   P = exp2(s - lse2) from the stored log-sum-exp, and accumulates dV = P^T dO and dK = scale dS^T Q
   in float32 registers. Summing the group's heads inside one program is what makes GQA gradients
   deterministic without atomics.
3. ``_bwd_dq_kernel``: one program per query block of one query head, walking the key blocks like the
   forward and accumulating dQ = scale dS K.

Where dQ runs on the current stream (problems too small for a second stream to pay), (3) runs first
and does (1)'s work for its own rows, so the call makes two launches, not three (:func:`launch_backward`).

S and dP are recomputed in both (2) and (3): seven matmuls instead of five, the price of never
adding into the same memory from two programs. Tiles are read through tensor descriptors, as in
:mod:`flashattn.forward`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashattn import _config, hopper
from flashattn.device_helpers import (
    LOG2E, backward_query_range, dq_key_range, dropout_keep, packed_tile, program_tile, score_mods, tile_mask,
    window_dq_key_range, window_query_range,
)
from flashattn.launch import compiling, fork, in_background, join, launch, on_stream, recording, replay
from flashattn.tensors import (
    addressable, ceil_div, Descriptors, heads_first, interpreter_needs_float32, tile_offsets,
)
from flashattn.problem import Problem, dense_like, output_like, seed_halves, variant_abi

PREPROCESS_BLOCK = 64  # rows per program of the delta kernel (memory bound: any size that fills the GPU)


# --8<-- [start:bwd-preprocess]
@triton.jit
def _row_stats(b_o, b_do, p_lse, p_dlse, mask_rows, HAS_DLSE: tl.constexpr):
    """delta and the base-2 lse of a block of query rows, from its float32 O and dO tiles
    ([BLOCK_M, BLOCK_D], zero past the rows and the head dim) and the stored natural-log LSE. The
    preprocess kernel below runs it for every row; the dQ kernel runs it for its own rows where it
    goes first (``ROW_STATS``, :func:`launch_backward`)."""
    # delta_i = sum_d dO_id O_id = sum_j P_ij dP_ij: an N x d reduction in place of an N x M one
    b_delta = tl.sum(b_o * b_do, axis=1)  # [BLOCK_M]
    # --8<-- [start:bwd-dlse]
    if HAS_DLSE:
        # A gradient that reaches the LSE output adds dLSE_i * P_ij to dS_ij (dLSE_i/dS_ij = P_ij),
        # so dS = P * (dP - delta + dLSE) = P * (dP - (delta - dLSE)): folding it into delta leaves the loops as
        # they are. A row with no key has P = 0 and takes nothing from it.
        b_delta -= tl.load(p_dlse, mask=mask_rows, other=0.0)
    # --8<-- [end:bwd-dlse]
    # lse in base 2, the pivot of P = exp2(c * qk - lse2). A row that saw no key stores lse = -inf,
    # and s - (-inf) = inf for every score. Such rows lie only in masked tiles, whose `where` replaces
    # their P by 0 whatever exp2 gave; the pivot 0 only keeps the subtraction itself from being inf.
    b_lse = tl.load(p_lse, mask=mask_rows, other=0.0)
    b_lse2 = tl.where(b_lse == float("-inf"), 0.0, b_lse * LOG2E)
    return b_lse2, b_delta


@triton.jit
def _bwd_preprocess_kernel(
    O, DO, LSE, DLSE, LSE2, DELTA,  #
    stride_ob, stride_oh, stride_on,  #
    stride_dob, stride_doh, stride_don,  #
    H_Q, N_CTX_Q, N_BLOCKS,  #
    HAS_DLSE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    i_m, i_bh = program_tile(N_BLOCKS, 1, False)  # row block, batch * query head
    i_b = i_bh // H_Q
    i_h = i_bh % H_Q
    start_m = i_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    mask_m = offs_m < N_CTX_Q
    mask = mask_m[:, None] & (offs_d < HEAD_DIM)[None, :]
    rows = tl.arange(0, BLOCK_M)[:, None]  # 64-bit bases below, 32-bit offsets inside the tile
    p_o = O + i_b.to(tl.int64) * stride_ob + i_h.to(tl.int64) * stride_oh + start_m.to(tl.int64) * stride_on \
        + rows * stride_on + offs_d[None, :]
    p_do = DO + i_b.to(tl.int64) * stride_dob + i_h.to(tl.int64) * stride_doh + start_m.to(tl.int64) * stride_don \
        + rows * stride_don + offs_d[None, :]
    b_o = tl.load(p_o, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_D]
    b_do = tl.load(p_do, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_D]
    row0 = i_bh.to(tl.int64) * N_CTX_Q  # lse, dlse, lse2 and delta are contiguous (B, Hq, N)
    b_lse2, b_delta = _row_stats(b_o, b_do, LSE + row0 + offs_m, DLSE + row0 + offs_m, mask_m, HAS_DLSE)
    tl.store(DELTA + row0 + offs_m, b_delta, mask=mask_m)
    tl.store(LSE2 + row0 + offs_m, b_lse2, mask=mask_m)
# --8<-- [end:bwd-preprocess]


@triton.jit
def _load_row_stats(p_lse2, p_delta, mask_rows, CHECK_ROWS: tl.constexpr):
    """Per-row base-2 lse and delta for a block of query rows."""
    if CHECK_ROWS:
        return tl.load(p_lse2, mask=mask_rows, other=0.0), tl.load(p_delta, mask=mask_rows, other=0.0)
    else:
        return tl.load(p_lse2), tl.load(p_delta)


# --8<-- [start:bwd-dkdv-inner]
@triton.jit
def _bwd_dkdv_inner(
    b_dk, b_dv, b_k, b_v,  #
    q_desc, do_desc, i_b, i_hq, p_lse2, p_delta,  #
    offs_m, offs_n, first_key, lo, hi, N_CTX_Q, N_CTX_K, qk_scale,  #
    win_left, win_right, cap_in, cap_out, slope2, seed_lo, seed_hi, i_bh, drop_threshold, inv_keep,  #
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,  #
    BLOCK_D: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,  #
    DROPOUT: tl.constexpr, PART: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Add the contributions of the query blocks starting in [lo, hi) to this key block's dK, dV.
    ``offs_n`` holds the block's key indices and ``first_key`` the first of them (the dropout mask's).
    ``PART`` 1 computes dV alone and 2 dK alone (the kernel's comment says why); 0, both."""
    p_lse2 += lo
    p_delta += lo
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m  # [BLOCK_M]
        b_q = q_desc.load([i_b, i_hq, start_m, 0]).reshape(BLOCK_M, BLOCK_D)  # [BLOCK_M, BLOCK_D]
        b_lse2, b_delta = _load_row_stats(p_lse2, p_delta, rows < N_CTX_Q, MASKED)  # [BLOCK_M] each
        # --8<-- [start:bwd-recompute-p]
        # Work with the transposes, [BLOCK_N, BLOCK_M], so every product below has the key block's
        # rows first and accumulates straight into dK and dV.
        if SOFTCAP or ALIBI:
            s_t, t_t = score_mods(tl.dot(b_k, tl.trans(b_q)), rows[None, :], offs_n[:, None], N_CTX_Q, N_CTX_K,
                                  qk_scale, cap_in, cap_out, slope2, SOFTCAP, ALIBI)
        else:
            s_t = tl.dot(b_k, tl.trans(b_q)) * qk_scale  # base-2 scores
        b_do = do_desc.load([i_b, i_hq, start_m, 0]).reshape(BLOCK_M, BLOCK_DV)  # [BLOCK_M, BLOCK_DV]
        # dP^T = V dO^T, [BLOCK_N, BLOCK_M], does not need P, so it goes to the tensor cores before the
        # exponentials: the compiled loop runs some of them while this product is in flight, and the
        # dV and dK products below then issue back to back
        # (docs/kernels/tuning-log.md#dp-first-in-the-backward-loops-commit-7752eb1)
        if PART != 1:
            dp_t = tl.dot(b_v, tl.trans(b_do))
        p_t = tl.exp2(s_t - b_lse2[None, :])  # P = exp(s - lse): the forward's softmax, recomputed
        if MASKED:
            # Rows past N are zeroed explicitly. In one dense problem that is defensive: their Q and dO
            # load as zeros (descriptor zero-fill) and their lse2 and delta as 0 (other=0.0), so P stays
            # finite and dS is 0. In packed sequences it is needed: the descriptor spans the pack, so
            # those rows are the next sequence's queries, whose P would reach dK and dV.
            p_t = tl.where(tile_mask(rows[None, :], offs_n[:, None], N_CTX_Q, N_CTX_K, win_left, win_right,
                                     CAUSAL, HAS_WINDOW), p_t, 0.0)
        # --8<-- [end:bwd-recompute-p]
        # --8<-- [start:bwd-dropout]
        if DROPOUT:
            # The forward's mask, drawn again from the seed (same (i, j), transposed tile): dV takes
            # the dropped P (its 1 / (1 - p) joins once, at the end), and dS = P * (Z * dP / (1 - p) - delta)
            # with delta = rowsum(dO * O) as without dropout.
            keep_t = tl.trans(dropout_keep(seed_lo, seed_hi, i_bh, rows, first_key, drop_threshold, BLOCK_N))
            if PART != 2:
                b_dv += tl.dot(tl.where(keep_t, p_t, 0.0).to(b_do.dtype), b_do)
            if PART != 1:
                ds_t = p_t * (tl.where(keep_t, dp_t * inv_keep, 0.0) - b_delta[None, :])
        # --8<-- [end:bwd-dropout]
        else:
            if PART != 2:
                # --8<-- [start:bwd-dv-accumulate]
                b_dv += tl.dot(p_t.to(b_do.dtype), b_do)  # dV += P^T dO, [BLOCK_N, BLOCK_DV]
                # --8<-- [end:bwd-dv-accumulate]
            if PART != 1:
                # --8<-- [start:bwd-ds]
                ds_t = p_t * (dp_t - b_delta[None, :])  # dS = P * (dP - delta), the softmax backward
                # --8<-- [end:bwd-ds]
        if PART != 1:
            # --8<-- [start:softcap-grad]
            if SOFTCAP:
                # dS above is the gradient of the capped score cap * tanh(s / cap); the chain rule through
                # tanh multiplies by 1 - tanh^2, with tanh recomputed above rather than stored.
                ds_t = ds_t * (1.0 - t_t * t_t)
            # --8<-- [end:softcap-grad]
            # --8<-- [start:bwd-dk-accumulate]
            b_dk += tl.dot(ds_t.to(b_q.dtype), b_q)  # dK += dS^T Q (scale applied once, at the end)
            # --8<-- [end:bwd-dk-accumulate]
        p_lse2 += BLOCK_M
        p_delta += BLOCK_M
    return b_dk, b_dv
# --8<-- [end:bwd-dkdv-inner]


# --8<-- [start:bwd-dkdv-kernel]
@triton.jit(do_not_specialize=["seed_lo", "seed_hi"])
def _bwd_dkdv_kernel(
    q_desc, k_desc, v_desc, do_desc, LSE2, DELTA, DK, DV,  #
    stride_dkb, stride_dkh, stride_dkn,  #
    stride_dvb, stride_dvh, stride_dvn,  #
    H_Q, H_KV, GROUP, N_CTX_Q, N_CTX_K, qk_scale, scale, N_BLOCKS, HEADS_PER_GROUP,  #
    CU_SEQLENS_Q, CU_SEQLENS_K, TILE_OFFSETS, N_SEQS,  #
    win_left, win_right, cap_in, cap_out, SLOPES, stride_slope_b, seed_lo, seed_hi, drop_threshold, inv_keep,  #
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,  #
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,  #
    HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
    VARLEN: tl.constexpr, PART: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    # key block, batch * key/value head; causal: the first key block is seen by the most rows
    i_n, i_bh = program_tile(N_BLOCKS, HEADS_PER_GROUP, False)
    i_b = i_bh // H_KV
    i_hkv = i_bh % H_KV

    start_n = i_n * BLOCK_N
    k_row = start_n  # the tile's first row in k, v, dk and dv
    lse_rows = N_CTX_Q  # rows per head of lse2 and delta
    i_seq = i_b  # whose ALiBi slopes and dropout draws: the batch entry, or the packed sequence
    # --8<-- [start:bwd-dkdv-varlen-prologue]
    if VARLEN:
        # Packed sequences: i_n is a tile of this head's packed key rows (the forward's mapping with
        # the sides swapped); N_CTX_Q and N_CTX_K become the sequence's lengths, start_n local to it.
        i_seq, start_n, k_start, q_start, N_CTX_K, N_CTX_Q = packed_tile(
            i_n, BLOCK_N, TILE_OFFSETS, CU_SEQLENS_K, CU_SEQLENS_Q, N_SEQS)
        if start_n >= N_CTX_K:
            return  # a spare program: every tile is taken
        k_row = k_start + start_n
    # --8<-- [end:bwd-dkdv-varlen-prologue]
    offs_n = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_m = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    offs_dv = tl.arange(0, BLOCK_DV)  # [BLOCK_DV]: v's columns (D_v = D unless the head dims are split)
    mask_n = offs_n < N_CTX_K
    mask_d = offs_d < HEAD_DIM
    mask_dv = offs_dv < HEAD_DIM_V

    # --8<-- [start:bwd-dkdv-parts]
    # PART: 0 computes dK and dV in one launch. At D = 256 the two float32 accumulators of a 64-row
    # key block take 128 registers a thread across two warpgroups, and 64 rows are one warpgroup's
    # product height: Triton gives a product that feeds another product all its warps along the rows
    # (flash attention's usual layout), so both warpgroups then compute the same S^T and dP^T. Two
    # launches, PART 1 for dV alone and PART 2 for dK alone, hold one accumulator each, which leaves
    # room for 128 key rows: no product is computed twice within a program, at the price of S^T
    # recomputed in the second launch (docs/kernels/tuning-log.md#dv-and-dk-in-two-launches-issue-15).
    b_k = k_desc.load([i_b, i_hkv, k_row, 0]).reshape(BLOCK_N, BLOCK_D)  # [BLOCK_N, BLOCK_D]
    b_v = b_k  # never read by PART 1, which needs no dP
    if PART != 1:
        b_v = v_desc.load([i_b, i_hkv, k_row, 0]).reshape(BLOCK_N, BLOCK_DV)  # [BLOCK_N, BLOCK_DV]
    # --8<-- [end:bwd-dkdv-parts]
    b_dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    b_dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)

    # The mirror of the forward schedule: query blocks in [lo, full_start) straddle the diagonal,
    # [full_start, full_end) see the whole key block, [full_end, hi) is the ragged last query block
    # (hi = N) or, under a window, the blocks that cross its left edge; a ragged key block masks
    # every tile (its padded keys must stay out of dS). Rows below lo see none of the block.
    # ONE_LOOP: from D = 128 up (BLOCK_D, the head dim padded: any D > 64), a causal mask without a
    # window or dropout walks [lo, hi) in one masked loop instead. The mask costs a few compares per
    # score, while three loops keep more values live, spill more and refill the pipeline between them,
    # which costs more than the mask from D = 128 up; at D = 64 and with dropout's draws in the loop the
    # three loops are the faster (docs/kernels/tuning-log.md#one-causal-loop-in-dkdv-issue-15).
    ONE_LOOP: tl.constexpr = CAUSAL and not HAS_WINDOW and not DROPOUT and BLOCK_D >= 128
    if HAS_WINDOW:
        lo, full_start, full_end, hi = window_query_range(start_n, BLOCK_M, BLOCK_N, N_CTX_Q, N_CTX_K,
                                                          win_left, win_right)
    else:
        lo, full_start, full_end = backward_query_range(start_n, BLOCK_M, BLOCK_N, N_CTX_Q, N_CTX_K, CAUSAL)
        hi = N_CTX_Q
    if VARLEN:
        # The loops walk q's packed rows from the sequence's first query (and lse2, delta with them);
        # offs_m shifted back by as much keeps each row index (start_m + offs_m) local for the masks.
        lo, full_start, full_end, hi = lo + q_start, full_start + q_start, full_end + q_start, hi + q_start
        offs_m -= q_start
        # lse2 and delta are indexed by packed row, as start_m now is: cancel the shift of offs_m there
        LSE2 += q_start
        DELTA += q_start

    for g in range(0, GROUP):  # the query heads that share this K/V head: summed here, no atomics
        i_hq = i_hkv * GROUP + g
        row0 = (i_b.to(tl.int64) * H_Q + i_hq) * lse_rows  # lse2 and delta: fresh contiguous (B, Hq, N) or (Hq, total_q)
        p_lse2 = LSE2 + row0 + offs_m
        p_delta = DELTA + row0 + offs_m
        i_bhq = i_seq * H_Q + i_hq  # the dropout mask's head counter (the forward's i_drop)
        slope2 = 0.0
        if ALIBI:
            slope2 = tl.load(SLOPES + i_seq * stride_slope_b + i_hq) * LOG2E
        b_dk, b_dv = _bwd_dkdv_inner(b_dk, b_dv, b_k, b_v, q_desc, do_desc, i_b, i_hq, p_lse2, p_delta,
                                     offs_m, offs_n, start_n, lo, hi if ONE_LOOP else full_start, N_CTX_Q, N_CTX_K,
                                     qk_scale, win_left, win_right, cap_in, cap_out, slope2, seed_lo, seed_hi, i_bhq,
                                     drop_threshold, inv_keep,
                                     True, CAUSAL, BLOCK_M, BLOCK_N, BLOCK_D, HAS_WINDOW, SOFTCAP, ALIBI, DROPOUT,
                                     PART, BLOCK_DV)
        if not ONE_LOOP:
            b_dk, b_dv = _bwd_dkdv_inner(b_dk, b_dv, b_k, b_v, q_desc, do_desc, i_b, i_hq, p_lse2, p_delta,
                                         offs_m, offs_n, start_n, full_start, full_end, N_CTX_Q, N_CTX_K, qk_scale,
                                         win_left, win_right, cap_in, cap_out, slope2, seed_lo, seed_hi, i_bhq,
                                         drop_threshold, inv_keep,
                                         False, CAUSAL, BLOCK_M, BLOCK_N, BLOCK_D, HAS_WINDOW, SOFTCAP, ALIBI, DROPOUT,
                                         PART, BLOCK_DV)
            b_dk, b_dv = _bwd_dkdv_inner(b_dk, b_dv, b_k, b_v, q_desc, do_desc, i_b, i_hq, p_lse2, p_delta,
                                         offs_m, offs_n, start_n, full_end, hi, N_CTX_Q, N_CTX_K, qk_scale,
                                         win_left, win_right, cap_in, cap_out, slope2, seed_lo, seed_hi, i_bhq,
                                         drop_threshold, inv_keep,
                                         True, CAUSAL, BLOCK_M, BLOCK_N, BLOCK_D, HAS_WINDOW, SOFTCAP, ALIBI, DROPOUT,
                                         PART, BLOCK_DV)

    b_dk *= scale  # S = scale * Q K^T, so dK = scale * dS^T Q
    if DROPOUT:
        b_dv *= inv_keep  # dV = (Z * P / (1 - p))^T dO: the kept entries' scale, applied once
    rows = tl.arange(0, BLOCK_N)[:, None]  # 64-bit bases, 32-bit offsets inside the tile
    p_dk = DK + i_b.to(tl.int64) * stride_dkb + i_hkv.to(tl.int64) * stride_dkh + k_row.to(tl.int64) * stride_dkn \
        + rows * stride_dkn + offs_d[None, :]
    p_dv = DV + i_b.to(tl.int64) * stride_dvb + i_hkv.to(tl.int64) * stride_dvh + k_row.to(tl.int64) * stride_dvn \
        + rows * stride_dvn + offs_dv[None, :]
    if PART != 1:  # mask_n: keys of this sequence only
        tl.store(p_dk, b_dk.to(DK.dtype.element_ty), mask=mask_n[:, None] & mask_d[None, :])
    if PART != 2:
        tl.store(p_dv, b_dv.to(DV.dtype.element_ty), mask=mask_n[:, None] & mask_dv[None, :])
# --8<-- [end:bwd-dkdv-kernel]


# --8<-- [start:bwd-dq-inner]
@triton.jit
def _bwd_dq_inner(
    b_dq, b_q, b_do, b_lse2, b_delta, k_desc, v_desc, i_b, i_hkv,  #
    offs_m, offs_n, key0, lo, hi, N_CTX_Q, N_CTX_K, qk_scale,  #
    win_left, win_right, cap_in, cap_out, slope2, seed_lo, seed_hi, i_bh, drop_threshold, inv_keep,  #
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,  #
    HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """Add the contributions of the key blocks starting in [lo, hi) to this query block's dQ
    (``key0`` and ``i_bh`` as in the forward's loop: the sequence's first row of k, the mask's counter)."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n  # [BLOCK_N]
        b_k = k_desc.load([i_b, i_hkv, start_n, 0]).reshape(BLOCK_N, BLOCK_D)  # [BLOCK_N, BLOCK_D]
        b_v = v_desc.load([i_b, i_hkv, start_n, 0]).reshape(BLOCK_N, BLOCK_DV)  # [BLOCK_N, BLOCK_DV]
        if SOFTCAP or ALIBI:
            s, t = score_mods(tl.dot(b_q, tl.trans(b_k)), offs_m[:, None], cols[None, :], N_CTX_Q, N_CTX_K,
                              qk_scale, cap_in, cap_out, slope2, SOFTCAP, ALIBI)
        else:
            s = tl.dot(b_q, tl.trans(b_k)) * qk_scale  # [BLOCK_M, BLOCK_N], base 2
        dp = tl.dot(b_do, tl.trans(b_v))  # dP = dO V^T, [BLOCK_M, BLOCK_N], before the exponentials too
        p = tl.exp2(s - b_lse2[:, None])
        if MASKED:
            p = tl.where(tile_mask(offs_m[:, None], cols[None, :], N_CTX_Q, N_CTX_K, win_left, win_right,
                                   CAUSAL, HAS_WINDOW), p, 0.0)
        if DROPOUT:
            keep = dropout_keep(seed_lo, seed_hi, i_bh, offs_m, start_n - key0, drop_threshold, BLOCK_N)
            ds = p * (tl.where(keep, dp * inv_keep, 0.0) - b_delta[:, None])  # dS = P * (Z dP / (1 - p) - delta)
        else:
            ds = p * (dp - b_delta[:, None])  # dS = P * (dP - delta)
        if SOFTCAP:
            ds = ds * (1.0 - t * t)  # through the softcap's tanh (softcap-grad)
        # --8<-- [start:bwd-dq-accumulate]
        b_dq += tl.dot(ds.to(b_k.dtype), b_k)  # dQ += dS K (scale applied once, at the end)
        # --8<-- [end:bwd-dq-accumulate]
    return b_dq
# --8<-- [end:bwd-dq-inner]


# --8<-- [start:bwd-dq-kernel]
@triton.jit(do_not_specialize=["seed_lo", "seed_hi"])
def _bwd_dq_kernel(
    q_desc, k_desc, v_desc, do_desc, LSE2, DELTA, DQ,  #
    stride_dqb, stride_dqh, stride_dqn,  #
    O, LSE, DLSE, stride_ob, stride_oh, stride_on,  # read only with ROW_STATS
    H_Q, GROUP, N_CTX_Q, N_CTX_K, qk_scale, scale, N_BLOCKS, HEADS_PER_GROUP,  #
    CU_SEQLENS_Q, CU_SEQLENS_K, TILE_OFFSETS, N_SEQS,  #
    win_left, win_right, cap_in, cap_out, SLOPES, stride_slope_b, seed_lo, seed_hi, drop_threshold, inv_keep,  #
    SINKS, SINK_PARTS,  # read and written only with HAS_SINKS
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,  #
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,  #
    HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
    VARLEN: tl.constexpr, ROW_STATS: tl.constexpr, HAS_DLSE: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    # query block, batch * query head; causal: the longest key walks first, as in the forward
    i_m, i_bh = program_tile(N_BLOCKS, HEADS_PER_GROUP, CAUSAL)
    i_b = i_bh // H_Q
    i_hq = i_bh % H_Q
    i_hkv = i_hq // GROUP

    start_m = i_m * BLOCK_M
    q_row = start_m  # the tile's first row in q, dO and dq
    row0 = i_bh.to(tl.int64) * N_CTX_Q  # of lse2 and delta, fresh contiguous (B, Hq, N)
    i_seq = i_b  # whose ALiBi slopes and dropout draws: the batch entry, or the packed sequence
    k_start = 0  # the row of k that holds the sequence's key 0
    if VARLEN:
        # Packed sequences: the forward's mapping (its prologue says more)
        row0 = i_hq.to(tl.int64) * N_CTX_Q  # lse2 and delta are (Hq, total_q); N_CTX_Q arrives as total_q
        i_seq, start_m, q_start, k_start, N_CTX_Q, N_CTX_K = packed_tile(
            i_m, BLOCK_M, TILE_OFFSETS, CU_SEQLENS_Q, CU_SEQLENS_K, N_SEQS)
        if start_m >= N_CTX_Q:
            return  # a spare program: every tile is taken
        q_row = q_start + start_m
        row0 += q_start
    offs_m = start_m + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    offs_dv = tl.arange(0, BLOCK_DV)  # [BLOCK_DV]: dO's and o's columns
    mask_m = offs_m < N_CTX_Q
    mask_d = offs_d < HEAD_DIM

    b_q = q_desc.load([i_b, i_hq, q_row, 0]).reshape(BLOCK_M, BLOCK_D)  # [BLOCK_M, BLOCK_D]
    b_do = do_desc.load([i_b, i_hq, q_row, 0]).reshape(BLOCK_M, BLOCK_DV)  # [BLOCK_M, BLOCK_DV]
    if ROW_STATS:
        # The preprocess kernel's work for this block's rows, here where dO is loaded anyway: where dQ
        # runs first, on the current stream, the backward saves that launch (launch_backward), and
        # dK/dV then reads what this stores. O's padded rows and columns load as 0, so their delta is 0.
        p_o = O + i_b.to(tl.int64) * stride_ob + i_hq.to(tl.int64) * stride_oh + q_row.to(tl.int64) * stride_on \
            + tl.arange(0, BLOCK_M)[:, None] * stride_on + offs_dv[None, :]
        b_o = tl.load(p_o, mask=mask_m[:, None] & (offs_dv < HEAD_DIM_V)[None, :], other=0.0).to(tl.float32)
        b_lse2, b_delta = _row_stats(b_o, b_do.to(tl.float32), LSE + row0 + offs_m, DLSE + row0 + offs_m, mask_m,
                                     HAS_DLSE)
        tl.store(LSE2 + row0 + offs_m, b_lse2, mask=mask_m)
        tl.store(DELTA + row0 + offs_m, b_delta, mask=mask_m)
    else:
        b_lse2, b_delta = _load_row_stats(LSE2 + row0 + offs_m, DELTA + row0 + offs_m, mask_m, True)
    # --8<-- [start:bwd-sinks]
    if HAS_SINKS:
        # The sink's gradient, dL/ds_h = -sum_i exp(s_h - lse_i) * delta_i (docs/math/sinks.md), needs
        # only these row statistics: this block's share goes to its own slot, and one reduction over
        # the slots finishes it (launch_backward), in a fixed order. Rows past the sequence add 0; a
        # row with no key and a sink of -inf has lse2 = 0 here and adds exp2(-inf) * delta = 0.
        sink2 = tl.load(SINKS + i_hq).to(tl.float32) * LOG2E
        p_sink = tl.where(mask_m, tl.exp2(sink2 - b_lse2), 0.0)
        tl.store(SINK_PARTS + i_bh.to(tl.int64) * N_BLOCKS + i_m, -tl.sum(p_sink * b_delta, 0))
    # --8<-- [end:bwd-sinks]
    b_dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    slope2 = 0.0
    if ALIBI:
        slope2 = tl.load(SLOPES + i_seq * stride_slope_b + i_hq) * LOG2E
    i_drop = i_seq * H_Q + i_hq  # the forward's dropout counter

    if HAS_WINDOW:
        # The forward's window walk; a ragged last query block masks every tile.
        lo, full_start, full_end, hi = window_dq_key_range(start_m, BLOCK_M, BLOCK_N, N_CTX_Q, N_CTX_K,
                                                           win_left, win_right)
    else:
        # The forward's key walk; a ragged last query block masks every tile (the schedule's dq_key_range).
        full_end, hi = dq_key_range(start_m, BLOCK_M, BLOCK_N, N_CTX_Q, N_CTX_K, CAUSAL)
        lo = 0
        full_start = 0
    if VARLEN:  # k's packed rows from the sequence's first key, key indices local (as in the forward)
        lo, full_start, full_end, hi = lo + k_start, full_start + k_start, full_end + k_start, hi + k_start
        offs_n -= k_start

    if HAS_WINDOW:
        b_dq = _bwd_dq_inner(b_dq, b_q, b_do, b_lse2, b_delta, k_desc, v_desc, i_b, i_hkv, offs_m, offs_n, k_start,
                             lo, full_start, N_CTX_Q, N_CTX_K, qk_scale,
                             win_left, win_right, cap_in, cap_out, slope2, seed_lo, seed_hi, i_drop,
                             drop_threshold, inv_keep,
                             True, CAUSAL, BLOCK_N, BLOCK_D, HAS_WINDOW, SOFTCAP, ALIBI, DROPOUT, BLOCK_DV)
    b_dq = _bwd_dq_inner(b_dq, b_q, b_do, b_lse2, b_delta, k_desc, v_desc, i_b, i_hkv, offs_m, offs_n, k_start,
                         full_start, full_end, N_CTX_Q, N_CTX_K, qk_scale,
                         win_left, win_right, cap_in, cap_out, slope2, seed_lo, seed_hi, i_drop,
                         drop_threshold, inv_keep,
                         False, CAUSAL, BLOCK_N, BLOCK_D, HAS_WINDOW, SOFTCAP, ALIBI, DROPOUT, BLOCK_DV)
    b_dq = _bwd_dq_inner(b_dq, b_q, b_do, b_lse2, b_delta, k_desc, v_desc, i_b, i_hkv, offs_m, offs_n, k_start,
                         full_end, hi, N_CTX_Q, N_CTX_K, qk_scale,
                         win_left, win_right, cap_in, cap_out, slope2, seed_lo, seed_hi, i_drop,
                         drop_threshold, inv_keep,
                         True, CAUSAL, BLOCK_N, BLOCK_D, HAS_WINDOW, SOFTCAP, ALIBI, DROPOUT, BLOCK_DV)

    b_dq *= scale  # S = scale * Q K^T, so dQ = scale * dS K
    p_dq = DQ + i_b.to(tl.int64) * stride_dqb + i_hq.to(tl.int64) * stride_dqh + q_row.to(tl.int64) * stride_dqn \
        + tl.arange(0, BLOCK_M)[:, None] * stride_dqn + offs_d[None, :]
    tl.store(p_dq, b_dq.to(DQ.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])  # this sequence's rows
# --8<-- [end:bwd-dq-kernel]


_SIDE_STREAMS: dict = {}
OVERLAP_MIN_WORK = 2**34  # B * Hq * N * M * D below which dQ runs after dK/dV on one stream


def worth_a_second_stream(problem: Problem) -> bool:
    """Whether running dQ beside dK/dV can gain anything: only when the kernels take long enough
    (about 0.5 ms of backward at 2^34) for a ragged last wave to matter. A shorter call is bound by
    the host, and the two stream switches cost it more than the overlap gives back."""
    p = problem
    rows, keys = (p.total_q, p.m) if p.varlen else (p.batch * p.n, p.m)  # varlen: m is the longest sequence's
    return rows * p.heads_q * keys * p.head_dim >= OVERLAP_MIN_WORK


def _second_stream(q: torch.Tensor, problem: Problem) -> torch.cuda.Stream | None:
    """The stream that runs dQ beside dK/dV on q's device, or None where dQ follows dK/dV on the
    current stream (small problems, a CPU tensor, a tuning with the overlap off)."""
    if not (_config.current_tuning().overlap_dq and q.is_cuda and worth_a_second_stream(problem)):
        return None
    if q.device not in _SIDE_STREAMS:
        _SIDE_STREAMS[q.device] = torch.cuda.Stream(q.device)
    return _SIDE_STREAMS[q.device]


def atomic_dq(problem: Problem, device: torch.device) -> bool:
    """Whether the backward of ``problem`` sums dQ with TMA reductions inside the Hopper dK/dV kernel,
    skipping the dQ kernel: only where ``deterministic=False`` permits it, a :func:`flashattn._config.tuning`
    turns it on (it measured slower than the deterministic pair, so nothing else does) and that kernel
    runs (plain dense problems past the Gluon bar on sm_90) at D = 128. Its dQ's last bits vary from
    run to run."""
    return (not problem.deterministic and _config.current_tuning().atomic_dq
            and problem.head_dim in hopper.bwd.ATOMIC_DQ_HEAD_DIMS
            and _config.gluon_kernel("bwd_dkdv", problem, device) and hopper.bwd.atomic_available())


def backward_key(do, q, k, v, o, lse, problem: Problem, dlse, alibi_slopes, side) -> tuple | None:
    """The key of a :func:`launch_backward` call (None: never replayed). A repeated call replays the
    first one's launches with its own tensors (as in the forward, :func:`flashattn.forward.forward_key`),
    the stream switches of dQ's second stream ``side`` (large problems only) included."""
    if problem.varlen or type(q) is not torch.Tensor:  # a subclass: the full path
        return None
    return (problem, q.device, q.stride(), k.stride(), v.stride(), do.stride(), o.stride(), lse.stride(),
            dlse is not None and dlse.stride(), alibi_slopes is not None and alibi_slopes.dim(),
            (k is q, v is q, v is k), side is not None)


def replay_backward(do, q, k, v, o, lse, problem: Problem, dlse=None, alibi_slopes=None, seed: int = 0):
    """``(dq, dk, dv)`` of :func:`launch_backward` (no sinks) from the recipe an earlier call with this key
    left, or None where there is none: the caller made q's device the current one and runs the dense kernels."""
    key = backward_key(do, q, k, v, o, lse, problem, dlse, alibi_slopes, _second_stream(q, problem))
    replayed = replay(key, (do, q, k, v, o, lse, dlse, alibi_slopes, None), seed_halves(problem, seed))
    return None if replayed is None else replayed[:3]


# --8<-- [start:bwd-launch]
def launch_backward(do, q, k, v, o, lse, problem: Problem, dlse=None, alibi_slopes=None, seed: int = 0,
                    packing=None, sinks=None):
    """Run the backward kernels on ``q``'s device (the preprocess, dK/dV and dQ; dQ with the preprocess's
    row statistics and first, where it runs on the current stream). Returns ``(dq, dk, dv)`` shaped like q, k, v.

    ``o`` and ``lse`` are the forward's outputs; ``dlse`` (B, Hq, N), when given, is the gradient that
    reached the LSE output. dK and dV of a K/V head sum over its query heads. ``alibi_slopes`` and
    ``seed`` are the forward's (the dropout mask is drawn again from the seed, never stored). Packed
    sequences (``problem.varlen``) take the packed layouts and ``packing`` of
    :func:`flashattn.forward.launch_forward`, with lse and dlse (Hq, total_q). With ``sinks`` (Hq,) (the
    forward's, ``problem.sinks``) the sinks' gradient comes back too, ``(dq, dk, dv, dsinks)``, summed by
    the dQ kernel from its row statistics; dsinks is None where no kernel ran (a pack with no query or key).
    """
    if interpreter_needs_float32(q):
        grads = launch_backward(do.float(), q.float(), k.float(), v.float(), o.float(), lse, problem, dlse,
                                alibi_slopes, seed, packing, sinks)
        return (*(g.to(q.dtype) for g in grads[:3]), *grads[3:])
    p = problem
    atomic = atomic_dq(p, q.device)
    side = None if atomic else _second_stream(q, p)
    key = backward_key(do, q, k, v, o, lse, p, dlse, alibi_slopes, side)
    inputs, free = (do, q, k, v, o, lse, dlse, alibi_slopes, sinks), seed_halves(p, seed)
    replayed = replay(key, inputs, free)
    if replayed is not None:
        return replayed[:3] if sinks is None else (*replayed[:3], _sinks_grad(replayed[5], p, sinks))
    # dK/dV and dQ by the Hopper kernels in Gluon (large plain problems on sm_90, _config.gluon_kernel)
    gluon_dkdv = not p.varlen and _config.gluon_kernel("bwd_dkdv", p, q.device) and hopper.bwd.available()
    gluon_dq = not atomic and not p.varlen and _config.gluon_kernel("bwd_dq", p, q.device) and hopper.bwd.dq_available()
    record = recording(key)
    if p.varlen:
        dq, dk, dv = _grad_like(q), _grad_like(k), _grad_like(v)
        if p.total_q == 0 or p.total_k == 0:  # no query sees a key: every gradient is zero
            if compiling():  # nothing to compile, and dq, dk, dv may be q, k, v themselves: write nothing
                return (dq, dk, dv, *(() if sinks is None else (None,)))
            return (dq.zero_(), dk.zero_(), dv.zero_(), *(() if sinks is None else (None,)))
        # (total, H, D) viewed as (1, H, total, D); the row-wise preprocess sees one sequence of total_q rows
        do, q, k, v, o, dq_view, dk_view, dv_view = (heads_first(x) for x in (do, q, k, v, o, dq, dk, dv))
        cu_q, cu_k = packing
        n_q, n_k, batch = p.total_q, p.total_k, 1
    else:
        n_q, n_k, batch = p.n, p.m, p.batch
    do, q, k, v = (addressable(x) for x in (do, q, k, v))
    if o.stride(-1) != 1:
        o = o.contiguous()  # read with plain loads by the preprocess kernel: any row stride works
    lse = lse.contiguous()
    if not p.varlen:
        dq, dk, dv = dq_view, dk_view, dv_view = _grad_like(q), _grad_like(k), _grad_like(v)
    delta = torch.empty((batch, p.heads_q, n_q), dtype=torch.float32, device=q.device)
    lse2 = torch.empty_like(delta)
    if not p.varlen:
        cu_q = cu_k = delta  # never read: VARLEN is off
    has_dlse = dlse is not None
    dlse = dlse.contiguous() if has_dlse else lse  # (never read without HAS_DLSE)
    # Where dQ runs on the current stream in the portable kernel, it runs first and computes delta and
    # lse2 for its own rows, which dK/dV then reads: one launch fewer, which a short call feels. Beside
    # dK/dV on a second stream, or in Gluon, the preprocess kernel computes them first.
    row_stats = side is None and not gluon_dq and not atomic and _config.current_tuning().row_stats_in_dq
    if not row_stats:
        block = 32 if _config.is_interpreter() else PREPROCESS_BLOCK
        n_rows = ceil_div(n_q, block)
        launch(_bwd_preprocess_kernel, n_rows * batch * p.heads_q,
               (o, do, lse, dlse, lse2, delta,
                o.stride(0), o.stride(1), o.stride(2), do.stride(0), do.stride(1), do.stride(2),
                p.heads_q, n_q, n_rows),
               dict(HAS_DLSE=has_dlse, HEAD_DIM=p.dv, BLOCK_D=p.block_dv, BLOCK_M=block), {}, record)

    desc = Descriptors(p.block_d)  # shared by the two kernels where their tiles agree
    sink_parts = [delta]  # the dQ launch's per-block shares of the sinks' gradient (HAS_SINKS), once it ran

    # dQ summed by the dK/dV kernel (never in a call that only compiles, or one that records: both run
    # under the default tuning, where atomic_dq is off)
    dq_accum = q.new_zeros(q.shape, dtype=torch.float32) if atomic else None

    def run_dkdv(plan: _config.Plan | None, record=None):
        if plan is None:  # the Hopper kernel in Gluon, whose tiles are its own
            hopper.bwd.dkdv(q, k, v, do, lse2, delta, dk_view, dv_view, p.causal, p.scale, record=record,
                            dq_accum=dq_accum)
            return
        cfg = plan.config
        offsets = tile_offsets(cu_k, cfg.block_n) if p.varlen else delta
        args = (desc(q, cfg.block_m), desc(k, cfg.block_n), desc(v, cfg.block_n, p.block_dv), desc(do, cfg.block_m, p.block_dv),
                lse2, delta, dk_view, dv_view,
                dk_view.stride(0), dk_view.stride(1), dk_view.stride(2),
                dv_view.stride(0), dv_view.stride(1), dv_view.stride(2),
                p.heads_q, p.heads_kv, p.group, n_q, n_k, p.qk_scale, p.scale, plan.n_blocks, plan.heads_per_group,
                cu_q, cu_k, offsets, p.batch, *variant_abi(p, alibi_slopes, seed, delta)[1])
        for constexprs in plan.passes:  # one launch, or dV's then dK's (KernelConfig.split)
            launch(_bwd_dkdv_kernel, plan.grid, args, constexprs, plan.options, record)

    def run_dq(plan: _config.Plan | None, record=None):
        if plan is None:  # the Hopper kernel in Gluon
            hopper.bwd.dq(q, k, v, do, lse2, delta, dq_view, p.causal, p.scale, record=record)
            return
        cfg = plan.config
        offsets = tile_offsets(cu_q, cfg.block_m) if p.varlen else delta
        if sinks is not None:  # one slot per program; a packed call's spare programs leave theirs at 0
            sink_parts[0] = torch.zeros(batch * p.heads_q * plan.n_blocks, dtype=torch.float32, device=q.device)
        args = (desc(q, cfg.block_m), desc(k, cfg.block_n), desc(v, cfg.block_n, p.block_dv), desc(do, cfg.block_m, p.block_dv),
                lse2, delta, dq_view, dq_view.stride(0), dq_view.stride(1), dq_view.stride(2),
                o, lse, dlse, o.stride(0), o.stride(1), o.stride(2),
                p.heads_q, p.group, n_q, n_k, p.qk_scale, p.scale, plan.n_blocks, plan.heads_per_group,
                cu_q, cu_k, offsets, p.batch, *variant_abi(p, alibi_slopes, seed, delta)[1],
                delta if sinks is None else sinks, sink_parts[0])
        constexprs = {**plan.constexprs, "ROW_STATS": row_stats, "HAS_DLSE": row_stats and has_dlse,
                      "HAS_SINKS": sinks is not None}
        launch(_bwd_dq_kernel, plan.grid, args, constexprs, plan.options, record)

    if atomic:  # dK, dV and the dQ sums in one kernel
        run_dkdv(None)
        dq.copy_(dq_accum.mul_(p.scale))
        return dq, dk, dv  # (no sinks: the Gluon kernels never take them)
    device = q.device
    if p.varlen:  # the fixed table entries, as in the forward
        plan_dkdv = _config.plan_for("bwd_dkdv", p, device, _config.get_config("bwd_dkdv", p, device))
        plan_dq = _config.plan_for("bwd_dq", p, device, _config.get_config("bwd_dq", p, device))
    else:
        # autotuning (opt-in) times candidate configs through the same launches; dQ's first, since
        # with row_stats its launches write the delta and lse2 that dK/dV's read
        plan_dq = None if gluon_dq else _config.plan(
            "bwd_dq", p, device, lambda c: run_dq(_config.plan_for("bwd_dq", p, device, c)))
        plan_dkdv = None if gluon_dkdv else _config.plan(
            "bwd_dkdv", p, device, lambda c: run_dkdv(_config.plan_for("bwd_dkdv", p, device, c)))
    if side is not None:
        # The two kernels read the same inputs and write disjoint outputs, so they may run side by
        # side: on a second stream the dQ programs fill the SMs that the last wave of dK/dV leaves
        # idle. The current stream waits for the side stream before anything after this call runs,
        # so every tensor used here stays alive and unchanged until both kernels are done.
        fork(side, record)  # delta is written
        run_dkdv(plan_dkdv, record)
        with on_stream(side, record):
            run_dq(plan_dq, record)
        join(side, record)
    else:
        # dQ first: with row_stats it writes the delta and lse2 that dK/dV reads
        run_dq(plan_dq, record)
        run_dkdv(plan_dkdv, record)
    if record is not None:  # q, k, v may be one tensor, as in the key
        record.keep(inputs, (dq, dk, dv, delta, lse2, *(() if sinks is None else sink_parts)), free, shared=(1, 2, 3))
    return (dq, dk, dv) if sinks is None else (dq, dk, dv, _sinks_grad(sink_parts[0], p, sinks))
# --8<-- [end:bwd-launch]


def _laid_out_like_its_gradient(x: torch.Tensor) -> bool:
    """Whether :func:`dense_like` would lay a new tensor out exactly as ``x`` is (asked of a meta tensor,
    which allocates nothing)."""
    return dense_like(torch.empty_like(x, device="meta")).stride() == x.stride()


def _grad_like(x: torch.Tensor) -> torch.Tensor:
    """A gradient for ``x``: :func:`dense_like` of it. In a call that only compiles
    (:func:`flashattn.launch.compiling`), which writes nothing, ``x`` itself where it is laid out the same
    way: the compiled kernels are the same, and a large problem's first forward allocates nothing for them."""
    if compiling() and _laid_out_like_its_gradient(x):
        return x
    return dense_like(x)


def compile_ahead(q, k, v, problem: Problem, alibi_slopes=None, packing=None, sinks=None):
    """Start compiling the kernels of the backward of this call on background threads
    (:func:`flashattn.launch.in_background`), for a first forward whose backward will follow: the
    forward's own kernels compile meanwhile, and the backward finds its kernels compiled. The call
    runs :func:`launch_backward` on stand-ins for o and dO (q itself where o would be laid out as q is,
    as autograd usually passes dO) and lse (allocated, small), with q, k and v standing in for their own
    gradients (:func:`_grad_like`): nothing is written. A backward whose dO is laid out otherwise compiles
    its own kernels. Returns the future of the compiles, or None where none started."""
    same = problem.dv == problem.head_dim and _laid_out_like_its_gradient(q)
    o = q if same else output_like(q, problem.dv)
    lse_shape = (problem.heads_q, problem.total_q) if problem.varlen else (problem.batch, problem.heads_q, problem.n)
    lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    return in_background(q.device, lambda: launch_backward(o, q, k, v, o, lse, problem, None, alibi_slopes, 0,
                                                           packing, sinks))


def _sinks_grad(parts: torch.Tensor, problem: Problem, sinks: torch.Tensor) -> torch.Tensor:
    """The sinks' gradient (Hq,) from the dQ kernel's per-program shares, laid out (B, Hq, blocks)
    (one batch entry for packed sequences)."""
    return parts.view(1 if problem.varlen else problem.batch, problem.heads_q, -1).sum((0, 2)).to(sinks.dtype)
