# --8<-- [start:statement]
"""Base 2 and the log-sum-exp. The hardware exponential is exp2 (`exp` costs one more multiply), so
the kernels work in base 2. With raw dot products X = QKᵀ, scores S = τX and c = τ · log2 e:

    e^x = 2^(x · log2 e),    S₂ = c X = S · log2 e,    LSE₂ = log2 Σ_j 2^(S₂_ij) = LSE · log2 e,

with LSE = ln Σ_j e^(S_ij). The forward pass stores one number per row, and the backward pass
recomputes P_ij = 2^(S₂_ij − LSE₂_i), which equals softmax(S)_ij exactly. Pre-scaling K once by c
(K' = c K) makes QK'ᵀ = S₂ directly. The backward pass is unchanged up to two corrections: with
dS = P ∘ (dP − δ) the gradient with respect to S,

    dQ = τ dS K = ln 2 · dS K'    (because τ K = ln 2 · K'),      dK = τ dSᵀ Q,

so dQ picks up ln 2 and dK the scale; dV = Pᵀ dO is untouched. The stored LSE is converted back with
LSE = LSE₂ · ln 2 for callers who want the natural log.
"""
# --8<-- [end:statement]

from __future__ import annotations

import random
from types import SimpleNamespace

import mpmath
import sympy as sp

from ._common import (broadcast_rows, hadamard, is_zero_with_exps, mp_matrix, mp_numeric_gradient,
                     mp_row_softmax, rowsum, symbol_matrix)
from ._result import CheckResult, Ledger

IDENTITY = ("base 2 and the LSE: e^x = 2^(x log2 e); LSE₂ = LSE·log2 e; P = 2^(s·c − LSE₂); K' = cK, dQ"
            " ·ln 2, dK ·τ")
METHOD = ("SymPy on explicit symbol matrices (true gradients by differentiation); mpmath 40-digit "
          "central differences")
NEGATIVE = ("dQ = dS K' (ln 2 dropped); dK = c dSᵀQ (log2 e kept); P = 2^(s·c − LSE) (natural LSE in a "
            "base-2 exponent)")

SYMBOLIC = SimpleNamespace(exp2=lambda x: sp.Integer(2) ** x, log2=lambda x: sp.log(x, 2),
                           LN2=sp.log(2), LOG2E=1 / sp.log(2))


def _numeric_ops(dps: int):
    with mpmath.workdps(dps + 10):
        ln2 = sp.Float(mpmath.log(2), dps + 10)
    return SimpleNamespace(exp2=lambda x: sp.Float(2, dps + 10) ** x, log2=lambda x: sp.log(x) / ln2,
                           LN2=ln2, LOG2E=1 / ln2)


# --8<-- [start:formula]
def lse_base2(S2: sp.Matrix, ops) -> list:
    """Row-wise log2 Σ 2^(S2): the one number per row the forward pass stores."""
    return [ops.log2(sum(ops.exp2(x) for x in S2.row(i))) for i in range(S2.rows)]


def recompute_p(S2: sp.Matrix, lse2: list, ops) -> sp.Matrix:
    return sp.Matrix(S2.rows, S2.cols, lambda i, j: ops.exp2(S2[i, j] - lse2[i]))


def dq_from_prescaled(dS, K2, scale, ops):
    return ops.LN2 * dS * K2  # τ K = ln 2 · K'


def dk_from(dS, Q, scale, ops):
    return scale * dS.T * Q  # Q was not pre-scaled, so only τ


def kernel_gradients(Q, K, V, dO, scale, ops, *, lse=lse_base2, recompute=recompute_p,
                     dq=dq_from_prescaled, dk=dk_from):
    """The base-2 forward quantities and backward gradients, computed the way the kernels do."""
    K2 = K * (scale * ops.LOG2E)  # pre-scaled keys: QK'ᵀ is the base-2 exponent
    S2 = Q * K2.T
    lse2 = lse(S2, ops)
    P = recompute(S2, lse2, ops)
    O = P * V
    dP = dO * V.T
    delta = rowsum(hadamard(dO, O))
    dS = hadamard(P, dP - broadcast_rows(delta, P.cols))
    return dict(P=P, lse2=lse2, O=O, dQ=dq(dS, K2, scale, ops), dK=dk(dS, Q, scale, ops), dV=P.T * dO)
# --8<-- [end:formula]


def _to_exp(expr):
    """2^x → e^(x ln 2) so that every power is an exponential."""
    return sp.sympify(expr).replace(lambda t: t.is_Pow and t.base == 2, lambda t: sp.exp(t.exp * sp.log(2)))


def _same_log(a, b) -> bool:
    """a = b for two logarithms: compare the arguments through is_zero_with_exps when both are logs."""
    a, b = sp.expand_log(sp.expand(a), force=True), sp.expand_log(sp.expand(b), force=True)
    if isinstance(a, sp.log) and isinstance(b, sp.log):
        return is_zero_with_exps(a.args[0] - b.args[0])
    return sp.simplify(a - b) == 0


# --8<-- [start:proof]
def scalar_identities() -> bool:
    x = sp.Symbol("x", real=True)
    tau = sp.Symbol("tau", positive=True)
    s = sp.symbols("s0:4", real=True)
    lse = sp.log(sum(sp.exp(tau * v) for v in s))
    lse2 = sp.log(sum(sp.Integer(2) ** (tau * v / sp.log(2)) for v in s), 2)
    return (is_zero_with_exps(_to_exp(2 ** (x / sp.log(2))) - sp.exp(x))            # e^x = 2^(x log2 e)
            and sp.simplify(_to_exp(lse2) - lse / sp.log(2)) == 0)                 # LSE₂ = LSE log2 e


