"""Run the benchmark: every provider at every setting of the grid, in one process on one GPU.

    PYTHONPATH=. python -m benchmarks.run [--quick] [--out benchmarks/results] [--budget-s 480]
    PYTHONPATH=. python -m benchmarks.run --sections latency --out benchmarks/results-latency

For each setting (dtype x head dim x mask x length, see :mod:`benchmarks.grid`) and each provider
(see :mod:`benchmarks.providers`): prepare it (FlexAttention compiles here), check it against float64
at the first length of each dtype x head dim x mask, time the forward and the backward, and measure the
peak memory of a forward + backward. Any failure is recorded with its message and the run goes on.
The results file is rewritten after every setting, so a run cut short still leaves what it measured.
At the end: the long-context memory check, the per-call latency section at small shapes
(:mod:`benchmarks.latency`), then the plots and ``summary.md`` (:mod:`benchmarks.report`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from benchmarks import grid as grid_mod
from benchmarks.provenance import _git, package_sources_sha256, sources_sha256_at
from benchmarks import latency as latency_mod, measure, providers as providers_mod, results as results_mod

BACKWARD_HOW = ("o.backward(do, retain_graph=True) after one forward, timed alone; gradients of q, k, v set "
                "to None before each call (do_bench grad_to_none)")
DEVICE = "cuda"  # a module constant so the CPU test of main() can point it elsewhere
FORWARD_HOW = "fn(q, k, v) with q, k, v requiring grad (a training forward: what the backward needs is saved)"
MEMORY_HOW = ("torch.cuda.max_memory_allocated after reset_peak_memory_stats over one forward + backward, minus "
              "memory_allocated before it (q, k, v, dO excluded; o, saved statistics, workspaces, dq, dk, dv "
              "included)")


def _finite(x):
    """JSON has no inf or NaN: keep them as strings."""
    return x if isinstance(x, (int, str)) or math.isfinite(x) else str(x)


def _record(setting, provider, **fields) -> dict:
    rec = {k: getattr(setting, k) for k in results_mod.SETTING_KEYS}
    rec["provider"] = provider.name
    rec.update(fields)
    return rec


class Clock:
    """Seconds since the run began, and whether the time budget is spent."""

    def __init__(self, budget_s: float | None):
        self.start, self.budget_s = time.monotonic(), budget_s

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def over(self) -> bool:
        return self.budget_s is not None and self.budget_s > 0 and self.elapsed() > self.budget_s


def run_grid(settings, providers, *, device, timer, peak_memory, clock=None, progress=None, on_setting=None,
             log=print, host_sync=None) -> dict:
    """Measure every provider at every setting; return ``{"checks", "measurements", "memory"}``.

    ``timer(fn, grad_to_none=None) -> ms`` and ``peak_memory(fn, inputs) -> bytes`` are injected so the
    loop itself runs (and is tested) on a CPU; a GPU run passes the do_bench timer and CUDA memory stats.
    With ``host_sync`` (a function that waits for the device) each timing also gets ``host_us``, the
    host's time to issue one call (:func:`benchmarks.measure.host_us_per_call`).
    The first setting of each dtype x head dim x mask is also the correctness-check shape.
    """
    clock = clock or Clock(None)
    out = {"checks": [], "measurements": [], "memory": []}
    checked_groups = set()
    failed_first = {}  # (provider, group) -> why the rest of the group is skipped
    for index, setting in enumerate(settings):
        do_check = setting.group not in checked_groups
        checked_groups.add(setting.group)
        inputs = measure.make_inputs(setting, device, seed=index)
        refs = {}  # the check's float64 and low-precision references, made once per setting when needed
        line = []
        for provider in providers:
            if progress is not None:
                progress.set_postfix_str(f"{setting.label()} {provider.name}", refresh=False)
            reason = provider.skip_reason(setting)
            if reason is None and (provider.name, setting.group) in failed_first:
                reason = failed_first[(provider.name, setting.group)]
            if reason is None and clock.over():
                reason = f"time budget of {clock.budget_s:.0f} s spent before this setting"
            if reason is None:
                failure = _measure_one(setting, provider, inputs, refs, device=device, timer=timer,
                                       peak_memory=peak_memory, do_check=do_check, out=out, line=line,
                                       host_sync=host_sync)
                # A provider that cannot even make its first call (a compile error, a refused head dim)
                # is not retried at the longer lengths of the group: each attempt can cost a compile.
                # Out of memory is not carried over: a shorter length may fit where a longer one did not.
                if failure is not None and failure[0] in ("error", "unsupported"):
                    failed_first[(provider.name, setting.group)] = (
                        f"not retried: {failure[0]} at N = {setting.seqlen} of this group: {failure[1][:300]}")
            else:
                for p in results_mod.PASSES:
                    out["measurements"].append(_record(setting, provider, **{"pass": p}, status="skipped", error=reason))
                out["memory"].append(_record(setting, provider, status="skipped", error=reason))
            if progress is not None:
                progress.update(1)
        del inputs, refs
        if device != "cpu":
            torch.cuda.empty_cache()
        log(f"[{clock.elapsed():6.0f} s] {setting.label()}: " + "  ".join(line))
        if on_setting is not None:
            on_setting(out)
    return out


def _measure_one(setting, provider, inputs, refs, *, device, timer, peak_memory, do_check, out, line,
                 host_sync=None):
    """Prepare, check (where due), time both passes and take the memory of one provider at one setting.

    Returns (status, message) when the provider could not make its first call, else None."""
    failure = None  # (status, message) once a step fails: the later steps are not attempted
    prepare_s = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            t0 = time.monotonic()
            fn = provider.prepare(setting, device)
            q, k, v, do = inputs
            fn(q, k, v)  # first call: compiles, autotunes, or says the backend cannot run this shape
            if device != "cpu":
                torch.cuda.synchronize()
            prepare_s = time.monotonic() - t0
        except Exception as exc:  # noqa: BLE001 -- any failure is a result to record
            failure = measure.classify_error(exc, caught)
    if do_check:
        rec = _record(setting, provider)
        if failure is None:
            try:
                if not refs:
                    refs.update(measure.reference_results(setting, inputs))
                result = measure.check(fn, inputs, refs)
                result["rel_err"] = {k: _finite(x) for k, x in result["rel_err"].items()}
                result["naive_lowp_rel_err"] = {k: _finite(x) for k, x in result["naive_lowp_rel_err"].items()}
                rec.update(status="ok" if result["passed"] else "failed", **result)
            except Exception as exc:  # noqa: BLE001
                status, message = measure.classify_error(exc)
                rec.update(status=status, passed=False, error=message)
        else:
            rec.update(status=failure[0], passed=False, error=failure[1])
        out["checks"].append(rec)
        errs = rec.get("rel_err")
        detail = (", ".join(f"{k} {x:.1e}" if isinstance(x, float) else f"{k} {x}" for k, x in errs.items())
                  if errs else rec["status"])
        verdict = {"ok": "PASS", "failed": "FAIL"}.get(rec["status"], "not run")
        line.append(f"{provider.name}: check {verdict} ({detail})")
    times = {}
    gqa = getattr(fn, "gqa", None) if failure is None else None
    for p, time_pass in (("fwd", measure.time_forward), ("bwd", measure.time_backward)):
        rec = _record(setting, provider, **{"pass": p})
        if gqa:
            rec["gqa"] = gqa
        if failure is None:
            try:
                ms = time_pass(fn, inputs, timer)
                flops, tf = measure.tflops(setting, p, ms)
                rec.update(status="ok", ms=ms, flops=flops, tflops=tf, prepare_s=prepare_s)
                if host_sync is not None:
                    rec["host_us"] = time_pass(fn, inputs, measure.host_timer(host_sync, ms))
                times[p] = tf
            except Exception as exc:  # noqa: BLE001
                rec.update(zip(("status", "error"), measure.classify_error(exc)))
        else:
            rec.update(status=failure[0], error=failure[1])
        out["measurements"].append(rec)
    rec = _record(setting, provider)
    if failure is None:
        try:
            rec.update(status="ok", peak_bytes=int(peak_memory(fn, inputs)))
        except Exception as exc:  # noqa: BLE001
            rec.update(zip(("status", "error"), measure.classify_error(exc)))
    else:
        rec.update(status=failure[0], error=failure[1])
    out["memory"].append(rec)
    if times:
        line.append(f"{provider.name} {times.get('fwd', 0):.0f}/{times.get('bwd', 0):.0f}")
    elif failure is not None:
        line.append(f"{provider.name} {failure[0]}")
    return failure


def long_context(device, *, seqlen: int, head_dim: int, dtype: str) -> dict:
    """One head of length ``seqlen``: flashattn forward + backward, then the naive reference's attempt."""
    from flashattn.reference import naive_attention

    import flashattn

    setting = grid_mod.Setting(dtype, head_dim, False, seqlen, batch=1, heads=1)
    elem = torch.empty((), dtype=measure.DTYPES[dtype]).element_size()
    out = {"seqlen": seqlen, "head_dim": head_dim, "dtype": dtype, "batch": 1, "heads": 1, "causal": False,
           "gpu_memory_bytes": torch.cuda.get_device_properties(device).total_memory,
           "input_bytes": 4 * seqlen * head_dim * elem,  # q, k, v, dO
           "score_matrix_bytes": seqlen * seqlen * elem,  # one N x N matrix in the input dtype
           "score_matrix_bytes_float32": seqlen * seqlen * 4}
    for name, fn in (("flashattn", lambda q, k, v: flashattn.attention(q, k, v)),
                     ("naive", lambda q, k, v: naive_attention(q, k, v)[0])):
        inputs = measure.make_inputs(setting, device, seed=1)
        try:
            t0 = time.monotonic()
            peak = measure.cuda_peak_memory(fn, inputs)
            q, k, v, _ = inputs
            o = fn(q, k, v).detach()
            out[name] = {"status": "ok", "peak_bytes": peak, "seconds": time.monotonic() - t0,
                         "output_finite": bool(torch.isfinite(o).all())}
            del o
        except Exception as exc:  # noqa: BLE001
            status, message = measure.classify_error(exc)
            out[name] = {"status": status, "error": message}
        for x in inputs[:3]:
            x.grad = None
        del inputs
        torch.cuda.empty_cache()
    return out


