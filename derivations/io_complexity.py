# --8<-- [start:statement]
"""I/O complexity: how many elements standard and tiled attention move between HBM and the chip.

Counted as FlashAttention 1's analysis counts them: every tile a kernel loads or stores is an HBM
access (the model ignores the L2 cache). With N queries, M keys, head dim d:

* standard attention writes S and P and reads them back: 4·N·M + 2·N·d + 2·M·d elements
  (Θ(N·d + N²) for N = M);
* the tiled forward reads Q once, K and V once per query block, and writes O and the LSE:
  2·N·d + N + ⌈N/block_m⌉·2·M·d;
* the tiled backward (δ preprocess, dK/dV kernel, dQ kernel) reads Q, dO, LSE₂, δ once per key block
  in dK/dV and K, V once per query block in dQ: ⌈M/block_n⌉·2·N·(d + 1) + ⌈N/block_m⌉·2·M·d plus
  terms linear in N and M.

The block that the inner loop re-reads against is bounded by on-chip memory: a query block of
block_m rows keeps its Q tile and its float32 accumulator (2·block_m·d) beside the K, V and score
tiles, so with S_sram elements of on-chip memory block_m = Θ(S_sram/d) and the traffic is
Θ(N·M·d²/S_sram), FlashAttention 1's Θ(N²d²/M) with its M the on-chip size. Whether that is fewer
elements than standard attention depends on d/block_m: it is when d < 2·block_m, and it is not for
d = 256 with block_m = 64, a configuration of this package's own table for GPUs before Hopper. The
memory the tiled kernels need beyond inputs and outputs stays O(N) either way (the LSE and δ).
"""
# --8<-- [end:statement]

from __future__ import annotations

from flashattn import schedule

from ._result import CheckResult, Ledger

IDENTITY = "I/O complexity: standard Θ(Nd + N²) vs tiled Θ(N²d²/S_sram), forward and backward, from the schedule"
METHOD = ("tile loads and stores counted by walking flashattn.schedule (causal and not, ragged); closed forms; "
          "block sizes from an SRAM budget; the package's config tables")
NEGATIVE = ("'K and V are read once'; 'tiled always moves fewer elements than standard' (d < 2·block_m "
            "for every configuration)")


# --8<-- [start:traffic]
def standard_traffic(n: int, m: int, d: int) -> int:
    """Elements moved by unfused attention: each pass reads its inputs from HBM and writes its output."""
    passes = [
        ((n * d, m * d), n * m),      # S = Q Kᵀ
        ((n * m,), n * m),            # P = softmax(S)
        ((n * m, m * d), n * d),      # O = P V
    ]
    return sum(sum(reads) + write for reads, write in passes)


def forward_traffic(n, m, d, block_m, block_n, causal=False) -> int:
    """Walk the forward kernel's schedule and add up every tile it loads or stores (ragged edges exact)."""
    moved = 0
    for start_m in range(0, n, block_m):
        rows = min(block_m, n - start_m)
        moved += rows * d                                   # load Q_i
        _, hi = schedule.forward_key_range(start_m, block_m, block_n, n, m, causal)
        for start_n in range(0, hi, block_n):
            moved += 2 * min(block_n, m - start_n) * d      # load K_j, V_j
        moved += rows * d + rows                            # store O_i and LSE_i
    return moved


