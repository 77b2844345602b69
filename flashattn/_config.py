"""Launch configurations: block sizes, warps and pipeline stages per GPU generation.

Nothing here touches the GPU driver at import time. Under Triton's CPU interpreter
(``TRITON_INTERPRET=1``) every kernel gets one small fixed configuration, so the interpreter tests
walk several blocks per row and column (diagonal, full and ragged tiles all occur) on tiny shapes.
On a GPU the table below is indexed by the padded head dimension and by the compute capability;
autotuning over a pruned set of neighbours is opt-in (``FLASHATTN_AUTOTUNE=1``) and happens at the
first call for a shape, never at import.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
from dataclasses import dataclass, field

import torch

from flashattn import schedule
from flashattn._memo import remember, table
from flashattn.problem import Problem, variant_abi


def is_interpreter() -> bool:
    """True when Triton runs kernels on the CPU: ``TRITON_INTERPRET`` set to anything but "" or "0",
    the test Triton itself applies. Read at call time, not at import. The one such test in the package."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def autotune_enabled() -> bool:
    return os.environ.get("FLASHATTN_AUTOTUNE", "0") not in ("", "0") and not is_interpreter()


@dataclass(frozen=True)
class KernelConfig:
    block_m: int  # query rows per tile
    block_n: int  # key rows per tile
    num_warps: int
    num_stages: int
    # dK/dV only: dV and dK in two launches of the kernel, one float32 accumulator each (its PART)
    split: bool = False

    def options(self) -> dict:
        """Triton's launch options (the tile sizes are the kernels' own constexpr arguments)."""
        return dict(num_warps=self.num_warps, num_stages=self.num_stages)


@dataclass(frozen=True)
class ByLength:
    """Two configurations of one kernel, chosen by the number of query rows N."""

    max_short: int  # N up to this uses ``short``
    short: KernelConfig
    long: KernelConfig

    def pick(self, n: int | None) -> KernelConfig:
        return self.short if n is None or n <= self.max_short else self.long


# Under the interpreter the tiles are small and *unequal* (BLOCK_M != BLOCK_N), so that a schedule
# bug that only shows when the two differ cannot hide behind square tiles.
_INTERPRETER = {
    "fwd": KernelConfig(32, 16, 4, 1),
    "bwd_dkdv": KernelConfig(16, 32, 4, 1),
    "bwd_dq": KernelConfig(32, 16, 4, 1),
}

# Hopper (sm_90), keyed by (kernel, BLOCK_D); a pair is (non-causal, causal). The entries are chosen
# from timed sweeps (docs/kernels/tuning-log.md#tma-pass-session-of-2026-11-22-second-half).
# Causal tiles are smaller where the diagonal makes short rows common: the causal forward at D <= 64
# takes 64 x 64 tiles up to N = 1024 and 64 x 128 above
# (docs/kernels/tuning-log.md#causal-d-64-forward-tiles-again-issue-15). The forward runs two pipeline
# stages, not three, which lets one warpgroup hold a 128-row tile at D = 128
# (docs/kernels/tuning-log.md#two-stages-run-13-issue-15).
_H64 = {
    "fwd": (KernelConfig(64, 128, 4, 2), ByLength(1024, KernelConfig(64, 64, 4, 2), KernelConfig(64, 128, 4, 2))),
    "bwd_dkdv": (KernelConfig(64, 64, 4, 3), KernelConfig(32, 64, 4, 3)),
    "bwd_dq": KernelConfig(128, 64, 8, 3),
}
_SM90 = {
    **{(kernel, block_d): cfg for block_d in (16, 32, 64) for kernel, cfg in _H64.items()},
    ("fwd", 128): KernelConfig(128, 64, 4, 2),
    ("fwd", 256): KernelConfig(128, 64, 8, 2),
    # the causal dK/dV kernel walks its query blocks in one masked loop: with it the causal tiles
    # match the non-causal ones at D = 128 and 256 (docs/kernels/tuning-log.md#one-causal-loop-in-dkdv-issue-15)
    ("bwd_dkdv", 128): KernelConfig(64, 128, 8, 3),
    # dV, then dK, in two launches on 128-row key blocks: one launch on 64-row blocks computes S^T and
    # dP^T twice (docs/kernels/tuning-log.md#dv-and-dk-in-two-launches-issue-15)
    ("bwd_dkdv", 256): KernelConfig(32, 128, 8, 3, split=True),
    ("bwd_dq", 128): (KernelConfig(128, 64, 8, 4), KernelConfig(128, 64, 8, 3)),
    # one warpgroup on 64 x 32 tiles, the fastest dQ tile timed at D = 256 (docs/kernels/tuning-log.md#dq-at-d-256)
    ("bwd_dq", 256): KernelConfig(64, 32, 4, 3),
}

