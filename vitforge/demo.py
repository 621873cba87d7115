"""`vitforge demo`: the whole job end to end on a fresh machine, on embedded defaults.

  1. generate a learnable corpus: JPEGs in 10 classes, varied sizes and aspect ratios, plus
     broken files the sharder must reject and report
  2. start an object store on 127.0.0.1 (SeaweedFS; a local folder if it cannot start)
  3. shard the corpus into the store, then verify every shard
  4. train a tiny ViT with ZeRO-2 on 2 CPU processes, the DALI CPU loader reading from the store,
     checkpoints to the store; SIGUSR1 a third of the way in, and the run resumes from the store
     (a private local SLURM requeues the job when SLURM's daemons are installed and this is
     root; otherwise the demo relaunches the ranks itself)
  5. evaluate the checkpoint on held-out shards
  6. export the weights to safetensors and reload them in timm
  7. draw the ViT paper's figures for the trained model
  8. write DEMO/report.md: summary table, curves, throughput, the shard report, where everything is

Every step is a `vitforge` command, printed before it runs: the same commands work on real data.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from vitforge.cluster import JOB_ENDED, cancel, job_info
from vitforge.core import errors, free_port, open_store
from vitforge.core.cli_args import bounded, positive_int

from .demo_report import write_report
from .synthetic import write_broken_files, write_class_folders

BUCKET = "vitforge-demo"
RUN = "demo"


@dataclass
class Demo:
    out: str
    images: int
    val_images: int
    steps: int
    workers: int
    store: str  # auto | local
    launcher: str  # auto | slurm | direct
    classes: int = 10
    facts: dict = field(default_factory=dict)  # what the report says
    stage: int = 0

    def path(self, *parts: str) -> str:
        return os.path.abspath(os.path.join(self.out, *parts))

    def say(self, title: str) -> None:
        self.stage += 1
        print(f"\n== [{self.stage}/8] {title}", flush=True)

    def vitforge(self, *args: str, quiet: bool = False, echo: bool = True) -> subprocess.CompletedProcess:
        """Run one vitforge command as a user would, echoing it (and its output unless `quiet`)."""
        if echo:
            print("$ vitforge " + shlex.join(args), flush=True)
        result = subprocess.run([sys.executable, "-m", "vitforge", *args], capture_output=True, text=True)
        if not quiet and result.stdout.strip():
            print(result.stdout.rstrip(), flush=True)
        if result.returncode != 0:
            raise DemoError(f"`vitforge {args[0]}` failed with exit code {result.returncode}:\n"
                            f"{result.stderr[-3000:]}", result.returncode)
        return result


class DemoError(Exception):
    """A stage failed: a command's exit code, or 1 when one of the demo's own checks did not hold."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="vitforge demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="demo-out", help="working folder (default ./demo-out, replaced)")
    p.add_argument("--images", type=bounded(int, low=100), default=3000,
                   help="training images to generate (default 3000)")
    p.add_argument("--val-images", type=bounded(int, low=10), default=500,
                   help="held-out images (default 500)")
    p.add_argument("--steps", type=bounded(int, low=20), default=600,
                   help="training steps of 32 images (default 600)")
    p.add_argument("--workers", type=positive_int, default=2, help="sharding processes (default 2)")
    p.add_argument("--store", choices=("auto", "local"), default="auto",
                   help="auto: an S3 server on 127.0.0.1 (a local folder if it cannot start); local: a folder")
    p.add_argument("--launcher", choices=("auto", "slurm", "direct"), default="auto",
                   help="auto: a private local SLURM when its daemons are installed and this is root, else direct")
    args = p.parse_args(argv)
    demo = Demo(args.out, args.images, args.val_images, args.steps, args.workers, args.store, args.launcher)
    started = time.monotonic()
    shutil.rmtree(demo.out, ignore_errors=True)
    os.makedirs(demo.out)
    stops = []
    try:
        _corpus(demo)
        stops.append(_store(demo))
        _shard(demo)
        stops.append(_train(demo))
        _evaluate(demo)
        _export(demo)
        _figures(demo)
        demo.say("report")
        demo.facts["minutes"] = (time.monotonic() - started) / 60
        report = write_report(demo.path(), demo.facts)
        print(f"wrote {report} ({demo.facts['minutes']:.1f} minutes in all)")
        return 0
    except DemoError as e:
        print(f"vitforge demo: stage {demo.stage} failed: {e}", file=sys.stderr)
        return e.code
    finally:
        for stop in reversed([s for s in stops if s]):
            stop()


