"""The results file: one JSON document per run, written as the run goes and read by the report.

Top-level keys (``SCHEMA`` names the version):

* ``environment`` -- GPU name, driver, CUDA, cuDNN, torch, triton, Python, date (UTC);
* ``config`` -- timing parameters and how each pass is timed; ``grid`` -- the settings measured;
* ``providers`` -- name -> label and how it is called;
* ``checks`` -- the correctness check of each provider (one shape per dtype x head dim x mask);
* ``measurements`` -- one record per setting x provider x pass (``fwd``/``bwd``): ``status`` is ``ok``
  (with ``ms``, ``flops``, ``tflops``), ``unsupported``, ``oom``, ``error`` (with the message) or
  ``skipped`` (not run by design, or the time budget ran out, with the reason);
* ``memory`` -- one record per setting x provider: peak bytes of a forward + backward;
* ``long_context`` -- the single-head N = 131072 run and the naive reference's attempt;
* ``complete`` -- False until the run has finished every setting.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

SCHEMA = "flashattn-benchmark/1"
STATUSES = ("ok", "unsupported", "oom", "error", "skipped")
PASSES = ("fwd", "bwd")
SETTING_KEYS = ("dtype", "head_dim", "causal", "seqlen", "batch", "heads")
TOP_KEYS = ("schema", "environment", "config", "grid", "providers", "checks", "measurements", "memory",
            "long_context", "complete")


def new_results(*, environment: dict, config: dict, grid: dict, providers: dict) -> dict:
    return {"schema": SCHEMA, "environment": environment, "config": config, "grid": grid,
            "providers": providers, "checks": [], "measurements": [], "memory": [], "long_context": None,
            "complete": False}


def validate(results: dict) -> None:
    """Raise ValueError naming the first thing a results document gets wrong."""
    if not isinstance(results, dict):
        raise ValueError("results must be a JSON object")
    missing = [k for k in TOP_KEYS if k not in results]
    if missing:
        raise ValueError(f"results lack the key(s) {missing}")
    if results["schema"] != SCHEMA:
        raise ValueError(f"schema is {results['schema']!r}, expected {SCHEMA!r}")
    for key in ("gpu", "torch", "triton", "date"):
        if key not in results["environment"]:
            raise ValueError(f"environment lacks {key!r}")
    for i, m in enumerate(results["measurements"]):
        where = f"measurements[{i}]"
        for key in (*SETTING_KEYS, "provider", "pass", "status"):
            if key not in m:
                raise ValueError(f"{where} lacks {key!r}")
        if m["pass"] not in PASSES:
            raise ValueError(f"{where}: pass {m['pass']!r} is not one of {PASSES}")
        if m["status"] not in STATUSES:
            raise ValueError(f"{where}: status {m['status']!r} is not one of {STATUSES}")
        if m["provider"] not in results["providers"]:
            raise ValueError(f"{where}: provider {m['provider']!r} is not listed under 'providers'")
        if m["status"] == "ok":
            for key in ("ms", "flops", "tflops"):
                if not isinstance(m.get(key), (int, float)) or not m[key] > 0:
                    raise ValueError(f"{where}: status ok needs a positive {key!r}, got {m.get(key)!r}")
        elif not m.get("error"):
            raise ValueError(f"{where}: status {m['status']!r} needs an 'error' that says why")
    for i, m in enumerate(results["memory"]):
        if m.get("status") not in STATUSES:
            raise ValueError(f"memory[{i}]: status {m.get('status')!r} is not one of {STATUSES}")
        if m["status"] == "ok" and not isinstance(m.get("peak_bytes"), int):
            raise ValueError(f"memory[{i}]: status ok needs an integer 'peak_bytes'")


def save(results: dict, path) -> Path:
    """Write atomically (a crash mid-write leaves the previous file), after validating."""
    validate(results)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(results, indent=1, allow_nan=False) + "\n")
    os.replace(tmp, path)
    return path


def load(path) -> dict:
    results = json.loads(Path(path).read_text())
    validate(results)
    return results
