"""The benchmark harness on a CPU: grid, FLOP convention, the measuring loop, results file, plots, summary.

Every number below is synthetic (a fake timer on tiny CPU shapes, or hand-written TFLOP/s in a temporary
folder): these tests check the harness's code paths, never a performance claim.
"""

import copy
import pathlib
import subprocess
import json

import pytest
import torch

from benchmarks import grid, measure, provenance, providers, report, results, run
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
        # The first length of a group is attempted; the longer ones are not retried, and say why.
        if m["provider"] == "boom" and m["head_dim"] == 16:
            if m["seqlen"] == 16:
                assert m["status"] == "error" and "boom" in m["error"]
            else:
                assert m["status"] == "skipped" and m["error"].startswith("not retried: error at N = 16")
                assert "boom" in m["error"]
        if m["provider"] == "nokernel" and m["head_dim"] == 16:
            expected = "unsupported" if m["seqlen"] == 16 else "skipped"
            assert m["status"] == expected and "No available kernel" in m["error"]
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


def test_out_of_memory_is_retried_at_the_next_length():
    class OOMAtFirst(providers.Provider):
        name, label = "oomfirst", "out of memory at N = 16 only"

        def prepare(self, setting, device):
            from flashattn.reference import naive_attention

            def fn(q, k, v):
                if q.shape[2] == 16:
                    raise torch.cuda.OutOfMemoryError("CUDA out of memory")
                return naive_attention(q, k, v, causal=setting.causal)[0]
            return fn

    out = run.run_grid(tiny_grid()[:2], [OOMAtFirst()], device="cpu", timer=fake_timer,
                       peak_memory=lambda fn, inputs: 1, log=lambda s: None)
    assert [m["status"] for m in out["measurements"]] == ["oom", "oom", "ok", "ok"]


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
    assert all(m["host_us"] > 0 for m in res["measurements"]) and "host_us" in res["config"]["host"]
    assert all(c["passed"] for c in res["checks"]) and len(res["checks"]) == 4 * 2
    lat = res["latency"]["records"]
    # 2 shapes (both masks) x 2 providers x 1 mode x 2 passes, every one timed.
    assert len(lat) == 2 * 2 * 2 and all(r["status"] == "ok" and r["us_per_call"] > 0 for r in lat)
    assert {(r["provider"], r["mode"], r["pass"]) for r in lat} == {
        (p, "eager", q) for p in ("flashattn", "reference") for q in ("fwd", "fwd_bwd")}
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latency_fwd_bwd_eager.png", "latency_fwd_eager.png", "results.json", "summary.md",
        "tflops_bwd_float32.png", "tflops_fwd_float32.png"]
    printed = capsys.readouterr().out
    assert "vs reference" in printed  # the ratio table ends the grid's output
    summary = (tmp_path / "summary.md").read_text()
    assert "### Per-call latency at small shapes" in summary and "#### µs per call, eager" in summary
    assert "### Calls the host may bound" in summary


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
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latency_fwd_eager.png", "results.json", "summary.md"]
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


# -- the latency section ----------------------------------------------------------------------------------

from benchmarks import ab, latency, registers, tune  # noqa: E402


class QueueModel:
    """A fake host clock and GPU: each call costs the host ``host_s`` and queues ``gpu_s`` of GPU work;
    ``sync`` waits until the queue is empty. What a CUDA stream does, with made-up costs (synthetic)."""

    def __init__(self, host_s, gpu_s):
        self.host_s, self.gpu_s, self.now, self.gpu_free = host_s, gpu_s, 0.0, 0.0

    def clock(self):
        return self.now

    def call(self):
        self.now += self.host_s
        self.gpu_free = max(self.gpu_free, self.now) + self.gpu_s

    def sync(self):
        self.now = max(self.now, self.gpu_free)


@pytest.mark.parametrize("host_us, gpu_us", [(2.0, 5.0), (5.0, 2.0)])
def test_wall_clock_per_call_is_the_slower_of_host_and_gpu(host_us, gpu_us):
    model = QueueModel(host_us * 1e-6, gpu_us * 1e-6)
    timer = latency.WallClock(target_ms=1.0, repeats=3, warmup_calls=2, clock=model.clock)
    got = timer(model.call, model.sync)
    n = got["calls"]
    # About 1 ms of calls per loop (the length is estimated from 3 calls, so a little under).
    assert 0.8e3 <= n * max(host_us, gpu_us) <= 1.0e3 and got["repeats"] == 3 and len(got["samples_us"]) == 3
    # Back-to-back calls: the wall time per call is the slower side's (plus one call of the other's latency / n).
    assert got["us_per_call"] == pytest.approx(max(host_us, gpu_us) + min(host_us, gpu_us) / n, rel=1e-9)
    assert got["host_us_per_call"] == pytest.approx(host_us)


def test_wall_clock_loop_length_is_bounded():
    timer = latency.WallClock(target_ms=10.0)
    assert timer.calls_for(1e-3) == 10 and timer.calls_for(1e-4) == 100
    assert timer.calls_for(0.0) == latency.MAX_CALLS and timer.calls_for(1.0) == latency.MIN_CALLS


def test_latency_shapes_follow_the_issue():
    shapes = latency.make_shapes()
    assert len(shapes) == 3 * 2 * 2 * 2  # N x (B, H) x D x mask, one dtype
    assert {s.seqlen for s in shapes} == {128, 512, 1024}
    assert {s.batch * s.heads for s in shapes} == {16, 128}
    assert {s.head_dim for s in shapes} == {64, 128} and {s.causal for s in shapes} == {False, True}
    # Mask outermost: dynamo sees one mask at a time.
    assert [s.causal for s in shapes] == sorted(s.causal for s in shapes)


def tiny_shapes():
    return latency.make_shapes(dtypes=("float32",), head_dims=(16,), seqlens=(16,), batch_heads=((1, 2),))


class RecordingCompile:
    """A stand-in for torch.compile that records how it was called; ``fail`` makes the compiled call raise."""

    def __init__(self, fail=False):
        self.calls, self.fail = [], fail

    def __call__(self, fn, **kwargs):
        self.calls.append(kwargs)
        if not self.fail:
            return fn

        def broken(*args):
            raise RuntimeError("Dynamo does not know how to trace the builtin native_specialize_impl")
        return broken