def symbolic_route(shapes, **parts) -> bool:
    """Explicit symbols; the true gradients come from differentiating L = ⟨dO, softmax(τQKᵀ)V⟩."""
    tau = sp.Symbol("tau", positive=True)
    for N, M, d in shapes:
        Q, K, V, dO = (symbol_matrix(nm, r, d) for nm, r in (("q", N), ("k", M), ("v", M), ("g", N)))
        S = tau * Q * K.T
        P_true = sp.Matrix(N, M, lambda i, j: sp.exp(S[i, j]) / sum(sp.exp(S[i, t]) for t in range(M)))
        lse_true = [sp.log(sum(sp.exp(S[i, t]) for t in range(M))) for i in range(N)]
        loss = sum(hadamard(dO, P_true * V))
        got = kernel_gradients(Q, K, V, dO, tau, SYMBOLIC, **parts)
        checks = [lambda i=i, j=j: is_zero_with_exps(_to_exp(got["P"][i, j]) - P_true[i, j])
                  for i in range(N) for j in range(M)]
        checks += [lambda i=i: _same_log(_to_exp(got["lse2"][i]) * sp.log(2), lse_true[i])
                   for i in range(N)]
        for name, X in (("dQ", Q), ("dK", K), ("dV", V)):
            checks += [lambda name=name, X=X, i=i, j=j: is_zero_with_exps(
                _to_exp(got[name][i, j]) - sp.diff(loss, X[i, j]))
                for i in range(X.rows) for j in range(X.cols)]
        if not all(test() for test in checks):  # stops at the first entry that disagrees
            return False
    return True
# --8<-- [end:proof]


# --8<-- [start:numeric]
def numeric_route(shapes, seed: int = 13, dps: int = 40, **parts) -> bool:
    """Larger sizes in 40-digit arithmetic: the kernel-style gradients against central differences of
    the natural-base loss (which knows nothing about base 2 or pre-scaling)."""
    rng = random.Random(seed)
    ops = _numeric_ops(dps)
    with mpmath.workdps(dps):
        tol = mpmath.mpf(10) ** (-(dps // 3))
        for N, M, d in shapes:
            tau = mpmath.mpf(1) / mpmath.sqrt(d)
            Q, K, V, dO = (mp_matrix(rng, r, d, scale=3) for r in (N, M, M, N))

            def loss(Q_=Q, K_=K, V_=V):
                P = mp_row_softmax(tau * Q_ * K_.T)
                return mpmath.fsum(a * b for a, b in zip(dO, P * V_))

            reference = dict(dQ=mp_numeric_gradient(lambda X: loss(Q_=X), Q),
                             dK=mp_numeric_gradient(lambda X: loss(K_=X), K),
                             dV=mp_numeric_gradient(lambda X: loss(V_=X), V))
            to_sym = lambda A: sp.Matrix(A.rows, A.cols, lambda i, j: sp.Float(A[i, j], dps + 10))
            got = kernel_gradients(*(to_sym(A) for A in (Q, K, V, dO)), sp.Float(tau, dps + 10), ops, **parts)
            for name, ref in reference.items():
                err = max(abs(mpmath.mpf(got[name][i, j]) - ref[i, j]) for i in range(ref.rows) for j in range(ref.cols))
                if not err < tol:
                    return False
    return True
# --8<-- [end:numeric]


SYMBOLIC_SHAPES = [(2, 2, 1), (1, 3, 2)]
NUMERIC_SHAPES = [(5, 7, 3), (4, 6, 8)]


def check() -> CheckResult:
    ledger = Ledger()
    ledger.claim("e^x = 2^(x log2 e) and LSE₂ = LSE · log2 e (symbolic)", scalar_identities)
    ledger.claim(f"P = 2^(QK'ᵀ − LSE₂), LSE₂ ln 2 = LSE, dQ = ln2·dS K', dK = τ dSᵀQ, dV = PᵀdO equal the "
                 f"true gradients; symbol matrices (N, M, d) {SYMBOLIC_SHAPES}", lambda: symbolic_route(SYMBOLIC_SHAPES))
    ledger.claim(f"the same against 40-digit central differences, (N, M, d) {NUMERIC_SHAPES}",
                 lambda: numeric_route(NUMERIC_SHAPES))
    # --8<-- [start:negative]
    wrong = {
        "dQ = dS K' (ln 2 dropped)": dict(dq=lambda dS, K2, scale, ops: dS * K2),
        "dK = τ log2e dSᵀ Q": dict(dk=lambda dS, Q, scale, ops: scale * ops.LOG2E * dS.T * Q),
        "P = 2^(QK'ᵀ − LSE) (natural LSE)": dict(lse=lambda S2, ops: [v * ops.LN2 for v in lse_base2(S2, ops)]),
    }
    for name, parts in wrong.items():
        ledger.control(f"{name}: symbolic", lambda: not symbolic_route(SYMBOLIC_SHAPES[:1], **parts))
        ledger.control(f"{name}: numeric", lambda: not numeric_route([(3, 4, 2)], **parts))
    # --8<-- [end:negative]
    sizes = (f"symbolic {', '.join('x'.join(map(str, s)) for s in SYMBOLIC_SHAPES)}; "
             f"mpmath {', '.join('x'.join(map(str, s)) for s in NUMERIC_SHAPES)}")
    return ledger.result(identity=IDENTITY, method=METHOD, sizes=sizes,
                         negative_control=NEGATIVE, module=__name__)
