"""Packed variable-length benchmark: flashattn.attention_varlen against FlexAttention's document mask
and against padded dense calls.

    python -m benchmarks.varlen --out DIR [--packs 3] [--head-dims 64,128] [--providers ...]
    python -m benchmarks.varlen --out DIR --window 1024 [--packs 1] [--name varlen_window]

Each pack holds 16384 tokens of sequences whose lengths are drawn log-uniformly from 64 to 8192
(seeded; the last one is cut so the pack sums to 16384), 16 heads (hidden 2048 at D = 128; 32 heads at
D = 64), bfloat16, causal and not. Providers, timed forward, backward and forward + backward:

* ``flashattn``: ``attention_varlen`` on the packed (total, H, D) tensors, ``validate=False`` (the
  lengths come from the benchmark, so the call makes no host sync);
* ``flex_document``: ``flex_attention`` compiled, on the (1, H, total, D) view, with a
  ``create_block_mask`` document mask (same sequence; causal: key position <= query position), the
  block mask built once outside the timed call, as a training loop that reuses it would;
* ``flashattn_padded`` / ``sdpa_flash_padded``: every sequence padded to the longest, one dense
  (B, H, max, D) call. The padding rows are computed and thrown away; without a causal mask the real
  rows also attend to padding keys, so the non-causal padded rows are **timing only** (``checked``
  false). This is the cost that packing avoids.

``--window W``: every sequence attends through a causal sliding window of W keys (query i of a sequence
sees its keys i - W + 1 .. i), and only causal runs: flashattn ``window=(W - 1, 0)`` (packed and
padded), FlexAttention's document mask gains ``q_pos - k_pos < W`` (positions within the sequence),
SDPA's flash backend has no window and is recorded ``unsupported``; the check's reference is
``reference.varlen_attention(..., window=(W - 1, 0))``. Results go to ``varlen_window`` unless
``--name`` says otherwise, so a plain run's ``varlen.json`` stays.

TFLOP/s use the project's cost model (:func:`flashattn.cost.attention_flops`) summed over the real
sequences, for every provider: padding earns no FLOPs; under a window only the pairs inside it count
(row i of a sequence: min(i + 1, W) keys, :func:`pack_flops`). Before timing, each checked provider's
output is compared with the float64 per-sequence reference by the tests' ratio rule. Timing:
``triton.testing.do_bench`` (median) of the forward, of the backward alone (one forward, then
``backward(retain_graph=True)`` with the gradients cleared before each call, as
:func:`benchmarks.measure.time_backward`) and of forward + backward. Writes ``DIR/NAME.json`` and
``DIR/NAME.md`` (``NAME`` = ``varlen`` by default).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import platform
import sys

import torch

from benchmarks import results as results_mod
from benchmarks.provenance import package_sources_sha256
from benchmarks.variants import pair_count

from flashattn import cost
from flashattn.cost import attention_flops

TOKENS = 16384
MIN_LEN, MAX_LEN = 64, 8192
HIDDEN = 2048
DTYPE = torch.bfloat16
PROVIDERS = ("flashattn", "flex_document", "flashattn_padded", "sdpa_flash_padded")
MODES = ("fwd", "bwd", "fwd_bwd")


class Unsupported(RuntimeError):
    """A provider that lacks the run's variant (recorded as ``unsupported``, never as a number)."""


