"""The development loop: ``dev.py serve`` passes signals on, and the site build's cache of derivation and
notebook results is keyed by everything those read.

The serve test runs ``dev.py serve`` on a one-page site (not this project's: building it takes a
minute) at a free loopback port, sends it a signal, and checks that the port is released and that no
process of the group it started survives.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


dev = _load("flashattn_dev", ROOT / "dev.py")


# ------------------------------------------------------------------------------------------------
# dev.py
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, default", [
    ([], True),
    (["--strict"], True),
    (["-a", "127.0.0.1:9001"], False),
    (["-a127.0.0.1:9001"], False),
    (["--dev-addr", "127.0.0.1:9001"], False),
    (["--dev-addr=127.0.0.1:9001"], False),
])
def test_serve_adds_the_default_address_only_when_none_is_given(args, default):
    cmd = dev.command_for("serve", args)
    assert cmd[1] == "serve" and cmd[len(cmd) - len(args):] == args
    assert ("127.0.0.1:8000" in cmd) == default
    assert sum(a in ("-a", "--dev-addr") or a.startswith(("-a1", "--dev-addr=")) for a in cmd) == 1  # one address


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


@pytest.mark.skipif(os.name != "posix", reason="process groups and POSIX signals")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_dev_serve_stops_the_server(tmp_path, sig):
    if not dev.is_current():
        pytest.skip("dev.py would install the environment first (.venv is missing or stale)")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# A page\n")
    (tmp_path / "mkdocs.yml").write_text("site_name: signal test\ntheme: mkdocs\n")
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "dev.py"), "serve", "-f", str(tmp_path / "mkdocs.yml"),
         "-a", f"127.0.0.1:{port}", "--no-livereload"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )
    try:
        if not _wait(lambda: _listening(port) or proc.poll() is not None, 30):
            pytest.fail("dev.py serve did not start listening within 30 s")
        assert proc.poll() is None, proc.stderr.read().decode()
        proc.send_signal(sig)  # to dev.py's own process id only, as a `kill PID` or a supervisor does
        assert _wait(lambda: proc.poll() is not None, 10), "dev.py still runs 10 s after the signal"
        assert _wait(lambda: not _listening(port), 5), f"port {port} still served after dev.py exited"
        assert _wait(lambda: not _group_alive(proc.pid), 5), "a process dev.py started outlived it"
    finally:
        if _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        proc.stderr.close()


# ------------------------------------------------------------------------------------------------
# python -m derivations
# ------------------------------------------------------------------------------------------------
def test_python_m_derivations_reports_each_check_before_the_next_starts(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT))
    from derivations import CheckResult
    from derivations import __main__ as cli

    seen_before = []

    def fake_run_module(name):
        seen_before.append(capsys.readouterr().err)  # what was printed before this check started
        ok = name != "merge"
        return CheckResult(identity=f"identity of {name}", method="m", sizes="s", passed=ok,
                           negative_control_rejected=True, details=[f"detail of {name}"],
                           module=f"derivations.{name}"), 0.5

    monkeypatch.setattr(cli, "run_module", fake_run_module)
    assert cli.main(["--only", "online_softmax", "merge", "d_identity"]) == 1  # merge fails: exit 1
    rest = capsys.readouterr()
    assert seen_before[0] == ""
    assert "[ 1/3] pass" in seen_before[1] and "identity of online_softmax" in seen_before[1]
    assert "[ 2/3] FAIL" in seen_before[2] and "identity of merge" in seen_before[2]
    assert "[ 3/3] pass" in rest.err and "identity of d_identity" in rest.err
    # the final table still lists every check, with the failing one's details
    assert all(f"identity of {n}" in rest.out for n in ("online_softmax", "merge", "d_identity"))
    assert "detail of merge" in rest.out
    assert "2/3 identities pass" in rest.out and "FAILED" in rest.out


# ------------------------------------------------------------------------------------------------
# the build's cache (docs/hooks/site_cache.py)
# ------------------------------------------------------------------------------------------------
site_cache = _load("flashattn_site_cache", ROOT / "docs" / "hooks" / "site_cache.py")


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A throwaway repository root with its own cache folder."""
    monkeypatch.setattr(site_cache, "ROOT", tmp_path)
    monkeypatch.setattr(site_cache, "CACHE", tmp_path / ".cache" / "site")
    return tmp_path


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_import_closure_follows_every_import_of_the_repository(repo):
    _write(repo / "pkg" / "__init__.py", "from pkg import a\n")
    _write(repo / "pkg" / "a.py", "import os\n\ndef f():\n    from . import b  # inside a function\n")
    _write(repo / "pkg" / "b.py", "from .sub.c import x\n")
    _write(repo / "pkg" / "sub" / "__init__.py", "")
    _write(repo / "pkg" / "sub" / "c.py", "x = 1\n")
    _write(repo / "pkg" / "unused.py", "")
    _write(repo / "pkg" / "lazy.py", "import importlib\n\ndef load(n):\n    return importlib.import_module(f'pkg.{n}')\n")
    _write(repo / "main.py", "import pkg.a\n")
    _write(repo / "dyn.py", "import pkg.lazy\n")
    rel = lambda paths: sorted(p.relative_to(repo).as_posix() for p in paths)  # noqa: E731
    assert rel(site_cache.import_closure([repo / "main.py"], [repo])) == [
        "main.py", "pkg/__init__.py", "pkg/a.py", "pkg/b.py", "pkg/sub/__init__.py", "pkg/sub/c.py"]
    # a computed import_module counts as the whole package, unless the file is the unit's runner
    assert "pkg/unused.py" in rel(site_cache.import_closure([repo / "dyn.py"], [repo]))
    assert "pkg/unused.py" not in rel(site_cache.import_closure([repo / "dyn.py"], [repo], runner=repo / "pkg" / "lazy.py"))


