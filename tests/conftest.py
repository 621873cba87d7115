"""Shared fixtures: generated corpora, and the real servers the tests need (S3, GCS, Azure,
SLURM, the multi-host cluster), each started once per test process; markers from what a test uses.

Layout: tests/unit holds in-process tests that start no server and no cluster (`make test-quick`),
tests/integration everything that runs the CLI, training or a real service; tests/common is the
equipment both share. Every test is marked by the services its fixtures start (slurm, cluster, s3,
gcs, azure, mlflow), so `-m "not cluster and not slurm"` and the like combine with `-m "not slow"`.
Where a test lives (unit files are `test_<package>_<module>.py`): tests/README.md.

Order: the longest tests first (`slow(seconds=N)`, N as measured in CI, then the other slow ones),
so that xdist's workers end together: the suite is CPU-bound on 2 cores, and a 5-15 minute test
handed out last would run on alone after everything else had finished.
"""

from __future__ import annotations

import ast
import os
import threading
import uuid
from pathlib import Path

import pytest

from common.cli import STRAIGHT, train, vitforge
from common.faulty_proxy import FaultSchedule, start_proxy
from common.once import built_once
from common.services import start_or_fail
from common.checks import SECRET
from vitforge.synthetic import write_class_folders
from vitforge.testing import start_local_s3, start_local_slurm, stop_local_slurm

# CPython 3.11's parser is not thread-safe (gh-106905): pytest formatting a failure while another
# thread's traceback is drawn (3.11's traceback module parses source lines for its ^^^ markers)
# can end the whole run with "SystemError: AST constructor recursion depth mismatch" and lose the
# failure's message. Both look ast.parse up at each call, so one lock here serialises them.
_parse_lock = threading.Lock()
_parse = ast.parse


def _serial_parse(*args, **kwargs):
    with _parse_lock:
        return _parse(*args, **kwargs)


ast.parse = _serial_parse

# torch.compile in the test processes too: kernels built in-process (see EXTENSIONS, common/cli.py).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