# Hopper forward tiles for sliding windows and for dropout, where they differ from the table above.
# One warpgroup holding a 128-row D = 128 tile runs at the 255-register cap, and with a window it is
# the slower tile, so windows keep 128 x 128 on two warpgroups (softcap, ALiBi and packed sequences
# keep the table's; docs/kernels/tuning-log.md#variants-on-the-new-d-128-tile).
# Dropout draws its mask inside the loop, which takes registers and, to spread each draw's eight lanes
# over the tile, shared memory, so it takes smaller tiles: 64 x 64 forward tiles on one warpgroup
# (D = 16 and 32 follow D = 64, as in the table above), a 32-row dK/dV tile for both masks at D = 128,
# and one warpgroup on 64 x 128 for dQ at D <= 64 (docs/kernels/tuning-log.md#eight-keys-per-draw).
_SM90_WINDOW = {
    ("fwd", 128): KernelConfig(128, 128, 8, 3),
    # 32 x 64 dK/dV tiles on one warpgroup under a window at D = 128, the fastest of a sweep on
    # packed and dense windows (docs/kernels/tuning-log.md#window-tiles-for-dkdv-at-d-128-issue-49)
    ("bwd_dkdv", 128): KernelConfig(32, 64, 4, 3),
}
_SM90_DROPOUT = {
    **{("fwd", block_d): KernelConfig(64, 64, 4, 2) for block_d in (16, 32, 64, 128)},
    **{("bwd_dq", block_d): KernelConfig(64, 128, 4, 2) for block_d in (16, 32, 64)},
    ("bwd_dkdv", 128): KernelConfig(32, 128, 8, 3),
    # Dropout keeps the causal dK/dV kernel's three loops, faster than one loop with dropout's draws,
    # and at D = 256 a two-warpgroup dQ tile, since the plain tiles there are not timed with dropout
    # (docs/kernels/tuning-log.md#one-causal-loop-in-dkdv-issue-15). Its D = 256 dK/dV also runs in
    # two launches, with two stages: the dK launch's third stage and dropout's shared memory do not
    # fit together (docs/kernels/tuning-log.md#dv-and-dk-in-two-launches-issue-15).
    ("bwd_dkdv", 256): KernelConfig(32, 128, 8, 2, split=True),
    ("bwd_dq", 256): KernelConfig(128, 64, 8, 1),
}


# Packed sequences at D = 128 take the window's 32 x 64 dK/dV tile with or without a mask, the fastest
# of a sweep on a pack of short and long sequences
# (docs/kernels/tuning-log.md#packed-sequences-take-the-same-dkdv-tile-issue-49).
_SM90_PACKED = {
    ("bwd_dkdv", 128): _SM90_WINDOW[("bwd_dkdv", 128)],
}

# Float8 forward tiles (flashattn.fp8): the float8 tensor cores take twice the bfloat16 rate, so the
# table's one-warpgroup 128 x 64 tile leaves them waiting; 64 x 128 on one warpgroup with three stages
# was the fastest of a sweep at D <= 128, and 128 x 128 on two warpgroups at D = 256
# (docs/kernels/tuning-log.md#float8-forward-tiles-issue-46).
_SM90_FP8 = {
    **{("fwd", block_d): KernelConfig(64, 128, 4, 3) for block_d in (32, 64, 128)},
    ("fwd", 256): KernelConfig(128, 128, 8, 3),
}


def sm90_entry(kernel: str, block_d: int, *, dropout: bool = False, window: bool = False, packed: bool = False,
               fp8: bool = False):
    """The Hopper table's entry for ``kernel`` at ``block_d``: float8's tiles first, then dropout's,
    then a window's, then packed sequences'."""
    key = (kernel, block_d)
    if fp8 and key in _SM90_FP8:
        return _SM90_FP8[key]
    if dropout and key in _SM90_DROPOUT:
        return _SM90_DROPOUT[key]
    if window and key in _SM90_WINDOW:
        return _SM90_WINDOW[key]
    if packed and key in _SM90_PACKED:
        return _SM90_PACKED[key]
    return _SM90[key]


