"""MkDocs hooks: everything the site computes at build time.

* serves MathJax from the installed ``django-static-mathjax`` package (math renders offline);
* draws the figures under ``figures/`` from :mod:`flashattn.schedule` and friends (see ``figures.py``);
* expands a few directives written as HTML comments in the pages:

  ``<!-- flashattn:derivation NAME -->``  the result of ``derivations.NAME.check()``; the page holding
                                         this directive *is* module NAME's page (links elsewhere
                                         are derived from it, so no list of Math pages is kept here)
  ``<!-- flashattn:derivations-table -->`` every check, in the order of ``derivations.MODULES``
  ``<!-- flashattn:errata -->``          the entries of ``derivations/errata.py``
  ``<!-- flashattn:benchmarks [part] -->`` results from ``benchmarks/results/`` or a placeholder
  ``<!-- flashattn:ring -->``            the two-GPU ring run in ``benchmarks/results/ring_2gpu.json``

* drops the dead MathJax 2 loader that nbconvert writes into notebook pages.

The checks run in this process, once per build, through ``derivations.run_module``; the notebooks run
here too, each in a fresh kernel on a thread of its own while the rest of the site builds, and
mkdocs-jupyter renders the executed copies (its own ``execute`` is off). A check's result, the figures
and an executed notebook are reused from ``.cache/site/`` while every file they were made from is
unchanged (``site_cache.py`` says how that is known). An unknown
directive, a derivation module no page shows or two pages show, and a directive naming a module
that ``derivations.MODULES`` does not list stop the build with an error. A failing check or an
unconfirmed erratum logs a warning, which fails ``mkdocs build --strict``.
"""

from __future__ import annotations

import html
import importlib
import logging
import os
import re
import sys
import time
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.plugins import event_priority
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

import site_cache  # noqa: E402 - needs the path above

# Its one computed import is run_module's import of the module it is asked to run, which only this
# hook calls (with that module as the unit's start): not an import of every derivation.
_DERIVATIONS_RUNNER = ROOT / "derivations" / "__init__.py"

_DIRECTIVE = re.compile(r"<!--\s*flashattn:([a-z_-]+)\s*([^>]*?)\s*-->")

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
    # Every build (including each rebuild of `mkdocs serve`) runs the checks whose inputs changed on
    # the code as it is now: drop the imported derivation modules so they are read again.
    _state.clear()
    for name in [n for n in sys.modules if n == "derivations" or n.startswith("derivations.")]:
        del sys.modules[name]


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


@event_priority(-100)  # after mkdocs-jupyter has wrapped the notebooks
def on_files(files: Files, config):
    _start_notebooks(files, config)
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
    cached = True
    for name, draw in figures.FIGURES.items():
        # one entry per figure: each depends only on what drawing it ran and read (one figure counts
        # the kernels' products from their sources; the others never read a kernel)
        svg, hit = site_cache.cached_call(f"figure-{name}", draw, [HOOKS / "figures.py"], roots=(HOOKS, ROOT),
                                          runner=_DERIVATIONS_RUNNER)
        cached &= hit
        files.append(File.generated(config, f"figures/{name}.svg", content=svg))
    log.info("figures %s in %.1f s", "from the cache" if cached else "drawn", time.perf_counter() - t0)

    for png in sorted(RESULTS.glob("*.png")) if RESULTS.is_dir() else []:
        files.append(File.generated(config, f"benchmarks/{png.name}", abs_src_path=str(png)))
    _state["pages"] = module_pages(files.documentation_pages())
    return files


def module_pages(pages) -> dict[str, str]:
    """{derivation module: the page (src_uri) whose ``flashattn:derivation`` directive shows it}.

    The directives are the one place that says which page explains which check; every module of
    ``derivations.MODULES`` must be shown by exactly one page, and no page may name another module.
    """
    import derivations

    found: dict[str, list[str]] = {}
    for page in pages:
        if not page.src_uri.endswith(".md"):
            continue
        text = Path(page.abs_src_path).read_text(encoding="utf-8")
        for m in _DIRECTIVE.finditer(text):
            if m.group(1) == "derivation":
                found.setdefault(m.group(2).strip(), []).append(page.src_uri)
    unknown = sorted(set(found) - set(derivations.MODULES))
    missing = [name for name in derivations.MODULES if name not in found]
    twice = {name: where for name, where in found.items() if len(where) > 1}
    if unknown or missing or twice:
        raise PluginError(f"derivation pages: modules not in derivations.MODULES {unknown}, "
                          f"modules no page shows {missing}, modules shown twice {twice}")
    return {name: where[0] for name, where in found.items()}


