"""Scaling benchmark of context-parallel attention (:mod:`flashattn.distributed`), one process per GPU.

    torchrun --nproc-per-node 2 -m benchmarks.ring --out benchmarks/results/ring_2gpu.json
    torchrun --nproc-per-node 4 -m benchmarks.ring --strategy ring ulysses hybrid --heads 8 \
        --lengths 131072 1048576 --mask causal --out ...
    python -m benchmarks.ring --dry-run --out /tmp/ring.json   # CPU, gloo, tiny shapes, 1 process

``--strategy`` picks what is measured (one or several, in one run): ``ring`` (:func:`ring_attention`,
zig-zag shards when causal), ``ulysses`` (:func:`ulysses_attention`, an all-to-all of heads; needs the
query heads divisible by P, K/V heads are repeated when fewer) or ``hybrid`` (:func:`hybrid_attention`:
Ulysses inside groups of ``--ulysses-size`` U ranks, the ring across the P / U groups; U defaults to
P / 2, a ring of 2 groups). For every total length N (a length that runs out of memory is recorded
and the run goes on), causal and not, it measures on every rank:

* each strategy's forward and forward + backward time (CUDA events, fixed warm-up and repetition
  counts so every rank makes the same number of collective calls; the slowest rank's median is
  reported) and the peak memory over the timed forward + backward calls;
* the single-GPU kernel at the same per-GPU work (no communication, timed the same way):
  non-causal, queries N/P against all N keys; causal, a causal square of length sqrt(N^2/P) rounded to
  128, which has the same number of visible pairs per GPU. The ratio of a strategy's TFLOP/s per GPU
  to this kernel's is ``fraction_of_single_gpu`` (the target is >= 0.9 at N/P >= 32k);
* each rank's compute alone (the local attention calls of its strategy, no communication), and the
  causal balance: (max - min) / mean of it over ranks (target: within 5%);
* PyTorch's own context parallelism (``torch.distributed.tensor.experimental.context_parallel`` around
  ``scaled_dot_product_attention``) at the same N, where it runs; its failure message where not.

The single-GPU kernel and PyTorch's context parallelism are measured once per length and mask and
shared by the strategies' rows. FLOPs come from :func:`flashattn.cost.attention_flops` (the
cost-model page's formula): a context-parallel call does the full sequence's FLOPs, divided by P per
GPU. The JSON records the GPUs, versions and methods beside the numbers.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from flashattn import cost
from flashattn import distributed as fd

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
DEFAULT_LENGTHS = [65536, 131072, 262144, 524288, 1048576]
STRATEGIES = ("ring", "ulysses", "hybrid")
TIMING_HOW = ("CUDA events around each call after a barrier, {warmup} warm-up and {reps} timed calls on every "
              "rank (fixed counts: every rank makes the same collective calls); median per rank, slowest rank "
              "reported; peak memory over the timed forward + backward calls")
BASELINE_HOW = ("flashattn.attention on one GPU with the same visible (query, key) pairs per GPU: non-causal q of N/P "
                "rows against N keys; causal, a causal square of length sqrt(N^2 / P) rounded to 128; timed as the "
                "strategies are (every rank runs it on its own GPU at the same time; rank 0's median reported); "
                "measured once per length and mask, shared by the strategies' rows")
STRATEGY_HOW = {
    "ring": "flashattn.distributed.ring_attention over all P ranks; zig-zag shards when causal, else contiguous",
    "ulysses": "flashattn.distributed.ulysses_attention over all P ranks (all-to-all of heads, K/V heads repeated "
               "by kv_head_repeats when fewer than P), contiguous shards",
    "hybrid": "flashattn.distributed.hybrid_attention: Ulysses inside groups of U consecutive ranks, the ring across "
              "the P / U groups (zig-zag when causal, else contiguous); shards of shard_sequence_2d",
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ring", description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=None, help="total sequence lengths N (all ranks)")
    p.add_argument("--strategy", nargs="+", choices=STRATEGIES, default=["ring"],
                   help="what to measure, one or several (default: ring)")
    p.add_argument("--ulysses-size", type=int, default=None,
                   help="hybrid: ranks per Ulysses group U, dividing P (default P / 2: a ring of 2 groups)")
    p.add_argument("--heads", type=int, default=1, help="query heads (default 1: one head group)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--mask", choices=["causal", "full", "both"], default="both")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--no-torch-cp", action="store_true", help="skip PyTorch's context_parallel")
    p.add_argument("--no-single-gpu", action="store_true",
                   help="skip the single-GPU baseline (no fraction of one GPU's throughput is reported)")
    p.add_argument("--ring-fetch", choices=["all-gather", "send-recv", "relay"], default=None,
                   help="the ring forward's key/value exchange: every shard fetched at the start by one all-gather "
                        "or by send/receive pairs with its owner, or passed along the ring step by step (relay); "
                        "default: the package's choice for the group size (flashattn.distributed."
                        "DIRECT_FETCH_MAX_WORLD, DIRECT_FETCH_BY)")
    p.add_argument("--sm-margin", type=int, default=None,
                   help="SMs the ring forward's persistent kernels leave to NCCL while exchanges are in flight "
                        "(default: flashattn.distributed.EXCHANGE_SM_MARGIN)")
    p.add_argument("--profile-exchange", action="store_true",
                   help="one more forward per strategy under torch.profiler: exchange against compute (GPU only)")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, gloo, float64, tiny lengths, no baseline or memory: checks the harness runs")
    p.add_argument("--out", type=Path, required=True, help="JSON file (written by rank 0, after every length)")
    args = p.parse_args(argv)
    if args.lengths is None:
        args.lengths = [64, 128] if args.dry_run else DEFAULT_LENGTHS
    if args.dry_run:
        args.dtype, args.head_dim, args.warmup, args.reps = "float64", 16, 1, 2
    args.kv_heads = args.kv_heads or args.heads
    args.strategy = list(dict.fromkeys(args.strategy))
    if args.sm_margin is not None and args.sm_margin < 0:
        p.error("--sm-margin must be >= 0")
    if args.ulysses_size is not None and args.ulysses_size < 1:
        p.error("--ulysses-size must be >= 1")
    for name in ("heads", "kv_heads", "head_dim", "batch", "reps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:  # 0: the first call is timed (at millions of tokens, where one call takes a minute)
        p.error("--warmup must be >= 0")
    if args.heads % args.kv_heads:
        p.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    if any(n < 2 for n in args.lengths):
        p.error("--lengths must be >= 2")
    return args


# --------------------------------------------------------------------------------------------------
# process group
# --------------------------------------------------------------------------------------------------
def init(dry_run: bool):
    """Join the group torchrun set up (or a 1-process gloo group on the loopback for a plain dry run)."""
    if "RANK" not in os.environ:
        if not dry_run:
            raise SystemExit("launch with torchrun (or pass --dry-run for a 1-process CPU run)")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if dry_run:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo", timeout=dt.timedelta(seconds=120))
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device, timeout=dt.timedelta(seconds=600))
    return device


# --------------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------------
def timed_ms(fn, device, warmup: int, reps: int) -> float:
    """Median milliseconds of ``fn()`` on this rank; every rank calls ``fn`` exactly warmup + reps times."""
    return timed(fn, device, warmup, reps)[0]


def timed(fn, device, warmup: int, reps: int) -> tuple[float, float | None]:
    """:func:`timed_ms` and the peak GiB allocated on this GPU over the timed calls (None on the CPU):
    everything alive during them, inputs, buffers and gradients."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(reps):
        dist.barrier()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return statistics.median(times), peak


