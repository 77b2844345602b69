"""The documentation site: strict build, snippet sections, links and anchors, and a real browser.

The site is built once per session (``mkdocs build --strict`` into a temporary folder, notebooks
executed); every test below reads that build. The browser test drives the system Chromium through
its chromedriver (Debian packages ``chromium`` and ``chromium-driver``). Without them it is skipped,
unless ``FLASHATTN_REQUIRE_BROWSER=1`` (set by CI), where a missing browser is a failure.
"""

from __future__ import annotations

import functools
import http.server
import importlib.util
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import site_checks  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

# Tests that read the built site share one build (about a minute on 2 cores): they are "slow".
slow = pytest.mark.slow

# Pages that must show display math: if arithmatex or the notebook text stopped producing it, the
# count taken from the HTML would silently drop to zero, so these are named explicitly.
PAGES_WITH_DISPLAY_MATH = [
    "index.html",
    "math/index.html",
    *[f"math/{p.stem}/index.html" for p in sorted((DOCS / "math").glob("*.md")) if p.stem != "index"],
    "kernels/forward/index.html",
    "kernels/backward/index.html",
    "notebooks/online-attention/index.html",
]


# ------------------------------------------------------------------------------------------------
# the build
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def built_site(tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    env.pop("TRITON_INTERPRET", None)  # the notebooks decide for themselves
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    seconds = time.perf_counter() - start
    print(f"\nmkdocs build --strict took {seconds:.1f} s")
    return SimpleNamespace(dir=site, proc=proc, seconds=seconds)


@pytest.fixture(scope="session")
def site(built_site):
    if built_site.proc.returncode != 0:
        pytest.fail("the site did not build; see test_strict_build", pytrace=False)
    return built_site.dir


@slow
def test_strict_build(built_site):
    log = built_site.proc.stdout + built_site.proc.stderr
    assert built_site.proc.returncode == 0, f"mkdocs build --strict failed:\n{log[-6000:]}"
    warnings = [line for line in log.splitlines() if line.startswith("WARNING")]
    assert not warnings, "\n".join(warnings)


@slow
def test_every_nav_page_is_built(site):
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    config = yaml.load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=Loader)

    def walk(entries):
        for entry in entries:
            value = entry if isinstance(entry, str) else next(iter(entry.values()))
            if isinstance(value, list):
                yield from walk(value)
            else:
                yield value

    missing = []
    for src in walk(config["nav"]):
        stem = Path(src).with_suffix("")
        out = site / ("index.html" if src == "index.md" else stem.parent / "index.html" if stem.name == "index" else stem / "index.html")
        if not out.is_file():
            missing.append(f"{src} -> {out.relative_to(site)}")
    assert not missing, missing


# ------------------------------------------------------------------------------------------------
# snippets
# ------------------------------------------------------------------------------------------------
def _source_files():
    skip = {".venv", ".git", "site", "build", "dist", ".cache", "node_modules", "__pycache__"}
    for path in ROOT.rglob("*"):
        if path.is_file() and path.suffix in (".py", ".md", ".yml", ".yaml", ".toml", ".txt") \
                and not skip.intersection(path.relative_to(ROOT).parts):
            yield path


def test_every_start_marker_has_its_end():
    problems = []
    for path in _source_files():
        if path.resolve() in (Path(__file__).resolve(), Path(site_checks.__file__).resolve()):
            continue  # these two mention markers in their checks
        problems += site_checks.marker_problems(path.read_text(encoding="utf-8", errors="replace"),
                                                str(path.relative_to(ROOT)))
    assert not problems, "\n".join(problems)


def test_every_snippet_section_referenced_exists():
    problems, count = [], 0
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text(encoding="utf-8")
        count += len(site_checks.snippet_refs(text))
        problems += site_checks.reference_problems(text, ROOT, str(page.relative_to(ROOT)))
    assert not problems, "\n".join(problems)
    assert count > 0, "no page embeds code: the snippet check would prove nothing"


