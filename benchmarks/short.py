"""Short training shapes: eager forward and forward + backward where vision encoders and BERT-style
models live (N from 64 to 1024, D 64 or 128, B x H from 16 to 512), every SDPA backend and
FlexAttention in the same run.

    PYTHONPATH=. python -m benchmarks.short [--out benchmarks/results/short] [--dtypes bfloat16]
                                            [--budget-s 240] [--providers flashattn,sdpa_cudnn]

At these sizes a call does microseconds of GPU work, so launches and the host's work per call weigh
as much as the kernels. Each pass is timed as the latency section times it (:mod:`benchmarks.latency`,
its ``WallClock`` and its loop, eager mode only): n calls back to back between two synchronizes, µs
per call = elapsed / n, the median of the repeats, the providers' loops taking turns at each shape.
Writes ``DIR/short.json`` (the records, the timer, the GPU, the versions and the hash of the measured
package's sources) and ``DIR/short.md`` (flashattn's speed over the fastest SDPA backend per shape and
pass). Without a CUDA GPU it stops before measuring and writes nothing.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import torch

from benchmarks import latency, providers as providers_mod, side
from benchmarks.grid import Setting

# (B, H, N, D, dtype, causal): 24 shapes, 12 at each head dim; every N of the section, B x H 16..512.
SHAPES = (
    (32, 16, 64, 64, "bfloat16", False),
    (32, 16, 64, 128, "float16", False),
    (32, 12, 128, 64, "float16", False),     # BERT-base, N 128 (issue 45)
    (16, 16, 128, 64, "float16", False),     # BERT-large, N 128
    (8, 16, 128, 128, "bfloat16", False),
    (32, 12, 197, 64, "bfloat16", False),    # ViT-B/16 at 224 px
    (32, 16, 197, 64, "float16", False),     # ViT-L/16 at 224 px
    (16, 12, 256, 64, "float16", False),
    (8, 16, 256, 128, "bfloat16", False),
    (32, 16, 257, 64, "bfloat16", False),    # ViT-L/14 at 224 px (issue 45)
    (8, 16, 257, 128, "float16", False),
    (8, 12, 512, 64, "float16", False),      # BERT-base, N 512
    (4, 16, 512, 128, "bfloat16", False),
    (2, 16, 1024, 64, "float16", False),
    (1, 16, 1024, 128, "bfloat16", False),
    (1, 16, 64, 128, "bfloat16", True),
    (16, 32, 128, 128, "bfloat16", True),
    (16, 12, 256, 64, "float16", True),
    (8, 16, 256, 128, "bfloat16", True),     # issue 45
    (32, 12, 512, 64, "bfloat16", True),
    (4, 32, 512, 128, "bfloat16", True),
    (16, 12, 1024, 64, "float16", True),     # GPT-2 small, N 1024
    (1, 16, 1024, 128, "bfloat16", True),    # issue 45
    (2, 16, 1024, 128, "float16", True),
)
# The four shapes issue 45 found slow in forward + backward.
ISSUE_SHAPES = ((32, 16, 257, 64, "bfloat16", False), (32, 12, 128, 64, "float16", False),
                (8, 16, 256, 128, "bfloat16", True), (1, 16, 1024, 128, "bfloat16", True))

PASSES = ("fwd", "fwd_bwd")
MODE = "eager"
BUDGET_S = 240.0  # the section's share of a GPU session: shapes past it are recorded as skipped
# SDPA's math backend (a reference in plain ATen ops) is available by name but not run by default.
SDPA_MATH = providers_mod.SDPA("sdpa_math", "SDPA math", "MATH")
PROVIDERS = {**providers_mod.PROVIDERS, SDPA_MATH.name: SDPA_MATH}
DEFAULT_PROVIDERS = ("flashattn", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "flex")
PASS_LABELS = {"fwd": "forward", "fwd_bwd": "forward + backward"}
OUT = pathlib.Path(__file__).resolve().parent / "results" / "short"


def make_shapes(dtypes=None) -> list[Setting]:
    """The section's shapes, each in its own dtype, or (``dtypes`` given) in each of those dtypes."""
    out = []
    for b, h, n, d, dtype, causal in SHAPES:
        for dt in dtypes or (dtype,):
            setting = Setting(dt, d, causal, n, batch=b, heads=h)
            if setting not in out:
                out.append(setting)
    return out


def get_providers(names) -> list:
    unknown = [n for n in names if n not in PROVIDERS]
    if unknown:
        raise ValueError(f"unknown provider(s) {unknown}; choose from {sorted(PROVIDERS)}")
    return [PROVIDERS[n] for n in names]


def shape_label(rec) -> str:
    dtype = {"bfloat16": "bf16", "float16": "fp16"}.get(rec["dtype"], rec["dtype"])
    return f"B{rec['batch']} H{rec['heads']} N{rec['seqlen']} D{rec['head_dim']} {dtype}"


