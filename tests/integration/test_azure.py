"""Azure Blob (az://, abfs://) against Azurite on 127.0.0.1: the URL forms and the credential chain,
failures as one line without the key, a transfer through resets, 503s and cut bodies, and a run
sharded, trained, preempted, resumed and exported there, equal to the same run from local folders.

Azurite cannot show: a conditional create refused with 412 (it answers 409; both are mapped to
PreconditionFailed), OAuth (DefaultAzureCredential is only checked to be the chain's last resort),
and the 7-day expiry of uncommitted blocks (abort_uploads relies on it)."""

from __future__ import annotations

import hashlib
import os
import signal
import time
import uuid

import pytest
import torch

from common.checks import assert_same_weights, losses, weights
from common.cli import STRAIGHT, start_ranks, train, vitforge
from common.faulty_proxy import FaultSchedule, start_proxy
from vitforge.core import PreconditionFailed, StorageError, UsageError, errors, open_store
from vitforge.core.store_azure import parse_azure_url, service_client
from vitforge.testing.local_azure import DEV_KEY, dev_connection_string

AZURE_ENV = ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT",
             "AZURE_STORAGE_KEY", "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_TOKEN")
WRONG_KEY = "V3JvbmdLZXlXcm9uZ0tleVdyb25nS2V5V3JvbmdLZXk="  # valid base64, not the account's


@pytest.fixture
def azure_env(monkeypatch):
    """No Azure variable from the caller's environment leaks into a test."""
    for name in AZURE_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_url_forms_name_the_container_prefix_and_account():
    assert parse_azure_url("az://data/a/b/").prefix == "a/b" and parse_azure_url("az://data/x").account is None
    adls = parse_azure_url("abfss://data@acct.dfs.core.windows.net/runs")
    assert (adls.container, adls.prefix, adls.account, adls.suffix) == ("data", "runs", "acct", "core.windows.net")
    assert parse_azure_url("abfs://data@acct.dfs.core.chinacloudapi.cn/").suffix == "core.chinacloudapi.cn"
    assert parse_azure_url("az://data@acct/x").account == "acct"
    with pytest.raises(UsageError, match="'Data' is not a container name"):
        parse_azure_url("az://Data/x")
    with pytest.raises(UsageError, match="got the host 'acct.web.core.windows.net'"):
        parse_azure_url("abfs://data@acct.web.core.windows.net/x")


def test_credentials_come_from_the_standard_chain_in_order(azure_env):
    from azure.core.credentials import AzureSasCredential
    from azure.identity import DefaultAzureCredential

    with pytest.raises(UsageError, match="no Azure storage account.*AZURE_STORAGE_ACCOUNT_NAME"):
        open_store("az://data/x")  # at once, not after retries
    assert isinstance(service_client(parse_azure_url("az://data@acct/x")).credential, DefaultAzureCredential)
    azure_env.setenv("AZURE_STORAGE_ACCOUNT_NAME", "acct")
    azure_env.setenv("AZURE_STORAGE_SAS_TOKEN", "?sv=2024&sig=c2VjcmV0")
    sas = service_client(parse_azure_url("az://data/x"))
    assert isinstance(sas.credential, AzureSasCredential) and sas.url.startswith("https://acct.blob.core.windows.net")
    azure_env.setenv("AZURE_STORAGE_KEY", WRONG_KEY)  # a key comes before a SAS token
    keyed = service_client(parse_azure_url("abfs://data@acct.dfs.core.chinacloudapi.cn/x"))
    assert keyed.credential.account_name == "acct" and keyed.url.startswith("https://acct.blob.core.chinacloudapi.cn")
    azure_env.setenv("AZURE_STORAGE_CONNECTION_STRING", dev_connection_string("http://127.0.0.1:1/devstoreaccount1"))
    assert service_client(parse_azure_url("az://data/x")).account_name == "devstoreaccount1"  # first in the chain
    with pytest.raises(UsageError, match="names the account 'acct' but .* is for 'devstoreaccount1'") as refused:
        service_client(parse_azure_url("az://data@acct/x"))
    store = open_store("az://data/x")
    assert store.url("a/b") == "az://data/x/a/b" and DEV_KEY not in repr(store) + str(refused.value)


def test_wrong_key_and_missing_container_fail_in_one_line_without_the_key(azure_server, azure_env):
    endpoint = azure_server["server"].endpoint
    container = azure_server["make_bucket"]()
    azure_env.setenv("AZURE_STORAGE_CONNECTION_STRING",
                     dev_connection_string(endpoint).replace(DEV_KEY, WRONG_KEY))
    with pytest.raises(StorageError) as denied:
        open_store(f"az://{container}/runs").get_bytes("latest")
    message = str(denied.value)
    assert message.startswith(f"az://{container}/runs/latest: access denied (403") and "\n" not in message
    assert WRONG_KEY not in message and WRONG_KEY[:12] not in message
    azure_env.setenv("AZURE_STORAGE_CONNECTION_STRING", dev_connection_string(endpoint))
    for call in (lambda s: s.get_bytes("latest"), lambda s: s.exists("latest"), lambda s: s.put_bytes("a", b"1")):
        with pytest.raises(StorageError, match=r"^az://no-such-container/runs/\w+: the container does not exist$"):
            call(open_store("az://no-such-container/runs"))


