"""Decoding benchmark: one (or a few) new queries against a KV cache, flashattn against its peers.

    python -m benchmarks.decode --out DIR [--batches 1,16,64] [--seqlens 1024,...] [--queries 1,16]

Grid: B = 1, 16 and 64 sequences, 32 query heads sharing 8 K/V heads (GQA 4), D = 128, bfloat16, a
cache of M = 1k .. 128k keys per sequence (every sequence full), Nq = 1 and 16 new queries. The cache
is stored (B, M, Hkv, D), as ``flash_attn_with_kvcache`` and flashattn take it; the peers get the
(B, Hkv, M, D) transposed *views* of the same memory (no copy), and a contiguous copy only if a
backend refuses the view (recorded per row as ``layout``).

Every provider computes the same thing: attention **without** a causal mask. For one query causal
and non-causal agree; for 16 queries bottom-right causal would hide 15 diagonal keys, and SDPA's
``is_causal`` is top-left aligned (it would hide almost the whole cache), so no provider masks.

* ``flashattn``: ``flashattn.decode.attention_with_kvcache`` with int32 ``cache_seqlens`` (as a
  server calls it; the call checks the lengths against the capacity with one device sync);
* ``flashattn_int``: the same with ``cache_seqlens`` a Python int (no sync);
* ``sdpa_flash``, ``sdpa_cudnn``: ``scaled_dot_product_attention`` under ``sdpa_kernel`` of one
  backend, with ``enable_gqa=True`` (K/V not repeated); if the backend refuses GQA, K/V repeated to
  32 heads *outside* the timed call (recorded as ``gqa = "repeated"``, and it reads 4x the bytes);
* ``flex``: ``flex_attention`` compiled (``torch.compile(dynamic=False)``), ``enable_gqa=True``;
* ``flashattn_dense``: ``flashattn.attention`` on the (B, H, L, D) views, the dense entry point as
  transformers' ``generate()`` calls it; it hands few queries against many keys to the split-KV
  kernels (:attr:`flashattn.problem.Problem.split_kv`);
* ``sdpa_efficient``: the memory-efficient SDPA backend, like the other two.

``--heads 32:8`` sets the query and K/V heads and ``--dtype`` the dtype (defaults: 32:8, bfloat16);
``--name`` names the output files (``DIR/NAME.json``, ``DIR/NAME.md``).

Timing, two modes per provider: ``eager`` is ``triton.testing.do_bench`` of the call (median; the L2
cache is flushed before every call), so a call's host work counts whenever it is longer than its
kernels; ``graph`` captures the call once in a CUDA graph and times ``graph.replay()`` the same
way, which is how decoding loops in serving code usually run and leaves only the GPU work. Bandwidth
is the K and V bytes of the cache over the time, reported as a fraction of the copy bandwidth
measured in the same run (``dst.copy_(src)`` of 1 GiB, read + write bytes). Each provider's output
is checked against the float64 reference (on the first two sequences) with the tests' ratio rule
before it is timed. Writes ``DIR/decode.json`` and ``DIR/decode.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import platform
import sys
import time

import torch

from benchmarks import results as results_mod
from benchmarks.provenance import package_sources_sha256

H_Q, H_KV, D = 32, 8, 128
DTYPE = torch.bfloat16
BATCHES = (1, 16, 64)
SEQLENS = (1024, 4096, 16384, 65536, 131072)
QUERIES = (1, 16)
MODES = ("eager", "graph")
CHECKED_SEQUENCES = 2  # the float64 reference of a whole 64 x 128k cache would not fit
PROVIDERS = ("flashattn", "flashattn_int", "sdpa_flash", "sdpa_cudnn", "flex")
OPTIONAL = ("flashattn_dense", "sdpa_efficient")  # asked for by name (--providers)


def _bench(fn, rep: int = 100) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=rep, return_mode="median"))


def copy_bandwidth(device) -> float:
    """Bytes per second of ``dst.copy_(src)`` on 1 GiB (read + written bytes)."""
    src = torch.empty(1 << 29, dtype=torch.float16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = _bench(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def _graph_bench(fn, rep: int = 100) -> float:
    """do_bench of ``fn`` captured once in a CUDA graph: the GPU time of the call, without its host work."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the capture (allocator, lazy initialization)
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _bench(graph.replay, rep)


