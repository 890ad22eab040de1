"""Key encodings: tensordict keys <-> file and directory names.

Two conventions exist on disk (format-notes.md §2):

* **robust** (tensordict >= 0.13 for leaves, >= 0.14 for directories): percent-encoding
  of the characters unsafe in file names, ``""`` -> ``%`` and ``.``/``..`` -> ``%2E``...
* **legacy** (tensordict <= 0.12, or ``robust_key=False``): the raw key is the name.
  A key containing ``/`` names a chain of directories.

These functions are pure and byte-for-byte equal to tensordict's
``_encode_key_for_filesystem`` / ``_decode_key_from_filesystem`` / ``_is_safe_legacy_key``.
"""

from __future__ import annotations

from enum import Enum

__all__ = [
    "KeyEncoding",
    "decode_key",
    "encode_key",
    "is_safe_legacy_key",
    "leaf_file_name",
    "legacy_components",
    "nested_shape_file_name",
]

_UNSAFE = set('/<>:"|?*\\ \0%') | {chr(i) for i in range(32)} | {chr(127)}
_ENCODE_TABLE = str.maketrans({c: f"%{ord(c):02X}" for c in _UNSAFE})

LEAF_SUFFIX = ".memmap"
NESTED_SHAPE_SUFFIX = ".shape.memmap"


class KeyEncoding(str, Enum):
    """How a directory names its files: what tdckpt records in its manifest."""

    ROBUST = "robust"
    LEGACY = "legacy"

    def __str__(self) -> str:
        return self.value


def encode_key(key: str, *, robust: bool = True) -> str:
    """Return the file-system name of ``key`` (without suffix).

    >>> encode_key("a b")
    'a%20b'
    >>> encode_key("")
    '%'
    >>> encode_key("..")
    '%2E%2E'
    >>> encode_key("a/b", robust=False)
    'a/b'
    """
    if not robust or key.isidentifier():
        # Letters, digits and "_" only (the usual key): nothing to encode.
        return key
    if not key:
        return "%"
    if key in (".", ".."):
        return "%2E" * len(key)
    return key.translate(_ENCODE_TABLE)


def decode_key(name: str) -> str:
    """Invert :func:`encode_key` (robust); malformed ``%`` sequences stay literal.

    >>> decode_key("a%20b")
    'a b'
    >>> decode_key("%")
    ''
    >>> decode_key("%zz")
    '%zz'
    """
    if name == "%":
        return ""
    out: list[str] = []
    i = 0
    n = len(name)
    while i < n:
        # Exactly tensordict's rule: "%" plus the next two characters, when at least one
        # more character follows the "%", parsed by int(..., 16) (which also accepts
        # " 1" and "+1"); anything int() or chr() rejects stays literal.
        if name[i] == "%" and i + 2 < n:
            try:
                out.append(chr(int(name[i + 1 : i + 3], 16)))
            except ValueError:
                out.append(name[i])
                i += 1
            else:
                i += 3
        else:
            out.append(name[i])
            i += 1
    return "".join(out)


def is_safe_legacy_key(key: str, *, is_collection: bool = False) -> bool:
    """Whether a raw legacy name for ``key`` stays beneath its directory.

    >>> is_safe_legacy_key("a b")
    True
    >>> is_safe_legacy_key("a/b")
    False
    >>> is_safe_legacy_key("C:payload")
    False
    >>> is_safe_legacy_key("..", is_collection=True)
    False
    """
    if "/" in key or "\\" in key:
        return False
    if len(key) >= 2 and key[0].isalpha() and key[1] == ":":
        return False
    return not is_collection or key not in ("", ".", "..")


def legacy_components(key: str) -> list[str] | None:
    """Split a legacy raw name into path components, or None if it would escape.

    Legacy writers joined the raw key onto the prefix, so ``"a/b"`` is the directory
    ``a`` then ``b``. A key with an empty, ``.`` or ``..`` component, or an absolute
    one, points at the prefix itself or outside it: such keys are never followed.

    >>> legacy_components("a/b")
    ['a', 'b']
    >>> legacy_components("../x") is None
    True
    """
    parts = key.split("/")
    if any(part in ("", ".", "..") for part in parts):
        return None
    return parts


def leaf_file_name(key: str, *, robust: bool = True) -> str:
    """The data file name of a dense leaf."""
    return encode_key(key, robust=robust) + LEAF_SUFFIX


def nested_shape_file_name(key: str, *, robust: bool = True) -> str:
    """The size-table file name of a strided nested-tensor leaf."""
    return encode_key(key, robust=robust) + NESTED_SHAPE_SUFFIX
