"""Device helpers shared by the Triton kernels: the base-2 constants, the schedule compiled for the
device, the tile mask, the score modifications of the variants, the dropout mask and the
program-to-tile map. ``@triton.jit`` code only; importing it imports Triton and touches no GPU.
"""

from __future__ import annotations

import types

import triton
import triton.language as tl

from flashattn import constants, schedule

# Kernels may read module globals only when they are constexpr; host code uses ``.value``.
LOG2E = tl.constexpr(constants.LOG2E)
LN2 = tl.constexpr(constants.LN2)


# --8<-- [start:device-schedule]
@triton.jit
def _minimum(a, b):
    return tl.minimum(a, b)


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _clamp(x, lo, hi):
    return tl.minimum(tl.maximum(x, lo), hi)


@triton.jit
def _select(condition, if_true, if_false):
    return tl.where(condition, if_true, if_false)


@triton.jit
def _load(table, i):
    return tl.load(table + i)


# The kernels' view of flashattn.schedule: the same functions, compiled, with the five primitives
# swapped for their Triton twins. Triton's interpreter insists on seeing triton.language among a
# jitted function's globals, so the clones get a copy of the module's globals with it added.
_SCOPE = dict(vars(schedule), tl=tl, minimum=_minimum, maximum=_maximum, clamp=_clamp, select=_select, load=_load)


def device_fn(fn):
    """``fn`` of :mod:`flashattn.schedule`, compiled with ``triton.jit`` over the device primitives."""
    clone = types.FunctionType(fn.__code__, _SCOPE, fn.__name__, fn.__defaults__, fn.__closure__)
    clone.__doc__, clone.__module__, clone.__qualname__ = fn.__doc__, fn.__module__, fn.__qualname__
    jitted = triton.jit(clone)
    _SCOPE[fn.__name__] = jitted  # composed functions call the compiled versions of their parts
    return jitted


fwd_first_masked_key = device_fn(schedule.fwd_first_masked_key)
fwd_end_visible_key = device_fn(schedule.fwd_end_visible_key)
bwd_first_seeing_query = device_fn(schedule.bwd_first_seeing_query)
bwd_first_full_query = device_fn(schedule.bwd_first_full_query)
clamp = _clamp
visible = device_fn(schedule.visible)
forward_key_range = device_fn(schedule.forward_key_range)
dq_key_range = device_fn(schedule.dq_key_range)
backward_query_range = device_fn(schedule.backward_query_range)
launch_order = device_fn(schedule.launch_order)
sequence_of_tile = device_fn(schedule.sequence_of_tile)
packed_tile = device_fn(schedule.packed_tile)
in_window = device_fn(schedule.in_window)
window_key_range = device_fn(schedule.window_key_range)
window_dq_key_range = device_fn(schedule.window_dq_key_range)
window_query_range = device_fn(schedule.window_query_range)
decode_split_range = device_fn(schedule.decode_split_range)
# --8<-- [end:device-schedule]