# Ampere / Ada and anything else: smaller shared memory, so smaller tiles and shallower pipelines.
# Not timed on such a GPU: conservative choices that fit 100 KB of shared memory.
_DEFAULT = {
    ("fwd", 16): KernelConfig(128, 64, 4, 2),
    ("fwd", 32): KernelConfig(128, 64, 4, 2),
    ("fwd", 64): KernelConfig(128, 64, 4, 2),
    ("fwd", 128): KernelConfig(128, 32, 4, 2),
    ("fwd", 256): KernelConfig(64, 32, 4, 1),
    ("bwd_dkdv", 16): KernelConfig(32, 64, 4, 2),
    ("bwd_dkdv", 32): KernelConfig(32, 64, 4, 2),
    ("bwd_dkdv", 64): KernelConfig(32, 64, 4, 2),
    ("bwd_dkdv", 128): KernelConfig(32, 64, 4, 2),
    ("bwd_dkdv", 256): KernelConfig(16, 32, 4, 1),
    ("bwd_dq", 16): KernelConfig(64, 32, 4, 2),
    ("bwd_dq", 32): KernelConfig(64, 32, 4, 2),
    ("bwd_dq", 64): KernelConfig(64, 32, 4, 2),
    ("bwd_dq", 128): KernelConfig(64, 32, 4, 2),
    ("bwd_dq", 256): KernelConfig(32, 16, 4, 1),
}


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


@dataclass(frozen=True)
class Tuning:
    """What a benchmark sweep may pin for the calls made inside :func:`tuning` (the package never does),
    and the SMs a persistent launch leaves to other streams' kernels (:func:`sm_margin`).

    ``configs`` maps a kernel name to the configuration to launch it with; ``heads_per_group`` caps the
    causal launch order's group (the largest divisor of B * H up to it is used); ``overlap_dq`` lets
    the dQ kernel run beside dK/dV on a second stream (the default; only problems large enough for it
    to pay use it, :func:`flashattn.backward.worth_a_second_stream`) or always after it;
    ``row_stats_in_dq`` lets the portable dQ kernel, where it runs on the current stream, go first and
    compute delta and the base-2 LSE itself, in place of the preprocess kernel's launch; ``gluon``
    lets the Hopper kernels in Gluon replace the portable ones where :func:`gluon_kernel` says so;
    ``sm_margin`` is how many SMs a persistent launch (one CTA per SM) leaves free; ``atomic_dq`` lets
    a backward that ``deterministic=False`` permits sum dQ inside the Hopper dK/dV kernel with TMA
    reductions (:func:`flashattn.backward.atomic_dq`), off by default: it measured slower than the
    deterministic pair at every shape tried (docs/kernels/tuning-log.md#a-nondeterministic-backward-in-gluon-issue-46).
    """

    configs: dict = field(default_factory=dict)
    heads_per_group: int | None = None
    overlap_dq: bool = True
    gluon: bool = True  # the Hopper kernels in Gluon where they apply (:func:`gluon_kernel`)
    row_stats_in_dq: bool = True
    sm_margin: int = 0
    atomic_dq: bool = False


DEFAULT_TUNING = Tuning()
_TUNING: contextvars.ContextVar[Tuning] = contextvars.ContextVar("flashattn_tuning", default=DEFAULT_TUNING)


def current_tuning() -> Tuning:
    return _TUNING.get()


def tuning_is_default() -> bool:
    """Whether no :func:`tuning` is in force: the table's choices, cached per problem, apply."""
    return _TUNING.get() is DEFAULT_TUNING


class tuning_of:
    """Run the ``with`` block under a :class:`Tuning` captured earlier. The autograd engine runs a
    CUDA backward on its own thread, where :func:`tuning` of the caller is not set, so the forward
    captures the state and the backward restores it. (A class, not a generator: every backward
    enters one, and a short call feels the difference.)"""

    def __init__(self, state: Tuning):
        self.state = state

    def __enter__(self):
        self.token = _TUNING.set(self.state)

    def __exit__(self, *exc_info):
        _TUNING.reset(self.token)


