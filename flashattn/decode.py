"""Decoding against a KV cache: :func:`attention_with_kvcache`, forward only.

Layout of ``flash_attn.flash_attn_with_kvcache`` (heads after the sequence dimension):

* ``q``: (B, Nq, Hq, D), the new queries of each sequence (Nq = 1 for plain decoding);
* ``k_cache``, ``v_cache``: (B, Mmax, Hkv, D), or a **paged** cache (num_pages, page_size, Hkv, D) with
  ``block_table`` (B, max_pages) int32, whose row b lists the pages of sequence b in order;
* ``cache_seqlens``: (B,) int32 (or one Python int for all): the keys each sequence already holds;
* ``k_new``, ``v_new``: (B, Nnew, Hkv, D), written **in place** into the cache at positions
  ``cache_seqlens[b] .. cache_seqlens[b] + Nnew - 1`` (through the block table when paged).

Sequence b then attends to its first ``L_b = cache_seqlens[b] + Nnew`` keys. Validation happens here,
before anything is written or launched; this module does not import Triton (the kernels in
:mod:`flashattn.decode_kernels` are imported at the first call that runs them).
"""

from __future__ import annotations


import torch

from flashattn import reference
from flashattn.api import check_dtype_for_device, check_flag, check_scale, check_sinks, check_variants, is_int
from flashattn.autograd import launchers, use_kernels, with_sinks
from flashattn.problem import Problem
from flashattn.rotary import apply_rotary
from flashattn.varlen import attention_varlen, cached_key_rows

MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256


def _check_tensor(name, x, dims, layout):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D {layout}, got shape {tuple(x.shape)}")


