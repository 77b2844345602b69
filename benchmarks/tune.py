"""Tuning sweeps of flashattn's launch choices, timed by the harness (one process, one GPU).

    PYTHONPATH=. python -m benchmarks.tune configs [--kernels fwd,bwd_dq] [--space JSON] [grid options]
    PYTHONPATH=. python -m benchmarks.tune order   [--groups 1,2,4,8,16] [--peers flex,sdpa_flash]
    PYTHONPATH=. python -m benchmarks.tune overlap          # dQ beside dK/dV on a second stream, or after it
    PYTHONPATH=. python -m benchmarks.tune profile          # per-kernel GPU time of one forward + backward

Every variant is the public call ``flashattn.attention`` (the grid's ``flashattn`` provider) made inside
``flashattn._config.tuning(...)``, which pins one choice and leaves the table alone:

* ``configs`` -- for each kernel (``fwd``, ``bwd_dkdv``, ``bwd_dq``) and each candidate
  ``KernelConfig(block_m, block_n, num_warps, num_stages)``, the pass that kernel belongs to, timed with
  that kernel pinned and the others from the table (a backward kernel is judged by the whole
  backward). Candidates: ``_config.tuning_space`` (the table entry and its neighbours) unless
  ``--space '{"128": {"fwd": [[128, 64, 8, 3]]}}'`` names them. The table's own choice is timed first.
  ``--dropout P`` sweeps the calls with dropout at rate P (and the table entries dropout takes).
* ``order`` -- heads per group of the causal launch order (``heads_per_group``), causal settings only;
  ``auto`` is the package's own choice; ``--peers`` adds other providers as a control.
* ``overlap`` -- the backward with ``overlap_dq=True`` (the default: a second stream where the problem is large
  enough, :func:`flashattn.backward.worth_a_second_stream`) and ``False`` (always one stream).
* ``profile`` -- ``torch.profiler`` time per kernel over a few forward + backward calls.

The backward runs on the calling thread (``torch.autograd.set_multithreading_enabled(False)``): on a
GPU the autograd engine otherwise runs it on a worker thread, where the ``tuning`` context (a
``contextvars`` value) is not set, and the pinned choice would silently not apply to the backward.
Inputs, timer (``do_bench`` medians) and FLOP count are the grid's.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch

from benchmarks import grid as grid_mod, measure, providers as providers_mod

KERNEL_PASS = {"fwd": "fwd", "bwd_dkdv": "bwd", "bwd_dq": "bwd"}


def _problem(setting, dropout_p: float = 0.0):
    """The package's description of one grid setting (what the config table and the sweeps key on)."""
    from flashattn.problem import Problem

    return Problem(setting.batch, setting.heads, setting.h_kv, setting.seqlen, setting.seqlen, setting.head_dim,
                   getattr(torch, setting.dtype), setting.causal, setting.head_dim ** -0.5, dropout_p=dropout_p)


def flashattn_call(setting, device, dropout_p: float = 0.0):
    """The grid's flashattn provider, with dropout at rate ``dropout_p`` (a fixed seed) when it is > 0."""
    fn = providers_mod.PROVIDERS["flashattn"].prepare(setting, device)
    if dropout_p > 0:
        fn, gqa = functools.partial(fn, dropout_p=dropout_p, seed=0), fn.gqa
        fn.gqa = gqa
    return fn


def config_variants(setting, device, kernels=tuple(KERNEL_PASS), space=None,
                    dropout_p: float = 0.0) -> list[tuple[str, dict, tuple]]:
    """(label, tuning kwargs, passes) for the table and every candidate of each kernel."""
    from flashattn import _config

    variants = [("table", {}, ("fwd", "bwd"))]
    for kernel in kernels:
        if space is not None:
            candidates = [_config.KernelConfig(*c) for c in space.get(setting.head_dim, {}).get(kernel, [])]
        else:
            candidates = _config.tuning_space(kernel, _problem(setting, dropout_p), torch.device(device))
        for cfg in candidates:
            label = f"{kernel} ({cfg.block_m}, {cfg.block_n}, {cfg.num_warps}, {cfg.num_stages})"
            variants.append((label, {kernel: cfg}, (KERNEL_PASS[kernel],)))
    return variants


def order_variants(groups) -> list[tuple[str, dict, tuple]]:
    return [("auto", {}, ("fwd", "bwd"))] + [(f"G={g}", {"heads_per_group": g}, ("fwd", "bwd")) for g in groups]


def overlap_variants() -> list[tuple[str, dict, tuple]]:
    return [("overlap_dq", {}, ("bwd",)), ("serial", {"overlap_dq": False}, ("bwd",))]


