"""Hopper-only (sm_90a) FlashAttention forward written in Gluon, for Triton 3.6.

    o, lse = forward(q, k, v, causal, scale)      # q (B, Hq, N, D); k, v (B, Hkv, M, D)

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
  mbarrier per half and buffer): with one Q buffer (``QBUFS``) the current block, with two (the default without a mask
  at D <= 128, :func:`q_buffers_default`) the block before it. O leaves through a buffer of its
  own (D <= 128) by TMA, so the next Q may land while O is stored. At D = 256 there is no room for
  that buffer: O is staged in the dead Q half, which is released after the store.
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
* ping-pong (``PINGPONG``, off by default, see :func:`_config`): two "turn" mbarriers make the
  consumers issue their GEMMs in strict alternation, so one warpgroup's softmax overlaps the
  other's tensor-core work (FA3 uses named barriers for this; Gluon 3.6 exposes none, so mbarriers
  between the two consumer partitions play their part).
* scores are kept in base 2 (scale * log2(e) folded in); the running max starts at a finite floor
  (-1e30), so rows that see no key produce p = 0, alpha = 1 and never NaN; such rows store o = 0 and
  lse = -inf.
* causal masking is bottom-right aligned (query i sees key j iff j <= i + M - N); key blocks wholly
  visible to the whole 128-row block run without a mask, the diagonal/ragged ones with it, and key
  blocks above the diagonal are never loaded.

Importing this module never imports Gluon: the kernel is defined the first time it is needed.
"""

from __future__ import annotations

import functools
import math

BLOCK_M = 128          # query rows per CTA (two consumer warpgroups of 64 rows)
HALF_M = 64            # query rows per consumer warpgroup
MAXNREG = 168          # per-thread register cap of the whole kernel (see module docstring)
PRODUCER_REGS = 24
CONSUMER_REGS = 240



def _config(head_dim: int):
    """(BLOCK_N, STAGES, PINGPONG) for a head dim. The K+V ring plus the two Q halves must fit the
    227 KB of shared memory; BLOCK_N must be a power of two (192 is not expressible), and 256 spills
    at D=64. A deeper ring, 64-key blocks where 128 fit and ping-pong ordering are no faster, so the
    ring has two stages and ping-pong is off by default (``forward(..., pingpong=True)`` turns it on;
    docs/kernels/tuning-log.md#a-hopper-forward-in-gluon-issue-15-dispatched-in-the-next-section)."""
    if head_dim == 64:
        return 128, 2, False   # Q 16 KB + 2 * (16 + 16) KB = 80 KB
    if head_dim == 256:
        return 64, 2, False    # Q 64 KB + 2 * (32 + 32) KB = 192 KB; a third stage would need 256 KB
    return 128, 2, False       # Q 32 KB + 2 * (32 + 32) KB = 160 KB


def schedule_default(head_dim: int, causal: bool) -> tuple[bool, bool]:
    """How :func:`forward` walks the query blocks by default, as ``(persistent, dynamic)``.

    Without a mask at D <= 128 the launch is persistent (one CTA per SM) with a static walk: the
    next block's Q half loads into its own buffer while a consumer finishes the last block. At
    D = 256 O is staged in the Q buffer, so the next Q waits for the store and a persistent launch
    gains nothing (docs/kernels/tuning-log.md#a-persistent-forward-issue-15). Under causal, blocks
    have unequal work, which a static walk leaves unbalanced; a dynamic walk, each CTA drawing its
    next block from a counter, longest blocks first within sections of heads (:func:`section_default`),
    balances it (docs/kernels/tuning-log.md#a-dynamic-walk-for-the-causal-forward-issue-15)."""
    if causal:
        return True, True
    return head_dim <= 128, False


def q_buffers_default(head_dim: int, causal: bool) -> int:
    """Q buffers of a persistent CTA. Two fit up to D = 128 (at D = 128: 2 * 32 KB of Q, 32 KB of O
    staging and the 128 KB K/V ring, 224 KB of the 227), one at D = 256, where O is staged in the Q
    buffer. A second buffer lets the next tile's Q load earlier, which pays without a mask; under
    causal the dynamic walk's producer would then draw each next tile a tile earlier, with no steady
    gain, so causal walks keep one (docs/kernels/tuning-log.md#two-q-buffers)."""
    return 2 if head_dim <= 128 and not causal else 1


