"""The launchers (cluster/launcher.py): the registry, and the SLURM launcher's job ids and scripts."""

from __future__ import annotations

import pytest

from vitforge.cluster import LAUNCHERS, SlurmLauncher, get_launcher, load_spec, render
from vitforge.cluster.render import render_merge, render_shard_array
from vitforge.core import UsageError


def test_launcher_registry_and_the_slurm_launcher():
    assert sorted(LAUNCHERS) == ["slurm"] and isinstance(get_launcher(), SlurmLauncher)
    with pytest.raises(UsageError, match="unknown launcher 'k8s'; known: slurm"):
        get_launcher("k8s")
    slurm = get_launcher("slurm")
    assert slurm.parse_job("1234_7") == "1234_7" and slurm.parse_job("1234+1") == "1234+1"
    with pytest.raises(ValueError, match=r"'12a' is not a SLURM job id \(e.g. 1234 or 1234_7\)"):
        slurm.parse_job("12a")
    train = load_spec("tiny_cpu", [])
    assert [tuple(s) for s in slurm.scripts(train)] == \
        [(f"{train.name}.sbatch", render(train), "job", f"{train.name}-{{job}}.out")]
    shard = load_spec("imagenet21k_shard", [])
    array, merge = slurm.scripts(shard, [1, 3])
    assert (array.text, array.kind, merge.text, merge.kind) == \
        (render_shard_array(shard, [1, 3]), "job array", render_merge(shard), "merge job")
