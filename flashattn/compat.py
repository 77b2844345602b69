"""Entry points with the ``flash_attn`` package's names, argument names and defaults, for code ported
from it: tensors are (B, N, H, D) (or packed (total, H, D)) instead of (B, H, N, D), and each call is
a thin conversion onto :func:`flashattn.attention` or :func:`flashattn.attention_varlen`.
"""

from __future__ import annotations

import torch

from flashattn.api import attention, is_int
from flashattn.varlen import attention_varlen


def _shapes_as_passed(q, k, v) -> ValueError | None:
    """For a failed :func:`flash_attn_func` call: the error of the contract's check that prints shapes
    (k and v alike), in the (B, N, H, D) order the caller passed them (``attention`` saw them
    transposed), or None when that is not the fault."""
    if q.device == k.device == v.device and q.dtype == k.dtype == v.dtype and k.shape != v.shape:
        return ValueError(f"k and v must have the same shape (B, M, Hkv, D), got k {tuple(k.shape)} and v {tuple(v.shape)}")
    return None


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0,
                    softmax_scale: float | None = None, causal: bool = False, window_size: tuple[int, int] = (-1, -1),
                    softcap: float = 0, alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                    return_attn_probs: bool = False, *, generator: torch.Generator | None = None,
                    seed: int | None = None):
    """Drop-in for ``flash_attn.flash_attn_func``: tensors are (B, N, H, D) instead of (B, H, N, D).

    The arguments mean what they mean in FlashAttention 2: ``window_size = (left, right)`` with -1
    (any negative value) for an unbounded side, ``softcap`` 0 for off, ``alibi_slopes`` float32 (H,)
    or (B, H), ``dropout_p`` drawn with ``generator`` (torch's default CPU generator when None; pass
    ``dropout_p=0.0`` at evaluation) or from the explicit ``seed`` (what dropout needs under
    ``torch.compile``). See :func:`attention` for each. The kernels are always
    deterministic, so ``deterministic`` is accepted and has no effect. With ``return_attn_probs`` the
    result is ``(out, softmax_lse, None)``, the LSE shaped (B, H, N); flashattn never materializes
    the probabilities.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} must be a 4-D tensor (B, N, H, D), got {shape}")
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a (left, right) pair, -1 for unbounded, got {window_size!r}")
    for w in window_size:
        if not is_int(w):
            raise TypeError(f"window_size must hold ints (-1 for unbounded), got {window_size!r}")
    window = tuple(None if w < 0 else int(w) for w in window_size)
    # (B, N, H, D) viewed as (B, H, N, D): a transpose, no copy; the kernels take any strides.
    try:
        out, lse = attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal, scale=softmax_scale,
            return_lse=True, window=window, softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
            generator=generator, seed=seed,
        )
    except ValueError:
        restated = _shapes_as_passed(q, k, v)
        if restated is None:
            raise
        raise restated from None
    out = out.transpose(1, 2)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0,
                           softmax_scale: float | None = None, causal: bool = False,
                           window_size: tuple[int, int] = (-1, -1), softcap: float = 0,
                           alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                           return_attn_probs: bool = False, block_table: torch.Tensor | None = None):
    """Drop-in for ``flash_attn.flash_attn_varlen_func``: the same packed layout and argument names.

    q (total_q, Hq, D), k and v (total_k, Hkv, D), int32 ``cu_seqlens`` of B + 1 entries. Options
    flashattn does not implement yet (``dropout_p`` other than 0, a ``window_size`` other than
    (-1, -1), ``softcap``, ``alibi_slopes``, ``block_table``) raise ``NotImplementedError``. The
    kernels are always deterministic, so ``deterministic`` has no effect. With ``return_attn_probs``
    the result is ``(out, softmax_lse, None)``, the LSE (Hq, total_q); the probabilities are never
    materialized.
    """
    if dropout_p != 0.0:
        raise NotImplementedError(f"dropout_p must be 0.0: flashattn's varlen path has no dropout yet, got {dropout_p}")
    if tuple(window_size) != (-1, -1):
        raise NotImplementedError(f"window_size must be (-1, -1): no sliding window yet, got {tuple(window_size)}")
    if softcap != 0.0:
        raise NotImplementedError(f"softcap must be 0.0: no softcapping yet, got {softcap}")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes must be None: no ALiBi yet")
    if block_table is not None:
        raise NotImplementedError("block_table must be None: a paged KV cache is flashattn.attention_with_kvcache's")
    out, lse = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                                scale=softmax_scale, return_lse=True)
    return (out, lse, None) if return_attn_probs else out
