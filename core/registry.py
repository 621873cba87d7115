"""Tables of implementations found by name, one mechanism for each of them: stores by URL scheme
(core/store.py), loader backends (pipeline/backend.py), objectives (trainer/objectives.py),
launchers (cluster/launcher.py) and experiment trackers (trainer/tracking/start.py).

A table is a plain dict: name -> the implementation, or "module:attribute" naming it (fsspec's
`known_implementations`). A string is imported when its name is first used and then kept in the
table, so a table can name implementations whose modules import torch, DALI or a cloud client
without a login node that only validates a config ever importing them. Installed packages add
names through an entry-point group (name: the key; value: "module:attribute"), read when a name is
not in the table or the names are listed (stores read theirs once per process); a name the table
already has is not replaced by one.
Registering a name twice is the registering module's error to raise (each says it in its own
words); an unknown name is an error listing the known ones.

Cost: a table holds one entry per registered name (a handful), nothing that grows with the data.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any

# The implementations come back as Any: a table holds whatever its caller registers (a store's
# opener, a backend's builder, an objective), and each caller gives the result its own type.


def load(target: str) -> Any:
    """The object "module:attribute" names (the module itself for "module")."""
    module, _, attribute = target.partition(":")
    loaded = importlib.import_module(module)
    return getattr(loaded, attribute) if attribute else loaded


def add_entry_points(table: dict, points: Iterable) -> None:
    """Names from installed packages' entry points (each with .name and .value) that the table
    does not have yet."""
    for point in points:
        table.setdefault(point.name, point.value)


def resolve(table: dict, name: str) -> Any:
    """The implementation registered as `name` (a KeyError when none): a "module:attribute" string
    is imported now and replaces itself in the table."""
    value = table[name]
    if isinstance(value, str):
        value = table[name] = load(value)
    return value


def find(
    table: dict, name: str, unknown: Callable[[list[str]], Exception], more: Callable[[], None] | None = None
) -> Any:
    """`resolve`, once `require` knows the name."""
    require(table, name, unknown, more)
    return resolve(table, name)


def require(
    table: dict, name: str, unknown: Callable[[list[str]], Exception], more: Callable[[], None] | None = None
) -> None:
    """That `name` is registered, importing nothing of it: `more()` (e.g. reading entry points)
    tried first when it is missing; an unknown name raises `unknown(the known names, sorted)`."""
    if name not in table and more is not None:
        more()
    if name not in table:
        raise unknown(sorted(table))