def run_tiny_latency(provs, compile_fn, **kw):
    return latency.run_latency(tiny_shapes(), provs, device="cpu", compile_fn=compile_fn,
                               measure_fn=latency.WallClock(target_ms=0.5, repeats=1, warmup_calls=1),
                               reset=lambda: None, log=lambda s: None, **kw)


def test_latency_runs_every_provider_mode_and_pass():
    compile_fn = RecordingCompile()
    recs = run_tiny_latency([providers.PROVIDERS["flashattn"], providers.PROVIDERS["reference"]], compile_fn)
    assert len(recs) == 2 * 2 * 4 * 2  # shapes (2 masks) x providers x modes x passes
    assert all(r["status"] == "ok" and r["us_per_call"] > 0 and r["host_us_per_call"] > 0 for r in recs)
    assert all(r["host_us_per_call"] <= r["us_per_call"] * (1 + 1e-9) for r in recs)  # on a CPU: no queue
    modes = {kw.get("mode") for kw in compile_fn.calls}
    assert modes == {None, "reduce-overhead"}
    assert all(kw["fullgraph"] and kw["dynamic"] for kw in compile_fn.calls)
    assert len(compile_fn.calls) == 2 * 2 * 2  # shapes x providers x compiled modes: the eager modes never compile
    results.validate_latency(latency.section(tiny_shapes(), [providers.PROVIDERS["reference"]], [
        r for r in recs if r["provider"] == "reference"], latency.WallClock()), {"reference": {}})


def test_latency_measures_the_providers_of_a_shape_back_to_back_in_every_mode():
    """Shape, then provider, in the eager and the compiled modes alike: the figures compared at a
    shape are taken together; dynamo is reset once per compiled mode, never between providers."""
    compile_fn, resets = RecordingCompile(), []
    recs = latency.run_latency(tiny_shapes(), [providers.PROVIDERS["flashattn"], providers.PROVIDERS["reference"]],
                               device="cpu", compile_fn=compile_fn,
                               measure_fn=latency.WallClock(target_ms=0.5, repeats=1, warmup_calls=1),
                               reset=lambda: resets.append(1), log=lambda s: None)
    for mode in latency.MODES:
        seen = [(r["provider"], r["causal"]) for r in recs if r["mode"] == mode and r["pass"] == "fwd"]
        assert seen == [("flashattn", False), ("reference", False), ("flashattn", True), ("reference", True)]
    assert len(resets) == len([m for m in latency.MODES if m not in latency.EAGER_MODES])


def test_compiled_latency_loops_take_turns_between_providers():
    timer = LoopLog(latency.WallClock(target_ms=0.2, repeats=3, warmup_calls=1))
    recs = latency.run_latency(tiny_shapes()[:1], [providers.PROVIDERS["flashattn"], providers.PROVIDERS["reference"]],
                               device="cpu", modes=("reduce-overhead",), passes=("fwd",), measure_fn=timer,
                               compile_fn=RecordingCompile(), reset=lambda: None, log=lambda s: None)
    assert [r["provider"] for r in recs] == ["flashattn", "reference"] and all(r["status"] == "ok" for r in recs)
    first, second = timer.log[0], timer.log[1]
    assert first is not second and timer.log == [first, second] * 3


