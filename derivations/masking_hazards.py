# --8<-- [start:statement]
"""Masking hazards: four ways a masked or padded entry silently corrupts attention, and the fix for each.

a. Padding keys scored 0 instead of −∞. With running max m, each padded key adds 2^(0 − m) to l
   (and its value, weighted the same, to acc): exactly 2^(−m) per key, which is 1 only when m = 0.
   When every real score of a row is negative, the padded 0 is larger than all of them and becomes
   the max itself. Fix: score padded keys −∞, so that 2^(−∞ − m) = 0 exactly.
b. A row whose keys are all masked (so far) has pivot m = −∞, and s − m = −∞ − (−∞) = NaN poisons
   l and acc. Fix: use the pivot 0 when m = −∞ (every term is then 2^(−∞) = 0) and divide by l only
   where l > 0; the row's output is 0 and its LSE −∞.
c. float16 overflow: the largest float16 is (2 − 2^(−10))·2^15 = 65504, so 2^20 is inf, and
   inf · 0 = NaN (e.g. against a zero entry of V or dO). Fix: subtract the row max (or the LSE) so
   every exponent is ≤ 0, and evaluate exp2 in float32.
d. The dK/dV loop recomputes P for a whole block of query rows. Leaving the rows past N unmasked is
   safe only while their recomputed P stays finite: their dO and D load as 0, so dS = P·(0 − 0),
   which is NaN once P overflows — e.g. non-zero ("dirty") padding in Q giving a base-2 exponent above
   128 in float32. Those NaNs reach every key of the block through dSᵀQ and Pᵀ dO. Fix: mask the
   query rows (P = 0 for rows ≥ N) before they touch dV, dS and dK.
"""
# --8<-- [end:statement]

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import sympy as sp

from ._result import CheckResult, Ledger
from .online_softmax import exp2_exact, finish, online_step

IDENTITY = "masking hazards a–d: zero-scored padding, −∞ − (−∞), float16 overflow, dirty query padding"
METHOD = "SymPy + exact base-2 rationals (a); numpy float32 / float16 demonstrations with the fix (b–d)"
NEGATIVE = ("pad keys with 0; unguarded pivot; exp2 of unshifted scores in float16; unmasked query rows"
            " in dK/dV")


# ---------------------------------------------------------------- a. zero-scored padding
# --8<-- [start:proof]
def inflation_symbolic() -> bool:
    """Symbolic: with p padded keys of score 0 and pivot m, l grows by exactly p·2^(−m), and 2^(−m) = 1
    has the single real solution m = 0."""
    m = sp.Symbol("m", real=True)
    p = sp.Symbol("p", integer=True, positive=True)
    s = sp.symbols("s0:3", real=True)
    l_true = sum(2 ** (x - m) for x in s)
    l_padded = l_true + sum(2 ** (0 - m) for _ in range(3))  # three padded keys, explicitly
    per_key = sp.simplify((l_padded - l_true) / 3)
    return (sp.simplify(per_key - 2 ** (-m)) == 0
            and sp.solveset(sp.Eq(2 ** (-m), 1), m, domain=sp.S.Reals) == sp.FiniteSet(0)
            and sp.simplify(p * per_key - p * 2 ** (-m)) == 0)
# --8<-- [end:proof]


# --8<-- [start:numeric]
# --8<-- [start:hazard-a]
PAD_SCORE_FIX = -math.inf


def pad_row(scores, values, n_pad, fill):
    """The key row as a kernel sees it after padding to a block multiple."""
    return list(scores) + [fill] * n_pad, list(values) + [[Fraction(0)]] * n_pad


def padded_forward(scores, values, n_pad, fill, block=4):
    """Exact base-2 online softmax over a padded row, blocks of `block` keys, running-max pivot."""
    scores, values = pad_row(scores, values, n_pad, fill)
    state = (-math.inf, 0, [0])
    for start in range(0, len(scores), block):
        sc, va = scores[start:start + block], values[start:start + block]
        state = online_step(state, sc, va, max([state[0], *sc]), exp2_exact)
    return state


