# --8<-- [start:statement]
"""The gradient through the LSE. When a caller uses the log-sum-exp LSE_i = log Σ_j e^(S_ij) as well as
O (split-KV merges and ring attention combine partial results by their LSEs), the loss has a gradient
dLSE_i with respect to it, and since

    ∂LSE_i / ∂S_ij = e^(S_ij) / Σ_k e^(S_ik) = P_ij,

the score gradient gains P_ij · dLSE_i:

    dS = P ∘ (dP − δ + dLSE),    δ = rowsum(dO ∘ O),    dLSE broadcast along each row.

So a kernel folds dLSE into δ once per row, δ' = δ − dLSE, and its loops stay as they are:
dS = P ∘ (dP − δ'). dQ = τ dS K and dK = τ dSᵀ Q follow unchanged; dV does not see the LSE.
"""
# --8<-- [end:statement]

from __future__ import annotations

import random

import mpmath
import sympy as sp

from ._common import (broadcast_rows, hadamard, holds, is_zero_with_exps, mp_matrix, mp_numeric_gradient,
                      mp_row_softmax, row_softmax, rowsum, symbol_matrix)
from ._result import CheckResult, Ledger

IDENTITY = "gradient through the LSE: ∂LSE_i/∂S_ij = P_ij, so dS = P∘(dP − δ + dLSE); fold as δ' = δ − dLSE"
METHOD = ("SymPy on explicit symbol matrices (L = ⟨dO, O⟩ + ⟨dLSE, LSE⟩); mpmath central differences; "
          "torch autograd through flashattn.reference.naive_attention in float64")
NEGATIVE = "dLSE ignored; dLSE with the wrong sign; dLSE added without the factor P"


# --8<-- [start:formula]
def ds_with_lse(P, dP, delta, dlse):
    """dS = P ∘ (dP − δ + dLSE), written as the kernel would: δ' = δ − dLSE, then P ∘ (dP − δ')."""
    folded = delta - dlse
    return hadamard(P, dP - broadcast_rows(folded, P.cols))
# --8<-- [end:formula]


# --8<-- [start:proof]
def symbolic_route(formula, shapes) -> bool:
    for N, M, d in shapes:
        S, V, dO = symbol_matrix("s", N, M), symbol_matrix("v", M, d), symbol_matrix("g", N, d)
        dlse = symbol_matrix("h", N, 1)
        P = row_softmax(S)
        O = P * V
        lse = [sp.log(sum(sp.exp(S[i, j]) for j in range(M))) for i in range(N)]
        loss = sum(hadamard(dO, O)) + sum(dlse[i, 0] * lse[i] for i in range(N))
        # ∂LSE_i/∂S_ij = P_ij, entry by entry
        if not all(holds(lambda i=i, j=j: is_zero_with_exps(sp.diff(lse[i], S[i, j]) - P[i, j]))
                   for i in range(N) for j in range(M)):
            return False
        dS = formula(P, dO * V.T, rowsum(hadamard(dO, O)), dlse)
        if not all(holds(lambda i=i, j=j: is_zero_with_exps(dS[i, j] - sp.diff(loss, S[i, j])))
                   for i in range(N) for j in range(M)):
            return False
    return True
# --8<-- [end:proof]


