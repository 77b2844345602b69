# --8<-- [start:statement]
"""Online softmax: a row of scores s_j with values v_j can be consumed block by block with the state
(m, l, acc), where m is a pivot, l = Σ_seen e^(s_j − m) and acc = Σ_seen e^(s_j − m) v_j. A new block
with pivot m' updates it as

    α = e^(m − m'),   l' = α l + Σ_block e^(s_j − m'),   acc' = α acc + Σ_block e^(s_j − m') v_j,

and at the end O = acc / l = Σ_j softmax(s)_j v_j exactly. Two partial states (over disjoint key sets)
merge the same way, l = e^(m_a − m) l_a + e^(m_b − m) l_b: the merge only adds the pivot-free sums
l·e^m and acc·e^m, so it is exact, commutative and associative — which is what lets key blocks,
split-K partitions and devices be combined in any order. Nothing requires m to be the maximum:
any finite pivot gives the same result in exact arithmetic. The running max is there so that every
exponent is ≤ 0 and e^(·) stays within floating-point range.
"""
# --8<-- [end:statement]

from __future__ import annotations

import math
import random
from fractions import Fraction

import mpmath
import numpy as np
import sympy as sp

from ._common import holds, is_zero_with_exps
from ._result import CheckResult, Ledger

IDENTITY = "online softmax: (m, l, acc) recurrence = softmax·V; merge exact and associative; any finite pivot"
METHOD = ("symbolic (Sum with symbolic block lengths; explicit symbols, arbitrary symbolic pivots); "
          "exact base-2 rationals; mpmath")
NEGATIVE = "acc not rescaled by α; merge without rescaling (l = l_a + l_b); α = e^(m' − m)"


# --8<-- [start:formula]
def online_step(state, scores, values, pivot, exp):
    """Consume one key block. `exp` is the exponential in use (e^x, or 2^x for the base-2 kernels)."""
    m, l, acc = state
    alpha = exp(m - pivot)  # rescales the old sums to the new pivot; exp(−∞) = 0 for the empty state
    weights = [exp(s - pivot) for s in scores]
    l = alpha * l + sum(weights)
    acc = [alpha * a + sum(w * v[c] for w, v in zip(weights, values)) for c, a in enumerate(acc)]
    return pivot, l, acc


def merge(state_a, state_b, pivot, exp):
    """Combine the states of two disjoint key sets."""
    (m_a, l_a, acc_a), (m_b, l_b, acc_b) = state_a, state_b
    scale_a, scale_b = exp(m_a - pivot), exp(m_b - pivot)
    return pivot, scale_a * l_a + scale_b * l_b, [scale_a * a + scale_b * b for a, b in zip(acc_a, acc_b)]


def finish(state):
    _, l, acc = state
    return [a / l for a in acc]
# --8<-- [end:formula]


def exp2_exact(x):
    """2^x for integer x, exact; 2^(−∞) = 0."""
    if x == -math.inf:
        return Fraction(0)
    return Fraction(2) ** int(x)


def _empty(d, minus_inf):
    return minus_inf, 0, [0] * d


# --8<-- [start:proof]
def invariant_route() -> bool:
    """Symbolic block lengths a, b and symbolic pivots m, m': after the update, l' is the sum over all
    a + b keys of e^(s_j − m'). (acc has the same form with v_j inside the sum.)"""
    j = sp.symbols("j", integer=True)
    a, b = sp.symbols("a b", integer=True, positive=True)
    m, m_new = sp.symbols("m m_new", real=True)
    s, v = sp.IndexedBase("s"), sp.IndexedBase("v")
    ok = True
    for weight in (lambda j_: 1, lambda j_: v[j_]):  # l, then acc
        old = sp.Sum(sp.exp(s[j] - m) * weight(j), (j, 0, a - 1))
        new_block = sp.Sum(sp.exp(s[j] - m_new) * weight(j), (j, a, a + b - 1))
        updated = sp.exp(m - m_new) * old + new_block
        target = sp.Sum(sp.exp(s[j] - m_new) * weight(j), (j, 0, a + b - 1))
        ok = ok and sp.simplify(sp.powsimp(updated - target)) == 0
    return ok


def merge_value_route() -> bool:
    """Symbolic: e^p · l(merge(A, B, p)) = e^(m_a) l_a + e^(m_b) l_b for every pivot p, so merging adds
    pivot-free quantities — associative and commutative because + is."""
    m_a, m_b, p, l_a, l_b = sp.symbols("m_a m_b p l_a l_b", real=True)
    _, l, _ = merge((m_a, l_a, []), (m_b, l_b, []), p, sp.exp)
    return is_zero_with_exps(sp.exp(p) * l - (sp.exp(m_a) * l_a + sp.exp(m_b) * l_b))


