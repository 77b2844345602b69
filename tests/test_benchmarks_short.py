"""The short training shapes section and the first-call benchmark, on a CPU.

Every number here is synthetic (hand-written records, a fake clock, or tiny CPU shapes timed on this
machine and thrown away): these tests check the code paths, never a performance claim, and nothing
is written under ``benchmarks/results/``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from benchmarks import first_call, latency, providers, short

ROOT = pathlib.Path(__file__).resolve().parents[1]
HOOKS = ROOT / "docs" / "hooks"


# -- the shapes ---------------------------------------------------------------------------------------------

def test_shapes_cover_the_section_and_the_issue():
    shapes = short.make_shapes()
    assert len(shapes) == len(short.SHAPES) == 24  # the count the README and the page give
    assert {s.seqlen for s in shapes} == {64, 128, 197, 256, 257, 512, 1024}
    assert {s.head_dim for s in shapes} == {64, 128}
    assert {s.dtype for s in shapes} == {"float16", "bfloat16"} and {s.causal for s in shapes} == {False, True}
    bh = [s.batch * s.heads for s in shapes]
    assert min(bh) == 16 and max(bh) == 512
    assert len(set(shapes)) == len(shapes) and all(s.kv_heads is None for s in shapes)
    # the four slow shapes of issue 45, exactly
    issue = [(32, 16, 257, 64, "bfloat16", False), (32, 12, 128, 64, "float16", False),
             (8, 16, 256, 128, "bfloat16", True), (1, 16, 1024, 128, "bfloat16", True)]
    assert list(short.ISSUE_SHAPES) == issue
    have = {(s.batch, s.heads, s.seqlen, s.head_dim, s.dtype, s.causal) for s in shapes}
    assert set(issue) <= have


def test_dtypes_option_runs_every_shape_in_each_dtype():
    both = short.make_shapes(["float16", "bfloat16"])
    assert len(both) == 2 * len(short.SHAPES)
    assert {s.dtype for s in short.make_shapes(["bfloat16"])} == {"bfloat16"}


# -- ratios and the table -----------------------------------------------------------------------------------

def _rec(provider, p, us, *, status="ok", **shape):
    base = {"dtype": "bfloat16", "head_dim": 64, "causal": False, "seqlen": 257, "batch": 32, "heads": 16,
            "kv_heads": None, "mode": "eager"}
    base.update(shape)
    rec = {**base, "provider": provider, "pass": p, "status": status}
    if status == "ok":
        rec.update(us_per_call=us, host_us_per_call=us / 2)
    else:
        rec["error"] = "No available kernel"
    return rec


def _synthetic_records():
    other = {"seqlen": 1024, "batch": 1, "head_dim": 128, "causal": True}
    return [
        _rec("flashattn", "fwd", 100.0), _rec("sdpa_flash", "fwd", 120.0), _rec("sdpa_cudnn", "fwd", 80.0),
        _rec("sdpa_efficient", "fwd", 90.0), _rec("flex", "fwd", 300.0),
        _rec("flashattn", "fwd_bwd", 600.0), _rec("sdpa_flash", "fwd_bwd", 400.0),
        _rec("sdpa_cudnn", "fwd_bwd", 1.0, status="unsupported"), _rec("sdpa_efficient", "fwd_bwd", 330.0),
        _rec("flex", "fwd_bwd", 900.0),
        _rec("flashattn", "fwd", 50.0, **other), _rec("sdpa_math", "fwd", 200.0, **other),
        _rec("flashattn", "fwd_bwd", 1.0, status="error", **other), _rec("sdpa_flash", "fwd_bwd", 170.0, **other),
    ]


def test_ratio_is_the_fastest_sdpa_backend_over_flashattn():
    rows = {(r["seqlen"], r["pass"]): r for r in short.ratios(_synthetic_records())}
    assert len(rows) == 4
    fwd = rows[257, "fwd"]
    assert fwd["best_sdpa"] == "sdpa_cudnn" and fwd["best_sdpa_us"] == 80.0 and fwd["flex_us"] == 300.0
    assert fwd["ratio"] == pytest.approx(0.8)  # flex is never the "best SDPA backend"
    bwd = rows[257, "fwd_bwd"]  # a backend that did not run is not the fastest
    assert bwd["best_sdpa"] == "sdpa_efficient" and bwd["ratio"] == pytest.approx(330 / 600)
    assert rows[1024, "fwd"]["best_sdpa"] == "sdpa_math" and rows[1024, "fwd"]["ratio"] == pytest.approx(4.0)
    assert rows[1024, "fwd_bwd"]["ratio"] is None and rows[1024, "fwd_bwd"]["flashattn_us"] is None


def _synthetic_result(records):
    return {"what": "short training shapes", "device": "a GPU", "versions": {"torch": "2.x", "triton": "3.x"},
            "config": {}, "rows": records}


def test_table_has_a_row_per_shape_with_both_passes():
    table = short.markdown(_synthetic_result(_synthetic_records()))
    rows = [line for line in table.splitlines() if line.startswith("| B")]
    assert len(rows) == 2
    assert rows[0].startswith("| B32 H16 N257 D64 bf16 | none | 100 | 80 (cudnn) | 0.80× | 300 | 600 | "
                              "330 (efficient) | 0.55× | 900 |")
    assert "| B1 H16 N1024 D128 bf16 | causal | 50 | 200 (math) | 4.00× |" in rows[1]
    assert rows[1].endswith("| – | 170 (flash) | – | – |")
    assert "2 measurement(s) did not run" in table and "sdpa_cudnn fwd_bwd" in table


def test_section_runs_on_cpu_with_the_latency_timer(monkeypatch):
    """The whole loop on tiny CPU shapes (numbers thrown away): every provider, both passes, eager."""
    from benchmarks.grid import Setting

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "CPU stand-in")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the reference path: fast
    shapes = [Setting("float32", 16, c, 16, batch=1, heads=2) for c in (False, True)]
    provs = short.get_providers(["flashattn", "sdpa_math"])
    result = short.run("cpu", shapes, provs, budget_s=0,
                       timer=latency.WallClock(target_ms=0.5, repeats=2, warmup_calls=1), log=lambda s: None)
    assert len(result["rows"]) == 2 * 2 * 2 and all(r["status"] == "ok" for r in result["rows"])
    assert {r["mode"] for r in result["rows"]} == {"eager"}
    assert result["config"]["issue_shapes"] == [list(s) for s in short.ISSUE_SHAPES]
    assert len(result["versions"]["flashattn_sources_sha256"]) == 64
    assert all(r["ratio"] > 0 for r in short.ratios(result["rows"]))
    assert short.markdown(result).count("| B1 H2 N16 D16 float32 |") == 2


def test_budget_records_the_rest_as_skipped(monkeypatch):
    from benchmarks import run as run_mod
    from benchmarks.grid import Setting

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "CPU stand-in")
    monkeypatch.setattr(run_mod.Clock, "over", lambda self: True)
    result = short.run("cpu", [Setting("float32", 16, False, 16, batch=1, heads=2)],
                       short.get_providers(["flashattn"]), budget_s=1, log=lambda s: None)
    assert [r["status"] for r in result["rows"]] == ["skipped", "skipped"]
    assert "time budget" in result["rows"][0]["error"]


def test_short_refuses_without_cuda_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert short.main(["--out", str(tmp_path / "out")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv", [["--providers", "flashattn,nope"], ["--dtypes", "float32"]])
def test_short_rejects_bad_options(argv):
    with pytest.raises(SystemExit):
        short.main(argv)


def test_math_backend_is_a_provider_but_not_run_by_default():
    assert isinstance(short.PROVIDERS["sdpa_math"], providers.SDPA)
    assert "sdpa_math" not in short.DEFAULT_PROVIDERS
    assert {"sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "flex", "flashattn"} == set(short.DEFAULT_PROVIDERS)


# -- first call ---------------------------------------------------------------------------------------------

TINY = {"name": "tiny", "dtype": "float16", "head_dim": 16, "causal": True, "batch": 1, "heads": 2, "seqlen": 16,
        "options": {"window": [4, 0]}}


class FakeClock:
    """Each reading is one second after the last: every timed step then reads 1 s."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        self.t += 1.0
        return self.t


