"""The benchmark harness on a CPU: grid, FLOP convention, the measuring loop, results file, plots, summary.

Every number below is synthetic (a fake timer on tiny CPU shapes, or hand-written TFLOP/s in a temporary
folder): these tests check the harness's code paths, never a performance claim.
"""

import copy
import json

import pytest
import torch

from benchmarks import grid, measure, providers, report, results, run
from flashattn import cost as cost_model


# -- the grid -------------------------------------------------------------------------------------------

def test_grid_holds_tokens_and_width_fixed():
    settings = grid.make_grid()
    plain = [s for s in settings if not s.gqa]
    assert len(plain) == 2 * 3 * 2 * 6  # dtype x D x mask x N, every provider
    for s in plain:
        assert s.batch * s.seqlen == 16384
        assert s.heads * s.head_dim == 2048
        assert s.peers and s.h_kv == s.heads
    assert {s.seqlen for s in plain} == {512, 1024, 2048, 4096, 8192, 16384}
    assert {s.dtype for s in plain} == {"float16", "bfloat16"}
    assert {(s.head_dim, s.heads) for s in plain} == {(64, 32), (128, 16), (256, 8)}
    # Within a group the lengths ascend (the first is the check shape); every setting is distinct.
    for a, b in zip(settings, settings[1:]):
        if a.group == b.group:
            assert a.seqlen < b.seqlen
    assert len({s.key for s in settings}) == len(settings)


def test_grid_has_a_gqa_row_after_the_rest():
    settings = grid.make_grid()
    gqa = [s for s in settings if s.gqa]
    assert [s.seqlen for s in gqa] == [512, 2048, 8192]
    assert settings[-len(gqa):] == gqa  # the side-by-side plain grid finishes first
    for s in gqa:
        assert (s.heads, s.h_kv, s.head_dim, s.dtype, s.causal) == (32, 8, 128, "bfloat16", True)
        assert s.batch * s.seqlen == 16384 and s.peers
        assert s.gqa == "32:8" and "GQA 32:8" in s.label()
    # The GQA row is its own line: never grouped with the plain bf16 D = 128 causal settings.
    plain = grid.make_setting("bfloat16", 128, True, 8192)
    assert plain.group != gqa[-1].group and plain.key != gqa[-1].key
    assert grid.make_grid(gqa_seqlens=()) == [s for s in settings if not s.gqa]


def test_gqa_inputs_have_fewer_kv_heads():
    s = grid.make_setting("float32", 16, True, 16, tokens=32, heads=4, kv_heads=2)
    q, k, v, do = measure.make_inputs(s, "cpu")
    assert q.shape == do.shape == (2, 4, 16, 16) and k.shape == v.shape == (2, 2, 16, 16)
    # FLOPs count query heads: GQA does the work of Hq heads.
    assert measure.attention_flops(s, "fwd") == cost_model.attention_flops(2, 4, 16, 16, 16, causal=True, mode="fwd")
    with pytest.raises(ValueError, match="kv_heads"):
        grid.make_setting("float32", 16, True, 16, tokens=32, heads=4, kv_heads=3)


def test_grid_rejects_shapes_off_the_token_budget():
    with pytest.raises(ValueError, match="seqlen"):
        grid.make_setting("float16", 64, False, 3000)
    with pytest.raises(ValueError, match="head_dim"):
        grid.make_setting("float16", 96, False, 1024)


def test_peers_skip_ours_only_head_dims():
    s256 = grid.make_setting("float16", 256, False, 1024, peers=False)
    s128 = grid.make_setting("float16", 128, False, 1024)
    for name in providers.PEERS:
        assert "flashattn only" in providers.PROVIDERS[name].skip_reason(s256)
        assert providers.PROVIDERS[name].skip_reason(s128) is None
    assert providers.PROVIDERS["flashattn"].skip_reason(s256) is None
    # D = 256 is in the side-by-side grid now: no provider skips it there.
    for s in grid.make_grid():
        assert all(p.skip_reason(s) is None for p in providers.get(providers.DEFAULT))


# -- FLOPs: the cost model's formula, no second one -------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mode", ["fwd", "bwd"])
def test_tflops_come_from_the_cost_model(causal, mode):
    s = grid.make_setting("bfloat16", 128, causal, 4096)
    flops, tf = measure.tflops(s, mode, 2.5)
    expected = cost_model.attention_flops(s.batch, s.heads, s.seqlen, s.seqlen, s.head_dim, causal=causal, mode=mode)
    assert flops == pytest.approx(float(expected))
    assert tf == pytest.approx(float(expected) / 2.5e-3 / 1e12)