def section_default(batch_heads: int, n: int, ctas: int) -> int:
    """Heads per section of a dynamic causal walk: about as many query blocks as CTAs, so the CTAs
    start together on the longest blocks of a few heads, whose keys and values L2 then serves to
    all of them (16 heads at N = 1024 on 132 SMs, one from N = 16384). One section of every head
    (the longest blocks of all heads first) is slower, and sections twice or half this size gain
    nothing steady (docs/kernels/tuning-log.md#a-dynamic-walk-for-the-causal-forward-issue-15)."""
    return max(1, min(batch_heads, ctas // -(-n // BLOCK_M)))


def walk_work(batch_heads: int, n: int, m: int, ctas: int, causal: bool, block_n: int = 128,
              dynamic: bool = False, section: int = 1) -> list[int]:
    """The key blocks each of ``ctas`` persistent CTAs would walk, computed on the host, in the
    kernel's tile order (``tile_coords``: query blocks of one (batch, head) after another; under
    causal, sections of ``section`` heads, the longest block of each head of a section first). A
    static walk gives CTA p the tiles p, p + ctas, ...; a dynamic one is modelled with every key block
    taking the same time: the CTAs start on tiles 0..ctas-1 and each next tile goes to the CTA that
    finishes first (the lowest-numbered one on a tie). A 128-row tile visits the key blocks
    :func:`flashattn.schedule.forward_key_range` gives it. For the Hopper page's figure and its
    numbers (tested)."""
    import heapq

    from flashattn import schedule

    num_mb = -(-n // BLOCK_M)
    blocks = []
    for mb in range(num_mb):
        _, hi = schedule.forward_key_range(mb * BLOCK_M, BLOCK_M, block_n, n, m, causal)
        blocks.append(-(-max(hi, 0) // block_n))
    order = []
    if causal:
        for first in range(0, batch_heads, section):
            heads = min(section, batch_heads - first)
            order += [blocks[mb] for mb in range(num_mb - 1, -1, -1) for _ in range(heads)]
    else:
        order = blocks * batch_heads
    work = [0] * ctas
    if not dynamic:
        for tile, cost in enumerate(order):
            work[tile % ctas] += cost
        return work
    free = [(0, p) for p in range(ctas)]   # (time the CTA frees up, CTA)
    for cost in order:
        t, p = heapq.heappop(free)
        work[p] += cost
        heapq.heappush(free, (t + cost, p))
    return work


def triton_version_ok() -> bool:
    """Whether the installed Triton is 3.6, the version whose Gluon these kernels are written for."""
    try:
        import triton
    except Exception:
        return False
    parts = triton.__version__.split(".")
    try:
        return (int(parts[0]), int(parts[1])) == (3, 6)
    except Exception:
        return False


def supported(q, k, v, causal: bool = False) -> bool:
    """True when :func:`forward` handles these inputs on this machine (Hopper sm_90, Triton 3.6)."""
    try:
        import torch
    except Exception:
        return False
    try:
        if not (q.is_cuda and k.is_cuda and v.is_cuda):
            return False
        if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
            return False
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or k.shape != v.shape:
            return False
        B, Hq, N, D = q.shape
        if D not in (64, 128, 256) or k.shape[0] != B or k.shape[3] != D or Hq % k.shape[1] != 0:
            return False
        if N == 0 or k.shape[2] == 0:
            return False
        if torch.cuda.get_device_capability(q.device) != (9, 0):
            return False
        return available()
    except Exception:
        return False


def available() -> bool:
    """Whether the kernel can be built with the Triton installed here (Gluon of Triton 3.6)."""
    return _get_kernel.available()


@functools.lru_cache(maxsize=None)
def gluon_helpers():
    """Gluon functions shared by the kernels laid out per query block (this forward and
    :func:`flashattn.hopper_bwd.dq`), as ``(tile_coords, masked_scores, load_kv_ring)``:

    * ``tile_coords(tile, BH, N, M, HQ, GROUP, SECTION, BLOCK_M, BLOCK_N, CAUSAL) -> (b, hq, hkv, bh,
      m0, n_total, n_full)`` places a tile: without a mask tiles enumerate (query block, batch *
      head), query block fastest, so CTAs that run together share K/V in L2; under causal they come
      in sections of SECTION heads (1: head by head), within a section the longest block of each
      head first, then the next longest of each. It returns the batch, query head, K/V head, batch
      * Hq + head, the block's first row, the key blocks it visits and how many of the first of them
      need no mask;
    * ``masked_scores(s, n0, row0, M, q_off, CAUSAL, HALF, BLOCK_N, s_layout)`` sets to -inf the scores
      of a [HALF, BLOCK_N] tile (rows from ``row0``, keys from ``n0``) whose key lies past M or, under
      causal, after the row's last visible key (query i sees key j iff j <= i + q_off, q_off = M - N);
    * ``load_kv_ring(..., n_total, base, ...)`` is the producer's loop: K and V tiles of ``BLOCK_N`` keys
      of one K/V head into a ring of ``STAGES`` slots, each slot refilled once both consumers released
      it; ``base`` is the number of fills the ring took before (a persistent CTA's earlier tiles)."""
    global gluon, gl, mbarrier, tma
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

    @gluon.jit
    def tile_coords(tile, BH, N, M, HQ, GROUP, SECTION, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    CAUSAL: gl.constexpr):
        num_mb = gl.cdiv(N, BLOCK_M)
        if CAUSAL:
            # Sections of SECTION heads, one after another; within a section the longest query block
            # of each head first, then the next longest of each, ... (SECTION = 1: head by head).
            span = SECTION * num_mb
            first = (tile // span) * SECTION
            heads = gl.minimum(BH - first, SECTION)
            r = tile % span
            bh = first + r % heads
            mb = num_mb - 1 - r // heads
        else:
            bh = tile // num_mb
            mb = tile % num_mb
        b = bh // HQ
        hq = bh % HQ
        hkv = hq // GROUP
        m0 = mb * BLOCK_M
        # Key blocks: n_total visited, the first n_full of them need no mask.
        if CAUSAL:
            hi = gl.minimum(M, m0 + BLOCK_M + (M - N))
            n_total = gl.cdiv(gl.maximum(hi, 0), BLOCK_N)
            n_full = gl.minimum(gl.maximum(m0 + (M - N) + 1, 0) // BLOCK_N, M // BLOCK_N)
        else:
            n_total = gl.cdiv(M, BLOCK_N)
            n_full = M // BLOCK_N
        return b, hq, hkv, bh, m0, n_total, n_full

    @gluon.jit
    def masked_scores(s, n0, row0, M, q_off, CAUSAL: gl.constexpr, HALF: gl.constexpr, BLOCK_N: gl.constexpr,
                      s_layout: gl.constexpr):
        cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        keep = gl.expand_dims(cols < M, 0)
        if CAUSAL:
            rows = row0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, s_layout))
            keep = keep & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows + q_off, 1))
        return gl.where(keep, s, -float("inf"))

    @gluon.jit
    def load_kv_ring(k_desc, v_desc, k_smem, v_smem, k_full, v_full, k_empty, v_empty, b, hkv, n_total, base,
                     BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
        KV_BYTES: gl.constexpr = BLOCK_N * HEAD_DIM * 2
        for i in range(n_total):
            # the ring's (base + i)-th fill: base counts the fills of the CTA's earlier tiles
            s = (base + i) % STAGES
            # A fresh mbarrier counts as having completed the phase before phase 0, so the first
            # STAGES waits (parity 1) return at once.
            ph = (((base + i) // STAGES) & 1) ^ 1
            mbarrier.wait(k_empty.index(s), ph)
            mbarrier.expect(k_full.index(s), KV_BYTES)
            tma.async_copy_global_to_shared(k_desc, [b, hkv, i * BLOCK_N, 0], k_full.index(s),
                                            k_smem.index(s).reshape([1, 1, BLOCK_N, HEAD_DIM]))
            mbarrier.wait(v_empty.index(s), ph)
            mbarrier.expect(v_full.index(s), KV_BYTES)
            tma.async_copy_global_to_shared(v_desc, [b, hkv, i * BLOCK_N, 0], v_full.index(s),
                                            v_smem.index(s).reshape([1, 1, BLOCK_N, HEAD_DIM]))

    return tile_coords, masked_scores, load_kv_ring


def _build_kernel():
    """Define the Gluon kernel. Gluon is imported here, never at module import, so that importing this
    module works on any Triton (or none) and touches no GPU state. The Gluon names become module
    globals, where the JIT resolves them (annotations included)."""
    global gluon, gl, fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    global _tile_coords, _masked_scores, _load_kv_ring
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                   warpgroup_mma, warpgroup_mma_wait)
    _tile_coords, _masked_scores, _load_kv_ring = gluon_helpers()

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
        mbarrier.expect(q_bars.index(slot), HALF * HEAD_DIM * 2)
        tma.async_copy_global_to_shared(q_desc, [b, hq, row, 0], q_bars.index(slot),
                                        q_smem.index(slot).reshape([1, 1, HALF, HEAD_DIM]))

    @gluon.jit
    def _produce_tile(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, q_empty, k_full, v_full, k_empty,
                      v_empty, tile_ids, tile, t, kv, BH, HQ, GROUP, N, M, SECTION,
                      CAUSAL: gl.constexpr, DYNAMIC: gl.constexpr, HALF: gl.constexpr, BLOCK_N: gl.constexpr,
                      HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, QBUFS: gl.constexpr):
        # The CTA's t-th tile: its Q halves into Q buffer t % QBUFS (once the consumers are done
        # with the tile that used it last), then its K and V tiles into the ring. Returns the number
        # of ring fills it took.
        b, hq, hkv, bh, m0, n_total, n_full = _tile_coords(tile, BH, N, M, HQ, GROUP, SECTION, 2 * HALF, BLOCK_N,
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
        _load_kv_ring(k_desc, v_desc, k_smem, v_smem, k_full, v_full, k_empty, v_empty, b, hkv, n_total, kv,
                      BLOCK_N, HEAD_DIM, STAGES)
        return n_total

    # --8<-- [start:gluon-fwd-dynamic]
    @gluon.jit
    def _fa_producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, q_empty, k_full, v_full, k_empty,
                     v_empty, tile_ids, counter_ptr, BH, HQ, GROUP, N, M, SECTION,
                     CAUSAL: gl.constexpr, DYNAMIC: gl.constexpr, HALF: gl.constexpr, BLOCK_N: gl.constexpr,
                     HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, QBUFS: gl.constexpr):
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
                                    CAUSAL, DYNAMIC, HALF, BLOCK_N, HEAD_DIM, STAGES, QBUFS)
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
                                    CAUSAL, DYNAMIC, HALF, BLOCK_N, HEAD_DIM, STAGES, QBUFS)
                t += 1
    # --8<-- [end:gluon-fwd-dynamic]


    @gluon.jit
    def _fa_softmax(s, m_i, l_i, n0, row0, M, q_off, qk_scale,
                    MASK: gl.constexpr, CAUSAL: gl.constexpr, HALF: gl.constexpr, BLOCK_N: gl.constexpr,
                    s_layout: gl.constexpr):
        # s: raw scores q.k [HALF, BLOCK_N] (fp32, wgmma layout); qk_scale = scale * log2(e) > 0.
        # Returns (p fp32, alpha, m_new, l_new) with m in base-2 scaled units; s * qk_scale - m is
        # one FMA per score.
        if MASK:
            s = _masked_scores(s, n0, row0, M, q_off, CAUSAL, HALF, BLOCK_N, s_layout)
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
        l_new = l_i * alpha + gl.sum(p, axis=1)
        return p, alpha, m_new, l_new


    # --8<-- [start:gluon-fwd-step]
    @gluon.jit
    def _fa_step(i, kv, q, k_smem, v_smem, k_full, v_full, k_empty, v_empty, turn_mine, turn_other,
                 m_i, l_i, p, acc, row0, M, q_off, qk_scale,
                 CONSUMER: gl.constexpr, MASK: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr,
                 HALF: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                 s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr):
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
        acc_tok = warpgroup_mma(p, v_smem.index(v_idx), acc, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn_other)
        s = warpgroup_mma_wait(1, deps=(s_tok, ))
        mbarrier.arrive(k_empty.index(s_idx))
        p_new, alpha, m_i, l_i = _fa_softmax(s, m_i, l_i, i * BLOCK_N, row0, M, q_off, qk_scale, MASK, CAUSAL, HALF,
                                             BLOCK_N, s_layout)
        acc, p = warpgroup_mma_wait(0, deps=(acc_tok, p))
        mbarrier.arrive(v_empty.index(v_idx))
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        p = gl.convert_layout(p_new.to(q.dtype), p_layout)
        return m_i, l_i, p, acc
    # --8<-- [end:gluon-fwd-step]


    @gluon.jit
    def _fa_tile(q_smem, k_smem, v_smem, o_smem, q_bars, q_empty, k_full, v_full, k_empty, v_empty, turn_bars,
                 o_desc, lse_ptr, b, hq, bh, m0, N, M, n_full, n_total, t, kv, qk_scale,
                 CONSUMER: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr, O_IN_Q: gl.constexpr,
                 HALF: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                 QBUFS: gl.constexpr):
        # One warpgroup, one tile: query rows [m0 + CONSUMER * HALF, + HALF) of the CTA's tile number
        # t, whose key blocks are the ring's fills kv, kv + 1, ..., and whose Q half is in Q buffer
        # t % QBUFS.
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

        row0 = m0 + CONSUMER * HALF
        q_off = M - N
        turn_mine = turn_bars.index(CONSUMER)
        turn_other = turn_bars.index(1 - CONSUMER)

        qi = _q_slot(t, CONSUMER, QBUFS)
        q = q_smem.index(qi)
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
                                               s_layout)
            p = gl.convert_layout(p32.to(q.dtype), p_layout)
            # Key blocks every row of this CTA sees in full: no mask.
            for i in range(1, n_full):
                m_i, l_i, p, acc = _fa_step(i, kv, q, k_smem, v_smem, k_full, v_full, k_empty, v_empty, turn_mine,
                                            turn_other, m_i, l_i, p, acc, row0, M, q_off, qk_scale, CONSUMER, False,
                                            CAUSAL, PINGPONG, HALF, BLOCK_N, STAGES, s_layout, o_layout, p_layout)
            # Diagonal and ragged key blocks: masked.
            for i in range(gl.maximum(n_full, 1), n_total):
                m_i, l_i, p, acc = _fa_step(i, kv, q, k_smem, v_smem, k_full, v_full, k_empty, v_empty, turn_mine,
                                            turn_other, m_i, l_i, p, acc, row0, M, q_off, qk_scale, CONSUMER, True,
                                            CAUSAL, PINGPONG, HALF, BLOCK_N, STAGES, s_layout, o_layout, p_layout)
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
            acc_tok = warpgroup_mma(p, v_smem.index(v_idx), acc, is_async=True)
            if PINGPONG:
                mbarrier.arrive(turn_other)
            acc, p = warpgroup_mma_wait(0, deps=(acc_tok, p))
            mbarrier.arrive(v_empty.index(v_idx))
        elif not O_IN_Q:
            mbarrier.arrive(q_empty.index(qi))  # no key: Q was never read

        # o = acc / l (0 where the row saw nothing: then acc is 0 too), one reciprocal per row;
        # lse = ln2 * (m + log2 l).
        l_o = gl.convert_layout(l_i, row_o)
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
            o_buf.store(o.to(q.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(o_desc, [b, hq, row0, 0], o_buf.reshape([1, 1, HALF, HEAD_DIM]))


    @gluon.jit
    def _consume_tile(q_smem, k_smem, v_smem, o_smem, q_bars, q_empty, k_full, v_full, k_empty, v_empty, turn_bars,
                      o_desc, lse_ptr, tile, t, kv, BH, HQ, GROUP, N, M, SECTION, qk_scale,
                      CONSUMER: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr, O_IN_Q: gl.constexpr,
                      HALF: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                      QBUFS: gl.constexpr):
        # The CTA's t-th tile, number `tile`; returns the ring fills it took.
        b, hq, hkv, bh, m0, n_total, n_full = _tile_coords(tile, BH, N, M, HQ, GROUP, SECTION, 2 * HALF, BLOCK_N,
                                                           CAUSAL)
        _fa_tile(q_smem, k_smem, v_smem, o_smem, q_bars, q_empty, k_full, v_full, k_empty, v_empty, turn_bars,
                 o_desc, lse_ptr, b, hq, bh, m0, N, M, n_full, n_total, t, kv, qk_scale,
                 CONSUMER, CAUSAL, PINGPONG, O_IN_Q, HALF, BLOCK_N, HEAD_DIM, STAGES, QBUFS)
        return n_total


    # --8<-- [start:gluon-fwd-persistent]
    @gluon.jit
    def _fa_consumer(q_smem, k_smem, v_smem, o_smem, q_bars, q_empty, k_full, v_full, k_empty, v_empty, turn_bars,
                     tile_ids, o_desc, lse_ptr, BH, HQ, GROUP, N, M, SECTION, qk_scale,
                     CONSUMER: gl.constexpr, CAUSAL: gl.constexpr, DYNAMIC: gl.constexpr, PINGPONG: gl.constexpr,
                     O_IN_Q: gl.constexpr, HALF: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                     STAGES: gl.constexpr, QBUFS: gl.constexpr):
        # The CTA's tiles in the producer's order: pid, pid + grid, ... (one tile unless the launch is
        # persistent, with fewer CTAs than tiles), or with a dynamic walk the tiles the producer drew.
        tiles = BH * gl.cdiv(N, 2 * HALF)
        t = 0
        kv = 0
        if DYNAMIC:
            tile = _get_tile(tile_ids, q_bars, t, CONSUMER, QBUFS)
            while tile < tiles:
                kv += _consume_tile(q_smem, k_smem, v_smem, o_smem, q_bars, q_empty, k_full, v_full, k_empty, v_empty,
                                    turn_bars, o_desc, lse_ptr, tile, t, kv, BH, HQ, GROUP, N, M, SECTION, qk_scale,
                                    CONSUMER, CAUSAL, PINGPONG, O_IN_Q, HALF, BLOCK_N, HEAD_DIM, STAGES, QBUFS)
                t += 1
                tile = _get_tile(tile_ids, q_bars, t, CONSUMER, QBUFS)
        else:
            for tile in range(gl.program_id(0), tiles, gl.num_programs(0)):
                kv += _consume_tile(q_smem, k_smem, v_smem, o_smem, q_bars, q_empty, k_full, v_full, k_empty, v_empty,
                                    turn_bars, o_desc, lse_ptr, tile, t, kv, BH, HQ, GROUP, N, M, SECTION, qk_scale,
                                    CONSUMER, CAUSAL, PINGPONG, O_IN_Q, HALF, BLOCK_N, HEAD_DIM, STAGES, QBUFS)
                t += 1
        tma.store_wait(0)
    # --8<-- [end:gluon-fwd-persistent]


    @gluon.jit
    def _fa_fwd_kernel(q_desc, k_desc, v_desc, o_desc, lse_ptr, counter_ptr,
                       BH, HQ, GROUP, N, M, SECTION, qk_scale,
                       HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                       CAUSAL: gl.constexpr, DYNAMIC: gl.constexpr, PINGPONG: gl.constexpr,
                       PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr, QBUFS: gl.constexpr):
        HALF: gl.constexpr = 64
        dtype: gl.constexpr = q_desc.dtype
        # O has a staging buffer of its own unless that would overflow shared memory (D = 256)
        O_IN_Q: gl.constexpr = HEAD_DIM > 128

        smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF, HEAD_DIM], dtype)
        # Q buffers of two halves each: with two, the next tile's Q loads while this one's last S runs
        gl.static_assert(QBUFS == 1 or not O_IN_Q)
        q_smem = gl.allocate_shared_memory(dtype, [2 * QBUFS, HALF, HEAD_DIM], q_layout)
        if O_IN_Q:
            o_smem = q_smem
        else:
            o_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_DIM], q_layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], smem_layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], smem_layout)
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
            (_fa_consumer, (q_smem, k_smem, v_smem, o_smem, q_bars, q_empty, k_full, v_full, k_empty, v_empty,
                            turn_bars, tile_ids, o_desc, lse_ptr, BH, HQ, GROUP, N, M, SECTION, qk_scale, 0, CAUSAL,
                            DYNAMIC, PINGPONG, O_IN_Q, HALF, BLOCK_N, HEAD_DIM, STAGES, QBUFS)),
            (_fa_consumer, (q_smem, k_smem, v_smem, o_smem, q_bars, q_empty, k_full, v_full, k_empty, v_empty,
                            turn_bars, tile_ids, o_desc, lse_ptr, BH, HQ, GROUP, N, M, SECTION, qk_scale, 1, CAUSAL,
                            DYNAMIC, PINGPONG, O_IN_Q, HALF, BLOCK_N, HEAD_DIM, STAGES, QBUFS)),
            (_fa_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, q_empty, k_full, v_full, k_empty,
                            v_empty, tile_ids, counter_ptr, BH, HQ, GROUP, N, M, SECTION, CAUSAL, DYNAMIC, HALF,
                            BLOCK_N, HEAD_DIM, STAGES, QBUFS)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])

    return _fa_fwd_kernel


