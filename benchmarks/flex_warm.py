"""Worker of :func:`benchmarks.run.precompile_flex`: compile FlexAttention for some settings, time nothing.

    python -m benchmarks.flex_warm '<JSON list of Setting dicts>'

Runs one forward and one backward per setting through the same ``Flex.prepare`` the timing process
uses, so the compiled graphs and Triton kernels land in the shared on-disk caches.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from benchmarks import measure
from benchmarks.grid import Setting
from benchmarks.providers import PROVIDERS


def main(argv) -> int:
    settings = [Setting.from_dict(d) for d in json.loads(argv[0])]
    flex, failures = PROVIDERS["flex"], 0
    for setting in settings:
        t0 = time.monotonic()
        try:
            fn = flex.prepare(setting, "cuda")
            q, k, v, do = measure.make_inputs(setting, "cuda")
            fn(q, k, v).backward(do, retain_graph=True)
            torch.cuda.synchronize()
            print(f"compiled {setting.label()} in {time.monotonic() - t0:.1f} s", flush=True)
        except Exception as exc:  # noqa: BLE001 -- the timing process records the failure itself
            failures += 1
            print(f"failed {setting.label()}: {type(exc).__name__}: {exc}"[:500], flush=True)
        finally:
            torch.cuda.empty_cache()
    print(f"done: {len(settings) - failures} of {len(settings)} compiled", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
