"""The Hopper-only (sm_90a) FlashAttention forward kernel, written in Gluon for Triton 3.6.

Its host side (configuration, launch, ``forward``) is :mod:`flashattn.hopper.fwd`, which imports
this module, and Gluon with it, at the first launch.

Design (a CTA computes 128-row query blocks of one (batch, head) at a time: one block, or with a
persistent launch the blocks pid, pid + grid, ... of a grid of at most one CTA per SM):

* three warp-specialized partitions (``gl.warp_specialize``):
  - consumer 0: the default partition, 4 warps (one warpgroup), query rows [0, 64) of the block;
  - consumer 1: a worker partition, 4 warps, query rows [64, 128);
  - producer: a worker partition, 1 warp, 24 registers, that issues every TMA load: per block the
    two Q halves, then K and V tiles into a ring of ``STAGES`` shared-memory slots, whose fills
    carry on from block to block.
* a persistent CTA's producer loads the next block's Q half once that half's consumer has completed
  its last S product (and that step's softmax) of the block that used the buffer last (an "empty"
  mbarrier per half and buffer): with one Q buffer (``QBUFS``) the current block, with two (the
  default without a mask at D <= 128, :func:`flashattn.hopper.fwd.q_buffers_default`) the block
  before it. O leaves through a buffer of its own (D <= 128) by TMA, so the next Q may land while O
  is stored. At D = 256 there is no room for that buffer: O is staged in the dead Q half, which is
  released after the store.
* a persistent walk is static (blocks pid, pid + grid, ...) or dynamic (``DYNAMIC``, the default
  under causal): the producer draws the CTA's next block from a counter all CTAs add to (an int32
  zeroed per call, which the CTA that draws last also sets back to zero) and hands its number to the
  consumers in shared memory, written before the mbarrier arrive that the Q half's TMA completes.
  Under causal the blocks are numbered in sections of ``SECTION`` heads, the longest block of each
  head of a section first.
  The kernel runs with ``maxnreg=168`` so that the register allocator gives each consumer
  warpgroup 240 registers per thread (12 warps * 168 = 4 * 240 + 4 * 240 + 4 * 24).
* K and V of a slot have separate "full" mbarriers (expect-tx, completed by TMA) and separate
  "empty" mbarriers (count 2: one arrive from each consumer), so S = Q K^T may start before V lands.
* each consumer keeps one P V product in flight: it issues S_j = Q K_j^T and O += P_{j-1} V_{j-1}
  back to back (async wgmma), waits for S_j only, runs the softmax of S_j while P_{j-1} V_{j-1}
  runs, then waits for the product, rescales O and casts P_j to a register wgmma operand.
* ping-pong (``PINGPONG``, off by default, see :func:`flashattn.hopper.fwd._config`): two "turn"
  mbarriers make the consumers issue their GEMMs in strict alternation, so one warpgroup's softmax
  overlaps the other's tensor-core work (FA3 uses named barriers for this; Gluon 3.6 exposes none, so mbarriers
  between the two consumer partitions play their part).
* scores are kept in base 2 (scale * log2(e) folded in); the running max starts at a finite floor
  (-1e30), so rows that see no key produce p = 0, alpha = 1 and never NaN; such rows store o = 0 and
  lse = -inf.
* causal masking is bottom-right aligned (query i sees key j iff j <= i + M - N); key blocks wholly
  visible to the whole 128-row block run without a mask, the diagonal/ragged ones with it, and key
  blocks above the diagonal are never loaded.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

from flashattn.hopper.common import load_kv_ring, masked_scores, tile_coords

# float8 P is rounded as 2^P_LOG2_SCALE P (flashattn.forward.FP8_P_SCALE = 2^8 in the portable kernel)
P_LOG2_SCALE = gl.constexpr(8.0)


@gluon.jit
def _put_tile(tile_ids, t, tile):
    # The producer tells the consumers which tile is its t-th: slot t % 2, read once that tile's
    # Q halves have landed. The slot's last readers read it for tile t - 2 before releasing that
    # tile's Q buffer, which the producer waited for (two buffers), or for tile t - 1's (one).
    one: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    tile_ids.index(t % 2).store(gl.full([1], tile, gl.int32, one))


@gluon.jit
def _q_slot(t, c, QBUFS: gl.constexpr):
    # The Q slot (barrier and shared-memory half) of consumer c's half of the CTA's t-th tile:
    # buffer t % QBUFS, two halves per buffer. A slot's phase is (t // QBUFS) & 1.
    return (t % QBUFS) * 2 + c


@gluon.jit
def _get_tile(tile_ids, q_bars, t, CONSUMER: gl.constexpr, QBUFS: gl.constexpr):
    one: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    mbarrier.wait(q_bars.index(_q_slot(t, CONSUMER, QBUFS)), (t // QBUFS) & 1)
    return gl.max(tile_ids.index(t % 2).load(one), axis=0)


@gluon.jit
def _wait_q_free(q_empty, t, QBUFS: gl.constexpr):
    # Both halves of the Q buffer of the CTA's t-th tile released by their consumers (a fresh
    # mbarrier counts as having completed the phase before phase 0: the first waits return at once).
    for c in gl.static_range(2):
        mbarrier.wait(q_empty.index(_q_slot(t, c, QBUFS)), ((t // QBUFS) & 1) ^ 1)


@gluon.jit
def _load_q_half(q_desc, q_bars, q_smem, slot, b, hq, row, HALF: gl.constexpr, HEAD_DIM: gl.constexpr):
    mbarrier.expect(q_bars.index(slot), HALF * HEAD_DIM * (q_desc.dtype.primitive_bitwidth // 8))
    tma.async_copy_global_to_shared(q_desc, [b, hq, row, 0], q_bars.index(slot),
                                    q_smem.index(slot).reshape([1, 1, HALF, HEAD_DIM]))


@gluon.jit
def _produce_tile(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, q_empty, k_full, v_full, k_empty,
                  v_empty, tile_ids, tile, t, kv, BH, HQ, GROUP, N, M, SECTION,
                  CAUSAL: gl.constexpr, DYNAMIC: gl.constexpr, HALF: gl.constexpr, BLOCK_N: gl.constexpr,
                  HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, QBUFS: gl.constexpr, FP8: gl.constexpr):
    # The CTA's t-th tile: its Q halves into Q buffer t % QBUFS (once the consumers are done
    # with the tile that used it last), then its K and V tiles into the ring. Returns the number
    # of ring fills it took.
    b, hq, hkv, bh, m0, n_total, n_full = tile_coords(tile, BH, N, M, HQ, GROUP, SECTION, 2 * HALF, BLOCK_N,
                                                      CAUSAL)
    if QBUFS == 1:
        # each half loads as soon as its own consumer has released it
        for c in gl.static_range(2):
            mbarrier.wait(q_empty.index(c), (t & 1) ^ 1)
            if DYNAMIC and c == 0:
                _put_tile(tile_ids, t, tile)
            _load_q_half(q_desc, q_bars, q_smem, c, b, hq, m0 + c * HALF, HALF, HEAD_DIM)
    else:
        # Both consumers have released the buffer, so both have read the tile number in the
        # slot this overwrites.
        _wait_q_free(q_empty, t, QBUFS)
        if DYNAMIC:
            _put_tile(tile_ids, t, tile)
        for c in gl.static_range(2):
            _load_q_half(q_desc, q_bars, q_smem, _q_slot(t, c, QBUFS), b, hq, m0 + c * HALF, HALF, HEAD_DIM)
    load_kv_ring(k_desc, v_desc, k_smem, v_smem, k_full, v_full, k_empty, v_empty, b, hkv, n_total, kv,
                 BLOCK_N, HEAD_DIM, STAGES, FP8)
    return n_total


# --8<-- [start:gluon-fwd-dynamic]
@gluon.jit
def _fa_producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, q_empty, k_full, v_full, k_empty,
                 v_empty, tile_ids, counter_ptr, BH, HQ, GROUP, N, M, SECTION,
                 CAUSAL: gl.constexpr, DYNAMIC: gl.constexpr, HALF: gl.constexpr, BLOCK_N: gl.constexpr,
                 HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, QBUFS: gl.constexpr, FP8: gl.constexpr):
    # One warp: the CTA's tiles, whose K/V ring fills carry on from tile to tile. A static walk
    # takes tiles pid, pid + grid, ...; a dynamic one takes its first tile by program id and each
    # next one from a counter shared by all CTAs, so a CTA that drew short tiles draws more.
    tiles = BH * gl.cdiv(N, 2 * HALF)
    t = 0
    kv = 0
    if DYNAMIC:
        tile = gl.program_id(0)
        drawn = 0
        while tile < tiles:
            kv += _produce_tile(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, q_empty, k_full, v_full,
                                k_empty, v_empty, tile_ids, tile, t, kv, BH, HQ, GROUP, N, M, SECTION,
                                CAUSAL, DYNAMIC, HALF, BLOCK_N, HEAD_DIM, STAGES, QBUFS, FP8)
            t += 1
            drawn = gl.atomic_add(counter_ptr, 1, sem="relaxed")
            tile = gl.num_programs(0) + drawn
        # Every CTA draws until it gets a number past the last tile, so the draws number exactly
        # `tiles` (tiles - grid that succeed, one that fails per CTA) and return 0 .. tiles - 1.
        # The CTA that drew the last one sets the counter back to zero, so a launch leaves it
        # as it found it (the package still zeroes one per call: flashattn.tensors.tile_counter).
        if drawn == tiles - 1:
            gl.atomic_xchg(counter_ptr, 0, sem="relaxed")
        # No tile left: a tile number past the end wakes the consumers, which then stop.
        _wait_q_free(q_empty, t, QBUFS)
        _put_tile(tile_ids, t, tile)
        for c in gl.static_range(2):
            mbarrier.arrive(q_bars.index(_q_slot(t, c, QBUFS)))
    else:
        for tile in range(gl.program_id(0), tiles, gl.num_programs(0)):
            kv += _produce_tile(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, q_empty, k_full, v_full,
                                k_empty, v_empty, tile_ids, tile, t, kv, BH, HQ, GROUP, N, M, SECTION,
                                CAUSAL, DYNAMIC, HALF, BLOCK_N, HEAD_DIM, STAGES, QBUFS, FP8)
            t += 1
# --8<-- [end:gluon-fwd-dynamic]


@gluon.jit
def _fa_softmax(s, m_i, l_i, n0, row0, M, q_off, qk_scale,
                MASK: gl.constexpr, CAUSAL: gl.constexpr, HALF: gl.constexpr, BLOCK_N: gl.constexpr,
                s_layout: gl.constexpr, FP8: gl.constexpr):
    # s: raw scores q.k [HALF, BLOCK_N] (fp32, wgmma layout); qk_scale = scale * log2(e) > 0.
    # Returns (p fp32, alpha, m_new, l_new) with m in base-2 scaled units; s * qk_scale - m is
    # one FMA per score.
    if MASK:
        s = masked_scores(s, n0, row0, M, q_off, CAUSAL, HALF, BLOCK_N, s_layout)
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    alpha = gl.exp2(m_i - m_new)
    # --8<-- [start:gluon-fp8-pivot]
    if FP8:
        # 2^8 P, ready for float8's rounding (docs/kernels/fp8.md): the pivot moves down by 8, a
        # per-row subtraction; l sums 2^8 P too, so o = acc / l needs no division by 2^8
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_new - P_LOG2_SCALE, 1))
    else:
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
    # --8<-- [end:gluon-fp8-pivot]
    l_new = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_new


# --8<-- [start:gluon-fp8-pv]
# The P V product. Float8 tensor cores read V with keys contiguous, so the float8 V tiles arrive
# [HEAD_DIM, BLOCK_N] and are read transposed (V_KEYS_LAST). P is the product's register operand, or
# with P_SMEM it goes through shared memory (p_buf, one [HALF, BLOCK_N] buffer per consumer): always
# for float8, since Triton 3.6 cannot keep an 8-bit register operand of an asynchronous product alive
# across its wait, and for 16-bit inputs where P's registers would not fit beside a wide S tile.
@gluon.jit
def _pv_product(p, p_buf, v_smem, idx, acc, P_SMEM: gl.constexpr, V_KEYS_LAST: gl.constexpr):
    if V_KEYS_LAST:
        v = v_smem.index(idx).permute((1, 0))
    else:
        v = v_smem.index(idx)
    if P_SMEM:
        return warpgroup_mma(p_buf, v, acc, is_async=True)
    else:
        return warpgroup_mma(p, v, acc, is_async=True)


@gluon.jit
def _pv_wait(acc_tok, p, P_SMEM: gl.constexpr):
    # (acc, p) once the P V product has completed
    if P_SMEM:
        return warpgroup_mma_wait(0, deps=(acc_tok, )), p
    else:
        return warpgroup_mma_wait(0, deps=(acc_tok, p))


@gluon.jit
def _p_operand(p32, p, p_buf, p_layout: gl.constexpr, P_SMEM: gl.constexpr):
    # The next P V product's P, rounded to the input dtype: in registers, or in p_buf (once the last
    # product that read p_buf has completed; p is then passed through)
    if P_SMEM:
        p_buf.store(p32.to(p_buf.dtype))
        fence_async_shared()
        return p
    else:
        return gl.convert_layout(p32.to(p_buf.dtype), p_layout)
# --8<-- [end:gluon-fp8-pv]


# --8<-- [start:gluon-fwd-step]
@gluon.jit
def _fa_step(i, kv, q, k_smem, v_smem, p_buf, k_full, v_full, k_empty, v_empty, turn_mine, turn_other,
             m_i, l_i, p, acc, row0, M, q_off, qk_scale,
             CONSUMER: gl.constexpr, MASK: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr,
             HALF: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
             s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr, FP8: gl.constexpr,
             P_SMEM: gl.constexpr):
    # Key block i: S_i = Q K_i^T and O += P_{i-1} V_{i-1}, softmax of S_i under the P V product.
    # Block i is the ring's fill kv + i (kv: the fills of this CTA's earlier tiles).
    s_idx = (kv + i) % STAGES
    s_ph = ((kv + i) // STAGES) & 1
    j = kv + i - 1
    v_idx = j % STAGES
    v_ph = (j // STAGES) & 1
    mbarrier.wait(k_full.index(s_idx), s_ph)
    mbarrier.wait(v_full.index(v_idx), v_ph)
    if PINGPONG:
        # turn number i of this consumer (the prologue was turn 0)
        mbarrier.wait(turn_mine, (i & 1) ^ (1 - CONSUMER))
    s_tok = warpgroup_mma(q, k_smem.index(s_idx).permute((1, 0)),
                          gl.zeros([HALF, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
    acc_tok = _pv_product(p, p_buf, v_smem, v_idx, acc, P_SMEM, FP8)
    if PINGPONG:
        mbarrier.arrive(turn_other)
    s = warpgroup_mma_wait(1, deps=(s_tok, ))
    mbarrier.arrive(k_empty.index(s_idx))
    p_new, alpha, m_i, l_i = _fa_softmax(s, m_i, l_i, i * BLOCK_N, row0, M, q_off, qk_scale, MASK, CAUSAL, HALF,
                                         BLOCK_N, s_layout, FP8)
    acc, p = _pv_wait(acc_tok, p, P_SMEM)
    mbarrier.arrive(v_empty.index(v_idx))
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    p = _p_operand(p_new, p, p_buf, p_layout, P_SMEM)
    return m_i, l_i, p, acc
# --8<-- [end:gluon-fwd-step]


@gluon.jit
def _fa_tile(q_smem, k_smem, v_smem, o_smem, p_smem, q_bars, q_empty, k_full, v_full, k_empty, v_empty, turn_bars,
             o_desc, lse_ptr, b, hq, bh, m0, N, M, n_full, n_total, t, kv, qk_scale, o_scale,
             CONSUMER: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr, O_IN_Q: gl.constexpr,
             HALF: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
             QBUFS: gl.constexpr, FP8: gl.constexpr, P_SMEM: gl.constexpr):
    # One warpgroup, one tile: query rows [m0 + CONSUMER * HALF, + HALF) of the CTA's tile number
    # t, whose key blocks are the ring's fills kv, kv + 1, ..., and whose Q half is in Q buffer
    # t % QBUFS.
    # wgmma's k per instruction: 32 bytes of the inputs (16 for 16-bit inputs, 32 for float8)
    INSTR_K: gl.constexpr = 256 // q_smem.dtype.primitive_bitwidth
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, INSTR_K])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, INSTR_K])
    # P as the register operand: 32 bits of consecutive k per thread (two 16-bit or four 8-bit values)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout,
                                                 k_width=32 // q_smem.dtype.primitive_bitwidth)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    row0 = m0 + CONSUMER * HALF
    q_off = M - N
    turn_mine = turn_bars.index(CONSUMER)
    turn_other = turn_bars.index(1 - CONSUMER)

    qi = _q_slot(t, CONSUMER, QBUFS)
    q = q_smem.index(qi)
    p_buf = p_smem.index(CONSUMER)
    mbarrier.wait(q_bars.index(qi), (t // QBUFS) & 1)

    m_i = gl.full([HALF], -1.0e30, gl.float32, row_s)
    l_i = gl.full([HALF], 0.0, gl.float32, row_s)
    acc = gl.zeros([HALF, HEAD_DIM], gl.float32, o_layout)
    if n_total > 0:
        # Prologue: S_0 alone (always masked: it may be the ragged or diagonal block).
        mbarrier.wait(k_full.index(kv % STAGES), (kv // STAGES) & 1)
        if PINGPONG:
            mbarrier.wait(turn_mine, 1 - CONSUMER)
        s_tok = warpgroup_mma(q, k_smem.index(kv % STAGES).permute((1, 0)),
                              gl.zeros([HALF, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn_other)
        s = warpgroup_mma_wait(0, deps=(s_tok, ))
        mbarrier.arrive(k_empty.index(kv % STAGES))
        p32, alpha, m_i, l_i = _fa_softmax(s, m_i, l_i, 0, row0, M, q_off, qk_scale, True, CAUSAL, HALF, BLOCK_N,
                                           s_layout, FP8)
        p = _p_operand(p32, gl.zeros([HALF, HEAD_DIM], q.dtype, p_layout), p_buf, p_layout, P_SMEM)
        # Key blocks every row of this CTA sees in full: no mask.
        for i in range(1, n_full):
            m_i, l_i, p, acc = _fa_step(i, kv, q, k_smem, v_smem, p_buf, k_full, v_full, k_empty, v_empty, turn_mine,
                                        turn_other, m_i, l_i, p, acc, row0, M, q_off, qk_scale, CONSUMER, False,
                                        CAUSAL, PINGPONG, HALF, BLOCK_N, STAGES, s_layout, o_layout, p_layout, FP8,
                                        P_SMEM)
        # Diagonal and ragged key blocks: masked.
        for i in range(gl.maximum(n_full, 1), n_total):
            m_i, l_i, p, acc = _fa_step(i, kv, q, k_smem, v_smem, p_buf, k_full, v_full, k_empty, v_empty, turn_mine,
                                        turn_other, m_i, l_i, p, acc, row0, M, q_off, qk_scale, CONSUMER, True,
                                        CAUSAL, PINGPONG, HALF, BLOCK_N, STAGES, s_layout, o_layout, p_layout, FP8,
                                        P_SMEM)
        if not O_IN_Q:
            # Every S product of this tile has completed: the producer may load the next tile's
            # Q half while this consumer finishes the tile.
            mbarrier.arrive(q_empty.index(qi))
        # Epilogue: the last P V.
        j = kv + n_total - 1
        v_idx = j % STAGES
        mbarrier.wait(v_full.index(v_idx), (j // STAGES) & 1)
        if PINGPONG:
            mbarrier.wait(turn_mine, (n_total & 1) ^ (1 - CONSUMER))
        acc_tok = _pv_product(p, p_buf, v_smem, v_idx, acc, P_SMEM, FP8)
        if PINGPONG:
            mbarrier.arrive(turn_other)
        acc, p = _pv_wait(acc_tok, p, P_SMEM)
        mbarrier.arrive(v_empty.index(v_idx))
    elif not O_IN_Q:
        mbarrier.arrive(q_empty.index(qi))  # no key: Q was never read

    # o = acc / l (0 where the row saw nothing: then acc is 0 too), one reciprocal per row;
    # lse = ln2 * (m + log2 l). Float8: o also takes v's factor, and l held 2^8 times the sum.
    l_o = gl.convert_layout(l_i, row_o)
    if FP8:
        o = acc * gl.expand_dims(o_scale / gl.where(l_o == 0.0, 1.0, l_o), 1)
        lse = gl.where(l_i == 0.0, -float("inf"), (m_i + gl.log2(l_i) - P_LOG2_SCALE) * 0.6931471805599453)
    else:
        o = acc * gl.expand_dims(1.0 / gl.where(l_o == 0.0, 1.0, l_o), 1)
        lse = gl.where(l_i == 0.0, -float("inf"), (m_i + gl.log2(l_i)) * 0.6931471805599453)
    rows = row0 + gl.arange(0, HALF, layout=row_s)
    gl.store(lse_ptr + bh.to(gl.int64) * N + rows, lse, mask=rows < N)
    # O leaves through shared memory by TMA, which clips rows >= N: through the dead Q tile where
    # there is no room for a buffer of its own (Q is then released once the store has read it),
    # else through this consumer's O buffer, once the previous tile's store has read that.
    if O_IN_Q:
        q.store(o.to(q.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [b, hq, row0, 0], q.reshape([1, 1, HALF, HEAD_DIM]))
        tma.store_wait(0)
        mbarrier.arrive(q_empty.index(qi))
    else:
        o_buf = o_smem.index(CONSUMER)
        tma.store_wait(0)
        o_buf.store(o.to(o_buf.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [b, hq, row0, 0], o_buf.reshape([1, 1, HALF, HEAD_DIM]))


@gluon.jit
def _consume_tile(q_smem, k_smem, v_smem, o_smem, p_smem, q_bars, q_empty, k_full, v_full, k_empty, v_empty, turn_bars,
                  o_desc, lse_ptr, descale_ptr, tile, t, kv, BH, HQ, GROUP, N, M, SECTION, qk_scale,
                  CONSUMER: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr, O_IN_Q: gl.constexpr,
                  HALF: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                  QBUFS: gl.constexpr, FP8: gl.constexpr, P_SMEM: gl.constexpr):
    # The CTA's t-th tile, number `tile`; returns the ring fills it took.
    b, hq, hkv, bh, m0, n_total, n_full = tile_coords(tile, BH, N, M, HQ, GROUP, SECTION, 2 * HALF, BLOCK_N,
                                                      CAUSAL)
    if FP8:
        # float8 q, k, v hold x / descale per (batch, K/V head); descale_ptr is float32 (3, B, Hkv):
        # q's and k's factors join the score scale, v's multiplies the output
        heads_kv = HQ // GROUP
        per_tensor = (BH // HQ) * heads_kv
        factors = descale_ptr + b * heads_kv + hkv
        tile_scale = qk_scale * gl.load(factors) * gl.load(factors + per_tensor)
        o_scale = gl.load(factors + 2 * per_tensor)
    else:
        tile_scale = qk_scale
        o_scale = 1.0
    _fa_tile(q_smem, k_smem, v_smem, o_smem, p_smem, q_bars, q_empty, k_full, v_full, k_empty, v_empty, turn_bars,
             o_desc, lse_ptr, b, hq, bh, m0, N, M, n_full, n_total, t, kv, tile_scale, o_scale,
             CONSUMER, CAUSAL, PINGPONG, O_IN_Q, HALF, BLOCK_N, HEAD_DIM, STAGES, QBUFS, FP8, P_SMEM)
    return n_total


# --8<-- [start:gluon-fwd-persistent]
@gluon.jit
def _fa_consumer(q_smem, k_smem, v_smem, o_smem, p_smem, q_bars, q_empty, k_full, v_full, k_empty, v_empty, turn_bars,
                 tile_ids, o_desc, lse_ptr, descale_ptr, BH, HQ, GROUP, N, M, SECTION, qk_scale,
                 CONSUMER: gl.constexpr, CAUSAL: gl.constexpr, DYNAMIC: gl.constexpr, PINGPONG: gl.constexpr,
                 O_IN_Q: gl.constexpr, HALF: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                 STAGES: gl.constexpr, QBUFS: gl.constexpr, FP8: gl.constexpr, P_SMEM: gl.constexpr):
    # The CTA's tiles in the producer's order: pid, pid + grid, ... (one tile unless the launch is
    # persistent, with fewer CTAs than tiles), or with a dynamic walk the tiles the producer drew.
    tiles = BH * gl.cdiv(N, 2 * HALF)
    t = 0
    kv = 0
    if DYNAMIC:
        tile = _get_tile(tile_ids, q_bars, t, CONSUMER, QBUFS)
        while tile < tiles:
            kv += _consume_tile(q_smem, k_smem, v_smem, o_smem, p_smem, q_bars, q_empty, k_full, v_full, k_empty, v_empty,
                                turn_bars, o_desc, lse_ptr, descale_ptr, tile, t, kv, BH, HQ, GROUP, N, M, SECTION,
                                qk_scale, CONSUMER, CAUSAL, PINGPONG, O_IN_Q, HALF, BLOCK_N, HEAD_DIM, STAGES, QBUFS,
                                FP8, P_SMEM)
            t += 1
            tile = _get_tile(tile_ids, q_bars, t, CONSUMER, QBUFS)
    else:
        for tile in range(gl.program_id(0), tiles, gl.num_programs(0)):
            kv += _consume_tile(q_smem, k_smem, v_smem, o_smem, p_smem, q_bars, q_empty, k_full, v_full, k_empty, v_empty,
                                turn_bars, o_desc, lse_ptr, descale_ptr, tile, t, kv, BH, HQ, GROUP, N, M, SECTION,
                                qk_scale, CONSUMER, CAUSAL, PINGPONG, O_IN_Q, HALF, BLOCK_N, HEAD_DIM, STAGES, QBUFS,
                                FP8, P_SMEM)
            t += 1
    tma.store_wait(0)
# --8<-- [end:gluon-fwd-persistent]


@gluon.jit
def _fa_fwd_kernel(q_desc, k_desc, v_desc, o_desc, lse_ptr, counter_ptr,
                   BH, HQ, GROUP, N, M, SECTION, qk_scale, descale_ptr,
                   HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                   CAUSAL: gl.constexpr, DYNAMIC: gl.constexpr, PINGPONG: gl.constexpr,
                   PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr, QBUFS: gl.constexpr,
                   FP8: gl.constexpr, P_SMEM: gl.constexpr):
    HALF: gl.constexpr = 64
    dtype: gl.constexpr = q_desc.dtype
    # FP8: float8 q, k, v with their descale factors (descale_ptr, unread otherwise), V laid out
    # (B, Hkv, D, M), and a 16-bit o (o_desc's dtype)
    out_dtype: gl.constexpr = o_desc.dtype
    # O has a staging buffer of its own unless that would overflow shared memory (D = 256)
    O_IN_Q: gl.constexpr = HEAD_DIM > 128
    gl.static_assert(not (FP8 and O_IN_Q))
    gl.static_assert(P_SMEM or not FP8)

    smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF, HEAD_DIM], dtype)
    # Q buffers of two halves each: with two, the next tile's Q loads while this one's last S runs
    gl.static_assert(QBUFS == 1 or not O_IN_Q)
    q_smem = gl.allocate_shared_memory(dtype, [2 * QBUFS, HALF, HEAD_DIM], q_layout)
    if O_IN_Q:
        o_smem = q_smem
    else:
        o_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF, HEAD_DIM], out_dtype)
        o_smem = gl.allocate_shared_memory(out_dtype, [2, HALF, HEAD_DIM], o_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], smem_layout)
    if FP8:
        vt_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEAD_DIM, BLOCK_N], dtype)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, HEAD_DIM, BLOCK_N], vt_layout)
    else:
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], smem_layout)
    if P_SMEM:
        # each consumer's P, the P V product's first operand (_pv_product)
        p_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF, BLOCK_N], dtype)
        p_smem = gl.allocate_shared_memory(dtype, [2, HALF, BLOCK_N], p_smem_layout)
    else:
        p_smem = q_smem  # unused: P is a register operand
    q_bars = gl.allocate_shared_memory(gl.int64, [2 * QBUFS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2 * QBUFS, 1], mbarrier.MBarrierLayout())
    turn_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    tile_ids = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    for c in gl.static_range(2 * QBUFS):
        mbarrier.init(q_bars.index(c), count=1)
        mbarrier.init(q_empty.index(c), count=1)
    for c in gl.static_range(2):
        mbarrier.init(turn_bars.index(c), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_full.index(s), count=1)
        mbarrier.init(v_full.index(s), count=1)
        mbarrier.init(k_empty.index(s), count=2)
        mbarrier.init(v_empty.index(s), count=2)
    fence_async_shared()

    gl.warp_specialize([
        (_fa_consumer, (q_smem, k_smem, v_smem, o_smem, p_smem, q_bars, q_empty, k_full, v_full, k_empty, v_empty,
                        turn_bars, tile_ids, o_desc, lse_ptr, descale_ptr, BH, HQ, GROUP, N, M, SECTION, qk_scale, 0,
                        CAUSAL, DYNAMIC, PINGPONG, O_IN_Q, HALF, BLOCK_N, HEAD_DIM, STAGES, QBUFS, FP8, P_SMEM)),
        (_fa_consumer, (q_smem, k_smem, v_smem, o_smem, p_smem, q_bars, q_empty, k_full, v_full, k_empty, v_empty,
                        turn_bars, tile_ids, o_desc, lse_ptr, descale_ptr, BH, HQ, GROUP, N, M, SECTION, qk_scale, 1,
                        CAUSAL, DYNAMIC, PINGPONG, O_IN_Q, HALF, BLOCK_N, HEAD_DIM, STAGES, QBUFS, FP8, P_SMEM)),
        (_fa_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, q_empty, k_full, v_full, k_empty,
                        v_empty, tile_ids, counter_ptr, BH, HQ, GROUP, N, M, SECTION, CAUSAL, DYNAMIC, HALF,
                        BLOCK_N, HEAD_DIM, STAGES, QBUFS, FP8)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