def _driver_version() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # noqa: BLE001 -- fall back to nvidia-smi
        pass
    try:
        res = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return res.stdout.strip().splitlines()[0] if res.returncode == 0 and res.stdout.strip() else None
    except Exception:  # noqa: BLE001
        return None


def environment(device) -> dict:
    import triton

    props = torch.cuda.get_device_properties(device)
    try:
        import flashattn

        ours = getattr(flashattn, "__version__", None)
        sources = package_sources_sha256()
    except Exception as exc:  # noqa: BLE001
        ours, sources = f"import failed: {exc}", None
    status = _git("status", "--porcelain", "--", "flashattn")
    commit = _git("rev-parse", "HEAD")
    # git status trusts file times, and a copied tree (a GPU machine's) can keep a stale HEAD and look
    # clean: compare the commit's own sources with the ones imported instead.
    at_commit = sources_sha256_at(commit) if commit else None
    return {
        "gpu": props.name,
        "compute_capability": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count,
        "gpu_memory_bytes": props.total_memory,
        "driver": _driver_version(),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "flashattn": ours,
        "flashattn_sources_sha256": sources,
        "git_commit": commit,
        "git_flashattn_dirty": None if status is None else bool(status),
        "git_commit_is_sources": None if at_commit is None or sources is None else at_commit == sources,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(("FLASHATTN_", "TRITON_", "TORCHINDUCTOR_"))},
    }