def draw_lengths(tokens: int, low: int, high: int, seed: int) -> list[int]:
    """Sequence lengths drawn log-uniformly from [low, high], in order, until they sum to ``tokens``
    (the last one cut short, but never below 1)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < tokens:
        u = float(torch.rand((), generator=gen))
        lengths.append(int(round(math.exp(math.log(low) + u * (math.log(high) - math.log(low))))))
    lengths[-1] -= sum(lengths) - tokens
    return lengths


def pack_flops(lengths, heads: int, d: int, causal: bool, mode: str, window: int | None = None) -> float:
    """The cost model summed over the sequences of a pack (queries = keys per sequence). Under a causal
    sliding window of ``window`` keys only the pairs inside it count, at the cost model's FLOPs per pair
    (row i of a sequence of length n sees min(i + 1, window) keys)."""
    if window is None:
        return sum(attention_flops(1, heads, n, n, d, causal=causal, mode=mode) for n in lengths)
    return sum(float(cost.FORWARD_FLOPS_PER_PAIR_AND_DIM * heads * pair_count(n, n, causal, (window - 1, 0)) * d)
               * cost.MODES[mode] for n in lengths)


def document_ids(lengths, device) -> torch.Tensor:
    """For each packed token, the index of its sequence."""
    return torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))


def document_mask_mod(doc, offsets, causal: bool, window: int | None = None):
    """FlexAttention's mask: same sequence, and (causal) key position <= query position within it,
    and (``window``) query position - key position < window.

    ``offsets[s]`` is where sequence ``s`` starts; with equal query and key lengths per sequence,
    bottom-right and top-left causal alignment agree, so positions compare directly."""
    def mask_mod(b, h, q_idx, kv_idx):
        same = doc[q_idx] == doc[kv_idx]
        q_pos, k_pos = q_idx - offsets[doc[q_idx]], kv_idx - offsets[doc[kv_idx]]
        if causal:
            same = same & (k_pos <= q_pos)
        if window is not None:
            same = same & (q_pos - k_pos < window)
        return same
    return mask_mod


def pad(x, lengths, cu) -> torch.Tensor:
    """Packed (total, H, D) -> (B, H, max, D) with zeros after each sequence's end."""
    longest = max(lengths)
    out = x.new_zeros((len(lengths), x.shape[1], longest, x.shape[2]))
    for i, n in enumerate(lengths):
        out[i, :, :n] = x[cu[i]:cu[i] + n].transpose(0, 1)
    return out


def unpad(x, lengths) -> torch.Tensor:
    """(B, H, max, D) -> packed (total, H, D), dropping the padding rows."""
    return torch.cat([x[i, :, :n].transpose(0, 1) for i, n in enumerate(lengths)], 0)


def prepare(name, q, k, v, lengths, causal, window: int | None = None):
    """``(fn, checked, inputs)``: fn() returns the packed output (total, H, D), differentiable in
    ``inputs``; ``checked`` says whether that output is attention by sequence (padded non-causal is
    not). The padded providers get padded copies of q, k, v as leaves of their own (a padded pipeline
    holds its data padded already), so the padding copy is not timed. ``window``: a causal sliding
    window of that many keys per sequence (raises :class:`Unsupported` for a provider without one)."""
    import flashattn

    if window is not None and not causal:
        raise ValueError("the window runs are causal only")
    variant = {} if window is None else {"window": (window - 1, 0)}
    cu_list = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    if name == "flashattn":
        cu = torch.tensor(cu_list, dtype=torch.int32, device=q.device)
        longest = max(lengths)
        return (lambda: flashattn.attention_varlen(q, k, v, cu, cu, longest, longest, causal=causal,
                                                   validate=False, **variant)), True, (q, k, v)
    if name == "sdpa_flash_padded" and window is not None:
        raise Unsupported("SDPA's flash backend has no sliding window (only is_causal or a dense attn_mask)")
    if name == "flex_document":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        total = q.shape[0]
        doc = document_ids(lengths, q.device)
        offsets = torch.tensor(cu_list[:-1], device=q.device)
        block_mask = create_block_mask(document_mask_mod(doc, offsets, causal, window), None, None, total, total,
                                       device=q.device)
        torch._dynamo.reset()
        compiled = torch.compile(flex_attention, dynamic=False)
        view = (lambda x: x.transpose(0, 1)[None])  # (total, H, D) -> (1, H, total, D), no copy
        return (lambda: compiled(view(q), view(k), view(v), block_mask=block_mask)[0].transpose(0, 1)), True, (q, k, v)
    qp, kp, vp = (pad(x.detach(), lengths, cu_list).requires_grad_() for x in (q, k, v))
    if name == "flashattn_padded":
        return (lambda: unpad(flashattn.attention(qp, kp, vp, causal=causal, **variant), lengths)), causal, (qp, kp, vp)
    if name == "sdpa_flash_padded":
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def fn():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return unpad(F.scaled_dot_product_attention(qp, kp, vp, is_causal=causal), lengths)
        return fn, causal, (qp, kp, vp)
    raise ValueError(f"unknown provider {name!r}")


