"""Plots and a Markdown summary from a results file: what the site's Benchmarks page shows.

    PYTHONPATH=. python -m benchmarks.report [benchmarks/results/results.json] [--out DIR]

Writes next to the results file (or into ``--out``):

* ``tflops_{fwd,bwd}_{dtype}.png`` -- TFLOP/s against N, one panel per head dim x mask (and the GQA
  row), one line per provider; a provider with no point at some N did not run there (the summary says why);
* ``latency_{fwd,fwd_bwd}_{mode}.png`` -- when the run has a latency section: µs per call against N,
  one figure per pass and mode, a panel per head dim x mask, a line per provider and B x H;
* ``summary.md`` -- the run's GPU and versions, the correctness checks, ours / peer ratios per setting
  (with the issue's targets marked), every TFLOP/s figure, peak memory, the long-context check, and the
  per-call latency tables when the run measured them. A section the run did not measure is left out.

A throughput ratio is flashattn's TFLOP/s over the peer's at the same setting and pass (> 1: flashattn
is faster). A latency ratio is flashattn's time per call over the peer's (< 1: flashattn is faster).
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


# The latency targets (flashattn's time per call / SDPA flash's, at N = 512 and B x H = 16).
LATENCY_TARGETS = {("eager", "fwd"): 1.5, ("eager", "fwd_bwd"): 1.5, ("reduce-overhead", "fwd"): 1.1,
                   ("reduce-overhead", "fwd_bwd"): 1.1}
# A timing whose host time per call is at least this share of its GPU time per call is listed as one the
# host may bound (the grid's "Calls the host may bound").
HOST_NEAR = 0.5
LATENCY_TARGET_PEER = "sdpa_flash"
LATENCY_TARGET_SHAPE = (512, 16)  # (N, B x H)
LATENCY_PASS_NAMES = {"fwd": "forward", "fwd_bwd": "forward + backward"}


def _mask(causal: bool) -> str:
    return "causal" if causal else "non-causal"


def _gqa(m) -> str:
    """'' for plain attention, else 'Hq:Hkv' (records of schema 1 have no kv_heads: plain)."""
    kv = m.get("kv_heads")
    return "" if kv is None or kv == m["heads"] else f"{m['heads']}:{kv}"


def _group_label(group) -> str:
    dtype, d, causal, gqa = group
    return f"{dtype}, D = {d}, {_mask(causal)}" + (f", GQA {gqa}" if gqa else "")


def _index(results) -> dict:
    """(dtype, head_dim, causal, gqa, seqlen, pass) -> provider -> measurement record."""
    table = {}
    for m in results["measurements"]:
        key = (m["dtype"], m["head_dim"], m["causal"], _gqa(m), m["seqlen"], m["pass"])
        table.setdefault(key, {})[m["provider"]] = m
    return table


def _peers(results) -> list[str]:
    return [p for p in results["providers"] if p != OURS]


def _groups(results) -> list[tuple]:
    """(dtype, head_dim, causal, gqa) in the order they were measured."""
    seen = {}
    for m in results["measurements"]:
        seen.setdefault((m["dtype"], m["head_dim"], m["causal"], _gqa(m)), None)
    return list(seen)


def _seqlens(results, group=None) -> list[int]:
    """The lengths measured (in one group, or in all)."""
    return sorted({m["seqlen"] for m in results["measurements"]
                   if group is None or (m["dtype"], m["head_dim"], m["causal"], _gqa(m)) == group})


def ratios(results) -> dict:
    """(dtype, head_dim, causal, gqa, seqlen, pass) -> peer -> ours / peer TFLOP/s, where both ran."""
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
    """(dtype, head_dim, causal, gqa, pass) -> peer -> (smallest ratio over N >= min_seqlen, its N)."""
    out = {}
    for (dtype, d, causal, gqa, n, p), by_peer in ratios(results).items():
        if n < min_seqlen:
            continue
        slot = out.setdefault((dtype, d, causal, gqa, p), {})
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
    for (dtype, d, causal, gqa) in _groups(results):
        for p in ("fwd", "bwd"):
            slot = mins.get((dtype, d, causal, gqa, p), {})
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
            mask = _mask(causal) + (f", GQA {gqa}" if gqa else "")
            lines.append(f"| {dtype} | {d} | {mask} | {p} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _md(text, limit=160) -> str:
    """Text safe inside a Markdown table cell: one line, no bare pipes, cut to ``limit`` characters."""
    text = " ".join(str(text).split())
    text = text if len(text) <= limit else text[: limit - 1] + "…"
    return text.replace("|", "\\|")


def _fmt_bytes(b) -> str:
    return f"{b / 2**20:,.0f} MiB" if b < 2**30 else f"{b / 2**30:,.2f} GiB"


def code_identity(env: dict) -> str:
    """The sentence that says which code a run measured. The hash of the package's sources, taken where
    the run ran, is the identity; the git commit the run recorded is named only where its own sources
    hash the same (a copied checkout can carry a stale HEAD). Where it does not, the local history is
    searched for the commit that holds those sources."""
    from benchmarks.provenance import commit_with_sources, sources_sha256_at

    sources, commit = env.get("flashattn_sources_sha256"), env.get("git_commit")
    if not sources:  # schema-1 files: a commit that could be stale, and nothing to check it against
        return ""
    matches = env.get("git_commit_is_sources")
    if matches is None and commit:
        at_commit = sources_sha256_at(commit)
        matches = None if at_commit is None else at_commit == sources
    if matches:
        dirty = " with uncommitted changes under `flashattn/`" if env.get("git_flashattn_dirty") else ""
        return f"The package measured: git commit `{commit[:12]}`{dirty}, sources SHA-256 `{sources[:16]}`."
    if matches is None:
        return f"The package measured: sources SHA-256 `{sources[:16]}` (git commit recorded: `{str(commit)[:12]}`, unchecked)."
    found = commit_with_sources(sources)
    if found:
        return (f"The package measured: sources SHA-256 `{sources[:16]}`, the `flashattn/` of commit `{found[:12]}` "
                f"(the run's own git metadata named `{str(commit)[:12]}`, which holds other sources).")
    return (f"The package measured: sources SHA-256 `{sources[:16]}`, held by no recent commit (the run's git "
            f"metadata named `{str(commit)[:12]}`, which holds other sources).")


def summary_markdown(results) -> str:
    env, cfg = results["environment"], results["config"]
    out = ["## Benchmark results", ""]
    code = code_identity(env)
    code = " " + code if code else ""
    out.append(f"Measured on **{env['gpu']}** (driver {env.get('driver')}, CUDA {env.get('cuda')}, "
               f"cuDNN {env.get('cudnn')}) with torch {env['torch']} and triton {env['triton']}, "
               f"{env['date']}, in one run of `python -m benchmarks.run`"
               + (" (`--quick`)" if cfg.get("quick") else "") + "." + code)
    if not results.get("complete"):
        out.append("")
        out.append("**This run is incomplete**: some settings were skipped (time budget or interruption); "
                   "their cells say so.")
    if results.get("grid") and results["measurements"]:
        out += _grid_markdown(results)
    if results.get("latency"):
        out += _latency_markdown(results)
    return "\n".join(out) + "\n"


def _host_timed(results) -> list[dict]:
    """The timings (measurement records) for which the run recorded the host's time per call."""
    return [m for m in results["measurements"] if m["status"] == "ok" and m.get("host_us") is not None]


