# --8<-- [start:statement]
"""Cost model: FLOPs of the forward and the two backward designs, counted from their loops, and
the HBM traffic of standard versus tiled attention.

A matmul of an (r × k) tile by a (k × c) tile costs 2·r·k·c FLOPs. Every product inside the loops of
attention is a (block_m, block_n, d) product in some order, so each costs 2·block_m·block_n·d per
visited tile pair, and over all (N/block_m)·(M/block_n) pairs 2·N·M·d. Hence FLOPs = 2·N·M·d per
matmul in the loop bodies:

* forward: S = QKᵀ, O += PV → 2 matmuls, 4·N·M·d;
* backward in one kernel with atomic dQ: S, dP = dO Vᵀ, dV += Pᵀ dO, dK += dSᵀ Q, dQ += dS K →
  5 matmuls, 10·N·M·d;
* backward in two kernels (dK/dV, then dQ), deterministic: the dK/dV kernel does S, dP, dV, dK and
  the dQ kernel must recompute both S (for P) *and* dP (for dS = P ∘ (dP − D)) before dQ += dS K →
  7 matmuls, 14·N·M·d. Counting 12·N·M·d forgets that the dQ kernel needs dP.

Benchmarks report backward FLOPs as 2.5 × forward by convention (10/4, the single-kernel count),
whatever the kernel really does; `attention_flops` below is that convention, and causal attention
counts only the visible pairs (bottom-right alignment).

HBM traffic (elements, forward, N = M): standard attention writes and re-reads S and P,
4·N·d + 4·N²; the tiled kernel reads Q once, K and V once per query block and writes O and the LSE,
2·N·d + 2·N²·d/block_m + N: never O(N²) memory, and for large N fewer accesses whenever
d < 2·block_m.
"""
# --8<-- [end:statement]

from __future__ import annotations

from dataclasses import dataclass

from ._result import CheckResult, Ledger

IDENTITY = "cost model: forward 4N²d; backward 10N²d (atomic dQ) and 14N²d (two kernels); HBM traffic"
METHOD = ("matmuls counted from loop descriptions with shape and dataflow checks; SymPy totals; "
          "traffic by loop simulation")
NEGATIVE = "12N²d two-kernel backward (dQ kernel without dP); 'K and V are read once' traffic"


# --8<-- [start:loops]
# Tile shapes inside one (query block, key block) iteration. Query-side tiles have block_m rows,
# key-side tiles block_n rows; score-like tiles are block_m × block_n; LSE and D one number per row.
TILE_SHAPES = {
    "Q": ("block_m", "d"), "O": ("block_m", "d"), "dO": ("block_m", "d"), "dQ": ("block_m", "d"),
    "K": ("block_n", "d"), "V": ("block_n", "d"), "dK": ("block_n", "d"), "dV": ("block_n", "d"),
    "S": ("block_m", "block_n"), "P": ("block_m", "block_n"),
    "dP": ("block_m", "block_n"), "dS": ("block_m", "block_n"),
    "LSE": ("block_m", "1"), "D": ("block_m", "1"), "m_l": ("block_m", "1"),
}


@dataclass(frozen=True)
class MatMul:
    """out = a · b (or out += a · b); an operand written "X^T" is the transpose of tile X."""
    out: str
    a: str
    b: str
    accumulate: bool = False


@dataclass(frozen=True)
class Elementwise:
    """An element-wise step (exp2, mask, subtract): O(block_m·block_n) work, not a matmul."""
    out: str
    inputs: tuple[str, ...]


@dataclass(frozen=True)
class Kernel:
    """One kernel's loop over the tile pairs it visits: `loads` are the tiles it reads from HBM
    (before or during the loop), `state` what it keeps in registers across the loop, `body` runs once
    per visited pair, `epilogue` once per program after the loop, `outputs` are what it writes."""
    name: str
    loads: tuple[str, ...]
    body: tuple
    outputs: tuple[str, ...]
    state: tuple[str, ...] = ()
    epilogue: tuple = ()