EXCHANGE_KEYS = ("span_ms", "compute_ms", "exchange_ms", "exposed_exchange_ms", "idle_ms")


def interval_stats(kernels: list[tuple[str, float, float]]) -> tuple[float, ...]:
    """From one call's GPU kernels ``(name, start_us, end_us)``: its span (first start to last end), the time
    some compute kernel runs, the time some exchange (NCCL) kernel runs, the exchange time no compute
    kernel overlaps, and the time no kernel runs; in milliseconds, in the order of ``EXCHANGE_KEYS``."""
    def union(spans):
        merged = []
        for a, b in sorted(spans):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        return merged

    def length(spans):
        return sum(b - a for a, b in spans)

    if not kernels:
        return (0.0,) * len(EXCHANGE_KEYS)
    nccl = union([(a, b) for name, a, b in kernels if "nccl" in name.lower()])
    compute = union([(a, b) for name, a, b in kernels if "nccl" not in name.lower()])
    overlap = sum(max(0.0, min(b, d) - max(a, c)) for a, b in nccl for c, d in compute)  # both lists are disjoint
    span = max(b for _, _, b in kernels) - min(a for _, a, _ in kernels)
    busy = length(compute) + length(nccl) - overlap  # some kernel runs
    return tuple(x / 1e3 for x in (span, length(compute), length(nccl), length(nccl) - overlap, span - busy))


