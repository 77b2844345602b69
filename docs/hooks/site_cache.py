"""The build's cache: a derivation's check, the figures or an executed notebook, reused only while every
file it was made from is unchanged.

Each entry records the SHA-256 of every file of this repository the result was made from, and is used
only if each of those files still has that content:

* in-process work (a derivation module, the figures): the module files it can import from this
  repository (every ``import`` statement of every file reached, followed to the end, including imports
  inside functions) that this process has executed by the time it finished, plus any file under the
  repository it opened while it ran (cost_model, for one, parses kernel sources);
* a notebook: the notebook itself, plus every module its kernel had loaded when the last cell finished
  and every repository file the kernel opened (the kernel is a fresh process, so that list is exact).

The versions of Python and of the libraries that shape the output, and the build code itself, are
part of every entry. A notebook can therefore never show output from code older than the tree it was
built from. Entries live in ``.cache/site/`` (git-ignored); deleting that folder only costs time.
"""

from __future__ import annotations

import ast
import asyncio
import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOOKS = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("FLASHATTN_SITE_CACHE", ROOT / ".cache" / "site"))
KEEP = 4  # entries kept per unit (a touched-then-reverted file finds its old entry)

# Files that are never inputs: the environment, caches, build output.
_SKIP_TOP = {".venv", ".cache", ".git", "site", "build", "dist"}
_SKIP_PARTS = {"__pycache__", ".pytest_cache", ".ipynb_checkpoints"}
_SKIP_SUFFIXES = {".pyc", ".egg-info"}  # bytecode; the editable install's metadata (importlib.metadata reads it)
# Libraries whose version changes a result (a new SymPy may simplify differently, a new nbconvert
# renders differently); with Python's version and this build code they salt every entry.
_LIBRARIES = ("sympy", "mpmath", "numpy", "torch", "triton", "matplotlib", "ipykernel", "nbclient", "nbformat")


def _salt() -> str:
    h = hashlib.sha256(sys.version.encode())
    for name in _LIBRARIES:
        try:
            h.update(f"{name}={importlib.metadata.version(name)};".encode())
        except importlib.metadata.PackageNotFoundError:
            h.update(f"{name}=none;".encode())
    for path in sorted(HOOKS.glob("site_*.py")):
        h.update(path.read_bytes())
    return h.hexdigest()


SALT = _salt()
# The in-process modules are those imported since this process started (reloaded only in part by
# `mkdocs serve`): a result made from a file edited after this moment may come from older code in
# memory, so it is used for this build but never stored.
STARTED = time.time()


def sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def in_repo(path) -> Path | None:
    """`path` as an absolute Path if it is a file of this repository that can be an input, else None."""
    try:
        p = Path(os.path.abspath(path))
        rel = p.relative_to(ROOT)
    except (TypeError, ValueError):
        return None
    if (not rel.parts or rel.parts[0] in _SKIP_TOP or _SKIP_PARTS.intersection(rel.parts)
            or any(Path(part).suffix in _SKIP_SUFFIXES for part in rel.parts)):
        return None
    return p


# --------------------------------------------------------------------------------------------------
# what a computation reads
# --------------------------------------------------------------------------------------------------
def _module_files(name: str, roots) -> list[Path]:
    """The files `import name` executes from `roots`: each package's __init__.py on the way, and the module."""
    found = []
    parts = name.split(".")
    for root in roots:
        for k in range(1, len(parts) + 1):
            base = Path(root, *parts[:k])
            for candidate in (base / "__init__.py", base.with_suffix(".py")):
                if candidate.is_file():
                    found.append(candidate)
                    break
            else:
                break
        if found:
            return found
    return found


def _module_name(path: Path, roots) -> str:
    for root in roots:
        try:
            rel = path.relative_to(root)
        except ValueError:
            continue
        parts = list(rel.with_suffix("").parts)
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    return path.stem


