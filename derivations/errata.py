"""Errata: claims that recur in write-ups of FlashAttention and that a check in this package shows to
be wrong or imprecise. The site renders this list; `tests/test_derivations.py` confirms that every
entry names a check that exists and that the named claim or negative control comes out as stated.

Each entry: the claim (paraphrased, not attributed), the correction, the check that shows it
(``module:function``), and ``evidence``: the text of the claim ("holds") or negative control
("rejected") in that check's details.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Erratum:
    claim: str
    correction: str
    check: str       # "derivations.<module>:<function>"
    evidence: str    # a claim or control name, as it appears in the check's details
    verdict: str     # "rejected" (the claim is a negative control the check rejects) or "holds"

    def to_dict(self) -> dict:
        return asdict(self)


ERRATA = [
    Erratum(
        claim="A deterministic backward split into a dK/dV kernel and a dQ kernel costs 12·N²·d FLOPs.",
        correction="It costs 14·N²·d: the dQ kernel needs dS = P ∘ (dP − D), so it recomputes dP = dO Vᵀ "
                   "as well as S. Seven matmuls per tile pair, not six; the single kernel with atomic dQ "
                   "does five (10·N²·d).",
        check="derivations.cost_model:check",
        evidence="12·N·M·d: its dQ kernel reads dP that it never computes",
        verdict="rejected",
    ),
    Erratum(
        claim="The backward pass costs 2.5 × the forward pass.",
        correction="2.5 × is the reporting convention (10N²d / 4N²d, the single-kernel count). The "
                   "deterministic two-kernel backward does 14N²d, 3.5 × the forward.",
        check="derivations.cost_model:check",
        evidence="backward, two kernels: 4 + 3 = 7 matmuls → 14·N·M·d (S and dP each computed twice)",
        verdict="holds",
    ),
    Erratum(
        claim="Padding the key dimension with zero scores is harmless.",
        correction="Each zero-scored padded key adds 2^(−m) to the softmax denominator (m the running max) "
                   "and its value to the numerator; the output changes. When all real scores are negative the "
                   "padded 0 even becomes the max. Padded keys must be scored −∞.",
        check="derivations.masking_hazards:check",
        evidence="a: padding keys with score 0 is not exact",
        verdict="rejected",
    ),
    Erratum(
        claim="Each zero-scored padded key adds exactly 1 to the softmax denominator (e⁰ = 1).",
        correction="It adds 2^(0 − m) = 2^(−m) after the max subtraction, which is 1 only when the running max "
                   "is exactly 0.",
        check="derivations.masking_hazards:check",
        evidence="a: 'each zero pad adds exactly 1' fails when m ≠ 0",
        verdict="rejected",
    ),
    Erratum(
        claim="The running max in online softmax is needed for the result to be correct.",
        correction="Any finite pivot gives exactly the same result (checked in exact arithmetic with random "
                   "and constant pivots); the max only keeps every exponent ≤ 0 so exp stays in floating-point "
                   "range.",
        check="derivations.online_softmax:check",
        evidence="exact base-2 rationals: max / random / zero pivots and random merge trees give softmax·V exactly",
        verdict="holds",
    ),
    Erratum(
        claim="Masking with −∞ takes care of fully masked rows by itself.",
        correction="A row (or a first key block) with every score −∞ has pivot −∞, and −∞ − (−∞) = NaN. "
                   "The pivot must be replaced (e.g. by 0) when it is −∞, and l = 0 must not be divided by.",
        check="derivations.masking_hazards:check",
        evidence="b: unguarded pivot gives NaN",
        verdict="rejected",
    ),
    Erratum(
        claim="In the dK/dV loop, query rows past the end of the sequence need no mask: their dO is zero, so "
              "they contribute nothing.",
        correction="Only while their recomputed P is finite. With non-zero padding in Q the base-2 exponent "
                   "can pass 128, P overflows to inf, and dS = inf · (0 − 0) = NaN spreads to every dK and dV "
                   "of the block. Masking the query rows removes it.",
        check="derivations.masking_hazards:check",
        evidence="d: unmasked query rows with dirty padding give NaN dK/dV",
        verdict="rejected",
    ),
    Erratum(
        claim="The softmax backward is dS = P ∘ dP.",
        correction="dS = P ∘ (dP − rowsum(P ∘ dP)): the normaliser shared by a row contributes the "
                   "subtracted term (the Jacobian is diag(p) − p pᵀ, not diag(p)).",
        check="derivations.softmax_backward:check",
        evidence="dS = P∘dP fails the symbolic check",
        verdict="rejected",
    ),
    Erratum(
        claim="The correction term of the softmax backward needs a full row of dP (an N × N reduction).",
        correction="rowsum(P ∘ dP) = rowsum(dO ∘ O): it is computed from the N × d output and its gradient, "
                   "before the main loop.",
        check="derivations.d_identity:check",
        evidence="both sides are one double sum over (j, k) (symbolic M, d)",
        verdict="holds",
    ),
    Erratum(
        claim="Causal masking means query i sees keys j ≤ i, whatever the lengths.",
        correction="That is top-left alignment. For N ≠ M (e.g. decoding with a KV cache) the convention of "
                   "FlashAttention 2.1+ and of this package is bottom-right, j ≤ i + M − N: the last query sees "
                   "every key. The two agree only when N = M.",
        check="derivations.causal_masking:check",
        evidence="top-left alignment: last query does not see every key when N < M",
        verdict="rejected",
    ),
    Erratum(
        claim="Causal attention does exactly half the work of full attention.",
        correction="For N = M it sees N(N + 1)/2 pairs, a fraction (N + 1)/(2N); tiled kernels also run the "
                   "diagonal tiles in full, so they save a little less than half.",
        check="derivations.causal_masking:check",
        evidence="'causal attention does exactly half the work': visible fraction is (N + 1)/(2N) ≠ 1/2",
        verdict="rejected",
    ),
    Erratum(
        claim="Switching the kernel to exp2 changes nothing in the backward pass.",
        correction="With K pre-scaled by τ·log2 e, dQ = ln 2 · dS K' (the ln 2 undoes log2 e) and dK = τ dSᵀ Q; "
                   "forgetting the ln 2 scales dQ by log2 e ≈ 1.44.",
        check="derivations.base2_lse:check",
        evidence="dQ = dS K' (ln 2 dropped): numeric",
        verdict="rejected",
    ),
    Erratum(
        claim="With dropout, D must be computed from the output without dropout.",
        correction="D = rowsum(dO ∘ O) with O = (P ∘ Z/p) V, the dropped output the forward pass stored; "
                   "using the undropped output gives wrong gradients.",
        check="derivations.dropout:check",
        evidence="D from undropped O: mpmath",
        verdict="rejected",
    ),
]


def as_rows() -> list[dict]:
    return [e.to_dict() for e in ERRATA]
