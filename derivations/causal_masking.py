# --8<-- [start:statement]
"""Causal masking, aligned bottom-right: with N queries and M keys, query i sees key j exactly when
j ≤ i + M − N. The last query always sees every key (decoding with a KV cache); for N = M this is
the lower triangle j ≤ i. Row i sees clamp(i + M − N + 1, 0, M) keys, so with r = min(N, M)

    visible pairs = r (M − r) + r (r + 1) / 2,

i.e. N·M − N(N − 1)/2 when N ≤ M, and M(M + 1)/2 when N > M. For N = M the visible fraction is
(N + 1) / (2N), a little more than half. When N > M the first N − M query rows see no key at all:
their output is 0 and their LSE −∞.

Top-left alignment (query i sees keys j ≤ i, the first i + 1 keys, whatever M is) is the other
convention in use: it is what PyTorch's `scaled_dot_product_attention(is_causal=True)` does for
N ≠ M. The two agree when N = M. This module checks SDPA's behaviour and that the two differ
otherwise.

Tiled into block_m × block_n tiles, the schedule of `flashattn.schedule` marks each tile full (no pair
masked: runs without a mask), masked (straddles the diagonal or the ragged key edge) or skipped (no
visible pair: never loaded). This module checks, pair by pair, that the schedule the kernels use
never skips a visible pair and never runs a masked pair without its mask.
"""
# --8<-- [end:statement]

from __future__ import annotations

import itertools

from flashattn import cost

from ._result import CheckResult, Ledger

IDENTITY = "causal masking (bottom-right): visible count, full/masked/skipped tiles, work saved, empty rows"
METHOD = ("SymPy summation (closed form); exact counts pair by pair against flashattn.schedule; "
          "reference on empty rows")
NEGATIVE = "top-left alignment (j ≤ i) for N ≠ M; a top-left tile schedule; 'causal halves the work' exactly"


# --8<-- [start:formula]
def visible_pairs(n: int, m: int) -> int:
    """Closed form of the number of (query, key) pairs with j ≤ i + m − n: r(m − r) + r(r + 1)/2,
    r = min(n, m). The benchmarks' FLOP count uses this function from flashattn.cost."""
    return cost.visible_pairs(n, m, causal=True)


def visible_fraction(n: int, m: int) -> float:
    return visible_pairs(n, m) / (n * m)


def bottom_right(i: int, j: int, n: int, m: int) -> bool:
    return 0 <= i < n and 0 <= j < m and j <= i + m - n
# --8<-- [end:formula]


# --8<-- [start:proof]
def closed_form_symbolic() -> bool:
    """Sum the per-row counts symbolically in the two regimes; the clamp never binds where it is
    dropped (N ≤ M: i + M − N + 1 ∈ [1, M]; N > M: rows i < N − M count i + M − N + 1 ≤ 0 → 0)."""
    import sympy as sp

    i = sp.Symbol("i", integer=True)
    n, m, extra = sp.symbols("n m extra", integer=True, nonnegative=True)
    r_le = sp.summation(i + m - n + 1, (i, 0, n - 1))                    # N ≤ M
    closed_le = n * (m - n) + n * (n + 1) / 2
    big_n = m + extra + 1                                                 # N > M
    r_gt = sp.summation(i + m - big_n + 1, (i, big_n - m, big_n - 1))
    closed_gt = m * (m + 1) / 2
    clamp_ok = (sp.simplify((0 + m - n + 1) - (m - n + 1)) == 0          # row 0 sees M − N + 1 ≥ 1
                and sp.simplify(((n - 1) + m - n + 1) - m) == 0           # row N − 1 sees exactly M
                and sp.simplify(((big_n - m - 1) + m - big_n + 1)) == 0)  # last empty row counts 0
    return sp.simplify(r_le - closed_le) == 0 and sp.simplify(r_gt - closed_gt) == 0 and clamp_ok


def counts_match(predicate, sizes) -> bool:
    """Exact pair counts of `predicate` against the closed form that flashattn.cost uses."""
    for n, m in sizes:
        brute = sum(predicate(i, j, n, m) for i in range(n) for j in range(m))
        if not brute == visible_pairs(n, m):
            return False
    return True


