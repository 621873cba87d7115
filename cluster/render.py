"""The sbatch script of a launch spec: readable, commented, and free of credentials.

One task per GPU via srun; the rendezvous is the allocation's first node (an address every node
reaches: its `network_interface`'s, or its name as the batch host resolves it, never loopback on
several nodes) and a port derived from the job id; SLURM sends SIGUSR1 `signal_lead_s` before the
time limit to every task (the trainer saves and exits 75, as it does when it loses a peer node);
the script then requeues the job itself, up to `max_requeues` times, unless a newer incarnation of
the job already runs, and the restarted job resumes from the newest complete checkpoint. A hang
(the trainer's watchdog exits 76) requeues the same way, at most `max_hang_requeues` times in the
job's life. GPU jobs turn on PyTorch's NCCL flight recorder and watchdog monitor (`nccl_watchdog`).

Spec values are data, never script: the schema (spec.py) keeps them on one line (and SLURM names
to a strict character set); here each is quoted for where it lands: `sbatch_word` in #SBATCH
lines (sbatch parses those itself), shlex in shell lines, and nothing inside double quotes.
"""

from __future__ import annotations

import re
import shlex

from vitforge.core import errors
from vitforge.core.scheduler import SLURM_PORT_BASE, SLURM_PORT_SPAN
from vitforge.trainer.config import TrainConfig

from .spec import LaunchSpec

REQUEUE_EXIT = errors.REQUEUE
HUNG_EXIT = errors.HUNG
# Every store's credentials travel by inheritance: sbatch passes the submitting environment to the
# batch step (its default, --export=ALL), srun to every rank (and into a container).
CREDENTIALS_NOTE = (
    "# Credentials are not in this file: the job inherits the submitting environment (AWS_*,",
    "# GOOGLE_APPLICATION_CREDENTIALS, AZURE_STORAGE_*: each cloud's standard chain), and srun passes it on.",
)

# NCCL settings per fabric; users add or override any in `env`.
NCCL_PRESETS = {
    "none": {},
    "infiniband": {"NCCL_IB_DISABLE": "0", "NCCL_NET_GDR_LEVEL": "PHB", "NCCL_SOCKET_IFNAME": "^lo,docker"},
    "efa": {
        "FI_PROVIDER": "efa",
        "FI_EFA_USE_DEVICE_RDMA": "1",
        "NCCL_PROTO": "simple",
        "NCCL_SOCKET_IFNAME": "^lo,docker",
    },
    "roce": {"NCCL_IB_DISABLE": "0", "NCCL_IB_GID_INDEX": "3", "NCCL_SOCKET_IFNAME": "^lo,docker"},
}
SBATCH_PLAIN = re.compile(r"[A-Za-z0-9_.:/@%+=,&|*()!\[\]^-]+")


