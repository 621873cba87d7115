"""Tests on a cluster of separate hosts (tests/common/cluster_harness.py, the session's `cluster` fixture):
each host its own address, hostname and node-local scratch; SLURM and S3 across them."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import uuid
from collections import Counter
from urllib.parse import urlparse
from pathlib import Path

import pytest

from common import cluster_harness
from common.cluster_harness import PYTHON
from common.checks import assert_same_weights, losses, weights
from common.faulty_proxy import FaultSchedule
from common.cli import EXTENSIONS, REPO
from vitforge.cluster import JOB_ENDED
from vitforge.cluster.slurm import parse_job_info

# Connects to HOST:PORT from inside a host; exit 0 when it answers.
REACH = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1).close()"


def test_hosts_are_separate_and_slurm_and_s3_span_them(cluster):
    shown = {}
    for host in cluster.hosts:
        out = cluster.run(host, ["sh", "-c", "hostname; ip -4 -o addr show scope global | awk '{print $4}'; "
                                 f"hostname > {cluster.scratch}/who"]).stdout.split()
        shown[host] = (out[0], out[1].split("/")[0])
    assert shown == {name: (name, host.address) for name, host in cluster.hosts.items()}
    assert len({address for _, address in shown.values()}) == len(cluster.hosts)
    # node-local scratch: one path, each host's own content, and nothing of it outside the hosts
    assert {h: cluster.run(h, ["cat", cluster.scratch / "who"]).stdout.strip() for h in cluster.hosts} == \
        {h: h for h in cluster.hosts}
    assert not (cluster.scratch / "who").exists()

    assert cluster.node_states() == {node: "idle" for node in ("node1", "node2", "node3")}
    lines = cluster.slurm("srun", "-N2", "sh", "-c", 'echo "$(hostname) $TMPDIR"', timeout=60).stdout.split("\n")
    ran = [line.split() for line in lines if line]
    assert len(ran) == 2 and ran[0][0] != ran[1][0] and {r[0] for r in ran} <= set(cluster.nodes)
    assert all(r[1] == str(cluster.scratch / "tmp") for r in ran)  # the TaskProlog's node-local TMPDIR
    # the wrappers in cluster.bin reach the same SLURM from the test process
    sinfo = subprocess.run(["sinfo", "-h", "-o", "%D"], capture_output=True, text=True, check=True,
                           env={**os.environ, "PATH": f"{cluster.bin}{os.pathsep}{os.environ['PATH']}"})
    assert sinfo.stdout.strip() == "3"

    # S3: the test process through the relay, a node directly; the server sees each one's own address
    bucket, key = "smoke-" + uuid.uuid4().hex[:10], "data/blob.bin"
    client = cluster.s3_client()
    client.create_bucket(Bucket=bucket)
    client.put_object(Bucket=bucket, Key=key, Body=b"multi-host")
    mark = cluster.s3_mark()
    got = cluster.run("node2", [PYTHON, "-c", "import boto3, sys; print(boto3.client('s3').get_object("
                                "Bucket=sys.argv[1], Key=sys.argv[2])['Body'].read().decode())", bucket, key])
    assert got.stdout.strip() == "multi-host"
    assert cluster.s3_requests(since=mark, bucket=bucket) == \
        {cluster.address_of("node2"): Counter({("REST.GET.OBJECT", key): 1})}
    before = cluster.s3_requests(bucket=bucket)
    assert before[cluster.address_of("store")][("REST.PUT.OBJECT", key)] == 1  # the relay's address
    assert client.get_object(Bucket=bucket, Key=key)["Body"].read() == b"multi-host"


def test_kill_partition_and_restart_a_host(cluster):
    slurmd_port = ["node3", "6818"]  # slurmd's default port, on node3's own address through /etc/hosts
    probe = cluster.popen("node3", ["sleep", "600"])
    cluster.link("node3", False)
    assert cluster.run("node1", [PYTHON, "-c", REACH, *slurmd_port], check=False).returncode != 0
    assert probe.poll() is None  # a partition leaves the host's processes running
    cluster.link("node3", True)
    cluster.run("node1", [PYTHON, "-c", REACH, *slurmd_port])

    cluster.kill_host("node3")
    assert probe.wait(10) == -9
    assert cluster.processes("node3") == [cluster.hosts["node3"].pid]  # the holder
    assert cluster.run("node1", [PYTHON, "-c", REACH, *slurmd_port], check=False).returncode != 0
    cluster.restart_host("node3")
    assert cluster.node_states()["node3"] == "idle"


def test_down_removes_everything_even_after_a_crash(tmp_path):
    if cluster_harness.missing():
        pytest.skip(f"no multi-host cluster here: {cluster_harness.missing()}")
    folder = tmp_path / "session" / "cluster"
    first = cluster_harness.up(1, folder)
    first.popen("node1", ["sleep", "600"], start_new_session=True)  # a stray job process
    # By PID and start time: the new cluster's namespaces may get the old ones' freed inode numbers.
    stale = {pid: cluster_harness._start_time(pid) for pid in first.processes()}
    assert len(stale) >= 4  # the holders, slurmctld, slurmd, the stray job
    # A crashed session leaves its cluster running: `up` in the same folder removes it first...
    second = cluster_harness.up(1, folder)
    try:
        assert [pid for pid, began in stale.items()
                if cluster_harness.alive(pid) and cluster_harness._start_time(pid) == began] == []
        # ... and so does the next session's fixture, once the owner is gone (here: a start time not its own)
        state = json.loads((folder / "cluster.json").read_text())
        (folder / "cluster.json").write_text(json.dumps({**state, "owner": [os.getpid(), "0"]}))
        assert cluster_harness.down_orphans(tmp_path) == [folder]
        assert second.processes() == []
    finally:
        cluster_harness.down(second)
    assert cluster_harness.down(folder) < 1  # idempotent


# ---- training across hosts ----------------------------------------------------------------------
# Every run below is the same tiny job: 4 ranks (2 hosts x 2 or 1 host x 4), data and checkpoints
# on the store host's S3, the node cache on each host's own scratch (TMPDIR, from the TaskProlog).
STEPS, EVERY = 40, 20


@pytest.fixture(scope="module")
def dataset(cluster, data):
    """The trainer corpus sharded into a bucket of the cluster's S3 (by `vitforge shard` on ctl)."""
    bucket = "mh-" + uuid.uuid4().hex[:10]
    cluster.s3_client().create_bucket(Bucket=bucket)
    cluster.vitforge("shard", data / "train_src", f"s3://{bucket}/train", "--shard-samples", "64", "--workers", "2",
                     timeout=300)
    cluster.vitforge("shard", data / "val_src", f"s3://{bucket}/val", "--prefix", "val", "--workers", "2",
                     timeout=300)
    return bucket


