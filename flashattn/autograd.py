"""The autograd function behind :func:`flashattn.attention`, and the two backends it runs.

It saves what the backward pass needs, ``q, k, v, o`` and the per-row log-sum-exp, and nothing of size
N x M: the backward recomputes P tile by tile from the stored LSE. A gradient that reaches the LSE
output joins the backward through D (see :mod:`flashattn.backward`). Two backends share one
signature: the Triton kernels and the tile-by-tile reference.
"""

from __future__ import annotations

import torch

from flashattn import _config, reference
from flashattn.problem import Problem


def _variants(problem: Problem, alibi_slopes, seed) -> dict:
    """The reference's keyword arguments for the problem's variants."""
    return dict(window=problem.window, softcap=problem.softcap, alibi_slopes=alibi_slopes if problem.alibi else None,
                dropout_p=problem.dropout_p, seed=seed if problem.dropout_p > 0 else None)


def _reference_forward(q, k, v, problem: Problem, alibi_slopes=None, seed: int = 0):
    return reference.online_forward(q, k, v, problem.causal, problem.scale,
                                    **_variants(problem, alibi_slopes, seed))


def _reference_backward(do, q, k, v, o, lse, problem: Problem, dlse=None, alibi_slopes=None, seed: int = 0):
    return reference.online_backward(do, q, k, v, o, lse, problem.causal, problem.scale, dlse=dlse,
                                     **_variants(problem, alibi_slopes, seed))


def _kernel_forward(q, k, v, problem: Problem, alibi_slopes=None, seed: int = 0):
    # Imported late: importing triton costs time, and a CPU-only user never needs it.
    from flashattn.forward import attention_forward

    if q.is_cuda:  # Triton launches on the current device: make it the inputs' device
        with torch.cuda.device(q.device):
            return attention_forward(q, k, v, problem, alibi_slopes, seed)
    return attention_forward(q, k, v, problem, alibi_slopes, seed)


def _kernel_backward(do, q, k, v, o, lse, problem: Problem, dlse=None, alibi_slopes=None, seed: int = 0):
    from flashattn.backward import attention_backward

    if q.is_cuda:
        with torch.cuda.device(q.device):
            return attention_backward(do, q, k, v, o, lse, problem, dlse, alibi_slopes, seed)
    return attention_backward(do, q, k, v, o, lse, problem, dlse, alibi_slopes, seed)


def backend(use_kernels: bool):
    """``(forward, backward)`` of the Triton kernels, or of the PyTorch tile-by-tile reference.

    ``forward(q, k, v, problem, alibi_slopes=None, seed=0) -> (o, lse)``;
    ``backward(do, q, k, v, o, lse, problem, dlse=None, alibi_slopes=None, seed=0) -> (dq, dk, dv)``.
    ``alibi_slopes`` matters when ``problem.alibi``, ``seed`` when ``problem.dropout_p`` > 0.
    """
    return (_kernel_forward, _kernel_backward) if use_kernels else (_reference_forward, _reference_backward)


class AttentionFunction(torch.autograd.Function):
    """``apply(q, k, v, problem, use_kernels, alibi_slopes=None, seed=0) -> (o, lse)``, differentiable in
    q, k, v through both outputs (the ALiBi slopes get no gradient).

    ``use_kernels`` picks the Triton kernels (GPU, or CPU under ``TRITON_INTERPRET=1``) or the
    reference, whose backward is the explicit online backward, not autograd through its loops. The
    dropout seed is kept for the backward, which draws the same mask again.
    """

    @staticmethod
    def forward(ctx, q, k, v, problem: Problem, use_kernels: bool, alibi_slopes=None, seed: int = 0):
        forward, _ = backend(use_kernels)
        o, lse = forward(q, k, v, problem, alibi_slopes, seed)
        ctx.save_for_backward(q, k, v, o, lse, alibi_slopes)
        ctx.problem, ctx.use_kernels, ctx.seed = problem, use_kernels, seed
        ctx.tuning = _config.current_tuning()  # the backward may run on another thread
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None, not zeros
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        _, backward = backend(ctx.use_kernels)
        q, k, v, o, lse, alibi_slopes = ctx.saved_tensors
        if do is None:  # only the LSE was used
            do = torch.zeros_like(o)
        with _config.tuning_of(ctx.tuning):
            dq, dk, dv = backward(do, q, k, v, o, lse, ctx.problem, dlse, alibi_slopes, ctx.seed)
        return dq, dk, dv, None, None, None, None
