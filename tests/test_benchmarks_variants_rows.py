"""The benchmark rows of issue 49's variants on a CPU: packed sequences with a sliding window
(benchmarks.varlen --window) and attention sinks (benchmarks.variants sinks-8k, sinks-window-8k).

Every time below is synthetic (a fake timer on tiny CPU shapes): these tests check the options, the
pair counts behind the TFLOP/s, the masks and the correctness checks, never a performance claim.
"""

import json
import warnings

import pytest
import torch

from benchmarks import variants, varlen
from flashattn import cost, schedule
from flashattn.reference import naive_attention
from flashattn.testing import rel_err

FAKE_MS = 1.0  # what the fake timers say every call took (synthetic)


def fake_timer(fn, grad_to_none=None, seen=None):
    """Runs the call for real, clears the gradients do_bench would clear, and returns a fixed time."""
    if seen is not None:
        seen.append([id(x) for x in grad_to_none or ()])
    if grad_to_none:
        for x in grad_to_none:
            x.grad = None
    fn()
    return FAKE_MS


def brute_pairs(n, m, causal, window):
    return sum(schedule.is_visible(i, j, n, m, causal, window) for i in range(n) for j in range(m))


# -- the pair counts behind the TFLOP/s ----------------------------------------------------------------------

@pytest.mark.parametrize("n, m", [(1, 1), (9, 9), (12, 7), (7, 12)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, (0, 0), (3, 0), (2, 4), (None, 1), (5, None), (40, 40)])
def test_pair_count_is_the_visible_pairs_by_brute_force(n, m, causal, window):
    assert variants.pair_count(n, m, causal, window) == brute_pairs(n, m, causal, window)


def test_sink_rows_count_their_window_and_no_pair_for_the_sinks():
    n = 8192
    assert variants.visible_pairs(variants.ROWS["sinks-8k"]) == n * (n + 1) // 2
    window_row = variants.ROWS["sinks-window-8k"]
    assert variants.visible_pairs(window_row) == sum(min(i + 1, 128) for i in range(n))
    # the plain call of a sink row drops the sinks only, so it computes (and is credited) the same pairs
    plain = variants.counted(window_row, "flashattn_plain")
    assert not plain.sinks and plain.variant == window_row.variant
    assert variants.counted(variants.ROWS["window-16k"], "flashattn_plain").variant == {}


@pytest.mark.parametrize("window", [1, 3, 16, 1000])
def test_varlen_window_flops_count_min_of_row_and_window(window):
    lengths, heads, d = [100, 3, 50, 1], 4, 64
    pairs = sum(min(i + 1, window) for n in lengths for i in range(n))
    for mode, times in (("fwd", 1.0), ("bwd", 2.5), ("fwd_bwd", 3.5)):
        assert varlen.pack_flops(lengths, heads, d, True, mode, window) == times * 4 * heads * pairs * d
    wide = max(lengths)
    assert varlen.pack_flops(lengths, heads, d, True, "fwd", wide) == varlen.pack_flops(lengths, heads, d, True, "fwd")
    assert varlen.pack_flops(lengths, heads, d, True, "fwd") == sum(
        cost.attention_flops(1, heads, n, n, d, causal=True, mode="fwd") for n in lengths)


# -- benchmarks.varlen --window ------------------------------------------------------------------------------

def test_varlen_options_and_the_results_name():
    ap = varlen.build_parser()
    plain = varlen.parse_args(ap, ["--out", "x"])
    assert plain.window is None and plain.name == "varlen" and plain.head_dims == [64, 128]
    assert plain.providers == list(varlen.PROVIDERS)
    windowed = varlen.parse_args(ap, ["--out", "x", "--window", "1024", "--packs", "1"])
    assert windowed.window == 1024 and windowed.name == "varlen_window" and windowed.packs == 1
    named = varlen.parse_args(ap, ["--out", "x", "--window", "512", "--name", "w512", "--head-dims", "64",
                                   "--providers", "flashattn,flex_document"])
    assert named.name == "w512" and named.head_dims == [64] and named.providers == ["flashattn", "flex_document"]


@pytest.mark.parametrize("argv", [["--window", "0"], ["--window", "-3"], ["--providers", "flashattn,nope"],
                                  ["--name", "../escape"]])
def test_varlen_refuses_bad_options(argv, capsys):
    with pytest.raises(SystemExit):
        varlen.parse_args(varlen.build_parser(), ["--out", "x", *argv])
    assert "error" in capsys.readouterr().err


