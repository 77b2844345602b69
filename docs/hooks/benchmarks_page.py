"""The results part of the Benchmarks page, from the committed ``benchmarks/results/``.

The page opens with the plots and the one summary table (flashattn over each peer); everything else
of ``summary.md`` (the run's setup, the correctness checks, every TFLOP/s and latency figure) follows
in collapsed blocks, unedited: each ``###`` section of the summary becomes one ``??? note`` block
titled by its heading, so every number of the summary is on the page.
"""

from __future__ import annotations

import re
from pathlib import Path

PLACEHOLDER = (
    '!!! info "No results yet"\n\n'
    "    `benchmarks/results/` holds no measurements yet, so there is nothing to plot. The\n"
    "    harness needs a CUDA GPU (H100 or H200). Once its JSON, plots and `summary.md` are\n"
    "    committed under `benchmarks/results/`, this page shows them without any edit: the\n"
    "    build reads that folder every time.\n"
)
PASS_LABELS = {"fwd": "forward", "bwd": "backward", "fwd_bwd": "forward + backward"}


def _indent(text: str) -> str:
    return "\n".join("    " + line if line.strip() else "" for line in text.strip("\n").splitlines())


def _collapsed(title: str, body: str) -> str:
    # Sub-headings become bold lines: a heading inside a collapsed block would still fill the TOC.
    body = re.sub(r"^#{3,6} (.*)$", r"**\1**", body, flags=re.M)
    return f'??? note "{title.replace(chr(34), chr(39))}"\n\n{_indent(body)}\n'


def _tabs(items: list[tuple[str, list[Path]]]) -> str:
    out = []
    for label, pngs in items:
        out.append(f'=== "{label}"\n')
        out += [f"    ![{png.stem.replace('_', ' ')}](benchmarks/{png.name})\n" for png in pngs]
    return "\n".join(out)


def plots(pngs: list[Path]) -> str:
    """Throughput plots in one set of tabs (one per pass and dtype), latency plots in another (one per
    mode, both passes in each); any other plot after them."""
    tflops = [p for p in pngs if p.stem.startswith("tflops_")]
    latency = [p for p in pngs if p.stem.startswith("latency_")]
    rest = [p for p in pngs if p not in tflops and p not in latency]
    out = []
    if tflops:
        items = []
        for png in tflops:
            _, p, dtype = png.stem.split("_", 2)
            items.append((f"{PASS_LABELS.get(p, p).capitalize()}, {dtype}", [png]))
        items.sort(key=lambda item: (item[0].split(", ")[1], item[0].startswith("B")))
        out.append("**Throughput** (TFLOP/s against N; higher is better):\n\n" + _tabs(items))
    if latency:
        modes: dict[str, list[Path]] = {}
        for png in latency:
            mode = re.sub(r"^latency_(fwd_bwd|fwd)_", "", png.stem)
            modes.setdefault(mode, []).append(png)
        items = [(mode, sorted(group, key=lambda png: "fwd_bwd" in png.stem)) for mode, group in modes.items()]
        order = ["eager", "eager-one-thread", "compile", "reduce-overhead"]
        items.sort(key=lambda item: order.index(item[0]) if item[0] in order else len(order))
        out.append("**Per-call latency** at small shapes (µs per call against N; lower is better), by mode:\n\n"
                   + _tabs(items))
    out += [f"![{png.stem.replace('_', ' ')}](benchmarks/{png.name})\n" for png in rest]
    return "\n".join(out)


