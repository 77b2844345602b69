"""The autograd function behind :func:`flashattn.attention`, and the two backends it runs.

It saves what the backward pass needs, ``q, k, v, o`` and the per-row log-sum-exp, and nothing of size
N x M: the backward recomputes P tile by tile from the stored LSE. A gradient that reaches the LSE
output joins the backward through D (see :mod:`flashattn.backward`). Two backends share one
signature: the Triton kernels and the tile-by-tile reference.
"""

from __future__ import annotations

import contextlib

import torch

from flashattn import _config, reference
from flashattn._memo import remember, table
from flashattn.problem import Problem, dense_like, in_layout, output_like


KERNEL_DTYPES = (torch.float16, torch.bfloat16)  # what the Triton kernels run


def use_kernels(q: torch.Tensor) -> bool:
    """CUDA tensors run the Triton kernels; so do float16/bfloat16 CPU tensors under the interpreter."""
    return q.is_cuda or (_config.is_interpreter() and q.dtype in KERNEL_DTYPES)


def _variants(problem: Problem, alibi_slopes, seed) -> dict:
    """The reference's keyword arguments for the problem's variants."""
    return dict(window=problem.window, softcap=problem.softcap, alibi_slopes=alibi_slopes if problem.alibi else None,
                dropout_p=problem.dropout_p, seed=seed if problem.dropout_p > 0 else None)


def _empty_forward(q, problem: Problem):
    """A problem with no batch, head or query (empty outputs) or no key (every query sees none:
    output 0, LSE -inf), answered without a kernel (the reference's loops handle such a problem
    themselves unless it has no key/value head)."""
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return (output_like(q, problem.dv).zero_(),
            torch.full((problem.batch, problem.heads_q, problem.n), -torch.inf, dtype=lse_dtype, device=q.device))


def _empty_backward(q, k, v):
    """Its gradients: zero (no key: every row's output is the constant 0; no query: no key is seen)."""
    return dense_like(q).zero_(), dense_like(k).zero_(), dense_like(v).zero_()


# The reference runs with autocast off: its float32 arithmetic stays float32 inside torch.autocast("cpu")
# (the inputs come in the autocast dtype already, flashattn.api.autocast_inputs), as inside the custom operators,
# which run below autocast.
@torch.autocast("cpu", enabled=False)
def _reference_forward(q, k, v, problem: Problem, alibi_slopes=None, seed: int = 0, packing=None, sinks=None):
    if problem.varlen:
        o, lse = _varlen_reference_forward(q, k, v, problem, packing, alibi_slopes, seed)
    elif problem.heads_kv == 0:  # no head at all: the reference's head groups need one
        o, lse = _empty_forward(q, problem)
    else:
        o, lse = reference.online_forward(q, k, v, problem.causal, problem.scale,
                                          **_variants(problem, alibi_slopes, seed))
        o = in_layout(o, q)
    return (o, lse) if sinks is None else with_sinks(o, lse, sinks, problem.varlen)


@torch.autocast("cpu", enabled=False)
def _reference_backward(do, q, k, v, o, lse, problem: Problem, dlse=None, alibi_slopes=None, seed: int = 0,
                        packing=None, sinks=None):
    if problem.varlen:
        grads = _varlen_reference_backward(do, q, k, v, o, lse, problem, dlse, packing, alibi_slopes, seed)
    elif problem.heads_kv == 0:
        grads = _empty_backward(q, k, v)
    else:
        dq, dk, dv = reference.online_backward(do, q, k, v, o, lse, problem.causal, problem.scale, dlse=dlse,
                                               **_variants(problem, alibi_slopes, seed))
        grads = in_layout(dq, q), in_layout(dk, k), in_layout(dv, v)
    return (*grads, None if sinks is None else sinks_grad(do, o, lse, dlse, sinks, problem.varlen))


_LAUNCHERS: list = []  # [forward, backward, decode_kernels, tensors] once imported
# Compiling backward kernels ahead (compile_backward_ahead): the problems whose first forward has been
# seen, the (family, device) pairs whose backward compiled ahead, and the compiles no backward has
# waited for yet
_SEEN = table("autograd.compile_ahead_seen")
_FAMILIES = table("autograd.compile_ahead_families")
_PENDING: dict = {}
_EARLY_REPLAY = [True]


