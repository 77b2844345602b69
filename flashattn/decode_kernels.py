"""Split-KV decoding kernels in Triton (flash-decoding), behind :func:`flashattn.decode.attention_with_kvcache`.

Decoding has few queries (one per sequence, or a short chunk) and many keys. The forward kernel's
grid, one program per (block of 128 query rows, batch * head), would launch B * Hq programs that each
fill one row of a 128-row tile and walk every key alone. Here instead:

* **GQA packing**: the G = Hq / Hkv query heads that read one K/V head share one tile. Tile row
  ``r`` is query ``r // G`` of head ``hkv * G + r % G``, so a tile holds G heads x a few queries, and
  every key block loaded from memory serves all of them.
* **Split-KV**: the keys of one sequence are dealt out to ``n_splits`` programs
  (:func:`flashattn.schedule.decode_split_range`). Each writes its tile's output normalized over
  its own keys, and the base-2 log-sum-exp of those keys, to float32 scratch.
* **Merge**: a second small kernel combines the partials of each row with the online-softmax merge.
  On sm_90 and later it is launched as a programmatic dependent of the split kernel, so it is
  scheduled while the split kernel runs and waits in the kernel (``gdc_wait``) for its partials.

Grid of the split kernel: (B * Hkv, splits, query tiles); the first axis is the one that grows with
the problem (axes 1 and 2 stop at 65535). With one split the split kernel writes the final output
itself and no merge runs.

Shapes: q (B, Nq, Hq, D); the cache (B, Mmax, Hkv, D), or paged (pages, page_size, Hkv, D) with a
(B, max_pages) int32 block table; any strides. Tiles are read with plain masked loads (a paged cache
gathers each key row through the block table), so no layout needs a copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashattn import _config
from flashattn._memo import remember, table
from flashattn.device_helpers import LN2
from flashattn.device_helpers import clamp as _clamp
from flashattn.device_helpers import decode_split_range as _decode_split_range
from flashattn.device_helpers import fwd_end_visible_key as _fwd_end_visible_key
from flashattn.device_helpers import fwd_first_masked_key as _fwd_first_masked_key
from flashattn.launch import has_recipe, launch, recording, replay
from flashattn.problem import Problem, dense_like
from flashattn.problem import head_dim_block as _head_dim_block
from flashattn.tensors import ceil_div
from flashattn.tensors import interpreter_needs_float32 as _interpreter_needs_float32

try:  # programmatic dependent launch; a Triton without it launches the merge after the split kernel
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - depends on the installed Triton
    gdc_launch_dependents = gdc_wait = None


# --8<-- [start:decode-key-rows]
@triton.jit
def _key_rows(cols, table_row, in_range, stride_page, stride_row, PAGE_SIZE: tl.constexpr):
    """Offsets (int64, [BLOCK_N]) of the cache rows that hold keys ``cols`` of one sequence.

    Contiguous cache: row ``j`` of the sequence is at ``j * stride_row`` from its base. Paged cache
    (``PAGE_SIZE > 0``): key ``j`` sits in slot ``j % PAGE_SIZE`` of page ``table[j // PAGE_SIZE]``.
    The page is looked up per key, so a key block may cross pages and any page size works; keys
    out of range read page 0 instead of a table entry that may not exist.
    """
    if PAGE_SIZE > 0:
        page = tl.load(table_row + cols // PAGE_SIZE, mask=in_range, other=0)  # [BLOCK_N]
        return page.to(tl.int64) * stride_page + (cols % PAGE_SIZE).to(tl.int64) * stride_row
    else:
        return cols.to(tl.int64) * stride_row
# --8<-- [end:decode-key-rows]


@triton.jit
def _load_keys(ptrs, in_range, mask_d, MASKED: tl.constexpr, EVEN_D: tl.constexpr):
    """One [BLOCK_N, BLOCK_D] tile of K or V: masked only where a block can leave the sequence or D."""
    if MASKED:
        return tl.load(ptrs, mask=in_range[:, None] & mask_d[None, :], other=0.0)
    elif EVEN_D:
        return tl.load(ptrs)  # every key of an unmasked block is in the sequence
    else:
        return tl.load(ptrs, mask=mask_d[None, :], other=0.0)


# --8<-- [start:decode-inner]
@triton.jit
def _decode_inner(
    acc, l_i, m_i, b_q, k_base, v_base, table_row, i_q, lo, hi, seq_len, N_Q, qk_scale,  #
    stride_kp, stride_kn, stride_kd, stride_vp, stride_vn, stride_vd,  #
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Fold the key blocks starting in [lo, hi) into the online-softmax state of one packed tile."""
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    mask_d = offs_d < HEAD_DIM
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n  # [BLOCK_N]: key positions in the sequence
        in_range = cols < seq_len
        rows_k = _key_rows(cols, table_row, in_range, stride_kp, stride_kn, PAGE_SIZE)
        rows_v = _key_rows(cols, table_row, in_range, stride_vp, stride_vn, PAGE_SIZE)
        # [BLOCK_N, BLOCK_D]; keys past the sequence read as 0 and are masked to -inf below
        b_k = _load_keys(k_base + rows_k[:, None] + offs_d[None, :] * stride_kd, in_range, mask_d, MASKED, EVEN_D)
        qk = tl.dot(b_q, tl.trans(b_k))  # [BLOCK_M, BLOCK_N]: raw scores q . k
        if MASKED:
            # Keys past the sequence (the cache may hold stale rows there) go to -inf before the max.
            visible = in_range[None, :]
            if CAUSAL:
                # bottom-right within the sequence: query i sees key j when j <= i + (L_b - Nq)
                visible = visible & (cols[None, :] <= i_q[:, None] + (seq_len - N_Q))
            s = tl.where(visible, qk * qk_scale, float("-inf"))  # base-2 scores
            m_new = tl.maximum(m_i, tl.max(s, 1))  # [BLOCK_M]
            # A row that has seen only masked keys pivots at 0: -inf - (-inf) would be NaN.
            m_pivot = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_pivot[:, None])  # [BLOCK_M, BLOCK_N]
        else:
            # every score is finite and qk_scale >= 0: one fused multiply-add per score
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            m_pivot = m_new
            p = tl.exp2(qk * qk_scale - m_pivot[:, None])
        alpha = tl.exp2(m_i - m_pivot)  # [BLOCK_M]: rescales the old state to the new pivot
        l_i = l_i * alpha + tl.sum(p, 1)
        b_v = _load_keys(v_base + rows_v[:, None] + offs_d[None, :] * stride_vd, in_range, mask_d, MASKED, EVEN_D)
        acc = acc * alpha[:, None] + tl.dot(p.to(b_v.dtype), b_v)  # [BLOCK_M, BLOCK_D]
        m_i = m_new
    return acc, l_i, m_i
