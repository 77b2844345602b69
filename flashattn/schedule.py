"""The causal block schedule: which (query block, key block) tiles a kernel visits, and which need a mask.

Causal attention here is aligned **bottom-right**: with N queries and M keys, query ``i`` sees key ``j``
exactly when ``j <= i + (M - N)``. For N == M that is the usual lower triangle; for N < M (decoding
with a KV cache) every query also sees the whole prefix; for N > M the first ``N - M`` queries see no
key at all.

Tiling the (N, M) score matrix into ``block_m x block_n`` tiles splits the tiles three ways:

* **full**: every (i, j) in the tile is visible and in range: the kernel runs it without a mask;
* **masked**: the tile straddles the causal diagonal or the ragged key edge (keys >= M): the
  kernel runs it and masks what it must not see (rows >= N of a ragged last query block are computed
  and never stored in the forward; the dK/dV loop masks them, see :func:`backward_query_range`);
* **skipped**: no (i, j) in the tile is visible: the kernel never loads it.

Every function here is plain arithmetic on five primitives (:func:`minimum`, :func:`maximum`,
:func:`clamp`, :func:`select`, and :func:`load` for the packed-sequence tables), so the Triton kernels wrap the very same functions with
``triton.jit`` (swapping the primitives for device versions built on ``tl.minimum``, ``tl.maximum``,
``tl.where`` and ``tl.load``): the
kernels call :func:`forward_key_range`, :func:`dq_key_range`, :func:`backward_query_range`,
:func:`visible` and :func:`launch_order` compiled, the PyTorch reference calls them on the host, and
the site draws its figures with :func:`block_grid`. There is one schedule, not three.
"""

from __future__ import annotations

import functools

FULL = "full"
MASKED = "masked"
SKIPPED = "skipped"


# --8<-- [start:primitives]
# The schedule's functions run in three places: on the host (the reference, the figures, the tests),
# and inside the Triton kernels, which wrap these very functions with ``triton.jit``
# (:func:`flashattn.device_helpers.device_fn`). Everything below is written with + - * // and comparisons,
# and with the five primitives here; on the device each primitive is swapped for its Triton twin
# (tl.minimum, tl.maximum, clamp built from those two, tl.where, tl.load), so host and kernel compute
# the same numbers by construction.
def minimum(a, b):
    return min(a, b)


def maximum(a, b):
    return max(a, b)


def clamp(x, lo, hi):
    return minimum(maximum(x, lo), hi)


def select(condition, if_true, if_false):
    return if_true if condition else if_false


def load(table, i):
    """Entry ``i`` of an integer table: a list or tensor on the host, a pointer (``tl.load``) on the device."""
    return table[i]
# --8<-- [end:primitives]


# --8<-- [start:visible]
def visible(rows, cols, n, m, causal):
    """Which (query row, key column) pairs a tile may use: in range, and not in the future when causal.

    ``rows`` and ``cols`` broadcast against each other (ints, or index tensors shaped [R, 1] and [1, C]
    on the host and in the kernels alike). Bottom-right alignment: query ``i`` sees key ``j`` when
    ``j <= i + (m - n)``.
    """
    ok = (rows < n) & (cols < m)
    if causal:
        ok = ok & (cols <= rows + (m - n))
    return ok
# --8<-- [end:visible]


def is_visible(i: int, j: int, n: int, m: int, causal: bool, window=None) -> bool:
    """Whether query ``i`` may attend to key ``j`` (both in range) under bottom-right alignment,
    and inside ``window = (left, right)`` when one is given (see :func:`window_bounds`)."""
    ok = 0 <= i and 0 <= j and visible(i, j, n, m, causal)
    if window is not None:
        left, right = window_bounds(n, m, causal, window)
        ok = ok and in_window(i, j, n, m, left, right)
    return bool(ok)