_PROFILER_STARTED: list = []


def exchange_profile(fn, device) -> tuple[float, ...]:
    """:func:`interval_stats` of one ``fn()`` after a barrier, from torch.profiler's CUDA kernel records."""
    from torch.profiler import ProfilerActivity, profile

    if not _PROFILER_STARTED:  # the first profile of a process also starts CUPTI: not in a timed one
        with profile(activities=[ProfilerActivity.CUDA]):
            torch.ones(1, device=device).add_(1)
            torch.cuda.synchronize(device)
        _PROFILER_STARTED.append(True)
    dist.barrier()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start]
    return interval_stats(kernels)


def gather_rows(values: tuple[float, ...], device) -> list[list[float]]:
    """Every rank's ``values`` (one tuple of floats each), in rank order."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [x.tolist() for x in out]


def gather_floats(x: float, device) -> list[float]:
    return [row[0] for row in gather_rows((x,), device)]


# --------------------------------------------------------------------------------------------------
# the providers
# --------------------------------------------------------------------------------------------------
def local_shards(args, n: int, device, seed: int):
    """This rank's q, k, v, dO shards (random; the full sequence is never built)."""
    gen = torch.Generator(device=device).manual_seed(seed + dist.get_rank())
    n_local = n // dist.get_world_size()
    dtype = DTYPES[args.dtype]

    def randn(h):
        return torch.randn(args.batch, h, n_local, args.head_dim, dtype=dtype, device=device, generator=gen)

    q, k, v, do = randn(args.heads), randn(args.kv_heads), randn(args.kv_heads), randn(args.heads)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), do


class Grid(NamedTuple):
    """The hybrid's process groups as this rank sees them: Ulysses groups of ``ulysses`` consecutive
    ranks, the ring across ``ring`` groups; this rank is piece ``piece`` at ring position ``position``."""

    ulysses: int
    ring: int
    position: int
    piece: int
    ulysses_group: object
    ring_group: object


def default_ulysses_size(world: int) -> int:
    return world // 2 if world % 2 == 0 else 1


def make_grid(world: int, rank: int, ulysses: int) -> Grid:
    """Every group of the grid (every rank takes part in creating each one), and this rank's two."""
    ring = world // ulysses
    ulysses_groups = [dist.new_group([g * ulysses + u for u in range(ulysses)]) for g in range(ring)]
    ring_groups = [dist.new_group([g * ulysses + u for g in range(ring)]) for u in range(ulysses)]
    position, piece = divmod(rank, ulysses)
    return Grid(ulysses, ring, position, piece, ulysses_groups[position], ring_groups[piece])


