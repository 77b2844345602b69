"""The README and the Getting started page, as a new user reads them.

The README's first two commands are the ones CI runs, it stays short and free of history, its table
of ratios is the committed benchmark run's, and the Python it shows runs as pasted: on the CPU for
the unmarked blocks, on a CUDA GPU for the blocks marked as needing one. Getting started is held to
the same rule. A block is marked by the line above it: one that names "CUDA GPU" (a bold lead-in or a
content tab ``=== "CUDA GPU"``) needs a GPU; a ``=== "CPU"`` tab is the CPU's alternative to it.
"""

from __future__ import annotations

import json
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from devices import gpu, needs_cuda

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GETTING_STARTED = ROOT / "docs" / "getting-started.md"
RESULTS = ROOT / "benchmarks" / "results" / "results.json"

MAX_README_WORDS = 400

# The README's table: the peer named in each row, and the headline shape its first two columns are for.
PEERS = {"SDPA flash (FlashAttention 2)": "sdpa_flash", "FlexAttention": "flex", "SDPA cuDNN": "sdpa_cudnn"}
HEADLINE = {"dtype": "float16", "head_dim": 128, "seqlen": 16384, "causal": False, "kv_heads": None}
SMALLEST_FROM_N = 2048


@dataclass
class Block:
    lang: str
    code: str
    marker: str  # the last non-blank line above the opening fence

    @property
    def needs_gpu(self) -> bool:
        return "CUDA GPU" in self.marker

    @property
    def cpu_tab(self) -> bool:
        return self.marker.strip() == '=== "CPU"'


def fenced_blocks(text: str) -> list[Block]:
    """The fenced code blocks of a Markdown page, indented ones (inside tabs or admonitions) included."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = re.match(r"^(\s*)(`{3,})\s*([\w+-]*)", lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        above = next((ln for ln in reversed(lines[:i]) if ln.strip()), "")
        end = i + 1
        while end < len(lines) and lines[end].strip() != fence:
            end += 1
        assert end < len(lines), f"unclosed code fence at line {i + 1}"
        code = textwrap.dedent("\n".join(lines[i + 1:end]))
        blocks.append(Block(lang, code, above))
        i = end + 1
    return blocks


def python_blocks(path: Path) -> list[Block]:
    return [b for b in fenced_blocks(path.read_text(encoding="utf-8")) if b.lang == "python"]


def commands(block: Block) -> list[str]:
    """The shell commands of a block, comments stripped."""
    return [c for c in (ln.split("#", 1)[0].strip() for ln in block.code.splitlines()) if c]


def run_blocks(blocks: list[Block], source: Path) -> dict:
    ns: dict = {"__name__": "__example__"}
    for b in blocks:
        exec(compile(b.code, str(source), "exec"), ns)
    return ns


@pytest.fixture
def reference_path(monkeypatch):
    """The CPU as a user has it: no Triton interpreter (tests/conftest.py turns it on without a GPU)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


# --- the README -------------------------------------------------------------------------------


def test_readme_first_two_commands_serve_and_test():
    first = fenced_blocks(README.read_text(encoding="utf-8"))[0]
    assert commands(first)[:2] == ["python3 dev.py serve", "python3 dev.py test"]


def test_ci_runs_the_readmes_second_command():
    second = commands(fenced_blocks(README.read_text(encoding="utf-8"))[0])[1]
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert [ln for ln in ci if ln and not ln.startswith("#")][-1] == second


def test_readme_is_short_and_has_no_history():
    text = README.read_text(encoding="utf-8")
    assert len(text.split()) < MAX_README_WORDS  # words as `wc -w` counts them
    assert not re.search(r"\bruns? [0-9]+", text), "run numbers belong in the tuning log"
    hashes = [h for h in re.findall(r"\b[0-9a-f]{7,40}\b", text) if re.search(r"[a-f]", h) and re.search(r"\d", h)]
    assert not hashes, f"commit hashes belong in the tuning log: {hashes}"


def test_readme_links_resolve():
    text = README.read_text(encoding="utf-8")
    targets = [t for t in re.findall(r"\]\(([^)#\s]+)", text) if "://" not in t]
    assert "docs/benchmarks.md" in targets
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing


def test_readme_marks_exactly_its_gpu_examples():
    blocks = python_blocks(README)
    assert blocks and not blocks[0].needs_gpu
    for b in blocks:
        assert b.needs_gpu == ('"cuda"' in b.code), b.code