def sbatch_word(value: str) -> str:
    """`value` written so that sbatch's own #SBATCH parser (not a shell) reads back exactly it:
    there whitespace ends a value, '#' starts a comment, quotes are removed and a backslash escapes
    the next character, also inside quotes."""
    if SBATCH_PLAIN.fullmatch(value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _option(name: str, value: object) -> str:
    return f"--{name}={sbatch_word(str(value))}"


def _log(log_dir: str, pattern: str) -> str:
    """--output: the folder taken literally ('%' doubled), then SLURM's %x/%j/%A/%a pattern."""
    return _option("output", f"{log_dir.replace('%', '%%')}/{pattern}")


def trainer_command(spec: LaunchSpec) -> list[str]:
    """`vitforge train` with the spec's overrides. A time budget that ends where the pre-limit
    signal would come is set first (the user's own train.max_minutes wins): if the signal is late
    (SLURM checks limits every 30 s) or lost, the trainer still stops in time with a checkpoint."""
    args = ["vitforge", "train", spec.train.config]
    budget = (spec.time_limit_s() - spec.signal_lead_s) / 60
    overrides = [f"train.max_minutes={budget:g}", *spec.train.overrides]
    if spec.train.dataset:
        overrides.append(f"data.train={spec.train.dataset}")
    if spec.train.checkpoint_dir:
        overrides.append(f"checkpoint.dir={spec.train.checkpoint_dir}")
    for item in overrides:
        args += ["--set", item]
    return args


def eval_command(spec: LaunchSpec) -> list[str]:
    """`vitforge eval` of the spec's checkpoint on its dataset, with its overrides."""
    args = ["vitforge", "eval", spec.eval.config, "--checkpoint", spec.eval.checkpoint]
    for item in [*spec.eval.overrides, *([f"data.val={spec.eval.dataset}"] if spec.eval.dataset else [])]:
        args += ["--set", item]
    return args


def _rendezvous(spec: LaunchSpec) -> list[str]:
    """MASTER_ADDR/MASTER_PORT for every rank. sbatch runs this script on the allocation's first node,
    where srun's block distribution puts rank 0, so the address is found here, once, and exported:
    an address, never a name that only some hosts resolve. Anything wrong ends the job before srun
    with a usage error (not requeued: a requeue would fail the same way)."""
    fail = f'{{ echo "vitforge: $1" >&2; exit {errors.USAGE}; }}'
    several = '[ "${SLURM_JOB_NUM_NODES:-1}" -gt 1 ]'
    lines = [
        "# Rendezvous: rank 0 runs on the allocation's first node, which runs this script; its address must",
        "# be one every node reaches. The port derives from the job id (stable across requeues).",
        f"rendezvous_fail() {fail}",
    ]
    iface = spec.network_interface
    if iface:
        quoted = shlex.quote(iface)
        lines += [
            f"export GLOO_SOCKET_IFNAME={quoted} NCCL_SOCKET_IFNAME={quoted}",
            f'MASTER_ADDR="$(ip -4 -o addr show dev {quoted} 2>/dev/null '
            '| awk \'{split($4, a, "/"); print a[1]; exit}\')"',
            f'[ -n "$MASTER_ADDR" ] || rendezvous_fail "network_interface {iface} does not exist or has no IPv4 '
            'address on $(hostname) (it has: $(ls /sys/class/net | tr "\\n" " "))"',
            f'case "$MASTER_ADDR" in 127.*) {several} && rendezvous_fail "network_interface {iface} on $(hostname) '
            'is loopback ($MASTER_ADDR): other nodes cannot reach it";; esac',
        ]
    else:
        lines += [
            'first_node="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
            'MASTER_ADDR="$(getent ahostsv4 "$first_node" | awk \'{print $1; exit}\')"',
            '[ -n "$MASTER_ADDR" ] || rendezvous_fail "node $first_node has no IPv4 address on $(hostname) '
            '(getent ahostsv4); set network_interface in the launch spec"',
            f'case "$MASTER_ADDR" in 127.*) {several} && rendezvous_fail "node $first_node resolves to loopback '
            "$MASTER_ADDR on $(hostname), which other nodes cannot reach: set network_interface in the launch spec "
            '(e.g. eth0, ib0)";; esac',
        ]
    port = f"$(({SLURM_PORT_BASE} + SLURM_JOB_ID % {SLURM_PORT_SPAN}))"  # what scheduler_env derives
    return [*lines, "export MASTER_ADDR", f"export MASTER_PORT={port}"]


def nccl_watchdog(spec: LaunchSpec) -> list[str]:
    """PyTorch's own NCCL watchdog, set to agree with the trainer's (GPU specs only; the spec's `env`
    is exported after these and wins)."""
    if not spec.gpus_per_node:
        return []
    heartbeat = int(TrainConfig.model_fields["collective_timeout_s"].default)
    floor = int(TrainConfig.model_fields["hang_floor_s"].default)
    trace = shlex.quote(f"{spec.log_dir}/nccl-trace-")
    return [
        "# PyTorch's NCCL watchdog: a collective past train.collective_timeout_s makes each rank dump its flight",
        "# recorder (its last collectives) to the log folder before it aborts; the monitor aborts a rank whose NCCL",
        f"# watchdog thread is itself stuck in a CUDA/NCCL call for {heartbeat} s (collective_timeout_s's default).",
        f"# Both come after the trainer's own hang watchdog (train.hang_floor_s, {floor} s by default), which writes",
        f"# every thread's stack to RUN/debug/ and exits {HUNG_EXIT} first.",
        f"export TORCH_NCCL_TRACE_BUFFER_SIZE=2000 TORCH_NCCL_DUMP_ON_TIMEOUT=1 TORCH_NCCL_ENABLE_MONITORING=1 "
        f"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC={heartbeat}",
        f'export TORCH_NCCL_DEBUG_INFO_TEMP_FILE={trace}"$SLURM_JOB_ID-${{SLURM_RESTART_COUNT:-0}}-rank"',
    ]


def _allocation(spec: LaunchSpec) -> list[str]:
    requests = {
        "mem": spec.mem_per_node,
        "mem-per-cpu": spec.mem_per_cpu,
        "mem-per-gpu": spec.mem_per_gpu,
        "partition": spec.partition,
        "account": spec.account,
        "qos": spec.qos,
        "constraint": spec.constraint,
    }
    return [
        *(_option(name, value) for name, value in requests.items() if value),
        *(["--exclusive"] if spec.exclusive else []),
    ]


def _setup(env: dict[str, str], venv: str | None) -> list[str]:
    return [
        *(f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items())),
        *([f"source {shlex.quote(venv)}/bin/activate"] if venv else []),
    ]


