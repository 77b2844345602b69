"""The derivations package: every check passes, every negative control is rejected, the runner's exit
status and JSON say so, a formula broken on purpose is caught, and the errata point at real checks."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import derivations
from derivations import MODULES
from derivations.__main__ import main
from derivations.cost_model import attention_flops
from derivations.errata import ERRATA

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def runner(tmp_path_factory):
    """One real run of ``python -m derivations --json PATH``, shared by the tests below."""
    out = tmp_path_factory.mktemp("derivations") / "checks.json"
    proc = subprocess.run([sys.executable, "-m", "derivations", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    return proc, json.loads(out.read_text(encoding="utf-8"))


def test_runner_exit_status_and_table(runner):
    proc, payload = runner
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert payload["all_passed"] is True
    for row in payload["rows"]:
        assert row["identity"] in proc.stdout
    n = len(MODULES)
    assert f"{n}/{n} identities pass, {n}/{n} negative controls rejected" in proc.stdout


@pytest.mark.parametrize("name", MODULES)
def test_check_passes_and_rejects_its_negative_control(runner, name):
    _, payload = runner
    (row,) = [r for r in payload["rows"] if r["module"] == f"derivations.{name}"]
    assert row["passed"] and row["result"] == "pass", "\n".join(row["details"])
    assert row["negative_control_rejected"], "\n".join(row["details"])
    assert any(line.startswith("rejected") for line in row["details"])
    assert row["method"] and row["sizes"] and row["negative_control"]


def test_json_rows_cover_every_module_in_order(runner):
    _, payload = runner
    assert [r["module"] for r in payload["rows"]] == [f"derivations.{m}" for m in MODULES]
    assert set(payload["rows"][0]) >= {"identity", "method", "sizes", "result", "negative_control_rejected"}


def test_json_to_stdout(capsys):
    assert main(["--only", "cost_model", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["all_passed"] and payload["rows"][0]["module"] == "derivations.cost_model"


# ---------------------------------------------------------------- formulas broken on purpose

def _fails(name: str) -> bool:
    result = importlib.import_module(f"derivations.{name}").check()
    return not result.passed


def test_broken_softmax_backward_is_caught(monkeypatch):
    from derivations import _common, softmax_backward as mod

    # Drop the normaliser term: the classic wrong softmax backward.
    monkeypatch.setattr(mod, "softmax_grad",
                        lambda P, dP: _common.hadamard(P, dP) if hasattr(P, "multiply_elementwise")
                        else _common.mp_hadamard(P, dP))
    assert _fails("softmax_backward")


def test_broken_matmul_backward_is_caught(monkeypatch):
    from derivations import matmul_backward as mod

    monkeypatch.setattr(mod, "grad_y", lambda dO, X, Y: -(X.T * dO))  # sign flipped
    assert _fails("matmul_backward")


def test_broken_d_identity_is_caught(monkeypatch):
    from derivations import _common, d_identity as mod

    monkeypatch.setattr(mod, "delta", lambda dO, O: _common.rowsum(O))
    assert _fails("d_identity")


def test_broken_online_softmax_is_caught(monkeypatch):
    from derivations import online_softmax as mod

    def no_rescale(state, scores, values, pivot, exp):
        m, l, acc = state
        weights = [exp(s - pivot) for s in scores]
        return pivot, l + sum(weights), [a + sum(w * v[c] for w, v in zip(weights, values))
                                         for c, a in enumerate(acc)]

    monkeypatch.setattr(mod, "online_step", no_rescale)
    assert _fails("online_softmax")


def test_broken_cost_model_is_caught(monkeypatch):
    from derivations import cost_model as mod

    dkdv, dq = mod.BACKWARD_TWO_KERNELS
    monkeypatch.setattr(mod, "BACKWARD_TWO_KERNELS",
                        (dkdv, mod.Kernel(dq.name, dq.loads, tuple(s for s in dq.body if s.out != "dP"),
                                          dq.outputs)))
    assert _fails("cost_model")


def test_broken_dropout_is_caught(monkeypatch):
    from derivations import dropout as mod

    real = mod.dropout_backward
    monkeypatch.setattr(mod, "dropout_backward",
                        lambda P, Z, keep, V, dO, O: {**real(P, Z, keep, V, dO, O), "dV": P.T * dO})
    assert _fails("dropout")


def test_broken_masking_fix_is_caught(monkeypatch):
    from derivations import masking_hazards as mod

    monkeypatch.setattr(mod, "PAD_SCORE_FIX", 0)  # pad keys with 0 instead of −∞
    assert _fails("masking_hazards")


def test_broken_causal_closed_form_is_caught(monkeypatch):
    from derivations import causal_masking as mod

    monkeypatch.setattr(mod, "visible_pairs", lambda n, m: n * (n + 1) // 2)  # top-left count
    assert _fails("causal_masking")


def test_runner_exits_nonzero_on_a_failed_check(monkeypatch):
    from derivations import _common, d_identity as mod

    monkeypatch.setattr(mod, "delta", lambda dO, O: _common.rowsum(O))
    assert main(["--only", "d_identity"]) == 1


def test_runner_exits_nonzero_on_an_accepted_negative_control(monkeypatch):
    from derivations import cost_model as mod
    from derivations._result import CheckResult

    real = mod.check

    def control_accepted():
        result = real()
        return CheckResult(**{**result.to_dict(), "negative_control_rejected": False})

    monkeypatch.setattr(mod, "check", control_accepted)
    assert main(["--only", "cost_model"]) == 1


def test_runner_exits_nonzero_when_a_check_raises(monkeypatch):
    from derivations import cost_model as mod

    monkeypatch.setattr(mod, "check", lambda: 1 / 0)
    assert main(["--only", "cost_model"]) == 1


# ---------------------------------------------------------------- the FLOP formula of the benchmarks

def _visible_brute(n, m):
    return sum(1 for i in range(n) for j in range(m) if j <= i + m - n)


@pytest.mark.parametrize("n,m", [(1, 1), (7, 7), (5, 12), (12, 5), (64, 64), (1, 100), (100, 1), (33, 65)])
def test_attention_flops_counts_visible_pairs_exactly(n, m):
    batch, heads, d = 2, 3, 16
    full = attention_flops(batch, heads, n, m, d, causal=False, mode="fwd")
    causal = attention_flops(batch, heads, n, m, d, causal=True, mode="fwd")
    assert full == 4 * batch * heads * n * m * d
    assert causal == 4 * batch * heads * d * _visible_brute(n, m)
    assert isinstance(causal, float)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_flops_modes(causal):
    fwd = attention_flops(4, 8, 1024, 2048, 128, causal=causal, mode="fwd")
    assert attention_flops(4, 8, 1024, 2048, 128, causal=causal, mode="bwd") == 2.5 * fwd
    assert attention_flops(4, 8, 1024, 2048, 128, causal=causal, mode="fwd_bwd") == 3.5 * fwd


def test_attention_flops_known_value():
    # H200 setting of the benchmark page: batch·N = 16k tokens, 2048 hidden = 16 heads of 128.
    assert attention_flops(1, 16, 16384, 16384, 128, causal=False, mode="fwd") == 4 * 16 * 16384**2 * 128
    assert attention_flops(1, 1, 4, 4, 1, causal=True, mode="fwd") == 40.0  # 10 visible pairs


@pytest.mark.parametrize("kwargs", [dict(mode="forward"), dict(mode="bwd", n=0), dict(mode="fwd", d=-1),
                                    dict(mode="fwd", batch=1.5)])
def test_attention_flops_rejects_bad_input(kwargs):
    args = dict(batch=1, heads=1, n=8, m=8, d=16)
    args.update({k: v for k, v in kwargs.items() if k != "mode"})
    with pytest.raises(ValueError):
        attention_flops(**args, causal=False, mode=kwargs["mode"])


# ---------------------------------------------------------------- section markers and errata

MARKER = re.compile(r"^\s*# --8<-- \[(start|end):([\w-]+)\]\s*$")


@pytest.mark.parametrize("name", MODULES)
def test_section_markers_are_balanced(name):
    text = (ROOT / "derivations" / f"{name}.py").read_text(encoding="utf-8")
    open_sections, seen = [], set()
    for line in text.splitlines():
        match = MARKER.match(line)
        if not match:
            assert "--8<--" not in line, f"malformed marker: {line!r}"
            continue
        kind, section = match.groups()
        if kind == "start":
            assert section not in seen, f"section {section} started twice"
            open_sections.append(section)
            seen.add(section)
        else:
            assert open_sections and open_sections[-1] == section, f"end:{section} does not close a start"
            open_sections.pop()
    assert not open_sections, f"unclosed sections {open_sections}"
    assert {"statement", "proof", "numeric", "negative"} <= seen


@pytest.mark.parametrize("name", MODULES)
def test_statement_is_the_module_docstring(name):
    module = importlib.import_module(f"derivations.{name}")
    assert module.__doc__ and len(module.__doc__.split()) > 20
    assert callable(module.check)


@pytest.mark.parametrize("erratum", ERRATA, ids=lambda e: e.check + ":" + e.evidence[:30])
def test_erratum_points_at_a_check_that_shows_it(runner, erratum):
    _, payload = runner
    module_name, function = erratum.check.split(":")
    assert callable(getattr(importlib.import_module(module_name), function))
    (row,) = [r for r in payload["rows"] if r["module"] == module_name]
    prefix = "rejected  control: " if erratum.verdict == "rejected" else "ok        "
    assert prefix + erratum.evidence in row["details"], row["details"]
    assert erratum.claim and erratum.correction


def test_package_lists_every_identity_of_the_site():
    """SPEC's ten identities plus the LSE gradient, the I/O count and the precision measurement."""
    assert set(derivations.MODULES) >= {
        "matmul_backward", "softmax_backward", "d_identity", "online_softmax", "base2_lse", "softmax_scale",
        "masking_hazards", "causal_masking", "cost_model", "dropout",
        "lse_gradient", "io_complexity", "backward_precision"}