# A test's fixtures (their whole closure) -> the markers it gets: what it starts, so it can be selected.
SERVICE_MARKERS = {"slurm": "slurm", "cluster": "cluster", "s3_server": "s3", "gcs_server": "gcs",
                   "azure_server": "azure", "mlflow_server": "mlflow"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the group
def pytest_collection_modifyitems(config, items):
    tests = Path(__file__).parent
    for item in items:
        suite = Path(item.fspath).relative_to(tests).parts[0]
        if suite in ("unit", "integration"):
            item.add_marker(suite)
        for fixture in set(item.fixturenames) & SERVICE_MARKERS.keys():
            item.add_marker(SERVICE_MARKERS[fixture])
        if "cluster" in item.fixturenames:  # one multi-host cluster per run: its tests share one worker
            item.add_marker(pytest.mark.xdist_group("cluster"))
    items.sort(key=lambda item: -_expected_seconds(item))  # stable: files keep their order otherwise


def _expected_seconds(item) -> float:
    # A parameter's own slow(seconds=N) comes with its function's plain slow mark.
    return max((slow.kwargs.get("seconds", 20) for slow in item.iter_markers("slow")), default=0)


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus") / "images"
    write_class_folders(str(root), num_classes=5, per_class=24, size=(64, 48))
    return root


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3-API server (SeaweedFS `weed mini`) on 127.0.0.1, for this test session only."""
    server = start_or_fail(start_local_s3, tmp_path_factory, "seaweed")
    env = {**server.env, "AWS_ACCESS_KEY_ID": "test-key-id", "AWS_SECRET_ACCESS_KEY": "test-secret"}
    yield {"endpoint": server.endpoint, "env": env, "client": server.client()}
    server.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """The standard AWS variables pointing at the test server, in this process and its children."""
    for key, value in s3_server["env"].items():
        monkeypatch.setenv(key, value)
    return s3_server["env"]


@pytest.fixture(scope="session")
def data(tmp_path_factory):
    """A learnable 10-class corpus: train and a held-out val set, sharded."""
    root = tmp_path_factory.mktemp("trainer")
    write_class_folders(str(root / "train_src"), num_classes=10, per_class=40, size=(48, 40), seed=0)
    write_class_folders(str(root / "val_src"), num_classes=10, per_class=10, size=(48, 40), seed=1)
    vitforge("shard", root / "train_src", root / "train", "--shard-samples", "64", "--workers", "2")
    vitforge("shard", root / "val_src", root / "val", "--prefix", "val", "--workers", "2")
    return root


@pytest.fixture(scope="session")
def straight(data, tmp_path_factory, worker_id):
    """The reference run (STRAIGHT: 24 steps, 2 ranks, ZeRO-2, local folder), trained once per run
    (tests/common/once.py) for every test that compares with it or needs a finished run: every
    worker's `data` holds the same shards, so the one run serves them all."""
    runs = built_once(tmp_path_factory, worker_id, "straight-runs",
                      lambda folder: train(data, "straight", *STRAIGHT, store=str(folder)))
    return runs / "straight"


@pytest.fixture(scope="session")
def zero_run(data, tmp_path_factory, worker_id):
    """stage -> a finished 60-step run of ZeRO-`stage` on 2 ranks, evaluated at its end, trained
    once per pytest run (tests/common/once.py) for the tests that read one (test_trainer,
    test_scale_weights): its folder."""
    def run(stage: int):
        name = f"zero{stage}"

        def train_it(folder):
            train(data, name, f"train.zero_stage={stage}", "train.steps=60", "train.eval_every=60",
                  "train.log_every=1", store=str(folder))

        return built_once(tmp_path_factory, worker_id, f"{name}-runs", train_it) / name
    return run


@pytest.fixture
def bucket(s3_server):
    name = "vf-" + uuid.uuid4().hex[:12]
    s3_server["client"].create_bucket(Bucket=name)
    return name


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
def slurm(tmp_path_factory, worker_id):
    """A real SLURM controller and node on localhost, for this test session. Each xdist worker's
    numbers its jobs from its own thousand (gw0 from 1001, gw1 from 2001; the demo's own SLURM
    from 1): a job's rendezvous port is 20000 + its id, and two jobs 1 on one machine, a
    requeued job's ranks among them, collided (EADDRINUSE, exit 70)."""
    worker = int(worker_id.removeprefix("gw")) if worker_id != "master" else 0
    env = start_or_fail(lambda folder: start_local_slurm(folder, first_job_id=1001 + 1000 * worker),
                        tmp_path_factory, "slurm")
    yield env
    stop_local_slurm(env)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """ctl (slurmctld, the login host), store (S3) and node1..node3 (a slurmd each): separate hosts
    made of Linux namespaces (tests/common/cluster_harness.py), built once and shared by every multi-host test."""
    from common import cluster_harness

    why = cluster_harness.missing()
    if why:
        pytest.skip(f"no multi-host cluster here: {why}")
    cluster_harness.down_orphans(tmp_path_factory.getbasetemp().parent)  # from sessions killed mid-way
    built = cluster_harness.up(3, tmp_path_factory.mktemp("cluster"))
    try:
        yield built
    finally:
        cluster_harness.down(built)


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    """fake-gcs-server on 127.0.0.1 for this session: its client environment, and `make_bucket()`
    creating a fresh bucket there. A server that died says so, with its log, at the next bucket."""
    from vitforge.testing import start_local_gcs

    server = start_or_fail(start_local_gcs, tmp_path_factory, "fake-gcs")
    yield {"env": server.env, "make_bucket": lambda: server.make_bucket("vf-" + uuid.uuid4().hex[:12]),
           "server": server}
    server.stop()


@pytest.fixture(scope="session")
def azure_server(tmp_path_factory):
    """Azurite on 127.0.0.1 for this session: its client environment (the development account's
    connection string), and `make_bucket()` creating a fresh container there."""
    from vitforge.testing import start_local_azure

    server = start_or_fail(start_local_azure, tmp_path_factory, "azurite")

    def make_bucket() -> str:
        name = "vf-" + uuid.uuid4().hex[:12]
        server.client().create_container(name)
        return name

    yield {"env": server.env, "make_bucket": make_bucket, "server": server}
    server.stop()