@triton.jit
def tile_mask(rows, cols, N_CTX_Q, N_CTX_K, win_left, win_right, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """The schedule's visibility test, with the window's when there is one."""
    mask = visible(rows, cols, N_CTX_Q, N_CTX_K, CAUSAL)
    if HAS_WINDOW:
        mask = mask & in_window(rows, cols, N_CTX_Q, N_CTX_K, win_left, win_right)
    return mask


@triton.jit
def tanh(x):
    """tanh from one exp2: (1 - e) / (1 + e) with e = exp(-2|x|) in (0, 1], so nothing overflows
    for any finite x, and the sign comes back last. Absolute error a few float32 ulps of 1."""
    e = tl.exp2(tl.abs(x) * (-2.0 * LOG2E))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


# --8<-- [start:score-mods]
@triton.jit
def score_mods(qk, rows, cols, N_CTX_Q, N_CTX_K, qk_scale, cap_in, cap_out, slope2,
               SOFTCAP: tl.constexpr, ALIBI: tl.constexpr):
    """Base-2 scores of a tile of raw products q . k, and the tanh the softcap backward needs.

    Plain: s = c q.k with c = scale * log2(e). Softcap: the natural score scale * q.k becomes
    cap * tanh(scale * q.k / cap), so t = tanh(q.k * cap_in) with ``cap_in = scale / cap`` and
    s = t * cap_out with ``cap_out = cap * log2(e)``. ALiBi then adds -slope * |i + M - N - j|
    (``slope2`` is the head's slope times log2(e)): after the cap, as in the definition. ``rows``
    and ``cols`` broadcast to the tile ([R, 1] and [1, C], or transposed in the dK/dV loop). The
    returned ``t`` is meaningful only with SOFTCAP.
    """
    if SOFTCAP:
        t = tanh(qk * cap_in)
        s = t * cap_out
    else:
        t = qk
        s = qk * qk_scale
    if ALIBI:
        distance = tl.abs(rows + (N_CTX_K - N_CTX_Q) - cols).to(tl.float32)
        s = s - slope2 * distance
    return s, t
# --8<-- [end:score-mods]


# --8<-- [start:dropout-mask]
@triton.jit
def dropout_keep(seed_lo, seed_hi, i_bh, rows, first_col, threshold, BLOCK_N: tl.constexpr):
    """Which entries of the tile (rows, first_col .. first_col + BLOCK_N) of P survive dropout: a
    [len(rows), BLOCK_N] mask, a pure function of (seed, b * Hq + h, i, j).

    One Philox-4x32-10 draw (Triton's ``tl.philox``) serves eight neighbouring keys of one row: it is
    keyed by the 62-bit seed (passed as two 31-bit halves, so every launch has the same argument
    types) and counted by three separate 32-bit words, the key group ``j // 8``, the query index ``i``
    and ``b * Hq + h``, so no word ever wraps, whatever B * H * N * M is. Its four 32-bit output words
    give eight 16-bit lanes; key ``j`` reads lane ``j % 8`` = 2 w + h, the low (h = 0) or high
    (h = 1) half of word w. An entry is dropped when its lane falls below
    ``threshold = floor(p * 2^16)``. ``first_col`` must be a multiple of 8 (key tiles start at
    multiples of BLOCK_N); a kernel with transposed tiles transposes the result, so the same (i, j)
    gives the same bit in every kernel.
    """
    seed = (seed_hi.to(tl.int64) << 31) | seed_lo.to(tl.int64)
    groups = first_col // 8 + tl.arange(0, BLOCK_N // 8)  # [BLOCK_N // 8]
    c0 = (groups[None, :] + rows[:, None] * 0).to(tl.uint32)  # every counter word spans the draws' tile
    c1 = (rows[:, None] + groups[None, :] * 0).to(tl.uint32)
    c2 = (c0 * 0 + i_bh).to(tl.uint32)
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, c2, c2 * 0)  # [rows, BLOCK_N // 8] each
    # join appends an axis: words[..., a, b] = r_(2a + b), then lanes[..., a, b, h] = half h of it,
    # so the row-major flattening of the last three axes is the lane 2 w + h.
    words = tl.join(tl.join(r0, r2), tl.join(r1, r3))
    lanes = tl.join(words & 0xFFFF, words >> 16)
    lanes = tl.reshape(lanes, [rows.shape[0], BLOCK_N])
    return lanes.to(tl.int32) >= threshold
# --8<-- [end:dropout-mask]


# --8<-- [start:program-tile]
@triton.jit
def program_tile(n_blocks, heads_per_group, LONGEST_FIRST: tl.constexpr):
    """(block, batch * head) of this program.

    The grid is one-dimensional, ``n_blocks * B * H`` programs long, so B * H is not bound by the
    65 535 programs that grid axes 1 and 2 allow. Programs launch in the order of their index, and the
    schedule's :func:`flashattn.schedule.launch_order` maps that index to a tile: without a causal mask
    (one head per group) that is plain row-major order; with one, rank 0, the block with the most
    work, launches first across a group of heads. ``LONGEST_FIRST`` turns rank into a query block
    (the last query block walks the most keys); key blocks of dK/dV are already longest first.
    """
    rank, i_bh = launch_order(tl.program_id(0), n_blocks, heads_per_group)
    block = rank
    if LONGEST_FIRST:
        block = n_blocks - 1 - rank
    return block, i_bh
# --8<-- [end:program-tile]
