"""What every level's validation reports alike: schema errors of a ``meta.json`` (one
problem per error, naming the entry and field) and a level's device (one torch parses).

Problems are reported through the run's context (``validate.Ctx``), never raised.
"""

from __future__ import annotations

import functools
import reprlib
from typing import Any

import pydantic
import torch

from tdckpt._read.storage import join
from tdckpt._read.tree import VDir
from tdckpt._read.validate_leaf import LeafCtx

__all__ = ["check_device", "schema_problems"]


def schema_problems(
    ctx: LeafCtx,
    exc: pydantic.ValidationError,
    path: str,
    key: tuple[str, ...],
    raw: dict[str, Any] | None = None,
) -> None:
    """Report each error of ``exc`` (the pydantic model of ``path``'s meta.json, ``raw``
    its document) as a problem naming the entry and field, never the whole input."""
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        sub = key
        if loc[:1] == ["entries"] and len(loc) >= 2:
            entry = raw.get(loc[1]) if raw is not None else None
            if isinstance(entry, dict) and len(loc) >= 3:
                # An entry is a leaf or a child (the union): report only the errors of the
                # branch it is meant to be, not "field 'type' required" for a broken leaf.
                meant = "ChildEntry" if "type" in entry and "dtype" not in entry else "LeafEntry"
                if loc[2] in ("LeafEntry", "ChildEntry") and loc[2] != meant:
                    continue
            sub = (*key, loc[1])
            where = f"entry {loc[1]!r}" + (f" field {'.'.join(loc[3:])!r}" if len(loc) > 3 else "")
        else:
            where = f"field {'.'.join(loc)!r}" if loc else "the document"
        ctx.add(
            "schema",
            join(path, "meta.json"),
            sub,
            f"{where}: {err['msg']} (found {_short_repr(err.get('input')):.80}). "
            "The metadata does not fit the tensordict format; the file is damaged or was edited.",
        )


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxdict, _REPR.maxlist, _REPR.maxtuple = 3, 8, 16, 16
_REPR.maxstring = _REPR.maxother = 80


def _short_repr(value: Any) -> str:
    """A repr of at most a few hundred characters, whatever the size of ``value``.

    ``f"{value!r:.80}"`` builds the whole repr first: of a 60 MB document, for one message.
    """
    return _REPR.repr(value)


def check_device(ctx: LeafCtx, vdir: VDir, key: tuple[str, ...], device: str | None) -> bool:
    """A level's device must be one torch knows (leaf devices are ignored by every loader)."""
    if device is None or _is_torch_device(device):
        return True
    ctx.add(
        "bad-device",
        join(vdir.source, "meta.json"),
        key,
        f"device {device!r} is not a torch device (expected e.g. 'cpu' or 'cuda:0'). The "
        "metadata is damaged or was edited.",
    )
    return False


def _is_torch_device(text: str) -> bool:
    """Whether torch parses ``text`` as a device (short strings cached: a checkpoint repeats
    a few; a hostile megabyte-long one is not kept alive by the cache)."""
    return _parses_as_device_cached(text) if len(text) <= 64 else _parses_as_device(text)


def _parses_as_device(text: str) -> bool:
    try:
        torch.device(text)
    except (RuntimeError, ValueError):
        return False
    return True


_parses_as_device_cached = functools.lru_cache(maxsize=64)(_parses_as_device)