def make_inputs(batch, m, n_q, device, seed=0, heads=(H_Q, H_KV), dtype=DTYPE):
    gen = torch.Generator(device=device).manual_seed(seed)
    B, (h_q, h_kv) = batch, heads
    q = torch.randn(B, n_q, h_q, D, dtype=dtype, device=device, generator=gen)
    k_cache = torch.randn(B, m, h_kv, D, dtype=dtype, device=device, generator=gen)
    v_cache = torch.randn(B, m, h_kv, D, dtype=dtype, device=device, generator=gen)
    return q, k_cache, v_cache


def prepare(name, q, k_cache, v_cache):
    """``(fn, info)``: fn() returns o as (B, Nq, Hq, D); info says how the provider was called."""
    import torch.nn.functional as F

    B, m = k_cache.shape[:2]
    if name in ("flashattn", "flashattn_int"):
        from flashattn.decode import attention_with_kvcache

        lengths = m if name == "flashattn_int" else torch.full((B,), m, dtype=torch.int32, device=q.device)
        return (lambda: attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, causal=False),
                {"gqa": "packed", "layout": "(B, M, Hkv, D)"})
    qt, kt, vt = q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2)  # (B, H, L, D) views
    if name == "flashattn_dense":
        import flashattn

        return (lambda: flashattn.attention(qt, kt, vt).transpose(1, 2),
                {"gqa": "packed", "layout": "(B, Hkv, M, D) view"})
    if name == "flex":
        from torch.nn.attention.flex_attention import flex_attention

        torch._dynamo.reset()
        compiled = torch.compile(flex_attention, dynamic=False)
        return (lambda: compiled(qt, kt, vt, enable_gqa=True).transpose(1, 2),
                {"gqa": "enable_gqa", "layout": "(B, Hkv, M, D) view"})
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
               "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}[name]
    attempts = [("enable_gqa", "(B, Hkv, M, D) view", kt, vt, True),
                ("enable_gqa", "(B, Hkv, M, D) contiguous", kt.contiguous(), vt.contiguous(), True)]
    group = q.shape[2] // k_cache.shape[2]
    attempts.append(("repeated", "(B, Hq, M, D) contiguous", kt.repeat_interleave(group, 1).contiguous(),
                     vt.repeat_interleave(group, 1).contiguous(), False))
    errors = []
    for gqa, layout, k_, v_, enable in attempts:
        def fn(k_=k_, v_=v_, enable=enable):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, k_, v_, enable_gqa=enable).transpose(1, 2)
        try:
            fn()
            torch.cuda.synchronize()
            return fn, {"gqa": gqa, "layout": layout, "refused": errors}
        except RuntimeError as exc:  # this backend has no kernel for these inputs: try the next form
            errors.append(f"{gqa}/{layout}: {str(exc).splitlines()[0][:200]}")
    raise RuntimeError("; ".join(errors))


def check(o, q, k_cache, v_cache) -> dict:
    """Error against float64, next to the error of the naive attention computed in bfloat16, on the
    first :data:`CHECKED_SEQUENCES` sequences."""
    from flashattn.reference import naive_attention
    from flashattn.testing import rel_err

    o, q, k_cache, v_cache = (x[:CHECKED_SEQUENCES] for x in (o, q, k_cache, v_cache))
    ref = naive_attention(q.transpose(1, 2).double(), k_cache.transpose(1, 2).double(),
                          v_cache.transpose(1, 2).double())[0].transpose(1, 2)
    lowp = naive_attention(q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2))[0].transpose(1, 2)
    err, base = rel_err(o, ref), rel_err(lowp, ref)
    return {"rel_err": err, "torch_bf16_rel_err": base, "passed": bool(err <= 2.0 * base + 1e-5)}


def run(batches, seqlens, queries, providers, device, modes=MODES, heads=(H_Q, H_KV), dtype=DTYPE) -> dict:
    bw_copy = copy_bandwidth(device)
    rows = []
    for batch in batches:
        for m in seqlens:
            for n_q in queries:
                q, k_cache, v_cache = make_inputs(batch, m, n_q, device, heads=heads, dtype=dtype)
                kv_bytes = 2 * k_cache.numel() * k_cache.element_size()
                for name in providers:
                    row = {"B": batch, "M": m, "Nq": n_q, "provider": name}
                    t0 = time.monotonic()
                    try:
                        fn, info = prepare(name, q, k_cache, v_cache)
                        row.update(info)
                        row["check"] = check(fn(), q, k_cache, v_cache)
                        for mode in modes:
                            try:
                                ms = _bench(fn) if mode == "eager" else _graph_bench(fn)
                                row[mode] = {"us": ms * 1e3, "gbps": kv_bytes / (ms * 1e-3) / 1e9,
                                             "copy_fraction": kv_bytes / (ms * 1e-3) / bw_copy}
                            except Exception as exc:  # noqa: BLE001 -- e.g. a call that cannot be captured
                                row[mode] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                        row["status"] = "ok"
                    except Exception as exc:  # noqa: BLE001 -- recorded, the run goes on
                        row.update(status="error", error=f"{type(exc).__name__}: {exc}"[:500])
                    row["wall_s"] = round(time.monotonic() - t0, 1)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                del q, k_cache, v_cache
                torch.cuda.empty_cache()
    import triton

    return {
        "what": f"decoding against a full KV cache, non-causal, Hq={heads[0]}, Hkv={heads[1]}, D={D}, "
                f"{str(dtype).removeprefix('torch.')}",
        "device": torch.cuda.get_device_name(device),
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
                     "cuda": torch.version.cuda, "flashattn_sources_sha256": package_sources_sha256()},
        "copy_bandwidth_gbps": bw_copy / 1e9,
        "modes": list(modes),
        "rows": rows,
    }