def submit(cluster, logs: Path, run: str, bucket: str, *spec_sets: str, overrides: tuple = (),
           env: dict | None = None) -> str:
    """`vitforge submit` of the tiny spec from the login host (ctl), 2 nodes x 2 ranks unless
    `spec_sets` say otherwise, in the environment `env` adds to (the job inherits it); returns the
    job id."""
    train = [f"data.train=s3://{bucket}/train", f"data.val=s3://{bucket}/val", f"train.eval_every={STEPS}",
             "data.backend=torch", "data.workers=0",
             f"checkpoint.dir=s3://{bucket}/runs", f"checkpoint.run={run}", f"checkpoint.log_dir={logs / 'metrics'}",
             f"train.steps={STEPS}", "train.global_batch=32", "train.micro_batch=8", "train.log_every=1",
             f"train.checkpoint_every={EVERY}", "checkpoint.keep_last=10", "train.collective_timeout_s=20",
             *overrides]
    out = cluster.vitforge(
        "submit", "tiny_cpu", "--set", "nodes=2", "--set", "tasks_per_node=2", "--set", "network_interface=eth0",
        "--set", f"venv={REPO / '.venv'}", "--set", f"log_dir={logs}", "--set", f"name={run}",
        "--set", f"train.overrides=[{', '.join(train)}]", *spec_sets, env={**EXTENSIONS, **(env or {})}).stdout
    return re.search(r"submitted job (\d+)", out).group(1)


