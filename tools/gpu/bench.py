"""First performance reading and tuning sweeps for the kernels, run on the device machine.

    PYTHONPATH=. python3 tools/gpu/bench.py peers  [--out DIR]   # ours vs SDPA flash / cuDNN / FlexAttention
    PYTHONPATH=. python3 tools/gpu/bench.py sweep  [--out DIR]   # block sizes / warps / stages of our kernels

Batch * N = 16k tokens, Hq = 16, D = 128, fp16. TFLOP/s: forward 4 * B * H * N * M * D times the
visible fraction (causal), backward 2.5x forward (SPEC's cost-model convention).
Timings are ``triton.testing.do_bench`` medians. This is a tool script, not the benchmark harness.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton
from triton.testing import do_bench

from flashattn import _config, schedule
from flashattn.backward import attention_backward
from flashattn.forward import attention_forward
from flashattn.autograd import AttentionFunction

TOKENS, HEADS = 16384, 16


def fwd_flops(b, h, n, m, d, causal):
    return 4.0 * b * h * d * schedule.visible_count(n, m, causal)


def inputs(b, h, n, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=g) for _ in range(4))
    return q, k, v, do


def bench_fwd_bwd(fwd, q, k, v, do):
    """(forward ms, backward ms) of ``fwd(q, k, v) -> o`` through autograd."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    ms_f = do_bench(lambda: fwd(q, k, v), warmup=25, rep=100, return_mode="median")
    o = fwd(q, k, v)
    ms_b = do_bench(lambda: o.backward(do, retain_graph=True), warmup=25, rep=100,
                    grad_to_none=[q, k, v], return_mode="median")
    return ms_f, ms_b


def providers(causal, n):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    def ours(q, k, v):
        return AttentionFunction.apply(q, k, v, causal, q.shape[-1] ** -0.5, True)[0]

    def sdpa(backend):
        def run(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return run

    out = {"ours": ours, "sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION), "sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION)}
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
        mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, n, n, device="cuda") if causal else None
        out["flex"] = lambda q, k, v: flex(q, k, v, block_mask=mask)
    except Exception as exc:  # noqa: BLE001
        print("flex unavailable:", exc)
    return out


def run_peers(args):
    from flashattn import backward

    rows = []
    dtype = torch.float16
    for d, n in ((d, n) for d in args.d for n in args.n):
        b = TOKENS // n
        for causal in (False, True):
            q, k, v, do = inputs(b, HEADS, n, d, dtype)
            ref = None
            provs = providers(causal, n)
            provs = {"ours": provs["ours"], "ours_serial": provs["ours"], **provs} if args.serial else provs
            for name, fn in provs.items():
                backward.OVERLAP_DQ = name != "ours_serial"
                try:
                    o = fn(q, k, v)
                    if ref is None:
                        ref = o.float()
                    err = ((o.float() - ref).norm() / ref.norm()).item()
                    ms_f, ms_b = bench_fwd_bwd(fn, q, k, v, do)
                except Exception as exc:  # noqa: BLE001
                    print(f"{name} N={n} causal={causal}: failed: {type(exc).__name__}: {str(exc)[:200]}")
                    continue
                fl = fwd_flops(b, HEADS, n, n, d, causal)
                row = dict(provider=name, d=d, n=n, b=b, causal=causal, fwd_ms=ms_f, bwd_ms=ms_b,
                           fwd_tflops=fl / ms_f * 1e-9, bwd_tflops=2.5 * fl / ms_b * 1e-9, err_vs_ours=err)
                rows.append(row)
                print(f"{name:11s} D={d:3d} N={n:6d} causal={causal!s:5s} fwd {ms_f:7.3f} ms {row['fwd_tflops']:6.1f} TF/s"
                      f"   bwd {ms_b:7.3f} ms {row['bwd_tflops']:6.1f} TF/s   rel diff {err:.1e}", flush=True)
    return rows


