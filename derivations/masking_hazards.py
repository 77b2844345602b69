# --8<-- [start:statement]
"""Masking hazards: four ways a masked or padded entry can corrupt attention, and what removes each.

a. Padding keys scored 0 instead of −∞. Each zero-scored pad adds 2⁰ = 1 to the unshifted
   denominator Σ_j 2^(s_j); in the units of the running sum l = Σ_j 2^(s_j − m) that same amount is
   2^(−m). Padded value rows load as 0, so the numerator is unchanged and the output shrinks by the
   factor Σ/(Σ + n_pad). When every real score of a row is negative, the pad's 0 is also the row max.
   Fix: score padded keys −∞ before the max, so that 2^(−∞) = 0 exactly.
b. A row whose running max is −∞ computes s − m = −∞ − (−∞) = NaN. In this package's kernels, which
   walk the keys upward from key 0, that happens only to rows that see no key at all (bottom-right
   causal with N > M): any row that sees a key sees key 0, which lies in its first tile. A kernel
   that walks down from the diagonal meets fully masked first tiles for rows that do see keys.
   Fix: pivot at 0 where m = −∞ (every term is then 2^(−∞) = 0) and divide by l only where l > 0.
c. Overflow. The largest float16 is (2 − 2^(−10))·2^15 = 65504, so 2^20 is inf, and inf · 0 = NaN.
   The forward subtracts the running max, so its exponents are ≤ 0. The backward subtracts LSE₂,
   which covers only the *visible* keys: for a padded key (score 0) the exponent is −LSE₂, positive
   whenever LSE₂ < 0, and a causally hidden key can score far above LSE₂, so exp2 may return inf in
   a discarded lane. The kernels stay finite because they *select* with `where` after exp2; a kernel
   that multiplies P by a 0/1 mask turns that inf into NaN.
d. Rows past N in the dK/dV loop. Their Q and dO tiles load as zeros (tensor descriptors zero-fill
   per dimension) and their LSE₂ and δ load as 0 (`other=0.0`), so P = 2⁰ = 1 and dS = 1·(0 − 0) = 0:
   the unmasked loop is bitwise equal to the masked one, and the kernel's explicit row mask is
   defensive. Padding rows *inside* the sequence (tokens whose dO is 0) are safe too whatever their
   Q holds: they have a real LSE, so P ≤ 1, and dP = δ = 0. The real hazard is a masked load without
   `other=`. Guaranteed: nothing; Triton documents the masked-off value as undefined when `other` is
   None (and a block-pointer load's default padding_option "" names no value either). Observed:
   Triton's interpreter fills zeros there, and today's GPU backends happen to as well; the check
   reads the first two facts from the installed Triton and does not claim the third. What it shows
   is the consequence *if* a lane holds anything else: the check itself puts −200, NaN or −3e38 in
   those lanes, and the block's dK and dV come out NaN. Fix: `other=0.0` on every masked load whose
   value is used. The row mask is then defensive; it is no substitute, since it zeroes P but a NaN δ
   lane still gives dS = 0·(0 − NaN) = NaN. A load whose masked-off lanes reach only a store under
   the same mask needs no `other=`: those lanes are never written.
"""
# --8<-- [end:statement]

from __future__ import annotations

import ast
import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import sympy as sp

from flashattn import schedule

from ._result import CheckResult, Ledger
from .online_softmax import exp2_exact, finish, online_step
from .seed_passages import ZERO_PADDED_004

# The control that answers seed 004's "zero-padded via the mask" (the Errata page quotes this line).
ZERO_PADDED_CONTROL = (f"d: '{ZERO_PADDED_004.text}' (seed 004) is not guaranteed: if a masked-off LSE₂ lane held "
                       "−200, NaN or −3e38 (put there by this check), the unmasked dK/dV would be NaN")

IDENTITY = ("masking hazards a–d: zero-scored padding, −∞ − (−∞), overflow in masked lanes, "
            "rows past N and masked loads without other=")
METHOD = ("SymPy + exact base-2 rationals (a); the package's schedule, brute force (b); numpy float32/16 "
          "demonstrations with the fix (c, d); the kernel source's tl.load calls (d)")
NEGATIVE = ("pad keys with 0; '2^(−m) per pad' in unshifted units; walk down from the diagonal unguarded; "
            "mask by multiplying; masked loads without other= read as zeros")
