"""In-process A/B of the autograd layer's early replay (``flashattn.autograd.early_replay`` on and off).

    PYTHONPATH=. python -m benchmarks.early_replay_ab OUT_DIR

Four short eager shapes; for each, 15 interleaved rounds of back-to-back calls (400 forward calls,
or 150 forward + backward calls, per round) with the early replay on, off, and SDPA's efficient
backend, all in one process so that the host's drift between processes does not enter the ratio.
Reports the median per-call µs of each and the ratio off / on. Writes ``OUT_DIR/early_ab.json``
(committed: ``benchmarks/results/core/early_replay_ab.json``).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import warnings

import torch

SHAPES = [("B8 H16 N128 D128 bf16", (8, 16, 16, 128, 128, 128, torch.bfloat16, False)),
          ("B32 H12 N128 D64 fp16", (32, 12, 12, 128, 128, 64, torch.float16, False)),
          ("B8 H16 N256 D128 bf16 causal", (8, 16, 16, 256, 256, 128, torch.bfloat16, True)),
          ("B1 H16 N512 D64 bf16", (1, 16, 16, 512, 512, 64, torch.bfloat16, False))]
ROUNDS = 15


def per_call_us(fn, n: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def measure(shape) -> dict:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashattn
    from flashattn import autograd

    b, hq, hkv, n, m, d, dtype, causal = shape
    q = torch.randn(b, hq, n, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(b, hkv, m, d, device="cuda", dtype=dtype) for _ in range(2))
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    do = torch.randn_like(q)

    def ours(a, b_, c):
        return flashattn.attention(a, b_, c, causal=causal)

    def sdpa(a, b_, c):
        return F.scaled_dot_product_attention(a, b_, c, is_causal=causal)

    def forward(f):
        return lambda: f(q, k, v)

    def forward_backward(f):
        def step():
            torch.autograd.backward(f(qg, kg, vg), do)
        return step

    times = {}
    for pass_name, make, reps in (("fwd", forward, 400), ("fwd_bwd", forward_backward, 150)):
        for flag in (True, False):  # warm both paths (compile, record) before any timing
            with autograd.early_replay(flag):
                for _ in range(5):
                    make(ours)()
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            for _ in range(5):
                make(sdpa)()
        for _ in range(ROUNDS):
            for flag in (True, False):
                with autograd.early_replay(flag):
                    times.setdefault(f"{'on' if flag else 'off'}_{pass_name}", []).append(per_call_us(make(ours), reps))
            with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                times.setdefault(f"sdpa_{pass_name}", []).append(per_call_us(make(sdpa), reps))
    row = {key: round(statistics.median(vals), 1) for key, vals in times.items()}
    for pass_name in ("fwd", "fwd_bwd"):
        row[f"ratio_off_over_on_{pass_name}"] = round(row[f"off_{pass_name}"] / row[f"on_{pass_name}"], 3)
    return row


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python -m benchmarks.early_replay_ab OUT_DIR")
    warnings.filterwarnings("ignore")
    result = {}
    for name, shape in SHAPES:
        result[name] = measure(shape)
        print(name, result[name], flush=True)
    with open(f"{argv[0]}/early_ab.json", "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
