"""The Hopper-only (sm_90a) kernels of the backward pass, written in Gluon for Triton 3.6: dK/dV
(``_dkdv_kernel``) and dQ (``_dq_kernel``).

Their host side (configuration, launches, ``dkdv`` and ``dq``) is :mod:`flashattn.hopper.bwd`, which
imports this module, and Gluon with it, at the first launch. The dK/dV kernel computes what
:func:`flashattn.backward._bwd_dkdv_kernel` computes for plain attention (no variant, dense inputs),
reading the same scratch rows: ``lse2`` (the forward's LSE in base 2, with the rows that saw no key
pivoted at 0) and ``delta`` (rowsum(dO * O)), both float32 (B, Hq, N).

dK/dV design (one CTA per 128-row key block of one (batch, K/V head)):

* three warp-specialized partitions (``gl.warp_specialize``):
  - consumer 0: the default partition, one warpgroup, key rows [0, 64) of the block;
  - consumer 1: a worker partition, one warpgroup, key rows [64, 128);
  - producer: one warp that issues every TMA load: the K and V halves once, then a Q tile and a dO
    tile of 64 query rows per step into a ring of ``STAGES`` shared-memory slots, for every query
    head of the group and every query block that sees the key block.
  Each consumer holds its two float32 accumulators, dV and dK (64 x D each), for the whole loop:
  at D = 128 they take 128 of its 240 registers.
* per step a consumer issues S^T = K Q^T and dP^T = V dO^T back to back (async wgmma), waits for
  S^T only and recomputes P^T = exp2(c S^T - lse2) while dP^T runs, then forms
  dS^T = P^T * (dP^T - delta) and issues dV += P^T dO and dK += dS^T Q with P^T and dS^T as register
  operands. Summing the group's query heads inside the CTA keeps GQA deterministic (no atomics).
* query blocks are walked like the portable kernel's: the ones straddling the causal diagonal and the
  ragged last block take the mask, the others none; blocks that see no key of the CTA are never
  loaded.

With ``ATOMIC_DQ`` (the nondeterministic backward, not dispatched by default) the dK/dV kernel also
adds each step's dQ share into a float32 accumulator with TMA reductions (``_dkdv_dq_products``), and
the dQ kernel does not run; dK and dV keep their bits.

dQ: one CTA per 128 query rows of one (batch, query head), laid out like the forward of
:mod:`flashattn.hopper.fwd_kernels` (two consumer warpgroups of 64 rows, a TMA producer warp, a K/V
ring) and sharing its helpers (:mod:`flashattn.hopper.common`).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

from flashattn.hopper.common import load_kv_ring, masked_scores, tile_coords

try:  # private to Triton (Gluon's builtin decorator, its builder's TMA reduction): only ATOMIC_DQ needs them
    from triton._C.libtriton import gluon_ir, ir
    from triton.experimental.gluon.language._core import builtin

    TMA_REDUCE = hasattr(gluon_ir.GluonOpBuilder, "create_async_tma_reduce")
except ImportError:
    TMA_REDUCE = False


# --8<-- [start:gluon-dkdv-producer]
@gluon.jit
def _dkdv_producer(q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_smem, do_smem, kv_bar, full, empty,
                   b, hkv, n0, first_block, n_blocks, GROUP,
                   HALF: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    # One warp: the two K and V halves once, then (Q, dO) tiles into the ring.
    HALF_BYTES: gl.constexpr = HALF * HEAD_DIM * 2
    TILE_BYTES: gl.constexpr = BLOCK_M * HEAD_DIM * 2
    mbarrier.expect(kv_bar, 4 * HALF_BYTES)
    for c in gl.static_range(2):
        tma.async_copy_global_to_shared(k_desc, [b, hkv, n0 + c * HALF, 0], kv_bar,
                                        k_smem.index(c).reshape([1, 1, HALF, HEAD_DIM]))
        tma.async_copy_global_to_shared(v_desc, [b, hkv, n0 + c * HALF, 0], kv_bar,
                                        v_smem.index(c).reshape([1, 1, HALF, HEAD_DIM]))
    for t in range(GROUP * n_blocks):
        hq = hkv * GROUP + t // n_blocks
        m0 = (first_block + t % n_blocks) * BLOCK_M
        s = t % STAGES
        # a fresh mbarrier counts as having completed the phase before phase 0: the first STAGES
        # waits (parity 1) return at once
        mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)
        mbarrier.expect(full.index(s), 2 * TILE_BYTES)
        tma.async_copy_global_to_shared(q_desc, [b, hq, m0, 0], full.index(s),
                                        q_smem.index(s).reshape([1, 1, BLOCK_M, HEAD_DIM]))
        tma.async_copy_global_to_shared(do_desc, [b, hq, m0, 0], full.index(s),
                                        do_smem.index(s).reshape([1, 1, BLOCK_M, HEAD_DIM]))
# --8<-- [end:gluon-dkdv-producer]


# --8<-- [start:gluon-dkdv-step]
@gluon.jit
def _dkdv_step(t, m0, k_c, v_c, q_smem, do_smem, full, empty, dk, dv, lse2_ptr, delta_ptr, row_base,
               key0, N, M, qk_scale, k_smem, ds_smem, ds_full, ds_empty, dq_desc, dq_smem, dq_at,
               MASK: gl.constexpr, CAUSAL: gl.constexpr, HALF: gl.constexpr, BLOCK_M: gl.constexpr,
               STAGES: gl.constexpr, OVERLAP: gl.constexpr, st_layout: gl.constexpr, a_layout: gl.constexpr,
               row_layout: gl.constexpr, HEAD_DIM: gl.constexpr, ATOMIC_DQ: gl.constexpr, CONSUMER: gl.constexpr):
    # Query block [m0, m0 + BLOCK_M) of one head against this warpgroup's 64 keys, transposed:
    # rows are keys, columns are queries.
    s = t % STAGES
    cols = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))  # [BLOCK_M] query index
    # The rows' statistics, loaded before the wait so their latency hides behind it; rows past N
    # read 0 and lie only in masked steps. Loaded one row per thread, then spread to the columns
    # of the wgmma layout: loaded in that layout, every thread would hold 16 addresses per vector.
    rows = m0 + gl.arange(0, BLOCK_M, layout=row_layout)
    lse2 = gl.load(lse2_ptr + row_base + rows, mask=rows < N, other=0.0)
    delta = gl.load(delta_ptr + row_base + rows, mask=rows < N, other=0.0)
    lse2 = gl.convert_layout(lse2, gl.SliceLayout(0, st_layout))
    delta = gl.convert_layout(delta, gl.SliceLayout(0, st_layout))
    mbarrier.wait(full.index(s), (t // STAGES) & 1)
    q_t = q_smem.index(s)
    do_t = do_smem.index(s)
    zeros = gl.zeros([HALF, BLOCK_M], gl.float32, st_layout)
    st_tok = warpgroup_mma(k_c, q_t.permute((1, 0)), zeros, use_acc=False, is_async=True)
    dpt_tok = warpgroup_mma(v_c, do_t.permute((1, 0)), zeros, use_acc=False, is_async=True)
    st = warpgroup_mma_wait(1, deps=(st_tok, ))  # [HALF, BLOCK_M] raw q . k, keys by queries
    if MASK:
        # rows past N and (causal) keys a query may not see go to -inf before the exponential, so
        # their P^T is exactly 0 whatever the pivot: lse2 is 0 for rows that saw no key
        keys = key0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, st_layout))
        keep = gl.expand_dims(cols < N, 0)
        if CAUSAL:
            keep = keep & (gl.expand_dims(keys, 1) <= gl.expand_dims(cols + (M - N), 0))
        st = gl.where(keep, st, -float("inf"))
    pt = gl.exp2(st * qk_scale - gl.expand_dims(lse2, 0))  # P^T in [0, 1]
    pt_op = gl.convert_layout(pt.to(q_t.dtype), a_layout)
    if OVERLAP:
        # dV += P^T dO runs under the arithmetic of dS^T: wgmma groups complete in order, so
        # waiting for all but the newest (this one) completes dP^T
        dv_tok = warpgroup_mma(pt_op, do_t, dv, is_async=True)
        dpt = warpgroup_mma_wait(1, deps=(dpt_tok, ))
    else:
        dpt = warpgroup_mma_wait(0, deps=(dpt_tok, ))
    dst = pt * (dpt - gl.expand_dims(delta, 0))  # dS^T = P^T (dP^T - delta), delta per query
    if ATOMIC_DQ:
        dk, dv = _dkdv_dq_products(dst, pt_op, dv_tok, do_t, q_t, dk, dv, k_smem, ds_smem, ds_full, ds_empty,
                                   dq_desc, dq_smem, dq_at[0], dq_at[1], m0, t, HALF, BLOCK_M, HEAD_DIM, OVERLAP,
                                   st_layout, CONSUMER)
    else:
        dst_op = gl.convert_layout(dst.to(q_t.dtype), a_layout)
        if not OVERLAP:
            dv_tok = warpgroup_mma(pt_op, do_t, dv, is_async=True)
        dk_tok = warpgroup_mma(dst_op, q_t, dk, is_async=True)
        dv, dk, pt_op, dst_op = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, pt_op, dst_op))
    mbarrier.arrive(empty.index(s))  # this stage's Q and dO are read
    return dk, dv
# --8<-- [end:gluon-dkdv-step]


# --8<-- [start:gluon-atomic-dq]
# The nondeterministic backward (ATOMIC_DQ, flash_attn's deterministic=False): the dK/dV kernel also
# adds this step's share of dQ, dS K summed over the CTA's 128 keys, into a float32 (B, Hq, N, D)
# accumulator, so the dQ kernel and its two recomputed products are skipped. The two warpgroups write
# their dS^T halves to shared memory (dK's operand there too); once both are in, each warpgroup takes
# half of dQ's columns, dQ[:, c] = dS_0 K_0[:, c] + dS_1 K_1[:, c], stages it in shared memory and
# has the TMA unit add it to global memory (a bulk reduction; per-element atomics from the registers
# were slower still). The order in which CTAs' additions land varies from run to run, and so do dQ's
# last bits. It is not dispatched by default: it measured slower than the deterministic pair
# (docs/kernels/tuning-log.md#a-nondeterministic-backward-in-gluon-issue-46).
@gluon.jit
def _dkdv_dq_products(dst, pt_op, dv_tok, do_t, q_t, dk, dv, k_smem, ds_smem, ds_full, ds_empty, dq_desc, dq_smem,
                      b, hq, m0, t, HALF: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr,
                      OVERLAP: gl.constexpr, dq_layout: gl.constexpr, CONSUMER: gl.constexpr):
    COLS: gl.constexpr = HEAD_DIM // 2
    # this warpgroup's dS^T half, once the last step's dQ products (both warpgroups') have read it
    mbarrier.wait(ds_empty, (t & 1) ^ 1)
    ds_c = ds_smem.index(CONSUMER)
    ds_c.store(dst.to(q_t.dtype))
    fence_async_shared()
    gl.thread_barrier()  # every thread's part is written before the arrive that announces it
    mbarrier.arrive(ds_full)
    if not OVERLAP:
        dv_tok = warpgroup_mma(pt_op, do_t, dv, is_async=True)
    dk_tok = warpgroup_mma(ds_c, q_t, dk, is_async=True)
    mbarrier.wait(ds_full, t & 1)  # both halves of dS^T are in
    zeros = gl.zeros([BLOCK_M, COLS], gl.float32, dq_layout)
    dq = warpgroup_mma(ds_smem.index(0).permute((1, 0)), k_smem.index(0).slice(CONSUMER * COLS, COLS, dim=1),
                       zeros, use_acc=False, is_async=True)
    dq_tok = warpgroup_mma(ds_smem.index(1).permute((1, 0)), k_smem.index(1).slice(CONSUMER * COLS, COLS, dim=1),
                           dq, is_async=True)
    dv, dk, dq, pt_op = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, dq_tok, pt_op))
    mbarrier.arrive(ds_empty)
    # two staging buffers per warpgroup: the reduction issued two steps ago has read this one
    buf = dq_smem.index(2 * CONSUMER + (t & 1))
    tma.store_wait(1)
    buf.store(dq)
    fence_async_shared()
    _tma_reduce_add(dq_desc, [b, hq, m0, CONSUMER * COLS], buf.reshape([1, 1, BLOCK_M, COLS]))
    return dk, dv


if TMA_REDUCE:
    @builtin
    def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
        # global[coord ...] += src (shared memory) through the TMA unit: cp.reduce.async.bulk.tensor's
        # add, which Gluon's builder of Triton 3.6 creates but its language does not expose; completes
        # like a TMA store (tma.store_wait)
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                  src.handle)
else:
    @gluon.jit
    def _tma_reduce_add(tensor_desc, coord, src):
        gl.static_assert(False, "this Triton's Gluon builds no TMA reduction (flashattn.hopper.bwd.atomic_available)")
# --8<-- [end:gluon-atomic-dq]


@gluon.jit
def _dkdv_consumer(k_smem, v_smem, q_smem, do_smem, kv_bar, full, empty, dk_desc, dv_desc, lse2_ptr, delta_ptr,
                   b, hkv, n0, first_block, mid_block, full_blocks, n_blocks, GROUP, HQ, N, M, qk_scale, scale,
                   ds_smem, ds_full, ds_empty, dq_desc, dq_smem,
                   CONSUMER: gl.constexpr, CAUSAL: gl.constexpr, HALF: gl.constexpr, BLOCK_M: gl.constexpr,
                   HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, OVERLAP: gl.constexpr, ATOMIC_DQ: gl.constexpr):
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    key0 = n0 + CONSUMER * HALF
    k_c = k_smem.index(CONSUMER)
    v_c = v_smem.index(CONSUMER)
    mbarrier.wait(kv_bar, 0)
    dk = gl.zeros([HALF, HEAD_DIM], gl.float32, acc_layout)
    dv = gl.zeros([HALF, HEAD_DIM], gl.float32, acc_layout)
    # Query blocks [first, mid) straddle the causal diagonal, [mid, full) see every key of the CTA,
    # [max(mid, full), n) is the ragged last block: masked, unmasked, masked.
    t = 0
    for g in range(GROUP):
        row_base = (b * HQ + hkv * GROUP + g).to(gl.int64) * N  # lse2 and delta are (B, Hq, N)
        dq_at = (b, hkv * GROUP + g)  # with ATOMIC_DQ, where this head's dQ rows are added
        for part in gl.static_range(3):  # masked, unmasked, masked: three loops, unrolled here
            if part == 0:
                lo, hi = first_block, mid_block
            elif part == 1:
                lo, hi = mid_block, full_blocks
            else:
                lo, hi = gl.maximum(mid_block, full_blocks), first_block + n_blocks
            for j in range(lo, hi):
                dk, dv = _dkdv_step(t, j * BLOCK_M, k_c, v_c, q_smem, do_smem, full, empty, dk, dv, lse2_ptr,
                                    delta_ptr, row_base, key0, N, M, qk_scale, k_smem, ds_smem, ds_full, ds_empty,
                                    dq_desc, dq_smem, dq_at, part != 1, CAUSAL, HALF, BLOCK_M,
                                    STAGES, OVERLAP, st_layout, a_layout, row_layout, HEAD_DIM,
                                    ATOMIC_DQ, CONSUMER)
                t += 1
    # dK = scale dS^T Q (the natural scale: the scores' log2(e) lives only in the exponent).
    # K and V of this warpgroup are dead (its last products have completed): stage the results
    # there and TMA-store them; TMA clips key rows >= M.
    if ATOMIC_DQ:  # the other warpgroup's dQ products read this K half too: wait for its last one
        mbarrier.wait(ds_empty, (t & 1) ^ 1)
    k_c.store((dk * scale).to(k_c.dtype))
    v_c.store(dv.to(v_c.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [b, hkv, key0, 0], k_c.reshape([1, 1, HALF, HEAD_DIM]))
    tma.async_copy_shared_to_global(dv_desc, [b, hkv, key0, 0], v_c.reshape([1, 1, HALF, HEAD_DIM]))
    tma.store_wait(0)


@gluon.jit
def _dkdv_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse2_ptr, delta_ptr, dq_desc,
                 HQ, HKV, GROUP, N, M, qk_scale, scale,
                 HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                 OVERLAP: gl.constexpr, PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                 ATOMIC_DQ: gl.constexpr = False):
    HALF: gl.constexpr = 64
    BLOCK_N: gl.constexpr = 2 * HALF
    dtype: gl.constexpr = q_desc.dtype
    # Grid axis 0 enumerates (key block, batch * K/V head), key block fastest: CTAs that run
    # together read the same Q and dO from L2. Under the causal mask the first key blocks see the
    # most queries, so they also go first.
    num_nb = gl.cdiv(M, BLOCK_N)
    pid = gl.program_id(0)
    bh = pid // num_nb
    n0 = (pid % num_nb) * BLOCK_N
    b = bh // HKV
    hkv = bh % HKV

    num_mb = gl.cdiv(N, BLOCK_M)
    full_blocks = N // BLOCK_M  # query blocks with no row past N
    if CAUSAL:
        # query i sees key j iff j <= i + M - N: the first query seeing key n0, and the first from
        # which every row sees all BLOCK_N keys
        first_block = gl.maximum(n0 - (M - N), 0) // BLOCK_M
        mid_block = gl.minimum(gl.cdiv(gl.maximum(n0 + BLOCK_N - 1 - (M - N), 0), BLOCK_M), num_mb)
        mid_block = gl.maximum(mid_block, first_block)
        first_block = gl.minimum(first_block, num_mb)
    else:
        first_block = 0
        mid_block = 0
    n_blocks = num_mb - first_block

    k_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF, HEAD_DIM], dtype)
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    k_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_DIM], k_layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_DIM], k_layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(full.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # one arrive from each consumer
    if ATOMIC_DQ:
        # both warpgroups' dS^T halves, [keys, queries]; "full" once both are written, "empty" once
        # both warpgroups' dQ products have read them
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF, BLOCK_M], dtype)
        ds_smem = gl.allocate_shared_memory(dtype, [2, HALF, BLOCK_M], ds_layout)
        # dQ's staging buffers for the TMA reductions: two per warpgroup, [BLOCK_M, D / 2] float32
        dq_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM // 2], gl.float32)
        dq_smem = gl.allocate_shared_memory(gl.float32, [4, BLOCK_M, HEAD_DIM // 2], dq_layout)
        ds_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ds_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(ds_full, count=2)
        mbarrier.init(ds_empty, count=2)
    else:  # never read
        ds_smem = k_smem
        dq_smem = k_smem
        ds_full = kv_bar
        ds_empty = kv_bar
    fence_async_shared()

    # --8<-- [start:gluon-dkdv-partitions]
    gl.warp_specialize([
        (_dkdv_consumer, (k_smem, v_smem, q_smem, do_smem, kv_bar, full, empty, dk_desc, dv_desc, lse2_ptr,
                          delta_ptr, b, hkv, n0, first_block, mid_block, full_blocks, n_blocks, GROUP, HQ, N, M,
                          qk_scale, scale, ds_smem, ds_full, ds_empty, dq_desc, dq_smem,
                          0, CAUSAL, HALF, BLOCK_M, HEAD_DIM, STAGES, OVERLAP, ATOMIC_DQ)),
        (_dkdv_consumer, (k_smem, v_smem, q_smem, do_smem, kv_bar, full, empty, dk_desc, dv_desc, lse2_ptr,
                          delta_ptr, b, hkv, n0, first_block, mid_block, full_blocks, n_blocks, GROUP, HQ, N, M,
                          qk_scale, scale, ds_smem, ds_full, ds_empty, dq_desc, dq_smem,
                          1, CAUSAL, HALF, BLOCK_M, HEAD_DIM, STAGES, OVERLAP, ATOMIC_DQ)),
        (_dkdv_producer, (q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_smem, do_smem, kv_bar, full, empty,
                          b, hkv, n0, first_block, n_blocks, GROUP, HALF, BLOCK_M, HEAD_DIM, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    # --8<-- [end:gluon-dkdv-partitions]


@gluon.jit
def _dq_producer(q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_smem, v_smem, qdo_bar, k_full, v_full,
                 k_empty, v_empty, b, hq, hkv, m0, n_total,
                 HALF: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    # One warp: the Q and dO halves once, then K and V tiles into the ring (as in the forward).
    HALF_BYTES: gl.constexpr = HALF * HEAD_DIM * 2
    mbarrier.expect(qdo_bar, 4 * HALF_BYTES)
    for c in gl.static_range(2):
        tma.async_copy_global_to_shared(q_desc, [b, hq, m0 + c * HALF, 0], qdo_bar,
                                        q_smem.index(c).reshape([1, 1, HALF, HEAD_DIM]))
        tma.async_copy_global_to_shared(do_desc, [b, hq, m0 + c * HALF, 0], qdo_bar,
                                        do_smem.index(c).reshape([1, 1, HALF, HEAD_DIM]))
    load_kv_ring(k_desc, v_desc, k_smem, v_smem, k_full, v_full, k_empty, v_empty, b, hkv, n_total, 0,
                 BLOCK_N, HEAD_DIM, STAGES, False)


@gluon.jit
def _dq_scores(s, dp, lse2, delta, n0, row0, N, M, qk_scale,
               MASK: gl.constexpr, CAUSAL: gl.constexpr, HALF: gl.constexpr, BLOCK_N: gl.constexpr,
               s_layout: gl.constexpr):
    # dS = P (dP - delta) of one [HALF, BLOCK_N] tile, P recomputed from the base-2 LSE; keys past M
    # and (causal) keys a row may not see go to -inf before the exponential, so their P is exactly 0
    if MASK:
        s = masked_scores(s, n0, row0, M, M - N, CAUSAL, HALF, BLOCK_N, s_layout)
    p = gl.exp2(s * qk_scale - gl.expand_dims(lse2, 1))
    return p * (dp - gl.expand_dims(delta, 1))


# --8<-- [start:gluon-dq-step]
@gluon.jit
def _dq_step(i, q, do, k_smem, v_smem, k_full, v_full, k_empty, v_empty, dq, ds, lse2, delta, row0, N, M,
             qk_scale, MASK: gl.constexpr, CAUSAL: gl.constexpr, HALF: gl.constexpr, BLOCK_N: gl.constexpr,
             STAGES: gl.constexpr, s_layout: gl.constexpr, a_layout: gl.constexpr):
    # Key block i: S_i = Q K_i^T, dP_i = dO V_i^T and dQ += dS_{i-1} K_{i-1} in flight together;
    # dS_i is formed while the dQ product of the block before runs.
    si = i % STAGES
    ph = (i // STAGES) & 1
    sj = (i - 1) % STAGES
    mbarrier.wait(k_full.index(si), ph)
    mbarrier.wait(v_full.index(si), ph)
    zeros = gl.zeros([HALF, BLOCK_N], gl.float32, s_layout)
    s_tok = warpgroup_mma(q, k_smem.index(si).permute((1, 0)), zeros, use_acc=False, is_async=True)
    dp_tok = warpgroup_mma(do, v_smem.index(si).permute((1, 0)), zeros, use_acc=False, is_async=True)
    dq_tok = warpgroup_mma(ds, k_smem.index(sj), dq, is_async=True)
    s = warpgroup_mma_wait(2, deps=(s_tok, ))
    dp = warpgroup_mma_wait(1, deps=(dp_tok, ))
    mbarrier.arrive(v_empty.index(si))
    ds_new = _dq_scores(s, dp, lse2, delta, i * BLOCK_N, row0, N, M, qk_scale, MASK, CAUSAL, HALF, BLOCK_N,
                        s_layout)
    dq, ds = warpgroup_mma_wait(0, deps=(dq_tok, ds))
    mbarrier.arrive(k_empty.index(sj))
    return dq, gl.convert_layout(ds_new.to(q.dtype), a_layout)
# --8<-- [end:gluon-dq-step]


@gluon.jit
def _dq_consumer(q_smem, do_smem, k_smem, v_smem, qdo_bar, k_full, v_full, k_empty, v_empty, dq_desc, lse2_ptr,
                 delta_ptr, b, hq, bh, m0, N, M, n_full, n_total, qk_scale, scale,
                 CONSUMER: gl.constexpr, CAUSAL: gl.constexpr, HALF: gl.constexpr, BLOCK_N: gl.constexpr,
                 HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    # One warpgroup: query rows [m0 + CONSUMER * HALF, + HALF).
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    row0 = m0 + CONSUMER * HALF
    # lse2 (pivoted at 0 for rows that saw no key) and delta of the rows; rows past N read 0, and
    # their dS is 0 (their dO is 0); loaded one per thread, then spread to the rows of the layout
    rows = row0 + gl.arange(0, HALF, layout=row_layout)
    lse2 = gl.load(lse2_ptr + bh.to(gl.int64) * N + rows, mask=rows < N, other=0.0)
    delta = gl.load(delta_ptr + bh.to(gl.int64) * N + rows, mask=rows < N, other=0.0)
    lse2 = gl.convert_layout(lse2, gl.SliceLayout(1, s_layout))
    delta = gl.convert_layout(delta, gl.SliceLayout(1, s_layout))
    q = q_smem.index(CONSUMER)
    do = do_smem.index(CONSUMER)
    mbarrier.wait(qdo_bar, 0)
    dq = gl.zeros([HALF, HEAD_DIM], gl.float32, acc_layout)
    if n_total > 0:
        # Prologue: block 0 alone (always masked: it may be the ragged or diagonal block).
        mbarrier.wait(k_full.index(0), 0)
        mbarrier.wait(v_full.index(0), 0)
        zeros = gl.zeros([HALF, BLOCK_N], gl.float32, s_layout)
        s_tok = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), zeros, use_acc=False, is_async=True)
        dp_tok = warpgroup_mma(do, v_smem.index(0).permute((1, 0)), zeros, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s_tok, ))
        dp = warpgroup_mma_wait(0, deps=(dp_tok, ))
        mbarrier.arrive(v_empty.index(0))
        ds = _dq_scores(s, dp, lse2, delta, 0, row0, N, M, qk_scale, True, CAUSAL, HALF, BLOCK_N, s_layout)
        ds = gl.convert_layout(ds.to(q.dtype), a_layout)
        for i in range(1, n_full):  # key blocks every row of the CTA sees in full
            dq, ds = _dq_step(i, q, do, k_smem, v_smem, k_full, v_full, k_empty, v_empty, dq, ds, lse2, delta,
                              row0, N, M, qk_scale, False, CAUSAL, HALF, BLOCK_N, STAGES, s_layout, a_layout)
        for i in range(gl.maximum(n_full, 1), n_total):  # diagonal and ragged blocks
            dq, ds = _dq_step(i, q, do, k_smem, v_smem, k_full, v_full, k_empty, v_empty, dq, ds, lse2, delta,
                              row0, N, M, qk_scale, True, CAUSAL, HALF, BLOCK_N, STAGES, s_layout, a_layout)
        # Epilogue: the last dQ product.
        last = (n_total - 1) % STAGES
        dq_tok = warpgroup_mma(ds, k_smem.index(last), dq, is_async=True)
        dq, ds = warpgroup_mma_wait(0, deps=(dq_tok, ds))
        mbarrier.arrive(k_empty.index(last))
    # dQ = scale dS K. The Q tile is dead (every S product has completed): stage dQ there and
    # TMA-store it; TMA clips rows >= N.
    q.store((dq * scale).to(q.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dq_desc, [b, hq, row0, 0], q.reshape([1, 1, HALF, HEAD_DIM]))
    tma.store_wait(0)


@gluon.jit
def _dq_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, lse2_ptr, delta_ptr, HQ, GROUP, N, M, qk_scale, scale,
               HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
               PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    HALF: gl.constexpr = 64
    BLOCK_M: gl.constexpr = 2 * HALF
    dtype: gl.constexpr = q_desc.dtype
    # one tile per CTA: the program id numbers it
    b, hq, hkv, bh, m0, n_total, n_full = tile_coords(gl.program_id(0), gl.num_programs(0) // gl.cdiv(N, BLOCK_M),
                                                      N, M, HQ, GROUP, 1, BLOCK_M, BLOCK_N, CAUSAL)

    half_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF, HEAD_DIM], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_DIM], half_layout)
    do_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_DIM], half_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    qdo_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(qdo_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_full.index(s), count=1)
        mbarrier.init(v_full.index(s), count=1)
        mbarrier.init(k_empty.index(s), count=2)  # one arrive from each consumer
        mbarrier.init(v_empty.index(s), count=2)
    fence_async_shared()

    gl.warp_specialize([
        (_dq_consumer, (q_smem, do_smem, k_smem, v_smem, qdo_bar, k_full, v_full, k_empty, v_empty, dq_desc,
                        lse2_ptr, delta_ptr, b, hq, bh, m0, N, M, n_full, n_total, qk_scale, scale, 0, CAUSAL,
                        HALF, BLOCK_N, HEAD_DIM, STAGES)),
        (_dq_consumer, (q_smem, do_smem, k_smem, v_smem, qdo_bar, k_full, v_full, k_empty, v_empty, dq_desc,
                        lse2_ptr, delta_ptr, b, hq, bh, m0, N, M, n_full, n_total, qk_scale, scale, 1, CAUSAL,
                        HALF, BLOCK_N, HEAD_DIM, STAGES)),
        (_dq_producer, (q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_smem, v_smem, qdo_bar, k_full,
                        v_full, k_empty, v_empty, b, hq, hkv, m0, n_total, HALF, BLOCK_N, HEAD_DIM, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