PACKAGE = Path(__file__).resolve().parents[1] / "flashattn"
BACKWARD_SOURCE = PACKAGE / "backward.py"


# ---------------------------------------------------------------- a. zero-scored padding
# --8<-- [start:proof]
def inflation_symbolic() -> bool:
    """Symbolic: three zero-scored pads add exactly 3 to the unshifted sum Σ 2^(s_j) and 3·2^(−m) to
    l = Σ 2^(s_j − m): one amount in two units (l·2^m is the unshifted sum). Zero value rows leave
    the numerator alone, so the output is scaled by Σ/(Σ + 3)."""
    m = sp.Symbol("m", real=True)
    s = sp.symbols("s0:3", real=True)
    v = sp.symbols("v0:3", real=True)
    pads = 3
    unshifted_true = sum(2 ** x for x in s)
    unshifted_pad = unshifted_true + sum(2 ** sp.Integer(0) for _ in range(pads))
    l_true = sum(2 ** (x - m) for x in s)
    l_pad = l_true + sum(2 ** (0 - m) for _ in range(pads))
    num = sum(2 ** x * y for x, y in zip(s, v)) + sum(2 ** sp.Integer(0) * 0 for _ in range(pads))
    return (sp.simplify(unshifted_pad - unshifted_true - pads) == 0
            and sp.simplify(l_pad - l_true - pads * 2 ** (-m)) == 0
            and sp.simplify(l_pad * 2 ** m - unshifted_pad) == 0
            and sp.simplify(num / unshifted_pad - (num / unshifted_true) * unshifted_true / (unshifted_true + pads)) == 0)
# --8<-- [end:proof]


# --8<-- [start:numeric]
# --8<-- [start:hazard-a]
PAD_SCORE_FIX = -math.inf


def pad_row(scores, values, n_pad, fill):
    """The key row as a kernel sees it after padding to a block multiple (padded V rows are 0)."""
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
    """Does padding with `fill` leave (l·2^m, acc/l) exactly as without padding?"""
    notes, ok = [], True
    for scores, values, n_pad in cases:
        m_true, l_true, acc_true = padded_forward(scores, values, 0, fill)
        m_pad, l_pad, acc_pad = padded_forward(scores, values, n_pad, fill)
        same = (l_pad * exp2_exact(m_pad) == l_true * exp2_exact(m_true)
                and finish((m_pad, l_pad, acc_pad)) == finish((m_true, l_true, acc_true)))
        ok = ok and same
        notes.append(f"scores {scores}, {n_pad} pads: pivot {m_pad}")
    return ok, notes


def unshifted_growth(scores, values, n_pad):
    """With fill 0: (growth of Σ 2^(s_j), growth of the numerator Σ 2^(s_j) v_j, pivot after padding)."""
    m_true, l_true, acc_true = padded_forward(scores, values, 0, 0)
    m_pad, l_pad, acc_pad = padded_forward(scores, values, n_pad, 0)
    denominator = l_pad * exp2_exact(m_pad) - l_true * exp2_exact(m_true)
    numerator = acc_pad[0] * exp2_exact(m_pad) - acc_true[0] * exp2_exact(m_true)
    return denominator, numerator, m_pad


def one_per_pad(cases) -> bool:
    """Each zero pad adds exactly 1 to the unshifted denominator (2^(−m) in l's units), nothing to the
    numerator, and an all-negative row adopts the pad's 0 as its max."""
    for scores, values, n_pad in cases:
        denominator, numerator, m_pad = unshifted_growth(scores, values, n_pad)
        if denominator != n_pad or numerator != 0:
            return False
        if max(scores) < 0 and m_pad != 0:
            return False
    return True