@contextlib.contextmanager
def early_replay(enabled: bool):
    """Inside the ``with`` block, repeated dense calls replay their recipes from here (the default) or
    only from the launchers, past the backend's layers (what ``gpu``-side A/B timings compare)."""
    before = _EARLY_REPLAY[0]
    _EARLY_REPLAY[0] = bool(enabled)
    try:
        yield
    finally:
        _EARLY_REPLAY[0] = before


def _replayable(q, problem: Problem, use_kernels: bool) -> bool:
    """Whether a call may go straight to the recipe its first calls left (flashattn.launch.replay): the
    dense kernels run it, on q's device, which is the current one (no device guard needed)."""
    return problem.dense_kernels and _early(q, use_kernels)


def _early(q, use_kernels: bool) -> bool:
    """Whether the kernels run this call on q's device and it is the current one, with early replay on."""
    return use_kernels and _EARLY_REPLAY[0] and q.is_cuda and q.get_device() == _config.current_device()


def launchers():
    """The launcher modules (:mod:`flashattn.forward`, :mod:`flashattn.backward`,
    :mod:`flashattn.decode_kernels`) and :mod:`flashattn.tensors`, imported at the first kernel call:
    they import Triton, which a CPU-only user never needs. Kept after that, since an import statement
    in a function costs a short call its lookup every time."""
    if not _LAUNCHERS:
        from flashattn import backward, decode_kernels, forward, tensors

        _LAUNCHERS.extend((forward, backward, decode_kernels, tensors))
    return _LAUNCHERS


def _kernel_forward(q, k, v, problem: Problem, alibi_slopes=None, seed: int = 0, packing=None, sinks=None):
    if problem.empty:
        o, lse = _empty_forward(q, problem)
        return (o, lse) if sinks is None else with_sinks(o, lse, sinks, problem.varlen)
    forward, _, decode_kernels, tensors = launchers()
    with tensors.on_device(q):  # Triton launches on the current device: make it the inputs'
        if problem.split_kv:  # a few rows: the sinks join after the merge
            o, lse = _split_kv_forward(decode_kernels, q, k, v, problem)
            return (o, lse) if sinks is None else with_sinks(o, lse, sinks, problem.varlen)
        return forward.launch_forward(q, k, v, problem, alibi_slopes, seed, packing, sinks)


# --8<-- [start:compile-ahead]
def compile_backward_ahead(q, k, v, problem: Problem, alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_k=None,
                           sinks=None) -> None:
    """At the first forward of a family of problems (:attr:`Problem.family`: dtype, head dims, mask,
    variants, layout) that requires a gradient on a device, start compiling its backward's kernels on
    background threads (:func:`flashattn.backward.compile_ahead`): they compile while the forward's
    kernels do, and while the rest of the model's forward runs. Once per family and device, and each
    problem is looked at once (on the device of its first call): later shapes that need other kernels
    compile them when they run, as before. Only for plain CUDA tensors
    (no subclass or functorch wrapper), under the default tuning, without autotuning (which times real
    launches) and outside CUDA-graph capture (where another thread's allocation could break it). A
    problem seen before costs one lookup of its (cached) hash."""
    if problem in _SEEN:
        return
    remember(_SEEN, problem, True)
    key = (problem.family, q.device)
    if (key in _FAMILIES or problem.empty or (problem.varlen and not (problem.total_q and problem.total_k))
            or not _config.tuning_is_default() or _config.autotune_enabled() or not _plain_cuda_outside_capture(q)):
        return
    remember(_FAMILIES, key, True)
    packing = None if cu_seqlens_q is None else (cu_seqlens_q, cu_seqlens_k)
    future = launchers()[1].compile_ahead(q, k, v, problem, alibi_slopes, packing,
                                          None if sinks is None else sinks.detach().contiguous())
    if future is not None:
        _PENDING[key] = future


