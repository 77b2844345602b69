"""Context-parallel attention over ``torch.distributed``: ring attention, and Ulysses.

The sequence is cut into R shards, one per rank of a process group. Every rank keeps its query shard
and passes its key/value shard around the ring (rank r sends to r + 1 and receives from r - 1), so
after R steps every query shard has met every key/value shard. Each step runs the single-device
attention on the pair in hand while the next key/value shard is already on the wire, and the partial
results are merged through their log-sum-exp, which is exact (the merge derivation,
``derivations/merge.py``).

The backward sends the key/value shards around again. Every partial gradient is computed with the
*global* output O and the *global* LSE, so delta = rowsum(dO * O) and the recomputed P are those of the
full row and the partial gradients simply add: dQ stays home, and each dK/dV accumulator travels with
its key/value shard and arrives back at its owner after the last step.

Causal attention with contiguous shards leaves rank 0 almost idle and rank R - 1 doing R times its
work. The zig-zag layout cuts the sequence into 2R chunks and gives rank r the chunks r and
2R - 1 - r; every rank then does the same work at every step (see :func:`ring_step`).

Ulysses (:func:`ulysses_attention`) cuts the other way: an all-to-all hands every rank the *whole*
sequence of R-th of the heads, each rank runs the single-device attention on its heads, and a second
all-to-all hands the output back as sequence shards of every head. Two collectives per pass instead of
R - 1 exchanges, at the price of needing at least R heads (K/V heads are repeated when they are fewer).

The attention math itself is the package's single-device forward and backward; this module adds
only the schedule, the communication and the merge.
"""

from __future__ import annotations

import bisect
import math
from typing import NamedTuple

import torch
import torch.distributed as dist

from flashattn import _config
from flashattn.api import _check_inputs, attention, check_flag, check_variants, is_int
from flashattn.varlen import attention_varlen
from flashattn.autograd import backend, not_twice, use_kernels
from flashattn.problem import Problem

LAYOUTS = ("contiguous", "zigzag")


# --------------------------------------------------------------------------------------------------
# the local attention (the only two functions that know how the package computes attention)
# --------------------------------------------------------------------------------------------------
def _local_forward(q, k, v, causal: bool, scale: float, window=None, documents=None):
    """Single-device attention of one query shard against one key/value shard: ``(o, lse)``; with
    ``documents`` (local cumulative lengths, B = 1) packed attention over them."""
    forward, _ = backend(use_kernels(q))
    if documents is None:
        return forward(q, k, v, Problem.of(q, k, causal, scale, window=window))
    problem, packing = _packed(q, k, causal, scale, documents)
    o, lse = forward(*(_tokens(x) for x in (q, k, v)), problem, None, 0, packing)
    return o.transpose(0, 1)[None], lse[None]


def _local_backward(do, q, k, v, o, lse, causal: bool, scale: float, window=None, documents=None):
    """Single-device backward of one shard pair, given the *global* o and lse: ``(dq, dk, dv)``."""
    _, backward = backend(use_kernels(q))
    if documents is None:
        return backward(do, q, k, v, o, lse, Problem.of(q, k, causal, scale, window=window))[:3]
    problem, packing = _packed(q, k, causal, scale, documents)
    grads = backward(*(_tokens(x) for x in (do, q, k, v, o)), lse[0], problem, None, None, 0, packing)[:3]
    return tuple(g.transpose(0, 1)[None] for g in grads)


def _tokens(x: torch.Tensor) -> torch.Tensor:
    """(1, H, L, D) -> (L, H, D), the packed layout, as a view."""
    return x[0].transpose(0, 1)


def _cu_seqlens(documents: tuple, device) -> tuple[torch.Tensor, int]:
    """The documents' cumulative lengths as the packed kernels take them (int32 on ``device``) and the
    longest document's length."""
    longest = max(end - start for start, end in zip(documents[:-1], documents[1:]))
    return torch.tensor(documents, dtype=torch.int32, device=device), longest


def _packed(q, k, causal: bool, scale: float, documents: tuple):
    """The packed problem of one chunk's documents and its ``(cu_seqlens, cu_seqlens)``."""
    cu, longest = _cu_seqlens(documents, q.device)
    problem = Problem.packed(_tokens(q), _tokens(k), len(documents) - 1, longest, longest, causal, scale)
    return problem, (cu, cu)


# --------------------------------------------------------------------------------------------------
# layouts: which part of the sequence each rank holds
# --------------------------------------------------------------------------------------------------
def _check_layout(layout) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def _chunks(n: int, world_size: int, layout: str, what: str) -> int:
    """Length of one chunk; raises when the sequence does not split evenly."""
    parts = world_size * (2 if layout == "zigzag" else 1)
    if n % parts:
        raise ValueError(
            f"the sequence length N of {what} ({n}) must be divisible by "
            f"{'2 * world_size' if layout == 'zigzag' else 'world_size'} = {parts} for layout={layout!r}; "
            f"uneven shards are not supported (pad the sequence to a multiple of {parts} and mask the padding "
            "yourself, or pick another length)"
        )
    return n // parts


def chunk_ids(rank: int, world_size: int, layout: str = "zigzag") -> tuple[int, ...]:
    """The chunks of the sequence that ``rank`` holds, in order: ``(r,)`` when contiguous (R chunks),
    ``(r, 2R - 1 - r)`` for the zig-zag layout (2R chunks)."""
    _check_layout(layout)
    return (rank, 2 * world_size - 1 - rank) if layout == "zigzag" else (rank,)