FORWARD = (Kernel("forward", loads=("Q", "K", "V"), outputs=("O", "LSE"), state=("m_l",), body=(
    MatMul("S", "Q", "K^T"),
    Elementwise("P", ("S", "m_l")),          # P = 2^(S·c − m), running max and sum updated
    MatMul("O", "P", "V", accumulate=True),  # acc += P V (rescaled by α first)
), epilogue=(Elementwise("LSE", ("m_l",)),)),)  # O = acc / l, LSE₂ = m + log2 l

BACKWARD_ATOMIC_DQ = (Kernel("dK, dV and atomic dQ", loads=("Q", "K", "V", "dO", "LSE", "D"),
                             outputs=("dQ", "dK", "dV"), body=(
    MatMul("S", "Q", "K^T"),
    Elementwise("P", ("S", "LSE")),          # P = 2^(S·c − LSE₂), recomputed
    MatMul("dV", "P^T", "dO", accumulate=True),
    MatMul("dP", "dO", "V^T"),
    Elementwise("dS", ("P", "dP", "D")),     # dS = P ∘ (dP − D)
    MatMul("dK", "dS^T", "Q", accumulate=True),
    MatMul("dQ", "dS", "K", accumulate=True),  # atomic add: many key blocks write one dQ tile
)),)

BACKWARD_TWO_KERNELS = (
    Kernel("dK, dV", loads=("Q", "K", "V", "dO", "LSE", "D"), outputs=("dK", "dV"), body=(
        MatMul("S", "Q", "K^T"),
        Elementwise("P", ("S", "LSE")),
        MatMul("dV", "P^T", "dO", accumulate=True),
        MatMul("dP", "dO", "V^T"),
        Elementwise("dS", ("P", "dP", "D")),
        MatMul("dK", "dS^T", "Q", accumulate=True),
    )),
    Kernel("dQ", loads=("Q", "K", "V", "dO", "LSE", "D"), outputs=("dQ",), body=(
        MatMul("S", "Q", "K^T"),
        Elementwise("P", ("S", "LSE")),
        MatMul("dP", "dO", "V^T"),           # dS needs dP, so the dQ kernel recomputes it too
        Elementwise("dS", ("P", "dP", "D")),
        MatMul("dQ", "dS", "K", accumulate=True),
    )),
)
# --8<-- [end:loops]


# --8<-- [start:counting]
class LoopError(ValueError):
    """A loop description that could not run: a shape mismatch or a tile used before it exists."""


def _shape(operand: str) -> tuple[str, str]:
    name, transposed = (operand[:-2], True) if operand.endswith("^T") else (operand, False)
    rows, cols = TILE_SHAPES[name]
    return (cols, rows) if transposed else (rows, cols)


def matmul_shapes(kernels) -> list[tuple[str, str, str]]:
    """(rows, inner, cols) of every matmul in the loop bodies, after checking that every product is
    well-formed, lands in a tile of the right shape, and reads only tiles that are loaded or computed
    earlier in the same iteration; every declared output must be produced."""
    products = []
    for kernel in kernels:
        available = set(kernel.loads) | set(kernel.state)
        for step in kernel.body + kernel.epilogue:
            inputs = (step.a, step.b) if isinstance(step, MatMul) else step.inputs
            for operand in inputs:
                name = operand[:-2] if operand.endswith("^T") else operand
                if name not in available:
                    raise LoopError(f"{kernel.name}: {step.out} reads {name} before it exists")
            if isinstance(step, MatMul):
                (r, k1), (k2, c) = _shape(step.a), _shape(step.b)
                if k1 != k2 or (r, c) != TILE_SHAPES[step.out]:
                    raise LoopError(f"{kernel.name}: {step.out} = {step.a}·{step.b} has mismatched shapes")
                if step not in kernel.epilogue:
                    products.append((r, k1, c))
            available.add(step.out)
        missing = set(kernel.outputs) - available
        if missing:
            raise LoopError(f"{kernel.name}: never computes {sorted(missing)}")
    return products


