# --8<-- [start:statement]
"""ALiBi's position term. Each head h has a slope λ_h ≥ 0; the scores S = τ Q Kᵀ get a bias that
depends only on where the query and the key sit (bottom-right aligned, like causal):

    B_ij = −λ · |i + M − N − j|,    P = softmax_row(S + B),    O = P V.

Three facts make it cheap in a FlashAttention kernel:

1. The bias commutes with the online softmax. A tile adds B to its own scores (with the *global*
   row and column indices) before the running max; the rescaling by α = e^(m_old − m_new) then
   treats biased scores like any others, so the tiled result is softmax(S + B) V and the stored LSE
   is log Σ_j e^(S_ij + B_ij), for any tiling and any finite pivots.
2. B is a constant with respect to Q, K and V, so it adds nothing to their gradients: dV = Pᵀ dO,
   dS = P ∘ (dP − δ) with δ = rowsum(dO ∘ O), dQ = τ dS K and dK = τ dSᵀ Q, exactly the plain
   formulas, with P the *biased* probabilities (which the backward recomputes from the stored LSE,
   so it must add the same B again). The bias sits outside the scale: B is added to τ QKᵀ, not to QKᵀ.
3. Under causal masking i + M − N − j ≥ 0 wherever P is non-zero, so B_ij = λ j − λ (i + M − N):
   the row term cancels in the softmax. P and O are those of a bias λ j on the keys alone; the LSE
   is lower by λ (i + M − N).
"""
# --8<-- [end:statement]

from __future__ import annotations

import sympy as sp

from ._common import broadcast_rows, hadamard, holds, is_zero_with_exps, rowsum, symbol_matrix
from ._result import CheckResult, Ledger

IDENTITY = ("ALiBi: B_ij = −λ|i + M − N − j| commutes with the online rescaling; dQ = τ dS K, dK = τ dSᵀ Q "
            "with dS = P∘(dP − δ), P = softmax(S + B): nothing added")
METHOD = ("SymPy: online fold of two key blocks with symbolic scores, values, slope and pivots; "
          "∂L/∂Q, ∂L/∂K on explicit symbol matrices with symbolic τ and λ; float64 torch: tile-by-tile "
          "online forward and autograd against a hand-written biased attention (causal, N ≠ M, GQA, ragged tiles)")
NEGATIVE = ("block-local column index in the bias; top-left |i − j| when N ≠ M; bias inside the scale "
            "τ(QKᵀ + B); backward recomputing P without the bias")


# --8<-- [start:formula]
def tile_bias(rows, cols, slope, n, m):
    """The bias of one tile, from the tile's *global* query rows and key columns (broadcasting)."""
    return -slope * abs(rows + (m - n) - cols)


def biased_tile_scores(qk, rows, cols, slope, tau, n, m, bias=None):
    """What a kernel feeds to the running max: the scaled scores plus the bias, outside the scale."""
    return tau * qk + (bias or tile_bias)(rows, cols, slope, n, m)


def score_grad(P, dO, V):
    """dS of biased attention: the plain formula, with P the biased probabilities."""
    O = P * V
    return hadamard(P, dO * V.T - broadcast_rows(rowsum(hadamard(dO, O)), P.cols))
# --8<-- [end:formula]


# --8<-- [start:proof]
def _identically_zero(expr) -> bool:
    """Exact zero test, after a cheap look for a witness: a point (random rationals for every symbol)
    where the expression is far from 0 at 30 digits proves it is not identically zero."""
    rng = __import__("random").Random(5)
    point = {s: sp.Rational(rng.randint(1, 40), 17) for s in expr.free_symbols}
    if abs(sp.N(expr.xreplace(point), 30)) > sp.Float("1e-20"):
        return False
    return is_zero_with_exps(expr)


def _sym_abs(x):
    return sp.Abs(sp.Integer(x)) if isinstance(x, int) else sp.Abs(x)


