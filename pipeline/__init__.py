"""Loaders from shards to device batches: DALI (GPU mixed or CPU decode), torch, or synthetic.

Every rank gets the same number of batches; the epoch order is a function of (seed, epoch);
the state is a position that resumes exactly, at any world size.
"""

from .cache import CacheFootprint, cache_footprint
from .index import DatasetError, DatasetIndex, load_index
from .loader import Loader, build_loader, choose_backend
from .reader import IGNORE_LABEL
from .spec import BACKENDS, IMAGENET_MEAN, IMAGENET_STD, LoaderSpec

__all__ = ["BACKENDS", "CacheFootprint", "DatasetError", "DatasetIndex", "IGNORE_LABEL", "IMAGENET_MEAN",
           "IMAGENET_STD", "Loader", "LoaderSpec", "build_loader", "cache_footprint", "choose_backend", "load_index"]
