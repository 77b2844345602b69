"""One notation on every page: the symbols the notation table retired must not come back.

The table on docs/math/index.md fixes the symbols. This test reads the math of every Markdown page
(inside \\( \\) and \\[ \\], outside code) and fails on the retired uses:

* ``D`` in math: the row term is δ (`delta` in the code) and the head dimension is d;
* a softmax of τS: S already contains τ (S = τQKᵀ), so that scales twice;
* ``p`` as a dropout probability (``/p`` or ``\\frac{..}{p}``): the drop probability is p_drop;
* ``c\\, s`` or ``s = c ...``: base-2 scores are S₂ = cQKᵀ, raw products X = QKᵀ; s stays an entry of S;
* one meaning per capital: P the probabilities (the GPU count is R, a page size is written page_size),
  M the key count (a max is m), L the loss (a log-sum-exp is LSE), K the keys (a key shard is J),
  S the scores (a count of heads per section is n_sec), Z the dropout mask (a softmax normaliser is
  ℓ), and δ the row term (the Kronecker delta is the bracket [i = j]).

Every page is read: ``docs/**/*.md`` and the Markdown cells of every notebook under ``docs/``.
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
    # one meaning per capital (issue 47): the second meanings below were renamed on every page
    "P as a count of GPUs or a page size (P is the probabilities; use R, page_size)":
        re.compile(r"/\s*2?P(?![A-Za-z_])|\\bmod\s+P(?![A-Za-z_])|(?<![A-Za-z\\_])2P(?![A-Za-z_])"
                   r"|(?<![A-Za-z\\_])P\s*-\s*1(?![0-9])"),
    "M as a max (M is the key count; a max is m)": re.compile(r"(?<![A-Za-z\\_])M\s*=\s*\\max|e\^\{-M\}|-\s*M\}"),
    "L as a log-sum-exp (L is the loss; write \\mathrm{LSE})":
        re.compile(r"(?<![A-Za-z\\_])L_[A-Za-z{]|e\^\{?L(?![A-Za-z])|(?<![A-Za-z\\_])L\s*=\s*(?:\\log|m\s*\+|-\\infty)"),
    "K as a shard (K is the keys; a shard is J)": re.compile(r"_K(?![A-Za-z,])|_\{K\}"),
    "S as a count (S is the scores; heads per section are n_sec)": re.compile(r"(?<![A-Za-z\\_])S\s*=\s*\d+\s*/"),
    "Z as a normaliser (Z is the dropout mask; a softmax sum is ℓ)":
        re.compile(r"(?<![A-Za-z\\_])Z\s*=\s*\\sum|/\s*Z(?![A-Za-z_])|Z\^2"),
    "δ_ij, a Kronecker delta beside the row term δ (write [i = j])": re.compile(r"\\delta_\{?ij"),
    "δ as a variation (δ is the row term; a small change of X is \\dot X)": re.compile(r"\\delta\s*(?:\\,\s*)?[A-Z]"),
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
    # the second meanings issue 47 listed, as the pages had them
    r"shape (B, H, N, d) per rank: \(r - t \bmod P\), after \(P - 1\) steps, \(2P\) chunks",
    r"slot \(j \bmod P\) of the page",
    r"\(M = \max(L_A, L_B)\)",
    r"\(L = \log\!\left(e^{L_A} + e^{L_B}\right)\)",
    r"\(dS_K = P_K \circ (dO\, V_K^\top - \delta)\)",
    r"\(S = 16384 / N\)",
    r"\(L_b = \texttt{cache\_seqlens}[b] + N_\text{new}\)",
    r"\(Z = \sum_k e^{s_k}\), so \(p_i = e^{s_i}/Z\)",
    r"\[p_i(\delta_{ij} - p_j)\]",
    r"\(\delta L = \operatorname{tr}(dO^\top \delta O)\)",
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
    r"\(r - t \bmod R\), \(2R - 1 - r\), \(R = 4\)",
    r"\(m_{AB} = \max(\mathrm{LSE}_A, \mathrm{LSE}_B)\) and \(e^{\mathrm{LSE}_A - m_{AB}}\)",
    r"\(dS_J = P_J \circ (dO\, V_J^\top - \delta)\) and \(dK = \tau\, dS^\top Q\)",
    r"\(L = \langle dO, O\rangle\) and \(\partial L/\partial X\)",
    r"\(P \circ Z/(1 - p_{\text{drop}})\), \(p_i = e^{s_i}/\ell\), \(p_i([i = j] - p_j)\)",
    r"\(n_\text{sec} = 16384 / N\), \(M_i\), \(N \times M\), \(M_b \le M_\text{max}\)",
    r"\(\underbrace{2Md}_{K,V}\)",
    r"\(\dot L = \operatorname{tr}(dO^\top \dot O)\) and \(dS = P \circ (dP - \delta)\), \(\delta_i\)",
])

def test_current_notation_passes(good):
    assert violations(good) == []


def test_every_page_is_read():
    """The test covers every Markdown page and every notebook under docs/ (none skipped)."""
    pages = {p.relative_to(DOCS).as_posix() for p in PAGES}
    on_disk = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*") if p.suffix in (".md", ".ipynb")
               and "hooks" not in p.parts and ".ipynb_checkpoints" not in p.parts}
    assert pages == on_disk and {"errata.md", "kernels/ring.md", "math/merge.md"} <= pages


def test_notebook_math_is_read(tmp_path):
    cell = {"cell_type": "markdown", "source": ["$dS = P \\circ (dP - D)$ and $$P = 2^{s - m}$$"]}
    page = tmp_path / "probe.ipynb"
    page.write_text(json.dumps({"cells": [cell]}), encoding="utf-8")
    assert len(violations(page_markdown(page))) == 2