def test_cost_model_reads_the_kernel_source(monkeypatch):
    """A kernel source with one tl.dot fewer in the dQ loop must fail the check (the count is not typed in)."""
    from derivations import cost_model as mod

    real = mod.kernel_products

    def fewer(sources=None):
        counts = real(sources)
        return {**counts, "dQ": counts["dQ"][:-1]}

    monkeypatch.setattr(mod, "kernel_products", fewer)
    assert _fails("cost_model")


def test_broken_lse_gradient_is_caught(monkeypatch):
    from derivations import lse_gradient as mod
    from derivations._common import broadcast_rows, hadamard

    monkeypatch.setattr(mod, "ds_with_lse", lambda P, dP, delta, dlse: hadamard(P, dP - broadcast_rows(delta, P.cols)))
    assert _fails("lse_gradient")


def test_masked_load_checker_sees_a_missing_other():
    from derivations.masking_hazards import masked_loads_without_other

    assert masked_loads_without_other("x = tl.load(p, mask=m)\ny = tl.load(p, mask=m, other=0.0)\n") == [
        "tl.load(p, mask=m)"]


def test_broken_io_closed_form_is_caught(monkeypatch):
    from derivations import io_complexity as mod

    monkeypatch.setattr(mod, "forward_closed", lambda n, m, d, block_m: 2 * n * d + n + 2 * m * d)
    assert _fails("io_complexity")