# --8<-- [end:decode-inner]


@triton.jit
def _cached_len(SEQLENS, i_b, len_all, SCALAR_LEN: tl.constexpr):
    """Keys sequence ``i_b`` held before the append: ``len_all`` for every sequence when the caller
    gave one Python int (no tensor to fill and read), else ``SEQLENS[i_b]``."""
    if SCALAR_LEN:
        return len_all
    else:
        return tl.load(SEQLENS + i_b)


# --8<-- [start:decode-append-kernel]
@triton.jit(do_not_specialize=["len_all"])
def _decode_append_kernel(
    K_NEW, V_NEW, K, V, SEQLENS, TABLE, len_all,  #
    stride_knb, stride_knn, stride_knh, stride_knd,  #
    stride_vnb, stride_vnn, stride_vnh, stride_vnd,  #
    stride_kb, stride_kn, stride_kh, stride_kd,  #
    stride_vb, stride_vn, stride_vh, stride_vd,  #
    stride_tb, H_KV, N_NEW, CAPACITY,  #
    SCALAR_LEN: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Copy row t of k_new[b] and v_new[b] (BLOCK_H heads of it) to position len_b + t of sequence b.

    One program per (b, t) and block of K/V heads. A paged cache maps the position to slot
    ``pos % PAGE_SIZE`` of page ``table[b, pos // PAGE_SIZE]``, as the key loads do. Positions outside
    [0, CAPACITY) are never written: the host checks the lengths, and this keeps a bad one in bounds.
    """
    i = tl.program_id(0)  # b * N_NEW + t
    i_b = i // N_NEW
    t = i % N_NEW
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    # the position, once per head row (a [BLOCK_H] vector: the interpreter cannot mask by a scalar)
    pos = _cached_len(SEQLENS, i_b, len_all, SCALAR_LEN) + t + tl.zeros([BLOCK_H], dtype=tl.int32)
    inside = (pos >= 0) & (pos < CAPACITY)
    pos = tl.where(inside, pos, 0)  # an address to compute, never written to
    mask = (inside & (offs_h < H_KV))[:, None] & (offs_d < HEAD_DIM)[None, :]
    if PAGE_SIZE > 0:
        page = tl.load(TABLE + i_b.to(tl.int64) * stride_tb + pos // PAGE_SIZE).to(tl.int64)
        slot = (pos % PAGE_SIZE).to(tl.int64)
        row_k = page * stride_kb + slot * stride_kn  # [BLOCK_H], equal entries
        row_v = page * stride_vb + slot * stride_vn
    else:
        row_k = i_b.to(tl.int64) * stride_kb + pos.to(tl.int64) * stride_kn
        row_v = i_b.to(tl.int64) * stride_vb + pos.to(tl.int64) * stride_vn
    h, d = offs_h.to(tl.int64)[:, None], offs_d[None, :]
    b_k = tl.load(K_NEW + i_b.to(tl.int64) * stride_knb + t * stride_knn + h * stride_knh + d * stride_knd, mask=mask)
    b_v = tl.load(V_NEW + i_b.to(tl.int64) * stride_vnb + t * stride_vnn + h * stride_vnh + d * stride_vnd, mask=mask)
    tl.store(K + row_k[:, None] + h * stride_kh + d * stride_kd, b_k, mask=mask)
    tl.store(V + row_v[:, None] + h * stride_vh + d * stride_vd, b_v, mask=mask)
# --8<-- [end:decode-append-kernel]


# --8<-- [start:decode-split-kernel]
@triton.jit(do_not_specialize=["len_all"])
def _decode_split_kernel(
    Q, K, V, SEQLENS, TABLE, O_PART, LSE_PART, O, LSE, len_all,  #
    stride_qb, stride_qn, stride_qh, stride_qd,  #
    stride_kb, stride_kn, stride_kh, stride_kd,  #
    stride_vb, stride_vn, stride_vh, stride_vd,  #
    stride_tb, stride_ob, stride_on, stride_oh, stride_od,  #
    H_KV, N_Q, N_NEW, N_SPLITS, qk_scale,  #
    GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, CAUSAL: tl.constexpr, DIRECT: tl.constexpr,
    SCALAR_LEN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # the merge may be scheduled now; it waits for this grid's writes before it reads them
        gdc_launch_dependents()
    i_bh = tl.program_id(0)  # batch * K/V head
    i_split = tl.program_id(1)
    i_t = tl.program_id(2)  # tile of packed query rows
    i_b = i_bh // H_KV
    i_hkv = i_bh % H_KV
    n_rows = GROUP * N_Q
    seq_len = _cached_len(SEQLENS, i_b, len_all, SCALAR_LEN) + N_NEW  # keys of this sequence, the appended ones included

    # --8<-- [start:decode-pack]
    # Row r of the tile is query r // GROUP of query head i_hkv * GROUP + r % GROUP: the heads that
    # share this K/V head, times the queries, fill the rows one query of one head would leave empty.
    offs_r = i_t * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    mask_r = offs_r < n_rows
    mask_d = offs_d < HEAD_DIM
    i_q = (offs_r // GROUP).to(tl.int64)  # query index of each row; 64-bit, as the row offsets below
    i_hq = i_hkv * GROUP + offs_r % GROUP  # query head of each row
    p_q = Q + i_b.to(tl.int64) * stride_qb + i_q[:, None] * stride_qn + i_hq[:, None] * stride_qh \
        + offs_d[None, :] * stride_qd
    b_q = tl.load(p_q, mask=mask_r[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    # --8<-- [end:decode-pack]

    # --8<-- [start:decode-split-walk]
    # Keys [0, full_end) are visible to every row of the tile, [full_end, hi) to some; the schedule's
    # boundary functions take query indices, and the tile holds queries first_q .. last_q.
    if CAUSAL:
        first_q = (i_t * BLOCK_M) // GROUP
        last_q = tl.minimum((i_t * BLOCK_M + BLOCK_M - 1) // GROUP, N_Q - 1)
        full_end = _clamp(_fwd_first_masked_key(first_q, N_Q, seq_len), 0, seq_len)
        hi = _clamp(_fwd_end_visible_key(first_q, last_q - first_q + 1, N_Q, seq_len), 0, seq_len)
    else:
        full_end = seq_len
        hi = seq_len
    # This program's share of the keys: whole blocks, so only the sequence's last block is ragged.
    lo, split_hi = _decode_split_range(i_split, N_SPLITS, seq_len, BLOCK_N)
    hi = tl.minimum(hi, split_hi)
    full_end = tl.maximum(tl.minimum(full_end, hi), lo) // BLOCK_N * BLOCK_N  # lo is block-aligned
    # --8<-- [end:decode-split-walk]

    table_row = TABLE + i_b.to(tl.int64) * stride_tb  # unused without paging
    if PAGE_SIZE > 0:
        k_base = K + i_hkv.to(tl.int64) * stride_kh  # the page index selects the rest
        v_base = V + i_hkv.to(tl.int64) * stride_vh
    else:
        k_base = K + i_b.to(tl.int64) * stride_kb + i_hkv.to(tl.int64) * stride_kh
        v_base = V + i_b.to(tl.int64) * stride_vb + i_hkv.to(tl.int64) * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running row max, base 2
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    acc, l_i, m_i = _decode_inner(acc, l_i, m_i, b_q, k_base, v_base, table_row, i_q, lo, full_end, seq_len, N_Q,
                                  qk_scale, stride_kb, stride_kn, stride_kd, stride_vb, stride_vn, stride_vd,
                                  False, CAUSAL, PAGE_SIZE, HEAD_DIM, BLOCK_N, BLOCK_D)
    acc, l_i, m_i = _decode_inner(acc, l_i, m_i, b_q, k_base, v_base, table_row, i_q, full_end, hi, seq_len, N_Q,
                                  qk_scale, stride_kb, stride_kn, stride_kd, stride_vb, stride_vn, stride_vd,
                                  True, CAUSAL, PAGE_SIZE, HEAD_DIM, BLOCK_N, BLOCK_D)

    # --8<-- [start:decode-partial-store]
    # l_i == 0 marks rows that saw no key in this split (an empty split, or causal rows that see
    # nothing here): their partial is o = 0 with base-2 LSE -inf, which the merge weighs by 0.
    empty = l_i == 0.0
    b_o = acc / tl.where(empty, 1.0, l_i)[:, None]  # [BLOCK_M, BLOCK_D], normalized over this split
    b_lse2 = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))  # [BLOCK_M]
    if DIRECT:
        # one split: this is the final answer, stored in place of the merge
        p_o = O + i_b.to(tl.int64) * stride_ob + i_q[:, None] * stride_on + i_hq[:, None] * stride_oh \
            + offs_d[None, :] * stride_od
        tl.store(p_o, b_o.to(O.dtype.element_ty), mask=mask_r[:, None] & mask_d[None, :])
        p_lse = LSE + (i_b.to(tl.int64) * (H_KV * GROUP) + i_hq) * N_Q + i_q  # lse is (B, Hq, Nq)
        tl.store(p_lse, b_lse2 * LN2, mask=mask_r)
    else:
        # scratch (splits, B * Hkv, rows, D) and (splits, B * Hkv, rows), float32; the output of an
        # empty row is never written, and the merge drops what it loads there
        part = (i_split.to(tl.int64) * tl.num_programs(0) + i_bh) * n_rows + offs_r  # [BLOCK_M]
        tl.store(O_PART + part[:, None] * HEAD_DIM + offs_d[None, :], b_o,
                 mask=(mask_r & ~empty)[:, None] & mask_d[None, :])
        tl.store(LSE_PART + part, b_lse2, mask=mask_r)
    # --8<-- [end:decode-partial-store]
# --8<-- [end:decode-split-kernel]


# --8<-- [start:decode-merge-kernel]
@triton.jit
def _decode_merge_kernel(
    O_PART, LSE_PART, O, LSE,  #
    stride_ob, stride_on, stride_oh, stride_od,  #
    H_KV, N_Q, N_SPLITS, N_BH,  #
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr, PDL: tl.constexpr,
):
    """Merge the partials of BLOCK_R packed rows in BLOCK_C columns, BLOCK_S splits a step:
    LSE = log2 sum_s 2^LSE_s, O = sum_s 2^(LSE_s - LSE) O_s."""
    if PDL:  # launched before the split kernel ended: wait until it has, and its writes are visible
        gdc_wait()
    n_rows = GROUP * N_Q
    row_blocks = tl.cdiv(n_rows, BLOCK_R)
    i_bh = tl.program_id(0) // row_blocks
    i_b = i_bh // H_KV
    i_hkv = i_bh % H_KV
    offs_r = (tl.program_id(0) % row_blocks) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C]
    mask_r = offs_r < n_rows
    mask_c = offs_c < HEAD_DIM
    m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)  # pivot: the largest LSE so far
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)  # sum of 2^(LSE_s - m_i)
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)  # sum of 2^(LSE_s - m_i) O_s
    # A step loads the LSEs and outputs of BLOCK_S splits at once and sums them down the splits, so
    # the loop waits on memory once per BLOCK_S splits (once in all where a step holds every split).
    for first in range(0, N_SPLITS, BLOCK_S):
        split = first + tl.arange(0, BLOCK_S)  # [BLOCK_S]
        part = (split.to(tl.int64)[:, None] * N_BH + i_bh) * n_rows + offs_r[None, :]  # [BLOCK_S, BLOCK_R]
        mask_sr = (split < N_SPLITS)[:, None] & mask_r[None, :]
        b_lse2 = tl.load(LSE_PART + part, mask=mask_sr, other=float("-inf"))
        # an empty partial's output was never written, so whatever the scratch holds there is
        # dropped, not weighed by 0 (0 * NaN is NaN)
        b_o = tl.load(O_PART + part[:, :, None] * HEAD_DIM + offs_c[None, None, :],
                      mask=mask_sr[:, :, None] & mask_c[None, None, :], other=0.0)  # [BLOCK_S, BLOCK_R, BLOCK_C]
        b_o = tl.where((b_lse2 != float("-inf"))[:, :, None], b_o, 0.0)
        m_new = tl.maximum(m_i, tl.max(b_lse2, axis=0))
        # rows with no partial seen yet pivot at 0, so 2^(-inf - 0) = 0 instead of 2^(-inf + inf) = NaN
        m_pivot = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_pivot)
        w = tl.exp2(b_lse2 - m_pivot[None, :])  # [BLOCK_S, BLOCK_R]: each partial's share of the mass, up to 2^m_pivot
        l_i = l_i * alpha + tl.sum(w, axis=0)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * b_o, axis=0)
        m_i = m_new
    # l_i >= 1 for every row some split saw (its largest partial weighs 2^0); rows none saw get 0 / -inf
    empty = l_i == 0.0
    b_o = acc / tl.where(empty, 1.0, l_i)[:, None]
    b_lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * LN2)
    i_q = (offs_r // GROUP).to(tl.int64)
    i_hq = i_hkv * GROUP + offs_r % GROUP
    p_o = O + i_b.to(tl.int64) * stride_ob + i_q[:, None] * stride_on + i_hq[:, None] * stride_oh \
        + offs_c[None, :] * stride_od
    tl.store(p_o, b_o.to(O.dtype.element_ty), mask=mask_r[:, None] & mask_c[None, :])
    if tl.program_id(1) == 0:  # every column block computes the rows' LSE; the first stores it
        tl.store(LSE + (i_b.to(tl.int64) * (H_KV * GROUP) + i_hq) * N_Q + i_q, b_lse, mask=mask_r)
# --8<-- [end:decode-merge-kernel]


# The tile's M side is the packed rows, at least 16 for tl.dot; the key block is as long as the
# registers allow at each head dim. At D = 128 the key block and the depth are the sweeps' choice:
# 128-key blocks, three stages, fitted to the grid by fit_tile
# (docs/kernels/tuning-log.md#decodings-tile-fitted-to-its-grid-issue-44); elsewhere they are not tuned.
_INTERPRETER_BLOCK_M, _INTERPRETER_BLOCK_N = 16, 16
_INTERPRETER_SPLITS = 3  # fixed, so that the tests walk several splits, some of them empty
MAX_SPLITS = 128
PROGRAMS_PER_SM = 1  # split until the grid holds about this many programs per SM (one wave) ...
MIN_BLOCKS_PER_SPLIT = 2  # ... but give each split at least this many key blocks
SM_SHARED_BYTES = 228 * 1024  # shared memory of one SM on sm_90 (sm_80 has less)


def decode_config(rows: int, block_d: int, device: torch.device) -> _config.KernelConfig:
    """Tile of the split kernel for ``rows`` packed query rows per (sequence, K/V head)."""
    if _config.is_interpreter() or device.type != "cuda":
        return _config.KernelConfig(_INTERPRETER_BLOCK_M, _INTERPRETER_BLOCK_N, 4, 1)
    block_m = min(64, _head_dim_block(rows))  # rows padded as a head dim is: a power of two, at least 16
    if block_d <= 128:
        return _config.KernelConfig(block_m, 128, 4, 3)
    return _config.KernelConfig(block_m, 32, 4, 2)


def dependent_launch(device: torch.device) -> bool:
    """Whether the merge launches as a programmatic dependent of the split kernel: on sm_90 and later,
    where the installed Triton has it, and not under the interpreter."""
    if gdc_wait is None or _config.is_interpreter() or device.type != "cuda":
        return False
    return _config._capability(_config.index_of(device))[0] >= 9


# --8<-- [start:decode-num-splits]
def fills_sm(cfg: _config.KernelConfig, block_d: int, element_size: int) -> bool:
    """Whether a split program's key and value stages take more than half of an SM's shared memory, so
    that no second program runs beside it (its loop holds ``num_stages - 1`` blocks of K and V in flight)."""
    return (cfg.num_stages - 1) * cfg.block_n * block_d * element_size * 2 > SM_SHARED_BYTES // 2


def choose_num_splits(programs: int, max_keys: int, block_n: int, device: torch.device,
                      whole_sm: bool = False) -> int:
    """How many splits share the keys of one tile, from the problem size and the SM count.

    ``programs`` is the grid without splits (B * Hkv * query tiles) and ``max_keys`` the most keys a
    sequence can have. Enough splits to give every SM about ``PROGRAMS_PER_SM`` programs (one wave: a
    tile's loads are deep enough to keep its SM busy), but at most one split per
    ``MIN_BLOCKS_PER_SPLIT`` key blocks of ``max_keys``, where the merge would cost more than the
    split saves. The count is rounded up, except for programs that take a ``whole_sm``
    (:func:`fills_sm`): those run one to an SM, and one past the wave would start only as one of the
    first ends, so it is rounded down. Splits take runs of ``ceil(blocks / splits)`` blocks, so the
    last can be shorter, or empty.
    """
    if _config.is_interpreter() or device.type != "cuda":
        return _INTERPRETER_SPLITS
    index = _config.index_of(device)
    slots = PROGRAMS_PER_SM * _config._sm_count(index)
    wanted = slots // programs if whole_sm else ceil_div(slots, programs)
    longest = ceil_div(max_keys, block_n) // MIN_BLOCKS_PER_SPLIT
    return max(1, min(wanted, longest, MAX_SPLITS))


def fit_tile(cfg: _config.KernelConfig, block_d: int, programs: int, max_keys: int, splits: int,
             device: torch.device) -> _config.KernelConfig:
    """The D = 128 tile fitted to its grid (``programs`` before splitting, ``splits`` of ``max_keys``).

    More programs than SMs before any split: two stages, so three programs share an SM and the grid
    runs in one wave instead of a second wave of whole-SM programs. Splits of at most
    ``MIN_BLOCKS_PER_SPLIT`` key blocks: blocks half as long, twice as many to a split (measured
    faster; docs/kernels/decoding.md#how-many-splits).
    """
    if block_d != 128 or _config.is_interpreter() or device.type != "cuda":
        return cfg
    index = _config.index_of(device)
    if programs > _config._sm_count(index):
        return _config.KernelConfig(cfg.block_m, cfg.block_n, cfg.num_warps, 2)
    if ceil_div(max_keys, splits) <= MIN_BLOCKS_PER_SPLIT * cfg.block_n:
        return _config.KernelConfig(cfg.block_m, cfg.block_n // 2, cfg.num_warps, cfg.num_stages)
    return cfg
# --8<-- [end:decode-num-splits]


MERGE_TILE = 4096  # elements of a merge step's [splits, rows, columns] tile


def merge_blocks(rows: int, block_d: int, splits: int) -> tuple[int, int, int]:
    """The merge's tile: up to 16 packed rows and 32 columns a program, and as many splits a step as
    fill ``MERGE_TILE``, so that a step waits on its loads once for all of them."""
    block_r = min(16, triton.next_power_of_2(rows))
    block_c = min(32, block_d)
    return block_r, block_c, min(triton.next_power_of_2(splits), max(1, MERGE_TILE // (block_r * block_c)))


# (rows, block_d, B * Hkv, max_keys, splits asked, dtype, device) -> (cfg, tiles, splits, dependent launch)
_PLANS = table("decode.plans")


def _scratch(shape, device) -> torch.Tensor:
    """Float32 scratch for the partials; a function so a test can hand out poisoned memory."""
    return torch.empty(shape, dtype=torch.float32, device=device)


# --8<-- [start:decode-launch]
def launch_decode(q, k_cache, v_cache, seq_lens, k_new, v_new, block_table, problem: Problem, max_keys: int,
                  num_splits: int | None = None, out=None, key=None):
    """Append ``k_new``/``v_new`` (None: nothing to append) to the cache in place, then run split-KV
    decoding on it.

    ``seq_lens`` holds the lengths *before* the append: a (B,) int32 tensor on q's device, or one
    Python int for every sequence, which the kernels take as an argument (no tensor is made or read
    for it). ``max_keys`` bounds the lengths after the append (the cache's capacity when they are not
    known on the host). Returns ``(o, lse)``: o (B, Nq, Hq, D) in q's dtype (``out`` when given, any
    strides, else contiguous), lse (B, Hq, Nq) float32 natural log. Inputs are validated by :mod:`flashattn.decode`, which also makes q's device
    the current one, where the launches go. ``key``, when given, replaces the recipe key the call
    would build (:func:`split_kv_key`): the caller vouches that it determines everything the key would hold.
    """
    scalar = isinstance(seq_lens, int)
    # the kernels read seq_lens[b] and a table row's entries at unit stride (a no-op when they are)
    if not scalar:
        seq_lens = seq_lens.contiguous()
    block_table = None if block_table is None else block_table.contiguous()
    if _interpreter_needs_float32(q):
        if k_new is not None:  # the append only copies: it runs in bfloat16, into the cache itself
            _append(k_cache, v_cache, seq_lens, k_new, v_new, block_table, None)
            seq_lens = seq_lens + k_new.shape[1] if scalar else (seq_lens + k_new.shape[1]).to(torch.int32)
        o, lse = launch_decode(q.float(), k_cache.float(), v_cache.float(), seq_lens, None, None, block_table,
                               problem, max_keys, num_splits)
        if out is None:
            return o.to(q.dtype), lse
        out.copy_(o)
        return out, lse
    batch, n_q, h_q, d = q.shape
    h_kv = k_cache.shape[2]
    n_new = 0 if k_new is None else k_new.shape[1]
    group = h_q // h_kv
    rows = group * n_q
    block_d = _head_dim_block(d)
    # the tile and the split count, worked out once per shape (a decoding step is short: it feels each)
    plan_key = (rows, block_d, batch * h_kv, max_keys, num_splits, q.dtype, q.device)
    plan = _PLANS.get(plan_key)
    if plan is None:
        cfg = decode_config(rows, block_d, q.device)
        tiles = ceil_div(rows, cfg.block_m)
        if tiles > 65535:
            raise ValueError(f"q has too many queries for one call: Nq * Hq / Hkv = {rows} packed rows "
                             f"need {tiles} tiles of {cfg.block_m}, at most 65535")
        splits = num_splits or choose_num_splits(batch * h_kv * tiles, max_keys, cfg.block_n, q.device,
                                                 fills_sm(cfg, block_d, q.element_size()))
        cfg = fit_tile(cfg, block_d, batch * h_kv * tiles, max_keys, splits, q.device)
        plan = remember(_PLANS, plan_key, (cfg, tiles, splits, dependent_launch(q.device)))
    cfg, tiles, num_splits, pdl = plan
    paged = block_table is not None
    # A step whose shapes, layouts and split count repeat an earlier one's replays that step's
    # launches with its own tensors (flashattn.launch.Recipe), as the attention launchers do; an int
    # length is the launches' one per-call integer, so a loop whose cache grows keeps replaying.
    if key is None:
        key = ("decode", q.dtype, q.device, q.shape, q.stride(), k_cache.shape, k_cache.stride(), v_cache.stride(),
               scalar or seq_lens.stride(), None if not paged else (block_table.shape, block_table.stride()),
               None if not n_new else (k_new.shape, k_new.stride(), v_new.stride()), problem.causal, problem.scale,
               num_splits,
               None if out is None else out.stride())
    # a caller's ``out`` is one of the inputs a replay takes; otherwise a replay allocates o itself
    inputs = (q, k_cache, v_cache, None if scalar else seq_lens, block_table, k_new, v_new, out)
    free = (seq_lens if scalar else 0,)
    replayed = replay(key, inputs, free)
    if replayed is not None:
        return (replayed[0], replayed[1]) if out is None else (out, replayed[0])
    record = recording(key)
    if n_new:
        _append(k_cache, v_cache, seq_lens, k_new, v_new, block_table, record)
    o = torch.empty((batch, n_q, h_q, d), dtype=q.dtype, device=q.device) if out is None else out
    lse = torch.empty((batch, h_q, n_q), dtype=torch.float32, device=q.device)
    direct = num_splits == 1
    if direct:
        o_part = lse_part = lse  # not touched by the kernel
    else:
        o_part = _scratch((num_splits, batch * h_kv, rows, d), q.device)
        lse_part = _scratch((num_splits, batch * h_kv, rows), q.device)
    lens = lse if scalar else seq_lens  # any tensor of the call: never read with an int length
    table = block_table if paged else lens  # likewise never read without paging
    # launch() goes straight to the compiled kernel after the first call: at short caches the host
    # work of Triton's own launch path is longer than the kernels
    launch(_decode_split_kernel, (batch * h_kv, num_splits, tiles),
           (q, k_cache, v_cache, lens, table, o_part, lse_part, o, lse, free[0],
            *q.stride(), *k_cache.stride(), *v_cache.stride(),
            block_table.stride(0) if paged else 0, *o.stride(),
            h_kv, n_q, n_new, num_splits, problem.qk_scale),
           dict(GROUP=group, PAGE_SIZE=k_cache.shape[1] if paged else 0, CAUSAL=problem.causal, DIRECT=direct,
                SCALAR_LEN=scalar, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                PDL=pdl and not direct),
           cfg.options(), record)
    if not direct:
        block_r, block_c, block_s = merge_blocks(rows, block_d, num_splits)
        launch(_decode_merge_kernel, (batch * h_kv * ceil_div(rows, block_r), ceil_div(d, block_c)),
               (o_part, lse_part, o, lse, *o.stride(), h_kv, n_q, num_splits, batch * h_kv),
               dict(GROUP=group, HEAD_DIM=d, BLOCK_S=block_s, BLOCK_R=block_r, BLOCK_C=block_c, PDL=pdl),
               dict(num_warps=4, launch_pdl=True) if pdl else dict(num_warps=4), record)
    if record is not None:
        outputs = (lse,) if direct else (lse, o_part, lse_part)
        record.keep(inputs, outputs if out is not None else (o, *outputs), free)
    return o, lse
# --8<-- [end:decode-launch]


def split_kv_key(q, k, v, problem: Problem) -> tuple:
    """The recipe key of a dense-API call that the split-KV kernels run (:attr:`Problem.split_kv`): q
    (B, Hq, N, D), k and v (B, Hkv, M, D) as the API takes them. The problem (shapes, dtype, mask,
    scale), the device and the three tensors' strides fix everything :func:`launch_decode`'s own key
    would hold for their transposes: the split count and tile follow from the shapes and the device,
    and the output is laid out from q (:func:`flashattn.problem.dense_like`)."""
    return ("split_kv", problem, q.device, q.stride(), k.stride(), v.stride())


def replay_split_kv(q, k, v, problem: Problem):
    """``(o, lse)`` of a dense-API split-KV call from the recipe an earlier call with this key left
    (recorded by :func:`flashattn.autograd`'s split-KV forward under :func:`split_kv_key`), or None where
    there is none: the caller made q's device the current one. The recipe takes the tensors as the API
    gives them: their transposes, which the kernels were launched with, share their data pointers."""
    key = split_kv_key(q, k, v, problem)
    if not has_recipe(key):  # (before o is allocated for nothing)
        return None
    o = dense_like(q)
    replayed = replay(key, (q, k, v, None, None, None, None, o), (problem.m,))
    return None if replayed is None else (o, replayed[0])


def _append(k_cache, v_cache, seq_lens, k_new, v_new, block_table, record) -> None:
    """Launch :func:`_decode_append_kernel`: k_new and v_new into the cache at each sequence's length."""
    batch, n_new, h_kv, d = k_new.shape
    scalar = isinstance(seq_lens, int)
    paged = block_table is not None
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    block_d = _head_dim_block(d)
    block_h = max(2, min(triton.next_power_of_2(h_kv), 4096 // block_d))  # K/V heads per program
    lens = k_cache if scalar else seq_lens  # never read with an int length
    launch(_decode_append_kernel, (batch * n_new, ceil_div(h_kv, block_h)),
           (k_new, v_new, k_cache, v_cache, lens, block_table if paged else lens, seq_lens if scalar else 0,
            *k_new.stride(), *v_new.stride(), *k_cache.stride(), *v_cache.stride(),
            block_table.stride(0) if paged else 0, h_kv, n_new, capacity),
           dict(SCALAR_LEN=scalar, PAGE_SIZE=k_cache.shape[1] if paged else 0, HEAD_DIM=d, BLOCK_H=block_h,
                BLOCK_D=block_d), dict(num_warps=4), record)
