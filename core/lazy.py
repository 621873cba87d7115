"""Package exports loaded on first use: a package whose modules import torch (seconds) can still be
imported cheaply by a command that only validates a config or submits a job."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


# Any, not object: a type checker gives each lazily exported name the return type of `__getattr__`.
def lazy_exports(package: str, namespace: dict, modules: dict[str, tuple[str, ...]]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package`: the names in `modules` ({submodule: names}) are imported
    from their submodule when first asked for, then kept in `namespace` (the package's globals)."""
    where = {name: module for module, names in modules.items() for name in names}

    def load(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = namespace[name] = getattr(importlib.import_module(f".{where[name]}", package), name)
        return value

    return load
