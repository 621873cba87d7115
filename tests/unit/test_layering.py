"""The structure stays as docs/ARCHITECTURE.md draws it (the direction of imports between packages is
test_units.py's): no module imports itself back through others (lazy imports inside functions
count; imports only for type checkers do not), no module grows past 450 lines, and the light
commands (submitting, watching and cancelling jobs, validating a config, listing and verifying
checkpoints) never import torch."""

from __future__ import annotations

import ast
import subprocess
import sys

from common.cli import REPO

FOLDERS = ("core", "shards", "pipeline", "trainer", "cluster", "testing", "vitforge")
MAX_LINES = 450


def _module_name(path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    package = ["vitforge"] + [p for p in parts[:-1] if p != "vitforge"]
    return ".".join(package if parts[-1] == "__init__" else package + [parts[-1]])


def _product_modules() -> dict[str, object]:
    return {_module_name(p): p for folder in FOLDERS for p in sorted((REPO / folder).rglob("*.py"))}


def _imports(name: str, path, modules) -> set[str]:
    """The product modules `name` imports, at its top or inside functions (not under TYPE_CHECKING)."""
    package = name if path.stem == "__init__" else name.rsplit(".", 1)[0]
    found = set()

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names if a.name in modules)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - child.level + 1] + ([base] if base else []))
                for alias in child.names:
                    target = f"{base}.{alias.name}"
                    found.add(target if target in modules else base)
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in found if m in modules and m != name}


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
