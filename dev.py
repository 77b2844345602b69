"""Set up the project in ./.venv and serve the site or run the tests: the README's two commands.

    python3 dev.py serve    # install everything, then serve the site at http://127.0.0.1:8000
    python3 dev.py test     # install everything, then run the whole test suite

Extra arguments go to ``mkdocs serve`` (``-a HOST:PORT`` replaces the default address) or ``pytest``.
Only Python (3.10+) is needed beforehand. Set FLASHATTN_TORCH to choose the torch requirement (default
``torch==2.13.0``).

After the setup, this process *becomes* ``mkdocs serve`` or ``pytest`` (``os.execv``): Ctrl-C, SIGTERM
or a kill of this process's id reach the server or the tests themselves, so nothing is left running.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PY = BIN / ("python.exe" if os.name == "nt" else "python")
STAMP = VENV / ".flashattn-installed"


def run(*cmd: str) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)


def _torch_requirement() -> str:
    return os.environ.get("FLASHATTN_TORCH", "torch==2.13.0")


def _wanted_stamp() -> str:
    return hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + _torch_requirement().encode()).hexdigest()


def is_current() -> bool:
    """Whether .venv already holds what pyproject.toml and FLASHATTN_TORCH ask for (setup() then does nothing)."""
    return PY.exists() and STAMP.exists() and STAMP.read_text() == _wanted_stamp()


def setup() -> None:
    """Create .venv and install the package with its docs, test and bench extras (skipped when current)."""
    if is_current():
        return
    if not PY.exists():
        print(f"+ creating {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    torch_req, wanted = _torch_requirement(), _wanted_stamp()
    # torch first, pinned: an unpinned torch pulls a multi-GB CUDA build where a CPU one will do.
    run(str(PY), "-m", "pip", "install", "--quiet", torch_req)
    run(str(PY), "-m", "pip", "install", "--quiet", "-e", ".[docs,test,bench]")
    STAMP.write_text(wanted)


def has_address(args: list[str]) -> bool:
    """Whether ``mkdocs serve`` arguments already name the address (``-a X``, ``-aX``, ``--dev-addr[=]X``)."""
    return any(a == "-a" or (a.startswith("-a") and not a.startswith("--")) or a == "--dev-addr"
               or a.startswith("--dev-addr=") for a in args)


def command_for(command: str, rest: list[str]) -> list[str]:
    """The command line that `command` (serve or test) runs, extra arguments included."""
    if command == "serve":
        address = [] if has_address(rest) else ["-a", "127.0.0.1:8000"]
        return [str(BIN / "mkdocs"), "serve", *address, *rest]
    return [str(PY), "-m", "pytest", *rest]


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("serve", "test", "setup"):
        print(__doc__)
        return 2
    setup()
    command, rest = argv[0], argv[1:]
    if command == "setup":
        return 0
    cmd = command_for(command, rest)
    # Material prints a notice about its end of life at every start unless this is set.
    os.environ.setdefault("NO_MKDOCS_2_WARNING", "1")
    os.chdir(ROOT)
    sys.stdout.flush()
    sys.stderr.flush()
    if os.name == "nt":  # Windows has no exec that keeps the process: wait on a child instead.
        return subprocess.call(cmd)
    if command == "serve":
        # A shell starts a background job with SIGINT ignored, and exec keeps that: the server would then
        # outlive a `kill -INT`. Ctrl-C or SIGINT stops the server wherever it was started from.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.execv(cmd[0], cmd)  # replaces this process: signals sent to it reach mkdocs or pytest
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
