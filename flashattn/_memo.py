"""The bound on the package's memo tables.

The package remembers per-call work (a call's description, its tile plan, the compiled kernel of a
launch signature, a recorded recipe) in plain dicts keyed by shapes and options. A program that
keeps meeting new lengths would grow them without bound, so each entry goes in through
:func:`remember`, which starts the table over once it holds :data:`LIMIT` entries: the next calls of
each shape redo their work once and are remembered again.
"""

LIMIT = 4096


def remember(table: dict, key, value):
    """Store ``table[key] = value``, first emptying ``table`` if it is full; returns ``value``."""
    if len(table) >= LIMIT:
        table.clear()
    table[key] = value
    return value
