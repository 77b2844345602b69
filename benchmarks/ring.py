"""Scaling benchmark of ring attention (:mod:`flashattn.distributed`), one process per GPU.

    torchrun --nproc-per-node 2 -m benchmarks.ring --out benchmarks/results/ring_2gpu.json
    torchrun --nproc-per-node 4 -m benchmarks.ring --lengths 65536 262144 1048576 --out ...
    python -m benchmarks.ring --dry-run --out /tmp/ring.json   # CPU, gloo, tiny shapes, 1 process

For every total length N (largest first is not required; a length that runs out of memory is recorded
and the run goes on), causal and not, it measures on every rank:

* the ring's forward and forward + backward time (CUDA events, fixed warm-up and repetition counts so
  every rank makes the same number of collective calls; the slowest rank's median is reported) and
  the peak memory of one forward + backward;
* the single-GPU kernel at the same per-GPU work (``triton.testing.do_bench``, no communication):
  non-causal, queries N/P against all N keys; causal, a causal square of length sqrt(N^2/P) rounded to
  128, which has the same number of visible pairs per GPU. The ratio of the ring's TFLOP/s per GPU to
  this kernel's is ``fraction_of_single_gpu`` (the target is >= 0.9 at N/P >= 32k);
* the causal balance: each rank's compute alone (its ring steps with no communication), reported as
  (max - min) / mean over ranks (target: within 5%);
* PyTorch's own context parallelism (``torch.distributed.tensor.experimental.context_parallel`` around
  ``scaled_dot_product_attention``) at the same N, where it runs; its failure message where not.

FLOPs come from :func:`flashattn.cost.attention_flops` (the cost-model page's formula): a ring call
does the full sequence's FLOPs, divided by P per GPU. The JSON records the GPUs, versions and
methods beside the numbers.
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

import torch
import torch.distributed as dist

from flashattn import cost
from flashattn import distributed as fd

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
DEFAULT_LENGTHS = [65536, 131072, 262144, 524288, 1048576]
TIMING_HOW = ("CUDA events around each call after a barrier, {warmup} warm-up and {reps} timed calls on every "
              "rank (fixed counts: every rank makes the same collective calls); median per rank, slowest rank reported")
BASELINE_HOW = ("flashattn.attention on one GPU with the same visible (query, key) pairs per GPU: non-causal q of N/P "
                "rows against N keys; causal, a causal square of length sqrt(N^2 / P) rounded to 128; "
                "triton.testing.do_bench median")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ring", description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=None, help="total sequence lengths N (all ranks)")
    p.add_argument("--heads", type=int, default=1, help="query heads (default 1: one head group)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--mask", choices=["causal", "full", "both"], default="both")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--no-torch-cp", action="store_true", help="skip PyTorch's context_parallel")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, gloo, float64, tiny lengths, no baseline or memory: checks the harness runs")
    p.add_argument("--out", type=Path, required=True, help="JSON file (written by rank 0, after every length)")
    args = p.parse_args(argv)
    if args.lengths is None:
        args.lengths = [64, 128] if args.dry_run else DEFAULT_LENGTHS
    if args.dry_run:
        args.dtype, args.head_dim, args.warmup, args.reps = "float64", 16, 1, 2
    args.kv_heads = args.kv_heads or args.heads
    for name in ("heads", "kv_heads", "head_dim", "batch", "warmup", "reps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
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
    for _ in range(warmup):
        fn()
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
    return statistics.median(times)


def gather_floats(x: float, device) -> list[float]:
    t = torch.tensor([x], dtype=torch.float64, device=device)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [float(o.item()) for o in out]


def peak_memory(fn, device) -> float | None:
    """Peak GiB allocated on this GPU during ``fn()`` (everything: inputs, buffers, gradients)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) / 2**30


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