def job_info(cluster, job: str) -> dict:
    return parse_job_info(cluster.scontrol("show", "job", "-o", job).stdout)


def wait_job(cluster, job: str, logs: Path, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"),
             timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info = job_info(cluster, job)
        if info["JobState"] in states:
            return info
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job} is {info['JobState']}, not {states}:\n{job_log(logs, job)[-4000:]}")
        time.sleep(0.5)


def job_log(logs: Path, job: str) -> str:
    found = list(logs.glob(f"*-{job}.out"))
    return found[0].read_text(errors="replace") if found else ""


def wait_log(logs: Path, job: str, pattern: str, timeout: float = 180, after: int = 0) -> re.Match:
    """The first match of `pattern` in the job's log past character `after`, waiting for it."""
    deadline = time.monotonic() + timeout
    while True:
        match = re.compile(pattern).search(job_log(logs, job), after)
        if match:
            return match
        if time.monotonic() > deadline:
            raise AssertionError(f"{pattern!r} not in job {job}'s log:\n{job_log(logs, job)[-4000:]}")
        time.sleep(0.2)


def hosts_of(cluster, info: dict) -> list[str]:
    return cluster.scontrol("show", "hostnames", info["NodeList"]).stdout.split()


def evals(folder: Path) -> list[dict]:
    lines = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [m for m in lines if any(k.startswith("eval") for k in m)]


def command_pids(cluster, host: str, words: bytes) -> list[int]:
    """The host's processes running `words` (e.g. b"vitforge\0train"), srun's own excepted."""
    found = []
    for pid in cluster.processes(host):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if words in argv and os.path.basename(argv.split(b"\0")[0]) != b"srun":
            found.append(pid)
    return found


def node_of(cluster, address: str) -> str:
    return next(name for name in cluster.nodes if cluster.address_of(name) == address)


@pytest.fixture(scope="module")
def reference(cluster, dataset, tmp_path_factory):
    """The uninterrupted run on 2 hosts x 2 ranks, and the S3 requests it made."""
    logs = tmp_path_factory.mktemp("reference")
    mark = cluster.s3_mark()
    started = time.monotonic()
    job = submit(cluster, logs, "reference", dataset)
    info = wait_job(cluster, job, logs)
    assert info["JobState"] == "COMPLETED", job_log(logs, job)[-4000:]
    print(f"reference run (2 hosts x 2 ranks, {STEPS} steps): {time.monotonic() - started:.1f} s")
    return {"logs": logs, "job": job, "info": info, "requests": cluster.s3_requests(since=mark, bucket=dataset),
            "url": f"s3://{dataset}/runs/reference"}


@pytest.fixture
def s3_here(cluster, monkeypatch):
    """The cluster's S3 (through the relay) for code in the test process, e.g. reading checkpoints."""
    for key, value in cluster.relay_env.items():
        monkeypatch.setenv(key, value)