def _plain_cuda_outside_capture(q) -> bool:
    return (type(q) is torch.Tensor and q.is_cuda and not (_functorch_wrapped is not None and _functorch_wrapped(q))
            and not torch.cuda.is_current_stream_capturing())


def wait_for_compile_ahead(problem: Problem, q) -> None:
    """Before a backward launches: wait for its family's background compile on q's device if one is
    under way, so that the backward does not compile the same kernels a second time beside it.
    Nothing to do, and no cost beyond an empty-dict test, once every compile started has been waited for."""
    if _PENDING:
        future = _PENDING.pop((problem.family, q.device), None)
        if future is not None:
            future.exception()  # waits; a compile that failed fails again, and reports, at the launch itself
# --8<-- [end:compile-ahead]


def _split_kv_forward(decode_kernels, q, k, v, problem: Problem):
    """A few queries against many keys (:attr:`Problem.split_kv`) by the split-KV decoding kernels: q,
    k, v seen as the decoding layout (B, N, H, D), a transpose and no copy, and every sequence holding
    all M keys. The output keeps q's layout (:func:`dense_like`); lse is (B, Hq, N) float32. The launches
    are kept under a key of the tensors as given (:func:`flashattn.decode_kernels.split_kv_key`), so a
    repeated call replays them before any transpose (:meth:`AttentionFunction.run_forward`)."""
    o = dense_like(q)  # split_kv: D_v = D
    _, lse = decode_kernels.launch_decode(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), problem.m, None,
                                          None, None, problem, problem.m, out=o.transpose(1, 2),
                                          key=decode_kernels.split_kv_key(q, k, v, problem))
    return o, lse


def _kernel_backward(do, q, k, v, o, lse, problem: Problem, dlse=None, alibi_slopes=None, seed: int = 0,
                     packing=None, sinks=None):
    if problem.empty:
        grads = _empty_backward(q, k, v)
        return (*grads, None if sinks is None else sinks_grad(do, o, lse, dlse, sinks, problem.varlen))
    _, backward, _, tensors = launchers()
    with tensors.on_device(q):
        if sinks is None:
            return (*backward.launch_backward(do, q, k, v, o, lse, problem, dlse, alibi_slopes, seed, packing), None)
        # the dQ kernel sums the sinks' gradient from its row statistics (flashattn.backward.launch_backward)
        *grads, d_sinks = backward.launch_backward(do, q, k, v, o, lse, problem, dlse, alibi_slopes, seed, packing,
                                                   sinks.detach().contiguous())
    if d_sinks is None:  # no kernel ran (no query or no key in the pack): from the outputs
        d_sinks = sinks_grad(do, o, lse, dlse, sinks, problem.varlen)
    return (*grads, d_sinks)


def _varlen_reference_forward(q, k, v, problem: Problem, packing, alibi_slopes=None, seed: int = 0):
    # 16-bit CPU inputs run in float32 and round back, as the tile-by-tile reference does
    wide = q.dtype if q.dtype == torch.float64 else torch.float32
    o, lse = reference.varlen_attention(q.to(wide), k.to(wide), v.to(wide), *packing, problem.causal, problem.scale,
                                        **_variants(problem, alibi_slopes, seed))
    return in_layout(o.to(q.dtype), q), lse


def _varlen_reference_backward(do, q, k, v, o, lse, problem: Problem, dlse, packing, alibi_slopes=None,
                               seed: int = 0):
    """The tile-by-tile reference backward (:func:`flashattn.reference.online_backward`), one sequence at a
    time. Not autograd: inside a custom operator autograd does not record."""
    dq, dk, dv = dense_like(q).zero_(), dense_like(k).zero_(), dense_like(v).zero_()
    cu_q, cu_k = (cu.tolist() for cu in packing)
    heads = (lambda x: x.transpose(0, 1)[None])  # (L, H, D) -> (1, H, L, D)
    for i in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        if rows.start == rows.stop or keys.start == keys.stop:
            continue  # no query, or no key: every gradient of the sequence is zero
        grads = reference.online_backward(
            heads(do[rows]), heads(q[rows]), heads(k[keys]), heads(v[keys]), heads(o[rows]), lse[None, :, rows],
            problem.causal, problem.scale, dlse=None if dlse is None else dlse[None, :, rows],
            **reference.sequence_variants(i, **_variants(problem, alibi_slopes, seed)))
        for out, g, span in zip((dq, dk, dv), grads, (rows, keys, keys)):
            out[span] = g[0].transpose(0, 1)
    return dq, dk, dv


