"""A/B reading on the device: the working tree's kernels, the previous commit's, and the peers, in one run.

    PYTHONPATH=. python3 tools/gpu/ab.py ab    [--out DIR]   # new vs baseline vs SDPA flash / cuDNN / Flex
    PYTHONPATH=. python3 tools/gpu/ab.py sweep [--out DIR]   # launch configurations of the new kernels
    PYTHONPATH=. python3 tools/gpu/ab.py order [--out DIR]   # heads per group of the causal launch order

The baseline is a copy of the committed kernels in ``tools/gpu/baseline_kernels`` (git-ignored; pass it
to the device with ``carry``), so both versions are timed in the same process on the same GPU. Make it
with ``git show HEAD:flashattn/X.py > tools/gpu/baseline_kernels/X.py`` for X in forward, backward and
_config, then point the two kernel files at the copied table::

    sed -i 's/^from flashattn import _config, schedule/from flashattn import schedule\nfrom tools.gpu.baseline_kernels import _config/' \
        tools/gpu/baseline_kernels/forward.py tools/gpu/baseline_kernels/backward.py

Without the last step a table change in the working tree would change the baseline too.
Settings, inputs, timer and FLOP count are the benchmark harness's (:mod:`benchmarks`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton

from benchmarks import grid, measure, providers as providers_mod
from benchmarks.run import precompile_flex
from flashattn import _config
from flashattn.backward import attention_backward
from flashattn.forward import attention_forward


def _baseline_fn(causal):
    from tools.gpu.baseline_kernels.backward import attention_backward as bwd
    from tools.gpu.baseline_kernels.forward import attention_forward as fwd

    class Baseline(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            scale = q.shape[-1] ** -0.5
            o, lse = fwd(q, k, v, causal, scale)
            ctx.save_for_backward(q, k, v, o, lse)
            return o

        @staticmethod
        def backward(ctx, do):
            q, k, v, o, lse = ctx.saved_tensors
            return bwd(do, q, k, v, o, lse, causal, q.shape[-1] ** -0.5)

    return Baseline.apply


def _time_passes(fn, s, inputs, timer) -> dict:
    """Forward and backward of ``fn`` on one setting: medians in ms and TFLOP/s by the harness's count."""
    ms_f = measure.time_forward(fn, inputs, timer)
    ms_b = measure.time_backward(fn, inputs, timer)
    return dict(fwd_ms=ms_f, bwd_ms=ms_b, fwd_tflops=measure.tflops(s, "fwd", ms_f)[1],
                bwd_tflops=measure.tflops(s, "bwd", ms_b)[1])


