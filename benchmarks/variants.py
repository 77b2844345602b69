"""Variants benchmark: sliding window, softcap and dropout, flashattn against FlexAttention and SDPA.

    PYTHONPATH=. python -m benchmarks.variants --out DIR [--rows window-16k,softcap-8k] [--providers ...]

Rows (bfloat16, D = 128, 16 heads, causal, N = M):

* ``window-16k`` / ``window-32k``: a sliding window of 4096 keys (query i sees keys i - 4096 .. i),
  N = 16k (B = 2) and 32k (B = 1);
* ``softcap-8k``: scores capped by 50 * tanh(s / 50) (Gemma 2), N = 8k, B = 2;
* ``dropout-8k``: dropout 0.1 on P, N = 8k, B = 2.

Providers: ``flashattn`` (the variant's keyword arguments), ``flashattn_plain`` (the same call without
the variant: the cost of the variant in our own kernels), ``flex`` (``flex_attention`` compiled with
``dynamic=False``; the window and causal mask as a block mask from ``create_block_mask``, the softcap
as a ``score_mod``; no dropout), ``sdpa_flash`` (``scaled_dot_product_attention(is_causal=True)`` under
the FlashAttention backend; it has dropout but neither a window nor a softcap). A provider without
the variant is recorded as ``unsupported``.

Correctness first: each provider runs the row's variant at N = 1024 (B = 1, H = 2) and its o, dq, dk,
dv are compared with ``flashattn.reference.naive_attention`` in float64 by the tests' ratio rule.
flashattn's dropout is checked with the reference given the same seed; SDPA's dropout draws from its
own generator, so it cannot be compared entry by entry and is recorded as ``unchecked``.

Timing: :func:`benchmarks.measure.time_forward` / ``time_backward`` (``do_bench``, median). TFLOP/s
count only the visible (query, key) pairs (:func:`visible_pairs`), forward 4 * B * H * pairs * D,
backward 2.5 x that (the convention of :mod:`flashattn.cost`). Writes ``DIR/variants.json`` and
``DIR/variants.md``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from benchmarks import measure, results as results_mod
from benchmarks.provenance import package_sources_sha256

WINDOW = 4096
SOFTCAP = 50.0
DROPOUT = 0.1
PROVIDERS = ("flashattn", "flashattn_plain", "flex", "sdpa_flash")
CHECK_SHAPE = dict(batch=1, heads=2, seqlen=1024)


@dataclass(frozen=True)
class Row:
    name: str
    batch: int
    heads: int
    seqlen: int
    head_dim: int = 128
    dtype: str = "bfloat16"
    causal: bool = True
    variant: dict = field(default_factory=dict)  # keyword arguments of flashattn.attention

    @property
    def kind(self) -> str:
        return self.name.split("-")[0]

    def at(self, **shape) -> "Row":
        return Row(**{**asdict(self), **shape})


ROWS = {
    "window-16k": Row("window-16k", 2, 16, 16384, variant=dict(window=(WINDOW, 0))),
    "window-32k": Row("window-32k", 1, 16, 32768, variant=dict(window=(WINDOW, 0))),
    "softcap-8k": Row("softcap-8k", 2, 16, 8192, variant=dict(softcap=SOFTCAP)),
    "dropout-8k": Row("dropout-8k", 2, 16, 8192, variant=dict(dropout_p=DROPOUT, seed=1234)),
}


def visible_pairs(row: Row) -> int:
    """(query, key) pairs the row's mask leaves visible: causal, and inside the window if any."""
    n = row.seqlen
    left = row.variant.get("window", (None, None))[0]
    if not row.causal:
        return n * n
    if left is None:
        return n * (n + 1) // 2
    # query i sees min(i, left) + 1 keys
    full = min(n, left + 1)
    return full * (full + 1) // 2 + (n - full) * (left + 1)