def _interpreter_grads(q, k, v, do):
    """O, dQ, dK, dV of the real kernels under Triton's interpreter, for one (N, d) head."""
    import flashattn

    q, k, v = (x.clone()[None, None].requires_grad_() for x in (q, k, v))
    o = flashattn.attention(q, k, v)
    o.backward(do[None, None])
    return dict(O=o.detach()[0, 0], dQ=q.grad[0, 0], dK=k.grad[0, 0], dV=v.grad[0, 0])


def test_backward_precision_emulation_matches_the_interpreter_kernels():
    """The backward-precision page's numbers come from an emulation of the kernels' rounding points.
    Run the real kernels under the interpreter on a small head and require the same errors against
    float64: in float16 the interpreter keeps every rounding (P, dS, O), so it must agree with the full
    emulation and not with one that keeps P and dS in float32 (the negative control, about 1.4× less
    error). A bfloat16 problem runs in float32 under the interpreter (flashattn.tensors.
    interpreter_needs_float32), so there it must agree with the emulation without those two roundings."""
    import torch

    from derivations import backward_precision as bp
    from flashattn.autograd import use_kernels

    if not use_kernels(torch.zeros(1, dtype=torch.float16)):
        pytest.skip("the kernels run on CPU tensors only under TRITON_INTERPRET=1")

    def errors(got, ref):
        return {k: bp.rel_error(got[k], ref[k]) for k in bp.NAMES}

    def agree(a, b):
        return all(0.8 < a[k] / b[k] < 1.25 for k in bp.NAMES)

    for dtype, full_rounding in ((torch.float16, True), (torch.bfloat16, False)):
        x = bp.inputs(dtype, n=64, m=64, d=32)
        ref = bp.exact(*x)
        kernels = errors(_interpreter_grads(*x), ref)
        full = errors(bp.kernel_like(*x), ref)
        no_p_ds = errors(bp.kernel_like(*x, round_p=False, round_ds=False), ref)
        if full_rounding:
            assert agree(kernels, full), (kernels, full)
            assert not agree(kernels, no_p_ds), (kernels, no_p_ds)  # the control: rounding P and dS shows
        else:
            assert agree(kernels, no_p_ds), (kernels, no_p_ds)
            assert not agree(kernels, full), (kernels, full)