@contextlib.contextmanager
def tuning(*, fwd: KernelConfig | None = None, bwd_dkdv: KernelConfig | None = None,
           bwd_dq: KernelConfig | None = None, heads_per_group: int | None = None, overlap_dq: bool = True,
           gluon: bool = True, row_stats_in_dq: bool = True, atomic_dq: bool = False):
    """Pin launch choices for the calls inside the ``with`` block, and restore the previous ones after.

    ``with tuning(fwd=KernelConfig(128, 64, 8, 3)): ...`` times one tile without touching the table;
    ``with tuning(gluon=False): ...`` runs the portable Triton kernels where Gluon ones would run.
    """
    pinned = {name: cfg for name, cfg in (("fwd", fwd), ("bwd_dkdv", bwd_dkdv), ("bwd_dq", bwd_dq))
              if cfg is not None}
    token = _TUNING.set(Tuning(pinned, heads_per_group, overlap_dq, gluon, row_stats_in_dq, atomic_dq=atomic_dq))
    try:
        yield
    finally:
        _TUNING.reset(token)


@contextlib.contextmanager
def sm_margin(margin: int):
    """Inside the ``with`` block, persistent launches leave ``margin`` SMs free, so that kernels of other
    streams (a communication library's, moving data while attention computes) find SMs to run on
    instead of waiting for the whole launch to end. The other choices stay as they are; launches
    inside are neither recorded nor replayed (a recipe keeps its grid)."""
    if margin < 0:
        raise ValueError(f"sm_margin must be >= 0, got {margin}")
    if margin == 0:
        yield
        return
    token = _TUNING.set(dataclasses.replace(_TUNING.get(), sm_margin=int(margin)))
    try:
        yield
    finally:
        _TUNING.reset(token)


def persistent_ctas(tiles: int, device_index: int) -> int:
    """CTAs of a persistent launch over ``tiles`` tiles: one per SM, less the :func:`sm_margin` in force."""
    return min(tiles, max(1, _sm_count(device_index) - current_tuning().sm_margin))


# --8<-- [start:gluon-dispatch]
# The Hopper kernels in Gluon (flashattn.hopper.fwd, flashattn.hopper.bwd): head dims they are built
# for and beat the portable kernels at (docs/kernels/tuning-log.md#gluon-kernels-dispatched-issue-15,
# docs/kernels/tuning-log.md#the-gluon-forward-at-d-256-issue-15). The dK/dV kernel keeps dK and dV of
# 64 keys per warpgroup in registers, 2 * 64 * D / 128 floats per thread: at D = 256 that is 256, over
# the 240 a thread gets. The dQ kernel in Gluon (flashattn.hopper.bwd.dq) slows the D = 64 backward
# and speeds up the D = 128 and 256 ones (256 in 32-key steps), so it runs at 128 and 256
# (docs/kernels/tuning-log.md#a-dq-kernel-in-gluon-issue-15-built-not-dispatched,
# docs/kernels/tuning-log.md#dq-in-gluon-at-d-256-issue-15).
GLUON_HEAD_DIMS = {"fwd": (128, 256), "bwd_dkdv": (128,), "bwd_dq": (128, 256)}
# B * Hq * N * M * D below which the portable kernels run, per (kernel, head dim): (without a mask,
# causal). A bar is the least work where Gluon takes less GPU time per pass (CUDA graphs) and no more
# eager wall time, host included (docs/kernels/tuning-log.md#the-gluon-bar-again). Under causal the
# forward's call also allocates and zeroes the tile counter of its dynamic walk, host work that short
# calls do not earn back, hence its higher bars (docs/kernels/tuning-log.md#a-tile-counter-per-stream-issues-11-and-15);
# the D = 256 dQ's bars: docs/kernels/tuning-log.md#dq-in-gluon-at-d-256-issue-15.
# Every cell of the benchmark grid (16k tokens, 2048 hidden) from N = 1024 up is at 2^35 or more.
GLUON_MIN_WORK = {
    ("fwd", 128): (2**31, 2**33),
    ("fwd", 256): (2**32, 2**33),
    ("bwd_dkdv", 128): (2**33, 2**34),
    ("bwd_dq", 128): (2**33, 2**34),
    ("bwd_dq", 256): (2**32, 2**34),
}
# The float8 forward (flashattn.fp8) runs in Gluon at these head dims from this work on, (without a
# mask, causal) as above (docs/kernels/tuning-log.md#a-float8-gluon-forward-issue-46).
GLUON_FP8_HEAD_DIMS = (64, 128)
GLUON_FP8_MIN_WORK = (2**31, 2**33)
_GLUON = table("config.gluon")  # (kernel, problem, device index) -> whether the Gluon kernel runs it


