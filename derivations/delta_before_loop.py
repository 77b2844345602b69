# --8<-- [start:statement]
"""Why δ must be known before the tile loop. With the LSE stored by the forward, every quantity of a
tile is local to it: P_ij = e^(S_ij − LSE_i) needs q_i, k_j and LSE_i; dP_ij = dO_i · v_j needs dO_i
and v_j. The one exception is the row term of the softmax backward,

    dS_ij = P_ij (dP_ij − δ_i),    δ_i = Σ_k P_ik dP_ik,

a sum over the whole row: it is complete only after the last key block of row i has been seen, yet
the first tile of the row already needs it. That is a data dependency, not a cost. A loop that forms
δ from the tiles it has seen so far gets dS wrong; getting it right from P ∘ dP takes a second pass
over every tile (recomputing S and dP: two more products per tile) or storing dP (N × M). The
identity δ = rowsum(dO ∘ O) reads only O (stored by the forward) and dO (the incoming gradient), so
δ is ready before any tile. The arithmetic it saves is small: rowsum(P ∘ dP) over products the loop
forms anyway is N·M multiply-adds against the backward's seven N·M·d products, 1/(7d) of them.
"""
# --8<-- [end:statement]

from __future__ import annotations

from fractions import Fraction

import sympy as sp

from ._common import hadamard, is_zero_with_exps, rowsum, symbol_matrix
from ._result import CheckResult, Ledger

IDENTITY = ("δ_i = rowsum(P∘dP)_i couples the whole row: a one-pass tile loop cannot form it; "
            "δ = rowsum(dO∘O) is ready before the loop (a data dependency, not saved FLOPs)")
METHOD = ("SymPy: which symbols each tile quantity depends on, with the stored LSE a symbol; float64 torch: "
          "a tiled dQ loop with δ from the identity, from a second pass, from the running partial sum, and "
          "deferred, against autograd, with products and multiply-adds counted")
NEGATIVE = ("δ from the running partial sum of the tiles seen so far; δ from the current tile alone")


# --8<-- [start:proof]
def dependencies(n_keys: int = 3):
    """One query row against `n_keys` keys (d = 1), the stored LSE a symbol ℓ. Returns the symbols that
    P_0j dP_0j (the tile-local part of dS_0j), δ from rowsum(P ∘ dP), and δ from rowsum(dO ∘ O) read."""
    S, V = symbol_matrix("s", 1, n_keys), symbol_matrix("v", n_keys, 1)
    dO, O, lse = symbol_matrix("g", 1, 1), symbol_matrix("o", 1, 1), sp.Symbol("lse", real=True)
    P = S.applyfunc(lambda s: sp.exp(s - lse))  # recomputed from the stored LSE
    dP = dO * V.T
    local = [hadamard(P, dP)[0, j].free_symbols for j in range(n_keys)]
    return dict(S=S, V=V, dO=dO, O=O, lse=lse, local=local,
                delta_from_tiles=rowsum(hadamard(P, dP))[0].free_symbols,
                delta_from_output=rowsum(hadamard(dO, O))[0].free_symbols)


def locality_route(n_keys: int = 3) -> bool:
    """Tile j's P_0j dP_0j reads s_0j, v_j, dO_0 and ℓ only; rowsum(P∘dP) reads every s_0k and v_k;
    rowsum(dO∘O) reads no score and no value."""
    dep = dependencies(n_keys)
    S, V = dep["S"], dep["V"]
    tile_ok = all(dep["local"][j] == {S[0, j], V[j, 0], dep["dO"][0, 0], dep["lse"]} for j in range(n_keys))
    row_wide = set(S) | set(V) <= dep["delta_from_tiles"]
    before_loop = dep["delta_from_output"] == {dep["dO"][0, 0], dep["O"][0, 0]}
    return tile_ok and row_wide and before_loop


def identity_route(n_keys: int = 3) -> bool:
    """With ℓ the true LSE and O = P V, the two δ agree (the identity of the δ page, here on one row)."""
    S, V, g = symbol_matrix("s", 1, n_keys), symbol_matrix("v", n_keys, 1), symbol_matrix("g", 1, 1)
    z = sum(sp.exp(S[0, k]) for k in range(n_keys))
    P = S.applyfunc(lambda s: sp.exp(s) / z)
    return is_zero_with_exps(rowsum(hadamard(P, g * V.T))[0] - rowsum(hadamard(g, P * V))[0])
# --8<-- [end:proof]


# --8<-- [start:numeric]
class Counter:
    """Products (matmuls) and multiply-adds a loop issues."""

    def __init__(self):
        self.products, self.macs, self.row_macs = 0, 0, 0

    def mm(self, a, b):
        self.products += 1
        self.macs += a.shape[0] * a.shape[1] * b.shape[1]
        return a @ b

    def rowsum_of_product(self, a, b):
        self.row_macs += a.numel()
        return (a * b).sum(-1)


