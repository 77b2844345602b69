"""The autograd functions behind :func:`flashattn.attention`.

Both save what the backward pass needs, ``q, k, v, o`` and the per-row log-sum-exp, and nothing of size
N x M: the backward recomputes P tile by tile from the stored LSE. The LSE output is not differentiable.
"""

from __future__ import annotations

import torch

from flashattn import reference


class ReferenceAttention(torch.autograd.Function):
    """CPU path: the tile-by-tile PyTorch reference, with its explicit online backward."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float):
        o, lse = reference.online_forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, scale
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = reference.online_backward(do, q, k, v, o, lse, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None


class TritonAttention(torch.autograd.Function):
    """GPU path (or CPU under ``TRITON_INTERPRET=1``): the Triton kernels."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float):
        from flashattn.forward import attention_forward  # imported late: importing triton costs time

        o, lse = attention_forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, scale
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        from flashattn.backward import attention_backward

        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = attention_backward(do, q, k, v, o, lse, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None
