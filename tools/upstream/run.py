"""Run a sample of flash_attn's own tests (tests/test_flash_attn.py at v2.8.3) against flashattn's
compat functions, through the ``flash_attn`` shim next to this file, and count the outcomes per test
function.

    PYTHONPATH=.:tools/upstream python tools/upstream/run.py --out $OUT/upstream --budget-s 240
    python tools/upstream/run.py --collect-only          # no GPU needed: import and count the items

Writes ``run_meta.json``, ``items.jsonl`` (one line per pytest report, as they arrive),
``collection.json``, ``pytest.log``, ``results.json`` (every sampled item's outcome) and ``summary.md``
under ``--out`` (``--summarize-only`` rebuilds the last two from the others). Compiled kernels go to a
cache under /tmp; nothing else is written.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
DEFAULT_TEST_FILE = REPO / "gpu" / "upstream" / "test_flash_attn.py"
UPSTREAM_REF = "v2.8.3"
# git's blob id of tests/test_flash_attn.py at tag v2.8.3 (commit 060c9188beec3a8b62b33a3bfa6d5d2d44975fab)
UPSTREAM_BLOB = "d5bb6ba853128cfa4b34b78489dbd90b6c664308"
UPSTREAM_URL = f"https://github.com/Dao-AILab/flash-attention/blob/{UPSTREAM_REF}/tests/test_flash_attn.py"
CACHE = Path("/tmp/flashattn-upstream-cache")
MAX_GROUPS = 60  # rows of the grouped table in summary.md; results.json has every item
CATEGORIES = ("passed", "failed", "not_implemented", "no_probs", "skipped", "error", "timeout", "not_run")
HEADINGS = {"passed": "passed", "failed": "failed (wrong result)", "not_implemented": "NotImplemented",
            "no_probs": "needs probs", "skipped": "skipped by test", "error": "error", "timeout": "timeout",
            "not_run": "not run"}


def git_blob_id(path: Path) -> str:
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def flashattn_revision() -> dict:
    """What flashattn code ran: the SHA-256 of its sources (benchmarks.provenance's rule, the one every
    results file records), and the checked-out commit with whether flashattn/ differs from it where this
    folder is itself a git checkout (read-only: no index refresh). A copy without its own ``.git`` (an
    exported snapshot) would otherwise report the HEAD of whatever repository lies above it."""
    from benchmarks.provenance import sources_sha256

    info = {"commit": None, "sources_sha256": sources_sha256(REPO / "flashattn")}
    if not (REPO / ".git").exists():
        return info

    def git(*args):
        return subprocess.run(["git", "--no-optional-locks", "-C", str(REPO), *args], capture_output=True,
                              text=True, timeout=30)
    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return info
        dirty = git("diff", "--quiet", "HEAD", "--", "flashattn").returncode == 1
        return {**info, "commit": head.stdout.strip(), "flashattn_modified": dirty}
    except (OSError, subprocess.TimeoutExpired):
        return info


def pytest_command(args, out: Path, deadline: float) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", str(args.test_file), "-c", str(HERE / "pytest.ini"),
           "--rootdir", str(args.test_file.parent), "-p", "no:cacheprovider", "-p", "upstream_plugin",
           "-q", "--upstream-per-function", str(args.per_function), "--upstream-seed", str(args.seed),
           "--upstream-only", ",".join(args.only), "--upstream-collection", str(out / "collection.json"),
           "--upstream-log", str(out / "items.jsonl")]
    if args.collect_only:
        return cmd + ["--collect-only", "--upstream-fake-capability", args.fake_capability, *args.pytest_args]
    cmd += ["--upstream-deadline", f"{deadline:.3f}"]
    if importlib.util.find_spec("pytest_timeout") is not None:
        cmd += ["--timeout", str(args.timeout_s), "--timeout-method", "signal"]
    else:
        print("warning: pytest-timeout is not installed: no per-item timeout", file=sys.stderr)
    if args.workers > 0:
        if importlib.util.find_spec("xdist") is not None:
            cmd += ["-n", str(args.workers), "--dist", "load"]
        else:
            print("warning: pytest-xdist is not installed: one process", file=sys.stderr)
    return cmd + list(args.pytest_args)


def child_env() -> dict:
    env = dict(os.environ)
    paths = [str(HERE), str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))  # the shim first
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # no __pycache__ (nor pytest's rewritten .pyc) in the tree
    # Every cache the kernels or torch may write goes under /tmp; one Triton cache shared by the
    # workers (and by a later run on the same machine) so each kernel variant compiles once.
    env["TRITON_HOME"] = str(CACHE)
    env["TRITON_CACHE_DIR"] = str(CACHE / "triton")
    env["TORCHINDUCTOR_CACHE_DIR"] = str(CACHE / "inductor")
    env["CUDA_CACHE_PATH"] = str(CACHE / "cuda")
    env["XDG_CACHE_HOME"] = str(CACHE / "xdg")
    return env


def fold(lines: list[dict], sampled: list[str]) -> dict[str, dict]:
    """Each sampled item's outcome from its reports (setup, call, teardown, or one crash report)."""
    reports = defaultdict(list)
    for line in lines:
        reports[line["nodeid"]].append(line)
    items = {}
    for nodeid in sampled:
        rs = reports.get(nodeid, [])
        record = {"nodeid": nodeid, "function": nodeid.split("::")[-1].split("[")[0], "category": "not_run",
                  "duration": round(sum(r["duration"] for r in rs), 3)}
        failing = [r for r in rs if r["outcome"] == "failed"]
        skipped = [r for r in rs if r["outcome"] == "skipped"]
        if failing:
            r = next((r for r in failing if r["when"] == "call"), failing[0])
            if r["info"] is not None:
                record.update({k: v for k, v in r["info"].items()})
                if r["when"] != "call" and record["category"] == "failed":
                    record["category"] = "error"  # an assertion outside the test body
                record["phase"] = r["when"]
            else:  # no worker-side record: the worker died (a crash, or a timeout that killed it)
                record.update({"category": "error", "exc_type": "worker crash", "message": r["longrepr"],
                               "origin": "other", "phase": r["when"]})
        elif skipped:
            reason = skipped[0]["skip_reason"] or ""
            record["category"] = "not_run" if "time budget spent" in reason else "skipped"
            record["skip_reason"] = reason
        elif any(r["when"] == "call" and r["outcome"] == "passed" for r in rs):
            record["category"] = "passed"
        items[nodeid] = record
    return items