def test_sdpa_providers_compile_functions_of_their_own_code():
    """The SDPA providers' compiled-mode functions come from one def: each provider gets a code object
    of its own (dynamo's graphs live on code objects), the same one at every shape, so dynamic=True
    reuses a provider's graph across shapes and no provider is handed another backend's graph."""
    compile_fn = RecordingCompile()
    shapes = tiny_shapes() + latency.make_shapes(dtypes=("float32",), head_dims=(32,), seqlens=(64,),
                                                 batch_heads=((2, 2),))
    codes = {name: {providers.PROVIDERS[name].latency_parts(s, "cpu", compile_fn).compiled.__code__ for s in shapes}
             for name in ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient")}
    assert all(len(c) == 1 for c in codes.values())  # one code object per provider, at every shape
    assert len({c for cs in codes.values() for c in cs}) == 3  # and no two providers share one
    parts = providers.PROVIDERS["sdpa_efficient"].latency_parts(tiny_shapes()[0], "cpu", compile_fn)
    assert parts.compiled is not parts.inner and parts.eager is parts.inner


def test_latency_records_a_failed_compile_and_goes_on():
    recs = run_tiny_latency([providers.PROVIDERS["reference"]], RecordingCompile(fail=True))
    for r in recs:
        if r["mode"] in latency.EAGER_MODES:
            assert r["status"] == "ok"
        else:
            assert r["status"] == "error" and "native_specialize_impl" in r["error"]


class ContextCounter(providers.Provider):
    """The reference, with a backend context (like SDPA's) that counts how often it is entered."""

    name, label = "reference", "counting"

    def __init__(self):
        self.entered = 0

    def latency_parts(self, setting, device, compile_fn):
        from flashattn.reference import naive_attention
        import contextlib

        @contextlib.contextmanager
        def context():
            self.entered += 1
            yield

        return providers.LatencyParts(lambda q, k, v: naive_attention(q, k, v, causal=setting.causal)[0],
                                      context=context)


def test_latency_enters_a_backend_context_once_per_timed_loop_not_per_call():
    prov = ContextCounter()
    recs = run_tiny_latency([prov], RecordingCompile(), modes=("eager",))
    assert all(r["status"] == "ok" and r["calls"] >= latency.MIN_CALLS for r in recs)
    # per shape and pass: the first call with the calibration, then each of the repeats' loops (1 here)
    assert prov.entered == len(tiny_shapes()) * len(latency.PASSES) * 2


class LoopLog:
    """A WallClock whose timed loops also log which call they ran."""

    def __init__(self, inner):
        self.inner, self.repeats, self.log = inner, inner.repeats, []

    def calibrate(self, call, sync):
        return self.inner.calibrate(call, sync)

    def sample(self, call, sync, n):
        self.log.append(call)
        return self.inner.sample(call, sync, n)

    def summary(self, n, samples):
        return self.inner.summary(n, samples)


def test_latency_eager_loops_take_turns_between_providers():
    """At one shape and pass, the providers' timed loops alternate round by round (A B A B A B, not
    A A A B B B), so a drifting host moves the figures compared at a shape together."""
    timer = LoopLog(latency.WallClock(target_ms=0.2, repeats=3, warmup_calls=1))
    provs = [providers.PROVIDERS["reference"], ContextCounter()]
    recs = latency.run_latency(tiny_shapes()[:1], provs, device="cpu", modes=("eager",), passes=("fwd",),
                               measure_fn=timer, compile_fn=RecordingCompile(), reset=lambda: None,
                               log=lambda s: None)
    assert [r["provider"] for r in recs] == ["reference", "reference"] and all(r["repeats"] == 3 for r in recs)
    first, second = timer.log[0], timer.log[1]
    assert first is not second and timer.log == [first, second] * 3


class ThreadSwitchSpy(providers.Provider):
    """The reference, recording whether the autograd engine may use its worker threads during each call."""

    name, label = "reference", "thread spy"

    def __init__(self):
        self.seen = []

    def latency_parts(self, setting, device, compile_fn):
        from flashattn.reference import naive_attention

        def fn(q, k, v):
            self.seen.append(torch.autograd.is_multithreading_enabled())
            return naive_attention(q, k, v, causal=setting.causal)[0]
        return providers.LatencyParts(fn)


def test_latency_one_thread_mode_runs_the_calls_with_the_engine_threads_off():
    for mode, expected in (("eager", True), ("eager-one-thread", False)):
        spy = ThreadSwitchSpy()
        recs = run_tiny_latency([spy], RecordingCompile(), modes=(mode,))
        assert all(r["status"] == "ok" and r["mode"] == mode for r in recs)
        assert spy.seen and set(spy.seen) == {expected}
    assert torch.autograd.is_multithreading_enabled()  # restored after the measurement


class CompiledOnly(providers.Provider):
    """Like FlexAttention: the eager column is already a compiled call; compiling again is skipped,
    without making the parts (FlexAttention's reset dynamo)."""

    name, label = "reference", "compiled only"
    not_compiled_again = "eager = compiled already"

    def __init__(self):
        self.made = []

    def latency_parts(self, setting, device, compile_fn):
        self.made.append(setting)
        fn = providers.PROVIDERS["reference"].prepare(setting, device)
        return providers.LatencyParts(fn, note=self.not_compiled_again)


def test_latency_skips_compiling_a_provider_twice_and_says_why():
    compile_fn, prov = RecordingCompile(), CompiledOnly()
    recs = run_tiny_latency([prov], compile_fn)
    for r in recs:
        if r["mode"] in latency.EAGER_MODES:
            assert r["status"] == "ok" and r["note"] == "eager = compiled already"
        else:
            assert r["status"] == "skipped" and "eager = compiled already" in r["error"]
    assert compile_fn.calls == []
    assert len(prov.made) == len(tiny_shapes()) * len(latency.EAGER_MODES)


def test_flex_latency_compiles_each_shape_with_dynamo_reset_first(monkeypatch):
    """Every torch.compile wrapper of flex_attention shares dynamo's cache for its code: without a
    reset per shape, the ninth shape passes dynamo's recompile limit and flex_attention runs unfused
    (on an H200 this made the D = 128 causal cells milliseconds per call). Each shape's compile must
    come right after a reset."""
    import torch._dynamo

    events = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: events.append("reset"))

    def compile_fn(fn, **kw):
        events.append("compile")
        return fn
    shapes = [s for s in tiny_shapes() for _ in range(5)]  # ten shapes, both masks
    for s in shapes:
        providers.PROVIDERS["flex"].latency_parts(s, "cpu", compile_fn)
    assert events == ["reset", "compile"] * len(shapes)


def test_latency_budget_skips_with_a_reason():
    class Spent(run.Clock):
        def over(self):
            return True

    recs = run_tiny_latency([providers.PROVIDERS["reference"]], RecordingCompile(), clock=Spent(1.0))
    assert recs and all(r["status"] == "skipped" and "time budget" in r["error"] for r in recs)


def test_gqa_is_not_a_latency_shape():
    s = grid.make_setting("float32", 16, True, 16, tokens=32, heads=4, kv_heads=2)
    with pytest.raises(providers.Unsupported):
        providers.PROVIDERS["sdpa_flash"].latency_parts(s, "cpu", RecordingCompile())


def latency_results(flash_us, sdpa_us):
    """Synthetic latency records: flashattn and SDPA flash at every tiny shape, every mode and pass."""
    res = synthetic_results({"checks": [], "measurements": [], "memory": []})
    res["providers"] = {"flashattn": {"label": "flashattn (ours)"}, "sdpa_flash": {"label": "SDPA flash"}}
    recs = []
    for s in latency.make_shapes(dtypes=("bfloat16",), head_dims=(64,), seqlens=(128, 512), batch_heads=((1, 16),)):
        for mode in latency.MODES:
            for p in latency.PASSES:
                for prov, us in (("flashattn", flash_us[mode]), ("sdpa_flash", sdpa_us)):
                    recs.append({**{k: getattr(s, k) for k in results.SETTING_KEYS}, "provider": prov, "mode": mode,
                                 "pass": p, "status": "ok", "us_per_call": us, "host_us_per_call": us / 2})
    res["latency"] = {"config": {"timer": "synthetic", "forward": "f", "fwd_bwd": "fb", "modes": latency.MODE_HOW,
                                 "target_ms": 1, "repeats": 1}, "records": recs}
    results.validate(res)
    return res


def test_latency_table_marks_the_targets(tmp_path):
    res = latency_results({"eager": 30.0, "eager-one-thread": 28.0, "compile": 25.0, "reduce-overhead": 24.0}, sdpa_us=20.0)
    table = report.latency_target_table(res)
    rows = [line for line in table.splitlines() if line.startswith("| bfloat16 | 64 | non-causal | fwd |")]
    assert rows == ["| bfloat16 | 64 | non-causal | fwd | 1.50× ✓ | 1.40× | 1.25× | 1.20× ✗ (>1.1) |"]
    paths = report.write_all(res, tmp_path)
    assert sorted(p.name for p in paths) == sorted([f"latency_{q}_{m}.png" for q in ("fwd", "fwd_bwd") for m in latency.MODES] + ["summary.md"])
    summary = (tmp_path / "summary.md").read_text()
    assert "#### µs per call, reduce-overhead" in summary
    assert "| bfloat16 | 64 | causal | 512 | 16 | fwd_bwd | 24.0 (1.20×) | 20.0 |" in summary
    assert "### TFLOP/s" not in summary  # no grid measured: no grid tables


