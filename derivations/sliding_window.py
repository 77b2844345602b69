# --8<-- [start:statement]
"""The sliding window. With N queries, M keys and a window (left, right), query i sees key j exactly when

    i + M − N − left ≤ j ≤ i + M − N + right,

aligned bottom-right like causal: a_i = i + M − N is the key on row i's diagonal. An unbounded side
(None) is the same as left = M or right = N (no pair reaches further), and causal composes as
right ← min(right, 0). Row i sees

    count_i = max(0, min(a_i + right, M − 1) − max(a_i − left, 0) + 1)

keys, at most w = left + right + 1, so the visible pairs number at most N·w. A row with count_i = 0
(a_i + right < 0 or a_i − left > M − 1) gets o = 0 and LSE = −∞, like an empty causal row.

In tiles: a query block of block_m rows starting at start_m needs only the keys from its first row's
left edge, a_start − left, to its last row's right edge, a_start + block_m − 1 + right; key blocks
outside that range are skipped. That is at most ⌈(block_m + left + right)/block_n⌉ + 1 key blocks
whatever M is, so the work is O(N·w), not O(N·M). Tiles wholly inside every row's window (at or
past the last row's left edge, before the first row's right edge) run without a mask.
"""
# --8<-- [end:statement]

from __future__ import annotations

import itertools

from ._result import CheckResult, Ledger

IDENTITY = ("sliding window: i + M − N − left ≤ j ≤ i + M − N + right; count_i = max(0, min(a_i + right, M − 1) − "
            "max(a_i − left, 0) + 1) ≤ w; the schedule skips no visible pair, masks every hidden one, visits O(N·w) tiles")
METHOD = ("brute force over (N, M, left, right, causal) against the closed form; pair-by-pair check of "
          "flashattn.schedule's window ranges (forward, dQ, dK/dV) and block_grid(window=...); tile counts at N = M = 4096")
NEGATIVE = ("top-left window (a_i = i); causal not capping right at 0; the unmasked range starting at the first "
            "row's left edge; hi rounded down to a key block; no skipping (lo = 0, hi = M) against the O(N·w) bound")


# --8<-- [start:formula]
def bounds(n, m, causal, window):
    """(left, right) as plain integers: None = unbounded (M on the left, N on the right); causal caps right at 0."""
    left, right = window
    left = m if left is None else min(left, m)
    right = n if right is None else min(right, n)
    return left, (min(right, 0) if causal else right)


def row_count(i, n, m, left, right, diagonal=lambda i, n, m: i + m - n):
    """Keys row i sees: the window [a − left, a + right] cut to [0, M − 1], a = i + M − N."""
    a = diagonal(i, n, m)
    return max(0, min(a + right, m - 1) - max(a - left, 0) + 1)
# --8<-- [end:formula]


def sees(i, j, n, m, left, right):
    return 0 <= i < n and 0 <= j < m and i + m - n - left <= j <= i + m - n + right


WINDOWS = [(0, 0), (1, 0), (3, 2), (0, 5), (None, 0), (2, None), (None, None), (7, 1), (16, 16)]
SHAPES = [(1, 1), (5, 5), (7, 12), (12, 7), (16, 16), (33, 20), (20, 33), (1, 40), (40, 1)]
BLOCKS = [(4, 4), (4, 8), (8, 4), (16, 16)]


# --8<-- [start:proof]
def count_route(count=None, bound=bounds) -> bool:
    """The closed form against brute force, every row, every (shape, window, causal); and count_i ≤ w."""
    count = count or row_count
    for (n, m), window, causal in itertools.product(SHAPES, WINDOWS, (False, True)):
        left, right = bound(n, m, causal, window)
        true_left, true_right = bounds(n, m, causal, window)
        for i in range(n):
            brute = sum(sees(i, j, n, m, true_left, true_right) for j in range(m))
            if count(i, n, m, left, right) != brute or brute > max(0, true_left + true_right + 1):
                return False
    return True