# --8<-- [start:sinks]
def _wide(x: torch.Tensor) -> torch.Tensor:
    """float32, or float64 for float64 inputs: the precision the sink arithmetic runs in."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _row_shape(sinks: torch.Tensor, packed: bool) -> torch.Tensor:
    """The sinks (Hq,) shaped to broadcast against lse: (1, Hq, 1) dense, (Hq, 1) packed."""
    return sinks.view(-1, 1) if packed else sinks.view(1, -1, 1)


def with_sinks(o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor, packed: bool):
    """The attention with sinks from the attention without them: a sink logit s_h joins the softmax
    denominator of every row of head h (it has no value), so the output shrinks by
    l / (l + e^s) = exp(lse - lse') and the log-sum-exp becomes lse' = log(e^lse + e^s). A row that saw
    no key (o = 0, lse = -inf) keeps o = 0 and gets lse' = s. ``o`` is (B, Hq, N, D) dense or
    (total, Hq, D) packed, lse (B, Hq, N) or (Hq, total) (docs/math/sinks.md)."""
    lse_w = _wide(lse)
    lse_sink = torch.logaddexp(lse_w, _row_shape(sinks.to(lse_w.dtype), packed))
    # in [0, 1]: the share of the row's mass its keys keep; 0 for a row with no key and a sink of -inf,
    # where lse = lse' = -inf would give -inf - (-inf) = NaN
    shrink = torch.where(lse_sink == float("-inf"), 0.0, torch.exp(lse_w - lse_sink))
    shrink = shrink.transpose(0, 1)[..., None] if packed else shrink[..., None]
    return (_wide(o) * shrink.to(_wide(o).dtype)).to(o.dtype), lse_sink.to(lse.dtype)


def sinks_grad(do, o, lse, dlse, sinks: torch.Tensor, packed: bool) -> torch.Tensor:
    """dL/ds_h = sum over the rows of head h of P_sink * (dLSE - rowsum(dO * O)), with o and lse the
    outputs with sinks and P_sink = exp(s_h - lse) the sink's probability. (The keys' gradients need
    nothing new: the backward kernels recompute P from the final lse and use the final o's delta.)"""
    delta = (_wide(do) * _wide(o)).sum(-1)  # (B, Hq, N) dense, (total, Hq) packed
    if packed:
        delta = delta.transpose(0, 1)  # (Hq, total), lse's layout
    if dlse is not None:
        delta = delta - dlse.to(delta.dtype)
    lse_w = _wide(lse)
    p_sink = torch.exp(_row_shape(sinks.to(lse_w.dtype), packed) - lse_w)
    p_sink = torch.where(lse_w == float("-inf"), 0.0, p_sink)  # no key and a sink of -inf: nothing flows
    return -(p_sink * delta.to(lse_w.dtype)).sum((1,) if packed else (0, 2)).to(sinks.dtype)
# --8<-- [end:sinks]


def backend(use_kernels: bool):
    """``(forward, backward)`` of the Triton kernels, or of the PyTorch tile-by-tile reference.

    ``forward(q, k, v, problem, alibi_slopes=None, seed=0, packing=None, sinks=None) -> (o, lse)``;
    ``backward(do, q, k, v, o, lse, problem, dlse=None, alibi_slopes=None, seed=0, packing=None, sinks=None)
    -> (dq, dk, dv, dsinks)`` (dsinks None without sinks). ``alibi_slopes`` matters when ``problem.alibi``, ``seed`` when
    ``problem.dropout_p`` > 0, and ``packing = (cu_seqlens_q, cu_seqlens_k)`` when ``problem.varlen``
    (packed sequences, whose reference is :func:`flashattn.reference.varlen_attention`).
    """
    return (_kernel_forward, _kernel_backward) if use_kernels else (_reference_forward, _reference_backward)


_SECOND_BACKWARD = ("flashattn computed this gradient with kernels (or ring_attention's exchanges) that are not "
                    "differentiable: no double backward (create_graph=True) through it; in eager mode, "
                    "flashattn.attention and flashattn.attention_varlen on float32 or float64 CPU inputs run "
                    "the PyTorch reference, which has one")


class _FirstOrderOnly(torch.autograd.Function):
    """``apply(dq, dk, dv, *sources) -> (dq, dk, dv)``, the same tensors, tied in the autograd graph to
    ``sources`` (what the gradients depend on): a second backward that reaches them, by ``backward``
    or by ``torch.autograd.grad`` with any of the sources among its inputs, raises."""

    @staticmethod
    def forward(ctx, dq, dk, dv, *sources):
        # copies, not views: a gradient that a view node produced could not be scaled in place later
        # (gradient clipping does that)
        return dq.clone(), dk.clone(), dv.clone()

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(_SECOND_BACKWARD)


def not_twice(grads: tuple, *sources) -> tuple:
    """``grads`` (dq, dk, dv) as a backward run with ``create_graph=True`` returns them, for backends
    whose gradients carry no graph (the Triton kernels; the ring's exchanges): where the incoming
    gradients or the saved inputs require grad, they come out of a node joined to those ``sources``
    that raises if a second backward reaches it, instead of passing as constants that would drop the
    second-order terms without a word. In a plain backward (grad mode off) ``grads`` is returned as it is."""
    if not torch.is_grad_enabled():
        return grads
    sources = tuple(t for t in sources if t is not None and t.requires_grad)
    if not sources:
        return grads
    return _FirstOrderOnly.apply(*grads, *sources)


class AttentionFunction(torch.autograd.Function):
    """``apply(q, k, v, problem, use_kernels, alibi_slopes=None, seed=0, cu_seqlens_q=None,
    cu_seqlens_k=None, sinks=None) -> (o, lse)``, differentiable in q, k, v and the sinks through both
    outputs (the ALiBi slopes get no gradient), for every layout of :class:`Problem`: dense, or packed
    sequences with their cumulative lengths. Sinks (``problem.sinks``) join the softmax after the
    backend's forward (:func:`with_sinks`).

    ``use_kernels`` picks the Triton kernels (GPU, or CPU under ``TRITON_INTERPRET=1``) or the
    reference, whose backward is the explicit online backward, not autograd through its loops. The
    dropout seed is kept for the backward, which draws the same mask again.

    Eager calls come here; calls traced by ``torch.compile`` reach the same backends through the
    custom operator (:mod:`flashattn.custom_ops`) and its registered autograd, which skip nothing
    but cost a short eager call the dispatcher's microseconds (``benchmarks.autograd_paths``).
    """

    @staticmethod
    def run_forward(q, k, v, problem: Problem, use_kernels: bool, alibi_slopes=None, seed: int = 0,
                    cu_seqlens_q=None, cu_seqlens_k=None, sinks=None):
        """The forward pass alone, ``(o, lse)``, for calls that need no gradient: the same backend
        :meth:`forward` runs, without the autograd bookkeeping."""
        if sinks is not None:
            sinks = sinks.detach().contiguous()
        if _replayable(q, problem, use_kernels):
            # past the backend's layers, which cost a short call microseconds
            replayed = launchers()[0].replay_forward(q, k, v, problem, alibi_slopes, seed, sinks)
            if replayed is not None:
                return replayed
        elif sinks is None and problem.split_kv and _early(q, use_kernels):
            # likewise a decoding-shaped call (a few queries, many keys): past the transposes too
            replayed = launchers()[2].replay_split_kv(q, k, v, problem)
            if replayed is not None:
                return replayed
        packing = None if cu_seqlens_q is None else (cu_seqlens_q, cu_seqlens_k)
        return backend(use_kernels)[0](q, k, v, problem, alibi_slopes, seed, packing, sinks)

    @staticmethod
    def forward(ctx, q, k, v, problem: Problem, use_kernels: bool, alibi_slopes=None, seed: int = 0,
                cu_seqlens_q=None, cu_seqlens_k=None, sinks=None):
        if use_kernels:
            compile_backward_ahead(q, k, v, problem, alibi_slopes, cu_seqlens_q, cu_seqlens_k, sinks)
        o, lse = AttentionFunction.run_forward(q, k, v, problem, use_kernels, alibi_slopes, seed, cu_seqlens_q,
                                               cu_seqlens_k, sinks)
        if alibi_slopes is None and cu_seqlens_q is None and sinks is None:  # a short call feels each saved None
            ctx.save_for_backward(q, k, v, o, lse)
        else:
            ctx.save_for_backward(q, k, v, o, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k, sinks)
        # one attribute, not four: a short call feels each; the tuning because the backward may run
        # on another thread
        ctx.call = (problem, use_kernels, seed, _config.current_tuning())
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None, not zeros
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        problem, use_kernels, seed, tuning = ctx.call
        q, k, v, o, lse, *extras = ctx.saved_tensors
        alibi_slopes, cu_q, cu_k, sinks = extras if extras else (None, None, None, None)
        if do is None:  # only the LSE was used
            do = torch.zeros_like(o)
        if use_kernels:
            wait_for_compile_ahead(problem, q)
        if not extras and tuning is _config.DEFAULT_TUNING and _replayable(q, problem, use_kernels):
            # a repeated call's recipe, as in run_forward (not under a tuning the forward pinned)
            grads = launchers()[1].replay_backward(do, q, k, v, o, lse, problem, dlse, None, seed)
            if grads is not None:
                return *not_twice(grads, do, dlse, q, k, v), None, None, None, None, None, None, None
        with _config.tuning_of(tuning):
            *grads, d_sinks = backend(use_kernels)[1](do, q, k, v, o, lse, problem, dlse, alibi_slopes, seed,
                                                      None if cu_q is None else (cu_q, cu_k), sinks)
        if use_kernels:
            grads = not_twice(tuple(grads), do, dlse, q, k, v)
        return *grads, None, None, None, None, None, None, d_sinks


_functorch_wrapped = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", None)
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", None)
_base_apply = super(torch.autograd.Function, AttentionFunction).apply  # the C++ apply it inherits


def attention_apply(q, k, v, problem: Problem, use_kernels: bool, alibi_slopes=None, seed: int = 0,
                    cu_seqlens_q=None, cu_seqlens_k=None, sinks=None):
    """``AttentionFunction.apply`` without its Python wrapper where that wrapper would do nothing.

    ``torch.autograd.Function.apply`` first unwraps leftover functorch wrappers from its arguments
    with a pytree walk, and hands the call to functorch while a transform (vmap, grad, ...) is active;
    with neither, it calls the C++ ``apply`` it inherits. This calls that one directly when no
    transform is active and no input is a functorch wrapper, and the wrapper otherwise: a short call
    feels the microseconds of the walk."""
    args = (q, k, v, problem, use_kernels, alibi_slopes, seed, cu_seqlens_q, cu_seqlens_k, sinks)
    if (_functorch_wrapped is None or _functorch_active is None or _functorch_active()
            or _functorch_wrapped(q) or _functorch_wrapped(k) or _functorch_wrapped(v)
            or (alibi_slopes is not None and _functorch_wrapped(alibi_slopes))
            or (sinks is not None and _functorch_wrapped(sinks))):
        return AttentionFunction.apply(*args)
    return _base_apply(*args)


def attend(q, k, v, problem: Problem, use_kernels: bool, alibi_slopes=None, seed: int = 0,
           cu_seqlens_q=None, cu_seqlens_k=None, sinks=None):
    """``(o, lse)`` of one call of the public API: through :func:`attention_apply` where a gradient can
    reach q, k, v or the sinks, else :meth:`AttentionFunction.run_forward`, with no autograd bookkeeping."""
    args = (q, k, v, problem, use_kernels, alibi_slopes, seed, cu_seqlens_q, cu_seqlens_k, sinks)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                    or (sinks is not None and sinks.requires_grad)):
        return attention_apply(*args)
    return AttentionFunction.run_forward(*args)