def shard_sequence(x: torch.Tensor, rank: int, world_size: int, *, layout: str = "zigzag", dim: int = -2):
    """This rank's shard of a full sequence ``x`` (the sequence along ``dim``, by default N of (B, H, N, D)).

    Every rank calls it on the same full tensor and gets its own part. Raises ``ValueError`` unless N is
    divisible by ``world_size`` (contiguous) or ``2 * world_size`` (zig-zag).
    """
    _check_layout(layout)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size = {world_size}), got {rank}")
    size = _chunks(x.shape[dim], world_size, layout, "x")
    parts = [x.narrow(dim, c * size, size) for c in chunk_ids(rank, world_size, layout)]
    return torch.cat(parts, dim=dim)


def unshard_sequence(shards, *, layout: str = "zigzag", dim: int = -2) -> torch.Tensor:
    """The inverse of :func:`shard_sequence`: the full sequence from the shards of ranks 0 .. R - 1."""
    _check_layout(layout)
    world_size = len(shards)
    per_shard = len(chunk_ids(0, world_size, layout))
    length = shards[0].shape[dim]
    if length % per_shard:
        raise ValueError(f"each shard must hold {per_shard} equal chunks for layout={layout!r}, got length {length}")
    size = length // per_shard
    chunks = [None] * (world_size * per_shard)
    for rank, shard in enumerate(shards):
        for i, c in enumerate(chunk_ids(rank, world_size, layout)):
            chunks[c] = shard.narrow(dim, i * size, size)
    return torch.cat(chunks, dim=dim)


def gather_sequence(x: torch.Tensor, *, group=None, layout: str = "zigzag", dim: int = -2) -> torch.Tensor:
    """All-gather every rank's shard and return the full sequence on every rank (no gradient)."""
    shards = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, x.contiguous(), group=group)
    return unshard_sequence(shards, layout=layout, dim=dim)


# --------------------------------------------------------------------------------------------------
# the schedule: what one ring step computes
# --------------------------------------------------------------------------------------------------
class RingStep(NamedTuple):
    """One ring step (or one piece of it): query rows ``rows`` of the local shard attend to key rows
    ``cols`` of the shard in hand, with (``causal=True``) or without the diagonal mask, and through the
    local sliding window ``window`` = (left, right) of :func:`flashattn.attention` when not None."""

    rows: slice
    cols: slice
    causal: bool
    window: tuple | None = None
    # packed documents inside the piece (rows and cols then cover the same chunk): the local cumulative
    # lengths (0, ..., length), each document attending only to itself
    documents: tuple | None = None


# --8<-- [start:ring-step]
def ring_step(rank: int, source: int, n: int, causal: bool, layout: str) -> RingStep | None:
    """What rank ``rank`` computes with the key/value shard of rank ``source`` (local length ``n``);
    ``None`` when every pair of the two shards is masked."""
    everything = slice(0, n)
    if not causal:
        return RingStep(everything, everything, False)
    if source == rank:  # the shard against itself: the diagonal chunks need the causal mask
        return RingStep(everything, everything, True)
    if layout == "contiguous":  # earlier keys are all visible, later ones all masked
        return RingStep(everything, everything, False) if source < rank else None
    half = n // 2  # zig-zag: chunks (r, 2R-1-r) against (s, 2R-1-s)
    if source < rank:  # chunk s precedes both query chunks; chunk 2R-1-s follows both
        return RingStep(everything, slice(0, half), False)
    # s > r: both key chunks precede chunk 2R-1-r and follow chunk r
    return RingStep(slice(half, n), everything, False)
# --8<-- [end:ring-step]


# --8<-- [start:ring-window]
def _band(delta: int, c: int, left, right):
    """Query chunk against key chunk (both ``c`` long), the query chunk starting ``delta`` positions
    after the key chunk, under the global window: query i sees key j when i - left <= j <= i + right
    (None: unbounded). Returns None when no pair is visible, else ``(row0, col0, length, window)``: the
    visible pairs lie in rows row0 .. row0 + length and keys col0 .. col0 + length of the chunks, where
    local row i' sees local key j' when i' - wl <= j' <= i' + wr for ``window = (wl, wr)`` (a side None
    when it hides nothing there; None for both)."""
    # local row i sees local key j when i + delta - left <= j <= i + delta + right
    if (left is not None and delta - left > c - 1) or (right is not None and c - 1 + delta + right < 0):
        return None
    # the first `skip` keys reach no row (nor do the last `skip` rows reach a key); the first `late` rows
    # reach no key (nor do the last `late` keys reach a row)
    skip = max(0, delta - left) if left is not None else 0
    late = max(0, -(delta + right)) if right is not None else 0
    row0, col0 = late, skip  # at most one of them is nonzero (skip > 0 needs delta > 0, late > 0 delta < 0)
    length = c - skip - late
    wl = None if left is None else left - delta - row0 + col0
    wr = None if right is None else row0 - col0 + delta + right
    wl = None if wl is not None and wl >= length - 1 else wl
    wr = None if wr is not None and wr >= length - 1 else wr
    return row0, col0, length, None if wl is None and wr is None else (wl, wr)