# ---------------------------------------------------------------- the variants: formulas broken on purpose

def test_broken_softcap_is_caught(monkeypatch):
    from derivations import softcap as mod

    real = mod.softcap_backward

    def derivative_at_capped_score(S, c, P, dP, delta, tanh=mod.sp.tanh):
        capped = S.applyfunc(lambda s: c * tanh(s / c)) if hasattr(S, "applyfunc") else c * tanh(S / c)
        return real(capped, c, P, dP, delta, tanh)

    monkeypatch.setattr(mod, "softcap_backward", derivative_at_capped_score)
    assert _fails("softcap")


def test_broken_alibi_bias_is_caught(monkeypatch):
    from derivations import alibi as mod

    monkeypatch.setattr(mod, "tile_bias", lambda rows, cols, slope, n, m: -slope * abs(rows - cols))  # top-left
    assert _fails("alibi")


def test_broken_alibi_gradient_is_caught(monkeypatch):
    from derivations import _common, alibi as mod

    monkeypatch.setattr(mod, "score_grad", lambda P, dO, V: _common.hadamard(P, dO * V.T))  # δ dropped
    assert _fails("alibi")


def test_broken_dropout_kernel_form_is_caught(monkeypatch):
    """The kernel's dS = P∘(Z∘dP̃/(1−p_drop) − δ) with the mask's rescale forgotten fails the float64 check too."""
    from derivations import _common, dropout as mod

    real = mod.dropout_backward

    def no_rescale(P, Z, keep, V, dO, O):
        dP = _common.hadamard(dO * V.T, Z)
        D = _common.rowsum(_common.hadamard(dO, O))
        return {**real(P, Z, keep, V, dO, O), "dS": _common.hadamard(P, dP - _common.broadcast_rows(D, P.cols))}

    monkeypatch.setattr(mod, "dropout_backward", no_rescale)
    assert not mod.torch_route(mod.dropout_backward)
    assert _fails("dropout")