# --------------------------------------------------------------------------------------------------
# directives
# --------------------------------------------------------------------------------------------------
def _results() -> dict:
    """{module name: its row (``derivations.as_rows``)}, every check run once per build, in this process."""
    if "results" not in _state:
        import derivations

        from derivations import CheckResult

        def run(name):
            result, _seconds = derivations.run_module(name)
            return result.to_dict()

        t0 = time.perf_counter()
        results, from_cache = [], 0
        for name in derivations.MODULES:
            row, cached = site_cache.cached_call(
                f"derivation-{name}", lambda: run(name), [ROOT / "derivations" / f"{name}.py"],
                keep=lambda row: row["passed"] and row["negative_control_rejected"],  # failures run again
                runner=_DERIVATIONS_RUNNER)
            results.append((CheckResult(**row), 0.0))
            from_cache += cached
        log.info("derivations: %d checks in %.1f s (%d from the cache)", len(results),
                 time.perf_counter() - t0, from_cache)
        if not derivations.all_good(results):
            log.warning("derivations: a check failed or a negative control was accepted")
        _state["rows"] = derivations.as_rows(results)
        _state["results"] = {row["module"].rsplit(".", 1)[-1]: row for row in _state["rows"]}
    return _state["results"]


def _page_link(module: str, from_page: str) -> str:
    """Relative link from `from_page` to the page that shows `module`."""
    target = _state["pages"][module]
    return os.path.relpath(target, os.path.dirname(from_page) or ".").replace(os.sep, "/")