def host_bound(results) -> list[dict]:
    """The timings whose host time per call is at least :data:`HOST_NEAR` of the GPU time per call
    that was timed."""
    return [m for m in _host_timed(results) if m["host_us"] >= HOST_NEAR * m["ms"] * 1e3]


def _host_bound_markdown(results) -> list[str]:
    timed = _host_timed(results)
    if not timed:
        return []  # a run from before the grid recorded host time
    near = host_bound(results)
    out = ["", "### Calls the host may bound", "",
           f"{_md(results['config'].get('host', 'host_us'), 300)}. Listed: the timings whose host time per "
           f"call is at least {HOST_NEAR:.0%} of the GPU time per call timed for them, where `do_bench`'s loop "
           f"may wait for the host and read the host's speed rather than the kernels' ({len(near)} of "
           f"{len(timed)} timings)."]
    if near:
        out += ["", "| provider | dtype | D | mask | N | pass | GPU µs per call | host µs per call |",
                "|---|---|---|---|---|---|---|---|"]
        for m in sorted(near, key=lambda m: (m["provider"], m["dtype"], m["head_dim"], m["causal"], _gqa(m),
                                             m["seqlen"], m["pass"])):
            mask = _mask(m["causal"]) + (f", GQA {_gqa(m)}" if _gqa(m) else "")
            out.append(f"| {m['provider']} | {m['dtype']} | {m['head_dim']} | {mask} | {m['seqlen']} | {m['pass']} "
                       f"| {m['ms'] * 1e3:.0f} | {m['host_us']:.0f} |")
    return out