def test_readme_example_runs_on_cpu(reference_path):
    import torch

    first = python_blocks(README)[0]
    ns = run_blocks([first], README)  # the example asserts its own result against SDPA
    assert ns["o"].device.type == "cpu"
    for name in "qkv":
        assert ns[name].grad is not None and torch.isfinite(ns[name].grad).all()


@gpu
@needs_cuda
def test_readme_gpu_example_runs_on_gpu():
    blocks = python_blocks(README)
    ns = run_blocks(blocks, README)
    assert ns["o"].is_cuda


def test_readme_ratio_table_is_the_committed_run():
    data = json.loads(RESULTS.read_text())
    env = data["environment"]
    tflops, heads = {}, None
    for r in data["measurements"]:
        if r["status"] == "ok":
            key = (r["dtype"], r["head_dim"], r["causal"], r["seqlen"], r["kv_heads"], r["pass"])
            tflops[(r["provider"], *key)] = r["tflops"]
            if all(r[k] == v for k, v in HEADLINE.items()):
                heads = r["heads"]

    def ratios(peer, pass_, from_n):
        return [t / tflops[(peer, *key)] for (prov, *key), t in tflops.items()
                if prov == "flashattn" and key[5] == pass_ and key[3] >= from_n and (peer, *key) in tflops]

    text = README.read_text(encoding="utf-8")
    torch_version = ".".join(env["torch"].split(".")[:2])
    triton_version = ".".join(env["triton"].split(".")[:2])
    prose = " ".join(text.split())
    for claim in (env["gpu"], f"torch {torch_version}", f"Triton {triton_version}",
                  f"{HEADLINE['dtype']}, head dim {HEADLINE['head_dim']}, N = {HEADLINE['seqlen']:,}, {heads} heads, no mask",
                  f"from N = {SMALLEST_FROM_N}"):
        assert claim in prose

    rows = {m.group(1).strip(): [c.strip() for c in m.group(2).split("|")]
            for m in re.finditer(r"^\| ([^|]+) \|(.+)\|$", text, flags=re.M)}
    assert set(PEERS) <= set(rows)
    for label, peer in PEERS.items():
        at = (HEADLINE["dtype"], HEADLINE["head_dim"], HEADLINE["causal"], HEADLINE["seqlen"], HEADLINE["kv_heads"])
        expected = [tflops[("flashattn", *at, p)] / tflops[(peer, *at, p)] for p in ("fwd", "bwd")]
        expected += [min(ratios(peer, p, SMALLEST_FROM_N)) for p in ("fwd", "bwd")]
        assert rows[label] == [f"{x:.2f}×" for x in expected], label


# --- Getting started --------------------------------------------------------------------------


def test_getting_started_marks_exactly_its_gpu_examples():
    blocks = python_blocks(GETTING_STARTED)
    assert any(b.needs_gpu for b in blocks) and any(b.cpu_tab for b in blocks)
    for b in blocks:
        assert b.needs_gpu == ('"cuda"' in b.code), b.code


def test_getting_started_runs_on_cpu(reference_path):
    blocks = [b for b in python_blocks(GETTING_STARTED) if not b.needs_gpu]
    assert len(blocks) >= 2
    ns = run_blocks(blocks, GETTING_STARTED)
    assert ns["o"].device.type == "cpu" and ns["q"].grad is not None
    assert ns["lse"].shape == ns["q"].shape[:3]


@gpu
@needs_cuda
def test_getting_started_runs_on_gpu():
    blocks = [b for b in python_blocks(GETTING_STARTED) if not b.cpu_tab]
    ns = run_blocks(blocks, GETTING_STARTED)
    assert ns["o"].is_cuda and ns["q"].grad is not None


def test_block_markers_are_read():
    """The parser itself: a marked block, a tab and an unmarked one are told apart."""
    page = textwrap.dedent('''\
        Intro.

        ```bash
        echo hi
        ```

        === "CPU"

            ```python
            x = 1
            ```

        === "CUDA GPU"

            ```python
            x = "cuda"
            ```
        ''')
    blocks = fenced_blocks(page)
    assert [(b.lang, b.needs_gpu, b.cpu_tab, b.code) for b in blocks] == [
        ("bash", False, False, "echo hi"), ("python", False, True, "x = 1"), ("python", True, False, 'x = "cuda"')]

