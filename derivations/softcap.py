# --8<-- [start:statement]
"""The softcap backward: the chain rule through tanh. With a cap κ > 0 (the `softcap` argument, Gemma 2's logit
soft-capping; `c` in the code below) the scores S = τ Q Kᵀ are squashed entry by entry before the softmax (and before any ALiBi bias B,
which is a constant here):

    t = tanh(S / κ),    T = κ · t + B,    P = softmax_row(T),    O = P V.

The softmax backward is the usual one, at the capped scores: dT = P ∘ (dP − δ) with dP = dO Vᵀ and
δ = rowsum(dO ∘ O) (T is what the softmax saw, so the δ identity holds for it unchanged). Each T_ij
depends on S_ij alone, with dT_ij/dS_ij = 1 − t_ij², so

    dS = dT ∘ (1 − t²) = P ∘ (dP − δ) ∘ (1 − t²),    dQ = τ dS K,    dK = τ dSᵀ Q,    dV = Pᵀ dO.

t is recomputed from the raw score S in the backward, not from the capped one: tanh'(T/κ) would
differentiate a second application of the cap. As κ → ∞, κ · tanh(S/κ) → S and 1 − t² → 1: the
plain attention and its backward are the limit. For huge logits t → ±1 and 1 − t² → 0, with
nothing to overflow: |T − B| ≤ κ whatever the logits, and the factor 1 − t² lies in [0, 1].
"""
# --8<-- [end:statement]

from __future__ import annotations

import random

import sympy as sp

from ._common import broadcast_rows, hadamard, holds, is_zero_with_exps, rowsum, symbol_matrix
from ._result import CheckResult, Ledger

IDENTITY = "softcap: T = κ·tanh(S/κ) (+ bias); dS = P∘(dP − δ)∘(1 − t²), t = tanh(S/κ); δ = rowsum(dO∘O); κ → ∞ gives plain attention"
METHOD = ("SymPy on explicit symbol matrices with a symbolic cap κ and bias B (tanh and exp replaced by fresh "
          "symbols, exact rational zero test); SymPy limits κ → ∞; float64 torch central differences of a "
          "hand-written softcap attention (causal, N ≠ M, empty rows, GQA, huge logits)")
NEGATIVE = ("the factor (1 − t²) forgotten; tanh' taken at the capped score, 1 − tanh²(T/κ); "
            "the factor as 1 − t instead of 1 − t²; δ from the uncapped softmax")


# --8<-- [start:formula]
def softcap_backward(S, c, P, dP, delta, tanh=sp.tanh):
    """dS from the raw scores S: the softmax backward at the capped scores, times tanh' at S/c.

    P = softmax(c·tanh(S/c) + B) is what the forward used, dP = dO Vᵀ, δ = rowsum(dO ∘ O). `tanh` is
    the elementwise tanh of the matrix library (SymPy's or torch's)."""
    t = S.applyfunc(lambda s: tanh(s / c)) if hasattr(S, "applyfunc") else tanh(S / c)  # recomputed from S
    d_capped = _hadamard(P, dP - _broadcast(delta, P))  # dT: the softmax backward, at the capped scores
    return _hadamard(d_capped, _one_minus(_square(t)))  # chain rule: dT/dS = 1 − tanh²(S/c)
# --8<-- [end:formula]


def _hadamard(A, B):
    return hadamard(A, B) if hasattr(A, "multiply_elementwise") else A * B


def _square(A):
    return hadamard(A, A) if hasattr(A, "multiply_elementwise") else A * A


def _one_minus(A):
    return A.applyfunc(lambda a: 1 - a) if hasattr(A, "applyfunc") else 1 - A


def _broadcast(col, like):
    return broadcast_rows(col, like.cols) if hasattr(like, "multiply_elementwise") else col


# --8<-- [start:proof]
def _as_rational(expr, t_symbols):
    """tanh(S_ij/c) → the fresh symbol t_ij, so exp(c·t_ij + B_ij) becomes a fresh positive symbol in
    the zero test; anything that is not tanh(S_ij/c) (a tanh of the capped score, say) stays a tanh and
    counts as an independent quantity, which is exactly right for an identity in S."""
    return expr.xreplace(t_symbols)