def equation_table_problems(table_md: str) -> list[str]:
    """Each row of the equation <-> code table names a kernel section and quotes a key line of it
    (``...`` standing for an elided part); the quote must still be in that section."""
    import re

    texts = {name: (ROOT / "flashattn" / name).read_text(encoding="utf-8")
             for name in ("forward.py", "backward.py", "schedule.py")}
    problems, rows = [], 0
    for line in table_md.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[2].startswith("`"):
            continue
        rows += 1
        section = cells[2].strip("`").split(":")[-1].split("`")[0].strip()
        quote = cells[3].strip("`")
        pattern = ".*?".join(re.escape(part) for part in quote.split("..."))
        bodies = []
        for text in texts.values():
            m = re.search(rf"--8<-- \[start:{re.escape(section)}\](.*?)--8<-- \[end:{re.escape(section)}\]", text, re.S)
            if m:
                bodies.append(m.group(1))
        if not bodies:
            problems.append(f"section {section!r} not found")
        elif not any(re.search(pattern, body) for body in bodies):
            problems.append(f"{quote!r} is not in section {section!r}")
    if rows == 0:
        problems.append("no table rows found")
    return problems


def test_equation_code_table_matches_the_kernels():
    problems = equation_table_problems((DOCS / "kernels" / "equation-code.md").read_text(encoding="utf-8"))
    assert not problems, "\n".join(problems)
    # negative control: a quote that is not in its section
    bad = "| x | y | `bwd-ds` | `ds_t = p_t * dp_t` |\n"
    assert equation_table_problems(bad) == ["'ds_t = p_t * dp_t' is not in section 'bwd-ds'"]


def test_marker_checks_reject_bad_input():
    """Negative controls: the checks above must be able to fail."""
    assert site_checks.marker_problems("# --8<-- [start:a]\nx = 1\n")  # no end: snippets would run on
    assert site_checks.marker_problems("x = 1\n# --8<-- [end:a]\n")  # end without start
    assert site_checks.marker_problems("# --8<-- [start:a]\n# --8<-- [end:a]\n# --8<-- [start:a]\n# --8<-- [end:a]\n")
    assert not site_checks.marker_problems("# --8<-- [start:a]\n# --8<-- [start:b]\n# --8<-- [end:b]\n# --8<-- [end:a]\n")
    page = '```python\n--8<-- "flashattn/schedule.py:no-such-section"\n```\n'
    assert site_checks.reference_problems(page, ROOT, "page")
    page = '    --8<-- "flashattn/schedule.py:forward-range"\n'
    assert not site_checks.reference_problems(page, ROOT, "page")
    assert site_checks.reference_problems('--8<-- "no/such/file.py"\n', ROOT, "page")


# ------------------------------------------------------------------------------------------------
# links
# ------------------------------------------------------------------------------------------------
@slow
def test_links_and_anchors(site):
    problems = site_checks.link_problems(site)
    assert not problems, "\n".join(problems)


def test_link_check_rejects_bad_links(tmp_path):
    """Negative control on a tiny site: a missing page, a missing anchor in a notebook-like page,
    and a script from the network are all reported; the good links are not."""
    (tmp_path / "nb").mkdir()
    (tmp_path / "nb" / "index.html").write_text('<h2 id="real-heading">x</h2>')
    (tmp_path / "index.html").write_text(
        '<a href="nb/#real-heading">ok</a> <a href="nb/#gone">bad anchor</a> <a href="missing/">bad page</a>'
        '<a href="https://example.org/">fine: a link out</a>'
        '<script src="https://cdn.example.org/mathjax.js"></script>'
    )
    problems = site_checks.link_problems(tmp_path)
    assert len(problems) == 3, problems
    assert any("#gone" in p for p in problems)
    assert any("missing/" in p for p in problems)
    assert any("network" in p for p in problems)