def ring_pieces(rank: int, source: int, world: int, n: int, causal: bool, layout: str, window=None,
                documents=None) -> list[RingStep]:
    """What rank ``rank`` of ``world`` computes with the key/value shard of rank ``source`` (local length
    ``n``) as a list of pieces, empty when every pair of the two shards is masked. Without a window or
    documents it is :func:`ring_step`'s one step; with a global window ``(left, right)`` (query i sees
    key j when i - left <= j <= i + right, causal folding right to 0) each pair of a query chunk and a key
    chunk becomes at most one piece, cut to its visible rows and keys, with the window that remains
    inside it; with packed ``documents`` (the full sequence's cumulative lengths), see
    :func:`_document_pieces`."""
    if documents is not None:
        return _document_pieces(rank, source, world, n, causal, layout, documents)
    if window is None:
        step = ring_step(rank, source, n, causal, layout)
        return [] if step is None else [step]
    left, right = window
    if causal:
        right = 0 if right is None else min(right, 0)
    ids_q, ids_k = chunk_ids(rank, world, layout), chunk_ids(source, world, layout)
    c = n // len(ids_q)
    pieces = []
    for iq, cq in enumerate(ids_q):
        for ik, ck in enumerate(ids_k):
            band = _band((cq - ck) * c, c, left, right)
            if band is None:
                continue
            row0, col0, length, local = band
            rows = slice(iq * c + row0, iq * c + row0 + length)
            cols = slice(ik * c + col0, ik * c + col0 + length)
            pieces.append(RingStep(rows, cols, False, local))
    return pieces
# --8<-- [end:ring-window]


# --8<-- [start:ring-documents]
def _document_pieces(rank: int, source: int, world: int, n: int, causal: bool, layout: str,
                     documents: tuple) -> list[RingStep]:
    """:func:`ring_pieces` for packed documents: query i sees key j only inside its own document (and,
    causal, when j <= i). Two different chunks are disjoint intervals, so at most one document reaches
    both (it holds every position between them): their pair is the rectangle of that document's rows and
    keys, all visible (causal: when the key chunk comes first; a later one is skipped). A chunk against
    itself is packed attention over the documents inside it, causal within each when ``causal``."""
    ids_q, ids_k = chunk_ids(rank, world, layout), chunk_ids(source, world, layout)
    c = n // len(ids_q)
    pieces = []
    for iq, cq in enumerate(ids_q):
        for ik, ck in enumerate(ids_k):
            a, b = cq * c, ck * c  # global first query and first key
            if cq == ck:
                inner = tuple(x - a for x in documents if a < x < a + c)
                bounds = (0, *inner, c)
                rows = slice(iq * c, (iq + 1) * c)
                cols = slice(ik * c, (ik + 1) * c)
                # one document over the whole chunk: dense attention, no packing
                pieces.append(RingStep(rows, cols, causal, None, bounds if inner else None))
                continue
            if causal and ck > cq:
                continue  # every key after every query
            # the one document that could reach both: the one holding the later chunk's first position
            later = max(a, b)
            start, end = _document_of(documents, later)
            earlier = min(a, b)
            if start >= earlier + c:
                continue  # it begins inside the later chunk: the two chunks share no document
            q_lo, q_hi = max(start, a) - a, min(end, a + c) - a
            k_lo, k_hi = max(start, b) - b, min(end, b + c) - b
            pieces.append(RingStep(slice(iq * c + q_lo, iq * c + q_hi), slice(ik * c + k_lo, ik * c + k_hi), False))
    return pieces


def _document_of(documents: tuple, position: int) -> tuple[int, int]:
    """(start, end) of the document holding ``position``, from the cumulative lengths (0, ..., N)."""
    i = bisect.bisect_right(documents, position) - 1
    return documents[i], documents[i + 1]
# --8<-- [end:ring-documents]


# --------------------------------------------------------------------------------------------------
# the merge of partial results
# --------------------------------------------------------------------------------------------------
# --8<-- [start:merge]
def merge_pair(o, lse, o_part, lse_part):
    """Merge two partial attentions over disjoint key sets: ``(o, lse)`` of the union.

    ``o`` (.., N, D) and ``lse`` (.., N) are one partial, ``o_part``/``lse_part`` the other; an empty
    partial has lse = -inf (and any finite o). Exact: o = e^(lse_a - lse) o_a + e^(lse_b - lse) o_b,
    computed as (w_a o_a + w_b o_b) / (w_a + w_b) with w = e^(lse_x - max(lse_a, lse_b)): the larger
    weight is exactly 1 and the two sum to 1 after the division, where weights taken against a rounded
    lse would carry its rounding, a relative error of eps * |lse|, into o.
    """
    w, w_part, total, pivot = _weights(lse, lse_part)
    o_new = (w.unsqueeze(-1) * o + w_part.unsqueeze(-1) * o_part) / torch.where(total > 0, total, 1).unsqueeze(-1)
    return o_new, pivot + torch.log(total)


def _weights(lse, lse_part):
    """``(w, w_part, w + w_part, pivot)``: the two partials' weights against the larger LSE."""
    top = torch.maximum(lse, lse_part)
    # A row empty in both partials keeps lse = -inf; pivoting it at 0 keeps both weights e^(-inf) = 0
    # instead of e^(-inf - (-inf)) = NaN (and then its total 0 gives lse = -inf, o = 0).
    pivot = torch.where(top == float("-inf"), torch.zeros_like(top), top)
    w, w_part = torch.exp(lse - pivot), torch.exp(lse_part - pivot)
    return w, w_part, w + w_part, pivot


