"""Time to the first call of a new configuration, with a cold and a warm Triton cache.

    PYTHONPATH=. python -m benchmarks.first_call [--out benchmarks/results/short] [--warmup] [--foreground]

Triton compiles a kernel the first time one of its configurations runs (dtype, head dim, mask,
variant, tile) and keeps the result under ``TRITON_CACHE_DIR``. For each configuration of
:data:`CONFIGS`, a fresh Python process is started with its own cache directory (cold), then a
second fresh process with the same directory (warm). Each child imports torch and flashattn,
initializes CUDA and runs one call of an unrelated configuration (:data:`UNRELATED`) before anything
is timed for the configuration, so that what every process pays once (imports, CUDA context,
Triton's driver helpers) is reported on its own. The cold directory starts as a copy of one in
which only that unrelated call ran (a "prime" child, itself reported: its unrelated call is a
process's first compile on an empty cache), so the cold child's unrelated call costs no compile and
its configuration's kernels are not in the cache. Then, with ``torch.cuda.synchronize()`` before and
after each and ``time.perf_counter``: the first forward, the first backward of it, and a second
forward + backward (the steady cost, for reference). ``--warmup`` also measures each configuration
with ``flashattn.warmup`` of its shape run in the child before the timed calls, reported apart;
``--foreground`` also measures it with ``FLASHATTN_BACKGROUND_COMPILE=0``, where the backward's
kernels compile when the backward runs instead of beside the first forward
(:func:`flashattn.launch.in_background`).
Writes ``DIR/first_call.json`` and ``DIR/first_call.md``; without a CUDA GPU it stops and writes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "short"
HOW = ("a fresh process per measurement, TRITON_CACHE_DIR a copy of a cache holding only the unrelated call's "
       "kernels (cold), then the same directory again (warm); torch.cuda.synchronize() and time.perf_counter() "
       "around each call, after imports, CUDA start and one unrelated call")
MARKER = "FIRST_CALL_RESULT "  # the child's one line of JSON for the parent
DTYPES = ("float16", "bfloat16")
# A configuration shares no kernel with UNRELATED (head dim 32, forward only).
UNRELATED = {"name": "unrelated", "dtype": "float16", "head_dim": 32, "causal": False, "batch": 1, "heads": 2,
             "seqlen": 64, "options": {}}
CONFIGS = (
    {"name": "bf16 D128 causal", "dtype": "bfloat16", "head_dim": 128, "causal": True, "batch": 8, "heads": 16,
     "seqlen": 256, "options": {}},
    {"name": "fp16 D64", "dtype": "float16", "head_dim": 64, "causal": False, "batch": 32, "heads": 12,
     "seqlen": 128, "options": {}},
    {"name": "bf16 D128 causal window 256", "dtype": "bfloat16", "head_dim": 128, "causal": True, "batch": 4,
     "heads": 16, "seqlen": 1024, "options": {"window": [256, 0]}},
    {"name": "bf16 D64 softcap 30", "dtype": "bfloat16", "head_dim": 64, "causal": False, "batch": 32, "heads": 16,
     "seqlen": 257, "options": {"softcap": 30.0}},
)


# -- the child: one fresh process ----------------------------------------------------------------------------

def _options(cfg) -> dict:
    opts = dict(cfg["options"])
    if "window" in opts:
        opts["window"] = tuple(opts["window"])
    return opts


def _inputs(torch, cfg, device):
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (cfg["batch"], cfg["heads"], cfg["seqlen"], cfg["head_dim"])
    dtype = getattr(torch, cfg["dtype"])
    q, k, v, do = (torch.randn(shape, dtype=dtype, device=device, generator=gen) for _ in range(4))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), do


def child(cfg, *, device="cuda", warmup=False, clock=time.perf_counter) -> dict:
    """The timings of one process (seconds): imports, CUDA start, the unrelated call, then, when ``cfg``
    is given, the configuration's first forward and backward and a second forward + backward."""
    t0 = clock()
    import torch

    import flashattn

    out = {"import_s": clock() - t0}
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)

    def timed(fn):
        sync()
        start = clock()
        result = fn()
        sync()
        return result, clock() - start

    _, out["cuda_init_s"] = timed(lambda: torch.zeros(1, device=device))
    # torch's own first backward in a process imports torch.fx's symbolic shapes (and SymPy with it):
    # seconds that any library's first backward would pay, so they count with the process's one-time costs
    # (with explicit grad_outputs, as the timed backward passes them: that check is what imports them)
    x = torch.ones(2, device=device, requires_grad=True)
    _, out["torch_first_grad_s"] = timed(lambda: torch.autograd.grad(x * x, x, torch.ones_like(x)))
    q, k, v, _ = _inputs(torch, UNRELATED, device)
    _, out["unrelated_call_s"] = timed(lambda: flashattn.attention(q.detach(), k.detach(), v.detach()))
    if cfg is None:
        return out
    q, k, v, do = _inputs(torch, cfg, device)
    causal, opts = cfg["causal"], _options(cfg)
    if warmup:
        shape = (cfg["batch"], cfg["heads"], cfg["heads"], cfg["seqlen"], cfg["seqlen"], cfg["head_dim"])
        _, out["warmup_s"] = timed(lambda: flashattn.warmup([shape], dtype=q.dtype, device=device, causal=causal,
                                                            **opts))
    o, out["first_fwd_s"] = timed(lambda: flashattn.attention(q, k, v, causal=causal, **opts))
    _, out["first_bwd_s"] = timed(lambda: torch.autograd.grad(o, (q, k, v), do))
    _, out["second_fwd_bwd_s"] = timed(
        lambda: torch.autograd.grad(flashattn.attention(q, k, v, causal=causal, **opts), (q, k, v), do))
    out["first_fwd_bwd_s"] = out["first_fwd_s"] + out["first_bwd_s"]
    return out