def online_route(scores=None) -> bool:
    """One query row (i = 1 of N = 2, M = 4: position 3) folded over two key blocks of two, with every
    q·k, value, the slope, the scale and both pivots symbols; the fold must equal softmax(τ x + B) v
    and its log-sum-exp. The pivots are free: the identity may not depend on them."""
    scores = scores or biased_tile_scores
    lam, tau = sp.Symbol("lambda", positive=True), sp.Symbol("tau", positive=True)
    n, m, i, block = 2, 4, 1, 2
    x = [sp.Symbol(f"x_{j}", real=True) for j in range(m)]
    v = [sp.Symbol(f"v_{j}", real=True) for j in range(m)]
    bias = lambda r, cols, slope, n_, m_: -slope * _sym_abs(r + (m_ - n_) - cols)
    truth = [tau * x[j] - lam * abs(i + m - n - j) for j in range(m)]
    z = sum(sp.exp(t) for t in truth)
    want_o, want_lse = sum(sp.exp(t) * v[j] for j, t in enumerate(truth)) / z, sp.log(z)
    pivots = [sp.Symbol("m_1", real=True), sp.Symbol("m_2", real=True)]
    m_old, l_acc, acc = None, sp.Integer(0), sp.Integer(0)
    for b, pivot in enumerate(pivots):
        cols = range(b * block, (b + 1) * block)
        s = [scores(x[j], i, j, lam, tau, n, m, bias) for j in cols]
        alpha = 1 if m_old is None else sp.exp(m_old - pivot)  # rescale the old state to the new pivot
        l_acc = l_acc * alpha + sum(sp.exp(sj - pivot) for sj in s)
        acc = acc * alpha + sum(sp.exp(sj - pivot) * v[j] for sj, j in zip(s, cols))
        m_old = pivot
    got_o, got_lse = acc / l_acc, m_old + sp.log(l_acc)
    return (holds(lambda: _identically_zero(got_o - want_o))
            and holds(lambda: _identically_zero(sp.exp(got_lse) - sp.exp(want_lse))))


def gradient_route(grad=None, shapes=((2, 3, 1), (3, 2, 1))) -> bool:
    """L = ⟨dO, softmax(τ Q Kᵀ + B) V⟩ with Q, K, V, dO, τ and λ symbols; ∂L/∂Q and ∂L/∂K by SymPy
    against τ dS K and τ dSᵀ Q with dS from `grad` (N < M and N > M, so both sides of |·| occur)."""
    lam, tau = sp.Symbol("lambda", positive=True), sp.Symbol("tau", positive=True)
    for n, m, d in shapes:
        Q, K = symbol_matrix("q", n, d), symbol_matrix("k", m, d)
        V, dO = symbol_matrix("v", m, d), symbol_matrix("g", n, d)
        B = sp.Matrix(n, m, lambda i, j: -lam * abs(i + m - n - j))
        T = tau * Q * K.T + B
        P = sp.Matrix(n, m, lambda i, j: sp.exp(T[i, j]) / sum(sp.exp(T[i, k]) for k in range(m)))
        loss = sum(hadamard(dO, P * V))
        dS = score_grad(P, dO, V) if grad is None else grad(P, dO, V, tau * Q * K.T)
        for X, want in ((Q, tau * dS * K), (K, tau * dS.T * Q)):
            if not all(holds(lambda a=a, c=c: _identically_zero(want[a, c] - sp.diff(loss, X[a, c])))
                       for a in range(X.rows) for c in range(X.cols)):
                return False
    return True
# --8<-- [end:proof]


