"""The structure stays as docs/ARCHITECTURE.md draws it: the product packages import one another only
in the documented direction and never the local stand-ins (vitforge.testing) or the CLI front-end;
no module imports itself back through others (lazy imports inside functions count; imports only for
type checkers do not); no module grows past 450 lines and no function past 60; and the light
commands and modules (submitting, watching and cancelling jobs, validating a config, listing and
verifying checkpoints, rendering scripts, reading the scheduler's variables) never import torch."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from common.cli import REPO

FOLDERS = ("core", "shards", "pipeline", "trainer", "cluster", "testing", "vitforge")
PRODUCT_PACKAGES = ("core", "shards", "pipeline", "trainer", "cluster")
# The other vitforge packages each product package may import, as docs/ARCHITECTURE.md states the rules.
# Neither the `vitforge` front-end (the CLI) nor `vitforge.testing` (the local stand-ins) is among them.
MAY_IMPORT = {"core": set(), "shards": {"core"}, "pipeline": {"core", "shards"}, "trainer": {"core", "pipeline"},
              "cluster": {"core", "shards", "pipeline", "trainer"}}
MAX_LINES = 450
MAX_FUNCTION_LINES = 60  # from the `def` line to the last, the docstring counted


def _module_name(path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    package = ["vitforge"] + [p for p in parts[:-1] if p != "vitforge"]
    return ".".join(package if parts[-1] == "__init__" else package + [parts[-1]])


def _product_modules() -> dict[str, object]:
    return {_module_name(p): p for folder in FOLDERS for p in sorted((REPO / folder).rglob("*.py"))}


def _package_of(name: str, path) -> str:
    return name if path.stem == "__init__" else name.rsplit(".", 1)[0]


def _imported(path, package: str):
    """(line, dotted name, only for type checkers) for every import in one file, at any depth (lazy
    ones too), relative ones resolved against `package`, the dotted package the file belongs to.
    `from m import n` gives m.n, which is a module or a name defined in m."""
    def visit(node, type_only):
        for child in ast.iter_child_nodes(node):
            guarded = type_only or (isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test))
            if isinstance(child, ast.Import):
                yield from ((child.lineno, alias.name, guarded) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                parts = package.split(".")
                base = parts[:len(parts) - child.level + 1] if child.level else []
                module = ".".join(base + ([child.module] if child.module else []))
                yield from ((child.lineno, f"{module}.{alias.name}", guarded) for alias in child.names)
            yield from visit(child, guarded)

    yield from visit(ast.parse(path.read_text(), filename=str(path)), False)


def _vitforge_imports(path, package: str):
    """(line, package imported) for every vitforge import in one file, type checkers' ones too."""
    for line, name, _ in _imported(path, package):
        parts = name.split(".")
        if parts[0] == "vitforge":
            imported = parts[1] if len(parts) > 1 else "vitforge"  # `from vitforge import testing` too
            yield line, imported if imported in (*PRODUCT_PACKAGES, "testing") else "vitforge"


def _product_imports():
    for name, path in _product_modules().items():
        top = path.relative_to(REPO).parts[0]
        if top in PRODUCT_PACKAGES:
            for line, imported in _vitforge_imports(path, _package_of(name, path)):
                if imported != top:
                    yield top, imported, f"{path.relative_to(REPO)}:{line}"


def _imports(name: str, path, modules) -> set[str]:
    """The product modules `name` imports, at its top or inside functions (not under TYPE_CHECKING)."""
    found = {imported if imported in modules else imported.rsplit(".", 1)[0]
             for _, imported, type_only in _imported(path, _package_of(name, path)) if not type_only}
    return {m for m in found if m in modules and m != name}


