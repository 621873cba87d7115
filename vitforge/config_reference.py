"""docs/CONFIG.md from the schemas themselves: every key of a training config and of a launch
spec, its type, default and meaning (the fields' docstrings). A test fails when the file is stale;
regenerate it with `python -m vitforge.config_reference docs/CONFIG.md`."""

from __future__ import annotations

import re
import sys
import types
import typing

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

HEADER = """# Configuration reference

Generated from the schemas (`trainer/config.py`, whose `data` settings `pipeline/spec.py` declares,
`trainer/output_config.py` and `cluster/spec.py`) by `python -m vitforge.config_reference docs/CONFIG.md`;
a test fails when this file is stale.
Set any key in a YAML file or with `--set section.key=value` (values are typed as YAML: `--set
augment.randaugment=[2,9]`, `--set data.val=null`). A key without a default must be given.
"""


def render() -> str:
    from vitforge.cluster import LaunchSpec
    from vitforge.trainer import Config

    parts = [
        HEADER,
        "## Training config (`vitforge train CONFIG`)\n",
        "Shipped recipes: `trainer/recipes/*.yaml`; `vitforge train NAME` finds them by name.\n",
    ]
    parts += _sections(Config, "")
    parts += [
        "## Launch spec (`vitforge submit SPEC`)\n",
        "Shipped specs: `cluster/specs/*.yaml`; `vitforge submit NAME` finds them by name.\n",
    ]
    parts += _sections(LaunchSpec, "")
    return "\n".join(parts)


def _sections(schema: type[BaseModel], prefix: str) -> list[str]:
    """One table for the schema's own keys, then a section per nested schema."""
    rows, nested = [], []
    for name, field in schema.model_fields.items():
        inner = _model_of(field.annotation)
        if inner is not None:
            nested.append((f"{prefix}{name}", inner, field))
            continue
        default = (
            "*required*"
            if field.default is PydanticUndefined and field.default_factory is None
            else f"`{_show(field.default)}`"
        )
        rows.append(f"| `{prefix}{name}` | {_type(field)} | {default} | {_one_line(field.description)} |")
    out = []
    if rows:
        out += ["| key | type | default | meaning |", "|---|---|---|---|", *rows, ""]
    for path, inner, field in nested:
        out += [f"### `{path}`\n"]
        described = field.description or (inner.__doc__ if inner.__doc__ != BaseModel.__doc__ else None)
        if described:
            out += [_one_line(described) + "\n"]
        out += _sections(inner, f"{path}.")
    return out


def _model_of(annotation) -> type[BaseModel] | None:
    candidates = typing.get_args(annotation) if _is_union(annotation) else (annotation,)
    return next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)


def _is_union(annotation) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def _type(field) -> str:
    text = _type_name(field.annotation)
    bounds = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    for item in field.metadata:
        for attr, sign in bounds.items():
            if getattr(item, attr, None) is not None:
                text += f", {sign} {getattr(item, attr)}"
    return text


def _type_name(annotation) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:  # a constrained type (e.g. the launch spec's SlurmName) shows as its base
        return _type_name(args[0])
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if _is_union(annotation):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in args)
    if origin in (list, tuple, dict):
        shown = ", ".join(_type_name(a) for a in args if a is not Ellipsis)
        return f"{origin.__name__}[{shown}]"
    return getattr(annotation, "__name__", str(annotation))


def _show(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value) if not isinstance(value, str) else value


def _one_line(text: str | None) -> str:
    return re.sub(r"\s+", " ", text or "").strip().replace("|", "\\|")


def main(argv: list[str]) -> int:
    text = render()
    if argv:
        with open(argv[0], "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
