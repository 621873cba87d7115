"""The benchmark summary (benchmarks/summarise.py) reads each figure's value, its goal and whether
it is met from a benchmark's report lines."""

from __future__ import annotations

from benchmarks.summarise import goal_rows


def test_the_benchmark_summary_reads_goal_and_comparison_lines():
    text = "\n".join([
        "corpus: 4000 JPEGs",
        "best CPU backend (dali-cpu) vs baseline, per CPU-second: 1.42x (goal >= 1.5x)",
        "overhead: +2.8% (goal <= 5%)  [2 ranks]",
        "(a) async stall vs its own local write: 1.00x (goal <= 1.0x; vitforge adds 5 ms)",
        "4 node(s): first-epoch egress, one order / partitioned = 4.00x (for comparison)",
    ])
    rows = goal_rows("bench", text)
    assert [(r["value"], r["goal"], r["met"]) for r in rows] == [
        ("1.42x", ">= 1.5x", False), ("+2.8%", "<= 5%", True), ("1.00x", "<= 1.0x", True), ("4.00x", "-", None)]
    assert rows[0]["figure"] == "best CPU backend (dali-cpu) vs baseline, per CPU-second"
