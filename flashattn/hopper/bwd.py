"""Host side of the Hopper-only (sm_90a) kernels of the backward pass written in Gluon, for Triton 3.6.

    bwd.dkdv(q, k, v, do, lse2, delta, dk, dv, causal, scale)   # fills dk, dv in place
    bwd.dq(q, k, v, do, lse2, delta, dq, causal, scale)         # fills dq in place

The kernels and their design are in :mod:`flashattn.hopper.bwd_kernels`: dK/dV for plain attention
(no variant, dense inputs), and dQ (:func:`dq`, laid out like the forward: one CTA per 128 query
rows), dispatched at D = 128 and 256 (``flashattn._config.GLUON_HEAD_DIMS``). Importing this module
never imports Gluon: the kernel module is imported at the first launch, where :func:`available` and
:func:`dq_available` say this Triton can define the kernels.
"""

from __future__ import annotations

import torch

from flashattn.hopper import fwd

BLOCK_N = 128          # key rows per CTA (two consumer warpgroups of 64 rows)
HALF_N = 64            # key rows per consumer warpgroup
BLOCK_M = 64           # query rows per step
STAGES = 2             # Q/dO ring depth
OVERLAP = True         # dV's product in flight while dS^T is computed
HEAD_DIMS = (64, 128)  # built for both; dispatched at 128 (flashattn._config.GLUON_HEAD_DIMS)
# dQ summed with atomics (deterministic=False): each warpgroup takes half of dQ's columns, a 64-column
# slice of K's shared-memory tile, which is one whole swizzle row only at D = 128
ATOMIC_DQ_HEAD_DIMS = (128,)
# the register split and the launch (maxnreg) are flashattn.hopper.fwd's: 24 for the producer, 240 per consumer


def _load_kernel():
    """The dK/dV kernel, from the module that defines it at module scope (importing Gluon)."""
    from flashattn.hopper import bwd_kernels

    return bwd_kernels._dkdv_kernel


_get_kernel = fwd.LazyKernel(_load_kernel)


def available() -> bool:
    """Whether the kernel can be built with the Triton installed here (Gluon of Triton 3.6)."""
    return _get_kernel.available()


def atomic_available() -> bool:
    """Whether the dK/dV kernel's ``ATOMIC_DQ`` mode can be built here: it adds dQ with a TMA reduction
    that only Gluon's builder creates (private to Triton, present in 3.6)."""
    if not available():
        return False
    from flashattn.hopper import bwd_kernels

    return bwd_kernels.TMA_REDUCE