def explicit_route(step, splits) -> bool:
    """Explicit symbolic scores and values, blocks as given, every pivot an independent symbol
    (not the max): acc / l must equal Σ softmax(s)_j v_j."""
    for split in splits:
        n_keys = sum(split)
        s = sp.symbols(f"s0:{n_keys}", real=True)
        v = sp.symbols(f"v0:{n_keys}", real=True)
        pivots = sp.symbols(f"p0:{len(split)}", real=True)
        state, start = _empty(1, -sp.oo), 0
        for size, pivot in zip(split, pivots):
            block = slice(start, start + size)
            state = step(state, s[block], [[x] for x in v[block]], pivot, sp.exp)
            start += size
        direct = sum(sp.exp(x) * y for x, y in zip(s, v)) / sum(sp.exp(x) for x in s)
        if not holds(lambda: is_zero_with_exps(finish(state)[0] - direct)):
            return False
    return True
# --8<-- [end:proof]


# --8<-- [start:numeric]
def _random_split(rng, n, max_block):
    split = []
    while n > 0:
        split.append(min(n, rng.randint(1, max_block)))
        n -= split[-1]
    return split


def exact_route(step, merge_fn, seed: int = 7, trials: int = 20) -> bool:
    """Base 2 with integer scores keeps every weight 2^(s − m) rational, so the whole recurrence runs
    in exact arithmetic. Pivots: the running max, random integers, a constant 0."""
    rng = random.Random(seed)
    for _ in range(trials):
        n_keys, d = rng.randint(1, 40), 3
        scores = [rng.randint(-30, 30) for _ in range(n_keys)]
        values = [[Fraction(rng.randint(-50, 50), rng.randint(1, 9)) for _ in range(d)] for _ in range(n_keys)]
        total = sum(exp2_exact(s) for s in scores)
        direct = [sum(exp2_exact(s) * v[c] for s, v in zip(scores, values)) / total for c in range(d)]

        split = _random_split(rng, n_keys, 8)
        blocks, start = [], 0
        for size in split:
            blocks.append((scores[start:start + size], values[start:start + size]))
            start += size
        for choose in ("max", "random", "zero"):
            state = _empty(d, -math.inf)
            for sc, va in blocks:
                pivot = {"max": max([state[0], *sc]), "random": rng.randint(-40, 40), "zero": 0}[choose]
                state = step(state, sc, va, pivot, exp2_exact)
            if finish(state) != direct:
                return False
        # Per-block partial states with random pivots, merged in a random tree order.
        states = [step(_empty(d, -math.inf), sc, va, rng.randint(-40, 40), exp2_exact) for sc, va in blocks]
        while len(states) > 1:
            i = rng.randrange(len(states) - 1)
            states[i:i + 2] = [merge_fn(states[i], states[i + 1], rng.randint(-40, 40), exp2_exact)]
        if finish(states[0]) != direct:
            return False
    return True


def associativity_route(merge_fn, seed: int = 8, trials: int = 20) -> bool:
    """With max pivots, (A ⊕ B) ⊕ C and A ⊕ (B ⊕ C) are the identical state (m, l, acc), exactly;
    A ⊕ B and B ⊕ A too."""
    rng = random.Random(seed)
    for _ in range(trials):
        parts = []
        for _ in range(3):
            sc = [rng.randint(-20, 20) for _ in range(rng.randint(1, 6))]
            va = [[Fraction(rng.randint(-9, 9), 4)] for _ in sc]
            parts.append(online_step(_empty(1, -math.inf), sc, va, max(sc), exp2_exact))
        a, b, c = parts
        mx = lambda x, y: merge_fn(x, y, max(x[0], y[0]), exp2_exact)
        if mx(mx(a, b), c) != mx(a, mx(b, c)) or mx(a, b) != mx(b, a):
            return False
    return True


def mpmath_route(step, merge_fn, seed: int = 9, trials: int = 6, dps: int = 50) -> bool:
    """Real scores, base e, 50 digits, random splits and pivots anywhere within ±20 of the scores."""
    rng = random.Random(seed)
    with mpmath.workdps(dps):
        for _ in range(trials):
            n_keys = rng.randint(20, 60)
            scores = [mpmath.mpf(rng.uniform(-10, 10)) for _ in range(n_keys)]
            values = [[mpmath.mpf(rng.uniform(-1, 1))] for _ in range(n_keys)]
            direct = mpmath.fsum(mpmath.exp(s) * v[0] for s, v in zip(scores, values)) / mpmath.fsum(
                mpmath.exp(s) for s in scores)
            state, start = _empty(1, -mpmath.inf), 0
            partials = []
            for size in _random_split(rng, n_keys, 16):
                sc, va = scores[start:start + size], values[start:start + size]
                state = step(state, sc, va, mpmath.mpf(rng.uniform(-20, 20)), mpmath.exp)
                partials.append(step(_empty(1, -mpmath.inf), sc, va, mpmath.mpf(rng.uniform(-20, 20)), mpmath.exp))
                start += size
            merged = partials[0]
            for part in partials[1:]:
                merged = merge_fn(merged, part, mpmath.mpf(rng.uniform(-20, 20)), mpmath.exp)
            tol = mpmath.mpf(10) ** (-(dps - 10))
            if abs(finish(state)[0] - direct) > tol or abs(finish(merged)[0] - direct) > tol:
                return False
    return True


