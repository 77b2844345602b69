"""The seeds' passages that the Errata page discusses, each stored once.

The seeds (the write-ups this project started from) are not in the repository. What is kept of them
is the wording below, and only that: the Errata page shows these strings, and the checks in
``derivations.errata``, ``derivations.dropout``, ``derivations.cost_model`` and
``derivations.masking_hazards`` parse or evaluate the same strings. No check re-types a passage.

``wording`` says how faithful a passage is:

* ``"quoted"``: the seed's words, as the project's review quoted them;
* ``"restated"``: the review described the passage without quoting it; the text here is that
  description in the site's symbols (the seed's own typography is not kept), and the page says so.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Passage:
    seed: str       # "003", or "000, 002" when two seeds share the passage
    where: str      # the section or listing of the seed
    text: str       # the passage (see `wording`)
    wording: str    # "quoted" or "restated"

    @property
    def cite(self) -> str:
        seeds = "Seeds" if "," in self.seed else "Seed"
        note = "" if self.wording == "quoted" else " (restated: the seed's own wording is not kept)"
        return f"{seeds} {self.seed}, {self.where}{note}"


# --8<-- [start:passages]
# Seed 003, Appendix B: the backward with dropout, three steps in this order.
DROPOUT_003 = Passage(
    seed="003", where="Appendix B, the backward with dropout", wording="restated",
    text="P ← P̃; dP ← dP ∘ Z/keep; dS = P̃ ∘ (dP − rowsum(dP ∘ P̃))")
COST_004 = Passage(seed="004", where="the heading of its Triton section", wording="quoted",
                   text="Triton (Two Kernels, 12N²d FLOPS)")
ZERO_PADDED_004 = Passage(seed="004", where="the text beside its dK/dV kernel's LSE and Δ loads",
                          wording="quoted", text="zero-padded via the mask")
INFLATED_004 = Passage(seed="004", where="its discussion of padding keys", wording="quoted",
                       text="l inflated by 1 for every invalid position")
TRACE_003 = Passage(seed="003", where="the matmul backward by traces", wording="quoted",
                    text="tr(ABC) = tr(CBA)")
MAX_003 = Passage(seed="003", where="the forward equations (its code subtracts the scaled max)",
                  wording="restated", text="exp(τ S − rowmax(S))")
DQ_003 = Passage(seed="003", where="the backward equations in the text", wording="restated",
                 text="dQ = dS K")
NCTX_002_TEXT = Passage(seed="002", where="the text on sequence lengths", wording="restated",
                        text="N_CTX must be a multiple of 32")
NCTX_002_CODE = Passage(seed="002", where="its launcher's assertion", wording="restated",
                        text="N_CTX % 128 == 0")
PREDIVIDED_000_002 = Passage(seed="000, 002", where="a comment in the backward kernel, above code that "
                             "divides nothing", wording="quoted",
                             text="D (= delta) is pre-divided by ds_scale")
STORE_P_001 = Passage(seed="001", where="its account of the δ identity", wording="restated",
                      text="the δ identity removes the need to store P")
# --8<-- [end:passages]

ALL = {name: value for name, value in dict(globals()).items() if isinstance(value, Passage)}


def leading_number(text: str, before: str) -> int:
    """The integer written right before `before` in `text` ("12N²d" → 12 for before="N²d")."""
    match = re.search(r"(\d+)\s*" + re.escape(before), text)
    if match is None:
        raise ValueError(f"no number before {before!r} in {text!r}")
    return int(match.group(1))


def trailing_number(text: str) -> int:
    """The last integer in `text` ("a multiple of 32" → 32)."""
    numbers = re.findall(r"\d+", text)
    if not numbers:
        raise ValueError(f"no number in {text!r}")
    return int(numbers[-1])


_TOKENS = {"P̃": "Pt", "−": "-", "∘": "*", "τ": "tau", "←": "="}


def to_python(formula: str) -> str:
    """A passage's formula as a Python expression over NumPy/torch arrays: ∘ is the elementwise
    product, juxtaposition of two capitals (dS K) a matrix product, ← an assignment."""
    text = formula
    for symbol, name in _TOKENS.items():
        text = text.replace(symbol, name)
    # juxtaposed matrices "dS K", "τ S": a space between two operands is a product; between two
    # matrix names (capital first letter after an optional d) it is the matrix product.
    text = re.sub(r"\b(d?[A-Z]\w*)\s+(d?[A-Z]\w*)\b", r"\1 @ \2", text)
    text = re.sub(r"\b(tau)\s+(d?[A-Z]\w*)\b", r"\1 * \2", text)
    return text


def run_steps(passage: Passage, env: dict) -> dict:
    """Execute a passage written as steps "a ← b; c ← d; x = e" in `env` (a copy is returned)."""
    env = dict(env)
    for step in passage.text.split(";"):
        target, expr = (part.strip() for part in to_python(step).split("=", 1))
        env[target] = eval(expr, {"__builtins__": {}}, env)  # noqa: S307 - our own stored strings
    return env
