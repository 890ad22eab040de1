"""A Lightning ``CheckpointIO`` that stores each checkpoint as one tdckpt checkpoint.

``Trainer(plugins=[TdckptCheckpointIO()])``: every checkpoint Lightning saves (through
``ModelCheckpoint``, ``trainer.save_checkpoint``, top-k, ``last.ckpt``) is written by tdckpt
instead of ``torch.save``: tensors as raw leaves with a checksum each, everything else as
JSON data (int vs str keys, tuples and non-finite floats kept), a pickle only for a value that
is not data (listed in the manifest, loaded only when allowed), written beside its final
name, synced and renamed into place (a crash never leaves half a checkpoint under the
name). ``ModelCheckpoint``'s ``.ckpt`` names are kept: by default each is one ``.tdz``-format
file (``archive=True``), which ``tdckpt inspect`` / ``validate`` / ``diff`` / ``export``
and plain tensordict (``TensorDict.load_memmap``) read; ``archive=False`` writes a folder
instead.

Loading checks the whole checkpoint first (every file, shape and checksum of a folder's
manifest... see :func:`tdckpt.load_memmap`) and gives back the dict Lightning saved, its
tensors memory-mapped (copy-on-write) until Lightning copies them into the model.

Needs ``lightning`` (or ``pytorch_lightning``) and tensordict: ``pip install
'tdckpt[lightning]'``. Importing :mod:`tdckpt` never imports Lightning; this module does.
"""

from __future__ import annotations

import os
import secrets
import stat
import threading
from pathlib import Path
from typing import Any

import torch

from tdckpt._manage.steps import StepIndex
from tdckpt._manage.verify import verify_files
from tdckpt._restore.engine import load_memmap
from tdckpt._state.decode import to_state_dicts
from tdckpt._state.encode import to_tensordict
from tdckpt._write.archive_write import write_archive
from tdckpt._write.atomic import remove_tree
from tdckpt._write.export import save
from tdckpt.errors import IntegrityError

try:  # Lightning 2.x ships both names; the Trainer checks its own package's base class
    from lightning.pytorch.plugins.io import CheckpointIO
except ImportError:  # pragma: no cover - the standalone pytorch_lightning package
    from pytorch_lightning.plugins.io import CheckpointIO  # type: ignore[no-redef,assignment,unused-ignore]

__all__ = ["ENTRY", "TdckptCheckpointIO"]

#: The name of the one training-state entry that holds Lightning's checkpoint dict.
ENTRY = "lightning"


class _Checkpoint:
    """Lightning's checkpoint dict as a state-dict object (tdckpt's training-state encoder)."""

    def __init__(self, checkpoint: dict[str, Any]) -> None:
        self.checkpoint = checkpoint

    def state_dict(self) -> dict[str, Any]:
        return self.checkpoint

    def load_state_dict(self, state: dict[str, Any]) -> None:  # pragma: no cover - unused
        self.checkpoint = state


