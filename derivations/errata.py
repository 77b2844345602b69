# --8<-- [start:statement]
"""Errata: claims in the write-ups this project started from ("seeds") that a check shows to be wrong.

Each entry names its seed and passage; the passage itself is stored once, in
``derivations.seed_passages``, and the checks parse or evaluate that stored text. Entries whose
subject has a Math page (dropout, the cost model, masked loads) are decided by that page's check;
the others by ``check()`` below, which ``python -m derivations`` runs like every other module:

* tr(ABC) = tr(CBA) (seed 003): only the cyclic shifts ABC, BCA, CAB share a trace;
* exp(τS − rowmax(S)) (seed 003's equations): exact in real arithmetic, but the shift is the max of
  the *unscaled* scores, so scores near −400 with τ = 1/4 give exponents near 300 and float32 inf;
* dQ = dS K (seed 003's text): with S = τQKᵀ the gradient is τ dS K;
* "l inflated by 1 for every invalid position" (seed 004): a zero-scored pad adds 2^(−m) to
  l = Σ 2^(s − m); 1 only when the running max m is 0;
* "N_CTX must be a multiple of 32" (seed 002's text) where its assertion wants 128;
* "D (= delta) is pre-divided by ds_scale" (seeds 000, 002, a comment): the code divides nothing,
  and rightly: dS = P ∘ (dP − δ) needs δ undivided;
* "the δ identity removes the need to store P" (seed 001): recomputing P from the stored LSE does
  that; the identity only turns rowsum(P ∘ dP) into rowsum(dO ∘ O), a preprocessing pass.

Only claims a seed makes belong here. Plausible slips that no seed makes are negative controls on
the Math pages instead. Fields of an entry: ``title``, ``source`` (seed and passage), ``claim`` and
``correction`` (Markdown with ``\\(...\\)`` math), ``check`` (``module:function``), ``evidence`` (a
claim or control as it appears in that check's details) and ``verdict`` ("rejected": the claim is
a negative control the check rejects; "holds": the correction is a claim that holds).
"""
# --8<-- [end:statement]

from __future__ import annotations

import itertools
import math
import re
from dataclasses import asdict, dataclass
from fractions import Fraction

from ._result import CheckResult, Ledger
from .cost_model import SEED_004_CONTROL
from .seed_passages import (COST_004, DQ_003, DROPOUT_003, INFLATED_004, MAX_003, NCTX_002_CODE,
                            NCTX_002_TEXT, PREDIVIDED_000_002, STORE_P_001, TRACE_003, ZERO_PADDED_004,
                            to_python, trailing_number)

IDENTITY = "errata: seven seed passages (traces, the max shift, dQ's scale, pad inflation, N_CTX, δ's scale, storing P)"
METHOD = ("each seed passage parsed or evaluated from derivations/seed_passages.py; SymPy symbol matrices (traces), "
          "float32/float64 numpy and torch autograd, exact base-2 rationals")
NEGATIVE = "each seed passage, evaluated as stored, against the claim that holds"


# --8<-- [start:proof]
def trace_orders(passage: str) -> tuple[str, str]:
    """"tr(ABC) = tr(CBA)" → ("ABC", "CBA")."""
    left, right = re.findall(r"tr\((\w+)\)", passage)
    return left, right


def orders_with_the_same_trace(order: str = "ABC", n: int = 2) -> set[str]:
    """Every ordering of the letters of `order` whose product has the trace of `order`'s, decided on
    n × n matrices of independent symbols (a polynomial identity, so exact)."""
    import sympy as sp

    from ._common import symbol_matrix

    mats = {c: symbol_matrix(c.lower(), n, n) for c in order}
    trace = lambda o: sp.expand(math.prod((mats[c] for c in o[1:]), start=mats[o[0]]).trace())
    ref = trace(order)
    return {"".join(p) for p in itertools.permutations(order) if sp.expand(trace("".join(p)) - ref) == 0}


def trace_numeric(left: str, right: str, seed: int = 0, n: int = 5) -> float:
    """|tr(left) − tr(right)| relative to |tr(left)| on random n × n float64 matrices."""
    import numpy as np

    rng = np.random.default_rng(seed)
    mats = {c: rng.standard_normal((n, n)) for c in set(left + right)}
    tr = lambda o: np.trace(np.linalg.multi_dot([mats[c] for c in o]))
    return abs(tr(left) - tr(right)) / abs(tr(left))
