# --8<-- [start:statement]
"""Matmul backward: if O = X Y and dO = ∂L/∂O, then dX = dO Yᵀ and dY = Xᵀ dO.

Why: the first-order change of the loss is dL = tr(dOᵀ δO) = ⟨dO, δO⟩, and δO = δX Y + X δY.
Moving Y (or X) to the other side of the inner product with the cyclic property of the trace gives
dL = ⟨dO Yᵀ, δX⟩ + ⟨Xᵀ dO, δY⟩, so the two gradients can be read off. In index form,
∂/∂X_pq Σ_ij dO_ij Σ_l X_il Y_lj = Σ_j dO_pj Y_qj = (dO Yᵀ)_pq.

Every matmul of attention (S = QKᵀ, O = PV, dP = dO Vᵀ, …) is differentiated with this rule.
"""
# --8<-- [end:statement]

from __future__ import annotations

import itertools
import random

import sympy as sp
from sympy.matrices.expressions.matexpr import MatrixElement

from ._common import flatten_sum, holds, rational_matrix, symbol_matrix
from ._result import CheckResult, Ledger

IDENTITY = "matmul backward: dX = dO Yᵀ, dY = Xᵀ dO"
METHOD = ("Trace(...).diff on MatrixSymbols (symbolic sizes); index calculus with symbolic sizes; "
          "explicit symbols; exact rationals")
NEGATIVE = "dX = Yᵀ dO, dY = dO Xᵀ (operands swapped); dX = dO Y (transpose dropped)"

n, k, m = sp.symbols("n k m", integer=True, positive=True)


# --8<-- [start:formula]
def grad_x(dO, X, Y):
    """dX for O = X Y."""
    return dO * Y.T


def grad_y(dO, X, Y):
    """dY for O = X Y."""
    return X.T * dO
# --8<-- [end:formula]


# --8<-- [start:proof]
def trace_route(grad_x_formula, grad_y_formula) -> bool:
    """Matrix calculus with symbolic sizes n × k times k × m.

    With the upstream gradient G held fixed, L is locally tr(Gᵀ X Y); SymPy differentiates the trace
    with respect to the matrix symbols directly, and the result must equal the candidate formula.
    """
    X, Y, G = sp.MatrixSymbol("X", n, k), sp.MatrixSymbol("Y", k, m), sp.MatrixSymbol("G", n, m)
    loss = sp.Trace(G.T * X * Y)
    ok_x = holds(lambda: sp.simplify(loss.diff(X) - grad_x_formula(G, X, Y)).is_ZeroMatrix
                 or loss.diff(X) == grad_x_formula(G, X, Y))
    ok_y = holds(lambda: sp.simplify(loss.diff(Y) - grad_y_formula(G, X, Y)).is_ZeroMatrix
                 or loss.diff(Y) == grad_y_formula(G, X, Y))
    return ok_x and ok_y


def _contract(e):
    """Apply Σ_v δ(v, x) f(v) = f(x) for every Kronecker delta, then name the summation
    indices canonically so that two sums can be compared term by term."""
    f, limits = flatten_sum(e)
    bound = {lim[0] for lim in limits}
    changed = True
    while changed:
        changed = False
        for delta in f.atoms(sp.KroneckerDelta):
            a, b = delta.args
            v, other = (a, b) if a in bound and b not in bound else (b, a)
            if v in bound and other not in bound:
                f = f.subs(v, other)  # the free index lies inside v's range by construction
                limits = [lim for lim in limits if lim[0] != v]
                bound.discard(v)
                changed = True
                break
    names = [sp.Symbol(f"s{t}", integer=True) for t in range(len(limits))]
    renamed = [(f.subs(dict(zip([l[0] for l in perm], names))),
                sorted(((l[1], l[2]) for l in perm), key=sp.default_sort_key))
               for perm in itertools.permutations(limits)]
    return renamed


def _as_indexed(e):
    return e.replace(lambda t: isinstance(t, MatrixElement),
                     lambda t: sp.IndexedBase(t.parent.name)[t.i, t.j])


def index_route(grad_x_formula, grad_y_formula) -> bool:
    """Index calculus with symbolic sizes: L = Σ_ij G_ij Σ_l X_il Y_lj, differentiated with respect to
    one entry X_pq (resp. Y_pq). The free entry (p, q) is placed inside the matrix by writing the sizes
    as p + 1 + a and q + 1 + b with a, b ≥ 0."""
    i, j, l = sp.symbols("i j l", integer=True)
    p, q, a, b = sp.symbols("p q a b", integer=True, nonnegative=True)
    Xi, Yi, Gi = (sp.IndexedBase(s) for s in "XYG")
    loss = sp.Sum(Gi[i, j] * sp.Sum(Xi[i, l] * Yi[l, j], (l, 0, k - 1)), (i, 0, n - 1), (j, 0, m - 1))
    X, Y, G = sp.MatrixSymbol("X", n, k), sp.MatrixSymbol("Y", k, m), sp.MatrixSymbol("G", n, m)

    def agrees(wrt, rows, cols, formula) -> bool:
        sizes = {rows: p + 1 + a, cols: q + 1 + b}
        derived = _contract(loss.subs(sizes).diff(sp.IndexedBase(wrt)[p, q]))[0]
        candidate = _contract(_as_indexed(formula(G, X, Y)[p, q]).subs(sizes))
        return any(sp.expand(derived[0] - f) == 0 and derived[1] == lims for f, lims in candidate)

    return (holds(lambda: agrees("X", n, k, grad_x_formula))
            and holds(lambda: agrees("Y", k, m, grad_y_formula)))


