"""MkDocs hooks: everything the site computes at build time.

* serves MathJax from the installed ``django-static-mathjax`` package (math renders offline);
* draws the figures under ``figures/`` from :mod:`flashattn.schedule` and friends (see ``figures.py``);
* expands a few directives written as HTML comments in the pages:

  ``<!-- flashattn:derivation NAME -->``  the rows of ``python -m derivations --json`` for module NAME
  ``<!-- flashattn:derivations-table -->`` every row of that output
  ``<!-- flashattn:errata -->``          the entries of ``derivations/errata.py``
  ``<!-- flashattn:benchmarks -->``      results from ``benchmarks/results/`` or a placeholder

* drops the dead MathJax 2 loader that nbconvert writes into notebook pages.

A directive whose data is missing renders a visible warning box and logs a warning, which fails
``mkdocs build --strict``; so does a derivation check that fails.
"""

from __future__ import annotations

import html
import importlib
import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.hooks.flashattn")

ROOT = Path(__file__).resolve().parents[2]
HOOKS = Path(__file__).resolve().parent
# The benchmark results the Benchmarks page shows (overridable so the page can be tested).
RESULTS = Path(os.environ.get("FLASHATTN_BENCH_RESULTS", ROOT / "benchmarks" / "results"))



def _ensure_paths() -> None:
    # MkDocs restores sys.path after loading a hook file, so this runs again in on_config.
    for p in (str(HOOKS), str(ROOT)):
        if p not in sys.path:
            sys.path.insert(0, p)


_ensure_paths()

_DIRECTIVE = re.compile(r"<!--\s*flashattn:([a-z-]+)\s*([^>]*?)\s*-->")

_state: dict = {}


# --------------------------------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------------------------------
def on_config(config):
    _ensure_paths()
    # Notebook kernels are child processes: make `import flashattn` / `import derivations` work in them
    # whether or not the package is installed.
    parts = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
    # Matplotlib inside notebooks and figures: no display, deterministic SVG ids.
    os.environ.setdefault("MPLBACKEND", "Agg")
    return config


def on_pre_build(config):
    # Every build (including each rebuild of `mkdocs serve`) runs the checks afresh.
    _state.clear()


# --------------------------------------------------------------------------------------------------
# files: MathJax and figures
# --------------------------------------------------------------------------------------------------
def _mathjax_root() -> Path:
    try:
        spec = importlib.util.find_spec("mathjax")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "MathJax is missing: install the docs extra (pip install -e '.[docs]'), which brings "
            "the 'django-static-mathjax' package."
        )
    root = Path(list(spec.submodule_search_locations)[0]) / "static" / "mathjax" / "es5"
    if not (root / "tex-svg.js").is_file():
        raise SystemExit(f"MathJax package found but {root}/tex-svg.js is not there")
    return root


# The SVG build only needs its main file plus what it may load on demand: TeX extensions
# (autoload), the accessibility components and the menu.
_MATHJAX_PARTS = ("tex-svg.js", "input/tex/extensions", "a11y", "ui", "sre")


def on_files(files: Files, config):
    es5 = _mathjax_root()
    for part in _MATHJAX_PARTS:
        base = es5 / part
        paths = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file())
        for path in paths:
            uri = "assets/mathjax/" + path.relative_to(es5).as_posix()
            files.append(File.generated(config, uri, abs_src_path=str(path)))

    import figures
    import flashattn.schedule

    # `mkdocs serve` keeps this process alive between rebuilds: draw from the code as it is now.
    importlib.reload(flashattn.schedule)
    importlib.reload(figures)
    t0 = time.perf_counter()
    for name, svg in figures.render_all():
        files.append(File.generated(config, f"figures/{name}.svg", content=svg))
    log.info("figures drawn in %.1f s", time.perf_counter() - t0)

    for png in sorted(RESULTS.glob("*.png")) if RESULTS.is_dir() else []:
        files.append(File.generated(config, f"benchmarks/{png.name}", abs_src_path=str(png)))
    return files


# --------------------------------------------------------------------------------------------------
# directives
# --------------------------------------------------------------------------------------------------
def _problem(message: str) -> str:
    log.warning(message)
    return f'!!! failure "Build problem"\n\n    {message}\n'


def _run_json(args: list[str]):
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True)
    log.info("python %s: exit %d in %.1f s", " ".join(args[:3]), proc.returncode, time.perf_counter() - t0)
    try:
        data = json.loads(proc.stdout)
    except json.JSONDecodeError:
        log.warning("python %s printed no JSON:\n%s", " ".join(args), proc.stderr[-3000:])
        return None, proc.returncode
    return data, proc.returncode


