"""`vitforge submit SPEC`, `vitforge status JOB`, `vitforge logs JOB [-f]`, `vitforge cancel JOB`.

vitforge submit vit_h14_pretrain_1node --dry-run     print the sbatch script a spec renders to
vitforge submit my_spec.yaml --set nodes=4            write it to LOG_DIR/NAME.sbatch and sbatch it
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

from vitforge.core import setup_logging

from .launcher import get_launcher
from .spec import SPECS, SpecError, load_spec


def submit_main(argv: list[str]) -> int:
    shipped = ", ".join(sorted(p.stem for p in SPECS.glob("*.yaml")))
    p = argparse.ArgumentParser(
        prog="vitforge submit", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("spec", help=f"a launch spec YAML file, or a shipped one: {shipped}")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a spec value, e.g. --set nodes=4 --set train.overrides=[train.steps=100]",
    )
    p.add_argument("--dry-run", action="store_true", help="print the script instead of submitting it")
    p.add_argument(
        "--parts",
        default=None,
        metavar="I,J,...",
        help="sharding specs: submit only these array tasks (e.g. the ones that failed), then the merge",
    )
    args = p.parse_args(argv)
    setup_logging()
    spec = load_spec(args.spec, args.overrides)
    parts = _parts(args.parts, spec) if args.parts else None
    launcher = get_launcher()
    jobs = launcher.scripts(spec, parts)  # each job after the first waits for the first (afterok)
    if args.dry_run:
        print("\n".join(script.text for script in jobs), end="")
        return 0
    launcher.check(spec)
    os.makedirs(spec.log_dir, exist_ok=True)
    first = None
    for name, script, kind, log in jobs:
        path = os.path.join(spec.log_dir, name)
        with open(path, "w") as f:
            f.write(script)
        job = launcher.submit(path, after_ok=first)
        first = first or job
        print(f"submitted {kind} {job}: script {path}, log {os.path.join(spec.log_dir, log.format(job=job))}")
    return 0


def _parts(text: str, spec) -> list[int]:
    if spec.shard is None:
        raise SpecError("--parts applies to sharding specs only")
    try:
        parts = sorted({int(p) for p in text.split(",")})
    except ValueError:
        raise SpecError(f"--parts {text!r}: expected part numbers such as 7,12") from None
    if parts[0] < 0 or parts[-1] >= spec.shard.num_parts:
        raise SpecError(f"--parts {text}: parts are 0..{spec.shard.num_parts - 1}")
    return parts


def job_id(text: str) -> str:
    """A job id as the launcher takes it."""
    try:
        return get_launcher().parse_job(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def signal_name(text: str) -> str:
    """A signal as scancel --signal takes it: a name with or without SIG (USR1, SIGTERM) or a number."""
    name = text.upper().removeprefix("SIG")
    if not (f"SIG{name}" in signal.Signals.__members__ or (name.isdigit() and 0 < int(name) < signal.NSIG)):
        raise argparse.ArgumentTypeError(f"{text!r} is not a signal (e.g. USR1, TERM, 10)")
    return name


def status_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="vitforge status", description="State of a submitted job.")
    p.add_argument("job", type=job_id)
    info = get_launcher().status(p.parse_args(argv).job)
    print(
        f"job {info['job']} {info['name']}: {info['state']} (reason {info['reason']}), "
        f"restarts {info['restarts']}, exit code {info['exit_code']}, log {info['log']}"
    )
    return 0


def logs_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="vitforge logs", description="Print (or follow) a job's log.")
    p.add_argument("job", type=job_id)
    p.add_argument("-f", "--follow", action="store_true", help="keep printing as the log grows (Ctrl-C to stop)")
    args = p.parse_args(argv)
    path = get_launcher().log_path(args.job)
    if args.follow:
        return subprocess.call(["tail", "-n", "+1", "-F", path])
    with open(path, errors="replace") as f:
        sys.stdout.write(f.read())
    return 0


def cancel_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="vitforge cancel", description="Cancel a job (or send it a signal).")
    p.add_argument("job", type=job_id)
    p.add_argument(
        "--signal",
        type=signal_name,
        default=None,
        help="send this signal instead, e.g. USR1 to make it save and requeue",
    )
    args = p.parse_args(argv)
    get_launcher().cancel(args.job, args.signal)
    return 0