def ratios(records) -> list[dict]:
    """One row per shape and pass: flashattn's µs, the fastest SDPA backend's, FlexAttention's, and
    ``ratio`` = fastest SDPA µs / flashattn µs (flashattn's speed over it: above 1 it is faster)."""
    rows: dict = {}
    for r in records:
        key = (r["dtype"], r["head_dim"], r["causal"], r["seqlen"], r["batch"], r["heads"], r["pass"])
        row = rows.setdefault(key, {k: r[k] for k in ("dtype", "head_dim", "causal", "seqlen", "batch", "heads")}
                              | {"pass": r["pass"], "flashattn_us": None, "best_sdpa": None,
                                 "best_sdpa_us": None, "flex_us": None, "ratio": None})
        if r["status"] != "ok":
            continue
        us = r["us_per_call"]
        if r["provider"] == "flashattn":
            row["flashattn_us"] = us
        elif r["provider"] == "flex":
            row["flex_us"] = us
        elif r["provider"].startswith("sdpa_") and (row["best_sdpa_us"] is None or us < row["best_sdpa_us"]):
            row["best_sdpa"], row["best_sdpa_us"] = r["provider"], us
    for row in rows.values():
        if row["flashattn_us"] and row["best_sdpa_us"]:
            row["ratio"] = row["best_sdpa_us"] / row["flashattn_us"]
    return list(rows.values())


def _us(value, who=None) -> str:
    if value is None:
        return "–"
    return f"{value:.0f}" + (f" ({who.removeprefix('sdpa_')})" if who else "")


def markdown(result: dict) -> str:
    """The table: a row per shape, for each pass flashattn's µs, the fastest SDPA backend's and the ratio."""
    versions = result["versions"]
    lines = [f"{result['what']}; {result['device']}, torch {versions['torch']}, triton {versions['triton']}. "
             "µs per call (wall clock of back-to-back calls, host included, median of the repeats); ratio = "
             "fastest SDPA backend's µs / flashattn's (above 1: flashattn is faster); FlexAttention compiled.", "",
             "| shape | mask | fwd: flashattn | best SDPA | ratio | FlexAttention | fwd+bwd: flashattn | best SDPA "
             "| ratio | FlexAttention |",
             "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|"]
    by_shape: dict = {}
    for row in ratios(result["rows"]):
        by_shape.setdefault((shape_label(row), row["causal"]), {})[row["pass"]] = row
    for (label, causal), passes in by_shape.items():
        cells = [label, "causal" if causal else "none"]
        for p in PASSES:
            row = passes.get(p) or {}
            ratio = row.get("ratio")
            cells += [_us(row.get("flashattn_us")), _us(row.get("best_sdpa_us"), row.get("best_sdpa")),
                      "–" if ratio is None else f"{ratio:.2f}×", _us(row.get("flex_us"))]
        lines.append("| " + " | ".join(cells) + " |")
    failed = [r for r in result["rows"] if r["status"] != "ok"]
    if failed:
        lines += ["", f"{len(failed)} measurement(s) did not run: "
                  + "; ".join(f"{r['provider']} {r['pass']} at {shape_label(r)}: {r['status']}" for r in failed[:8])
                  + ("; …" if len(failed) > 8 else "") + " (the JSON has each message)."]
    return "\n".join(lines) + "\n"


def run(device, shapes, providers, *, budget_s=BUDGET_S, timer=None, log=print) -> dict:
    """Every provider at every shape, eager, both passes (the latency section's loop and timer)."""
    from benchmarks.run import Clock

    timer = timer or latency.WallClock()
    t0 = time.monotonic()
    log(f"[short] {len(shapes)} shapes x {len(providers)} providers x passes {', '.join(PASSES)}; "
        f"budget {budget_s:.0f} s")
    records = latency.run_latency(shapes, providers, device=device, modes=(MODE,), passes=PASSES,
                                  measure_fn=timer, clock=Clock(budget_s), log=log)
    config = latency.section(shapes, providers, records, timer, elapsed_s=time.monotonic() - t0)["config"]
    config.update(mode=MODE, budget_s=budget_s, issue_shapes=[list(s) for s in ISSUE_SHAPES])
    return side.record("short training shapes, eager forward and forward + backward", device, records,
                       config=config, providers={p.name: p.describe() for p in providers})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=OUT)
    parser.add_argument("--dtypes", help="comma-separated: every shape in each of these dtypes "
                                         "(default: each shape in its own)")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S,
                        help="stop starting new shapes after this many seconds (0: no limit)")
    parser.add_argument("--providers", default=",".join(DEFAULT_PROVIDERS),
                        help=f"comma-separated, from {','.join(PROVIDERS)}")
    args = parser.parse_args(argv)
    try:
        chosen = get_providers([p for p in args.providers.split(",") if p])
    except ValueError as exc:
        parser.error(str(exc))
    dtypes = [d for d in (args.dtypes or "").split(",") if d] or None
    if dtypes and not set(dtypes) <= {"float16", "bfloat16"}:
        parser.error(f"--dtypes takes float16 and bfloat16, got {args.dtypes}")
    if not torch.cuda.is_available():
        print("benchmarks.short needs a CUDA GPU: nothing was measured or written", file=sys.stderr)
        return 2
    return side.write(args.out, "short", run(torch.device("cuda"), make_shapes(dtypes), chosen, budget_s=args.budget_s),
                      markdown)


if __name__ == "__main__":
    sys.exit(main())
