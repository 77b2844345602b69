# --8<-- [start:statement]
"""The backward with every variant on at once: a mask, the softcap, ALiBi, dropout and a gradient
arriving at the LSE, all in one dS. With S = τ Q Kᵀ, t = tanh(S/κ), the bias B_ij = −λ|i + M − N − j|,
and masked entries at −∞:

    T = κ t + B (−∞ where masked),   P = softmax_row(T),   LSE_i = log Σ_j e^(T_ij),
    P̃ = P ∘ Z / (1 − p_drop),        O = P̃ V,              L with upstream gradients dO and dLSE.

Each variant enters the backward at exactly one place:

    dV = P̃ᵀ dO,    δ = rowsum(dO ∘ O),    δ' = δ − dLSE,
    dS = P ∘ (Z ∘ (dO Vᵀ) / (1 − p_drop) − δ') ∘ (1 − t²),    dQ = τ dS K,    dK = τ dSᵀ Q.

The mask and the bias live inside P (a masked entry has P = 0 and so dS = 0; the bias is a constant
and adds no term). Dropout scales dP by Z/(1 − p_drop) and nothing else: δ is taken from the dropped
output O the forward stored. dLSE joins the row term before the softcap factor, because the LSE is a
function of T, and T is what the factor 1 − t² converts back to S.
"""
# --8<-- [end:statement]

from __future__ import annotations

import sympy as sp

from ._common import broadcast_rows, hadamard, holds, is_zero_with_exps, rowsum, symbol_matrix
from ._result import CheckResult, Ledger

IDENTITY = ("variants stacked: dS = P∘(Z∘dP/(1−p_drop) − (δ − dLSE))∘(1 − t²), δ = rowsum(dO∘O), "
            "with causal mask, softcap, ALiBi, dropout and dLSE all on")
METHOD = ("SymPy on explicit symbol matrices (scores, cap κ, slope λ, keep mask, p_drop, dLSE all symbols; "
          "causal mask with an empty row); float64 torch autograd through a hand-written attention with "
          "every variant on (causal with empty rows, sliding window, GQA); flashattn.reference.online_backward "
          "with the same variants against the same autograd")
NEGATIVE = ("(1 − t²) forgotten; Z/(1 − p_drop) applied to the δ term as well; dLSE added after the softcap "
            "factor; δ from the undropped output")


def _had(A, B):
    return hadamard(A, B) if hasattr(A, "multiply_elementwise") else A * B


def _row(col, like):
    """A per-row column broadcast across the columns (SymPy needs it spelled out; torch broadcasts)."""
    return broadcast_rows(col, like.cols) if hasattr(like, "multiply_elementwise") else col


def _one_minus_square(t):
    return t.applyfunc(lambda x: 1 - x**2) if hasattr(t, "applyfunc") else 1 - t * t


# --8<-- [start:formula]
def row_term(dO, O, dlse):
    """δ' = rowsum(dO ∘ O) − dLSE, once per row, before any tile (O is the dropped output)."""
    if hasattr(O, "multiply_elementwise"):
        return rowsum(hadamard(dO, O)) - dlse
    return (dO * O).sum(-1, keepdim=True) - dlse


def stacked_ds(P, Z, keep, dP, delta_folded, t):
    """dS of the raw scores S = τQKᵀ. P: the probabilities the forward used (mask and bias inside, 0
    where masked); Z: the keep mask; keep = 1 − p_drop; dP = dO Vᵀ; t = tanh(S/κ) recomputed from S."""
    dP_undropped = _had(Z, dP) / keep                      # dropout: the gradient of the undropped P
    dT = _had(P, dP_undropped - _row(delta_folded, P))     # softmax backward at T, dLSE folded in δ'
    return _had(dT, _one_minus_square(t))                  # softcap: dT/dS = 1 − tanh²(S/κ)
# --8<-- [end:formula]


def stacked_backward(P, Z, keep, V, dO, O, dlse, t):
    """dS and dV as the kernel forms them (the formula above, one function per quantity)."""
    dP = dO * V.T if hasattr(V, "multiply_elementwise") else dO @ V.transpose(-1, -2)
    P_dropped = _had(P, Z) / keep
    dV = P_dropped.T * dO if hasattr(P, "multiply_elementwise") else P_dropped.transpose(-1, -2) @ dO
    return dict(dS=stacked_ds(P, Z, keep, dP, row_term(dO, O, dlse), t), dV=dV)


