"""A/B: the working tree's flashattn against another git revision's, timed in one run on one GPU.

    PYTHONPATH=. python -m benchmarks.ab HEAD~1                          # working tree vs HEAD~1
    PYTHONPATH=. python -m benchmarks.ab 22bf7d9 --new HEAD --head-dims 128 --seqlens 2048,16384
    PYTHONPATH=. python -m benchmarks.ab HEAD --latency                  # per-call time instead of TFLOP/s
    PYTHONPATH=. python -m benchmarks.ab HEAD~1 --export ab-base         # on a checkout with git history, then
    PYTHONPATH=. python -m benchmarks.ab ab-base                         # on a copy without it (e.g. a GPU box)

How it works:

1. The baseline's ``flashattn/`` is exported from git (``git archive REV flashattn``) into a temporary
   folder; so is the new side's when ``--new`` names a revision (by default the new side is the
   working tree, uncommitted changes included). Nothing in the checkout is touched. Where the copy of
   the checkout has no git history, ``--export DIR`` writes the baseline beforehand, and ``DIR`` is
   then given as the baseline.
2. Each side runs in its own worker process that imports *that* copy of ``flashattn`` (its folder first
   on ``sys.path``; the worker checks ``flashattn.__file__`` and reports a hash of its sources) and the
   harness's own ``benchmarks`` (inputs, providers, timer, FLOP count) from this checkout. Two copies of
   one package cannot share a process: a lazy import inside the package would find the wrong one.
3. Per setting, both workers build the same inputs (same seed) and run one forward + backward; the
   parent compares o, dq, dk, dv **bitwise**. Then the passes are timed alternately, new then base,
   base then new, for ``--repeats`` rounds, so drift in clocks or temperature hits both sides alike;
   the medians of the rounds are reported.
4. The workers exit and the temporary folders are removed, also when something fails.

Timing is the harness's: ``do_bench`` medians and ``flashattn.cost.attention_flops`` (the grid's
settings, B x N = 16k tokens, heads x D = 2048), or with ``--latency`` the latency section's wall clock
over back-to-back eager calls.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Run in the worker process: the chosen flashattn first on sys.path, then this checkout (benchmarks).
_BOOT = "import sys; sys.path[:0] = sys.argv[1:3]; from benchmarks.ab import worker_main; sys.exit(worker_main())"


# -- the revision -------------------------------------------------------------------------------------------

def resolve(rev: str, repo: Path = REPO) -> str:
    """The full commit hash of ``rev``; ValueError naming it when git does not know it."""
    res = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"], cwd=repo,
                         capture_output=True, text=True)
    if res.returncode != 0 or not res.stdout.strip():
        raise ValueError(f"git does not know the revision {rev!r} (in {repo})")
    return res.stdout.strip()


def export_package(commit: str, dest: Path, repo: Path = REPO) -> Path:
    """Write the ``flashattn/`` folder of ``commit`` under ``dest`` (``git archive``); return ``dest``."""
    res = subprocess.run(["git", "archive", "--format=tar", commit, "flashattn"], cwd=repo, capture_output=True)
    if res.returncode != 0:
        raise ValueError(f"git archive {commit} flashattn failed: {res.stderr.decode(errors='replace').strip()}")
    with tarfile.open(fileobj=io.BytesIO(res.stdout)) as tar:
        tar.extractall(dest, filter="data") if hasattr(tarfile, "data_filter") else tar.extractall(dest)
    if not (dest / "flashattn" / "__init__.py").is_file():
        raise ValueError(f"revision {commit} has no flashattn package")
    return dest


# -- the worker (one per side) ------------------------------------------------------------------------------

def _equal_bits(a, b) -> bool:
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def compare(got: dict, ref: dict) -> dict:
    """Bitwise equality of each output, and the largest absolute difference where they differ."""
    out = {}
    for name in ref:
        a, b = got[name], ref[name]
        same = _equal_bits(a, b)
        diff = 0.0 if same else float((a.double() - b.double()).abs().nan_to_num(float("inf")).max())
        out[name] = {"bitwise_equal": same, "max_abs_diff": diff if diff == diff else "nan"}
    return out


def wall_timer(fn, grad_to_none=None) -> float:
    """A plain wall-clock timer (median of 5 calls, ms) for CPU runs, where do_bench has no CUDA events."""
    times = []
    for _ in range(5):
        if grad_to_none:
            for x in grad_to_none:
                x.grad = None
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


LATENCY_PASSES = ("fwd_call", "fwd_bwd")  # --latency: the forward and forward + backward, wall clock per call


class _Worker:
    """The state of one worker: inputs and prepared calls of the current setting."""

    def __init__(self, device: str, timer: str, warmup_ms: int, rep_ms: int, latency_target_ms: float):
        from benchmarks import latency, measure

        self.device = device
        self.timer = measure.do_bench_timer(warmup=warmup_ms, rep=rep_ms) if timer == "do_bench" else wall_timer
        self.wall = latency.WallClock(target_ms=latency_target_ms, repeats=1)
        self.setting, self.inputs, self.fns = None, None, {}

    def sync(self):
        if self.device != "cpu":
            import torch

            torch.cuda.synchronize()

    def prepare(self, setting: dict, seed: int, providers: list, outputs: str) -> dict:
        import torch

        from benchmarks import grid, measure, providers as providers_mod

        self.release()
        self.setting = grid.Setting.from_dict(setting)
        self.inputs = measure.make_inputs(self.setting, self.device, seed=seed)
        t0 = time.monotonic()
        self.fns = {name: providers_mod.PROVIDERS[name].prepare(self.setting, self.device) for name in providers}
        q, k, v, do = self.inputs
        first = {}
        for name, fn in self.fns.items():
            result = measure._forward_backward(fn, q, k, v, do)  # the first call: compiles, autotunes
            if name == "flashattn":
                first = {key: x.detach().cpu() for key, x in result.items()}
        self.sync()
        torch.save(first, outputs)
        return {"prepare_s": time.monotonic() - t0}

    def time(self, provider: str, p: str) -> dict:
        from benchmarks import latency, measure

        fn = self.fns[provider]
        if p in ("fwd", "bwd"):
            ms = (measure.time_forward if p == "fwd" else measure.time_backward)(fn, self.inputs, self.timer)
            return {"ms": ms}  # TFLOP/s comes from the parent's cost model: a baseline may predate it
        # the latency passes, on the latency section's wall clock: "fwd_call" is its forward pass
        q, k, v, do = self.inputs
        call = latency._step(fn, q, k, v, do, (), "fwd" if p == "fwd_call" else p, "eager")
        return self.wall(call, self.sync)

    def release(self) -> dict:
        self.setting, self.inputs, self.fns = None, None, {}
        if self.device != "cpu":
            import torch

            torch.cuda.empty_cache()
        return {}


def worker_main() -> int:
    """Serve one JSON request per stdin line with one JSON reply per stdout line, until ``exit``."""
    import flashattn

    from benchmarks.provenance import sources_sha256

    expected = Path(sys.path[0]).resolve()
    package = Path(flashattn.__file__).resolve().parent
    hello = {"flashattn_file": str(package), "sources_sha256": sources_sha256(package),
             "expected_root": str(expected), "pid": os.getpid()}
    reply = sys.stdout
    sys.stdout = sys.stderr  # anything the package or torch prints goes to the log, not into the protocol
    if package.parent != expected:
        reply.write(json.dumps({"error": f"imported flashattn from {package}, expected it under {expected}"}) + "\n")
        reply.flush()
        return 1
    reply.write(json.dumps(hello) + "\n")
    reply.flush()
    worker = None
    for line in sys.stdin:
        request = json.loads(line)
        op = request.pop("op")
        if op == "exit":
            break
        try:
            if op == "init":
                worker = _Worker(**request)
                answer = {}
            else:
                answer = getattr(worker, op)(**request)
        except Exception as exc:  # noqa: BLE001 -- reported to the parent, which records it
            from benchmarks import measure

            status, message = measure.classify_error(exc)
            answer = {"error": message, "status": status}
        reply.write(json.dumps(answer) + "\n")
        reply.flush()
    return 0


class Side:
    """The parent's handle on one worker process."""

    def __init__(self, name: str, root: Path, device: str, timer: str, warmup_ms: int, rep_ms: int,
                 latency_target_ms: float):
        self.name, self.root = name, root
        self.proc = subprocess.Popen([sys.executable, "-c", _BOOT, str(root), str(REPO)], cwd=root,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.hello = self._read()
        if "error" in self.hello:
            raise RuntimeError(f"{name} worker: {self.hello['error']}")
        self.ask("init", device=device, timer=timer, warmup_ms=warmup_ms, rep_ms=rep_ms,
                 latency_target_ms=latency_target_ms)

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.name} worker exited (code {self.proc.wait()}); its log is above")
        return json.loads(line)

    def ask(self, op: str, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except Exception:  # noqa: BLE001 -- a stuck or dead worker: stop it by its own handle
                self.proc.kill()
                self.proc.wait()


# -- the parent ---------------------------------------------------------------------------------------------

def exported(path) -> tuple[Path, str | None] | None:
    """(folder, commit) when ``path`` is a folder made by ``--export`` (or any folder holding a
    ``flashattn`` package), else None."""
    root = Path(path)
    if not (root / "flashattn" / "__init__.py").is_file():
        return None
    commit_file = root / "COMMIT"
    return root, commit_file.read_text().strip() if commit_file.is_file() else None


def run_ab(base_rev: str, settings, *, new_rev: str | None = None, peers=(), passes=("fwd", "bwd"), repeats=3,
           device="cuda", timer="do_bench", warmup_ms=25, rep_ms=100, latency_target_ms=10.0, log=print) -> dict:
    """Time flashattn of the working tree (or ``new_rev``) against ``base_rev`` on ``settings``.

    ``base_rev`` is a git revision, or a folder written by ``python -m benchmarks.ab REV --export DIR``
    (for a machine whose copy of the checkout has no git history); such a folder is used as it is and
    left in place.
    """
    given = exported(base_rev) if os.path.isdir(base_rev) else None
    base_commit = given[1] if given else resolve(base_rev)
    new_commit = resolve(new_rev) if new_rev else None
    tmp = Path(tempfile.mkdtemp(prefix="flashattn-ab-"))
    sides = []
    try:
        base_root = given[0].resolve() if given else export_package(base_commit, tmp / "base")
        new_root = export_package(new_commit, tmp / "new") if new_commit else REPO
        kw = dict(device=device, timer=timer, warmup_ms=warmup_ms, rep_ms=rep_ms, latency_target_ms=latency_target_ms)
        sides = [Side("new", new_root, **kw), Side("base", base_root, **kw)]
        new, base = sides
        out = {"base": {"rev": base_rev, "commit": base_commit, **base.hello},
               "new": {"rev": new_rev or "working tree", "commit": new_commit, **new.hello},
               "same_sources": base.hello["sources_sha256"] == new.hello["sources_sha256"],
               "passes": list(passes), "repeats": repeats, "timer": timer, "peers": list(peers), "rows": []}
        log(f"new: {out['new']['rev']} ({new.hello['flashattn_file']}, sources {new.hello['sources_sha256'][:12]}); "
            f"base: {base_rev} = {str(base_commit)[:12]} (sources {base.hello['sources_sha256'][:12]})")
        for index, setting in enumerate(settings):
            out["rows"].append(_one_setting(setting, index, new, base, peers, passes, repeats, tmp, log))
        return out
    finally:
        for side in sides:
            side.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _one_setting(setting, index, new, base, peers, passes, repeats, tmp, log) -> dict:
    import torch

    row = {"setting": setting.to_dict(), "label": setting.label()}
    files = {}
    for side, provs in ((new, ["flashattn", *peers]), (base, ["flashattn"])):
        files[side.name] = tmp / f"{side.name}-{index}.pt"
        answer = side.ask("prepare", setting=setting.to_dict(), seed=index, providers=provs,
                          outputs=str(files[side.name]))
        if "error" in answer:
            row["error"] = f"{side.name}: {answer['error']}"
            log(f"{setting.label()}: {row['error'][:300]}")
            for s in (new, base):
                s.ask("release")
            return row
        row[f"{side.name}_prepare_s"] = answer["prepare_s"]
    row["outputs"] = compare(torch.load(files["new"]), torch.load(files["base"]))
    row["bitwise_equal"] = all(o["bitwise_equal"] for o in row["outputs"].values())
    samples = {}
    for r in range(repeats):
        order = [(new, "flashattn"), (base, "flashattn")]
        order = order if r % 2 == 0 else order[::-1]
        order += [(new, peer) for peer in peers]
        for side, prov in order:
            name = side.name if prov == "flashattn" else prov
            for p in passes:
                answer = side.ask("time", provider=prov, p=p)
                samples.setdefault((name, p), []).append(answer)
    row["timings"] = {}
    for (name, p), answers in samples.items():
        errors = [a["error"] for a in answers if "error" in a]
        if errors:
            row["timings"].setdefault(name, {})[p] = {"error": errors[0]}
            continue
        value = "ms" if p in ("fwd", "bwd") else "us_per_call"
        entry = {value: statistics.median(a[value] for a in answers), "samples": [a[value] for a in answers]}
        if value == "ms":
            from benchmarks import measure

            entry["tflops"] = measure.tflops(setting, p, entry["ms"])[1]
        row["timings"].setdefault(name, {})[p] = entry
    for s in (new, base):
        s.ask("release")
    log(format_row(row))
    return row


def speedup(row, p) -> float | None:
    """Base time over new time for pass ``p`` (> 1: the new code is faster)."""
    t = row.get("timings", {})
    try:
        key = "ms" if p in ("fwd", "bwd") else "us_per_call"
        return t["base"][p][key] / t["new"][p][key]
    except (KeyError, TypeError, ZeroDivisionError):
        return None


def format_row(row) -> str:
    if "error" in row:
        return f"{row['label']}: {row['error'][:300]}"
    parts = [row["label"] + ":", "outputs " + ("bitwise equal" if row["bitwise_equal"] else "DIFFER " + ", ".join(
        f"{k} {v['max_abs_diff']}" for k, v in row["outputs"].items() if not v["bitwise_equal"]))]
    for p, timing in row["timings"].get("new", {}).items():
        base = row["timings"].get("base", {}).get(p, {})
        if "tflops" in timing and "tflops" in base:
            parts.append(f"{p} new {timing['tflops']:.0f} / base {base['tflops']:.0f} TFLOP/s")
        elif "us_per_call" in timing and "us_per_call" in base:
            parts.append(f"{p} new {timing['us_per_call']:.1f} / base {base['us_per_call']:.1f} µs")
        s = speedup(row, p)
        if s is not None:
            parts[-1] += f" (x{s:.3f})"
    for name, timing in row["timings"].items():
        if name not in ("new", "base"):
            parts.append(name + " " + " ".join(f"{p} {t.get('tflops', t.get('us_per_call', 0)):.0f}"
                                               for p, t in timing.items() if "error" not in t))
    return "  ".join(parts)


def main(argv=None) -> int:
    from benchmarks import grid as grid_mod

    ap = argparse.ArgumentParser(prog="python -m benchmarks.ab", description=__doc__.split("\n\n")[0])
    ap.add_argument("base", help="the baseline: any git revision (HEAD, HEAD~1, a commit, a branch), or a folder "
                                 "written by --export")
    ap.add_argument("--export", metavar="DIR",
                    help="only write the baseline's flashattn/ (and a COMMIT file) to DIR and exit: for a machine "
                         "whose copy of the checkout has no git history (pass DIR as the baseline there)")
    ap.add_argument("--new", help="a revision for the new side (default: the working tree as it is)")
    ap.add_argument("--dtypes", default="float16")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--seqlens", default="2048,16384")
    ap.add_argument("--causal", choices=("both", "true", "false"), default="both")
    ap.add_argument("--gqa", action="store_true", help="also the grid's GQA 32:8 row at --seqlens")
    ap.add_argument("--tokens", type=int, default=grid_mod.TOKENS)
    ap.add_argument("--hidden", type=int, default=grid_mod.HIDDEN)
    ap.add_argument("--peers", default="", help="comma-separated peers timed in the new side's process as a control")
    ap.add_argument("--repeats", type=int, default=3, help="alternating rounds of timing (median reported)")
    ap.add_argument("--warmup-ms", type=int, default=25)
    ap.add_argument("--rep-ms", type=int, default=100)
    ap.add_argument("--latency", action="store_true",
                    help="time per call (wall clock over back-to-back eager calls) of the forward (fwd_call) and "
                         "forward + backward (fwd_bwd) instead")
    ap.add_argument("--latency-target-ms", type=float, default=10.0)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu (the reference path; for testing the harness)")
    ap.add_argument("--out", default="benchmarks/results-ab", help="folder for ab.json")
    args = ap.parse_args(argv)

    from benchmarks.run import _CAUSAL, _ints, _strs

    if args.export:
        try:
            commit = resolve(args.base)
            dest = Path(args.export)
            if dest.exists() and any(dest.iterdir()):
                raise ValueError(f"{dest} exists and is not empty")
            export_package(commit, dest)
        except ValueError as exc:
            print(f"benchmarks.ab: {exc}", file=sys.stderr)
            return 2
        (dest / "COMMIT").write_text(commit + "\n")
        print(f"wrote {dest}/flashattn of {args.base} = {commit}")
        return 0
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("benchmarks.ab needs a CUDA GPU (or --device cpu to exercise it on the reference path)",
                  file=sys.stderr)
            return 2
    seqlens = _ints(args.seqlens)
    settings = grid_mod.make_grid(dtypes=_strs(args.dtypes), head_dims=_ints(args.head_dims), head_dims_ours_only=(),
                                  causal=_CAUSAL[args.causal], seqlens=seqlens, tokens=args.tokens,
                                  hidden=args.hidden, gqa_seqlens=seqlens if args.gqa else ())
    # with --latency both passes are wall clock per call ("fwd_call": the forward alone), never do_bench
    passes = LATENCY_PASSES if args.latency else ("fwd", "bwd")
    try:
        out = run_ab(args.base, settings, new_rev=args.new, peers=_strs(args.peers), passes=passes,
                     repeats=args.repeats, device=args.device, timer="do_bench" if args.device != "cpu" else "wall",
                     warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, latency_target_ms=args.latency_target_ms,
                     log=lambda s: print(s, flush=True))
    except ValueError as exc:
        print(f"benchmarks.ab: {exc}", file=sys.stderr)
        return 2
    path = Path(args.out) / "ab.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, default=str) + "\n")
    differ = [r["label"] for r in out["rows"] if r.get("bitwise_equal") is False]
    failed = [r["label"] for r in out["rows"] if "error" in r]
    print(f"wrote {path}; same sources: {out['same_sources']}; outputs bitwise equal in "
          f"{len(out['rows']) - len(differ) - len(failed)} of {len(out['rows'])} settings"
          + (f"; differ: {differ}" if differ else "") + (f"; failed: {failed}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