def backward_traffic(n, m, d, block_m, block_n, causal=False) -> int:
    """The three backward kernels: δ preprocess, dK/dV (walks query blocks), dQ (walks key blocks)."""
    moved = 2 * n * d + n + 2 * n                           # read O, dO, LSE; write δ, LSE₂
    for start_n in range(0, m, block_n):                    # dK/dV kernel
        cols = min(block_n, m - start_n)
        moved += 2 * cols * d                               # load K_j, V_j
        lo, _, _ = schedule.backward_query_range(start_n, block_m, block_n, n, m, causal)
        for start_m in range(lo, n, block_m):
            rows = min(block_m, n - start_m)
            moved += 2 * rows * d + 2 * rows                # load Q_i, dO_i, LSE₂_i, δ_i
        moved += 2 * cols * d                               # store dK_j, dV_j
    for start_m in range(0, n, block_m):                    # dQ kernel
        rows = min(block_m, n - start_m)
        moved += 2 * rows * d + 2 * rows                    # load Q_i, dO_i, LSE₂_i, δ_i
        _, hi = schedule.forward_key_range(start_m, block_m, block_n, n, m, causal)
        for start_n in range(0, hi, block_n):
            moved += 2 * min(block_n, m - start_n) * d      # load K_j, V_j
        moved += rows * d                                   # store dQ_i
    return moved


