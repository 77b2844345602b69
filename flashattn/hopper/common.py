"""Gluon functions shared by the Hopper kernels laid out per query block (the forward of
:mod:`flashattn.hopper.fwd_kernels` and the dQ kernel of :mod:`flashattn.hopper.bwd_kernels`):

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
  it; ``base`` is the number of fills the ring took before (a persistent CTA's earlier tiles). With
  ``V_KEYS_LAST`` v is read as (B, Hkv, D, M) in [D, BLOCK_N] tiles (the float8 forward's layout).

Like the kernels, this module imports Gluon at its top; the host modules import it only at a launch.
"""

from __future__ import annotations

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
                 BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, V_KEYS_LAST: gl.constexpr):
    # V_KEYS_LAST: v is laid out (B, Hkv, D, M) and its tiles are [HEAD_DIM, BLOCK_N] (the float8 forward)
    KV_BYTES: gl.constexpr = BLOCK_N * HEAD_DIM * (k_desc.dtype.primitive_bitwidth // 8)
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
        if V_KEYS_LAST:
            tma.async_copy_global_to_shared(v_desc, [b, hkv, 0, i * BLOCK_N], v_full.index(s),
                                            v_smem.index(s).reshape([1, 1, HEAD_DIM, BLOCK_N]))
        else:
            tma.async_copy_global_to_shared(v_desc, [b, hkv, i * BLOCK_N, 0], v_full.index(s),
                                            v_smem.index(s).reshape([1, 1, BLOCK_N, HEAD_DIM]))
