"""Packed variable-length batches: :func:`attention_varlen` and the ``flash_attn``-style
:func:`flash_attn_varlen_func`.

Training pipelines pack sequences of different lengths one after the other, with no padding, and pass
their boundaries as cumulative lengths: sequence ``i`` holds rows ``cu_seqlens_q[i] : cu_seqlens_q[i + 1]``
of q and ``cu_seqlens_k[i] : cu_seqlens_k[i + 1]`` of k and v, and attends to nothing else. The kernels
launch one program per tile of a sequence (:func:`flashattn.schedule.packed_tile`), so the cost follows
the sum of ``N_i * M_i``, never ``B * max(N)^2``. Validation happens here, before anything is launched;
this module does not import Triton.
"""

from __future__ import annotations


import torch

from flashattn.api import (MAX_HEAD_DIM, MIN_HEAD_DIM, autocast_inputs, check_dropout_source, check_dtype_for_device,
                           check_flag, check_scale, check_sinks, check_tensors, check_variants, dropout_seed, is_int)
from flashattn.autograd import attend, use_kernels
from flashattn.problem import Problem


def _check_tensors(q, k, v):
    check_tensors(q, k, v, "(total_q, Hq, D)", "(total_k, Hkv, D)")
    _, h_q, d = q.shape
    _, h_kv, d_k = k.shape
    if d_k != d:
        raise ValueError(f"k and v must have the head dim D of q ({d}), got {d_k}")
    if h_q == 0 or h_kv == 0 or h_q % h_kv != 0:
        raise ValueError(f"the number of query heads ({h_q}) must be a positive multiple of the number of "
                         f"key/value heads of k and v ({h_kv})")
    if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head dim D of q, k, v must be between {MIN_HEAD_DIM} and {MAX_HEAD_DIM}, got {d}")
    check_dtype_for_device(q, "q, k, v")