def symbolic_route(backward, shapes) -> bool:
    """L = ⟨dO, softmax(c·tanh(S/c) + B) V⟩ with every entry of S, B, V, dO and c a symbol; ∂L/∂S_ij by
    SymPy, entry by entry, against the formula."""
    c = sp.Symbol("c", positive=True)
    for N, M, d in shapes:
        S, B = symbol_matrix("s", N, M), symbol_matrix("b", N, M)
        V, dO = symbol_matrix("v", M, d), symbol_matrix("g", N, d)
        T = S.applyfunc(lambda s: c * sp.tanh(s / c)) + B
        P = sp.zeros(N, M)
        for i in range(N):
            denom = sum(sp.exp(T[i, k]) for k in range(M))
            for j in range(M):
                P[i, j] = sp.exp(T[i, j]) / denom
        O = P * V
        loss = sum(hadamard(dO, O))
        dS = backward(S, c, P, dO * V.T, rowsum(hadamard(dO, O)))
        t_symbols = {sp.tanh(S[i, j] / c): sp.Symbol(f"t_{i}_{j}", real=True)
                     for i in range(N) for j in range(M)}
        tests = [lambda i=i, j=j: is_zero_with_exps(_as_rational(dS[i, j] - sp.diff(loss, S[i, j]), t_symbols))
                 for i in range(N) for j in range(M)]
        if not all(holds(t) for t in tests):
            return False
    return True


def limit_route() -> bool:
    """c → ∞: the cap is the identity map and its derivative is 1, to second order in 1/c."""
    c, s = sp.Symbol("c", positive=True), sp.Symbol("s", real=True)
    capped = c * sp.tanh(s / c)
    slope = sp.diff(capped, s)
    return (sp.limit(capped, c, sp.oo) == s
            and sp.limit(slope, c, sp.oo) == 1
            and sp.simplify(slope - (1 - sp.tanh(s / c) ** 2)) == 0
            and sp.simplify(sp.series(capped, c, sp.oo, 4).removeO() - (s - s**3 / (3 * c**2))) == 0)
# --8<-- [end:proof]


# --8<-- [start:numeric]
def softcap_attention(q, k, v, cap, causal, bias=None):
    """Attention with the cap written out by hand (float64 torch; no flashattn API): q (B, Hq, N, d),
    k and v (B, Hkv, M, d), bottom-right causal, rows with no visible key give o = 0."""
    import torch

    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    n, m, d = q.shape[2], k.shape[2], q.shape[3]
    s = d ** -0.5 * q @ k.transpose(-1, -2)
    capped = cap * torch.tanh(s / cap) + (0 if bias is None else bias)
    if causal:
        hidden = torch.arange(m)[None, :] > torch.arange(n)[:, None] + (m - n)
        capped = capped.masked_fill(hidden, float("-inf"))
    p = torch.softmax(capped, dim=-1).nan_to_num(0.0)  # an empty row is all -inf: 0/0 → o = 0
    return p @ v, s, p


def torch_route(backward, seed: int = 0, h: float = 1e-6) -> bool:
    """dQ and dK from the formula (dS pushed through τ dS K, τ dSᵀ Q, summed over a GQA group) against
    central differences of L = ⟨dO, O⟩ in float64; dV = Pᵀ dO. Three cases: causal N > M with empty
    rows and a bias; N < M with GQA; huge logits (|S| up to ~10³ against c = 5)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    cases = [  # (B, Hq, Hkv, N, M, d, cap, causal, logit scale, bias)
        (1, 2, 2, 7, 5, 3, 2.0, True, 3.0, True),
        (1, 4, 2, 3, 6, 5, 1.5, False, 2.0, False),
        (1, 1, 1, 4, 4, 2, 5.0, True, 400.0, False),
    ]
    for b, hq, hkv, n, m, d, cap, causal, scale, with_bias in cases:
        q = torch.randn(b, hq, n, d, generator=gen, dtype=torch.float64) * scale ** 0.5
        k = torch.randn(b, hkv, m, d, generator=gen, dtype=torch.float64) * scale ** 0.5
        v = torch.randn(b, hkv, m, d, generator=gen, dtype=torch.float64)
        do = torch.randn(b, hq, n, d, generator=gen, dtype=torch.float64)
        bias = torch.randn(b, hq, n, m, generator=gen, dtype=torch.float64) if with_bias else None
        loss = lambda q_, k_: (softcap_attention(q_, k_, v, cap, causal, bias)[0] * do).sum()
        fd = []
        for x, which in ((q, 0), (k, 1)):
            g = torch.zeros_like(x)
            for idx in range(x.numel()):
                xp, xm = x.clone(), x.clone()
                xp.view(-1)[idx] += h
                xm.view(-1)[idx] -= h
                args_p = (xp, k) if which == 0 else (q, xp)
                args_m = (xm, k) if which == 0 else (q, xm)
                g.view(-1)[idx] = (loss(*args_p) - loss(*args_m)) / (2 * h)
            fd.append(g)
        o, s, p = softcap_attention(q, k, v, cap, causal, bias)
        group = hq // hkv
        kk = k.repeat_interleave(group, 1)
        dp = do @ v.repeat_interleave(group, 1).transpose(-1, -2)
        delta = (do * o).sum(-1, keepdim=True)
        ds = backward(s, cap, p, dp, delta, tanh=torch.tanh)
        if not torch.isfinite(ds).all():
            return False  # NaN never passes
        tau = d ** -0.5
        dq = tau * ds @ kk
        dk = (tau * ds.transpose(-1, -2) @ q).reshape(b, hkv, group, m, d).sum(2)
        for got, want in ((dq, fd[0]), (dk, fd[1])):
            if not torch.allclose(got, want, atol=1e-7, rtol=1e-6):
                return False
    return True


def large_cap_route(seed: int = 1) -> bool:
    """c = 10⁸: the capped attention and its dS equal the plain ones to float64 round-off."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(1, 1, r, 4, generator=gen, dtype=torch.float64) for r in (5, 6, 6, 5))
    o_cap, s, p_cap = softcap_attention(q, k, v, 1e8, True)
    hidden = torch.arange(6)[None, :] > torch.arange(5)[:, None] + 1
    p_plain = torch.softmax(s.masked_fill(hidden, float("-inf")), dim=-1)
    o_plain = p_plain @ v
    dp = do @ v.transpose(-1, -2)
    ds_cap = softcap_backward(s, 1e8, p_cap, dp, (do * o_cap).sum(-1, keepdim=True), tanh=torch.tanh)
    ds_plain = p_plain * (dp - (do * o_plain).sum(-1, keepdim=True))
    return torch.allclose(o_cap, o_plain, atol=1e-13) and torch.allclose(ds_cap, ds_plain, atol=1e-13)
