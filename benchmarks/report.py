"""Plots and a Markdown summary from a results file: what the site's Benchmarks page shows.

    PYTHONPATH=. python -m benchmarks.report [benchmarks/results/results.json] [--out DIR]

Writes next to the results file (or into ``--out``):

* ``tflops_{fwd,bwd}_{dtype}.png`` -- TFLOP/s against N, one panel per head dim x mask, one line per
  provider; a provider with no point at some N did not run there (the summary says why);
* ``summary.md`` -- the run's GPU and versions, the correctness checks, ours / peer ratios per setting
  (with the issue's targets marked), every TFLOP/s figure, peak memory, and the long-context check.

A ratio is flashattn's TFLOP/s over the peer's at the same setting and pass (> 1: flashattn is faster).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks import results as results_mod

# The targets (ours / peer, N >= 2048). cuDNN's is the further goal.
TARGETS = {("fwd", "flex"): 1.0, ("fwd", "sdpa_flash"): 1.3, ("bwd", "flex"): 1.0, ("bwd", "sdpa_flash"): 1.2,
           ("fwd", "sdpa_cudnn"): 1.0, ("bwd", "sdpa_cudnn"): 1.0}
TARGET_MIN_SEQLEN = 2048
OURS = "flashattn"
PASS_NAMES = {"fwd": "forward", "bwd": "backward"}


def _mask(causal: bool) -> str:
    return "causal" if causal else "non-causal"


def _index(results) -> dict:
    """(dtype, head_dim, causal, seqlen, pass) -> provider -> measurement record."""
    table = {}
    for m in results["measurements"]:
        key = (m["dtype"], m["head_dim"], m["causal"], m["seqlen"], m["pass"])
        table.setdefault(key, {})[m["provider"]] = m
    return table


def _peers(results) -> list[str]:
    return [p for p in results["providers"] if p != OURS]


def _groups(results) -> list[tuple]:
    """(dtype, head_dim, causal) in the order they were measured."""
    seen = {}
    for m in results["measurements"]:
        seen.setdefault((m["dtype"], m["head_dim"], m["causal"]), None)
    return list(seen)


def ratios(results) -> dict:
    """(dtype, head_dim, causal, seqlen, pass) -> peer -> ours / peer TFLOP/s, where both ran."""
    out = {}
    for key, by_provider in _index(results).items():
        ours = by_provider.get(OURS)
        if not ours or ours["status"] != "ok":
            continue
        for peer, m in by_provider.items():
            if peer != OURS and m["status"] == "ok":
                out.setdefault(key, {})[peer] = ours["tflops"] / m["tflops"]
    return out


def min_ratios(results, min_seqlen: int = TARGET_MIN_SEQLEN) -> dict:
    """(dtype, head_dim, causal, pass) -> peer -> (smallest ratio over N >= min_seqlen, its N)."""
    out = {}
    for (dtype, d, causal, n, p), by_peer in ratios(results).items():
        if n < min_seqlen:
            continue
        slot = out.setdefault((dtype, d, causal, p), {})
        for peer, r in by_peer.items():
            if peer not in slot or r < slot[peer][0]:
                slot[peer] = (r, n)
    return out


def _status_cell(m) -> str:
    if m is None:
        return "—"
    if m["status"] == "ok":
        return f"{m['tflops']:.0f}"
    return m["status"]


def ratio_table(results) -> str:
    """Markdown: per setting and pass, the smallest ours / peer ratio at N >= 2048, targets marked."""
    peers = _peers(results)
    mins = min_ratios(results)
    lines = ["| dtype | D | mask | pass | " + " | ".join(f"vs {p}" for p in peers) + " |",
             "|---|---|---|---|" + "---|" * len(peers)]
    for (dtype, d, causal) in _groups(results):
        for p in ("fwd", "bwd"):
            slot = mins.get((dtype, d, causal, p), {})
            if not slot:
                continue
            cells = []
            for peer in peers:
                if peer not in slot:
                    cells.append("—")
                    continue
                r, n = slot[peer]
                target = TARGETS.get((p, peer))
                mark = "" if target is None else (" ✓" if r >= target else f" ✗ (<{target:g})")
                cells.append(f"{r:.2f}× @{n}{mark}")
            lines.append(f"| {dtype} | {d} | {_mask(causal)} | {p} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _md(text, limit=160) -> str:
    """Text safe inside a Markdown table cell: one line, no bare pipes, cut to ``limit`` characters."""
    text = " ".join(str(text).split())
    text = text if len(text) <= limit else text[: limit - 1] + "…"
    return text.replace("|", "\\|")


def _fmt_bytes(b) -> str:
    return f"{b / 2**20:,.0f} MiB" if b < 2**30 else f"{b / 2**30:,.2f} GiB"


def summary_markdown(results) -> str:
    env, cfg = results["environment"], results["config"]
    peers = _peers(results)
    providers = [OURS, *peers] if OURS in results["providers"] else peers
    index = _index(results)
    all_ratios = ratios(results)
    out = ["## Benchmark results", ""]
    out.append(f"Measured on **{env['gpu']}** (driver {env.get('driver')}, CUDA {env.get('cuda')}, "
               f"cuDNN {env.get('cudnn')}) with torch {env['torch']} and triton {env['triton']}, "
               f"{env['date']}, in one run of `python -m benchmarks.run`"
               + (" (`--quick`)" if cfg.get("quick") else "") + ".")
    if not results.get("complete"):
        out.append("")
        out.append("**This run is incomplete**: some settings were skipped (time budget or interruption); "
                   "their cells say so.")
    grid = results["grid"]
    out += ["", f"Grid: batch × N = {grid['tokens']} tokens, heads × D = {grid['hidden']}; "
                f"N in {grid['seqlens']}; D in {grid['head_dims']} for every provider"
                + (f" and {grid['head_dims_ours_only']} for flashattn only" if grid["head_dims_ours_only"] else "")
                + f"; {', '.join(grid['dtypes'])}; causal and not.",
            "",
            f"Timing: `{cfg['timer']}`, median, warm-up {cfg['warmup_ms']} ms, repetitions {cfg['rep_ms']} ms. "
            f"Forward: {cfg['forward']}. Backward: {cfg['backward']}. TFLOP/s: `{cfg['flops']}` over the median time.",
            "", "Providers: " + "; ".join(f"`{k}` = {v['label']}" for k, v in results["providers"].items()) + "."]

    checks = ["", "### Correctness check", "",
              f"{cfg['check']}.", "",
              "| dtype | D | mask | N | provider | rel err o | dq | dk | dv | naive same-dtype o / dq | result |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in results["checks"]:
        e, b = c.get("rel_err") or {}, c.get("naive_lowp_rel_err") or {}

        def fmt(x):
            return f"{x:.1e}" if isinstance(x, (int, float)) else str(x) if x is not None else "—"

        if c.get("passed"):
            result = "pass"
        elif c["status"] == "failed":
            result = "**FAILED**"
        else:  # the provider could not run here: not a wrong answer, but no answer
            result = f"{c['status']}: {_md(c['error'])}"
        checks.append(f"| {c['dtype']} | {c['head_dim']} | {_mask(c['causal'])} | {c['seqlen']} | {c['provider']} | "
                      f"{fmt(e.get('o'))} | {fmt(e.get('dq'))} | {fmt(e.get('dk'))} | {fmt(e.get('dv'))} | "
                      f"{fmt(b.get('o'))} / {fmt(b.get('dq'))} | {result} |")

    out += ["", f"### flashattn / peer, smallest ratio over N ≥ {TARGET_MIN_SEQLEN}", "",
            "TFLOP/s of flashattn over the peer's at the same setting (> 1: flashattn is faster), the smallest over "
            f"N ≥ {TARGET_MIN_SEQLEN} and the N where it occurs. ✓/✗: the issue's targets "
            + ", ".join(f"{PASS_NAMES[p]} ≥ {t:g}× {peer}" for (p, peer), t in TARGETS.items()) + ".", "",
            ratio_table(results)]

    out += checks

    out += ["", "### TFLOP/s", "",
            "Each cell: TFLOP/s, and for a peer flashattn's ratio to it. `unsupported`: the backend refused "
            "the shape; `skipped`: not run by design (or the time budget); `error`/`oom`: see the results file."]
    for group in _groups(results):
        dtype, d, causal = group
        out += ["", f"#### {dtype}, D = {d}, {_mask(causal)}", "",
                "| N | pass | " + " | ".join(providers) + " |", "|---|---|" + "---|" * len(providers)]
        for n in grid["seqlens"]:
            for p in ("fwd", "bwd"):
                by_provider = index.get((dtype, d, causal, n, p))
                if not by_provider:
                    continue
                cells = []
                for prov in providers:
                    cell = _status_cell(by_provider.get(prov))
                    r = all_ratios.get((dtype, d, causal, n, p), {}).get(prov)
                    cells.append(f"{cell} ({r:.2f}×)" if r is not None else cell)
                out.append(f"| {n} | {p} | " + " | ".join(cells) + " |")

    missing = {}
    for m in results["measurements"]:
        if m["status"] != "ok":
            missing.setdefault((m["provider"], m["status"], _md(m.get("error", ""), 200)), []).append(m)
    if missing:
        out += ["", "### Not measured", "", "| provider | status | reason | cells |", "|---|---|---|---|"]
        for (prov, status, reason), ms in missing.items():
            out.append(f"| {prov} | {status} | {reason} | {len(ms)} |")

    out += ["", "### Peak memory of forward + backward", "",
            cfg["memory"] + ". Shown at the longest N of each setting (every N is in the results file).", "",
            "| dtype | D | mask | N | " + " | ".join(providers) + " |", "|---|---|---|---|" + "---|" * len(providers)]
    mem = {}
    for m in results["memory"]:
        mem.setdefault((m["dtype"], m["head_dim"], m["causal"]), {}).setdefault(m["seqlen"], {})[m["provider"]] = m
    for (dtype, d, causal), by_n in mem.items():
        n = max(by_n)
        cells = [(_fmt_bytes(m["peak_bytes"]) if m["status"] == "ok" else m["status"]) if m else "—"
                 for m in (by_n[n].get(p) for p in providers)]
        out.append(f"| {dtype} | {d} | {_mask(causal)} | {n} | " + " | ".join(cells) + " |")

    lc = results.get("long_context")
    if lc and lc.get("status") == "error":
        out += ["", "### Long context: one head, N = {:,}".format(lc["seqlen"]), "",
                f"The check itself failed: {_md(lc['error'], 300)}"]
    elif lc:
        out += ["", "### Long context: one head, N = {:,}".format(lc["seqlen"]), ""]
        fa, naive = lc.get("flashattn", {}), lc.get("naive", {})
        if fa.get("status") == "ok":
            out.append(f"flashattn forward + backward at N = {lc['seqlen']:,}, D = {lc['head_dim']}, {lc['dtype']}: "
                       f"peak {_fmt_bytes(fa['peak_bytes'])} above the inputs ({_fmt_bytes(lc['input_bytes'])} for "
                       f"q, k, v, dO); output finite: {fa['output_finite']}.")
        else:
            out.append(f"flashattn at N = {lc['seqlen']:,}: **{fa.get('status')}**: {_md(fa.get('error', ''), 300)}")
        out.append("")
        s_bytes = _fmt_bytes(lc["score_matrix_bytes"])
        if naive.get("status") == "ok":
            out.append(f"The naive reference also ran, with a peak of {_fmt_bytes(naive['peak_bytes'])} "
                       f"(one N × N score matrix is {s_bytes} in {lc['dtype']}).")
        else:
            out.append(f"The naive reference ({naive.get('status')}): one N × N score matrix alone is {s_bytes} in "
                       f"{lc['dtype']} ({_fmt_bytes(lc['score_matrix_bytes_float32'])} in float32), against "
                       f"{_fmt_bytes(lc['gpu_memory_bytes'])} on the GPU.")
    return "\n".join(out) + "\n"


def plot_files(results, out_dir) -> list[Path]:
    """One PNG per dtype x pass: TFLOP/s against N, a panel per head dim x mask."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    index = _index(results)
    groups = _groups(results)
    providers = list(results["providers"])
    styles = {p: dict(marker="o", linewidth=2.5 if p == OURS else 1.5, zorder=3 if p == OURS else 2,
                      color=f"C{i}") for i, p in enumerate(providers)}
    gpu = results["environment"]["gpu"]
    written = []
    for dtype in dict.fromkeys(g[0] for g in groups):
        dims = sorted({g[1] for g in groups if g[0] == dtype})
        masks = sorted({g[2] for g in groups if g[0] == dtype})
        for p in ("fwd", "bwd"):
            fig, axes = plt.subplots(len(dims), len(masks), figsize=(5.2 * len(masks), 3.4 * len(dims)),
                                     squeeze=False, sharex=True)
            for i, d in enumerate(dims):
                for j, causal in enumerate(masks):
                    ax = axes[i][j]
                    for prov in providers:
                        pts = sorted((n, index[(dtype, d, causal, n, p)][prov]["tflops"])
                                     for n in results["grid"]["seqlens"]
                                     if prov in index.get((dtype, d, causal, n, p), {})
                                     and index[(dtype, d, causal, n, p)][prov]["status"] == "ok")
                        if pts:
                            ax.plot(*zip(*pts), label=results["providers"][prov]["label"], **styles[prov])
                    ax.set_xscale("log", base=2)
                    seqlens = results["grid"]["seqlens"]
                    ax.set_xticks(seqlens, [f"{n // 1024}k" if n >= 1024 else str(n) for n in seqlens])
                    ax.minorticks_off()
                    ax.set_title(f"D = {d}, {_mask(causal)}", fontsize=10)
                    ax.set_ylim(bottom=0)
                    ax.grid(True, alpha=0.3)
                    if j == 0:
                        ax.set_ylabel("TFLOP/s")
                    if i == len(dims) - 1:
                        ax.set_xlabel("sequence length N (batch × N = {:,})".format(results["grid"]["tokens"]))
            handles = {}
            for ax in axes.flat:
                for h, lab in zip(*ax.get_legend_handles_labels()):
                    handles.setdefault(lab, h)
            fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=min(5, len(handles)),
                       fontsize=9, frameon=False)
            fig.suptitle(f"{PASS_NAMES[p].capitalize()}, {dtype}, {gpu}", fontsize=11)
            fig.tight_layout(rect=(0, 0.045 if len(dims) > 2 else 0.08, 1, 1))
            path = out_dir / f"tflops_{p}_{dtype}.png"
            fig.savefig(path, dpi=100)
            plt.close(fig)
            written.append(path)
    return written


def write_all(results, out_dir) -> list[Path]:
    out_dir = Path(out_dir)
    written = plot_files(results, out_dir)
    summary = out_dir / "summary.md"
    summary.write_text(summary_markdown(results))
    return [*written, summary]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="?", default="benchmarks/results/results.json")
    ap.add_argument("--out", help="folder for the plots and summary.md (default: the results file's folder)")
    args = ap.parse_args(argv)
    path = Path(args.results)
    if not path.exists():
        print(f"no results file at {path}: run `PYTHONPATH=. python -m benchmarks.run` on a GPU first",
              file=sys.stderr)
        return 2
    results = results_mod.load(path)
    for p in write_all(results, Path(args.out) if args.out else path.parent):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