def test_an_entry_is_used_only_while_every_input_is_unchanged(repo, monkeypatch):
    src = _write(repo / "m.py", "VALUE = 1\n")
    monkeypatch.setattr(site_cache, "STARTED", time.time() + 1)  # as if this process started after the edit
    calls = []

    def fn():
        calls.append(1)
        return {"value": src.read_text()}

    assert site_cache.cached_call("unit", fn, [src]) == ({"value": "VALUE = 1\n"}, False)
    assert site_cache.cached_call("unit", fn, [src]) == ({"value": "VALUE = 1\n"}, True)
    src.write_text("VALUE = 2\n")
    monkeypatch.setattr(site_cache, "STARTED", time.time() + 1)
    assert site_cache.cached_call("unit", fn, [src]) == ({"value": "VALUE = 2\n"}, False)
    src.write_text("VALUE = 1\n")  # reverted: the first entry is still there
    assert site_cache.cached_call("unit", fn, [src]) == ({"value": "VALUE = 1\n"}, True)
    assert len(calls) == 2
    # a file opened while the unit ran is an input too
    data = _write(repo / "data.txt", "a")
    assert site_cache.cached_call("reads", lambda: data.read_text(), [src]) == ("a", False)
    data.write_text("b")
    assert site_cache.cached_call("reads", lambda: data.read_text(), [src]) == ("b", False)


def test_an_entry_depends_on_the_reachable_modules_that_ran_not_on_the_others(repo, monkeypatch):
    """A module the unit can import but never executed (an import inside a function it did not call)
    is no input: editing it keeps the entry; editing a module it executed does not."""
    import sys

    _write(repo / "lib_used.py", "X = 1\n")
    _write(repo / "lib_idle.py", "Y = 2\n")
    start = _write(repo / "unit_mod.py", "import lib_used\n\ndef later():\n    import lib_idle\n")
    monkeypatch.setattr(site_cache, "STARTED", time.time() + 1)
    monkeypatch.syspath_prepend(str(repo))
    for name in ("unit_mod", "lib_used", "lib_idle"):
        monkeypatch.delitem(sys.modules, name, raising=False)

    def fn():
        import unit_mod  # noqa: F401  (executes lib_used, not lib_idle)

        return "drawn"

    assert site_cache.cached_call("unit", fn, [start], roots=(repo,)) == ("drawn", False)
    assert "lib_idle" not in sys.modules
    (repo / "lib_idle.py").write_text("Y = 3\n")
    assert site_cache.cached_call("unit", fn, [start], roots=(repo,)) == ("drawn", True)
    (repo / "lib_used.py").write_text("X = 5\n")
    assert site_cache.cached_call("unit", fn, [start], roots=(repo,)) == ("drawn", False)


def test_a_result_made_from_a_file_edited_after_the_process_started_is_not_stored(repo):
    src = _write(repo / "m.py", "VALUE = 1\n")
    os.utime(src, (time.time() + 5, time.time() + 5))  # edited after this process imported its code
    assert site_cache.cached_call("unit", lambda: 1, [src]) == (1, False)
    assert site_cache.cached_call("unit", lambda: 1, [src]) == (1, False)


def test_a_notebook_is_executed_again_when_a_module_its_kernel_imported_changes(repo):
    nbformat = pytest.importorskip("nbformat")
    helper = _write(repo / "nbs" / "helper.py", "VALUE = 6 * 7\n")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import helper\nprint(helper.VALUE)")])
    nbformat.write(nb, repo / "nbs" / "demo.ipynb")

    def run():
        notebook = site_cache.Notebook(repo / "nbs" / "demo.ipynb", "python3")
        executed = nbformat.read(notebook.result(), as_version=4)
        return notebook.cached, executed.cells[0].outputs[0]["text"]

    assert run() == (False, "42\n")
    assert run() == (True, "42\n")
    manifest = site_cache.lookup("notebook-demo")[1]
    assert {"nbs/demo.ipynb", "nbs/helper.py"} <= set(manifest["inputs"])
    helper.write_text("VALUE = 43\n")
    assert run() == (False, "43\n")
