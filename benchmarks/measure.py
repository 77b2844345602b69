"""How one provider is measured at one setting: inputs, timing, FLOPs, peak memory, correctness.

* Timing is ``triton.testing.do_bench`` with ``return_mode="median"``: CUDA events around each call,
  the L2 cache flushed before each call, warm-up and repetitions given in milliseconds.
* The forward is timed as a training forward: q, k, v require grad, so each provider also saves
  what its backward needs (the LSE). The backward is timed alone: one forward is run once, then
  ``o.backward(do, retain_graph=True)`` is timed with the gradients of q, k, v set to None before
  each call (``do_bench(grad_to_none=...)``), so no accumulation kernel is counted.
* FLOPs come from ``flashattn.cost.attention_flops``, the formula the cost-model page derives:
  the benchmark has no formula of its own.
* Peak memory is ``torch.cuda.max_memory_allocated`` over one forward + backward, after
  ``reset_peak_memory_stats``, minus what was allocated before (q, k, v, dO): it counts o, the saved
  statistics, workspaces, and dq, dk, dv.
"""

from __future__ import annotations

import time

import torch

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}

# A provider passes the correctness check when its error against float64 is at most this multiple of
# the error that the naive attention in the same low precision makes (the test suite's convention).
CHECK_FACTOR = 2.0
CHECK_FLOOR = 1e-5


def make_inputs(setting, device, *, seed: int = 0):
    """Fresh random q, k, v (requiring grad) and dO of the setting's shape: never zeros.

    k and v have ``setting.h_kv`` heads; the same seed gives the same tensors in every process.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    q_shape = (setting.batch, setting.heads, setting.seqlen, setting.head_dim)
    kv_shape = (setting.batch, setting.h_kv, setting.seqlen, setting.head_dim)
    dtype = DTYPES[setting.dtype]

    def randn(shape):
        return torch.randn(shape, dtype=dtype, device=device, generator=gen)

    q, k, v = (randn(shape).requires_grad_() for shape in (q_shape, kv_shape, kv_shape))
    return q, k, v, randn(q_shape)


def attention_flops(setting, mode: str) -> float:
    """FLOPs of one pass at ``setting`` by the project's one cost model."""
    from flashattn import cost  # imported here: an A/B worker's old flashattn may predate cost.py

    return float(cost.attention_flops(setting.batch, setting.heads, setting.seqlen, setting.seqlen,
                                            setting.head_dim, causal=setting.causal, mode=mode))


def tflops(setting, mode: str, ms: float) -> tuple[float, float]:
    """(FLOPs, TFLOP/s) of one pass that took ``ms`` milliseconds."""
    flops = attention_flops(setting, mode)
    return flops, flops / (ms * 1e-3) / 1e12


def do_bench_timer(*, warmup: int, rep: int):
    """The timer of a GPU run: ``timer(fn, grad_to_none) -> median milliseconds``."""

    def timer(fn, grad_to_none=None):
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, return_mode="median"))

    return timer


def time_forward(fn, inputs, timer) -> float:
    q, k, v, _ = inputs
    return timer(lambda: fn(q, k, v))


def time_backward(fn, inputs, timer) -> float:
    q, k, v, do = inputs
    o = fn(q, k, v)
    try:
        return timer(lambda: o.backward(do, retain_graph=True), grad_to_none=[q, k, v])
    finally:
        for x in (q, k, v):
            x.grad = None


def host_us_per_call(fn, *, sync, grad_to_none=None, calls: int = 20, clock=time.perf_counter) -> float:
    """Microseconds the host takes to issue one call of ``fn``: ``calls`` calls back to back with no
    synchronization between them (``sync`` waits for the GPU before and after). A call whose host
    time comes near its GPU time keeps the GPU waiting in ``do_bench``'s loop too, and its reading
    is then the host's, not the kernels'; the grid records this next to every timing to tell them
    apart."""
    sync()
    start = clock()
    for _ in range(calls):
        if grad_to_none is not None:
            for x in grad_to_none:
                x.grad = None
        fn()
    host = (clock() - start) / calls * 1e6
    sync()
    return host


HOST_LOOP_MS = 10.0  # about how long the loop of :func:`host_timer` runs


def host_calls(ms: float) -> int:
    """How many calls :func:`host_timer` makes of a callable timed at ``ms``:
    about :data:`HOST_LOOP_MS` of them, at least 3 and at most 20, so the long settings add little time."""
    return max(3, min(20, round(HOST_LOOP_MS / ms)))


def host_timer(sync, ms: float):
    """A timer for :func:`time_forward` / :func:`time_backward` that returns :func:`host_us_per_call`
    of the pass's callable (timed at ``ms`` by the GPU timer) instead of its GPU time."""

    def timer(fn, grad_to_none=None):
        return host_us_per_call(fn, sync=sync, grad_to_none=grad_to_none, calls=host_calls(ms))

    return timer


def cuda_peak_memory(fn, inputs) -> int:
    """Bytes allocated at the peak of one forward + backward, above what existed before it."""
    q, k, v, do = inputs
    for x in (q, k, v):
        x.grad = None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn(q, k, v).backward(do)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    for x in (q, k, v):
        x.grad = None
    return int(peak)


def _forward_backward(fn, q, k, v, do):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    o = fn(q, k, v)
    o.backward(do)
    return {"o": o.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def reference_results(setting, inputs) -> dict:
    """The float64 ground truth and the naive attention in the setting's own low precision."""
    from flashattn.reference import naive_attention

    q, k, v, do = inputs
    naive = lambda q, k, v: naive_attention(q, k, v, causal=setting.causal)[0]  # noqa: E731
    exact = _forward_backward(naive, *(x.detach().double() for x in (q, k, v, do)))
    lowp = _forward_backward(naive, q, k, v, do)
    return {"exact": exact, "lowp": lowp}


def check(fn, inputs, refs) -> dict:
    """Relative errors of o, dq, dk, dv against float64, judged against the low-precision naive error."""
    from flashattn.testing import rel_err

    q, k, v, do = inputs
    got = _forward_backward(fn, q, k, v, do)
    errors, bases, passed = {}, {}, True
    for name, ref in refs["exact"].items():
        errors[name] = rel_err(got[name], ref)
        bases[name] = rel_err(refs["lowp"][name], ref)
        passed &= errors[name] <= CHECK_FACTOR * bases[name] + CHECK_FLOOR  # inf and NaN fail here
    return {"rel_err": errors, "naive_lowp_rel_err": bases, "factor": CHECK_FACTOR, "floor": CHECK_FLOOR,
            "passed": bool(passed)}


def classify_error(exc: BaseException, caught_warnings=()) -> tuple[str, str]:
    """(status, message) of a failed measurement: ``oom``, ``unsupported`` or ``error``."""
    from benchmarks.providers import Unsupported

    message = f"{type(exc).__name__}: {exc}".strip()
    notes = [str(w.message) for w in caught_warnings]
    if notes:
        message += " | warnings: " + " | ".join(dict.fromkeys(notes))  # unique, in order
    message = message[:2000]
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return "oom", message
    # SDPA's words for "this backend cannot run these inputs" (GPU, then CPU).
    if isinstance(exc, Unsupported) or any(w in str(exc) for w in ("No available kernel", "No viable backend")):
        return "unsupported", message
    return "error", message