# --8<-- [start:numeric]
def alibi_attention(q, k, v, slopes, causal, top_left=False):
    """Biased attention by the definition, float64 torch, no flashattn API. slopes (B, Hq); returns
    o, lse, p. Rows with no visible key give o = 0, lse = −inf."""
    import torch

    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    n, m, d = q.shape[2], k.shape[2], q.shape[3]
    rows, cols = torch.arange(n)[:, None], torch.arange(m)[None, :]
    offset = 0 if top_left else m - n
    s = d ** -0.5 * q @ k.transpose(-1, -2) - slopes[:, :, None, None] * (rows + offset - cols).abs()
    if causal:
        s = s.masked_fill(cols > rows + (m - n), float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return p @ v, lse, p


def tiled_forward(q, k, v, slopes, causal, block_m=3, block_n=2, bias=None, scores=None):
    """The online forward, tile by tile (ragged blocks, pivot = running max, empty rows kept at −inf)."""
    import torch

    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    n, m, d = q.shape[2], k.shape[2], q.shape[3]
    lam = slopes[:, :, None, None]
    o, lse = torch.zeros_like(q), torch.full(q.shape[:3], float("-inf"), dtype=q.dtype)
    for sm in range(0, n, block_m):
        rows = torch.arange(sm, min(sm + block_m, n))[:, None]
        m_i = torch.full((*q.shape[:2], rows.shape[0]), float("-inf"), dtype=q.dtype)
        l_i, acc = torch.zeros_like(m_i), torch.zeros(*m_i.shape, d, dtype=q.dtype)
        for sn in range(0, m, block_n):
            cols = torch.arange(sn, min(sn + block_n, m))[None, :]
            qk = q[:, :, rows[:, 0]] @ k[:, :, cols[0]].transpose(-1, -2)
            s = (scores or biased_tile_scores)(qk, rows, cols, lam, d ** -0.5, n, m, bias)
            if causal:
                s = s.masked_fill(cols > rows + (m - n), float("-inf"))
            m_new = torch.maximum(m_i, s.amax(-1))
            pivot = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))  # empty so far
            p = torch.exp(s - pivot[..., None])
            alpha = torch.exp(m_i - pivot)
            l_i = l_i * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + p @ v[:, :, cols[0]]
            m_i = m_new
        empty = l_i == 0
        o[:, :, rows[:, 0]] = acc / torch.where(empty, 1.0, l_i)[..., None]
        lse[:, :, rows[:, 0]] = torch.where(empty, float("-inf"), torch.where(torch.isfinite(m_i), m_i, 0.0)
                                            + torch.log(torch.where(empty, 1.0, l_i)))
    return o, lse


CASES = [  # (B, Hq, Hkv, N, M, d, causal)
    (2, 2, 1, 7, 5, 3, True),   # N > M: the first rows see nothing
    (1, 4, 2, 5, 9, 4, False),  # N < M, GQA, keys on both sides of the diagonal
    (1, 2, 2, 6, 6, 3, True),
]


def _inputs(case, seed):
    import torch

    b, hq, hkv, n, m, d, causal = case
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, n, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(b, hkv, m, d, generator=gen, dtype=torch.float64) for _ in range(2))
    slopes = torch.rand(b, hq, generator=gen, dtype=torch.float64) + 0.25  # per (batch, head)
    return q, k, v, slopes, causal


def online_torch_route(seed: int = 0, **tiled) -> bool:
    import torch

    for case in CASES:
        q, k, v, slopes, causal = _inputs(case, seed)
        o_ref, lse_ref, _ = alibi_attention(q, k, v, slopes, causal)
        o, lse = tiled_forward(q, k, v, slopes, causal, **tiled)
        if not (torch.allclose(o, o_ref, atol=1e-12) and torch.equal(torch.isinf(lse), torch.isinf(lse_ref))
                and torch.allclose(lse.nan_to_num(neginf=0.0), lse_ref.nan_to_num(neginf=0.0), atol=1e-12)):
            return False
    return True


def autograd_route(recompute_p=None, seed: int = 1) -> bool:
    """dQ, dK, dV by autograd through the biased attention against the plain formulas with the biased P
    (or with the P that `recompute_p(q, k, slopes, causal)` gives, for the controls)."""
    import torch

    for case in CASES:
        q, k, v, slopes, causal = _inputs(case, seed)
        group = q.shape[1] // k.shape[1]
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        o, lse, p = alibi_attention(q, k, v, slopes, causal)
        do = torch.randn(o.shape, generator=torch.Generator().manual_seed(seed + 7), dtype=torch.float64)
        (o * do).sum().backward()
        with torch.no_grad():
            if recompute_p is not None:
                p = recompute_p(q, k, slopes, causal)
            kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            ds = p * (do @ vv.transpose(-1, -2) - (do * o).sum(-1, keepdim=True))
            tau = q.shape[-1] ** -0.5
            fold = lambda t: t.reshape(k.shape[0], k.shape[1], group, *t.shape[2:]).sum(2)
            want = (tau * ds @ kk, fold(tau * ds.transpose(-1, -2) @ q), fold(p.transpose(-1, -2) @ do))
        if not all(torch.allclose(g, w, atol=1e-12) for g, w in zip((q.grad, k.grad, v.grad), want)):
            return False
    return True