@pytest.mark.parametrize("warmup", [False, True])
def test_child_times_each_step_after_the_process_costs(monkeypatch, warmup):
    import flashattn

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    calls = []
    real_attention, real_warmup = flashattn.attention, flashattn.warmup
    monkeypatch.setattr(flashattn, "attention", lambda *a, **kw: calls.append(("attention", kw)) or
                        real_attention(*a, **kw))
    monkeypatch.setattr(flashattn, "warmup", lambda shapes, **kw: calls.append(("warmup", shapes, kw)) or
                        real_warmup(shapes, **kw))
    out = first_call.child(TINY, device="cpu", warmup=warmup, clock=FakeClock())
    steps = ["import_s", "cuda_init_s", "unrelated_call_s", *(["warmup_s"] * warmup), "first_fwd_s", "first_bwd_s",
             "second_fwd_bwd_s"]
    assert all(out[k] == 1.0 for k in steps) and out["first_fwd_bwd_s"] == 2.0
    assert calls[0] == ("attention", {})  # the unrelated configuration comes first
    if warmup:
        assert calls[1] == ("warmup", [(1, 2, 2, 16, 16, 16)],
                            {"dtype": torch.float16, "device": "cpu", "causal": True, "window": (4, 0)})
    timed = [c for c in calls[1:] if c[0] == "attention"]
    assert timed[-2:] == [("attention", {"causal": True, "window": (4, 0)})] * 2
    assert "first_fwd_s" not in first_call.child(None, device="cpu", clock=FakeClock())