class TdckptCheckpointIO(CheckpointIO):
    """Lightning checkpoints through tdckpt: checksummed, atomic, no pickle for data.

    Args:
        archive: each checkpoint is one file (the ``.tdz`` layout, under Lightning's
            ``.ckpt`` name); False: a folder of that name.
        allow_pickle: whether :meth:`load_checkpoint` loads values stored as pickles (values
            that are not data, e.g. an ``argparse.Namespace`` in the hyper-parameters) when
            Lightning does not say (``weights_only=None``). ``weights_only=True`` never loads
            a pickle, ``weights_only=False`` does.
        fsync: make each checkpoint durable before it is renamed into place.
        verify: before loading, re-read every file and compare it with the checksums the
            checkpoint's manifest recorded (a flipped byte is refused, naming the file and
            key, before Lightning sees any of it). False skips that read.

    Example::

        trainer = lightning.Trainer(
            plugins=[TdckptCheckpointIO()],
            callbacks=[ModelCheckpoint(monitor="val_loss", save_top_k=3)],
        )
    """

    def __init__(
        self,
        *,
        archive: bool = True,
        allow_pickle: bool = False,
        fsync: bool = True,
        verify: bool = True,
    ) -> None:
        super().__init__()
        self.archive = archive
        self.allow_pickle = allow_pickle
        self.fsync = fsync
        self.verify = verify

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Write ``checkpoint`` to ``path`` (replacing what is there, atomically)."""
        if storage_options is not None:
            raise TypeError(
                "TdckptCheckpointIO.save_checkpoint takes no storage_options (got "
                f"{storage_options!r}); tdckpt writes local files."
            )
        if not isinstance(checkpoint, dict):
            raise TypeError(
                "TdckptCheckpointIO.save_checkpoint takes Lightning's checkpoint dict, not "
                f"{type(checkpoint).__name__}"
            )
        dest = Path(_local(path, "save_checkpoint"))
        dest.parent.mkdir(parents=True, exist_ok=True)
        td, _ = to_tensordict({ENTRY: _Checkpoint(checkpoint)})
        metadata = {
            k: checkpoint[k]
            for k in ("epoch", "global_step")
            if isinstance(checkpoint.get(k), int) and not isinstance(checkpoint.get(k), bool)
        }
        if not self.archive:
            save(td, dest, metadata=metadata, overwrite=True, fsync=self.fsync)
            return
        staging = dest.with_name(f".{dest.name}.tdckpt-{secrets.token_hex(8)}")
        try:
            save(td, staging, metadata=metadata, fsync=self.fsync)
            write_archive(staging, dest, fsync=self.fsync)  # temp file, then os.replace
        finally:
            remove_tree(staging, ignore_errors=True)

    def load_checkpoint(
        self,
        path: Any,
        map_location: Any | None = None,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Read the checkpoint at ``path`` back as the dict Lightning saved.

        ``map_location``: None or ``"cpu"`` keeps tensors memory-mapped; a device (or its
        name) moves them there. A callable or a dict (``torch.load``'s other forms) is
        refused: tdckpt does not call code to place tensors.
        """
        if map_location is not None and not isinstance(map_location, (str, torch.device)):
            raise TypeError(
                "TdckptCheckpointIO.load_checkpoint takes map_location as None, a device or "
                f"a device name, not {type(map_location).__name__}"
            )
        allow = self.allow_pickle if weights_only is None else not weights_only
        # The path the user (or Lightning) named: a link there is theirs (save_last="link"
        # makes last.ckpt one), resolved once, so that what is verified is what is loaded.
        where = _local(path, "load_checkpoint")
        if os.path.islink(where):
            where = os.path.realpath(where)
        if self.verify:
            _verify(Path(where))
        td = load_memmap(
            where,
            allow_pickle=allow,
            mode="r",
            device=None if map_location in (None, "cpu") else map_location,
        )
        checkpoint: dict[str, Any] = to_state_dicts(td)[ENTRY]
        return checkpoint

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the checkpoint at ``path`` (a file or a folder; a link is never followed)."""
        remove_tree(os.fspath(path))


def _local(path: Any, method: str) -> str:
    """``path`` as a local path; a URL is refused (this plugin writes and reads local files,
    and would otherwise make a folder named after the scheme, ``./s3:/...``)."""
    text: str = os.fsdecode(os.fspath(path))
    if "://" in text:
        raise ValueError(
            f"TdckptCheckpointIO.{method}: {text!r} is a URL; TdckptCheckpointIO writes and "
            "reads local files. Use a local dirpath, or tdckpt.CheckpointManager for object "
            "storage (docs/remote.rst)."
        )
    return text


def _verify(path: Path) -> None:
    """Raise IntegrityError unless every file of ``path`` matches its manifest's checksums."""
    try:
        archive = stat.S_ISREG(os.stat(path, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return  # load_memmap says "not found", naming the path
    manifest = StepIndex(path.parent, threading.RLock()).manifest(
        path, "archive" if archive else "dir"
    )
    report = verify_files(manifest.step or 0, path, manifest, archive=archive)
    if not report.ok:
        problems = "\n  ".join(str(p) for p in report.problems[:20])
        raise IntegrityError(
            f"{path}: {len(report.problems)} file(s) differ from what was saved; nothing was "
            f"loaded:\n  {problems}\nResume from another checkpoint.",
            path=str(path),
            problems=[str(p) for p in report.problems],
        )