def _cell(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "**no**"
    if value is None:
        return ""
    if isinstance(value, (list, tuple)):
        value = ", ".join(str(v) for v in value)
    return html.escape(str(value)).replace("|", "&#124;").replace("\n", " ")


_SUMMARY_KEYS = ("identity", "method", "sizes", "passed", "negative_control", "negative_control_rejected")


def _failed(row: dict) -> bool:
    return not (row["passed"] and row["negative_control_rejected"])


def _derivation(arg: str, page) -> str:
    name = arg.strip()
    row = _results()[name]  # module_pages() has already stopped the build for an unknown name
    if _failed(row):
        log.warning("derivations.%s: a check failed or a negative control was accepted", name)
    out = [f"The output of `derivations.{name}.check()`, produced while this page was built:\n",
           f"| check | {_cell(row['module'])} |", "|---|---|"]
    out.extend(f"| {k.replace('_', ' ')} | {_cell(row[k])} |" for k in _SUMMARY_KEYS)
    out += ["", "```text", *row["details"], "```\n"]
    return "\n".join(out)


def _derivations_table(_arg: str, page) -> str:
    out = ["| identity | method | sizes | result | negative control rejected |", "|---|---|---|---|---|"]
    for name, row in _results().items():
        identity = f"[{_cell(row['identity'])}]({_page_link(name, page.file.src_uri)})"
        out.append(f"| {identity} | {_cell(row['method'])} | {_cell(row['sizes'])} | "
                   f"{_cell(row['result'])} | {_cell(row['negative_control_rejected'])} |")
    out.append("")
    return "\n".join(out)


def _errata(_arg: str, page) -> str:
    """Render derivations/errata.py and confirm each entry against this build's check output."""
    from derivations.errata import ERRATA

    if not ERRATA:
        raise PluginError("derivations.errata.ERRATA is empty")
    out = []
    for number, e in enumerate(ERRATA, 1):
        module = e.check.split(":")[0].rsplit(".", 1)[-1]
        details = _results()[module]["details"]
        if e.verdict == "rejected":
            wanted, meaning = "rejected  control: " + e.evidence, "rejects this claim"
        else:
            wanted, meaning = "ok        " + e.evidence, "confirms the correction"
        if wanted not in details:
            log.warning("erratum %d: %r is not in the output of %s", number, wanted, e.check)
            status = "**not confirmed**: the line below is missing from the check's output"
        else:
            status = f"confirmed in this build: the check {meaning}"
        out.append(f"## {number}. {e.title}\n")
        out.append(f"*Source:* {_md_inline(e.source)}.\n")
        out.append('!!! failure "The claim"\n')
        out.append(f"    {_md_inline(e.claim)}\n")
        out.append('!!! success "What holds"\n')
        out.append(f"    {_md_inline(e.correction)}\n")
        out.append(f"**Checked by** `{e.check}` (see [{module.replace('_', ' ')}]"
                   f"({_page_link(module, page.file.src_uri)})), {status}:\n")
        out.append(f"```text\n{wanted}\n```\n")
    return "\n".join(out)


def _md_inline(text) -> str:
    return str(text).replace("\n", " ")


def _benchmarks(arg: str, page=None) -> str:
    """Plots and the summary table first, the rest of ``summary.md`` collapsed; with an argument (``short``,
    ``first-call``) that part of the page instead (``benchmarks_page.py``)."""
    import benchmarks_page

    return importlib.reload(benchmarks_page).render(RESULTS, arg)  # `mkdocs serve` keeps the process


def _ring(arg: str, page=None) -> str:
    """A committed run of ``benchmarks.ring`` as a table (:func:`benchmarks.ring.markdown`): the file the
    directive names in ``benchmarks/results/``, the two-GPU ring run by default."""
    import json

    from benchmarks import ring

    name = arg.strip() or "ring_2gpu.json"
    path = RESULTS / name
    if not path.is_file():
        return ('!!! info "No results yet"\n\n'
                f"    `benchmarks/results/{name}` is not there: no multi-GPU run has been committed.\n")
    return ring.markdown(json.loads(path.read_text(encoding="utf-8")))


def _layers(_arg: str, page=None) -> str:
    """The package's layers (:data:`flashattn.layers.LAYERS`, the table the import contract checks),
    top to bottom, each importing only its own layer and those below it."""
    from flashattn import layers

    rows = ["| | layer | modules (`flashattn/`) | what it holds |", "|---|---|---|---|"]
    for index, (name, what, members) in enumerate(layers.LAYERS):
        modules = ", ".join(f"`{m}`" for m in members)
        rows.append(f"| {'↓' if index else ''} | **{name}** | {modules} | {what} |")
    beside = ", ".join(f"`{m}`" for m in layers.BESIDE)
    rows += ["", f"Beside the layers: {beside} (they import only the description and schedule; the entry "
             "points and autograd may import them, no layer below may)."]
    return "\n".join(rows) + "\n"


_HANDLERS = {
    "layers": _layers,
    "ring": _ring,
    "derivation": _derivation,
    "derivations-table": _derivations_table,
    "errata": _errata,
    "benchmarks": _benchmarks,
}


def on_page_markdown(markdown: str, page, config, files):
    def expand(m: re.Match) -> str:
        name, arg = m.group(1), m.group(2)
        if name not in _HANDLERS:
            raise PluginError(f"unknown directive flashattn:{name} on {page.file.src_uri} "
                              f"(known: {', '.join(sorted(_HANDLERS))})")
        return _HANDLERS[name](arg, page)

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


def _start_notebooks(files: Files, config) -> None:
    """Start executing every notebook whose cached copy is out of date (each on a thread of its own)."""
    plugin = config["plugins"].get("mkdocs-jupyter")
    kernel = (plugin.config["kernel_name"] if plugin else "") or "python3"
    _state["notebooks"] = {f.src_uri: site_cache.Notebook(Path(f.abs_src_path), kernel)
                           for f in files.documentation_pages() if f.src_uri.endswith(".ipynb")}


def on_pre_page(page, config, files):
    notebook = _state.get("notebooks", {}).get(page.file.src_uri)
    if notebook is not None:
        try:
            executed = notebook.result()
        except Exception as exc:  # a failing cell fails the build
            raise PluginError(f"notebook {page.file.src_uri} failed:\n{exc}") from exc
        log.info("notebook %s %s", page.file.src_uri,
                 "from the cache" if notebook.cached else f"executed in {notebook.seconds:.1f} s")
        # mkdocs-jupyter renders (without executing) the file this names.
        page.file.abs_src_path = str(executed)
    return page


def on_post_page(output: str, page, config):
    if page.file.src_uri.endswith(".ipynb"):
        output = _NB_MATHJAX2.sub("", output)
    return output