def _validate(q, k_cache, v_cache, cache_seqlens, k_new, v_new, causal, scale, block_table, num_splits,
              return_lse, cache_batch_idx=None) -> Problem:
    _check_tensor("q", q, 4, "(B, Nq, Hq, D)")
    paged = block_table is not None
    cache_layout = "(num_pages, page_size, Hkv, D)" if paged else "(B, Mmax, Hkv, D)"
    _check_tensor("k_cache", k_cache, 4, cache_layout)
    _check_tensor("v_cache", v_cache, 4, cache_layout)
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"q, k_cache and v_cache must share one dtype, got q {q.dtype}, "
                        f"k_cache {k_cache.dtype}, v_cache {v_cache.dtype}")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if x.device != q.device:
            raise ValueError(f"{name} must be on the device of q ({q.device}), got {x.device}")
    check_dtype_for_device(q, "q, k_cache, v_cache")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    batch, n_q, h_q, d = q.shape
    h_kv, d_k = k_cache.shape[2], k_cache.shape[3]
    if batch == 0 or n_q == 0 or h_q == 0:
        raise ValueError(f"q needs at least one batch, query and head, got shape {tuple(q.shape)}")
    if d_k != d:
        raise ValueError(f"k_cache and v_cache must have the head dim D of q ({d}), got {d_k}")
    if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head dim D of q and the cache must be between {MIN_HEAD_DIM} and {MAX_HEAD_DIM}, got {d}")
    if h_kv == 0 or h_q % h_kv != 0:
        raise ValueError(f"the number of query heads of q ({h_q}) must be a multiple of the number of "
                         f"key/value heads of k_cache ({h_kv})")

    if paged:
        _check_tensor("block_table", block_table, 2, "(B, max_pages)")
        if block_table.dtype != torch.int32:
            raise TypeError(f"block_table must be int32, got {block_table.dtype}")
        if block_table.device != q.device:
            raise ValueError(f"block_table must be on the device of q ({q.device}), got {block_table.device}")
        if block_table.shape[0] != batch:
            raise ValueError(f"block_table must have one row per sequence (B = {batch}), got {block_table.shape[0]}")
        page_size = k_cache.shape[1]
        if page_size == 0 or k_cache.shape[0] == 0:
            raise ValueError(f"a paged k_cache needs at least one page of at least one slot, got {tuple(k_cache.shape)}")
        capacity = block_table.shape[1] * page_size
    else:
        if k_cache.shape[0] != batch and cache_batch_idx is None:
            raise ValueError(f"k_cache and v_cache must have the batch size of q ({batch}), got {k_cache.shape[0]} "
                             "(a paged cache needs block_table)")
        page_size, capacity = 0, k_cache.shape[1]

    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new must be given together (both or neither)")
    n_new = 0
    if k_new is not None:
        for name, x in (("k_new", k_new), ("v_new", v_new)):
            _check_tensor(name, x, 4, "(B, Nnew, Hkv, D)")
            if x.dtype != q.dtype:
                raise TypeError(f"{name} must have the dtype of q ({q.dtype}), got {x.dtype}")
            if x.device != q.device:
                raise ValueError(f"{name} must be on the device of q ({q.device}), got {x.device}")
        if k_new.shape != v_new.shape:
            raise ValueError(f"k_new and v_new must have the same shape, got {tuple(k_new.shape)} and {tuple(v_new.shape)}")
        if k_new.shape[0] != batch or k_new.shape[2] != h_kv or k_new.shape[3] != d:
            raise ValueError(f"k_new and v_new must be (B, Nnew, Hkv, D) = ({batch}, Nnew, {h_kv}, {d}), "
                             f"got {tuple(k_new.shape)}")
        n_new = k_new.shape[1]

    if is_int(cache_seqlens):
        if not 0 <= cache_seqlens <= capacity - n_new:
            raise ValueError(f"cache_seqlens ({cache_seqlens}) + Nnew ({n_new}) must lie in [0, {capacity}], "
                             "the capacity of the cache")
    elif isinstance(cache_seqlens, torch.Tensor):
        if cache_seqlens.dtype != torch.int32:
            raise TypeError(f"cache_seqlens must be int32, got {cache_seqlens.dtype}")
        if cache_seqlens.shape != (batch,):
            raise ValueError(f"cache_seqlens must have shape (B,) = ({batch},), got {tuple(cache_seqlens.shape)}")
        if cache_seqlens.device != q.device:
            raise ValueError(f"cache_seqlens must be on the device of q ({q.device}), got {cache_seqlens.device}")
    else:
        raise TypeError(f"cache_seqlens must be an int32 tensor of shape (B,) or an int, got {type(cache_seqlens).__name__}")

    check_flag("causal", causal)
    check_flag("return_lse", return_lse)
    check_scale(scale)
    if num_splits is not None:
        if not is_int(num_splits):
            raise TypeError(f"num_splits must be an int or None, got {type(num_splits).__name__}")
        if not 1 <= num_splits <= 65535:
            raise ValueError(f"num_splits must be between 1 and 65535, got {num_splits}")
    if torch.is_grad_enabled():
        for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k_new", k_new), ("v_new", v_new)):
            if x is not None and x.requires_grad:
                raise ValueError(f"attention_with_kvcache is forward only (no gradients), but {name} requires grad; "
                                 "call it under torch.no_grad() or torch.inference_mode()")
    return Problem.cache(q, k_cache, capacity, causal, scale, page_size=page_size, n_new=n_new)


