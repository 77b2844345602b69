# --8<-- [start:statement]
"""Backward precision: where float16 and bfloat16 lose accuracy in the backward pass, measured.

The kernels accumulate every product in float32, but four things are rounded to the input dtype:
the inputs Q, K, V, dO themselves; P before O += P V and dV += Pᵀ dO (so the products run on the
tensor cores); dS before dK += dSᵀ Q and dQ += dS K; and the stored O, from which δ = rowsum(dO ∘ O)
is formed. δ then describes the O that the rounded P produced and that was rounded again when
stored, while dS multiplies the float32 P and dP: rowsum(dS) = 0, exact in real arithmetic, fails by
about the rounding error of the input dtype, and both roundings contribute. bfloat16 keeps 8 significant bits and float16
11, so each bfloat16 error is several times the float16 one.

This module emulates those rounding points in PyTorch on the CPU (float32 arithmetic, rounding where
the kernels round), measures each output's relative error against float64 on the same rounded inputs,
and compares it with PyTorch's own computation in the low-precision dtype. The numbers are measured
when the check runs; none is typed in.
"""
# --8<-- [end:statement]

from __future__ import annotations

import math

from ._result import CheckResult, Ledger

IDENTITY = "backward precision: error of O, dQ, dK, dV in float16 vs bfloat16 against float64; rowsum(dS) ≠ 0"
METHOD = ("PyTorch emulation of the kernels' rounding points (P, dS, O, δ) against float64 on the same inputs; "
          "PyTorch's own low-precision autograd as the yardstick")
NEGATIVE = ("'rowsum(dS) = 0 in the kernel's arithmetic'; 'bfloat16 is as accurate as float16'; "
            "'the last rounding is the largest share of the error'")

NAMES = ("O", "dQ", "dK", "dV")


# --8<-- [start:proof]
def unit_roundoff() -> dict:
    """u = 2^-(significand bits) for round-to-nearest: half of torch.finfo(dtype).eps."""
    import torch

    return {str(t).removeprefix("torch."): torch.finfo(t).eps / 2 for t in (torch.float16, torch.bfloat16)}
# --8<-- [end:proof]


