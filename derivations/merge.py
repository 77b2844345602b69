# --8<-- [start:statement]
"""Merging partial attentions, and the backward across shards (split-KV decoding, ring attention).

Forward. Split the keys of a row into disjoint sets A and B. Each partial gives its normalized output
o_A = Σ_A e^(s_j − L_A) v_j and its log-sum-exp L_A = log Σ_A e^(s_j). Then

    L = log(e^(L_A) + e^(L_B)),    o = e^(L_A − L) o_A + e^(L_B − L) o_B

is the output and LSE of the whole row, exactly. The pair (e^L, e^L·o) is just (Σ e^s, Σ e^s v) over
the keys seen, so merging adds them: the merge is commutative and associative, and any tree of merges
over any partition gives the same result. An empty partial has L = −∞ and is the identity element
(its o is never read, since e^(−∞) = 0); two empty partials merge to an empty one, provided the
weights are computed against a pivot that is 0, not −∞, when L = −∞ (else −∞ − (−∞) = NaN).

Backward. With L_row = ⟨dO, O⟩, the gradient of a key shard K needs only that shard's columns of
P = exp(S − LSE) and D = rowsum(dO ∘ O) (δ in the notation table; D here, as in the papers):

    dS_K = P_K ∘ (dO V_Kᵀ − D),   dV_K = P_Kᵀ dO,   dQ = τ Σ_K dS_K K_K,   dK_K = τ dS_Kᵀ Q,

where LSE and O are those of the *whole* row. So a shard's backward, given the global LSE and the
global O (hence the global D), returns exactly its block of the full gradient, and the shards' dQ
contributions add. With the shard's own LSE or its own partial O in their place the blocks are the
gradient of a different function and the sum is wrong.
"""
# --8<-- [end:statement]

from __future__ import annotations

import math
import random

import mpmath
import sympy as sp

from ._common import holds, is_zero_with_exps, mp_matrix
from ._result import CheckResult, Ledger

IDENTITY = ("merge of partial (o, LSE): exact, associative, −∞ for empty partials; shard backward with the "
            "global LSE and δ sums to the full gradient")
METHOD = "explicit symbols (SymPy, exp/log eliminated exactly); mpmath 40 digits with central differences; float64"
NEGATIVE = ("o = o_A + o_B; L = max(L_A, L_B); unguarded pivot on empty partials; shard backward with the "
            "shard's own LSE, own δ, or both")

NEG_INF = float("-inf")


# --8<-- [start:formula]
def merge_pair(part_a, part_b, exp, logaddexp):
    """(o, L) of the union of two disjoint key sets from their partials (o_A, L_A), (o_B, L_B)."""
    (o_a, lse_a), (o_b, lse_b) = part_a, part_b
    lse = logaddexp(lse_a, lse_b)
    pivot = 0 if lse == NEG_INF else lse  # both partials empty: keep e^(−∞ − 0) = 0, not e^(−∞ + ∞) = NaN
    return exp(lse_a - pivot) * o_a + exp(lse_b - pivot) * o_b, lse


def shard_backward(S, V, dO, O, lse, exp):
    """dS and dV of one key shard (S: its N × m columns of scores, V: its m × d values), given the O
    and the LSE to use (lists of rows). The same steps as the single-device backward."""
    n, m, d = len(S), len(V), len(V[0])
    pivots = [0 if x == NEG_INF else x for x in lse]
    P = [[exp(S[i][j] - pivots[i]) for j in range(m)] for i in range(n)]
    D = [sum(dO[i][c] * O[i][c] for c in range(d)) for i in range(n)]
    dP = [[sum(dO[i][c] * V[j][c] for c in range(d)) for j in range(m)] for i in range(n)]
    dS = [[P[i][j] * (dP[i][j] - D[i]) for j in range(m)] for i in range(n)]
    dV = [[sum(P[i][j] * dO[i][c] for i in range(n)) for c in range(d)] for j in range(m)]
    return dS, dV
# --8<-- [end:formula]