def sweep(settings, variants_for, *, device, timer, peers=(), log=print, dropout_p: float = 0.0) -> list[dict]:
    """Time every variant (``variants_for(setting)``) of flashattn, and each peer, at every setting;
    flashattn with dropout at rate ``dropout_p`` when it is > 0 (the peers without)."""
    from flashattn import _config

    rows = []
    for index, setting in enumerate(settings):
        inputs = measure.make_inputs(setting, device, seed=index)
        fn = flashattn_call(setting, device, dropout_p)
        runs = [(label, fn, kw, passes) for label, kw, passes in variants_for(setting)]
        runs += [(peer, providers_mod.PROVIDERS[peer].prepare(setting, device), None, ("fwd", "bwd")) for peer in peers]
        for label, call, kw, passes in runs:
            row = {"setting": setting.to_dict(), "variant": label}
            if dropout_p > 0 and kw is not None:  # flashattn's rows, not the peers'
                row["dropout_p"] = dropout_p
            try:
                with _config.tuning(**(kw or {})), torch.autograd.set_multithreading_enabled(False):
                    for p in passes:
                        ms = (measure.time_forward if p == "fwd" else measure.time_backward)(call, inputs, timer)
                        row[p] = {"ms": ms, "tflops": measure.tflops(setting, p, ms)[1]}
            except Exception as exc:  # noqa: BLE001 -- a config that does not fit is a result
                row["status"], row["error"] = measure.classify_error(exc)
            rows.append(row)
            numbers = " ".join(f"{p} {row[p]['tflops']:6.1f}" for p in ("fwd", "bwd") if p in row)
            log(f"{setting.label():48s} {label:34s} {numbers or row.get('error', '')[:160]}")
        del inputs
        if device != "cpu":
            torch.cuda.empty_cache()
    return rows


def profile(settings, *, device, calls=10, log=print) -> list[dict]:
    """Time per kernel (µs per forward + backward) from ``torch.profiler`` over ``calls`` calls."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activity = ProfilerActivity.CUDA if device != "cpu" else ProfilerActivity.CPU
    rows = []
    for index, setting in enumerate(settings):
        q, k, v, do = measure.make_inputs(setting, device, seed=index)
        fn = providers_mod.PROVIDERS["flashattn"].prepare(setting, device)

        def step():
            torch.autograd.grad(fn(q, k, v), (q, k, v), do)

        for _ in range(3):  # compile and warm up
            step()
        if device != "cpu":
            torch.cuda.synchronize()
        with torch_profile(activities=[activity]) as prof:
            for _ in range(calls):
                step()
            if device != "cpu":
                torch.cuda.synchronize()
        for ev in prof.key_averages():
            if device != "cpu":
                us = getattr(ev, "device_time_total", getattr(ev, "cuda_time_total", 0)) / calls
            else:
                us = ev.self_cpu_time_total / calls
            if us > 1:
                rows.append({"setting": setting.to_dict(), "kernel": ev.key, "us": us})
                log(f"{setting.label():48s} {ev.key[:48]:48s} {us:9.1f} µs")
    return rows


def main(argv=None) -> int:
    from benchmarks.run import _CAUSAL, _ints, _strs, environment

    ap = argparse.ArgumentParser(prog="python -m benchmarks.tune", description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("configs", "order", "overlap", "profile"))
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--seqlens", default="2048,16384")
    ap.add_argument("--causal", choices=("both", "true", "false"), default="both")
    ap.add_argument("--tokens", type=int, default=grid_mod.TOKENS)
    ap.add_argument("--hidden", type=int, default=grid_mod.HIDDEN)
    ap.add_argument("--kernels", default=",".join(KERNEL_PASS), help="configs: the kernels to sweep")
    ap.add_argument("--space", default="",
                    help='configs: JSON {"head_dim": {"kernel": [[BLOCK_M, BLOCK_N, warps, stages], ...]}}')
    ap.add_argument("--groups", default="1,2,4,8,16,32,64", help="order: heads-per-group caps to time")
    ap.add_argument("--peers", default="", help="comma-separated providers timed beside (order, overlap, configs)")
    ap.add_argument("--dropout", type=float, default=0.0,
                    help="configs, order, overlap: flashattn with this dropout rate (its table entries and neighbours)")
    ap.add_argument("--warmup-ms", type=int, default=10)
    ap.add_argument("--rep-ms", type=int, default=50)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="benchmarks/results-tune", help="folder for <mode>.json")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks.tune needs a CUDA GPU", file=sys.stderr)
        return 2
    causal = (True,) if args.mode == "order" else _CAUSAL[args.causal]
    settings = [grid_mod.make_setting(args.dtype, d, c, n, tokens=args.tokens, hidden=args.hidden)
                for d in _ints(args.head_dims) for c in causal for n in _ints(args.seqlens)]
    timer = measure.do_bench_timer(warmup=args.warmup_ms, rep=args.rep_ms)
    log = lambda s: print(s, flush=True)  # noqa: E731
    peers = _strs(args.peers)
    if args.mode == "configs":
        space = ({int(d): ks for d, ks in json.loads(args.space).items()} if args.space else None)
        kernels = _strs(args.kernels)
        rows = sweep(settings, lambda s: config_variants(s, args.device, kernels, space, args.dropout),
                     device=args.device, timer=timer, peers=peers, log=log, dropout_p=args.dropout)
    elif args.mode == "order":
        groups = _ints(args.groups)
        rows = sweep(settings, lambda s: order_variants(groups), device=args.device, timer=timer, peers=peers, log=log,
                     dropout_p=args.dropout)
    elif args.mode == "overlap":
        rows = sweep(settings, lambda s: overlap_variants(), device=args.device, timer=timer, peers=peers, log=log,
                     dropout_p=args.dropout)
    else:
        rows = profile(settings, device=args.device, log=log)
    env = environment(args.device) if args.device != "cpu" else {"device": "cpu"}
    path = Path(args.out) / f"{args.mode}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"environment": env, "argv": list(argv or sys.argv[1:]), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                "rows": rows}, indent=1, default=str) + "\n")
    print(f"wrote {path} ({len(rows)} rows)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