def dkdv(q, k, v, do, lse2, delta, dk, dv, causal: bool, scale: float, stages: int | None = None,
         overlap: bool | None = None, record=None, dq_accum=None) -> None:
    """Fill ``dk`` and ``dv`` (laid out like k and v, head dim contiguous) for plain attention.

    q, do (B, Hq, N, D); k, v (B, Hkv, M, D), float16 or bfloat16, head dim contiguous and 16-byte
    aligned strides (TMA); ``lse2`` and ``delta`` float32 contiguous (B, Hq, N) from the backward's
    preprocess kernel; ``scale`` > 0 is the softmax scale. A ``record`` keeps the launch for a recipe.
    With ``dq_accum``, a zeroed float32 tensor shaped like q (head dim contiguous; D = 128 only,
    :data:`ATOMIC_DQ_HEAD_DIMS`), the kernel also adds dS K into it with TMA reductions (the
    nondeterministic backward): dQ is ``scale`` times it."""
    from flashattn.tensors import ceil_div
    from flashattn.constants import LOG2E

    kernel = fwd.require(_get_kernel, "dK/dV kernel")
    B, Hq, N, D = q.shape
    _, Hkv, M, _ = k.shape
    assert D in HEAD_DIMS and scale > 0
    atomic = dq_accum is not None
    assert not atomic or (D in ATOMIC_DQ_HEAD_DIMS and dq_accum.dtype == torch.float32 and dq_accum.shape[-1] == D
                          and dq_accum.stride(-1) == 1)
    describe = fwd.descriptor
    dk_desc = describe(dk, HALF_N)
    fwd.launch(kernel, ceil_div(M, BLOCK_N) * B * Hkv,
               (describe(q, BLOCK_M), describe(k, HALF_N), describe(v, HALF_N), describe(do, BLOCK_M),
                dk_desc, describe(dv, HALF_N), lse2, delta,
                describe(dq_accum, BLOCK_M, D // 2) if atomic else dk_desc,  # (never read without ATOMIC_DQ)
                Hq, Hkv, Hq // Hkv, N, M, float(scale) * LOG2E, float(scale)),
               dict(HEAD_DIM=D, BLOCK_M=BLOCK_M, STAGES=stages or STAGES, CAUSAL=bool(causal),
                    OVERLAP=OVERLAP if overlap is None else bool(overlap),
                    PRODUCER_REGS=fwd.PRODUCER_REGS, CONSUMER_REGS=fwd.CONSUMER_REGS, ATOMIC_DQ=atomic),
               record=record)


# dQ in Gluon: one CTA per 128 query rows of one (batch, query head), built like the forward (two
# consumer warpgroups of 64 rows, a TMA producer warp, a K/V ring); dispatched at D = 128 and 256.
DQ_BLOCK_N = 64        # keys per step
DQ_STAGES = 3          # K/V ring depth: K_j stays in its slot until dQ += dS_j K_j completes, a step later
DQ_HEAD_DIMS = (64, 128, 256)
# at D = 256, 32-key steps: beside the Q and dO halves (128 KiB), a ring of 64-key K and V tiles takes
# 64 KiB a stage, over the 227 KiB a CTA can have from two stages; 32-key ones in three stages: 224 KiB
DQ_BLOCK_N_256 = 32


def _load_dq_kernel():
    """The dQ kernel, from the module that defines it at module scope (importing Gluon)."""
    from flashattn.hopper import bwd_kernels

    return bwd_kernels._dq_kernel


_get_dq_kernel = fwd.LazyKernel(_load_dq_kernel)


def dq_available() -> bool:
    """Whether the Gluon dQ kernel can be built with the Triton installed here (Gluon of Triton 3.6)."""
    return _get_dq_kernel.available()


def dq(q, k, v, do, lse2, delta, dq_out, causal: bool, scale: float, block_n: int | None = None,
       stages: int | None = None, record=None) -> None:
    """Fill ``dq_out`` (laid out like q, head dim contiguous) for plain attention; the inputs are those
    of :func:`dkdv`. The backward runs it where ``flashattn._config.gluon_kernel("bwd_dq", ...)``
    says so: large plain problems at D = 128 and 256, where it speeds up the backward
    (docs/kernels/tuning-log.md#a-dq-kernel-in-gluon-issue-15-built-not-dispatched,
    docs/kernels/tuning-log.md#dq-in-gluon-at-d-256-issue-15). A ``record`` keeps the launch for a recipe."""
    from flashattn.tensors import ceil_div
    from flashattn.constants import LOG2E

    kernel = fwd.require(_get_dq_kernel, "dQ kernel")
    B, Hq, N, D = q.shape
    _, Hkv, M, _ = k.shape
    assert D in DQ_HEAD_DIMS and scale > 0
    block_n = block_n or (DQ_BLOCK_N_256 if D == 256 else DQ_BLOCK_N)
    describe = fwd.descriptor
    # laid out per query block like the forward: 128 rows per CTA, 64 per consumer warpgroup
    fwd.launch(kernel, ceil_div(N, fwd.BLOCK_M) * B * Hq,
               (describe(q, fwd.HALF_M), describe(k, block_n), describe(v, block_n),
                describe(do, fwd.HALF_M), describe(dq_out, fwd.HALF_M), lse2, delta,
                Hq, Hq // Hkv, N, M, float(scale) * LOG2E, float(scale)),
               dict(HEAD_DIM=D, BLOCK_N=block_n, STAGES=stages or DQ_STAGES, CAUSAL=bool(causal),
                    PRODUCER_REGS=fwd.PRODUCER_REGS, CONSUMER_REGS=fwd.CONSUMER_REGS),
               record=record)