# --8<-- [start:proof]
def visible(i, j, n, m):
    """Bottom-right causal: query i sees key j when j ≤ i + M − N."""
    return j <= i + m - n


def symbolic_route(backward, shapes) -> bool:
    """L = ⟨dO, O⟩ + Σ_i dLSE_i LSE_i with every score, the cap κ, the slope λ, each keep-mask entry,
    p_drop, V, dO and dLSE a symbol; masked entries are left out of the softmax (that is what −∞ does),
    and a row with no visible key has P = 0 and no LSE term. ∂L/∂S_ij by SymPy, entry by entry."""
    c, lam = sp.Symbol("kappa", positive=True), sp.Symbol("lambda", positive=True)
    keep = 1 - sp.Symbol("p_drop", positive=True)
    for n, m, d in shapes:
        S, Z = symbol_matrix("s", n, m), symbol_matrix("z", n, m)
        V, dO, dlse = symbol_matrix("v", m, d), symbol_matrix("g", n, d), symbol_matrix("h", n, 1)
        T = sp.Matrix(n, m, lambda i, j: c * sp.tanh(S[i, j] / c) - lam * abs(i + m - n - j))
        P, loss = sp.zeros(n, m), sp.Integer(0)
        for i in range(n):
            keys = [j for j in range(m) if visible(i, j, n, m)]
            if not keys:
                continue  # P row 0, LSE = −∞ is not differentiated
            z = sum(sp.exp(T[i, j]) for j in keys)
            for j in keys:
                P[i, j] = sp.exp(T[i, j]) / z
            loss += dlse[i, 0] * sp.log(z)
        O = (hadamard(P, Z) / keep) * V
        loss += sum(hadamard(dO, O))
        t = S.applyfunc(lambda s: sp.tanh(s / c))
        got = backward(P, Z, keep, V, dO, O, dlse, t)
        to_t = {sp.tanh(S[i, j] / c): sp.Symbol(f"t_{i}_{j}", real=True) for i in range(n) for j in range(m)}
        tests = [lambda i=i, j=j: is_zero_with_exps((got["dS"][i, j] - sp.diff(loss, S[i, j])).xreplace(to_t))
                 for i in range(n) for j in range(m)]
        tests += [lambda a=a, b=b: is_zero_with_exps(got["dV"][a, b] - sp.diff(loss, V[a, b]))
                  for a in range(m) for b in range(d)]
        if not all(holds(test) for test in tests):
            return False
    return True
# --8<-- [end:proof]


# --8<-- [start:numeric]
CASES = [  # (N, M, d, Hq, Hkv, causal, window (left, right) or None)
    (7, 5, 3, 2, 1, True, None),    # N > M: rows 0 and 1 see no key; GQA 2:1
    (4, 6, 3, 2, 2, False, (2, 1)),  # N < M, a sliding window of 2 left, 1 right
]
CAP, SLOPES, P_DROP, SEED = 1.5, (0.5, 0.25), 0.3, 11


def _visible(n, m, causal, window):
    import torch

    rows, cols = torch.arange(n)[:, None], torch.arange(m)[None, :]
    diag = rows + (m - n)  # bottom-right alignment
    seen = torch.ones(n, m, dtype=torch.bool)
    if causal:
        seen &= cols <= diag
    if window is not None:
        seen &= (cols >= diag - window[0]) & (cols <= diag + window[1])
    return seen


def stacked_attention(q, k, v, z, causal, window, cap=CAP, slopes=SLOPES, p_drop=P_DROP):
    """Every variant by its definition, float64 torch, no flashattn API: returns o, lse, p, t."""
    import torch

    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    n, m, d = q.shape[2], k.shape[2], q.shape[3]
    s = d ** -0.5 * q @ k.transpose(-1, -2)
    t = torch.tanh(s / cap)
    slope = torch.tensor(slopes, dtype=q.dtype)[None, :, None, None]
    distance = (torch.arange(n)[:, None] + (m - n) - torch.arange(m)[None, :]).abs()
    scores = (cap * t - slope * distance).masked_fill(~_visible(n, m, causal, window), float("-inf"))
    lse = torch.logsumexp(scores, -1)
    p = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # a row with no key: p = 0
    return (p * z / (1 - p_drop)) @ v, lse, p, t


