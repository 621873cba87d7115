"""The run lease trusts no clock: holders and takers are separate processes, one side's wall clock
skewed by libfaketime (the monotonic clock left true), on S3 and on the local store."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from vitforge.core import open_store

PERIOD = 2.0  # the lease period of every process here, in seconds
SKEW = {"-15m": -900.0, "+15m": 900.0}

# One process holding or taking the lease, driven by commands on stdin (acquire, try_acquire SECONDS,
# refresh, publish TAG, release), one JSON answer per command (vitforge.trainer imports no torch: the child starts in a second).
# libfaketime 0.9.10 breaks Python 3.11's time.sleep under FAKETIME_DONT_FAKE_MONOTONIC (EINVAL from
# clock_nanosleep on an absolute monotonic deadline, libfaketime issue 426): the child sleeps on a
# condition variable instead, which waits on the true monotonic clock just the same.
CHILD = """
import json, os, sys, threading, time
time.sleep = lambda seconds: threading.Event().wait(seconds)
from vitforge.trainer.lease import Lease, job_identity
from vitforge.trainer.run_store import RunStore
url, seconds, host = sys.argv[1], float(sys.argv[2]), sys.argv[3]
lease = Lease(RunStore(url), seconds / 60, me={**job_identity(), "host": host})
lease.run.store.get_versioned("lease.json")  # the S3 client is made here, not inside a timed command
print(json.dumps({"time": time.time(), "pid": os.getpid(), "job": lease.me["job"]}), flush=True)
for line in sys.stdin:
    (command, *args), start = line.split(), time.monotonic()
    try:
        answer = {"ok": getattr(lease, command)(*(a if a.startswith("step_") else float(a) for a in args))}
        if command == "acquire" or command == "try_acquire" and answer["ok"][0]:
            lease.start_heartbeat()
    except Exception as e:
        answer = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps({**answer, "waited": time.monotonic() - start}), flush=True)
