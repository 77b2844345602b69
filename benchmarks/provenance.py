"""Which code a benchmark measured: one hash of the package's sources, and the commit that holds them.

Every results file records :func:`package_sources_sha256` of the ``flashattn`` it imported; the report
looks the hash up in the git history (:func:`commit_with_sources`) to name the commit, and says so
when the committed files no longer match.
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent  # git runs here: "flashattn" pathspecs are relative to it


def sources_sha256(package_dir) -> str:
    """One hash of every ``.py`` file of a package (relative paths and bytes, sorted): the identity of the
    code a run measured, which a stale or dirty git checkout cannot misreport."""
    root = Path(package_dir)
    return _digest({path.relative_to(root).as_posix(): path.read_bytes() for path in root.rglob("*.py")})


def package_sources_sha256() -> str:
    """:func:`sources_sha256` of the imported ``flashattn``: what every results file records as the code it measured."""
    import flashattn

    return sources_sha256(Path(flashattn.__file__).parent)


def _digest(files: dict) -> str:
    """SHA-256 over ``{relative path: bytes}``, paths sorted: one rule for the files on disk and in git."""
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + files[name] + b"\0")
    return digest.hexdigest()


def sources_sha256_at(commit: str, repo=None) -> str | None:
    """:func:`sources_sha256` of ``flashattn/`` as ``commit`` holds it (read with ``git archive``, nothing
    checked out), or None where there is no git history or no such commit. Equal to the hash of the
    imported package exactly when that commit describes the code that ran."""
    import io
    import tarfile

    try:
        res = subprocess.run(["git", "archive", "--format=tar", commit, "flashattn"], capture_output=True,
                             timeout=30, cwd=repo or REPO_ROOT)
    except Exception:  # noqa: BLE001 -- no git
        return None
    if res.returncode != 0:
        return None
    files = {}
    with tarfile.open(fileobj=io.BytesIO(res.stdout)) as tar:
        for member in tar.getmembers():
            if member.isfile() and member.name.endswith(".py"):
                files[member.name.removeprefix("flashattn/")] = tar.extractfile(member).read()
    return _digest(files)


def commit_with_sources(sha256: str, max_count: int = 200, repo=None) -> str | None:
    """The newest of the last ``max_count`` commits whose ``flashattn/`` hashes to ``sha256``, or None."""
    log = _git("log", f"--max-count={max_count}", "--format=%H", "--", "flashattn", cwd=repo)
    for commit in (log or "").split():
        if sources_sha256_at(commit, repo) == sha256:
            return commit
    return None


def _git(*args, cwd=None) -> str | None:
    try:
        res = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, cwd=cwd or REPO_ROOT)
        return res.stdout.strip() if res.returncode == 0 else None
    except Exception:  # noqa: BLE001 -- no git, or not a checkout
        return None
