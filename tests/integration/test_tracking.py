"""Experiment tracking: one MLflow run and one W&B run across preemptions and a rollback, a tracking
server that dies mid-run and comes back, and no secret anywhere.

A real `mlflow server` (sqlite, artifacts behind it, 127.0.0.1) from testing/local_mlflow.py, and W&B
offline, whose `.wandb` files are read here record by record (W&B ships no reader of them)."""

from __future__ import annotations

import json
import logging
import os
import signal
import struct
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from common.checks import losses
from common.cli import EXTENSIONS, REPO, start_ranks, train, train_args
from common.services import start_or_fail
from vitforge.core import errors
from vitforge.testing import start_local_mlflow
from vitforge.trainer.tracking import feed as tracking
from vitforge.trainer.output_config import MLflowTracking
from vitforge.trainer.run_store import RunStore
from vitforge.trainer.tracking import MLFLOW_BOUNDS, MLFLOW_QUIET, TRACKING, MLflowSink, TrackingFeed, check_trackers

TRACKED = ["train.steps=12", "train.log_every=1", "train.checkpoint_every=4", "checkpoint.keep_last=10",
           "train.eval_every=6"]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    server = start_or_fail(start_local_mlflow, tmp_path_factory, "mlflow")
    yield server
    server.stop()


def _env(server, experiment: str, **extra: str) -> dict:
    return {**server.env, "MLFLOW_EXPERIMENT_NAME": experiment, "WANDB_MODE": "offline", "WANDB_SILENT": "true",
            **extra}


def _history(server, run_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in sorted(server.client().get_metric_history(run_id, key),
                                              key=lambda m: (m.timestamp, m.step))]


def _logged(folder: Path, step: int) -> bool:
    path = folder / "metrics.jsonl"
    return path.exists() and any(json.loads(line)["step"] >= step for line in path.read_text().splitlines())


def _preempt(data, run: str, at: int, env: dict) -> str:
    """Start both ranks, SIGUSR1 rank 1 once rank 0 logged step `at`; the log of rank 0."""
    ranks = start_ranks(data, run, *TRACKED, "tracking.mlflow={}", "tracking.wandb={}", env=env)
    deadline = time.monotonic() + 120
    while not _logged(data / "runs" / run, at) and time.monotonic() < deadline:
        time.sleep(0.05)
    ranks[1].send_signal(signal.SIGUSR1)
    outputs = [r.communicate(timeout=120) for r in ranks]
    assert [r.returncode for r in ranks] == [errors.REQUEUE, errors.REQUEUE], outputs[0][1][-3000:]
    return outputs[0][1]


