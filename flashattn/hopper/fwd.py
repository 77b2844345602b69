"""Host side of the Hopper-only (sm_90a) FlashAttention forward written in Gluon, for Triton 3.6.

    o, lse = forward(q, k, v, causal, scale)      # q (B, Hq, N, D); k, v (B, Hkv, M, D)

The kernel and its design are in :mod:`flashattn.hopper.fwd_kernels`; this module holds what the
launch needs around it: the tile configuration, the default walk (persistent or not, static or
dynamic, sections of heads, Q buffers), the host model of a persistent walk (:func:`walk_work`),
which inputs it takes (:func:`supported`), the TMA descriptors and the launch. Importing it never
imports Gluon: the kernel module is imported at the first launch, where :func:`available` says
this Triton can define it.
"""

from __future__ import annotations

import functools
import math

BLOCK_M = 128          # query rows per CTA (two consumer warpgroups of 64 rows)
HALF_M = 64            # query rows per consumer warpgroup
MAXNREG = 168          # per-thread register cap of the whole kernel (see fwd_kernels' docstring)
PRODUCER_REGS = 24
CONSUMER_REGS = 240
FP8_HEAD_DIMS = (64, 128)  # float8 inputs: O has no room in the Q buffer at D = 256 (it is 16-bit there)



def _config(head_dim: int, fp8: bool = False, causal: bool = False):
    """(BLOCK_N, STAGES, PINGPONG) for a head dim. The K+V ring plus the two Q halves must fit the
    227 KB of shared memory; BLOCK_N must be a power of two (192 is not expressible), and 256 spills
    at D=64. A deeper ring, 64-key blocks where 128 fit and ping-pong ordering are no faster, so the
    ring has two stages and ping-pong is off by default (``forward(..., pingpong=True)`` turns it on;
    docs/kernels/tuning-log.md#a-hopper-forward-in-gluon-issue-15-dispatched-in-the-next-section).
    Float8 tiles take half the bytes: 256-key blocks in two stages without a mask, 128-key blocks in
    three under causal, whose diagonal blocks mask more keys the wider they are
    (docs/kernels/tuning-log.md#a-float8-gluon-forward-issue-46)."""
    if fp8:
        # D = 128 without a mask: Q 32 KB, O 32 KB, P 32 KB + 2 * (32 + 32) KB = 224 KB;
        # causal (one Q buffer): 16 + 32 + 16 + 3 * (16 + 16) = 160 KB
        return (128, 3, False) if causal else (256, 2, False)
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
    """True when :func:`forward` handles these 16-bit inputs on this machine (Hopper sm_90, Triton 3.6)."""
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


class LazyKernel:
    """A Gluon kernel that ``load()`` imports with its module (and Gluon) at its first use, kept after
    it: ``kernel()`` returns it, or None where this Triton cannot define it (``error`` then says why).
    :mod:`flashattn.hopper.bwd` keeps its kernels the same way."""

    def __init__(self, load):
        self.load, self.kernel, self.error = load, None, None

    def __call__(self):
        if self.kernel is None and self.error is None:
            try:
                self.kernel = self.load()
            except Exception as e:  # e.g. a Triton whose Gluon lacks an API used here
                self.error = e
        return self.kernel

    def available(self) -> bool:
        """Whether the kernel can be built with the Triton installed here (Gluon of Triton 3.6)."""
        return triton_version_ok() and self() is not None


def _load_kernel():
    """The forward's Gluon kernel, from the module that defines it at module scope (importing Gluon)."""
    from flashattn.hopper import fwd_kernels

    return fwd_kernels._fa_fwd_kernel


_get_kernel = LazyKernel(_load_kernel)


def require(get_kernel, what: str):
    """``get_kernel()`` (a :class:`LazyKernel`), or ``RuntimeError`` naming ``what`` where this Triton
    cannot build it."""
    kernel = get_kernel()
    if kernel is None:
        raise RuntimeError(f"Gluon Hopper {what} unavailable: {get_kernel.error!r}")
    return kernel