def test_committed_results_render_with_and_without_their_latency_section(tmp_path):
    """The committed file holds a latency section (it validates on load) and renders it; the same file
    without the section, as files from before it existed are, renders the rest alone."""
    res = results.load("benchmarks/results/results.json")
    assert res["latency"]["records"]
    summary = report.summary_markdown(res)
    assert "Per-call latency" in summary and "### TFLOP/s" in summary
    assert report.latency_target_table(res) != ""
    res["latency"] = None
    assert report.latency_plot_files(res, tmp_path) == [] and report.latency_target_table(res) == ""
    summary = report.summary_markdown(res)
    assert "Per-call latency" not in summary and "### TFLOP/s" in summary


@pytest.mark.parametrize("break_it, words", [
    (lambda r: r["latency"]["records"][0].__setitem__("mode", "jit"), "mode"),
    (lambda r: r["latency"]["records"][0].__setitem__("pass", "bwd"), "pass"),
    (lambda r: r["latency"]["records"][0].__setitem__("us_per_call", 0.0), "us_per_call"),
    (lambda r: r["latency"]["records"][0].update(status="error"), "error"),
    (lambda r: r["latency"].pop("config"), "config"),
])
def test_latency_validation_rejects(break_it, words):
    res = latency_results({"eager": 30.0, "eager-one-thread": 28.0, "compile": 25.0, "reduce-overhead": 24.0}, sdpa_us=20.0)
    break_it(res)
    with pytest.raises(ValueError, match=words):
        results.validate(res)


# -- A/B against a git revision ---------------------------------------------------------------------------

def test_compare_is_bitwise():
    x = torch.randn(3, 4)
    y = x.clone()
    y[1, 2] = float("nan")
    assert ab.compare({"o": y}, {"o": y.clone()})["o"]["bitwise_equal"]  # NaN where both have it: same bits
    z = x.clone()
    z[0, 0] = torch.nextafter(z[0, 0], torch.tensor(float("inf")))  # one ulp
    got = ab.compare({"o": z}, {"o": x})["o"]
    assert not got["bitwise_equal"] and 0 < got["max_abs_diff"] < 1e-6
    assert not ab.compare({"o": x.double()}, {"o": x})["o"]["bitwise_equal"]


def test_ab_refuses_an_unknown_revision_and_leaves_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(ab.tempfile, "tempdir", str(tmp_path))
    with pytest.raises(ValueError, match="no-such-rev"):
        ab.run_ab("no-such-rev", [], device="cpu", timer="wall")
    assert list(tmp_path.iterdir()) == []


def test_ab_against_head_on_cpu(monkeypatch, tmp_path):
    # Two worker processes, the working tree's flashattn and HEAD's exported copy, on the reference path.
    monkeypatch.setattr(ab.tempfile, "tempdir", str(tmp_path))
    s = grid.make_setting("float32", 16, True, 16, tokens=16, hidden=32)
    lines = []
    out = ab.run_ab("HEAD", [s], device="cpu", timer="wall", repeats=2, log=lines.append)
    assert list(tmp_path.iterdir()) == []  # the exported revision is gone
    assert out["new"]["flashattn_file"] == str(ab.REPO / "flashattn")
    assert out["base"]["flashattn_file"].startswith(str(tmp_path)) and out["base"]["commit"] == ab.resolve("HEAD")
    assert out["same_sources"] == (provenance.sources_sha256(ab.REPO / "flashattn") == out["base"]["sources_sha256"])
    (row,) = out["rows"]
    assert set(row["outputs"]) == {"o", "dq", "dk", "dv"}
    if out["same_sources"]:
        assert row["bitwise_equal"]
    for side in ("new", "base"):
        for p in ("fwd", "bwd"):
            t = row["timings"][side][p]
            assert len(t["samples"]) == 2 and t["ms"] > 0 and t["tflops"] > 0
    assert ab.speedup(row, "fwd") == pytest.approx(row["timings"]["base"]["fwd"]["ms"] / row["timings"]["new"]["fwd"]["ms"])
    assert "outputs bitwise equal" in lines[-1] or not out["same_sources"]


def test_ab_latency_passes_are_wall_clock_per_call(monkeypatch, tmp_path):
    # --latency times the forward with the latency section's wall clock too, never with do_bench.
    monkeypatch.setattr(ab.tempfile, "tempdir", str(tmp_path))
    s = grid.make_setting("float32", 16, True, 16, tokens=16, hidden=32)
    out = ab.run_ab("HEAD", [s], device="cpu", timer="wall", repeats=1, passes=ab.LATENCY_PASSES,
                    latency_target_ms=1.0, log=lambda x: None)
    (row,) = out["rows"]
    for side in ("new", "base"):
        for p in ab.LATENCY_PASSES:
            t = row["timings"][side][p]
            assert t["us_per_call"] > 0 and "ms" not in t and "tflops" not in t
    assert "fwd_call new" in ab.format_row(row) and "µs" in ab.format_row(row)


# -- tuning sweeps ----------------------------------------------------------------------------------------

def pins_timer(seen):
    """A fake timer that records what the tuning context and the autograd engine look like during the call."""
    from flashattn import _config

    def timer(fn, grad_to_none=None):
        t = _config.current_tuning()
        seen.append((dict(t.configs), t.heads_per_group, t.overlap_dq, torch.autograd.is_multithreading_enabled()))
        return fake_timer(fn, grad_to_none)
    return timer


