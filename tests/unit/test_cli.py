"""The `vitforge` command (vitforge/cli.py): one version string in the package metadata and the CLI,
and bad arguments and configuration files, CLI by CLI: each is exit 2 (or the documented code) and
a message that names the argument, key or file, never a traceback and never a run that goes on."""

from __future__ import annotations

import signal
from importlib.metadata import version

import pytest

from common.cli import vitforge
from vitforge.cli import main
from vitforge.core import __version__


def test_one_version_string_in_the_package_metadata_and_the_cli():
    assert version("vitforge") == __version__  # pyproject.toml reads it from vitforge.core
    assert vitforge("--version").stdout.strip() == f"vitforge {__version__}"


@pytest.fixture(scope="module")
def files(tmp_path_factory, small_corpus):
    root = tmp_path_factory.mktemp("inputs")
    (root / "latin1.yaml").write_bytes("train:\n  steps: 10 # caf\xe9\n".encode("latin-1"))
    (root / "list.yaml").write_text("- train\n- steps\n")
    (root / "broken.yaml").write_text("train: [1,\n")
    (root / "folder").mkdir()
    (root / "not_a_spec.yaml").write_text("- a\n")
    return root


# (name, argv with {root} and {corpus} placeholders, exit code, words the message must contain)
CASES = [
    # configuration files and --set, through the one loader every CLI uses
    ("set-bad-yaml", ["train", "tiny_cpu", "--set", "optimizer.lr=[1,"], 2, ["--set optimizer.lr", "YAML"]),
    ("set-bad-yaml-submit", ["submit", "tiny_cpu", "--dry-run", "--set", "nodes=[1,"], 2, ["--set nodes"]),
    ("set-no-equals", ["train", "tiny_cpu", "--set", "train.steps"], 2, ["train.steps", "KEY=VALUE"]),
    ("recipe-not-utf8", ["train", "{root}/latin1.yaml"], 2, ["latin1.yaml", "UTF-8"]),
    ("recipe-list-with-set", ["train", "{root}/list.yaml", "--set", "train.steps=3"], 2, ["list.yaml", "mapping"]),
    ("recipe-bad-yaml", ["train", "{root}/broken.yaml"], 2, ["broken.yaml", "YAML"]),
    ("recipe-is-folder", ["train", "{root}/folder"], 2, ["folder", "folder"]),
    ("recipe-missing", ["train", "{root}/nope.yaml"], 2, ["nope.yaml"]),
    ("eval-recipe-is-folder", ["eval", "{root}/folder", "--checkpoint", "{root}/run"], 2, ["folder"]),
    ("spec-is-folder", ["submit", "{root}/folder", "--dry-run"], 2, ["folder"]),
    ("spec-list", ["submit", "{root}/not_a_spec.yaml", "--dry-run", "--set", "nodes=2"], 2, ["mapping"]),
    ("study-is-folder", ["study", "data-scale", "{root}/folder", "--dry-run"], 2, ["folder"]),
    # vitforge shard: numbers and paths
    ("shard-samples-negative", ["shard", "{corpus}", "{root}/o1", "--shard-samples", "-1"], 2, ["--shard-samples"]),
    ("shard-samples-zero", ["shard", "{corpus}", "{root}/o2", "--shard-samples", "0"], 2, ["--shard-samples"]),
    ("shard-bytes-words", ["shard", "{corpus}", "{root}/o3", "--shard-bytes", "lots"], 2, ["--shard-bytes"]),
    ("shard-quality", ["shard", "{corpus}", "{root}/o4", "--quality", "0"], 2, ["--quality"]),
    ("shard-quality-high", ["shard", "{corpus}", "{root}/o4", "--quality", "101"], 2, ["--quality"]),
    ("shard-max-side", ["shard", "{corpus}", "{root}/o5", "--max-side", "0"], 2, ["--max-side"]),
    ("shard-min-side", ["shard", "{corpus}", "{root}/o6", "--min-side", "-3"], 2, ["--min-side"]),
    ("shard-max-pixels", ["shard", "{corpus}", "{root}/o7", "--max-pixels", "0"], 2, ["--max-pixels"]),
    ("shard-workers", ["shard", "{corpus}", "{root}/o8", "--workers", "0"], 2, ["--workers"]),
    ("shard-num-parts", ["shard", "{corpus}", "{root}/o9", "--num-parts", "0"], 2, ["--num-parts"]),
    ("shard-part-range", ["shard", "{corpus}", "{root}/o10", "--num-parts", "2", "--part", "2"], 2, ["--part"]),
    ("shard-part-negative", ["shard", "{corpus}", "{root}/o10", "--num-parts", "2", "--part", "-1"], 2, ["--part"]),
    ("shard-seed-words", ["shard", "{corpus}", "{root}/o11", "--seed", "x"], 2, ["--seed"]),
    ("shard-src-missing", ["shard", "{root}/no-such-corpus", "{root}/o12"], 2, ["no-such-corpus"]),
    ("shard-classes-missing", ["shard", "{corpus}", "{root}/o13", "--classes", "{root}/nope.txt"], 2, ["nope.txt"]),
    ("shard-dest-is-file", ["shard", "{corpus}", "{root}/list.yaml"], 2, ["list.yaml"]),
    ("shard-verify-workers", ["shard", "verify", "{root}/o1", "--workers", "0"], 2, ["--workers"]),
    ("shard-verify-missing", ["shard", "verify", "{root}/no-dataset"], 2, ["no-dataset"]),
    ("shard-info-missing", ["shard", "info", "{root}/no-dataset"], 2, ["no-dataset"]),
    ("shard-merge-missing", ["shard", "merge", "{root}/no-dataset"], 2, ["no-dataset"]),
    # vitforge loader-bench
    ("bench-batch", ["loader-bench", "{root}/no-dataset", "--batch", "0"], 2, ["--batch"]),
    ("bench-steps", ["loader-bench", "{root}/no-dataset", "--steps", "0"], 2, ["--steps"]),
    ("bench-warmup", ["loader-bench", "{root}/no-dataset", "--warmup", "-1"], 2, ["--warmup"]),
    ("bench-image-size", ["loader-bench", "{root}/no-dataset", "--image-size", "-224"], 2, ["--image-size"]),
    ("bench-workers", ["loader-bench", "{root}/no-dataset", "--workers", "-1"], 2, ["--workers"]),
    ("bench-cache-gb", ["loader-bench", "{root}/no-dataset", "--cache-gb", "0"], 2, ["--cache-gb"]),
    ("bench-read-block", ["loader-bench", "{root}/no-dataset", "--read-block-mb", "-1"], 2, ["--read-block-mb"]),
    ("bench-dataset-missing", ["loader-bench", "{root}/no-dataset", "--steps", "1"], 2, ["no-dataset"]),
    # checkpoints
    ("ckpt-verify-missing", ["ckpt", "verify", "{root}/no-run"], 4, ["no-run"]),
    ("ckpt-export-missing", ["ckpt", "export", "{root}/no-run", "--out", "{root}/w.safetensors"], 4, ["no-run"]),
    ("ckpt-export-out", ["ckpt", "export", "{root}/no-run", "--out", "{root}/w.bin"], 2, ["--out", "w.bin"]),
    ("inspect-count", ["inspect", "{root}/no-run", "--out", "{root}/figs", "--count", "0"], 2, ["--count"]),
    ("inspect-missing", ["inspect", "{root}/no-run", "--out", "{root}/figs"], 4, ["no-run"]),
    # jobs: checked before SLURM is asked
    ("status-job", ["status", "12;ls"], 2, ["job", "'12;ls'"]),
    ("logs-job", ["logs", "abc"], 2, ["job", "'abc'"]),
    ("cancel-job", ["cancel", "$(id)"], 2, ["job", "'$(id)'"]),
    ("cancel-signal", ["cancel", "12", "--signal", "USR9"], 2, ["--signal", "'USR9'"]),
    # a study's runs are launch specs like any other: validated before a script is rendered
    ("study-model-line-break", ["study", "data-scale", "tiny_cpu_data_scale", "--dry-run", "--set",
                                'models=["vit_tiny_cpu\\ntouch x"]'], 2, ["train.overrides"]),
    # vitforge plan
    ("plan-nodes", ["plan", "--nodes", "0"], 2, ["nodes"]),
    ("plan-mfu", ["plan", "--mfu", "1.5"], 2, ["mfu"]),
    ("plan-epochs", ["plan", "--epochs", "-1"], 2, ["epochs"]),
    ("plan-bandwidth", ["plan", "--checkpoint-bandwidth", "0"], 2, ["checkpoint"]),
    ("plan-lost", ["plan", "--target-lost-fraction", "2"], 2, ["lost"]),
    ("plan-mtbf", ["plan", "--node-mtbf-hours", "-5"], 2, ["mtbf"]),
    ("plan-words", ["plan", "--nodes", "many"], 2, ["--nodes"]),
    # vitforge demo
    ("demo-workers", ["demo", "--workers", "0", "--out", "{root}/demo"], 2, ["--workers"]),
    ("demo-images", ["demo", "--images", "-5", "--out", "{root}/demo"], 2, ["--images"]),
]


def run_cli(capsys, args: list[str]) -> tuple[int, str]:
    """The real `vitforge` entry point, in this process (a subprocess each would cost seconds of
    imports per case): its exit code, argparse's included, and what it printed to stderr."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])  # `train` blocks its stop signals
    try:
        code = main(args)
    except SystemExit as e:
        code = e.code
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("argv,code,words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_argument_is_a_clear_error(files, small_corpus, capsys, argv, code, words):
    args = [a.format(root=files, corpus=small_corpus) for a in argv]
    got, stderr = run_cli(capsys, args)
    assert "Traceback" not in stderr, stderr
    assert got == code, (got, stderr)
    message = stderr.strip().splitlines()[-1]
    for word in words:
        assert word in message, message
    assert not (files / "o1").exists(), "a refused shard run must not start"