def matmul_count(kernels) -> int:
    return len(matmul_shapes(kernels))


def total_flops_symbolic(kernels):
    """Σ over kernels of (tile pairs visited) × Σ_body 2·r·k·c, as a SymPy expression in N, M, d."""
    import sympy as sp

    N, M, d, bm, bn = sp.symbols("N M d block_m block_n", positive=True)
    size = {"block_m": bm, "block_n": bn, "d": d, "1": 1}
    pairs = (N / bm) * (M / bn)  # non-causal: every tile pair is visited
    per_pair = sum(2 * size[r] * size[k] * size[c] for r, k, c in matmul_shapes(kernels))
    return sp.simplify(pairs * per_pair), (N, M, d)
# --8<-- [end:counting]


# The formula itself lives in flashattn.cost (the benchmarks import it from there, without importing
# the derivations); this module derives the counts it uses and checks it.
from flashattn.cost import FORWARD_FLOPS_PER_PAIR_AND_DIM, FORWARD_MATMULS, MODES, attention_flops  # noqa: E402


# --8<-- [start:traffic]
def standard_traffic(n: int, m: int, d: int) -> int:
    """Elements moved by unfused attention: each pass reads its inputs from HBM and writes its output."""
    passes = [
        ((n * d, m * d), n * m),      # S = Q Kᵀ
        ((n * m,), n * m),            # P = softmax(S)
        ((n * m, m * d), n * d),      # O = P V
    ]
    return sum(sum(reads) + write for reads, write in passes)


def tiled_traffic_simulated(n: int, m: int, d: int, block_m: int, block_n: int) -> int:
    """Walk the forward kernel's loops and add up every tile it loads or stores (ragged edges exact)."""
    moved = 0
    for start_m in range(0, n, block_m):
        rows = min(block_m, n - start_m)
        moved += rows * d                       # load Q_i
        for start_n in range(0, m, block_n):
            cols = min(block_n, m - start_n)
            moved += 2 * cols * d               # load K_j, V_j
        moved += rows * d + rows                # store O_i and LSE_i
    return moved


