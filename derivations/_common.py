"""Helpers shared by the derivation checks: explicit symbol matrices, an exact zero test for
expressions rational in exponentials, exact-rational and mpmath matrices, and central differences."""

from __future__ import annotations

import itertools
import random
from fractions import Fraction
from typing import Callable

import mpmath
import sympy as sp


def holds(test: Callable[[], bool]) -> bool:
    """Run a test of a candidate formula; a formula that cannot even be evaluated does not hold."""
    try:
        return bool(test())
    except (ArithmeticError, ValueError, TypeError, IndexError, sp.ShapeError):
        return False


# ---------------------------------------------------------------- symbolic matrices

def symbol_matrix(name: str, rows: int, cols: int, **assumptions) -> sp.Matrix:
    """An explicit rows × cols matrix of independent real symbols name_i_j."""
    assumptions.setdefault("real", True)
    return sp.Matrix(rows, cols, lambda i, j: sp.Symbol(f"{name}_{i}_{j}", **assumptions))


def row_softmax(S: sp.Matrix) -> sp.Matrix:
    """Softmax of every row of an explicit symbolic matrix, written with exp."""
    P = sp.zeros(S.rows, S.cols)
    for i in range(S.rows):
        denom = sum(sp.exp(S[i, k]) for k in range(S.cols))
        for j in range(S.cols):
            P[i, j] = sp.exp(S[i, j]) / denom
    return P


def rowsum(A: sp.Matrix) -> sp.Matrix:
    """Column vector of the row sums."""
    return sp.Matrix([sum(A.row(i)) for i in range(A.rows)])


def hadamard(A: sp.Matrix, B: sp.Matrix) -> sp.Matrix:
    return A.multiply_elementwise(B)


def broadcast_rows(col: sp.Matrix, cols: int) -> sp.Matrix:
    """Repeat a column vector across `cols` columns (the row-wise broadcast of NumPy)."""
    return sp.Matrix(col.rows, cols, lambda i, j: col[i, 0])


def flatten_sum(e):
    """Σ_a f · Σ_b g → (f·g, [a, b]): pull every sum to the front (the indices are distinct)."""
    if isinstance(e, sp.Sum):
        f, limits = flatten_sum(e.function)
        return f, limits + list(e.limits)
    if isinstance(e, sp.Mul):
        factors, limits = [], []
        for arg in e.args:
            f, lims = flatten_sum(arg)
            factors.append(f)
            limits += lims
        return sp.Mul(*factors), limits
    return e, []


def is_zero_with_exps(expr: sp.Expr) -> bool:
    """True when expr is identically zero, for expressions rational in exponentials.

    Every exp(u) is replaced by a fresh positive symbol (exp(2u) becomes its square); the result is
    a rational function, and `rational_is_zero` decides exactly whether it vanishes. If an exponential
    or logarithm is left that the substitution could not express, fall back to `simplify`.
    """
    expr = sp.sympify(expr)
    # exp(a + b) → exp(a)·exp(b), so that every exponential is built from the same primitives.
    expr = expr.replace(lambda t: isinstance(t, sp.exp), lambda t: sp.exp(sp.expand(t.args[0])))
    expr = sp.expand_power_exp(expr)
    symbols: dict = {}

    def to_symbol(t):
        arg = t.args[0]
        coeff, rest = arg.as_coeff_Mul()  # exp(2u) → e_u², exp(−u) → 1/e_u
        if rest not in symbols:
            symbols[rest] = sp.Dummy("e", positive=True)
        return symbols[rest] ** coeff

    rational = expr.replace(lambda t: isinstance(t, sp.exp), to_symbol)
    if rational.atoms(sp.exp) or rational.atoms(sp.log):
        return sp.simplify(expr) == 0
    return rational_is_zero(rational)


