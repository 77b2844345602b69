"""The float8 forward against the bfloat16 one, with SDPA's cuDNN backend in the same run.

    PYTHONPATH=. python -m benchmarks.fp8 --out benchmarks/results/fp8

For each shape (B, H, N = M, D, causal or not): ``flashattn.attention`` on bfloat16 inputs, the
same inputs quantized to e4m3 through ``flashattn.attention_fp8`` (per-(batch, K/V head) factors),
once with v laid out (B, H, M, D), which the call copies keys last, and once with v quantized keys
last (the transpose of a (B, H, D, M) tensor), which it reads in place, and
``scaled_dot_product_attention`` with the cuDNN backend on the bfloat16 inputs (and on float8 ones,
recorded as an error where SDPA refuses them). Forward only, no grad, median of
``triton.testing.do_bench``; TFLOP/s by flashattn.cost's convention. Each output's largest
difference from float64 attention of what the provider was given (the dequantized values for float8)
is recorded beside its time. Writes ``DIR/fp8.json`` and ``DIR/fp8.md``; needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

import torch

SHAPES = [(4, 16, n, 128, causal) for n in (4096, 8192, 16384) for causal in (False, True)] + \
         [(4, 16, 8192, 64, causal) for causal in (False, True)] + [(4, 16, 8192, 256, False)]


def _quantize(x: torch.Tensor):
    amax = x.float().abs().amax(dim=(2, 3)).clamp_min(1e-12)  # (B, H): here Hq = Hkv
    descale = amax / 448.0
    return (x.float() / descale[:, :, None, None]).to(torch.float8_e4m3fn), descale


def _max_err(o, q, k, v, causal) -> float:
    """Largest |o - float64 attention| over the first batch entry and head (a check, not the time)."""
    q, k, v = (x[:1, :1].double() for x in (q, k, v))
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    want = torch.softmax(s, -1) @ v
    return (o[:1, :1].double() - want).abs().max().item()


def measure(b, h, n, d, causal) -> dict:
    import triton.testing

    import flashattn
    from flashattn import cost

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    (q8, dq), (k8, dk), (v8, dv) = (_quantize(x) for x in (q, k, v))
    deq = [x.float() * s[:, :, None, None] for x, s in ((q8, dq), (k8, dk), (v8, dv))]
    v8_keys_last = v8.transpose(2, 3).contiguous().transpose(2, 3)  # as a quantizer could write it
    flops = cost.attention_flops(b, h, n, n, d, causal=causal, mode="fwd")
    runs = {
        "flashattn_bf16": (lambda: flashattn.attention(q, k, v, causal=causal), (q, k, v)),
        "flashattn_fp8": (lambda: flashattn.attention_fp8(q8, k8, v8, dq, dk, dv, causal=causal), deq),
        "flashattn_fp8_v_keys_last": (lambda: flashattn.attention_fp8(q8, k8, v8_keys_last, dq, dk, dv, causal=causal),
                                      deq),
    }

    def sdpa(a, b_, c):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(a, b_, c, is_causal=causal)

    runs["sdpa_cudnn_bf16"] = (lambda: sdpa(q, k, v), (q, k, v))
    runs["sdpa_cudnn_fp8"] = (lambda: sdpa(q8, k8, v8), deq)
    row = {"B": b, "H": h, "N": n, "D": d, "causal": causal}
    with torch.no_grad():
        for name, (fn, given) in runs.items():
            try:
                o = fn()
                err = _max_err(o, *given, causal)
                ms = triton.testing.do_bench(fn, warmup=25, rep=100)
                row[name] = {"ms": ms, "tflops": flops / ms / 1e9, "max_err": err}
            except Exception as exc:  # noqa: BLE001 -- a provider that refuses the inputs is recorded
                row[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    return row


def markdown(payload: dict) -> str:
    env = payload["environment"]
    lines = [f"Float8 forward, {env['gpu']}, torch {env['torch']}, triton {env['triton']}; median of "
             "triton.testing.do_bench, no grad; B = 4, H = 16, N = M. Error: largest |o - float64| of the first "
             "head against what each provider was given.", "",
             "| D | N | causal | bf16 ms (TFLOP/s) | fp8 ms (TFLOP/s) | fp8, v keys last | fp8 / bf16 speed "
             "(v keys last) | fp8 error | bf16 error | cuDNN bf16 ms | fp8 / cuDNN bf16 (v keys last) | cuDNN fp8 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in payload["rows"]:
        bf, f8, f8t, cu, cu8 = (r.get(k, {}) for k in ("flashattn_bf16", "flashattn_fp8", "flashattn_fp8_v_keys_last",
                                                      "sdpa_cudnn_bf16", "sdpa_cudnn_fp8"))

        def cell(x):
            return f"{x['ms']:.3f} ({x['tflops']:.0f})" if "ms" in x else "error"

        def ratio(a, b):
            return f"{a['ms'] / b['ms']:.2f}x" if "ms" in a and "ms" in b else "-"

        speed = f"{ratio(bf, f8)} ({ratio(bf, f8t)})"
        vs_cudnn = f"{ratio(cu, f8)} ({ratio(cu, f8t)})"
        lines.append(f"| {r['D']} | {r['N']} | {r['causal']} | {cell(bf)} | {cell(f8)} | {cell(f8t)} | {speed} | "
                     f"{f8.get('max_err', float('nan')):.2e} | {bf.get('max_err', float('nan')):.2e} | "
                     f"{cell(cu)} | {vs_cudnn} | {cell(cu8) if 'ms' in cu8 else 'refused'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=pathlib.Path, required=True)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    import triton

    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    rows = []
    for shape in SHAPES:
        rows.append(measure(*shape))
        print(json.dumps(rows[-1]), flush=True)
    payload = {"environment": env, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fp8.json").write_text(json.dumps(payload, indent=1))
    (args.out / "fp8.md").write_text(markdown(payload))
    print(markdown(payload))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