def _check_lengths(seq_lens: torch.Tensor, block_table, p: Problem, num_pages: int, cache_leftpad=None,
                   cache_batch_idx=None, entries: int = 0, rotary_rows: int = 0):
    """The checks that need the lengths' values: one small reduction and one device sync.

    Skipped while a CUDA graph is being captured (a sync is not allowed there); a graph's inputs
    are checked by the eager call that warms it up.
    """
    if seq_lens.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    lengths = seq_lens.long() + p.n_new
    stats = [seq_lens.min(), lengths.max()]
    if block_table is not None:
        used = torch.arange(block_table.shape[1], device=seq_lens.device)[None, :] * p.page_size < lengths[:, None]
        stats.append((((block_table < 0) | (block_table >= num_pages)) & used).sum())
    else:
        stats.append(seq_lens.new_zeros(()))
    stats.append(((cache_leftpad < 0) | (cache_leftpad > seq_lens)).sum() if cache_leftpad is not None
                 else seq_lens.new_zeros(()))
    stats.append(((cache_batch_idx < 0) | (cache_batch_idx >= entries)).sum() if cache_batch_idx is not None
                 else seq_lens.new_zeros(()))
    # the last rotary position: cache_seqlens + max(Nq, Nnew) - 1
    stats.append((seq_lens.long() + max(p.n, p.n_new) > rotary_rows).sum() if rotary_rows else seq_lens.new_zeros(()))
    values = torch.stack([x.long() for x in stats]).tolist()
    if values[0] < 0:
        raise ValueError(f"cache_seqlens must be non-negative, got a minimum of {values[0]}")
    if values[1] > p.m:
        raise ValueError(f"cache_seqlens + Nnew ({values[1]} at most) must not exceed the capacity of the cache "
                         f"({p.m} keys{' = max_pages * page_size' if block_table is not None else ' = Mmax'})")
    if block_table is not None and values[2]:
        raise ValueError(f"block_table has {values[2]} entries outside [0, {num_pages}) among the pages the sequences use")
    if values[3]:
        raise ValueError("cache_leftpad must lie in [0, cache_seqlens[b]] for every sequence")
    if values[4]:
        raise ValueError(f"cache_batch_idx must lie in [0, {entries}), the cache's entries")
    if values[5]:
        raise ValueError(f"rotary_cos has {rotary_rows} rows, fewer than the positions the call rotates "
                         "(up to cache_seqlens + max(Nq, Nnew) - 1)")