@pytest.mark.slow
def test_two_hosts_equal_one_host_bit_for_bit_and_each_node_fetches_its_shards_once(
        cluster, dataset, reference, s3_here, tmp_path):
    from vitforge.cluster import PlanInput, plan
    from vitforge.cluster.planner_formulas import shards_per_node

    hosts = hosts_of(cluster, reference["info"])
    assert len(hosts) == 2, reference["info"]
    # The rendezvous is the first node's routable address on the spec's interface, not a name or loopback.
    text = job_log(reference["logs"], reference["job"])
    assert f"rendezvous {cluster.address_of(hosts[0])}:" in text, text[-3000:]

    # 1 host x 4 ranks: the same world size, the same losses, parameters and eval, bit for bit.
    job = submit(cluster, tmp_path, "one_host", dataset, "--set", "nodes=1", "--set", "tasks_per_node=4")
    assert wait_job(cluster, job, tmp_path)["JobState"] == "COMPLETED", job_log(tmp_path, job)[-4000:]
    two, one = losses(reference["logs"] / "metrics"), losses(tmp_path / "metrics")
    assert len(two) == STEPS and two == one
    assert_same_weights(weights(reference["url"]), weights(f"s3://{dataset}/runs/one_host"))
    assert evals(reference["logs"] / "metrics") == evals(tmp_path / "metrics") != []
    print(f"2 hosts x 2 ranks vs 1 host x 4 ranks: {len(two)} losses, every parameter and the eval "
          f"{evals(tmp_path / 'metrics')[-1]} bit-identical")

    # Each node fetched each shard it needed once, from its own address (counted by the S3 server),
    # and no more than `vitforge plan` says a node fetches for this layout.
    client = cluster.s3_client()
    sizes = {o["Key"]: o["Size"] for o in client.list_objects_v2(Bucket=dataset, Prefix="train/")["Contents"]}
    tars = sorted(k for k in sizes if k.endswith(".tar"))
    fetched = {node_of(cluster, address): Counter({key: n for (op, key), n in counts.items()
                                                  if op == "REST.GET.OBJECT" and key in tars})
               for address, counts in reference["requests"].items() if address != cluster.address_of("store")
               and any(key in tars for _, key in counts)}
    assert sorted(fetched) == hosts, fetched
    assert all(n == 1 for counts in fetched.values() for n in counts.values()), fetched
    assert set().union(*fetched.values()) == set(tars)
    dataset_bytes = sum(sizes[k] for k in tars)
    figures = plan(PlanInput(model="vit_tiny_cpu", image_size=32, dataset_images=400, epochs=1, nodes=2,
                             gpus_per_node=2, mean_image_bytes=dataset_bytes / 400,
                             shard_bytes=dataset_bytes / len(tars), global_batch=32, micro_batch=8))
    for node, counts in sorted(fetched.items()):
        got = sum(sizes[k] for k in counts)
        print(f"{node}: {len(counts)} shard GETs ({got:,} bytes) for {STEPS * 32 / 400:.1f} epochs; plan: at most "
              f"{shards_per_node(len(tars), 2)} shards ({figures['egress_bytes_per_node_per_epoch']:,.0f} bytes) "
              "per node per epoch")
        assert len(counts) <= shards_per_node(len(tars), 2) and got <= figures["egress_bytes_per_node_per_epoch"]
        # the node's cache folder (job node index i) lies on that host's own scratch
        assert f"node{hosts.index(node)}" in \
            cluster.run(node, ["ls", cluster.scratch / "tmp" / "vitforge-cache"]).stdout.split()