def counted(row: Row, provider: str) -> Row:
    """The row whose visible pairs ``provider``'s call computes: ``flashattn_plain`` runs it without the
    variant, so a window's plain call attends to every causal pair."""
    return row.at(variant={}) if provider == "flashattn_plain" else row


def tflops(row: Row, mode: str, ms: float) -> float:
    forward = 4.0 * row.batch * row.heads * visible_pairs(row) * row.head_dim
    return forward * {"fwd": 1.0, "bwd": 2.5}[mode] / (ms * 1e-3) / 1e12


class Unsupported(RuntimeError):
    pass


def prepare(name: str, row: Row, device):
    """``fn(q, k, v) -> o`` of one provider for one row (raises :class:`Unsupported` when it lacks the variant)."""
    import flashattn

    variant, causal = dict(row.variant), row.causal
    if name == "flashattn":
        return lambda q, k, v: flashattn.attention(q, k, v, causal=causal, **variant)
    if name == "flashattn_plain":
        return lambda q, k, v: flashattn.attention(q, k, v, causal=causal)
    if name == "sdpa_flash":
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if set(variant) - {"dropout_p", "seed"}:
            raise Unsupported("SDPA has no sliding window or softcap (only a dense attn_mask)")
        p = variant.get("dropout_p", 0.0)

        def sdpa(q, k, v):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=p)

        return sdpa
    if name == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        if "dropout_p" in variant:
            raise Unsupported("FlexAttention has no dropout")
        left = variant.get("window", (None, None))[0]

        def mask_mod(b, h, q_idx, kv_idx):
            visible = q_idx >= kv_idx  # N == M: top-left and bottom-right alignment agree
            if left is not None:
                visible = visible & (q_idx - kv_idx <= left)
            return visible

        cap = variant.get("softcap")
        score_mod = None
        if cap:
            def score_mod(score, b, h, q_idx, kv_idx):
                return cap * torch.tanh(score / cap)

        n = row.seqlen
        block_mask = create_block_mask(mask_mod, None, None, n, n, device=device)
        if device == "cpu" or getattr(device, "type", None) == "cpu":
            compiled = flex_attention  # the CPU test of the harness runs it eagerly
        else:
            torch._dynamo.reset()
            compiled = torch.compile(flex_attention, dynamic=False)
        return lambda q, k, v: compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)
    raise ValueError(f"unknown provider {name!r}; choose from {PROVIDERS}")


def make_inputs(row: Row, device, seed: int = 0):
    from benchmarks.grid import Setting

    setting = Setting(row.dtype, row.head_dim, row.causal, row.seqlen, batch=row.batch, heads=row.heads)
    return measure.make_inputs(setting, device, seed=seed)


def check(name: str, row: Row, device, check_shape=None) -> dict:
    """Errors of o, dq, dk, dv at the check shape against float64, judged by the tests' ratio rule."""
    from flashattn.reference import naive_attention

    if name == "sdpa_flash" and row.variant.get("dropout_p"):
        return {"status": "unchecked", "why": "SDPA's dropout draws from its own generator"}
    small = row.at(**(check_shape or CHECK_SHAPE))
    inputs = make_inputs(small, device, seed=1)
    fn = prepare(name, small, device)
    variant = {} if name == "flashattn_plain" else dict(small.variant)

    def naive(q, k, v):
        return naive_attention(q, k, v, small.causal, **variant)[0]

    q, k, v, do = inputs
    exact = measure._forward_backward(naive, *(x.detach().double() for x in inputs))
    lowp = measure._forward_backward(naive, q, k, v, do)
    result = measure.check(fn, inputs, {"exact": exact, "lowp": lowp})
    result["status"] = "ok" if result["passed"] else "failed"
    return result