# --8<-- [start:window-range]
# A sliding window (left, right): query i sees key j when i + (m - n) - left <= j <= i + (m - n) + right,
# the same bottom-right alignment as the causal mask. The kernels take the two bounds as plain
# integers: an unbounded side is clipped to a bound no pair reaches (j - (i + m - n) lies in
# [1 - m, n - 1]), and causal caps the right bound at 0, so one test covers every combination.
def window_bounds(n, m, causal, window):
    """``(left, right)`` as the kernels use them, from ``window = (left, right)`` (``None`` = unbounded).

    Host only (it reads ``None``): the problem description calls it once. ``left`` is at most ``m``
    and ``right`` at most ``n`` (both already unbounded there); causal makes ``right <= 0``.
    """
    left, right = window
    left = m if left is None else min(left, m)
    right = n if right is None else min(right, n)
    if causal:
        right = min(right, 0)
    return left, right


def in_window(rows, cols, n, m, left, right):
    """Which (query row, key column) pairs lie inside the window; broadcasts like :func:`visible`."""
    diagonal = rows + (m - n)  # the key that sits on query ``rows``'s diagonal
    return (cols >= diagonal - left) & (cols <= diagonal + right)


def window_key_range(start_m, block_m, block_n, n, m, left, right):
    """Key ranges the forward loop of one query block walks under a window.

    Returns ``(lo, full_start, full_end, hi)``: key blocks starting in ``[lo, full_start)`` cross the
    window's left edge and run masked, those in ``[full_start, full_end)`` lie inside the window for
    every row of the block and run unmasked, those in ``[full_end, hi)`` cross the right edge (or
    the ragged key edge) and run masked. Keys below ``lo`` and from ``hi`` on are never visited, so a
    window of w keys costs O(w) per row, not O(m). ``lo``, ``full_start`` and ``full_end`` are
    multiples of ``block_n`` whenever the unmasked range is not empty.
    """
    last_row = start_m + block_m - 1
    lo = clamp(start_m + m - n - left, 0, m) // block_n * block_n  # the first row's first key
    hi = clamp(last_row + m - n + right + 1, 0, m)  # past the last row's last key
    # Unmasked: at or past the last row's first key (rounded up to a block) ...
    first_full = (clamp(last_row + m - n - left, 0, m) + block_n - 1) // block_n * block_n
    # ... and ending at or before the first row's last key, never on the ragged key edge.
    end_full = clamp(start_m + m - n + right + 1, 0, m) // block_n * block_n
    full_start = clamp(first_full, lo, hi)
    full_end = clamp(end_full, full_start, hi)
    return lo, full_start, full_end, hi


def window_dq_key_range(start_m, block_m, block_n, n, m, left, right):
    """:func:`window_key_range` for the dQ loop: a ragged last query block masks every tile."""
    lo, full_start, full_end, hi = window_key_range(start_m, block_m, block_n, n, m, left, right)
    ragged = start_m + block_m > n
    full_start = select(ragged, hi, full_start)
    full_end = select(ragged, hi, full_end)
    return lo, full_start, full_end, hi


