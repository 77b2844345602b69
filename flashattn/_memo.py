"""The package's memo tables, in one registry.

The package remembers per-call work (a call's description, its tile plan, the compiled kernel of a
launch signature, a recorded recipe) in plain dicts keyed by shapes and options. Each is made by
:func:`table`, which registers it, so :func:`clear` empties every one of them. A program that keeps
meeting new lengths would grow them without bound, so each entry goes in through :func:`remember`,
which starts the table over once it holds :data:`LIMIT` entries: the next calls of each shape redo
their work once and are remembered again.
"""

LIMIT = 4096

TABLES: dict[str, dict] = {}  # name -> the table


def table(name: str) -> dict:
    """A new memo table, registered under ``name`` (module.what, e.g. ``"launch.recipes"``)."""
    if name in TABLES:
        raise ValueError(f"a memo table named {name!r} exists already")
    TABLES[name] = made = {}
    return made


def clear() -> None:
    """Empty every memo table: the next call of each shape describes, plans and records itself again."""
    for made in TABLES.values():
        made.clear()


def remember(table: dict, key, value):
    """Store ``table[key] = value``, first emptying ``table`` if it is full; returns ``value``."""
    if len(table) >= LIMIT:
        table.clear()
    table[key] = value
    return value