def run_ab(args):
    settings = [grid.make_setting(args.dtype, d, c, n) for d in args.d for c in (False, True) for n in args.n]
    print(precompile_flex(settings, workers=8, timeout_s=180), flush=True)
    timer = measure.do_bench_timer(warmup=25, rep=100)
    rows = []
    for s in settings:
        inputs = measure.make_inputs(s, "cuda")
        q, k, v, _ = inputs
        fns = {"new": providers_mod.PROVIDERS["flashattn"].prepare(s, "cuda"), "baseline": _baseline_fn(s.causal)}
        for name in ("sdpa_flash", "sdpa_cudnn", "flex"):
            fns[name] = providers_mod.PROVIDERS[name].prepare(s, "cuda")
        ref = None
        for name, fn in fns.items():
            try:
                with torch.no_grad():
                    o = fn(q, k, v).float()
                ref = o if ref is None else ref
                diff = ((o - ref).norm() / ref.norm()).item()
                t = _time_passes(fn, s, inputs, timer)
            except Exception as exc:  # noqa: BLE001
                print(f"{name} {s}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                continue
            rows.append(dict(provider=name, d=s.head_dim, n=s.seqlen, causal=s.causal, diff_vs_new=diff, **t))
            print(f"{name:10s} D={s.head_dim:3d} N={s.seqlen:6d} causal={s.causal!s:5s} fwd {t['fwd_tflops']:6.1f} "
                  f"bwd {t['bwd_tflops']:6.1f} TF/s  diff {diff:.1e}", flush=True)
    return rows


SPACES = {  # pruned with tools/gpu/aot_check.py: none of these overflows shared memory
    64: dict(fwd=[(128, 128, 4, 3), (128, 64, 4, 3), (64, 64, 4, 3), (64, 128, 4, 3)],
             bwd_dkdv=[(32, 128, 4, 3), (64, 64, 4, 3), (64, 64, 4, 4), (32, 64, 4, 3)],
             bwd_dq=[(64, 64, 4, 3), (128, 64, 8, 3), (128, 64, 4, 3), (64, 128, 4, 3)]),
    128: dict(fwd=[(128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2)],
              bwd_dkdv=[(64, 128, 8, 4), (64, 128, 8, 3), (32, 128, 8, 3), (64, 64, 4, 3)],
              bwd_dq=[(128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 8, 4)]),
}


def run_sweep(args):
    spaces = SPACES
    if args.space:  # e.g. '{"64": {"fwd": [[64, 128, 4, 3]]}}'
        spaces = {int(d): {k: [tuple(c) for c in v] for k, v in ks.items()} for d, ks in json.loads(args.space).items()}
    rows = []
    timer = measure.do_bench_timer(warmup=10, rep=40)
    for d in (args.d if not args.space else spaces):
        for n in args.n:
            for causal in map(bool, args.causal):
                s = grid.make_setting(args.dtype, d, causal, n)
                q, k, v, do = (x.detach() for x in measure.make_inputs(s, "cuda"))
                scale = d ** -0.5
                _config.OVERRIDE.clear()
                o, lse = attention_forward(q, k, v, causal, scale)
                for kernel, space in spaces[d].items():
                    for cfg in space:
                        _config.OVERRIDE.clear()
                        _config.OVERRIDE[kernel] = _config.KernelConfig(*cfg)
                        try:
                            if kernel == "fwd":
                                ms = timer(lambda: attention_forward(q, k, v, causal, scale))
                                tf = measure.tflops(s, "fwd", ms)[1]
                            else:
                                ms = timer(lambda: attention_backward(do, q, k, v, o, lse, causal, scale))
                                tf = measure.tflops(s, "bwd", ms)[1]
                        except Exception as exc:  # noqa: BLE001
                            print(f"{kernel} {cfg} D={d} N={n} causal={causal}: {type(exc).__name__} {str(exc)[:160]}",
                                  flush=True)
                            continue
                        rows.append(dict(kernel=kernel, cfg=cfg, d=d, n=n, causal=causal, ms=ms, tflops=tf))
                        print(f"{kernel:9s} {str(cfg):18s} D={d:3d} N={n:6d} causal={causal!s:5s} {tf:6.1f} TF/s",
                              flush=True)
    _config.OVERRIDE.clear()
    return rows


def run_order(args):
    """Causal kernels under several heads-per-group values of the launch order (None: the package's own)."""
    settings = [grid.make_setting(args.dtype, d, True, n) for d in args.d for n in args.n]
    peers = ("flex", "sdpa_flash")
    print(precompile_flex(settings, workers=8, timeout_s=180), flush=True)
    timer = measure.do_bench_timer(warmup=25, rep=100)
    rows = []
    for s in settings:
        inputs = measure.make_inputs(s, "cuda")
        for g in [None, 1, 2, 4, 8, 16, 32, 64] + list(peers):
            name = g if isinstance(g, str) else "flashattn"
            _config.HEADS_PER_GROUP = None if isinstance(g, str) else g
            fn = providers_mod.PROVIDERS[name].prepare(s, "cuda")
            try:
                t = _time_passes(fn, s, inputs, timer)
            except Exception as exc:  # noqa: BLE001
                print(f"{name} {g} {s}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                continue
            rows.append(dict(provider=name, heads_per_group=g, d=s.head_dim, n=s.seqlen, **t))
            print(f"{name:10s} G={g!s:10s} D={s.head_dim:3d} N={s.seqlen:6d} fwd {t['fwd_tflops']:6.1f} "
                  f"bwd {t['bwd_tflops']:6.1f} TF/s", flush=True)
    _config.HEADS_PER_GROUP = None
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["ab", "sweep", "order"])
    parser.add_argument("--d", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--n", type=int, nargs="+", default=[2048, 16384])
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--causal", type=int, nargs="+", default=[0, 1], help="1 for causal, 0 for not")
    parser.add_argument("--space", default="", help="JSON {head_dim: {kernel: [[BM, BN, warps, stages], ...]}}")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    env = dict(gpu=torch.cuda.get_device_name(0), torch=torch.__version__, triton=triton.__version__,
               python=sys.version.split()[0], date=time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()))
    print(env, flush=True)
    rows = dict(ab=run_ab, sweep=run_sweep, order=run_order)[args.mode](args)
    with open(os.path.join(args.out, f"{args.mode}.json"), "w") as f:
        json.dump(dict(env=env, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
