"""A pytest plugin that routes tensordict's loads through tdckpt.

Load it into a run of *tensordict's own* test suite (``-p tdckpt_peer`` with this folder on
``PYTHONPATH``; ``run_peer.py`` does that) to check that tdckpt is a drop-in for tensordict's
loaders. Two entry points of ``TensorDictBase`` are routed:

``load_memmap_``
    :func:`tdckpt.load_memmap_`: every caller of the method - ``td.load_memmap_(...)``, the
    deprecated ``td.load_(...)`` and ``td.memmap_refresh_()``, which call it - runs tdckpt's
    restore instead. Takes tensordict's signature (``prefix, robust_key=True, *,
    allow_pickle, mode``) and returns ``self``.
``load_memmap``
    The classmethod, hence ``TensorDict.load`` (which calls it) and every tensorclass's
    ``load_memmap``/``load`` (tensorclasses copy the classmethod when they are defined, after
    the plugin is installed): :func:`tdckpt.load_memmap`, or :func:`tdckpt.load_memmap_`
    into ``out=`` when one is given. ``device`` and ``mode`` are passed on; ``non_blocking``
    and ``num_threads`` are performance hints tdckpt does not need. A ``subpath=`` load -
    one sub-tree of a checkpoint, which tdckpt has no entry point for - goes to tensordict's
    own method (the one case not routed). A nested call tensordict makes while loading (a
    lazy view's source, a tensorclass's ``_tensordict``) passes an internal archive path and
    is left to tensordict too: tdckpt reads the whole tree in one call.

tdckpt's errors stay tdckpt's errors: the point of the run is to see where tdckpt refuses what
tensordict loads.

``TDCKPT_PEER_ROUTE`` (comma-separated) chooses the entry points; the default is all of
:data:`ROUTES`. The run's header names what was routed.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

__all__ = ["ROUTES", "install", "routed_entry_points", "uninstall"]

#: The attributes of ``TensorDictBase`` the plugin can replace.
ROUTES = ("load_memmap_", "load_memmap")

_ORIGINALS: dict[str, Any] = {}
#: Marks an entry point ``TensorDictBase`` inherits: uninstall deletes the override.
_INHERITED = object()


def _routed_load_memmap_(original: Callable[..., Any]) -> Callable[..., Any]:
    import tdckpt

    @functools.wraps(original)
    def load_memmap_(
        self: Any,
        prefix: str | os.PathLike[str],
        robust_key: bool | None = True,
        *,
        allow_pickle: bool | None = None,
        mode: str | None = None,
    ) -> Any:
        return tdckpt.load_memmap_(self, prefix, robust_key, allow_pickle=allow_pickle, mode=mode)

    load_memmap_.__tdckpt_routed__ = True  # type: ignore[attr-defined]
    return load_memmap_


def _routed_load_memmap(original: Callable[..., Any]) -> Callable[..., Any]:
    """The classmethod ``TensorDictBase.load_memmap``, routed (``original`` is bound)."""
    import tdckpt

    func = original.__func__  # type: ignore[attr-defined]

    @functools.wraps(func)
    def load_memmap(
        cls: type,
        prefix: str | os.PathLike[str],
        device: Any = None,
        non_blocking: bool = False,
        **kwargs: Any,
    ) -> Any:
        if kwargs.get("subpath") is not None or not isinstance(prefix, (str, os.PathLike)):
            # tensordict's own, with exactly the arguments given (its defaults differ
            # between releases: 0.14 takes mode "r"/"r+" only)
            return func(cls, prefix, device, non_blocking, **kwargs)
        out = kwargs.get("out")
        robust_key = kwargs.get("robust_key", True)
        allow_pickle = kwargs.get("allow_pickle")
        mode = kwargs.get("mode")
        if out is not None:
            return tdckpt.load_memmap_(
                out, prefix, robust_key, allow_pickle=allow_pickle, mode=mode
            )
        return tdckpt.load_memmap(
            prefix, robust_key=robust_key, allow_pickle=allow_pickle, mode=mode, device=device
        )

    load_memmap.__tdckpt_routed__ = True  # type: ignore[attr-defined]
    return classmethod(load_memmap)  # type: ignore[return-value]


_ROUTERS: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
    "load_memmap_": _routed_load_memmap_,
    "load_memmap": _routed_load_memmap,
}


def routed_entry_points(env: dict[str, str] | None = None) -> tuple[str, ...]:
    """The entry points ``TDCKPT_PEER_ROUTE`` asks for (default: all of :data:`ROUTES`)."""
    raw = (os.environ if env is None else env).get("TDCKPT_PEER_ROUTE", "")
    names = tuple(n.strip() for n in raw.split(",") if n.strip()) or ROUTES
    unknown = sorted(set(names) - set(ROUTES))
    if unknown:
        raise pytest.UsageError(
            f"TDCKPT_PEER_ROUTE names {unknown}, which tdckpt_peer cannot route; "
            f"known entry points: {list(ROUTES)}."
        )
    return names


def install(names: tuple[str, ...] = ROUTES) -> None:
    """Replace the entry points on ``TensorDictBase`` (idempotent)."""
    from tensordict import TensorDictBase

    for name in names:
        if name in _ORIGINALS:
            continue
        # defined on a base class (tensordict 0.15: _Serialization): uninstall deletes ours
        _ORIGINALS[name] = TensorDictBase.__dict__.get(name, _INHERITED)
        setattr(TensorDictBase, name, _ROUTERS[name](getattr(TensorDictBase, name)))


def uninstall() -> None:
    """Put tensordict's own methods back."""
    from tensordict import TensorDictBase

    for name, original in _ORIGINALS.items():
        if original is _INHERITED:
            delattr(TensorDictBase, name)
        else:
            setattr(TensorDictBase, name, original)
    _ORIGINALS.clear()


def pytest_configure(config: pytest.Config) -> None:
    install(routed_entry_points())


def pytest_unconfigure(config: pytest.Config) -> None:
    uninstall()


def pytest_report_header(config: pytest.Config) -> str:
    import tdckpt

    where = Path(tdckpt.__file__).resolve().parent
    return f"tdckpt_peer: TensorDictBase.{', '.join(_ORIGINALS)} routed through tdckpt ({where})"
