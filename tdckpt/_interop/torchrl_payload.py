"""The tdckpt checkpoint inside a TorchRL component or replay-buffer dump: its manifest, verified.

:mod:`tdckpt.torchrl`'s adapter (a component's ``tdckpt/`` payload) and its storage
checkpointer (a replay buffer's ``storage/`` dump) both write one tdckpt checkpoint; before
loading either, they read its manifest here and re-read every file against its checksums.
TorchRL not needed.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from tdckpt._manage.steps import StepIndex
from tdckpt._manage.verify import verify_files
from tdckpt.errors import CheckpointNotFoundError, IntegrityError
from tdckpt.schema import Manifest

__all__ = ["payload_manifest", "verify_payload"]


def payload_manifest(payload: Path, where: str) -> Manifest:
    """The manifest of the tdckpt checkpoint ``payload`` (``where`` names it in errors)."""
    if not payload.is_dir():
        raise CheckpointNotFoundError(
            f"{where}: no tdckpt payload at {payload}; the component was not written by "
            "tdckpt's TdckptAdapter, or the checkpoint is damaged. Nothing was loaded.",
            path=str(payload),
        )
    return StepIndex(payload.parent, threading.RLock()).manifest(payload, "dir")


def verify_payload(payload: Path, manifest: Manifest, where: str) -> None:
    """Raise IntegrityError unless every file of ``payload`` matches its manifest's checksums."""
    report = verify_files(manifest.step or 0, payload, manifest, archive=False)
    if not report.ok:
        problems = [str(p) for p in report.problems]
        listed = "\n  ".join(problems[:20])
        raise IntegrityError(
            f"{where}: {len(problems)} file(s) differ from what was saved; nothing was "
            f"loaded:\n  {listed}\nResume from another checkpoint.",
            path=os.fspath(payload),
            problems=problems,
        )
