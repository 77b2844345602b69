"""Entry points with the ``flash_attn`` package's names, argument names and defaults, for code ported
from it: tensors are (B, N, H, D) (or packed (total, H, D)) instead of (B, H, N, D), and each call is
a thin conversion onto :func:`flashattn.attention` or :func:`flashattn.attention_varlen`.
"""

from __future__ import annotations

import torch

from flashattn.api import attention, is_int
from flashattn.decode import attention_with_kvcache
from flashattn.varlen import attention_varlen


def _window(window_size) -> tuple[int | None, int | None]:
    """flash_attn's ``window_size = (left, right)`` as :func:`attention` takes it: each side a Python
    int or a 0-d integer tensor (as upstream code passes them), or the pair as one 1-D integer tensor of two
    entries (as flash_attn's own tests draw it); any negative value unbounded (None)."""
    if isinstance(window_size, torch.Tensor) and window_size.dim() == 1 and window_size.shape[0] == 2:
        window_size = tuple(window_size.unbind(0))  # each side then passes as a 0-d tensor
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a (left, right) pair, -1 for unbounded, got {window_size!r}")
    sides = []
    for w in window_size:
        if isinstance(w, torch.Tensor) and w.dim() == 0 and not w.is_floating_point() and not w.is_complex() \
                and w.dtype != torch.bool:
            w = int(w.item())
        if not is_int(w):
            raise TypeError(f"window_size must hold ints or 0-d integer tensors (-1 for unbounded), got {window_size!r}")
        sides.append(None if w < 0 else int(w))
    return sides[0], sides[1]


