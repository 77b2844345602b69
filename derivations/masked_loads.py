# --8<-- [start:statement]
"""What a masked or out-of-bounds load returns: what Triton promises, and what this package relies on.

* A pointer load `tl.load(ptrs, mask=m)` with no `other=` leaves the lanes where m is false undefined
  (Triton's `tl.load` documentation). Whatever a backend happens to put there today, code that lets
  such a lane reach a sum, a max, a dot or a store is relying on something Triton does not promise.
* A tensor-descriptor load `desc.load([...])` fills the part of the block outside the tensor's shape
  with the descriptor's padding value, "zero" unless the descriptor is made with padding="nan".
  (Block pointers, `tl.make_block_ptr`, had `padding_option` "" by default, documented as an undefined
  value; Triton 3.9 has removed block pointers.)

The package's rule: every masked pointer load either passes `other=`, or its result is used only as
the value of a store under the same mask (the lanes that were not loaded are not written), and every
descriptor keeps the zero padding. The check reads the package's source and proves the rule holds
for each load it finds.
"""
# --8<-- [end:statement]

from __future__ import annotations

import ast
from pathlib import Path

from ._result import CheckResult, Ledger

PACKAGE = Path(__file__).resolve().parents[1] / "flashattn"

IDENTITY = ("masked loads: no masked-off lane without other= reaches arithmetic (only a store under the same "
            "mask); every tensor descriptor pads with zeros")
METHOD = ("brute force over the package's source (Python ast: every tl.load/gl.load with a mask, every use of "
          "its result, every descriptor constructor); the installed Triton's documented load semantics")
NEGATIVE = ("a load without other= feeding tl.sum; one stored under a different mask; one returned to the "
            "caller; a descriptor made with padding='nan'")

LOADS = {"load"}
STORES = {"store"}
MODULES = {"tl", "gl"}
DESCRIPTORS = {"TensorDescriptor", "make_tensor_descriptor", "from_tensor"}


# --8<-- [start:proof]
def _is_call(node, names, modules=MODULES) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in names
            and isinstance(node.func.value, ast.Name) and node.func.value.id in modules)


def _arg(call: ast.Call, name: str, position: int):
    """A keyword argument, or the positional one at `position` (tl.load(ptr, mask, other))."""
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    return call.args[position] if len(call.args) > position else None


def _same(a, b) -> bool:
    return a is not None and b is not None and ast.dump(a) == ast.dump(b)


def masked_loads(source: str, filename: str = "<source>"):
    """Every masked pointer load of `source`: (place, has other=, safe). A load without other= is safe
    only if it is assigned to a name whose every use is the value of tl.store / gl.store with the same
    mask expression, in the same function."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for call in (n for n in ast.walk(tree) if _is_call(n, LOADS)):
        mask = _arg(call, "mask", 1)
        if mask is None:
            continue
        func = call
        while func in parents and not isinstance(func, ast.FunctionDef):
            func = parents[func]
        place = f"{filename}:{call.lineno} ({getattr(func, 'name', '?')})"
        if _arg(call, "other", 2) is not None:
            found.append((place, True, True))
            continue
        target = parents.get(call)
        safe = False
        if isinstance(target, ast.Assign) and len(target.targets) == 1 and isinstance(target.targets[0], ast.Name):
            name = target.targets[0].id
            uses = [n for n in ast.walk(func) if isinstance(n, ast.Name) and n.id == name
                    and isinstance(n.ctx, ast.Load)]
            safe = bool(uses) and all(
                _is_call(parents.get(u), STORES) and _arg(parents[u], "value", 1) is u
                and _same(_arg(parents[u], "mask", 2), mask) for u in uses)
        found.append((place, False, safe))
    return found


def descriptor_paddings(source: str, filename: str = "<source>"):
    """Every descriptor constructor call of `source`: (place, the padding it asks for; 'zero' if none)."""
    out = []
    for call in (n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)):
        name = getattr(call.func, "attr", getattr(call.func, "id", None))
        if name not in DESCRIPTORS:
            continue
        padding = next((kw.value for kw in call.keywords if kw.arg in ("padding", "padding_option")), None)
        value = padding.value if isinstance(padding, ast.Constant) else ("zero" if padding is None else "?")
        out.append((f"{filename}:{call.lineno}", value))
    return out


def package_sources():
    return {str(p.relative_to(PACKAGE.parent)): p.read_text(encoding="utf-8") for p in sorted(PACKAGE.rglob("*.py"))}


def scan(sources):
    loads = [entry for name, src in sources.items() for entry in masked_loads(src, name)]
    descriptors = [entry for name, src in sources.items() for entry in descriptor_paddings(src, name)]
    return loads, descriptors


def rule_holds(sources) -> bool:
    loads, descriptors = scan(sources)
    return all(safe for _, _, safe in loads) and all(p == "zero" for _, p in descriptors)
# --8<-- [end:proof]


# --8<-- [start:numeric]
def triton_documents() -> dict:
    """What the installed Triton says and does: the masked-out value of tl.load without other=, the
    default padding of host-side descriptors (Triton's and Gluon's), and the values padding accepts."""
    import dataclasses

    import torch
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    defaults = {f.name: f.default for f in dataclasses.fields(TensorDescriptor)}
    x = torch.zeros(4, 16)
    accepted = {}
    for padding in ("zero", "nan", ""):
        try:
            TensorDescriptor(x, list(x.shape), list(x.stride()), [2, 16], padding=padding)
            accepted[padding] = True
        except AssertionError:
            accepted[padding] = False
    try:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
        gluon_default = next(f.default for f in dataclasses.fields(GluonDescriptor) if f.name == "padding")
    except ImportError:
        gluon_default = None
    return dict(
        undefined_without_other="If `other` is `None`, the masked-out value is undefined." in (tl.load.__doc__ or ""),
        descriptor_default=defaults.get("padding"),
        gluon_default=gluon_default,
        accepted=accepted,
    )


def _probe(X, Y, N):
    """Load 8 lanes with the first N unmasked and no other=, and store every lane."""
    import triton.language as tl

    offs = tl.arange(0, 8)
    tl.store(Y + offs, tl.load(X + offs, mask=offs < N))


def interpreter_fill():
    """What Triton's CPU interpreter (one backend, the one that runs without a GPU) puts in the masked-off lanes."""
    import torch
    from triton.runtime.interpreter import InterpretedFunction

    x, y = torch.full((8,), 7.0), torch.full((8,), -1.0)
    InterpretedFunction(_probe)[(1,)](x, y, 3)
    return y.tolist()