def _corpus(demo: Demo) -> None:
    demo.say(f"generate {demo.images} training and {demo.val_images} held-out JPEGs in {demo.classes} classes")
    train, val = demo.path("corpus", "train"), demo.path("corpus", "val")
    paths = write_class_folders(train, demo.classes, demo.images // demo.classes, seed=0, varied=True)
    write_class_folders(val, demo.classes, demo.val_images // demo.classes, seed=1, varied=True)
    broken = write_broken_files(train)
    print(f"{len(paths)} images of 48-256 px at aspect ratios 1:2 to 2:1 under {train}, and {len(broken)} broken "
          f"files the sharder must reject: " + ", ".join(f"{os.path.basename(p)} ({r})" for p, r in broken.items()))
    demo.facts.update(corpus=train, val_corpus=val, broken=broken, images=len(paths))


def _store(demo: Demo):
    """The datasets' and checkpoints' home: s3://vitforge-demo on a private server, or a folder."""
    # The stand-ins are imported where used: only `vitforge demo` needs them, not the rest of the CLI.
    from vitforge.testing import start_local_s3

    demo.say("start an object store on 127.0.0.1")
    if demo.store == "auto":
        try:
            server = start_local_s3(demo.path("store"))
            server.client().create_bucket(Bucket=BUCKET)
            os.environ.update(server.env)  # every command below, and this process, reach the store
            demo.facts.update(store=f"s3://{BUCKET}", endpoint=server.endpoint, store_data=demo.path("store"))
            print(f"SeaweedFS S3 API at {server.endpoint} (data in {demo.path('store')}); "
                  "the AWS_* variables of every command below point at it")
            return server.stop
        except Exception as e:  # any reason it cannot start: say it and go on with a folder
            print(f"the S3 server did not start ({str(e).splitlines()[0]}); using a local folder instead")
            demo.facts["store_fallback"] = str(e).splitlines()[0]
    demo.facts.update(store=demo.path("bucket"))
    print(f"storing datasets and checkpoints in {demo.facts['store']}")
    return None


def _shard(demo: Demo) -> None:
    demo.say("shard the corpus into the store and verify every shard")
    train, val = f"{demo.facts['store']}/shards/train", f"{demo.facts['store']}/shards/val"
    per_shard = str(max(demo.images // 8, 50))
    result = demo.vitforge("shard", demo.facts["corpus"], train, "--shard-samples", per_shard,
                           "--workers", str(demo.workers))
    demo.vitforge("shard", demo.facts["val_corpus"], val, "--prefix", "val", "--classes", f"{train}/dataset.json",
                  "--workers", str(demo.workers))
    verified = demo.vitforge("shard", "verify", train, "--workers", str(demo.workers))
    # The same command into a folder gives the same bytes (sharding is deterministic); the copy
    # stays for the README's next steps (`vitforge train tiny_cpu` reads demo-out/shards).
    local = demo.path("shards")
    demo.vitforge("shard", demo.facts["corpus"], local, "--shard-samples", per_shard, "--workers", str(demo.workers),
                  quiet=True)
    if _shard_digests(local) != _shard_digests(train):
        raise DemoError(f"{local} and {train} hold different shards from the same command")
    print(f"the same command into {local}: the same bytes, shard for shard (kept for the README's next steps)")
    info = demo.vitforge("shard", "info", train, quiet=True).stdout
    rejects = open_store(train).get_bytes("rejects.jsonl").decode().splitlines()
    demo.facts.update(train=train, val=val, local_shards=local, shard_summary=result.stdout.strip(),
                      shard_info=info.strip(),
                      verify=verified.stdout.strip().splitlines()[-1], rejects=[json.loads(r) for r in rejects])


def _shard_digests(dataset: str) -> list[str]:
    return [s["sha256"] for s in json.loads(open_store(dataset).get_bytes("dataset.json"))["shards"]]


def _training_overrides(demo: Demo) -> list[str]:
    steps = demo.steps
    return [f"data.train={demo.facts['train']}", f"data.val={demo.facts['val']}", "data.backend=dali-cpu",
            "data.workers=1", f"checkpoint.dir={demo.facts['store']}/runs", f"checkpoint.run={RUN}",
            f"checkpoint.log_dir={demo.path('logs')}", f"train.steps={steps}", f"train.eval_every={max(steps // 6, 1)}",
            f"train.checkpoint_every={max(steps // 2, 1)}", f"train.log_every={max(steps // 60, 1)}",
            "train.zero_stage=2",
            "model.name=vit_tiny_cpu"]


def _train(demo: Demo):
    from vitforge.testing import local_slurm_missing

    slurm_why = None
    if demo.launcher != "direct":
        slurm_why = local_slurm_missing()
        if slurm_why and demo.launcher == "slurm":
            raise DemoError(f"--launcher slurm: {slurm_why}")
    use_slurm = demo.launcher == "slurm" or (demo.launcher == "auto" and slurm_why is None)
    how = "a private local SLURM" if use_slurm else f"2 rank processes started directly ({slurm_why or 'asked'})"
    demo.say(f"train a tiny ViT, ZeRO-2 on 2 CPU processes, through {how}; SIGUSR1 a third of the way in, "
             "then resume from the store")
    demo.facts.update(run=f"{demo.facts['store']}/runs/{RUN}", launcher="slurm" if use_slurm else "direct",
                      launcher_why=slurm_why)
    if use_slurm:
        return _train_slurm(demo)
    _train_direct(demo)
    return None


def _metrics(demo: Demo) -> list[dict]:
    path = demo.path("logs", "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


class Progress:
    """Prints the new lines of metrics.jsonl once each: every evaluation, a tenth of the log lines."""

    def __init__(self, demo: Demo):
        self.demo, self.shown, self.every, self.next = demo, set(), max(demo.steps // 10, 1), 1

    def step(self) -> int:
        latest = 0
        for m in _metrics(self.demo):
            latest = max(latest, m["step"])
            key = (m["step"], "loss" in m)
            if key in self.shown:
                continue
            self.shown.add(key)
            if "loss" in m and m["step"] >= self.next:
                self.next = m["step"] + self.every
                print(f"  step {m['step']:4d}  loss {m['loss']:.3f}  {m['images_per_s']:.0f} images/s  "
                      f"data wait {100 * m['data_wait_fraction']:.0f}%", flush=True)
            elif "eval_top1" in m:
                print(f"  step {m['step']:4d}  held-out top-1 {100 * m['eval_top1']:.1f}%", flush=True)
        return latest


def _wait_for_step(progress: Progress, step: int, ended, timeout: float = 900) -> None:
    """Poll the metrics often (a tiny model takes a few seconds for the second half of its run),
    and now and then whether the training has ended: `ended()` says how, or None while it runs."""
    checked = time.monotonic()
    deadline = checked + timeout
    while progress.step() < step:
        if time.monotonic() - checked > 5:
            if how := ended():
                raise DemoError(f"training ended before the demo could interrupt it at step {step}: {how}")
            checked = time.monotonic()
        if time.monotonic() > deadline:
            raise DemoError(f"training did not reach step {step} in {timeout:.0f} s")
        time.sleep(0.1)


def _train_direct(demo: Demo) -> None:
    """What srun does, by hand: 2 rank processes; SIGUSR1 to each, as SLURM sends it; then again."""
    progress = Progress(demo)
    command = ["train", "tiny_cpu"] + [a for o in _training_overrides(demo) for a in ("--set", o)]
    print("$ RANK=0,1 WORLD_SIZE=2 ... vitforge " + shlex.join(command), flush=True)
    logs = []
    os.makedirs(demo.path("logs"), exist_ok=True)
    for attempt in (1, 2):
        port = free_port()
        ranks = []
        for rank in range(2):
            log_path = demo.path("logs", f"train-attempt{attempt}-rank{rank}.log")
            logs.append(log_path)
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                   "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            with open(log_path, "w") as log:
                ranks.append(subprocess.Popen([sys.executable, "-m", "vitforge", *command], stdout=log,
                                              stderr=subprocess.STDOUT, env=env))
        if attempt == 1:
            _wait_for_step(progress, demo.steps // 3, lambda: any(r.poll() is not None for r in ranks) and
                           f"the ranks exited {[r.poll() for r in ranks]}; logs: {', '.join(logs)}")
            print(f"  sending SIGUSR1 to both ranks at step {progress.step()} (as a preemption would)", flush=True)
            for r in ranks:
                r.send_signal(signal.SIGUSR1)
        while any(r.poll() is None for r in ranks):
            progress.step()
            time.sleep(0.5)
        codes = [r.returncode for r in ranks]
        wanted = errors.REQUEUE if attempt == 1 else errors.OK
        if codes != [wanted, wanted]:
            raise DemoError(f"attempt {attempt}: the ranks exited {codes}, expected {wanted}; logs: {', '.join(logs)}")
        if attempt == 1:
            print("  both ranks saved a checkpoint to the store and exited 75 (requeue me); starting them again",
                  flush=True)
    progress.step()
    _record_resume(demo, "".join(open(p).read() for p in logs), logs)


def _train_slurm(demo: Demo):
    from vitforge.testing import start_local_slurm, stop_local_slurm

    slurm_env = start_local_slurm(demo.path("slurm"))
    os.environ.update(slurm_env)
    print(f"slurmctld and slurmd up on localhost (SLURM_CONF={slurm_env['SLURM_CONF']})")
    try:
        progress = Progress(demo)
        overrides = "[" + ", ".join(_training_overrides(demo)) + "]"
        venv = ["--set", f"venv={sys.prefix}"] if sys.prefix != sys.base_prefix else []
        submitted = demo.vitforge("submit", "tiny_cpu", "--set", "name=vitforge-demo", "--set",
                                  f"log_dir={demo.path('slurm-logs')}", *venv, "--set", f"train.overrides={overrides}")
        job = submitted.stdout.split("submitted job ")[1].split(":")[0]
        log_path = demo.path("slurm-logs", f"vitforge-demo-{job}.out")
        _wait_for_step(progress, demo.steps // 3, lambda: _job_ended(job, log_path))
        # In this process: a command's start-up (about 2 s on a busy machine) is a tenth of the run.
        print(f"  step {progress.step()}: sending SIGUSR1 to the job, as a preemption or its time limit would "
              f"(`vitforge cancel {job} --signal USR1`)", flush=True)
        cancel(job, "USR1")
        deadline = time.monotonic() + 900
        while (state := _job_state(job))[0] not in JOB_ENDED:
            if time.monotonic() > deadline:
                raise DemoError(f"job {job} did not finish in 15 minutes: {state}")
            progress.step()
            time.sleep(1)
        progress.step()
        log = demo.vitforge("logs", job, quiet=True).stdout
        if state[0] != "COMPLETED":
            raise DemoError(f"job {job} ended {state[0]}; its log {log_path}:\n{log[-3000:]}")
        print(f"  job {job} COMPLETED after {state[1]} requeue(s)", flush=True)
        demo.facts.update(job=job, requeues=state[1])
        _record_resume(demo, log, [log_path])
    except BaseException:
        stop_local_slurm(slurm_env)
        raise
    return lambda: stop_local_slurm(slurm_env)


def _job_ended(job: str, log_path: str) -> str | None:
    """How a job ended (its state and the end of its log), or None while it may still run."""
    state = _job_state(job)[0]
    if state not in JOB_ENDED:
        return None
    tail = open(log_path).read()[-3000:] if os.path.exists(log_path) else "(no log)"
    return f"job {job} is {state}; its log {log_path} ends:\n{tail}"


def _job_state(job: str) -> tuple[str, int]:
    """(state, restarts) of a job, straight from scontrol: polled often, it must be quick."""
    info = job_info(job)
    return info.get("JobState", "UNKNOWN"), int(info["Restarts"])


def _record_resume(demo: Demo, log: str, logs: list[str]) -> None:
    """The trainer's own words: where it stopped (and why), and which checkpoint it resumed from."""
    stopped = re.search(r"stopped at step (\d+) \(([^)]*)\)", log)
    resumed = re.search(rf"resumed ({re.escape(demo.facts['run'])}/step_\d+) at step (\d+)", log)
    if not stopped or not resumed:
        raise DemoError(f"the run was not stopped and resumed from the store as planned; logs: {', '.join(logs)}")
    demo.facts.update(stop_step=int(stopped.group(1)), stop_reason=stopped.group(2), resumed_from=resumed.group(1),
                      resume_step=int(resumed.group(2)), train_logs=logs, metrics=_metrics(demo))
    print(f"  stopped at step {stopped.group(1)} ({stopped.group(2)}) with a complete checkpoint; resumed from "
          f"{resumed.group(1)} at step {resumed.group(2)}", flush=True)


def _evaluate(demo: Demo) -> None:
    demo.say("evaluate the trained model on the held-out shards")
    result = demo.vitforge("eval", "tiny_cpu", "--checkpoint", demo.facts["run"], "--set",
                           f"data.val={demo.facts['val']}", "--set", "data.backend=dali-cpu", quiet=True)
    metrics = json.loads(result.stdout.strip().splitlines()[-1])
    print(f"held-out top-1 {100 * metrics['eval_top1']:.1f}% (chance {100 / demo.classes:.0f}%), top-5 "
          f"{100 * metrics['eval_top5']:.1f}%, loss {metrics['eval_loss']:.3f} over {metrics['eval_samples']} images")
    demo.facts["eval"] = metrics


def _export(demo: Demo) -> None:
    demo.say("export the weights to safetensors and reload them in timm")
    weights = demo.path("model.safetensors")
    exported = json.loads(demo.vitforge("ckpt", "export", demo.facts["run"], "--out", weights,
                                        quiet=True).stdout.strip().splitlines()[-1])
    print(f"{weights}: {exported['model']} at {exported['image_size']} px, {exported['num_classes']} classes, "
          f"from {exported['source']}")
    check = _timm_top1(weights, demo.facts["val"])
    print(f"timm's VisionTransformer loaded {weights} strictly: held-out top-1 {100 * check['top1']:.1f}% over "
          f"{check['samples']} images (the torch loader's decode; eval above used DALI's)")
    demo.facts.update(weights=weights, timm=check)


def _timm_top1(weights: str, val: str) -> dict:
    """Rebuild the model with timm alone from the export's description, load the weights strictly,
    and classify the held-out shards with it."""
    import timm
    import torch
    from safetensors.torch import load_file
    from timm.models.vision_transformer import VisionTransformer

    from vitforge.pipeline import IGNORE_LABEL, LoaderSpec, build_loader
    from vitforge.trainer import TINY_MODELS

    with open(weights.removesuffix(".safetensors") + ".json") as f:
        description = json.load(f)
    name, size, classes = description["model"], description["image_size"], description["num_classes"]
    if name in TINY_MODELS:  # a CPU-sized layout of timm's VisionTransformer, not in timm's registry
        model = VisionTransformer(img_size=size, num_classes=classes, **TINY_MODELS[name])
    else:
        model = timm.create_model(name, img_size=size, num_classes=classes)
    model.load_state_dict(load_file(weights), strict=True)
    model.eval()
    hits = count = 0
    with torch.no_grad():
        for batch in build_loader(LoaderSpec(val, batch_size=100, image_size=size, train=False, backend="torch",
                                             workers=0)):
            real = batch["label"] != IGNORE_LABEL
            predicted = model(batch["image"].float()).argmax(dim=1)
            hits += int((predicted == batch["label"])[real].sum())
            count += int(real.sum())
    return {"model": name, "top1": hits / max(count, 1), "samples": count}


def _figures(demo: Demo) -> None:
    demo.say("draw the ViT paper's figures for the trained model")
    result = demo.vitforge("inspect", demo.facts["run"], "--images", demo.facts["val"], "--count", "8",
                           "--out", demo.path("figures"), quiet=True)
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    print(f"wrote {len(summary['files'])} files under {demo.path('figures')}")
    demo.facts["figures"] = summary
