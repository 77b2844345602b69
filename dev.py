"""Set up the project in ./.venv and serve the site or run the tests: the README's two commands.

    python3 dev.py serve    # install everything, then serve the site at http://127.0.0.1:8000
    python3 dev.py test     # install everything, then run the whole test suite

Extra arguments go to ``mkdocs serve`` or ``pytest``. Only Python (3.10+) is needed beforehand.
Set FLASHATTN_TORCH to choose the torch requirement (default ``torch==2.13.0``).
"""

from __future__ import annotations

import hashlib
import os
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


def setup() -> None:
    """Create .venv and install the package with its docs, test and bench extras (skipped when current)."""
    if not PY.exists():
        print(f"+ creating {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    torch_req = os.environ.get("FLASHATTN_TORCH", "torch==2.13.0")
    wanted = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + torch_req.encode()).hexdigest()
    if STAMP.exists() and STAMP.read_text() == wanted:
        return
    # torch first, pinned: an unpinned torch pulls a multi-GB CUDA build where a CPU one will do.
    run(str(PY), "-m", "pip", "install", "--quiet", torch_req)
    run(str(PY), "-m", "pip", "install", "--quiet", "-e", ".[docs,test,bench]")
    STAMP.write_text(wanted)


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("serve", "test", "setup"):
        print(__doc__)
        return 2
    setup()
    command, rest = argv[0], argv[1:]
    if command == "serve":
        return subprocess.call([str(BIN / "mkdocs"), "serve", "-a", "127.0.0.1:8000", *rest], cwd=ROOT)
    if command == "test":
        return subprocess.call([str(PY), "-m", "pytest", *rest], cwd=ROOT)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
