"""A pytest plugin that makes tdckpt's adapter TorchRL's default for state-dict components.

Load it into a run of *TorchRL's own* ``test/test_checkpoint.py`` (``-p tdckpt_torchrl_peer``
with this folder on ``PYTHONPATH``; ``run_torchrl_peer.py`` does that): wherever
``torchrl.checkpoint.Checkpoint`` would infer its default ``StateDictCheckpointAdapter()``
(a TensorDict directory payload) for a component with ``state_dict`` / ``load_state_dict``,
it gets :class:`tdckpt.torchrl.TdckptAdapter` instead. Adapters passed explicitly
(``register(..., adapter=...)``, ``register_adapter``) and the dump/load and JSON adapters
are left alone. tdckpt's errors stay tdckpt's: the point of the run is to see where tdckpt
refuses what TorchRL loads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

__all__ = ["install", "uninstall"]

_ORIGINAL: list[Callable[..., Any]] = []


def install() -> None:
    """Route the inferred default state-dict adapter to TdckptAdapter (idempotent)."""
    from torchrl.checkpoint import Checkpoint, StateDictCheckpointAdapter

    from tdckpt.torchrl import TdckptAdapter

    if _ORIGINAL:
        return
    original = Checkpoint._resolve_adapter
    adapter = TdckptAdapter()

    def _resolve_adapter(self: Any, component: Any) -> Any:
        resolved = original(self, component)
        inferred = component.adapter is None and not any(
            resolved is registered for _, registered in self._adapter_registry
        )
        if inferred and type(resolved) is StateDictCheckpointAdapter:
            return adapter
        return resolved

    _ORIGINAL.append(original)
    Checkpoint._resolve_adapter = _resolve_adapter  # type: ignore[method-assign]


def uninstall() -> None:
    """Put TorchRL's own resolution back."""
    from torchrl.checkpoint import Checkpoint

    if _ORIGINAL:
        Checkpoint._resolve_adapter = _ORIGINAL.pop()  # type: ignore[method-assign]


def pytest_configure(config: pytest.Config) -> None:
    install()


def pytest_report_header(config: pytest.Config) -> str:
    return "tdckpt_torchrl_peer: TorchRL's inferred StateDictCheckpointAdapter -> TdckptAdapter"


def pytest_unconfigure(config: pytest.Config) -> None:
    uninstall()
