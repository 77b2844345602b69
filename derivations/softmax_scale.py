# --8<-- [start:statement]
"""Where the softmax scale goes. With S = τ Q Kᵀ (τ = 1/√d by default), P = softmax(S), O = P V and
dS = P ∘ (dP − δ) the gradient with respect to S:

    dQ = τ dS K,      dK = τ dSᵀ Q,      dV = Pᵀ dO.

The scale multiplies the product QKᵀ, so by the matmul rule it comes back exactly once in each of
the two gradients that flow through that product, and not at all in dV. Forgetting it, or applying
it a second time (once folded into K and once more at the end), gives gradients off by τ.
"""
# --8<-- [end:statement]

from __future__ import annotations

import random

import mpmath
import sympy as sp

from ._common import (broadcast_rows, hadamard, holds, is_zero_with_exps, mp_matrix,
                     mp_numeric_gradient, mp_row_softmax, rowsum, symbol_matrix)
from ._result import CheckResult, Ledger

IDENTITY = "softmax scale: S = τQKᵀ ⇒ dQ = τ dS K, dK = τ dSᵀ Q"
METHOD = ("Trace(...).diff on MatrixSymbols (symbolic sizes); SymPy through the softmax on explicit "
          "symbols; mpmath central differences")
NEGATIVE = "dQ = dS K, dK = dSᵀ Q (scale forgotten); τ² (scale applied twice)"


# --8<-- [start:formula]
def scaled_grads(dS, Q, K, scale):
    """(dQ, dK) from the gradient dS with respect to S = τ Q Kᵀ."""
    return scale * dS * K, scale * dS.T * Q
# --8<-- [end:formula]


# --8<-- [start:proof]
def trace_route(grads) -> bool:
    """Symbolic sizes N, M, d: with G = dS fixed, L is locally tr(Gᵀ τ Q Kᵀ)."""
    N, M, d = sp.symbols("N M d", integer=True, positive=True)
    tau = sp.Symbol("tau", positive=True)
    Q, K, G = sp.MatrixSymbol("Q", N, d), sp.MatrixSymbol("K", M, d), sp.MatrixSymbol("G", N, M)
    loss = sp.Trace(G.T * (tau * Q * K.T))
    dQ, dK = grads(G, Q, K, tau)
    same = lambda a, b: sp.simplify(a - b).is_ZeroMatrix or a == b
    return holds(lambda: same(loss.diff(Q), dQ) and same(loss.diff(K), dK))


def through_softmax_route(grads, shapes) -> bool:
    """Explicit symbols, the whole chain: L = ⟨dO, softmax(τQKᵀ) V⟩ differentiated by SymPy."""
    tau = sp.Symbol("tau", positive=True)
    for N, M, d in shapes:
        Q, K, V, dO = (symbol_matrix(nm, r, d) for nm, r in (("q", N), ("k", M), ("v", M), ("g", N)))
        S = tau * Q * K.T
        P = sp.Matrix(N, M, lambda i, j: sp.exp(S[i, j]) / sum(sp.exp(S[i, t]) for t in range(M)))
        loss = sum(hadamard(dO, P * V))
        dP = dO * V.T
        dS = hadamard(P, dP - broadcast_rows(rowsum(hadamard(P, dP)), M))
        dQ, dK = grads(dS, Q, K, tau)
        for got, X in ((dQ, Q), (dK, K)):
            if not all(is_zero_with_exps(got[i, j] - sp.diff(loss, X[i, j]))
                       for i in range(X.rows) for j in range(X.cols)):
                return False
    return True
# --8<-- [end:proof]


# --8<-- [start:numeric]
def numeric_route(grads, shapes, seed: int = 17, dps: int = 40) -> bool:
    rng = random.Random(seed)
    with mpmath.workdps(dps):
        for N, M, d in shapes:
            tau = 1 / mpmath.sqrt(d)
            Q, K, V, dO = (mp_matrix(rng, r, d, scale=3) for r in (N, M, M, N))

            def loss(Q_=Q, K_=K):
                return mpmath.fsum(a * b for a, b in zip(dO, mp_row_softmax(tau * Q_ * K_.T) * V))

            P = mp_row_softmax(tau * Q * K.T)
            dP = dO * V.T
            dS = mpmath.matrix(N, M)
            for i in range(N):
                delta = mpmath.fsum(P[i, j] * dP[i, j] for j in range(M))
                for j in range(M):
                    dS[i, j] = P[i, j] * (dP[i, j] - delta)
            dQ, dK = grads(dS, Q, K, tau)
            tol = mpmath.mpf(10) ** (-(dps // 3))
            for got, ref in ((dQ, mp_numeric_gradient(lambda X: loss(Q_=X), Q)),
                             (dK, mp_numeric_gradient(lambda X: loss(K_=X), K))):
                if max(abs(got[i, j] - ref[i, j]) for i in range(ref.rows) for j in range(ref.cols)) > tol:
                    return False
    return True
# --8<-- [end:numeric]


SYMBOLIC_SHAPES = [(2, 2, 1), (1, 3, 2)]
NUMERIC_SHAPES = [(6, 5, 4), (3, 9, 8)]


def check() -> CheckResult:
    ledger = Ledger()
    ledger.claim("Trace(Gᵀ τQKᵀ).diff(Q) = τ G K, .diff(K) = τ Gᵀ Q (symbolic N, M, d)",
                 lambda: trace_route(scaled_grads))
    ledger.claim(f"through the softmax, explicit symbols (N, M, d) {SYMBOLIC_SHAPES}",
                 lambda: through_softmax_route(scaled_grads, SYMBOLIC_SHAPES))
    ledger.claim(f"mpmath 40 digits vs central differences (N, M, d) {NUMERIC_SHAPES}",
                 lambda: numeric_route(scaled_grads, NUMERIC_SHAPES))
    # --8<-- [start:negative]
    forgotten = lambda dS, Q, K, scale: (dS * K, dS.T * Q)
    twice = lambda dS, Q, K, scale: (scale ** 2 * dS * K, scale ** 2 * dS.T * Q)
    for name, wrong in (("scale forgotten", forgotten), ("scale applied twice", twice)):
        ledger.control(f"{name}: trace route", lambda: not trace_route(wrong))
        ledger.control(f"{name}: through the softmax", lambda: not through_softmax_route(wrong, SYMBOLIC_SHAPES[:1]))
        ledger.control(f"{name}: numeric", lambda: not numeric_route(wrong, NUMERIC_SHAPES[:1]))
    # --8<-- [end:negative]
    sizes = (f"symbolic N, M, d; explicit {', '.join('x'.join(map(str, s)) for s in SYMBOLIC_SHAPES)}; "
             f"mpmath {', '.join('x'.join(map(str, s)) for s in NUMERIC_SHAPES)}")
    return ledger.result(identity=IDENTITY, method=METHOD, sizes=sizes,
                         negative_control=NEGATIVE, module=__name__)