# --8<-- [end:proof]


# --8<-- [start:numeric]
MAX_CASE = dict(scores=[-404.0, -402.0, -400.0], tau=0.25)


def shifted_exponents(passage: str, scores, tau, dtype):
    """The exponent and exp of a passage written as exp(...), evaluated as stored on one row."""
    import numpy as np

    expr = to_python(passage).split("=", 1)[-1].strip()
    inner = expr[expr.index("exp(") + 4:expr.rindex(")")]
    env = {"tau": dtype(tau), "S": np.array([scores], dtype=dtype),
           "rowmax": lambda A: A.max(-1, keepdims=True), "exp": np.exp}
    with np.errstate(over="ignore"):
        return eval(inner, {"__builtins__": {}}, env), eval(expr, {"__builtins__": {}}, env)  # noqa: S307


def softmax_from(weights):
    import numpy as np

    with np.errstate(invalid="ignore"):
        return weights / weights.sum(-1, keepdims=True)


def attention_grads(seed: int = 0, n: int = 4, m: int = 6, d: int = 8):
    """float64 autograd through O = softmax(τQKᵀ)V: (Q, K, dS, dQ, τ, δ, P, dP)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(n, d, generator=gen, dtype=torch.float64), torch.randn(m, d, generator=gen, dtype=torch.float64)
    v, do = torch.randn(m, d, generator=gen, dtype=torch.float64), torch.randn(n, d, generator=gen, dtype=torch.float64)
    q.requires_grad_()
    tau = d ** -0.5
    s = tau * q @ k.T
    s.retain_grad()
    p = s.softmax(-1)
    o = p @ v
    (o * do).sum().backward()
    dp = do @ v.T
    delta = (do * o.detach()).sum(-1, keepdim=True)
    return dict(Q=q.detach(), K=k, dS=s.grad, dQ=q.grad, tau=tau, delta=delta, P=p.detach(), dP=dp)


def eval_matrix_passage(passage: str, env: dict):
    """Evaluate the right-hand side of a passage "x = ..." as stored."""
    rhs = to_python(passage).split("=", 1)[1]
    return eval(rhs, {"__builtins__": {}}, env)  # noqa: S307 - our own stored strings


INFLATION_CASES = [([3, 1, 2], 2), ([-2, -5, -3], 2), ([0, -1], 3)]  # (integer base-2 scores, zero pads)


def inflation(scores, pads) -> tuple[Fraction, int]:
    """(growth of l = Σ 2^(s − m) when `pads` zero-scored keys join the row, the row's max m), exact."""
    m_real = max(scores)
    m = max(m_real, 0)  # the pads' 0 joins the max
    l_real = sum(Fraction(2) ** (s - m) for s in scores)
    l_padded = l_real + pads * Fraction(2) ** (0 - m)
    return l_padded - l_real, m


def seed_inflation_per_pad(passage: str) -> int:
    """"l inflated by 1 for every invalid position" → 1."""
    return int(re.search(r"inflated by (\d+)", passage).group(1))


def nctx_allowed_by_text_refused_by_code(limit: int = 512) -> list[int]:
    step = trailing_number(NCTX_002_TEXT.text)
    return [n for n in range(step, limit + 1, step)
            if not eval(NCTX_002_CODE.text, {"__builtins__": {}}, {"N_CTX": n})]  # noqa: S307


def ds_with_delta_divided(g: dict, divisor: float):
    """dS = P ∘ (dP − δ / divisor): the comment's "pre-divided" δ (divisor 1: the code, which divides nothing)."""
    return g["P"] * (g["dP"] - g["delta"] / divisor)


def recompute_p_from_lse(g: dict):
    """P = exp(S − LSE) from Q, K and one stored number per row: what removes the need to store P."""
    import torch

    s = g["tau"] * g["Q"] @ g["K"].T
    lse = torch.logsumexp(s, -1, keepdim=True)
    return torch.exp(s - lse)
# --8<-- [end:numeric]


# The control lines the Errata page quotes (one constant each, so page and check cannot drift).
TRACE_CONTROL = f"seed 003's '{TRACE_003.text}' on 2×2 symbol matrices and random 5×5 float64 matrices"
MAX_CONTROL = (f"seed 003's shift {MAX_003.text} with scores −404…−400, τ = 1/4, float32: exponents "
               "{lo:.0f}…{hi:.0f} overflow to inf and P is NaN")
DQ_CONTROL = f"seed 003's '{DQ_003.text}' against float64 autograd with τ = 1/√8"
INFLATION_CONTROL = f"seed 004's '{INFLATED_004.text}' against exact base-2 sums with running max m ≠ 0"
NCTX_CONTROL = f"seed 002's '{NCTX_002_TEXT.text}' against its assertion '{NCTX_002_CODE.text}'"
PREDIVIDED_CONTROL = (f"seeds 000/002's '{PREDIVIDED_000_002.text}': δ divided by ds_scale ∈ {{2, 1/2, τ}} is "
                      "not the gradient (float64 autograd)")
STORE_P_CONTROL = (f"seed 001's '{STORE_P_001.text}': dS = P ∘ (dP − δ) with the right δ but without P "
                   "(P replaced by its row mean) is not the gradient")


def check() -> CheckResult:
    import numpy as np
    import torch

    ledger = Ledger()
    left, right = trace_orders(TRACE_003.text)
    same = orders_with_the_same_trace(left)
    ledger.claim(f"the orders of {left} whose trace equals tr({left}) on 2×2 symbol matrices: "
                 f"{', '.join(sorted(same))} (the cyclic shifts)", same == {left[i:] + left[:i] for i in range(3)})
    ledger.claim(f"cyclic shifts on random 5×5 float64: |tr({left}) − tr({left[1:] + left[0]})| / |tr({left})| "
                 f"= {trace_numeric(left, left[1:] + left[0]):.0e}", trace_numeric(left, left[1:] + left[0]) < 1e-12)

    exps32, w32 = shifted_exponents(MAX_003.text, **MAX_CASE, dtype=np.float32)
    right_shift = np.float32(MAX_CASE["tau"]) * np.array([MAX_CASE["scores"]], np.float32)
    right_shift = right_shift - right_shift.max(-1, keepdims=True)
    exact = softmax_from(np.exp(np.float64(MAX_CASE["tau"]) * np.array([MAX_CASE["scores"]])))
    ledger.claim(f"shifting by the max of the scaled scores: exponents {right_shift.min():.1f}…{right_shift.max():.1f} "
                 "≤ 0, float32 softmax equals float64", bool(np.allclose(softmax_from(np.exp(right_shift)), exact,
                                                                            rtol=1e-6)))
    g = attention_grads()
    ledger.claim("dQ = τ dS K equals float64 autograd (τ = 1/√8)",
                 torch.allclose(g["tau"] * g["dS"] @ g["K"], g["dQ"], atol=1e-12))
    growth = [(inflation(s, n), n) for s, n in INFLATION_CASES]
    ledger.claim("each zero-scored pad adds exactly 2^(−m) to l = Σ 2^(s − m) (exact rationals): "
                 + "; ".join(f"m = {m}: {n} pads add {str(x)}" for (x, m), n in growth),
                 all(x == n * Fraction(2) ** (-m) for (x, m), n in growth))
    ledger.claim(f"'{NCTX_002_CODE.text}' implies '{NCTX_002_TEXT.text}' (the assertion is the stricter rule)",
                 all(n % trailing_number(NCTX_002_TEXT.text) == 0 for n in range(0, 4097, 128)))
    ledger.claim("δ = rowsum(dO ∘ O) undivided gives dS = P ∘ (dP − δ) equal to float64 autograd",
                 torch.allclose(ds_with_delta_divided(g, 1.0), g["dS"], atol=1e-12))
    ledger.claim("P = exp(S − LSE) from Q, K and the N stored LSEs equals the forward's P (float64)",
                 torch.allclose(recompute_p_from_lse(g), g["P"], atol=1e-14))
    # --8<-- [start:negative]
    ledger.control(TRACE_CONTROL, lambda: right not in same and trace_numeric(left, right) > 1e-3)
    lo, hi = float(exps32.min()), float(exps32.max())
    ledger.control(MAX_CONTROL.format(lo=lo, hi=hi),
                   lambda: lo > 88.8 and bool(np.isinf(w32).all()) and bool(np.isnan(softmax_from(w32)).all()))
    seed_dq = eval_matrix_passage(DQ_003.text, {"dS": g["dS"], "K": g["K"], "tau": g["tau"]})
    ledger.control(DQ_CONTROL, lambda: not torch.allclose(seed_dq, g["dQ"], atol=1e-6))
    ledger.control(INFLATION_CONTROL, lambda: any(x != n * seed_inflation_per_pad(INFLATED_004.text)
                                                  for (x, m), n in growth if m != 0))
    refused = nctx_allowed_by_text_refused_by_code()
    ledger.control(NCTX_CONTROL + f": {len(refused)} lengths ≤ 512 it allows are refused ({', '.join(map(str, refused[:3]))}, …)",
                   lambda: len(refused) > 0)
    ledger.control(PREDIVIDED_CONTROL, lambda: not any(torch.allclose(ds_with_delta_divided(g, c), g["dS"], atol=1e-6)
                                                       for c in (2.0, 0.5, g["tau"])))
    ledger.control(STORE_P_CONTROL, lambda: not torch.allclose(
        g["P"].mean(-1, keepdim=True) * (g["dP"] - g["delta"]), g["dS"], atol=1e-6))
    # --8<-- [end:negative]
    return ledger.result(identity=IDENTITY, method=METHOD,
                         sizes="traces 2×2 symbolic and 5×5; one row of 3 scores; attention 4×6, d = 8; "
                               "3 padded rows; N_CTX ≤ 512",
                         negative_control=NEGATIVE, module=__name__)


# ------------------------------------------------------------------------------------------ entries
@dataclass(frozen=True)
class Erratum:
    title: str
    source: str
    claim: str
    correction: str
    check: str       # "derivations.<module>:<function>"
    evidence: str    # a claim or control name, as it appears in the check's details
    verdict: str     # "rejected" or "holds"

    def to_dict(self) -> dict:
        return asdict(self)


def _quote(passage) -> str:
    return f"“{passage.text}”"


ERRATA = [
    Erratum(
        title="With dropout, the mask and 1/keep enter dS twice",
        source=DROPOUT_003.cite,
        claim=(r"The backward sets \(P \leftarrow \tilde P = P \circ Z/\text{keep}\) (keep \(= 1 - p_{\text{drop}}\)), "
               r"rescales \(dP \leftarrow dP \circ Z/\text{keep}\), then forms "
               r"\(dS = \tilde P \circ (dP - \operatorname{rowsum}(dP \circ \tilde P))\); stored as "
               + f"`{DROPOUT_003.text}`."),
        correction=(r"\(dS = P \circ (dP - \delta)\) with the *undropped* \(P\), \(dP = d\tilde P \circ Z/\text{keep}\) "
                    r"and \(\delta = \operatorname{rowsum}(P \circ dP) = \operatorname{rowsum}(dO \circ O)\). Since "
                    r"\(Z \circ Z = Z\), the seed's steps give \(dS_{\text{seed}} = (Z/\text{keep}) \circ P \circ "
                    r"(dP - \delta/\text{keep})\): zero on every dropped entry, where the true \(dS_{ij} = -P_{ij}\delta_i\), "
                    r"and \(1/\text{keep}\) times \(P \circ (dP - \delta/\text{keep})\) on the kept ones. The two agree "
                    r"only when \(p_{\text{drop}} = 0\), which is why a run with `dropout_p = 0` does not show it. The "
                    r"dropout check evaluates the stored steps and compares them with SymPy derivatives, 40-digit "
                    r"central differences and float64 autograd."),
        check="derivations.dropout:check",
        evidence="seed 003, App. B: dS = P̃ ∘ (dP − rowsum(dP ∘ P̃)) after P ← P̃, dP ← dP ∘ Z/keep: torch",
        verdict="rejected",
    ),
    Erratum(
        title="The two-kernel backward costs 14N²d, not 12N²d",
        source=COST_004.cite,
        claim=f"The heading {_quote(COST_004)} prices the backward in two kernels at \\(12N^2d\\) FLOPs.",
        correction=(r"Two kernels issue 4 + 3 = 7 products per tile, \(14N^2d\): the dK/dV kernel forms \(S\), \(dP\), "
                    r"\(dV\), \(dK\), and the dQ kernel must form \(S\) and \(dP\) again before \(dQ\). \(12N^2d\) leaves "
                    r"out the dQ kernel's \(dP\). The cost model counts the `tl.dot` calls of this package's kernels "
                    r"and parses the seed's figure from its heading."),
        check="derivations.cost_model:check",
        evidence=SEED_004_CONTROL,
        verdict="rejected",
    ),
    Erratum(
        title="Masked loads without other= are not guaranteed to be zero-padded",
        source=ZERO_PADDED_004.cite,
        claim=(r"The per-row LSE and \(\Delta\) are loaded with a mask and no `other=`, and the text calls them "
               + _quote(ZERO_PADDED_004) + r"; its `boundary_check` loads leave `padding_option` at its default."),
        correction=(r"**Guaranteed:** nothing. Triton documents the masked-off value of a `tl.load` without `other=` "
                    r"as undefined, and a block-pointer load's default `padding_option=\"\"` names no value "
                    r"(only `\"zero\"` and `\"nan\"` do). **Observed:** Triton's interpreter fills zeros, and the GPU "
                    r"backends happen to; the check reads the documentation sentence and the interpreter's source "
                    r"from the installed Triton. If a lane held anything else, the recomputed \(P = 2^{S_2 - "
                    r"\mathrm{LSE}_2}\) would use it: the check puts \(-200\), NaN and \(-3\cdot 10^{38}\) there itself, "
                    r"and \(dK\), \(dV\) of the block come out NaN. Pass `other=0.0` (or `padding_option=\"zero\"`). "
                    r"This package does on every masked load whose value it computes with; the two exceptions, "
                    r"the appended key and value rows of the decoding append kernel "
                    r"(`flashattn/decode_kernels.py`), go straight to a `tl.store` under the same mask, so their "
                    r"masked-off lanes are never written. The check reads every file under `flashattn/` and fails "
                    r"on any other load without `other=`. An explicit row mask on \(P\) is not a substitute: a NaN "
                    r"\(\delta\) lane still gives \(dS = 0\cdot(0 - \text{NaN}) = \text{NaN}\). The seed's other "
                    r"argument, that padding rows *inside* the sequence need no mask because their \(dO = 0\), is "
                    r"right: they have a real LSE, so \(P \le 1\)."),
        check="derivations.masking_hazards:check",
        evidence=(f"d: '{ZERO_PADDED_004.text}' (seed 004) is not guaranteed: if a masked-off LSE₂ lane held "
                  "−200, NaN or −3e38 (put there by this check), the unmasked dK/dV would be NaN"),
        verdict="rejected",
    ),
    Erratum(
        title="Only cyclic shifts leave a trace unchanged",
        source=TRACE_003.cite,
        claim=f"{_quote(TRACE_003)}.",
        correction=(r"\(\operatorname{tr}(ABC) = \operatorname{tr}(BCA) = \operatorname{tr}(CAB)\), and in general no "
                    r"other order: on \(2\times 2\) symbol matrices the check finds exactly the three cyclic shifts, "
                    r"and \(\operatorname{tr}(CBA)\) differs from \(\operatorname{tr}(ABC)\) on random matrices. "
                    r"(For symmetric \(A, B, C\) the reversed product has the same trace, since "
                    r"\(\operatorname{tr}(X) = \operatorname{tr}(X^\top)\); attention's matrices are not symmetric.)"),
        check="derivations.errata:check", evidence=TRACE_CONTROL, verdict="rejected",
    ),
    Erratum(
        title="The softmax shift must be the max of the scaled scores",
        source=MAX_003.cite,
        claim=(r"The equations subtract the row max of the unscaled scores from the scaled ones, "
               + f"`{MAX_003.text}` (its code subtracts the max of the scaled scores)."),
        correction=(r"In exact arithmetic any shift cancels in the normalisation ([online softmax](math/online-softmax.md)), "
                    r"but the shift exists to keep exponents \(\le 0\): it must be \(\max_j \tau s_j\). With scores "
                    r"\(-404 \ldots -400\) and \(\tau = 1/4\) the seed's exponents are \(\tau s - \max s = 299 \ldots 300\), "
                    r"far above float32's limit of about 88.7, so every weight is inf and \(P\) is NaN; shifted by "
                    r"\(\max \tau s\) the exponents are \(-1 \ldots 0\) and float32 matches float64."),
        check="derivations.errata:check",
        evidence=MAX_CONTROL.format(lo=299, hi=300), verdict="rejected",
    ),
    Erratum(
        title="dQ carries the softmax scale",
        source=DQ_003.cite,
        claim=f"The text gives `{DQ_003.text}` for scores \\(S = \\tau QK^\\top\\).",
        correction=(r"\(dQ = \tau\, dS\, K\) and \(dK = \tau\, dS^\top Q\) ([where the scale goes](math/softmax-scale.md)). "
                    r"Without \(\tau\) the gradient is \(1/\tau = \sqrt{d}\) times too large."),
        check="derivations.errata:check", evidence=DQ_CONTROL, verdict="rejected",
    ),
    Erratum(
        title="A zero-scored pad adds 2^(−m) to l, not 1",
        source=INFLATED_004.cite,
        claim=f"{_quote(INFLATED_004)}.",
        correction=(r"With \(\ell = \sum_j 2^{S_{2,ij} - m}\), a pad scored 0 adds \(2^{-m}\) to \(\ell\); it adds exactly 1 "
                    r"only to the unshifted sum \(\ell\, 2^m\), or when the running max \(m\) is 0. With \(m = 3\) each pad "
                    r"adds \(1/8\); with all scores negative the pad's 0 becomes the max and \(m = 0\) "
                    r"([masking hazards](math/masking.md#hazard-a))."),
        check="derivations.errata:check", evidence=INFLATION_CONTROL, verdict="rejected",
    ),
    Erratum(
        title="N_CTX must be a multiple of 128, as the code asserts",
        source=NCTX_002_TEXT.cite,
        claim=f"The text says {_quote(NCTX_002_TEXT)}; the launcher asserts `{NCTX_002_CODE.text}`.",
        correction=(r"The assertion is the rule: every multiple of 128 is a multiple of 32, but 32, 64, 96, 160, … pass the "
                    r"text's rule and fail the assertion."),
        check="derivations.errata:check",
        evidence=NCTX_CONTROL + ": 12 lengths ≤ 512 it allows are refused (32, 64, 96, …)", verdict="rejected",
    ),
    Erratum(
        title="δ is not pre-divided by the scale",
        source=PREDIVIDED_000_002.cite,
        claim=f"The comment {_quote(PREDIVIDED_000_002)} sits above code that divides nothing.",
        correction=(r"The code is right and the comment wrong: \(dS = P \circ (dP - \delta)\) needs "
                    r"\(\delta = \operatorname{rowsum}(dO \circ O)\) as it is; the scale enters once, in "
                    r"\(dQ = \tau\, dS\, K\) and \(dK = \tau\, dS^\top Q\). A \(\delta\) divided by any scale \(\neq 1\) "
                    r"gives a wrong \(dS\)."),
        check="derivations.errata:check", evidence=PREDIVIDED_CONTROL, verdict="rejected",
    ),
    Erratum(
        title="Recomputation, not the δ identity, removes the need to store P",
        source=STORE_P_001.cite,
        claim="It credits the δ identity with removing the need to store \\(P\\).",
        correction=(r"\(dS = P \circ (dP - \delta)\) needs \(P\) entry by entry whatever \(\delta\) is. What removes "
                    r"the \(N \times M\) store is [recomputation](math/recomputation.md): \(P = e^{S - \mathrm{LSE}}\) "
                    r"from \(Q\), \(K\) and one stored number per row. The identity does something else: "
                    r"\(\delta = \operatorname{rowsum}(dO \circ O)\) is known before the tile loop, from a preprocessing "
                    r"pass over \(O\) and \(dO\), instead of a reduction over a whole row of \(P \circ dP\) "
                    r"([the δ identity](math/d-identity.md))."),
        check="derivations.errata:check", evidence=STORE_P_CONTROL, verdict="rejected",
    ),
]


def as_rows() -> list[dict]:
    return [e.to_dict() for e in ERRATA]
