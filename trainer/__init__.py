"""DeepSpeed ZeRO trainer for ViT-B/16, L/16 and H/14 (timm), with the ViT paper's recipes, and
checkpoints in object storage that survive preemption."""

from .config import Config, ConfigError, load_config
from .distributed import PeerWatch, check_socket_interfaces
from .model import (PAPER_PARAMETERS, PEAK_FLOPS, TINY_MODELS, adapt_state_dict, build_model, check_model_name,
                    forward_flops, parameter_count)
from .run_store import RunStore, tag_for
from .train import PeerLost, Requeue, Trainer, run, run_eval

__all__ = ["Config", "ConfigError", "PAPER_PARAMETERS", "PEAK_FLOPS", "PeerLost", "PeerWatch", "Requeue", "RunStore",
           "TINY_MODELS", "Trainer", "adapt_state_dict", "build_model", "check_model_name", "check_socket_interfaces",
           "forward_flops", "load_config", "parameter_count", "run", "run_eval", "tag_for"]