def merge_into(o, lse, o_part, lse_part) -> None:
    """:func:`merge_pair` written into ``o`` and ``lse`` (views of a float32 running result) in place,
    as o * (w / total) + o_part * (w_part / total): two passes over o, where merge_pair makes a new
    tensor per operation and the caller copies the result back."""
    w, w_part, total, pivot = _weights(lse, lse_part)
    inv = torch.where(total > 0, total, 1).reciprocal_()
    o.mul_((w * inv).unsqueeze(-1)).addcmul_(o_part, (w_part * inv).unsqueeze(-1))
    lse.copy_(pivot + torch.log(total))
# --8<-- [end:merge]


# --------------------------------------------------------------------------------------------------
# communication
# --------------------------------------------------------------------------------------------------
def _group_ranks(group) -> tuple[int, int, list[int]]:
    """(rank in group, group size, the global rank of each rank of the group)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    ranks = list(range(world)) if group is None or group is dist.group.WORLD else dist.get_process_group_ranks(group)
    return rank, world, ranks


def _ring_peers(group) -> tuple[int, int, int, int]:
    """(rank in group, group size, global rank of the next rank, global rank of the previous one)."""
    rank, world, ranks = _group_ranks(group)
    return rank, world, ranks[(rank + 1) % world], ranks[(rank - 1) % world]


def _pass_on(send: torch.Tensor, recv: torch.Tensor, to_rank: int, from_rank: int, group):
    """Start sending ``send`` to global rank ``to_rank`` and receiving ``recv`` from ``from_rank``."""
    ops = [dist.P2POp(dist.isend, send, to_rank, group), dist.P2POp(dist.irecv, recv, from_rank, group)]
    return dist.batch_isend_irecv(ops)


# Groups up to this size fetch every key/value shard at the start of the forward and of the backward
# (which sends each shard's gradients straight to its owner); larger ones pass shards and gradients
# along the ring, one step at a time.
DIRECT_FETCH_MAX_WORLD = 8
# How that fetch runs: one all-gather ("all_gather") or R - 1 point-to-point exchanges ("send_recv").
DIRECT_FETCH_BY = "all_gather"
# SMs the forward's persistent kernels leave free while exchanges are in flight, for NCCL's kernels
# (flashattn._config.sm_margin); 0 leaves every SM to attention, which measured fastest with the
# all-gather (docs/kernels/ring.md).
EXCHANGE_SM_MARGIN = 0


def _fetch_all(kv: torch.Tensor, group) -> list:
    """Start the forward's exchanges at once: at step s (1 .. R - 1) this rank needs the shard of rank
    r - s and rank r + s needs this one, so every rank sends its own shard to each other rank and
    receives theirs, in the steps' order. ``[(shard, works)]`` per step, step 0 being ``kv`` itself.

    The ring passes shards along one step at a time, and each exchange waits for the step before it.
    When the compute kernels of a step hold every SM, the exchange then runs late, so it shows up
    between steps; started together before the first step, with only this rank's own shard to send,
    the exchanges overlap the first step's compute. ``DIRECT_FETCH_BY`` picks one all-gather of every
    shard (R shards in hand, this rank's own copied once more) or R - 1 send/receive pairs (R - 1
    shards in hand); either costs memory against the ring's two."""
    rank, world, ranks = _group_ranks(group)
    if world == 1:
        return [(kv, [])]
    if DIRECT_FETCH_BY == "all_gather":  # one collective; shard i of the result is group rank i's
        every = torch.empty((world * kv.shape[0], *kv.shape[1:]), dtype=kv.dtype, device=kv.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
        works = [gather(every, kv.contiguous(), group=group, async_op=True)]
        every = every.view(world, *kv.shape)
        # waited for once, by step 1 (the steps run in order)
        return [(kv, [])] + [(every[(rank - step) % world], works if step == 1 else []) for step in range(1, world)]
    if DIRECT_FETCH_BY != "send_recv":
        raise ValueError(f"DIRECT_FETCH_BY is {DIRECT_FETCH_BY!r}; expected 'all_gather' or 'send_recv'")
    fetched = [(kv, [])]
    for step in range(1, world):
        recv = torch.empty_like(kv)
        fetched.append((recv, _pass_on(kv, recv, ranks[(rank + step) % world], ranks[(rank - step) % world], group)))
    return fetched


def _wait(works) -> None:
    for work in works:
        work.wait()


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    # Partials are merged, and the steps' partial gradients (each in the inputs' dtype, as the backward
    # that computed it returns it) summed, in float32 (float64 stays float64 for exact tests).
    return torch.float64 if x.dtype == torch.float64 else torch.float32


# --8<-- [start:ring-forward]
def _ring_forward(q, k, v, causal: bool, scale: float, layout: str, group, window=None, documents=None):
    rank, world, next_rank, prev_rank = _ring_peers(group)
    n = q.shape[2]
    kv = torch.stack((k, v))  # (2, B, Hkv, n, D): one message per step
    o = torch.zeros(q.shape, dtype=_acc_dtype(q), device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=_acc_dtype(q), device=q.device)  # empty so far
    fetched = _fetch_all(kv, group) if world <= DIRECT_FETCH_MAX_WORLD else None
    for step in range(world):
        source = (rank - step) % world  # whose key/value shard is in hand
        works, kv_next = [], None
        if fetched is not None:  # all exchanges started at once: wait for this step's shard alone
            (kv, arrival), fetched[step] = fetched[step], None
            _wait(arrival)
        elif step + 1 < world:  # the next shard travels while this one is used
            kv_next = torch.empty_like(kv)
            works = _pass_on(kv, kv_next, next_rank, prev_rank, group)
        # exchanges in flight: the first step's (all of them, fetched directly) or the next shard's
        in_flight = world > 1 and q.is_cuda and (step == 0 if fetched is not None else step + 1 < world)
        with _config.sm_margin(EXCHANGE_SM_MARGIN if in_flight else 0):
            for plan in ring_pieces(rank, source, world, n, causal, layout, window, documents):
                rows, cols = plan.rows, plan.cols
                o_part, lse_part = _local_forward(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], plan.causal,
                                                  scale, plan.window, plan.documents)
                merge_into(o[:, :, rows], lse[:, :, rows], o_part, lse_part)
        if fetched is None:
            _wait(works)
            kv = kv_next
    return o.to(q.dtype), lse