CASES_A = [
    ([3, 1, 2], [[Fraction(1)], [Fraction(-2)], [Fraction(5)]], 5),   # m = 3: l grows by 5·2^-3
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


def upward_walk(start_m, block_m, block_n, n, m):
    """Key blocks in the order this package's forward and dQ kernels visit them (from key 0 up)."""
    _, hi = schedule.forward_key_range(start_m, block_m, block_n, n, m, True)
    return list(range(0, hi, block_n))


def downward_walk(start_m, block_m, block_n, n, m):
    """The same blocks, visited from the diagonal down (the order of FA2's CUDA causal loop)."""
    return upward_walk(start_m, block_m, block_n, n, m)[::-1]


def rows_meeting_minus_inf(walk, cases) -> list[tuple]:
    """(N, M, block_m, block_n, row) of every row that *sees some key* yet has running max −∞ after
    the first tile of its walk, i.e. would compute −∞ − (−∞) in an unguarded update."""
    found = []
    for n, m, block_m, block_n in cases:
        for start_m in range(0, n, block_m):
            order = walk(start_m, block_m, block_n, n, m)
            for i in range(start_m, min(start_m + block_m, n)):
                sees_any = any(schedule.is_visible(i, j, n, m, True) for j in range(m))
                if not sees_any or not order:
                    continue
                first = order[0]
                if not any(schedule.is_visible(i, j, n, m, True) for j in range(first, min(first + block_n, m))):
                    found.append((n, m, block_m, block_n, i))
    return found


CASES_B = [(n, m, bm, bn) for n in (1, 5, 16, 37) for m in (1, 7, 16, 40) for bm, bn in ((4, 4), (8, 4), (4, 8))]
# --8<-- [end:hazard-b]


# ---------------------------------------------------------------- c. overflow
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


def backward_row_case():
    """One query row in the backward, float32, base 2: keys 0–1 visible (scores −150, −151), key 2
    causally hidden (score 40), key 3 a zero-filled pad past M (score 0). LSE₂ ≈ −149.4 covers only
    keys 0–1, so the discarded lanes have exponents 189 and 149: exp2 gives inf there."""
    s = np.array([-150.0, -151.0, 40.0, 0.0], np.float32)           # base-2 scores of one row
    visible = np.array([True, True, False, False])
    lse2 = np.float32(np.log2(np.exp2(s[visible].astype(np.float64)).sum()))
    dp = np.array([0.5, -1.0, 2.0, 0.0], np.float32)               # dP = dO Vᵀ (pad's V row is 0)
    return s, visible, lse2, dp


def backward_exponents(s, visible, lse2) -> np.ndarray:
    return (s - lse2)[~visible]


def ds_row(select: str) -> np.ndarray:
    """dS of that row with P = exp2(s − LSE₂) then masked by `where` (the kernels) or by a 0/1 multiply."""
    s, visible, lse2, dp = backward_row_case()
    with np.errstate(over="ignore", invalid="ignore"):
        p = np.exp2(s - lse2)
        p = np.where(visible, p, np.float32(0)) if select == "where" else p * visible.astype(np.float32)
        delta = np.float32((p[visible] * dp[visible]).sum())
        return p * (dp - delta)


def ds_row_exact() -> np.ndarray:
    s, visible, _, dp = backward_row_case()
    p = np.zeros(4)
    w = np.exp2(s[visible].astype(np.float64))
    p[visible] = w / w.sum()
    return p * (dp - (p * dp).sum())
# --8<-- [end:hazard-c]


# ---------------------------------------------------------------- d. rows past N, and masked loads
# --8<-- [start:hazard-d]
def dkdv_block(q, k, v, do, lse2, delta, n_valid, scale, mask_rows):
    """dK, dV of one key block from one query block of rows (some past N), float32, base 2."""
    c = np.float32(scale / math.log(2))
    with np.errstate(over="ignore", invalid="ignore"):
        p = np.exp2(q @ (k * c).T - lse2[:, None])                      # [BLOCK_M, BLOCK_N]
        if mask_rows:
            p = np.where((np.arange(q.shape[0]) < n_valid)[:, None], p, np.float32(0))
        dv = p.T @ do
        ds = p * (do @ v.T - delta[:, None])
        dk = np.float32(scale) * (ds.T @ q)
    return dk, dv


def block_case(seed: int = 1, pad_inside: bool = False):
    """A query block of 8 rows over 4 keys, d = 4. Rows 0–4 are real. Returns the tiles as the dK/dV
    loop would load them for rows past N (Q, dO zero-filled; LSE₂, δ = other = 0), and the exact
    answer in float64. With ``pad_inside`` rows 5–7 are *inside* the sequence instead: padding tokens
    with dirty Q (200.0), dO = 0, and their own real LSE and δ."""
    rng = np.random.default_rng(seed)
    n_real, block_m, m_keys, d = 5, 8, 4, 4
    scale = 1 / math.sqrt(d)
    q = np.zeros((block_m, d), np.float32)
    q[:n_real] = rng.standard_normal((n_real, d))
    if pad_inside:
        q[n_real:] = 200.0
    k = (np.abs(rng.standard_normal((m_keys, d))) + 0.5).astype(np.float32)
    v = rng.standard_normal((m_keys, d)).astype(np.float32)
    do = np.zeros((block_m, d), np.float32)
    do[:n_real] = rng.standard_normal((n_real, d))
    rows = block_m if pad_inside else n_real   # rows with a real LSE and δ
    s = (q[:rows].astype(np.float64) @ k.T.astype(np.float64)) * scale
    lse = s.max(axis=1) + np.log(np.exp(s - s.max(axis=1, keepdims=True)).sum(axis=1))
    p = np.exp(s - lse[:, None])
    delta64 = (do[:rows].astype(np.float64) * (p @ v.astype(np.float64))).sum(axis=1)
    lse2, delta = np.zeros(block_m, np.float32), np.zeros(block_m, np.float32)
    lse2[:rows], delta[:rows] = lse / math.log(2), delta64
    ds = p[:n_real] * (do[:n_real].astype(np.float64) @ v.T.astype(np.float64) - delta64[:n_real, None])
    ref_dk = scale * ds.T @ q[:n_real].astype(np.float64)
    ref_dv = p[:n_real].T @ do[:n_real].astype(np.float64)
    n_valid = block_m if pad_inside else n_real
    return (q, k, v, do, lse2, delta, n_valid, scale), ref_dk, ref_dv


def close_to(got, ref_dk, ref_dv) -> bool:
    dk, dv = got
    return bool(np.all(np.isfinite(dk)) and np.all(np.isfinite(dv))
                and np.allclose(dk, ref_dk, rtol=1e-4, atol=1e-5) and np.allclose(dv, ref_dv, rtol=1e-4, atol=1e-5))


# Values this check *puts* in a masked-off lane of a load without `other=`, to show what follows if a
# backend leaves something other than 0 there (Triton does not define the value; it is not observed here).
GARBAGE = (np.float32(-200.0), np.float32(np.nan), np.float32(-3e38))


def with_garbage_stats(args, garbage, delta_garbage=None):
    """The tiles of ``args`` with the LSE₂ (and δ) lanes of rows past N set to ``garbage``."""
    q, k, v, do, lse2, delta, n_valid, scale = args
    lse2, delta = lse2.copy(), delta.copy()
    lse2[n_valid:] = garbage
    delta[n_valid:] = garbage if delta_garbage is None else delta_garbage
    return (q, k, v, do, lse2, delta, n_valid, scale)


def _is_tl(node, name: str) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == name
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "tl")