def references(q, k, v, lengths, causal, window: int | None = None):
    """``(ref, lowp)``: the per-sequence reference output in float64 and in the inputs' own precision."""
    from flashattn.reference import varlen_attention

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    win = None if window is None else (window - 1, 0)
    ref = varlen_attention(q.double(), k.double(), v.double(), cu, cu, causal, window=win)[0]
    lowp = varlen_attention(q, k, v, cu, cu, causal, window=win)[0]
    return ref, lowp


def check(o, q, k, v, lengths, causal, window: int | None = None, refs=None) -> dict:
    """Error against the float64 per-sequence reference, next to the reference's own in bfloat16
    (``refs``: :func:`references` of these inputs, computed here when None)."""
    from flashattn.testing import rel_err

    ref, lowp = refs if refs is not None else references(q, k, v, lengths, causal, window)
    err, base = rel_err(o, ref), rel_err(lowp, ref)
    return {"rel_err": err, "torch_bf16_rel_err": base, "passed": bool(err <= 2.0 * base + 1e-5)}


def _bench(fn, grad_to_none=None) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median"))


def time_passes(fn, inputs, do, bench=_bench) -> dict:
    """Milliseconds of the forward, of the backward alone (one forward, then ``backward(retain_graph=True)``
    with the inputs' gradients cleared before each call, so no accumulation is timed), and of both."""
    times = {"fwd": bench(fn)}
    o = fn()
    try:
        times["bwd"] = bench(lambda: o.backward(do, retain_graph=True), grad_to_none=list(inputs))
    finally:
        for x in inputs:
            x.grad = None
    times["fwd_bwd"] = bench(lambda: torch.autograd.grad(fn(), inputs, do))
    return times


