"""Telling an fsspec URL from a local path, without importing fsspec."""

from __future__ import annotations

import os
import re
from typing import Any

__all__ = ["is_url", "require_local_options"]

#: ``scheme://``, as fsspec's ``url_to_fs`` splits it (a chained ``simplecache::s3://`` too).
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*(::[A-Za-z][A-Za-z0-9+.\-]*)*://")


def is_url(where: object) -> bool:
    """Whether ``where`` is an fsspec URL (``s3://b/k``, ``memory://x``, ``file:///p``).

    Only a ``str`` can be a URL; a :class:`pathlib.Path` (or any other ``os.PathLike``)
    is always a local path, so ``Path("s3:/x")`` never reaches the network.

    >>> is_url("s3://bucket/run"), is_url("runs/exp1"), is_url("C:/x")
    (True, False, False)
    """
    return isinstance(where, str) and _URL.match(where) is not None


def require_local_options(where: str | os.PathLike[str], storage_options: Any) -> None:
    """Refuse ``storage_options`` for a local path: they would be silently ignored."""
    if storage_options is not None:
        raise ValueError(
            f"storage_options are for fsspec URLs (s3://..., memory://...), but {str(where)!r} "
            "is a local path. Drop storage_options, or pass a URL."
        )
