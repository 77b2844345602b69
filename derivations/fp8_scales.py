# --8<-- [start:statement]
"""Float8 attention: where the descale factors go, and what rounding P to float8 costs.

q, k and v arrive as q₈ = q / a, k₈ = k / b and v₈ = v / c (one factor per batch entry and K/V head).
Attention of the values they stand for is

    softmax(τ (a q₈)(b k₈)ᵀ) (c v₈) = c · softmax((τ a b) q₈ k₈ᵀ) v₈,

so a and b join the score scale and c multiplies the output. The kernel rounds each P entry to e4m3
after multiplying it by 2⁸ (P ≤ 1, so 2⁸ P ≤ 256 < 448, the largest e4m3). e4m3 keeps 4 significant
bits from 2⁻⁶ up, so 2⁸ P is rounded to a relative 2⁻⁴ for P ≥ 2⁻¹⁴, and below that to an absolute
2⁻¹⁰ · 2⁻⁸ = 2⁻¹⁸. With ℓ = Σⱼ exp(sⱼ − max s) the output then obeys, entry by entry,

    |ô − o| ≤ 2⁻⁴ Σⱼ Pⱼ |vⱼ| + 2⁻¹⁸ Σⱼ |vⱼ| / ℓ.
"""
# --8<-- [end:statement]

from __future__ import annotations

import sympy as sp
import torch

from ._common import holds, is_zero_with_exps, symbol_matrix
from ._result import CheckResult, Ledger

IDENTITY = "float8 attention: a, b join the score scale, c the output; rounding 2⁸P to e4m3 costs ≤ 2⁻⁴ΣP|v| + 2⁻¹⁸Σ|v|/ℓ"
METHOD = ("SymPy through the softmax on explicit symbols; every e4m3 rounding of 2⁸P on a dense grid (torch); "
          "the kernel's block walk emulated in float64 on rows flat and peaked")
NEGATIVE = "c folded into the score scale; a and b on the output; P rounded without the 2⁸ factor"
E4M3 = torch.float8_e4m3fn
P_SCALE = 2.0**8


def _softmax_times(q, k, v, scale):
    s = (q * k.T) * scale
    rows = []
    for i in range(s.rows):
        e = [sp.exp(s[i, j]) for j in range(s.cols)]
        rows.append([x / sum(e) for x in e])
    return sp.Matrix(rows) * v


# --8<-- [start:proof]
def folded(q8, k8, v8, a, b, c, tau):
    """What the kernel computes: a and b in the score scale, c on the output."""
    return c * _softmax_times(q8, k8, v8, tau * a * b)


def fold_route(kernel) -> bool:
    a, b, c, tau = sp.symbols("a b c tau", positive=True)
    q8, k8, v8 = symbol_matrix("q", 2, 2), symbol_matrix("k", 3, 2), symbol_matrix("v", 3, 2)
    want = _softmax_times(a * q8, b * k8, c * v8, tau)
    got = kernel(q8, k8, v8, a, b, c, tau)
    return holds(lambda: all(is_zero_with_exps(sp.expand(got[i, j] - want[i, j]))
                             for i in range(want.rows) for j in range(want.cols)))


def _round(p: torch.Tensor, scale: float) -> torch.Tensor:
    """p (float64) rounded as the kernel rounds it: times ``scale``, to e4m3, divided back."""
    return (p * scale).to(torch.float32).to(E4M3).to(torch.float64) / scale


def rounding_route(scale: float) -> bool:
    """Every p on a dense grid of [2^-30, 1]: relative error <= 2^-4 from 2^-14 up, absolute <= 2^-18 below."""
    p = torch.logspace(-30, 0, 200_001, base=2.0, dtype=torch.float64)
    p = torch.cat([p, torch.tensor([2.0**-14, 0.99, 1.0], dtype=torch.float64)])
    err = (_round(p, scale) - p).abs()
    big = p >= 2.0**-14
    return bool((err[big] <= 2.0**-4 * p[big]).all() and (err[~big] <= 2.0**-18).all())