def padding_is_exact(fill, cases) -> tuple[bool, list[str]]:
    """Does padding with `fill` leave (l, acc/l) exactly as without padding?"""
    notes, ok = [], True
    for scores, values, n_pad in cases:
        m_true, l_true, acc_true = padded_forward(scores, values, 0, fill)
        m_pad, l_pad, acc_pad = padded_forward(scores, values, n_pad, fill)
        # Compare at a common pivot: l·2^m is pivot-free.
        same = (l_pad * exp2_exact(m_pad) == l_true * exp2_exact(m_true)
                and finish((m_pad, l_pad, acc_pad)) == finish((m_true, l_true, acc_true)))
        ok = ok and same
        notes.append(f"scores {scores}, {n_pad} pads: pivot {m_pad}, l {l_true}→{l_pad}")
    return ok, notes


def inflation_exact(cases) -> bool:
    """With fill 0: l_padded − l_true·2^(m_true − m_pad) = n_pad · 2^(−m_pad) exactly, and when every
    real score is negative the pivot becomes the padded 0 (inflation exactly 1 per key)."""
    for scores, values, n_pad in cases:
        m_true, l_true, _ = padded_forward(scores, values, 0, 0)
        m_pad, l_pad, _ = padded_forward(scores, values, n_pad, 0)
        if l_pad - l_true * exp2_exact(m_true - m_pad) != n_pad * exp2_exact(-m_pad):
            return False
        if max(scores) < 0 and not (m_pad == 0 and l_pad - l_true * exp2_exact(m_true) == n_pad):
            return False
        if max(scores) > 0 and n_pad * exp2_exact(-m_pad) == n_pad:
            return False  # not 1 per key when m ≠ 0
    return True


CASES_A = [
    ([3, 1, 2], [[Fraction(1)], [Fraction(-2)], [Fraction(5)]], 5),   # m = 3: inflation 2^-3 per key
    ([-3, -5, -1], [[Fraction(1)], [Fraction(2)], [Fraction(3)]], 1),  # all negative: 0 becomes the max
    ([0, -2, 7, 4, -6, 1], [[Fraction(k, 3)] for k in range(6)], 2),
]


# --8<-- [end:hazard-a]


# ---------------------------------------------------------------- b. −∞ − (−∞)
# --8<-- [start:hazard-b]
def row_forward_f32(scores, values, block, guarded):
    """float32 base-2 online softmax of one row, returns (o, lse2)."""
    m = np.float32(-np.inf)
    l = np.float32(0)
    acc = np.zeros(values.shape[1], np.float32)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        for start in range(0, len(scores), block):
            s, v = scores[start:start + block], values[start:start + block]
            m_new = np.maximum(m, s.max())
            # A row with no visible key so far has m_new = −∞; pivot 0 keeps −∞ − pivot = −∞.
            pivot = np.where(m_new == -np.inf, np.float32(0), m_new) if guarded else m_new
            alpha = np.exp2(m - pivot)
            w = np.exp2(s - pivot)
            l = alpha * l + w.sum()
            acc = alpha * acc + w @ v
            m = m_new
        if guarded:
            o = acc / np.where(l > 0, l, np.float32(1))
            lse2 = np.where(l > 0, m + np.log2(l), np.float32(-np.inf))
        else:
            o, lse2 = acc / l, m + np.log2(l)
    return o, lse2


def empty_rows_safe(guarded) -> bool:
    """A fully masked row must give o = 0, lse = −∞; a row whose first block is fully masked must give
    the softmax of its visible keys."""
    rng = np.random.default_rng(0)
    values = rng.standard_normal((8, 3)).astype(np.float32)
    all_masked = np.full(8, -np.inf, np.float32)
    o, lse2 = row_forward_f32(all_masked, values, 4, guarded)
    ok = bool(np.all(o == 0) and lse2 == -np.inf)
    first_block_masked = np.array([-np.inf] * 4 + [1.5, -2.0, 0.25, 3.0], np.float32)
    o, lse2 = row_forward_f32(first_block_masked, values, 4, guarded)
    w = np.exp2(first_block_masked.astype(np.float64))
    ref = (w / w.sum()) @ values.astype(np.float64)
    return ok and bool(np.all(np.isfinite(o)) and np.allclose(o, ref, rtol=1e-6, atol=1e-6))


# --8<-- [end:hazard-b]


# ---------------------------------------------------------------- c. float16 overflow
# --8<-- [start:hazard-c]
def float16_facts() -> bool:
    largest = (2 - Fraction(1, 2 ** 10)) * 2 ** 15
    with np.errstate(over="ignore", invalid="ignore"):
        return (largest == 65504 == float(np.finfo(np.float16).max)
                and 2 ** 20 > largest
                and np.isinf(np.exp2(np.float16(20)))
                and np.isnan(np.float16(np.inf) * np.float16(0)))