def explicit_route(grad_x_formula, grad_y_formula, shapes) -> bool:
    """Explicit matrices of independent symbols, L = Σ G∘(XY), differentiated entry by entry."""
    for rows, inner, cols in shapes:
        X, Y, G = symbol_matrix("x", rows, inner), symbol_matrix("y", inner, cols), symbol_matrix("g", rows, cols)
        loss = sum((G.multiply_elementwise(X * Y)))
        dX = X.applyfunc(lambda x: sp.diff(loss, x))
        dY = Y.applyfunc(lambda y: sp.diff(loss, y))
        if not holds(lambda: (grad_x_formula(G, X, Y) - dX).expand() == sp.zeros(*dX.shape)):
            return False
        if not holds(lambda: (grad_y_formula(G, X, Y) - dY).expand() == sp.zeros(*dY.shape)):
            return False
    return True
# --8<-- [end:proof]


# --8<-- [start:numeric]
def rational_route(grad_x_formula, grad_y_formula, shapes, seed: int = 3, directions: int = 3) -> bool:
    """Exact rationals at larger sizes. L = ⟨G, X Y⟩ is linear in X (and in Y), so for any direction E
    the difference L(X + E) − L(X) is exactly the directional derivative ⟨dX, E⟩; it is compared with
    the candidate along a few random rational directions."""
    rng = random.Random(seed)
    for rows, inner, cols in shapes:
        X, Y = sp.Matrix(rational_matrix(rng, rows, inner)), sp.Matrix(rational_matrix(rng, inner, cols))
        G = sp.Matrix(rational_matrix(rng, rows, cols))
        loss = lambda X_, Y_: sum(G.multiply_elementwise(X_ * Y_))
        for _ in range(directions):
            EX, EY = sp.Matrix(rational_matrix(rng, rows, inner)), sp.Matrix(rational_matrix(rng, inner, cols))
            along_x = loss(X + EX, Y) - loss(X, Y)
            along_y = loss(X, Y + EY) - loss(X, Y)
            if not holds(lambda: sum(grad_x_formula(G, X, Y).multiply_elementwise(EX)) == along_x):
                return False
            if not holds(lambda: sum(grad_y_formula(G, X, Y).multiply_elementwise(EY)) == along_y):
                return False
    return True
# --8<-- [end:numeric]


EXPLICIT_SHAPES = [(2, 3, 4), (3, 2, 2), (2, 2, 2)]
RATIONAL_SHAPES = [(16, 8, 24), (12, 12, 12)]


def check() -> CheckResult:
    ledger = Ledger()
    ledger.claim("Trace(Gᵀ X Y).diff(X), .diff(Y) equal dO Yᵀ, Xᵀ dO (symbolic n, k, m)",
                 lambda: trace_route(grad_x, grad_y))
    ledger.claim("index calculus, symbolic sizes: ∂L/∂X_pq = Σ_j dO_pj Y_qj, ∂L/∂Y_pq = Σ_i X_ip dO_iq",
                 lambda: index_route(grad_x, grad_y))
    ledger.claim(f"explicit symbol matrices {EXPLICIT_SHAPES}", lambda: explicit_route(grad_x, grad_y, EXPLICIT_SHAPES))
    ledger.claim(f"exact rationals {RATIONAL_SHAPES}", lambda: rational_route(grad_x, grad_y, RATIONAL_SHAPES))
    # --8<-- [start:negative]
    swapped_x = lambda dO, X, Y: Y.T * dO
    swapped_y = lambda dO, X, Y: dO * X.T
    no_transpose_x = lambda dO, X, Y: dO * Y
    for name, fx, fy in [("dX = Yᵀ dO, dY = dO Xᵀ", swapped_x, swapped_y),
                         ("dX = dO Y", no_transpose_x, grad_y)]:
        ledger.control(f"{name} fails the trace route", lambda: not trace_route(fx, fy))
        ledger.control(f"{name} fails the index route", lambda: not index_route(fx, fy))
        # Square sizes make the wrong formulas well-formed, so only the values can reject them.
        ledger.control(f"{name} fails explicit square symbols", lambda: not explicit_route(fx, fy, [(2, 2, 2)]))
        ledger.control(f"{name} fails exact rationals (square)", lambda: not rational_route(fx, fy, [(12, 12, 12)]))
    # --8<-- [end:negative]
    sizes = (f"symbolic n×k·k×m; explicit {', '.join('x'.join(map(str, s)) for s in EXPLICIT_SHAPES)}; "
             f"rational {', '.join('x'.join(map(str, s)) for s in RATIONAL_SHAPES)}")
    return ledger.result(identity=IDENTITY, method=METHOD, sizes=sizes,
                         negative_control=NEGATIVE, module=__name__)