# --8<-- [end:ring-forward]


# --8<-- [start:ring-backward]
def _ring_backward(do, q, k, v, o, lse, causal: bool, scale: float, layout: str, group, window=None,
                   documents=None):
    rank, world, ranks = _group_ranks(group)
    n = q.shape[2]
    kv = torch.stack((k, v))
    dq = torch.zeros(q.shape, dtype=_acc_dtype(q), device=q.device)

    def shard_grads(kv, source):  # adds the shard's share to dq; returns its float32 dK/dV
        dkv = torch.zeros(kv.shape, dtype=_acc_dtype(q), device=q.device)
        for plan in ring_pieces(rank, source, world, n, causal, layout, window, documents):
            rows, cols = plan.rows, plan.cols
            # The global o and lse: delta = rowsum(dO * O) and P = exp(S - LSE) are those of the full row,
            # so the partial gradients of all shards add up to the full gradient.
            dq_part, dk_part, dv_part = _local_backward(
                do[:, :, rows], q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols],
                o[:, :, rows], lse[:, :, rows], plan.causal, scale, plan.window, plan.documents)
            dq[:, :, rows] += dq_part
            dkv[0][:, :, cols] += dk_part
            dkv[1][:, :, cols] += dv_part
        return dkv

    if 1 < world <= DIRECT_FETCH_MAX_WORLD:
        # Every shard fetched at the start, as the forward does. Step s's gradients belong to rank
        # r - s and go straight to it, in the inputs' dtype (each piece's already was), while rank
        # r + s sends this rank its share; a share is added one step after it was sent.
        fetched = _fetch_all(kv, group)
        home, in_flight = None, None  # this rank's own sums; the last exchange (sent, received, works)
        for step in range(world):
            (kv, arrival), fetched[step] = fetched[step], None
            _wait(arrival)
            dkv = shard_grads(kv, (rank - step) % world)
            if step == 0:
                home = dkv
                continue
            send = dkv.to(k.dtype)
            recv = torch.empty_like(send)
            exchange = (send, recv, _pass_on(send, recv, ranks[(rank - step) % world], ranks[(rank + step) % world],
                                             group))
            if in_flight is not None:
                _wait(in_flight[2])
                home += in_flight[1]
            in_flight = exchange
        _wait(in_flight[2])
        dkv = home + in_flight[1]
    else:
        # The shards travel the ring again; a shard's dK/dV accumulate in float32 in a buffer that
        # follows it one step behind, each rank adding its share, and a last pass brings it home.
        next_rank, prev_rank = ranks[(rank + 1) % world], ranks[(rank - 1) % world]
        dkv_works, dkv_in = [], None  # the accumulator arriving with this step's shard
        for step in range(world):
            kv_works, kv_next = [], None
            if step + 1 < world:
                kv_next = torch.empty_like(kv)
                kv_works = _pass_on(kv, kv_next, next_rank, prev_rank, group)
            dkv = shard_grads(kv, (rank - step) % world)
            if step > 0:  # what the ranks before us added to this shard's gradients
                _wait(dkv_works)
                dkv += dkv_in
            dkv_in = torch.empty_like(dkv)
            dkv_works = _pass_on(dkv, dkv_in, next_rank, prev_rank, group) if world > 1 else []
            _wait(kv_works)
            kv = kv_next
        _wait(dkv_works)
        dkv = dkv_in if world > 1 else dkv
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)
# --8<-- [end:ring-backward]


