"""Restore at another world size converts once for the whole job and shares the result through the
run's store: no node but rank 0's downloads the whole checkpoint, no node but rank 0's converts it.

Real DeepSpeed ZeRO-2: a checkpoint saved by 1 rank to the S3 stand-in, restored by 2 ranks on two
"nodes" (torchrun --nnodes 2 on this host, each node its own staging folder: nodes share no disk).
The restores run one after another in one job of this file's rank script (`python
tests/integration/test_scale_restore.py`, below), so the engine state right after each restore (weights, fp32
partition, Adam moments) is compared bit for bit with what today's path gives: every node fetching
the whole checkpoint and converting it itself, which is still what a job that does not own the run
(checkpoint.save=false) does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# The order matters: each scenario starts from what the one before left in the store.
SCENARIOS = ("today", "first", "again", "half", "corrupt", "flipped")
SAVED = ["train.steps=2", "train.checkpoint_every=2", "data.val=null", "train.log_every=1"]
CONVERTED = "ran ds_to_universal"


@pytest.mark.slow(seconds=65)
def test_a_world_size_change_converts_once_and_shares_it(data, s3_server, bucket, tmp_path):
    from common.cli import EXTENSIONS, REPO, train
    from vitforge.core import free_port

    store = f"s3://{bucket}/runs"
    train(data, "rescale", *SAVED, nproc=1, store=store, env=s3_server["env"])
    port, out = str(free_port()), tmp_path / "out"
    out.mkdir()
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
                               "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", port,
                               __file__, f"{store}/rescale", str(out), str(tmp_path / "staging")],
                              cwd=REPO, env={**os.environ, **EXTENSIONS, **s3_server["env"]},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for node in range(2)]
    outputs = [node.communicate(timeout=600) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    import torch

    seen = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    runs = {name: sum(s[name]["conversions"] for s in seen) for name in SCENARIOS}
    # Today: each node converts; then rank 0 alone, once; a published copy is reused; a copy without
    # its marker (an upload cut short) or with a corrupt file is converted again, never used; a good
    # copy that one node's fetch got wrong (a byte flipped on its way) is fetched again, and left as
    # it is for the other jobs that may be reading it.
    assert runs == {"today": 2, "first": 1, "again": 0, "half": 1, "corrupt": 1, "flipped": 0}, runs
    assert "converting again" in outputs[0][1] and "sha256 differs" in outputs[0][1]
    assert seen[1]["flipped"]["flipped"] and "checks out in the store; fetching it again" in outputs[0][1]
    for name in SCENARIOS:
        for r in range(2):
            assert seen[r][name]["step"] == 2
            a, b = (torch.load(out / f"{n}_rank{r}.pt") for n in ("today", name))
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (name, r)
    def stored(name: str) -> dict:
        key = f"runs/rescale/step_00000002/{name}"
        return json.loads(s3_server["client"].get_object(Bucket=bucket, Key=key)["Body"].read())

    manifest, marker = stored("manifest.json"), stored("universal.json")
    checkpoint = sum(meta["bytes"] for meta in manifest["files"].values())
    params = {name.split("/")[2] for name in marker["files"] if name.count("/") == 3}
    # Today every node downloads the whole checkpoint; now only rank 0's, once, to convert it.
    assert seen[0]["today"]["fetched"] == seen[1]["today"]["fetched"] == checkpoint
    assert seen[0]["first"]["fetched"] == checkpoint and seen[0]["again"]["fetched"] < checkpoint
    # Node 1 fetches only the parameters its rank's ZeRO-2 partition holds, node 0 the others
    # (a parameter cut by the boundary of its group, with or without weight decay, is in both).
    held = [set(s["again"]["params"]) for s in seen]
    assert held[0] | held[1] == params and len(held[0] & held[1]) <= 2 and held[0] and held[1]
    assert set(seen[1]["first"]["params"]) == held[1]
    assert marker["converted_from_world_size"] == 1 and manifest["world_size"] == 1


def _engine_state(engine) -> dict:
    """What a ZeRO-2 restore sets on this rank: the module's weights, the rank's fp32 partition and
    its Adam state."""
    import torch

    state = {f"module.{k}": v.detach().clone() for k, v in engine.module.state_dict().items()}
    optimizer = engine.optimizer
    for i, flat in enumerate(optimizer.single_partition_of_fp32_groups):
        state[f"fp32.{i}"] = flat.detach().clone()
    for i, moments in enumerate(optimizer.optimizer.state.values()):
        state.update({f"adam.{i}.{k}": torch.as_tensor(v).clone() for k, v in moments.items()})
    return state


def _ranks(run_url: str, out: str, staging_base: str) -> None:
    """One rank of the restore job: every scenario's restore, its engine state and what it logged."""
    import logging

    import torch
    import torch.distributed as dist

    from vitforge.core import setup_logging
    from vitforge.trainer import build_model, load_config
    from vitforge.trainer.checkpoint import Checkpointer
    from vitforge.trainer.distributed import detect_env, init_distributed
    from vitforge.trainer.engine import build_engine
    from vitforge.trainer.run_store import RunStore

    setup_logging()
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("vitforge.checkpoint")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    env = detect_env()
    device = init_distributed(env)
    cfg = load_config("tiny_cpu", SAVED)
    staging = os.path.join(staging_base, f"node{env.rank}")  # one rank per node

    def engine_for(universal: bool):
        config = cfg.model_copy(update={"deepspeed": {**cfg.deepspeed, "checkpoint": {"load_universal": universal}}})
        return build_engine(config, lambda: build_model(cfg.model.name, 10, cfg.model.image_size, cfg.model.drop_path,
                                                        cfg.model.dropout, cfg.model.pre_logits, cfg.train.objective),
                            env.world_size, device)

    seen = {}
    run = RunStore(run_url)
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    for name in SCENARIOS:
        faults = None
        if env.rank == 1 and name == "flipped":  # node 1's link to the store flips a byte, once
            from common.faulty_proxy import FaultSchedule, start_proxy

            faults = FaultSchedule(0, 0, 0, flip_once="/universal/zero/")
            proxy, port = start_proxy(int(endpoint.rsplit(":", 1)[1]), faults)
            os.environ["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{port}"
        if env.rank == 0 and name == "half":  # an upload cut short: files without their marker
            run.store.delete(["step_00000002/universal.json"])
        if env.rank == 0 and name == "corrupt":  # the same size, other bytes: only its sha256 tells
            published = bytearray(run.get_bytes("step_00000002/universal/zero/optimizer_state.pt"))
            published[len(published) // 2] ^= 0xFF
            run.put_bytes("step_00000002/universal/zero/optimizer_state.pt", bytes(published))
        dist.barrier()
        checkpointer = Checkpointer(run_url, staging, None, None, 10, 10, None)
        if name != "today":  # today's path is what a job that may not write the run does
            checkpointer.claim()
        records.clear()
        engine, restored = checkpointer.restore(engine_for, 2)
        checkpointer.release()
        if faults is not None:
            proxy.shutdown()
            os.environ["AWS_ENDPOINT_URL"] = endpoint
        torch.save(_engine_state(engine), os.path.join(out, f"{name}_rank{env.rank}.pt"))
        fetched = [int(m.split(" files, ")[1].split()[0]) for m in records if m.startswith("fetched ")]
        zero = Path(checkpointer.download_dir, "step_00000002", "universal", "zero")
        seen[name] = {"step": restored.step, "conversions": sum(CONVERTED in m for m in records),
                      "fetched": sum(fetched), "flipped": faults is not None and faults.flip_once is None,
                      "params": sorted(p.name for p in zero.iterdir() if p.is_dir()) if zero.exists() else []}
    Path(out, f"rank{env.rank}.json").write_text(json.dumps(seen))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _ranks(*sys.argv[1:4])