def alignment_facts(predicate, sizes) -> bool:
    """What bottom-right alignment promises: the last query sees every key, and N = M is j ≤ i."""
    for n, m in sizes:
        if not all(predicate(n - 1, j, n, m) for j in range(m)):
            return False
    return all(predicate(i, j, n, n) == (j <= i) for n in (1, 5, 8) for i in range(n) for j in range(n))


def visibility(n: int, m: int):
    """The (n, m) boolean matrix of bottom-right visible pairs."""
    import numpy as np

    return np.arange(m)[None, :] <= np.arange(n)[:, None] + (m - n)


def schedule_sound(classify, n, m, block_m, block_n) -> tuple[bool, dict]:
    """Pair by pair: a skipped tile holds no visible pair; a full tile no masked pair (in-range rows
    see every key of it, and it never reaches past key M); a masked tile at least one visible pair."""
    seen_all = visibility(n, m)
    counts = {"full": 0, "masked": 0, "skipped": 0}
    for start_m, start_n in itertools.product(range(0, n, block_m), range(0, m, block_n)):
        kind = classify(start_m, start_n, block_m, block_n, n, m, True)
        counts[kind] += 1
        seen = seen_all[start_m:start_m + block_m, start_n:start_n + block_n]  # in-range part
        if kind == "skipped" and seen.any():
            return False, counts
        if kind == "full" and not (seen.all() and start_n + block_n <= m):
            return False, counts
        if kind == "masked" and not seen.any():
            return False, counts
    return True, counts


def backward_sound(n, m, block_m, block_n) -> bool:
    """The dK/dV loop: query blocks below lo hold no visible pair with the key block, blocks in
    [full_start, full_end) see all of its in-range keys with in-range rows, and [lo, n) covers every
    query that sees any of its keys."""
    from flashattn import schedule

    seen_all = visibility(n, m)
    for start_n in range(0, m, block_n):
        lo, full_start, full_end = schedule.backward_query_range(start_n, block_m, block_n, n, m, True)
        keys = seen_all[:, start_n:start_n + block_n]
        if keys[:lo].any() or not keys[full_start:full_end].all():
            return False
        if full_end > n or lo % block_m or full_start % block_m or not lo <= full_start <= full_end:
            return False
    return True


# --8<-- [end:proof]


# --8<-- [start:numeric]
def work_saved(n, m, block_m, block_n) -> tuple[float, float]:
    """(fraction of tiles skipped, fraction of pairs masked) for the causal schedule."""
    from flashattn import schedule

    grid = schedule.block_grid(n, m, block_m, block_n, True)
    tiles = [kind for row in grid for kind in row]
    return tiles.count(schedule.SKIPPED) / len(tiles), 1 - visible_fraction(n, m)


def empty_rows(n, m) -> list[int]:
    return [i for i in range(n) if not any(bottom_right(i, j, n, m) for j in range(m))]


def empty_rows_in_reference(n, m, d=4) -> bool:
    """The reference gives o = 0 and lse = −∞ on exactly those rows, and no NaN anywhere."""
    import torch

    from flashattn.reference import naive_attention

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, r, d, generator=gen, dtype=torch.float64) for r in (n, m, m))
    o, lse = naive_attention(q, k, v, causal=True)
    empty = torch.tensor([i in empty_rows(n, m) for i in range(n)])
    return bool(torch.all(o[0, 0][empty] == 0) and torch.all(lse[0, 0][empty] == float("-inf"))
                and torch.all(torch.isfinite(lse[0, 0][~empty])) and not torch.isnan(o).any())
# --8<-- [end:numeric]


COUNT_SIZES = [(n, m) for n in range(1, 25) for m in range(1, 25)]
# Every offset M − N in a range, against small blocks (so every residue of the offset modulo the block
# sizes occurs) and against kernel-sized blocks.
TILE_CASES = ([(n, m, bm, bn) for n in range(1, 34) for m in range(1, 34) for bm, bn in [(4, 4), (4, 8), (8, 4)]]
              + [(n, m, bm, bn) for n in (1, 17, 64, 100) for m in range(1, 141)
                 for bm, bn in [(16, 16), (32, 16), (16, 32), (64, 32)]])