def test_tflops_follow_a_changed_cost_model(monkeypatch):
    # If the benchmark kept a formula of its own, patching the cost model would not move its numbers.
    s = grid.make_setting("float16", 64, False, 1024)
    monkeypatch.setattr(cost_model, "attention_flops", lambda b, h, n, m, d, causal, mode: 1e12)
    assert measure.tflops(s, "fwd", 1000.0) == (1e12, pytest.approx(1.0))


def test_backward_counts_two_and_a_half_forwards():
    s = grid.make_setting("float16", 64, False, 2048)
    assert measure.attention_flops(s, "bwd") == pytest.approx(2.5 * measure.attention_flops(s, "fwd"))


# -- the measuring loop on a CPU, with a fake timer -------------------------------------------------------

FAKE_MS = 1.0  # what the fake timer says every call took (synthetic)


def fake_timer(fn, grad_to_none=None):
    fn()  # the code path runs for real; only the clock is fake
    if grad_to_none:
        for x in grad_to_none:
            x.grad = None
    return FAKE_MS


class Boom(providers.Provider):
    name, label = "boom", "fails at every call"

    def prepare(self, setting, device):
        def fn(q, k, v):
            raise RuntimeError("boom: kernel launch failed")
        return fn


class NoKernel(providers.Provider):
    name, label = "nokernel", "refuses every shape"

    def prepare(self, setting, device):
        def fn(q, k, v):
            raise RuntimeError("No available kernel. Aborting execution.")
        return fn


class Wrong(providers.Provider):
    name, label = "wrong", "off by 10 percent"

    def prepare(self, setting, device):
        from flashattn.reference import naive_attention
        return lambda q, k, v: 1.1 * naive_attention(q, k, v, causal=setting.causal)[0]


CPU_PROVIDERS = [providers.PROVIDERS["flashattn"], providers.PROVIDERS["reference"], Boom(), NoKernel(), Wrong()]


def tiny_grid():
    # float32 on a CPU: flashattn runs its tile-by-tile reference there. D = 16 (every provider) and
    # D = 32 (ours only), 2 masks x 2 lengths each, then a GQA 4:2 row at 2 lengths: 10 settings.
    return grid.make_grid(dtypes=("float32",), head_dims=(16,), head_dims_ours_only=(32,), causal=(False, True),
                          seqlens=(16, 32), tokens=64, hidden=64, gqa_seqlens=(16, 32), gqa_heads=(4, 2),
                          gqa_head_dim=16, gqa_dtype="float32", gqa_causal=True)


def run_tiny(**kw):
    return run.run_grid(tiny_grid(), CPU_PROVIDERS, device="cpu", timer=fake_timer,
                        peak_memory=lambda fn, inputs: 4096, log=lambda s: None, **kw)


@pytest.fixture(scope="module")
def tiny_run():
    handed_over = []  # how many measurements the loop had handed over after each setting
    out = run_tiny(on_setting=lambda partial: handed_over.append(len(partial["measurements"])))
    return out, handed_over


@pytest.fixture(scope="module")
def tiny(tiny_run):
    return tiny_run[0]


def test_loop_records_every_setting_provider_and_pass(tiny):
    settings = tiny_grid()
    assert len(tiny["measurements"]) == len(settings) * len(CPU_PROVIDERS) * 2
    assert len(tiny["memory"]) == len(settings) * len(CPU_PROVIDERS)
    by = {(m["provider"], m["head_dim"], m["causal"], m["kv_heads"], m["seqlen"], m["pass"]): m
          for m in tiny["measurements"]}
    assert len(by) == len(tiny["measurements"])  # the GQA row does not overwrite the plain D = 16 settings
    ok = by[("flashattn", 16, True, None, 32, "bwd")]
    s = grid.make_setting("float32", 16, True, 32, tokens=64, hidden=64)
    assert ok["status"] == "ok" and ok["ms"] == FAKE_MS
    assert ok["tflops"] == pytest.approx(measure.attention_flops(s, "bwd") / (FAKE_MS * 1e-3) / 1e12)
    assert ok["batch"] == 2 and ok["heads"] == 4 and "gqa" not in ok
    gqa = by[("flashattn", 16, True, 2, 32, "fwd")]
    assert gqa["status"] == "ok" and gqa["heads"] == 4 and gqa["gqa"] == "native"
    assert by[("reference", 16, True, 2, 32, "fwd")]["status"] == "ok"


