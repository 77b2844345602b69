"""One notation on every page: the symbols the notation table retired must not come back.

The table on docs/math/index.md fixes the symbols. This test reads the math of every Markdown page
(inside \\( \\) and \\[ \\], outside code) and fails on the retired uses:

* ``D`` in math: the row term is δ (`delta` in the code) and the head dimension is d;
* a softmax of τS: S already contains τ (S = τQKᵀ), so that scales twice;
* ``p`` as a dropout probability (``/p`` or ``\\frac{..}{p}``): the drop probability is p_drop;
* ``c\\, s`` or ``s = c ...``: base-2 scores are S₂ = cQKᵀ, raw products X = QKᵀ; s stays an entry of S.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGES = sorted(p for p in [*DOCS.rglob("*.md"), *DOCS.rglob("*.ipynb")] if "hooks" not in p.parts)

RETIRED = {
    # after a capital too: 4MD is the retired D as much as 4 D is; \\Delta and words like LSE stay legal
    "D in math (use δ for the row term, d for the head dimension)": re.compile(r"(?<![a-z\\])D(?![A-Za-z])"),
    "softmax of τS (S already holds τ)": re.compile(r"softmax\}?\s*\(\s*\\tau\s*S"),
    "p as a dropout probability (use p_drop)": re.compile(r"/\s*p(?![A-Za-z_])|\\frac\{[^{}]*\}\{p\}"),
    "c·s for base-2 scores (use S_2 = cX, X = QKᵀ)": re.compile(r"c\\?,?\s*s(?![A-Za-z])|s\s*=\s*c\b|s_\{ij\}\s*=\s*q_i"),
    "s in a base-2 exponent (s is a natural-log score; base-2 scores are S_2)": re.compile(r"2\^\{\s*(?:\\,)?\s*s[_\s\\-]"),
}

_CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)
_MATH = re.compile(r"\\\((.*?)\\\)|\\\[(.*?)\\\]", re.S)


def math_segments(markdown: str) -> list[str]:
    text = _CODE.sub("", markdown)
    return [a or b for a, b in _MATH.findall(text)]


def violations(markdown: str) -> list[str]:
    found = []
    for segment in math_segments(markdown):
        found += [f"{rule}: \\({segment.strip()[:80]}\\)" for rule, rx in RETIRED.items() if rx.search(segment)]
    return found


def page_markdown(page: Path) -> str:
    """A page's Markdown; for a notebook, its Markdown cells (code cells may name a head dim D)."""
    if page.suffix != ".ipynb":
        return page.read_text(encoding="utf-8")
    cells = json.loads(page.read_text(encoding="utf-8"))["cells"]
    text = "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    return re.sub(r"\$\$(.*?)\$\$|\$([^$\n]+)\$", lambda m: rf"\[{m[1]}\]" if m[1] is not None else rf"\({m[2]}\)",
                  text, flags=re.S)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_page_uses_the_notation_table(page):
    assert violations(page_markdown(page)) == []


@pytest.mark.parametrize("bad", [
    r"\(dS = P \circ (dP - D)\)",
    r"\(P = \operatorname{softmax}(\tau S)\)",
    r"\(\tilde P = P \circ Z / p\)",
    r"\[\tilde P = \frac{P \circ Z}{p}\]",
    r"\(P_{ij} = 2^{c\, s_{ij} - \mathrm{LSE}_2}\)",
    r"\(s_{ij} = q_i \cdot k_j\)",
    r"\(4MD\) bytes",
    r"\(\ell = \sum_j 2^{s_j - m}\)",
    r"\(P = 2^{\,s - \mathrm{LSE}_2}\)",
])
def test_retired_symbols_are_caught(bad):
    assert violations(bad), bad


@pytest.mark.parametrize("good", [
    r"\(dS = P \circ (dP - \delta)\)",
    r"\(d = 64\)",
    r"\(\tilde P = P \circ Z/(1 - p_{\text{drop}})\)",
    r"\(P_{ij} = 2^{S_{2,ij} - \mathrm{LSE}_{2,i}}\)",
    "`(B, H, N, D)` in code is not math",
    r"\(dP\) and \(\mathrm{LSE}\)",
    r"\(\ell = \sum_j 2^{S_{2,ij} - m}\) and \(e^{s_j - m}\)",
    r"\(4Md\) and \(\Delta\)",
])

def test_current_notation_passes(good):
    assert violations(good) == []


def test_notebook_math_is_read(tmp_path):
    cell = {"cell_type": "markdown", "source": ["$dS = P \\circ (dP - D)$ and $$P = 2^{s - m}$$"]}
    page = tmp_path / "probe.ipynb"
    page.write_text(json.dumps({"cells": [cell]}), encoding="utf-8")
    assert len(violations(page_markdown(page))) == 2