def rational_is_zero(rational: sp.Expr) -> bool:
    """Exact zero test for a rational function: multiply every term by a common multiple L of all
    denominators (the highest power of each denominator factor) and expand. r·L is then a polynomial
    that vanishes identically exactly when r does; any leftover fraction is settled by `cancel`."""
    terms = sp.Add.make_args(sp.expand(rational))
    highest: dict = {}
    for term in terms:
        for base, power in sp.denom(term).as_powers_dict().items():
            highest[base] = max(highest.get(base, 0), power)
    common = sp.Mul(*(base ** power for base, power in highest.items()))
    numerator = sp.expand(sp.Add(*(sp.cancel(term * common) for term in terms)))
    if numerator == 0:
        return True
    if all(sp.denom(term) == 1 for term in sp.Add.make_args(numerator)):
        return False  # a non-zero polynomial
    return sp.cancel(numerator) == 0


def matrices_equal_with_exps(A: sp.Matrix, B: sp.Matrix) -> bool:
    if A.shape != B.shape:
        return False
    return all(is_zero_with_exps(A[i, j] - B[i, j]) for i in range(A.rows) for j in range(A.cols))


def gradient(L: sp.Expr, X: sp.Matrix) -> sp.Matrix:
    """∂L/∂X entry by entry (the definition of the gradient, no formula assumed)."""
    return X.applyfunc(lambda x: sp.diff(L, x))


# ---------------------------------------------------------------- exact and high-precision numerics

def rational_matrix(rng: random.Random, rows: int, cols: int, lo: int = -9, hi: int = 9,
                    den: int = 8) -> list[list[Fraction]]:
    return [[Fraction(rng.randint(lo * den, hi * den), den) for _ in range(cols)]
            for _ in range(rows)]


def mp_matrix(rng: random.Random, rows: int, cols: int, scale: float = 1.0) -> mpmath.matrix:
    M = mpmath.matrix(rows, cols)
    for i, j in itertools.product(range(rows), range(cols)):
        M[i, j] = mpmath.mpf(rng.uniform(-1, 1)) * scale
    return M


def mp_row_softmax(S: mpmath.matrix) -> mpmath.matrix:
    P = mpmath.matrix(S.rows, S.cols)
    for i in range(S.rows):
        row_max = max(S[i, j] for j in range(S.cols))
        denom = mpmath.fsum(mpmath.exp(S[i, j] - row_max) for j in range(S.cols))
        for j in range(S.cols):
            P[i, j] = mpmath.exp(S[i, j] - row_max) / denom
    return P


def mp_hadamard(A: mpmath.matrix, B: mpmath.matrix) -> mpmath.matrix:
    C = mpmath.matrix(A.rows, A.cols)
    for i, j in itertools.product(range(A.rows), range(A.cols)):
        C[i, j] = A[i, j] * B[i, j]
    return C


def mp_rowsum(A: mpmath.matrix) -> list:
    return [mpmath.fsum(A[i, j] for j in range(A.cols)) for i in range(A.rows)]


def mp_frobenius(A: mpmath.matrix, B: mpmath.matrix):
    """⟨A, B⟩ = Σ A∘B: the scalar loss L = ⟨dO, O⟩ whose gradient is the backward pass."""
    return mpmath.fsum(A[i, j] * B[i, j] for i in range(A.rows) for j in range(A.cols))


def mp_numeric_gradient(loss: Callable[[mpmath.matrix], object], X: mpmath.matrix,
                        h=None) -> mpmath.matrix:
    """Central differences at high precision: error O(h²) + O(eps/h), both far below tolerance."""
    h = h if h is not None else mpmath.mpf(10) ** (-(mpmath.mp.dps // 3))
    G = mpmath.matrix(X.rows, X.cols)
    for i, j in itertools.product(range(X.rows), range(X.cols)):
        Xp, Xm = X.copy(), X.copy()
        Xp[i, j] += h
        Xm[i, j] -= h
        G[i, j] = (loss(Xp) - loss(Xm)) / (2 * h)
    return G


def mp_max_abs_diff(A: mpmath.matrix, B: mpmath.matrix):
    if (A.rows, A.cols) != (B.rows, B.cols):
        return mpmath.inf
    return max(abs(A[i, j] - B[i, j]) for i in range(A.rows) for j in range(A.cols))
