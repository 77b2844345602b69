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


def _reference_forward(q, k, v, problem: Problem):
    return reference.online_forward(q, k, v, problem.causal, problem.scale)


def _reference_backward(do, q, k, v, o, lse, problem: Problem, dlse=None):
    return reference.online_backward(do, q, k, v, o, lse, problem.causal, problem.scale, dlse=dlse)


def _kernel_forward(q, k, v, problem: Problem):
    # Imported late: importing triton costs time, and a CPU-only user never needs it.
    from flashattn.forward import attention_forward

    if q.is_cuda:  # Triton launches on the current device: make it the inputs' device
        with torch.cuda.device(q.device):
            return attention_forward(q, k, v, problem)
    return attention_forward(q, k, v, problem)


def _kernel_backward(do, q, k, v, o, lse, problem: Problem, dlse=None):
    from flashattn.backward import attention_backward

    if q.is_cuda:
        with torch.cuda.device(q.device):
            return attention_backward(do, q, k, v, o, lse, problem, dlse)
    return attention_backward(do, q, k, v, o, lse, problem, dlse)


def backend(use_kernels: bool):
    """``(forward, backward)`` of the Triton kernels, or of the PyTorch tile-by-tile reference.

    ``forward(q, k, v, problem) -> (o, lse)``;
    ``backward(do, q, k, v, o, lse, problem, dlse=None) -> (dq, dk, dv)``.
    """
    return (_kernel_forward, _kernel_backward) if use_kernels else (_reference_forward, _reference_backward)


class AttentionFunction(torch.autograd.Function):
    """``apply(q, k, v, problem, use_kernels) -> (o, lse)``, differentiable in both outputs.

    ``use_kernels`` picks the Triton kernels (GPU, or CPU under ``TRITON_INTERPRET=1``) or the
    reference, whose backward is the explicit online backward, not autograd through its loops.
    """

    @staticmethod
    def forward(ctx, q, k, v, problem: Problem, use_kernels: bool):
        forward, _ = backend(use_kernels)
        o, lse = forward(q, k, v, problem)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.problem, ctx.use_kernels = problem, use_kernels
        ctx.tuning = _config.current_tuning()  # the backward may run on another thread
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None, not zeros
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        _, backward = backend(ctx.use_kernels)
        q, k, v, o, lse = ctx.saved_tensors
        if do is None:  # only the LSE was used
            do = torch.zeros_like(o)
        with _config.tuning_of(ctx.tuning):
            dq, dk, dv = backward(do, q, k, v, o, lse, ctx.problem, dlse)
        return dq, dk, dv, None, None
