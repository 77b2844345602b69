"""flashattn's attention as PyTorch custom operators, so ``torch.compile`` can trace it.

``torch.ops.flashattn.attention_forward(q, k, v, causal, scale, window_left=-1, window_right=-1,
softcap=0.0, alibi_slopes=None, dropout_p=0.0, seed=0, cu_seqlens_q=None, cu_seqlens_k=None,
max_seqlen_q=0, max_seqlen_k=0, sinks=None) -> (o, lse)`` and
``torch.ops.flashattn.attention_backward(do, q, k, v, o, lse, dlse, causal, scale, <the same options>)
-> (dq, dk, dv, dsinks)`` (``dsinks`` empty without sinks) are registered with :mod:`torch.library`, one pair for every layout of
:class:`flashattn.problem.Problem`: dense (B, H, N, D) tensors, or packed sequences (total, H, D) when
``cu_seqlens_q`` and ``cu_seqlens_k`` are given, with the same variants on either.

``scale`` None means ``1 / sqrt(D)``, computed inside the operator: computed in the traced code from a
dynamic head dim, it would be a symbolic float that AOTAutograd turns into a tensor on every call. A
fake (meta) implementation gives Dynamo and AOTAutograd the output shapes without running anything,
and the forward's autograd formula calls the backward operator. To the compiler each is one opaque
node, so ``torch.compile(fullgraph=True)`` traces a model that calls :func:`flashattn.attention`
without a graph break, with dynamic shapes and under CUDA graphs (``mode="reduce-overhead"``). The
implementations are the backends the eager path runs (:func:`flashattn.autograd.backend`). The
operators do not check their inputs: :func:`flashattn.attention` and :func:`flashattn.attention_varlen`
check them (at trace time under ``torch.compile``) before they call the operators, so call those
rather than the operators themselves (inputs they would refuse, such as k and v of another dtype
than q, are read wrongly).
"""

from __future__ import annotations

import torch
from torch import Tensor

from flashattn._memo import remember, table
from flashattn.autograd import backend, use_kernels
from flashattn.problem import Problem, dense_like, in_layout, output_like


def _lse_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


_PROBLEMS = table("custom_ops.problems")  # the operators' arguments that describe a call -> its Problem


def _problem(q, k, v, causal, scale, window_left, window_right, softcap, alibi_slopes, dropout_p, cu_seqlens_q=None,
             max_seqlen_q=0, max_seqlen_k=0, sinks=None, deterministic=True) -> Problem:
    """The call's :class:`Problem`, kept per argument signature: a compiled model without CUDA graphs
    calls the operator itself every step, and building a Problem is a few microseconds of it."""
    packed = cu_seqlens_q is not None
    key = (q.shape, k.shape, v.shape[-1], sinks is None, q.dtype, causal, scale, window_left, window_right, softcap, alibi_slopes is None,
           dropout_p, packed and (cu_seqlens_q.shape[0], max_seqlen_q, max_seqlen_k), deterministic)
    problem = _PROBLEMS.get(key)
    if problem is None:
        # The operators spell the window as FlashAttention 2 does: a negative side is unbounded.
        window = (None if window_left < 0 else window_left, None if window_right < 0 else window_right)
        variants = dict(window=window, softcap=softcap, alibi=alibi_slopes is not None, dropout_p=dropout_p,
                        head_dim_v=v.shape[-1], sinks=sinks is not None)
        if packed:
            problem = Problem.packed(q, k, cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k, causal, scale,
                                     **variants)
        else:
            problem = Problem.of(q, k, causal, scale, **variants, deterministic=deterministic)
        remember(_PROBLEMS, key, problem)
    return problem


def _packing(cu_seqlens_q, cu_seqlens_k):
    return None if cu_seqlens_q is None else (cu_seqlens_q, cu_seqlens_k)