def wandb_records(path: Path):
    """The records of a `.wandb` file: a 7-byte header (":W&B", magic, version), then 32 KiB blocks
    of chunks, each with a 7-byte header (crc32, length, type: 1 whole, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data, pos, block, parts = path.read_bytes(), 7, 32768, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


@pytest.mark.slow(seconds=65)
def test_one_tracker_run_across_preemptions_and_a_rollback(data, mlflow_server):
    """2 ranks, MLflow and W&B both on: SIGUSR1 twice, then a relaunch from an older checkpoint
    (steps 5.. replayed with the same values). The server holds one run with every step once, in
    order, the parameters, a resumed_from_step per resume and the report files; every W&B
    incarnation used the stored id with resume="allow" and every step was written once."""
    run, experiment = "tracked", f"exp-{uuid.uuid4().hex[:8]}"
    env = _env(mlflow_server, experiment)
    folder = data / "runs" / run
    first = _preempt(data, run, 3, env)
    stopped = int(first.split("stopped at step ")[1].split()[0])
    stored = json.loads((folder / TRACKING).read_text())
    assert stored["mlflow"]["last_step"] == stopped and stored["wandb"]["last_step"] == stopped, stored
    second = _preempt(data, run, stopped + 3, env)
    again = int(second.split("stopped at step ")[1].split()[0])
    assert again > 4
    final = train(data, run, *TRACKED, "tracking.mlflow={}", "tracking.wandb={}", "checkpoint.resume=4", env=env)
    assert "at step 4" in final.stderr
    assert not [line for line in (first + second + final.stderr).splitlines() if "vitforge.tracking WARNING" in line]

    stored = json.loads((folder / TRACKING).read_text())
    runs = mlflow_server.client().search_runs([mlflow_server.client().get_experiment_by_name(experiment).experiment_id])
    assert [r.info.run_id for r in runs] == [stored["mlflow"]["run_id"]]
    mlrun = runs[0]
    assert mlrun.info.status == "FINISHED"
    assert mlrun.data.params["train.steps"] == "12" and mlrun.data.params["model.name"] == "vit_tiny_cpu"
    expected = sorted(losses(folder).items())
    assert [step for step, _ in expected] == list(range(1, 13))
    assert _history(mlflow_server, mlrun.info.run_id, "loss") == expected  # every step once, in order
    assert _history(mlflow_server, mlrun.info.run_id, "resumed_from_step") == [(stopped + 1, stopped),
                                                                               (again + 1, 4)]
    assert [s for s, _ in _history(mlflow_server, mlrun.info.run_id, "eval_top1")] == [6, 12]
    assert _history(mlflow_server, mlrun.info.run_id, "system/cpu_utilization_percentage")
    artifacts = {f.path for f in mlflow_server.client().list_artifacts(mlrun.info.run_id)}
    assert "metrics.jsonl" in artifacts

    wandb_id = stored["wandb"]["run_id"]
    files = sorted((folder / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 3
    steps = []
    for path in files:
        records = list(wandb_records(path))
        starts = [r.run for r in records if r.WhichOneof("record_type") == "run"]
        assert [(s.run_id, s.resume) for s in starts] == [(wandb_id, True)]
        steps += [r.history.step.num for r in records if r.WhichOneof("record_type") == "history"]
    assert steps == list(range(1, 13))
    uploaded = [f.path for r in records if r.WhichOneof("record_type") == "artifact"
                for f in r.artifact.manifest.contents]
    assert uploaded == ["metrics.jsonl"]  # at the end of the finished run, from its last incarnation


@pytest.mark.slow(seconds=60)
def test_a_dead_tracking_server_costs_one_warning_and_no_row(data, mlflow_server, tmp_path):
    """The MLflow server killed (its whole process tree) mid-run and restarted on the same port and
    database: training ends with exit 0, one warning, one info line, and the server holds every row
    once, those logged while it was down too. Secrets in the environment (a token, an API key, a
    password in the tracking URI) appear in no log, tracking.json, parameter or file of the run."""
    secret = "sEcReT-" + uuid.uuid4().hex
    run, experiment = "outage", f"exp-{uuid.uuid4().hex[:8]}"
    folder, log_path = data / "runs" / run, tmp_path / "train.log"
    # The feed's own client bounds (2 retries): urllib3's warning per retry must not show either.
    env = _env(mlflow_server, experiment, MLFLOW_TRACKING_TOKEN=secret, WANDB_API_KEY=secret,
               MLFLOW_TRACKING_USERNAME="vitforge", MLFLOW_TRACKING_PASSWORD=secret)
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "vitforge", "train", *train_args(data, run, "train.steps=400", "train.log_every=1",
                                                                  "train.global_batch=16", "train.eval_every=400",
                                                                  "tracking.mlflow={}", "tracking.wandb={}")],
            cwd=REPO, env={**os.environ, **EXTENSIONS, **env}, stdout=log, stderr=subprocess.STDOUT)
    client = mlflow_server.client()

    def delivered() -> int:
        experiment_id = client.get_experiment_by_name(experiment)
        runs = client.search_runs([experiment_id.experiment_id]) if experiment_id else []
        return len(client.get_metric_history(runs[0].info.run_id, "loss")) if runs else 0

    deadline = time.monotonic() + 120
    while not delivered() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert process.poll() is None, "training ended before the server could be killed: raise train.steps"
    mlflow_server.stop(kill=True)
    while "unreachable" not in log_path.read_text() and process.poll() is None:
        time.sleep(0.1)
    process.send_signal(signal.SIGSTOP)  # training and its feed wait while the server comes back
    mlflow_server.start()
    process.send_signal(signal.SIGCONT)
    assert process.wait(timeout=120) == 0, log_path.read_text()[-3000:]

    output = log_path.read_text()
    assert output.count("unreachable") == 1 and "MLflow is unreachable" in output, output[-3000:]
    assert "Retrying" not in output, output[-3000:]
    assert "MLflow answers again: sent the" in output
    mlrun = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])[0]
    expected = sorted(losses(folder).items())
    assert len(expected) == 400 and _history(mlflow_server, mlrun.info.run_id, "loss") == expected
    stored = (folder / TRACKING).read_text()
    params = json.dumps([mlrun.data.params, mlrun.data.tags])
    files = b"".join(p.read_bytes() for p in folder.rglob("*") if p.is_file())
    assert mlrun.info.run_id in stored and "step" not in mlrun.data.params
    for where in (output, stored, params, files.decode(errors="replace")):
        assert secret not in where


def test_a_refused_batch_or_a_foreign_line_stops_no_row_and_no_row_goes_twice(mlflow_server, tmp_path, monkeypatch,
                                                                              caplog):
    """The feed driven directly, no training. A name MLflow refuses reaches it with `_` in its place;
    a batch it refuses for good (a name over its 250 characters) costs one error and is dropped, a
    line that is not a row one warning, and the rows after both are sent. A feed that starts again
    from an old mark (its last save lost to a kill) sends none of the rows the server holds again."""
    for name, value in {**MLFLOW_BOUNDS, **MLFLOW_QUIET}.items():  # what the sink sets, undone after
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(tracking, "BATCH_ROWS", 1)  # a request per row: the refused row alone
    settings = MLflowTracking(uri=mlflow_server.uri, experiment=f"exp-{uuid.uuid4().hex[:8]}")
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "x" * 300: 1.0}, {"step": 2, "loss": 2.0, "eval_fewshot_in1k@224_5shot": 0.5},
            {"step": 3, "loss": 3.0}]
    lines = [json.dumps(rows[0]), "not a row", json.dumps(rows[1]), json.dumps(rows[2])]
    metrics.write_text("\n".join(lines) + "\n")

    def feed(run_store=None) -> MLflowSink:
        sink = MLflowSink(settings, "refused")
        fed = TrackingFeed([sink], run_store, str(metrics), None, {"probe": {"in1k@224": 5}})
        fed.start()
        fed.close(finished=False)  # sends every row, then ends the run
        return sink

    with caplog.at_level(logging.INFO, logger="vitforge.tracking"):
        run_id = feed().run_id
    said = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "vitforge.tracking"]
    errors, warnings = ([m for level, m in said if level == kind] for kind in ("ERROR", "WARNING"))
    assert len(errors) == 1 and "MLflow refused the rows of steps 1-1 for good" in errors[0], said
    assert "INVALID_PARAMETER_VALUE" in errors[0]
    assert len(warnings) == 1 and "skipped a line" in warnings[0] and "not a row" in warnings[0], said
    assert _history(mlflow_server, run_id, "loss") == [(2, 2.0), (3, 3.0)]
    assert _history(mlflow_server, run_id, "eval_fewshot_in1k_224_5shot") == [(2, 0.5)]
    assert mlflow_server.client().get_run(run_id).data.params["probe.in1k_224"] == "5"

    store = tmp_path / "store"
    store.mkdir()
    (store / TRACKING).write_text(json.dumps({"mlflow": {"run_id": run_id, "last_step": 1, "rows_at_last_step": 1}}))
    feed(RunStore(str(store)))
    assert _history(mlflow_server, run_id, "loss") == [(2, 2.0), (3, 3.0)]
    assert json.loads((store / TRACKING).read_text())["mlflow"] == {"run_id": run_id, "last_step": 3,
                                                                    "rows_at_last_step": 1}


def test_a_missing_client_or_server_is_a_config_error(monkeypatch):
    """What every rank checks before building anything: the extra to install, or the server to name."""
    from vitforge.trainer import ConfigError
    from vitforge.trainer.output_config import TrackingConfig

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(ConfigError, match="set tracking.mlflow.uri or MLFLOW_TRACKING_URI"):
        check_trackers(TrackingConfig(mlflow={}))
    check_trackers(TrackingConfig(mlflow={"uri": "http://127.0.0.1:5000"}, wandb={}))
    monkeypatch.setattr(sys, "path", [])  # neither client can be found any more
    for name in ("mlflow", "wandb"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    with pytest.raises(ConfigError, match=r"tracking.wandb is on but its client is not installed: "
                                          r"pip install 'vitforge\[wandb\]'"):
        check_trackers(TrackingConfig(wandb={}))
    with pytest.raises(ConfigError, match=r"pip install 'vitforge\[mlflow\]'"):
        check_trackers(TrackingConfig(mlflow={"uri": "http://127.0.0.1:5000"}))
