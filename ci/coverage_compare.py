"""Coverage per package from `coverage json` output; given a second file, every module that lost
covered lines or branches against the first.

    python ci/coverage_compare.py AFTER.json              the table
    python ci/coverage_compare.py BEFORE.json AFTER.json  both tables, and the losses (exit 1 if any)
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def modules(path: str) -> dict[str, dict]:
    """Module (path relative to the repository) -> its summary, covered lines and branches as sets."""
    files = json.load(open(path))["files"]
    return {name: {"lines": set(f["executed_lines"]), "statements": f["summary"]["num_statements"],
                   "branches": {tuple(b) for b in f.get("executed_branches", [])},
                   "num_branches": f["summary"].get("num_branches", 0)}
            for name, f in files.items()}


def package_table(found: dict[str, dict]) -> list[str]:
    totals = defaultdict(lambda: [0, 0, 0, 0])
    for name, m in found.items():
        package = name.split("/")[0] if "/" in name else "vitforge"
        for i, value in enumerate((len(m["lines"]), m["statements"], len(m["branches"]), m["num_branches"])):
            totals[package][i] += value
            totals["all"][i] += value
    rows = [f"{'package':<10} {'lines':>15} {'branches':>15}"]
    for package in sorted(totals, key=lambda p: (p == "all", p)):
        lines, statements, branches, num = totals[package]
        rows.append(f"{package:<10} {lines:>6}/{statements:<5} {100 * lines / max(statements, 1):5.1f}% "
                    f"{branches:>5}/{num:<5} {100 * branches / max(num, 1):5.1f}%")
    return rows


def main(argv: list[str]) -> int:
    found = [modules(path) for path in argv]
    for path, table in zip(argv, found):
        print(f"== {path}")
        print("\n".join(package_table(table)))
    if len(found) < 2:
        return 0
    before, after = found
    lost = []
    for name, m in sorted(before.items()):
        now = after.get(name, {"lines": set(), "branches": set()})
        lines, branches = m["lines"] - now["lines"], m["branches"] - now["branches"]
        if lines or branches:
            lost.append(f"{name}: {len(lines)} lines {sorted(lines)[:20]}, {len(branches)} branches")
    print("modules that lost covered lines or branches:" if lost else "no module lost a covered line or branch")
    print("\n".join(lost))
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
