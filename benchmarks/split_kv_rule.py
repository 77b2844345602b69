"""Where the dense entry point should hand a call to the split-KV kernels: both paths timed, one run.

    PYTHONPATH=. python -m benchmarks.split_kv_rule --out DIR

``flashattn.attention`` sends few queries against many keys to the split-KV decoding kernels
(:attr:`flashattn.problem.Problem.split_kv`, :func:`flashattn.problem.split_kv_wins`). This times, for each shape of a sweep around
those bounds, the same eager forward call with the rule as it is and with the rule turned off (the
dense forward kernel), and writes the ratio; each output is checked against float64 first. Writes
``DIR/split_kv_rule.json`` and ``DIR/split_kv_rule.md``.
"""

from __future__ import annotations

import contextlib
import sys

import torch

from benchmarks import side

QUERIES = (1, 4, 16, 32, 64)
KEYS = (128, 256, 512, 1024, 2048, 4096)
SHAPES = ((1, 32, 8), (16, 32, 8), (4, 8, 8))  # (B, Hq, Hkv)


@contextlib.contextmanager
def rule(always: bool):
    """Run the ``with`` block with every plain dense call on the split-KV kernels (``always``) or none
    (every memo table cleared before and after, so no call keeps a description made under the other
    rule)."""
    from flashattn import _memo, problem

    before = problem.split_kv_wins
    problem.split_kv_wins = lambda n, m, kv_heads: always
    _memo.clear()
    try:
        yield
    finally:
        problem.split_kv_wins = before
        _memo.clear()


def run(device, dtype=torch.bfloat16, head_dim: int = 128) -> dict:
    from triton.testing import do_bench

    import flashattn
    from flashattn.problem import Problem
    from flashattn.reference import naive_attention
    from flashattn.testing import rel_err

    rows = []
    for batch, h_q, h_kv in SHAPES:
        for n in QUERIES:
            for m in KEYS:
                gen = torch.Generator(device=device).manual_seed(n * 7919 + m)
                q = torch.randn(batch, h_q, n, head_dim, dtype=dtype, device=device, generator=gen)
                k, v = (torch.randn(batch, h_kv, m, head_dim, dtype=dtype, device=device, generator=gen)
                        for _ in range(2))
                ref = naive_attention(q.double(), k.double(), v.double(), causal=True)[0]
                row = {"B": batch, "Hq": h_q, "Hkv": h_kv, "N": n, "M": m,
                       "split_kv_by_rule": Problem.of(q, k, True).split_kv}
                for name, always in (("split_kv", True), ("dense", False)):
                    with rule(always):
                        fn = lambda: flashattn.attention(q, k, v, causal=True)  # noqa: E731
                        row[f"{name}_rel_err"] = rel_err(fn(), ref)
                        row[f"{name}_us"] = 1e3 * float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
                row["dense_over_split_kv"] = row["dense_us"] / row["split_kv_us"]
                rows.append(row)
                print(row, flush=True)
    return side.record(f"eager causal forward, D={head_dim}, {str(dtype).removeprefix('torch.')}: dense kernel "
                       "against split-KV kernels", device, rows)


def markdown(result: dict) -> str:
    lines = [f"{result['what']}; {result['device']}, torch {result['versions']['torch']}, triton "
             f"{result['versions']['triton']}. µs per call (median of do_bench); **bold** where the rule picks "
             "split-KV.", "", "| B | Hq:Hkv | N | M | dense µs | split-KV µs | dense / split-KV |", "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        ratio = f"{r['dense_over_split_kv']:.2f}"
        lines.append(f"| {r['B']} | {r['Hq']}:{r['Hkv']} | {r['N']} | {r['M']} | {r['dense_us']:.1f} | "
                     f"{r['split_kv_us']:.1f} | {'**' + ratio + '**' if r['split_kv_by_rule'] else ratio} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    return side.main(argv, __doc__, "split_kv_rule", run, markdown)


if __name__ == "__main__":
    sys.exit(main())