def precompile_flex(settings, workers: int, timeout_s: float, log=print) -> dict:
    """Compile FlexAttention for every setting in ``workers`` processes, before any timing starts.

    Each compile of a new static shape costs seconds, almost all of it on the CPU. The worker processes
    fill the on-disk caches of Inductor and Triton that the timing process then reads, so its own
    compile of each shape is a cache hit. Nothing is timed while they run. A worker that fails only
    means the main process compiles that shape itself.
    """
    shapes = [s.to_dict() for s in settings if providers_mod.PROVIDERS["flex"].skip_reason(s) is None]
    if not shapes or workers <= 0:
        return {"workers": 0, "shapes": len(shapes)}
    chunks = [shapes[i::workers] for i in range(min(workers, len(shapes)))]
    env = dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS="1")
    t0 = time.monotonic()
    logdir = Path(tempfile.mkdtemp(prefix="flexwarm-"))
    procs = []
    for i, chunk in enumerate(chunks):
        logf = open(logdir / f"worker{i}.log", "w")
        procs.append((subprocess.Popen([sys.executable, "-m", "benchmarks.flex_warm", json.dumps(chunk)],
                                       env=env, stdout=logf, stderr=subprocess.STDOUT), logf))
    failed = []
    for proc, logf in procs:
        left = max(1.0, timeout_s - (time.monotonic() - t0))
        try:
            proc.wait(timeout=left)
        except subprocess.TimeoutExpired:
            proc.kill()  # our own child, by its handle
            proc.wait()
        logf.close()
        if proc.returncode != 0:
            failed.append(proc.returncode)
    elapsed = time.monotonic() - t0
    tails = []
    for f in sorted(logdir.glob("*.log")):
        text = f.read_text(errors="replace").strip().splitlines()
        tails.append(f"{f.name}: {text[-1] if text else ''}"[:300])
    log(f"[flex precompile] {len(shapes)} shapes in {len(chunks)} workers: {elapsed:.0f} s, "
        f"{len(failed)} worker(s) failed")
    return {"workers": len(chunks), "shapes": len(shapes), "seconds": elapsed, "failed_workers": len(failed),
            "log_tails": tails}