def _walk(lo, full_start, full_end, hi, block):
    """The tiles a kernel loop visits, as (start, masked): range(lo, full_start) and range(full_end, hi)
    masked, range(full_start, full_end) unmasked, in steps of one block."""
    return ([(s, True) for s in range(lo, full_start, block)] + [(s, False) for s in range(full_start, full_end, block)]
            + [(s, True) for s in range(full_end, hi, block)])


def schedule_route(key_range=None, query_range=None, bound=bounds) -> bool:
    """Pair by pair, for every shape, window, causal flag and tile size: the forward, dQ and dK/dV walks
    leave no visible pair out and run no hidden or out-of-range pair unmasked (the forward may run the
    padding rows of a ragged query block unmasked: it never stores them; dQ and dK/dV may not), and
    block_grid(window=...) never labels a tile with a visible pair skipped or one with a hidden pair full."""
    from flashattn import schedule

    key_range = key_range or schedule.window_key_range
    query_range = query_range or schedule.window_query_range
    dq_range = schedule.window_dq_key_range if key_range is schedule.window_key_range else key_range
    for (n, m), window, causal, (bm, bn) in itertools.product(SHAPES, WINDOWS, (False, True), BLOCKS):
        left, right = bound(n, m, causal, window)
        L, R = bounds(n, m, causal, window)  # the truth the walks are judged by
        ok = lambda i, j: sees(i, j, n, m, L, R)
        for sm in range(0, n, bm):
            rows = range(sm, sm + bm)
            for walk, padding_rows_may_run in ((key_range, True), (dq_range, False)):
                tiles = _walk(*walk(sm, bm, bn, n, m, left, right), bn)
                covered = {j for s, _ in tiles for j in range(s, s + bn)}
                if any(ok(i, j) and j not in covered for i in rows for j in range(m)):
                    return False
                for s, masked in tiles:
                    if not masked and not all(ok(i, j) for i in rows for j in range(s, s + bn)
                                              if i < n or not padding_rows_may_run):
                        return False
        for sn in range(0, m, bn):
            keys = range(sn, sn + bn)
            tiles = _walk(*query_range(sn, bm, bn, n, m, left, right), bm)
            covered = {i for s, _ in tiles for i in range(s, s + bm)}
            if any(ok(i, j) and i not in covered for j in keys for i in range(n)):
                return False
            if any(not masked and not all(ok(i, j) for i in range(s, s + bm) for j in keys) for s, masked in tiles):
                return False
        grid = schedule.block_grid(n, m, bm, bn, causal, window=window)
        for (bi, row), sm in zip(enumerate(grid), range(0, n, bm)):
            for label, sn in zip(row, range(0, m, bn)):
                pairs = [(i, j) for i in range(sm, min(sm + bm, n)) for j in range(sn, sn + bn)]
                if label == schedule.SKIPPED and any(ok(i, j) for i, j in pairs):
                    return False
                if label == schedule.FULL and not all(ok(i, j) for i, j in pairs):
                    return False
    return True
# --8<-- [end:proof]