def partial(scores, values, exp, log):
    """(o, L) of one row over the keys given (every score finite or −∞), by the definition."""
    weights = [exp(s) for s in scores]
    total = sum(weights)
    if total == 0:
        return [0] * len(values[0]), NEG_INF
    return [sum(w * v[c] for w, v in zip(weights, values)) / total for c in range(len(values[0]))], log(total)


def _sp_logaddexp(a, b):
    return sp.log(sp.exp(a) + sp.exp(b))


def _mp_logaddexp(a, b):
    top = max(a, b)
    if top == NEG_INF:
        return mpmath.mpf(NEG_INF)
    return top + mpmath.log(mpmath.exp(a - top) + mpmath.exp(b - top))


def _f_logaddexp(a, b):
    top = max(a, b)
    return top if top == NEG_INF else top + math.log(math.exp(a - top) + math.exp(b - top))


def _merge_vec(merge_fn, a, b, exp, logaddexp):
    """Merge partials whose o is a vector: the formula is per feature with a shared L."""
    outs = [merge_fn((oa, a[1]), (ob, b[1]), exp, logaddexp) for oa, ob in zip(a[0], b[0])]
    return [o for o, _ in outs], outs[0][1]


# --8<-- [start:proof]
def symbolic_merge_route(merge_fn, split=(3, 2)) -> bool:
    """Explicit symbolic scores and values: merging the partials of two key sets gives softmax(s)·v and
    log Σ e^s of the whole row."""
    n_a, n_b = split
    s = sp.symbols(f"s0:{n_a + n_b}", real=True)
    v = sp.symbols(f"v0:{n_a + n_b}", real=True)
    o_a, l_a = partial(s[:n_a], [[x] for x in v[:n_a]], sp.exp, sp.log)
    o_b, l_b = partial(s[n_a:], [[x] for x in v[n_a:]], sp.exp, sp.log)
    o, lse = merge_fn((o_a[0], l_a), (o_b[0], l_b), sp.exp, _sp_logaddexp)
    total = sum(sp.exp(x) for x in s)
    direct = sum(sp.exp(x) * y for x, y in zip(s, v)) / total
    return holds(lambda: is_zero_with_exps(o - direct)) and holds(lambda: is_zero_with_exps(sp.exp(lse) - total))


def symbolic_associativity_route(merge_fn) -> bool:
    """Symbolic (o, L) of three partials: (A⊕B)⊕C = A⊕(B⊕C) and A⊕B = B⊕A, for o and for e^L."""
    o_a, o_b, o_c, l_a, l_b, l_c = sp.symbols("o_A o_B o_C L_A L_B L_C", real=True)
    mx = lambda x, y: merge_fn(x, y, sp.exp, _sp_logaddexp)  # noqa: E731
    a, b, c = (o_a, l_a), (o_b, l_b), (o_c, l_c)
    pairs = [(mx(mx(a, b), c), mx(a, mx(b, c))), (mx(a, b), mx(b, a))]
    return all(holds(lambda: is_zero_with_exps(x[0] - y[0]) and is_zero_with_exps(sp.exp(x[1]) - sp.exp(y[1])))
               for x, y in pairs)


def symbolic_empty_route(merge_fn) -> bool:
    """An empty partial (L = −∞, any o) is the identity on either side."""
    o_e, o_b, l_b = sp.symbols("o_E o_B L_B", real=True)
    for x, y in (((o_e, -sp.oo), (o_b, l_b)), ((o_b, l_b), (o_e, -sp.oo))):
        o, lse = merge_fn(x, y, sp.exp, _sp_logaddexp)
        if not (sp.simplify(o - o_b) == 0 and sp.simplify(lse - l_b) == 0):
            return False
    return True


def _sym_attention(N, M, d):
    S = [[sp.Symbol(f"s_{i}_{j}", real=True) for j in range(M)] for i in range(N)]
    V = [[sp.Symbol(f"v_{j}_{c}", real=True) for c in range(d)] for j in range(M)]
    dO = [[sp.Symbol(f"g_{i}_{c}", real=True) for c in range(d)] for i in range(N)]
    return S, V, dO