# --8<-- [end:proof]


# --8<-- [start:numeric]
def emulated_row(s: torch.Tensor, v: torch.Tensor, scale: float, block: int = 64) -> torch.Tensor:
    """One output row as the kernel walks it: key blocks, a running max, P rounded per block."""
    m, ell, acc = torch.tensor(float("-inf"), dtype=torch.float64), 0.0, torch.zeros(v.shape[1], dtype=torch.float64)
    for start in range(0, s.numel(), block):
        blk = s[start:start + block]
        m_new = torch.maximum(m, blk.max())
        p = torch.exp(blk - m_new)
        alpha = torch.exp(m - m_new)
        ell = ell * alpha + p.sum()
        acc = acc * alpha + _round(p, scale) @ v[start:start + block]
        m = m_new
    return acc / ell


def _rows(seed: int):
    """Rows of 4096 scores with values: random, flat to peaked; and one key with P far above 4095 keys
    at exp(s) = 1.4 * 2^-10 of it, values all 1, where rounding errors of the small entries add up."""
    g = torch.Generator().manual_seed(seed)
    for spread in (0.05, 1.0, 3.0, 8.0):
        for _ in range(3):
            yield (torch.randn(4096, generator=g, dtype=torch.float64) * spread,
                   torch.randn(4096, 8, generator=g, dtype=torch.float64))
    s = torch.full((4096,), torch.log(torch.tensor(1.4 * 2.0**-10, dtype=torch.float64)).item(), dtype=torch.float64)
    s[0] = 0.0
    yield s, torch.ones(4096, 8, dtype=torch.float64)


def bound_route(scale: float, seed: int = 5) -> bool:
    """The emulated error within the bound at every entry of every row of :func:`_rows`."""
    for s, v in _rows(seed):
        p = torch.softmax(s, 0)
        ell = torch.exp(s - s.max()).sum()
        bound = 2.0**-4 * (p @ v.abs()) + 2.0**-18 * v.abs().sum(0) / ell
        if not ((emulated_row(s, v, scale) - p @ v).abs() <= bound * (1 + 1e-9)).all():
            return False
    return True
# --8<-- [end:numeric]


def check() -> CheckResult:
    ledger = Ledger()
    ledger.claim("softmax(τ(a q₈)(b k₈)ᵀ)(c v₈) = c softmax(τab q₈k₈ᵀ) v₈, explicit symbols 2x2, 3x2",
                 lambda: fold_route(folded))
    ledger.claim("2⁸p to e4m3: relative error ≤ 2⁻⁴ for p ≥ 2⁻¹⁴, absolute ≤ 2⁻¹⁸ below (200,004 values)",
                 lambda: rounding_route(P_SCALE))
    ledger.claim("the kernel's walk emulated on 13 rows of 4096 keys: every entry within the bound",
                 lambda: bound_route(P_SCALE))
    # --8<-- [start:negative]
    c_in_scale = lambda q8, k8, v8, a, b, c, tau: _softmax_times(q8, k8, v8, tau * a * b * c)
    ab_outside = lambda q8, k8, v8, a, b, c, tau: a * b * c * _softmax_times(q8, k8, v8, tau)
    ledger.control("c folded into the score scale", lambda: not fold_route(c_in_scale))
    ledger.control("a and b multiply the output", lambda: not fold_route(ab_outside))
    ledger.control("P rounded without the 2⁸ factor: the rounding claim", lambda: not rounding_route(1.0))
    ledger.control("P rounded without the 2⁸ factor: the bound on the walk", lambda: not bound_route(1.0))
    # --8<-- [end:negative]
    return ledger.result(identity=IDENTITY, method=METHOD,
                         sizes="symbols q 2x2, k and v 3x2; 200,004 values of p; 13 rows x 4096 keys x 8",
                         negative_control=NEGATIVE, module=__name__)