# --8<-- [start:numeric]
def cost_route(key_range=None, n=4096, m=4096, block_m=128, block_n=64, window=(256, 0)) -> bool:
    """Tiles one head visits at N = M = 4096, window (256, 0): at most ⌈(block_m + left + right)/block_n⌉ + 1
    per query block, whatever M is: about N·w / (block_m·block_n), not N·M / (block_m·block_n)."""
    from flashattn import schedule

    key_range = key_range or schedule.window_key_range
    left, right = bounds(n, m, False, window)
    per_block = -(-(block_m + left + right) // block_n) + 1
    visited = 0
    for sm in range(0, n, block_m):
        lo, _, _, hi = key_range(sm, block_m, block_n, n, m, left, right)
        blocks = len(range(lo // block_n * block_n, hi, block_n))
        if blocks > per_block:
            return False
        visited += blocks
    return visited <= -(-n // block_m) * per_block < (n // block_m) * (m // block_n) // 4


def causal_route() -> bool:
    """window (None, 0) without causal is causal; window (left, right) with causal is (left, min(right, 0))."""
    from flashattn import schedule

    for (n, m), (bm, bn) in itertools.product(SHAPES, BLOCKS):
        plain = [[schedule.is_visible(i, j, n, m, True) for j in range(m)] for i in range(n)]
        if plain != [[schedule.is_visible(i, j, n, m, False, (None, 0)) for j in range(m)] for i in range(n)]:
            return False
        for window in WINDOWS:
            capped = (window[0], 0 if window[1] is None else min(window[1], 0))
            if ([[schedule.is_visible(i, j, n, m, True, window) for j in range(m)] for i in range(n)]
                    != [[schedule.is_visible(i, j, n, m, False, capped) for j in range(m)] for i in range(n)]):
                return False
    return True
# --8<-- [end:numeric]


def check() -> CheckResult:
    from flashattn import schedule

    ledger = Ledger()
    ledger.claim(f"closed-form count_i = brute force, and count_i ≤ left + right + 1: {len(SHAPES)} shapes × "
                 f"{len(WINDOWS)} windows × causal on/off", count_route)
    ledger.claim(f"schedule pair by pair (forward, dQ, dK/dV, block_grid): no visible pair skipped, no hidden or "
                 f"out-of-range pair unmasked; tiles {BLOCKS}", schedule_route)
    ledger.claim("window (None, 0) is causal; causal with (left, right) is (left, min(right, 0))", causal_route)
    ledger.claim("N = M = 4096, window (256, 0), 128×64 tiles: ≤ ⌈(128 + 256)/64⌉ + 1 key blocks per query block, "
                 "under a quarter of the full grid", cost_route)
    # --8<-- [start:negative]
    top_left = lambda i, n, m, left, right: row_count(i, n, m, left, right, diagonal=lambda i, n, m: i)
    no_causal_cap = lambda n, m, causal, window: bounds(n, m, False, window)

    def full_from_first_row(start_m, block_m, block_n, n, m, left, right):
        lo, _, full_end, hi = schedule.window_key_range(start_m, block_m, block_n, n, m, left, right)
        first = (max(0, min(start_m + m - n - left, m)) + block_n - 1) // block_n * block_n
        return lo, min(max(first, lo), full_end), full_end, hi

    def hi_rounded_down(start_m, block_m, block_n, n, m, left, right):
        lo, fs, fe, hi = schedule.window_key_range(start_m, block_m, block_n, n, m, left, right)
        hi = hi // block_n * block_n
        return lo, min(fs, hi), min(fe, hi), hi

    def no_skipping(start_m, block_m, block_n, n, m, left, right):
        _, fs, fe, _ = schedule.window_key_range(start_m, block_m, block_n, n, m, left, right)
        return 0, fs, fe, m

    for name, route in (("top-left window a_i = i: count", lambda: count_route(count=top_left)),
                        ("causal without right ← min(right, 0): count", lambda: count_route(bound=no_causal_cap)),
                        ("causal without right ← min(right, 0): schedule",
                         lambda: schedule_route(bound=no_causal_cap)),
                        ("unmasked range from the first row's left edge: schedule",
                         lambda: schedule_route(key_range=full_from_first_row)),
                        ("hi rounded down to a key block: schedule", lambda: schedule_route(key_range=hi_rounded_down)),
                        ("no skipping (lo = 0, hi = M): cost", lambda: cost_route(key_range=no_skipping))):
        ledger.control(name, lambda route=route: not route())
    # --8<-- [end:negative]
    sizes = (f"{len(SHAPES)} shapes (1x1 … 40x1, N ≠ M both ways) × {len(WINDOWS)} windows (None sides included) × "
             f"causal on/off × tiles {', '.join(f'{a}x{b}' for a, b in BLOCKS)}; cost at 4096x4096")
    return ledger.result(identity=IDENTITY, method=METHOD, sizes=sizes,
                         negative_control=NEGATIVE, module=__name__)