class RingAttentionFunction(torch.autograd.Function):
    """``apply(q, k, v, causal, scale, layout, group, window=None, documents=None) -> (o, lse)``, both this
    rank's shard."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float, layout: str, group, window=None, documents=None):
        o, lse = _ring_forward(q, k, v, causal, scale, layout, group, window, documents)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.call = (causal, scale, layout, group, window, documents)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        with torch.no_grad():  # under create_graph=True too: the exchanges have no graph to build
            grads = _ring_backward(do.contiguous(), q, k, v, o, lse, *ctx.call)
        return *not_twice(grads, do, q, k, v), None, None, None, None, None, None


# --------------------------------------------------------------------------------------------------
# the public entry point
# --------------------------------------------------------------------------------------------------
def _check_ring_inputs(q, k, v, causal, scale, layout, group, what: str = "ring_attention") -> None:
    _check_inputs(q, k, v, causal, scale)  # the single-device contract: types, shapes, dtypes, D, scale
    _check_layout(layout)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{what} needs torch.distributed: call torch.distributed.init_process_group first")
    if q.shape[2] != k.shape[2]:
        raise ValueError(
            f"q and k must hold shards of the same length (self-attention over one sharded sequence), "
            f"got q with {q.shape[2]} queries and k with {k.shape[2]} keys")
    if layout == "zigzag" and q.shape[2] % 2:
        raise ValueError(f"layout='zigzag' needs an even shard length of q, k, v (two equal chunks), got {q.shape[2]}")
    backend = dist.get_backend(group)
    if backend == "nccl" and not q.is_cuda:
        raise ValueError(f"the process group uses NCCL, so q, k, v must be CUDA tensors, got {q.device}")
    if q.is_cuda and backend == "gloo":
        raise ValueError("q, k, v are CUDA tensors but the process group uses gloo; use the NCCL backend")


def _check_sequence_variants(q: torch.Tensor, group, window, cu_seqlens) -> tuple:
    """``(window, documents)`` over the full sequence, checked: the window as :func:`flashattn.attention`
    takes it, the documents by :func:`_check_documents`."""
    window, _ = check_variants(q, q.shape[0], q.shape[1], window, None, None, 0.0)
    return window, _check_documents(cu_seqlens, q, dist.get_world_size(group), window)


def _check_documents(cu_seqlens, q: torch.Tensor, world: int, window) -> tuple | None:
    """The documents' cumulative lengths as a tuple of ints 0 < ... < N (empty documents dropped), or
    None; raises on anything else."""
    if cu_seqlens is None:
        return None
    if window is not None:
        raise ValueError("cu_seqlens and window cannot be combined in context-parallel attention")
    if q.shape[0] != 1:
        raise ValueError(f"packed documents (cu_seqlens) need a batch of 1, got B = {q.shape[0]}")
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point() or cu_seqlens.dtype == torch.bool:
            raise TypeError(f"cu_seqlens must be a 1-D integer tensor or a list of ints, got {cu_seqlens.dtype} "
                            f"of shape {tuple(cu_seqlens.shape)}")
        cu_seqlens = cu_seqlens.tolist()
    values = list(cu_seqlens)
    if not all(is_int(x) for x in values):
        raise TypeError("cu_seqlens must hold ints")
    total = q.shape[2] * world
    if len(values) < 2 or values[0] != 0 or values[-1] != total:
        raise ValueError(f"cu_seqlens must run from 0 to the full sequence length N = {total}, got {values}")
    if any(b < a for a, b in zip(values[:-1], values[1:])):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {values}")
    return tuple(sorted(set(int(x) for x in values)))


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: dist.ProcessGroup | None = None,
                   causal: bool = False, scale: float | None = None, layout: str = "contiguous",
                   return_lse: bool = False, window: tuple[int | None, int | None] | None = None,
                   cu_seqlens=None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention over a sequence sharded across the ranks of ``group``; returns this rank's output shard.

    Args:
        q: this rank's query shard (B, Hq, N/R, D).
        k: this rank's key shard (B, Hkv, N/R, D), ``Hq % Hkv == 0``; with grouped-query attention only
            the smaller K/V travels.
        v: this rank's value shard, shaped like ``k``.
        group: the process group (default: the world). Its size R is the number of shards.
        causal: causal masking over the *full* sequence (query i sees key j <= i).
        scale: softmax scale; ``1 / sqrt(D)`` when None.
        layout: how the caller cut the sequence: ``"contiguous"`` (rank r holds the r-th of R equal
            chunks) or ``"zigzag"`` (rank r holds chunks r and 2R - 1 - r of 2R; balances causal work).
            :func:`shard_sequence` and :func:`unshard_sequence` cut and reassemble a full sequence.
        return_lse: also return this shard's global log-sum-exp (B, Hq, N/R), no gradient.
        window: ``(left, right)`` sliding window over the *full* sequence: query i sees key j when
            ``i - left <= j <= i + right`` (``None`` on a side: unbounded; with ``causal=True`` the right
            side is at most 0), as :func:`flashattn.attention` takes it for N = M. Each step computes
            only the pieces of the shard pair that the window reaches (:func:`ring_pieces`); a pair it
            misses is skipped, though its shard still travels the ring.
        cu_seqlens: documents packed one after the other in the full sequence (B = 1), as their
            cumulative lengths 0, ..., N (a list of ints or an integer tensor, read on the host): query
            i then sees only keys of its own document, causal within it when ``causal=True``. Shard
            pairs that share no document are skipped; a chunk against itself runs packed attention over
            the documents inside it (:func:`ring_pieces`). Not with ``window``.

    Every rank must call it with tensors of the same shape, dtype and layout; that is the caller's
    promise (checking it would cost a collective per call). Shards must have equal length, so N must be
    divisible by R (contiguous) or 2R (zig-zag). Gradients flow to q, k, v; dK and dV come back to the
    rank that owns the shard. They are first order: a second backward (``create_graph=True``) through
    them raises ``RuntimeError``. NCCL with CUDA tensors runs the Triton kernels; gloo with CPU tensors runs
    the PyTorch reference (float16/bfloat16 CPU tensors the kernels under ``TRITON_INTERPRET=1``).

    Memory: in groups of up to ``DIRECT_FETCH_MAX_WORLD`` ranks the forward and the backward each
    fetch every rank's key/value shard at their start, so they hold all R of them at once (R - 1 when
    ``DIRECT_FETCH_BY`` is ``"send_recv"``; larger groups relay and hold two at a time); set the
    constant lower to trade that memory for exchanges that wait for each other.

    Every rank of the group must make the call, and the backward of its output: the exchanges wait for
    all of them. A rank that raises (on arguments unlike the others') or skips the backward leaves the
    other ranks waiting until the process group's timeout.
    """
    _check_ring_inputs(q, k, v, causal, scale, layout, group)
    check_flag("return_lse", return_lse)
    window, documents = _check_sequence_variants(q, group, window, cu_seqlens)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    o, lse = RingAttentionFunction.apply(q, k, v, causal, scale, layout, group, window, documents)
    return (o, lse) if return_lse else o


