"""Checkpoints in object storage (S3, GCS, ``memory://``, ``file://``) through fsspec.

Nothing here imports fsspec at import time: :mod:`tdckpt._remote.urls` tells a URL from a
local path with the standard library alone, and the modules that talk to a store import
fsspec when first used (``pip install 'tdckpt[remote]'``). See ``docs/remote.rst``.
"""

from tdckpt._remote.urls import is_url

__all__ = ["is_url"]
