"""Inputs, the float64 check and the Hopper stand-ins shared by the tests/test_kernels_*.py modules
(not a test module, like tests/devices.py).

``_check_against_reference`` runs the forward and backward launchers, checks the outputs' shapes,
dtypes and finiteness, and asserts each output's error ratio against float64
(:func:`flashattn.testing.assert_close_ratio`). ``_on_hopper`` makes the Gluon dispatch rule see an
sm_90 GPU with Gluon available, and ``_stub_gluon_forward_launch`` runs the Gluon forward's host code
with its kernel, descriptors, launch and SM count stubbed: both work on any machine.
"""

from __future__ import annotations

import torch

from flashattn import _config
from flashattn.backward import launch_backward as attention_backward
from flashattn.forward import launch_forward as attention_forward
from flashattn.problem import Problem
from flashattn.reference import naive_attention
from flashattn.testing import assert_close_ratio, random_qkv

from devices import DEVICE


def _inputs(b, h_q, h_kv, n, m, d, dtype, *, layout="bhnd", std=1.0, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q, k, v = random_qkv(b, h_q, h_kv, n, m, d, dtype=dtype, device=DEVICE, layout=layout, generator=gen, std=std)
    do = torch.randn(q.shape, dtype=dtype, device=DEVICE, generator=gen)
    return q, k, v, do


def _references(q, k, v, do, causal, scale):
    """(float64 outputs, PyTorch low-precision outputs): each is (o, lse, dq, dk, dv)."""
    out = []
    for dtype in (torch.float64, q.dtype):
        qr, kr, vr = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
        o, lse = naive_attention(qr, kr, vr, causal=causal, scale=scale)
        o.backward(do.to(dtype))
        out.append((o.detach(), lse.detach(), qr.grad, kr.grad, vr.grad))
    return out


def _check_against_reference(q, k, v, do, causal, scale, *, floor=1e-5, deterministic=True):
    """Run forward and backward kernels, assert the error ratio for each output, return the errors."""
    problem = Problem.of(q, k, causal, scale, deterministic=deterministic)
    o, lse = attention_forward(q, k, v, problem)
    dq, dk, dv = attention_backward(do, q, k, v, o, lse, problem)
    assert o.shape == q.shape and o.dtype == q.dtype
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    for name, x in (("o", o), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.isfinite(x).all(), f"{name}: NaN or inf"
    assert not torch.isnan(lse).any(), "lse: NaN"
    ref, lowp = _references(q, k, v, do, causal, scale)
    errors = {}
    for name, out, r, lp in zip(("o", "lse", "dq", "dk", "dv"), (o, lse, dq, dk, dv), ref, lowp):
        errors[name], _ = assert_close_ratio(name, out, r, lp, floor=floor)
    return errors, (o, lse, dq, dk, dv)


def _empty_rows_are_zero(causal, n, m, o, lse, dq):
    """Rows with no visible key (causal, N > M): o = 0, lse = -inf, dq = 0."""
    if causal and n > m:
        empty = slice(0, n - m)
        assert (o[:, :, empty] == 0).all()
        assert (lse[:, :, empty] == float("-inf")).all()
        assert (dq[:, :, empty] == 0).all()
        assert torch.isfinite(lse[:, :, n - m:]).all()


def _stub_gluon_forward_launch(monkeypatch, launches: list) -> None:
    """hopper.fwd.forward's host code without a GPU: the kernel, the descriptors and a 132-SM count
    stubbed, each launch's positional arguments appended to ``launches``."""
    from flashattn import _config, hopper

    monkeypatch.setattr(hopper.fwd, "_get_kernel", lambda: "kernel")
    monkeypatch.setattr(hopper.fwd, "descriptor", lambda t, rows, cols=None: ("desc", rows, cols))
    monkeypatch.setattr(hopper.fwd, "launch", lambda *a, **k: launches.append(a))
    monkeypatch.setattr(_config, "_sm_count", lambda index: 132)


def _on_hopper(monkeypatch):
    """Make flashattn._config.gluon_kernel see an sm_90 GPU with Gluon available, on any machine."""
    monkeypatch.setattr(_config, "is_interpreter", lambda: False)
    monkeypatch.setattr(_config, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(_config, "_GLUON", {})


def _problem(b=2, h_q=8, h_kv=8, n=4096, m=4096, d=128, causal=True, **variants):
    q = torch.empty((b, h_q, n, d), dtype=torch.float16, device="meta")
    k = torch.empty((b, h_kv, m, d), dtype=torch.float16, device="meta")
    return Problem.of(q, k, causal, **variants)