# --8<-- [start:numeric]
# --8<-- [start:emulation]
def inputs(dtype, n=256, m=256, d=64, seed=0):
    """q, k, v, dO drawn in float64 and rounded to `dtype`: every method below sees the same numbers."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, d, generator=gen, dtype=torch.float64).to(dtype) for rows in (n, m, m, n)]


def exact(q, k, v, do):
    """float64 forward and backward by the definition (the ground truth)."""
    q, k, v, do = (x.double() for x in (q, k, v, do))
    tau = q.shape[1] ** -0.5
    p = (tau * q @ k.T).softmax(-1)
    o = p @ v
    dp = do @ v.T
    ds = p * (dp - (p * dp).sum(-1, keepdim=True))
    return dict(O=o, dQ=tau * ds @ k, dK=tau * ds.T @ q, dV=p.T @ do, dS=ds)


def kernel_like(q, k, v, do, round_p=True, round_ds=True, delta_from="stored O", round_out=True):
    """The kernels' arithmetic: float32 products and softmax; P and dS rounded to the input dtype before
    their products; O stored in the input dtype; δ from the stored O (or from the float32 O); the
    results rounded to the input dtype as they are stored (or, with round_out=False, kept in float32:
    then only the internal roundings show)."""
    import torch

    low, f32 = q.dtype, torch.float32
    rnd = lambda x, on=True: x.to(low).to(f32) if on else x
    q32, k32, v32, do32 = (x.to(f32) for x in (q, k, v, do))
    tau = q.shape[1] ** -0.5
    s2 = (q32 @ k32.T) * (tau * math.log2(math.e))          # base-2 scores
    lse2 = torch.logsumexp(s2 * math.log(2), -1) / math.log(2)
    p = torch.exp2(s2 - lse2[:, None])                       # normalised: the backward's recomputed P
    # forward: acc += rnd(p~) V with p~ = exp2(s - m), then O = acc / l; normalising first is the same
    # up to float32 rounding, so P itself is rounded here
    o32 = rnd(p, round_p) @ v32
    o_stored = o32.to(low).to(f32)
    dv = rnd(p, round_p).T @ do32
    dp = do32 @ v32.T
    delta = (do32 * (o_stored if delta_from == "stored O" else o32)).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    dq = tau * rnd(ds, round_ds) @ k32
    dk = tau * rnd(ds, round_ds).T @ q32
    out = rnd if round_out else (lambda x: x)
    return dict(O=out(o32), dQ=out(dq), dK=out(dk), dV=out(dv), dS=ds)


def torch_low_precision(q, k, v, do):
    """PyTorch autograd of the definition, computed in the low-precision dtype itself."""
    q, k, v = (x.clone().requires_grad_(True) for x in (q, k, v))
    tau = q.shape[1] ** -0.5
    o = (tau * q @ k.T).softmax(-1) @ v
    o.backward(do)
    return dict(O=o.detach(), dQ=q.grad, dK=k.grad, dV=v.grad)


def rel_error(got, want) -> float:
    return float((got.double() - want).norm() / want.norm())


def rowsum_ds(ds) -> float:
    """max_i |Σ_j dS_ij| relative to max |dS|: zero in exact arithmetic."""
    return float(ds.double().sum(-1).abs().max() / ds.double().abs().max())


def measure():
    import torch

    table = {}
    for dtype in (torch.float16, torch.bfloat16):
        x = inputs(dtype)
        ref, ker, pt = exact(*x), kernel_like(*x), torch_low_precision(*x)
        table[str(dtype).removeprefix("torch.")] = dict(
            kernel={k: rel_error(ker[k], ref[k]) for k in NAMES},
            torch={k: rel_error(pt[k], ref[k]) for k in NAMES},
            keep_ds={k: rel_error(kernel_like(*x, round_ds=False)[k], ref[k]) for k in NAMES},
            keep_p_ds={k: rel_error(kernel_like(*x, round_p=False, round_ds=False)[k], ref[k]) for k in NAMES},
            # the two shares of the kernel's error, each measured alone
            internal={k: rel_error(kernel_like(*x, round_out=False)[k], ref[k]) for k in NAMES},
            last={k: rel_error(ref[k].to(dtype), ref[k]) for k in NAMES},
            rowsum=dict(exact=rowsum_ds(ref["dS"]), kernel=rowsum_ds(ker["dS"]),
                        delta_from_float32_O=rowsum_ds(kernel_like(*x, delta_from="float32 O")["dS"]),
                        all_float32=rowsum_ds(kernel_like(*x, round_p=False, delta_from="float32 O")["dS"])),
        )
    return table
# --8<-- [end:emulation]
# --8<-- [end:numeric]


def check() -> CheckResult:
    table = measure()
    ledger = Ledger()
    u = unit_roundoff()
    ledger.claim(f"unit roundoff: float16 2^{math.log2(u['float16']):.0f}, bfloat16 2^{math.log2(u['bfloat16']):.0f}, "
                 f"ratio {u['bfloat16'] / u['float16']:.0f}", u["float16"] == 2.0 ** -11 and u["bfloat16"] == 2.0 ** -8)
    fp16, bf16 = table["float16"], table["bfloat16"]
    for dtype, row in table.items():
        ledger.claim(f"{dtype}, N = M = 256, d = 64, relative error vs float64 — kernel arithmetic: "
                     + ", ".join(f"{k} {row['kernel'][k]:.1e}" for k in NAMES)
                     + "; PyTorch in " + dtype + ": " + ", ".join(f"{k} {row['torch'][k]:.1e}" for k in NAMES),
                     all(row["kernel"][k] <= 2 * row["torch"][k] for k in NAMES))
        ledger.claim(f"{dtype}: dS kept in float32 instead of rounded: dQ {row['keep_ds']['dQ']:.1e}, "
                     f"dK {row['keep_ds']['dK']:.1e} (rounding dS is a visible part of their error)",
                     all(row["keep_ds"][k] < row["kernel"][k] for k in ("dQ", "dK")))
        ledger.claim(f"{dtype}: P and dS kept in float32 (δ still from the stored O): "
                     + ", ".join(f"{k} {row['keep_p_ds'][k]:.1e}" for k in NAMES),
                     all(row["keep_p_ds"][k] < row["kernel"][k] for k in NAMES))
        ledger.claim(f"{dtype}: the shares, each alone — internal roundings (P, dS, stored O; results kept in "
                     "float32): " + ", ".join(f"{k} {row['internal'][k]:.1e}" for k in NAMES)
                     + "; the last rounding (the float64 result rounded to " + dtype + "): "
                     + ", ".join(f"{k} {row['last'][k]:.1e}" for k in NAMES)
                     + " — comparable, within 2× of each other for the gradients",
                     all(0.5 < row["internal"][k] / row["last"][k] < 2 for k in ("dQ", "dK", "dV")))
        r = row["rowsum"]
        ledger.claim(f"{dtype}: max|rowsum(dS)|/max|dS| = {r['exact']:.1e} in float64; {r['kernel']:.1e} in the "
                     f"kernel's arithmetic; {r['delta_from_float32_O']:.1e} with δ from the unrounded O (P still "
                     f"rounded for P V); {r['all_float32']:.1e} with neither rounding",
                     r["exact"] < 1e-12 and r["kernel"] > 100 * r["all_float32"]
                     and r["delta_from_float32_O"] > 100 * r["all_float32"])
    ratios = {k: bf16["kernel"][k] / fp16["kernel"][k] for k in NAMES}
    ledger.claim("bfloat16 / float16 error ratio: " + ", ".join(f"{k} {v:.1f}×" for k, v in ratios.items())
                 + " (2^3 = 8 for 3 fewer significand bits)", all(3 < v < 20 for v in ratios.values()))
    # --8<-- [start:negative]
    ledger.control("'rowsum(dS) = 0 in the kernel's arithmetic' (as in float64, ≤ 1e-12)",
                   all(row["rowsum"]["kernel"] > 1e-6 for row in table.values()))
    ledger.control("'bfloat16 gradients are as accurate as float16' (within 2×)",
                   all(bf16["kernel"][k] > 2 * fp16["kernel"][k] for k in NAMES))
    ledger.control("'the last rounding is the largest share' (internal share below 2/3 of the last, for dQ and dK)",
                   all(row["internal"][k] > row["last"][k] * 2 / 3 for row in table.values() for k in ("dQ", "dK")))
    # --8<-- [end:negative]
    return ledger.result(identity=IDENTITY, method=METHOD, sizes="N = M = 256, d = 64, one head, seed 0",
                         negative_control=NEGATIVE, module=__name__)
