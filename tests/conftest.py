"""Shared fixtures: generated corpora, the CLI as a subprocess, a real S3 server on loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import uuid
from pathlib import Path

import pytest
import torch

from faulty_proxy import FaultSchedule, start_proxy
from vitforge.core import free_port
from vitforge.synthetic import write_class_folders
from vitforge.testing import start_local_s3, start_local_slurm, stop_local_slurm

REPO = Path(__file__).resolve().parent.parent


def vitforge(*args: str, env: dict | None = None, check: bool = True, timeout: float = 300,
             prefix: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run the real CLI in a fresh process, as a user would, with the venv's DeepSpeed op cache
    (EXTENSIONS): a command that starts a process group (eval, train) would otherwise JIT-build the
    shm op again in ~/.cache, 30-40 s, whenever the ninja on PATH differs from the last build's."""
    cmd = (prefix or []) + [sys.executable, "-m", "vitforge", *map(str, args)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, **EXTENSIONS, **(env or {})}, cwd=REPO)
    if check and result.returncode != 0:
        raise AssertionError(f"{cmd} exited {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}")
    return result


def tree_bytes(root: Path) -> dict[str, bytes]:
    """Every file under root (relative path -> bytes): the whole output, compared byte for byte."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def dataset_samples(out: Path) -> list[dict]:
    """Every sample of a sharded dataset, read with tarfile: key, info (json), cls (None when it has
    none), ext, image bytes."""
    manifest = json.loads((out / "dataset.json").read_text())
    samples = []
    for shard in manifest["shards"]:
        with tarfile.open(out / shard["name"]) as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}
        by_key: dict[str, dict] = {}
        for name, data in members.items():
            key, ext = name.split(".", 1)
            by_key.setdefault(key, {"key": key})[ext] = data
        for key, sample in by_key.items():
            ext = next(e for e in ("jpg", "png", "webp") if e in sample)
            cls = int(sample["cls"]) if "cls" in sample else None
            samples.append({"key": key, "info": json.loads(sample["json"]), "cls": cls,
                            "ext": ext, "image_bytes": sample[ext]})
    return samples


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus") / "images"
    write_class_folders(str(root), num_classes=5, per_class=24, size=(64, 48))
    return root


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3-API server (SeaweedFS `weed mini`) on 127.0.0.1, for this test session only."""
    try:
        server = start_local_s3(str(tmp_path_factory.mktemp("seaweed")))
    except RuntimeError as e:
        pytest.fail(str(e))
    env = {**server.env, "AWS_ACCESS_KEY_ID": "test-key-id", "AWS_SECRET_ACCESS_KEY": "test-secret"}
    yield {"endpoint": server.endpoint, "env": env, "client": server.client()}
    server.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """The standard AWS variables pointing at the test server, in this process and its children."""
    for key, value in s3_server["env"].items():
        monkeypatch.setenv(key, value)
    return s3_server["env"]