SECTIONS = ("grid", "latency")


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help="comma-separated: grid (TFLOP/s, checks, memory, long context), latency (per-call "
                         "time at small shapes); default both")
    ap.add_argument("--quick", action="store_true", help="a smaller grid: float16, N in {1k, 4k, 16k}, no GQA row")
    ap.add_argument("--out", default=None, help="output folder (default benchmarks/results, "
                                                "or benchmarks/results-quick with --quick)")
    ap.add_argument("--providers", default=",".join(providers_mod.DEFAULT),
                    help=f"comma-separated, from {sorted(providers_mod.PROVIDERS)}")
    ap.add_argument("--dtypes", help="comma-separated subset of float16,bfloat16")
    ap.add_argument("--head-dims", help="comma-separated head dims measured for every provider")
    ap.add_argument("--head-dims-ours-only", help="comma-separated head dims measured for flashattn only")
    ap.add_argument("--seqlens", help="comma-separated sequence lengths")
    ap.add_argument("--gqa-seqlens", help="comma-separated lengths of the GQA 32:8 row ('' for none)")
    ap.add_argument("--causal", choices=("both", "true", "false"), default="both")
    ap.add_argument("--tokens", type=int, default=grid_mod.TOKENS, help="batch x seqlen (default %(default)s)")
    ap.add_argument("--hidden", type=int, default=grid_mod.HIDDEN, help="heads x head dim (default %(default)s)")
    ap.add_argument("--warmup-ms", type=int, default=25, help="do_bench warm-up, in ms")
    ap.add_argument("--rep-ms", type=int, default=100, help="do_bench repetition time, in ms")
    ap.add_argument("--budget-s", type=float, default=0,
                    help="stop starting new grid measurements after this many seconds (0: no limit); "
                         "the rest are recorded as skipped")
    ap.add_argument("--flex-workers", type=int, default=8,
                    help="processes that pre-compile FlexAttention's shapes before timing (0: none)")
    ap.add_argument("--long-seqlen", type=int, default=131072, help="the single-head memory check (0: skip)")
    lat = ap.add_argument_group("latency section")
    lat.add_argument("--latency-providers", help="comma-separated (default: --providers)")
    lat.add_argument("--latency-modes", default=",".join(latency_mod.MODES), help="subset of %(default)s")
    lat.add_argument("--latency-passes", default=",".join(latency_mod.PASSES), help="subset of %(default)s")
    lat.add_argument("--latency-dtypes", default=",".join(latency_mod.DTYPES))
    lat.add_argument("--latency-head-dims", default=",".join(map(str, latency_mod.HEAD_DIMS)))
    lat.add_argument("--latency-seqlens", default=",".join(map(str, latency_mod.SEQLENS)))
    lat.add_argument("--latency-batch-heads", default=",".join(f"{b}x{h}" for b, h in latency_mod.BATCH_HEADS),
                     help="comma-separated BxH pairs (default %(default)s)")
    lat.add_argument("--latency-causal", choices=("both", "true", "false"), default="both")
    lat.add_argument("--latency-target-ms", type=float, default=latency_mod.TARGET_MS,
                     help="length of one timed loop of back-to-back calls")
    lat.add_argument("--latency-repeats", type=int, default=latency_mod.REPEATS)
    lat.add_argument("--latency-budget-s", type=float, default=0,
                     help="stop starting new latency measurements after this many seconds of the section (0: no limit)")
    ap.add_argument("--update", action="store_true",
                    help="keep the sections of an existing results.json in --out that this run does not measure "
                         "(e.g. add the latency section to a grid run made before)")
    ap.add_argument("--no-report", action="store_true", help="skip the plots and summary.md")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    args.sections = _strs(args.sections)
    unknown = set(args.sections) - set(SECTIONS)
    if unknown or not args.sections:
        ap.error(f"--sections takes a comma-separated subset of {SECTIONS}, got {args.sections}")
    return args


