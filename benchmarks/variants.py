"""Variants benchmark: sliding window, softcap, dropout and attention sinks, flashattn against
FlexAttention and SDPA.

    PYTHONPATH=. python -m benchmarks.variants --out DIR [--rows window-16k,softcap-8k] [--providers ...]

Rows (bfloat16, causal, N = M; D = 128 and 16 heads unless said):

* ``window-16k`` / ``window-32k``: a sliding window of 4096 keys (query i sees keys i - 4096 .. i),
  N = 16k (B = 2) and 32k (B = 1);
* ``softcap-8k``: scores capped by 50 * tanh(s / 50) (Gemma 2), N = 8k, B = 2;
* ``dropout-8k``: dropout 0.1 on P, N = 8k, B = 2;
* ``sinks-8k``: attention sinks as in gpt-oss: one float32 logit per query head joins every row's
  softmax denominator (and gets a gradient); D = 64, 64 query heads over 8 K/V heads, N = 8k, B = 1;
* ``sinks-window-8k``: the same with gpt-oss's local layers' sliding window of 128 keys (query i sees
  keys i - 127 .. i, transformers' ``sliding_window = 128``).

Providers: ``flashattn`` (the variant's keyword arguments), ``flashattn_plain`` (the same call without
the variant: the cost of the variant in our own kernels; for the sink rows only the sinks are dropped,
so ``sinks-window-8k``'s plain call keeps the window), ``flex`` (``flex_attention`` compiled with
``dynamic=False``; the window and causal mask as a block mask from ``create_block_mask``, the softcap
as a ``score_mod``; no dropout; sinks as :func:`flex_with_sinks`: FlexAttention returns the row LSE
(``return_aux=AuxRequest(lse=True)``) and the same torch correction flashattn applies, o * exp(lse -
lse') with lse' = logaddexp(lse, sink), runs after it inside the one compiled function),
``sdpa_flash`` (``scaled_dot_product_attention(is_causal=True)`` under the FlashAttention backend; it
has dropout but neither a window, a softcap nor sinks). A provider without the variant is recorded as
``unsupported``. Grouped-query rows pass ``enable_gqa`` to FlexAttention.

Correctness first: each provider runs the row's variant at N = 1024 (B = 1, H = 2; a grouped-query row
keeps its group: 8 query heads over 1 K/V head for the sink rows) and its o, dq, dk, dv (and the sinks'
gradient) are compared with ``flashattn.reference.naive_attention`` in float64 by the tests' ratio rule.
flashattn's dropout is checked with the reference given the same seed; SDPA's dropout draws from its
own generator, so it cannot be compared entry by entry and is recorded as ``unchecked``. In the timed
calls the sink logits require grad as in training, and the backward clears their gradient with q, k,
v's before each call.

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
SINK_WINDOW = 128  # gpt-oss's local layers: each query sees 128 keys, its own included
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
    kv_heads: int | None = None  # None: as many as ``heads``
    sinks: bool = False  # per-head sink logits (flashattn.attention(sinks=)), the variant under study

    @property
    def kind(self) -> str:
        return self.name.split("-")[0]

    def at(self, **shape) -> "Row":
        return Row(**{**asdict(self), **shape})

    def plain(self) -> "Row":
        """The row without the variant under study: the sinks where there are any, else every keyword."""
        return self.at(sinks=False) if self.sinks else self.at(variant={})


ROWS = {
    "window-16k": Row("window-16k", 2, 16, 16384, variant=dict(window=(WINDOW, 0))),
    "window-32k": Row("window-32k", 1, 16, 32768, variant=dict(window=(WINDOW, 0))),
    "softcap-8k": Row("softcap-8k", 2, 16, 8192, variant=dict(softcap=SOFTCAP)),
    "dropout-8k": Row("dropout-8k", 2, 16, 8192, variant=dict(dropout_p=DROPOUT, seed=1234)),
    "sinks-8k": Row("sinks-8k", 1, 64, 8192, head_dim=64, kv_heads=8, sinks=True),
    "sinks-window-8k": Row("sinks-window-8k", 1, 64, 8192, head_dim=64, kv_heads=8, sinks=True,
                           variant=dict(window=(SINK_WINDOW - 1, 0))),
}


def pair_count(n: int, m: int, causal: bool, window=None) -> int:
    """(query, key) pairs of an n x m problem that the mask leaves visible: bottom-right causal, and
    inside ``window = (left, right)`` if any (:func:`flashattn.schedule.window_bounds` semantics)."""
    from flashattn import cost, schedule

    if window is None:
        return cost.visible_pairs(n, m, causal)
    left, right = schedule.window_bounds(n, m, causal, tuple(window))
    diagonal = torch.arange(n, dtype=torch.int64) + (m - n)  # row i's own key
    first, last = (diagonal - left).clamp(min=0), (diagonal + right).clamp(max=m - 1)
    return int((last - first + 1).clamp(min=0).sum())


def visible_pairs(row: Row) -> int:
    """(query, key) pairs the row's mask leaves visible: causal, and inside the window if any. Sinks
    add no pair (a sink has no key and no value)."""
    return pair_count(row.seqlen, row.seqlen, row.causal, row.variant.get("window"))


def counted(row: Row, provider: str) -> Row:
    """The row whose visible pairs ``provider``'s call computes: ``flashattn_plain`` runs it without the
    variant, so a window's plain call attends to every causal pair (and a sink row's keeps its window)."""
    return row.plain() if provider == "flashattn_plain" else row


def sink_logits(row: Row, device, seed: int = 0) -> torch.Tensor:
    """The row's per-head sink logits, float32 (Hq,), seeded: drawn from N(3, 2^2), of the order of a
    row's log-sum-exp at these shapes, so the sinks take a visible share of the rows (none for a
    row without sinks)."""
    if not row.sinks:
        return None
    gen = torch.Generator(device=device).manual_seed(seed)
    return 3.0 + 2.0 * torch.randn(row.heads, dtype=torch.float32, device=device, generator=gen)


def flex_with_sinks(flex, q, k, v, sinks, **flex_kwargs):
    """FlexAttention with sinks: its output and natural-log LSE without them, then the sinks joined
    to each row's denominator in torch: lse' = logaddexp(lse, s_h), o' = o * exp(lse - lse')
    (what :func:`flashattn.autograd.with_sinks` does after flashattn's kernels). Differentiable in
    q, k, v (through o and the LSE) and the sinks."""
    from torch.nn.attention.flex_attention import AuxRequest

    o, aux = flex(q, k, v, return_aux=AuxRequest(lse=True), **flex_kwargs)
    lse = aux.lse.float()  # (B, Hq, N)
    shrink = torch.exp(lse - torch.logaddexp(lse, sinks.float().view(1, -1, 1)))
    return (o.float() * shrink[..., None]).to(o.dtype)


def tflops(row: Row, mode: str, ms: float) -> float:
    forward = 4.0 * row.batch * row.heads * visible_pairs(row) * row.head_dim
    return forward * {"fwd": 1.0, "bwd": 2.5}[mode] / (ms * 1e-3) / 1e12


class Unsupported(RuntimeError):
    pass


def prepare(name: str, row: Row, device, sinks=None):
    """``fn(q, k, v) -> o`` of one provider for one row (raises :class:`Unsupported` when it lacks the
    variant). A sink row's call uses ``sinks`` (Hq,), the caller's leaf (a fresh seeded one if None)."""
    import flashattn

    if name == "flashattn_plain":
        row = row.plain()
    variant, causal = dict(row.variant), row.causal
    if row.sinks and sinks is None:
        sinks = sink_logits(row, device)
    if not row.sinks:
        sinks = None
    if name in ("flashattn", "flashattn_plain"):
        return lambda q, k, v: flashattn.attention(q, k, v, causal=causal, sinks=sinks, **variant)
    if name == "sdpa_flash":
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if row.sinks:
            raise Unsupported("SDPA has no attention sinks")
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
        gqa = row.kv_heads not in (None, row.heads)

        def call(q, k, v, sinks):
            if sinks is None:
                return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa)
            return flex_with_sinks(flex_attention, q, k, v, sinks, score_mod=score_mod, block_mask=block_mask,
                                   enable_gqa=gqa)

        if device == "cpu" or getattr(device, "type", None) == "cpu":
            compiled = call  # the CPU test of the harness runs it eagerly
        else:
            torch._dynamo.reset()
            compiled = torch.compile(call, dynamic=False)  # the sinks' correction compiles with the attention
        return lambda q, k, v: compiled(q, k, v, sinks)
    raise ValueError(f"unknown provider {name!r}; choose from {PROVIDERS}")


def make_inputs(row: Row, device, seed: int = 0):
    from benchmarks.grid import Setting

    setting = Setting(row.dtype, row.head_dim, row.causal, row.seqlen, batch=row.batch, heads=row.heads,
                      kv_heads=row.kv_heads)
    return measure.make_inputs(setting, device, seed=seed)


def check_row(row: Row, check_shape=None) -> Row:
    """The row at the check shape; a grouped-query row keeps its group size (query heads per K/V
    head), with at least the check shape's query heads."""
    small = row.at(**(check_shape or CHECK_SHAPE))
    if row.kv_heads in (None, row.heads):
        return small.at(kv_heads=None)
    group = row.heads // row.kv_heads
    heads = -(-small.heads // group) * group
    return small.at(heads=heads, kv_heads=heads // group)


def check(name: str, row: Row, device, check_shape=None) -> dict:
    """Errors of o, dq, dk, dv (and of the sinks' gradient) at the check shape against float64, judged
    by the tests' ratio rule."""
    from flashattn.reference import naive_attention
    from flashattn.testing import rel_err

    if name == "sdpa_flash" and row.variant.get("dropout_p"):
        return {"status": "unchecked", "why": "SDPA's dropout draws from its own generator"}
    small = check_row(row, check_shape)
    computed = counted(small, name)  # what the provider's call computes, for the reference
    inputs = make_inputs(small, device, seed=1)
    sinks = sink_logits(computed, device, seed=1)
    leaves = {}  # the sink leaf of each computation, to read its gradient after the backward

    def with_sink_leaf(key, dtype):
        if sinks is None:
            return None
        leaves[key] = sinks.detach().to(dtype).requires_grad_()
        return leaves[key]

    fn = prepare(name, small, device, sinks=with_sink_leaf("got", torch.float32))

    def naive(sink_leaf):
        return lambda q, k, v: naive_attention(q, k, v, computed.causal, sinks=sink_leaf, **computed.variant)[0]

    q, k, v, do = inputs
    exact = measure._forward_backward(naive(with_sink_leaf("exact", torch.float64)),
                                      *(x.detach().double() for x in inputs))
    lowp = measure._forward_backward(naive(with_sink_leaf("lowp", torch.float32)), q, k, v, do)
    result = measure.check(fn, inputs, {"exact": exact, "lowp": lowp})
    if sinks is not None:  # each leaf took exactly one backward; a provider that left its sinks unused fails
        grads = {key: leaf.grad for key, leaf in leaves.items()}
        err = float("inf") if grads["got"] is None else rel_err(grads["got"], grads["exact"])
        base = rel_err(grads["lowp"], grads["exact"])
        result["rel_err"]["dsinks"], result["naive_lowp_rel_err"]["dsinks"] = err, base
        result["passed"] = bool(result["passed"] and err <= measure.CHECK_FACTOR * base + measure.CHECK_FLOOR)
    result["status"] = "ok" if result["passed"] else "failed"
    return result


def time_backward(fn, inputs, timer, sinks=None) -> float:
    """:func:`benchmarks.measure.time_backward`, with the sink logits' gradient cleared before each call
    as q, k, v's are (so no accumulation kernel is timed)."""
    q, k, v, do = inputs
    o = fn(q, k, v)
    leaves = [q, k, v] + ([] if sinks is None else [sinks])
    try:
        return timer(lambda: o.backward(do, retain_graph=True), grad_to_none=leaves)
    finally:
        for x in leaves:
            x.grad = None


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
                sinks = sink_logits(counted(row, name), device)
                if sinks is not None:
                    sinks.requires_grad_()  # a trained parameter, as in gpt-oss
                fn = prepare(name, row, device, sinks=sinks)
                fn(*inputs[:3])  # compiles, or says it cannot run
                times = {"fwd": measure.time_forward(fn, inputs, timer),
                         "bwd": time_backward(fn, inputs, timer, sinks)}
                for mode, ms in times.items():
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