def _derivation_rows() -> list[dict] | None:
    """Run ``python -m derivations --json`` once per build and return its rows (one per check)."""
    if "derivations" in _state:
        return _state["derivations"]
    rows = None
    if (ROOT / "derivations" / "__main__.py").is_file():
        data, code = _run_json(["-m", "derivations", "--json"])
        if isinstance(data, dict):
            data = data.get("checks") or data.get("rows") or data.get("results")
        if isinstance(data, list):
            rows = data
        if code != 0:
            log.warning("python -m derivations --json failed (exit %d)", code)
    _state["derivations"] = rows
    return rows


def _module_rows(name: str) -> tuple[list[dict], str]:
    """The rows of one derivation module, and the command that produced them."""
    rows = _derivation_rows()
    if rows is not None:
        mine = [r for r in rows if _row_module(r) == name]
        if mine:
            return mine, "python -m derivations --json"
    # Without the runner (or if it does not list the module), ask the module itself.
    code = (
        "import json, importlib; "
        f"r = importlib.import_module('derivations.{name}').check(); "
        "r = r if isinstance(r, list) else [r]; "
        "print(json.dumps([x.to_dict() if hasattr(x, 'to_dict') else x for x in r]))"
    )
    data, _ = _run_json(["-c", code])
    return (data if isinstance(data, list) else []), f"derivations.{name}.check()"