def causal_row_term_route(seed: int = 2) -> bool:
    """Causal: B = λ j − λ(i + M − N) on the visible pairs, so P matches a key-only bias λ j and the LSE
    is lower by λ(i + M − N)."""
    import torch

    q, k, v, slopes, _ = _inputs(CASES[2], seed)
    n, m, d = q.shape[2], k.shape[2], q.shape[3]
    o, lse, p = alibi_attention(q, k, v, slopes, True)
    rows, cols = torch.arange(n)[:, None], torch.arange(m)[None, :]
    s = d ** -0.5 * q @ k.transpose(-1, -2) + slopes[:, :, None, None] * cols
    s = s.masked_fill(cols > rows + (m - n), float("-inf"))
    lse_keys = torch.logsumexp(s, -1)
    return (torch.allclose(torch.softmax(s, -1), p, atol=1e-14)
            and torch.allclose(lse, lse_keys - slopes[:, :, None] * (torch.arange(n) + m - n), atol=1e-12))
# --8<-- [end:numeric]


def check() -> CheckResult:
    ledger = Ledger()
    ledger.claim("symbolic: two key blocks folded online with the bias on global indices, free pivots m_1, m_2, "
                 "give softmax(τx + B)v and its LSE", online_route)
    ledger.claim("symbolic τ, λ: ∂L/∂Q = τ dS K and ∂L/∂K = τ dSᵀ Q with dS = P∘(dP − δ), P biased "
                 "((N, M, d) = (2, 3, 1), (3, 2, 1))", gradient_route)
    ledger.claim("float64 torch: tile-by-tile online forward (3×2 tiles, ragged) = biased attention, O and LSE, "
                 "causal N > M with empty rows, GQA with N < M, per-(batch, head) slopes", online_torch_route)
    ledger.claim("float64 torch autograd: dQ, dK, dV are the plain formulas with the biased P", autograd_route)
    ledger.claim("causal: P equals softmax(S + λj) and LSE = LSE(S + λj) − λ(i + M − N)", causal_row_term_route)
    # --8<-- [start:negative]
    block_local = lambda rows, cols, slope, n, m: tile_bias(rows, cols % 2, slope, n, m)  # j − start_n
    top_left = lambda rows, cols, slope, n, m: tile_bias(rows, cols, slope, n, n)  # |i − j|
    inside_scale = lambda qk, rows, cols, slope, tau, n, m, bias: tau * (qk + (bias or tile_bias)(rows, cols, slope, n, m))

    def unbiased_p(q, k, slopes, causal):  # the backward recomputes P and forgets to add B again
        zero = slopes * 0
        return alibi_attention(q, k, k, zero, causal)[2]

    def grad_unbiased(P, dO, V, S):  # the symbolic twin: P from S alone
        P0 = sp.Matrix(P.rows, P.cols, lambda i, j: sp.exp(S[i, j]) / sum(sp.exp(S[i, c]) for c in range(P.cols)))
        return hadamard(P0, dO * V.T - broadcast_rows(rowsum(hadamard(dO, P * V)), P.cols))

    for name, route in (
        ("block-local column j − start_n: symbolic",
         lambda: online_route(lambda x, i, j, lam, tau, n, m, b: tau * x - lam * abs(i + m - n - j % 2))),
        ("block-local column j − start_n: torch", lambda: online_torch_route(bias=block_local)),
        ("top-left |i − j| with N ≠ M: torch", lambda: online_torch_route(bias=top_left)),
        ("bias inside the scale, τ(x + B): symbolic",
         lambda: online_route(lambda x, i, j, lam, tau, n, m, b: tau * (x - lam * abs(i + m - n - j)))),
        ("bias inside the scale, τ(x + B): torch", lambda: online_torch_route(scores=inside_scale)),
        ("backward recomputes P without B: symbolic", lambda: gradient_route(grad_unbiased, shapes=((2, 3, 1),))),
        ("backward recomputes P without B: torch", lambda: autograd_route(unbiased_p)),
    ):
        ledger.control(name, lambda route=route: not route())
    # --8<-- [end:negative]
    sizes = ("symbolic: one row over 2 blocks of 2 keys; gradients 2x3x1, 3x2x1; torch: 7x5x3 causal (B=2, GQA 2:1), "
             "5x9x4 GQA 4:2, 6x6x3 causal; tiles 3x2")
    return ledger.result(identity=IDENTITY, method=METHOD, sizes=sizes,
                         negative_control=NEGATIVE, module=__name__)