def _ints(text):
    return tuple(int(x) for x in text.split(",") if x.strip())


def _strs(text):
    return tuple(x.strip() for x in text.split(",") if x.strip())


_CAUSAL = {"both": (False, True), "true": (True,), "false": (False,)}


def _latency_shapes(args):
    batch_heads = tuple(tuple(int(x) for x in pair.lower().split("x")) for pair in _strs(args.latency_batch_heads))
    return latency_mod.make_shapes(dtypes=_strs(args.latency_dtypes), head_dims=_ints(args.latency_head_dims),
                                   seqlens=_ints(args.latency_seqlens), batch_heads=batch_heads,
                                   causal=_CAUSAL[args.latency_causal])


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if not torch.cuda.is_available():
        print("benchmarks.run needs a CUDA GPU: torch.cuda.is_available() is False on this machine.\n"
              "Nothing was measured or written. The harness's own tests run on a CPU: "
              "python -m pytest tests/test_benchmarks.py", file=sys.stderr)
        return 2
    device = DEVICE
    do_grid, do_latency = "grid" in args.sections, "latency" in args.sections
    dtypes = _strs(args.dtypes) if args.dtypes else (grid_mod.QUICK_DTYPES if args.quick else grid_mod.DTYPES)
    seqlens = _ints(args.seqlens) if args.seqlens else (grid_mod.QUICK_SEQLENS if args.quick else grid_mod.SEQLENS)
    head_dims = _ints(args.head_dims) if args.head_dims else grid_mod.HEAD_DIMS
    ours_only = (_ints(args.head_dims_ours_only) if args.head_dims_ours_only is not None
                 else grid_mod.HEAD_DIMS_OURS_ONLY)
    gqa_seqlens = (_ints(args.gqa_seqlens) if args.gqa_seqlens is not None
                   else () if args.quick else grid_mod.GQA_SEQLENS)
    grid_kw = dict(dtypes=dtypes, head_dims=head_dims, head_dims_ours_only=ours_only, causal=_CAUSAL[args.causal],
                   seqlens=seqlens, tokens=args.tokens, hidden=args.hidden, gqa_seqlens=gqa_seqlens)
    settings = grid_mod.make_grid(**grid_kw) if do_grid else []
    chosen = providers_mod.get(_strs(args.providers))
    lat_providers = providers_mod.get(_strs(args.latency_providers)) if args.latency_providers else chosen
    out_dir = Path(args.out or ("benchmarks/results-quick" if args.quick else "benchmarks/results"))
    json_path = out_dir / "results.json"

    clock = Clock(args.budget_s)
    env = environment(device)
    print(f"{env['gpu']} | driver {env['driver']} | CUDA {env['cuda']} | torch {env['torch']} | "
          f"triton {env['triton']} | flashattn sources {str(env.get('flashattn_sources_sha256'))[:12]} | "
          f"sections {','.join(args.sections)} | {len(settings)} settings x {len(chosen)} providers -> {json_path}",
          flush=True)
    config = {"sections": list(args.sections), "quick": args.quick, "warmup_ms": args.warmup_ms,
              "rep_ms": args.rep_ms, "return_mode": "median",
              "timer": "triton.testing.do_bench (CUDA events, L2 flushed before each call)",
              "host": ("host_us: the host's microseconds per call of the same callable, about 10 ms of calls "
                       "(3 to 20) back to back with no synchronization between them and no L2 flush"),
              "forward": FORWARD_HOW, "backward": BACKWARD_HOW, "memory": MEMORY_HOW,
              "flops": "flashattn.cost.attention_flops(batch, heads, n, m, d, causal=..., mode='fwd'|'bwd')",
              "check": (f"o, dq, dk, dv against flashattn.reference.naive_attention in float64 at the first length "
                        f"of each dtype x head dim x mask (x GQA); pass: rel err <= {measure.CHECK_FACTOR} x the "
                        f"naive attention's own rel err in the same dtype + {measure.CHECK_FLOOR}"),
              "gqa": ("flashattn: native; flex: enable_gqa=True; SDPA backends: enable_gqa=True where the backend "
                      "accepts it, else k, v repeated with repeat_interleave inside the timed call (each record's "
                      "'gqa' field says which)"),
              "budget_s": args.budget_s, "argv": sys.argv[1:] if argv is None else list(argv)}
    grid_desc = grid_mod.grid_description(**grid_kw) if do_grid else None
    results = results_mod.new_results(environment=env, config=config, grid=grid_desc,
                                      providers={p.name: p.describe() for p in dict.fromkeys(chosen + lat_providers)})
    if args.update and json_path.exists():
        _keep_other_sections(results, results_mod.load(json_path), args.sections)

    def save_partial(partial=None):
        results.update(partial or {})
        results["elapsed_s"] = clock.elapsed()
        try:
            results_mod.save(results, json_path)
        except Exception as exc:  # noqa: BLE001 -- a bad record must not end the run; the final save says so
            print(f"could not save {json_path} mid-run: {exc}", file=sys.stderr, flush=True)

    if do_grid:
        _run_grid_section(args, settings, chosen, device, clock, results, save_partial)
    if do_latency:
        shapes = _latency_shapes(args)
        timer = latency_mod.WallClock(target_ms=args.latency_target_ms, repeats=args.latency_repeats)
        lat_clock = Clock(args.latency_budget_s)
        print(f"[latency] {len(shapes)} shapes x {len(lat_providers)} providers x modes {args.latency_modes} "
              f"x passes {args.latency_passes}", flush=True)
        records = latency_mod.run_latency(shapes, lat_providers, device=device, modes=_strs(args.latency_modes),
                                          passes=_strs(args.latency_passes), measure_fn=timer, clock=lat_clock,
                                          log=lambda s: print(s, flush=True))
        results["latency"] = latency_mod.section(shapes, lat_providers, records, timer,
                                                 elapsed_s=lat_clock.elapsed(), environment=env,
                                                 argv=config["argv"])
    skipped = [m for m in results["measurements"] + ((results["latency"] or {}).get("records") or [])
               if "time budget" in (m.get("error") or "")]
    results["complete"] = not skipped
    results["elapsed_s"] = clock.elapsed()
    try:
        results_mod.save(results, json_path)
    except ValueError as exc:  # a harness bug: keep the numbers, say what is wrong, write no report
        raw = json_path.with_name("results.unvalidated.json")
        raw.write_text(json.dumps(results, indent=1, default=str) + "\n")
        print(f"results failed validation ({exc}); wrote {raw} unvalidated", file=sys.stderr, flush=True)
        return 1
    verdicts = [c["status"] for c in results["checks"]]
    print(f"wrote {json_path} ({clock.elapsed():.0f} s; complete: {results['complete']}); correctness checks: "
          f"{verdicts.count('ok')} passed, {verdicts.count('failed')} FAILED, "
          f"{len(verdicts) - verdicts.count('ok') - verdicts.count('failed')} could not run", flush=True)
    if not args.no_report:
        from benchmarks import report

        written = report.write_all(results, out_dir)
        print("wrote " + ", ".join(str(p) for p in written), flush=True)
        if do_grid:
            print(report.ratio_table(results), flush=True)
        if do_latency:
            print(report.latency_target_table(results), flush=True)
    return 0