def _cell(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "**no**"
    if value is None:
        return ""
    if isinstance(value, (list, tuple)):
        value = ", ".join(str(v) for v in value)
    return html.escape(str(value)).replace("|", "&#124;").replace("\n", " ")


_SUMMARY_KEYS = ("identity", "method", "sizes", "passed", "negative_control", "negative_control_rejected")


def _row_module(row: dict) -> str:
    for key in ("module", "identity", "name"):
        if key in row:
            return str(row[key]).rsplit(".", 1)[-1]
    return ""


def _failed(row: dict) -> bool:
    return row.get("passed") is False or row.get("negative_control_rejected") is False


def _derivation(arg: str) -> str:
    name = arg.strip()
    if not (ROOT / "derivations" / f"{name}.py").is_file():
        return _problem(f"derivations/{name}.py does not exist")
    rows, source = _module_rows(name)
    if not rows:
        return _problem(f"no check results for derivations.{name}")
    for row in rows:
        if _failed(row):
            log.warning("derivations.%s: a check failed or a negative control was accepted", name)
    out = [f"The output of `{source}` for this module, produced while this page was built:\n"]
    for row in rows:
        keys = [k for k in _SUMMARY_KEYS if k in row] + [k for k in row if k not in _SUMMARY_KEYS
                                                          and k not in ("module", "details")]
        out.append("| check | " + _cell(row.get("module", name)) + " |\n|---|---|")
        out.extend(f"| {k.replace('_', ' ')} | {_cell(row[k])} |" for k in keys)
        out.append("")
    details = [line for row in rows for line in row.get("details", [])]
    if details:
        out.append("```text")
        out.extend(details)
        out.append("```\n")
    return "\n".join(out)


def _derivations_table(_arg: str) -> str:
    rows = _derivation_rows()
    if rows is None:
        return _problem("`python -m derivations --json` gave no rows")
    out = ["| identity | method | sizes | result | negative control rejected |", "|---|---|---|---|---|"]
    for row in rows:
        module = _row_module(row)
        identity = _cell(row.get("identity", module))
        if module in MATH_PAGES:
            identity = f"[{identity}]({MATH_PAGES[module].removeprefix('math/')})"
        out.append(f"| {identity} | {_cell(row.get('method'))} | {_cell(row.get('sizes'))} | "
                   f"{_cell(row.get('result', row.get('passed')))} | {_cell(row.get('negative_control_rejected'))} |")
    out.append("")
    if any(_failed(r) for r in rows):
        log.warning("python -m derivations reports a failed check")
    return "\n".join(out)


MATH_PAGES = {
    "matmul_backward": "math/matmul-backward.md",
    "softmax_backward": "math/softmax-backward.md",
    "d_identity": "math/d-identity.md",
    "online_softmax": "math/online-softmax.md",
    "base2_lse": "math/base2-lse.md",
    "softmax_scale": "math/softmax-scale.md",
    "masking_hazards": "math/masking.md",
    "causal_masking": "math/causal.md",
    "cost_model": "math/cost-model.md",
    "dropout": "math/dropout.md",
}


def _errata(_arg: str) -> str:
    """Render derivations/errata.py and confirm each entry against this build's check output."""
    if not (ROOT / "derivations" / "errata.py").is_file():
        return _problem("derivations/errata.py does not exist")
    try:
        errata = importlib.import_module("derivations.errata")
        entries = [e.to_dict() if hasattr(e, "to_dict") else dict(e) for e in errata.ERRATA]
    except Exception as exc:  # noqa: BLE001 - any failure to read the data is a build problem
        return _problem(f"cannot read derivations.errata.ERRATA: {exc!r}")
    if not entries:
        return _problem("derivations.errata.ERRATA is empty")
    out = []
    for number, e in enumerate(entries, 1):
        module = e["check"].split(":")[0].rsplit(".", 1)[-1]
        rows, source = _module_rows(module)
        details = [line for row in rows for line in row.get("details", [])]
        if e["verdict"] == "rejected":
            wanted, meaning = "rejected  control: " + e["evidence"], "rejects this claim"
        else:
            wanted, meaning = "ok        " + e["evidence"], "confirms the correction"
        if wanted not in details:
            log.warning("erratum %d: %r is not in the output of %s", number, wanted, e["check"])
            status = f"**not confirmed**: the line below is missing from the output of `{source}`"
        else:
            status = f"confirmed in this build: `{source}` {meaning}"
        page = MATH_PAGES.get(module)
        where = f" (see [{module.replace('_', ' ')}]({page}))" if page else ""
        out.append(f"## {number}. {_md_inline(e['claim']).rstrip('.')}\n")
        out.append('!!! success "What holds"\n')
        out.append(f"    {_md_inline(e['correction'])}\n")
        out.append(f"**Checked by** `{e['check']}`{where}, {status}:\n")
        out.append(f"```text\n{wanted}\n```\n")
    return "\n".join(out)


def _md_inline(text) -> str:
    return str(text).replace("\n", " ")


def _benchmarks(_arg: str) -> str:
    summary = RESULTS / "summary.md"
    pngs = sorted(RESULTS.glob("*.png")) if RESULTS.is_dir() else []
    jsons = sorted(RESULTS.glob("*.json")) if RESULTS.is_dir() else []
    if not (summary.is_file() or pngs or jsons):
        return (
            '!!! info "No results yet"\n\n'
            "    `benchmarks/results/` holds no measurements yet, so there is nothing to plot. The\n"
            "    harness needs a CUDA GPU (H100 or H200). Once its JSON, plots and `summary.md` are\n"
            "    committed under `benchmarks/results/`, this page shows them without any edit: the\n"
            "    build reads that folder every time.\n"
        )
    out = []
    if summary.is_file():
        text = summary.read_text(encoding="utf-8")
        # Shift the summary's headings below this page's title.
        text = re.sub(r"^(#{1,5}) ", lambda m: "#" + m.group(1) + " ", text, flags=re.M)
        out.append(text.strip() + "\n")
    if pngs:
        out.append("## Plots\n")
        for png in pngs:
            label = png.stem.replace("_", " ").replace("-", " ")
            out.append(f"![{label}](benchmarks/{png.name})\n")
    if jsons:
        out.append("## Raw results\n")
        out.append("The JSON files the plots and tables come from, in `benchmarks/results/`:\n")
        for js in jsons:
            out.append(f"- `{js.name}`")
        out.append("")
    return "\n".join(out)


_HANDLERS = {
    "derivation": _derivation,
    "derivations-table": _derivations_table,
    "errata": _errata,
    "benchmarks": _benchmarks,
}


def on_page_markdown(markdown: str, page, config, files):
    def expand(m: re.Match) -> str:
        name, arg = m.group(1), m.group(2)
        if name not in _HANDLERS:
            return _problem(f"unknown directive flashattn:{name} on {page.file.src_uri}")
        return _HANDLERS[name](arg)

    return _DIRECTIVE.sub(expand, markdown)


# --------------------------------------------------------------------------------------------------
# notebooks
# --------------------------------------------------------------------------------------------------
# nbconvert writes a MathJax 2 loader (empty src, since the site brings its own MathJax 3) and a
# MathJax 2 configuration script; both are dead weight and the empty src is a request for nothing.
_NB_MATHJAX2 = re.compile(
    r'<!-- Load mathjax -->\s*<script src="">\s*</script>.*?<!-- End of mathjax configuration -->',
    re.S,
)


def on_post_page(output: str, page, config):
    if page.file.src_uri.endswith(".ipynb"):
        output = _NB_MATHJAX2.sub("", output)
    return output