@pytest.mark.slow
def test_an_eval_job_on_two_hosts_gives_the_single_host_figure(cluster, dataset, reference, tmp_path):
    """`vitforge eval` submitted as a 2-node job, and run as one process on one host."""
    out = cluster.vitforge(
        "submit", "tiny_cpu", "--set", "nodes=2", "--set", "tasks_per_node=2", "--set", "network_interface=eth0",
        "--set", f"venv={REPO / '.venv'}", "--set", f"log_dir={tmp_path}", "--set", "name=eval2", "--set", "train=null",
        "--set", f"eval={{config: tiny_cpu, checkpoint: {reference['url']}, dataset: s3://{dataset}/val, "
        "overrides: [data.backend=torch, data.workers=0]}", env=EXTENSIONS).stdout
    job = re.search(r"submitted job (\d+)", out).group(1)
    assert wait_job(cluster, job, tmp_path)["JobState"] == "COMPLETED", job_log(tmp_path, job)[-4000:]
    two_hosts = json.loads(re.findall(r"^\{.*\}$", job_log(tmp_path, job), re.M)[-1])
    one = cluster.run("node3", [PYTHON, "-m", "vitforge", "eval", "tiny_cpu", "--checkpoint", reference["url"],
                                "--set", f"data.val=s3://{dataset}/val", "--set", "data.backend=torch",
                                "--set", "data.workers=0"], env=EXTENSIONS, timeout=300)
    one_host = json.loads(one.stdout.strip().splitlines()[-1])
    trained = evals(reference["logs"] / "metrics")[-1]
    figures = sorted(k for k in one_host if k.startswith("eval"))
    counts = [k for k in figures if k != "eval_loss"]  # samples and top-k: counted, so exact at any world size
    assert counts and {k: two_hosts[k] for k in counts} == {k: one_host[k] for k in counts}
    # The loss is a float32 sum per batch: one process batches the set differently from four, and the
    # trainer's own eval runs the DeepSpeed-wrapped module rather than the checkpoint's weights reloaded.
    assert two_hosts["eval_loss"] == pytest.approx(one_host["eval_loss"], rel=1e-6)
    assert {k: two_hosts[k] for k in counts} == {k: trained[k] for k in counts}
    assert two_hosts["eval_loss"] == pytest.approx(trained["eval_loss"], rel=1e-6)
    print(f"eval: 2-node job {({k: two_hosts[k] for k in figures})}, one process on one host "
          f"{({k: one_host[k] for k in figures})}")


def requeued_to(cluster, job: str, restart: int, timeout: float = 120) -> dict:
    """Wait until the job runs as incarnation `restart`; returns its info."""
    deadline = time.monotonic() + timeout
    while True:
        info = job_info(cluster, job)
        if int(info["Restarts"]) >= restart and info["JobState"] == "RUNNING":
            return info
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job} did not run again as restart {restart}: {info}")
        time.sleep(0.3)