def _case(case, seed):
    import torch

    from flashattn.reference import dropout_keep_mask

    n, m, d, hq, hkv, causal, window = case
    gen = torch.Generator().manual_seed(seed)
    q = 2 * torch.randn(1, hq, n, d, generator=gen, dtype=torch.float64)  # large enough that the cap bends
    k = 2 * torch.randn(1, hkv, m, d, generator=gen, dtype=torch.float64)
    v = torch.randn(1, hkv, m, d, generator=gen, dtype=torch.float64)
    do = torch.randn(1, hq, n, d, generator=gen, dtype=torch.float64)
    dlse = torch.randn(1, hq, n, generator=gen, dtype=torch.float64)
    z = dropout_keep_mask(SEED, 1, hq, n, m, P_DROP).to(torch.float64)  # the kernels' Philox mask
    return q, k, v, do, dlse, z, causal, window


def autograd(case, seed=0, *, cap=CAP, slopes=SLOPES, p_drop=P_DROP, with_dlse=True):
    """dQ, dK, dV of L = ⟨dO, O⟩ + ⟨dLSE, LSE⟩ (rows with a key) by float64 autograd."""
    import torch

    q, k, v, do, dlse, z, causal, window = _case(case, seed)
    z = z if p_drop else torch.ones_like(z)
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    o, lse, _, _ = stacked_attention(q, k, v, z, causal, window, cap, slopes, p_drop)
    has_key = torch.isfinite(lse)
    loss = (o * do).sum() + (torch.where(has_key, lse, 0.0) * dlse).sum() * with_dlse
    loss.backward()
    return q.grad, k.grad, v.grad


def torch_route(backward, seed=0) -> bool:
    """`backward`'s dS and dV, pushed through dQ = τ dS K and dK = τ dSᵀ Q (summed over a GQA group),
    against autograd, on every case."""
    import torch

    for case in CASES:
        want = autograd(case, seed)
        if not all(torch.isfinite(w).all() for w in want):
            return False
        q, k, v, do, dlse, z, causal, window = _case(case, seed)
        group, tau = q.shape[1] // k.shape[1], q.shape[-1] ** -0.5
        o, lse, p, t = stacked_attention(q, k, v, z, causal, window)
        kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        got = backward(p, z, 1 - P_DROP, vv, do, o, dlse[..., None], t)
        dq = tau * got["dS"] @ kk
        dk = (tau * got["dS"].transpose(-1, -2) @ q).reshape(1, k.shape[1], group, *k.shape[2:]).sum(2)
        dv = got["dV"].reshape(1, k.shape[1], group, *k.shape[2:]).sum(2)
        if not all(torch.allclose(g, w, atol=1e-12, rtol=1e-10) for g, w in zip((dq, dk, dv), want)):
            return False
    return True


def online_route(seed=0) -> bool:
    """flashattn.reference.online_backward (the kernels' loops in PyTorch, 3×2 tiles) with all the
    variants and dLSE on, fed the forward's O and LSE, against the same autograd."""
    import torch

    from flashattn.reference import online_backward

    for case in CASES:
        want = autograd(case, seed)
        q, k, v, do, dlse, z, causal, window = _case(case, seed)
        o, lse, _, _ = stacked_attention(q, k, v, z, causal, window)
        got = online_backward(do, q, k, v, o, lse, causal, block_m=3, block_n=2, dlse=dlse, window=window,
                              softcap=CAP, alibi_slopes=torch.tensor(SLOPES, dtype=torch.float64),
                              dropout_p=P_DROP, seed=SEED)
        if not all(torch.allclose(g, w, atol=1e-12, rtol=1e-10) for g, w in zip(got, want)):
            return False
    return True


