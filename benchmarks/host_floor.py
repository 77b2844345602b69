"""A short training step's host time against what any Python ``autograd.Function`` costs, in one run.

    PYTHONPATH=. python -m benchmarks.host_floor --out DIR

At short shapes an eager forward + backward is bound by the host (the latency section, and the
short-shape section's ratios). flashattn's step goes through a Python ``autograd.Function``, while
SDPA's goes through C++. This asks how much of the gap the Python function itself accounts for. At
a few short shapes, with the timed loops taking turns, it times back-to-back eager steps of:

* ``flashattn``: ``flashattn.attention`` and ``torch.autograd.grad`` of it;
* ``sdpa_efficient`` and ``sdpa_cudnn``: ``scaled_dot_product_attention`` under one backend;
* ``floor``: a Python ``autograd.Function`` that allocates the same outputs and gradients
  (o and lse forward, dq, dk and dv backward) and launches nothing: a lower bound for any Python
  function standing where flashattn's does;
* ``floor_4_kernels``: the same plus one tiny torch kernel for each launch a flashattn step makes
  (one forward, three backward; a short backward makes two or three).

Each step runs twice: with PyTorch's default autograd threads (the backward of CUDA tensors on a worker
thread) and inside ``torch.autograd.set_multithreading_enabled(False)`` (on the calling thread). The
forward alone is timed too, inputs requiring grad. Every loop is timed as the latency section times a
call (:class:`benchmarks.latency.WallClock`: back-to-back calls between two synchronizes, the host's
share beside the wall clock, the median of the repeats), and the functions' loops take turns. Writes
``DIR/host_floor.json`` and ``DIR/host_floor.md``.
"""

from __future__ import annotations

import sys

import torch

from benchmarks import latency, side

SHAPES = ((8, 16, 128, 128, torch.bfloat16, False), (32, 12, 128, 64, torch.float16, False),
          (8, 16, 256, 128, torch.bfloat16, True))  # (B, H, N, D, dtype, causal): three of the short section's


def _outputs(ctx, q, k, v) -> torch.Tensor:
    """o and lse as flashattn's forward allocates them, saved with the inputs; returns o."""
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], device=q.device, dtype=torch.float32)
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.lse = lse  # (saved tensors cannot be read back inside forward)
    return o


def _gradients(ctx) -> tuple:
    q, k, v, _, _ = ctx.saved_tensors
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class Floor(torch.autograd.Function):
    """A Python autograd function with flashattn's allocations and no kernels."""

    @staticmethod
    def forward(ctx, q, k, v):
        return _outputs(ctx, q, k, v)

    @staticmethod
    def backward(ctx, do):
        return _gradients(ctx)


class FloorKernels(torch.autograd.Function):
    """:class:`Floor` with one tiny kernel per launch of a flashattn step: one forward, three backward."""

    @staticmethod
    def forward(ctx, q, k, v):
        o = _outputs(ctx, q, k, v)
        ctx.lse[:1, :1, :1].zero_()
        return o

    @staticmethod
    def backward(ctx, do):
        grads = _gradients(ctx)
        for g in grads:
            g[:1, :1, :1, :1].zero_()
        return grads


def _turns(calls: dict, timer, sync=None) -> dict:
    """Each call's ``timer.summary``: every call calibrated, then the timed loops taking turns."""
    sync = sync or torch.cuda.synchronize
    counts = {name: timer.calibrate(call, sync) for name, call in calls.items()}
    samples = {name: [] for name in calls}
    for _ in range(timer.repeats):
        for name, call in calls.items():
            samples[name].append(timer.sample(call, sync, counts[name]))
    return {name: timer.summary(counts[name], samples[name]) for name in calls}


def run(device, timer=None) -> dict:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashattn

    timer = timer or latency.WallClock()
    rows = []
    for b, h, n, d, dtype, causal in SHAPES:
        q, k, v = (torch.randn(b, h, n, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        do = torch.randn_like(q)

        def sdpa(backend):
            def call(q_, k_, v_):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q_, k_, v_, is_causal=causal)
            return call

        calls = {"flashattn": lambda q_, k_, v_: flashattn.attention(q_, k_, v_, causal=causal),
                 "sdpa_efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION), "sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
                 "floor": Floor.apply, "floor_4_kernels": FloorKernels.apply}
        steps = {name: (lambda f=f: torch.autograd.grad(f(q, k, v), (q, k, v), do)) for name, f in calls.items()}
        row = {"B": b, "H": h, "N": n, "D": d, "dtype": str(dtype).removeprefix("torch."), "causal": causal}
        for threads in (True, False):
            with torch.autograd.set_multithreading_enabled(threads):
                row["fwd_bwd_threads" if threads else "fwd_bwd_one_thread"] = _turns(steps, timer)
        row["fwd"] = _turns({name: (lambda f=f: f(q, k, v)) for name, f in calls.items()}, timer)
        rows.append(row)
    return side.record("a short step's host time against a Python autograd function's floor", device, rows,
                       timer=timer.describe())


COLUMNS = ("flashattn", "sdpa_efficient", "sdpa_cudnn", "floor", "floor_4_kernels")


def markdown(result: dict) -> str:
    lines = [f"{result['what']}; {result['device']}, torch {result['versions']['torch']}, triton "
             f"{result['versions']['triton']}. µs per step (wall clock of back-to-back eager steps, median of "
             f"{result['timer']['repeats']} loops, the loops taking turns).", "",
             "| shape | pass | " + " | ".join(COLUMNS) + " |", "|---|---|" + "--:|" * len(COLUMNS)]
    for r in result["rows"]:
        shape = f"B{r['B']} H{r['H']} N{r['N']} D{r['D']} {r['dtype']}{' causal' if r['causal'] else ''}"
        for key, label in (("fwd", "forward"), ("fwd_bwd_threads", "fwd+bwd, autograd threads"),
                           ("fwd_bwd_one_thread", "fwd+bwd, one thread")):
            lines.append(f"| {shape} | {label} | " + " | ".join(f"{r[key][c]['us_per_call']:.1f}" for c in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    return side.main(argv, __doc__, "host_floor", run, markdown)


if __name__ == "__main__":
    sys.exit(main())