def range_demo():
    """float64: scores near 800 overflow e^s with pivot 0 (inf / inf = NaN); the running max keeps
    every exponent ≤ 0 and the result matches 50-digit arithmetic."""
    scores, values = [800.0, 799.0, 10.0], [[1.0], [-2.0], [3.0]]
    with np.errstate(over="ignore", invalid="ignore"):
        exp = lambda x: np.exp(np.float64(x))
        zero_pivot = finish(online_step(_empty(1, -np.inf), scores, values, 0.0, exp))[0]
        max_pivot = finish(online_step(_empty(1, -np.inf), scores, values, max(scores), exp))[0]
    with mpmath.workdps(50):
        exact = mpmath.fsum(mpmath.exp(s) * v[0] for s, v in zip(scores, values)) / mpmath.fsum(
            mpmath.exp(s) for s in scores)
    return zero_pivot, max_pivot, float(exact)
# --8<-- [end:numeric]


SPLITS = [(3, 2), (2, 2, 1)]


def check() -> CheckResult:
    ledger = Ledger()
    ledger.claim("update invariant with symbolic block lengths and pivots (l and acc)", invariant_route())
    ledger.claim("e^p·l(merge) = e^(m_a) l_a + e^(m_b) l_b for any pivot p", merge_value_route())
    ledger.claim(f"symbolic scores/values, blocks {SPLITS}, symbolic pivots: acc/l = softmax·v",
                 explicit_route(online_step, SPLITS))
    ledger.claim("exact base-2 rationals: max / random / zero pivots and random merge trees give "
                 "softmax·V exactly", exact_route(online_step, merge))
    ledger.claim("exact: (A⊕B)⊕C = A⊕(B⊕C) and A⊕B = B⊕A (max pivots)", associativity_route(merge))
    ledger.claim("mpmath 50 digits: random splits, pivots and merges within 1e-40", mpmath_route(online_step, merge))
    zero_pivot, max_pivot, exact = range_demo()
    ledger.claim(f"float64, scores ~800: pivot 0 gives {zero_pivot}, running max gives {max_pivot:.15g} "
                 f"(exact {exact:.15g})",
                 math.isnan(zero_pivot) and abs(max_pivot - exact) <= 1e-14 * abs(exact))
    # --8<-- [start:negative]
    def acc_not_rescaled(state, scores, values, pivot, exp):
        m, l, acc = state
        alpha = exp(m - pivot)
        weights = [exp(s - pivot) for s in scores]
        return pivot, alpha * l + sum(weights), [
            a + sum(w * v[c] for w, v in zip(weights, values)) for c, a in enumerate(acc)]

    def alpha_inverted(state, scores, values, pivot, exp):
        m, l, acc = state
        alpha = exp(pivot - m) if l != 0 else 0  # the inverse rescaling (guarded for the empty state)
        weights = [exp(s - pivot) for s in scores]
        return pivot, alpha * l + sum(weights), [
            alpha * a + sum(w * v[c] for w, v in zip(weights, values)) for c, a in enumerate(acc)]

    def merge_no_rescale(state_a, state_b, pivot, exp):
        return pivot, state_a[1] + state_b[1], [a + b for a, b in zip(state_a[2], state_b[2])]

    ledger.control("acc not rescaled: symbolic", lambda: not explicit_route(acc_not_rescaled, SPLITS))
    ledger.control("acc not rescaled: exact", lambda: not exact_route(acc_not_rescaled, merge))
    ledger.control("α = e^(m' − m): exact", lambda: not exact_route(alpha_inverted, merge))
    ledger.control("merge without rescaling: exact", lambda: not exact_route(online_step, merge_no_rescale))
    # --8<-- [end:negative]
    sizes = f"symbolic lengths; explicit splits {SPLITS}; exact 20 rows ≤ 40 keys; mpmath 6 rows ≤ 60 keys"
    return ledger.result(identity=IDENTITY, method=METHOD, sizes=sizes,
                         negative_control=NEGATIVE, module=__name__)
