"""The three pages added for issue 47 (variants stacked, δ before the loop, masked loads): each check
passes and rejects its controls, a formula broken on purpose is caught, the pages are in the nav and
embed sections that exist, and each notebook draws a plot."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from derivations import MODULES, delta_before_loop, masked_loads, stacked_variants

ROOT = Path(__file__).resolve().parents[1]
PAGES = {"stacked_variants": "math/stacked-variants.md", "delta_before_loop": "math/delta-before-loop.md",
         "masked_loads": "math/masked-loads.md"}


@pytest.fixture(scope="module", params=sorted(PAGES))
def result(request):
    module = {"stacked_variants": stacked_variants, "delta_before_loop": delta_before_loop,
              "masked_loads": masked_loads}[request.param]
    return request.param, module.check()


def test_check_passes_and_rejects_every_control(result):
    name, r = result
    assert name in MODULES
    assert r.passed, "\n".join(r.details)
    assert r.negative_control_rejected, "\n".join(r.details)
    assert sum(line.startswith("rejected") for line in r.details) >= 2


# ---------------------------------------------------------------- formulas broken on purpose

def test_stacked_without_the_dropout_scale_on_dp_is_caught():
    def wrong(P, Z, keep, V, dO, O, dlse, t):
        return stacked_variants.stacked_backward(P, Z, 1.0, V, dO, O, dlse, t)  # /(1 − p_drop) lost

    assert stacked_variants.torch_route(stacked_variants.stacked_backward)
    assert not stacked_variants.torch_route(wrong)


def test_stacked_symbolic_rejects_the_forgotten_tanh_factor():
    def wrong(P, Z, keep, V, dO, O, dlse, t):
        return stacked_variants.stacked_backward(P, Z, keep, V, dO, O, dlse, 0 * t)

    assert not stacked_variants.symbolic_route(wrong, [(2, 2, 1)])


def test_one_pass_delta_is_wrong_and_the_identity_is_right():
    error_identity, count = delta_before_loop.run("identity")
    error_running, _ = delta_before_loop.run("running")
    assert error_identity < 1e-12 and count.products == 9  # 3 key blocks × 3 products
    assert error_running > 1e-3


def test_scan_flags_a_masked_load_without_other_that_is_summed():
    bad = "def k(p, m):\n    x = tl.load(p, mask=m)\n    return tl.sum(x, axis=0)\n"
    good = "def k(p, q, m):\n    x = tl.load(p, mask=m)\n    tl.store(q, x, mask=m)\n"
    assert masked_loads.masked_loads(bad) == [("<source>:2 (k)", False, False)]
    assert masked_loads.masked_loads(good) == [("<source>:2 (k)", False, True)]
    loads, _ = masked_loads.scan(masked_loads.package_sources())
    assert len(loads) >= 10 and all(safe for _, _, safe in loads)


# ---------------------------------------------------------------- pages, nav, snippets

@pytest.mark.parametrize("name", sorted(PAGES))
def test_page_is_in_the_nav_and_shows_its_check(name):
    page = PAGES[name]
    text = (ROOT / "docs" / page).read_text(encoding="utf-8")
    assert f"<!-- flashattn:derivation {name} -->" in text
    assert re.search(rf"^\s+- .+: {re.escape(page)}$", (ROOT / "mkdocs.yml").read_text(encoding="utf-8"), re.M)
    for path, section in re.findall(r'--8<-- "([^":]+):([^"]+)"', text):
        source = (ROOT / path).read_text(encoding="utf-8")
        assert f"[start:{section}]" in source and f"[end:{section}]" in source, (path, section)


@pytest.mark.parametrize("module", ["stacked_variants", "delta_before_loop", "masked_loads"])
def test_every_start_marker_has_its_end(module):
    source = (ROOT / "derivations" / f"{module}.py").read_text(encoding="utf-8")
    starts = re.findall(r"--8<-- \[start:([\w-]+)\]", source)
    ends = re.findall(r"--8<-- \[end:([\w-]+)\]", source)
    assert starts and sorted(starts) == sorted(ends)


@pytest.mark.parametrize("notebook", ["online-attention.ipynb", "triton-interpreter.ipynb"])
def test_notebook_draws_a_labelled_plot_and_ships_without_outputs(notebook):
    cells = json.loads((ROOT / "docs" / "notebooks" / notebook).read_text(encoding="utf-8"))["cells"]
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    plots = [c for c in code if "plt." in c or "matplotlib" in c]
    assert plots and any("set_xlabel" in c and "set_ylabel" in c for c in plots)
    assert all(not c.get("outputs") for c in cells if c["cell_type"] == "code")