def summarize(collected: dict[str, int], items: dict[str, dict]) -> dict[str, dict]:
    table = {name: {"collected": n, "sampled": 0, **{c: 0 for c in CATEGORIES}} for name, n in collected.items()}
    for record in items.values():
        row = table[record["function"]]
        row["sampled"] += 1
        row[record["category"]] += 1
    return table


def markdown(table: dict[str, dict], items: dict[str, dict], meta: dict) -> str:
    cols = ["collected", "sampled", *CATEGORIES]
    out = [f"# flash_attn {UPSTREAM_REF} tests/test_flash_attn.py against flashattn", ""]
    env = meta.get("environment") or {}
    out.append(f"- device: {env.get('cuda_device')}; torch {env.get('torch')}, triton {env.get('triton')}")
    out.append(f"- flashattn: commit {meta['flashattn'].get('commit') or 'unknown (no git checkout here)'}"
               + (" (flashattn/ modified)" if meta["flashattn"].get("flashattn_modified") else "")
               + f"; sources sha256 {(meta['flashattn'].get('sources_sha256') or 'unknown')[:12]}")
    out.append(f"- upstream file: {meta['test_file_blob']} ({'the' if meta['test_file_is_upstream'] else 'NOT the'} "
               f"{UPSTREAM_REF} blob)")
    out.append(f"- sample: {meta['per_function'] or 'all'} per function, seed {meta['seed']}; per-item timeout "
               f"{meta['timeout_s']} s; budget {meta['budget_s']} s; {meta['workers']} workers; wall "
               f"{meta['wall_s']:.0f} s; pytest exit {meta['pytest_rc']}")
    out += ["", "| test function | " + " | ".join(HEADINGS.get(c, c) for c in cols) + " |",
            "|---|" + "---:|" * len(cols)]
    totals = Counter()
    for name, row in table.items():
        out.append(f"| {name} | " + " | ".join(str(row[c]) for c in cols) + " |")
        totals.update({c: row[c] for c in cols})
    out.append("| **total** | " + " | ".join(f"**{totals[c]}**" for c in cols) + " |")
    groups = defaultdict(list)
    for record in items.values():
        if record["category"] in ("failed", "not_implemented", "no_probs", "error", "timeout"):
            first_line = (record.get("message") or "").strip().splitlines()[:1]
            key = (record["function"], record["category"], record.get("exc_type"), record.get("origin"),
                   (first_line[0] if first_line else "")[:160])
            groups[key].append(record["nodeid"])
    if groups:
        out += ["", "## Items that did not pass, grouped", "",
                "| test function | category | exception | raised in | message (first line) | items | example |",
                "|---|---|---|---|---|---:|---|"]
        ordered = sorted(groups.items(), key=lambda kv: (kv[0][0], -len(kv[1])))
        for key, nodeids in ordered[:MAX_GROUPS]:
            name, category, exc, origin, message = key
            message = message.replace("|", "\\|")
            example = nodeids[0].split("::")[-1]
            out.append(f"| {name} | {category} | {exc} | {origin} | {message} | {len(nodeids)} | `{example}` |")
        if len(ordered) > MAX_GROUPS:
            out.append(f"\n({len(ordered) - MAX_GROUPS} more groups in results.json)")
    out += ["", "Categories: *failed* is an upstream assertion that did not hold (a wrong result); *NotImplemented* "
            "a NotImplementedError (flashattn refusing a feature); *needs probs* an item that read the attention "
            "probabilities flash_attn returns with return_attn_probs=True, which flashattn returns as None; "
            "*error* any other exception (including a crashed worker); *not run* sampled items that never started (the time budget was spent, or the run was stopped)."]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("/tmp/upstream-out"), help="output folder (created)")
    parser.add_argument("--test-file", type=Path, default=DEFAULT_TEST_FILE,
                        help=f"flash_attn's tests/test_flash_attn.py at {UPSTREAM_REF} (default: %(default)s)")
    parser.add_argument("--per-function", type=int, default=40, help="items sampled per test function (0: all)")
    parser.add_argument("--seed", default="0", help="salt of the sampling hash")
    parser.add_argument("--only", action="append", default=[], help="keep only this test function (repeatable)")
    parser.add_argument("--budget-s", type=float, default=240.0,
                        help="no item starts after this many seconds from launch (collection included)")
    parser.add_argument("--timeout-s", type=float, default=90.0, help="per-item timeout (pytest-timeout)")
    parser.add_argument("-n", "--workers", type=int, default=4, help="pytest-xdist workers (0: one process)")
    parser.add_argument("--collect-only", action="store_true",
                        help="import the file through the shim and count the items; runs without a GPU")
    parser.add_argument("--fake-capability", default="9.0",
                        help="with --collect-only and no CUDA device: the capability reported to the "
                             "upstream module's import-time checks (default: H100's)")
    parser.add_argument("--summarize-only", action="store_true",
                        help="only rebuild results.json and summary.md from --out (e.g. after a killed run)")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args(argv)
    if args.summarize_only:
        out = args.out.resolve()
        meta = json.loads((out / "run_meta.json").read_text())
        last = max([out / "items.jsonl", out / "collection.json"], key=lambda p: p.stat().st_mtime if p.exists() else 0)
        return write_report(out, "unknown (--summarize-only)", last.stat().st_mtime - meta["start"])
    args.test_file = args.test_file.resolve()
    if not args.test_file.is_file():
        print(f"{args.test_file} is missing. It is not committed; get it with\n"
              f"  git -C <flash-attention clone> show {UPSTREAM_REF}:tests/test_flash_attn.py > {args.test_file}\n"
              f"(source: {UPSTREAM_URL}). On a device machine, carry gpu/upstream.", file=sys.stderr)
        return 2
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    for name in ("items.jsonl", "collection.json", "run_meta.json", "results.json", "summary.md"):
        (out / name).unlink(missing_ok=True)
    blob = git_blob_id(args.test_file)
    if blob != UPSTREAM_BLOB:
        print(f"warning: {args.test_file} is not the {UPSTREAM_REF} file (blob {blob}, expected {UPSTREAM_BLOB})",
              file=sys.stderr)

    start = time.time()
    cmd = pytest_command(args, out, start + args.budget_s)
    meta = {"upstream_ref": UPSTREAM_REF, "upstream_url": UPSTREAM_URL, "test_file": str(args.test_file),
            "test_file_blob": blob, "test_file_is_upstream": blob == UPSTREAM_BLOB, "per_function": args.per_function,
            "seed": args.seed, "only": args.only, "budget_s": args.budget_s, "timeout_s": args.timeout_s,
            "workers": args.workers, "command": cmd, "start": start, "flashattn": flashattn_revision()}
    (out / "run_meta.json").write_text(json.dumps(meta, indent=1))
    # Hard stop: the budget, then one item's timeout for the items in flight, then a margin.
    hard_limit = None if args.collect_only else args.budget_s + args.timeout_s + 60
    rc = run_pytest(cmd, out, hard_limit)
    if args.collect_only:
        return print_collection(out, args.per_function, rc)
    return write_report(out, rc, time.time() - start)