# --------------------------------------------------------------------------------------------------
# Ulysses: an all-to-all of heads
# --------------------------------------------------------------------------------------------------
def kv_head_repeats(heads_q: int, heads_kv: int, world_size: int) -> int:
    """How many times each K/V head is repeated so that the heads split evenly over ``world_size``
    ranks: 1 when ``world_size`` divides Hkv, else the least factor f for which it divides Hkv * f and
    Hkv * f still divides Hq (query head h keeps reading its own K/V head). Raises ``ValueError`` when
    Hq itself does not split."""
    if heads_q % world_size:
        raise ValueError(f"ulysses_attention splits the query heads over the ranks: Hq ({heads_q}) must be "
                         f"divisible by the group's size ({world_size}); use ring_attention otherwise")
    f = world_size // math.gcd(heads_kv, world_size)
    while heads_q % (heads_kv * f):  # f grows by whole multiples; Hkv * f = Hq always works
        f += world_size // math.gcd(heads_kv, world_size)
    return f


# --8<-- [start:ulysses-exchange]
def _sequence_to_heads(x: torch.Tensor, world: int, layout: str, group) -> torch.Tensor:
    """(B, H, n, ...) this rank's sequence shard of every head -> (B, H/R, R n, ...): the whole
    sequence of this rank's R-th of the heads. Differentiable (the backward is the reverse all-to-all)."""
    from torch.distributed.nn.functional import all_to_all_single

    b, h, n = x.shape[:3]
    send = x.reshape(b, world, h // world, n, *x.shape[3:]).movedim(1, 0).contiguous()  # [rank to] = its heads
    recv = all_to_all_single(torch.empty_like(send), send, group=group)  # [rank from] = its shard of my heads
    return unshard_sequence(list(recv.unbind(0)), layout=layout, dim=2)


def _heads_to_sequence(x: torch.Tensor, world: int, layout: str, group) -> torch.Tensor:
    """The inverse of :func:`_sequence_to_heads`: (B, H/R, N, ...) -> (B, H, N/R, ...)."""
    from torch.distributed.nn.functional import all_to_all_single

    send = torch.stack([shard_sequence(x, r, world, layout=layout, dim=2) for r in range(world)]).contiguous()
    recv = all_to_all_single(torch.empty_like(send), send, group=group)  # [rank from] = my shard of its heads
    return recv.movedim(0, 1).flatten(1, 2)
# --8<-- [end:ulysses-exchange]


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: dist.ProcessGroup | None = None,
                      causal: bool = False, scale: float | None = None, layout: str = "contiguous",
                      return_lse: bool = False, window: tuple[int | None, int | None] | None = None,
                      cu_seqlens=None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention over a sequence sharded across the ranks of ``group`` by an all-to-all of heads
    (Ulysses); returns this rank's output shard, like :func:`ring_attention`.

    Args:
        q: this rank's query shard (B, Hq, N/R, D); Hq must be divisible by R, the group's size.
        k: this rank's key shard (B, Hkv, N/R, D), ``Hq % Hkv == 0``. When R does not divide Hkv the
            K/V heads are repeated (:func:`kv_head_repeats`) before the exchange, so each rank gets the
            K/V heads its query heads read.
        v: this rank's value shard, shaped like ``k``.
        group: the process group (default: the world).
        causal: causal masking over the *full* sequence (query i sees key j <= i).
        scale: softmax scale; ``1 / sqrt(D)`` when None.
        layout: how the caller cut the sequence, ``"contiguous"`` or ``"zigzag"`` (:func:`shard_sequence`).
        return_lse: also return this shard's log-sum-exp (B, Hq, N/R), float32.
        window: a sliding window over the full sequence, as :func:`ring_attention` takes it; each rank
            holds the whole sequence of its heads, so it goes to :func:`flashattn.attention` as it is.
        cu_seqlens: packed documents (B = 1), as :func:`ring_attention` takes them; each rank runs
            :func:`flashattn.attention_varlen` over them on the whole sequence of its heads.

    Each rank runs :func:`flashattn.attention` on the whole sequence of its heads (the kernels on CUDA
    tensors with NCCL; on CPU tensors with gloo, the reference or, under ``TRITON_INTERPRET=1``, the
    kernels); the all-to-alls are autograd functions of ``torch.distributed.nn``, so gradients flow to
    q, k, v on their owners. As with :func:`ring_attention`, every rank must call it with tensors of the
    same shape, dtype and layout, and run the backward.
    """
    _check_ring_inputs(q, k, v, causal, scale, layout, group, what="ulysses_attention")
    check_flag("return_lse", return_lse)
    window, documents = _check_sequence_variants(q, group, window, cu_seqlens)
    if documents is None:
        attend = lambda *qkv: attention(*qkv, causal=causal, scale=scale, return_lse=True, window=window)  # noqa: E731
    else:
        attend = lambda *qkv: _packed_attention(*qkv, documents, causal, scale)  # noqa: E731
    return _over_heads(q, k, v, group, layout, return_lse, attend)


def _packed_attention(q, k, v, documents: tuple, causal: bool, scale):
    """``(o, lse)`` of :func:`flashattn.attention_varlen` over ``documents`` for (1, H, N, D) tensors, in
    their layout."""
    cu, longest = _cu_seqlens(documents, q.device)
    o, lse = attention_varlen(*(_tokens(x) for x in (q, k, v)), cu, cu, longest, longest, causal=causal, scale=scale,
                              return_lse=True)
    return o.transpose(0, 1)[None], lse[None]


def _over_heads(q, k, v, group, layout: str, return_lse: bool, attend):
    """Ulysses' frame around ``attend(q, k, v) -> (o, lse)``: K/V heads repeated until they split over
    the group (:func:`kv_head_repeats`), the all-to-all that gives each rank the whole sequence (cut in
    ``layout``) of its share of the heads, ``attend`` on them, and the all-to-all of o (and of lse when
    asked for) back."""
    width = dist.get_world_size(group)
    repeats = kv_head_repeats(q.shape[1], k.shape[1], width)
    if repeats > 1:
        k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
    o_h, lse_h = attend(*(_sequence_to_heads(x, width, layout, group) for x in (q, k, v)))
    o = _heads_to_sequence(o_h, width, layout, group)
    return (o, _heads_to_sequence(lse_h, width, layout, group)) if return_lse else o


# --------------------------------------------------------------------------------------------------
# hybrid: Ulysses inside a group of ranks, the ring across the groups
# --------------------------------------------------------------------------------------------------
def shard_sequence_2d(x: torch.Tensor, ring_rank: int, ring_size: int, ulysses_rank: int, ulysses_size: int, *,
                      layout: str = "zigzag", dim: int = -2) -> torch.Tensor:
    """A rank's shard for :func:`hybrid_attention`: the ring position's shard of ``x`` (``layout`` over
    ``ring_size`` positions), cut again into ``ulysses_size`` contiguous pieces, of which this rank holds
    piece ``ulysses_rank``."""
    ring_shard = shard_sequence(x, ring_rank, ring_size, layout=layout, dim=dim)
    return shard_sequence(ring_shard, ulysses_rank, ulysses_size, layout="contiguous", dim=dim)


def hybrid_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, ulysses_group: dist.ProcessGroup,
                     ring_group: dist.ProcessGroup, causal: bool = False, scale: float | None = None,
                     layout: str = "zigzag", return_lse: bool = False,
                     window: tuple[int | None, int | None] | None = None, cu_seqlens=None
                     ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention over a sequence sharded across a grid of ranks: Ulysses inside ``ulysses_group``
    (its U ranks exchange heads), the ring across ``ring_group`` (its G ranks, one from each Ulysses
    group, pass key/value shards around). Returns this rank's output shard.

    Each rank holds :func:`shard_sequence_2d`'s shard, (B, H, N / (G U), D): its ring position's shard
    (``layout``), cut into U contiguous pieces. The all-to-all of heads gives every rank of a Ulysses
    group the whole ring shard of H / U heads; :func:`ring_attention` runs across the ring group on
    those; the reverse all-to-all hands the output back. Hq must be divisible by U (K/V heads are
    repeated as in :func:`ulysses_attention`). Every rank must belong to one Ulysses group and one ring
    group, with the ring group's ranks ordered by ring position. ``window`` and ``cu_seqlens`` are the
    full sequence's, as :func:`ring_attention` takes them.
    """
    _check_ring_inputs(q, k, v, causal, scale, layout, ulysses_group, what="hybrid_attention")
    check_flag("return_lse", return_lse)
    # inside a group the pieces are contiguous: the gathered sequence is the ring position's shard
    return _over_heads(q, k, v, ulysses_group, "contiguous", return_lse,
                       lambda *qkv: ring_attention(*qkv, group=ring_group, causal=causal, scale=scale,
                                                   layout=layout, return_lse=True, window=window,
                                                   cu_seqlens=cu_seqlens))


__all__ = ["LAYOUTS", "RingStep", "chunk_ids", "gather_sequence", "hybrid_attention", "kv_head_repeats",
           "merge_into", "merge_pair", "ring_attention", "ring_pieces", "ring_step", "shard_sequence",
           "shard_sequence_2d", "ulysses_attention", "unshard_sequence"]