def render_shard_array(spec: LaunchSpec, parts: list[int] | None = None) -> str:
    """One array task per part (`vitforge shard` reads its part from SLURM_ARRAY_TASK_ID); `parts`
    resubmits only those (a failed task, alone)."""
    shard = spec.shard
    indices = ",".join(map(str, parts)) if parts else f"0-{shard.num_parts - 1}"
    throttle = f"%{shard.throttle}" if shard.throttle else ""
    command = [
        "vitforge",
        "shard",
        shard.src,
        shard.dest,
        "--num-parts",
        str(shard.num_parts),
        "--workers",
        str(spec.cpus_per_task),
        *shard.args,
    ]
    lines = [
        "#!/bin/bash",
        f"# vitforge launch spec {spec.name!r}: sharding in {shard.num_parts} parts, one array task each.",
        *CREDENTIALS_NOTE,
        f"#SBATCH {_option('job-name', spec.name)}",
        f"#SBATCH --array={indices}{throttle}",
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks=1",
        f"#SBATCH --cpus-per-task={spec.cpus_per_task}",
        f"#SBATCH {_option('time', spec.time)}",
        *(f"#SBATCH {d}" for d in _allocation(spec)),
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        f"#SBATCH {_log(spec.log_dir, '%x-%A_%a.out')}",
        "",
        "set -uo pipefail",
        *_setup(spec.env, spec.venv),
        "# Array task i builds part i (also when only some parts are resubmitted); a rerun resumes it.",
        shlex.join(command) + ' --part "$SLURM_ARRAY_TASK_ID"',
    ]
    return "\n".join(lines) + "\n"


def render_merge(spec: LaunchSpec) -> str:
    """Runs after every array task succeeded (afterok): writes the final dataset.json."""
    lines = [
        "#!/bin/bash",
        f"# vitforge launch spec {spec.name!r}: merge the parts' records into dataset.json.",
        f"#SBATCH {_option('job-name', f'{spec.name}-merge')}",
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks=1",
        *CREDENTIALS_NOTE,
        "#SBATCH --cpus-per-task=1",
        f"#SBATCH {_option('time', spec.time)}",
        *(f"#SBATCH {d}" for d in _allocation(spec)),
        "#SBATCH --open-mode=append",
        f"#SBATCH {_log(spec.log_dir, '%x-%j.out')}",
        "",
        "set -uo pipefail",
        *_setup(spec.env, spec.venv),
        shlex.join(["vitforge", "shard", "merge", spec.shard.dest]),
    ]
    return "\n".join(lines) + "\n"