class Stopped(Exception):
    pass


def _stop(signum, frame):
    raise Stopped(signal.Signals(signum).name)


def run_pytest(cmd: list[str], out: Path, hard_limit: float | None):
    """pytest in its own process group, output to pytest.log; returns its exit status, or why it was
    stopped (the hard limit, or a signal to this script: the items recorded so far are still reported)."""
    with open(out / "pytest.log", "w") as log:
        log.write(" ".join(cmd) + "\n\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=str(REPO), env=child_env(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            return proc.wait(timeout=hard_limit)
        except (subprocess.TimeoutExpired, Stopped) as why:
            reason = f"stopped at the hard limit of {hard_limit:.0f} s" if isinstance(why, subprocess.TimeoutExpired) \
                else f"stopped by {why}"
            for sig in previous:  # a repeated signal must not cut the cleanup and the report short
                signal.signal(sig, signal.SIG_IGN)
            os.killpg(proc.pid, signal.SIGTERM)  # the pytest process group this script started
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            print(f"pytest {reason}", file=sys.stderr)
            return reason
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def load_collection(out: Path, rc) -> dict | None:
    path = out / "collection.json"
    if not path.is_file():
        print(f"no collection record: pytest ({rc}) stopped before collecting; see {out / 'pytest.log'}:",
              file=sys.stderr)
        print((out / "pytest.log").read_text()[-4000:], file=sys.stderr)
        return None
    return json.loads(path.read_text())


def print_collection(out: Path, per_function: int, rc) -> int:
    collection = load_collection(out, rc)
    if collection is None:
        return 1
    table = summarize(collection["collected"], {})
    for nodeid in collection["sampled"]:
        table[nodeid.split("::")[-1].split("[")[0]]["sampled"] += 1
    width = max(len(n) for n in table)
    print(f"{'test function':{width}}  collected  sampled (--per-function {per_function or 'all'})")
    for name, row in table.items():
        print(f"{name:{width}}  {row['collected']:9d}  {row['sampled']:7d}")
    print(f"{'total':{width}}  {sum(r['collected'] for r in table.values()):9d}  "
          f"{sum(r['sampled'] for r in table.values()):7d}")
    print(f"pytest exit {rc}; environment: {collection['environment']}")
    return 0 if rc == 0 else 1


def write_report(out: Path, rc, wall: float) -> int:
    """results.json and summary.md from what the run left in ``out``; also usable on the folder of a
    run that was killed (``--summarize-only``)."""
    collection = load_collection(out, rc)
    if collection is None:
        return 1
    meta = json.loads((out / "run_meta.json").read_text())
    lines = []
    if (out / "items.jsonl").is_file():
        lines = [json.loads(line) for line in (out / "items.jsonl").read_text().splitlines() if line.strip()]
    items = fold(lines, collection["sampled"])
    table = summarize(collection["collected"], items)
    meta.update({"wall_s": wall, "pytest_rc": rc, "environment": collection.get("environment"),
                 "collection_errors": [line for line in lines if line["when"] == "collect"]})
    (out / "results.json").write_text(json.dumps({"meta": meta, "summary": table, "items": list(items.values())},
                                                 indent=1))
    text = markdown(table, items, meta)
    (out / "summary.md").write_text(text)
    print(text)
    for line in meta["collection_errors"]:
        print("collection error:", line["longrepr"][-2000:], file=sys.stderr)
    return 0 if not meta["collection_errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