@pytest.mark.slow
def test_preempted_then_a_host_lost_mid_upload_resumes_on_other_hosts_and_ends_like_the_reference(
        cluster, dataset, reference, s3_here, tmp_path):
    client = cluster.s3_client()
    job = submit(cluster, tmp_path, "chain", dataset, overrides=("train.collective_timeout_s=15",))
    wait_log(tmp_path, job, r"step (1[0-9]|[2-9]\d) loss", timeout=240)
    first = hosts_of(cluster, job_info(cluster, job))
    # Preemption: SIGUSR1 reaches every rank on both hosts; one checkpoint; the script requeues the job,
    # which restarts away from the first allocation's batch host.
    cluster.scancel("--signal=USR1", job)
    deadline = time.monotonic() + 120
    while job_info(cluster, job)["JobState"] != "PENDING":
        assert time.monotonic() < deadline, job_log(tmp_path, job)[-4000:]
        time.sleep(0.2)
    cluster.scontrol("update", f"JobId={job}", f"ExcNodeList={first[0]}")
    info = requeued_to(cluster, job, 1)
    second = hosts_of(cluster, info)
    assert first[0] not in second and len(second) == 2, (first, second)
    text = job_log(tmp_path, job)
    # The rank that reports may have seen the other host's signal before its own (scancel reaches
    # the hosts' tasks in no fixed order); both are the same preemption.
    stopped = re.search(r"stopped at step (\d+) \((?:signal SIGUSR1|another rank was signalled)\)", text)
    assert stopped, text[-4000:]
    stopped = int(stopped.group(1))
    assert text.count("stopped for requeue") >= 1 and "requeueing job" in text

    # A host lost while it uploads a checkpoint: what it sends to the store is slowed to 1 Mbit/s from
    # now on (its collectives keep their speed), so when the next checkpoint comes the other host's
    # ranks finish uploading theirs while its own are still under way; as soon as they have, its link
    # goes down and everything on it is killed. (Throttled only once its ranks began writing, a
    # small checkpoint could be uploaded whole first on a busy machine.)
    victim = second[1]  # not the batch host: its survivors' messages reach the job log
    cluster.throttle(victim, "1mbit", to=urlparse(cluster.s3_endpoint).hostname)
    staging = cluster.folder / "hosts" / victim / "scratch" / "tmp" / "vitforge-ckpt"
    deadline = time.monotonic() + 240
    while True:
        steps = [int(p.name.removeprefix("step_")) for p in staging.glob("*/rank*/step_*")]
        if any(step > stopped for step in steps):
            break
        assert time.monotonic() < deadline, job_log(tmp_path, job)[-4000:]
        time.sleep(0.01)
    half = f"runs/chain/step_{max(steps):08d}/"
    deadline = time.monotonic() + 60
    while not {f"{half}receipts/rank0.json", f"{half}receipts/rank1.json"} <= \
            {o["Key"] for o in client.list_objects_v2(Bucket=dataset, Prefix=half).get("Contents", [])}:
        assert time.monotonic() < deadline, "the healthy host's ranks did not finish uploading"
        time.sleep(0.1)
    cluster.kill_host(victim)
    killed = time.monotonic()
    try:
        left = {o["Key"] for o in client.list_objects_v2(Bucket=dataset, Prefix=half)["Contents"]}
        assert f"{half}manifest.json" not in left and f"{half}receipts/rank2.json" not in left  # half-written
        # Whichever notices first ends the allocation: the survivors' collective timeout (they name the
        # lost host) or slurmctld's node timeout (it cancels the step); both are real and both requeue.
        lost = wait_log(tmp_path, job, rf"lost contact with node 1 \(host {victim}\)|Node failure on {victim}",
                        timeout=60)
        print(f"{lost.group(0)!r} {time.monotonic() - killed:.1f} s after the kill")
        deadline = time.monotonic() + 90
        while cluster.node_states()[victim] not in ("down", "down*"):  # SLURM marks the node down
            assert time.monotonic() < deadline, cluster.node_states()
            time.sleep(0.5)
        if job_info(cluster, job)["ExcNodeList"] != "(null)":
            cluster.scontrol("update", f"JobId={job}", "ExcNodeList=")
        third = hosts_of(cluster, requeued_to(cluster, job, 2, timeout=180))
        assert victim not in third
        resumed = wait_log(tmp_path, job, r"resumed s3://\S+/step_(\d+)", after=lost.end())
        wait_log(tmp_path, job, r"step \d+ loss", after=resumed.end())
        print(f"kill to the first resumed step: {time.monotonic() - killed:.1f} s")
        assert int(resumed.group(1)) < max(steps)  # the previous complete step, not the half-written one
        info = wait_job(cluster, job, tmp_path)
    finally:  # the next tests need every host, and nodes no job of this one holds
        if job_info(cluster, job)["JobState"] not in JOB_ENDED:
            cluster.scancel(job)
        cluster.restart_host(victim)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "2", job_log(tmp_path, job)[-4000:]
    assert losses(tmp_path / "metrics") == losses(reference["logs"] / "metrics")
    assert evals(tmp_path / "metrics")[-1] == evals(reference["logs"] / "metrics")[-1]
    assert_same_weights(weights(f"s3://{dataset}/runs/chain"), weights(reference["url"]))


