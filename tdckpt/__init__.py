"""tdckpt: make any TensorDict checkpoint restorable, safely and in place."""

from ._restore import load_memmap, load_memmap_
from ._version import __version__

__all__ = ["__version__", "load_memmap", "load_memmap_"]
