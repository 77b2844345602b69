"""The project's one cost model for reporting speed: FLOPs per attention call.

The benchmark harness turns times into TFLOP/s with :func:`attention_flops`, and the cost-model page
(:mod:`derivations.cost_model`) derives the same counts from the kernels' loops and checks this
function against them, so the number on the plots and the number on the page cannot drift apart.
Plain integer arithmetic: no torch, no triton.
"""

from __future__ import annotations

# --8<-- [start:flops]
FLOPS_PER_MATMUL_ENTRY = 2  # one multiply and one add per (row, inner, col) triple
FORWARD_MATMULS = 2  # S = Q K^T and O += P V; derivations.cost_model counts them from the loops
FORWARD_FLOPS_PER_PAIR_AND_DIM = FLOPS_PER_MATMUL_ENTRY * FORWARD_MATMULS  # = 4
MODES = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}  # benchmark convention: backward = 2.5 × forward


def visible_pairs(n: int, m: int, causal: bool = True) -> int:
    """Number of (query, key) pairs with ``j <= i + m - n`` (bottom-right causal), or ``n * m``.

    Row ``i`` sees ``clamp(i + m - n + 1, 0, m)`` keys; the sum is ``r (m - r) + r (r + 1) / 2`` with
    ``r = min(n, m)`` (:mod:`derivations.causal_masking` proves it and checks it pair by pair).
    """
    if not causal:
        return n * m
    r = min(n, m)
    return r * (m - r) + r * (r + 1) // 2


def attention_flops(batch: int, heads: int, n: int, m: int, d: int, *, causal: bool, mode: str) -> float:
    """FLOPs the benchmarks report for attention of `batch` × `heads` (n × m) problems of head dim d.

    fwd = 4·batch·heads·n·m·d, times the visible fraction of bottom-right causal masking (pairs with
    j ≤ i + m − n, counted exactly); bwd = 2.5 × fwd and fwd_bwd = 3.5 × fwd by convention, whatever
    the kernel really computes (the cost-model page derives the true backward counts).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
    for name, value in (("batch", batch), ("heads", heads), ("n", n), ("m", m), ("d", d)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    pairs = visible_pairs(n, m, causal)
    return float(FORWARD_FLOPS_PER_PAIR_AND_DIM * batch * heads * pairs * d) * MODES[mode]
# --8<-- [end:flops]