def measure_ring(args, n: int, causal: bool, device) -> dict:
    layout = "zigzag" if causal else "contiguous"
    q, k, v, do = local_shards(args, n, device, seed=n)

    def fwd():
        with torch.no_grad():
            fd.ring_attention(q, k, v, causal=causal, layout=layout)

    def fwd_bwd():
        o = fd.ring_attention(q, k, v, causal=causal, layout=layout)
        o.backward(do)
        q.grad = k.grad = v.grad = None

    rec = {"fwd_ms": max(gather_floats(timed_ms(fwd, device, args.warmup, args.reps), device)),
           "fwd_bwd_ms": max(gather_floats(timed_ms(fwd_bwd, device, args.warmup, args.reps), device))}
    rec["peak_gib_per_rank"] = gather_floats(peak_memory(fwd_bwd, device), device) if device.type == "cuda" else None
    rec["compute_ms_per_rank"] = gather_floats(rank_compute_ms(args, q, k, v, causal, layout, device), device)
    work = rec["compute_ms_per_rank"]
    rec["balance"] = (max(work) - min(work)) / statistics.mean(work) if statistics.mean(work) > 0 else None
    return rec


def rank_compute_ms(args, q, k, v, causal, layout, device) -> float:
    """This rank's ring steps with its own K/V standing in for the others' (same shapes), no communication."""
    rank, world, n_local = dist.get_rank(), dist.get_world_size(), q.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1])

    def steps():
        with torch.no_grad():
            for source in range(world):
                plan = fd.ring_step(rank, source, n_local, causal, layout)
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
    import triton.testing

    import flashattn

    rows, cols = baseline_shape(n, dist.get_world_size(), causal)
    dtype = DTYPES[args.dtype]
    gen = torch.Generator(device=device).manual_seed(1)
    q = torch.randn(args.batch, args.heads, rows, args.head_dim, dtype=dtype, device=device, generator=gen)
    k, v = (torch.randn(args.batch, args.kv_heads, cols, args.head_dim, dtype=dtype, device=device, generator=gen)
            for _ in range(2))
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    do = torch.randn_like(q)

    def fwd_bwd():
        flashattn.attention(q, k, v, causal=causal).backward(do)

    with torch.no_grad():
        fwd_ms = triton.testing.do_bench(lambda: flashattn.attention(q, k, v, causal=causal), return_mode="median")
    fwd_bwd_ms = triton.testing.do_bench(fwd_bwd, grad_to_none=[q, k, v], return_mode="median")
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
                rec = {"fwd_ms": max(gather_floats(timed_ms(fwd, device, args.warmup, args.reps), device)),
                       "fwd_bwd_ms": max(gather_floats(timed_ms(fwd_bwd, device, args.warmup, args.reps), device)),
                       "peak_gib_per_rank": gather_floats(peak_memory(fwd_bwd, device), device)}
                with torch.no_grad():
                    o_cp = context_parallel_unshard(mesh, [sdpa(q, k, v, is_causal=causal, **gqa)], [2])[0]
            finally:
                # On exit the context puts the full buffers back in place (a resize), which PyTorch
                # refuses for a tensor that requires grad: "cannot resize variables that require grad".
                q.requires_grad_(False), k.requires_grad_(False), v.requires_grad_(False)
    finally:
        _cp_options.enable_load_balance = balance
    # q, k, v are whole again: the check of what was timed (N = M, so causal means the same to both)
    with torch.no_grad():
        rec["rel_err_vs_flashattn"] = max(gather_floats(rel_err(o_cp, attention(q, k, v, causal=causal)), device))
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