# --8<-- [start:decode-append]
def _append(k_cache, v_cache, seq_lens, k_new, v_new, block_table, cache_batch_idx=None):
    """Write k_new[b, t], v_new[b, t] at position seq_lens[b] + t of sequence b, in place: the append
    of the PyTorch path (CPU tensors outside the interpreter; the kernels' path has a kernel for it).

    One scatter per cache (``index_put_``); a paged cache maps the position to (page, slot) through
    the block table first.
    """
    batch, n_new = k_new.shape[:2]
    pos = seq_lens.long()[:, None] + torch.arange(n_new, device=seq_lens.device)  # (B, Nnew)
    if block_table is None:
        entry = cache_batch_idx.long() if cache_batch_idx is not None else torch.arange(batch, device=seq_lens.device)
        index = (entry[:, None].expand(batch, n_new), pos)
    else:
        page_size = k_cache.shape[1]
        index = (block_table.long().gather(1, pos // page_size), pos % page_size)
    k_cache.index_put_(index, k_new)
    v_cache.index_put_(index, v_new)
# --8<-- [end:decode-append]


def _check_index(name, x, batch, device):
    if x is None:
        return
    if not isinstance(x, torch.Tensor) or x.dtype != torch.int32 or tuple(x.shape) != (batch,):
        raise TypeError(f"{name} must be an int32 tensor of shape (B,) = ({batch},)")
    if x.device != device:
        raise ValueError(f"{name} must be on the device of q ({device}), got {x.device}")


def _validate_extras(q, block_table, window, softcap, alibi_slopes, sinks, rotary_cos, rotary_sin, rotary_interleaved,
                     cache_leftpad, cache_batch_idx):
    """The options beyond the split-KV kernels' own: variants, sinks, rotary, left padding, batch index."""
    batch, _, h_q, d = q.shape
    window, softcap = check_variants(q, batch, h_q, window, softcap, alibi_slopes, 0.0)
    if window == (None, None):  # unbounded on both sides: no window
        window = None
    check_sinks(q, h_q, sinks)
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together (both or neither)")
    if rotary_cos is not None:
        for name, x in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
                raise TypeError(f"{name} must be a 2-D floating-point tensor (seqlen_ro, rotary_dim / 2)")
            if x.device != q.device:
                raise ValueError(f"{name} must be on the device of q ({q.device}), got {x.device}")
        if rotary_cos.shape != rotary_sin.shape:
            raise ValueError(f"rotary_cos and rotary_sin must have one shape, got {tuple(rotary_cos.shape)} and "
                             f"{tuple(rotary_sin.shape)}")
        if not 0 < 2 * rotary_cos.shape[1] <= d:
            raise ValueError(f"rotary_dim = 2 * rotary_cos.shape[1] must be in (0, D = {d}], got {2 * rotary_cos.shape[1]}")
    check_flag("rotary_interleaved", rotary_interleaved)
    _check_index("cache_leftpad", cache_leftpad, batch, q.device)
    _check_index("cache_batch_idx", cache_batch_idx, batch, q.device)
    if block_table is not None and (cache_leftpad is not None or cache_batch_idx is not None):
        raise ValueError("cache_leftpad and cache_batch_idx index a (B, Mmax, Hkv, D) cache: not with a block_table")
    return window, softcap


def _positions(start: torch.Tensor, n: int, same: bool) -> torch.Tensor:
    """(B, n) rotary positions: start[b] + t, or start[b] for every t when ``same``."""
    steps = torch.zeros(n, dtype=torch.long, device=start.device) if same else torch.arange(n, device=start.device)
    return start.long()[:, None] + steps


def _outputs(o, lse, sinks, return_lse: bool):
    """The call's result: ``o`` (B, Nq, Hq, D) and ``lse`` (B, Hq, Nq) with the sinks joined (a decoding
    step's few rows, by :func:`flashattn.autograd.with_sinks`), o alone unless ``return_lse``."""
    if sinks is not None:
        o_heads, lse = with_sinks(o.transpose(1, 2), lse, sinks, packed=False)
        o = o_heads.transpose(1, 2)
    return (o, lse) if return_lse else o


# --8<-- [start:decode-general]
def _attend_gathered(q, k_cache, v_cache, seq_lens, k_new, v_new, block_table, p: Problem, variants: dict,
                     cache_leftpad, cache_batch_idx):
    """The KV-cache call with options the split-KV kernels lack (a window, softcap, ALiBi, left padding,
    a batch index): append, then gather each sequence's keys (rows ``cache_leftpad[b] .. L_b`` of its
    cache entry or pages) into packed k, v and run the packed-sequence kernels
    (:func:`flashattn.attention_varlen`) with q as B sequences of Nq rows. One copy of the keys used and
    one host sync for the totals; ``(o (B, Nq, Hq, D), lse (B, Hq, Nq))``."""
    batch, n_q, h_q, d = q.shape
    device = q.device
    if p.n_new:
        _append(k_cache, v_cache, seq_lens, k_new, v_new, block_table, cache_batch_idx)
    ends = seq_lens.long() + p.n_new
    starts = cache_leftpad.long() if cache_leftpad is not None else torch.zeros_like(ends)
    counts = ends - starts
    cu_k = torch.nn.functional.pad(torch.cumsum(counts, 0), (1, 0))
    total, longest, shortest = torch.stack([cu_k[-1], counts.max(), counts.min()]).tolist()
    if shortest < 0:
        raise ValueError("cache_leftpad must not exceed cache_seqlens + Nnew")
    rows = cached_key_rows(cu_k, total, k_cache.shape[1], block_table, starts, cache_batch_idx)
    k = k_cache.flatten(0, 1).index_select(0, rows)
    v = v_cache.flatten(0, 1).index_select(0, rows)
    cu_q = torch.arange(0, (batch + 1) * n_q, n_q, dtype=torch.int32, device=device)
    o, lse = attention_varlen(q.reshape(batch * n_q, h_q, d), k, v, cu_q, cu_k.to(torch.int32), n_q, int(longest),
                              causal=p.causal, scale=p.scale, return_lse=True, validate=False, **variants)
    return o.view(batch, n_q, h_q, d), lse.view(h_q, batch, n_q).transpose(0, 1)
# --8<-- [end:decode-general]


def attention_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                           cache_seqlens: torch.Tensor | int, k_new: torch.Tensor | None = None,
                           v_new: torch.Tensor | None = None, causal: bool = True, scale: float | None = None,
                           block_table: torch.Tensor | None = None, num_splits: int | None = None,
                           return_lse: bool = False, window: tuple[int | None, int | None] | None = None,
                           softcap: float | None = None, alibi_slopes: torch.Tensor | None = None,
                           sinks: torch.Tensor | None = None, rotary_cos: torch.Tensor | None = None,
                           rotary_sin: torch.Tensor | None = None, rotary_interleaved: bool = False,
                           cache_leftpad: torch.Tensor | None = None,
                           cache_batch_idx: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of a few new queries against a KV cache, appending new keys first. Forward only.

    Args:
        q: (B, Nq, Hq, D) queries (the layout of ``flash_attn_with_kvcache``; any strides).
        k_cache: (B, Mmax, Hkv, D), or (num_pages, page_size, Hkv, D) with ``block_table``.
            ``Hq % Hkv == 0``. Any strides. Modified in place when ``k_new`` is given.
        v_cache: like ``k_cache``.
        cache_seqlens: (B,) int32 tensor on q's device, or an int: keys already in each sequence.
        k_new: optional (B, Nnew, Hkv, D) keys to append before attending.
        v_new: the values that go with ``k_new``.
        causal: bottom-right within each sequence: query i sees key j when ``j <= i + L_b - Nq``, with
            ``L_b = cache_seqlens[b] + Nnew``. Without it every query sees all ``L_b`` keys.
        scale: softmax scale, ``1 / sqrt(D)`` when None.
        block_table: (B, max_pages) int32; row b lists the pages of sequence b. Any page size.
        num_splits: how many programs share one sequence's keys; chosen from the problem size and
            the SM count when None.
        return_lse: also return the natural-log log-sum-exp, float32 (float64 for float64 inputs), shape
            (B, Hq, Nq).
        window: as in :func:`flashattn.attention`, within each sequence's ``L_b`` keys (bottom-right:
            the window ends on query i's key ``i + L_b - Nq``).
        softcap: as in :func:`flashattn.attention`.
        alibi_slopes: as in :func:`flashattn.attention`, distances within each sequence.
        sinks: per-head sink logits (Hq,), as in :func:`flashattn.attention`.
        rotary_cos: (seqlen_ro, R / 2) cosines (:mod:`flashattn.rotary`): the first R dims of k_new are
            rotated at positions ``cache_seqlens[b] + t`` (the rows they are written to, left padding
            included) before they are appended, and q's at the same positions when causal or windowed,
            else all at ``cache_seqlens[b]`` (flash_attn's convention, as its own tests check it).
        rotary_sin: the sines that go with ``rotary_cos``.
        rotary_interleaved: rotate pairs (2i, 2i + 1) instead of (i, i + R/2).
        cache_leftpad: (B,) int32: sequence b's keys start at row ``cache_leftpad[b]`` of its cache
            entry (rows before it are padding). Not with a block table.
        cache_batch_idx: (B,) int32: sequence b reads and appends to cache entry ``cache_batch_idx[b]``
            (the cache may hold more entries than B). Not with a block table.

    Returns:
        ``o`` (B, Nq, Hq, D) in q's dtype, or ``(o, lse)``. A query that sees no key (an empty
        sequence, or causal rows before the first key) gets o = 0 and lse = -inf.

    No gradients: with grad mode on, inputs that require grad raise ``ValueError``. A tensor
    ``cache_seqlens`` and the ``block_table`` entries the sequences use are checked against the
    cache's capacity and page pool with one device sync (skipped during CUDA graph capture). An int
    ``cache_seqlens`` is checked on the host with no sync; its block table then only where the table
    is a CPU tensor: on a GPU its entries are the caller's to keep inside the pool. CUDA tensors run
    the Triton split-KV kernels; CPU tensors run the PyTorch reference, or the kernels under
    ``TRITON_INTERPRET=1`` (float16 and bfloat16).
    """
    p = _validate(q, k_cache, v_cache, cache_seqlens, k_new, v_new, causal, scale, block_table, num_splits,
                  return_lse, cache_batch_idx)
    window, softcap = _validate_extras(q, block_table, window, softcap, alibi_slopes, sinks, rotary_cos, rotary_sin,
                                       rotary_interleaved, cache_leftpad, cache_batch_idx)
    general = (window is not None or softcap or alibi_slopes is not None or cache_leftpad is not None
               or cache_batch_idx is not None)
    checked = False
    if rotary_cos is not None or general:
        seq_lens = (torch.full((p.batch,), int(cache_seqlens), dtype=torch.int32, device=q.device)
                    if is_int(cache_seqlens) else cache_seqlens)
        rotary_rows = 0 if rotary_cos is None else rotary_cos.shape[0]
        if general or not is_int(cache_seqlens):  # one sync checks the lengths, the options and the table
            _check_lengths(seq_lens, block_table, p, k_cache.shape[0], cache_leftpad, cache_batch_idx,
                           k_cache.shape[0] if block_table is None else 0, rotary_rows)
            checked = True
        elif int(cache_seqlens) + max(p.n, p.n_new) > rotary_rows:  # an int: checked on the host
            raise ValueError(f"rotary_cos has {rotary_rows} rows, fewer than the positions the call rotates "
                             f"(up to cache_seqlens + max(Nq, Nnew) - 1 = {int(cache_seqlens) + max(p.n, p.n_new) - 1})")
        if rotary_cos is not None:
            start = seq_lens  # the cache rows the new keys land in: absolute, left padding included
            same = not (causal or window is not None)
            q = apply_rotary(q, rotary_cos, rotary_sin, _positions(start, p.n, same), rotary_interleaved)
            if k_new is not None:
                k_new = apply_rotary(k_new, rotary_cos, rotary_sin, _positions(start, p.n_new, False),
                                     rotary_interleaved)
        if general:
            variants = dict(window=window, softcap=softcap, alibi_slopes=alibi_slopes)
            o, lse = _attend_gathered(q, k_cache, v_cache, seq_lens, k_new, v_new, block_table, p, variants,
                                      cache_leftpad, cache_batch_idx)
            return _outputs(o, lse, sinks, return_lse)
    if num_splits is not None:
        num_splits = int(num_splits)  # an integral type of numpy's, say: the launchers take Python ints
    kernels = use_kernels(q)
    if is_int(cache_seqlens):
        cache_seqlens = int(cache_seqlens)
        max_keys = cache_seqlens + p.n_new  # known on the host: no sync, and the splits fit it
        if block_table is not None and not block_table.is_cuda:  # the tensor path's checks: on a GPU a sync
            _check_lengths(torch.full((p.batch,), cache_seqlens, dtype=torch.int32), block_table, p, k_cache.shape[0])
        # the kernels take the int as it is (no tensor to fill per call); the reference wants a tensor
        seq_lens = cache_seqlens if kernels else torch.full((p.batch,), cache_seqlens, dtype=torch.int32)
    else:
        seq_lens = cache_seqlens
        if not checked:
            _check_lengths(seq_lens, block_table, p, k_cache.shape[0])
        max_keys = p.m
    if kernels:
        # the append (when k_new is given) and the attention, in one launcher call
        _, _, decode_kernels, tensors = launchers()
        with tensors.on_device(q):  # Triton launches on the current device: the inputs'
            o, lse = decode_kernels.launch_decode(q, k_cache, v_cache, seq_lens, k_new, v_new, block_table, p, max_keys,
                                                  num_splits)
    else:
        if p.n_new:
            _append(k_cache, v_cache, seq_lens, k_new, v_new, block_table)
        # the cache now holds the new keys: attend to the first L_b of them, in float32 or float64
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        lengths = (seq_lens.long() + p.n_new).cpu()
        o, lse, _, _ = reference.kvcache_attention_reference(
            q.to(acc), k_cache.to(acc), v_cache.to(acc), lengths, causal=p.causal, scale=p.scale,
            block_table=block_table)
        o = o.to(q.dtype)
    return _outputs(o, lse, sinks, return_lse)
