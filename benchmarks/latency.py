"""Per-call latency at small shapes: what one call of attention costs a user, host work included.

At N <= 1024 a call does little GPU work, and what the user waits for is the host: Python, input
checks, the dispatcher, launching each kernel, dynamo's guards. TFLOP/s from ``do_bench`` (CUDA
events around the GPU work of each call) hide most of that, so this section times differently:

* **Wall clock over back-to-back calls.** ``torch.cuda.synchronize()``, then ``n`` calls in a Python
  loop with nothing between them, then ``torch.cuda.synchronize()`` again; per call = elapsed / n.
  While the host is slower than the GPU, the GPU waits for each launch and this is the host's time;
  once the GPU is slower, the launch queue fills and this is the GPU's time. Either way it is the time
  a training or inference loop of such calls takes per call. ``n`` is chosen so one loop lasts about
  ``target_ms``; the median of ``repeats`` loops is reported, in microseconds.
* **Host time** of the same loop: the clock read when the last call returns, before the final
  synchronize. It is the host's cost per call while the GPU keeps up; once the launch queue is full
  it includes waiting for the GPU too, so it is never more than the wall time.
* No L2 flush between calls (``do_bench`` flushes): back-to-back calls of one layer find their inputs
  in L2 as a model's small layers often do, and a flush kernel would be counted in the wall time.

Passes: ``fwd`` is a training forward (q, k, v require grad, as in the grid); ``fwd_bwd`` is
``torch.autograd.grad(fn(q, k, v), (q, k, v), do)``: the forward and the whole backward, no gradient
accumulation. Modes: ``eager``; ``eager-one-thread`` = the same calls with the loop inside
``torch.autograd.set_multithreading_enabled(False)``, so each backward runs on the calling thread
instead of autograd's worker thread for the device (a switch a training script can set once);
``compile`` = ``torch.compile(fn, fullgraph=True, dynamic=True)``;
``reduce-overhead`` = the same with ``mode="reduce-overhead"`` (CUDA graphs), each call preceded by
``torch.compiler.cudagraph_mark_step_begin()`` as a loop of such calls needs. ``dynamic=True``
compiles each provider once per mask instead of once per shape (the section would otherwise spend
minutes compiling); dynamo's guards on symbolic shapes are then part of the measured host cost, as
they are for a model compiled over varying lengths. Compile time is never timed: the first calls of
each shape run before the clock starts. A compile or call that fails is recorded with its message.

Order: mode, then shape, then provider: at one shape every provider's calls are set up (compiled, in
the compiled modes), run once and calibrated, and then the timed loops take turns, one loop of each
provider in each of the ``repeats`` rounds, so a host whose speed drifts during the section moves the
figures compared at a shape together. (On the H200 machines the same loops were seen to run 1.5-1.7x
slower for seconds at a time, or for a whole run, every provider at once, while flashattn's eager
forward over SDPA flash's, taken in turns, held at 1.31-1.45.) Dynamo's caches are reset at the
start of each compiled mode; the providers' compiled functions then live side by side, each with a
code object of its own (:func:`benchmarks.providers.own_code`), so no provider is ever handed
another's graph.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
import warnings

import torch

from benchmarks import grid as grid_mod, measure, results as results_mod

DTYPES = ("bfloat16",)
HEAD_DIMS = (64, 128)
SEQLENS = (128, 512, 1024)
BATCH_HEADS = ((1, 16), (8, 16))  # (B, H): B x H = 16 and 128
CAUSAL = (False, True)
MODES = results_mod.LATENCY_MODES
PASSES = results_mod.LATENCY_PASSES

TARGET_MS = 10.0  # each timed loop lasts about this long
REPEATS = 5
WARMUP_CALLS = 5  # compile, autotune, CUDA-graph warm-up and recording happen here, untimed
MIN_CALLS, MAX_CALLS = 10, 5000

TIMER_HOW = ("wall clock (time.perf_counter) over n back-to-back calls between two torch.cuda.synchronize(); "
             "per call = elapsed / n, median of the repeats (the providers' loops at a shape take turns, round "
             "by round); host = clock when the last call returned; no L2 flush")
FWD_HOW = "fn(q, k, v) with q, k, v requiring grad (a training forward)"
FWD_BWD_HOW = "torch.autograd.grad(fn(q, k, v), (q, k, v), do): forward and whole backward, no accumulation"
EAGER_MODES = ("eager", "eager-one-thread")
MODE_HOW = {
    "eager": "the provider's call as it is",
    "eager-one-thread": ("the provider's call as it is, timed inside torch.autograd.set_multithreading_enabled(False): "
                         "the backward runs on the calling thread"),
    "compile": "torch.compile(fn, fullgraph=True, dynamic=True)",
    "reduce-overhead": ("torch.compile(fn, fullgraph=True, dynamic=True, mode='reduce-overhead'); "
                        "torch.compiler.cudagraph_mark_step_begin() before each call"),
}


def make_shapes(*, dtypes=DTYPES, head_dims=HEAD_DIMS, seqlens=SEQLENS, batch_heads=BATCH_HEADS,
                causal=CAUSAL) -> list[grid_mod.Setting]:
    """The small shapes, mask outermost and N innermost (so dynamo sees one mask at a time)."""
    return [grid_mod.Setting(dtype, d, c, n, batch=b, heads=h)
            for c in causal for dtype in dtypes for d in head_dims for b, h in batch_heads for n in sorted(seqlens)]


class WallClock:
    """``measure(call, sync) -> dict``: per-call wall and host time of back-to-back calls (see the module doc)."""

    def __init__(self, *, target_ms=TARGET_MS, repeats=REPEATS, warmup_calls=WARMUP_CALLS, clock=time.perf_counter):
        self.target_ms, self.repeats, self.warmup_calls, self.clock = target_ms, repeats, warmup_calls, clock

    def describe(self) -> dict:
        return {"timer": TIMER_HOW, "target_ms": self.target_ms, "repeats": self.repeats,
                "warmup_calls": self.warmup_calls}

    def calls_for(self, seconds_per_call: float) -> int:
        """Calls in one timed loop: about ``target_ms`` of them, within [MIN_CALLS, MAX_CALLS]."""
        n = math.ceil(self.target_ms * 1e-3 / max(seconds_per_call, 1e-9))
        return max(MIN_CALLS, min(MAX_CALLS, n))

    def calibrate(self, call, sync) -> int:
        """Warm up, then the number of calls in one timed loop (from three timed calls)."""
        for _ in range(self.warmup_calls):
            call()
        sync()
        t0 = self.clock()
        for _ in range(3):
            call()
        sync()
        return self.calls_for((self.clock() - t0) / 3)

    def sample(self, call, sync, n: int) -> tuple[float, float]:
        """One timed loop of ``n`` calls: (wall, host) µs per call."""
        sync()
        t0 = self.clock()
        for _ in range(n):
            call()
        t_host = self.clock()
        sync()
        t1 = self.clock()
        return (t1 - t0) / n * 1e6, (t_host - t0) / n * 1e6

    def summary(self, n: int, samples: list[tuple[float, float]]) -> dict:
        walls, hosts = [w for w, _ in samples], [h for _, h in samples]
        return {"us_per_call": statistics.median(walls), "host_us_per_call": statistics.median(hosts),
                "calls": n, "repeats": len(samples), "samples_us": walls}

    def __call__(self, call, sync) -> dict:
        n = self.calibrate(call, sync)
        return self.summary(n, [self.sample(call, sync, n) for _ in range(self.repeats)])


def _record(setting, provider, mode, p, **fields) -> dict:
    rec = {k: getattr(setting, k) for k in results_mod.SETTING_KEYS}
    rec.update(provider=provider.name, mode=mode, **{"pass": p})
    rec.update(fields)
    return rec


def _step(fn, q, k, v, do, extras, p, mode):
    """The timed call of one pass in one mode."""
    mark = torch.compiler.cudagraph_mark_step_begin if mode == "reduce-overhead" else None

    if p == "fwd":
        def call():
            if mark is not None:
                mark()
            return fn(q, k, v, *extras)
    else:
        def call():
            if mark is not None:
                mark()
            return torch.autograd.grad(fn(q, k, v, *extras), (q, k, v), do)
    return call


def _compiled(parts, mode, compile_fn):
    if mode in EAGER_MODES:
        return parts.eager
    kwargs = {"fullgraph": True, "dynamic": True}
    if mode == "reduce-overhead":
        kwargs["mode"] = "reduce-overhead"
    return compile_fn(parts.compiled, **kwargs)


def run_latency(shapes, providers, *, device, modes=MODES, passes=PASSES, measure_fn=None, compile_fn=None,
                sync=None, reset=None, clock=None, log=print) -> list[dict]:
    """Every provider at every shape, in every mode and pass; one record each (see the module doc).

    ``measure_fn`` (a :class:`WallClock`, or anything with its ``calibrate``, ``sample``, ``summary``
    and ``repeats``), ``compile_fn`` (``torch.compile``), ``sync`` and ``reset`` (dynamo's) are
    injected so the loop runs, and is tested, on a CPU.
    """
    measure_fn = measure_fn or WallClock()
    compile_fn = compile_fn or torch.compile
    if sync is None:
        sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    if reset is None:
        from torch import _dynamo

        reset = _dynamo.reset
    records = []
    for mode in modes:
        lines = {provider.name: [] for provider in providers}
        if mode not in EAGER_MODES:
            reset()  # each compiled mode starts from empty caches; its providers' graphs then live side by side
        # every provider at one shape, then the next shape, and at a shape the providers' timed loops
        # take turns: a host whose speed drifts moves the figures compared at a shape together
        for index, setting in enumerate(shapes):
            recs = _measure_shape(setting, providers, mode, passes, device=device, timer=measure_fn,
                                  compile_fn=compile_fn, sync=sync, clock=clock, seed=index)
            records += recs
            for r in recs:
                lines[r["provider"]].append(f"{r['us_per_call']:.0f}" if r["status"] == "ok" else r["status"])
        for name, line in lines.items():
            log(f"[latency {mode}] {name}: " + " ".join(line) + " µs")
    return records


def _measure_shape(setting, providers, mode, passes, *, device, timer, compile_fn, sync, clock, seed):
    """The providers at one shape in one mode: each provider's calls are set up (compiled, in the
    compiled modes), run once and calibrated, then the timed loops go round the providers
    ``timer.repeats`` times (pass by pass), so every provider's samples are spread over the same
    stretch of time. Records come out in provider order."""
    if clock is not None and clock.over():
        reason = f"time budget of {clock.budget_s:.0f} s spent before this measurement"
        return [_record(setting, provider, mode, p, status="skipped", error=reason)
                for provider in providers for p in passes]
    out = {}  # (provider index, pass) -> record
    ready = []  # (provider index, pass, call, parts, first call's seconds, calls per loop)
    one_thread = mode == "eager-one-thread"

    def entered(parts):
        # the provider's backend context, and for eager-one-thread the engine's threads off;
        # set_multithreading_enabled switches on construction: built inside the with, restored on its exit
        stack = contextlib.ExitStack()
        if parts.context is not None:
            stack.enter_context(parts.context())
        if one_thread:
            stack.enter_context(torch.autograd.set_multithreading_enabled(False))
        return stack

    for i, provider in enumerate(providers):
        if mode not in EAGER_MODES and provider.not_compiled_again:
            for p in passes:  # (its parts are not even made: FlexAttention's would reset dynamo)
                out[i, p] = _record(setting, provider, mode, p, status="skipped",
                                    error=f"not compiled again: {provider.not_compiled_again}")
            continue
        q, k, v, do = measure.make_inputs(setting, device, seed=seed)
        try:
            parts = provider.latency_parts(setting, device, compile_fn)
            fn = _compiled(parts, mode, compile_fn)
        except Exception as exc:  # noqa: BLE001 -- a provider that cannot even be set up is a result
            status, message = measure.classify_error(exc)
            for p in passes:
                out[i, p] = _record(setting, provider, mode, p, status=status, error=message)
            continue
        for p in passes:
            call = _step(fn, q, k, v, do, parts.extras, p, mode)
            with warnings.catch_warnings(record=True) as caught, entered(parts):
                warnings.simplefilter("always")
                try:
                    t0 = time.monotonic()
                    call()  # the first call compiles, where anything does: timed apart, never per call
                    sync()
                    first_s = time.monotonic() - t0
                    n = timer.calibrate(call, sync)
                    ready.append((i, p, call, parts, first_s, n))
                except Exception as exc:  # noqa: BLE001 -- e.g. a compile that fails at run time
                    status, message = measure.classify_error(exc, caught)
                    out[i, p] = _record(setting, provider, mode, p, status=status, error=message)
    samples = {(i, p): [] for i, p, *_ in ready}
    for p in passes:
        for _ in range(timer.repeats):
            for i, p_, call, parts, _first, n in ready:
                if p_ != p or (i, p) in out:
                    continue
                with warnings.catch_warnings(record=True) as caught, entered(parts):
                    warnings.simplefilter("always")
                    try:
                        samples[i, p].append(timer.sample(call, sync, n))
                    except Exception as exc:  # noqa: BLE001
                        status, message = measure.classify_error(exc, caught)
                        out[i, p] = _record(setting, providers[i], mode, p, status=status, error=message)
    for i, p, _call, parts, first_s, n in ready:
        if (i, p) not in out:
            out[i, p] = _record(setting, providers[i], mode, p, status="ok", first_call_s=first_s,
                                note=parts.note or None, **timer.summary(n, samples[i, p]))
    return [out[i, p] for i in range(len(providers)) for p in passes if (i, p) in out]


def section(shapes, providers, records, measure_fn, *, elapsed_s=None, environment=None, argv=None) -> dict:
    """The ``latency`` entry of the results file (with the environment of the run that measured it,
    which differs from the file's own when the section was added by a later ``--update`` run)."""
    cfg = {"shapes": [s.to_dict() for s in shapes], "providers": [p.name for p in providers],
           "forward": FWD_HOW, "fwd_bwd": FWD_BWD_HOW, "modes": MODE_HOW}
    describe = getattr(measure_fn, "describe", None)
    cfg.update(describe() if describe else {"timer": "injected"})
    if elapsed_s is not None:
        cfg["elapsed_s"] = elapsed_s
    if argv is not None:
        cfg["argv"] = list(argv)
    out = {"config": cfg, "records": records}
    if environment is not None:
        out["environment"] = environment
    return out
