"""vitforge: from a folder (or bucket) of images to a ViT trained across many GPU nodes."""

from vitforge.core import __version__

__all__ = ["__version__"]
