"""CPU cost of one launch vs GPU time at small N: is a short backward bound by the host?

    PYTHONPATH=. python3 tools/gpu/overhead.py   # needs tools/gpu/baseline_kernels (see ab.py)
"""
import time

import torch
from triton.testing import do_bench

from flashattn.backward import attention_backward
from flashattn.forward import attention_forward


def host_us(fn, reps=200):
    fn(); torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / reps * 1e6


def main():
    from tools.gpu.baseline_kernels.backward import attention_backward as old_bwd
    from tools.gpu.baseline_kernels.forward import attention_forward as old_fwd

    for d, n, causal in ((128, 512, True), (128, 512, False), (64, 512, False), (128, 1024, True), (128, 2048, True)):
        b, h = 16384 // n, 2048 // d
        q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float16) for _ in range(4))
        for name, fwd, bwd in (("new", attention_forward, attention_backward), ("old", old_fwd, old_bwd)):
            o, lse = fwd(q, k, v, causal, d ** -0.5)
            f = lambda: fwd(q, k, v, causal, d ** -0.5)
            g = lambda: bwd(do, q, k, v, o, lse, causal, d ** -0.5)
            gpu_f = [do_bench(f, warmup=25, rep=100, return_mode="median") * 1e3 for _ in range(3)]
            gpu_b = [do_bench(g, warmup=25, rep=100, return_mode="median") * 1e3 for _ in range(3)]
            print(f"{name} D={d} N={n} causal={causal}: fwd host {host_us(f):6.1f} us, timed {gpu_f[0]:6.1f}/{gpu_f[1]:6.1f}/{gpu_f[2]:6.1f} us; "
                  f"bwd host {host_us(g):6.1f} us, timed {gpu_b[0]:6.1f}/{gpu_b[1]:6.1f}/{gpu_b[2]:6.1f} us", flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                attention_backward(do, q, k, v, o, lse, causal, d ** -0.5)
            torch.cuda.synchronize()
        for ev in prof.key_averages():
            us = getattr(ev, "device_time_total", 0) / 5
            if us > 1:
                print(f"    {ev.key[:30]:30s} {us:8.1f} us per backward")


if __name__ == "__main__":
    main()