def test_config_sweep_pins_one_kernel_per_variant():
    from flashattn import _config

    s = grid.make_setting("float32", 16, False, 16, tokens=16, hidden=32)
    space = {16: {"fwd": [[32, 16, 4, 1]], "bwd_dq": [[16, 16, 4, 1], [64, 16, 4, 1]]}}
    seen = []
    rows = tune.sweep([s], lambda st: tune.config_variants(st, "cpu", ("fwd", "bwd_dq"), space), device="cpu",
                      timer=pins_timer(seen), log=lambda x: None)
    assert [r["variant"] for r in rows] == ["table", "fwd (32, 16, 4, 1)", "bwd_dq (16, 16, 4, 1)",
                                            "bwd_dq (64, 16, 4, 1)"]
    assert set(rows[0]) >= {"fwd", "bwd"} and "bwd" not in rows[1] and "fwd" not in rows[2]
    assert [pins for pins, *_ in seen] == [{}, {}, {"fwd": _config.KernelConfig(32, 16, 4, 1)},
                                           {"bwd_dq": _config.KernelConfig(16, 16, 4, 1)},
                                           {"bwd_dq": _config.KernelConfig(64, 16, 4, 1)}]
    # The backward must run on the calling thread, or the pin would not reach it on a GPU.
    assert not any(multithreaded for *_, multithreaded in seen)
    assert _config.current_tuning().configs == {}  # restored after the sweep


def test_config_sweep_defaults_to_the_package_neighbourhood():
    s = grid.make_setting("float32", 16, True, 16, tokens=16, hidden=32)
    variants = tune.config_variants(s, "cpu")
    assert variants[0][0] == "table"
    per_kernel = {k: [kw[k] for _, kw, _ in variants[1:] if k in kw] for k in tune.KERNEL_PASS}
    from flashattn import _config
    for kernel, cfgs in per_kernel.items():
        assert cfgs == _config.tuning_space(kernel, tune._problem(s), torch.device("cpu"))
        assert cfgs and cfgs[0] == _config.get_config(kernel, tune._problem(s), torch.device("cpu"))


