"""Every benchmark at its smallest size, run as `make bench` runs it (a fresh process from the repo
root), those whose children import torch with --fork (each child a fork of the benchmark, the
imports paid once): it exits 0 and prints its goal lines, the ones benchmarks/summarise.py reads.
Correctness only: a smoke-sized run's figures mean nothing, so none is compared with its goal."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.scale_bench import TARGETS
from benchmarks.summarise import goal_rows
from common.cli import EXTENSIONS, REPO  # the environment of every launch the tests make

WORK = "{work}"  # replaced by the test's tmp_path
SMOKES = {  # benchmark: (its smallest arguments, the starts of the goal lines it must print, one per line)
    "shard_bench": (["--images", "20", "--repeat", "1", "--work", WORK],
                    ["(a) pack-only vs tar -cf", "(b) validation scaling 2 vs 1 workers",
                     "(c) 2 workers vs webdataset+Pillow"]),
    "loader_bench": (["--images", "20", "--batch", "2", "--short", "3", "--long", "6", "--workers", "1",
                      "--consumer-batches", "7", "--work", WORK, "--s3", "--fork"],
                     ["best CPU backend (", "decode-only floor vs best CPU backend", "images/s: dali-cpu",
                      *["consumer at"] * 3, "s3 streamed vs cached, images/s:"]),
    "train_bench": (["--steps", "3", "--warmup", "1", "--nproc", "1", "--fork"], ["overhead"]),
    # vit_small_cpu: its upload outlasts a few training steps, so (c) has steps to measure
    "ckpt_bench": (["--model", "vit_small_cpu", "--image-size", "32", "--saves", "1", "--every", "1", "--alone", "5"],
                   ["(a) async stall vs its own local write", "(b) upload vs raw boto3", "restore vs raw boto3",
                    "(c) step during an upload vs alone"]),
    "egress_bench": (["--images", "40", "--shard-samples", "5", "--work", WORK],
                     [f"{nodes} node(s): {figure}" for nodes in (1, 2, 4)
                      for figure in ("first-epoch egress, one order / partitioned", "partitioned first-epoch egress")]),
    "scale_bench": (["--scales", "0.0001", "--full", "", "--work", WORK, "--json", f"{WORK}/scale.json", "--fork"],
                    [f"{step} {figure} at paper scale" for step, figures in TARGETS.items() for figure in figures]
                    + ["array plan: 400,000,000 rows over 64 tasks", "array plan: per-task peak"]),
    "fewshot_bench": (["--classes", "10", "--shots", "5", "--dim", "16", "--test", "50", "--e2e-images", "40",
                       "--e2e-shots", "1", "--corpus-images", "40", "--work", WORK, "--fork"],
                      ["one regulariser: vitforge"]),
    "tracking_bench": (["--steps", "16", "--warmup", "12", "--log-every", "4", "--rounds", "1", "--nproc", "1",
                        "--fork"],
                       ["all off", "watchdog overhead", "stragglers (every 100) overhead", "MLflow overhead",
                        "W&B offline overhead", "profiler window, steps outside it overhead"]),
    "store_bench": (["--mb", "1", "--repeats", "1"], []),
    "weights_bench": (["--mb", "1", "--ranks", "2", "--fork"], []),
    # img2dataset's side needs its own venv (PyPI, ~30 s): the smoke runs vitforge's side alone.
    "url_bench": (["--rows", "20", "--repeat", "1", "--skip-competitor", "--work", WORK], []),
}
# What the benchmarks without goals of their own print instead, and the end-to-end part of the
# few-shot benchmark (no goal line, but the evaluator's path): a pattern per line.
LINES = {
    "fewshot_bench": [r"end to end, vit_tiny_cpu at 64 px, 40 images per split, .*; eval_fewshot_corpus_1shot, "
                      r"eval_knn_corpus$"],
    "store_bench": [rf"{backend}: 1 MB {way} +ours +[\d.]+ MB/s +sdk +[\d.]+ MB/s +ratio [\d.]+$"
                    for backend in ("local", "s3", "gcs", "azure") for way in ("upload", "download")],
    "url_bench": [r"round 1 vitforge +[\d.]+ s +\d+ images/s +[\d.]+ CPU-ms per image +20 of 20 images",
                  r"success: vitforge 20 of 20$"],
    "weights_bench": [rf"1 MB, 2 ranks, {path} *: [\d.]+ s, peak above what a rank held \(rank 0, others\) "
                      r"\d+ / \d+ MB$" for path in ("all_gather_object", "broadcast_object", "tensor_by_tensor")],
}


def run_benchmark(name: str, args: list[str], work: Path) -> subprocess.CompletedProcess:
    # Temporary folders too (servers' data, runs, staging) go under the test's own tmp_path.
    env = {**os.environ, **EXTENSIONS, "TMPDIR": str(work)}
    cmd = [sys.executable, f"benchmarks/{name}.py", *(a.replace(WORK, str(work)) for a in args)]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, (f"{cmd} exited {result.returncode}\nstdout:\n{result.stdout[-3000:]}\n"
                                    f"stderr:\n{result.stderr[-3000:]}")
    return result


# Seconds under a load like CI's (4 workers on 2 cores), of those over the plain slow mark's 20: started first.
LONGEST = {"tracking_bench": 55, "ckpt_bench": 50, "loader_bench": 45, "fewshot_bench": 40, "train_bench": 25}


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow(seconds=LONGEST[name]))
                                  if name in LONGEST else name for name in SMOKES])
def test_benchmark_smoke_prints_its_goal_lines(name, tmp_path):
    args, goals = SMOKES[name]
    out = run_benchmark(name, args, tmp_path).stdout
    figures = [row["figure"] for row in goal_rows(name, out)]
    for start in set(goals):
        found = sum(figure.startswith(start) for figure in figures)
        assert found == goals.count(start), f"{goals.count(start)} goal line(s) {start!r}, {found} in:\n{out}"
    lines = out.splitlines()
    for pattern in LINES.get(name, []):
        assert any(re.match(pattern, line) for line in lines), f"no line matching {pattern!r} in:\n{out}"


# Each command line's exit code, stdout and last stderr line from a fresh interpreter and from a fork,
# in a process of its own: forked refuses to fork a process that runs other threads (xdist's worker does).
FORK_AGAINST_FRESH = r'''
import json, subprocess, sys
from benchmarks.common import forked
script, data = sys.argv[1:]
argvs = [["-c", "import sys; print(sys.argv[1:]); sys.exit(3)", "a"], ["-c", "import sys; sys.exit('no')"],
         ["-c", "raise ValueError('bad')"], ["-m", "json.tool", "--sort-keys", data], [script, "b"]]
for argv in argvs:
    cmd = [sys.executable, *argv]
    for result in (subprocess.run(cmd, capture_output=True, text=True), forked(cmd)):
        print(json.dumps([result.returncode, result.stdout, result.stderr.splitlines()[-1:]]))
'''


def test_a_forked_child_gives_what_a_fresh_process_gives(tmp_path):
    script, data = tmp_path / "script.py", tmp_path / "data.json"
    script.write_text("import sys\nprint(__name__, sys.argv)\nsys.exit(4)\n")
    data.write_text('{"b": 1, "a": 2}')
    out = subprocess.run([sys.executable, "-c", FORK_AGAINST_FRESH, str(script), str(data)], cwd=REPO,
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 10, out.stdout
    for fresh, fork in zip(lines[::2], lines[1::2]):
        assert fork == fresh
    assert json.loads(lines[0]) == [3, "['a']\n", []]
    assert json.loads(lines[2]) == [1, "", ["no"]]
    assert json.loads(lines[4]) == [1, "", ["ValueError: bad"]]
    assert json.loads(lines[8]) == [4, f"__main__ {[str(script), 'b']}\n", []]