def test_loop_records_failures_instead_of_crashing(tiny):
    for m in tiny["measurements"]:
        if m["provider"] == "boom" and m["head_dim"] == 16:
            assert m["status"] == "error" and "boom" in m["error"]
        if m["provider"] == "nokernel" and m["head_dim"] == 16:
            assert m["status"] == "unsupported" and "No available kernel" in m["error"]
        if m["head_dim"] == 32:  # ours only: flashattn and the reference run, the rest are skipped
            if m["provider"] in ("flashattn", "reference"):
                assert m["status"] == "ok"
            else:
                assert m["status"] == "skipped" and "flashattn only" in m["error"]
        assert m["status"] != "ok" or m["tflops"] > 0


def test_correctness_check_runs_once_per_group_and_can_fail(tiny):
    checks = {(c["provider"], c["head_dim"], c["causal"], c["kv_heads"]): c for c in tiny["checks"]}
    assert all(c["seqlen"] == 16 for c in tiny["checks"])  # the first length of each group
    # D=16: all providers, both masks; D=32: flashattn and the reference; the GQA row: all providers.
    assert len(tiny["checks"]) == len(checks) == 2 * len(CPU_PROVIDERS) + 2 * 2 + len(CPU_PROVIDERS)
    assert checks[("flashattn", 16, True, 2)]["passed"] and not checks[("wrong", 16, True, 2)]["passed"]
    for causal in (False, True):
        assert checks[("flashattn", 16, causal, None)]["passed"], checks[("flashattn", 16, causal, None)]
        assert checks[("reference", 16, causal, None)]["passed"]
        wrong = checks[("wrong", 16, causal, None)]
        assert not wrong["passed"] and wrong["status"] == "failed"
        assert wrong["rel_err"]["o"] == pytest.approx(0.1, rel=1e-3)  # 1.1 x o is 10 % off
        assert checks[("boom", 16, causal, None)]["status"] == "error"
        assert checks[("nokernel", 16, causal, None)]["status"] == "unsupported"


def test_results_are_handed_over_after_every_setting(tiny_run):
    per_setting = 2 * len(CPU_PROVIDERS)
    assert tiny_run[1] == [per_setting * (i + 1) for i in range(len(tiny_grid()))]


@pytest.mark.parametrize("exc, status", [
    (torch.cuda.OutOfMemoryError("CUDA out of memory"), "oom"),
    (RuntimeError("No available kernel. Aborting execution."), "unsupported"),
    (providers.Unsupported("D = 256"), "unsupported"),
    (ValueError("bad"), "error"),
])
def test_failures_are_classified(exc, status):
    got, message = measure.classify_error(exc)
    assert got == status and type(exc).__name__ in message


def test_time_budget_skips_the_rest_with_a_reason():
    class Spent(run.Clock):
        def over(self):
            return True

    out = run_tiny(clock=Spent(1.0))
    for m in out["measurements"]:
        assert m["status"] == "skipped"
        assert "time budget" in m["error"] or "flashattn only" in m["error"]


# -- the results file -------------------------------------------------------------------------------------

SYNTHETIC_ENV = {"gpu": "synthetic (test)", "driver": None, "cuda": None, "cudnn": None, "torch": torch.__version__,
                 "triton": "n/a", "date": "2000-01-01T00:00:00+00:00"}


def synthetic_results(measured):
    cfg = {"quick": True, "warmup_ms": 1, "rep_ms": 1, "timer": "fake (test)", "forward": "f", "backward": "b",
           "memory": "m", "flops": "attention_flops", "check": "c"}
    g = grid.grid_description(dtypes=("float32",), head_dims=(16,), head_dims_ours_only=(32,), causal=(False, True),
                              seqlens=(16, 32), tokens=64, hidden=64, gqa_seqlens=(16, 32), gqa_heads=(4, 2),
                              gqa_head_dim=16, gqa_dtype="float32", gqa_causal=True)
    res = results.new_results(environment=SYNTHETIC_ENV, config=cfg, grid=g,
                              providers={p.name: p.describe() for p in CPU_PROVIDERS})
    res.update(copy.deepcopy(measured))
    res["complete"] = True
    return res


