"""What a resumed run may not change, and what it records when it changes the rest.

A checkpoint carries its run's id (made by the run's first holder, kept in the lease: run_store.py
refuses a manifest of another run) and the whole config it was saved with. Resuming, the settings
in FIXED must equal the checkpoint's, or the run would go on as another experiment under the same
name: that is refused, naming both values. Any other setting may change (the schedule's length,
evaluation, logging, workers); each change is logged and recorded in the manifests that follow.
The loader checks its own part of the data order (seed, sample count) when it loads its state.
"""

from __future__ import annotations

from .errors import ConfigError

FIXED = (
    "model.name",
    "model.image_size",
    "model.pre_logits",
    "train.objective",
    "train.global_batch",
    "train.seed",
    "optimizer.name",
)
# Where the run lives and how this start picks its checkpoint: not settings of the experiment.
PLACE = ("checkpoint.dir", "checkpoint.run", "checkpoint.resume")
CHANGES = "changed_on_resume"  # the manifest's record: [{"step": N, "settings": {key: [saved, now]}}]


def flat(config: dict, prefix: str = "") -> dict[str, object]:
    """{"train.steps": 100, ...}: nested sections as dotted keys (a dict-valued setting stays whole
    only when it is empty)."""
    out: dict[str, object] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flat(value, f"{name}."))
        else:
            out[name] = value
    return out


def check_resume(manifest: dict, config: dict, num_classes: int | None, url: str) -> dict[str, list]:
    """Refuse (ConfigError) resuming checkpoint `url` with another value of a FIXED setting or
    another number of classes; return the other settings that differ, {key: [saved, now]}. A
    manifest without a config (from an early version) is taken as it is."""
    saved = manifest.get("config")
    if not isinstance(saved, dict):
        return {}
    before, now = flat(saved), flat(config)
    fixed = [
        f"{key}: {before[key]!r} in the checkpoint, {now.get(key)!r} now"
        for key in FIXED
        if key in before and before[key] != now.get(key)
    ]
    saved_classes = manifest.get("num_classes")
    if saved_classes is not None and num_classes is not None and saved_classes != num_classes:
        fixed.append(f"classes: {saved_classes} in the checkpoint, {num_classes} now")
    if fixed:
        raise ConfigError(
            f"{url} cannot be resumed with these settings, which a run keeps from its start: "
            f"{'; '.join(fixed)}. Set them back, or start another run (checkpoint.run, with "
            "checkpoint.init_from to fine-tune from this one)"
        )
    return {
        key: [before.get(key), now.get(key)]
        for key in sorted(set(before) | set(now))
        if before.get(key) != now.get(key) and key not in PLACE
    }
