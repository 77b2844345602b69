# --8<-- [start:statement]
"""Dropout on the attention probabilities. With drop probability p_drop (the `dropout_p` of PyTorch and
flash_attn), keep mask Z (entries 0 or 1, each 1 with probability 1 − p_drop):

    P̃ = P ∘ Z / (1 − p_drop),    O = P̃ V.

Backward, with dP̃ = dO Vᵀ the gradient with respect to P̃:

    dV = P̃ᵀ dO,    dP = dP̃ ∘ Z / (1 − p_drop),    dS = P ∘ (dP − δ),    δ = rowsum(P ∘ dP).

The δ identity survives: rowsum(P ∘ dP) = rowsum(P̃ ∘ dP̃) = rowsum(dO ∘ O), with O the output of
the *dropped* P̃, exactly the O the forward pass stored. dS is formed from the *undropped* P.
Seed 003's Appendix B reassigns P ← P̃, rescales dP ← dP ∘ Z/keep (keep = 1 − p_drop) and then forms
dS = P̃ ∘ (dP − rowsum(dP ∘ P̃)): the mask and 1/keep enter twice. With Z ∘ Z = Z that is
dS_seed = (Z/keep) ∘ P ∘ (dP − δ/keep): zero on the dropped entries, where the true dS is −P_ij δ_i,
and on the kept ones 1/keep times P ∘ (dP − δ/keep). It agrees with the true dS only when p_drop = 0.

In a kernel's terms: the forward drops the *normalized* probabilities, so the running sum ℓ and the
LSE are those of the undropped row (the LSE does not depend on Z) while only the accumulator sees
Z/(1 − p_drop); the backward recomputes P from the LSE, regenerates Z from the seed instead of
reading it, and forms

    dS = P ∘ (Z ∘ (dO Vᵀ) / (1 − p_drop) − δ),    δ = rowsum(dO ∘ O),

with O the dropped output the forward stored. Normalizing by the sum of the *dropped* row instead
gives a different O (and a different LSE) whenever a dropped entry carries weight.
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
from .seed_passages import DROPOUT_003, run_steps

IDENTITY = ("dropout: O = (P∘Z/(1−p_drop))V, LSE unchanged; dV = P̃ᵀdO; dS = P∘(Z∘(dO Vᵀ)/(1−p_drop) − δ); "
            "δ = rowsum(dO∘O) still")
METHOD = ("SymPy with symbolic mask entries and drop probability; exact rationals; mpmath central differences; "
          "float64 torch with a fixed mask: autograd (causal, N ≠ M, empty rows, GQA) and a tile-by-tile online forward")
NEGATIVE = ("dV = Pᵀ dO (mask forgotten); dP = dO Vᵀ (mask not applied); δ from the undropped output; "
            "seed 003's Appendix B run from its stored passage: P ← P̃, dP ← dP ∘ Z/keep, "
            "dS = P̃ ∘ (dP − rowsum(dP ∘ P̃)); dS = P̃ ∘ (dP̃ − δ); the online sum ℓ taken over the dropped row")


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


class _Tile:
    """A SymPy matrix under the seeds' notation, so that a stored passage can be evaluated as written:
    `∘` (parsed to *) is the elementwise product and a column (a rowsum) broadcasts across a row."""

    def __init__(self, m):
        self.m = m

    def _operand(self, other):
        if not isinstance(other, _Tile):
            return other  # a scalar
        o = other.m
        return broadcast_rows(o, self.m.cols) if o.cols == 1 and self.m.cols > 1 else o

    def __mul__(self, other):
        o = self._operand(other)
        return _Tile(hadamard(self.m, o) if isinstance(o, sp.MatrixBase) else self.m * o)

    __rmul__ = __mul__

    def __truediv__(self, other):
        o = self._operand(other)
        return _Tile(self.m / o if not isinstance(o, sp.MatrixBase)
                     else sp.Matrix(self.m.rows, self.m.cols, lambda i, j: self.m[i, j] / o[i, j]))

    def __sub__(self, other):
        return _Tile(self.m - self._operand(other))


def seed_003_backward(P, Z, keep, V, dO, O):
    """Seed 003's Appendix B, evaluated from its passage in `derivations.seed_passages` (not re-typed):
    P ← P̃; dP ← dP ∘ Z/keep; dS = P̃ ∘ (dP − rowsum(dP ∘ P̃)), starting from dP = dO Vᵀ."""
    env = {"P": _Tile(P), "Pt": _Tile(hadamard(P, Z) / keep), "Z": _Tile(Z), "keep": keep,
           "dP": _Tile(dO * V.T), "rowsum": lambda A: _Tile(rowsum(A.m))}
    return {**dropout_backward(P, Z, keep, V, dO, O), "dS": run_steps(DROPOUT_003, env)["dS"].m}


def seed_003_closed_form(seed: int = 31, shape=(5, 7, 3)) -> bool:
    """Exact rationals, 0/1 mask, p_drop = 1/5: the seed's steps give (Z/keep) ∘ P ∘ (dP − δ/keep), which
    is 0 on every dropped entry (the true dS there is −P_ij δ_i ≠ 0)."""
    rng = random.Random(seed)
    keep = 1 - sp.Rational(1, 5)
    N, M, d = shape
    P = sp.Matrix(N, M, lambda i, j: sp.Rational(rng.randint(1, 16), 16))  # no zero entry
    Z = sp.Matrix(N, M, lambda i, j: int(rng.random() < 0.8))
    Z[0, 0] = 0
    V, dO = sp.Matrix(rational_matrix(rng, M, d)), sp.Matrix(rational_matrix(rng, N, d))
    O = (hadamard(P, Z) / keep) * V
    true = dropout_backward(P, Z, keep, V, dO, O)
    dP = hadamard(dO * V.T, Z) / keep
    delta = rowsum(hadamard(P, dP))
    closed = hadamard(Z / keep, hadamard(P, dP - broadcast_rows(delta / keep, M)))
    seed_ds = seed_003_backward(P, Z, keep, V, dO, O)["dS"]
    dropped = [(i, j) for i in range(N) for j in range(M) if Z[i, j] == 0]
    return (seed_ds == closed and all(seed_ds[i, j] == 0 and true["dS"][i, j] != 0 for i, j in dropped)
            and seed_ds != true["dS"])


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


CASES = [  # (B, Hq, Hkv, N, M, d, causal)
    (1, 2, 1, 7, 5, 3, True),   # N > M: the first two rows see no key; GQA 2:1
    (1, 2, 2, 4, 6, 3, False),  # N < M
]


def _inputs(case, seed, p_drop):
    """Float64 q, k, v, dO and a fixed keep mask Z (each 1 with probability 1 − p_drop, at least one of each)."""
    import torch

    b, hq, hkv, n, m, d, causal = case
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, n, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(b, hkv, m, d, generator=gen, dtype=torch.float64) for _ in range(2))
    do = torch.randn(b, hq, n, d, generator=gen, dtype=torch.float64)
    z = (torch.rand(b, hq, n, m, generator=gen) >= p_drop).to(torch.float64)
    z[..., -1, -1], z[..., -1, 0] = 1.0, 0.0  # the last row sees every key when causal: one kept, one dropped
    return q, k, v, do, z, causal


def dropout_attention(q, k, v, z, p_drop, causal):
    """O = (P ∘ Z / (1 − p_drop)) V by the definition, float64 torch (no flashattn API); returns o, lse, p."""
    import torch

    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    n, m = q.shape[2], k.shape[2]
    s = q.shape[-1] ** -0.5 * q @ k.transpose(-1, -2)
    if causal:
        s = s.masked_fill(torch.arange(m)[None, :] > torch.arange(n)[:, None] + (m - n), float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)  # rows with no key: lse = −inf, p = 0
    return (p * z / (1 - p_drop)) @ v, lse, p


def torch_route(backward, seed: int = 3, p_drop: float = 0.25) -> bool:
    """dQ, dK, dV by float64 autograd through the dropped attention with a fixed Z, against `backward`
    (run per head on the recomputed P and the stored O) pushed through dQ = τ dS K, dK = τ dSᵀ Q."""
    import torch

    to_sym = lambda t: sp.Matrix(t.tolist())
    to_torch = lambda A: torch.tensor([[float(x) for x in row] for row in A.tolist()], dtype=torch.float64)
    for case in CASES:
        q, k, v, do, z, causal = _inputs(case, seed, p_drop)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        o, _, p = dropout_attention(q, k, v, z, p_drop, causal)
        (o * do).sum().backward()
        group, tau = q.shape[1] // k.shape[1], q.shape[-1] ** -0.5
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        with torch.no_grad():
            for b in range(q.shape[0]):
                for h in range(q.shape[1]):
                    hk = h // group
                    got = backward(to_sym(p[b, h]), to_sym(z[b, h]), sp.Float(1 - p_drop, 30),
                                   to_sym(v[b, hk]), to_sym(do[b, h]), to_sym(o[b, h]))
                    ds = to_torch(got["dS"])
                    dq[b, h] = tau * ds @ k[b, hk]
                    dk[b, hk] += tau * ds.T @ q[b, h]
                    dv[b, hk] += to_torch(got["dV"])
        if not all(torch.allclose(g, w, atol=1e-12) for g, w in ((q.grad, dq), (k.grad, dk), (v.grad, dv))):
            return False
    return True


def online_route(sum_dropped: bool = False, seed: int = 4, p_drop: float = 0.25, block_n: int = 2) -> bool:
    """The forward tile by tile: ℓ sums the undropped exponentials, the accumulator only the kept ones, and
    1/(1 − p_drop) multiplies once at the end (it is a constant, so it commutes with the rescaling); then
    O = (P ∘ Z / (1 − p_drop)) V and the LSE is that of S, untouched by Z. `sum_dropped` is the slip of
    summing ℓ over the dropped row."""
    import torch

    for case in CASES:
        q, k, v, _, z, causal = _inputs(case, seed, p_drop)
        o_ref, lse_ref, _ = dropout_attention(q, k, v, z, p_drop, causal)
        group = q.shape[1] // k.shape[1]
        kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        n, m = q.shape[2], k.shape[2]
        m_i = torch.full(q.shape[:3], float("-inf"), dtype=torch.float64)
        l_i, acc = torch.zeros_like(m_i), torch.zeros_like(q)
        for sn in range(0, m, block_n):
            cols = torch.arange(sn, min(sn + block_n, m))
            s = q.shape[-1] ** -0.5 * q @ kk[:, :, cols].transpose(-1, -2)
            if causal:
                s = s.masked_fill(cols[None, :] > torch.arange(n)[:, None] + (m - n), float("-inf"))
            m_new = torch.maximum(m_i, s.amax(-1))
            pivot = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
            e = torch.exp(s - pivot[..., None])
            kept = e * z[..., cols]  # the mask acts on what enters P V only
            alpha = torch.exp(m_i - pivot)
            l_i = l_i * alpha + (kept if sum_dropped else e).sum(-1)
            acc = acc * alpha[..., None] + kept @ vv[:, :, cols]
            m_i = m_new
        empty = l_i == 0
        o = acc / torch.where(empty, 1.0, l_i)[..., None] / (1 - p_drop)  # 1/(1 − p_drop) once, at the end
        lse = torch.where(empty, float("-inf"), torch.where(torch.isfinite(m_i), m_i, 0.0)
                          + torch.log(torch.where(empty, 1.0, l_i)))
        if not (torch.allclose(o, o_ref, atol=1e-12) and torch.equal(lse.isinf(), lse_ref.isinf())
                and torch.allclose(lse.nan_to_num(neginf=0.0), lse_ref.nan_to_num(neginf=0.0), atol=1e-12)):
            return False
    return True
# --8<-- [end:numeric]


def p_drop_zero_hides(shapes) -> bool:
    """With Z = 1 and p_drop = 0, P̃ = P, and seed 003's steps give the true softmax backward (symbolic):
    why a run with dropout_p = 0 does not show the error."""
    for N, M, d in shapes:
        S, V, dO = symbol_matrix("s", N, M), symbol_matrix("v", M, d), symbol_matrix("g", N, d)
        P = row_softmax(S)
        O = P * V
        loss = sum(hadamard(dO, O))
        dS = seed_003_backward(P, sp.ones(N, M), sp.Integer(1), V, dO, O)["dS"]
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
    ledger.claim("seed 003's Appendix B (run from its passage) equals the true dS when p_drop = 0 (Z = 1): "
                 "why running with dropout_p = 0 hides it", lambda: p_drop_zero_hides(SYMBOLIC_SHAPES))
    ledger.claim("seed 003's Appendix B (run from its passage) gives (Z/keep) ∘ P ∘ (dP − δ/keep): 0 on dropped "
                 "entries, where the true dS is −P_ij δ_i (exact rationals, 5×7×3, p_drop = 1/5)", seed_003_closed_form)
    ledger.claim("float64 torch, fixed mask, p_drop = 1/4: autograd dQ, dK, dV = the kernel's dS = P∘(Z∘dP̃/(1−p_drop) − δ) "
                 "pushed through τ dS K, τ dSᵀ Q (causal 7×5 with empty rows and GQA 2:1; 4×6)",
                 lambda: torch_route(dropout_backward))
    ledger.claim("float64 torch, 2-key tiles: ℓ over the undropped row, accumulator over the dropped one, give "
                 "O = (P∘Z/(1−p_drop))V and the LSE of S, unchanged by Z", online_route)
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

    def ds_from_dropped_p(P, Z, keep, V, dO, O):  # a slip no seed makes: P̃ in place of P, δ from O
        P = hadamard(P, Z) / keep
        dP = dO * V.T
        D = rowsum(hadamard(dO, O))
        return {**dropout_backward(P, Z, keep, V, dO, O), "dS": hadamard(P, dP - broadcast_rows(D, P.cols))}

    for name, wrong in (("dV = Pᵀ dO", mask_forgotten_in_dv), ("dP = dO Vᵀ", mask_not_applied_to_dp),
                        ("δ from undropped O", d_from_undropped_output),
                        ("dS = P̃ ∘ (dP̃ − δ)", ds_from_dropped_p),
                        ("seed 003, App. B: dS = P̃ ∘ (dP − rowsum(dP ∘ P̃)) after P ← P̃, dP ← dP ∘ Z/keep",
                         seed_003_backward)):
        ledger.control(f"{name}: symbolic", lambda: not symbolic_route(wrong, SYMBOLIC_SHAPES[:1]))
        ledger.control(f"{name}: mpmath", lambda: not mpmath_route(wrong, NUMERIC_SHAPES))
        ledger.control(f"{name}: torch", lambda: not torch_route(wrong))
    ledger.control("ℓ summed over the dropped row: torch", lambda: not online_route(sum_dropped=True))
    # --8<-- [end:negative]
    sizes = (f"symbolic {', '.join('x'.join(map(str, s)) for s in SYMBOLIC_SHAPES)}; rational "
             f"{', '.join('x'.join(map(str, s)) for s in RATIONAL_SHAPES)}; mpmath "
             f"{', '.join('x'.join(map(str, s)) for s in NUMERIC_SHAPES)}; torch 7x5x3 causal GQA 2:1, 4x6x3")
    return ledger.result(identity=IDENTITY, method=METHOD, sizes=sizes,
                         negative_control=NEGATIVE, module=__name__)