GRID_KEYS = ("environment", "config", "grid", "checks", "measurements", "memory", "long_context")


def _keep_other_sections(results: dict, old: dict, sections) -> None:
    """Carry over from ``old`` what this run does not measure: the grid (with the environment and the
    configuration it was measured with) and/or the latency section (which holds its own environment)."""
    if "grid" not in sections:
        argv = results["config"]["argv"]
        results.update({k: old[k] for k in GRID_KEYS if k in old})
        results["config"] = {**old["config"], "update_argv": argv}
    if "latency" not in sections:
        results["latency"] = old.get("latency")
    results["providers"] = {**old["providers"], **results["providers"]}


def _run_grid_section(args, settings, chosen, device, clock, results, save_partial):
    if any(p.name == "flex" for p in chosen):
        try:
            results["config"]["flex_precompile"] = precompile_flex(
                settings, args.flex_workers, timeout_s=max(60.0, 0.4 * (args.budget_s or 600)))
        except Exception as exc:  # noqa: BLE001 -- then the timing process compiles each shape itself
            results["config"]["flex_precompile"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}

    progress = None
    if not args.no_progress:
        from tqdm import tqdm

        progress = tqdm(total=len(settings) * len(chosen), desc="benchmark", unit="run", file=sys.stderr,
                        mininterval=1.0 if sys.stderr.isatty() else 30.0, ascii=not sys.stderr.isatty())
    # On a terminal, lines go above the bar; in a log file (the GPU run's case) plain prints read better.
    log = progress.write if progress is not None and sys.stderr.isatty() else print
    partial = run_grid(settings, chosen, device=device,
                       timer=measure.do_bench_timer(warmup=args.warmup_ms, rep=args.rep_ms),
                       peak_memory=measure.cuda_peak_memory, clock=clock, progress=progress,
                       on_setting=save_partial, log=lambda s: (log(s), sys.stdout.flush()),
                       host_sync=(lambda: None) if device == "cpu" else torch.cuda.synchronize)
    if progress is not None:
        progress.close()
    results.update(partial)
    if args.long_seqlen:
        try:
            results["long_context"] = long_context(device, seqlen=args.long_seqlen, head_dim=128, dtype="float16")
        except Exception as exc:  # noqa: BLE001
            results["long_context"] = {"seqlen": args.long_seqlen, "status": "error",
                                       "error": f"{type(exc).__name__}: {exc}"[:2000]}
        print("[long context]", json.dumps(results["long_context"])[:1500], flush=True)
    save_partial()


if __name__ == "__main__":
    sys.exit(main())
