"""The tests' launches forked from a zygote (tests/common/zygote.py) behave as fresh processes do:
the same output and exit codes, a signal's returncode, and a fresh interpreter where a fork cannot
stand in for one. (That a fork stages under the launch's own TMPDIR, which tempfile caches, is
test_cache_integrity's killed-shard test.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from common.cli import EXTENSIONS, REPO, launch
from common.zygote import usable


def _fresh(argv: list[str], env: dict) -> tuple[int, str, str]:
    result = subprocess.run([sys.executable, "-m", "vitforge", *argv], capture_output=True, text=True, env=env,
                            cwd=REPO, stdin=subprocess.DEVNULL, timeout=300)
    return result.returncode, result.stdout, result.stderr


def _forked(argv: list[str], env: dict) -> tuple[int, str, str]:
    process = launch(argv, env)
    assert not isinstance(process, subprocess.Popen), "the launch was not a fork"
    stdout, stderr = process.communicate(timeout=300)
    return process.returncode, stdout, stderr


@pytest.mark.skipif("COVERAGE_PROCESS_CONFIG" in os.environ,
                    reason="under `make coverage` no launch is forked (coverage would not trace a fork's threads)")
def test_a_forked_launch_gives_what_a_fresh_process_gives(tmp_path):
    env = {**os.environ, **EXTENSIONS, "TMPDIR": str(tmp_path)}
    for argv in (["--version"], ["train", "tiny_cpu", "--set", "train.steps=-1"], ["no-such-command"],
                 ["shard", str(tmp_path / "missing"), str(tmp_path / "out")]):
        fresh, forked = _fresh(argv, env), _forked(argv, env)
        assert forked[0] == fresh[0] and forked[1] == fresh[1], (argv, fresh, forked)
        assert forked[2].splitlines()[-1:] == fresh[2].splitlines()[-1:], (argv, fresh, forked)
    assert _forked(["--version"], env)[0] == 0 and _forked(["no-such-command"], env)[0] == 2


def test_a_fork_dies_by_its_signal(tmp_path):
    env = {**os.environ, **EXTENSIONS}
    process = launch(["train", "tiny_cpu", "--set", f"data.train={tmp_path / 'nowhere'}"], env,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    process.send_signal(signal.SIGKILL)
    assert process.wait(timeout=60) in (-signal.SIGKILL, 2)  # killed, or done before the signal came


def test_only_a_launch_with_the_zygotes_start_time_settings_is_forked():
    base = {"PATH": "/bin", "OMP_NUM_THREADS": "1"}
    assert usable({**base, "AWS_ENDPOINT_URL": "http://x"}, base)
    for changed in ({"OMP_NUM_THREADS": "2"}, {"PYTHONPATH": "/elsewhere"}, {"LD_PRELOAD": "libfaketime.so"},
                    {"TORCH_EXTENSIONS_DIR": "/other"}, {"COVERAGE_PROCESS_START": "rc"}, {"HF_HOME": "/h"}):
        assert not usable({**base, **changed}, base), changed
    # Under coverage nothing is forked, even from a zygote measured the same way: a fork's threads
    # (read-ahead, cache fetches, the lease's heartbeat) would go unmeasured.
    measured = {**base, "COVERAGE_PROCESS_CONFIG": "ci/coverage.rc"}
    assert not usable(measured, measured)
