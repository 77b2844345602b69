"""Executable derivations of the FlashAttention forward and backward pass.

One module per identity the site states; each has the same shape — statement (its docstring),
symbolic proof, numeric cross-check, negative control — and exposes one function, ``check()``, that
returns a :class:`CheckResult`. ``python -m derivations`` runs them all and prints a table.

The modules are imported only when run, so ``from derivations.cost_model import attention_flops``
(the FLOP formula the benchmarks use) stays light.
"""

from __future__ import annotations

import importlib
import time

from ._result import CheckResult

# In the order of the site's Math section (each module's page is the one whose
# `<!-- flashattn:derivation NAME -->` directive names it; the docs hook finds it there).
MODULES = (
    "online_softmax",
    "matmul_backward",
    "softmax_backward",
    "d_identity",
    "delta_before_loop",
    "softmax_scale",
    "base2_lse",
    "lse_gradient",
    "masking_hazards",
    "masked_loads",
    "causal_masking",
    "sliding_window",
    "softcap",
    "sinks",
    "alibi",
    "dropout",
    "stacked_variants",
    "cost_model",
    "io_complexity",
    "backward_precision",
    "merge",
    "fp8_scales",
    "errata",
)


def run_module(name: str) -> tuple[CheckResult, float]:
    """Run one module's check; an exception is a failed check, never a crash of the runner."""
    start = time.perf_counter()
    try:
        result = importlib.import_module(f"{__name__}.{name}").check()
    except Exception as exc:  # noqa: BLE001 - reported as a failed row
        result = CheckResult(identity=name, method="-", sizes="-", passed=False,
                             negative_control_rejected=False,
                             details=[f"check() raised {type(exc).__name__}: {exc}"],
                             module=f"{__name__}.{name}")
    return result, time.perf_counter() - start


def run_all(names=MODULES) -> list[tuple[CheckResult, float]]:
    return [run_module(name) for name in names]


def as_rows(results) -> list[dict]:
    """The rows the site and ``--json`` show (no timings, so the output is the same on every machine)."""
    return [
        {
            "module": r.module,
            "identity": r.identity,
            "method": r.method,
            "sizes": r.sizes,
            "result": "pass" if r.passed else "FAIL",
            "passed": r.passed,
            "negative_control": r.negative_control,
            "negative_control_rejected": r.negative_control_rejected,
            "details": r.details,
        }
        for r, _ in results
    ]


def all_good(results) -> bool:
    return all(r.passed and r.negative_control_rejected for r, _ in results)


__all__ = ["CheckResult", "MODULES", "all_good", "as_rows", "run_all", "run_module"]
