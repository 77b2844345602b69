"""Packed variable-length benchmark: flashattn.attention_varlen against FlexAttention's document mask
and against padded dense calls.

    python -m benchmarks.varlen --out DIR [--packs 3] [--head-dims 64,128] [--providers ...]

Each pack holds 16384 tokens of sequences whose lengths are drawn log-uniformly from 64 to 8192
(seeded; the last one is cut so the pack sums to 16384), 16 heads (hidden 2048 at D = 128; 32 heads at
D = 64), bfloat16, causal and not. Providers, forward and forward + backward:

* ``flashattn``: ``attention_varlen`` on the packed (total, H, D) tensors, ``validate=False`` (the
  lengths come from the benchmark, so the call makes no host sync);
* ``flex_document``: ``flex_attention`` compiled, on the (1, H, total, D) view, with a
  ``create_block_mask`` document mask (same sequence; causal: key position <= query position), the
  block mask built once outside the timed call, as a training loop that reuses it would;
* ``flashattn_padded`` / ``sdpa_flash_padded``: every sequence padded to the longest, one dense
  (B, H, max, D) call. The padding rows are computed and thrown away; without a causal mask the real
  rows also attend to padding keys, so the non-causal padded rows are **timing only** (``checked``
  false). This is the cost that packing avoids.

TFLOP/s use the project's cost model (:func:`flashattn.cost.attention_flops`) summed over the real
sequences, for every provider: padding earns no FLOPs. Before timing, each checked provider's output
is compared with the float64 per-sequence reference by the tests' ratio rule. Timing:
``triton.testing.do_bench`` (median). Writes ``DIR/varlen.json`` and ``DIR/varlen.md``.
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

from flashattn.cost import attention_flops

TOKENS = 16384
MIN_LEN, MAX_LEN = 64, 8192
HIDDEN = 2048
DTYPE = torch.bfloat16
PROVIDERS = ("flashattn", "flex_document", "flashattn_padded", "sdpa_flash_padded")
MODES = ("fwd", "fwd_bwd")


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


def pack_flops(lengths, heads: int, d: int, causal: bool, mode: str) -> float:
    """The cost model summed over the sequences of a pack (queries = keys per sequence)."""
    return sum(attention_flops(1, heads, n, n, d, causal=causal, mode=mode) for n in lengths)


def document_ids(lengths, device) -> torch.Tensor:
    """For each packed token, the index of its sequence."""
    return torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))


def document_mask_mod(doc, offsets, causal: bool):
    """FlexAttention's mask: same sequence, and (causal) key position <= query position within it.

    ``offsets[s]`` is where sequence ``s`` starts; with equal query and key lengths per sequence,
    bottom-right and top-left causal alignment agree, so positions compare directly."""
    def mask_mod(b, h, q_idx, kv_idx):
        same = doc[q_idx] == doc[kv_idx]
        if causal:
            return same & (kv_idx - offsets[doc[kv_idx]] <= q_idx - offsets[doc[q_idx]])
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


def prepare(name, q, k, v, lengths, causal):
    """``(fn, checked, inputs)``: fn() returns the packed output (total, H, D), differentiable in
    ``inputs``; ``checked`` says whether that output is attention by sequence (padded non-causal is
    not). The padded providers get padded copies of q, k, v as leaves of their own (a padded pipeline
    holds its data padded already), so the padding copy is not timed."""
    import flashattn

    cu_list = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    if name == "flashattn":
        cu = torch.tensor(cu_list, dtype=torch.int32, device=q.device)
        longest = max(lengths)
        return (lambda: flashattn.attention_varlen(q, k, v, cu, cu, longest, longest, causal=causal,
                                                   validate=False)), True, (q, k, v)
    if name == "flex_document":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        total = q.shape[0]
        doc = document_ids(lengths, q.device)
        offsets = torch.tensor(cu_list[:-1], device=q.device)
        block_mask = create_block_mask(document_mask_mod(doc, offsets, causal), None, None, total, total,
                                       device=q.device)
        torch._dynamo.reset()
        compiled = torch.compile(flex_attention, dynamic=False)
        view = (lambda x: x.transpose(0, 1)[None])  # (total, H, D) -> (1, H, total, D), no copy
        return (lambda: compiled(view(q), view(k), view(v), block_mask=block_mask)[0].transpose(0, 1)), True, (q, k, v)
    qp, kp, vp = (pad(x.detach(), lengths, cu_list).requires_grad_() for x in (q, k, v))
    if name == "flashattn_padded":
        return (lambda: unpad(flashattn.attention(qp, kp, vp, causal=causal), lengths)), causal, (qp, kp, vp)
    if name == "sdpa_flash_padded":
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def fn():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return unpad(F.scaled_dot_product_attention(qp, kp, vp, is_causal=causal), lengths)
        return fn, causal, (qp, kp, vp)
    raise ValueError(f"unknown provider {name!r}")


def check(o, q, k, v, lengths, causal) -> dict:
    """Error against the float64 per-sequence reference, next to the reference's own in bfloat16."""
    from flashattn.reference import varlen_attention
    from flashattn.testing import rel_err

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    ref = varlen_attention(q.double(), k.double(), v.double(), cu, cu, causal)[0]
    lowp = varlen_attention(q, k, v, cu, cu, causal)[0]
    err, base = rel_err(o, ref), rel_err(lowp, ref)
    return {"rel_err": err, "torch_bf16_rel_err": base, "passed": bool(err <= 2.0 * base + 1e-5)}