def test_results_round_trip(tmp_path, tiny):
    res = synthetic_results(tiny)
    path = results.save(res, tmp_path / "results.json")
    assert results.load(path) == json.loads(json.dumps(res))
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("break_it, words", [
    (lambda r: r.pop("environment"), "environment"),
    (lambda r: r.__setitem__("schema", "other/0"), "schema"),
    (lambda r: r["measurements"][0].__setitem__("status", "fast"), "status"),
    (lambda r: r["measurements"][0].__setitem__("pass", "both"), "pass"),
    (lambda r: next(m for m in r["measurements"] if m["status"] == "ok").__setitem__("tflops", 0.0), "tflops"),
    (lambda r: next(m for m in r["measurements"] if m["status"] == "error").pop("error"), "error"),
    (lambda r: r["measurements"][0].__setitem__("provider", "nobody"), "provider"),
])
def test_results_validation_rejects(break_it, words, tiny):
    res = synthetic_results(tiny)
    break_it(res)
    with pytest.raises(ValueError, match=words):
        results.validate(res)


# -- plots and summary ------------------------------------------------------------------------------------

def hand_made_results():
    """flashattn at 200 TFLOP/s, reference at 100 and 400: ratios 2.00 and 0.50 (all synthetic)."""
    res = synthetic_results({"checks": [], "measurements": [], "memory": []})
    res["providers"] = {p.name: p.describe() for p in CPU_PROVIDERS[:2]}
    for s in tiny_grid():
        for prov, tf in (("flashattn", 200.0), ("reference", 100.0 if s.seqlen == 16 else 400.0)):
            for p in ("fwd", "bwd"):
                res["measurements"].append({**{k: getattr(s, k) for k in results.SETTING_KEYS}, "provider": prov,
                                            "pass": p, "status": "ok", "ms": 1.0, "flops": tf * 1e9, "tflops": tf})
            res["memory"].append({**{k: getattr(s, k) for k in results.SETTING_KEYS}, "provider": prov,
                                  "status": "ok", "peak_bytes": 3 * 2**20})
    results.validate(res)
    return res


def test_ratios_are_ours_over_peer():
    r = report.ratios(hand_made_results())
    assert r[("float32", 16, False, "", 16, "fwd")]["reference"] == pytest.approx(2.0)
    assert r[("float32", 16, True, "", 32, "bwd")]["reference"] == pytest.approx(0.5)
    assert r[("float32", 16, True, "4:2", 32, "bwd")]["reference"] == pytest.approx(0.5)
    mins = report.min_ratios(hand_made_results(), min_seqlen=16)
    assert mins[("float32", 16, False, "", "fwd")]["reference"] == (pytest.approx(0.5), 32)


def test_plots_and_summary_are_written(tmp_path):
    res = hand_made_results()
    path = results.save(res, tmp_path / "results.json")
    assert report.main([str(path)]) == 0
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pngs == ["tflops_bwd_float32.png", "tflops_fwd_float32.png"]
    for name in pngs:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = (tmp_path / "summary.md").read_text()
    assert "synthetic (test)" in summary
    assert "200 (2.00×)" not in summary  # ours is not compared with itself
    assert "| 16 | fwd | 200 | 100 (2.00×) |" in summary
    assert "| 32 | bwd | 200 | 400 (0.50×) |" in summary
    assert "3 MiB" in summary


def test_report_without_results_says_how_to_make_them(tmp_path, capsys):
    assert report.main([str(tmp_path / "missing.json")]) == 2
    assert "benchmarks.run" in capsys.readouterr().err


# -- the command line -------------------------------------------------------------------------------------