def dq_loop(q, k, v, do, o, lse, delta_from: str, block_n: int, count: Counter):
    """dQ of one query block over the key blocks, as the dQ kernel walks them. `delta_from`:
    'identity' (rowsum(dO∘O), before the loop), 'second_pass' (rowsum(P∘dP) in a first pass over every
    tile), 'running' (the partial sum of the tiles seen so far), 'tile' (the current tile alone), or
    'deferred' (δ applied after the loop: dQ = τ(Σ (P∘dP) K − δ Σ P K), one more product per tile)."""
    import torch

    tau, m = q.shape[-1] ** -0.5, k.shape[0]
    blocks = [slice(j, min(j + block_n, m)) for j in range(0, m, block_n)]
    tile_p = lambda b: torch.exp(tau * count.mm(q, k[b].T) - lse[:, None])  # P from the stored LSE
    tile_dp = lambda b: count.mm(do, v[b].T)
    delta = torch.zeros(q.shape[0], dtype=q.dtype)
    if delta_from == "identity":
        delta = count.rowsum_of_product(do, o)
    elif delta_from == "second_pass":
        for b in blocks:
            delta = delta + count.rowsum_of_product(tile_p(b), tile_dp(b))
    dq, p_k = torch.zeros_like(q), torch.zeros_like(q)
    for b in blocks:
        p, dp = tile_p(b), tile_dp(b)
        if delta_from == "running":
            delta = delta + count.rowsum_of_product(p, dp)
        elif delta_from == "tile":
            delta = count.rowsum_of_product(p, dp)
        if delta_from == "deferred":
            dq += count.mm(p * dp, k[b])
            p_k += count.mm(p, k[b])
        else:
            dq += count.mm(p * (dp - delta[:, None]), k[b])
    if delta_from == "deferred":
        dq -= count.rowsum_of_product(do, o)[:, None] * p_k
    return tau * dq


def _inputs(seed=0, n=8, m=12, d=4):
    import torch

    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(r, d, generator=gen, dtype=torch.float64) for r in (n, m, m))
    do = torch.randn(n, d, generator=gen, dtype=torch.float64)
    return q, k, v, do


def autograd_dq(seed=0):
    import torch

    q, k, v, do = _inputs(seed)
    q = q.clone().requires_grad_()
    o = torch.softmax(q.shape[-1] ** -0.5 * q @ k.T, -1) @ v
    (o * do).sum().backward()
    return q.grad


def run(delta_from: str, seed=0, block_n=4):
    """(max |dQ − autograd|, the counter) for one way of getting δ; 3 key blocks of 4."""
    import torch

    q, k, v, do = _inputs(seed)
    s = q.shape[-1] ** -0.5 * q @ k.T
    lse = torch.logsumexp(s, -1)
    o = torch.softmax(s, -1) @ v
    count = Counter()
    dq = dq_loop(q, k, v, do, o, lse, delta_from, block_n, count)
    return (dq - autograd_dq(seed)).abs().max().item(), count


def cost_share(d: int) -> float:
    """rowsum(P∘dP) over the whole matrix (N·M multiply-adds) against the two-kernel backward's seven
    N·M·d products: 1/(7d), whatever N and M."""
    return Fraction(1, 7 * d)
# --8<-- [end:numeric]


def check() -> CheckResult:
    ledger = Ledger()
    ledger.claim("symbolic (one row, 3 keys, LSE a symbol): tile j's P∘dP reads only s_0j, v_j, dO, LSE; "
                 "rowsum(P∘dP) reads every score and value of the row; rowsum(dO∘O) reads neither", locality_route)
    ledger.claim("symbolic: rowsum(P∘dP) = rowsum(dO∘O) on the row when O = PV (so the early δ is the right one)",
                 identity_route)
    runs = {name: run(name) for name in ("identity", "second_pass", "deferred", "running", "tile")}
    per_tile = {name: c.products / 3 for name, (_, c) in runs.items()}  # 3 key blocks, one query block
    ledger.claim(f"float64, 8 queries × 12 keys in blocks of 4: dQ with δ from the identity matches autograd "
                 f"(error {runs['identity'][0]:.1e}), {per_tile['identity']:.0f} products per tile",
                 lambda: runs["identity"][0] < 1e-12 and per_tile["identity"] == 3)
    ledger.claim(f"δ from rowsum(P∘dP) in a first pass also matches (error {runs['second_pass'][0]:.1e}) but costs "
                 f"{per_tile['second_pass']:.0f} products per tile: S and dP formed twice",
                 lambda: runs["second_pass"][0] < 1e-12 and per_tile["second_pass"] == 5)
    ledger.claim(f"dQ alone can defer δ (dQ = τ(Σ(P∘dP)K − δ·ΣPK)): matches (error {runs['deferred'][0]:.1e}) "
                 f"with {per_tile['deferred']:.0f} products per tile and a second accumulator",
                 lambda: runs["deferred"][0] < 1e-12 and per_tile["deferred"] == 4)
    share = cost_share(64)
    ledger.claim(f"rowsum(P∘dP) over every tile is N·M = {runs['second_pass'][1].row_macs} multiply-adds (counted), "
                 f"against 7·N·M·d = {7 * 8 * 12 * 4} for the backward's 7 products at d = 4: 1/(7d), "
                 f"{float(share):.2%} at d = 64",
                 lambda: runs["second_pass"][1].row_macs == 8 * 12 and share == Fraction(1, 448))
    # --8<-- [start:negative]
    ledger.control(f"δ from the running partial sum (one pass): dQ off by {runs['running'][0]:.2g}",
                   lambda: runs["running"][0] > 1e-3)
    ledger.control(f"δ from the current tile alone: dQ off by {runs['tile'][0]:.2g}",
                   lambda: runs["tile"][0] > 1e-3)
    # --8<-- [end:negative]
    return ledger.result(identity=IDENTITY, method=METHOD,
                         sizes="symbolic 1 row x 3 keys; torch 8x12x4, key blocks of 4",
                         negative_control=NEGATIVE, module=__name__)
