"""The package's import contract: its layers import one way, down.

The layers are :data:`flashattn.layers.LAYERS`, which the design page draws (docs/kernels/design.md,
"Layers"); this test reads every import of every module of ``flashattn`` (module level and inside
functions, and ``importlib`` calls with a literal name) and fails on one that points up, or at a
module the drawing does not place.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import flashattn
from flashattn import layers

PACKAGE = pathlib.Path(flashattn.__file__).parent

LAYERS = [(name, set(members)) for name, _, members in layers.LAYERS]
BESIDE = layers.BESIDE


def _layer_of(module: str) -> int | None:
    return layers.depth(module)


def _module_name(path: pathlib.Path) -> str:
    """``flashattn/integrations/transformers.py`` -> ``integrations.transformers``; a package's
    ``__init__.py`` is the package (the top one is ``__init__``)."""
    try:
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    except ValueError:  # a file outside the package (the negative control's)
        return path.stem
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def _resolve(dotted: str) -> str | None:
    """The module of the package that ``flashattn.<dotted>`` names (the longest prefix that is one)."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        base = PACKAGE.joinpath(*parts[:end])
        if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
            return ".".join(parts[:end])
    return None


def _imports(path: pathlib.Path) -> set[str]:
    """The ``flashattn`` modules ``path`` imports, by their name inside the package."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names = [node.args[0].value]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "flashattn" and len(parts) > 1:
                module = _resolve(".".join(parts[1:]))
                if module is not None:
                    found.add(module)
    found.discard(_module_name(path))
    return found


MODULES = sorted(_module_name(p) for p in PACKAGE.rglob("*.py"))


def test_every_module_has_a_place_in_the_drawing():
    placed = set().union(*(members for _, members in LAYERS)) | set(BESIDE)
    assert set(MODULES) <= placed, f"place these modules in a layer: {sorted(set(MODULES) - placed)}"


@pytest.mark.parametrize("module", MODULES)
def test_imports_point_down(module):
    path = PACKAGE.joinpath(*module.split("."))
    imported = _imports(path.with_suffix(".py") if path.with_suffix(".py").is_file() else path / "__init__.py")
    if module in BESIDE:
        floor = _layer_of(next(iter(LAYERS[-1][1])))
        bad = {m for m in imported if m in BESIDE or _layer_of(m) != floor}
        assert not bad, f"{module} (beside the layers) may import only the description and schedule, not {sorted(bad)}"
        return
    depth = _layer_of(module)
    for other in imported:
        if other in BESIDE:
            assert depth <= 1, f"{module} ({LAYERS[depth][0]}) imports {other}: only the entry points and autograd may"
            continue
        assert _layer_of(other) >= depth, (f"{module} ({LAYERS[depth][0]}) imports {other} "
                                           f"({LAYERS[_layer_of(other)][0]}), a layer above it")


def test_the_design_page_draws_these_layers():
    """The design page's drawing is rendered from the same table (the site hook's ``layers`` directive)."""
    page = (PACKAGE.parent / "docs" / "kernels" / "design.md").read_text(encoding="utf-8")
    assert "<!-- flashattn:layers -->" in page


def test_the_contract_can_fail(tmp_path, monkeypatch):
    """The reader sees an upward import inside a function and through importlib (negative control)."""
    bad = tmp_path / "forward.py"
    bad.write_text("def f():\n    from flashattn import autograd\n    import importlib\n"
                   "    importlib.import_module('flashattn.api')\n")
    assert _imports(bad) == {"autograd", "api"}


def test_comments_cite_no_runs():
    """Comments and docstrings in flashattn/ give a reason and a link: no run numbers and no ratio ranges
    (those stay in the tuning log), and every ``docs/kernels/tuning-log.md#anchor`` names a heading of the
    log, with the id MkDocs' toc gives it (markdown's own toc extension, duplicate suffixes included)."""
    import io
    import re
    import tokenize

    import markdown

    md = markdown.Markdown(extensions=["toc"])
    md.convert((PACKAGE.parent / "docs" / "kernels" / "tuning-log.md").read_text(encoding="utf-8"))
    anchors, todo = set(), list(md.toc_tokens)
    while todo:
        token = todo.pop()
        anchors.add(token["id"])
        todo.extend(token["children"])
    run, ratio = re.compile(r"\b[Rr]uns? \d+\b"), re.compile(r"\d\.\d+-\d\.\d+x")
    link = re.compile(r"docs/kernels/tuning-log\.md#([\w-]+)")

    def findings(source: str) -> tuple[list[str], int]:
        """What ``source`` gets wrong, and how many tuning-log links it holds."""
        prose = [tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                 if tok.type == tokenize.COMMENT]
        prose += [ast.get_docstring(node, clean=False) or "" for node in ast.walk(ast.parse(source))
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
        bad = [f"run number: {line.strip()}" for line in source.splitlines() if run.search(line)]
        bad += [f"ratio range: {m.group()} in {text.strip()[:80]!r}" for text in prose for m in ratio.finditer(text)]
        links = link.findall(source)
        bad += [f"no tuning-log heading has the id {a!r}" for a in links if a not in anchors]
        return bad, len(links)

    # negative control: each kind of narration is caught, and a good link passes
    sample = ('"""Runs 41 and 42 read 0.93-1.10x."""\n# see docs/kernels/tuning-log.md#no-such-heading\n'
              "X = 1  # docs/kernels/tuning-log.md#the-gluon-bar-again\n")
    assert len(findings(sample)[0]) == 3, findings(sample)
    assert "the-gluon-bar-again" in anchors and "what-limits-us-now-measured_1" in anchors

    problems, n_links = [], 0
    for path in sorted(PACKAGE.rglob("*.py")):  # subpackages too (the Hopper kernels' host code links the log)
        bad, links = findings(path.read_text(encoding="utf-8"))
        problems += [f"{path.relative_to(PACKAGE)}: {b}" for b in bad]
        n_links += links
    assert not problems, "\n".join(problems)
    assert n_links > 0, "no comment links to the tuning log: the anchor check checked nothing"


def test_the_package_reaches_its_names_and_submodules_lazily():
    """``import flashattn`` runs only what the custom operators need; every public name and every
    submodule is reachable as an attribute, as when the package imported them all; anything else is an
    AttributeError."""
    import subprocess
    import sys

    code = ("import sys, flashattn\n"
            "assert 'flashattn.api' not in sys.modules and 'flashattn.distributed' not in sys.modules\n"
            "assert flashattn.attention.__module__ == 'flashattn.api'\n"
            "assert flashattn.decode.attention_with_kvcache is flashattn.attention_with_kvcache\n"
            "assert flashattn.distributed.ring_attention and flashattn.warmup.__module__ == 'flashattn.precompile'\n"
            "assert all(hasattr(flashattn, name) for name in flashattn.__all__)\n"
            "try:\n    flashattn.no_such_name\nexcept AttributeError:\n    pass\nelse:\n    raise SystemExit(1)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=PACKAGE.parent)
    assert proc.returncode == 0, proc.stderr