"""

pytestmark = pytest.mark.skipif(shutil.which("faketime") is None,
                                reason="libfaketime's `faketime` is missing (Debian package faketime)")


class Child:
    """A lease holder or taker in its own process, claiming to run on `host` (the same-host
    dead-process shortcut then does not apply, as for a process on another node)."""

    def __init__(self, url: str, host: str, cwd, skew: str | None = None, env: dict | None = None):
        prefix = ["faketime", "-f", skew] if skew else []
        clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        self.process = subprocess.Popen(
            prefix + [sys.executable, "-c", CHILD, url, str(PERIOD), host],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=cwd,
            env={**clean, "FAKETIME_DONT_FAKE_MONOTONIC": "1", **(env or {})})
        self.skew, self.host, self.started = skew, host, time.time()
        self._hello: dict | None = None

    @property
    def hello(self) -> dict:
        if self._hello is None:
            self._hello = json.loads(self.process.stdout.readline())
            # libfaketime really moved this process's wall clock (or left it alone): the test is not vacuous
            offset = self._hello["time"] - self.started
            assert abs(offset - SKEW.get(self.skew, 0.0)) < 30, (self.skew, offset)
        return self._hello

    def ask(self, command: str) -> dict:
        assert self.hello
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())

    def kill(self) -> None:
        if self._hello is not None:
            try:
                os.kill(self._hello["pid"], signal.SIGKILL)  # the Python process (faketime forks it)
            except ProcessLookupError:
                pass
        self.process.kill()
        self.process.wait()


@pytest.fixture
def run_url(request, tmp_path) -> str:
    """A run on the local store or on S3 (request.param)."""
    if request.param == "s3":
        request.getfixturevalue("s3_env")
        bucket = request.getfixturevalue("bucket")
        # SeaweedFS allocates a new bucket's volumes on its first write (about 1 s): not the lease's time
        request.getfixturevalue("s3_server")["client"].put_object(Bucket=bucket, Key="warm", Body=b"")
        return f"s3://{bucket}/runs/lease"
    return str(tmp_path / "runs" / "lease")


@pytest.fixture
def children(tmp_path):
    made: list[Child] = []

    def make(*args, **kwargs) -> Child:
        made.append(Child(*args, cwd=tmp_path, **kwargs))
        return made[-1]

    yield make
    for child in made:
        child.kill()


def record(url: str) -> dict:
    return json.loads(open_store(url).get_bytes("lease.json"))


# The holder's clock slow and fast on both stores; the taker's too on the local store (the same code path).
@pytest.mark.parametrize("run_url,holder_skew,taker_skew", [
    ("local", "-15m", None), ("local", "+15m", None), ("local", None, "-15m"), ("local", None, "+15m"),
    ("s3", "-15m", None), ("s3", "+15m", None)], indirect=["run_url"])
def test_a_live_holder_keeps_its_run_and_a_dead_one_loses_it_after_one_period_whatever_the_clocks(
        run_url, children, holder_skew, taker_skew):
    holder = children(run_url, "node-a", skew=holder_skew)
    taker = children(run_url, "node-b", skew=taker_skew)
    taken = holder.ask("acquire")
    assert taken["ok"] is None and taken["waited"] < PERIOD / 2, taken  # free: taken at once
    refused = taker.ask("acquire")  # as soon as the holder's beat changed the lease, well within a period
    assert f"is in use by job {holder.hello['job']} on node-a (pid {holder.hello['pid']})" in refused["error"]
    assert refused["waited"] < PERIOD / 2 + 0.5 and "ago" not in refused["error"], refused
    assert "ok" in holder.ask("refresh")  # and the holder still owns its run
    holder.kill()
    # Dead: taken after one period of watching on the taker's monotonic clock, not a wall-clock age;
    # watched in slices of 0.5 s as rank 0 does between collectives, the watch going on across them.
    start = time.monotonic()
    slices = [taker.ask("try_acquire 0.5")]
    while slices[-1]["ok"] == [False, None]:
        assert slices[-1]["waited"] < 0.5 + 0.3, slices
        slices.append(taker.ask("try_acquire 0.5"))
    waited = time.monotonic() - start
    assert PERIOD <= waited < PERIOD + 1.5 and len(slices) >= 4, (waited, slices)
    taken, note = slices[-1]["ok"]
    assert taken and f"from job {holder.hello['job']} on node-a" in note and "did not change for 2 s" in note
    assert record(run_url)["job"] == taker.hello["job"] and record(run_url)["host"] == "node-b"


@pytest.mark.parametrize("run_url", ["local", "s3"], indirect=True)
def test_a_requeued_incarnation_takes_over_at_once_and_its_stale_self_is_fenced(run_url, children):
    old = children(run_url, "node-a", env={"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "0"})
    new = children(run_url, "node-b", env={"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "1"})
    other = children(run_url, "node-c", skew="+15m")
    assert "ok" in old.ask("acquire")
    taken = new.ask("acquire")
    assert taken["ok"] == f"took over {run_url} from restart 0 of this job (SLURM requeued it)"
    assert taken["waited"] < PERIOD / 2, taken  # SLURM requeued it: no watching
    lost = old.ask("refresh")
    assert "this job lost ownership of the run to slurm:4242 (restart 1) on node-b" in lost["error"], lost
    for state in ("held", "released"):  # the stale copy can neither take nor release restart 1's lease
        stale = old.ask("acquire")
        assert f"{run_url} is held by restart 1 of job slurm:4242 on node-b" in stale["error"], stale
        assert "this process is restart 0, a stale copy" in stale["error"] and stale["waited"] < PERIOD / 2
        assert "ok" in old.ask("release")
        held = record(run_url)
        assert (held["job"], held["incarnation"], held["host"], held["state"]) == ("slurm:4242", 1, "node-b", state)
        if state == "held":
            assert "ok" in new.ask("release")
    free = other.ask("acquire")  # a released lease is taken at once, by any job
    assert free["ok"] is None and free["waited"] < PERIOD / 2, free
    assert (record(run_url)["host"], record(run_url)["state"]) == ("node-c", "held")


@pytest.mark.parametrize("run_url", ["local", "s3"], indirect=True)
def test_a_stale_holders_publish_is_refused_and_its_checkpoint_never_counts(run_url, children):
    """The window a partitioned holder leaves: it passed its ownership check, its link dropped, the
    run was taken over, and then its manifest landed. Its publish, a write conditional on the lease
    version it holds, is refused; the checkpoint is not part of the run for any reader. A stale
    manifest that lands over a step the new holder published is refused by its epoch."""
    from vitforge.core import CheckpointError
    from vitforge.trainer.run_store import RunStore

    old = children(run_url, "node-a", env={"SLURM_JOB_ID": "4343", "SLURM_RESTART_COUNT": "0"})
    new = children(run_url, "node-b", env={"SLURM_JOB_ID": "4343", "SLURM_RESTART_COUNT": "1"})
    run = RunStore(run_url)

    def manifest(step: int, epoch: int) -> None:
        run.put_bytes(f"step_{step:08d}/manifest.json", json.dumps(
            {"step": step, "files": {}, "run_id": first["run_id"], "epoch": epoch}).encode())

    assert "ok" in old.ask("acquire")
    first = record(run_url)
    manifest(10, first["epoch"])
    assert "ok" in old.ask("publish step_00000010")
    assert "ok" in new.ask("acquire")
    taken = record(run_url)
    assert (taken["run_id"], taken["epoch"], taken["checkpoints"]) == (first["run_id"], first["epoch"] + 1,
                                                                      {"step_00000010": first["epoch"]})
    manifest(20, first["epoch"])
    stale = old.ask("publish step_00000020")
    assert "this job lost ownership of the run to slurm:4343 (restart 1) on node-b" in stale["error"], stale
    assert record(run_url)["checkpoints"] == {"step_00000010": first["epoch"]}
    assert run.complete_tags() == ["step_00000010"]
    with pytest.raises(CheckpointError, match="step_00000020: never published by the run's holder"):
        run.manifest("step_00000020")
    assert run.manifest("step_00000010")["epoch"] == first["epoch"]  # published by the old holder, still its own
    manifest(30, taken["epoch"])
    assert "ok" in new.ask("publish step_00000030")  # the holder's own publish goes through
    assert record(run_url)["checkpoints"] == {"step_00000010": first["epoch"], "step_00000030": taken["epoch"]}
    assert run.manifest("step_00000030")["epoch"] == taken["epoch"]
    manifest(30, first["epoch"])  # the stale copy's retried manifest lands over the new holder's
    assert run.complete_tags() == ["step_00000010", "step_00000030"]
    with pytest.raises(CheckpointError, match=r"step_00000030/manifest.json: written by the run's holder of epoch "
                                              rf"{first['epoch']}, but the holder of epoch {taken['epoch']} published"):
        run.manifest("step_00000030")


def test_a_lease_write_whose_reply_was_lost_is_kept_not_taken_for_a_lost_run(tmp_path):
    from vitforge.core import StorageError
    from vitforge.trainer.lease import HELD, Lease
    from vitforge.trainer.run_store import LEASE, RunStore

    lease = Lease(RunStore(str(tmp_path / "run")), PERIOD / 60, me={"job": "a", "incarnation": 0, "host": "h",
                                                                      "pid": 1})
    lease.acquire()
    # The next beat lands but its reply is lost: the store holds it, the lease still has the old version
    # (what a client's retry of a landed conditional PUT then sees: 412).
    landed = {**lease.me, "state": HELD, "beat": lease.beats + 1, "lease_s": lease.seconds, "run_id": lease.run_id,
              "epoch": lease.epoch, "written_at": "then"}
    lease.run.store.put_bytes(LEASE, json.dumps(landed).encode())
    lease.refresh()
    assert lease.version == lease.run.store.get_versioned(LEASE)[1] and not lease.lost
    # Another job's record there instead: the run is lost.
    lease.run.store.put_bytes(LEASE, json.dumps({**landed, "job": "b", "beat": lease.beats + 1}).encode())
    with pytest.raises(StorageError, match="lost ownership"):
        lease.refresh()
