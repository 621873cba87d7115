"""Configuration as validated data: a YAML file (or the name of a shipped one), `a.b=c`
overrides typed as YAML, and one pydantic schema whose errors name the key."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, TypeVar

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError

from .errors import UsageError
from .urls import masked

M = TypeVar("M", bound=BaseModel)


class Strict(BaseModel):
    """A section of a config or spec: unknown keys are errors, assignments are validated, and each
    field's docstring is its description (docs/CONFIG.md is generated from them)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


def _switch(value):
    # YAML reads a bare on / off as true / false; null (None from Python callers) means auto.
    return {True: "on", False: "off", None: "auto"}[value] if value is None or isinstance(value, bool) else value


Switch = Annotated[Literal["auto", "on", "off"], BeforeValidator(_switch)]


def load_validated(
    path: str | Path,
    overrides: list[str],
    schema: type[M],
    shipped: Path,
    what: str,
    error: type[UsageError] = UsageError,
) -> M:
    """Read `path` (or SHIPPED/NAME.yaml), apply overrides, validate; every problem in one error."""
    path = Path(path)
    if not path.exists() and (shipped / f"{path}.yaml").exists():
        path = shipped / f"{path}.yaml"
    raw = _read_mapping(path, shipped, what, error)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise error(f"--set {item!r}: expected KEY=VALUE, e.g. train.steps=100")
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise error(
                f"--set {key}: the value is not valid YAML ({_yaml_problem(e)}); quote it to pass a string"
            ) from None
        _assign(raw, key.split("."), parsed, error)
    return validated(raw, schema, str(path), error)


def validated(raw: dict, schema: type[M], where: str, error: type[UsageError] = UsageError) -> M:
    """`raw` checked against `schema`; every problem, each naming its key, in one error about `where`."""
    try:
        return schema.model_validate(raw)
    except ValidationError as e:
        raise error(f"{where}: {problems(e)}") from None


def problems(e: ValidationError) -> str:
    """Every problem of a validation, each naming its key, on one line."""
    lines = []
    for problem in e.errors():
        key = ".".join(str(p) for p in problem["loc"]) or "(top level)"
        message = (
            "unknown key" if problem["type"] == "extra_forbidden" else problem["msg"].removeprefix("Value error, ")
        )
        shown = problem["type"] != "extra_forbidden" and not isinstance(problem["input"], dict)
        lines.append(masked(f"{key}: {message}" + (f" (got {problem['input']!r})" if shown else "")))
    return "; ".join(lines)


def _read_mapping(path: Path, shipped: Path, what: str, error: type[UsageError]) -> dict:
    """The file's top level: a mapping of sections (an empty file is an empty one)."""
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        names = ", ".join(sorted(p.stem for p in shipped.glob("*.yaml")))
        raise error(f"{path}: no such {what} file (shipped: {names})") from None
    except IsADirectoryError:
        raise error(f"{path}: is a folder, not a {what} file") from None
    except UnicodeDecodeError as e:
        raise error(f"{path}: not a UTF-8 text file (byte {e.start}: {e.reason})") from None
    except yaml.YAMLError as e:
        raise error(f"{path}: not valid YAML: {_yaml_problem(e)}") from None
    except OSError as e:
        raise error(f"{path}: cannot read the {what} file: {e.strerror}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise error(
            f"{path}: expected a mapping of sections at the top level (key: value lines), "
            f"got a YAML {type(raw).__name__}"
        )
    return raw


def _yaml_problem(e: yaml.YAMLError) -> str:
    """The parser's own words on one line."""
    return " ".join(str(e).split())


def _assign(tree: dict, keys: list[str], value, error: type[UsageError]) -> None:
    for key in keys[:-1]:
        node = tree.setdefault(key, {})
        if not isinstance(node, dict):
            raise error(f"--set {'.'.join(keys)}: {key} is not a section")
        tree = node
    tree[keys[-1]] = value