# The JIT-built DeepSpeed shm op is cached with the venv: built once (about 30 s), then reused. The
# venv's ninja comes first on PATH for every run, as in a SLURM job that activates the venv: ninja
# 1.11 (Debian) and 1.13 (the venv) hash .ninja_log differently, and each switch rebuilds the op.
EXTENSIONS = {"TORCH_EXTENSIONS_DIR": str(REPO / ".venv" / "torch_extensions"), "OMP_NUM_THREADS": "1",
              "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


@pytest.fixture(scope="session")
def data(tmp_path_factory):
    """A learnable 10-class corpus: train and a held-out val set, sharded."""
    root = tmp_path_factory.mktemp("trainer")
    write_class_folders(str(root / "train_src"), num_classes=10, per_class=40, size=(48, 40), seed=0)
    write_class_folders(str(root / "val_src"), num_classes=10, per_class=10, size=(48, 40), seed=1)
    vitforge("shard", root / "train_src", root / "train", "--shard-samples", "64", "--workers", "2")
    vitforge("shard", root / "val_src", root / "val", "--prefix", "val", "--workers", "2")
    return root


def train_args(data, run: str, *overrides: str, store: str | None = None) -> list[str]:
    args = ["tiny_cpu", "--set", f"data.train={data / 'train'}", "--set", f"data.val={data / 'val'}",
            "--set", f"checkpoint.dir={store or data / 'runs'}", "--set", f"checkpoint.run={run}",
            "--set", "data.backend=torch", "--set", "data.workers=0"]
    for item in overrides:
        args += ["--set", item]
    return args


def train(data, run: str, *overrides: str, nproc: int = 2, check: bool = True, store: str | None = None,
          env: dict | None = None, timeout: float = 600):
    """`vitforge train` under torchrun with `nproc` ranks (gloo on CPU)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(free_port()), "-m", "vitforge", "train", *train_args(data, run, *overrides, store=store)]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=timeout,
                            env={**os.environ, **EXTENSIONS, **(env or {})})
    if check and result.returncode != 0:
        raise AssertionError(f"training failed:\n{result.stderr[-4000:]}")
    return result


# The uninterrupted reference of the exact-resume tests: every run stopped and resumed with these
# settings must end equal to it, losses and weights.
STRAIGHT = ["train.steps=24", "train.log_every=1", "train.checkpoint_every=6", "data.val=null",
            "checkpoint.keep_last=10"]


@pytest.fixture(scope="session")
def straight(data):
    """The reference run (STRAIGHT: 24 steps, 2 ranks, ZeRO-2, local folder), trained once per
    session for every test that compares with it or needs a finished run."""
    train(data, "straight", *STRAIGHT)
    return data / "runs" / "straight"


def start_ranks(data, run: str, *overrides: str, nproc: int = 2, store: str | None = None,
                env: dict | None = None) -> list[subprocess.Popen]:
    """The ranks as srun starts them: one plain process each, RANK/WORLD_SIZE/MASTER_* set, so a
    test can signal one rank and read each rank's own exit code."""
    port = free_port()
    processes = []
    for rank in range(nproc):
        rank_env = {**os.environ, **EXTENSIONS, **(env or {}), "RANK": str(rank), "WORLD_SIZE": str(nproc),
                    "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        processes.append(subprocess.Popen(
            [sys.executable, "-m", "vitforge", "train", *train_args(data, run, *overrides, store=store)],
            cwd=REPO, env=rank_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return processes


@pytest.fixture
def bucket(s3_server):
    name = "vf-" + uuid.uuid4().hex[:12]
    s3_server["client"].create_bucket(Bucket=name)
    return name


SECRET = "sEcReT-" + uuid.uuid4().hex  # must never appear in any output


@pytest.fixture
def faulty(s3_server):
    """AWS environment pointing at a proxy that injects faults in front of the real server."""
    schedule = FaultSchedule(slow_down_every=7, reset_every=11, cut_body_every=13)
    port = int(s3_server["endpoint"].rsplit(":", 1)[1])
    server, proxy_port = start_proxy(port, schedule)
    env = {**s3_server["env"], "AWS_ENDPOINT_URL": f"http://127.0.0.1:{proxy_port}",
           "AWS_SECRET_ACCESS_KEY": SECRET}
    yield env, schedule
    server.shutdown()


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """A real SLURM controller and node on localhost, for this test session."""
    try:
        env = start_local_slurm(tmp_path_factory.mktemp("slurm"))
    except RuntimeError as e:
        pytest.fail(str(e))
    yield env
    stop_local_slurm(env)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """ctl (slurmctld, the login host), store (S3) and node1..node3 (a slurmd each): separate hosts
    made of Linux namespaces (tests/cluster_harness.py), built once and shared by every multi-host test."""
    import cluster_harness

    why = cluster_harness.missing()
    if why:
        pytest.skip(f"no multi-host cluster here: {why}")
    cluster_harness.down_orphans(tmp_path_factory.getbasetemp().parent)  # from sessions killed mid-way
    built = cluster_harness.up(3, tmp_path_factory.mktemp("cluster"))
    try:
        yield built
    finally:
        cluster_harness.down(built)


def losses(folder) -> dict[int, float]:
    lines = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    steps = [m["step"] for m in lines if "loss" in m]
    assert len(steps) == len(set(steps)), f"duplicated steps in metrics.jsonl: {steps}"
    return {m["step"]: m["loss"] for m in lines if "loss" in m}


def weights(url: str) -> dict:
    import tempfile

    from vitforge.trainer.export import consolidate

    with tempfile.TemporaryDirectory() as scratch:
        return consolidate(url, scratch, prefer_ema=False).state


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    """fake-gcs-server on 127.0.0.1 for this session: its client environment, and `make_bucket()`
    creating a fresh bucket there. A server that died says so, with its log, at the next bucket."""
    from vitforge.testing import start_local_gcs

    try:
        server = start_local_gcs(str(tmp_path_factory.mktemp("fake-gcs")))
    except RuntimeError as e:
        pytest.fail(str(e))
    yield {"env": server.env, "make_bucket": lambda: server.make_bucket("vf-" + uuid.uuid4().hex[:12]),
           "server": server}
    server.stop()


@pytest.fixture(scope="session")
def azure_server(tmp_path_factory):
    """Azurite on 127.0.0.1 for this session: its client environment (the development account's
    connection string), and `make_bucket()` creating a fresh container there."""
    from vitforge.testing import start_local_azure

    try:
        server = start_local_azure(str(tmp_path_factory.mktemp("azurite")))
    except RuntimeError as e:
        pytest.fail(str(e))

    def make_bucket() -> str:
        name = "vf-" + uuid.uuid4().hex[:12]
        server.client().create_container(name)
        return name

    yield {"env": server.env, "make_bucket": make_bucket, "server": server}
    server.stop()
