"""One table from the benchmarks' printed output: every line that states a goal, with the measured
value, the goal and whether it was met, and the ratios printed "for comparison" (no goal of their
own). `benchmarks/run_all.sh` calls it on the logs it keeps.

    python benchmarks/summarise.py bench-out/*.log
"""

from __future__ import annotations

import os
import re
import sys

# "<figure>: <value><unit> (goal <op> <target><unit>...)" as the benchmarks print it
GOAL_LINE = re.compile(r"^(?P<figure>.*?)[:=]?\s+(?P<value>[+-]?\d+(?:\.\d+)?)(?P<unit>[x%])"
                       r"(?:[^(]*)\(goal (?P<op><=|>=) (?P<target>\d+(?:\.\d+)?)(?P<goal_unit>[x%])")
# "<figure> = <value>x (for comparison)", or any other text before "(for comparison)"
COMPARISON_LINE = re.compile(r"^(?P<figure>.*?)(?:\s*[=:]\s*(?P<value>[+-]?\d+(?:\.\d+)?[x%]))?\s*\(for comparison\)$")


def goal_rows(benchmark: str, text: str) -> list[dict]:
    rows = []
    for line in text.splitlines():
        compared = COMPARISON_LINE.search(line.strip())
        if compared:
            rows.append({"benchmark": benchmark, "figure": compared["figure"], "value": compared["value"] or "",
                         "goal": "-", "met": None})
            continue
        match = GOAL_LINE.search(line.strip())
        if not match:
            continue
        value, target = float(match["value"]), float(match["target"])
        met = value >= target if match["op"] == ">=" else value <= target
        rows.append({"benchmark": benchmark, "figure": match["figure"].strip().rstrip(":= "),
                     "value": f"{match['value']}{match['unit']}", "goal": f"{match['op']} {match['target']}"
                     f"{match['goal_unit']}", "met": met})
    return rows


def table(rows: list[dict]) -> str:
    widths = [max(len(r[k]) for r in rows + [{"benchmark": "benchmark", "figure": "figure", "value": "measured",
                                               "goal": "goal"}]) for k in ("benchmark", "figure", "value", "goal")]
    lines = [f"{'benchmark':<{widths[0]}}  {'figure':<{widths[1]}}  {'measured':>{widths[2]}}  "
             f"{'goal':<{widths[3]}}  met"]
    lines += [f"{r['benchmark']:<{widths[0]}}  {r['figure']:<{widths[1]}}  {r['value']:>{widths[2]}}  "
              f"{r['goal']:<{widths[3]}}  {'-' if r['met'] is None else 'yes' if r['met'] else 'NO'}" for r in rows]
    return "\n".join(lines)


def main(paths: list[str]) -> int:
    rows = []
    for path in paths:
        with open(path, errors="replace") as f:
            rows += goal_rows(os.path.basename(path).removesuffix(".log"), f.read())
    if not rows:
        print("no goal lines found in " + ", ".join(paths))
        return 1
    print(table(rows))
    goals = [r for r in rows if r["met"] is not None]
    print(f"{sum(r['met'] for r in goals)} of {len(goals)} goals met")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