@pytest.mark.parametrize("window", [1, 3, 6])
def test_varlen_window_mask_is_the_reference_visibility(window):
    """FlexAttention's document mask with a window, on every (query, key) pair: block diagonal by
    sequence, and within each exactly the pairs of the causal window (W - 1, 0)."""
    lengths, cu = [5, 1, 7], [0, 5, 6, 13]
    mask_mod = varlen.document_mask_mod(varlen.document_ids(lengths, "cpu"), torch.tensor(cu[:-1]), True, window)
    got = mask_mod(0, 0, torch.arange(13)[:, None], torch.arange(13)[None, :])
    want = torch.zeros(13, 13, dtype=torch.bool)
    for s, n in enumerate(lengths):
        for a in range(n):
            for b in range(n):
                want[cu[s] + a, cu[s] + b] = schedule.is_visible(a, b, n, n, True, (window - 1, 0))
    assert torch.equal(got, want)
    assert int(got.sum()) == sum(min(i + 1, window) for n in lengths for i in range(n))


def test_varlen_window_providers_pass_the_check_and_sdpa_is_unsupported():
    lengths = [9, 20, 4]
    q, k, v = (torch.randn(33, 2, 16, dtype=torch.float16).requires_grad_() for _ in range(3))
    do = torch.randn(33, 2, 16, dtype=torch.float16)
    plain = varlen.references(q.detach(), k.detach(), v.detach(), lengths, True)[0]
    for name in ("flashattn", "flashattn_padded"):
        fn, checked, inputs = varlen.prepare(name, q, k, v, lengths, True, window=5)
        assert checked
        o = fn().detach()
        assert varlen.check(o, q.detach(), k.detach(), v.detach(), lengths, True, 5)["passed"], name
        # negative control: the same output is far from the reference without the window
        assert rel_err(o, plain) > 0.1
        assert all(g is not None for g in torch.autograd.grad(fn(), inputs, do))
    with pytest.raises(varlen.Unsupported):
        varlen.prepare("sdpa_flash_padded", q, k, v, lengths, True, window=5)
    with pytest.raises(ValueError):
        varlen.prepare("flashattn", q, k, v, lengths, False, window=5)


def test_varlen_window_loop_records_causal_rows_and_writes_the_table(tmp_path):
    """The whole loop at a tiny pack with a fake timer: causal only, the window in every row, SDPA
    recorded as unsupported, TFLOP/s over the window's pairs, and a table that says the window."""
    logged = []
    out = varlen.run(1, [16], ["flashattn", "flashattn_padded", "sdpa_flash_padded"], "cpu", window=6,
                     bench=fake_timer, tokens=40, lengths_range=(4, 16), hidden=32, log=logged.append)
    rows = out["rows"]
    assert [r["provider"] for r in rows] == ["flashattn", "flashattn_padded", "sdpa_flash_padded"]
    assert all(r["causal"] and r["window"] == 6 for r in rows) and len(logged) == 3
    by = {r["provider"]: r for r in rows}
    assert by["sdpa_flash_padded"]["status"] == "unsupported"
    lengths = rows[0]["lengths"]
    for name in ("flashattn", "flashattn_padded"):
        r = by[name]
        assert r["status"] == "ok" and r["check"]["passed"], r
        for mode in varlen.MODES:
            assert r[f"{mode}_ms"] == FAKE_MS
            assert r[f"{mode}_tflops"] == pytest.approx(varlen.pack_flops(lengths, 2, 16, True, mode, 6) / 1e-3 / 1e12)
    table = varlen.markdown(out)
    assert "window of 6 keys" in table and "unsupported: SDPA" in table
    json.dumps(out)  # the results file takes it as is


def test_varlen_table_divides_flex_time_by_ours():
    def row(provider, fwd, bwd, total):
        return {"pack": 0, "D": 64, "causal": True, "window": 1024, "provider": provider, "status": "ok",
                "checked": True, "check": {"passed": True}, "fwd_ms": fwd, "bwd_ms": bwd, "fwd_bwd_ms": total,
                "fwd_tflops": 1.0, "bwd_tflops": 1.0, "fwd_bwd_tflops": 1.0}

    table = varlen.markdown({"rows": [row("flashattn", 1.0, 2.0, 3.0), row("flex_document", 1.5, 2.0, 6.0)]})
    assert "| 0 | 64 | True | 1.50x | 1.00x | 2.00x |" in table


# -- benchmarks.variants: the sink rows ----------------------------------------------------------------------

def test_sink_rows_are_gpt_oss_shapes():
    for name, window in (("sinks-8k", None), ("sinks-window-8k", (127, 0))):
        row = variants.ROWS[name]
        assert (row.batch, row.heads, row.kv_heads, row.seqlen, row.head_dim) == (1, 64, 8, 8192, 64)
        assert row.sinks and row.causal and row.dtype == "bfloat16" and row.kind == "sinks"
        assert row.variant.get("window") == window
    # 128 keys per query, its own included (transformers' sliding_window = 128)
    assert brute_pairs(300, 300, True, variants.ROWS["sinks-window-8k"].variant["window"]) == sum(
        min(i + 1, 128) for i in range(300))


