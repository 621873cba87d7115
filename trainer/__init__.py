"""DeepSpeed ZeRO trainer for ViT-B/16, L/16 and H/14 (timm), with the ViT paper's recipes."""

from .config import Config, ConfigError, load_config
from .model import PAPER_PARAMETERS, adapt_state_dict, build_model, forward_flops, parameter_count

__all__ = ["Config", "ConfigError", "PAPER_PARAMETERS", "adapt_state_dict", "build_model", "forward_flops",
           "load_config", "parameter_count"]
