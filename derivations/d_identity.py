# --8<-- [start:statement]
"""The δ identity (D in the FlashAttention papers, `delta` in the code): with O = P V and dP = dO Vᵀ,

    δ_i = Σ_j P_ij dP_ij = Σ_k dO_ik O_ik,   i.e.  rowsum(P ∘ dP) = rowsum(dO ∘ O).

Proof: Σ_j P_ij Σ_k dO_ik V_jk = Σ_k dO_ik Σ_j P_ij V_jk = Σ_k dO_ik O_ik (swap the two finite sums).
It holds for any P, not only a softmax. Why it matters: the left side needs the full N × M matrix
dP (N·M·d multiply-adds to form it, then N·M more); the right side needs only the N × d outputs the
forward pass already wrote (N·d multiply-adds). The backward kernel computes δ once per row before
its main loop and never holds a full row of dP.
"""
# --8<-- [end:statement]

from __future__ import annotations

import random

import sympy as sp

from ._common import flatten_sum, hadamard, holds, rational_matrix, rowsum, symbol_matrix
from ._result import CheckResult, Ledger

IDENTITY = "δ identity: rowsum(P∘dP) = rowsum(dO∘O) for O = PV, dP = dO Vᵀ"
METHOD = "sum exchange with symbolic sizes; explicit symbol matrices; exact rationals"
NEGATIVE = "δ = rowsum(O); δ = rowsum(dP)"


# --8<-- [start:formula]
def delta(dO, O):
    """δ from the N × d tensors only."""
    return rowsum(hadamard(dO, O))
# --8<-- [end:formula]


# --8<-- [start:proof]
def sum_exchange_route() -> bool:
    """Symbolic sizes M, d: pulling each factor into the inner sum turns both sides into one
    double sum over (j, k); finite double sums do not depend on the order of summation."""
    j, k = sp.symbols("j k", integer=True)
    M, d = sp.symbols("M d", integer=True, positive=True)
    P, V, g = sp.IndexedBase("P"), sp.IndexedBase("V"), sp.IndexedBase("dO")
    lhs = sp.Sum(P[j] * sp.Sum(g[k] * V[j, k], (k, 0, d - 1)), (j, 0, M - 1))  # Σ_j P_j dP_j
    rhs = sp.Sum(g[k] * sp.Sum(P[j] * V[j, k], (j, 0, M - 1)), (k, 0, d - 1))  # Σ_k dO_k O_k
    (f_lhs, lim_lhs), (f_rhs, lim_rhs) = flatten_sum(lhs), flatten_sum(rhs)
    return (sp.expand(f_lhs - f_rhs) == 0
            and sorted(lim_lhs, key=sp.default_sort_key) == sorted(lim_rhs, key=sp.default_sort_key))


def explicit_route(delta_formula, shapes) -> bool:
    """Explicit symbol matrices P (N×M, any entries), V (M×d), dO (N×d); the candidate
    delta_formula(P, V, dO) must equal rowsum(P∘dP) entry by entry."""
    for N, M, d in shapes:
        P, V, dO = symbol_matrix("p", N, M), symbol_matrix("v", M, d), symbol_matrix("g", N, d)
        dP = dO * V.T
        lhs = rowsum(hadamard(P, dP))
        if not holds(lambda: (lhs - delta_formula(P, V, dO)).expand() == sp.zeros(N, 1)):
            return False
    return True
# --8<-- [end:proof]


# --8<-- [start:numeric]
def rational_route(delta_formula, shapes, seed: int = 11) -> bool:
    rng = random.Random(seed)
    for N, M, d in shapes:
        P = sp.Matrix(rational_matrix(rng, N, M))
        V, dO = sp.Matrix(rational_matrix(rng, M, d)), sp.Matrix(rational_matrix(rng, N, d))
        dP = dO * V.T
        if not holds(lambda: rowsum(hadamard(P, dP)) == delta_formula(P, V, dO)):
            return False
    return True


def multiply_adds(N: int, M: int, d: int) -> tuple[int, int]:
    """(rowsum(P∘dP) including forming dP, rowsum(dO∘O)): the reduction the identity saves."""
    return N * M * d + N * M, N * d
# --8<-- [end:numeric]


SYMBOLIC_SHAPES = [(2, 3, 2), (3, 2, 4)]
RATIONAL_SHAPES = [(16, 24, 8), (32, 16, 16)]


def via_outputs(P, V, dO):
    """The kernel's route: δ from O = PV (already written by the forward pass) and dO."""
    return delta(dO, P * V)


def check() -> CheckResult:
    ledger = Ledger()
    ledger.claim("both sides are one double sum over (j, k) (symbolic M, d)", lambda: sum_exchange_route())
    ledger.claim(f"explicit symbol matrices (N, M, d) {SYMBOLIC_SHAPES}", lambda: explicit_route(via_outputs, SYMBOLIC_SHAPES))
    ledger.claim(f"exact rationals (N, M, d) {RATIONAL_SHAPES}", lambda: rational_route(via_outputs, RATIONAL_SHAPES))
    big, small = multiply_adds(4096, 4096, 128)
    ledger.claim(f"N = M = 4096, d = 128: {big:,} multiply-adds via dP vs {small:,} via dO∘O "
                 f"({big // small}x)", big > 1000 * small)
    # --8<-- [start:negative]
    rowsum_o = lambda P, V, dO: rowsum(P * V)
    rowsum_dp = lambda P, V, dO: rowsum(dO * V.T)
    for name, wrong in [("δ = rowsum(O)", rowsum_o), ("δ = rowsum(dP)", rowsum_dp)]:
        ledger.control(f"{name} fails explicit symbols", lambda: not explicit_route(wrong, SYMBOLIC_SHAPES))
        ledger.control(f"{name} fails exact rationals", lambda: not rational_route(wrong, RATIONAL_SHAPES))
    # --8<-- [end:negative]
    sizes = (f"symbolic M, d; explicit {', '.join('x'.join(map(str, s)) for s in SYMBOLIC_SHAPES)}; "
             f"rational {', '.join('x'.join(map(str, s)) for s in RATIONAL_SHAPES)}")
    return ledger.result(identity=IDENTITY, method=METHOD, sizes=sizes,
                         negative_control=NEGATIVE, module=__name__)