def check_strategies(args, world: int) -> str | None:
    """Why the run cannot measure the strategies asked for on ``world`` ranks (None when it can); the
    same answer on every rank, before any collective."""
    problems = []
    if "ulysses" in args.strategy:
        try:
            fd.kv_head_repeats(args.heads, args.kv_heads, world)
        except ValueError as exc:
            problems.append(f"--strategy ulysses: {exc}")
    if "hybrid" in args.strategy:
        u = args.ulysses_size or default_ulysses_size(world)
        if world % u:
            problems.append(f"--strategy hybrid: --ulysses-size ({u}) must divide the number of ranks ({world})")
        elif args.heads % u:
            problems.append(f"--strategy hybrid: --heads ({args.heads}) must be divisible by the Ulysses group's "
                            f"size ({u})")
    return "; ".join(problems) or None


def strategy_call(strategy: str, causal: bool, grid: Grid | None):
    """``(attend(q, k, v) -> o, layout)`` of one strategy, on this rank's shards."""
    if strategy == "ulysses":
        return lambda q, k, v: fd.ulysses_attention(q, k, v, causal=causal, layout="contiguous"), "contiguous"
    layout = "zigzag" if causal else "contiguous"
    if strategy == "ring":
        return lambda q, k, v: fd.ring_attention(q, k, v, causal=causal, layout=layout), layout
    return (lambda q, k, v: fd.hybrid_attention(q, k, v, ulysses_group=grid.ulysses_group, ring_group=grid.ring_group,
                                                causal=causal, layout=layout)), layout


def local_work(args, strategy: str, n: int, grid: Grid | None) -> dict:
    """What this rank's kernels compute, as a ring over ``ring_size`` positions (1 for Ulysses): its
    position, the length of the sequence shard in its hands, and the heads it has after the all-to-all."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if strategy == "ring":
        return dict(position=rank, ring_size=world, n_local=n // world, heads=args.heads, kv_heads=args.kv_heads)
    width, position, ring_size = (world, 0, 1) if strategy == "ulysses" else (grid.ulysses, grid.position, grid.ring)
    kv_heads = args.kv_heads * fd.kv_head_repeats(args.heads, args.kv_heads, width) // width
    return dict(position=position, ring_size=ring_size, n_local=n // ring_size, heads=args.heads // width,
                kv_heads=kv_heads)


def measure_strategy(args, strategy: str, n: int, causal: bool, device, grid: Grid | None) -> dict:
    attend, layout = strategy_call(strategy, causal, grid)
    q, k, v, do = local_shards(args, n, device, seed=n)

    def fwd():
        with torch.no_grad():
            attend(q, k, v)

    def fwd_bwd():
        attend(q, k, v).backward(do)
        q.grad = k.grad = v.grad = None

    fwd_bwd_ms, peak = timed(fwd_bwd, device, args.warmup, args.reps)
    rec = {"layout": layout,
           "fwd_ms": max(gather_floats(timed_ms(fwd, device, args.warmup, args.reps), device)),
           "fwd_bwd_ms": max(gather_floats(fwd_bwd_ms, device)),
           "peak_gib_per_rank": gather_floats(peak, device) if device.type == "cuda" else None}
    if strategy == "hybrid":
        rec["grid"] = {"ulysses": grid.ulysses, "ring": grid.ring}
    if args.profile_exchange and device.type == "cuda":
        rec["exchange_per_rank"] = [dict(zip(EXCHANGE_KEYS, vals)) for vals in
                                    gather_rows(exchange_profile(fwd, device), device)]
    work = local_work(args, strategy, n, grid)
    rec["compute_ms_per_rank"] = gather_floats(rank_compute_ms(args, causal, layout, device, **work), device)
    times = rec["compute_ms_per_rank"]
    rec["balance"] = (max(times) - min(times)) / statistics.mean(times) if statistics.mean(times) > 0 else None
    return rec


def rank_compute_ms(args, causal, layout, device, *, position: int, ring_size: int, n_local: int, heads: int,
                    kv_heads: int) -> float:
    """This rank's local attention calls, no communication: its ring steps (``ring_size`` 1: one call
    on the whole sequence of its heads, as Ulysses makes) with its own K/V standing in for the others'."""
    gen = torch.Generator(device=device).manual_seed(7 + dist.get_rank())
    dtype = DTYPES[args.dtype]
    q = torch.randn(args.batch, heads, n_local, args.head_dim, dtype=dtype, device=device, generator=gen)
    k, v = (torch.randn(args.batch, kv_heads, n_local, args.head_dim, dtype=dtype, device=device, generator=gen)
            for _ in range(2))
    scale = 1.0 / math.sqrt(args.head_dim)

    def steps():
        with torch.no_grad():
            for source in range(ring_size):
                plan = fd.ring_step(position, source, n_local, causal, layout)
                if plan is not None:
                    fd._local_forward(q[:, :, plan.rows], k[:, :, plan.cols], v[:, :, plan.cols], plan.causal, scale)

    return timed_ms(steps, device, args.warmup, args.reps)


