"""DeepSpeed ZeRO trainer for ViT-B/16, L/16 and H/14 (timm), with the ViT paper's recipes, and
checkpoints in object storage that survive preemption."""

from vitforge.core.lazy import lazy_exports

from .config import Config, ConfigError, load_config
from .run_store import RunStore, tag_for

# torch, timm and DeepSpeed take seconds to import: the modules that import them load on first use,
# so `vitforge train` with a bad config fails at once (its config is read before `run` is named).
HEAVY = {
    "distributed": ("check_socket_interfaces",),
    "peers": ("PeerWatch",),
    "model": ("PAPER_PARAMETERS", "PEAK_FLOPS", "adapt_state_dict", "build_model", "forward_flops", "parameter_count"),
    # torch-free (timm's registry read from its source), but only what a model check needs
    "model_names": ("TINY_MODELS", "TINY_RESNETS", "check_model_config", "check_model_name", "is_vit"),
    "objective": ("OBJECTIVES", "Objective", "get_objective", "register_objective"),
    "probe": ("L2_GRID", "ProbeError", "ProbeResult", "choose_shots", "knn_top1", "linear_probe"),
    "state": ("RandomState", "RankBound", "Stateful", "StateParts"),
    "train": ("PeerLost", "Requeue", "Trainer"),
    "entry": ("run", "run_eval"),
}

__all__ = [
    "L2_GRID",
    "OBJECTIVES",
    "PAPER_PARAMETERS",
    "PEAK_FLOPS",
    "TINY_MODELS",
    "TINY_RESNETS",
    "Config",
    "ConfigError",
    "Objective",
    "PeerLost",
    "PeerWatch",
    "ProbeError",
    "ProbeResult",
    "RandomState",
    "RankBound",
    "Requeue",
    "RunStore",
    "StateParts",
    "Stateful",
    "Trainer",
    "adapt_state_dict",
    "build_model",
    "check_model_config",
    "check_model_name",
    "check_socket_interfaces",
    "choose_shots",
    "forward_flops",
    "get_objective",
    "is_vit",
    "knn_top1",
    "linear_probe",
    "load_config",
    "parameter_count",
    "register_objective",
    "run",
    "run_eval",
    "tag_for",
]


__getattr__ = lazy_exports(__name__, globals(), HEAVY)
