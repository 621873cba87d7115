"""Coverage per package from `coverage json` output; given a second file, every module that lost
covered lines or branches against the first.

    python ci/coverage_compare.py AFTER.json              the table
    python ci/coverage_compare.py BEFORE.json AFTER.json  both tables, and the losses (exit 1 if any)
    ... BEFORE.json AFTER.json --sources BEFORE_DIR AFTER_DIR

With --sources (the two checkouts the runs measured), a module whose text changed between them is
compared line by line through a diff of the two files: a covered line of the first that is still
there must be covered in the second; lines the change removed or rewrote are counted apart, not as
losses. Without it, lines are compared by number, which is only right for unchanged files.
"""

from __future__ import annotations

import difflib
import json
import os
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


def line_map(before: str | None, after: str | None) -> dict[int, int] | None:
    """Line number in `before`'s text -> the same line's number in `after`'s, for the lines the diff
    keeps; None when both are the same text (or either is unknown): numbers carry over as they are."""
    if before is None or after is None or before == after:
        return None
    old, new = before.splitlines(), after.splitlines()
    mapping = {}
    for block in difflib.SequenceMatcher(None, old, new, autojunk=False).get_matching_blocks():
        for k in range(block.size):
            mapping[block.a + k + 1] = block.b + k + 1
    return mapping


def losses(before: dict, after: dict, sources: tuple[str, str] | None) -> tuple[list[str], int]:
    """Every module's lost lines and branches, and how many covered lines the change rewrote or removed."""
    lost, rewritten = [], 0
    for name, m in sorted(before.items()):
        now = after.get(name, {"lines": set(), "branches": set()})
        texts = [_read(root, name) for root in sources] if sources else [None, None]
        mapping = line_map(*texts)
        if mapping is None:
            lines, branches = m["lines"] - now["lines"], m["branches"] - now["branches"]
        else:
            kept = {line for line in m["lines"] if line in mapping}
            rewritten += len(m["lines"]) - len(kept)
            lines = {line for line in kept if mapping[line] not in now["lines"]}
            # a branch's ends are line numbers; an exit (negative) stays as it is
            moved = {(a, b) for a, b in m["branches"] if a in mapping and (b < 0 or b in mapping)}
            branches = {(a, b) for a, b in moved if (mapping[a], b if b < 0 else mapping[b]) not in now["branches"]}
        if lines or branches:
            lost.append(f"{name}: {len(lines)} lines {sorted(lines)[:20]}, {len(branches)} branches")
    return lost, rewritten


def _read(root: str, name: str) -> str | None:
    path = os.path.join(root, name)
    return open(path, encoding="utf-8").read() if os.path.exists(path) else None


def main(argv: list[str]) -> int:
    sources = None
    if "--sources" in argv:
        at = argv.index("--sources")
        sources, argv = tuple(argv[at + 1:at + 3]), argv[:at] + argv[at + 3:]
    found = [modules(path) for path in argv]
    for path, table in zip(argv, found):
        print(f"== {path}")
        print("\n".join(package_table(table)))
    if len(found) < 2:
        return 0
    lost, rewritten = losses(found[0], found[1], sources)
    if sources:
        print(f"covered lines the change between the sources rewrote or removed (not counted): {rewritten}")
    print("modules that lost covered lines or branches:" if lost else "no module lost a covered line or branch")
    print("\n".join(lost))
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