def descriptor(t, rows: int, cols: int | None = None):
    """A Gluon TMA descriptor of the 4-d tensor ``t`` (B, H, L, D) read in [1, 1, rows, cols] tiles
    (cols = D when None), with its own strides (the last dim must be contiguous and the other strides
    16-byte aligned)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    cols = t.shape[-1] if cols is None else cols
    block = [1, 1, rows, cols]
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, _shared_layout(rows, cols, t.dtype))


@functools.lru_cache(maxsize=None)
def _shared_layout(rows: int, cols: int, dtype):
    """The shared-memory layout (swizzle) of a [1, 1, rows, cols] tile: the same for every call."""
    import torch
    import triton.experimental.gluon.language as gl

    gdt = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float8_e4m3fn: gl.float8e4nv,
           torch.float32: gl.float32}[dtype]
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, cols], gdt)


def launch(kernel, grid: int, args: tuple, constexprs: dict, warps: int = 4, record=None) -> None:
    """Launch a Gluon kernel of :mod:`flashattn.hopper` through the package's
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
            record=None, descales=None, p_smem: bool | None = None):
    """FlashAttention forward on Hopper: returns (o, lse) with o like q and lse float32 (B, Hq, N).

    Float8 (e4m3) q, k, v come with ``descales``, float32 (3, B, Hkv) contiguous (q's, k's and v's
    factors, :mod:`flashattn.fp8`), and v laid out keys last, (B, Hkv, D, M)
    (:func:`flashattn.tensors.keys_last`); o is then bfloat16 (or ``out``'s 16-bit dtype), at D = 64 or 128.

    ``scale`` defaults to 1/sqrt(D). The rest are tuning knobs: ``pingpong``, ``block_n`` and
    ``stages`` default to :func:`_config`'s, ``persistent`` and ``dynamic`` to
    :func:`schedule_default`'s. ``persistent`` launches at most one CTA per SM instead of one per
    query block; each CTA walks the blocks pid, pid + grid, ..., or with ``dynamic`` draws its next
    block from a counter shared by all CTAs. Under causal the blocks go in sections of ``section``
    heads, the longest block of each head first (default :func:`section_default` for a persistent
    launch, 1 otherwise). ``q_buffers`` (1 or 2) is how many tiles' Q a persistent CTA holds: with
    two the producer loads the next tile's Q while the consumers finish this one (default
    :func:`q_buffers_default`; a CTA of one tile holds one). ``p_smem`` passes P to the P V product
    through shared memory instead of registers (always for float8 inputs). ``out``, when given, receives o: any (B, Hq, N, D) tensor of q's dtype
    whose head dim is contiguous, such as one laid out like q. A ``record``
    (:class:`flashattn.launch.Recording`) keeps the launch, and which argument is the tile counter."""
    import torch

    from flashattn._config import persistent_ctas
    from flashattn.tensors import ceil_div, describable, tile_counter
    from flashattn.constants import LOG2E

    kernel = require(_get_kernel, "forward")
    B, Hq, N, D = q.shape
    Bk, Hkv, M, Dk = k.shape
    fp8 = descales is not None
    assert v.shape == ((B, Hkv, D, M) if fp8 else k.shape) and Bk == B and Dk == D and Hq % Hkv == 0
    if fp8:
        assert D in FP8_HEAD_DIMS and q.dtype == torch.float8_e4m3fn and descales.shape == (3, B, Hkv)
    else:
        assert D in (64, 128, 256) and q.dtype in (torch.float16, torch.bfloat16)
    assert k.dtype == q.dtype and v.dtype == q.dtype
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    assert scale > 0, "the kernel takes row maxima of unscaled scores: scale must be positive"
    # TMA addresses the tensors in place when the head dim is contiguous and the start and strides are 16-byte aligned
    q, k, v = (x if describable(x) else x.contiguous() for x in (q, k, v))
    o_dtype = torch.bfloat16 if fp8 else q.dtype
    o = torch.empty((B, Hq, N, D), device=q.device, dtype=o_dtype) if out is None else out
    lse = torch.empty((B, Hq, N), device=q.device, dtype=torch.float32)
    if B * Hq * N == 0:
        return o, lse
    if M == 0:
        o.zero_()
        lse.fill_(-math.inf)
        return o, lse
    cfg_n, cfg_stages, cfg_pp = _config(D, fp8, causal)
    block_n = block_n or cfg_n
    stages = stages or cfg_stages
    pingpong = cfg_pp if pingpong is None else pingpong
    default_persistent, default_dynamic = schedule_default(D, causal)
    persistent = (default_persistent and not pingpong) if persistent is None else persistent
    dynamic = persistent and (default_dynamic if dynamic is None else dynamic)
    assert not (pingpong and persistent), "ping-pong counts its turns within one tile: one tile per CTA"
    tiles = ceil_div(N, BLOCK_M) * B * Hq
    ctas = persistent_ctas(tiles, q.device.index) if persistent else tiles
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
    v_desc = descriptor(v, D, block_n) if fp8 else descriptor(v, block_n)
    q_desc, k_desc, o_desc = descriptor(q, HALF_M), descriptor(k, block_n), descriptor(o, HALF_M)
    # A dynamic walk's tile counter, zeroed for this call (flashattn.tensors.tile_counter), so that
    # calls on different streams, or the replays of a captured graph, never share one.
    counter = tile_counter(q.device) if dynamic else lse
    if dynamic and record is not None:
        record.add_counter(counter)
    launch(kernel, ctas,
           (q_desc, k_desc, v_desc, o_desc, lse, counter, B * Hq, Hq, Hq // Hkv, N, M, section,
            float(scale) * LOG2E, descales if fp8 else lse),
           dict(HEAD_DIM=D, BLOCK_N=block_n, STAGES=stages, CAUSAL=bool(causal), DYNAMIC=dynamic,
                PINGPONG=bool(pingpong), PRODUCER_REGS=PRODUCER_REGS, CONSUMER_REGS=CONSUMER_REGS,
                QBUFS=q_buffers, FP8=fp8, P_SMEM=fp8 or bool(p_smem)), record=record)
    return o, lse

