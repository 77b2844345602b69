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