# --8<-- [start:numeric]
def mpmath_route(formula, shapes, seed: int = 31, dps: int = 40) -> bool:
    """dS against 40-digit central differences of L(S) = ⟨dO, softmax(S) V⟩ + ⟨dLSE, LSE(S)⟩."""
    rng = random.Random(seed)
    with mpmath.workdps(dps):
        for N, M, d in shapes:
            S, V, dO = mp_matrix(rng, N, M, scale=3), mp_matrix(rng, M, d), mp_matrix(rng, N, d)
            dlse = mp_matrix(rng, N, 1, scale=2)

            def loss(S_):
                P_ = mp_row_softmax(S_)
                lse = [mpmath.log(mpmath.fsum(mpmath.exp(S_[i, j]) for j in range(M))) for i in range(N)]
                return (mpmath.fsum(a * b for a, b in zip(dO, P_ * V))
                        + mpmath.fsum(dlse[i, 0] * lse[i] for i in range(N)))

            to_sym = lambda A: sp.Matrix(A.rows, A.cols, lambda i, j: sp.Float(A[i, j], dps + 10))
            P, Vs, dOs, h = to_sym(mp_row_softmax(S)), to_sym(V), to_sym(dO), to_sym(dlse)
            got = formula(P, dOs * Vs.T, rowsum(hadamard(dOs, P * Vs)), h)
            ref = mp_numeric_gradient(loss, S)
            tol = mpmath.mpf(10) ** (-(dps // 3))
            if max(abs(mpmath.mpf(got[i, j]) - ref[i, j]) for i in range(N) for j in range(M)) > tol:
                return False
    return True


def autograd_route(formula, seed: int = 0) -> bool:
    """dQ, dK, dV of L = ⟨dO, O⟩ + ⟨dLSE, LSE⟩ through the package's naive reference (float64 autograd),
    against dS from `formula` pushed through dQ = τ dS K, dK = τ dSᵀ Q, dV = Pᵀ dO. Causal N > M, so
    rows with no key (LSE = −∞) are in the test too: they must get zero gradients."""
    import torch

    from flashattn.reference import naive_attention

    gen = torch.Generator().manual_seed(seed)
    n, m, d = 7, 5, 3
    q, k, v = (torch.randn(1, 1, r, d, generator=gen, dtype=torch.float64, requires_grad=True) for r in (n, m, m))
    do = torch.randn(1, 1, n, d, generator=gen, dtype=torch.float64)
    dlse = torch.randn(1, 1, n, generator=gen, dtype=torch.float64)
    o, lse = naive_attention(q, k, v, causal=True)
    visible = torch.isfinite(lse)
    ((o * do).sum() + (torch.where(visible, lse, 0.0) * dlse).sum()).backward()
    tau = d ** -0.5
    with torch.no_grad():
        s = tau * q[0, 0] @ k[0, 0].T
        mask = torch.arange(m)[None, :] <= torch.arange(n)[:, None] + (m - n)
        p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1).nan_to_num(0.0)
        h = torch.where(visible[0, 0], dlse[0, 0], 0.0)
        to = lambda t: sp.Matrix(t.tolist())
        ds = formula(to(p), to(do[0, 0] @ v[0, 0].T), to((do[0, 0] * o[0, 0]).sum(-1, keepdim=True)), to(h[:, None]))
        ds = torch.tensor([[float(x) for x in row] for row in ds.tolist()], dtype=torch.float64)
        want = (tau * ds @ k[0, 0], tau * ds.T @ q[0, 0], p.T @ do[0, 0])
    got = (q.grad[0, 0], k.grad[0, 0], v.grad[0, 0])
    return all(torch.allclose(g, w, atol=1e-12, rtol=1e-10) for g, w in zip(got, want))
# --8<-- [end:numeric]


SYMBOLIC_SHAPES = [(2, 3, 1), (1, 3, 2)]
NUMERIC_SHAPES = [(4, 6, 3)]


def check() -> CheckResult:
    ledger = Ledger()
    ledger.claim(f"symbolic: ∂LSE_i/∂S_ij = P_ij and dS = P∘(dP − δ + dLSE) equals ∂L/∂S, (N, M, d) {SYMBOLIC_SHAPES}",
                 lambda: symbolic_route(ds_with_lse, SYMBOLIC_SHAPES))
    ledger.claim(f"mpmath 40 digits: dS vs central differences {NUMERIC_SHAPES}",
                 lambda: mpmath_route(ds_with_lse, NUMERIC_SHAPES))
    ledger.claim("torch autograd through naive_attention (float64, causal 7×5 with empty rows): dQ, dK, dV "
                 "match the folded δ' = δ − dLSE", lambda: autograd_route(ds_with_lse))
    # --8<-- [start:negative]
    ignored = lambda P, dP, delta, dlse: hadamard(P, dP - broadcast_rows(delta, P.cols))
    wrong_sign = lambda P, dP, delta, dlse: hadamard(P, dP - broadcast_rows(delta + dlse, P.cols))
    without_p = lambda P, dP, delta, dlse: (hadamard(P, dP - broadcast_rows(delta, P.cols))
                                            + broadcast_rows(dlse, P.cols))
    for name, wrong in (("dLSE ignored", ignored), ("δ' = δ + dLSE (sign)", wrong_sign),
                        ("dS + dLSE without P", without_p)):
        ledger.control(f"{name}: symbolic", lambda: not symbolic_route(wrong, SYMBOLIC_SHAPES[:1]))
        ledger.control(f"{name}: autograd", lambda: not autograd_route(wrong))
    # --8<-- [end:negative]
    sizes = (f"symbolic {', '.join('x'.join(map(str, s)) for s in SYMBOLIC_SHAPES)}; mpmath "
             f"{', '.join('x'.join(map(str, s)) for s in NUMERIC_SHAPES)}; autograd 7x5x3 causal")
    return ledger.result(identity=IDENTITY, method=METHOD, sizes=sizes,
                         negative_control=NEGATIVE, module=__name__)