def test_run_refuses_without_cuda(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run.main(["--quick", "--out", str(tmp_path / "out")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_run_main_end_to_end_on_cpu(tmp_path, monkeypatch, capsys):
    # main() as the GPU run drives it, with only the GPU-bound pieces swapped for CPU stand-ins:
    # the device, the timer (fake: every call "takes" FAKE_MS), peak memory, and the environment record.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(run, "DEVICE", "cpu")
    monkeypatch.setattr(run, "environment", lambda device: dict(SYNTHETIC_ENV))
    monkeypatch.setattr(measure, "do_bench_timer", lambda warmup, rep: fake_timer)
    monkeypatch.setattr(measure, "cuda_peak_memory", lambda fn, inputs: 2**20)
    # The latency section runs for real on the CPU (wall clock, eager only: compiling needs a C compiler
    # and minutes), on two tiny shapes with short loops.
    argv = ["--dtypes", "float32", "--head-dims", "16", "--head-dims-ours-only", "32", "--seqlens", "16,32",
            "--gqa-seqlens", "", "--tokens", "64", "--hidden", "64", "--providers", "flashattn,reference",
            "--long-seqlen", "0", "--latency-modes", "eager", "--latency-dtypes", "float32",
            "--latency-head-dims", "16", "--latency-seqlens", "16", "--latency-batch-heads", "1x2",
            "--latency-target-ms", "1", "--latency-repeats", "2", "--no-progress", "--out", str(tmp_path)]
    assert run.main(argv) == 0
    res = results.load(tmp_path / "results.json")
    assert res["complete"] and res["grid"]["tokens"] == 64 and "gqa" not in res["grid"]
    assert res["config"]["sections"] == ["grid", "latency"]
    assert len(res["measurements"]) == 8 * 2 * 2 and all(m["status"] == "ok" for m in res["measurements"])
    assert all(c["passed"] for c in res["checks"]) and len(res["checks"]) == 4 * 2
    lat = res["latency"]["records"]
    # 2 shapes (both masks) x 2 providers x 1 mode x 2 passes, every one timed.
    assert len(lat) == 2 * 2 * 2 and all(r["status"] == "ok" and r["us_per_call"] > 0 for r in lat)
    assert {(r["provider"], r["mode"], r["pass"]) for r in lat} == {
        (p, "eager", q) for p in ("flashattn", "reference") for q in ("fwd", "fwd_bwd")}
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latency_fwd.png", "latency_fwd_bwd.png", "results.json", "summary.md", "tflops_bwd_float32.png",
        "tflops_fwd_float32.png"]
    printed = capsys.readouterr().out
    assert "vs reference" in printed  # the ratio table ends the grid's output
    summary = (tmp_path / "summary.md").read_text()
    assert "### Per-call latency at small shapes" in summary and "#### µs per call, eager" in summary


def test_run_latency_section_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(run, "DEVICE", "cpu")
    monkeypatch.setattr(run, "environment", lambda device: dict(SYNTHETIC_ENV))
    argv = ["--sections", "latency", "--providers", "reference", "--latency-modes", "eager",
            "--latency-passes", "fwd", "--latency-dtypes", "float32", "--latency-head-dims", "16",
            "--latency-seqlens", "16", "--latency-batch-heads", "1x2", "--latency-causal", "false",
            "--latency-target-ms", "1", "--latency-repeats", "1", "--no-progress", "--out", str(tmp_path)]
    assert run.main(argv) == 0
    res = results.load(tmp_path / "results.json")
    assert res["grid"] is None and res["measurements"] == [] and len(res["latency"]["records"]) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latency_fwd.png", "results.json", "summary.md"]
    summary = (tmp_path / "summary.md").read_text()
    assert "### TFLOP/s" not in summary and "Per-call latency" in summary


def test_run_rejects_unknown_sections(capsys):
    with pytest.raises(SystemExit):
        run.parse_args(["--sections", "grid,speed"])
    assert "--sections" in capsys.readouterr().err


def test_run_rejects_unknown_providers():
    with pytest.raises(ValueError, match="unknown provider"):
        providers.get(["flashattn", "xformers"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_run_smoke_on_gpu(tmp_path):
    argv = ["--dtypes", "float16", "--head-dims", "64", "--head-dims-ours-only", "", "--causal", "both",
            "--seqlens", "1024", "--providers", "flashattn,sdpa_flash", "--warmup-ms", "5", "--rep-ms", "10",
            "--flex-workers", "0", "--long-seqlen", "0", "--gqa-seqlens", "", "--sections", "grid",
            "--no-progress", "--out", str(tmp_path)]
    assert run.main(argv) == 0
    res = results.load(tmp_path / "results.json")
    assert res["complete"]
    assert all(c["passed"] for c in res["checks"] if c["provider"] == "flashattn")
    assert all(m["status"] == "ok" for m in res["measurements"] if m["provider"] == "flashattn")