@pytest.mark.slow
def test_a_partitioned_host_is_replaced_and_its_stale_copy_publishes_nothing(cluster, dataset, reference, s3_here,
                                                                            tmp_path):
    """The first node (rank 0, the lease holder) passes its ownership check for the checkpoint at
    step 40 and writes its manifest; its publish (the conditional lease write listing step 40) is
    delayed on the way, and its link is cut. SLURM requeues the job onto the two other hosts, which
    take the run over and resume from step 20. The delayed publish then reaches the store and is
    refused (412); when the link returns, the stale copy writes nothing before SLURM kills it, and
    the run ends like the reference. All S3 traffic goes through the fault proxy, which holds the
    stale publish and records who sent what."""
    run = "runs/partition/lease.json"
    cut_address: list[str] = []  # set once the job's hosts are known: the rule reads it

    def stale_publish(peer: str, method: str, path: str, body: bytes) -> bool:
        return (peer in cut_address and method == "PUT" and path.split("?")[0].endswith(run)
                and b'"step_00000040"' in body)

    schedule = FaultSchedule(0, 0, 0, hold=stale_publish)
    proxy, endpoint = cluster.s3_proxy(schedule)
    try:
        # A collective timeout longer than the partition: the stale ranks are still alive when it ends.
        job = submit(cluster, tmp_path, "partition", dataset, overrides=("train.collective_timeout_s=300",),
                     env={"AWS_ENDPOINT_URL": endpoint})
        info = wait_job(cluster, job, tmp_path, states=("RUNNING",), timeout=120)
        cut = hosts_of(cluster, info)[0]
        cut_address.append(cluster.address_of(cut))
        deadline = time.monotonic() + 300
        while not schedule.held:
            assert time.monotonic() < deadline, job_log(tmp_path, job)[-4000:]
            time.sleep(0.2)
        stale = command_pids(cluster, cut, b"vitforge\0train")
        assert len(stale) == 2
        cluster.link(cut, False)
        try:
            info = requeued_to(cluster, job, 1, timeout=180)
            assert cut not in hosts_of(cluster, info)
            resumed = wait_log(tmp_path, job, r"resumed s3://\S+/step_(\d+)", timeout=180)
            assert resumed.group(1) == "00000020", job_log(tmp_path, job)[-4000:]  # 40 was never published
            assert "step_00000040 have a manifest but were never published" in job_log(tmp_path, job)
            wait_log(tmp_path, job, r"step \d+ loss", after=resumed.end())
            assert all(Path(f"/proc/{pid}").exists() for pid in stale)  # both copies run at once
            # The takeover is done: the stale publish, held until now, reaches the store.
            mark = len(schedule.answers)
            schedule.released.set()
            deadline = time.monotonic() + 60
            def publishes():
                return [a for a in schedule.answers[mark:] if a[0] == cut_address[0] and a[1] == "PUT"
                        and a[2].split("?")[0].endswith(run)]
            while not publishes():
                assert time.monotonic() < deadline, "the held publish was not sent on"
                time.sleep(0.1)
            assert [a[3] for a in publishes()] == [412], schedule.answers[mark:]
        finally:
            cluster.link(cut, True)
        deadline = time.monotonic() + 60
        while any(cluster_harness.alive(pid) for pid in stale):
            assert time.monotonic() < deadline, "SLURM did not end the stale copy"
            time.sleep(0.2)
        print(f"the stale copy on {cut} ended {60 - (deadline - time.monotonic()):.1f} s after its link returned")
        written = [a for a in schedule.answers[mark:] if a[0] == cut_address[0]
                   and a[1] in ("PUT", "POST", "DELETE") and a[3] < 300]
        assert written == []  # no write of the stale copy landed after the takeover: not `latest`, not the lease
        info = wait_job(cluster, job, tmp_path)
        assert info["JobState"] == "COMPLETED", job_log(tmp_path, job)[-4000:]
    finally:
        schedule.released.set()
        proxy.shutdown()
        proxy.server_close()
    lease = json.loads(cluster.s3_client().get_object(Bucket=dataset, Key=run)["Body"].read())
    assert lease["incarnation"] == 1 and lease["state"] == "released"  # the new copy's, to the end
    assert lease["checkpoints"] == {"step_00000020": lease["epoch"] - 1, "step_00000040": lease["epoch"]}
    assert losses(tmp_path / "metrics") == losses(reference["logs"] / "metrics")
    assert_same_weights(weights(f"s3://{dataset}/runs/partition"), weights(reference["url"]))


