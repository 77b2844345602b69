# --8<-- [start:statement]
"""Dropout on the attention probabilities. With drop probability p_drop (the `dropout_p` of PyTorch and
flash_attn), keep mask Z (entries 0 or 1, each 1 with probability 1 − p_drop):

    P̃ = P ∘ Z / (1 − p_drop),    O = P̃ V.

Backward, with dP̃ = dO Vᵀ the gradient with respect to P̃:

    dV = P̃ᵀ dO,    dP = dP̃ ∘ Z / (1 − p_drop),    dS = P ∘ (dP − δ),    δ = rowsum(P ∘ dP).

The δ identity survives: rowsum(P ∘ dP) = rowsum(P̃ ∘ dP̃) = rowsum(dO ∘ O), with O the output of
the *dropped* P̃, exactly the O the forward pass stored. dS is formed from the *undropped* P: a
backward that reassigns P to P̃ and then forms dS = P̃ ∘ (dP̃ − δ) gets the first term right
(P̃ ∘ dP̃ = P ∘ dP) and the second wrong (P̃ δ instead of P δ); the two agree only when p_drop = 0.
"""
# --8<-- [end:statement]

from __future__ import annotations

import random

import mpmath
import sympy as sp

from ._common import (broadcast_rows, hadamard, holds, is_zero_with_exps, mp_matrix,
                     mp_numeric_gradient, mp_row_softmax, rational_matrix, row_softmax, rowsum,
                     symbol_matrix)
from ._result import CheckResult, Ledger

IDENTITY = "dropout: O = (P∘Z/(1−p_drop))V; dV = P̃ᵀdO; dP = (dO Vᵀ)∘Z/(1−p_drop); dS = P∘(dP − δ); δ = rowsum(dO∘O) still"
METHOD = "SymPy with symbolic mask entries and drop probability; exact rationals; mpmath central differences"
NEGATIVE = ("dV = Pᵀ dO (mask forgotten); dP = dO Vᵀ (mask not applied); δ from the undropped output; "
            "dS = P̃ ∘ (dP̃ − δ), P reassigned to P̃ (seed 003, Appendix B)")


# --8<-- [start:formula]
def dropout_backward(P, Z, keep, V, dO, O):
    """dV, dS and δ (here `D`) as a kernel computes them. SymPy matrices; P undropped, O the dropped
    output, `keep` = 1 − p_drop."""
    P_dropped = hadamard(P, Z) / keep
    dP = hadamard(dO * V.T, Z) / keep
    D = rowsum(hadamard(dO, O))  # the identity: equals rowsum(P ∘ dP)
    dS = hadamard(P, dP - broadcast_rows(D, P.cols))
    return dict(dV=P_dropped.T * dO, dS=dS, D=D, D_direct=rowsum(hadamard(P, dP)))
# --8<-- [end:formula]


# --8<-- [start:proof]
def symbolic_route(backward, shapes) -> bool:
    """L = ⟨dO, (softmax(S) ∘ Z / (1 − p_drop)) V⟩ with every entry of S, Z, V, dO and p_drop a symbol."""
    keep = 1 - sp.Symbol("p_drop", positive=True)
    for N, M, d in shapes:
        S, Z = symbol_matrix("s", N, M), symbol_matrix("z", N, M)
        V, dO = symbol_matrix("v", M, d), symbol_matrix("g", N, d)
        P = row_softmax(S)
        O = (hadamard(P, Z) / keep) * V
        loss = sum(hadamard(dO, O))
        got = backward(P, Z, keep, V, dO, O)
        tests = [lambda i=i: is_zero_with_exps(got["D"][i] - got["D_direct"][i]) for i in range(N)]
        tests += [lambda i=i, j=j: is_zero_with_exps(got["dS"][i, j] - sp.diff(loss, S[i, j]))
                  for i in range(N) for j in range(M)]
        tests += [lambda i=i, j=j: sp.expand(got["dV"][i, j] - sp.diff(loss, V[i, j])) == 0
                  for i in range(M) for j in range(d)]
        if not all(holds(t) for t in tests):
            return False
    return True