def test_config_sweep_with_dropout_calls_flashattn_with_it(monkeypatch):
    """--dropout: the swept calls drop (seeded, so repeatable), the candidates come from the dropout
    problem's table entry, and flashattn's rows say so; without it the call is the grid's."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the CPU reference path
    s = grid.make_setting("float32", 16, False, 16, tokens=16, hidden=32)
    q, k, v, _ = measure.make_inputs(s, "cpu", seed=0)
    plain = tune.flashattn_call(s, "cpu")(q, k, v)
    dropped = tune.flashattn_call(s, "cpu", 0.5)
    once, again = dropped(q, k, v), dropped(q, k, v)
    assert torch.equal(once, again) and not torch.allclose(once, plain)
    assert torch.equal(tune.flashattn_call(s, "cpu", 0.0)(q, k, v), plain)
    assert tune._problem(s, 0.5).dropout_p == 0.5 and tune._problem(s).dropout_p == 0.0
    rows = tune.sweep([s], lambda st: tune.config_variants(st, "cpu", ("fwd",), {16: {"fwd": [[32, 16, 4, 1]]}}, 0.5),
                      device="cpu", timer=fake_timer, peers=("reference",), log=lambda x: None, dropout_p=0.5)
    assert [r.get("dropout_p") for r in rows] == [0.5, 0.5, None]


def test_order_and_overlap_sweeps_set_their_switch():
    s = grid.make_setting("float32", 16, True, 16, tokens=16, hidden=32)
    seen = []
    tune.sweep([s], lambda st: tune.order_variants((1, 4)), device="cpu", timer=pins_timer(seen), log=lambda x: None)
    assert [g for _, g, _, _ in seen] == [None, None, 1, 1, 4, 4]  # auto, G=1, G=4; fwd and bwd each
    seen.clear()
    rows = tune.sweep([s], lambda st: tune.overlap_variants(), device="cpu", timer=pins_timer(seen),
                      peers=("reference",), log=lambda x: None)
    assert [o for _, _, o, _ in seen] == [True, False, True, True]  # overlap, serial, then the peer's 2 passes
    assert [r["variant"] for r in rows] == ["overlap_dq", "serial", "reference"]


def test_sweep_records_a_config_that_fails():
    s = grid.make_setting("float32", 16, False, 16, tokens=16, hidden=32)

    def timer(fn, grad_to_none=None):
        from flashattn import _config
        if _config.current_tuning().configs:
            raise RuntimeError("out of resource: shared memory")
        return fake_timer(fn, grad_to_none)

    rows = tune.sweep([s], lambda st: tune.config_variants(st, "cpu", ("fwd",), {16: {"fwd": [[256, 256, 8, 4]]}}),
                      device="cpu", timer=timer, log=lambda x: None)
    assert "error" not in rows[0] and rows[1]["status"] == "error" and "shared memory" in rows[1]["error"]


def test_profile_lists_what_ran(tmp_path):
    s = grid.make_setting("float32", 16, True, 16, tokens=16, hidden=32)
    rows = tune.profile([s], device="cpu", calls=2, log=lambda x: None)
    assert rows and all(r["us"] > 1 for r in rows)
    assert any("mm" in r["kernel"] or "matmul" in r["kernel"] for r in rows)


def test_registers_covers_every_table_entry():
    from flashattn import _config

    jobs = registers.jobs()
    assert {(kernel, d, causal) for kernel, _, d, _, causal, _ in jobs} == {
        (kernel, d, causal) for kernel in tune.KERNEL_PASS for d in (16, 64, 72, 128, 256) for causal in (False, True)}
    compiled = {(kernel, block_d, cfg) for kernel, _, _, block_d, _, cfg in jobs}
    small = {(kernel, block_d, cfg) for (kernel, block_d), (_, cfg) in _config._SM90_SMALL_GRID.items()
             if block_d in {b for _, b, _ in compiled}}  # (the head dims it compiles: no BLOCK_D 32)
    assert len(small) >= 4 and small <= compiled  # the small-grid tiles too
    extra = registers.jobs([(64, 128, 8, 3)])[len(jobs):]
    assert [(kernel, cfg.block_m, cfg.block_n) for kernel, *_, cfg in extra] == [
        (kernel, 64, 128) for kernel in tune.KERNEL_PASS]


def test_update_adds_the_latency_section_to_an_earlier_grid_run(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(run, "DEVICE", "cpu")
    monkeypatch.setattr(measure, "do_bench_timer", lambda warmup, rep: fake_timer)
    monkeypatch.setattr(measure, "cuda_peak_memory", lambda fn, inputs: 2**20)
    common = ["--providers", "reference", "--no-progress", "--out", str(tmp_path)]
    monkeypatch.setattr(run, "environment", lambda device: dict(SYNTHETIC_ENV, date="grid run"))
    assert run.main(["--sections", "grid", "--dtypes", "float32", "--head-dims", "16", "--seqlens", "16",
                     "--gqa-seqlens", "", "--tokens", "32", "--hidden", "32", "--long-seqlen", "0", *common]) == 0
    grid_run = results.load(tmp_path / "results.json")
    monkeypatch.setattr(run, "environment", lambda device: dict(SYNTHETIC_ENV, date="latency run"))
    assert run.main(["--sections", "latency", "--update", "--latency-modes", "eager", "--latency-passes", "fwd",
                     "--latency-dtypes", "float32", "--latency-head-dims", "16", "--latency-seqlens", "16",
                     "--latency-batch-heads", "1x2", "--latency-causal", "true", "--latency-target-ms", "1",
                     "--latency-repeats", "1", *common]) == 0
    both = results.load(tmp_path / "results.json")
    for key in ("environment", "grid", "checks", "measurements", "memory"):
        assert both[key] == grid_run[key], key
    assert both["config"]["argv"] == grid_run["config"]["argv"] and "--update" in both["config"]["update_argv"]
    assert both["latency"]["environment"]["date"] == "latency run" and len(both["latency"]["records"]) == 1
    summary = (tmp_path / "summary.md").read_text()
    assert "### TFLOP/s" in summary and "Measured in a separate run" in summary
    # Without --update the file holds only what this run measured.
    assert run.main(["--sections", "latency", "--latency-modes", "eager", "--latency-passes", "fwd",
                     "--latency-dtypes", "float32", "--latency-head-dims", "16", "--latency-seqlens", "16",
                     "--latency-batch-heads", "1x2", "--latency-causal", "true", "--latency-target-ms", "1",
                     "--latency-repeats", "1", *common]) == 0
    assert results.load(tmp_path / "results.json")["measurements"] == []


def test_ab_export_then_compare_from_the_folder(tmp_path, monkeypatch):
    dest = tmp_path / "ab-base"
    assert ab.main(["HEAD", "--export", str(dest)]) == 0
    assert (dest / "COMMIT").read_text().strip() == ab.resolve("HEAD")
    if subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "flashattn"], cwd=ab.REPO).returncode == 0:
        assert provenance.sources_sha256(dest / "flashattn") == provenance.sources_sha256(ab.REPO / "flashattn")
    assert ab.main(["HEAD", "--export", str(dest)]) == 2  # never writes over a folder
    monkeypatch.setattr(ab.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    s = grid.make_setting("float32", 16, False, 16, tokens=16, hidden=32)
    out = ab.run_ab(str(dest), [s], device="cpu", timer="wall", repeats=1, log=lambda x: None)
    assert out["base"]["commit"] == ab.resolve("HEAD")
    assert out["base"]["flashattn_file"] == str((dest / "flashattn").resolve())
    assert (dest / "flashattn" / "__init__.py").is_file()  # a given folder is left in place
    assert list((tmp_path / "tmp").iterdir()) == []
    if out["same_sources"]:
        assert out["rows"][0]["bitwise_equal"]


# -- the varlen benchmark (benchmarks.varlen): its CPU-side pieces ------------------------------------

def test_varlen_lengths_fill_the_pack_within_the_spread():
    from benchmarks import varlen

    for seed in range(4):
        lengths = varlen.draw_lengths(varlen.TOKENS, varlen.MIN_LEN, varlen.MAX_LEN, seed)
        assert sum(lengths) == varlen.TOKENS
        assert all(varlen.MIN_LEN <= n <= varlen.MAX_LEN for n in lengths[:-1]) and 1 <= lengths[-1] <= varlen.MAX_LEN
    assert varlen.draw_lengths(1000, 64, 8192, 0) == varlen.draw_lengths(1000, 64, 8192, 0)  # seeded


def test_varlen_flops_are_the_cost_model_summed_over_sequences():
    from benchmarks import varlen

    lengths = [100, 3, 50]
    assert varlen.pack_flops(lengths, 4, 64, False, "fwd") == 4 * 4 * 64 * (100 ** 2 + 9 + 2500)
    causal_pairs = sum(n * (n + 1) // 2 for n in lengths)
    assert varlen.pack_flops(lengths, 4, 64, True, "fwd_bwd") == 3.5 * 4 * 4 * 64 * causal_pairs


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_document_mask_is_the_reference_visibility(causal):
    """FlexAttention's mask_mod, evaluated on every (query, key) pair, is block diagonal by sequence
    and causal within each, exactly the pairs schedule.visible allows per sequence."""
    from benchmarks import varlen
    from flashattn import schedule

    lengths = [5, 1, 7]
    cu = [0, 5, 6, 13]
    doc = varlen.document_ids(lengths, "cpu")
    mask_mod = varlen.document_mask_mod(doc, torch.tensor(cu[:-1]), causal)
    i, j = torch.arange(13)[:, None], torch.arange(13)[None, :]
    got = mask_mod(0, 0, i, j)
    want = torch.zeros(13, 13, dtype=torch.bool)
    for s, n in enumerate(lengths):
        for a in range(n):
            for b in range(n):
                want[cu[s] + a, cu[s] + b] = schedule.is_visible(a, b, n, n, causal)
    assert torch.equal(got, want)


def test_varlen_padding_round_trips_and_providers_agree_on_the_cpu():
    """pad/unpad keep every real row; on the CPU (interpreter) the packed and the padded causal
    flashattn providers both pass the benchmark's own check."""
    from benchmarks import varlen

    lengths = [9, 20, 4]
    q, k, v = (torch.randn(33, 2, 16, dtype=torch.float16).requires_grad_() for _ in range(3))
    cu = [0, 9, 29, 33]
    assert torch.equal(varlen.unpad(varlen.pad(q.detach(), lengths, cu), lengths), q.detach())
    do = torch.randn(33, 2, 16, dtype=torch.float16)
    for name in ("flashattn", "flashattn_padded"):
        fn, checked, inputs = varlen.prepare(name, q, k, v, lengths, True)
        assert checked
        assert varlen.check(fn().detach(), q.detach(), k.detach(), v.detach(), lengths, True)["passed"], name
        for _ in range(2):  # the timer repeats forward + backward: the second must find its graph again
            assert all(g is not None for g in torch.autograd.grad(fn(), inputs, do))
    assert varlen.prepare("flashattn_padded", q, k, v, lengths, False)[1] is False  # padding keys: timing only
