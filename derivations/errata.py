"""Errata: claims in the write-ups this project started from ("seeds") that a check here shows to be
wrong, each attributed to its seed and passage. The site renders this list; the build and
`tests/test_derivations.py` confirm that each entry's evidence line is in the named check's output.

Only claims a source actually makes belong here. Plausible slips that no source makes are negative
controls on the Math pages instead.

Fields: ``title`` (plain text, the heading), ``source`` (seed and passage), ``claim`` and
``correction`` (Markdown with ``\\(...\\)`` math), ``check`` (``module:function``), ``evidence`` (a
claim or control as it appears in that check's details) and ``verdict`` ("rejected": the claim is a
negative control the check rejects; "holds": the correction is a claim that holds).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


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


ERRATA = [
    Erratum(
        title="Masked loads of the LSE and Δ without other= are not zero-padded",
        source="Seed 004, its dK/dV kernel listing (the LSE and Δ loads, twice) and the sentence "
               "that calls them \"zero-padded via the mask\"",
        claim=r"The per-row statistics are loaded with `tl.load(..., mask=offs_m < SEQ)` and no `other=`, "
              r"and the text says rows past the sequence are therefore zero-padded.",
        correction=r"A Triton load leaves its masked-off lanes **undefined**; only `other=` gives them a value. "
                   r"For a row past \(N\) the recomputed \(P = 2^{S_2 - \mathrm{LSE}_2}\) then uses whatever the "
                   r"lane held: a garbage \(\mathrm{LSE}_2 = -200\) against a zero row of \(Q\) gives "
                   r"\(P = 2^{200} = \infty\) and \(\infty \cdot 0 = \text{NaN}\) in every \(dK\), \(dV\) of "
                   r"the block. Pass `other=0.0` (this package does, on every masked load; the check reads "
                   r"`flashattn/backward.py` for it). An explicit row mask on \(P\) is not a substitute: a NaN "
                   r"in a \(\delta\) lane (the seed's \(\Delta\)) still gives \(dS = 0\cdot(0 - \text{NaN}) = \text{NaN}\). "
                   r"The seed's other argument, that padding rows *inside* the sequence need no mask "
                   r"because their \(dO = 0\), is right: they have a real LSE, so \(P \le 1\).",
        check="derivations.masking_hazards:check",
        evidence="d: masked loads without other= are not zero-padded: garbage LSE₂ gives NaN dK/dV unmasked",
        verdict="rejected",
    ),
    Erratum(
        title="With dropout, dS is formed from the undropped P",
        source="Seed 003, Appendix B (the backward with dropout), where P is reassigned to the dropped P̃ "
               "before dS is formed",
        claim=r"After \(P \leftarrow \tilde P = P \circ Z/(1 - p_{\text{drop}})\), the backward forms "
              r"\(dS = \tilde P \circ (d\tilde P - \delta)\).",
        correction=r"\(dS = P \circ (dP - \delta)\) with the undropped \(P\) and "
                   r"\(dP = d\tilde P \circ Z/(1 - p_{\text{drop}})\). The seed's first term is right "
                   r"(\(\tilde P \circ d\tilde P = P \circ dP\)); the second subtracts \(\tilde P_{ij}\,\delta_i\) "
                   r"instead of \(P_{ij}\,\delta_i\). The two agree only when \(p_{\text{drop}} = 0\), which is "
                   r"why a run with `dropout_p = 0` does not show it.",
        check="derivations.dropout:check",
        evidence="dS = P̃ ∘ (dP̃ − δ) (seed 003, App. B): mpmath",
        verdict="rejected",
    ),
]


def as_rows() -> list[dict]:
    return [e.to_dict() for e in ERRATA]