@torch.library.custom_op("flashattn::attention_forward", mutates_args=())
def attention_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float | None, window_left: int = -1,
                      window_right: int = -1, softcap: float = 0.0, alibi_slopes: Tensor | None = None,
                      dropout_p: float = 0.0, seed: int = 0, cu_seqlens_q: Tensor | None = None,
                      cu_seqlens_k: Tensor | None = None, max_seqlen_q: int = 0,
                      max_seqlen_k: int = 0, sinks: Tensor | None = None,
                      deterministic: bool = True) -> tuple[Tensor, Tensor]:
    problem = _problem(q, k, v, causal, scale, window_left, window_right, softcap, alibi_slopes, dropout_p,
                       cu_seqlens_q, max_seqlen_q, max_seqlen_k, sinks, deterministic)
    o, lse = backend(use_kernels(q))[0](q, k, v, problem, alibi_slopes, seed, _packing(cu_seqlens_q, cu_seqlens_k),
                                        sinks)
    return in_layout(o, q), lse


@attention_forward.register_fake
def _(q, k, v, causal, scale, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, dropout_p=0.0,
      seed=0, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0, sinks=None, deterministic=True):
    o = output_like(q, v.shape[-1])
    if cu_seqlens_q is not None:  # packed: lse is (Hq, total_q)
        return o, q.new_empty((q.shape[1], q.shape[0]), dtype=_lse_dtype(q))
    b, h_q, n, _ = q.shape
    return o, q.new_empty((b, h_q, n), dtype=_lse_dtype(q))


@torch.library.custom_op("flashattn::attention_backward", mutates_args=())
def attention_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                       dlse: Tensor | None, causal: bool, scale: float | None, window_left: int = -1,
                       window_right: int = -1, softcap: float = 0.0, alibi_slopes: Tensor | None = None,
                       dropout_p: float = 0.0, seed: int = 0, cu_seqlens_q: Tensor | None = None,
                       cu_seqlens_k: Tensor | None = None, max_seqlen_q: int = 0,
                       max_seqlen_k: int = 0, sinks: Tensor | None = None,
                       deterministic: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    problem = _problem(q, k, v, causal, scale, window_left, window_right, softcap, alibi_slopes, dropout_p,
                       cu_seqlens_q, max_seqlen_q, max_seqlen_k, sinks, deterministic)
    dq, dk, dv, d_sinks = backend(use_kernels(q))[1](do, q, k, v, o, lse, problem, dlse, alibi_slopes, seed,
                                                     _packing(cu_seqlens_q, cu_seqlens_k), sinks)
    d_sinks = q.new_empty(0) if d_sinks is None else d_sinks
    return in_layout(dq, q), in_layout(dk, k), in_layout(dv, v), d_sinks


@attention_backward.register_fake
def _(do, q, k, v, o, lse, dlse, causal, scale, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,
      dropout_p=0.0, seed=0, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0, sinks=None,
      deterministic=True):
    return dense_like(q), dense_like(k), dense_like(v), q.new_empty(0) if sinks is None else torch.empty_like(sinks)


_OPTIONS = ("window_left", "window_right", "softcap", "alibi_slopes", "dropout_p", "seed", "cu_seqlens_q",
            "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "sinks", "deterministic")
_TENSOR_OPTIONS = ("alibi_slopes", "cu_seqlens_q", "cu_seqlens_k", "sinks")


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, *options = inputs
    options = dict(zip(_OPTIONS, options))
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, *(options.pop(name, None) for name in _TENSOR_OPTIONS))
    ctx.causal, ctx.scale, ctx.options = causal, scale, options


def _backward(ctx, do, dlse):
    q, k, v, o, lse, *tensor_options = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(o)
    tensor_options = dict(zip(_TENSOR_OPTIONS, tensor_options))
    dq, dk, dv, d_sinks = torch.ops.flashattn.attention_backward(do, q, k, v, o, lse, dlse, ctx.causal, ctx.scale,
                                                                 **tensor_options, **ctx.options)
    grads = [dq, dk, dv, *(None,) * (2 + len(_OPTIONS))]
    if tensor_options["sinks"] is not None:
        grads[5 + _OPTIONS.index("sinks")] = d_sinks  # after q, k, v, causal, scale
    return tuple(grads)


attention_forward.register_autograd(_backward, setup_context=_setup_context)