def _shapes_as_passed(q, k, v) -> ValueError | None:
    """For a failed :func:`flash_attn_func` call: the error of the contract's check that prints shapes
    (k and v alike), in the (B, N, H, D) order the caller passed them (``attention`` saw them
    transposed), or None when that is not the fault."""
    if q.device == k.device == v.device and q.dtype == k.dtype == v.dtype and k.shape[:-1] != v.shape[:-1]:
        return ValueError(f"k and v must have the same shape (B, M, Hkv, D) but for the head dim, got k {tuple(k.shape)} "
                          f"and v {tuple(v.shape)}")
    return None


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0,
                    softmax_scale: float | None = None, causal: bool = False, window_size: tuple[int, int] = (-1, -1),
                    softcap: float = 0, alibi_slopes: torch.Tensor | None = None, deterministic: bool = True,
                    return_attn_probs: bool = False, *, generator: torch.Generator | None = None,
                    seed: int | None = None):
    """Drop-in for ``flash_attn.flash_attn_func``: tensors are (B, N, H, D) instead of (B, H, N, D).

    The arguments mean what they mean in FlashAttention 2: ``window_size = (left, right)`` with -1
    (any negative value) for an unbounded side, ``softcap`` 0 for off, ``alibi_slopes`` float32 (H,)
    or (B, H), ``dropout_p`` drawn with ``generator`` (torch's default CPU generator when None; pass
    ``dropout_p=0.0`` at evaluation) or from the explicit ``seed`` (what dropout needs under
    ``torch.compile``). See :func:`attention` for each, ``deterministic`` included: False permits a
    backward whose dQ differs in its last bits between runs (FlashAttention 2's default is False; this
    one's is True, so a call that does not ask gets the same bits every run). With
    ``return_attn_probs`` the
    result is ``(out, softmax_lse, None)``, the LSE shaped (B, H, N); flashattn never materializes
    the probabilities.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} must be a 4-D tensor (B, N, H, D), got {shape}")
    window = _window(window_size)
    # (B, N, H, D) viewed as (B, H, N, D): a transpose, no copy; the kernels take any strides.
    try:
        out, lse = attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal, scale=softmax_scale,
            return_lse=True, window=window, softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
            generator=generator, seed=seed, deterministic=deterministic,
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
                           alibi_slopes: torch.Tensor | None = None, deterministic: bool = True,
                           return_attn_probs: bool = False, block_table: torch.Tensor | None = None):
    """Drop-in for ``flash_attn.flash_attn_varlen_func``: the same packed layout and argument names.

    q (total_q, Hq, D), k and v (total_k, Hkv, D), int32 ``cu_seqlens`` of B + 1 entries; with
    ``block_table`` (B, max_pages) int32, k and v are a paged cache (num_pages, page_size, Hkv, D) and
    ``cu_seqlens_k`` counts each sequence's keys in its pages. ``window_size``, ``softcap``,
    ``alibi_slopes`` and ``dropout_p`` mean what they mean in :func:`flash_attn_func` and act inside each
    sequence (:func:`attention_varlen`). Packed sequences always take the deterministic kernels, so
    ``deterministic`` has no effect here. With ``return_attn_probs`` the result is ``(out, softmax_lse, None)``, the LSE
    (Hq, total_q); the probabilities are never materialized.
    """
    out, lse = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                                scale=softmax_scale, return_lse=True, window=_window(window_size), softcap=softcap,
                                alibi_slopes=alibi_slopes, dropout_p=dropout_p, block_table=block_table)
    return (out, lse, None) if return_attn_probs else out


# The packed forms: one tensor holds q, k and v (or k and v) along a dim of size 3 (or 2) before the
# heads, as a fused projection writes them; the slices are views, so gradients reach the packed tensor.
def _unpack(x: torch.Tensor, name: str, parts: int, dim: int) -> tuple[torch.Tensor, ...]:
    if not isinstance(x, torch.Tensor) or x.dim() <= dim or x.shape[dim] != parts:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        layout = {(3, 2): "(B, N, 3, H, D)", (2, 2): "(B, M, 2, Hkv, D)", (3, 1): "(total, 3, H, D)",
                  (2, 1): "(total_k, 2, Hkv, D)"}[(parts, dim)]
        raise ValueError(f"{name} must be {layout}, got {shape}")
    return x.unbind(dim)


def flash_attn_qkvpacked_func(qkv: torch.Tensor, dropout_p: float = 0, softmax_scale: float | None = None,
                              causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0,
                              alibi_slopes: torch.Tensor | None = None, deterministic: bool = True,
                              return_attn_probs: bool = False):
    """Drop-in for ``flash_attn.flash_attn_qkvpacked_func``: ``qkv`` (B, N, 3, H, D), the rest as
    :func:`flash_attn_func`."""
    q, k, v = _unpack(qkv, "qkv", 3, 2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q: torch.Tensor, kv: torch.Tensor, dropout_p: float = 0,
                             softmax_scale: float | None = None, causal: bool = False,
                             window_size: tuple[int, int] = (-1, -1), softcap: float = 0,
                             alibi_slopes: torch.Tensor | None = None, deterministic: bool = True,
                             return_attn_probs: bool = False):
    """Drop-in for ``flash_attn.flash_attn_kvpacked_func``: q (B, N, Hq, D), ``kv`` (B, M, 2, Hkv, D)."""
    k, v = _unpack(kv, "kv", 2, 2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                                     dropout_p: float = 0, softmax_scale: float | None = None, causal: bool = False,
                                     window_size: tuple[int, int] = (-1, -1), softcap: float = 0,
                                     alibi_slopes: torch.Tensor | None = None, deterministic: bool = True,
                                     return_attn_probs: bool = False):
    """Drop-in for ``flash_attn.flash_attn_varlen_qkvpacked_func``: ``qkv`` (total, 3, H, D) with one
    ``cu_seqlens`` for queries and keys."""
    q, k, v = _unpack(qkv, "qkv", 3, 1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q: torch.Tensor, kv: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                    cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                                    dropout_p: float = 0, softmax_scale: float | None = None, causal: bool = False,
                                    window_size: tuple[int, int] = (-1, -1), softcap: float = 0,
                                    alibi_slopes: torch.Tensor | None = None, deterministic: bool = True,
                                    return_attn_probs: bool = False):
    """Drop-in for ``flash_attn.flash_attn_varlen_kvpacked_func``: q (total_q, Hq, D), ``kv``
    (total_k, 2, Hkv, D)."""
    k, v = _unpack(kv, "kv", 2, 1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def flash_attn_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                            rotary_cos: torch.Tensor | None = None, rotary_sin: torch.Tensor | None = None,
                            cache_seqlens: torch.Tensor | int | None = None,
                            cache_batch_idx: torch.Tensor | None = None, cache_leftpad: torch.Tensor | None = None,
                            block_table: torch.Tensor | None = None, softmax_scale: float | None = None,
                            causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0,
                            rotary_interleaved: bool = True, alibi_slopes: torch.Tensor | None = None,
                            num_splits: int = 0, return_softmax_lse: bool = False):
    """Drop-in for ``flash_attn.flash_attn_with_kvcache``, with its argument names and defaults (note
    ``causal=False``, where :func:`flashattn.attention_with_kvcache` defaults to True).

    ``k``, ``v`` are appended in place at ``cache_seqlens``; ``cache_seqlens`` None means every
    sequence holds the whole (contiguous) cache, with nothing to append; ``num_splits`` 0 lets
    flashattn choose. Rotary embedding, ``cache_batch_idx``, ``cache_leftpad``, ``window_size``,
    ``softcap`` and ``alibi_slopes`` mean what they mean in flash_attn
    (:func:`flashattn.attention_with_kvcache` says how each is applied). Returns ``out`` (B, Nq, Hq, D),
    or ``(out, softmax_lse)`` with the LSE (B, Hq, Nq).
    """
    if not is_int(num_splits) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0: chosen by flashattn), got {num_splits!r}")
    if cache_seqlens is None:
        if block_table is not None or k is not None:
            raise ValueError("cache_seqlens is needed with a paged cache (block_table) or keys to append (k, v): "
                             "how many keys each sequence holds")
        cache_seqlens = k_cache.shape[1]  # every sequence holds the whole cache
    return attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, k_new=k, v_new=v,
                                  causal=causal, scale=softmax_scale, block_table=block_table,
                                  num_splits=num_splits or None, return_lse=return_softmax_lse,
                                  window=_window(window_size), softcap=softcap, alibi_slopes=alibi_slopes,
                                  rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
                                  cache_leftpad=cache_leftpad, cache_batch_idx=cache_batch_idx)