def test_the_import_walk_resolves_absolute_relative_and_lazy_imports(tmp_path):
    (tmp_path / "trainer" / "sub").mkdir(parents=True)
    (tmp_path / "trainer" / "sub" / "m.py").write_text(
        "import vitforge.core\nfrom ..pipeline_like import x\nfrom ... import shards\n"
        "def f():\n    from vitforge import testing\n    from . import y\n"
        "if TYPE_CHECKING:\n    from vitforge import cluster\n")
    found = sorted(_vitforge_imports(tmp_path / "trainer" / "sub" / "m.py", "vitforge.trainer.sub"))
    assert found == [(1, "core"), (2, "trainer"), (3, "shards"), (5, "testing"), (6, "trainer"), (8, "cluster")]
    # The direction rule counts an import for type checkers; the cycle rule does not (it runs no code).
    type_only = [line for line, _, only in _imported(tmp_path / "trainer" / "sub" / "m.py", "vitforge.trainer.sub")
                 if only]
    assert type_only == [8]


def test_no_product_package_imports_the_local_stand_ins_or_the_cli():
    bad = [where for _, imported, where in _product_imports() if imported in ("testing", "vitforge")]
    assert not bad, f"product code imports vitforge.testing or the vitforge front-end: {bad}"


def test_product_packages_import_only_in_the_documented_direction():
    bad = [f"{where}: {top} imports {imported}" for top, imported, where in _product_imports()
           if imported not in MAY_IMPORT[top]]
    assert not bad, "imports against the rules in docs/ARCHITECTURE.md:\n" + "\n".join(bad)


def test_no_module_imports_itself_back():
    modules = _product_modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    cycles, state = [], {}  # depth-first search: 1 on the current path, 2 done

    def walk(node, path):
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(" -> ".join(path[path.index(dep):] + [dep]))
            elif dep not in state:
                walk(dep, path + [dep])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            walk(name, [name])
    assert cycles == []


def test_no_module_grows_past_the_limit():
    sizes = {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in _product_modules().values()}
    assert {m: n for m, n in sizes.items() if n > MAX_LINES} == {}


def _functions(node, prefix: str = ""):
    """(qualified name, node) of every function under `node`: methods and nested functions too."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            if not isinstance(child, ast.ClassDef):
                yield prefix + child.name, child
            yield from _functions(child, f"{prefix}{child.name}.")
        else:
            yield from _functions(child, prefix)


def test_no_function_grows_past_the_limit():
    long = [f"{module}.{name} ({path.relative_to(REPO)}:{node.lineno}): {node.end_lineno - node.lineno + 1} lines"
            for module, path in _product_modules().items()
            for name, node in _functions(ast.parse(path.read_text(), filename=str(path)))
            if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert long == [], f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


@pytest.mark.parametrize("module", ["vitforge.cluster.render", "vitforge.cluster.launcher", "vitforge.core.scheduler"])
def test_light_modules_import_no_torch(module):
    """A login node renders and submits scripts, and a sharding task reads its array index, without torch."""
    code = f"import sys, {module}; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


LIGHT = r"""
import sys
from vitforge.cli import main
for argv in ARGVS:
    try:
        main(argv)
    except SystemExit:
        pass
    heavy = sorted({m.split(".")[0] for m in sys.modules} & {"torch", "timm", "deepspeed", "nvidia"})
    print(" ".join(argv), "->", heavy or "light", flush=True)
"""


def test_light_commands_never_import_torch(tmp_path):
    run = tmp_path / "runs" / "r"
    (run / "step_00000002").mkdir(parents=True)
    # (status, logs and cancel by their --help: their modules are imported, no SLURM is asked)
    argvs = [["submit", "tiny_cpu", "--dry-run"], ["status", "--help"], ["logs", "--help"], ["cancel", "--help"],
             ["ckpt", "list", str(run)], ["ckpt", "verify", str(run)],
             ["study", "data-scale", "tiny_cpu_data_scale", "--dry-run"],
             ["train", "tiny_cpu", "--set", "train.objective=contrastive"],
             ["train", "tiny_cpu", "--set", "train.objective=masked_patch_prediction", "--set", "augment.mixup=0.2"]]
    code = "import vitforge.cluster.render\n" + LIGHT.replace("ARGVS", repr(argvs))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "SLURM_CONF": str(tmp_path / "none.conf")}, cwd=tmp_path)
    lines = [line for line in out.stdout.splitlines() if " -> " in line]
    assert len(lines) == len(argvs), out.stdout + out.stderr
    assert [line for line in lines if not line.endswith("-> light")] == [], out.stdout + out.stderr
