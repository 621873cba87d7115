"""Secrets planted where a careless user puts them (a SAS token or signature in a store URL's query,
a password in its userinfo, a password in a tracking URI, a credentials file's contents) never
reach any output, and what is wrong is said in one line with a documented exit code: bad store
names and `..` segments fail at once as usage errors, a broken credentials file is named, a
`latest` pointer that is not text is ignored."""

from __future__ import annotations

import json
import time

import pytest

from common.checks import SECRET
from common.cli import vitforge
from vitforge.core import UsageError, errors, with_retries

STORE_URLS_WITH_SECRETS = [
    f"az://ctr/ds?sv=2024-05-04&ss=b&srt=co&sp=rwdlac&se=2030-01-01T00:00:00Z&sig={SECRET}",
    f"s3://bkt/ds?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Signature={SECRET}",
    f"gs://bkt/ds?token={SECRET}",
    f"s3://AKIDEXAMPLE:{SECRET}@bkt/ds",
    f"gs://bkt/ds#{SECRET}",
]


def _one_line_refusal(result, code: int = errors.USAGE) -> str:
    output = result.stdout + result.stderr
    assert result.returncode == code, output[-3000:]
    assert SECRET not in output and "Traceback" not in output, output[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("vitforge:")]
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize("url", STORE_URLS_WITH_SECRETS, ids=["az-sas", "s3-presigned", "gs-token", "s3-userinfo",
                                                               "gs-fragment"])
def test_a_store_url_carrying_credentials_is_refused_without_echoing_them(url, small_corpus, tmp_path):
    commands = [["shard", "info", url], ["shard", "verify", url], ["shard", str(small_corpus), url],
                ["ckpt", "list", url], ["ckpt", "verify", f"{url}"],
                ["train", "tiny_cpu", "--set", f"checkpoint.dir={url}", "--set", "data.train=synthetic"],
                ["train", "tiny_cpu", "--set", f"data.train={url}"],
                ["train", "tiny_cpu", "--set",
                 f"data.train=[{{url: '{small_corpus}', weight: 1}}, {{url: '{url}', weight: 1}}]"],
                ["train", "tiny_cpu", "--set", f"data.train=[{{url: '{url}', weight: 0}}]"]]
    for command in commands:
        line = _one_line_refusal(vitforge(*command, check=False, timeout=60))
        assert "takes no" in line and "credentials never come from a URL" in line, (command, line)
    assert not any(tmp_path.iterdir())  # nothing was staged for a write


@pytest.mark.parametrize("url", ["gs://bkt/a/../../b", "s3://bkt/data/./x", "az://ctr/runs/.."])
def test_dot_segments_in_a_store_url_are_refused(url, small_corpus):
    for command in (["shard", "info", url], ["shard", str(small_corpus), url]):
        line = _one_line_refusal(vitforge(*command, check=False, timeout=60))
        assert "no '.' or '..' path segment" in line and url in line


def test_a_tracking_uri_with_a_password_is_refused_from_the_config_or_the_environment():
    common = ("train", "tiny_cpu", "--set", "data.train=synthetic", "--set", "model.num_classes=10")
    keyed = vitforge(*common, "--set", f"tracking.mlflow.uri=http://alice:{SECRET}@mlflow.example:5000", check=False)
    assert "tracking.mlflow.uri: the URI holds credentials" in _one_line_refusal(keyed)
    environment = vitforge(*common, "--set", "tracking.mlflow={}", check=False, timeout=120,
                           env={"MLFLOW_TRACKING_URI": f"http://alice:{SECRET}@127.0.0.1:9"})
    line = _one_line_refusal(environment)
    assert "MLFLOW_TRACKING_URI holds credentials" in line and "MLFLOW_TRACKING_USERNAME" in line


def test_a_bad_bucket_name_is_a_usage_error_at_once():
    started = time.monotonic()
    line = _one_line_refusal(vitforge("shard", "info", "gs://Bad_Bucket!/x", check=False, timeout=60))
    assert "'Bad_Bucket!' is not a bucket name" in line
    assert time.monotonic() - started < 30  # not retried as if transient


def test_a_store_clients_value_error_is_not_retried():
    """What a client refuses before sending anything (google's bucket-name check raises ValueError)
    is the user's to fix: one attempt, a UsageError naming the operation. A body that fails to
    decode is worth another try."""
    calls = []

    def refused():
        calls.append(1)
        raise ValueError("Bucket names must start and end with a number or letter.")

    with pytest.raises(UsageError, match="get gs://x/y: Bucket names must start"):
        with_retries(refused, "get gs://x/y", base_delay=0.01)
    assert len(calls) == 1
    cut = []

    def undecodable():
        cut.append(1)
        if len(cut) < 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return "ok"

    assert with_retries(undecodable, "get gs://x/z", base_delay=0.01) == "ok" and len(cut) == 3


@pytest.mark.parametrize("content, expected", [
    (None, "which does not exist"),
    (f"not json {SECRET}", "which is not JSON"),
    (json.dumps({"client_secret": SECRET}), "a JSON file with no 'type'"),
    (json.dumps({"type": "service_account", "private_key": SECRET}), "which Google's client refused: "),
], ids=["missing", "not-json", "no-type", "malformed"])  # ids: SECRET differs in every xdist worker
def test_a_broken_google_credentials_file_is_named_with_what_is_wrong(tmp_path, content, expected):
    path = tmp_path / "key.json"
    if content is not None:
        path.write_text(content)
    result = vitforge("shard", "info", "gs://vitforge-bkt/ds", check=False, timeout=120,
                      env={"GOOGLE_APPLICATION_CREDENTIALS": str(path), "STORAGE_EMULATOR_HOST": ""})
    line = _one_line_refusal(result, errors.STORAGE)
    assert f"GOOGLE_APPLICATION_CREDENTIALS names {path}, {expected}" in line, line


def test_a_latest_pointer_that_is_not_text_is_ignored(tmp_path):
    run = tmp_path / "run"
    (run / "step_00000004").mkdir(parents=True)
    (run / "step_00000004" / "manifest.json").write_text("{}")
    (run / "latest").write_bytes(b"\xff\xfe\x00step")
    result = vitforge("ckpt", "list", run, check=False)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert "step_00000004" in result.stdout and "<- latest" not in result.stdout
    assert f"{run}/latest: not a checkpoint tag (7 bytes): ignored" in result.stderr