# -- the variants section (benchmarks.variants) on a CPU, with a fake timer ---------------------------------

def test_variants_section_runs_checks_and_reports_on_cpu():
    """Every row at a tiny shape: flashattn with and without the variant is checked against float64 and
    timed; providers without the variant are recorded as unsupported, never as a number."""
    from benchmarks import variants

    # the sink rows (grouped-query) have their own tests in test_benchmarks_variants_rows.py
    rows = [variants.ROWS[name].at(batch=1, heads=2, seqlen=48, head_dim=16) for name in variants.ROWS
            if not variants.ROWS[name].sinks]
    rows = [r.at(variant={**r.variant, "window": (20, 0)}) if r.kind == "window" else r for r in rows]
    out = variants.run(rows, ["flashattn", "flashattn_plain", "sdpa_flash"], "cpu", fake_timer,
                       log=lambda line: None, check_shape=dict(batch=1, heads=2, seqlen=40))
    by = {(r["row"], r["provider"]): r for r in out["rows"]}
    for row in rows:
        for provider in ("flashattn", "flashattn_plain"):
            rec = by[(row.name, provider)]
            assert rec["status"] == "ok", rec
            assert rec["check"]["passed"], rec["check"]
            assert rec["fwd"]["ms"] == FAKE_MS
    assert by[("window-16k", "sdpa_flash")]["status"] == "unsupported"
    assert by[("softcap-8k", "sdpa_flash")]["status"] == "unsupported"
    assert by[("dropout-8k", "sdpa_flash")]["check"]["status"] == "unchecked"
    # each call's TFLOP/s count the pairs it computes: the plain call of a window row attends causally
    window, plain = by[("window-16k", "flashattn")], by[("window-16k", "flashattn_plain")]
    causal_pairs, window_pairs = 48 * 49 // 2, 21 * 22 // 2 + (48 - 21) * 21
    assert plain["fwd"]["tflops"] / window["fwd"]["tflops"] == pytest.approx(causal_pairs / window_pairs)
    table = variants.markdown(out)
    assert "| window-16k |" in table and "unsupported" in table


def test_variants_visible_pairs_count_the_window():
    from benchmarks import variants

    def brute(n, left):
        return sum(1 for i in range(n) for j in range(n) if j <= i and (left is None or i - j <= left))

    for n, left in ((10, None), (10, 3), (7, 0), (5, 9)):
        row = variants.Row("x", 1, 1, n, variant={} if left is None else {"window": (left, 0)})
        assert variants.visible_pairs(row) == brute(n, left)