def forward_closed(n, m, d, block_m) -> int:
    return 2 * n * d + n + -(-n // block_m) * 2 * m * d


def backward_closed(n, m, d, block_m, block_n) -> int:
    preprocess = 2 * n * d + 3 * n
    dkdv = 4 * m * d + -(-m // block_n) * 2 * n * (d + 1)
    dq = 3 * n * d + 2 * n + -(-n // block_m) * 2 * m * d
    return preprocess + dkdv + dq


def largest_block_m(sram: int, d: int, block_n: int = 16) -> int:
    """The largest block_m (a multiple of 16) whose forward working set fits `sram` elements: the Q tile
    and float32 accumulator (2·block_m·d), the K and V tiles (2·block_n·d), the score tile, the row state."""
    best = 0
    for bm in range(16, 1 << 16, 16):
        if 2 * bm * d + 2 * block_n * d + bm * block_n + 2 * bm > sram:
            break
        best = bm
    return best


def config_block_ms():
    """(table, kernel, block_d, block_m) of every forward entry in flashattn._config's tables."""
    from flashattn import _config

    out = []
    for table_name in ("_SM90", "_SM90_WINDOW", "_SM90_DROPOUT", "_DEFAULT"):
        for (kernel, block_d), entry in getattr(_config, table_name).items():
            if kernel != "fwd":
                continue
            entries = entry if isinstance(entry, tuple) else (entry,)
            for e in entries:
                for cfg in ((e.short, e.long) if isinstance(e, _config.ByLength) else (e,)):
                    out.append((table_name, kernel, block_d, cfg.block_m))
    return out
# --8<-- [end:traffic]


# --8<-- [start:proof]
def theta_symbolic() -> bool:
    """With block_m = κ·S_sram/d (a fixed fraction κ of on-chip memory per row of d), the forward's
    closed form times S_sram/(N²d²) tends to 2/κ as N = M → ∞: Θ(N²d²/S_sram), and standard attention's
    count over N² tends to 4: Θ(N²)."""
    import sympy as sp

    n, d, sram, kappa = sp.symbols("N d S_sram kappa", positive=True)
    block_m = kappa * sram / d
    forward = 2 * n * d + n + (n / block_m) * 2 * n * d        # ⌈N/block_m⌉ → N/block_m for large N
    standard = 4 * n * n + 4 * n * d
    return (sp.limit(sp.simplify(forward * sram / (n ** 2 * d ** 2)), n, sp.oo) == 2 / kappa
            and sp.limit(standard / n ** 2, n, sp.oo) == 4)
# --8<-- [end:proof]


def check() -> CheckResult:
    ledger = Ledger()
    ledger.claim("symbolic: block_m = κ·S_sram/d gives forward traffic·S_sram/(N²d²) → 2/κ; standard/N² → 4",
                 theta_symbolic)
    # --8<-- [start:numeric]
    cases = [(n, m, d, bm, bn) for n, m in [(512, 512), (1000, 777), (64, 4096), (37, 5)] for d in (64, 72)
             for bm, bn in [(64, 64), (128, 64), (16, 32)]]
    ledger.claim(f"forward: schedule walk = 2Nd + N + ⌈N/block_m⌉·2Md ({len(cases)} cases, ragged included)",
                 all(forward_traffic(*c) == forward_closed(*c[:4]) for c in cases))
    ledger.claim(f"backward: schedule walk = closed form ({len(cases)} cases)",
                 all(backward_traffic(*c) == backward_closed(*c) for c in cases))
    ledger.claim("standard = 4NM + 2Nd + 2Md", all(standard_traffic(n, m, d) == 4 * n * m + 2 * n * d + 2 * m * d
                                                   for n, m, d, _, _ in cases))
    n = 8192
    tiles = [(128, 64), (64, 64)]  # (block_m, block_n) of the forward and the backward walked here
    ratios = [forward_traffic(n, n, 64, *tiles[0], True) / forward_traffic(n, n, 64, *tiles[0]),
              backward_traffic(n, n, 64, *tiles[1], True) / backward_traffic(n, n, 64, *tiles[1])]
    ledger.claim(f"causal N = M = {n}: the skipped tiles cut forward traffic to {ratios[0]:.3f} and backward to "
                 f"{ratios[1]:.3f} of non-causal (between 1/2 and 1/2 + (block_m + block_n)/N)",
                 all(0.5 < r < 0.5 + (bm + bn) / n for r, (bm, bn) in zip(ratios, tiles)))
    # Θ(N²d²/S_sram): traffic × S_sram / (N² d²) stays within a constant band over a 16× range of SRAM
    # sizes and a 4× range of d, while d ≤ block_m ≤ N/8 (the N²-term dominates).
    band = []
    big = 16384
    for d in (32, 64, 128):
        for sram in (1 << 15, 1 << 16, 1 << 17, 1 << 18, 1 << 19):
            bm = largest_block_m(sram, d, block_n=64)
            if d <= bm <= big // 8:
                band.append((d, forward_traffic(big, big, d, bm, 64) * sram / (big ** 2 * d ** 2)))
    values = [v for _, v in band]
    ledger.claim(f"forward traffic × S_sram/(N²d²) ∈ [{min(values):.2f}, {max(values):.2f}] over {len(band)} "
                 f"(d, S_sram) pairs with block_m sized to S_sram: Θ(N²d²/S_sram)",
                 len(band) >= 8 and max(values) / min(values) < 2)
    n, d = 4096, 256
    (bm_256,) = {bm for table, _, bd, bm in config_block_ms() if table == "_DEFAULT" and bd == 256}
    tiled, std = forward_traffic(n, n, d, bm_256, 32), standard_traffic(n, n, d)
    ledger.claim(f"non-Hopper table, d = 256: block_m = {bm_256}, N = M = {n}: tiled {tiled:,} > standard {std:,} "
                 f"elements ({tiled / std:.2f}×); with block_m = 128, d = 128 tiled is {forward_traffic(n, n, 128, 128, 64) / standard_traffic(n, n, 128):.2f}× standard",
                 tiled > std and forward_traffic(n, n, 128, 128, 64) < standard_traffic(n, n, 128))
    # --8<-- [end:numeric]
    # --8<-- [start:negative]
    ledger.control("'K and V are read once': 2Nd + N + 2Md ≠ the schedule walk",
                   all(forward_traffic(*c) != 2 * c[0] * c[2] + c[0] + 2 * c[1] * c[2] for c in cases if c[0] > c[3]))
    ledger.control("'d < 2·block_m holds for every configuration' is false for the package's own tables",
                   lambda: any(bd >= 2 * bm for _, _, bd, bm in config_block_ms()))
    ledger.control("a traffic of Θ(N²d/S_sram) (one d too few) drifts out of any constant band",
                   lambda: max(v * d_ for d_, v in band) / min(v * d_ for d_, v in band) > 2)
    # --8<-- [end:negative]
    sizes = (f"{len(cases)} (N, M, d, block) cases up to 4096 keys; N = M = 8192 causal; N = 16384, "
             f"S_sram 32k–512k elements")
    return ledger.result(identity=IDENTITY, method=METHOD, sizes=sizes,
                         negative_control=NEGATIVE, module=__name__)
