"""Configuration as validated data: a YAML file (or the name of a shipped one), `a.b=c`
overrides typed as YAML, and one pydantic schema whose errors name the key."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from .errors import UsageError

M = TypeVar("M", bound=BaseModel)


def load_validated(path: str | Path, overrides: list[str], schema: type[M], shipped: Path, what: str,
                   error: type[UsageError] = UsageError) -> M:
    """Read `path` (or SHIPPED/NAME.yaml), apply overrides, validate; every problem in one error."""
    path = Path(path)
    if not path.exists() and (shipped / f"{path}.yaml").exists():
        path = shipped / f"{path}.yaml"
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        names = ", ".join(sorted(p.stem for p in shipped.glob("*.yaml")))
        raise error(f"{path}: no such {what} file (shipped: {names})") from None
    except yaml.YAMLError as e:
        raise error(f"{path}: not valid YAML: {e}") from None
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise error(f"--set {item!r}: expected KEY=VALUE, e.g. train.steps=100")
        _assign(raw, key.split("."), yaml.safe_load(value), error)
    try:
        return schema.model_validate(raw)
    except ValidationError as e:
        problems = []
        for problem in e.errors():
            key = ".".join(str(p) for p in problem["loc"]) or "(top level)"
            message = "unknown key" if problem["type"] == "extra_forbidden" else \
                problem["msg"].removeprefix("Value error, ")
            shown = problem["type"] != "extra_forbidden" and not isinstance(problem["input"], dict)
            problems.append(f"{key}: {message}" + (f" (got {problem['input']!r})" if shown else ""))
        raise error(f"{path}: " + "; ".join(problems)) from None


def _assign(tree: dict, keys: list[str], value, error: type[UsageError]) -> None:
    for key in keys[:-1]:
        node = tree.setdefault(key, {})
        if not isinstance(node, dict):
            raise error(f"--set {'.'.join(keys)}: {key} is not a section")
        tree = node
    tree[keys[-1]] = value
