"""The public entry point :func:`attention` (the ``flash_attn``-style functions are in :mod:`flashattn.compat`).

Every check of the API contract happens here, before any kernel is launched, so bad input raises a
``TypeError`` or ``ValueError`` that names the argument, never a Triton compile error.
"""

from __future__ import annotations

import math
import numbers

import torch

from flashattn._memo import remember, table
from flashattn.autograd import KERNEL_DTYPES, attend, use_kernels
from flashattn.problem import Problem

MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
REFERENCE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # the CPU reference


def check_dtype_for_device(q, names: str) -> None:
    """What each device runs: float16/bfloat16 on CUDA (the kernels), any float on the CPU (the
    reference). ``names`` lists the tensors that share ``q``'s dtype and device, for the message."""
    if q.is_cuda:
        if q.dtype not in KERNEL_DTYPES:
            raise TypeError(f"on the GPU {names} must be float16 or bfloat16, got {q.dtype}")
    elif q.device.type == "cpu":
        if q.dtype not in REFERENCE_DTYPES:
            raise TypeError(f"{names} must be float16, bfloat16, float32 or float64 on the CPU, got {q.dtype}")
    else:
        raise ValueError(f"{names} must be on a CUDA device or the CPU, got {q.device}")


def check_tensors(q, k, v, q_layout: str, kv_layout: str) -> None:
    """The checks every entry point makes of q, k, v: tensors of the layouts' rank, floating point, one
    dtype, one device, k and v alike. ``q_layout``/``kv_layout`` name the dims, e.g. "(B, Hq, N, D)"."""
    dims = q_layout.count(",") + 1
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != dims:
            raise ValueError(f"{name} must be {dims}-D {q_layout if name == 'q' else kv_layout}, got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k and v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    if k.shape[:-1] != v.shape[:-1]:  # v's head dim may differ from k's (split head dims, checked by the caller)
        raise ValueError(f"k and v must have the same shape {kv_layout} but for the head dim, got k {tuple(k.shape)} "
                         f"and v {tuple(v.shape)}")
    if not MIN_HEAD_DIM <= v.shape[-1] <= MAX_HEAD_DIM:
        raise ValueError(f"head dim D_v of v must be between {MIN_HEAD_DIM} and {MAX_HEAD_DIM}, got {v.shape[-1]}")


def is_int(x) -> bool:
    """A Python (or NumPy) integer that is not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_flag(name: str, value) -> None:
    """A keyword that must be a bool (``causal``, ``return_lse``, ...), not merely truthy."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def _finite(x) -> bool:
    """Whether the real number ``x`` is finite, written as comparisons so that torch.compile can trace
    it for a symbolic float (math.isfinite breaks the graph)."""
    return -math.inf < x < math.inf


def check_scale(scale) -> None:
    """The softmax scale: None (1 / sqrt(D)) or a finite real number >= 0."""
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
            raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
        if not _finite(scale) or scale < 0:
            raise ValueError(f"scale must be finite and non-negative, got {scale}")


def _check_inputs(q, k, v, causal, scale, allow_empty: bool = False):
    check_shapes(q, k, v, causal, scale, allow_empty)
    check_dtype_for_device(q, "q, k, v")


def check_shapes(q, k, v, causal, scale, allow_empty: bool = False):
    """What :func:`attention` checks of q, k, v, ``causal`` and ``scale``, but the dtype each device
    runs: tensors, their shapes and head dims, the flag and the scale."""
    check_tensors(q, k, v, "(B, Hq, N, D)", "(B, Hkv, M, D)")
    b, h_q, n, d = q.shape
    _, h_kv, m, d_k = k.shape
    if k.shape[0] != b:
        raise ValueError(f"k and v must have the batch size of q ({b}), got {k.shape[0]}")
    if d_k != d:
        raise ValueError(f"k and v must have the head dim D of q ({d}), got {d_k}")
    if (h_kv == 0 and not (allow_empty and h_q == 0)) or (h_kv and h_q % h_kv != 0):  # Hq = Hkv = 0: empty
        raise ValueError(f"the number of query heads ({h_q}) must be a multiple of the number of key/value heads of k and v ({h_kv})")
    if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head dim D of q, k, v must be between {MIN_HEAD_DIM} and {MAX_HEAD_DIM}, got {d}")
    if not allow_empty and (b == 0 or h_q == 0 or n == 0 or m == 0):
        raise ValueError(f"q and k need at least one batch, head, query and key; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    check_flag("causal", causal)
    check_scale(scale)


def autocast_inputs(q, k, v):
    """Inside ``torch.autocast`` for q's device (CUDA or CPU), float32 (and other 16-bit) inputs on that
    device run in the autocast dtype, as ``scaled_dot_product_attention`` does; outside it nothing
    changes."""
    if not isinstance(q, torch.Tensor):
        return q, k, v
    device = "cuda" if q.is_cuda else "cpu" if q.is_cpu else None  # attributes: cheaper than q.device
    if device is None or not torch.is_autocast_enabled(device):
        return q, k, v
    dtype = torch.get_autocast_dtype(device)
    cast = (lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.device.type == device
            and x.dtype in (torch.float32, torch.float16, torch.bfloat16) else x)
    return cast(q), cast(k), cast(v)


MAX_SEED = 2**62  # the kernels take the dropout seed as two 31-bit halves


def check_variants(q, batch: int, heads_q: int, window, softcap, alibi_slopes, dropout_p):
    """Validate the variants' arguments but the dropout seed's source (:func:`check_dropout_source`),
    for ``batch`` batch entries or packed sequences of ``heads_q`` query heads; returns the window as a
    tuple (or None) and softcap as a float."""
    if window is not None:
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            raise TypeError(f"window must be a (left, right) pair of ints or None, got {window!r}")
        for side, w in zip(("left", "right"), window):
            if w is None:
                continue
            if not is_int(w):
                raise TypeError(f"window {side} must be an int >= 0 or None (unbounded), got {type(w).__name__}")
            if w < 0:
                raise ValueError(f"window {side} must be >= 0 (None for unbounded), got {w}")
        window = tuple(None if w is None else int(w) for w in window)
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
            raise TypeError(f"softcap must be a real number or None, got {type(softcap).__name__}")
        if not _finite(softcap) or softcap < 0:
            raise ValueError(f"softcap must be finite and >= 0 (0 or None: off), got {softcap}")
    softcap = float(softcap or 0.0)
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, torch.Tensor):
            raise TypeError(f"alibi_slopes must be a torch.Tensor, got {type(alibi_slopes).__name__}")
        if alibi_slopes.dtype != torch.float32:
            raise TypeError(f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
        b, h_q = batch, heads_q
        if tuple(alibi_slopes.shape) not in ((h_q,), (b, h_q)):
            raise ValueError(f"alibi_slopes must have shape (Hq,) = ({h_q},) or (B, Hq) = ({b}, {h_q}), "
                             f"got {tuple(alibi_slopes.shape)}")
        if alibi_slopes.device != q.device:
            raise ValueError(f"alibi_slopes must be on q's device {q.device}, got {alibi_slopes.device}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a real number, got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    return window, softcap


def check_sinks(q, heads_q: int, sinks) -> None:
    """Attention sinks: None, or a floating-point (Hq,) tensor of per-head logits on q's device."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point():
        raise TypeError(f"sinks must be a floating-point torch.Tensor (Hq,) or None, got "
                        f"{sinks.dtype if isinstance(sinks, torch.Tensor) else type(sinks).__name__}")
    if tuple(sinks.shape) != (heads_q,):
        raise ValueError(f"sinks must have shape (Hq,) = ({heads_q},), got {tuple(sinks.shape)}")
    if sinks.device != q.device:
        raise ValueError(f"sinks must be on q's device {q.device}, got {sinks.device}")


def check_dropout_source(generator, seed) -> None:
    """The dropout seed's source, which changes from call to call: a generator, a seed, or neither."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if seed is not None:
        if not is_int(seed):
            raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
        if not 0 <= seed < MAX_SEED:
            raise ValueError(f"seed must be in [0, 2**62), got {seed}")
        if generator is not None:
            raise ValueError("pass either a generator or a seed for dropout, not both")


def _check_call(q, k, v, causal, scale, return_lse, window, softcap, alibi_slopes, dropout_p, deterministic=True):
    """Every check of :func:`attention`'s arguments but the dropout seed's source; returns the window
    as a tuple (or None) and softcap as a float."""
    _check_inputs(q, k, v, causal, scale, allow_empty=True)
    check_flag("return_lse", return_lse)
    check_flag("deterministic", deterministic)
    return check_variants(q, q.shape[0], q.shape[1], window, softcap, alibi_slopes, dropout_p)


_DESCRIBED = table("api.described")  # the signature of a call that passed the checks -> its Problem


def _signature(q, k, v, causal, scale, return_lse, window, softcap, alibi_slopes, dropout_p, has_sinks=False,
               deterministic=True):
    """Everything the checks and :class:`Problem` of a call read, the type of each argument included
    (True and 1 hash alike, but only one is a valid ``causal``); None when an argument is unhashable."""
    try:
        return (type(q), type(k), type(v), q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype,
                q.device, k.device, v.device, type(causal), causal, type(scale), scale,
                type(return_lse), return_lse, type(window), window,
                window is not None and tuple(map(type, window)), type(softcap), softcap,
                alibi_slopes is not None and (type(alibi_slopes), alibi_slopes.shape, alibi_slopes.dtype,
                                              alibi_slopes.device),
                type(dropout_p), dropout_p, has_sinks, type(deterministic), deterministic)
    except (AttributeError, TypeError):  # not tensors, or a window that is not a sequence
        return None


def _described(q, k, v, causal, scale, return_lse, window, softcap, alibi_slopes, dropout_p,
               has_sinks: bool = False, deterministic: bool = True) -> Problem:
    """Check a call against the contract and describe it. The checks and the description are a pure
    function of the arguments' types, the tensors' shapes, dtypes and devices and the options'
    values, so a call with the signature of an earlier valid one reuses its Problem: a short call
    feels the microseconds the checks take."""
    signature = _signature(q, k, v, causal, scale, return_lse, window, softcap, alibi_slopes, dropout_p, has_sinks,
                           deterministic)
    try:
        problem = _DESCRIBED.get(signature) if signature is not None else None
    except TypeError:  # an unhashable option, e.g. a window given as a list
        signature = problem = None
    if problem is not None:
        return problem
    window, softcap = _check_call(q, k, v, causal, scale, return_lse, window, softcap, alibi_slopes, dropout_p,
                                  deterministic)
    problem = Problem.of(q, k, causal, scale, window=window, softcap=softcap, alibi=alibi_slopes is not None,
                         dropout_p=float(dropout_p), head_dim_v=v.shape[-1], sinks=has_sinks,
                         deterministic=deterministic)
    if signature is not None:
        remember(_DESCRIBED, signature, problem)
    return problem


def _restored_by_checkpoint(generator) -> bool:
    """Whether ``torch.utils.checkpoint`` puts ``generator`` back before it recomputes a forward: the
    default generators, whose states it saves (``preserve_rng_state``), and no other."""
    if generator is None or generator is torch.default_generator:
        return True
    index = generator.device.index  # None for a generator made as torch.Generator("cuda")
    return (generator.device.type == "cuda" and torch.cuda.is_initialized() and index is not None
            and generator is torch.cuda.default_generators[index])


_CHECKPOINTED_GENERATOR = (
    "flashattn.attention was called with dropout and a generator of your own while autograd was running a "
    "backward, which is how torch.utils.checkpoint recomputes a forward: it does not restore that generator, "
    "so the recomputed forward would draw another dropout mask and the gradients would not be those of the "
    "output the loss saw. Pass seed= (the same for the first call and its recomputation) or leave "
    "generator=None (torch's default generator, which checkpoint restores)")


def dropout_seed(dropout_p, generator, seed) -> int:
    """The seed of this call's dropout mask: ``seed`` itself, or one draw from ``generator`` (torch's
    default CPU generator when None, so ``torch.manual_seed`` makes a run repeatable). A draw from a
    generator checkpoint does not restore is refused inside a backward (a recomputed forward)."""
    if dropout_p == 0:
        return 0
    if seed is not None:
        return int(seed)
    if torch._C._current_graph_task_id() != -1 and not _restored_by_checkpoint(generator):
        raise RuntimeError(_CHECKPOINTED_GENERATOR)
    device = generator.device if generator is not None else "cpu"
    return int(torch.randint(0, MAX_SEED, (), generator=generator, device=device, dtype=torch.int64))


# The defaults of dropout_p and softcap here and in flash_attn_func are the int 0, not 0.0: under
# torch.compile(dynamic=True) a float default becomes a graph input that every call builds a tensor for
# (docs/kernels/tuning-log.md#a-float-default-guarded-by-a-tensor-issue-11).
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False, scale: float | None = None,
              return_lse: bool = False, window: tuple[int | None, int | None] | None = None,
              softcap: float | None = None, alibi_slopes: torch.Tensor | None = None, dropout_p: float = 0,
              generator: torch.Generator | None = None, seed: int | None = None,
              sinks: torch.Tensor | None = None,
              deterministic: bool = True) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention, FlashAttention style: O(N) extra memory, exact result.

    Args:
        q: queries, shape (B, Hq, N, D), any strides.
        k: keys, shape (B, Hkv, M, D), with ``Hq % Hkv == 0`` (grouped-query attention).
        v: values (B, Hkv, M, D_v): k's shape, with a head dim D_v of their own where it differs from
            D (split head dims, e.g. D = 192 and D_v = 128); the output then has D_v columns.
        causal: bottom-right aligned causal mask: query ``i`` sees key ``j`` when ``j <= i + M - N``.
            For N == M this is ``is_causal=True`` of ``scaled_dot_product_attention``.
            A query that sees no key gets output 0 (and LSE -inf).
        scale: softmax scale; ``1 / sqrt(D)`` when None.
        return_lse: also return the natural-log log-sum-exp of each score row, shape (B, Hq, N),
            float32 (float64 for float64 inputs). It is differentiable: a loss that uses it sends
            dLSE_i * P_ij back to each score (what merging partial results needs).
        window: ``(left, right)`` sliding window: query ``i`` sees key ``j`` when
            ``i + M - N - left <= j <= i + M - N + right`` (bottom-right aligned like ``causal``;
            ``None`` on a side is unbounded). With ``causal=True`` the right side is at most 0. Key
            blocks wholly outside the window are never visited. A query whose window holds no key
            gets output 0, LSE -inf and zero gradient.
        softcap: ``c > 0`` caps each score s = scale * q . k to ``c * tanh(s / c)`` before the
            softmax (Gemma 2); 0 or None is off.
        alibi_slopes: float32 tensor (Hq,) or (B, Hq) on q's device: ``-slope * |i + M - N - j|`` is
            added to each (capped) score. The slopes get no gradient.
        dropout_p: probability of zeroing each entry of the softmax P before ``P V`` (the mask's
            draw resolves it to a multiple of 2^-16, rounding down); kept entries are scaled by
            ``1 / (1 - dropout_p)``, the LSE is that of the undropped scores. The mask is
            a pure function of the seed and (batch, head, i, j): the backward draws it again, and the
            same seed gives bitwise the same outputs and gradients. No train/eval switch: pass 0 to
            turn it off.
        generator: ``torch.Generator`` to draw the dropout seed from (one draw per call); torch's
            default CPU generator when None and no ``seed`` is given. Under
            ``torch.utils.checkpoint``, which recomputes the forward during the backward, use
            ``seed`` or the default generator (checkpoint restores its state): a call that would
            draw from another generator while autograd runs a backward raises ``RuntimeError``.
        seed: the dropout seed itself, an int in [0, 2**62); excludes ``generator``. Under
            ``torch.compile``, dropout needs an explicit ``seed``.
        sinks: attention sinks (gpt-oss): a floating-point tensor (Hq,) of per-head logits. Each joins
            every row's softmax denominator as one more score with no value, so the keys' weights sum
            to less than 1; the LSE counts it (a row with no key gets o = 0, LSE = the sink). It
            receives a gradient; composes with every other option.
        deterministic: True (the default): the backward gives bitwise the same gradients on every run.
            False permits a backward that sums dQ with floating-point atomic additions, whose order
            (and so dQ's last bits) varies between runs, to skip recomputing two of its seven products.
            The one built (the Hopper dK/dV kernel in Gluon at D = 128) measured slower than the
            deterministic kernels, so it runs only under ``flashattn._config.tuning(atomic_dq=True)``;
            False alone runs the deterministic kernels.

    Returns:
        ``o`` of the shape and dtype of ``q``, or ``(o, lse)`` when ``return_lse`` is set. Empty
        inputs are answered without a kernel: no batch, head or query gives empty outputs, and no key
        (M = 0) what a query that sees no key gets (output 0, LSE -inf, zero gradients).

    Gradients are first order: a backward run with ``create_graph=True`` gives the same gradients,
    and a second backward through those the Triton kernels computed raises ``RuntimeError`` (the
    reference path of float32 and float64 CPU inputs differentiates twice in eager mode, not under
    ``torch.compile``).

    CUDA tensors (float16, bfloat16) run the Triton kernels on their own device, whatever the current
    device is; inside ``torch.autocast`` (CUDA or CPU) float32 inputs run in the autocast dtype. CPU tensors
    run the tile-by-tile PyTorch reference, or the same Triton kernels under Triton's interpreter when
    ``TRITON_INTERPRET=1`` was set before triton was imported (float16 and bfloat16 only; float32 and
    float64 use the reference). Under ``torch.compile`` the call is the custom operator
    ``torch.ops.flashattn.attention_forward`` (:mod:`flashattn.custom_ops`), traced without a graph break.
    """
    q, k, v = autocast_inputs(q, k, v)
    if torch.compiler.is_compiling():
        # traced once per graph: the full checks, with no cache keyed by (symbolic) shapes
        window, softcap = _check_call(q, k, v, causal, scale, return_lse, window, softcap, alibi_slopes, dropout_p,
                                      deterministic)
        check_dropout_source(generator, seed)
        if dropout_p > 0 and seed is None:
            raise ValueError("under torch.compile, dropout needs an explicit seed= (a generator cannot be traced)")
        if alibi_slopes is not None:
            alibi_slopes = alibi_slopes.detach().contiguous()
        left, right = window if window is not None else (None, None)
        scale = None if scale is None else float(scale)  # None: the operator takes 1 / sqrt(D) itself
        # No dropout reaches the operator as the constant 0.0. Dynamo makes any other float it reads
        # (dropout_p's default included) a graph input, a tensor built from it on every call.
        dropout_p = float(dropout_p) if dropout_p != 0 else 0.0
        check_sinks(q, q.shape[1], sinks)
        o, lse = torch.ops.flashattn.attention_forward(
            q, k, v, causal, scale, -1 if left is None else left, -1 if right is None else right, softcap,
            alibi_slopes, dropout_p, int(seed) if dropout_p > 0 else 0,
            sinks=None if sinks is None else sinks.contiguous(), deterministic=deterministic)
    else:
        # Eager calls skip the operator dispatcher (tens of microseconds of a short call) and run the
        # same backends through an autograd.Function, or, when no gradient can flow (inference,
        # torch.no_grad), call the forward backend itself: autograd.Function.apply costs a short
        # call microseconds even when it records nothing.
        problem = _described(q, k, v, causal, scale, return_lse, window, softcap, alibi_slopes, dropout_p,
                             sinks is not None, deterministic)
        check_dropout_source(generator, seed)
        if alibi_slopes is not None:
            alibi_slopes = alibi_slopes.detach().contiguous()
        args = (q, k, v, problem, use_kernels(q), alibi_slopes, dropout_seed(problem.dropout_p, generator, seed))
        if sinks is not None:
            check_sinks(q, problem.heads_q, sinks)
            args += (None, None, sinks)
        o, lse = attend(*args)
    return (o, lse) if return_lse else o