# --8<-- [end:proof]


# --8<-- [start:numeric]
def rational_route(backward, shapes, seed: int = 23) -> bool:
    """The δ identity with exact rationals and 0/1 masks (P any matrix; the identity needs no softmax)."""
    rng = random.Random(seed)
    keep = 1 - sp.Rational(1, 5)  # p_drop = 1/5
    for N, M, d in shapes:
        P = sp.Matrix(rational_matrix(rng, N, M, lo=0, hi=1, den=16))
        Z = sp.Matrix(N, M, lambda i, j: int(rng.random() < 0.8))
        V, dO = sp.Matrix(rational_matrix(rng, M, d)), sp.Matrix(rational_matrix(rng, N, d))
        O = (hadamard(P, Z) / keep) * V
        got = backward(P, Z, keep, V, dO, O)
        if not holds(lambda: got["D"] == got["D_direct"]):
            return False
    return True


def mpmath_route(backward, shapes, seed: int = 29, dps: int = 40) -> bool:
    """dS and dV against 40-digit central differences of L(S, V), with a random Bernoulli mask."""
    rng = random.Random(seed)
    keep = 1 - sp.Rational(1, 5)  # p_drop = 1/5
    with mpmath.workdps(dps):
        for N, M, d in shapes:
            S, V, dO = mp_matrix(rng, N, M, scale=3), mp_matrix(rng, M, d), mp_matrix(rng, N, d)
            Z = mpmath.matrix([[int(rng.random() < 0.8) for _ in range(M)] for _ in range(N)])
            Z[0, 0], Z[N - 1, M - 1] = 0, 1  # at least one dropped and one kept entry, whatever the draw
            kept = mpmath.mpf(keep.p) / keep.q  # 1 − p_drop

            def loss(S_=S, V_=V):
                P = mp_row_softmax(S_)
                dropped = mpmath.matrix(N, M)
                for i in range(N):
                    for j in range(M):
                        dropped[i, j] = P[i, j] * Z[i, j] / kept
                return mpmath.fsum(a * b for a, b in zip(dO, dropped * V_))

            to_sym = lambda A: sp.Matrix(A.rows, A.cols, lambda i, j: sp.Float(A[i, j], dps + 10))
            P = to_sym(mp_row_softmax(S))
            Zs, Vs, dOs = to_sym(Z), to_sym(V), to_sym(dO)
            O = (hadamard(P, Zs) / sp.Float(kept, dps + 10)) * Vs
            got = backward(P, Zs, sp.Float(kept, dps + 10), Vs, dOs, O)
            tol = mpmath.mpf(10) ** (-(dps // 3))
            for name, ref in (("dS", mp_numeric_gradient(lambda X: loss(S_=X), S)),
                              ("dV", mp_numeric_gradient(lambda X: loss(V_=X), V))):
                if max(abs(mpmath.mpf(got[name][i, j]) - ref[i, j]) for i in range(ref.rows) for j in range(ref.cols)) > tol:
                    return False
    return True
# --8<-- [end:numeric]


def p_drop_zero_hides(shapes) -> bool:
    """With Z = 1 and p_drop = 0, P̃ = P, and dS = P̃ ∘ (dP̃ − δ) is the true softmax backward (symbolic)."""
    for N, M, d in shapes:
        S, V, dO = symbol_matrix("s", N, M), symbol_matrix("v", M, d), symbol_matrix("g", N, d)
        P = row_softmax(S)
        Z = sp.ones(N, M)
        O = P * V
        loss = sum(hadamard(dO, O))
        dP = dO * V.T
        dS = hadamard(hadamard(P, Z), dP - broadcast_rows(rowsum(hadamard(dO, O)), M))
        if not all(holds(lambda i=i, j=j: is_zero_with_exps(dS[i, j] - sp.diff(loss, S[i, j])))
                   for i in range(N) for j in range(M)):
            return False
    return True


SYMBOLIC_SHAPES = [(2, 3, 1), (1, 2, 2)]
RATIONAL_SHAPES = [(16, 24, 8), (9, 13, 5)]
NUMERIC_SHAPES = [(4, 6, 3)]


def check() -> CheckResult:
    ledger = Ledger()
    ledger.claim(f"symbolic mask z_ij and drop probability p_drop: dS, dV equal the true gradients; δ identity holds; "
                 f"(N, M, d) {SYMBOLIC_SHAPES}", lambda: symbolic_route(dropout_backward, SYMBOLIC_SHAPES))
    ledger.claim(f"exact rationals, 0/1 masks, p_drop = 1/5: rowsum(P∘dP) = rowsum(dO∘O) {RATIONAL_SHAPES}",
                 lambda: rational_route(dropout_backward, RATIONAL_SHAPES))
    ledger.claim(f"mpmath 40 digits, Bernoulli mask: dS, dV vs central differences {NUMERIC_SHAPES}",
                 lambda: mpmath_route(dropout_backward, NUMERIC_SHAPES))
    ledger.claim("dS = P̃ ∘ (dP̃ − δ) equals the true dS when p_drop = 0 (Z = 1): why running with "
                 "dropout_p = 0 hides it", lambda: p_drop_zero_hides(SYMBOLIC_SHAPES))
    # --8<-- [start:negative]
    def mask_forgotten_in_dv(P, Z, keep, V, dO, O):
        return {**dropout_backward(P, Z, keep, V, dO, O), "dV": P.T * dO}

    def mask_not_applied_to_dp(P, Z, keep, V, dO, O):
        dP = dO * V.T
        D = rowsum(hadamard(dO, O))
        return {**dropout_backward(P, Z, keep, V, dO, O),
                "dS": hadamard(P, dP - broadcast_rows(D, P.cols)), "D_direct": rowsum(hadamard(P, dP))}

    def d_from_undropped_output(P, Z, keep, V, dO, O):
        D = rowsum(hadamard(dO, P * V))
        dP = hadamard(dO * V.T, Z) / keep
        return {**dropout_backward(P, Z, keep, V, dO, O), "D": D,
                "dS": hadamard(P, dP - broadcast_rows(D, P.cols))}

    def ds_from_dropped_p(P, Z, keep, V, dO, O):
        P = hadamard(P, Z) / keep  # P reassigned to the dropped P̃, as seed 003's Appendix B does
        dP = dO * V.T
        D = rowsum(hadamard(dO, O))
        return {**dropout_backward(P, Z, keep, V, dO, O), "dS": hadamard(P, dP - broadcast_rows(D, P.cols))}

    for name, wrong in (("dV = Pᵀ dO", mask_forgotten_in_dv), ("dP = dO Vᵀ", mask_not_applied_to_dp),
                        ("δ from undropped O", d_from_undropped_output),
                        ("dS = P̃ ∘ (dP̃ − δ) (seed 003, App. B)", ds_from_dropped_p)):
        ledger.control(f"{name}: symbolic", lambda: not symbolic_route(wrong, SYMBOLIC_SHAPES[:1]))
        ledger.control(f"{name}: mpmath", lambda: not mpmath_route(wrong, NUMERIC_SHAPES))
    # --8<-- [end:negative]
    sizes = (f"symbolic {', '.join('x'.join(map(str, s)) for s in SYMBOLIC_SHAPES)}; rational "
             f"{', '.join('x'.join(map(str, s)) for s in RATIONAL_SHAPES)}; mpmath "
             f"{', '.join('x'.join(map(str, s)) for s in NUMERIC_SHAPES)}")
    return ledger.result(identity=IDENTITY, method=METHOD, sizes=sizes,
                         negative_control=NEGATIVE, module=__name__)
