"""The two eager paths into the kernels, timed in one run: what the eager ``autograd.Function`` saves.

    PYTHONPATH=. python -m benchmarks.autograd_paths --out DIR

``flashattn.attention`` called eagerly runs the kernels through :class:`flashattn.autograd.AttentionFunction`;
under ``torch.compile`` it calls the custom operator ``torch.ops.flashattn.attention_forward``,
whose registered autograd formula calls ``torch.ops.flashattn.attention_backward``. Both reach the
same launchers. This times an eager forward + backward of short training shapes through each (the
operator called directly, as an eager caller of it would), host work included (``do_bench`` of the
whole call), and checks that both give bitwise the same outputs and gradients. Writes
``DIR/autograd_paths.json`` and ``DIR/autograd_paths.md``.
"""

from __future__ import annotations

import sys

import torch

from benchmarks import side

SHAPES = ((32, 16, 257, 64, False), (32, 12, 128, 64, False), (8, 16, 256, 128, True), (1, 16, 1024, 128, True),
          (4, 16, 512, 128, True))  # (B, H, N, D, causal)


def run(device, dtype=torch.bfloat16) -> dict:
    from triton.testing import do_bench

    import flashattn

    rows = []
    for b, h, n, d, causal in SHAPES:
        gen = torch.Generator(device=device).manual_seed(n + d)
        q, k, v, do = (torch.randn(b, h, n, d, dtype=dtype, device=device, generator=gen) for _ in range(4))
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        paths = {
            "autograd_function": lambda: flashattn.attention(q, k, v, causal=causal),
            "custom_operator": lambda: torch.ops.flashattn.attention_forward(q, k, v, causal, None)[0],
        }
        row, results = {"B": b, "H": h, "N": n, "D": d, "causal": causal}, []
        for name, forward in paths.items():
            def step(forward=forward):
                o = forward()
                return (o, *torch.autograd.grad(o, (q, k, v), do))
            results.append(step())
            row[f"{name}_fwd_us"] = 1e3 * float(do_bench(forward, warmup=25, rep=100, return_mode="median"))
            row[f"{name}_fwd_bwd_us"] = 1e3 * float(do_bench(step, warmup=25, rep=100, return_mode="median"))
        row["bitwise_equal"] = all(torch.equal(a, c) for a, c in zip(*results))
        rows.append(row)
        print(row, flush=True)
    return side.record(f"eager forward and forward + backward, {str(dtype).removeprefix('torch.')}", device, rows)


def markdown(result: dict) -> str:
    lines = [f"{result['what']}; {result['device']}, torch {result['versions']['torch']}, triton "
             f"{result['versions']['triton']}. µs per call, host work included (median of do_bench).", "",
             "| B | H | N | D | causal | Function fwd | operator fwd | Function fwd+bwd | operator fwd+bwd | bitwise |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['B']} | {r['H']} | {r['N']} | {r['D']} | {r['causal']} | "
                     f"{r['autograd_function_fwd_us']:.1f} | {r['custom_operator_fwd_us']:.1f} | "
                     f"{r['autograd_function_fwd_bwd_us']:.1f} | {r['custom_operator_fwd_bwd_us']:.1f} | "
                     f"{r['bitwise_equal']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    return side.main(argv, __doc__, "autograd_paths", run, markdown)


if __name__ == "__main__":
    sys.exit(main())