def baseline_shape(n: int, world: int, causal: bool) -> tuple[int, int]:
    """(queries, keys) of one single-GPU call with the per-GPU visible pairs of the ring (see BASELINE_HOW)."""
    if not causal:
        return n // world, n
    side = max(128, round(math.sqrt(n * n / world) / 128) * 128)
    return side, side


def measure_single_gpu(args, n: int, causal: bool, device) -> dict:
    import flashattn

    rows, cols = baseline_shape(n, dist.get_world_size(), causal)
    dtype = DTYPES[args.dtype]
    gen = torch.Generator(device=device).manual_seed(1)
    q = torch.randn(args.batch, args.heads, rows, args.head_dim, dtype=dtype, device=device, generator=gen)
    k, v = (torch.randn(args.batch, args.kv_heads, cols, args.head_dim, dtype=dtype, device=device, generator=gen)
            for _ in range(2))
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    do = torch.randn_like(q)

    def fwd():
        with torch.no_grad():
            flashattn.attention(q, k, v, causal=causal)

    def fwd_bwd():
        flashattn.attention(q, k, v, causal=causal).backward(do)
        q.grad = k.grad = v.grad = None

    # the strategies' timer (a call at 1M tokens takes seconds; do_bench would make ~8 of them)
    fwd_ms = timed_ms(fwd, device, args.warmup, args.reps)
    fwd_bwd_ms = timed_ms(fwd_bwd, device, args.warmup, args.reps)
    flops = cost.attention_flops(args.batch, args.heads, rows, cols, args.head_dim, causal=causal, mode="fwd")
    return {"queries": rows, "keys": cols, "fwd_ms": fwd_ms, "fwd_bwd_ms": fwd_bwd_ms,
            "fwd_tflops": flops / fwd_ms / 1e9, "fwd_bwd_tflops": 3.5 * flops / fwd_bwd_ms / 1e9}


_MESH = None