def test_broken_window_count_is_caught(monkeypatch):
    from derivations import sliding_window as mod

    monkeypatch.setattr(mod, "row_count", lambda i, n, m, left, right: min(left + right + 1, m))  # no cut at 0
    assert _fails("sliding_window")


# ---------------------------------------------------------------- the review's truth items (issue 47)

def _range(values) -> str:
    return f"{min(values):.2f}-{max(values):.2f}"


def test_ring_page_ranges_are_recomputed_from_the_results():
    """Every range the ring page quotes for a span of lengths is recomputed here from ring_2gpu.json;
    a range that mixes in rows outside its span (the 32k rows in a "from 64k" range) fails."""
    rows = json.loads((ROOT / "benchmarks" / "results" / "ring_2gpu.json").read_text(encoding="utf-8"))["rows"]
    text = " ".join((ROOT / "docs" / "kernels" / "ring.md").read_text(encoding="utf-8").split())
    span = lambda lo, hi=float("inf"): [r for r in rows if lo <= r["n_per_gpu"] <= hi]
    overlap = lambda rs: [r["ring"]["fwd_ms"] / max(r["ring"]["compute_ms_per_rank"]) for r in rs]
    fraction = lambda rs: [v for r in rs for v in r["fraction_of_single_gpu"].values()]
    fwd_speedup = lambda rs: [r["speedup_vs_torch_cp"]["fwd"] for r in rs]
    fwd_bwd_slowdown = lambda rs: [1 / r["speedup_vs_torch_cp"]["fwd_bwd"] for r in rs]
    expected = [
        f"from 64k tokens per GPU, the ring's forward took {_range(overlap(span(65536)))} times as long",
        f"{_range(overlap(span(131072)))} from 128k",
        f"at 32k tokens per GPU it took {_range(overlap(span(32768, 32768)))} times",
        f"From 64k tokens per GPU the ring keeps {_range(fraction(span(65536)))} of one GPU's",
        f"its forward is {_range(fwd_speedup(span(65536)))} times as fast as PyTorch's",
        f"its forward + backward takes {_range(fwd_bwd_slowdown(span(65536)))} times as long",
        f"forward {_range(fwd_speedup(span(32768, 32768)))} times as fast, forward + backward "
        f"{_range(fwd_bwd_slowdown(span(32768, 32768)))} times as long",
        f"At 32k tokens per GPU the ring keeps {_range(fraction(span(32768, 32768)))} of one GPU's",
    ]
    missing = [e for e in expected if e not in text]
    assert not missing, missing
    # the control: the review's finding, a "from 64k" range computed over every row, differs
    assert _range(fwd_speedup(rows)) != _range(fwd_speedup(span(65536)))


def _sci(x: float) -> str:
    mantissa, exponent = f"{x:.1e}".split("e")
    return rf"\({mantissa}\cdot 10^{{{int(exponent)}}}\)"


def test_backward_precision_page_quotes_the_check():
    """The page's prose and its emulation rows are the numbers the check prints (same rounding)."""
    from derivations import backward_precision as bp

    table = bp.measure()
    fp16 = table["float16"]
    text = " ".join((ROOT / "docs" / "math" / "backward-precision.md").read_text(encoding="utf-8").split())
    for phrase in (f"the internal share of \\(dQ\\) is {_sci(fp16['internal']['dQ'])} and the last {_sci(fp16['last']['dQ'])}",
                   f"together they make {_sci(fp16['kernel']['dQ'])}",
                   f"\\(dK\\) is {_sci(fp16['internal']['dK'])} against {_sci(fp16['last']['dK'])}",
                   f"the last rounding's {_sci(max(fp16['keep_p_ds'].values()))}"):
        assert phrase in text, phrase
    for dtype, row in table.items():
        for label, key in (("emulation", "kernel"),
                           ("emulation with \\(P\\), \\(dS\\) in float32 (\\(\\delta\\) from the stored \\(O\\))", "keep_p_ds")):
            cells = " | ".join(f"{row[key][k]:.1e}".replace("e-0", "e-") for k in bp.NAMES)
            assert f"| {dtype}, {label} | {cells} |" in text, (dtype, label, cells)