def masked_loads_without_other(source: str) -> list[str]:
    """Every `tl.load(..., mask=...)` in `source` that gives no `other=`: its masked-off lanes are undefined."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if _is_tl(node, "load"):
            keywords = {kw.arg for kw in node.keywords}
            if "mask" in keywords and "other" not in keywords:
                found.append(ast.unparse(node))
    return found


def undefined_lanes_that_escape(source: str) -> tuple[list[str], list[str]]:
    """Split the loads without `other=` of `source`: (harmless, hazardous). A load is harmless when it
    is assigned to a name and, in its function, every use of that name is the value of a `tl.store`
    whose mask is the load's mask, written identically: its undefined lanes are never stored or
    computed with. Every other load without `other=` (returned, used in arithmetic, stored under
    another mask) is hazardous."""
    harmless, hazardous, seen = [], [], set()
    assigned = {}
    for fn in (n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)):
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                assigned[id(node.value)] = (node.targets[0].id, fn)
        for node in ast.walk(fn):
            if not _is_tl(node, "load") or id(node) in seen:
                continue
            seen.add(id(node))
            kw = {k.arg: k.value for k in node.keywords}
            if "mask" not in kw or "other" in kw:
                continue
            text = ast.unparse(node)
            if id(node) not in assigned:
                hazardous.append(text)
                continue
            name, where = assigned[id(node)]
            mask = ast.unparse(kw["mask"])
            ok_uses = {id(c.args[1]) for c in ast.walk(where) if _is_tl(c, "store") and len(c.args) > 1
                       and isinstance(c.args[1], ast.Name) and c.args[1].id == name
                       and any(k.arg == "mask" and ast.unparse(k.value) == mask for k in c.keywords)}
            uses = [n for n in ast.walk(where) if isinstance(n, ast.Name) and n.id == name
                    and isinstance(n.ctx, ast.Load)]
            (harmless if uses and all(id(u) in ok_uses for u in uses) else hazardous).append(text)
    return harmless, hazardous


def package_loads() -> dict[str, tuple[list[str], list[str]]]:
    """{file under flashattn/: (harmless, hazardous) loads without other=}, files that have any."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        split = undefined_lanes_that_escape(path.read_text(encoding="utf-8"))
        if split[0] or split[1]:
            out[path.relative_to(PACKAGE.parent).as_posix()] = split
    return out