# --8<-- [end:numeric]


SYMBOLIC_SHAPES = [(2, 2, 1), (1, 3, 2)]


def check() -> CheckResult:
    ledger = Ledger()
    ledger.claim(f"symbolic κ, S, bias B: dS = P∘(dP − δ)∘(1 − tanh²(S/κ)) equals ∂L/∂S entry by entry, "
                 f"(N, M, d) {SYMBOLIC_SHAPES}", lambda: symbolic_route(softcap_backward, SYMBOLIC_SHAPES))
    ledger.claim("κ → ∞: κ·tanh(s/κ) → s, its derivative 1 − tanh²(s/κ) → 1; κ·tanh(s/κ) = s − s³/(3κ²) + O(κ⁻⁴)",
                 limit_route)
    ledger.claim("float64 central differences, hand-written softcap attention: dQ, dK from the formula "
                 "(causal 7×5 with empty rows and a bias; GQA 4:2 with N < M; logits ~10³ against κ = 5, no NaN)",
                 lambda: torch_route(softcap_backward))
    ledger.claim("κ = 10⁸: output and dS equal plain causal attention's to 1e-13", large_cap_route)
    # --8<-- [start:negative]
    def factor_forgotten(S, c, P, dP, delta, tanh=sp.tanh):
        return _hadamard(P, dP - _broadcast(delta, P))  # dT taken for dS

    def derivative_at_capped_score(S, c, P, dP, delta, tanh=sp.tanh):
        capped = S.applyfunc(lambda s: c * tanh(s / c)) if hasattr(S, "applyfunc") else c * tanh(S / c)
        return softcap_backward(capped, c, P, dP, delta, tanh)  # tanh recomputed from T, not S

    def linear_factor(S, c, P, dP, delta, tanh=sp.tanh):
        t = S.applyfunc(lambda s: tanh(s / c)) if hasattr(S, "applyfunc") else tanh(S / c)
        return _hadamard(_hadamard(P, dP - _broadcast(delta, P)), _one_minus(t))

    def delta_uncapped(S, c, P, dP, delta, tanh=sp.tanh):
        if hasattr(S, "applyfunc"):
            plain = sp.Matrix(S.rows, S.cols, lambda i, j: sp.exp(S[i, j]) / sum(sp.exp(S[i, k]) for k in range(S.cols)))
            wrong = rowsum(hadamard(plain, dP))
        else:
            import torch
            wrong = (torch.softmax(S.masked_fill(P == 0, float("-inf")), -1).nan_to_num(0.0) * dP).sum(-1, keepdim=True)
        return softcap_backward(S, c, P, dP, wrong, tanh)

    for name, wrong in (("(1 − t²) forgotten", factor_forgotten),
                        ("1 − tanh²(T/κ): derivative at the capped score", derivative_at_capped_score),
                        ("(1 − t) instead of (1 − t²)", linear_factor),
                        ("δ from softmax(S), not softmax(T)", delta_uncapped)):
        ledger.control(f"{name}: symbolic", lambda: not symbolic_route(wrong, SYMBOLIC_SHAPES[:1]))
        ledger.control(f"{name}: torch", lambda: not torch_route(wrong))
    # --8<-- [end:negative]
    sizes = (f"symbolic {', '.join('x'.join(map(str, s)) for s in SYMBOLIC_SHAPES)}; torch 7x5x3 causal "
             f"(2 heads), 3x6x5 GQA 4:2, 4x4x2 huge logits")
    return ledger.result(identity=IDENTITY, method=METHOD, sizes=sizes,
                         negative_control=NEGATIVE, module=__name__)