def test_child_process_reports_one_line_of_json(tmp_path):
    """The real child command on a CPU (the reference path), as the parent parses it."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.first_call", "--child", json.dumps(TINY),
                           "--device", "cpu"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line, = [x for x in proc.stdout.splitlines() if x.startswith(first_call.MARKER)]
    out = json.loads(line[len(first_call.MARKER):])
    assert out["first_fwd_bwd_s"] == pytest.approx(out["first_fwd_s"] + out["first_bwd_s"])
    assert all(v >= 0 for v in out.values())


def test_cold_and_warm_children_share_one_fresh_cache():
    seen = []

    def fake_spawn(cfg, cache_dir, warmup, background=True):
        cache_dir = pathlib.Path(cache_dir)
        seen.append((None if cfg is None else cfg["name"], cache_dir, warmup, sorted(os.listdir(cache_dir)),
                     background))
        (cache_dir / f"compiled-{len(seen)}").write_text("kernel")
        return {"first_fwd_s": 3.0 if len(os.listdir(cache_dir)) == 2 else 0.01}

    cfgs = [dict(TINY, name="a"), dict(TINY, name="b")]
    out = first_call.measure(cfgs, modes=("plain", "warmup", "foreground"), spawn_fn=fake_spawn, log=lambda s: None)
    prime, *children = seen
    assert prime[0] is None and prime[3] == []  # the prime child starts from an empty cache
    assert len(children) == 12 and [c[0] for c in children] == ["a", "a", "b", "b"] * 3
    assert [c[4] for c in children] == [True] * 8 + [False] * 4  # foreground: background compiles off
    children = children[:8]
    for cold, warm in zip(children[::2], children[1::2]):
        assert cold[1] == warm[1] != prime[1] and cold[2] == warm[2]
        assert cold[3] == ["compiled-1"]  # only what the prime child left
        assert len(warm[3]) == 2  # and what the cold child compiled
    assert [c[2] for c in children] == [False] * 4 + [True] * 4
    assert [(r["mode"], r["name"]) for r in out["rows"]] == [("plain", "a"), ("plain", "b"), ("warmup", "a"),
                                                             ("warmup", "b"), ("foreground", "a"),
                                                             ("foreground", "b")]
    assert all(r["cold"]["first_fwd_s"] == 3.0 and r["warm"]["first_fwd_s"] == 0.01 for r in out["rows"])
    assert not prime[1].parent.exists()  # the temporary caches are removed


def test_first_call_table():
    ok = {"import_s": 2.0, "cuda_init_s": 0.3, "unrelated_call_s": 0.2, "first_fwd_s": 1.5, "first_bwd_s": 2.5,
          "first_fwd_bwd_s": 4.0, "second_fwd_bwd_s": 0.0004}
    result = {"what": "first call", "device": "a GPU", "versions": {"torch": "2.x", "triton": "3.x"},
              "prime": dict(ok, unrelated_call_s=1.25),
              "rows": [dict(TINY, mode="plain", cold=ok, warm=dict(ok, first_fwd_bwd_s=0.02)),
                       dict(TINY, mode="warmup", cold={"error": "exit 1: boom"}, warm=dict(ok, warmup_s=0.5))]}
    table = first_call.markdown(result)
    assert "compiled) 1.25." in table
    assert "| tiny (B1 H2 N16) | plain | – | 1.50 | 4.00 | – | 1.50 | 20.0 ms | 0.4 ms | 2.50 |" in table
    assert "| tiny (B1 H2 N16) | warmup | error | error | error | 0.50 |" in table


def test_first_call_refuses_without_cuda_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert first_call.main(["--out", str(tmp_path / "out"), "--warmup"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_configs_cover_dtypes_head_dims_masks_and_variants():
    cfgs = first_call.CONFIGS
    assert {c["dtype"] for c in cfgs} == {"float16", "bfloat16"} and {c["head_dim"] for c in cfgs} == {64, 128}
    assert {c["causal"] for c in cfgs} == {False, True}
    assert {k for c in cfgs for k in c["options"]} == {"window", "softcap"}
    assert all(c["head_dim"] != first_call.UNRELATED["head_dim"] for c in cfgs)


# -- the site -----------------------------------------------------------------------------------------------

def _load(name, path, monkeypatch):
    monkeypatch.syspath_prepend(str(HOOKS))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_figure_of_a_synthetic_run(monkeypatch):
    figures = _load("flashattn_figures_short", HOOKS / "figures.py", monkeypatch)
    svg = figures.short_training(_synthetic_result(_synthetic_records()))
    assert svg.startswith("<?xml") and "flashattn-figure: smallest-font-pt=" in svg
    assert svg != figures.short_training(_synthetic_result(_synthetic_records()[:5]))


def test_figure_is_listed_only_once_a_run_is_committed(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHATTN_BENCH_RESULTS", str(tmp_path))
    assert "short-training" not in _load("flashattn_figures_a", HOOKS / "figures.py", monkeypatch).FIGURES
    (tmp_path / "short").mkdir()
    (tmp_path / "short" / "short.json").write_text(json.dumps(_synthetic_result(_synthetic_records())))
    figures = _load("flashattn_figures_b", HOOKS / "figures.py", monkeypatch)
    assert "<svg" in figures.FIGURES["short-training"]()


def test_page_parts_say_plainly_when_no_run_is_committed_and_show_it_once_there(tmp_path, monkeypatch):
    hooks = _load("flashattn_site_hooks_short", HOOKS / "site_hooks.py", monkeypatch)
    monkeypatch.setattr(hooks, "RESULTS", tmp_path)
    for part in ("short", "first-call", "decoding"):
        assert "No run committed yet" in hooks._benchmarks(part)
    (tmp_path / "short").mkdir()
    records = _synthetic_records() + [_rec("flex", "fwd", 1.0, status="skipped", seqlen=64)]
    (tmp_path / "short" / "short.json").write_text(json.dumps(_synthetic_result(records)))
    page = hooks._benchmarks("short")
    assert "No run committed yet" not in page
    assert page.index("](figures/short-training.svg)") < page.index("| B32 H16 N257 D64 bf16 | none |")
    assert "1 measurement(s) were skipped" in page
    first = {"what": "first call", "device": "a GPU", "versions": {"torch": "2", "triton": "3"},
             "prime": {"import_s": 1.0}, "rows": []}
    (tmp_path / "short" / "first_call.json").write_text(json.dumps(first))
    assert "| configuration | mode |" in hooks._benchmarks("first-call")
    (tmp_path / "core").mkdir()
    row = {"B": 1, "M": 4096, "Nq": 1, "check": {"passed": True}, "status": "ok", "gqa": "packed", "layout": "view"}
    for name, us in (("dense_decode_a.json", 30.0), ("dense_decode_a_88.json", 40.0), ("dense_decode_b.json", 20.0),
                     ("dense_decode_b_88.json", 32.0)):
        rows = [dict(row, provider="flashattn_dense", graph={"us": us, "copy_fraction": 0.2}),
                dict(row, provider="sdpa_cudnn", graph={"us": 16.0})]
        decode_run = {"what": "decoding", "device": "a GPU", "versions": {"torch": "2", "triton": "3"},
                      "copy_bandwidth_gbps": 4000.0, "modes": ["graph"], "rows": rows}
        (tmp_path / "core" / name).write_text(json.dumps(decode_run))
    page = hooks._benchmarks("decoding")
    assert "| 1 | 4096 | 1 | 20 | 16 | 0.80x | 20% |" in page and "dense_decode_b.json" in page  # the last run
    assert "| 1 | 4096 | 1 | 32 | 16 | 0.50x | 20% |" in page and "dense_decode_b_88.json" in page  # and its companion
    assert page.index("dense_decode_b.json") < page.index("dense_decode_b_88.json")
    assert "dense_decode_a" not in page and "| 30 |" not in page and "| 40 |" not in page
    with pytest.raises(ValueError, match="unknown benchmarks part"):
        hooks._benchmarks("nope")


# -- the host floor ------------------------------------------------------------------------------------------

def test_host_floor_functions_allocate_what_they_stand_for_and_the_table_lists_every_pass(monkeypatch, capsys):
    """The floor functions return an output and three gradients of the inputs' shapes (the kernel variant
    writes a zero into each, so it launched something); the loops take turns under the latency section's
    timer; the table has one line per shape and pass; without a GPU the command writes nothing and says why."""
    from benchmarks import host_floor

    q, k, v = (torch.randn(2, 3, 5, 8, requires_grad=True) for _ in range(3))
    for function in (host_floor.Floor, host_floor.FloorKernels):
        o = function.apply(q, k, v)
        grads = torch.autograd.grad(o, (q, k, v), torch.ones_like(o))
        assert o.shape == q.shape and [g.shape for g in grads] == [q.shape, k.shape, v.shape]
        if function is host_floor.FloorKernels:
            assert all(g[0, 0, 0, 0] == 0 for g in grads)
    order = []
    timer = latency.WallClock(target_ms=0.01, repeats=3, warmup_calls=1)
    timed = host_floor._turns({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, timer,
                              sync=lambda: None)
    assert set(timed) == {"a", "b"} and all(t["repeats"] == 3 and t["us_per_call"] > 0 for t in timed.values())
    # after each one's calibration (warm-up and three calls), the timed loops alternate a, b, a, b, a, b,
    # each as long as its own calibration asked
    assert order[2 * 4:] == (["a"] * timed["a"]["calls"] + ["b"] * timed["b"]["calls"]) * 3
    times = {c: {"host_us_per_call": 1.0, "us_per_call": float(i + 1)} for i, c in enumerate(host_floor.COLUMNS)}
    row = {"B": 8, "H": 16, "N": 128, "D": 128, "dtype": "bfloat16", "causal": True,
           "fwd": times, "fwd_bwd_threads": times, "fwd_bwd_one_thread": times}
    result = {"what": "w", "device": "d", "versions": {"torch": "t", "triton": "tr"}, "timer": timer.describe(),
              "rows": [row, row]}
    table = host_floor.markdown(result)
    assert table.count("| B8 H16 N128 D128 bfloat16 causal |") == 6
    assert "| 1.0 | 2.0 | 3.0 | 4.0 | 5.0 |" in table and "median of 3 loops" in table
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert host_floor.main(["--out", "unused"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