def render(results: Path, part: str = "") -> str:
    """The page's part named by the directive's argument: the main results (none), ``short``, ``first-call``
    or ``decoding``."""
    if part:
        parts = {"short": (short, "short"), "first-call": (first_call, "short"), "decoding": (decoding, "core")}
        if part not in parts:
            raise ValueError(f"unknown benchmarks part {part!r} (known: {', '.join(parts)})")
        show, folder = parts[part]
        return show(results / folder)
    summary = results / "summary.md"
    pngs = sorted(results.glob("*.png")) if results.is_dir() else []
    jsons = sorted(results.glob("*.json")) if results.is_dir() else []
    if not (summary.is_file() or pngs or jsons):
        return PLACEHOLDER
    text = summary.read_text(encoding="utf-8") if summary.is_file() else ""
    # The summary's sections start at level 3, below this page's "## Results"; its level-2 title
    # would repeat that heading.
    preamble, *sections = re.split(r"(?m)^(?=### )", text)
    preamble = re.sub(r"^## .*\n", "", preamble.strip() + "\n", count=1)
    paragraphs = [p for p in re.split(r"\n\s*\n", preamble.strip()) if p.strip()]
    measured = [p for p in paragraphs if p.startswith("Measured on")]
    setup = [p for p in paragraphs if not p.startswith("Measured on")]

    out = [*(p + "\n" for p in measured)]
    if pngs:
        out.append(plots(pngs))
    if sections:
        out.append(sections[0].strip() + "\n")  # the one summary table, open
    if setup:
        out.append(_collapsed("How this run was set up", "\n\n".join(setup)))
    for section in sections[1:]:
        heading, _, body = section.partition("\n")
        out.append(_collapsed(heading.lstrip("#").strip(), body))
    if jsons:
        out.append("The JSON files the plots and tables come from, in `benchmarks/results/`: "
                   + ", ".join(f"`{js.name}`" for js in jsons) + ".\n")
    return "\n".join(out)


def _json(path: Path) -> dict | None:
    import json

    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def short(folder: Path) -> str:
    """The short training shapes (``benchmarks.short``): the figure ``figures.py`` draws from the same file,
    then the table, or a plain note when no run is committed."""
    result = _json(folder / "short.json")
    if result is None:
        return ('!!! info "No run committed yet"\n\n'
                "    `benchmarks/results/short/short.json` is not there: no run of `benchmarks.short` has been\n"
                "    committed, so there is no table or plot yet. This section shows them once it is.\n")
    from benchmarks import short as short_mod

    skipped = sum(r["status"] == "skipped" for r in result["rows"])
    out = ["![flashattn and FlexAttention over the fastest SDPA backend at each short training shape]"
           "(figures/short-training.svg)\n", short_mod.markdown(result)]
    if skipped:
        out.append(f"{skipped} measurement(s) were skipped when the run's time budget ran out.\n")
    return "\n".join(out)


def first_call(folder: Path) -> str:
    """The first-call times (``benchmarks.first_call``), or a plain note when no run is committed."""
    result = _json(folder / "first_call.json")
    if result is None:
        return ('!!! info "No run committed yet"\n\n'
                "    `benchmarks/results/short/first_call.json` is not there: no run of `benchmarks.first_call`\n"
                "    has been committed yet.\n")
    from benchmarks import first_call as first_call_mod

    return first_call_mod.markdown(result)


def decoding(folder: Path) -> str:
    """The last committed run of dense-API decoding (``benchmarks.decode`` with ``flashattn_dense``; runs are
    committed as ``dense_decode_a.json``, ``_b``, ..., so the last by name) and the runs committed beside it
    under its name with a suffix (``dense_decode_j_88.json``: other heads, dtype or cache lengths), or a
    plain note when there is none."""
    runs = sorted(path for path in folder.glob("dense_decode_*.json") if "_" not in path.stem[len("dense_decode_"):]) \
        if folder.is_dir() else []
    if not runs:
        return ('!!! info "No run committed yet"\n\n'
                "    `benchmarks/results/core/dense_decode_*.json` is not there: no run of `benchmarks.decode`\n"
                "    with `flashattn_dense` has been committed yet.\n")
    from benchmarks import decode as decode_mod

    return "\n".join(decode_mod.markdown(_json(run)) + f"\nFrom `benchmarks/results/core/{run.name}`.\n"
                     for run in [runs[-1], *sorted(folder.glob(f"{runs[-1].stem}_*.json"))])
