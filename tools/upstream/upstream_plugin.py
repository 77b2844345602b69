"""pytest plugin for ``tools/upstream/run.py``: samples flash_attn's upstream tests, stops starting new
ones when the time budget is spent, and records every item's outcome with the exception behind it.

Loaded with ``-p upstream_plugin`` (``tools/upstream`` on ``sys.path``). Under pytest-xdist each worker
collects, samples (deterministically, so every worker agrees) and classifies; the controller (or the
single process without xdist) appends one JSON line per report to ``--upstream-log``.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import defaultdict

import pytest

BUDGET_REASON = "upstream-run: time budget spent before this item started"
PROPS_KEY = "upstream"


def pytest_addoption(parser):
    group = parser.getgroup("upstream", "flash_attn upstream tests against flashattn")
    group.addoption("--upstream-per-function", type=int, default=0,
                    help="run at most this many items of each test function (0: all)")
    group.addoption("--upstream-seed", default="0", help="salt of the hash that picks the sample")
    group.addoption("--upstream-only", default="", help="comma-separated test function names to keep")
    group.addoption("--upstream-deadline", type=float, default=0.0,
                    help="epoch seconds after which no new item starts (0: none)")
    group.addoption("--upstream-log", default="", help="JSON lines file for the reports")
    group.addoption("--upstream-collection", default="", help="JSON file for the collection and sample")
    group.addoption("--upstream-fake-capability", default="",
                    help="'major.minor' for torch.cuda.get_device_capability when no CUDA device is "
                         "present (collection only: the upstream file queries it at import)")


def _worker() -> str | None:
    return os.environ.get("PYTEST_XDIST_WORKER")


def pytest_configure(config):
    global _log
    path = config.getoption("--upstream-log")
    if path and _worker() is None:
        _log = open(path, "a", buffering=1)
    fake = config.getoption("--upstream-fake-capability")
    if fake:
        import torch

        if not torch.cuda.is_available():
            major, minor = (int(p) for p in fake.split("."))
            # The upstream module picks its dtype parametrization from the capability at import.
            torch.cuda.get_device_capability = lambda device=None: (major, minor)
    import flash_attn

    if not getattr(flash_attn, "IS_FLASHATTN_SHIM", False):
        raise pytest.UsageError(f"'import flash_attn' found {flash_attn.__file__}, not the shim in tools/upstream: "
                                "put tools/upstream first on PYTHONPATH")


def _function(item) -> str:
    return getattr(item, "originalname", None) or item.name.split("[")[0]


def _rank(seed: str, nodeid: str) -> str:
    return hashlib.sha256(f"{seed}:{nodeid}".encode()).hexdigest()


def _environment() -> dict:
    import flash_attn
    import flashattn
    import torch

    info = {"torch": torch.__version__, "shim": flash_attn.__file__, "flashattn": flashattn.__file__,
            "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def _pick(config, name: str, nodeids: list[str]) -> set[str]:
    """The sampled node ids of one test function: the ``--upstream-per-function`` lowest hashes."""
    only = {n for n in config.getoption("--upstream-only").split(",") if n}
    if only and name not in only:
        return set()
    per_function = config.getoption("--upstream-per-function")
    seed = config.getoption("--upstream-seed")
    ranked = sorted(nodeids, key=lambda nodeid: _rank(seed, nodeid))
    return set(ranked[:per_function] if per_function > 0 else ranked)


_generated: dict[str, int] = {}  # test function -> parameter sets before sampling


@pytest.hookimpl(trylast=True)
def pytest_generate_tests(metafunc):
    # The file parametrizes about 500,000 items, and building each pytest item costs far more than its
    # parameter set: sample the parameter sets here, after pytest's own parametrize has run, and let
    # pytest build only the sampled items. Node ids are the definition's id plus "[<callspec id>]".
    calls = getattr(metafunc, "_calls", None)
    if not calls or not hasattr(calls[0], "id"):
        return  # another pytest: pytest_collection_modifyitems samples the built items instead
    name = metafunc.definition.originalname
    base = metafunc.definition.nodeid
    keep = _pick(metafunc.config, name, [f"{base}[{c.id}]" for c in calls])
    _generated[name] = len(calls)
    metafunc._calls = [c for c in calls if f"{base}[{c.id}]" in keep]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    groups: dict[str, list] = defaultdict(list)
    for item in items:
        groups[_function(item)].append(item)
    seed = config.getoption("--upstream-seed")
    picked: dict[str, list] = {}
    for name, group in groups.items():
        keep = _pick(config, name, [it.nodeid for it in group])
        picked[name] = sorted((it for it in group if it.nodeid in keep), key=lambda it: _rank(seed, it.nodeid))
    # Round robin over the functions (in file order), so a budget that runs out cuts every function
    # at about the same depth instead of dropping the last ones.
    order = []
    depth = max((len(p) for p in picked.values()), default=0)
    for i in range(depth):
        for name in groups:
            if i < len(picked[name]):
                order.append(picked[name][i])
    chosen = {id(it) for it in order}
    deselected = [it for it in items if id(it) not in chosen]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
    items[:] = order
    path = config.getoption("--upstream-collection")
    if path and _worker() in (None, "gw0"):
        record = {"collected": {name: _generated.get(name, len(group)) for name, group in groups.items()},
                  "sampled": [it.nodeid for it in order], "sampled_before_build": sorted(_generated),
                  "per_function": config.getoption("--upstream-per-function"),
                  "seed": config.getoption("--upstream-seed"), "environment": _environment()}
        with open(path, "w") as f:
            json.dump(record, f, indent=1)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    deadline = item.config.getoption("--upstream-deadline")
    if deadline and time.time() > deadline:
        pytest.skip(BUDGET_REASON)


def _origin(path: str, test_file: str) -> str:
    path = path.replace(os.sep, "/")
    if "/tools/upstream/flash_attn/" in path:
        return "shim"
    if "/flashattn/" in path:
        return "flashattn"
    if os.path.basename(path) == os.path.basename(test_file):
        return "upstream test"
    for name in ("torch", "triton", "einops"):
        if f"/{name}/" in path:
            return name
    return "other"


def _type_name(exc: BaseException) -> str:
    module = type(exc).__module__
    return type(exc).__qualname__ if module == "builtins" else f"{module}.{type(exc).__qualname__}"


def _classify(excinfo, test_file: str) -> dict:
    from flash_attn.flash_attn_interface import NoAttentionProbabilities

    exc = excinfo.value
    entries = list(excinfo.traceback)
    innermost = entries[-1] if entries else None
    origin = _origin(str(innermost.path), test_file) if innermost is not None else "other"
    flashattn_frame = None
    for entry in reversed(entries):
        if _origin(str(entry.path), test_file) == "flashattn":
            flashattn_frame = f"{os.path.basename(str(entry.path))}:{entry.lineno + 1} {entry.name}"
            break
    # The test read the attention probabilities that flash_attn returns with return_attn_probs=True
    # and flashattn returned None in their place.
    reads_missing_probs = any(entry.name == "convert_flash_attn_S_to_softmax" and entry.locals.get("S", 0) is None
                              for entry in entries)
    message = str(exc).strip()
    if isinstance(exc, pytest.fail.Exception) and message.startswith("Timeout"):
        category = "timeout"
    elif isinstance(exc, NoAttentionProbabilities) or reads_missing_probs:
        category = "no_probs"
    elif isinstance(exc, NotImplementedError):
        category = "not_implemented"
    elif isinstance(exc, AssertionError) and origin == "upstream test":
        category = "failed"
    else:
        category = "error"
    return {"category": category, "exc_type": _type_name(exc),
            "message": message[:400], "origin": origin, "flashattn_frame": flashattn_frame,
            "where": f"{os.path.basename(str(innermost.path))}:{innermost.lineno + 1} {innermost.name}"
            if innermost is not None else None}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.excinfo is None or call.excinfo.errisinstance(pytest.skip.Exception):
        return
    info = _classify(call.excinfo, str(item.path))
    info["stdout_tail"] = report.capstdout[-1200:]
    report.user_properties.append((PROPS_KEY, info))


def _skip_reason(report) -> str | None:
    if report.skipped and isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
        return str(report.longrepr[2])
    return None


_log = None  # the controller's (or the single process's) JSON lines file


def _write(record: dict):
    if _log is not None:
        _log.write(json.dumps(record) + "\n")


def pytest_runtest_logreport(report):
    props = dict(report.user_properties).get(PROPS_KEY)
    longrepr = None
    if report.failed and props is None:
        longrepr = str(report.longrepr)[-1200:]  # e.g. a crashed xdist worker: no worker-side record
    _write({"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
            "duration": round(report.duration, 3), "skip_reason": _skip_reason(report), "info": props,
            "longrepr": longrepr, "time": time.time()})


def pytest_collectreport(report):
    if report.failed:
        _write({"nodeid": report.nodeid, "when": "collect", "outcome": "failed", "duration": 0.0,
                "skip_reason": None, "info": None, "longrepr": str(report.longrepr)[-3000:],
                "time": time.time()})