def test_recomputation_cost_agrees_across_pages_and_the_source():
    """Both backward kernels open their tile with the score product (the recomputation) and then dP;
    design.md and recomputation.md both say 2 of 7, and neither says one product."""
    from derivations.cost_model import kernel_products

    products = kernel_products()
    assert [products["dK, dV"][0], products["dQ"][0]] == ["s_t", "s"]
    assert [products["dK, dV"][1], products["dQ"][1]] == ["dp_t", "dp"]
    assert len(products["dK, dV"]) + len(products["dQ"]) == 7
    for page in ("kernels/design.md", "math/recomputation.md"):
        text = " ".join((ROOT / "docs" / page).read_text(encoding="utf-8").split())
        assert "2 of the backward's 7 products per tile" in text, page
        assert "one extra product" not in text, page


@pytest.mark.parametrize("module, attr, wrong_text", [
    ("errata", "DQ_003", "dQ = τ dS K"),
    ("errata", "TRACE_003", "tr(ABC) = tr(BCA)"),
    ("errata", "MAX_003", "exp(τ S − rowmax(τ S))"),
    ("errata", "NCTX_002_TEXT", "N_CTX must be a multiple of 128"),
    ("cost_model", "COST_004", "Triton (Two Kernels, 14N²d FLOPS)"),
    ("dropout", "DROPOUT_003", "P ← P; dP ← dP ∘ Z/keep; dS = P ∘ (dP − rowsum(dP ∘ P))"),
])
def test_errata_checks_read_the_stored_passage(monkeypatch, module, attr, wrong_text):
    """Replace a stored seed passage by a correct statement: the control that rejects the seed must
    then accept it. So the check evaluates the stored words, not a re-typed copy."""
    import dataclasses

    mod = importlib.import_module(f"derivations.{module}")
    monkeypatch.setattr(mod, attr, dataclasses.replace(getattr(mod, attr), text=wrong_text))
    if module == "dropout":  # the passage is read through seed_passages.run_steps in seed_003_backward
        assert mod.mpmath_route(mod.seed_003_backward, mod.NUMERIC_SHAPES)
        return
    assert not mod.check().negative_control_rejected


def test_every_seed_passage_is_shown_by_an_erratum():
    from derivations import seed_passages

    shown = " ".join(e.source + e.claim + e.evidence for e in ERRATA)
    assert [name for name, p in seed_passages.ALL.items() if p.text not in shown] == []


def test_masked_load_split_into_harmless_and_hazardous():
    from derivations.masking_hazards import undefined_lanes_that_escape

    source = ("def f():\n"
              "    x = tl.load(p, mask=m)\n    tl.store(q, x, mask=m)\n"       # same mask: harmless
              "    y = tl.load(p, mask=m)\n    tl.store(q, y, mask=n)\n"       # another mask
              "    z = tl.load(p, mask=m)\n    w = z + 1\n"                    # computed with
              "    return tl.load(p, mask=m)\n")                              # returned
    harmless, hazardous = undefined_lanes_that_escape(source)
    assert len(harmless) == 1 and len(hazardous) == 3


def test_check_output_writes_delta_not_d(runner):
    """The notation table's δ holds in the check output the pages embed: no standalone `D` for the row
    term (a seed passage quoted between '…' keeps its own words)."""
    _, payload = runner
    standalone_d = re.compile(r"(?<![A-Za-z_0-9\-])D(?![A-Za-z_0-9])")
    found = [(row["module"], text) for row in payload["rows"]
             for text in [row["identity"], row["method"], row["negative_control"], *row["details"]]
             if standalone_d.search(re.sub(r"'[^']*'|“[^”]*”", "", text))]
    assert found == []