# ------------------------------------------------------------------------------------------------
# content generated at build time
# ------------------------------------------------------------------------------------------------
@slow
def test_notebooks_were_executed(site):
    online = (site / "notebooks/online-attention/index.html").read_text(encoding="utf-8")
    interp = (site / "notebooks/triton-interpreter/index.html").read_text(encoding="utf-8")
    # Text that only the executed cells print.
    assert "max error dQ" in online and "any NaN in the gradients: False" in online
    assert "kernel error" in interp and "dQ: kernel error" in interp and "PyTorch fp16 error" in interp


@slow
def test_figures_are_built(site):
    for name in ("causal-schedule", "window-schedule", "tiling", "pointer-offsets", "masking", "warpgroup-timeline",
                 "persistent-walk"):
        svg = site / "figures" / f"{name}.svg"
        assert svg.is_file() and svg.stat().st_size > 10_000, name


def test_causal_figure_follows_the_schedule(monkeypatch):
    """The schedule figure is drawn from flashattn.schedule: changing the schedule changes it."""
    sys.path.insert(0, str(DOCS / "hooks"))
    import figures
    from flashattn import schedule

    before = figures.causal_schedule()
    monkeypatch.setattr(schedule, "block_grid",
                        lambda n, m, bm, bn, causal: [[schedule.FULL] * -(-m // bn)] * -(-n // bm))
    assert figures.causal_schedule() != before


def test_window_figure_follows_the_schedule(monkeypatch):
    """The window figure is drawn from flashattn.schedule.block_grid(..., window=...): changing it changes the figure."""
    sys.path.insert(0, str(DOCS / "hooks"))
    import figures
    from flashattn import schedule

    before = figures.window_schedule()
    monkeypatch.setattr(schedule, "block_grid",
                        lambda n, m, bm, bn, causal, window=None: [[schedule.FULL] * -(-m // bn)] * -(-n // bm))
    assert figures.window_schedule() != before


def test_timeline_figure_follows_the_dkdv_kernel_switches(monkeypatch):
    """The warpgroup timeline schedules flashattn.hopper.bwd's step with its STAGES and OVERLAP: without the
    overlap every dV product is issued after its dS^T is done, with it before; with one ring slot the
    second tile is loaded only after both consumers finished the first step."""
    sys.path.insert(0, str(DOCS / "hooks"))
    import figures
    from flashattn import hopper

    def ops(name):
        return {(o, s): (ready, t0, t1) for n, u, o, s, ready, t0, t1 in figures.dkdv_schedule() if n.startswith(name)}

    monkeypatch.setattr(hopper.bwd, "OVERLAP", False)
    dv, ds = ops("dV"), ops("dS")
    assert len(dv) >= 4 and dv.keys() == ds.keys()  # both consumers, several steps, one dS^T per dV
    assert all(dv[key][0] >= ds[key][2] for key in dv)  # dV issued once dS^T is done
    monkeypatch.setattr(hopper.bwd, "OVERLAP", True)
    dv, ds = ops("dV"), ops("dS")
    assert len(dv) >= 4 and dv.keys() == ds.keys()
    assert all(dv[key][0] < ds[key][2] for key in dv)  # dV issued before dS^T is done
    for stages in (1, 2):
        monkeypatch.setattr(hopper.bwd, "STAGES", stages)
        loads, dk = ops("Q, dO"), ops("dK")
        first_step_done = max(dk[(0, 0)][2], dk[(1, 0)][2])
        assert (loads[("producer", 1)][1] >= first_step_done) == (stages == 1)
    assert "<svg" in figures.warpgroup_timeline()


@slow
def test_benchmarks_page_matches_results(site):
    page = (site / "benchmarks/index.html").read_text(encoding="utf-8")
    results = ROOT / "benchmarks" / "results"
    has_results = results.is_dir() and any(results.glob("*.png")) or (results / "summary.md").is_file()
    if has_results:
        assert "No results yet" not in page
        for png in results.glob("*.png"):
            assert (site / "benchmarks" / "benchmarks" / png.name).is_file() or png.name in page
    else:
        assert "No results yet" in page


def _site_hooks():
    spec = importlib.util.spec_from_file_location("flashattn_site_hooks", DOCS / "hooks" / "site_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmarks_page_switches_when_results_appear(tmp_path, monkeypatch):
    """The Benchmarks page is a placeholder without results; once they exist it opens with the plots
    and the first table of the summary, and the rest of the summary follows in collapsed blocks."""
    hooks = _site_hooks()
    results = tmp_path / "results"
    monkeypatch.setattr(hooks, "RESULTS", results)
    assert "No results yet" in hooks._benchmarks("")
    results.mkdir()
    (results / "summary.md").write_text(
        "## Benchmark results\n\nMeasured on **a GPU**.\n\nGrid: N in [4096].\n\n"
        "### Ratios\n\n| N | ratio |\n|---|---|\n| 4096 | 1.25× |\n\n"
        "### TFLOP/s\n\n#### float16\n\n| N | TFLOP/s |\n|---|---|\n| 4096 | 512 |\n")
    (results / "tflops_fwd_float16.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    page = hooks._benchmarks("")
    assert "No results yet" not in page and "## Benchmark results" not in page  # the page has its own heading
    plot, table = page.index("](benchmarks/tflops_fwd_float16.png)"), page.index("| 4096 | 1.25× |")
    assert page.index("Measured on **a GPU**.") < plot < page.index("### Ratios") < table
    assert table < page.index('??? note "How this run was set up"') < page.index("    Grid: N in [4096].")
    assert page.index('??? note "TFLOP/s"') < page.index("    **float16**") < page.index("    | 4096 | 512 |")


def test_benchmarks_page_keeps_every_number_and_opens_one_table():
    """The committed summary on the page: every number of summary.md is there, and one table is open
    (every other line of a table sits in a collapsed block, indented)."""
    import re
    from collections import Counter

    summary = ROOT / "benchmarks" / "results" / "summary.md"
    if not summary.is_file():
        pytest.skip("no committed benchmark summary")
    page = _site_hooks()._benchmarks("")
    numbers = lambda text: Counter(re.findall(r"\d+(?:\.\d+)?", text))  # noqa: E731
    assert not numbers(summary.read_text(encoding="utf-8")) - numbers(page)
    open_tables = [line for line in page.splitlines() if line.startswith("|---")]
    assert len(open_tables) == 1, open_tables
    assert page.count("??? note") >= 2


def test_ring_page_shows_the_two_gpu_run_when_there_is_one(tmp_path, monkeypatch):
    """The ring page's scaling table comes from benchmarks/results/ring_2gpu.json (a placeholder
    without it), a row per length and mask, with the failures of a provider that did not run."""
    import json

    hooks = _site_hooks()
    monkeypatch.setattr(hooks, "RESULTS", tmp_path)
    assert "No results yet" in hooks._ring("")
    ok = {"fwd_ms": 1.8, "fwd_bwd_ms": 5.5, "fwd_tflops_per_gpu": 310.2, "fwd_bwd_tflops_per_gpu": 351.0,
          "balance": 0.079, "peak_gib_per_rank": [0.19, 0.18]}
    payload = {"environment": {"world_size": 2, "gpu": "NVIDIA H200", "torch": "2.11", "nccl": "2.28.9"},
               "config": {"batch": 1, "heads": 1, "kv_heads": 1, "head_dim": 128, "dtype": "bfloat16",
                          "warmup": 2, "reps": 5},
               "rows": [{"n": 65536, "n_per_gpu": 32768, "causal": True, "ring": ok,
                         "torch_cp": {"fwd_ms": 1.8, "fwd_bwd_ms": 5.1, "peak_gib_per_rank": [0.38, 0.38]},
                         "fraction_of_single_gpu": {"fwd": 0.53, "fwd_bwd": 0.70},
                         "speedup_vs_torch_cp": {"fwd": 1.04, "fwd_bwd": 0.92}},
                        {"n": 2**21, "n_per_gpu": 2**20, "causal": False, "ring": {"error": "OutOfMemoryError: x"},
                         "torch_cp": {"error": "RuntimeError: y"}}]}
    (tmp_path / "ring_2gpu.json").write_text(json.dumps(payload))
    page = hooks._ring("")
    assert "No results yet" not in page and "2 × NVIDIA H200" in page
    assert ("| 65,536 | 32,768 | causal | 1.8 / 5.5 | 310 / 351 | 0.53 / 0.70 | 7.9% | 0.19 | 1.8 / 5.1 "
            "| 1.04× / 0.92× | 0.38 |") in page
    assert "| 2,097,152 | 1,048,576 | none | failed: OutOfMemoryError: x |" in page and "failed: RuntimeError: y" in page


@slow
def test_ring_page_has_a_row_for_every_committed_measurement(site):
    import json

    path = ROOT / "benchmarks" / "results" / "ring_2gpu.json"
    page = (site / "kernels/ring/index.html").read_text(encoding="utf-8")
    if not path.is_file():
        assert "No results yet" in page
        return
    for row in json.loads(path.read_text(encoding="utf-8"))["rows"]:
        assert f"<td>{row['n']:,}</td>" in page


@slow
def test_errata_page_lists_every_entry_confirmed(site):
    from derivations.errata import ERRATA

    page = (site / "errata/index.html").read_text(encoding="utf-8")
    assert page.count("confirmed in this build") == len(ERRATA) > 0
    assert "not confirmed" not in page


@slow
def test_math_pages_show_their_checks(site):
    """Each Math page that embeds a derivation module also shows that module's output, all passing."""
    for md in sorted((DOCS / "math").glob("*.md")):
        text = md.read_text(encoding="utf-8")
        if "flashattn:derivation " not in text:
            continue
        html = (site / "math" / md.stem / "index.html").read_text(encoding="utf-8")
        assert "produced while this page was built" in html, md.name
        assert "FAILED" not in html and "ACCEPTED" not in html, md.name


# ------------------------------------------------------------------------------------------------
# the browser
# ------------------------------------------------------------------------------------------------
CHROMIUM = os.environ.get("FLASHATTN_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("FLASHATTN_CHROMEDRIVER", shutil.which("chromedriver") or "/usr/bin/chromedriver")

_WAIT_FOR_MATHJAX = """
const done = arguments[arguments.length - 1];
const started = Date.now();
(function wait() {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
    MathJax.startup.promise.then(() => done("ok")).catch((e) => done("error: " + e));
  } else if (Date.now() - started > 20000) {
    done("MathJax never started");
  } else {
    setTimeout(wait, 50);
  }
})();
"""

_INSPECT = r"""
const out = {};
out.version = window.MathJax && MathJax.version;
out.typeset = document.documentElement.dataset.mathjax === "typeset";
out.errors = [...document.querySelectorAll("mjx-merror, [data-mjx-error]")]
  .map((e) => e.getAttribute("data-mjx-error") || e.textContent).slice(0, 5);
out.unrendered = [...document.querySelectorAll(".arithmatex")]
  .filter((e) => !e.querySelector("mjx-container")).map((e) => e.textContent.slice(0, 80)).slice(0, 5);
out.display = document.querySelectorAll('mjx-container[display="true"]').length;
out.leftover = [...document.querySelectorAll(".jp-RenderedMarkdown")].map((e) => {
  const c = e.cloneNode(true);
  c.querySelectorAll("pre, code, mjx-container").forEach((x) => x.remove());
  return c.textContent;
}).filter((t) => /\$\$|\\\[|\\\(|\$[^$\s][^$]*\$/.test(t)).map((t) => t.slice(0, 80));
const body = document.body.cloneNode(true);
body.querySelectorAll("pre, code, script, style, textarea, mjx-container, .jp-OutputArea").forEach((x) => x.remove());
out.rawTex = (body.textContent.match(/.{0,30}(\\\(|\\\[|\$\$).{0,30}/g) || []).slice(0, 5);
return out;
"""


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def browser():
    required = os.environ.get("FLASHATTN_REQUIRE_BROWSER") == "1"
    reason = None
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        reason = "selenium is not installed (pip install -e '.[docs]')"
    if reason is None and not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        reason = f"no browser: need {CHROMIUM} and {CHROMEDRIVER} (Debian: apt-get install chromium chromium-driver)"
    if reason:
        if required:
            pytest.fail(f"FLASHATTN_REQUIRE_BROWSER=1 but {reason}", pytrace=False)
        pytest.skip(reason)

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run", "--disable-dev-shm-usage",
                 "--window-size=1280,1000",
                 # Nothing but this machine: any asset fetched from the network fails to load, and
                 # shows up as a console error below.
                 "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_script_timeout(30)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def _serve(directory: Path):
    handler = functools.partial(_QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server


def check_page(driver, url: str, expected_display: int) -> tuple[list[str], dict]:
    """Open one page, wait for MathJax, and list everything wrong with it."""
    driver.get_log("browser")  # drop what earlier pages logged
    driver.get(url)
    status = driver.execute_async_script(_WAIT_FOR_MATHJAX)
    info = driver.execute_script(_INSPECT)
    problems = []
    if status != "ok":
        problems.append(f"MathJax: {status}")
    if not str(info.get("version") or "").startswith("3."):
        problems.append(f"MathJax 3 not loaded (version {info.get('version')!r})")
    if not info["typeset"]:
        problems.append("the page never finished typesetting")
    problems += [f"math error: {e}" for e in info["errors"]]
    problems += [f"math left as text: {t!r}" for t in info["unrendered"] + info["leftover"]]
    problems += [f"TeX outside the typeset areas (a heading, the TOC?): {t!r}" for t in info["rawTex"]]
    if info["display"] < expected_display:
        problems.append(f"{info['display']} display equations rendered, {expected_display} expected")
    for entry in driver.get_log("browser"):
        if entry.get("level") == "SEVERE":
            problems.append(f"console: {entry.get('message')}")
    return problems, info


@slow
def test_browser_renders_every_page(site, browser):
    pages = sorted(p for p in site.rglob("*.html") if "assets" not in p.relative_to(site).parts)
    assert len(pages) >= 20, [str(p) for p in pages]
    names = {str(p.relative_to(site)) for p in pages}
    missing = [p for p in PAGES_WITH_DISPLAY_MATH if p not in names]
    assert not missing, f"pages expected to carry display math were not built: {missing}"

    server = _serve(site)
    failures, total_display = [], 0
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}/"
        for page in pages:
            rel = page.relative_to(site).as_posix()
            expected = site_checks.expected_display_equations(page.read_text(encoding="utf-8"))
            if rel in PAGES_WITH_DISPLAY_MATH and expected == 0:
                failures.append(f"{rel}: its source has no display equation")
            url = base + (rel[: -len("index.html")] if rel.endswith("index.html") else rel)
            problems, info = check_page(browser, url, expected)
            total_display += info["display"]
            failures += [f"{rel}: {p}" for p in problems]
    finally:
        server.shutdown()
    print(f"\nbrowser: {len(pages)} pages, {total_display} display equations typeset")
    assert not failures, "\n".join(failures)


@slow
def test_browser_check_catches_broken_math(site, browser, tmp_path):
    """Negative control: a page with an undefined macro, a console error and a missing equation fails."""
    shutil.copytree(site / "assets" / "mathjax", tmp_path / "assets" / "mathjax")
    shutil.copytree(site / "assets" / "javascripts", tmp_path / "assets" / "javascripts")
    (tmp_path / "index.html").write_text(
        "<!doctype html><html><head><meta charset='utf-8'>"
        "<script src='assets/javascripts/mathjax-config.js'></script>"
        "<script src='assets/mathjax/tex-svg.js'></script></head><body>"
        # like Material's table of contents: outside the typeset areas, so TeX there stays raw
        '<div class="md-sidebar"><nav>TOC: Padding scored \\(-\\infty\\)</nav></div>'
        '<div class="arithmatex">\\[ \\notamacro{x} + 1 \\]</div>'
        "<script>console.error('something broke')</script></body></html>",
        encoding="utf-8",
    )
    server = _serve(tmp_path)
    try:
        problems, _ = check_page(browser, f"http://127.0.0.1:{server.server_address[1]}/", expected_display=2)
    finally:
        server.shutdown()
    text = "\n".join(problems)
    assert "math error" in text and "notamacro" in text, text
    assert "console" in text and "something broke" in text, text
    assert "1 display equations rendered, 2 expected" in text, text
    assert "TeX outside the typeset areas" in text and "Padding scored" in text, text


@slow
def test_browser_layout_at_1280(site, browser):
    """At a 1280 x 900 window (a 688 px content column) no code block or table is cut off without a
    cue, and the smallest text of every figure is at least 8 px high as the page shows it. Without
    extra.css the same check must find clipped ones (it can fail), and every figure the site draws
    must record its smallest font size (docs/hooks/figures.py, benchmarks/report.py)."""
    from urllib.parse import unquote, urlsplit

    pages = sorted(p for p in site.rglob("*.html") if "assets" not in p.relative_to(site).parts
                   and p.name != "404.html")
    server = _serve(site)
    browser.set_window_size(1280, 900)
    failures, rows = [], []
    totals = {"elements": 0, "before": 0, "after": 0, "cued": 0, "figures": 0, "unmeasured": 0}
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}/"
        for page in pages:
            rel = page.relative_to(site).as_posix()
            browser.get(base + (rel[: -len("index.html")] if rel.endswith("index.html") else rel))
            browser.execute_async_script(_WAIT_FOR_MATHJAX)  # typeset math changes widths
            info = browser.execute_script(site_checks.LAYOUT_JS)
            if info["sheets"] != 1:
                failures.append(f"{rel}: extra.css is not loaded")
            failures += [f"{rel}: {u}" for u in info["after"]["uncued"]]
            sizes, unmeasured = [], 0
            for img in info["imgs"]:
                url = urlsplit(img["src"])
                if url.scheme == "data":
                    unmeasured += 1  # a notebook's output: it records no font size
                    continue
                path = site / unquote(url.path.lstrip("/"))
                font = site_checks.figure_font(path)
                if font is None:
                    failures.append(f"{rel}: {url.path} records no smallest font size")
                elif img["width"] < 1:
                    failures.append(f"{rel}: {url.path} is not shown")
                else:
                    px = site_checks.label_px(*font, img["width"])
                    sizes.append(px)
                    if px < 8:
                        failures.append(f"{rel}: {url.path} shown {img['width']:.0f} px wide: labels {px:.1f} px")
            before, after = info["before"], info["after"]
            totals["elements"] += after["elements"]
            totals["before"] += len(before["uncued"])
            totals["after"] += len(after["uncued"])
            totals["cued"] += after["cued"]
            totals["figures"] += len(sizes)
            totals["unmeasured"] += unmeasured
            rows.append(f"{rel:42s} {info['articleWidth']:5d} {after['elements']:5d} {len(before['uncued']):8d} "
                        f"{after['cued']:6d} {len(after['uncued']):7d} {len(sizes):5d} "
                        + (f"{min(sizes):8.1f}" if sizes else "       -") + (f"  ({unmeasured} unmeasured)" if unmeasured else ""))
    finally:
        server.shutdown()
        browser.set_window_size(1280, 1000)
    print(f"\nlayout at 1280 x 900: {len(pages)} pages")
    print(f"{'page':42s} {'col':>5s} {'code+':>5s} {'clipped':>8s} {'scroll':>6s} {'clipped':>7s} {'figs':>5s} {'min label':>8s}")
    print(f"{'':42s} {'px':>5s} {'table':>5s} {'no css':>8s} {'+cue':>6s} {'now':>7s} {'':>5s} {'px':>8s}")
    print("\n".join(rows))
    print(f"total: {totals['elements']} code blocks and tables; clipped without a cue: {totals['before']} without "
          f"extra.css, {totals['after']} with it ({totals['cued']} scroll with the cue); {totals['figures']} figures "
          f"measured, {totals['unmeasured']} notebook outputs not measured")
    assert totals["before"] > 0, "without extra.css nothing was found clipped: the check cannot fail"
    assert totals["figures"] > 0
    assert not failures, "\n".join(failures)


def test_figure_label_size_is_read_from_the_figure(tmp_path):
    """The figures record their smallest font; a figure drawn with 4 pt labels, shown at 688 px, fails."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(18, 12))
    ax.set_title("tiny", fontsize=4)
    fig.savefig(tmp_path / "a.png", dpi=100, metadata={"Description": "flashattn-figure: smallest-font-pt=4 dpi=100"})
    plt.close(fig)
    font = site_checks.figure_font(tmp_path / "a.png")
    assert font == (4.0, 100.0, 1800.0)
    assert site_checks.label_px(*font, 688) < 8
    sys.path.insert(0, str(DOCS / "hooks"))
    import figures

    svg = figures.causal_schedule()
    (tmp_path / "b.svg").write_text(svg, encoding="utf-8")
    pt, dpi, width = site_checks.figure_font(tmp_path / "b.svg")
    assert dpi == 72 and pt >= 9 and site_checks.label_px(pt, dpi, width, 688) >= 9
    (tmp_path / "c.svg").write_text(svg.replace("flashattn-figure", "other"), encoding="utf-8")
    assert site_checks.figure_font(tmp_path / "c.svg") is None


def test_hook_fails_loudly_on_unknown_directives_and_unplaced_checks(tmp_path):
    """An unknown directive, a module no page shows, or a module shown twice stops the build."""
    from mkdocs.exceptions import PluginError

    hooks = _site_hooks()
    page = SimpleNamespace(file=SimpleNamespace(src_uri="x.md"))
    with pytest.raises(PluginError, match="unknown directive flashattn:nonsense"):
        hooks.on_page_markdown("text <!-- flashattn:nonsense arg --> more", page, None, None)

    import derivations

    def pages(mapping):
        out = []
        for uri, text in mapping.items():
            path = tmp_path / uri.replace("/", "_")
            path.write_text(text, encoding="utf-8")
            out.append(SimpleNamespace(src_uri=uri, abs_src_path=str(path)))
        return out

    every = {f"math/{name}.md": f"<!-- flashattn:derivation {name} -->" for name in derivations.MODULES}
    assert hooks.module_pages(pages(every)) == {name: f"math/{name}.md" for name in derivations.MODULES}
    missing = dict(list(every.items())[1:])
    with pytest.raises(PluginError, match="no page shows"):
        hooks.module_pages(pages(missing))
    with pytest.raises(PluginError, match="shown twice"):
        hooks.module_pages(pages({**every, "math/again.md": f"<!-- flashattn:derivation {derivations.MODULES[0]} -->"}))
    with pytest.raises(PluginError, match="not in derivations.MODULES"):
        hooks.module_pages(pages({**every, "math/new.md": "<!-- flashattn:derivation no_such_module -->"}))


def test_serve_watches_the_code_the_pages_embed():
    """`mkdocs serve` reloads when an embedded kernel or derivation changes, not only a page."""
    from mkdocs.config import load_config

    config = load_config(str(ROOT / "mkdocs.yml"))
    watched = {Path(p).resolve() for p in config["watch"]}
    assert {(ROOT / "flashattn").resolve(), (ROOT / "derivations").resolve()} <= watched