def _check_cu_seqlens(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """Everything that the shapes, dtypes and devices tell, without reading a value."""
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be an int32 torch.Tensor, got {type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {cu.dtype}")
        if cu.dim() != 1 or cu.shape[0] < 2:
            raise ValueError(f"{name} must be 1-D with B + 1 >= 2 entries (0, then the cumulative lengths), "
                             f"got shape {tuple(cu.shape)}")
        if cu.device != q.device:
            raise ValueError(f"{name} must be on the device of q ({q.device}), got {cu.device}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have one entry per sequence boundary each (B + 1), "
                         f"got {cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not is_int(value):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")


def _check_cu_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """The checks that need the values: starts at 0, never decreases, ends at the total, and no sequence
    longer than its max_seqlen. Computed with torch ops on the tensors' device and read back at once:
    one host sync for a CUDA tensor (none on the CPU)."""
    facts = []
    for cu, total, longest in ((cu_seqlens_q, q.shape[0], max_seqlen_q), (cu_seqlens_k, k.shape[0], max_seqlen_k)):
        lengths = cu[1:] - cu[:-1]
        facts += [cu[0], lengths.min(), cu[-1], lengths.max()]
    first_q, shortest_q, last_q, longest_q, first_k, shortest_k, last_k, longest_k = torch.stack(facts).tolist()
    for name, side, first, shortest, last, longest, total, bound in (
        ("cu_seqlens_q", "q", first_q, shortest_q, last_q, longest_q, q.shape[0], max_seqlen_q),
        ("cu_seqlens_k", "k", first_k, shortest_k, last_k, longest_k, k.shape[0], max_seqlen_k),
    ):
        if first != 0:
            raise ValueError(f"{name} must start at 0, got {first}")
        if shortest < 0:
            raise ValueError(f"{name} must be non-decreasing (no negative length), got a length of {shortest}")
        if last != total:
            raise ValueError(f"{name} must end at the number of rows of {side} ({total}), got {last}")
        if longest > bound:
            raise ValueError(f"max_seqlen_{side} ({bound}) is smaller than the longest sequence of {name} ({longest})")


def _check_block_table(k, v, block_table, cu_seqlens_k, max_seqlen_k):
    """A paged K/V: k and v (num_pages, page_size, Hkv, D) and a block table (B, max_pages) int32 on
    their device whose rows hold at least max_seqlen_k keys."""
    for name, x in (("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"with a block_table, {name} must be a paged cache (num_pages, page_size, Hkv, D), got {shape}")
    if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2:
        raise TypeError("block_table must be a 2-D int32 torch.Tensor (B, max_pages)")
    if block_table.device != k.device:
        raise ValueError(f"block_table must be on the device of k ({k.device}), got {block_table.device}")
    if isinstance(cu_seqlens_k, torch.Tensor) and block_table.shape[0] != cu_seqlens_k.shape[0] - 1:
        raise ValueError(f"block_table must have one row per sequence ({cu_seqlens_k.shape[0] - 1}), "
                         f"got {block_table.shape[0]}")
    if k.shape[0] == 0 or k.shape[1] == 0:
        raise ValueError(f"a paged k needs at least one page of at least one slot, got {tuple(k.shape)}")
    if is_int(max_seqlen_k) and block_table.shape[1] * k.shape[1] < max_seqlen_k:
        raise ValueError(f"block_table holds {block_table.shape[1]} pages of {k.shape[1]} keys per sequence, "
                         f"fewer than max_seqlen_k = {max_seqlen_k}")


def cached_key_rows(cu_k: torch.Tensor, total: int, rows_per_entry: int, block_table=None, starts=None,
                    entries=None) -> torch.Tensor:
    """For each of the ``total`` packed keys of sequences bounded by ``cu_k``, the row of the flattened
    cache that holds it: key j of sequence b sits at position ``p = starts[b] + j`` (starts 0 when None)
    of its cache entry, slot ``p % page_size`` of page ``block_table[b, p // page_size]`` of a paged
    cache (``rows_per_entry`` = page_size), else row ``entries[b] * Mmax + p`` of a (B, Mmax) cache
    (``rows_per_entry`` = Mmax; entries b when None)."""
    key = torch.arange(total, device=cu_k.device, dtype=cu_k.dtype)
    seq = torch.searchsorted(cu_k[1:], key, right=True)  # the sequence of each packed key
    pos = (key - cu_k[seq]).long() + (starts.long()[seq] if starts is not None else 0)
    if block_table is not None:
        return block_table[seq, pos // rows_per_entry].long() * rows_per_entry + pos % rows_per_entry
    return (entries.long()[seq] if entries is not None else seq) * rows_per_entry + pos


def _gather_pages(k, v, block_table, cu_seqlens_k):
    """k and v of a paged cache as packed (total_k, Hkv, D) tensors (:func:`cached_key_rows`). One gather
    (a copy of the keys and values the sequences use; autograd sends their gradients back to the pages),
    and two host syncs (total_k, then the check of the page ids). Pages past a sequence's length are never
    read, and a page id out of range raises."""
    num_pages, page_size = k.shape[0], k.shape[1]
    total_k = int(cu_seqlens_k[-1])
    rows = cached_key_rows(cu_seqlens_k, total_k, page_size, block_table)
    if total_k and not bool(((rows >= 0) & (rows < num_pages * page_size)).all()):  # a page id in range
        raise ValueError(f"block_table names a page outside the cache's {num_pages} pages")
    return k.flatten(0, 1).index_select(0, rows), v.flatten(0, 1).index_select(0, rows)


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = False,
                     scale: float | None = None, return_lse: bool = False,
                     window: tuple[int | None, int | None] | None = None, softcap: float | None = None,
                     alibi_slopes: torch.Tensor | None = None, dropout_p: float = 0,
                     generator: torch.Generator | None = None, seed: int | None = None,
                     block_table: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                     validate: bool = True) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over packed sequences of different lengths, with no padding.

    Args:
        q: (total_q, Hq, D), the sequences' queries one after the other; any strides with a dense last
            dim are read in place (e.g. a slice of a packed qkv tensor).
        k: (total_k, Hkv, D), with ``Hq % Hkv == 0`` (grouped-query attention).
        v: values (total_k, Hkv, D_v): k's shape, with a head dim of their own where it differs from D
            (the output then has D_v columns).
        cu_seqlens_q: int32, shape (B + 1,), on the device of q: 0, then the cumulative lengths, so
            sequence ``i`` holds rows ``cu_seqlens_q[i] : cu_seqlens_q[i + 1]`` of q. Zero-length
            sequences are allowed on either side (a query with no key gets o = 0, lse = -inf).
        cu_seqlens_k: the same for k and v, with as many entries as ``cu_seqlens_q``.
        max_seqlen_q: the longest query sequence (picks the launch configuration).
        max_seqlen_k: the longest key sequence.
        causal: bottom-right aligned within each sequence: query ``i`` of a sequence with ``N_i``
            queries and ``M_i`` keys sees key ``j`` when ``j <= i + M_i - N_i``.
        scale: softmax scale; ``1 / sqrt(D)`` when None.
        return_lse: also return the natural-log log-sum-exp of each row, (Hq, total_q), float32 (float64
            for float64 inputs; the layout of ``flash_attn_varlen_func``), differentiable like
            :func:`flashattn.attention`'s.
        window: as in :func:`flashattn.attention`, inside each sequence: bottom-right aligned on that
            sequence's diagonal (``i + M_i - N_i``).
        softcap: as in :func:`flashattn.attention`.
        alibi_slopes: float32 (Hq,) or (B, Hq) with one row per sequence; distances are taken inside
            the sequence.
        dropout_p: as in :func:`flashattn.attention`. Sequence ``i`` draws exactly the mask that batch
            entry ``i`` of a dense call with the same seed draws (the mask is a function of the seed,
            the sequence, the head and the sequence-local ``(i, j)``).
        generator: as in :func:`flashattn.attention`.
        seed: as in :func:`flashattn.attention`.
        block_table: int32 (B, max_pages): k and v are then a paged cache (num_pages, page_size, Hkv, D)
            (prefill against a paged KV cache) and ``cu_seqlens_k`` counts each sequence's keys, key
            ``j`` of sequence ``b`` sitting in slot ``j % page_size`` of page ``block_table[b, j //
            page_size]``. The pages a call uses are gathered into packed k, v first (one copy of them,
            two host syncs; gradients flow back to the pages), then attended as above. Eager only.
        sinks: per-head sink logits (Hq,), as in :func:`flashattn.attention`, in every row of every sequence.
        validate: check the values of cu_seqlens (start 0, non-decreasing, end at the totals, lengths
            at most max_seqlen). On the CPU they are always checked; for CUDA tensors the check costs
            one host sync, so a caller that builds cu_seqlens itself can pass ``validate=False``.
            Skipped under ``torch.compile`` (the values are not known while tracing).

    Returns:
        ``o`` (total_q, Hq, D) in q's dtype, or ``(o, lse)`` with ``return_lse``.

    Gradients are first order on the kernels' path: a second backward (``create_graph=True``)
    through them raises ``RuntimeError``, as for :func:`flashattn.attention`.

    CUDA tensors (float16, bfloat16) run the Triton kernels; CPU tensors run
    :func:`flashattn.reference.varlen_attention` (float16/bfloat16 in float32), or the kernels under
    ``TRITON_INTERPRET=1``. Inside ``torch.autocast`` (CUDA or CPU) float32 inputs run in the autocast
    dtype, as for :func:`flashattn.attention`.
    """
    q, k, v = autocast_inputs(q, k, v)
    if block_table is not None:
        if torch.compiler.is_compiling():
            raise NotImplementedError("attention_varlen with a block_table runs eagerly only (its gather needs "
                                      "the total key count on the host)")
        _check_block_table(k, v, block_table, cu_seqlens_k, max_seqlen_k)
        _check_cu_seqlens(q, q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        k, v = _gather_pages(k, v, block_table, cu_seqlens_k.contiguous())
    _check_tensors(q, k, v)
    _check_cu_seqlens(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    for name, flag in (("causal", causal), ("return_lse", return_lse), ("validate", validate)):
        check_flag(name, flag)
    check_scale(scale)
    n_seqs = cu_seqlens_q.shape[0] - 1
    window, softcap = check_variants(q, n_seqs, q.shape[1], window, softcap, alibi_slopes, dropout_p)
    check_dropout_source(generator, seed)
    check_sinks(q, q.shape[1], sinks)
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.detach().contiguous()
    scale = None if scale is None else float(scale)  # None: 1 / sqrt(D), taken by Problem or the operator
    # the kernels read cu_seqlens at unit stride; made so once here (a no-op when they are), and the
    # backward gets them from the forward
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    compiling = torch.compiler.is_compiling()
    if not compiling and (validate or q.device.type == "cpu"):
        _check_cu_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if compiling:
        if dropout_p > 0 and seed is None:
            raise ValueError("under torch.compile, dropout needs an explicit seed= (a generator cannot be traced)")
        left, right = window if window is not None else (None, None)
        dropout_p = float(dropout_p) if dropout_p != 0 else 0.0  # flashattn.api.attention says why
        o, lse = torch.ops.flashattn.attention_forward(
            q, k, v, causal, scale, -1 if left is None else left, -1 if right is None else right, softcap,
            alibi_slopes, dropout_p, int(seed) if dropout_p > 0 else 0, cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
            sinks=None if sinks is None else sinks.contiguous())
    else:
        problem = Problem.packed(q, k, n_seqs, max_seqlen_q, max_seqlen_k, causal, scale, window=window,
                                 softcap=softcap, alibi=alibi_slopes is not None, dropout_p=float(dropout_p),
                                 head_dim_v=v.shape[-1], sinks=sinks is not None)
        args = (q, k, v, problem, use_kernels(q), alibi_slopes, dropout_seed(problem.dropout_p, generator, seed),
                cu_seqlens_q, cu_seqlens_k, sinks)
        o, lse = attend(*args)
    return (o, lse) if return_lse else o
