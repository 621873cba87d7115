"""The one `vitforge` command; each subcommand belongs to the package that does the work."""

from __future__ import annotations

import sys

from . import __version__

USAGE = f"""\
vitforge {__version__}

usage: vitforge COMMAND [ARGS]

commands:
  shard          pack images into validated WebDataset shards (also: shard merge | verify | info)
  loader-bench   measure a loader backend (DALI / torch) on your shards
  train          train a ViT with DeepSpeed ZeRO from a YAML recipe (--set key=value overrides)
  eval           evaluate a run's latest checkpoint
  demo           generate a small learnable corpus, shard it, verify it, print the report

'vitforge COMMAND --help' describes each command."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    if argv[0] == "--version":
        print(f"vitforge {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command == "shard":
        from shards.cli import main as shard_main

        return shard_main(rest)
    if command == "loader-bench":
        from pipeline.cli import main as loader_bench_main

        return loader_bench_main(rest)
    if command in ("train", "eval"):
        from trainer.cli import main as trainer_main

        return trainer_main(rest, evaluate=command == "eval")
    if command == "demo":
        from .demo import main as demo_main

        return demo_main(rest)
    print(f"vitforge: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2