def test_check_shape_keeps_the_query_group():
    small = variants.check_row(variants.ROWS["sinks-8k"])
    assert (small.heads, small.kv_heads, small.seqlen, small.batch) == (8, 1, 1024, 1)
    assert variants.check_row(variants.ROWS["softcap-8k"]).heads == 2
    assert variants.check_row(variants.ROWS["sinks-8k"].at(heads=4, kv_heads=2), dict(heads=3)).heads == 4


def test_sink_logits_are_seeded_per_head_and_absent_without_sinks():
    row = variants.ROWS["sinks-8k"]
    s = variants.sink_logits(row, "cpu")
    assert s.shape == (64,) and s.dtype == torch.float32 and torch.equal(s, variants.sink_logits(row, "cpu"))
    assert variants.sink_logits(variants.ROWS["softcap-8k"], "cpu") is None


def tiny_sink_rows():
    rows = [variants.ROWS[name].at(heads=4, kv_heads=2, seqlen=48, head_dim=16) for name in ("sinks-8k",
                                                                                         "sinks-window-8k")]
    return [rows[0], rows[1].at(variant={"window": (7, 0)})]


def test_sink_rows_run_check_and_report_on_cpu():
    """flashattn with and without sinks pass the float64 check (o, dq, dk, dv and the sinks' gradient),
    SDPA is unsupported, the backward timer clears the sinks' gradient too, and the plain call of the
    windowed row is checked and credited with the window."""
    seen = []
    out = variants.run(tiny_sink_rows(), ["flashattn", "flashattn_plain", "sdpa_flash"], "cpu",
                       lambda fn, grad_to_none=None: fake_timer(fn, grad_to_none, seen), log=lambda line: None,
                       check_shape=dict(batch=1, heads=2, seqlen=256))
    by = {(r["row"], r["provider"]): r for r in out["rows"]}
    for row in ("sinks-8k", "sinks-window-8k"):
        with_sinks, plain = by[(row, "flashattn")], by[(row, "flashattn_plain")]
        assert with_sinks["status"] == plain["status"] == "ok"
        assert with_sinks["check"]["passed"] and "dsinks" in with_sinks["check"]["rel_err"], with_sinks["check"]
        assert plain["check"]["passed"] and "dsinks" not in plain["check"]["rel_err"], plain["check"]
        assert with_sinks["fwd"]["tflops"] == plain["fwd"]["tflops"]  # same pairs: sinks add none
        assert by[(row, "sdpa_flash")]["status"] == "unsupported"
    assert by[("sinks-window-8k", "flashattn")]["fwd"]["tflops"] < by[("sinks-8k", "flashattn")]["fwd"]["tflops"]
    backward_clears = [ids for ids in seen if ids]
    assert sorted(map(len, backward_clears)) == [3, 3, 4, 4]  # q, k, v, and the sinks in the sink calls
    table = variants.markdown(out)
    assert "| sinks-window-8k |" in table and "WRONG" not in table


def test_sink_check_fails_without_the_sinks(monkeypatch):
    """Negative control: a provider that ignores the sinks fails the row's check."""
    row = tiny_sink_rows()[1]
    real = variants.prepare

    def forgetful(name, row_, device, sinks=None):
        return real(name, row_.at(sinks=False), device)

    monkeypatch.setattr(variants, "prepare", forgetful)
    result = variants.check("flashattn", row, "cpu", dict(batch=1, heads=2, seqlen=64))
    assert result["status"] == "failed"


def test_flex_with_sinks_matches_the_reference_forward():
    """FlexAttention (eager, forward only: it has no CPU backward) plus the LSE correction equals the
    float64 reference with sinks, and is far from the one without."""
    row = variants.check_row(tiny_sink_rows()[1], dict(batch=1, heads=2, seqlen=64))
    q, k, v, _ = (x.detach() for x in variants.make_inputs(row, "cpu", seed=1))
    sinks = variants.sink_logits(row, "cpu", seed=1)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # flex's "called without torch.compile" notice
        o = variants.prepare("flex", row, "cpu", sinks=sinks)(q, k, v)
        exact = naive_attention(q.double(), k.double(), v.double(), True, window=(7, 0), sinks=sinks.double())[0]
        lowp = naive_attention(q, k, v, True, window=(7, 0), sinks=sinks)[0]
        no_sinks = naive_attention(q.double(), k.double(), v.double(), True, window=(7, 0))[0]
    assert rel_err(o, exact) <= 2 * rel_err(lowp, exact) + 1e-5
    assert rel_err(no_sinks, exact) > 0.05  # the sinks take a visible share of the rows