def variant_effects(seed=0) -> dict:
    """How far dQ moves (max abs) when one variant is switched off, on the first case: the cases are
    not degenerate when every entry is well above round-off, so a formula that ignored a variant
    could not pass."""
    base = autograd(CASES[0], seed)[0]
    off = {"softcap": dict(cap=1e9), "ALiBi": dict(slopes=(0.0, 0.0)), "dropout": dict(p_drop=0.0),
           "dLSE": dict(with_dlse=False)}
    return {name: (autograd(CASES[0], seed, **kw)[0] - base).abs().max().item() for name, kw in off.items()}
# --8<-- [end:numeric]


SYMBOLIC_SHAPES = [(2, 3, 1), (3, 2, 1)]


def check() -> CheckResult:
    ledger = Ledger()
    ledger.claim(f"symbolic κ, λ, z_ij, p_drop, dLSE, causal mask (3×2 has a row with no key): dS and dV equal "
                 f"∂L/∂S, ∂L/∂V entry by entry, (N, M, d) {SYMBOLIC_SHAPES}",
                 lambda: symbolic_route(stacked_backward, SYMBOLIC_SHAPES))
    ledger.claim("float64 autograd, every variant on (κ = 1.5, slopes 0.5 and 0.25, p_drop = 0.3 with the kernels' "
                 "Philox mask, random dLSE): dQ, dK, dV from the formula (causal 7×5 GQA 2:1 with empty rows; "
                 "4×6 with a (2, 1) window)", lambda: torch_route(stacked_backward))
    ledger.claim("flashattn.reference.online_backward with the same variants and dLSE, 3×2 tiles: dQ, dK, dV "
                 "equal autograd's to 1e-12", online_route)
    effects = variant_effects()
    ledger.claim("each variant matters here: switching one off moves dQ by "
                 + ", ".join(f"{k} {v:.2g}" for k, v in effects.items()) + " (each > 1e-3)",
                 lambda: min(effects.values()) > 1e-3)
    # --8<-- [start:negative]
    def tanh_factor_forgotten(P, Z, keep, V, dO, O, dlse, t):
        return stacked_backward(P, Z, keep, V, dO, O, dlse, _had(t, 0 * t))  # 1 − 0² = 1

    def keep_mask_on_delta_too(P, Z, keep, V, dO, O, dlse, t):
        dP = dO * V.T if hasattr(V, "multiply_elementwise") else dO @ V.transpose(-1, -2)
        P_dropped = _had(P, Z) / keep
        dS = _had(_had(P_dropped, dP - _row(row_term(dO, O, dlse), P)), _one_minus_square(t))
        return {**stacked_backward(P, Z, keep, V, dO, O, dlse, t), "dS": dS}

    def dlse_after_the_cap(P, Z, keep, V, dO, O, dlse, t):
        got = stacked_backward(P, Z, keep, V, dO, O, 0 * dlse, t)
        return {**got, "dS": got["dS"] + _had(P, _row(dlse, P))}

    def delta_from_undropped_output(P, Z, keep, V, dO, O, dlse, t):
        undropped = P * V if hasattr(P, "multiply_elementwise") else P @ V
        return stacked_backward(P, Z, keep, V, dO, undropped, dlse, t)

    for name, wrong in (("(1 − t²) forgotten", tanh_factor_forgotten),
                        ("Z/(1 − p_drop) on the δ term too", keep_mask_on_delta_too),
                        ("dLSE added after the (1 − t²) factor", dlse_after_the_cap),
                        ("δ from the undropped output", delta_from_undropped_output)):
        ledger.control(f"{name}: symbolic", lambda: not symbolic_route(wrong, SYMBOLIC_SHAPES[:1]))
        ledger.control(f"{name}: autograd", lambda: not torch_route(wrong))
    # --8<-- [end:negative]
    sizes = (f"symbolic {', '.join('x'.join(map(str, s)) for s in SYMBOLIC_SHAPES)}; torch 7x5x3 causal GQA 2:1, "
             f"4x6x3 window (2, 1); online_backward 3x2 tiles")
    return ledger.result(identity=IDENTITY, method=METHOD, sizes=sizes,
                         negative_control=NEGATIVE, module=__name__)