# -- which code a run measured -------------------------------------------------------------------------------
def _git_repo_with_package(tmp_path, text):
    repo = tmp_path / "repo"
    (repo / "flashattn" / "sub").mkdir(parents=True)
    (repo / "flashattn" / "__init__.py").write_text(text)
    (repo / "flashattn" / "sub" / "mod.py").write_text("x = 1\n")
    (repo / "flashattn" / "notes.txt").write_text("not python\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@localhost", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "init", "-q"], cwd=repo, check=True)
    subprocess.run([*git, "add", "-A"], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-qm", "one"], cwd=repo, check=True)
    return repo, git


def _head(repo) -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()


def test_sources_at_a_commit_hash_like_the_imported_package(tmp_path):
    """The hash of a commit's flashattn/ (git archive) equals the hash of the same files on disk, and a
    later commit with other sources is found by its hash while the first one is not mistaken for it."""
    repo, git = _git_repo_with_package(tmp_path, "a = 1\n")
    first = _head(repo)
    on_disk = provenance.sources_sha256(repo / "flashattn")
    assert provenance.sources_sha256_at(first, repo) == on_disk
    (repo / "flashattn" / "__init__.py").write_text("a = 2\n")
    changed = provenance.sources_sha256(repo / "flashattn")
    assert changed != on_disk and provenance.sources_sha256_at(first, repo) == on_disk  # the commit keeps its own
    subprocess.run([*git, "commit", "-qam", "two"], cwd=repo, check=True)
    second = _head(repo)
    assert provenance.commit_with_sources(changed, repo=repo) == second
    assert provenance.commit_with_sources(on_disk, repo=repo) == first
    assert provenance.commit_with_sources("0" * 64, repo=repo) is None
    assert provenance.sources_sha256_at("no-such-revision", repo) is None


def test_summary_names_a_commit_only_when_it_holds_the_measured_sources(monkeypatch):
    env = {"flashattn_sources_sha256": "ab" * 32, "git_commit": "c" * 40}
    assert report.code_identity({"git_commit": "c" * 40}) == ""  # schema 1: nothing to check the commit by
    assert f"git commit `{'c' * 12}`" in report.code_identity({**env, "git_commit_is_sources": True})
    monkeypatch.setattr(provenance, "commit_with_sources", lambda sha, **kw: "d" * 40)
    text = report.code_identity({**env, "git_commit_is_sources": False})
    assert f"commit `{'d' * 12}`" in text and "holds other sources" in text and "git commit `" not in text
    monkeypatch.setattr(provenance, "commit_with_sources", lambda sha, **kw: None)
    assert "held by no recent commit" in report.code_identity({**env, "git_commit_is_sources": False})
    monkeypatch.setattr(provenance, "sources_sha256_at", lambda commit, repo=None: None)
    assert "unchecked" in report.code_identity(env)  # older files: checked against the local history if it can be


def test_hostcost_refuses_the_interpreter_and_restores_the_package(monkeypatch):
    """The host-cost tool replaces the compiled-kernel launch; under the interpreter, which never takes
    that path, it must refuse, and whatever it patched must come back afterwards."""
    from benchmarks import hostcost
    from flashattn import api, decode, varlen
    from flashattn import launch as launch_mod

    before = (launch_mod._COMPILED, launch_mod._current_device, api.use_kernels, decode.use_kernels, varlen.use_kernels)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        with hostcost.launches_disabled():
            pass
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with hostcost.launches_disabled():
        assert launch_mod._COMPILED is not before[0] and api.use_kernels is not before[2]
    assert (launch_mod._COMPILED, launch_mod._current_device, api.use_kernels, decode.use_kernels,
            varlen.use_kernels) == before


@pytest.mark.parametrize("name, expected", [("flashattn_portable", dict(gluon=False, overlap_dq=True)),
                                            ("flashattn_one_stream", dict(gluon=True, overlap_dq=False))])
def test_ab_providers_run_flashattn_under_their_tuning_forward_and_backward(monkeypatch, name, expected):
    """The A/B providers call flashattn.attention with their tuning in force, and the backward runs
    under it too (the autograd function keeps the caller's tuning); outside the call the default holds."""
    from flashattn import _config, autograd

    seen = []
    original = autograd.backend

    def backend(*args, **kwargs):  # record the tuning in force where each pass runs
        forward, backward = original(*args, **kwargs)

        def fwd(*a, **kw):
            seen.append(("fwd", _config.current_tuning()))
            return forward(*a, **kw)

        def bwd(*a, **kw):
            seen.append(("bwd", _config.current_tuning()))
            return backward(*a, **kw)

        return fwd, bwd

    monkeypatch.setattr(autograd, "backend", backend)
    setting = grid.Setting("float64", 16, True, 32, 1, 2)
    fn = providers.PROVIDERS[name].prepare(setting, "cpu")
    q, k, v = (torch.randn(1, 2, 32, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    fn(q, k, v).sum().backward()
    assert [kind for kind, _ in seen] == ["fwd", "bwd"]
    for _, state in seen:
        assert {key: getattr(state, key) for key in expected} == expected
    assert _config.tuning_is_default()
    assert q.grad is not None and torch.isfinite(q.grad).all()


# -- the host's time per call beside each timing ----------------------------------------------------------

class TickClock:
    """A clock that moves only when told to (synthetic seconds)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_host_time_per_call_counts_the_calls_and_not_the_waits():
    clock, log = TickClock(), []

    def call():
        clock.now += 3e-6  # each call: 3 µs of host work
        log.append("call")

    def sync():
        clock.now += 1.0  # waiting for the device: never counted
        log.append("sync")

    got = measure.host_us_per_call(call, sync=sync, calls=5, clock=clock)
    assert got == pytest.approx(3.0)
    assert log == ["sync"] + ["call"] * 5 + ["sync"]


def test_host_time_per_call_clears_the_gradients_before_each_call():
    x = torch.zeros(2, requires_grad=True)
    seen = []

    def call():
        seen.append(x.grad)
        x.grad = torch.ones(2)

    measure.host_us_per_call(call, sync=lambda: None, grad_to_none=[x], calls=3)
    assert seen == [None, None, None]


def test_host_loop_lasts_about_ten_milliseconds_within_bounds():
    assert measure.host_calls(0.5) == 20 and measure.host_calls(1.0) == 10 and measure.host_calls(2.5) == 4
    assert measure.host_calls(0.01) == 20 and measure.host_calls(50.0) == 3


def test_loop_records_host_time_only_when_asked(tiny):
    syncs = []
    out = run.run_grid(tiny_grid()[:2], CPU_PROVIDERS[:2], device="cpu", timer=fake_timer,
                       peak_memory=lambda fn, inputs: 4096, log=lambda s: None, host_sync=lambda: syncs.append(1))
    ok = [m for m in out["measurements"] if m["status"] == "ok"]
    assert len(ok) == 2 * 2 * 2 and all(m["host_us"] > 0 for m in ok)
    assert len(syncs) == 2 * len(ok)  # one wait before and one after each timing's loop of calls
    assert all("host_us" not in m for m in tiny["measurements"])  # the fixture's run did not ask


def test_summary_lists_the_timings_the_host_may_bound(tmp_path):
    res = hand_made_results()
    res["config"]["host"] = "host_us: synthetic (test)"
    ok = [m for m in res["measurements"] if m["status"] == "ok"]
    for m in ok:
        m["host_us"] = 100.0  # against 1000 µs of GPU per call: far from bound
    near = ok[3]
    near["host_us"] = 600.0  # 60% of its 1000 µs: listed
    results.validate(res)
    assert report.host_bound(res) == [near]
    summary = report.summary_markdown(res)
    assert "### Calls the host may bound" in summary and f"(1 of {len(ok)} timings)" in summary
    assert f"| {near['provider']} | float32 | {near['head_dim']} |" in summary and "| 1000 | 600 |" in summary
    for m in ok:
        m.pop("host_us")
    assert "Calls the host may bound" not in report.summary_markdown(res)  # a run that did not record it
    near["host_us"] = 0.0
    with pytest.raises(ValueError, match="host_us"):
        results.validate(res)


def test_gqa_probe_reads_only_a_missing_kernel_as_no_gqa(monkeypatch):
    """The SDPA providers probe enable_gqa with a tiny call: "no available kernel" (a RuntimeError) means
    K/V are repeated instead, but running out of memory, also a RuntimeError, is raised, not read as that."""
    import torch.nn.functional as F

    sdpa = providers.PROVIDERS["sdpa_flash"]
    setting = grid.make_setting("float32", 32, True, 64, tokens=64, heads=4, kv_heads=1)

    def fails_with(error):
        def call(*args, **kwargs):
            raise error
        return call

    monkeypatch.setattr(F, "scaled_dot_product_attention", fails_with(RuntimeError("No available kernel")))
    assert sdpa._accepts_gqa(setting, "cpu") is False
    monkeypatch.setattr(F, "scaled_dot_product_attention", fails_with(torch.cuda.OutOfMemoryError("CUDA out of memory")))
    with pytest.raises(torch.cuda.OutOfMemoryError):
        sdpa._accepts_gqa(setting, "cpu")


def test_the_benchmark_modules_import_without_cycles():
    """No benchmark module reaches itself through its imports (those inside functions included): the
    harness reads one way, like the package (measure -> providers, run -> report -> provenance)."""
    import ast

    folder = pathlib.Path(grid.__file__).parent
    modules = {path.stem: path for path in folder.glob("*.py")}
    edges = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "benchmarks":
                parts = node.module.split(".")
                found.update(parts[1:2] if len(parts) > 1 else (a.name for a in node.names))
        edges[name] = found & set(modules) - {name}

    def reaches(start, goal, seen):
        return any(nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})) for nxt in edges[start])

    cycles = sorted((a, b) for a in edges for b in edges[a] if reaches(b, a, {b}))
    assert not cycles, f"import cycles through: {cycles}"
    assert "providers" in edges["measure"] or "provenance" in edges["report"]  # the reader sees lazy imports