def p_times_v(scores, values, shifted):
    """One row of O = (Σ_j p_j v_j) / l with P stored in float16, as the kernel accumulates it:
    either p = exp2(s) of the unshifted scores in float16, or p = exp2(s − max) in float32."""
    with np.errstate(over="ignore", invalid="ignore"):
        if shifted:
            s32 = scores.astype(np.float32)
            p = np.exp2(s32 - s32.max()).astype(np.float16)  # every exponent ≤ 0, so p ≤ 1
        else:
            p = np.exp2(scores.astype(np.float16))  # 2^20 → inf
        acc = p.astype(np.float32) @ values.astype(np.float32)  # inf · 0 → NaN in that column
        return (acc / p.astype(np.float32).sum()).astype(np.float16)


def overflow_safe(shifted) -> bool:
    scores = np.array([20.0, 3.0, -1.0, 19.5], np.float16)
    values = np.array([[1.0, 0.0], [2.0, 1.0], [0.5, -1.0], [0.0, 2.0]], np.float16)  # zeros meet inf
    o = p_times_v(scores, values, shifted)
    w = np.exp2(scores.astype(np.float64))
    ref = (w / w.sum()) @ values.astype(np.float64)
    return bool(np.all(np.isfinite(o)) and np.allclose(o.astype(np.float64), ref, rtol=2e-3, atol=2e-3))


# --8<-- [end:hazard-c]


# ---------------------------------------------------------------- d. dirty query padding in dK/dV
# --8<-- [start:hazard-d]
def dkdv_block(q, k, v, do, lse2, delta, n_valid, scale, mask_rows):
    """dK, dV of one key block from one query block of rows (some past N), float32, base 2."""
    c = np.float32(scale / math.log(2))
    k2 = k * c
    with np.errstate(over="ignore", invalid="ignore"):
        p = np.exp2(q @ k2.T - lse2[:, None])                            # [BLOCK_M, BLOCK_N]
        if mask_rows:
            # Rows past N are not queries: their P must be 0 before it meets dO, D or Q.
            p = np.where((np.arange(q.shape[0]) < n_valid)[:, None], p, np.float32(0))
        dv = p.T @ do
        dp = do @ v.T
        ds = p * (dp - delta[:, None])
        dk = np.float32(scale) * (ds.T @ q)
    return dk, dv


def dirty_padding_case(padding: str, seed: int = 1):
    """N = 5 real query rows in a block of 8; rows 5–7 are padding: 'clean' zeros or 'dirty' values.
    dO, LSE and D of the padded rows load as 0, as a masked load with other=0 gives them."""
    rng = np.random.default_rng(seed)
    n, block_m, m_keys, d = 5, 8, 4, 4
    scale = 1 / math.sqrt(d)
    q = np.zeros((block_m, d), np.float32)
    q[:n] = rng.standard_normal((n, d))
    if padding == "dirty":
        q[n:] = 200.0  # e.g. stale data from a larger buffer
    k = np.abs(rng.standard_normal((m_keys, d))).astype(np.float32) + 0.5
    v = rng.standard_normal((m_keys, d)).astype(np.float32)
    do = np.zeros((block_m, d), np.float32)
    do[:n] = rng.standard_normal((n, d))
    # Forward quantities for the real rows, in float64.
    s = (q[:n].astype(np.float64) @ k.T.astype(np.float64)) * scale
    lse = np.log(np.exp(s).sum(axis=1))
    p = np.exp(s - lse[:, None])
    o = p @ v.astype(np.float64)
    delta64 = (do[:n].astype(np.float64) * o).sum(axis=1)
    lse2 = np.zeros(block_m, np.float32)
    lse2[:n] = lse / math.log(2)
    delta = np.zeros(block_m, np.float32)
    delta[:n] = delta64
    # The exact answer: only real rows contribute.
    ds = p * (do[:n].astype(np.float64) @ v.T.astype(np.float64) - delta64[:, None])
    ref_dk = scale * ds.T @ q[:n].astype(np.float64)
    ref_dv = p.T @ do[:n].astype(np.float64)
    largest_exponent = float((q[n:] @ (k * np.float32(scale / math.log(2))).T).max()) if padding == "dirty" else 0.0
    return (q, k, v, do, lse2, delta, n, scale), ref_dk, ref_dv, largest_exponent