def _bench(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def run(packs: int, head_dims, providers, device) -> dict:
    rows = []
    for seed in range(packs):
        lengths = draw_lengths(TOKENS, MIN_LEN, MAX_LEN, seed)
        for d in head_dims:
            heads = HIDDEN // d
            gen = torch.Generator(device=device).manual_seed(seed)
            q, k, v = (torch.randn(TOKENS, heads, d, dtype=DTYPE, device=device, generator=gen).requires_grad_()
                       for _ in range(3))
            do = torch.randn_like(q)
            for causal in (False, True):
                for name in providers:
                    row = {"pack": seed, "lengths": lengths, "D": d, "heads": heads, "causal": causal, "provider": name}
                    try:
                        fn, checked, inputs = prepare(name, q, k, v, lengths, causal)
                        row["checked"] = checked
                        if checked:
                            row["check"] = check(fn().detach(), q.detach(), k.detach(), v.detach(), lengths, causal)
                        fwd_ms = _bench(fn)

                        def fwd_bwd():
                            torch.autograd.grad(fn(), inputs, do)
                        total_ms = _bench(fwd_bwd)
                        row.update(status="ok", fwd_ms=fwd_ms, fwd_bwd_ms=total_ms,
                                   fwd_tflops=pack_flops(lengths, heads, d, causal, "fwd") / (fwd_ms * 1e-3) / 1e12,
                                   fwd_bwd_tflops=pack_flops(lengths, heads, d, causal, "fwd_bwd")
                                   / (total_ms * 1e-3) / 1e12)
                    except Exception as exc:  # a provider that cannot run this point is recorded, not fatal
                        row.update(status="error", error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
                    rows.append(row)
                    print(json.dumps({k_: v_ for k_, v_ in row.items() if k_ != "lengths"}), flush=True)
    return {"rows": rows}


def markdown(results: dict) -> str:
    lines = ["| pack | D | causal | provider | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | check |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results["rows"]:
        if r.get("status") != "ok":
            lines.append(f"| {r['pack']} | {r['D']} | {r['causal']} | {r['provider']} | error: {r['error']} |||||")
            continue
        verdict = ("pass" if r["check"]["passed"] else "FAIL") if r["checked"] else "timing only"
        lines.append(f"| {r['pack']} | {r['D']} | {r['causal']} | {r['provider']} | {r['fwd_ms']:.3f} | "
                     f"{r['fwd_tflops']:.0f} | {r['fwd_bwd_ms']:.3f} | {r['fwd_bwd_tflops']:.0f} | {verdict} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=pathlib.Path)
    ap.add_argument("--packs", type=int, default=3, help="packs of different drawn lengths (seeds 0..)")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--providers", default=",".join(PROVIDERS))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.varlen needs a CUDA device", file=sys.stderr)
        return 2
    providers = [p for p in args.providers.split(",") if p]
    unknown = set(providers) - set(PROVIDERS)
    if unknown:
        ap.error(f"--providers takes a subset of {PROVIDERS}, got {sorted(unknown)}")
    device = torch.device("cuda")
    results = run(args.packs, [int(x) for x in args.head_dims.split(",")], providers, device)
    import triton

    results["environment"] = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
                              "triton": triton.__version__, "python": platform.python_version(),
                              "tokens": TOKENS, "lengths": [MIN_LEN, MAX_LEN], "dtype": str(DTYPE),
                              "flashattn_sources_sha256": package_sources_sha256()}
    table = markdown(results)
    results_mod.save_table(args.out, "varlen", results, table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