@pytest.mark.slow
def test_a_sharding_array_across_hosts_survives_a_lost_host_and_equals_one_run(cluster, data, tmp_path):
    from common.checks import tree_bytes

    single = tmp_path / "single"
    cluster.vitforge("shard", data / "train_src", single, "--shard-samples", "32", "--workers", "1", host="node1")
    spec = tmp_path / "array.yaml"
    # 4 CPUs per task: a node's all, so the 3 parts run on 3 different hosts.
    spec.write_text(f"""name: mh-array
nodes: 1
gpus_per_node: 0
cpus_per_task: 4
time: "00:20:00"
venv: {REPO / '.venv'}
log_dir: {tmp_path / 'logs'}
shard:
  src: {data / 'train_src'}
  dest: {tmp_path / 'parts'}
  num_parts: 3
  args: [--shard-samples, "32"]
""")
    out = cluster.vitforge("submit", spec).stdout
    array, merge = re.findall(r"submitted (?:job array|merge job) (\d+):", out)
    # Lose node3 while its task runs: its `vitforge shard` is frozen as soon as it appears, then the
    # host's link goes down and everything on it is killed.
    victim, placed = "node3", {}
    deadline = time.monotonic() + 120
    while not command_pids(cluster, victim, b"vitforge\0shard"):
        running = cluster.squeue("-h", "-j", array, "-t", "R", "-o", "%i %N").stdout.split("\n")
        placed.update(line.split() for line in running if line.strip())
        assert time.monotonic() < deadline, f"no task started `vitforge shard` on {victim}: {placed}"
        time.sleep(0.02)
    for pid in command_pids(cluster, victim, b"vitforge\0shard"):
        os.kill(pid, signal.SIGSTOP)
    running = cluster.squeue("-h", "-j", array, "-t", "R", "-o", "%i %N").stdout.split("\n")
    placed.update(line.split() for line in running if line.strip())
    lost_part = next(task.split("_")[1] for task, node in placed.items() if node == victim)
    cluster.kill_host(victim)
    try:
        # SLURM requeues the lost task (the script asks for --requeue) on a healthy host; the merge follows.
        assert wait_job(cluster, merge, tmp_path / "logs", timeout=240)["JobState"] == "COMPLETED"
        # One task per host (each asks for a whole node's CPUs); the lost one ran again on a healthy host.
        hosts = {i: job_info(cluster, f"{array}_{i}")["BatchHost"] for i in range(3)}
        assert placed[f"{array}_{lost_part}"] == victim and hosts[int(lost_part)] != victim
        assert len({placed.get(f"{array}_{i}", hosts[i]) for i in range(3)}) == 3, (placed, hosts)
        produced = {k: v for k, v in tree_bytes(tmp_path / "parts").items() if not k.startswith("_work")}
        assert produced == {k: v for k, v in tree_bytes(single).items() if not k.startswith("_work")}
        # A user resubmits the part that failed, alone, and the merge: still the same bytes.
        again = cluster.vitforge("submit", spec, "--parts", lost_part).stdout
        assert f"#SBATCH --array={lost_part}\n" in (tmp_path / "logs" / "mh-array.sbatch").read_text()
        merge_again = re.findall(r"submitted merge job (\d+):", again)[0]
        assert wait_job(cluster, merge_again, tmp_path / "logs", timeout=120)["JobState"] == "COMPLETED"
        assert {k: v for k, v in tree_bytes(tmp_path / "parts").items() if not k.startswith("_work")} == produced
    finally:
        cluster.restart_host(victim)