def window_query_range(start_n, block_m, block_n, n, m, left, right):
    """Query ranges the dK/dV loop of one key block walks under a window.

    Returns ``(lo, full_start, full_end, hi)``: query blocks starting in ``[lo, full_start)`` and
    ``[full_end, hi)`` run masked, those in ``[full_start, full_end)`` see the whole key block.
    Rows below ``lo`` or from ``hi`` on see none of it. A ragged key block, and the ragged last
    query block, are always masked (as in :func:`backward_query_range`).
    """
    last_key = start_n + block_n - 1
    lo = clamp(start_n + n - m - right, 0, n) // block_m * block_m  # the first row seeing the first key
    hi = clamp(last_key + n - m + left + 1, 0, n)  # past the last row seeing the last key
    # Unmasked: rows that see the block's last key by the right bound (rounded up to a block) ...
    first_full = (clamp(last_key + n - m - right, 0, n) + block_m - 1) // block_m * block_m
    # ... and its first key by the left bound, below the ragged last query block.
    end_full = minimum(clamp(start_n + n - m + left + 1, 0, n), n // block_m * block_m) // block_m * block_m
    full_start = clamp(first_full, lo, hi)
    full_end = clamp(end_full, full_start, hi)
    full_end = select(start_n + block_n > m, full_start, full_end)
    return lo, full_start, full_end, hi
# --8<-- [end:window-range]


# --8<-- [start:boundaries]
def fwd_first_masked_key(start_m, n, m):
    """Keys below this index are visible to every row of the query block that starts at ``start_m``.

    The block's first row, ``start_m``, sees keys ``j <= start_m + m - n``; later rows see more.
    """
    return start_m + m - n + 1


def fwd_end_visible_key(start_m, block_m, n, m):
    """Keys at or past this index are visible to no row of the query block starting at ``start_m``.

    Its last row, ``start_m + block_m - 1``, sees keys up to ``start_m + block_m - 1 + m - n``.
    """
    return start_m + block_m + m - n


def bwd_first_seeing_query(start_n, n, m):
    """Query rows below this index see no key of the key block that starts at ``start_n``.

    Key ``j`` is seen by the rows ``i >= j - (m - n)``; the block's first key is the earliest seen.
    """
    return start_n + n - m


def bwd_first_full_query(start_n, block_n, n, m):
    """Query rows at or past this index see every key of the key block starting at ``start_n``."""
    return start_n + block_n - 1 + n - m
# --8<-- [end:boundaries]


# --8<-- [start:forward-range]
def forward_key_range(start_m, block_m, block_n, n, m, causal):
    """Key ranges the forward loop of one query block walks.

    Returns ``(full_end, hi)``: key blocks starting in ``[0, full_end)`` run without a mask,
    those starting in ``[full_end, hi)`` run with one, keys from ``hi`` on are skipped.
    ``full_end`` is a multiple of ``block_n``, so the unmasked loop never touches a ragged edge.
    """
    full_end = m
    hi = m
    if causal:
        full_end = clamp(fwd_first_masked_key(start_m, n, m), 0, m)
        hi = clamp(fwd_end_visible_key(start_m, block_m, n, m), 0, m)
    full_end = full_end // block_n * block_n  # operands are >= 0: // floors in Python and Triton alike
    return full_end, hi
# --8<-- [end:forward-range]


# --8<-- [start:dq-range]
def dq_key_range(start_m, block_m, block_n, n, m, causal):
    """Key ranges the dQ loop of one query block walks: the forward's, except that a ragged last
    query block masks every tile, so its padding rows (past ``n``) never enter dS."""
    full_end, hi = forward_key_range(start_m, block_m, block_n, n, m, causal)
    full_end = select(start_m + block_m > n, 0, full_end)
    return full_end, hi
# --8<-- [end:dq-range]


# --8<-- [start:backward-range]
def backward_query_range(start_n, block_m, block_n, n, m, causal):
    """Query ranges the dK/dV loop of one key block walks.

    Returns ``(lo, full_start, full_end)``: query blocks starting in ``[lo, full_start)`` straddle the
    diagonal and need the causal mask, those in ``[full_start, full_end)`` see the whole key block,
    and the rest, up to ``n`` (the ragged last query block), needs the row mask. Rows below ``lo``
    see none of the block and are skipped. A ragged key block (one reaching past ``m``) has no
    unmasked tiles at all: its padded keys must stay out of dS. ``lo`` and ``full_start`` are
    multiples of ``block_m``.
    """
    full_end = n // block_m * block_m
    lo = 0
    full_start = 0
    if causal:
        lo = clamp(bwd_first_seeing_query(start_n, n, m), 0, n) // block_m * block_m
        first_full = clamp(bwd_first_full_query(start_n, block_n, n, m), 0, n)
        up = (first_full + block_m - 1) // block_m * block_m  # round up to a block boundary
        full_start = maximum(minimum(up, full_end), lo)
    full_end = maximum(full_end, full_start)
    full_end = select(start_n + block_n > m, full_start, full_end)
    return lo, full_start, full_end
# --8<-- [end:backward-range]


# --8<-- [start:launch-order]
def launch_order(pid, n_blocks, heads_per_group):
    """Which block of which (batch, head) the ``pid``-th launched program of a causal kernel takes.

    Returns ``(rank, head)``; rank 0 is the block with the most work (the last query block in the
    forward and dQ, the first key block in dK/dV). The heads go in groups of ``heads_per_group``
    (which must divide the number of heads); inside a group every head's rank 0 launches before any
    rank 1, and so on. The GPU starts programs roughly in launch order, so the long blocks start
    early and the short ones fill the gaps at the end, while each group is small enough that the
    heads in flight share the L2 cache. ``heads_per_group = 1`` is one head after the other.
    Only ``//``, ``*``, ``+`` and ``-`` on non-negative integers: the kernels run this function.
    """
    per_group = n_blocks * heads_per_group
    group = pid // per_group
    r = pid - group * per_group
    rank = r // heads_per_group
    head = group * heads_per_group + r - rank * heads_per_group
    return rank, head
# --8<-- [end:launch-order]


# --8<-- [start:packed-tile]
def sequence_of_tile(tile, tile_offsets, n_seqs):
    """The sequence that the ``tile``-th tile of a packed batch belongs to.

    ``tile_offsets`` holds ``n_seqs + 1`` non-decreasing entries, ``tile_offsets[s]`` being the
    number of tiles of the sequences before ``s`` (0 first); a sequence with no rows has no tile and
    repeats its neighbour's entry. A binary search for the last ``s < n_seqs`` with
    ``tile_offsets[s] <= tile``: that sequence has ``tile_offsets[s + 1] > tile``, so it is never an
    empty one. A tile at or past the last entry lands in the last sequence, past its end, which
    :func:`packed_tile`'s caller checks. ``tile * 0`` is a zero of the tile's own type: on the device
    the loop's bounds must be tensors from the start.
    """
    lo = tile * 0  # invariant: tile_offsets[lo] <= tile, and tile < tile_offsets[hi] or hi == n_seqs
    hi = lo + n_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        later = load(tile_offsets, mid) <= tile
        lo = select(later, mid, lo)
        hi = select(later, hi, mid)
    return lo


def packed_tile(tile, block, tile_offsets, cu_tiled, cu_other, n_seqs):
    """Where the ``tile``-th tile of a packed batch lies: one program's share of a varlen kernel.

    The tiled side (queries in the forward and dQ, keys in dK/dV) has ``block`` rows per tile and the
    sequence boundaries ``cu_tiled`` (``n_seqs + 1`` cumulative lengths, 0 first); ``cu_other`` are
    the boundaries of the other side. Returns ``(seq, start, tiled_start, other_start, tiled_len,
    other_len)``: the tile's sequence, its first row inside that sequence, where the sequence begins
    in each packed tensor, and its two lengths (the sequence index picks a sequence's ALiBi slopes and
    counts its dropout draws, as the batch index does for dense tensors). ``start >= tiled_len`` marks a program with no tile: the launch has
    ``cdiv(total, block) + n_seqs`` programs per head, a bound the host knows without reading the
    lengths, and the programs past the last tile stop at once.
    """
    seq = sequence_of_tile(tile, tile_offsets, n_seqs)
    start = (tile - load(tile_offsets, seq)) * block
    tiled_start = load(cu_tiled, seq)
    other_start = load(cu_other, seq)
    tiled_len = load(cu_tiled, seq + 1) - tiled_start
    other_len = load(cu_other, seq + 1) - other_start
    return seq, start, tiled_start, other_start, tiled_len, other_len
# --8<-- [end:packed-tile]


def packed_tile_offsets(cu_seqlens, block):
    """``tile_offsets`` of :func:`sequence_of_tile` for a list of cumulative lengths (the host mirror of
    the launcher's torch ops): the running sum of ``cdiv(length, block)`` over the sequences."""
    offsets = [0]
    for lo, hi in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        offsets.append(offsets[-1] + -(-(hi - lo) // block))
    return offsets


def packed_programs(cu_tiled, cu_other, block):
    """What every program of one head of a varlen launch does, on the host.

    Returns one entry per launched program (``cdiv(total, block) + n_seqs`` of them): ``None`` for a
    program that stops at once, else ``(seq, start, tiled_start, other_start, tiled_len, other_len)``
    from the very :func:`packed_tile` the kernels run. The figure of the packing page and the tests
    count from here.
    """
    n_seqs = len(cu_tiled) - 1
    offsets = packed_tile_offsets(cu_tiled, block)
    programs = []
    for tile in range(-(-cu_tiled[-1] // block) + n_seqs):
        seq, start, tiled_start, other_start, tiled_len, other_len = packed_tile(
            tile, block, offsets, cu_tiled, cu_other, n_seqs)
        programs.append(None if start >= tiled_len else (seq, start, tiled_start, other_start, tiled_len, other_len))
    return programs


@functools.lru_cache(maxsize=256)
def heads_per_group(n_heads: int, n_blocks: int, programs: int) -> int:
    """The largest divisor ``g`` of ``n_heads`` with ``g * n_blocks <= programs`` (at least 1).

    ``programs`` is how many programs a group should hold: about two waves of the GPU is enough
    for the longest-first order to even out the end of the grid.
    """
    best = 1
    for g in range(1, n_heads + 1):
        if n_heads % g == 0 and g * n_blocks <= programs:
            best = g
    return best


def classify_block(
    start_m: int, start_n: int, block_m: int, block_n: int, n: int, m: int, causal: bool, window=None
) -> str:
    """How the forward schedule treats the tile at (``start_m``, ``start_n``): full, masked or skipped.

    ``window = (left, right)`` (``None`` on a side = unbounded) walks :func:`window_key_range` instead.
    """
    if window is None:
        full_end, hi = forward_key_range(start_m, block_m, block_n, n, m, causal)
        lo = full_start = 0
    else:
        left, right = window_bounds(n, m, causal, window)
        lo, full_start, full_end, hi = window_key_range(start_m, block_m, block_n, n, m, left, right)
    if start_n < lo or start_n >= hi:
        return SKIPPED
    if full_start <= start_n < full_end:
        return FULL
    return MASKED


def block_grid(n: int, m: int, block_m: int, block_n: int, causal: bool, *, window=None) -> list[list[str]]:
    """The whole schedule as a grid of labels: ``grid[query block][key block]``.

    ``window = (left, right)``, when given, is the sliding window (``None`` on a side = unbounded).
    """
    return [
        [classify_block(sm, sn, block_m, block_n, n, m, causal, window) for sn in range(0, m, block_n)]
        for sm in range(0, n, block_m)
    ]


# --8<-- [start:decode-split-range]
def decode_split_range(split, n_splits, seq_len, block_n):
    """Keys ``[lo, hi)`` that split ``split`` of ``n_splits`` walks in a sequence of ``seq_len`` keys.

    The sequence's key blocks are dealt out in equal runs of whole blocks, so ``lo`` is a multiple of
    ``block_n`` and only the last block of the sequence is ragged. A split whose run starts past the
    end gets no keys (the caller clamps ``hi`` to the sequence). Only ``+``, ``-``, ``*`` and ``//``
    on non-negative integers: the split kernel runs this very function.
    """
    blocks = (seq_len + block_n - 1) // block_n
    per_split = (blocks + n_splits - 1) // n_splits
    lo = split * per_split * block_n
    return lo, lo + per_split * block_n
# --8<-- [end:decode-split-range]
