"""Loaders from shards to device batches: DALI (GPU mixed or CPU decode), torch, or synthetic.

Every rank gets the same number of batches; the epoch order is a function of (seed, epoch);
the state is a position that resumes exactly, at any world size.
"""

from vitforge.core.lazy import lazy_exports

from .backend import Backend, Batch, backend_names, find_backend, make_batch, register_backend
from .spec import IMAGENET_MEAN, IMAGENET_STD, LoaderSettings, LoaderSpec, MixtureSource

# The loader's modules import torch (seconds): loaded on first use, so that a config (which embeds
# LoaderSettings) is validated without them.
HEAVY = {
    "cache": ("CacheFootprint", "cache_footprint"),
    "cache_shares": ("CacheDemand", "node_cache_shares"),
    "index": ("DatasetError", "DatasetIndex", "load_index"),
    "loader": ("Loader", "build_loader", "choose_backend"),
    "reader": ("IGNORE_LABEL",),
    "mixture": ("MixtureLoader", "batch_counts"),
    "mixture_build": ("build_mixture_loader",),
}

__all__ = [
    "IGNORE_LABEL",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "Backend",
    "Batch",
    "CacheDemand",
    "CacheFootprint",
    "DatasetError",
    "DatasetIndex",
    "Loader",
    "LoaderSettings",
    "LoaderSpec",
    "MixtureLoader",
    "MixtureSource",
    "backend_names",
    "batch_counts",
    "build_loader",
    "build_mixture_loader",
    "cache_footprint",
    "choose_backend",
    "find_backend",
    "load_index",
    "make_batch",
    "node_cache_shares",
    "register_backend",
]


__getattr__ = lazy_exports(__name__, globals(), HEAVY)