def run(packs: int, head_dims, providers, device, window: int | None = None, bench=_bench, tokens: int = TOKENS,
        lengths_range=(MIN_LEN, MAX_LEN), hidden: int = HIDDEN, log=print) -> dict:
    """Every pack x head dim x mask x provider; with ``window``, causal only. ``bench``, ``tokens``,
    ``lengths_range`` and ``hidden`` let the CPU tests run the loop small with a fake timer."""
    rows = []
    masks = (True,) if window is not None else (False, True)
    for seed in range(packs):
        lengths = draw_lengths(tokens, *lengths_range, seed)
        for d in head_dims:
            heads = hidden // d
            gen = torch.Generator(device=device).manual_seed(seed)
            q, k, v = (torch.randn(tokens, heads, d, dtype=DTYPE, device=device, generator=gen).requires_grad_()
                       for _ in range(3))
            do = torch.randn_like(q)
            for causal in masks:
                refs = None  # computed once, by the first checked provider
                for name in providers:
                    row = {"pack": seed, "lengths": lengths, "D": d, "heads": heads, "causal": causal,
                           "window": window, "provider": name}
                    try:
                        fn, checked, inputs = prepare(name, q, k, v, lengths, causal, window)
                        row["checked"] = checked
                        if checked:
                            if refs is None:
                                refs = references(q.detach(), k.detach(), v.detach(), lengths, causal, window)
                            row["check"] = check(fn().detach(), q.detach(), k.detach(), v.detach(), lengths, causal,
                                                 window, refs)
                        times = time_passes(fn, inputs, do, bench)
                        row["status"] = "ok"
                        for mode, ms in times.items():
                            row[f"{mode}_ms"] = ms
                            flops = pack_flops(lengths, heads, d, causal, mode, window)
                            row[f"{mode}_tflops"] = flops / (ms * 1e-3) / 1e12
                    except Unsupported as exc:
                        row.update(status="unsupported", error=str(exc))
                    except Exception as exc:  # a provider that cannot run this point is recorded, not fatal
                        row.update(status="error", error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
                    rows.append(row)
                    log(json.dumps({k_: v_ for k_, v_ in row.items() if k_ != "lengths"}))
                del refs
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
    return {"rows": rows}


def markdown(results: dict) -> str:
    rows = results["rows"]
    window = next((r.get("window") for r in rows if r.get("window")), None)
    lines = [f"Causal sliding window of {window} keys inside each sequence.", ""] if window else []
    lines += ["| pack | D | causal | provider | fwd ms | fwd TFLOP/s | bwd ms | bwd TFLOP/s | fwd+bwd ms | "
              "fwd+bwd TFLOP/s | check |", "| --- " * 11 + "|"]
    for r in rows:
        if r.get("status") != "ok":
            lines.append(f"| {r['pack']} | {r['D']} | {r['causal']} | {r['provider']} | "
                         f"{r.get('status', 'error')}: {r['error']} |||||||")
            continue
        verdict = ("pass" if r["check"]["passed"] else "FAIL") if r["checked"] else "timing only"
        times = " | ".join(f"{r[mode + '_ms']:.3f} | {r[mode + '_tflops']:.0f}" for mode in MODES if mode + "_ms" in r)
        lines.append(f"| {r['pack']} | {r['D']} | {r['causal']} | {r['provider']} | {times} | {verdict} |")
    ratios = []
    for r in rows:
        if r["provider"] != "flashattn" or r.get("status") != "ok":
            continue
        peer = next((p for p in rows if p["provider"] == "flex_document" and p.get("status") == "ok"
                     and (p["pack"], p["D"], p["causal"]) == (r["pack"], r["D"], r["causal"])), None)
        if peer is not None and all(mode + "_ms" in r and mode + "_ms" in peer for mode in MODES):
            ratios.append(f"| {r['pack']} | {r['D']} | {r['causal']} | "
                          + " | ".join(f"{peer[mode + '_ms'] / r[mode + '_ms']:.2f}x" for mode in MODES) + " |")
    if ratios:
        lines += ["", "flex_document time / flashattn time (above 1: flashattn is faster):", "",
                  "| pack | D | causal | fwd | bwd | fwd+bwd |", "| --- " * 6 + "|", *ratios]
    return "\n".join(lines) + "\n"


def parse_args(ap, argv):
    """The parsed options with ``head_dims`` and ``providers`` as lists and ``name`` resolved; bad
    values are refused by ``ap.error``."""
    args = ap.parse_args(argv)
    args.providers = [p for p in args.providers.split(",") if p]
    unknown = set(args.providers) - set(PROVIDERS)
    if unknown:
        ap.error(f"--providers takes a subset of {PROVIDERS}, got {sorted(unknown)}")
    args.head_dims = [int(x) for x in args.head_dims.split(",") if x]
    if args.window is not None and args.window < 1:
        ap.error(f"--window takes a number of keys >= 1, got {args.window}")
    if args.name is None:
        args.name = "varlen" if args.window is None else "varlen_window"
    if not args.name or "/" in args.name or args.name.startswith("."):
        ap.error(f"--name takes a plain file stem, got {args.name!r}")
    return args


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=pathlib.Path)
    ap.add_argument("--packs", type=int, default=3, help="packs of different drawn lengths (seeds 0..)")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--providers", default=",".join(PROVIDERS))
    ap.add_argument("--window", type=int, default=None,
                    help="a causal sliding window of this many keys inside each sequence (causal runs only)")
    ap.add_argument("--name", default=None,
                    help="results file stem (default: varlen, or varlen_window with --window)")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = parse_args(ap, argv)
    if not torch.cuda.is_available():
        print("benchmarks.varlen needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    results = run(args.packs, args.head_dims, args.providers, device, window=args.window)
    import triton

    results["environment"] = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
                              "triton": triton.__version__, "python": platform.python_version(),
                              "tokens": TOKENS, "lengths": [MIN_LEN, MAX_LEN], "dtype": str(DTYPE),
                              "window": args.window, "flashattn_sources_sha256": package_sources_sha256()}
    table = markdown(results)
    results_mod.save_table(args.out, args.name, results, table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