def _grid_markdown(results) -> list[str]:
    cfg = results["config"]
    peers = _peers(results)
    providers = [OURS, *peers] if OURS in results["providers"] else peers
    index = _index(results)
    all_ratios = ratios(results)
    grid = results["grid"]
    out = ["", f"Grid: batch × N = {grid['tokens']} tokens, heads × D = {grid['hidden']}; "
               f"N in {grid['seqlens']}; D in {grid['head_dims']} for every provider"
               + (f" and {grid['head_dims_ours_only']} for flashattn only" if grid["head_dims_ours_only"] else "")
               + f"; {', '.join(grid['dtypes'])}; causal and not."]
    if grid.get("gqa"):
        g = grid["gqa"]
        out[-1] += (f" GQA row: {g['heads']} query heads sharing {g['kv_heads']} key/value heads, D = {g['head_dim']}, "
                    f"{g['dtype']}, {_mask(g['causal'])}, N in {g['seqlens']} (batch × N = {grid['tokens']}); "
                    f"{cfg.get('gqa', '')}.")
    out += ["",
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
        mask = _mask(c["causal"]) + (f", GQA {_gqa(c)}" if _gqa(c) else "")
        checks.append(f"| {c['dtype']} | {c['head_dim']} | {mask} | {c['seqlen']} | {c['provider']} | "
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
        out += ["", f"#### {_group_label(group)}", "",
                "| N | pass | " + " | ".join(providers) + " |", "|---|---|" + "---|" * len(providers)]
        for n in _seqlens(results, group):
            for p in ("fwd", "bwd"):
                by_provider = index.get((*group, n, p))
                if not by_provider:
                    continue
                cells = []
                for prov in providers:
                    cell = _status_cell(by_provider.get(prov))
                    r = all_ratios.get((*group, n, p), {}).get(prov)
                    cells.append(f"{cell} ({r:.2f}×)" if r is not None else cell)
                out.append(f"| {n} | {p} | " + " | ".join(cells) + " |")
        hows = {m["provider"]: m["gqa"] for m in results["measurements"]
                if m.get("gqa") and (m["dtype"], m["head_dim"], m["causal"], _gqa(m)) == group}
        if group[3] and hows:
            out += ["", "GQA as run: " + "; ".join(f"`{p}` {how}" for p, how in hows.items()) + "."]

    out += _host_bound_markdown(results)

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
        group = (m["dtype"], m["head_dim"], m["causal"], _gqa(m))
        mem.setdefault(group, {}).setdefault(m["seqlen"], {})[m["provider"]] = m
    for (dtype, d, causal, gqa), by_n in mem.items():
        n = max(by_n)
        cells = [(_fmt_bytes(m["peak_bytes"]) if m["status"] == "ok" else m["status"]) if m else "—"
                 for m in (by_n[n].get(p) for p in providers)]
        mask = _mask(causal) + (f", GQA {gqa}" if gqa else "")
        out.append(f"| {dtype} | {d} | {mask} | {n} | " + " | ".join(cells) + " |")

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
    return out


# -- latency -------------------------------------------------------------------------------------------------

def _latency_index(results) -> dict:
    """(dtype, head_dim, causal, seqlen, batch x heads, pass) -> (provider, mode) -> latency record."""
    table = {}
    for r in (results.get("latency") or {}).get("records", []):
        key = (r["dtype"], r["head_dim"], r["causal"], r["seqlen"], r["batch"] * r["heads"], r["pass"])
        table.setdefault(key, {})[(r["provider"], r["mode"])] = r
    return table


def _latency_providers(results) -> list[str]:
    names = list(dict.fromkeys(r["provider"] for r in results["latency"]["records"]))
    return sorted(names, key=lambda p: p != OURS)  # ours first, the rest in run order


def _latency_modes(results) -> list[str]:
    present = {r["mode"] for r in results["latency"]["records"]}
    return [m for m in results_mod.LATENCY_MODES if m in present]


def latency_ratios(results) -> dict:
    """(dtype, D, causal, N, BxH, pass, mode) -> peer -> ours / peer time per call, where both ran."""
    out = {}
    for key, cell in _latency_index(results).items():
        for (prov, mode), ours in cell.items():
            if prov != OURS or ours["status"] != "ok":
                continue
            for (peer, peer_mode), r in cell.items():
                if peer != OURS and peer_mode == mode and r["status"] == "ok":
                    out.setdefault((*key, mode), {})[peer] = ours["us_per_call"] / r["us_per_call"]
    return out


def latency_target_table(results) -> str:
    """Markdown: flashattn / SDPA flash time per call at the target shape, with the issue's targets marked."""
    if not results.get("latency"):
        return ""
    n0, bh0 = LATENCY_TARGET_SHAPE
    rat = latency_ratios(results)
    lines = ["| dtype | D | mask | pass | " + " | ".join(f"{m} (target ≤ {LATENCY_TARGETS.get((m, 'fwd'), '—')}×)"
                                                      if (m, "fwd") in LATENCY_TARGETS else m
                                                      for m in _latency_modes(results)) + " |",
             "|---|---|---|---|" + "---|" * len(_latency_modes(results))]
    keys = sorted({k[:3] for k in _latency_index(results)}, key=lambda k: (k[0], k[1], k[2]))
    for dtype, d, causal in keys:
        for p in results_mod.LATENCY_PASSES:
            cells = []
            for mode in _latency_modes(results):
                r = rat.get((dtype, d, causal, n0, bh0, p, mode), {}).get(LATENCY_TARGET_PEER)
                if r is None:
                    cells.append("—")
                    continue
                target = LATENCY_TARGETS.get((mode, p))
                mark = "" if target is None else (" ✓" if r <= target else f" ✗ (>{target:g})")
                cells.append(f"{r:.2f}×{mark}")
            if any(c != "—" for c in cells):
                lines.append(f"| {dtype} | {d} | {_mask(causal)} | {p} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _latency_markdown(results) -> list[str]:
    lat = results["latency"]
    cfg = lat["config"]
    providers = _latency_providers(results)
    modes = _latency_modes(results)
    index = _latency_index(results)
    rat = latency_ratios(results)
    n0, bh0 = LATENCY_TARGET_SHAPE
    env, lat_env = results["environment"], lat.get("environment")
    measured = ""
    if lat_env and (lat_env.get("date"), lat_env.get("flashattn_sources_sha256")) != (
            env.get("date"), env.get("flashattn_sources_sha256")):
        measured = (f"Measured in a separate run on **{lat_env.get('gpu')}** with torch {lat_env.get('torch')} and "
                    f"triton {lat_env.get('triton')}, {lat_env.get('date')}. {code_identity(lat_env)} ")
    out = ["", "### Per-call latency at small shapes", "",
           measured + f"Time per call as a user sees it, host and GPU together: {cfg.get('timer', '')}; loops of about "
           f"{cfg.get('target_ms', '—')} ms, {cfg.get('repeats', '—')} repeats. Forward: {cfg['forward']}. "
           f"Forward + backward: {cfg['fwd_bwd']}. Modes: "
           + "; ".join(f"`{m}` = {how}" for m, how in cfg["modes"].items() if m in modes) + ".",
           "",
           f"flashattn's time per call over SDPA flash's at N = {n0}, B × H = {bh0} (< 1: flashattn is faster); "
           "✓/✗: the issue's targets (eager ≤ 1.5×, reduce-overhead ≤ 1.1×).", "",
           latency_target_table(results)]
    for mode in modes:
        out += ["", f"#### µs per call, {mode}", "",
                "Each cell: wall-clock µs per call; for flashattn, its time over SDPA flash's in brackets.", "",
                "| dtype | D | mask | N | B × H | pass | " + " | ".join(providers) + " |",
                "|---|---|---|---|---|---|" + "---|" * len(providers)]
        for key in sorted(index, key=lambda k: (k[0], k[1], k[2], results_mod.LATENCY_PASSES.index(k[5]), k[4], k[3])):
            dtype, d, causal, n, bh, p = key
            cells = []
            for prov in providers:
                r = index[key].get((prov, mode))
                if r is None:
                    cells.append("—")
                    continue
                if r["status"] != "ok":
                    cells.append(r["status"])
                    continue
                cell = f"{r['us_per_call']:.1f}"
                ratio = rat.get((*key, mode), {}).get(LATENCY_TARGET_PEER) if prov == OURS else None
                cells.append(cell + (f" ({ratio:.2f}×)" if ratio is not None else ""))
            out.append(f"| {dtype} | {d} | {_mask(causal)} | {n} | {bh} | {p} | " + " | ".join(cells) + " |")
    failed = {}
    for r in lat["records"]:
        if r["status"] != "ok" and not r.get("error", "").startswith("not compiled again"):
            failed.setdefault((r["provider"], r["mode"], r["status"], _md(r.get("error", ""), 300)), []).append(r)
    notes = {r["provider"]: r["note"] for r in lat["records"] if r.get("note")}
    notes.update({r["provider"]: r["error"] for r in lat["records"] if r.get("error", "").startswith("not compiled again")})
    if notes:
        out += ["", "Notes: " + "; ".join(f"`{p}`: {_md(n, 200)}" for p, n in notes.items()) + "."]
    if failed:
        out += ["", "#### Not measured (latency)", "", "| provider | mode | status | reason | cells |",
                "|---|---|---|---|---|"]
        for (prov, mode, status, reason), rs in failed.items():
            out.append(f"| {prov} | {mode} | {status} | {reason} | {len(rs)} |")
    return out


# -- plots ---------------------------------------------------------------------------------------------------

def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# Every plot is drawn at this size or larger, and sized so that the site's content column (about 688 px
# wide) shows it at no less than 0.8 of its natural width: labels stay above 9 px on the page.
FONT_PT = 10
DPI = 100


def _save(fig, path, plt) -> Path:
    """Write a PNG whose metadata records its smallest text size in points and its resolution, so that
    the site's browser test can work out how large the labels are where the page shows the image."""
    fig.canvas.draw()
    sizes = [t.get_fontsize() for t in fig.findobj(lambda a: hasattr(a, "get_fontsize") and hasattr(a, "get_text"))
             if t.get_visible() and t.get_text().strip()]
    fig.savefig(path, dpi=DPI, metadata={"Description": f"flashattn-figure: smallest-font-pt={min(sizes):g} dpi={DPI}"})
    plt.close(fig)
    return path


def _legend(fig, axes, ncol=5):
    handles = {}
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=min(ncol, len(handles)),
               fontsize=FONT_PT, frameon=False)


def _length_ticks(ax, seqlens):
    ax.set_xscale("log", base=2)
    ax.set_xticks(seqlens, [f"{n // 1024}k" if n >= 1024 else str(n) for n in seqlens])
    ax.minorticks_off()
    ax.tick_params(labelsize=FONT_PT)


def plot_files(results, out_dir) -> list[Path]:
    """One PNG per dtype x pass: TFLOP/s against N, a panel per head dim x mask (the GQA row its own panel)."""
    if not results["measurements"]:
        return []
    plt = _pyplot()
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
        rows = list(dict.fromkeys((g[1], g[3]) for g in groups if g[0] == dtype))  # (D, gqa)
        masks = sorted({g[2] for g in groups if g[0] == dtype})
        for p in ("fwd", "bwd"):
            fig, axes = plt.subplots(len(rows), len(masks), figsize=(4.3 * len(masks), 2.9 * len(rows) + 0.6),
                                     squeeze=False)
            for i, (d, gqa) in enumerate(rows):
                for j, causal in enumerate(masks):
                    ax = axes[i][j]
                    group = (dtype, d, causal, gqa)
                    if group not in groups:
                        ax.set_visible(False)
                        continue
                    seqlens = _seqlens(results, group)
                    for prov in providers:
                        pts = sorted((n, index[(*group, n, p)][prov]["tflops"]) for n in seqlens
                                     if prov in index.get((*group, n, p), {})
                                     and index[(*group, n, p)][prov]["status"] == "ok")
                        if pts:
                            ax.plot(*zip(*pts), label=results["providers"][prov]["label"], **styles[prov])
                    _length_ticks(ax, seqlens)
                    ax.set_title(f"D = {d}, {_mask(causal)}" + (f", GQA {gqa}" if gqa else ""), fontsize=FONT_PT)
                    ax.set_ylim(bottom=0)
                    ax.grid(True, alpha=0.3)
                    if j == 0:
                        ax.set_ylabel("TFLOP/s", fontsize=FONT_PT)
                    if i == len(rows) - 1 or (dtype, rows[i + 1][0], causal, rows[i + 1][1]) not in groups:
                        ax.set_xlabel("sequence length N", fontsize=FONT_PT)
            _legend(fig, axes, ncol=3)
            fig.suptitle(f"{PASS_NAMES[p].capitalize()}, {dtype}, {gpu}; batch × N = {results['grid']['tokens']:,}",
                         fontsize=FONT_PT + 1)
            fig.tight_layout(rect=(0, (0.25 * -(-len(providers) // 3) + 0.1) / fig.get_figheight(), 1, 1))
            written.append(_save(fig, out_dir / f"tflops_{p}_{dtype}.png", plt))
    return written


def latency_plot_files(results, out_dir) -> list[Path]:
    """One PNG per latency pass and mode (and dtype, when several): µs per call against N, log scale; a
    panel per head dim (rows) x mask (columns); a colour per provider, solid for the smaller B x H."""
    if not results.get("latency") or not results["latency"]["records"]:
        return []
    plt = _pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    index = _latency_index(results)
    providers = _latency_providers(results)
    modes = _latency_modes(results)
    labels = {p: results["providers"][p]["label"] for p in providers}
    dtypes = list(dict.fromkeys(k[0] for k in index))
    head_dims = sorted({k[1] for k in index})
    masks = sorted({k[2] for k in index})
    bhs = sorted({k[4] for k in index})
    seqlens = sorted({k[3] for k in index})
    styles = ["-", "--", ":", "-."]
    gpu = results["environment"]["gpu"]
    written = []
    for dtype in dtypes:
        for p in results_mod.LATENCY_PASSES:
            for mode in modes:
                if not any(k[0] == dtype and k[5] == p and (prov, mode) in v for k, v in index.items()
                           for prov in providers):
                    continue
                fig, axes = plt.subplots(len(head_dims), len(masks), squeeze=False, sharey=True,
                                         figsize=(4.0 * len(masks) + 0.4, 2.8 * len(head_dims) + 1.4))
                for i, d in enumerate(head_dims):
                    for j, causal in enumerate(masks):
                        ax = axes[i][j]
                        for c, prov in enumerate(providers):
                            for b, bh in enumerate(bhs):
                                pts = []
                                for n in seqlens:
                                    r = index.get((dtype, d, causal, n, bh, p), {}).get((prov, mode))
                                    if r is not None and r["status"] == "ok":
                                        pts.append((n, r["us_per_call"]))
                                if pts:
                                    ax.plot(*zip(*pts), marker="o", color=f"C{c}", linestyle=styles[b % len(styles)],
                                            linewidth=2.5 if prov == OURS else 1.3,
                                            label=f"{labels[prov]}, B × H = {bh}")
                        _length_ticks(ax, seqlens)
                        ax.set_yscale("log")
                        ax.yaxis.set_major_formatter("{x:g}")
                        ax.yaxis.set_minor_formatter("{x:g}")
                        ax.tick_params(which="both", labelsize=FONT_PT)
                        ax.grid(True, which="both", alpha=0.3)
                        ax.set_title(f"D = {d}, {_mask(causal)}", fontsize=FONT_PT)
                        if j == 0:
                            ax.set_ylabel("µs per call", fontsize=FONT_PT)
                        if i == len(head_dims) - 1:
                            ax.set_xlabel("sequence length N", fontsize=FONT_PT)
                _legend(fig, axes, ncol=2)
                fig.suptitle(f"Per-call latency, {LATENCY_PASS_NAMES[p]}, {mode}, {dtype}, {gpu}",
                             fontsize=FONT_PT + 1)
                n_legend_rows = -(-len({lab for ax in axes.flat for lab in ax.get_legend_handles_labels()[1]}) // 2)
                fig.tight_layout(rect=(0, min(0.45, (0.25 * n_legend_rows + 0.1) / fig.get_figheight()), 1, 1))
                suffix = f"_{dtype}" if len(dtypes) > 1 else ""
                written.append(_save(fig, out_dir / f"latency_{p}_{mode}{suffix}.png", plt))
    return written


def write_all(results, out_dir) -> list[Path]:
    out_dir = Path(out_dir)
    written = plot_files(results, out_dir) + latency_plot_files(results, out_dir)
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