def _command(spec: LaunchSpec, tasks: list[LaunchSpec] | None, srun: list[str]) -> list[str]:
    if not tasks:
        return [f"{shlex.join(srun)} \\\n    {shlex.join(trainer_command(spec) if spec.train else eval_command(spec))}"]
    cases = [f"    {i}) command=({shlex.join(trainer_command(task))}) ;;" for i, task in enumerate(tasks)]
    return [
        "# This array task's run (SLURM_ARRAY_TASK_ID); a task's requeue restarts this task alone.",
        'case "${SLURM_ARRAY_TASK_ID:?}" in',
        *cases,
        f'    *) echo "vitforge: no run for array task $SLURM_ARRAY_TASK_ID" >&2; exit {errors.USAGE} ;;',
        "esac",
        f'{shlex.join(srun)} "${{command[@]}}"',
    ]


def _requeue(spec: LaunchSpec) -> list[str]:
    """The script's ending: requeue the job after a stop for requeue or a hang, within its limits, and
    only while SLURM still runs this incarnation."""
    return [
        f"# {REQUEUE_EXIT}: the trainer stopped on SIGUSR1/SIGTERM or its time budget after a complete",
        "# checkpoint, or lost a peer node in a collective (nothing written since the newest complete",
        f"# checkpoint). {HUNG_EXIT}: a step, checkpoint save or evaluation hung: every live rank wrote its stacks",
        "# to RUN/debug/ and the log names the ranks that did not reach the collective. Requeue (the restarted",
        "# job resumes from the newest complete checkpoint), at most max_requeues times, after a hang at most",
        "# max_hang_requeues times in the job's life (counted in a file: SLURM_RESTART_COUNT counts every",
        "# requeue), and only while SLURM still runs this incarnation: a stale copy cut off by a network",
        "# partition, whose job SLURM already requeued elsewhere, must not requeue the newer one when its",
        "# link returns.",
        f"if [ $code -eq {REQUEUE_EXIT} ] || [ $code -eq {HUNG_EXIT} ]; then",
        "    for try in 1 2 3; do",
        '        current="$(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null '
        "| grep -oE '(Restarts|RestartCnt)=[0-9]+' | head -n 1 | cut -d= -f2)\"",
        '        [ -n "$current" ] && break; sleep 5',
        "    done",
        "    # Unreadable (slurmctld busy): requeue; a copy that is really cut off cannot requeue anyway.",
        '    if [ -n "$current" ] && [ "$current" -gt "${SLURM_RESTART_COUNT:-0}" ]; then',
        '        echo "vitforge: job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0} is stale (SLURM runs restart '
        '${current:-unknown}): a newer incarnation runs; not requeueing"',
        "        exit $code",
        "    fi",
        "    hangs=0",
        f"    if [ $code -eq {HUNG_EXIT} ]; then",
        f'        hangs_file={shlex.quote(f"{spec.log_dir}/.hangs-")}"$SLURM_JOB_ID"',
        '        hangs=$(( $(cat "$hangs_file" 2>/dev/null || echo 0) + 1 ))',
        '        echo "$hangs" > "$hangs_file"',
        f'        echo "vitforge: job $SLURM_JOB_ID hung (hang $hangs; at most {spec.max_hang_requeues} requeued): '
        "every rank's stacks are in the run's debug/ folder\"",
        "    fi",
        f'    if [ "$hangs" -gt {spec.max_hang_requeues} ]; then',
        f'        echo "vitforge: hang requeue limit {spec.max_hang_requeues} reached; the run is resumable by hand"',
        f'    elif [ "${{SLURM_RESTART_COUNT:-0}}" -lt {spec.max_requeues} ]; then',
        '        echo "vitforge: requeueing job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0})"',
        '        scontrol requeue "$SLURM_JOB_ID"',
        "        exit 0",
        "    else",
        f'        echo "vitforge: requeue limit {spec.max_requeues} reached; the run is resumable by hand"',
        "    fi",
        "fi",
    ]