# -- the parent: fresh processes, fresh caches -------------------------------------------------------------

def spawn(cfg, cache_dir, warmup, *, background=True, timeout_s=600.0) -> dict:
    """Run :func:`child` in a new Python process with ``TRITON_CACHE_DIR=cache_dir`` (and background
    compiles off unless ``background``); its timings, the process's wall time, or the error it ended with."""
    cmd = [sys.executable, "-m", "benchmarks.first_call", "--child", json.dumps(cfg)] + (["--warmup"] * warmup)
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache_dir), "FLASHATTN_BACKGROUND_COMPILE": "1" if background else "0"}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"no result after {timeout_s:.0f} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARKER)]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-1500:]}"}
    return {**json.loads(lines[-1][len(MARKER):]), "process_s": time.perf_counter() - t0}


def measure(configs, *, modes=("plain",), spawn_fn=spawn, log=print) -> dict:
    """Per mode (``plain``, ``warmup``, ``foreground``: background compiles off) and configuration: a
    cold and a warm child on one fresh cache."""
    root = pathlib.Path(tempfile.mkdtemp(prefix="flashattn-first-call-"))
    try:
        prime_dir = root / "prime"
        prime_dir.mkdir()
        prime = spawn_fn(None, prime_dir, False)
        log(f"[first_call] prime (empty cache): {prime}")
        rows = []
        for mode in modes:
            for i, cfg in enumerate(configs):
                cache = root / f"{mode}-{i}"
                shutil.copytree(prime_dir, cache)
                background = mode != "foreground"
                cold = spawn_fn(cfg, cache, mode == "warmup", background=background)
                warm = spawn_fn(cfg, cache, mode == "warmup", background=background)
                rows.append({"mode": mode, **cfg, "cold": cold, "warm": warm})
                log(f"[first_call] {mode} {cfg['name']}: cold {cold}, warm {warm}")
        return {"prime": prime, "rows": rows}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _s(child_out, key) -> str:
    if "error" in child_out:
        return "error"
    value = child_out.get(key)
    return "–" if value is None else (f"{value:.2f}" if value >= 0.1 else f"{value * 1e3:.1f} ms")


def markdown(result: dict) -> str:
    versions = result["versions"]
    prime = result["prime"]
    lines = [f"{result['what']}; {result['device']}, torch {versions['torch']}, triton {versions['triton']}. "
             "Seconds (or ms) from the call to its synchronize, in a fresh process; cold: a Triton cache "
             "without the configuration's kernels, warm: the same cache after the cold process.", "",
             f"Once per process, before any of it: imports {_s(prime, 'import_s')}, CUDA start "
             f"{_s(prime, 'cuda_init_s')}, torch's first autograd call (its lazy imports) "
             f"{_s(prime, 'torch_first_grad_s')}, first call on an empty cache (an unrelated configuration, "
             f"compiled) {_s(prime, 'unrelated_call_s')}.", "",
             "| configuration | mode | cold: warmup | cold: fwd | cold: fwd+bwd | warm: warmup | warm: fwd "
             "| warm: fwd+bwd | steady fwd+bwd | per process (warm) |",
             "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for row in result["rows"]:
        cold, warm = row["cold"], row["warm"]
        once = "error" if "error" in warm else _s({"x": sum(warm.get(k, 0) for k in
                                                             ("import_s", "cuda_init_s", "torch_first_grad_s",
                                                              "unrelated_call_s"))}, "x")
        lines.append(f"| {row['name']} (B{row['batch']} H{row['heads']} N{row['seqlen']}) | {row['mode']} | "
                     f"{_s(cold, 'warmup_s')} | {_s(cold, 'first_fwd_s')} | {_s(cold, 'first_fwd_bwd_s')} | "
                     f"{_s(warm, 'warmup_s')} | {_s(warm, 'first_fwd_s')} | {_s(warm, 'first_fwd_bwd_s')} | "
                     f"{_s(warm, 'second_fwd_bwd_s')} | {once} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=OUT)
    parser.add_argument("--warmup", action="store_true",
                        help="also measure with flashattn.warmup(...) of the shape in the child first")
    parser.add_argument("--foreground", action="store_true",
                        help="also measure with background compiles off (FLASHATTN_BACKGROUND_COMPILE=0)")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # JSON configuration (or null): run as the child
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # the child's device (cpu: tests)
    args = parser.parse_args(argv)
    if args.child is not None:
        print(MARKER + json.dumps(child(json.loads(args.child), device=args.device, warmup=args.warmup)), flush=True)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("benchmarks.first_call needs a CUDA GPU: nothing was measured or written", file=sys.stderr)
        return 2
    from benchmarks import side

    modes = ("plain",) + ("foreground",) * args.foreground + ("warmup",) * args.warmup
    measured = measure(CONFIGS, modes=modes)
    result = side.record("time to the first call of a configuration, cold and warm Triton cache",
                         torch.device("cuda"), measured["rows"], prime=measured["prime"], unrelated=UNRELATED,
                         how=HOW)
    return side.write(args.out, "first_call", result, markdown)


if __name__ == "__main__":
    sys.exit(main())