class LazyKernel:
    """A Gluon kernel defined by ``build()`` at its first use, kept after it: ``kernel()`` returns it, or
    None where this Triton cannot build it (``error`` then says why). :mod:`flashattn.hopper_bwd`
    keeps its kernel the same way."""

    def __init__(self, build):
        self.build, self.kernel, self.error = build, None, None

    def __call__(self):
        if self.kernel is None and self.error is None:
            try:
                self.kernel = self.build()
            except Exception as e:  # e.g. a Triton whose Gluon lacks an API used here
                self.error = e
        return self.kernel

    def available(self) -> bool:
        """Whether the kernel can be built with the Triton installed here (Gluon of Triton 3.6)."""
        return triton_version_ok() and self() is not None


_get_kernel = LazyKernel(_build_kernel)


def descriptor(t, rows: int):
    """A Gluon TMA descriptor of the 4-d tensor ``t`` (B, H, L, D) read in [1, 1, rows, D] tiles, with
    its own strides (the head dim must be contiguous and the other strides 16-byte aligned)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    block = [1, 1, rows, t.shape[-1]]
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, _shared_layout(rows, t.shape[-1], t.dtype))


@functools.lru_cache(maxsize=None)
def _shared_layout(rows: int, head_dim: int, dtype):
    """The shared-memory layout (swizzle) of a [1, 1, rows, head_dim] tile: the same for every call."""
    import torch
    import triton.experimental.gluon.language as gl

    gdt = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}[dtype]
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, head_dim], gdt)


def launch(kernel, grid: int, args: tuple, constexprs: dict, warps: int = 4, record=None) -> None:
    """Launch a Gluon kernel of this module or :mod:`flashattn.hopper_bwd` through the package's
    launcher (:func:`flashattn.launch.launch`): after its first call with a signature, the compiled
    kernel is called directly, without ``kernel[grid](...)``'s binding and specialization of every
    argument, host work a Gluon launch would otherwise pay at every call
    (docs/kernels/tuning-log.md#gluon-kernels-dispatched-issue-15). A ``record``
    (:class:`flashattn.launch.Recording`) keeps the launch for the recipe of the launcher call."""
    from flashattn.launch import launch as launch_compiled

    launch_compiled(kernel, grid, args, constexprs, dict(num_warps=warps, maxnreg=MAXNREG), record)


def forward(q, k, v, causal: bool = False, scale: float | None = None, pingpong: bool | None = None,
            block_n: int | None = None, stages: int | None = None, out=None, persistent: bool | None = None,
            dynamic: bool | None = None, section: int | None = None, q_buffers: int | None = None,
            record=None):
    """FlashAttention forward on Hopper: returns (o, lse) with o like q and lse float32 (B, Hq, N).

    ``scale`` defaults to 1/sqrt(D). The rest are tuning knobs: ``pingpong``, ``block_n`` and
    ``stages`` default to :func:`_config`'s, ``persistent`` and ``dynamic`` to
    :func:`schedule_default`'s. ``persistent`` launches at most one CTA per SM instead of one per
    query block; each CTA walks the blocks pid, pid + grid, ..., or with ``dynamic`` draws its next
    block from a counter shared by all CTAs. Under causal the blocks go in sections of ``section``
    heads, the longest block of each head first (default :func:`section_default` for a persistent
    launch, 1 otherwise). ``q_buffers`` (1 or 2) is how many tiles' Q a persistent CTA holds: with
    two the producer loads the next tile's Q while the consumers finish this one (default
    :func:`q_buffers_default`; a CTA of one tile holds one). ``out``, when given, receives o: any (B, Hq, N, D) tensor of q's dtype
    whose head dim is contiguous, such as one laid out like q. A ``record``
    (:class:`flashattn.launch.Recording`) keeps the launch, and which argument is the tile counter."""
    import torch

    from flashattn._config import _sm_count
    from flashattn.tensors import ceil_div, describable, tile_counter
    from flashattn.constants import LOG2E

    kernel = _get_kernel()
    if kernel is None:
        raise RuntimeError(f"Gluon Hopper forward unavailable: {_get_kernel.error!r}")
    B, Hq, N, D = q.shape
    Bk, Hkv, M, Dk = k.shape
    assert v.shape == k.shape and Bk == B and Dk == D and Hq % Hkv == 0
    assert D in (64, 128, 256) and q.dtype in (torch.float16, torch.bfloat16)
    assert k.dtype == q.dtype and v.dtype == q.dtype
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    assert scale > 0, "the kernel takes row maxima of unscaled scores: scale must be positive"
    # TMA addresses the tensors in place when the head dim is contiguous and the start and strides are 16-byte aligned
    q, k, v = (x if describable(x) else x.contiguous() for x in (q, k, v))
    o = torch.empty((B, Hq, N, D), device=q.device, dtype=q.dtype) if out is None else out
    lse = torch.empty((B, Hq, N), device=q.device, dtype=torch.float32)
    if B * Hq * N == 0:
        return o, lse
    if M == 0:
        o.zero_()
        lse.fill_(-math.inf)
        return o, lse
    cfg_n, cfg_stages, cfg_pp = _config(D)
    block_n = block_n or cfg_n
    stages = stages or cfg_stages
    pingpong = cfg_pp if pingpong is None else pingpong
    default_persistent, default_dynamic = schedule_default(D, causal)
    persistent = (default_persistent and not pingpong) if persistent is None else persistent
    dynamic = persistent and (default_dynamic if dynamic is None else dynamic)
    assert not (pingpong and persistent), "ping-pong counts its turns within one tile: one tile per CTA"
    tiles = ceil_div(N, BLOCK_M) * B * Hq
    ctas = min(tiles, _sm_count(q.device.index)) if persistent else tiles
    if not causal:
        section = 1  # the order of equal blocks does not matter: head by head shares K/V in L2
    elif section is None:
        section = section_default(B * Hq, N, ctas) if persistent else 1
    section = max(1, min(section, B * Hq))
    if not persistent:
        q_buffers = 1
    elif q_buffers is None:
        q_buffers = q_buffers_default(D, causal)
    assert q_buffers in (1, 2) and (q_buffers == 1 or D <= 128), "two Q buffers fit shared memory up to D = 128"
    q_desc, k_desc, v_desc, o_desc = (descriptor(q, HALF_M), descriptor(k, block_n), descriptor(v, block_n),
                                      descriptor(o, HALF_M))
    # A dynamic walk's tile counter, zeroed for this call (flashattn.tensors.tile_counter), so that
    # calls on different streams, or the replays of a captured graph, never share one.
    counter = tile_counter(q.device) if dynamic else lse
    if dynamic and record is not None:
        record.add_counter(counter)
    launch(kernel, ctas,
           (q_desc, k_desc, v_desc, o_desc, lse, counter, B * Hq, Hq, Hq // Hkv, N, M, section,
            float(scale) * LOG2E),
           dict(HEAD_DIM=D, BLOCK_N=block_n, STAGES=stages, CAUSAL=bool(causal), DYNAMIC=dynamic,
                PINGPONG=bool(pingpong), PRODUCER_REGS=PRODUCER_REGS, CONSUMER_REGS=CONSUMER_REGS,
                QBUFS=q_buffers), record=record)
    return o, lse