def _row_stats(S, V, cols, exp, log):
    """Per row: (o, L) over the key columns ``cols``."""
    return [partial([row[j] for j in cols], [V[j] for j in cols], exp, log) for row in S]


def _shard_blocks(S, V, dO, shards, stats, exp, log):
    """Concatenate the shards' dS (by columns) and dV (by rows), each computed by shard_backward with
    the O and LSE that ``stats(cols)`` names: the global ones, or a control's."""
    n = len(S)
    dS_full = [[None] * len(V) for _ in range(n)]
    dV_full = [None] * len(V)
    for cols in shards:
        O, lse = stats(cols)
        dS, dV = shard_backward([[S[i][j] for j in cols] for i in range(n)], [V[j] for j in cols], dO, O, lse, exp)
        for k, j in enumerate(cols):
            for i in range(n):
                dS_full[i][j] = dS[i][k]
            dV_full[j] = dV[k]
    return dS_full, dV_full


def global_stats(S, V, exp, log):
    everything = _row_stats(S, V, range(len(V)), exp, log)
    return lambda cols: ([o for o, _ in everything], [l for _, l in everything])


def symbolic_backward_route(stats_for, N=2, M=3, d=1, shards=((0, 1), (2,))) -> bool:
    """L = ⟨dO, softmax(S) V⟩ on explicit symbols: the shards' dS blocks are ∂L/∂S and their dV blocks
    ∂L/∂V (dQ and dK then follow blockwise by the matmul rule)."""
    S, V, dO = _sym_attention(N, M, d)
    O = [o for o, _ in _row_stats(S, V, range(M), sp.exp, sp.log)]
    loss = sum(dO[i][c] * O[i][c] for i in range(N) for c in range(d))
    dS, dV = _shard_blocks(S, V, dO, [list(c) for c in shards], stats_for(S, V, sp.exp, sp.log), sp.exp, sp.log)
    tests = [lambda i=i, j=j: is_zero_with_exps(dS[i][j] - sp.diff(loss, S[i][j])) for i in range(N) for j in range(M)]
    tests += [lambda j=j, c=c: is_zero_with_exps(dV[j][c] - sp.diff(loss, V[j][c])) for j in range(M) for c in range(d)]
    return all(holds(t) for t in tests)
# --8<-- [end:proof]


# --8<-- [start:numeric]
def mpmath_merge_route(merge_fn, seed: int = 31, trials: int = 8, dps: int = 40) -> bool:
    """Random rows, random partitions into up to 6 parts (some empty or fully masked), merged in a
    random tree order: equal to the whole row's (o, L) within 1e-30."""
    rng = random.Random(seed)
    with mpmath.workdps(dps):
        for _ in range(trials):
            n_keys, d = rng.randint(6, 30), 2
            scores = [mpmath.mpf(rng.uniform(-30, 30)) if rng.random() > 0.2 else mpmath.mpf(NEG_INF)
                      for _ in range(n_keys)]
            scores[0] = mpmath.mpf(rng.uniform(-30, 30))  # at least one visible key in the row
            values = [[mpmath.mpf(rng.uniform(-1, 1)) for _ in range(d)] for _ in range(n_keys)]
            cuts = sorted(rng.randint(0, n_keys) for _ in range(rng.randint(1, 5)))
            bounds = [0, *cuts, n_keys]
            parts = [partial(scores[a:b], values[a:b], mpmath.exp, mpmath.log) if b > a else ([0] * d, NEG_INF)
                     for a, b in zip(bounds, bounds[1:])]
            while len(parts) > 1:
                i = rng.randrange(len(parts) - 1)
                parts[i:i + 2] = [_merge_vec(merge_fn, parts[i], parts[i + 1], mpmath.exp, _mp_logaddexp)]
            o_want, l_want = partial(scores, values, mpmath.exp, mpmath.log)
            tol = mpmath.mpf(10) ** -30
            if abs(parts[0][1] - l_want) > tol or max(abs(x - y) for x, y in zip(parts[0][0], o_want)) > tol:
                return False
    return True