# --8<-- [end:numeric]


def check() -> CheckResult:
    ledger = Ledger()
    sources = package_sources()
    loads, descriptors = scan(sources)
    with_other = [p for p, other, _ in loads if other]
    without = [p for p, other, _ in loads if not other]
    unsafe = [p for p, _, safe in loads if not safe]
    docs = triton_documents()
    ledger.claim("installed Triton's tl.load documentation: without other=, the masked-out value is undefined",
                 lambda: docs["undefined_without_other"])
    ledger.claim(f"installed Triton's TensorDescriptor pads with {docs['descriptor_default']!r} by default "
                 f"(Gluon's Hopper descriptor: {docs['gluon_default']!r}); it accepts "
                 f"{sorted(k for k, v in docs['accepted'].items() if v)} and rejects ''",
                 lambda: docs["descriptor_default"] == "zero" and docs["gluon_default"] in ("zero", None)
                 and docs["accepted"] == {"zero": True, "nan": True, "": False})
    fill = interpreter_fill()
    ledger.claim(f"Triton's CPU interpreter, 8 lanes, 3 unmasked, no other=: it returns {fill} for inputs of 7 "
                 "(zeros in the masked lanes: what this backend does, not what Triton promises)",
                 lambda: fill == [7.0] * 3 + [0.0] * 5)
    ledger.claim(f"the package has {len(loads)} masked pointer loads: {len(with_other)} pass other=, "
                 f"{len(without)} do not, and each of those is only stored under its own mask: "
                 + (", ".join(without) or "none") + (f"; UNSAFE: {', '.join(unsafe)}" if unsafe else ""),
                 lambda: len(loads) >= 10 and not unsafe)
    ledger.claim(f"{len(descriptors)} descriptor constructors in the package, none asks for a padding other than "
                 "zero", lambda: descriptors and all(p == "zero" for _, p in descriptors))
    # --8<-- [start:negative]
    wrong = {
        "a load without other= feeding tl.sum": (
            "def k(p, m):\n    x = tl.load(p, mask=m)\n    s = tl.sum(x, axis=0)\n"),
        "stored under a different mask": (
            "def k(p, q, m, m2):\n    x = tl.load(p, mask=m)\n    tl.store(q, x, mask=m2)\n"),
        "returned to the caller": "def k(p, m):\n    return tl.load(p, mask=m)\n",
        "a descriptor with padding='nan'": "def f(x):\n    return TensorDescriptor(x, s, t, b, padding='nan')\n",
    }
    for name, source in wrong.items():
        ledger.control(f"{name}: scan", lambda source=source: not rule_holds({**sources, "<control>": source}))
    # --8<-- [end:negative]
    return ledger.result(identity=IDENTITY, method=METHOD,
                         sizes=f"{len(sources)} files of flashattn/, {len(loads)} masked loads, "
                               f"{len(descriptors)} descriptor constructors",
                         negative_control=NEGATIVE, module=__name__)