SPACES = {  # (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel and head dim
    128: dict(fwd=[(128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 1)],
              bwd_dkdv=[(32, 128, 8, 3), (64, 128, 8, 3), (32, 128, 8, 4), (32, 128, 8, 2), (64, 128, 8, 4),
                        (16, 128, 4, 4), (32, 64, 4, 4), (32, 128, 4, 4)],
              bwd_dq=[(128, 64, 8, 3), (128, 64, 8, 4), (128, 32, 8, 3), (64, 64, 4, 4), (128, 32, 4, 4),
                      (64, 64, 8, 3)]),
    64: dict(fwd=[(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 4, 3), (64, 64, 4, 3)],
             bwd_dkdv=[(32, 128, 4, 3), (64, 128, 8, 3), (32, 128, 8, 3), (64, 128, 4, 3), (32, 64, 4, 3)],
             bwd_dq=[(128, 32, 4, 3), (128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3)]),
    256: dict(fwd=[(64, 64, 4, 2), (64, 64, 8, 2), (128, 64, 8, 2), (64, 32, 4, 3), (128, 32, 8, 2)],
              bwd_dkdv=[(32, 64, 4, 2), (64, 64, 8, 2), (32, 64, 8, 2), (32, 128, 8, 2), (16, 64, 4, 3)],
              bwd_dq=[(64, 32, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2), (64, 32, 8, 2), (128, 64, 8, 1)]),
}


def run_sweep(args):
    rows = []
    dtype = torch.float16
    for d in args.d:
        for n in args.n:
            b = TOKENS // n
            q, k, v, do = inputs(b, HEADS, n, d, dtype)
            for causal in (False, True):
                fl = fwd_flops(b, HEADS, n, n, d, causal)
                _config.OVERRIDE.clear()
                o, lse = attention_forward(q, k, v, causal, d ** -0.5)
                for kernel, space in SPACES[d].items():
                    for cfg in space:
                        _config.OVERRIDE.clear()
                        _config.OVERRIDE[kernel] = _config.KernelConfig(*cfg)
                        try:
                            if kernel == "fwd":
                                ms = do_bench(lambda: attention_forward(q, k, v, causal, d ** -0.5), warmup=10,
                                              rep=50, return_mode="median")
                                tf = fl / ms * 1e-9
                            else:
                                ms = do_bench(lambda: attention_backward(do, q, k, v, o, lse, causal, d ** -0.5),
                                              warmup=10, rep=50, return_mode="median")
                                tf = 2.5 * fl / ms * 1e-9
                        except Exception as exc:  # noqa: BLE001
                            print(f"{kernel} {cfg} D={d} N={n} causal={causal}: {type(exc).__name__} {str(exc)[:120]}")
                            continue
                        rows.append(dict(kernel=kernel, cfg=cfg, d=d, n=n, causal=causal, ms=ms, tflops=tf))
                        print(f"{kernel:9s} {str(cfg):18s} D={d:3d} N={n:6d} causal={causal!s:5s} {ms:8.3f} ms "
                              f"{tf:6.1f} TF/s", flush=True)
    _config.OVERRIDE.clear()
    return rows


def run_profile(args):
    """Per-kernel GPU time of one forward + backward with the default configurations."""
    from torch.profiler import ProfilerActivity, profile

    rows = []
    for d in args.d:
        for n in args.n:
            b = TOKENS // n
            q, k, v, do = inputs(b, HEADS, n, d, torch.float16)
            for causal in (False, True):
                for _ in range(3):  # compile and warm up
                    o, lse = attention_forward(q, k, v, causal, d ** -0.5)
                    attention_backward(do, q, k, v, o, lse, causal, d ** -0.5)
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(10):
                        o, lse = attention_forward(q, k, v, causal, d ** -0.5)
                        attention_backward(do, q, k, v, o, lse, causal, d ** -0.5)
                    torch.cuda.synchronize()
                for ev in prof.key_averages():
                    if ev.device_type.name == "CUDA" or "kernel" in ev.key:
                        us = getattr(ev, "device_time_total", getattr(ev, "cuda_time_total", 0)) / 10
                        if us > 1:
                            rows.append(dict(d=d, n=n, causal=causal, kernel=ev.key, us=us))
                            print(f"D={d:3d} N={n:6d} causal={causal!s:5s} {ev.key[:40]:40s} {us:9.1f} us", flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["peers", "sweep", "profile"])
    parser.add_argument("--d", type=int, nargs="+", default=[128])
    parser.add_argument("--serial", action="store_true", help="also time ours with dQ after dK/dV, one stream")
    parser.add_argument("--n", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    env = dict(gpu=props.name, capability=torch.cuda.get_device_capability(0), torch=torch.__version__,
               triton=triton.__version__, python=sys.version.split()[0], date=time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()))
    print(env, flush=True)
    rows = dict(peers=run_peers, sweep=run_sweep, profile=run_profile)[args.mode](args)
    with open(os.path.join(args.out, f"{args.mode}.json"), "w") as f:
        json.dump(dict(env=env, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
