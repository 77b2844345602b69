"""flashattn.warmup: one forward and backward per shape, the shapes and options of the real calls, so
that the real calls find their kernels compiled."""

from __future__ import annotations

import pytest
import torch

import flashattn
import flashattn.precompile as warmup_mod
from devices import DEVICE, HAS_CUDA, gpu, needs_cuda


def test_warmup_calls_each_shape_forward_and_backward(monkeypatch):
    seen = []
    real = warmup_mod.attention

    def counting(q, k, v, **kw):
        seen.append((tuple(q.shape), tuple(k.shape), q.requires_grad, kw))
        return real(q, k, v, **kw)

    monkeypatch.setattr(warmup_mod, "attention", counting)
    shapes = [(1, 4, 2, 33, 50, 16), (2, 2, 2, 17, 17, 24)]
    n = flashattn.warmup(shapes, dtype=torch.float16, device=DEVICE, causal=False, window=(8, 8))
    assert n == 2
    assert [(q, k) for q, k, _, _ in seen] == [((1, 4, 33, 16), (1, 2, 50, 16)), ((2, 2, 17, 24), (2, 2, 17, 24))]
    assert all(grad and kw == dict(causal=False, window=(8, 8)) for _, _, grad, kw in seen)
    assert flashattn.warmup([(1, 2, 1, 5, 5, 16)], dtype=torch.float16, device=DEVICE, backward=False) == 1


@pytest.mark.parametrize("bad", [[(1, 2, 2, 8, 8)], [(1, 2, 2, 8, 8, 16.0)], [("1", 2, 2, 8, 8, 16)]])
def test_warmup_refuses_shapes_that_are_not_six_ints(bad):
    with pytest.raises(ValueError, match="B, Hq, Hkv, N, M, D"):
        flashattn.warmup(bad, dtype=torch.float16, device=DEVICE)


@gpu
@needs_cuda
def test_gpu_a_warmed_up_shape_compiles_nothing_more():
    """After warmup, the real call of the same shape launches only kernels already compiled."""
    from flashattn import launch

    if not launch._FAST_PATH[0]:
        pytest.skip("this Triton launches through kernel[grid](...): the package keeps no compiled-kernel table")
    shape = (2, 8, 2, 1000, 1000, 96)
    flashattn.warmup([shape], dtype=torch.bfloat16, device="cuda", causal=True, softcap=30.0)
    before = len(launch._COMPILED)
    assert before > 0  # the warm-up's launches were compiled and kept
    b, h_q, h_kv, n, m, d = shape
    q = torch.randn(b, h_q, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, h_kv, m, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    flashattn.attention(q, k, v, causal=True, softcap=30.0).sum().backward()
    torch.cuda.synchronize()
    assert HAS_CUDA and len(launch._COMPILED) == before
