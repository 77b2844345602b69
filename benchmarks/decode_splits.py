"""How many programs share one sequence's keys in decoding: the split rule's two knobs swept, one run.

    PYTHONPATH=. python -m benchmarks.decode_splits --out DIR

:func:`flashattn.decode_kernels.choose_num_splits` splits until the grid holds about
``PROGRAMS_PER_SM`` programs per SM, giving each split at least ``MIN_BLOCKS_PER_SPLIT`` key blocks.
This times one query per sequence (32:8 heads, D = 128, bfloat16) through ``flashattn.attention`` for
each pair of values, eager (``do_bench``, host work included) and as CUDA-graph replays, next to
cuDNN's SDPA in the same run. Writes ``DIR/decode_splits.json`` and ``DIR/decode_splits.md``.
"""

from __future__ import annotations

import sys

import torch

from benchmarks import side
from benchmarks.decode import _bench, _graph_bench

KNOBS = ((1, 2), (2, 2), (1, 4), (4, 4), (8, 2), (16, 1))  # (PROGRAMS_PER_SM, MIN_BLOCKS_PER_SPLIT)
SHAPES = ((1, 4096), (1, 16384), (1, 65536), (1, 131072), (16, 4096), (16, 16384))  # (B, M)


def run(device) -> dict:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashattn
    from flashattn import _memo, decode_kernels

    rows = []
    for batch, m in SHAPES:
        gen = torch.Generator(device=device).manual_seed(m + batch)
        q = torch.randn(batch, 32, 1, 128, dtype=torch.bfloat16, device=device, generator=gen)
        k, v = (torch.randn(batch, 8, m, 128, dtype=torch.bfloat16, device=device, generator=gen) for _ in range(2))

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        ref = cudnn()
        row = {"B": batch, "M": m, "cudnn_eager_us": 1e3 * _bench(cudnn), "cudnn_graph_us": 1e3 * _graph_bench(cudnn)}
        before = decode_kernels.PROGRAMS_PER_SM, decode_kernels.MIN_BLOCKS_PER_SPLIT
        for per_sm, min_blocks in KNOBS:
            decode_kernels.PROGRAMS_PER_SM, decode_kernels.MIN_BLOCKS_PER_SPLIT = per_sm, min_blocks
            _memo.clear()  # no recipe of another split count
            try:
                fn = lambda: flashattn.attention(q, k, v)  # noqa: E731
                err = float((fn().float() - ref.float()).abs().max())
                row[f"{per_sm}/{min_blocks}"] = {"eager_us": 1e3 * _bench(fn), "graph_us": 1e3 * _graph_bench(fn),
                                                 "max_abs_diff_vs_cudnn": err}
            finally:
                decode_kernels.PROGRAMS_PER_SM, decode_kernels.MIN_BLOCKS_PER_SPLIT = before
                _memo.clear()
        rows.append(row)
        print(row, flush=True)
    return side.record("one query per sequence, 32:8 heads, D=128, bfloat16, flashattn.attention (split-KV)",
                       device, rows, knobs=[f"{a}/{b}" for a, b in KNOBS])


def markdown(result: dict) -> str:
    knobs = result["knobs"]
    lines = [f"{result['what']}; {result['device']}, torch {result['versions']['torch']}, triton "
             f"{result['versions']['triton']}. µs per call (median of do_bench), eager / CUDA-graph replay; "
             "columns are PROGRAMS_PER_SM / MIN_BLOCKS_PER_SPLIT.", "",
             "| B | M | cuDNN | " + " | ".join(knobs) + " |", "|---|---|---|" + "---|" * len(knobs)]
    for r in result["rows"]:
        cells = [f"{r[k]['eager_us']:.0f} / {r[k]['graph_us']:.0f}" for k in knobs]
        lines.append(f"| {r['B']} | {r['M']} | {r['cudnn_eager_us']:.0f} / {r['cudnn_graph_us']:.0f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    return side.main(argv, __doc__, "decode_splits", run, markdown)


if __name__ == "__main__":
    sys.exit(main())