def test_an_unreachable_endpoint_with_a_sas_token_fails_without_the_signature(azure_env, monkeypatch):
    """The SDK's connection errors quote the request URL, whose query holds a SAS signature."""
    signature = "sig=" + uuid.uuid4().hex
    azure_env.setenv("AZURE_STORAGE_CONNECTION_STRING", "BlobEndpoint=http://127.0.0.1:9/devstoreaccount1;"
                     f"SharedAccessSignature=sv=2024-08-04&ss=b&srt=sco&sp=rwdl&{signature}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    for call in (lambda s: s.get_bytes("a.bin"), lambda s: s.put_bytes("a.bin", b"1")):
        with pytest.raises(StorageError) as failed:
            call(open_store("az://ctr/x"))
        assert str(failed.value).startswith("az://ctr/x/a.bin: ") and signature not in str(failed.value)


def test_a_transfer_through_resets_503s_and_cut_bodies_completes_and_is_one_version(azure_server, azure_env,
                                                                                     monkeypatch, tmp_path):
    """The fault proxy (tests/common/faulty_proxy.py) in front of Azurite: the SDK's retries and ours carry
    an upload of 3 staged blocks and one commit (4 MiB blocks here to keep it quick), then a
    download in 3 MiB ranged reads, through 503s, resets and bodies cut short."""
    import vitforge.core.store_azure as store_azure

    monkeypatch.setattr(store_azure, "BLOCK_BYTES", 4 << 20)
    monkeypatch.setattr(store_azure, "SINGLE_PUT_BYTES", 4 << 20)
    container = azure_server["make_bucket"]()
    schedule = FaultSchedule(slow_down_every=4, reset_every=7, cut_body_every=11)
    port = int(azure_server["server"].endpoint.split(":")[2].split("/")[0])
    proxy, proxy_port = start_proxy(port, schedule)
    try:
        azure_env.setenv("AZURE_STORAGE_CONNECTION_STRING",
                         dev_connection_string(f"http://127.0.0.1:{proxy_port}/devstoreaccount1"))
        store = open_store(f"az://{container}/ckpt")
        local = tmp_path / "big.bin"
        local.write_bytes(os.urandom(12 << 20))
        store.put_file(str(local), "rank0.pt", keep=True)
        assert schedule.injected["slow_down"]  # the commit met a 503
        digest = store.download("rank0.pt", str(tmp_path / "back.bin"), part_bytes=3 << 20, threads=4)
        assert digest == hashlib.sha256(local.read_bytes()).hexdigest()
        version = store.put_if("latest", b"step_1", None)
        with pytest.raises(PreconditionFailed):
            store.put_if("latest", b"step_2", None)
        assert store.get_versioned("latest") == (b"step_1", version)
    finally:
        proxy.shutdown()
    assert all(schedule.injected.values()), schedule.injected  # each kind of fault happened, and was survived
    blocks = {path.split("blockid=")[1] for method, path in schedule.requests if "comp=block&" in path}
    commits = [path for method, path in schedule.requests if path.endswith("comp=blocklist")]
    assert len(blocks) == 3 and commits  # staged, then committed


@pytest.mark.slow
def test_shard_train_preempt_resume_and_export_on_azure_equal_the_local_run(data, straight, azure_server,
                                                                           azure_env, tmp_path):
    env = azure_server["env"]
    for key, value in env.items():
        azure_env.setenv(key, value)
    root = f"az://{azure_server['make_bucket']()}"
    vitforge("shard", data / "train_src", f"{root}/train", "--shard-samples", "64", "--workers", "2", env=env)
    logs, runs = tmp_path / "logs", f"{root}/runs"
    common = [*STRAIGHT, f"data.train={root}/train", f"data.cache_dir={tmp_path / 'cache'}",
              f"checkpoint.log_dir={logs}"]
    ranks = start_ranks(data, "azrun", *common, store=runs, env=env)
    store, deadline = open_store(runs), time.monotonic() + 120
    while not store.exists("azrun/lease.json") and time.monotonic() < deadline:
        time.sleep(0.05)
    ranks[1].send_signal(signal.SIGUSR1)
    outputs = [r.communicate(timeout=240) for r in ranks]
    assert [r.returncode for r in ranks] == [errors.REQUEUE, errors.REQUEUE], outputs
    step = int(outputs[0][1].split("stopped at step ")[1].split()[0])
    assert store.get_bytes("azrun/latest").decode() == f"step_{step:08d}"
    resumed = train(data, "azrun", *common, store=runs, env=env)
    assert f"at step {step}" in resumed.stderr and f"{runs}/azrun/step_{step:08d}" in resumed.stderr
    assert losses(logs) == losses(straight)
    assert_same_weights(weights(f"{runs}/azrun"), weights(str(straight)))
    from safetensors.torch import load_file

    from vitforge.trainer.export import export

    exports = {name: str(tmp_path / f"{name}.safetensors") for name in ("azure", "local")}
    export(f"{runs}/azrun", exports["azure"], str(tmp_path / "scratch"))  # in-process: no second torch start-up
    export(str(straight), exports["local"], str(tmp_path / "scratch"))
    exported, reference = load_file(exports["azure"]), load_file(exports["local"])
    assert exported.keys() == reference.keys() and all(torch.equal(exported[k], reference[k]) for k in reference)
    everything = "".join(o + e for o, e in outputs) + resumed.stdout + resumed.stderr
    assert DEV_KEY not in everything and "Request headers" not in everything  # no SDK request dumps