def triton_documents_undefined() -> str:
    """The sentence of the installed Triton's `tl.load` docstring on a masked-off lane without `other`."""
    import triton
    import triton.language as tl

    sentence = next(s.strip() for s in tl.load.__doc__.split(".") if "other" in s and "undefined" in s)
    return f"Triton {triton.__version__}: '{sentence}.'"


def interpreter_fills_zeros() -> bool:
    """What the interpreter does (observed in its source, not documented): `other` None becomes zeros."""
    import inspect

    from triton.runtime.interpreter import InterpreterBuilder

    src = inspect.getsource(InterpreterBuilder.create_masked_load)
    return "if other is None" in src and "zeros_like" in src.split("if other is None", 1)[1].splitlines()[1]


def without_other(source: str, function: str) -> str:
    """`source` with the `other=` of the first masked tl.load in `function` removed (a mutation)."""
    tree = ast.parse(source)
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function)
    load = next(n for n in ast.walk(fn) if _is_tl(n, "load") and any(k.arg == "other" for k in n.keywords))
    load.keywords = [k for k in load.keywords if k.arg != "other"]
    return ast.unparse(tree)
# --8<-- [end:hazard-d]
# --8<-- [end:numeric]


def check() -> CheckResult:
    ledger = Ledger()
    # a
    ledger.claim("a: each zero pad adds 1 to Σ 2^(s_j) = l·2^m, i.e. 2^(−m) to l; output scaled by Σ/(Σ + n) "
                 "(symbolic)", inflation_symbolic)
    exact, notes = padding_is_exact(PAD_SCORE_FIX, CASES_A)
    ledger.claim("a: padding scored −∞ leaves l·2^m and O exactly unchanged (exact base 2): " + "; ".join(notes), exact)
    ledger.claim("a: padding scored 0 adds exactly n_pad to the unshifted denominator and 0 to the numerator; "
                 "an all-negative row adopts the pad's 0 as its max", lambda: one_per_pad(CASES_A))
    # b
    with np.errstate(invalid="ignore"):
        minus_inf = np.float32(-np.inf)
        ledger.claim("b: −∞ − (−∞) = NaN and 2^NaN = NaN in float32",
                     bool(np.isnan(minus_inf - minus_inf) and np.isnan(np.exp2(minus_inf - minus_inf))))
    ledger.claim("b: guarded pivot: fully masked row gives o = 0, lse = −∞; first-block-masked row is exact",
                 lambda: empty_rows_safe(guarded=True))
    ledger.claim(f"b: walking up from key 0 (flashattn.schedule), no row that sees a key has max −∞ after its "
                 f"first tile ({len(CASES_B)} causal (N, M, block) cases, every row)",
                 lambda: rows_meeting_minus_inf(upward_walk, CASES_B) == [])
    # c
    ledger.claim("c: 65504 = (2 − 2^−10)·2^15 < 2^20; exp2(20) = inf and inf·0 = NaN in float16", float16_facts)
    ledger.claim("c: max-shifted exp2 in float32 gives a finite P V matching float64", lambda: overflow_safe(shifted=True))
    exponents = backward_exponents(*backward_row_case()[:3])
    ledger.claim(f"c: backward exponents s − LSE₂ of a hidden key and a zero pad are {exponents[0]:.1f} and "
                 f"{exponents[1]:.1f} > 0 ('every exponent ≤ 0' is false in masked lanes)", bool(np.all(exponents > 128)))
    ledger.claim("c: exp2 then `where` (the kernels): inf in the discarded lanes, finite dS equal to float64",
                 lambda: np.allclose(ds_row("where"), ds_row_exact(), rtol=1e-5, atol=1e-30))
    # d
    clean, ref_dk, ref_dv = block_case()
    ledger.claim("d: rows past N loaded as the package loads them (Q, dO zero-filled; LSE₂, δ other=0): "
                 "the unmasked loop is bitwise equal to the masked one and exact",
                 lambda: all(np.array_equal(x, y) for x, y in zip(dkdv_block(*clean, mask_rows=False),
                                                                  dkdv_block(*clean, mask_rows=True)))
                 and close_to(dkdv_block(*clean, mask_rows=True), ref_dk, ref_dv))
    inside, in_dk, in_dv = block_case(pad_inside=True)
    ledger.claim("d: padding rows inside the sequence (dirty Q = 200, dO = 0, real LSE): no mask needed, "
                 "P ≤ 1 and dK, dV equal the real-rows-only answer",
                 lambda: close_to(dkdv_block(*inside, mask_rows=False), in_dk, in_dv))
    ledger.claim("d: the explicit row mask gives the exact answer whatever the LSE₂ lanes hold, while δ is finite",
                 lambda: all(close_to(dkdv_block(*with_garbage_stats(clean, g, np.float32(-7.0)), mask_rows=True),
                                      ref_dk, ref_dv) for g in GARBAGE))
    loads = package_loads()
    harmless = {f: len(h) for f, (h, _) in loads.items() if h}
    ledger.claim("d: guaranteed: " + triton_documents_undefined() + " Observed, not guaranteed: the interpreter "
                 "fills zeros (its create_masked_load)", interpreter_fills_zeros)
    ledger.claim(f"d: every masked tl.load under flashattn/ gives other=, except {sum(harmless.values())} whose value "
                 f"only reaches a tl.store under the same mask ({', '.join(f'{f}: {n}' for f, n in harmless.items())})",
                 lambda: all(not hazardous for _, hazardous in loads.values()))
    # --8<-- [start:negative]
    ledger.control("a: padding keys with score 0 is not exact", lambda: not padding_is_exact(0, CASES_A)[0])
    ledger.control("a: '2^(−m) per pad' read in unshifted units is wrong whenever m ≠ 0",
                   lambda: any(unshifted_growth(s, v, n)[0] != n * exp2_exact(-unshifted_growth(s, v, n)[2])
                               for s, v, n in CASES_A))
    ledger.control("b: unguarded pivot gives NaN", lambda: not empty_rows_safe(guarded=False))
    ledger.control("b: walking down from the diagonal, rows that see keys start on a fully masked tile",
                   lambda: len(rows_meeting_minus_inf(downward_walk, CASES_B)) > 0)
    ledger.control("c: exp2 of unshifted scores in float16 overflows", lambda: not overflow_safe(shifted=False))
    ledger.control("c: masking P by multiplying with a 0/1 mask gives inf·0 = NaN",
                   lambda: bool(np.isnan(ds_row("multiply")).any()))
    ledger.control(ZERO_PADDED_CONTROL,
                   lambda: all(not close_to(dkdv_block(*with_garbage_stats(clean, g), mask_rows=False), ref_dk, ref_dv)
                               for g in GARBAGE))
    ledger.control("d: 'the row mask alone makes loads without other= safe': a NaN δ lane gives 0·(0 − NaN) = NaN",
                   lambda: not close_to(dkdv_block(*with_garbage_stats(clean, np.float32(np.nan)), mask_rows=True),
                                        ref_dk, ref_dv))
    ledger.control("d: the source check is not blind: backward.py with the other= of _load_row_stats's first "
                   "load removed (a mutation) is flagged as hazardous",
                   lambda: len(undefined_lanes_that_escape(without_other(BACKWARD_SOURCE.read_text(encoding="utf-8"),
                                                                          "_load_row_stats"))[1]) == 1)
    # --8<-- [end:negative]
    sizes = ("a: rows of 3–6 keys + 1–5 pads, blocks of 4; b: 8 keys, and 48 causal (N, M, block) cases; "
             "c: 4 keys; d: 5 real of 8 rows × 4 keys, d = 4")
    return ledger.result(identity=IDENTITY, method=METHOD, sizes=sizes,
                         negative_control=NEGATIVE, module=__name__)