def measure_torch_cp(args, n: int, causal: bool, device) -> dict:
    """PyTorch's context parallelism around SDPA (it shards full-length buffers itself, in place), and
    the relative error of its unsharded output against flashattn.attention on the full sequence.

    ``context_parallel`` patches ``torch.nn.functional.scaled_dot_product_attention`` inside the
    context, so SDPA is looked up there at every call: a reference to it taken before the context
    computes each rank's shard against its own keys alone (a first version of this harness did, and
    read more TFLOP/s per GPU than the GPU has)."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options, context_parallel_unshard

    from flashattn import attention
    from flashattn.testing import rel_err

    def sdpa(*a, **kw):
        return F.scaled_dot_product_attention(*a, **kw)

    global _MESH
    if _MESH is None:  # one mesh (and its communicator) for the whole run
        _MESH = init_device_mesh(device.type, (dist.get_world_size(),))
    mesh = _MESH
    dtype = DTYPES[args.dtype]
    gen = torch.Generator(device=device).manual_seed(n)  # same full tensors on every rank
    shape_q = (args.batch, args.heads, n, args.head_dim)
    shape_kv = (args.batch, args.kv_heads, n, args.head_dim)
    q = torch.randn(shape_q, dtype=dtype, device=device, generator=gen)
    k, v = (torch.randn(shape_kv, dtype=dtype, device=device, generator=gen) for _ in range(2))
    do = torch.randn(shape_q, dtype=dtype, device=device, generator=gen)
    gqa = {"enable_gqa": True} if args.heads != args.kv_heads else {}
    # Its load balancing (a head-tail reordering of the sequence) is for causal attention only: without
    # the mask its SDPA refuses it ("Load balancing requires `is_causal=True`"), so it is off there.
    _cp_options.enable_load_balance, balance = causal, _cp_options.enable_load_balance
    try:
        with context_parallel(mesh, buffers=[q, k, v, do], buffer_seq_dims=[2, 2, 2, 2]):
            q.requires_grad_(), k.requires_grad_(), v.requires_grad_()

            def fwd():
                with torch.no_grad():
                    sdpa(q, k, v, is_causal=causal, **gqa)

            def fwd_bwd():
                sdpa(q, k, v, is_causal=causal, **gqa).backward(do)
                q.grad = k.grad = v.grad = None

            try:
                fwd_bwd_ms, peak = timed(fwd_bwd, device, args.warmup, args.reps)
                rec = {"fwd_ms": max(gather_floats(timed_ms(fwd, device, args.warmup, args.reps), device)),
                       "fwd_bwd_ms": max(gather_floats(fwd_bwd_ms, device)),
                       "peak_gib_per_rank": gather_floats(peak, device) if device.type == "cuda" else None}
                with torch.no_grad():
                    o_cp = context_parallel_unshard(mesh, [sdpa(q, k, v, is_causal=causal, **gqa)], [2])[0]
            finally:
                # On exit the context puts the full buffers back in place (a resize), which PyTorch
                # refuses for a tensor that requires grad: "cannot resize variables that require grad".
                q.requires_grad_(False), k.requires_grad_(False), v.requires_grad_(False)
    finally:
        _cp_options.enable_load_balance = balance
    # q, k, v are whole again: the check of what was timed (N = M, so causal means the same to both), on
    # the query heads of the first K/V head (all of them would cost the full problem on every rank)
    g = args.heads // args.kv_heads
    with torch.no_grad():
        want = attention(q[:, :g], k[:, :1], v[:, :1], causal=causal)
        rec["rel_err_vs_flashattn"] = max(gather_floats(rel_err(o_cp[:, :g], want), device))
    if not rec["rel_err_vs_flashattn"] < 2e-2:
        raise RuntimeError(f"context_parallel's output is off by {rec['rel_err_vs_flashattn']:.3g} (relative): "
                           "its times do not measure the attention asked for")
    return rec


# --------------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------------
def environment(device) -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(), "host": platform.node(),
           "world_size": dist.get_world_size(), "backend": dist.get_backend(),
           "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    if device.type == "cuda":
        import triton

        env.update(gpu=torch.cuda.get_device_name(device), triton=triton.__version__,
                   cuda=torch.version.cuda, nccl=".".join(map(str, torch.cuda.nccl.version())))
    return env


def _finite(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, list):
        return [_finite(y) for y in x]
    if isinstance(x, dict):
        return {k: _finite(y) for k, y in x.items()}
    return x


def _attempt(device, fn, *args) -> dict:
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - recorded; OOM at the largest N is expected
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}


def run(args) -> dict:
    if args.ring_fetch is not None:
        fd.DIRECT_FETCH_MAX_WORLD = 0 if args.ring_fetch == "relay" else 1 << 30
        if args.ring_fetch != "relay":
            fd.DIRECT_FETCH_BY = args.ring_fetch.replace("-", "_")
    if args.sm_margin is not None:
        fd.EXCHANGE_SM_MARGIN = args.sm_margin
    device = init(args.dry_run)
    world, rank = dist.get_world_size(), dist.get_rank()
    masks = {"causal": [True], "full": [False], "both": [False, True]}[args.mask]
    try:
        problem = check_strategies(args, world)
        if problem:  # every rank finds the same, before any collective
            raise SystemExit(problem)
        grid = None
        if "hybrid" in args.strategy:
            args.ulysses_size = args.ulysses_size or default_ulysses_size(world)
            grid = make_grid(world, rank, args.ulysses_size)
        payload = {"environment": environment(device),
                   "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                   "ring_fetch": fd.DIRECT_FETCH_BY.replace("_", "-") if world <= fd.DIRECT_FETCH_MAX_WORLD else "relay",
                   "sm_margin": fd.EXCHANGE_SM_MARGIN,
                   "methods": {"timing": TIMING_HOW.format(warmup=args.warmup, reps=args.reps),
                               "baseline": BASELINE_HOW,
                               "strategies": {s: STRATEGY_HOW[s] for s in args.strategy},
                               "flops": "flashattn.cost.attention_flops over the full sequence, / world size per GPU; "
                                        "fwd_bwd = 3.5 x fwd",
                               "balance": "(max - min) / mean over ranks of the time of each rank's local forward "
                                          "calls alone (its ring steps with its own K/V standing in for the others'; for "
                                          "Ulysses one call on the whole sequence of its heads; no communication)",
                               "exchange": "with --profile-exchange, one more forward per strategy under torch.profiler "
                                           "(CUDA kernels only), per rank: its span, the time compute kernels run, the "
                                           "time NCCL kernels run, the NCCL time no compute kernel overlaps, and the "
                                           "time no kernel runs (benchmarks.ring.interval_stats)"},
                   "rows": []}

        def save(rows):
            for row in rows:
                summarize(args, row, world)
            if rank == 0:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(_finite(payload), indent=2) + "\n", encoding="utf-8")

        for n in args.lengths:
            for causal in masks:
                base = {"n": n, "n_per_gpu": n // world, "causal": causal, "world_size": world}
                rows = [{**base, "strategy": s} for s in args.strategy]
                payload["rows"].extend(rows)
                parts = 2 * world if causal else world
                if n % parts:
                    for row in rows:
                        row["error"] = f"N = {n} is not divisible by {parts}"
                    save(rows)
                    continue
                # rows are written after every measurement: a run cut short keeps what it measured
                for row in rows:
                    strategy = row["strategy"]
                    row[strategy] = _attempt(device, measure_strategy, args, strategy, n, causal, device, grid)
                    dist.barrier()
                    save(rows)
                shared = [] if args.dry_run or args.no_single_gpu else [("single_gpu", measure_single_gpu)]
                if not args.dry_run and not args.no_torch_cp:
                    shared.append(("torch_cp", measure_torch_cp))
                for name, fn in shared:
                    rec = _attempt(device, fn, args, n, causal, device)
                    for row in rows:
                        row[name] = rec
                    dist.barrier()
                    save(rows)
                if rank == 0:
                    for row in rows:
                        print(json.dumps(_finite(row)), flush=True)
    finally:
        dist.destroy_process_group()
    return payload


def summarize(args, row: dict, world: int) -> None:
    """TFLOP/s per GPU of each provider, and the row's strategy's fraction of the single-GPU kernel and
    speed-up over torch's CP."""
    flops = cost.attention_flops(args.batch, args.heads, row["n"], row["n"], args.head_dim, causal=row["causal"],
                                 mode="fwd")
    strategy = row.get("strategy", "ring")
    for name in (strategy, "torch_cp"):
        rec = row.get(name)
        if rec and "fwd_ms" in rec:
            rec["fwd_tflops_per_gpu"] = flops / world / rec["fwd_ms"] / 1e9
            rec["fwd_bwd_tflops_per_gpu"] = 3.5 * flops / world / rec["fwd_bwd_ms"] / 1e9
    mine, single, cp = row.get(strategy, {}), row.get("single_gpu", {}), row.get("torch_cp", {})
    if "fwd_tflops_per_gpu" in mine and "fwd_tflops" in single:
        row["fraction_of_single_gpu"] = {m: mine[f"{m}_tflops_per_gpu"] / single[f"{m}_tflops"]
                                         for m in ("fwd", "fwd_bwd")}
    if "fwd_ms" in mine and "fwd_ms" in cp:
        row["speedup_vs_torch_cp"] = {m: cp[f"{m}_ms"] / mine[f"{m}_ms"] for m in ("fwd", "fwd_bwd")}