def import_closure(start, roots=(ROOT,), runner: Path | None = None) -> set[Path]:
    """Every file of `roots` that the files `start` import, directly or not (imports inside functions
    count too, and an ``import_module`` of a computed name counts as the whole package: a static
    over-approximation of what running them can import). The computed imports of `runner`, the file
    whose function loads `start` by name, are that load itself."""
    roots = [Path(r).resolve() for r in roots]
    runner = runner.resolve() if runner else None
    seen: set[Path] = set()
    todo = [Path(p).resolve() for p in start]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        name = _module_name(path, roots)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for parent in _module_files(package, roots) if package else []:
            todo.append(parent)
        try:
            tree = ast.parse(path.read_bytes(), filename=str(path))
        except (OSError, SyntaxError):
            continue  # a file that does not parse still counts by its content; running it fails anyway
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".") if package else []
                    anchor = anchor[: len(anchor) - (node.level - 1)] if node.level > 1 else anchor
                    base = ".".join([*anchor, *([base] if base else [])])
                names = [base, *(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")]
            elif isinstance(node, ast.Call) and _dynamic_import(node) and path != runner:
                arg = node.args[0] if node.args else None
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    names = [arg.value]
                else:  # a computed name (importlib.import_module(f"flashattn.{name}")): the whole package
                    top = Path(path.parent) if path.name == "__init__.py" else path.parent
                    while (top.parent / "__init__.py").is_file():
                        top = top.parent
                    todo.extend(top.rglob("*.py") if (top / "__init__.py").is_file() else [])
            for imported in names:
                if imported:
                    todo.extend(_module_files(imported, roots))
    return seen


def _dynamic_import(call: ast.Call) -> bool:
    f = call.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    return name in ("import_module", "__import__")


class _Opened:
    """Records the repository files this process opens while a unit runs (one audit hook per process)."""

    def __init__(self) -> None:
        self.paths: set[Path] | None = None
        self.lock = threading.Lock()
        self.owner: int | None = None
        sys.addaudithook(self._hook)

    def _hook(self, event, args) -> None:
        if event == "open" and self.paths is not None and threading.get_ident() == self.owner:
            if isinstance(args[0], (str, os.PathLike)):
                path = in_repo(args[0])
                if path is not None:
                    self.paths.add(path)

    def run(self, fn):
        """`fn()` and the repository files it opened (on this thread)."""
        with self.lock:
            self.paths, self.owner = set(), threading.get_ident()
            try:
                return fn(), self.paths
            finally:
                self.paths, self.owner = None, None


OPENED = _Opened()


# --------------------------------------------------------------------------------------------------
# entries
# --------------------------------------------------------------------------------------------------
def _digest(inputs: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps([SALT, sorted(inputs.items())]).encode()).hexdigest()[:24]


def lookup(unit: str) -> tuple[Path, dict] | None:
    """(entry folder, manifest) of an entry of `unit` whose every input is unchanged, else None."""
    folder = CACHE / unit
    if not folder.is_dir():
        return None
    entries = sorted(folder.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
    for entry in entries:
        try:
            manifest = json.loads((entry / "manifest.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if manifest.get("salt") == SALT and all(sha256(ROOT / rel) == digest
                                                for rel, digest in manifest["inputs"].items()):
            os.utime(entry)  # most recently used: kept longest
            return entry, manifest
    return None


def store(unit: str, inputs, payload=None, files: dict[str, Path] | None = None, since: float | None = None) -> bool:
    """Keep `payload` (JSON) and `files` as an entry of `unit` made from `inputs` (paths).

    Nothing is stored if an input changed after `since` (the moment the computation started, or the
    process started for in-process work): the result may then come from the older content."""
    since = STARTED if since is None else since
    paths = sorted({Path(p).resolve() for p in inputs})
    if any(not p.is_file() or p.stat().st_mtime > since for p in paths):
        return False
    recorded = {p.relative_to(ROOT).as_posix(): sha256(p) for p in paths}
    entry = CACHE / unit / _digest(recorded)
    tmp = entry.with_name(entry.name + f".tmp{os.getpid()}.{threading.get_ident()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name, src in (files or {}).items():
        shutil.copyfile(src, tmp / name)
    (tmp / "manifest.json").write_text(json.dumps({"salt": SALT, "inputs": recorded, "payload": payload}),
                                       encoding="utf-8")
    shutil.rmtree(entry, ignore_errors=True)
    tmp.rename(entry)
    for old in sorted((p for p in (CACHE / unit).iterdir() if ".tmp" not in p.name),
                      key=lambda p: p.stat().st_mtime, reverse=True)[KEEP:]:
        shutil.rmtree(old, ignore_errors=True)
    return True


def cached_call(unit: str, fn, start, roots=(ROOT,), keep=lambda payload: True, runner=None):
    """`fn()` (returning JSON data), or its stored result while the imports of `start` (see
    :func:`import_closure`) and the files it opened are unchanged. Returns (payload, whether it came
    from the cache)."""
    hit = lookup(unit)
    if hit is not None:
        return hit[1]["payload"], True
    payload, opened = OPENED.run(fn)
    # What the unit can import (static) and this process has executed: a module that was never run
    # cannot have shaped the result, so an import inside a function the unit never called (autograd's
    # of the launchers, say) does not tie the figures to the kernels' sources.
    inputs = {Path(p).resolve() for p in start} | (import_closure(start, roots, runner) & executed_modules())
    if keep(payload):
        store(unit, inputs | opened, payload)
    return payload, False


def executed_modules() -> set[Path]:
    """The repository's module files this process has imported so far (``sys.modules``)."""
    found = set()
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if path and in_repo(path) is not None:
            found.add(Path(path).resolve())
    return found


# --------------------------------------------------------------------------------------------------
# notebooks
# --------------------------------------------------------------------------------------------------
# Run in the kernel before the first cell, silently: records the files the kernel opens. Nothing
# is bound in the notebook's namespace but a module in sys.modules.
_KERNEL_SETUP = """
def _flashattn_site_inputs():
    import os, sys, types
    opened = set()
    def hook(event, args):
        if event == "open" and isinstance(args[0], str):
            opened.add(os.path.abspath(args[0]))
    sys.addaudithook(hook)
    record = types.ModuleType("_flashattn_site_inputs")
    record.report = lambda: sorted(opened | {m.__file__ for m in list(sys.modules.values())
                                             if isinstance(getattr(m, "__file__", None), str)})
    sys.modules["_flashattn_site_inputs"] = record
_flashattn_site_inputs()
del _flashattn_site_inputs
"""
_KERNEL_REPORT = "__import__('json').dumps(__import__('_flashattn_site_inputs').report())"


async def _execute(nb, kernel_name: str, cwd: Path) -> list[str]:
    """Run every cell of `nb` in place in a fresh kernel; return the files the kernel read."""
    from jupyter_client.manager import AsyncKernelManager
    from nbclient import NotebookClient

    # Local sockets instead of TCP ports (the kernel warns that TCP is plain text), under an absolute
    # path: the kernel runs in the notebook's folder, the client in the build's.
    sockets = tempfile.mkdtemp(prefix="flashattn-kernel-")
    km = AsyncKernelManager(kernel_name=kernel_name, transport="ipc", ip=os.path.join(sockets, "kernel"))
    client = NotebookClient(nb, km=km, kernel_name=kernel_name, allow_errors=False,
                            resources={"metadata": {"path": str(cwd)}})
    client.reset_execution_trackers()

    async def hidden(code: str = "", **expressions) -> dict:
        msg_id = client.kc.execute(code, silent=True, store_history=False, user_expressions=expressions)
        reply = await client.async_wait_for_reply(msg_id)
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"the build's own kernel code failed: {reply['content']}")
        return reply["content"]

    try:
        async with client.async_setup_kernel(cleanup_kc=True):
            await hidden(_KERNEL_SETUP)
            info = await client.async_wait_for_reply(client.kc.kernel_info())
            nb.metadata["language_info"] = info["content"]["language_info"]
            for index, cell in enumerate(nb.cells):
                await client.async_execute_cell(cell, index, execution_count=client.code_cells_executed + 1)
            content = await hidden(files=_KERNEL_REPORT)
    finally:
        shutil.rmtree(sockets, ignore_errors=True)
    result = content["user_expressions"]["files"]
    if result.get("status") != "ok":
        raise RuntimeError(f"the kernel could not list what it read: {result}")
    return json.loads(ast.literal_eval(result["data"]["text/plain"]))


class Notebook:
    """One notebook's executed copy: from the cache, or executed on a thread of its own (started at once)."""

    def __init__(self, source: Path, kernel_name: str) -> None:
        self.source, self.kernel_name = Path(source), kernel_name
        self.unit = "notebook-" + self.source.stem
        self.path: Path | None = None
        self.error: BaseException | None = None
        self.seconds = 0.0
        hit = lookup(self.unit)
        self.cached = hit is not None
        if hit is not None:
            self.path = hit[0] / self.source.name
            self.thread = None
        else:
            self.thread = threading.Thread(target=self._run, name=f"execute {self.source.name}", daemon=True)
            self.thread.start()

    def _run(self) -> None:
        import nbformat

        try:
            start = time.time()
            nb = nbformat.read(self.source, as_version=4)
            read = asyncio.run(_execute(nb, self.kernel_name, self.source.parent))
            self.seconds = time.time() - start
            out = CACHE / "executed" / f"{os.getpid()}-{threading.get_ident()}" / self.source.name
            out.parent.mkdir(parents=True, exist_ok=True)
            nbformat.write(nb, out)
            inputs = {self.source} | {p for p in map(in_repo, read) if p is not None and p.is_file()}
            hit = lookup(self.unit) if store(self.unit, inputs, files={self.source.name: out}, since=start) else None
            if hit is not None:
                self.path = hit[0] / self.source.name
                shutil.rmtree(out.parent, ignore_errors=True)
            else:  # an input changed while it ran: show this run, store nothing
                self.path = out
        except BaseException as exc:  # noqa: BLE001 - re-raised on the build's thread by result()
            self.error = exc

    def result(self) -> Path:
        """The executed copy's path (waits for the execution; re-raises its error)."""
        if self.thread is not None:
            self.thread.join()
        if self.error is not None:
            raise self.error
        return self.path