def float_empty_route(merge_fn) -> bool:
    """float64: two empty partials merge to an empty one (o = 0, L = −∞), no NaN; an empty and a
    non-empty one give the non-empty one; and with L near 800 nothing overflows."""
    with_nan = lambda x: x != x  # noqa: E731
    o, lse = merge_fn((0.0, NEG_INF), (0.0, NEG_INF), math.exp, _f_logaddexp)
    if with_nan(o) or o != 0.0 or lse != NEG_INF:
        return False
    o, lse = merge_fn((3.0, NEG_INF), (0.25, 1.5), math.exp, _f_logaddexp)
    if (o, lse) != (0.25, 1.5):
        return False
    o, lse = merge_fn((1.0, 800.0), (-1.0, 800.0 + math.log(3.0)), math.exp, _f_logaddexp)
    # L carries an absolute rounding of ~1e-13 at 800, which e^(L_A − L) turns into a relative one.
    return math.isclose(o, (1.0 - 3.0) / 4.0, rel_tol=1e-12) and math.isclose(lse, 800.0 + math.log(4.0), rel_tol=1e-15)


def mpmath_backward_route(stats_for, seed: int = 37, dps: int = 40) -> bool:
    """Q, K, V, dO random, causal mask, scores τ QKᵀ: dQ = τ Σ_K dS_K K_K, dK = τ dSᵀ Q and dV from the
    shard blocks against 40-digit central differences of L(Q, K, V). The shards are uneven and one
    of them is fully masked for the first rows (a partial with LSE −∞ there)."""
    rng = random.Random(seed)
    N = M = 6
    d, tau = 3, mpmath.mpf(1) / mpmath.sqrt(3)
    shards = [[0, 1, 2], [3, 4], [5]]
    with mpmath.workdps(dps):
        Q, K, V, dO = (mp_matrix(rng, r, d, scale=2) for r in (N, M, M, N))
        rows = lambda A: [[A[i, c] for c in range(A.cols)] for i in range(A.rows)]  # noqa: E731

        def scores(Q_, K_):
            return [[tau * mpmath.fsum(Q_[i, c] * K_[j, c] for c in range(d)) if j <= i else mpmath.mpf(NEG_INF)
                     for j in range(M)] for i in range(N)]

        def loss(Q_=Q, K_=K, V_=V):
            O = [o for o, _ in _row_stats(scores(Q_, K_), rows(V_), range(M), mpmath.exp, mpmath.log)]
            return mpmath.fsum(dO[i, c] * O[i][c] for i in range(N) for c in range(d))

        S = scores(Q, K)
        dS, dV = _shard_blocks(S, rows(V), rows(dO), shards, stats_for(S, rows(V), mpmath.exp, mpmath.log),
                               mpmath.exp, mpmath.log)
        # dQ summed shard by shard (each shard's dS block times its keys), dK from each shard's block.
        dQ = [[mpmath.fsum(tau * mpmath.fsum(dS[i][j] * K[j, c] for j in cols) for cols in shards)
               for c in range(d)] for i in range(N)]
        dK = [[tau * mpmath.fsum(dS[i][j] * Q[i, c] for i in range(N)) for c in range(d)] for j in range(M)]
        h = mpmath.mpf(10) ** -13
        tol = mpmath.mpf(10) ** -12
        for got, X, name in ((dQ, Q, "Q_"), (dK, K, "K_"), (dV, V, "V_")):
            for i in range(X.rows):
                for c in range(X.cols):
                    Xp, Xm = X.copy(), X.copy()
                    Xp[i, c] += h
                    Xm[i, c] -= h
                    numeric = (loss(**{name: Xp}) - loss(**{name: Xm})) / (2 * h)
                    if abs(got[i][c] - numeric) > tol:
                        return False
    return True
# --8<-- [end:numeric]


