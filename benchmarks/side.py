"""What the small side benchmarks share (``autograd_paths``, ``decode_splits``, ``split_kv_rule``, ``short``,
``first_call``): the
record of the machine and code they measured, and their command line (``--out DIR``, a CUDA GPU
required, ``DIR/NAME.json`` and ``DIR/NAME.md`` written, the table printed)."""

from __future__ import annotations

import argparse
import pathlib
import platform
import sys

import torch

from benchmarks import results as results_mod
from benchmarks.provenance import package_sources_sha256


def record(what: str, device, rows: list, **extra) -> dict:
    """A side benchmark's result: what it measured, the GPU, the versions and the package's sources hash."""
    import triton

    return {"what": what, "device": torch.cuda.get_device_name(device),
            "versions": {"torch": torch.__version__, "triton": triton.__version__,
                         "python": platform.python_version(), "flashattn_sources_sha256": package_sources_sha256()},
            **extra, "rows": rows}


def main(argv, doc: str, name: str, run, markdown) -> int:
    """Parse ``--out``, run ``run(device)`` on the GPU, save ``DIR/name.json`` and ``.md``, print the table."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--out", required=True, type=pathlib.Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"benchmarks.{name} needs a CUDA GPU", file=sys.stderr)
        return 2
    return write(args.out, name, run(torch.device("cuda")), markdown)


def write(out: pathlib.Path, name: str, result: dict, markdown) -> int:
    """Save ``out/name.json`` and ``.md`` (the table ``markdown(result)``), print the table; returns 0."""
    table = markdown(result)
    results_mod.save_table(out, name, result, table)
    print(table)
    return 0