def markdown(payload: dict) -> str:
    """The run as the site's ring page shows it: where it ran, then one table row per length, mask and
    strategy (a strategy column when the run measured several; times are the slowest rank's medians;
    fractions and speed-ups as :func:`summarize` computes them; a provider that failed shows its error)."""
    from benchmarks import report  # its table-cell escaping: an error message may hold '|' or newlines

    env, cfg = payload.get("environment", {}), payload.get("config", {})
    strategies = cfg.get("strategy") or ["ring"]  # runs from before --strategy measured the ring
    several = len(strategies) > 1
    world = env.get("world_size", "?")
    out = [f"{world} × {env.get('gpu', env.get('backend', '?'))}, torch {env.get('torch', '?')}, "
           f"triton {env.get('triton', '-')}, NCCL {env.get('nccl', '-')}, {env.get('date', '')[:10]}; "
           f"B = {cfg.get('batch')}, H = {cfg.get('heads')} (K/V heads {cfg.get('kv_heads')}), "
           f"D = {cfg.get('head_dim')}, {cfg.get('dtype')}; {cfg.get('warmup')} warm-up and "
           f"{cfg.get('reps')} timed calls per rank"
           + (f"; hybrid: Ulysses groups of {cfg.get('ulysses_size')}." if "hybrid" in strategies else "."), "",
           "| N | N per GPU | mask | " + ("strategy | fwd" if several else f"{strategies[0]} fwd")
           + " / fwd+bwd (ms) | TFLOP/s per GPU | of one GPU's | balance "
           "| peak GiB per GPU | torch CP fwd / fwd+bwd (ms) | speed-up over torch CP | torch CP peak GiB |",
           "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if several else "")]

    def pair(rec, a, b, fmt):
        return f"{fmt.format(rec[a])} / {fmt.format(rec[b])}" if a in rec and b in rec else "-"

    for row in payload.get("rows", []):
        strategy = row.get("strategy", "ring")
        ring, cp = row.get(strategy, {}), row.get("torch_cp", {})
        if "error" in row and not ring:  # a length the ranks cannot split
            ring = {"error": row["error"]}
        if "error" in ring:
            ring_cells = [report._md(f"failed: {ring['error']}", 80), "-", "-", "-", "-"]
        else:
            ring_cells = [pair(ring, "fwd_ms", "fwd_bwd_ms", "{:.1f}"),
                          pair(ring, "fwd_tflops_per_gpu", "fwd_bwd_tflops_per_gpu", "{:.0f}"),
                          pair(row.get("fraction_of_single_gpu", {}), "fwd", "fwd_bwd", "{:.2f}"),
                          f"{ring['balance']:.1%}" if ring.get("balance") is not None else "-",
                          f"{max(ring['peak_gib_per_rank']):.2f}" if ring.get("peak_gib_per_rank") else "-"]
        if "error" in cp:
            cp_cells = [report._md(f"failed: {cp['error']}", 80), "-", "-"]
        elif cp:
            cp_cells = [pair(cp, "fwd_ms", "fwd_bwd_ms", "{:.1f}"),
                        pair(row.get("speedup_vs_torch_cp", {}), "fwd", "fwd_bwd", "{:.2f}×"),
                        f"{max(cp['peak_gib_per_rank']):.2f}" if cp.get("peak_gib_per_rank") else "-"]
        else:
            cp_cells = ["not run", "-", "-"]
        cells = [f"{row['n']:,}", f"{row.get('n_per_gpu', row['n']):,}", "causal" if row["causal"] else "none",
                 *([strategy] if several else []), *ring_cells, *cp_cells]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