def _us(row, mode):
    """Microseconds of one provider in one mode, or None where it did not run."""
    if row is None or row.get("status") != "ok" or "us" not in row.get(mode, {}):
        return None
    return row[mode]["us"]


def markdown(result: dict) -> str:
    rows = result["rows"]
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    peers = [p for p in providers if not p.startswith("flashattn")]
    modes = result.get("modes", MODES)
    how = " and ".join({"eager": "eager calls", "graph": "CUDA-graph replays"}[mode] for mode in modes)
    lines = [f"Decoding, {result['what']}; {result['device']}, torch {result['versions']['torch']}, "
             f"triton {result['versions']['triton']}. Time per call in µs (median of do_bench), {how}; "
             f"copy bandwidth {result['copy_bandwidth_gbps']:.0f} GB/s. "
             "(WRONG) marks an output that failed the float64 check.", ""]
    for mode in modes:
        lines += [f"**{mode}**", "",
                  "| B | M | Nq | " + " | ".join(providers) + " | flashattn / best peer | flashattn % of copy BW |",
                  "|" + "---|" * (len(providers) + 5)]
        for b, m, n_q in dict.fromkeys((r["B"], r["M"], r["Nq"]) for r in rows):
            cell = {r["provider"]: r for r in rows if (r["B"], r["M"], r["Nq"]) == (b, m, n_q)}

            def show(p):
                us = _us(cell.get(p), mode)
                if us is None:
                    return "error" if p in cell else "-"
                return f"{us:.0f}" + ("" if cell[p]["check"]["passed"] else " (WRONG)")

            mine = "flashattn" if "flashattn" in cell else next((p for p in providers if p.startswith("flashattn")
                                                                 and p in cell), None)
            ours = _us(cell.get(mine), mode)
            best = min((u for u in (_us(cell.get(p), mode) for p in peers) if u is not None), default=math.nan)
            speedup = best / ours if ours else math.nan
            frac = 100 * cell[mine][mode]["copy_fraction"] if ours else math.nan
            lines.append(f"| {b} | {m} | {n_q} | " + " | ".join(show(p) for p in providers)
                         + f" | {speedup:.2f}x | {frac:.0f}% |")
        lines.append("")
    gqa = {r["provider"]: f"{r['gqa']}, {r['layout']}" for r in rows if r.get("status") == "ok"}
    lines += ["How each peer took GQA and the cache: " + "; ".join(f"{p}: {g}" for p, g in gqa.items()) + "."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=pathlib.Path)
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--seqlens", default=",".join(map(str, SEQLENS)))
    parser.add_argument("--queries", default=",".join(map(str, QUERIES)))
    parser.add_argument("--providers", default=",".join(PROVIDERS))
    parser.add_argument("--modes", default=",".join(MODES), help="subset of %(default)s")
    parser.add_argument("--heads", default=f"{H_Q}:{H_KV}", help="query heads : K/V heads")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--name", default="decode", help="the output files' name")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.decode needs a CUDA GPU", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    heads = tuple(int(h) for h in args.heads.split(":"))
    result = run(ints(args.batches), ints(args.seqlens), ints(args.queries), args.providers.split(","),
                 torch.device("cuda"), modes=args.modes.split(","), heads=heads, dtype=getattr(torch, args.dtype))
    result["wall_s"] = round(time.monotonic() - t0, 1)
    table = markdown(result)
    json_path, md_path = results_mod.save_table(args.out, args.name, result, table)
    print(table)
    print(f"wrote {json_path} and {md_path} in {result['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