def tiled_traffic(n: int, m: int, d: int, block_m: int) -> int:
    """Closed form: Q and O once, the LSE once, K and V once per query block."""
    query_blocks = -(-n // block_m)
    return 2 * n * d + n + query_blocks * 2 * m * d
# --8<-- [end:traffic]


def _coefficient(kernels) -> object:
    total, (N, M, d) = total_flops_symbolic(kernels)
    import sympy as sp

    return sp.simplify(total / (N * M * d))


def check() -> CheckResult:
    ledger = Ledger()
    # --8<-- [start:proof]
    ledger.claim("forward: 2 well-formed matmuls per tile pair → 4·N·M·d",
                 lambda: matmul_count(FORWARD) == 2 and _coefficient(FORWARD) == 4)
    ledger.claim("backward, one kernel with atomic dQ: 5 matmuls → 10·N·M·d",
                 lambda: matmul_count(BACKWARD_ATOMIC_DQ) == 5 and _coefficient(BACKWARD_ATOMIC_DQ) == 10)
    ledger.claim("backward, two kernels: 4 + 3 = 7 matmuls → 14·N·M·d (S and dP each computed twice)",
                 lambda: [matmul_count(k_) for k_ in [(BACKWARD_TWO_KERNELS[0],), (BACKWARD_TWO_KERNELS[1],)]] == [4, 3]
                 and _coefficient(BACKWARD_TWO_KERNELS) == 14)
    ledger.claim("benchmark convention bwd/fwd = 2.5 = 10/4 (the single-kernel ratio)",
                 lambda: MODES["bwd"] == float(_coefficient(BACKWARD_ATOMIC_DQ) / _coefficient(FORWARD)))
    # --8<-- [end:proof]
    # --8<-- [start:numeric]
    ledger.claim("attention_flops: fwd 4·B·H·N·M·d; causal N = M counts N(N+1)/2 pairs; bwd 2.5×, fwd_bwd 3.5×",
                 lambda: attention_flops(2, 3, 64, 64, 32, causal=False, mode="fwd") == 4 * 2 * 3 * 64 * 64 * 32
                 and attention_flops(1, 1, 64, 64, 32, causal=True, mode="fwd") == 4 * 32 * 64 * 65 // 2
                 and attention_flops(1, 1, 10, 30, 8, causal=True, mode="fwd") == 4 * 8 * (10 * 30 - 10 * 9 // 2)
                 and attention_flops(2, 2, 48, 16, 8, causal=True, mode="bwd")
                 == 2.5 * attention_flops(2, 2, 48, 16, 8, causal=True, mode="fwd")
                 and attention_flops(1, 2, 5, 7, 16, causal=False, mode="fwd_bwd")
                 == 3.5 * attention_flops(1, 2, 5, 7, 16, causal=False, mode="fwd"))
    cases = [(n, m, d, bm, bn) for n, m in [(512, 512), (1000, 777), (64, 4096)] for d in (64, 128)
             for bm, bn in [(64, 64), (128, 64), (128, 32)]]
    ledger.claim("tiled traffic: loop simulation = closed form (18 cases, ragged included)",
                 all(tiled_traffic_simulated(n, m, d, bm, bn) == tiled_traffic(n, m, d, bm) for n, m, d, bm, bn in cases))
    n, d, bm = 4096, 128, 128
    std, tiled = standard_traffic(n, n, d), tiled_traffic(n, n, d, bm)
    ledger.claim(f"N = M = {n}, d = {d}, block_m = {bm}: standard {std:,} vs tiled {tiled:,} elements "
                 f"({std / tiled:.2f}x); standard = 4Nd + 4N²",
                 std == 4 * n * d + 4 * n * n and tiled < std)
    # --8<-- [end:numeric]
    # --8<-- [start:negative]
    dq_kernel_without_dp = Kernel("dQ (no dP)", loads=("Q", "K", "V", "dO", "LSE", "D"), outputs=("dQ",), body=(
        MatMul("S", "Q", "K^T"),
        Elementwise("P", ("S", "LSE")),
        Elementwise("dS", ("P", "dP", "D")),
        MatMul("dQ", "dS", "K", accumulate=True),
    ))
    twelve = (BACKWARD_TWO_KERNELS[0], dq_kernel_without_dp)
    ledger.control("12·N·M·d: its dQ kernel reads dP that it never computes",
                   lambda: _raises(LoopError, lambda: matmul_count(twelve)))
    ledger.control("12·N·M·d ≠ the derived two-kernel count", lambda: _coefficient(BACKWARD_TWO_KERNELS) != 12)
    ledger.control("'K and V are read once': 2Nd + N + 2Md ≠ the simulated traffic",
                   lambda: all(tiled_traffic_simulated(n_, m_, d_, bm_, bn_) != 2 * n_ * d_ + n_ + 2 * m_ * d_
                               for n_, m_, d_, bm_, bn_ in cases if n_ > bm_))
    ledger.control("dQ += dSᵀ K (wrong operand) fails the shape check",
                   lambda: _raises(LoopError, lambda: matmul_count((Kernel("bad", ("Q", "K", "dS"), (
                       MatMul("dQ", "dS^T", "K"),), ("dQ",)),))))
    # --8<-- [end:negative]
    sizes = "symbolic N, M, d, block_m, block_n; traffic 18 cases up to 4096 keys"
    return ledger.result(identity=IDENTITY, method=METHOD, sizes=sizes,
                         negative_control=NEGATIVE, module=__name__)


def _raises(error, fn) -> bool:
    try:
        fn()
    except error:
        return True
    return False
