"""The attention-sinks derivation (derivations/sinks.py, docs/math/sinks.md): a formula broken on purpose
fails the check, the routes test the package's own functions, and the page embeds what it names."""

from __future__ import annotations

from pathlib import Path

import derivations
from derivations import sinks as mod

ROOT = Path(__file__).resolve().parents[1]


def test_registered_after_softcap_and_shown_by_its_page():
    assert derivations.MODULES.index("sinks") == derivations.MODULES.index("softcap") + 1
    page = (ROOT / "docs" / "math" / "sinks.md").read_text(encoding="utf-8")
    assert "<!-- flashattn:derivation sinks -->" in page
    assert '--8<-- "flashattn/autograd.py:sinks"' in page
    assert "math/sinks.md" in (ROOT / "mkdocs.yml").read_text(encoding="utf-8")


def test_unscaled_output_is_caught(monkeypatch):
    monkeypatch.setattr(mod, "with_sink", lambda o, lse, sink, exp, logaddexp: (o, logaddexp(lse, sink)))
    assert not mod.check().passed


def test_sink_gradient_with_the_wrong_sign_is_caught(monkeypatch):
    real = mod.sink_grad_row
    monkeypatch.setattr(mod, "sink_grad_row", lambda *args: -real(*args))
    assert not mod.check().passed


def test_backward_fed_the_sink_free_lse_is_caught(monkeypatch):
    monkeypatch.setattr(mod, "backward_inputs", lambda plain, final: (final[0], plain[1]))
    assert not mod.check().passed


def test_torch_route_reads_the_package_functions():
    """The route that checks flashattn.autograd's functions fails when one of them is wrong, so a bug in
    the package (not only in the module's own formulas) shows in the check."""
    import torch

    from flashattn.autograd import sinks_grad, with_sinks

    assert mod.torch_route(with_sinks, sinks_grad, mod.backward_inputs)
    halved = lambda *args: 0.5 * sinks_grad(*args)  # noqa: E731
    assert not mod.torch_route(with_sinks, halved, mod.backward_inputs)
    no_shrink = lambda o, lse, sinks, packed: (o, with_sinks(o, lse, sinks, packed)[1])  # noqa: E731
    assert not mod.torch_route(no_shrink, sinks_grad, mod.backward_inputs)
    assert torch.isfinite(mod.dense_case(0)["fd"][3]).all() and mod.dense_case(0)["fd"][3].abs().max() > 0.1
