"""The documentation stays true: docs/CONFIG.md is what the schemas generate, and every key, recipe
and launch spec the README tells a user to pass exists."""

from __future__ import annotations

import re

from pydantic import BaseModel

from common.cli import REPO
from vitforge.cluster import LaunchSpec
from vitforge.config_reference import render
from vitforge.trainer import Config

README = (REPO / "README.md").read_text()


def test_the_config_reference_is_generated_from_the_current_schemas():
    assert (REPO / "docs" / "CONFIG.md").read_text() == render(), \
        "docs/CONFIG.md is stale: python -m vitforge.config_reference docs/CONFIG.md"


def _has_key(schema: type[BaseModel], path: list[str]) -> bool:
    field = schema.model_fields.get(path[0])
    if field is None:
        return False
    if len(path) == 1:
        return True
    if path[0] == "deepspeed":  # any DeepSpeed key
        return True
    inner = next((t for t in (field.annotation, *getattr(field.annotation, "__args__", ()))
                  if isinstance(t, type) and issubclass(t, BaseModel)), None)
    return inner is not None and _has_key(inner, path[1:])


def test_every_key_the_readme_sets_exists():
    keys = set(re.findall(r"--set\s+\"?([a-z_][a-z0-9_.]*)=", README)) - {"a.b"}  # "--set a.b=c": the form
    keys |= set(re.findall(r"(?:\[|, |`)((?:model|data|augment|optimizer|train|checkpoint)\.[a-z_]+)[=`]", README))
    keys = {k for k in keys if not k.endswith((".json", ".jsonl", ".yaml"))}  # file names such as model.json
    assert len(keys) >= 30
    unknown = sorted(k for k in keys if not (_has_key(Config, k.split(".")) or _has_key(LaunchSpec, k.split("."))))
    assert not unknown, f"README sets keys no schema has: {unknown}"


def test_every_recipe_and_spec_the_readme_names_is_shipped():
    recipes = set(re.findall(r"vitforge (?:train|eval) ([a-z0-9_]+)", README))
    specs = set(re.findall(r"vitforge submit ([a-z0-9_]+)\b(?!\.)", README))
    assert recipes and specs
    assert all((REPO / "trainer" / "recipes" / f"{name}.yaml").exists() for name in recipes), recipes
    assert all((REPO / "cluster" / "specs" / f"{name}.yaml").exists() for name in specs), specs
