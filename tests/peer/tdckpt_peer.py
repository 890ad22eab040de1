"""A pytest plugin that routes tensordict's in-place load through tdckpt.

Load it into a run of *tensordict's own* test suite (``-p tdckpt_peer`` with this folder on
``PYTHONPATH``; ``run_peer.py`` does that) to check that :func:`tdckpt.load_memmap_` is a
drop-in for ``TensorDictBase.load_memmap_``: every caller of the method -
``td.load_memmap_(...)``, the deprecated ``td.load_(...)`` and ``td.memmap_refresh_()``, which
call it - then runs tdckpt's restore instead.

The routed method takes tensordict's signature (``prefix, robust_key=True, *, allow_pickle,
mode``) and returns ``self``. tdckpt's errors stay tdckpt's errors: the point of the run is to
see where tdckpt refuses what tensordict loads.

``TDCKPT_PEER_ROUTE`` (comma-separated) chooses the entry points; the default, and the
only one today, is ``load_memmap_``. The run's header names what was routed.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

__all__ = ["ROUTES", "install", "routed_entry_points", "uninstall"]

#: Entry point name -> the attribute of ``TensorDictBase`` it replaces.
ROUTES = ("load_memmap_",)

_ORIGINALS: dict[str, Callable[..., Any]] = {}


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
        original = getattr(TensorDictBase, name)
        _ORIGINALS[name] = original
        setattr(TensorDictBase, name, _routed_load_memmap_(original))


def uninstall() -> None:
    """Put tensordict's own methods back."""
    from tensordict import TensorDictBase

    for name, original in _ORIGINALS.items():
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