def gluon_kernel(kernel: str, problem: Problem, device: torch.device) -> bool:
    """Whether the Hopper kernel in Gluon runs ``kernel`` ("fwd", "bwd_dkdv" or "bwd_dq") for ``problem``.

    Only plain attention (no variant, no packing) with a positive scale, at a head dim of
    :data:`GLUON_HEAD_DIMS`, with at least the work of :data:`GLUON_MIN_WORK` (float8 inputs: the forward at
    :data:`GLUON_FP8_HEAD_DIMS` from :data:`GLUON_FP8_MIN_WORK`), on an sm_90 GPU (the launchers also ask
    whether this Triton builds the Gluon kernel), and never when a :func:`tuning` pins this kernel's tile
    or turns Gluon off. The answer is kept per problem and device."""
    t = _TUNING.get()
    if not t.gluon or kernel in t.configs or device.type != "cuda":
        return False
    key = (kernel, problem, device.index)
    found = _GLUON.get(key)
    if found is None:
        p = problem
        if p.descale:
            dims = GLUON_FP8_HEAD_DIMS if kernel == "fwd" else ()
        else:
            dims = GLUON_HEAD_DIMS.get(kernel, ())
        found = remember(_GLUON, key, p.head_dim in dims and (
            not is_interpreter()
            and not (p.varlen or p.window is not None or p.softcap or p.alibi or p.dropout_p or p.head_dim_v
                     or p.sinks)
            and p.scale > 0
            and p.batch * p.heads_q * p.n * p.m * p.head_dim
            >= (GLUON_FP8_MIN_WORK if p.descale else GLUON_MIN_WORK[(kernel, p.head_dim)])[int(p.causal)]
            and _capability(index_of(device)) == (9, 0)))
    return found
# --8<-- [end:gluon-dispatch]


def index_of(device: torch.device) -> int:
    """The CUDA index of ``device``: its own, or the current device's where it names none."""
    return device.index if device.index is not None else torch.cuda.current_device()


def current_device() -> int:
    """The current CUDA device's index (torch.cuda.current_device without its lazy-init check)."""
    get = getattr(torch._C, "_cuda_getDevice", None)
    return get() if get is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def heads_per_group(grid: tuple[int, int], device: torch.device, causal: bool) -> int:
    """Heads per group of the causal launch order (:func:`flashattn.schedule.launch_order`) for a
    (blocks, batch * heads) grid; 1 without a mask, where the kernels launch in grid order.

    A group holds about two waves of programs on a GPU (twice its SM count). Under the interpreter a
    group holds up to 8 programs, so the small test shapes put several heads in one group.
    """
    n_blocks, n_heads = grid
    if not causal:
        return 1
    cap = current_tuning().heads_per_group
    if cap is not None:
        return schedule.heads_per_group(n_heads, n_blocks, cap * n_blocks)
    if is_interpreter() or device.type != "cuda":
        return schedule.heads_per_group(n_heads, n_blocks, 8)
    index = index_of(device)
    return schedule.heads_per_group(n_heads, n_blocks, 2 * _sm_count(index))


def get_config(kernel: str, problem: Problem, device: torch.device) -> KernelConfig:
    """The fixed configuration of ``kernel`` ("fwd", "bwd_dkdv", "bwd_dq") for ``problem``."""
    pinned = current_tuning().configs
    if kernel in pinned:
        return pinned[kernel]
    if is_interpreter() or device.type != "cuda":
        return _INTERPRETER[kernel]
    index = index_of(device)
    major, _ = _capability(index)
    p = problem
    block_d = max(p.block_d, p.block_dv)  # split head dims take the tiles of the wider one
    if major != 9:
        return resolve(_DEFAULT[(kernel, block_d)], p.causal, p.n)
    cfg = resolve(sm90_entry(kernel, block_d, dropout=p.dropout_p > 0, window=p.window is not None, packed=p.varlen,
                             fp8=p.descale), p.causal, p.n)
    small = _SM90_SMALL_GRID.get((kernel, block_d))
    if small is not None and not (p.dropout_p or p.window is not None or p.varlen or p.descale):
        blocks, heads = _blocks_and_heads(kernel, p, cfg)  # the table tile's programs, as plan_for launches them
        share, tile = small
        if blocks * p.batch * heads < resolve(share, p.causal, p.n) * _sm_count(index):
            return tile
    return cfg