def render(spec: LaunchSpec, tasks: list[LaunchSpec] | None = None) -> str:
    """The sbatch script of a training or eval spec. `tasks`: a job array, one task per spec, which
    share `spec`'s resources and differ only in the trainer's command (a study's runs); each task
    requeues on its own."""
    if spec.shard is not None:
        return render_shard_array(spec)
    directives = _directives(spec, tasks)
    srun = _srun(spec)
    lines = [
        "#!/bin/bash",
        f"# vitforge launch spec {spec.name!r}: {spec.nodes} node(s) x {spec.ntasks_per_node} task(s), rendered by "
        "`vitforge submit`.",
        *CREDENTIALS_NOTE,
        *(f"#SBATCH {d}" for d in directives),
        "",
        "set -uo pipefail",
        *_rendezvous(spec),
        *nccl_watchdog(spec),
        *_setup(
            {
                k: v
                for k, v in {**NCCL_PRESETS[spec.nccl], **spec.env}.items()
                if not (spec.network_interface and k == "NCCL_SOCKET_IFNAME")
            },
            spec.venv,
        ),
        'echo "vitforge: job $SLURM_JOB_ID start $(date -Is) restart ${SLURM_RESTART_COUNT:-0} on $SLURM_JOB_NODELIST, '
        'rendezvous $MASTER_ADDR:$MASTER_PORT"',
        "",
        "# One task per GPU; SLURM maps SLURM_PROCID/NTASKS/LOCALID to the trainer's ranks. Rank 0 writes",
        "# its exit code to VITFORGE_EXIT_FILE: srun reports a killed straggler's code, not the trainer's.",
        f'export VITFORGE_EXIT_FILE={shlex.quote(f"{spec.log_dir}/.exit-")}"$SLURM_JOB_ID-${{SLURM_RESTART_COUNT:-0}}"',
        'rm -f "$VITFORGE_EXIT_FILE"',
        *_command(spec, tasks, srun),
        "code=$?",
        '[ -s "$VITFORGE_EXIT_FILE" ] && code=$(cat "$VITFORGE_EXIT_FILE") && rm -f "$VITFORGE_EXIT_FILE"',
        "",
        *_requeue(spec),
        'echo "vitforge: job $SLURM_JOB_ID ended $(date -Is) with exit code $code"',
        "exit $code",
    ]
    return "\n".join(lines) + "\n"


def _directives(spec: LaunchSpec, tasks: list[LaunchSpec] | None) -> list[str]:
    """The #SBATCH options: the job's name, shape, time, GPUs and allocation, requeueing, and its log."""
    array = [f"--array=0-{len(tasks) - 1}"] if tasks else []
    return [
        _option("job-name", spec.name),
        f"--nodes={spec.nodes}",
        f"--ntasks-per-node={spec.ntasks_per_node}",
        f"--cpus-per-task={spec.cpus_per_task}",
        _option("time", spec.time),
        *(
            [_option("gpus-per-node", f"{spec.gpu_type + ':' if spec.gpu_type else ''}{spec.gpus_per_node}")]
            if spec.gpus_per_node
            else []
        ),
        *_allocation(spec),
        # An eval has nothing to save: no pre-limit signal, which would only kill it.
        "--requeue",
        *([f"--signal=USR1@{spec.signal_lead_s}"] if spec.train else []),
        "--open-mode=append",
        *array,
        _log(spec.log_dir, "%x-%A_%a.out" if tasks else "%x-%j.out"),
    ]


def _srun(spec: LaunchSpec) -> list[str]:
    """srun's options, the spec's container among them."""
    srun = ["srun", "--kill-on-bad-exit=1", f"--ntasks-per-node={spec.ntasks_per_node}"]
    if spec.container:
        srun.append(f"--container-image={spec.container.image}")
        if spec.container.mounts:
            srun.append(f"--container-mounts={','.join(spec.container.mounts)}")
    return srun
