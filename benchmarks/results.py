"""The results file: one JSON document per run, written as the run goes and read by the report.

Top-level keys (``SCHEMA`` names the version):

* ``environment`` -- GPU name, driver, CUDA, cuDNN, torch, triton, Python, date (UTC);
* ``config`` -- timing parameters and how each pass is timed; ``grid`` -- the settings measured;
* ``providers`` -- name -> label and how it is called;
* ``checks`` -- the correctness check of each provider (one shape per dtype x head dim x mask);
* ``measurements`` -- one record per setting x provider x pass (``fwd``/``bwd``): ``status`` is ``ok``
  (with ``ms``, ``flops``, ``tflops``, and in runs that recorded it ``host_us``, the host's time per
  call), ``unsupported``, ``oom``, ``error`` (with the message) or ``skipped`` (not run by design, or
  the time budget ran out, with the reason);
* ``memory`` -- one record per setting x provider: peak bytes of a forward + backward;
* ``long_context`` -- the single-head N = 131072 run and the naive reference's attempt;
* ``latency`` -- per-call wall-clock time at small shapes (:mod:`benchmarks.latency`), or absent/None
  when the run did not measure it: ``config`` (how), ``records`` (one per shape x provider x mode x
  pass, ``us_per_call`` and ``host_us_per_call`` when ``ok``);
* ``complete`` -- False until the run has finished every setting.

Schema 2 added ``kv_heads`` (None: as many as ``heads``) and ``gqa`` (how a provider ran grouped-query
attention) to the records, and the ``latency`` section; files of schema 1 still load.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

SCHEMA = "flashattn-benchmark/2"
READABLE_SCHEMAS = ("flashattn-benchmark/1", SCHEMA)
STATUSES = ("ok", "unsupported", "oom", "error", "skipped")
PASSES = ("fwd", "bwd")
LATENCY_PASSES = ("fwd", "fwd_bwd")
LATENCY_MODES = ("eager", "eager-one-thread", "compile", "reduce-overhead")
REQUIRED_SETTING_KEYS = ("dtype", "head_dim", "causal", "seqlen", "batch", "heads")
SETTING_KEYS = (*REQUIRED_SETTING_KEYS, "kv_heads")  # what a new record carries
TOP_KEYS = ("schema", "environment", "config", "grid", "providers", "checks", "measurements", "memory",
            "long_context", "complete")


def new_results(*, environment: dict, config: dict, grid: dict, providers: dict) -> dict:
    return {"schema": SCHEMA, "environment": environment, "config": config, "grid": grid,
            "providers": providers, "checks": [], "measurements": [], "memory": [], "long_context": None,
            "latency": None,
            "complete": False}


def validate(results: dict) -> None:
    """Raise ValueError naming the first thing a results document gets wrong."""
    if not isinstance(results, dict):
        raise ValueError("results must be a JSON object")
    missing = [k for k in TOP_KEYS if k not in results]
    if missing:
        raise ValueError(f"results lack the key(s) {missing}")
    if results["schema"] not in READABLE_SCHEMAS:
        raise ValueError(f"schema is {results['schema']!r}, expected one of {READABLE_SCHEMAS}")
    for key in ("gpu", "torch", "triton", "date"):
        if key not in results["environment"]:
            raise ValueError(f"environment lacks {key!r}")
    for i, m in enumerate(results["measurements"]):
        where = f"measurements[{i}]"
        for key in (*REQUIRED_SETTING_KEYS, "provider", "pass", "status"):
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
            if "host_us" in m and not (isinstance(m["host_us"], (int, float)) and m["host_us"] > 0):
                raise ValueError(f"{where}: 'host_us' must be a positive number, got {m['host_us']!r}")
        elif not m.get("error"):
            raise ValueError(f"{where}: status {m['status']!r} needs an 'error' that says why")
    for i, m in enumerate(results["memory"]):
        if m.get("status") not in STATUSES:
            raise ValueError(f"memory[{i}]: status {m.get('status')!r} is not one of {STATUSES}")
        if m["status"] == "ok" and not isinstance(m.get("peak_bytes"), int):
            raise ValueError(f"memory[{i}]: status ok needs an integer 'peak_bytes'")
    validate_latency(results.get("latency"), results["providers"])


def validate_latency(latency, providers) -> None:
    """The latency section may be absent (None); when present every record must say what it is."""
    if latency is None:
        return
    if not isinstance(latency, dict) or "config" not in latency or "records" not in latency:
        raise ValueError("latency must be an object with 'config' and 'records'")
    for i, r in enumerate(latency["records"]):
        where = f"latency.records[{i}]"
        for key in (*REQUIRED_SETTING_KEYS, "provider", "mode", "pass", "status"):
            if key not in r:
                raise ValueError(f"{where} lacks {key!r}")
        if r["pass"] not in LATENCY_PASSES:
            raise ValueError(f"{where}: pass {r['pass']!r} is not one of {LATENCY_PASSES}")
        if r["mode"] not in LATENCY_MODES:
            raise ValueError(f"{where}: mode {r['mode']!r} is not one of {LATENCY_MODES}")
        if r["status"] not in STATUSES:
            raise ValueError(f"{where}: status {r['status']!r} is not one of {STATUSES}")
        if r["provider"] not in providers:
            raise ValueError(f"{where}: provider {r['provider']!r} is not listed under 'providers'")
        if r["status"] == "ok":
            for key in ("us_per_call", "host_us_per_call"):
                if not isinstance(r.get(key), (int, float)) or not r[key] > 0:
                    raise ValueError(f"{where}: status ok needs a positive {key!r}, got {r.get(key)!r}")
        elif not r.get("error"):
            raise ValueError(f"{where}: status {r['status']!r} needs an 'error' that says why")


def save(results: dict, path) -> Path:
    """Write atomically (a crash mid-write leaves the previous file), after validating."""
    validate(results)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(results, indent=1, allow_nan=False) + "\n")
    os.replace(tmp, path)
    return path


def save_table(out_dir, name: str, result: dict, markdown: str) -> tuple[Path, Path]:
    """A side benchmark's (decode, variants, varlen) ``name.json`` and ``name.md`` in ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = out_dir / f"{name}.json", out_dir / f"{name}.md"
    paths[0].write_text(json.dumps(result, indent=1))
    paths[1].write_text(markdown)
    return paths


def load(path) -> dict:
    results = json.loads(Path(path).read_text())
    validate(results)
    return results
