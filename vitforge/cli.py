"""The one `vitforge` command; each subcommand belongs to the package that does the work.

Every subcommand follows one exit-code convention (vitforge.core.errors, listed in the README):
an expected failure is one line `vitforge: <kind>: <message>` on rank 0 and its code, never a
traceback; only a bug prints a traceback (code 70).
"""

from __future__ import annotations

import signal
import sys
import traceback

from vitforge.core import VitforgeError, __version__, errors, process_rank, record_exit_code

USAGE = f"""\
vitforge {__version__}

usage: vitforge COMMAND [ARGS]

commands:
  shard          pack images into validated WebDataset shards (also: shard merge | verify | info)
  loader-bench   measure a loader backend (DALI / torch) on your shards
  train          train a ViT with DeepSpeed ZeRO from a YAML recipe (--set key=value overrides)
  eval           evaluate a checkpoint (local or s3://) on held-out shards
  ckpt           list, verify or export a run's checkpoints (ckpt list | verify | export)
  inspect        the ViT paper's figures for a checkpoint: position embeddings, filters, attention
  submit         render a launch spec to an sbatch script and submit it (--dry-run prints it)
  status | logs | cancel JOB   a submitted job's state, its log (-f follows), cancel or signal it
  study          the paper's data-scale study: one run per (model, subset), then collect a table and plot
  plan           capacity planner: throughput, time, GPU-hours, decode cores, store traffic, checkpoint interval
  demo           generate a small learnable corpus, shard it, train on it, evaluate
  build-ops      build DeepSpeed's CPU op into the installation once (else the first train does, ~35 s)

exit codes: 0 ok, 1 a verification found problems, 2 bad usage/config/input, 3 storage unreachable
or denied (or the run is owned by another job), 4 checkpoint missing/corrupt/incompatible,
5 training diverged (non-finite loss), 70 internal error (a bug), 75 stopped on a signal or
time limit after a complete checkpoint: run again to resume, 76 a step hung (every rank's stacks
in RUN/debug/): run again to resume, 130 interrupted.

'vitforge COMMAND --help' describes each command."""


def _dispatch(command: str, rest: list[str]) -> int:
    if command == "shard":
        from vitforge.shards.cli import main as shard_main

        return shard_main(rest)
    if command == "loader-bench":
        from vitforge.pipeline.cli import main as loader_bench_main

        return loader_bench_main(rest)
    if command in ("train", "eval"):
        if command == "train":
            # SLURM signals every process of a job step. Held from here, a stop signal that comes
            # during imports and start-up neither kills this process nor a child it starts (the
            # mask is inherited: DeepSpeed's JIT compiler): the trainer takes it when it can save.
            # The trainer's STOP_SIGNALS, spelled out: importing the trainer package imports torch.
            signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGUSR1, signal.SIGTERM))
        from vitforge.trainer.cli import main as trainer_main

        return trainer_main(rest, evaluate=command == "eval")
    if command == "ckpt":
        from vitforge.trainer.ckpt_cli import main as ckpt_main

        return ckpt_main(rest)
    if command == "inspect":
        from vitforge.trainer.figures_cli import main as inspect_main

        return inspect_main(rest)
    if command in ("submit", "status", "logs", "cancel"):
        from vitforge.cluster import submit_cli

        return getattr(submit_cli, f"{command}_main")(rest)
    if command == "study":
        from vitforge.cluster.study_cli import main as study_main

        return study_main(rest)
    if command == "plan":
        from vitforge.cluster.cli import main as plan_main

        return plan_main(rest)
    if command == "build-ops":
        from vitforge.trainer.ops import main as build_ops_main

        return build_ops_main(rest)
    if command == "demo":
        from .demo import main as demo_main

        return demo_main(rest)
    print(f"vitforge: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return errors.USAGE


def main(argv: list[str] | None = None) -> int:
    code = _main(sys.argv[1:] if argv is None else argv)
    record_exit_code(code)
    return code


def _main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return errors.OK
    if argv[0] == "--version":
        print(f"vitforge {__version__}")
        return errors.OK
    try:
        return _dispatch(argv[0], argv[1:])
    except VitforgeError as e:
        _say(f"vitforge: {e.kind}: {e}")
        return e.exit_code
    except OSError as e:
        _say(f"vitforge: storage error: {e}")
        return errors.STORAGE
    except KeyboardInterrupt:
        _say("vitforge: interrupted")
        return errors.INTERRUPTED
    except Exception:
        traceback.print_exc()
        return errors.INTERNAL


def _say(line: str) -> None:
    """Every rank of a job fails the same way (decisions are agreed), so only rank 0 speaks."""
    if process_rank() == 0:
        print(line, file=sys.stderr)
