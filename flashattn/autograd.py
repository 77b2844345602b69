"""The autograd function behind :func:`flashattn.attention`.

It saves what the backward pass needs, ``q, k, v, o`` and the per-row log-sum-exp, and nothing of size
N x M: the backward recomputes P tile by tile from the stored LSE. The LSE output is not differentiable.
Two backends share it, with the same signatures: the Triton kernels and the tile-by-tile reference.
"""

from __future__ import annotations

import torch

from flashattn import reference


def _backend(use_kernels: bool):
    """(forward, backward) of the Triton kernels, or of the PyTorch tile-by-tile reference."""
    if use_kernels:
        # Imported late: importing triton costs time, and a CPU-only user never needs it.
        from flashattn.backward import attention_backward
        from flashattn.forward import attention_forward

        return attention_forward, attention_backward
    return reference.online_forward, reference.online_backward


class AttentionFunction(torch.autograd.Function):
    """``apply(q, k, v, causal, scale, use_kernels) -> (o, lse)``.

    ``use_kernels`` picks the Triton kernels (GPU, or CPU under ``TRITON_INTERPRET=1``) or the
    reference, whose backward is the explicit online backward, not autograd through its loops.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float, use_kernels: bool):
        forward, _ = _backend(use_kernels)
        o, lse = forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale, ctx.use_kernels = causal, scale, use_kernels
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        _, backward = _backend(ctx.use_kernels)
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = backward(do, q, k, v, o, lse, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None, None