def run(rows, providers, device, timer, log=print, check_shape=None) -> dict:
    out = []
    for row in rows:
        inputs = None
        for name in providers:
            rec = {"row": row.name, "provider": name, **{k: v for k, v in asdict(row).items() if k != "name"}}
            rec["variant"] = {k: list(v) if isinstance(v, tuple) else v for k, v in row.variant.items()}
            t0 = time.monotonic()
            try:
                rec["check"] = check(name, row, device, check_shape)
                if inputs is None:
                    inputs = make_inputs(row, device)
                fn = prepare(name, row, device)
                fn(*inputs[:3])  # compiles, or says it cannot run
                for mode, time_pass in (("fwd", measure.time_forward), ("bwd", measure.time_backward)):
                    ms = time_pass(fn, inputs, timer)
                    rec[mode] = {"ms": ms, "tflops": tflops(counted(row, name), mode, ms)}
                rec["status"] = "ok"
            except Unsupported as exc:
                rec.update(status="unsupported", error=str(exc))
            except Exception as exc:  # noqa: BLE001 -- recorded, the run goes on
                rec.update(status="error", error=f"{type(exc).__name__}: {exc}"[:1000])
            rec["wall_s"] = round(time.monotonic() - t0, 1)
            out.append(rec)
            log(json.dumps(rec))
        del inputs
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return {"rows": out}


def markdown(result: dict) -> str:
    recs = result["rows"]
    providers = list(dict.fromkeys(r["provider"] for r in recs))
    lines = [f"Variants, {result.get('device', '?')}: time per call in ms (median of do_bench), "
             "TFLOP/s over the visible pairs in parentheses; fwd / bwd.", "",
             "| row | " + " | ".join(providers) + " | flashattn / flex | flashattn / plain |",
             "|" + "---|" * (len(providers) + 3)]
    for name in dict.fromkeys(r["row"] for r in recs):
        cell = {r["provider"]: r for r in recs if r["row"] == name}

        def show(p):
            r = cell.get(p)
            if r is None:
                return "-"
            if r["status"] != "ok":
                return r["status"]
            flag = {"failed": " WRONG", "unchecked": " (unchecked)"}.get(r.get("check", {}).get("status"), "")
            return " / ".join(f"{r[m]['ms']:.2f} ({r[m]['tflops']:.0f})" for m in ("fwd", "bwd")) + flag

        def ratio(a, b):
            ra, rb = cell.get(a), cell.get(b)
            if not (ra and rb and ra["status"] == rb["status"] == "ok"):
                return "-"
            return " / ".join(f"{rb[m]['ms'] / ra[m]['ms']:.2f}x" for m in ("fwd", "bwd"))

        lines.append(f"| {name} | " + " | ".join(show(p) for p in providers)
                     + f" | {ratio('flashattn', 'flex')} | {ratio('flashattn', 'flashattn_plain')} |")
    lines += ["", "flashattn / flex above 1 means flashattn is faster; flashattn / plain below 1 is the cost of the "
              "variant in our kernels (for dropout: plain time / dropout time)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=pathlib.Path)
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--providers", default=",".join(PROVIDERS))
    parser.add_argument("--warmup-ms", type=int, default=25)
    parser.add_argument("--rep-ms", type=int, default=100)
    args = parser.parse_args(argv)
    unknown = [r for r in args.rows.split(",") if r not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {list(ROWS)}")
    if not torch.cuda.is_available():
        print("benchmarks.variants needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    t0 = time.monotonic()
    device = torch.device("cuda")
    result = run([ROWS[r] for r in args.rows.split(",")], args.providers.split(","), device,
                 measure.do_bench_timer(warmup=args.warmup_ms, rep=args.rep_ms))
    result.update(device=torch.cuda.get_device_name(device), wall_s=round(time.monotonic() - t0, 1),
                  versions={"torch": torch.__version__, "triton": triton.__version__,
                            "python": platform.python_version(), "cuda": torch.version.cuda,
                            "flashattn_sources_sha256": package_sources_sha256()})
    table = markdown(result)
    json_path, md_path = results_mod.save_table(args.out, "variants", result, table)
    print(table)
    print(f"wrote {json_path} and {md_path} in {result['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