# Hopper tiles for grids that leave SMs idle, keyed like _SM90: (the share of the SMs below which
# the table tile's programs count as few, the tile then used). Smaller tiles make more programs and
# so keep more SMs busy (at B * H = 16, N = 512 the D = 128 table tiles make 64 programs for 132 SMs).
# The forward's bar is a full wave; the backward's is half a wave, since near a full wave its table
# tiles are the faster ones without a mask (docs/kernels/tuning-log.md#tiles-for-small-grids). At
# D <= 64 the forward's tiles have 64 rows already, and only dQ's 128-row tile is swapped. A share
# may be a (without a mask, causal) pair: the D = 256 forward's 64 x 64 tile is the faster one below
# half the SMs without a mask and below all of them with the causal mask; the D = 256 backward keeps
# its table tiles, the fastest tried on small grids (docs/kernels/tuning-log.md#small-grids-at-d-256).
_SMALL_BWD = (0.5, KernelConfig(64, 64, 4, 3))
_SM90_SMALL_GRID = {
    ("fwd", 128): (1.0, KernelConfig(64, 64, 4, 2)),
    ("fwd", 256): ((0.5, 1.0), KernelConfig(64, 64, 4, 2)),
    ("bwd_dkdv", 128): _SMALL_BWD,
    ("bwd_dq", 128): _SMALL_BWD,
    **{("bwd_dq", block_d): _SMALL_BWD for block_d in (16, 32, 64)},
}


def resolve(entry, causal: bool, n: int | None) -> KernelConfig:
    """One table entry (a config, a (non-causal, causal) pair, or :class:`ByLength`) for one problem."""
    entry = entry[int(causal)] if isinstance(entry, tuple) else entry
    return entry.pick(n) if isinstance(entry, ByLength) else entry