def check() -> CheckResult:
    ledger = Ledger()
    ledger.claim("symbolic scores/values, keys split 3 + 2: merge of the partials = softmax·v and e^L = Σ e^s",
                 lambda: symbolic_merge_route(merge_pair))
    ledger.claim("symbolic (o, L): (A⊕B)⊕C = A⊕(B⊕C), A⊕B = B⊕A", lambda: symbolic_associativity_route(merge_pair))
    ledger.claim("symbolic: an empty partial (L = −∞) is the identity on either side",
                 lambda: symbolic_empty_route(merge_pair))
    ledger.claim("mpmath 40 digits: random partitions with empty and masked parts, random merge trees, within 1e-30",
                 lambda: mpmath_merge_route(merge_pair))
    ledger.claim("float64: empty ⊕ empty = (0, −∞) without NaN; L ≈ 800 does not overflow",
                 lambda: float_empty_route(merge_pair))
    ledger.claim("symbolic 2×3, shards {0,1} {2}: shard dS, dV with global LSE and δ = ∂L/∂S, ∂L/∂V",
                 lambda: symbolic_backward_route(global_stats))
    ledger.claim("mpmath 40 digits, causal 6×6, shards 3+2+1: summed dQ, shard dK, dV = central differences",
                 lambda: mpmath_backward_route(global_stats))
    # --8<-- [start:negative]
    def merge_unweighted(part_a, part_b, exp, logaddexp):
        return part_a[0] + part_b[0], logaddexp(part_a[1], part_b[1])

    def merge_max_lse(part_a, part_b, exp, logaddexp):
        lse = max(part_a[1], part_b[1]) if not isinstance(part_a[1], sp.Basic) else sp.Max(part_a[1], part_b[1])
        return exp(part_a[1] - lse) * part_a[0] + exp(part_b[1] - lse) * part_b[0], lse

    def merge_unguarded(part_a, part_b, exp, logaddexp):
        lse = logaddexp(part_a[1], part_b[1])
        return exp(part_a[1] - lse) * part_a[0] + exp(part_b[1] - lse) * part_b[0], lse

    def local_lse(S, V, exp, log):  # each shard normalizes by its own LSE; D still global
        glob = global_stats(S, V, exp, log)
        return lambda cols: (glob(cols)[0], [l for _, l in _row_stats(S, V, cols, exp, log)])

    def local_delta(S, V, exp, log):  # D from the shard's own partial output; LSE still global
        glob = global_stats(S, V, exp, log)
        return lambda cols: ([o for o, _ in _row_stats(S, V, cols, exp, log)], glob(cols)[1])

    def local_both(S, V, exp, log):
        return lambda cols: tuple(map(list, zip(*_row_stats(S, V, cols, exp, log))))

    ledger.control("o = o_A + o_B: symbolic", lambda: not symbolic_merge_route(merge_unweighted))
    ledger.control("o = o_A + o_B: mpmath", lambda: not mpmath_merge_route(merge_unweighted))
    ledger.control("L = max(L_A, L_B): symbolic", lambda: not symbolic_merge_route(merge_max_lse))
    ledger.control("L = max(L_A, L_B): mpmath", lambda: not mpmath_merge_route(merge_max_lse))
    ledger.control("pivot −∞ for an empty merge: float64 NaN", lambda: not float_empty_route(merge_unguarded))
    for name, wrong in (("shard's own LSE", local_lse), ("shard's own δ", local_delta), ("own LSE and δ", local_both)):
        ledger.control(f"{name}: symbolic", lambda: not symbolic_backward_route(wrong))
        ledger.control(f"{name}: mpmath", lambda: not mpmath_backward_route(wrong))
    # --8<-- [end:negative]
    sizes = ("symbolic 5 keys (3 + 2), 3 partials, backward 2×3×1; mpmath 8 rows ≤ 30 keys, "
             "backward 6×6×3 causal in 3 shards")
    return ledger.result(identity=IDENTITY, method=METHOD, sizes=sizes, negative_control=NEGATIVE, module=__name__)