def dkdv_safe(mask_rows, padding) -> bool:
    args, ref_dk, ref_dv, _ = dirty_padding_case(padding)
    dk, dv = dkdv_block(*args, mask_rows=mask_rows)
    return bool(np.all(np.isfinite(dk)) and np.all(np.isfinite(dv))
                and np.allclose(dk, ref_dk, rtol=1e-4, atol=1e-5) and np.allclose(dv, ref_dv, rtol=1e-4, atol=1e-5))


def clean_padding_bitwise() -> bool:
    """With clean zero padding the unmasked loop is not just close but bitwise equal to the masked one:
    P = 2^0 = 1 is finite, dS = 1·(0 − 0) = 0 and every padded contribution is an exact zero."""
    args, *_ = dirty_padding_case("clean")
    a, b = dkdv_block(*args, mask_rows=False), dkdv_block(*args, mask_rows=True)
    return all(np.array_equal(x, y) for x, y in zip(a, b))
# --8<-- [end:hazard-d]
# --8<-- [end:numeric]


def check() -> CheckResult:
    ledger = Ledger()
    # a
    ledger.claim("a: l grows by exactly 2^(−m) per zero-scored pad; 2^(−m) = 1 ⇔ m = 0 (symbolic)", inflation_symbolic)
    exact, notes = padding_is_exact(PAD_SCORE_FIX, CASES_A)
    ledger.claim("a: padding scored −∞ leaves l and O exactly unchanged (exact base 2): " + "; ".join(notes), exact)
    ledger.claim("a: padding scored 0 inflates l by exactly n_pad·2^(−m); all-negative rows adopt the pad 0 "
                 "as max (+1 per pad)", lambda: inflation_exact(CASES_A))
    # b
    with np.errstate(invalid="ignore"):
        minus_inf = np.float32(-np.inf)
        ledger.claim("b: −∞ − (−∞) = NaN and 2^NaN = NaN in float32",
                     bool(np.isnan(minus_inf - minus_inf) and np.isnan(np.exp2(minus_inf - minus_inf))))
    ledger.claim("b: guarded pivot: fully masked row gives o = 0, lse = −∞; first-block-masked row is exact",
                 lambda: empty_rows_safe(guarded=True))
    # c
    ledger.claim("c: 65504 = (2 − 2^−10)·2^15 < 2^20; exp2(20) = inf and inf·0 = NaN in float16", float16_facts)
    ledger.claim("c: max-shifted exp2 in float32 gives a finite P V matching float64", lambda: overflow_safe(shifted=True))
    # d
    _, _, _, exponent = dirty_padding_case("dirty")
    with np.errstate(over="ignore"):
        fp32_limit = bool(np.isinf(np.exp2(np.float32(128))) and np.isfinite(np.exp2(np.float32(127))))
    ledger.claim(f"d: dirty padding pushes a base-2 exponent to {exponent:.0f} > 128 (2^128 = inf in float32)",
                 exponent > 128 and fp32_limit)
    ledger.claim("d: masking query rows gives finite dK, dV equal to the real-rows-only answer (dirty and clean)",
                 lambda: dkdv_safe(True, "dirty") and dkdv_safe(True, "clean"))
    ledger.claim("d: with clean zero padding the unmasked loop is bitwise equal to the masked one", clean_padding_bitwise)
    # --8<-- [start:negative]
    ledger.control("a: padding keys with score 0 is not exact", lambda: not padding_is_exact(0, CASES_A)[0])
    ledger.control("a: 'each zero pad adds exactly 1' fails when m ≠ 0",
                   lambda: any(n * exp2_exact(-padded_forward(s, v, n, 0)[0]) != n for s, v, n in CASES_A))
    ledger.control("b: unguarded pivot gives NaN", lambda: not empty_rows_safe(guarded=False))
    ledger.control("c: exp2 of unshifted scores in float16 overflows", lambda: not overflow_safe(shifted=False))
    ledger.control("d: unmasked query rows with dirty padding give NaN dK/dV", lambda: not dkdv_safe(False, "dirty"))
    # --8<-- [end:negative]
    sizes = "a: rows of 3–6 keys + 1–5 pads, blocks of 4; b: 8 keys; c: 4 keys; d: 5 real of 8 rows × 4 keys, d = 4"
    return ledger.result(identity=IDENTITY, method=METHOD, sizes=sizes,
                         negative_control=NEGATIVE, module=__name__)
