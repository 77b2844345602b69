# --8<-- [start:statement]
"""Row-softmax backward: for one row p = softmax(s), ∂p_i/∂s_j = p_i (δ_ij − p_j), i.e. the Jacobian
is diag(p) − p pᵀ. Applied to every row of P = softmax(S) with upstream gradient dP:

    dS = P ∘ (dP − rowsum(P ∘ dP)),

where rowsum(·) is broadcast across the columns. The subtracted term comes from the normaliser
that every entry of a row shares; dropping it (dS = P ∘ dP) is the classic mistake.
"""
# --8<-- [end:statement]

from __future__ import annotations

import random

import mpmath
import sympy as sp

from ._common import (broadcast_rows, hadamard, holds, matrices_equal_with_exps, mp_hadamard,
                     mp_matrix, mp_max_abs_diff, mp_numeric_gradient, mp_row_softmax, mp_rowsum,
                     row_softmax, rowsum, symbol_matrix)
from ._result import CheckResult, Ledger

IDENTITY = "row-softmax backward: J = diag(p) − p pᵀ; dS = P∘(dP − rowsum(P∘dP))"
METHOD = ("element-wise SymPy differentiation on explicit symbol matrices; mpmath (50 digits) central"
          " differences")
NEGATIVE = "dS = P∘dP (normaliser term dropped); J = diag(p) (off-diagonal terms dropped)"


# --8<-- [start:formula]
def softmax_jacobian(p: sp.Matrix) -> sp.Matrix:
    """Jacobian of softmax for one row p (a column vector)."""
    return sp.diag(*p) - p * p.T


def softmax_grad(P, dP):
    """dS from P = row-softmax(S) and the upstream dP (SymPy or mpmath matrices)."""
    if isinstance(P, sp.MatrixBase):
        return hadamard(P, dP - broadcast_rows(rowsum(hadamard(P, dP)), P.cols))
    delta = mp_rowsum(mp_hadamard(P, dP))
    dS = mpmath.matrix(P.rows, P.cols)
    for i in range(P.rows):
        for j in range(P.cols):
            dS[i, j] = P[i, j] * (dP[i, j] - delta[i])
    return dS
# --8<-- [end:formula]


# --8<-- [start:proof]
def jacobian_route(jacobian_formula, lengths) -> bool:
    """Differentiate softmax(s) of a row of symbols and compare every entry of the Jacobian."""
    for c in lengths:
        s = symbol_matrix("s", 1, c)
        p = row_softmax(s).T  # column vector
        J = sp.Matrix(c, c, lambda i, j: sp.diff(p[i], s[0, j]))
        if not holds(lambda: matrices_equal_with_exps(J, jacobian_formula(p))):
            return False
    return True


def gradient_route(grad_formula, shapes) -> bool:
    """L = Σ dP ∘ softmax(S), differentiated by SymPy with respect to every S_ij."""
    for rows, cols in shapes:
        S, dP = symbol_matrix("s", rows, cols), symbol_matrix("g", rows, cols)
        P = row_softmax(S)
        loss = sum(hadamard(dP, P))
        dS = S.applyfunc(lambda s: sp.diff(loss, s))
        if not holds(lambda: matrices_equal_with_exps(dS, grad_formula(P, dP))):
            return False
    return True
# --8<-- [end:proof]


# --8<-- [start:numeric]
def numeric_route(grad_formula, shapes, seed: int = 5, dps: int = 50) -> bool:
    """At larger sizes: central differences of L(S) = ⟨dP, softmax(S)⟩ in 50-digit arithmetic."""
    rng = random.Random(seed)
    with mpmath.workdps(dps):
        for rows, cols in shapes:
            S, dP = mp_matrix(rng, rows, cols, scale=4), mp_matrix(rng, rows, cols)
            loss = lambda S_: mpmath.fsum(a * b for a, b in zip(dP, mp_row_softmax(S_)))
            reference = mp_numeric_gradient(loss, S)
            if not holds(lambda: mp_max_abs_diff(grad_formula(mp_row_softmax(S), dP), reference)
                         < mpmath.mpf(10) ** (-(dps // 3))):
                return False
    return True
# --8<-- [end:numeric]


JACOBIAN_LENGTHS = [2, 3, 4]
SYMBOLIC_SHAPES = [(2, 3), (3, 2)]
NUMERIC_SHAPES = [(6, 9), (9, 6)]


def check() -> CheckResult:
    ledger = Ledger()
    ledger.claim(f"Jacobian of softmax = diag(p) − p pᵀ, row lengths {JACOBIAN_LENGTHS}",
                 lambda: jacobian_route(softmax_jacobian, JACOBIAN_LENGTHS))
    ledger.claim(f"dS = P∘(dP − rowsum(P∘dP)) on symbol matrices {SYMBOLIC_SHAPES}",
                 lambda: gradient_route(softmax_grad, SYMBOLIC_SHAPES))
    ledger.claim(f"same formula against 50-digit central differences {NUMERIC_SHAPES}",
                 lambda: numeric_route(softmax_grad, NUMERIC_SHAPES))
    # --8<-- [start:negative]
    no_normaliser = lambda P, dP: hadamard(P, dP) if isinstance(P, sp.MatrixBase) else mp_hadamard(P, dP)
    diagonal_only = lambda p: sp.diag(*p)
    ledger.control("dS = P∘dP fails the symbolic check",
                   lambda: not gradient_route(no_normaliser, SYMBOLIC_SHAPES))
    ledger.control("dS = P∘dP fails the numeric check", lambda: not numeric_route(no_normaliser, NUMERIC_SHAPES))
    ledger.control("J = diag(p) fails the Jacobian check", lambda: not jacobian_route(diagonal_only, JACOBIAN_LENGTHS))
    # --8<-- [end:negative]
    sizes = (f"rows {JACOBIAN_LENGTHS}; symbolic {', '.join(f'{r}x{c}' for r, c in SYMBOLIC_SHAPES)}; "
             f"mpmath {', '.join(f'{r}x{c}' for r, c in NUMERIC_SHAPES)}")
    return ledger.result(identity=IDENTITY, method=METHOD, sizes=sizes,
                         negative_control=NEGATIVE, module=__name__)