def tuning_space(kernel: str, problem: Problem, device: torch.device) -> list[KernelConfig]:
    """A pruned neighbourhood of the table entry: the entry itself first, then at most ten variants.

    Same tile with other warps / pipeline depths first (two stages included: one warpgroup with two
    stages is the D = 128 forward's table tile, docs/kernels/tuning-log.md#two-stages-run-13-issue-15),
    then the tile halved or doubled along one side; tiles past 128 x 128 (128 x 64 at D = 256) are
    left out, they do not fit shared memory.
    """
    base = get_config(kernel, problem, device)
    variants = [base]
    for warps, stages in ((4, 2), (4, 3), (4, 4), (8, 2), (8, 3), (8, 4)):
        variants.append(dataclasses.replace(base, num_warps=warps, num_stages=stages))
    for bm, bn in ((base.block_m, base.block_n * 2), (base.block_m, base.block_n // 2),
                   (base.block_m // 2, base.block_n), (base.block_m * 2, base.block_n)):
        if 16 <= bm and 16 <= bn and bm * bn <= (128 * 64 if problem.block_d >= 256 else 128 * 128):
            variants.append(dataclasses.replace(base, block_m=bm, block_n=bn))
    unique = list(dict.fromkeys(variants))
    return unique[:11]


_TUNED = table("config.tuned")  # autotuning results: (kernel, device, problem) -> the fastest config measured


def choose(kernel: str, problem: Problem, device: torch.device, launch) -> KernelConfig:
    """The configuration to launch ``kernel`` with for ``problem`` on ``device``.

    Without autotuning this is the fixed table entry. With ``FLASHATTN_AUTOTUNE=1`` on a GPU, the first
    call for a problem times every candidate of :func:`tuning_space` through ``launch(cfg)`` (each
    launch only overwrites its outputs, so timing them is harmless) and remembers the fastest; later
    calls, and so every backward pass after the first, reuse it, which keeps results bitwise repeatable.
    """
    if not autotune_enabled() or device.type != "cuda" or kernel in current_tuning().configs:
        return get_config(kernel, problem, device)
    full_key = (kernel, device.index, problem)
    if full_key not in _TUNED:
        from triton.testing import do_bench  # imported here: nothing GPU-related at import time

        best, best_ms = None, float("inf")
        for cfg in tuning_space(kernel, problem, device):
            try:
                ms = do_bench(lambda: launch(cfg), warmup=5, rep=20, return_mode="median")
            except Exception:  # a candidate that does not fit (shared memory, registers) is skipped
                continue
            if ms < best_ms:
                best, best_ms = cfg, ms
        remember(_TUNED, full_key, best if best is not None else get_config(kernel, problem, device))
    return _TUNED[full_key]


@dataclass(frozen=True)
class Plan:
    """How one kernel launches for one problem: its config, its 1-D grid and its constexpr arguments."""

    config: KernelConfig
    n_blocks: int  # query blocks (key blocks for dK/dV) per (batch, head)
    grid: int  # programs: n_blocks * batch * heads
    heads_per_group: int  # of the causal launch order
    constexprs: dict  # in the kernels' parameter order
    options: dict  # Triton's launch options
    # the constexprs of each launch: ``constexprs`` alone, or for a split dK/dV config the dV
    # launch's, then dK's (made once, by plan_for: a plan is cached and launched on every call)
    passes: tuple


def _blocks_and_heads(kernel: str, problem: Problem, cfg: KernelConfig) -> tuple[int, int]:
    """Blocks per (batch, head) and heads of ``kernel``'s grid: one program per key block of a
    key/value head for dK/dV, per query block of a query head otherwise."""
    if kernel == "bwd_dkdv":
        return -(-problem.m // cfg.block_n), problem.heads_kv
    return -(-problem.n // cfg.block_m), problem.heads_q


def plan_for(kernel: str, problem: Problem, device: torch.device, cfg: KernelConfig) -> Plan:
    """The :class:`Plan` of ``kernel`` for ``problem`` with the configuration ``cfg``."""
    n_blocks, heads = _blocks_and_heads(kernel, problem, cfg)
    constexprs = dict(CAUSAL=problem.causal, HEAD_DIM=problem.head_dim, BLOCK_D=problem.block_d,
                      BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **variant_abi(problem)[0],
                      HEAD_DIM_V=problem.dv, BLOCK_DV=problem.block_dv)
    passes = (constexprs,)
    if kernel == "fwd":
        constexprs["HAS_SINKS"] = problem.sinks  # the sinks join the epilogue's normalization
        constexprs["DESCALE"] = problem.descale  # float8 inputs and their factors (flashattn.fp8)
    if kernel == "bwd_dq":
        # the preprocess's row statistics computed in the dQ kernel (flashattn.backward.attention_backward
        # turns them on where dQ runs first)
        constexprs.update(ROW_STATS=False, HAS_DLSE=False)
    if kernel == "bwd_dkdv":
        constexprs["PART"] = 0  # dK and dV in one launch, unless the config splits them
        if cfg.split:
            passes = ({**constexprs, "PART": 1}, {**constexprs, "PART": 2})
    if problem.varlen:
        # Packed sequences: one program per tile of the packed rows of a head, and one spare per
        # sequence, since sum_i cdiv(n_i, block) <= cdiv(total, block) + n_seqs - 1 is a bound the host
        # knows without reading the lengths (flashattn.schedule.packed_tile); the heads go one after the other.
        rows, block = (problem.total_k, cfg.block_n) if kernel == "bwd_dkdv" else (problem.total_q, cfg.block_m)
        n_blocks = -(-rows // block) + problem.batch
        return Plan(cfg, n_blocks, n_blocks * heads, 1, constexprs, cfg.options(), passes)
    group = heads_per_group((n_blocks, problem.batch * heads), device, problem.causal)
    return Plan(cfg, n_blocks, n_blocks * problem.batch * heads, group, constexprs, cfg.options(), passes)


_PLANS = table("config.plans")  # (kernel, problem, device index) -> Plan, for calls with the default tuning


def plan(kernel: str, problem: Problem, device: torch.device, launch) -> Plan:
    """The :class:`Plan` of ``kernel`` for ``problem`` on ``device``, chosen by :func:`choose`.

    Remembered per problem, so a training loop that repeats its shapes pays for the choice once
    (``FLASHATTN_AUTOTUNE`` is read the first time a problem is seen). Calls inside :func:`tuning`
    choose afresh every time.
    """
    key = (kernel, problem, device.index)
    cacheable = current_tuning() is DEFAULT_TUNING
    if cacheable:
        found = _PLANS.get(key)
        if found is not None:
            return found
    result = plan_for(kernel, problem, device, choose(kernel, problem, device, launch))
    if cacheable:
        remember(_PLANS, key, result)
    return result