def sdpa_alignment(top_left, bottom_right) -> bool:
    """PyTorch SDPA with is_causal=True against explicit masks, in float64 on the CPU."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    for n, m in itertools.product((3, 5, 8), repeat=2):
        q, k, v = (torch.randn(1, 1, rows, 4, generator=gen, dtype=torch.float64) for rows in (n, m, m))
        got = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        for rule, expect_match in ((top_left, True), (bottom_right, n == m)):
            mask = torch.tensor([[rule(i, j, n, m) for j in range(m)] for i in range(n)])
            want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            if bool(torch.allclose(got, want, atol=1e-12)) != expect_match:
                return False
    return True


def check() -> CheckResult:
    from flashattn import schedule

    ledger = Ledger()
    ledger.claim("closed form by symbolic summation, N ≤ M and N > M", closed_form_symbolic)
    ledger.claim("exact pair counts = closed form = flashattn.cost.visible_pairs, all N, M in 1..24",
                 lambda: counts_match(bottom_right, COUNT_SIZES))
    ledger.claim("schedule.is_visible agrees with j ≤ i + M − N on every pair (N, M ≤ 24)",
                 lambda: all(schedule.is_visible(i, j, n, m, True) == bottom_right(i, j, n, m)
                             for n, m in COUNT_SIZES[::7] for i in range(n) for j in range(m)))
    ledger.claim("last query sees every key; N = M gives j ≤ i", lambda: alignment_facts(bottom_right, COUNT_SIZES))
    tile_counts = {}
    ok = True
    for n, m, bm, bn in TILE_CASES:
        sound, counts = schedule_sound(schedule.classify_block, n, m, bm, bn)
        ok = ok and sound
        tile_counts[(n, m, bm, bn)] = counts
    ledger.claim(f"forward schedule sound pair by pair on {len(TILE_CASES)} (N, M, block) cases", ok)
    ledger.claim("dK/dV schedule sound pair by pair on the same cases",
                 lambda: all(backward_sound(n, m, bm, bn) for n, m, bm, bn in TILE_CASES))
    n = 4096
    skipped, masked = work_saved(n, n, 128, 64)
    ledger.claim(f"N = M = {n}, tiles 128×64: {skipped:.4f} of tiles skipped; {masked:.6f} of pairs masked "
                 f"= (N − 1)/(2N) = {(n - 1) / (2 * n):.6f}",
                 abs(masked - (n - 1) / (2 * n)) < 1e-15 and 0 < skipped < masked)
    ledger.claim("N = 7, M = 3: rows 0–3 see no key; the reference gives them o = 0, lse = −∞, no NaN",
                 lambda: empty_rows(7, 3) == [0, 1, 2, 3] and empty_rows_in_reference(7, 3)
                 and all(empty_rows(n, m) == list(range(max(n - m, 0))) for n, m in COUNT_SIZES))
    top_left = lambda i, j, n, m: 0 <= i < n and 0 <= j < m and j <= i
    ledger.claim("SDPA is_causal=True is top-left for N ≠ M (query i sees keys 0..i) and equals "
                 "bottom-right for N = M (float64, N, M ∈ {3, 5, 8})",
                 lambda: sdpa_alignment(top_left, bottom_right))
    # --8<-- [start:negative]

    def top_left_tiles(start_m, start_n, block_m, block_n, n, m, causal):
        if start_n > start_m + block_m - 1:
            return "skipped"
        return "full" if start_n + block_n - 1 <= start_m and start_n + block_n <= m else "masked"

    ledger.control("top-left alignment (SDPA's is_causal, N ≠ M): last query does not see every key when N < M",
                   lambda: not alignment_facts(top_left, COUNT_SIZES))
    ledger.control("top-left alignment: pair counts differ from the closed form when N ≠ M",
                   lambda: not counts_match(top_left, COUNT_SIZES))
    ledger.control("top-left tile schedule is unsound for N ≠ M",
                   lambda: not all(schedule_sound(top_left_tiles, *case)[0] for case in TILE_CASES))
    ledger.control("'causal attention does exactly half the work': visible fraction is (N + 1)/(2N) ≠ 1/2",
                   lambda: all(visible_fraction(n, n) != 0.5 for n in range(1, 200)))
    # --8<-- [end:negative]
    sizes = (f"counts N, M ∈ 1..24; tiles: {len(TILE_CASES)} (N, M, block) cases, N, M ≤ 140, "
             f"blocks 4–64; N = M = 4096 work saved")
    return ledger.result(identity=IDENTITY, method=METHOD, sizes=sizes,
                         negative_control=NEGATIVE, module=__name__)