def run(args) -> dict:
    device = init(args.dry_run)
    world, rank = dist.get_world_size(), dist.get_rank()
    masks = {"causal": [True], "full": [False], "both": [False, True]}[args.mask]
    payload = {"environment": environment(device),
               "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               "methods": {"timing": TIMING_HOW.format(warmup=args.warmup, reps=args.reps), "baseline": BASELINE_HOW,
                           "flops": "flashattn.cost.attention_flops over the full sequence, / world size per GPU; "
                                    "fwd_bwd = 3.5 x fwd",
                           "balance": "(max - min) / mean over ranks of the time of each rank's ring-step forward calls "
                                      "alone (its own K/V standing in for the others', no communication)"},
               "rows": []}
    try:
        for n in args.lengths:
            for causal in masks:
                row = {"n": n, "n_per_gpu": n // world, "causal": causal, "world_size": world}
                parts = 2 * world if causal else world
                if n % parts:
                    row["error"] = f"N = {n} is not divisible by {parts}"
                    payload["rows"].append(row)
                    continue
                providers = [("ring", measure_ring)]
                if not args.dry_run:
                    providers.append(("single_gpu", measure_single_gpu))
                    if not args.no_torch_cp:
                        providers.append(("torch_cp", measure_torch_cp))
                for name, fn in providers:
                    try:
                        row[name] = fn(args, n, causal, device)
                    except Exception as exc:  # noqa: BLE001 - recorded; OOM at the largest N is expected
                        row[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
                    dist.barrier()
                summarize(args, row, world)
                payload["rows"].append(row)
                if rank == 0:
                    args.out.parent.mkdir(parents=True, exist_ok=True)
                    args.out.write_text(json.dumps(_finite(payload), indent=2) + "\n", encoding="utf-8")
                    print(json.dumps(_finite(row)), flush=True)
    finally:
        dist.destroy_process_group()
    return payload


def summarize(args, row: dict, world: int) -> None:
    """TFLOP/s per GPU of each provider, and the ring's fraction of the single-GPU kernel and of torch's CP."""
    flops = cost.attention_flops(args.batch, args.heads, row["n"], row["n"], args.head_dim, causal=row["causal"],
                                 mode="fwd")
    for name in ("ring", "torch_cp"):
        rec = row.get(name)
        if rec and "fwd_ms" in rec:
            rec["fwd_tflops_per_gpu"] = flops / world / rec["fwd_ms"] / 1e9
            rec["fwd_bwd_tflops_per_gpu"] = 3.5 * flops / world / rec["fwd_bwd_ms"] / 1e9
    ring, single, cp = row.get("ring", {}), row.get("single_gpu", {}), row.get("torch_cp", {})
    if "fwd_tflops_per_gpu" in ring and "fwd_tflops" in single:
        row["fraction_of_single_gpu"] = {m: ring[f"{m}_tflops_per_gpu"] / single[f"{m}_tflops"] for m in ("fwd", "fwd_bwd")}
    if "fwd_ms" in ring and "fwd_ms" in cp:
        row["speedup_vs_torch_cp"] = {m: cp[f"{m}_ms"] / ring[f"{m}_ms"] for m in ("fwd", "fwd_bwd")}


def markdown(payload: dict) -> str:
    """The run as the site's ring page shows it: where it ran, then one table row per length and mask
    (times are the slowest rank's medians; fractions and speed-ups as :func:`summarize` computes them;
    a provider that failed shows its error)."""
    from benchmarks import report  # its table-cell escaping: an error message may hold '|' or newlines

    env, cfg = payload.get("environment", {}), payload.get("config", {})
    world = env.get("world_size", "?")
    out = [f"{world} × {env.get('gpu', env.get('backend', '?'))}, torch {env.get('torch', '?')}, "
           f"triton {env.get('triton', '-')}, NCCL {env.get('nccl', '-')}, {env.get('date', '')[:10]}; "
           f"B = {cfg.get('batch')}, H = {cfg.get('heads')} (K/V heads {cfg.get('kv_heads')}), "
           f"D = {cfg.get('head_dim')}, {cfg.get('dtype')}; {cfg.get('warmup')} warm-up and "
           f"{cfg.get('reps')} timed calls per rank.", "",
           "| N | N per GPU | mask | ring fwd / fwd+bwd (ms) | TFLOP/s per GPU | of one GPU's | balance "
           "| peak GiB per GPU | torch CP fwd / fwd+bwd (ms) | speed-up over torch CP | torch CP peak GiB |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]

    def pair(rec, a, b, fmt):
        return f"{fmt.format(rec[a])} / {fmt.format(rec[b])}" if a in rec and b in rec else "-"

    for row in payload.get("rows", []):
        ring, cp = row.get("ring", {}), row.get("torch_cp", {})
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
                 *ring_cells, *cp_cells]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
