"""TorchRL's ``torchrl.checkpoint`` with tdckpt's durability: checksums, fsync, verified loads.

:class:`TdckptAdapter` is a TorchRL ``CheckpointAdapter``. Register it for a component
(``Checkpoint.register(name, obj, adapter=TdckptAdapter())``) or for every module,
optimizer, scheduler, TensorDict and RNG state of a checkpoint (:func:`use_tdckpt`), and
TorchRL's ``Checkpoint.save`` / ``load`` keep their API while each component is written
by tdckpt's training-state encoder (tensors as raw leaves with a checksum each, the rest as
JSON data, a pickle only for a value that is not data) and every file is fsynced. Its
payload is one tdckpt checkpoint, ``components/<NNNN-name>/tdckpt/``, which ``tdckpt
inspect`` / ``verify`` / ``diff`` and plain ``TensorDict.load_memmap`` read.

Loading re-reads every file of the component against the checksums its manifest recorded,
validates the payload, and checks it against the live object (state-dict keys, shapes,
dtypes, optimizer parameter groups) before anything is changed: a flipped byte, a
truncated file or a mismatched shape raises a tdckpt error naming the component and the
file, the live object unchanged. Pickled values load only with ``allow_pickle=True`` (or
``tensor_load_kwargs={"weights_only": False}``).

:class:`TdckptStorageCheckpointer` does the same for a replay buffer's tensordict storage:
``ReplayBuffer(storage=LazyMemmapStorage(n), checkpointer=TdckptStorageCheckpointer())``.

Needs ``torchrl`` (0.14.1 or later) and tensordict: ``pip install 'tdckpt[torchrl]'``.
Importing :mod:`tdckpt` never imports TorchRL; this module does.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Collection, Mapping, MutableMapping
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import torch
from torchrl.checkpoint import (
    Checkpoint,
    CheckpointAdapter,
    CheckpointLoadResult,
    GlobalRNGState,
    StateDictCheckpointAdapter,
)

from tdckpt._interop.torchrl_payload import payload_manifest, verify_payload
from tdckpt._interop.torchrl_storage import STORAGE_METADATA, TdckptStorageCheckpointer
from tdckpt._manage.steps import StepIndex
from tdckpt._restore.engine import load_local
from tdckpt._state.encode import to_tensordict
from tdckpt._state.restore import compare_structure, restore_state
from tdckpt._write.atomic import fsync_dir
from tdckpt._write.journal import fsync_file
from tdckpt._write.save import write_checkpoint
from tdckpt.errors import (
    MetadataError,
    PickleNotAllowedError,
    RestoreError,
)

__all__ = [
    "ADAPTER_ID",
    "ENTRY",
    "PAYLOAD",
    "STORAGE_METADATA",
    "CheckedStateDictAdapter",
    "JSONComponent",
    "TdckptAdapter",
    "TdckptStorageCheckpointer",
    "restore_checkpoint",
    "save",
    "training_state",
    "use_tdckpt",
]

#: The ``adapter`` TorchRL's manifest records for a component written by :class:`TdckptAdapter`.
ADAPTER_ID = "tdckpt.state"
#: The folder, inside a component's folder, that holds its tdckpt checkpoint.
PAYLOAD = "tdckpt"
#: The name of the one training-state entry of that checkpoint.
ENTRY = "component"
#: ``tensor_load_kwargs`` the adapter understands (TorchRL's names for the pickle policy).
_LOAD_KWARGS = frozenset({"weights_only", "mmap"})


def component_name(path: Path) -> str:
    """The component a TorchRL component folder (``components/0003-policy``) belongs to."""
    index, sep, quoted = path.name.partition("-")
    return unquote(quoted) if sep and index.isdigit() else path.name


def _where(path: Path, payload: str | None = PAYLOAD) -> str:
    """The component and its folder inside the checkpoint (``components/0002-policy/...``):
    what the user's checkpoint holds, never the temporary folder TorchRL unpacks an archive
    into."""
    inside = f"{path.parent.name}/{path.name}" + (f"/{payload}" if payload else "")
    return f"component {component_name(path)!r} ({inside})"


class TdckptAdapter(CheckpointAdapter):  # type: ignore[misc,unused-ignore]
    """A TorchRL checkpoint component written and read by tdckpt.

    Works for what has ``state_dict()`` / ``load_state_dict()`` (a policy or any
    ``nn.Module``, an optimizer, an LR scheduler, ``GlobalRNGState``, ...) and for
    TensorDicts (restored in place).

    Args:
        allow_pickle: whether :meth:`load` loads values stored as pickles (a state_dict
            value that is not JSON data, tensors or arrays); ``tensor_load_kwargs=
            {"weights_only": ...}`` of ``Checkpoint.load`` decides instead when given.
        fsync: make every file and folder of the component durable as it is written.
        verify: before loading, re-read every file of the component and compare it with
            the checksums its manifest recorded. False skips that read (the payload is
            still validated and checked against the live object).

    Example::

        from torchrl.checkpoint import Checkpoint
        from tdckpt.torchrl import TdckptAdapter

        ckpt = Checkpoint().register("policy", policy, adapter=TdckptAdapter())
        ckpt.save("runs/ckpt")
        ckpt.load("runs/ckpt")  # verified, then restored in place
    """

    adapter_id = ADAPTER_ID
    format_version = 1

    def __init__(
        self, *, allow_pickle: bool = False, fsync: bool = True, verify: bool = True
    ) -> None:
        self.allow_pickle = allow_pickle
        self.fsync = fsync
        self.verify = verify

    def save(
        self,
        component: Any,
        path: Path,
        *,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
    ) -> None:
        """Write ``component`` as one tdckpt checkpoint at ``path/tdckpt`` (fsynced)."""
        path = Path(path)
        if args or kwargs:
            raise TypeError(
                f"TdckptAdapter: {_where(path)}: state_dict() arguments are not supported "
                f"(got args={args!r}, kwargs={dict(kwargs)!r}); nothing was written. Drop the "
                "CheckpointOptions save_args/save_kwargs, or use TorchRL's "
                "StateDictCheckpointAdapter for this component."
            )
        td, record = to_tensordict({ENTRY: component})
        path.mkdir(parents=True, exist_ok=True)
        # TorchRL writes every component into its private stage folder and renames the
        # stage into place; the payload is complete (and synced) before that rename.
        write_checkpoint(td, path / PAYLOAD, state=record, fsync=self.fsync)

    def load(
        self,
        component: Any,
        path: Path,
        *,
        map_location: Any,
        tensor_load_kwargs: Mapping[str, Any],
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
    ) -> None:
        """Verify the component's files, then restore ``component`` in place (all or nothing).

        Raises:
            tdckpt.errors.IntegrityError: a file differs from what was saved (each named).
            tdckpt.errors.RestoreError: the payload does not fit ``component`` (every
                mismatch listed), or it is damaged.
            tdckpt.errors.PickleNotAllowedError: the payload holds a pickle and pickles
                are not allowed.
        """
        path = Path(path)
        if args or kwargs:
            raise TypeError(
                f"TdckptAdapter: {_where(path)}: load_state_dict() arguments are not "
                f"supported (got args={args!r}, kwargs={dict(kwargs)!r}); nothing was loaded."
            )
        unknown = sorted(set(tensor_load_kwargs) - _LOAD_KWARGS)
        if unknown:
            raise TypeError(
                f"TdckptAdapter: tensor_load_kwargs {unknown} are torch.load options; tdckpt "
                f"takes only {sorted(_LOAD_KWARGS)}. Nothing was loaded."
            )
        if map_location is not None and not isinstance(map_location, (str, torch.device)):
            raise TypeError(
                "TdckptAdapter: map_location must be None, a device or a device name, not "
                f"{type(map_location).__name__}; tdckpt does not call code to place tensors."
            )
        allow = self.allow_pickle
        if "weights_only" in tensor_load_kwargs:
            allow = not tensor_load_kwargs["weights_only"]
        payload = path / PAYLOAD
        manifest = payload_manifest(payload, _where(path))
        if self.verify:
            verify_payload(payload, manifest, _where(path))
        loaded = load_local(
            payload, robust_key=True, allow_pickle=allow, mode="r", manifest_checked=True
        )
        restore_state(
            {ENTRY: component},
            loaded,
            manifest.state,
            where=_where(path),
            device=map_location,
        )


class CheckedStateDictAdapter(StateDictCheckpointAdapter):  # type: ignore[misc,unused-ignore]
    """TorchRL's own state-dict adapter, its loads checked by tdckpt first.

    Same adapter id and files as TorchRL's default ``StateDictCheckpointAdapter``: it reads
    what plain TorchRL wrote and writes what plain TorchRL reads. Before a component
    changes, the payload is validated by tdckpt's reader (a missing, truncated or malformed
    file of ``state/`` or ``state.tdz`` is refused, naming the file), decoded, and compared
    with the live object's ``state_dict()`` (keys, shapes, dtypes): a mismatch raises
    :class:`~tdckpt.errors.RestoreError` listing every difference, where torch's
    ``load_state_dict`` would have copied the parameters that did fit. A ``torch.save``
    payload (``state.pt``, a pickle) loads only with ``allow_pickle=True``; a consolidated
    payload (``state.tdc``) is TorchRL's to read. TorchRL keeps no checksums, so a flipped
    byte inside a tensor cannot be found: write with :class:`TdckptAdapter` for that.

    Example::

        ckpt = Checkpoint(policy=policy, optim=optim)
        ckpt.register_adapter(object, CheckedStateDictAdapter())  # or per type / component
        ckpt.load("runs/plain-torchrl-ckpt")
    """

    def __init__(
        self,
        payload_format: Any = "directory",
        *,
        archive_compression: str | int | None = None,
        allow_pickle: bool = False,
    ) -> None:
        super().__init__(payload_format, archive_compression=archive_compression)
        self.allow_pickle = allow_pickle

    def load(
        self,
        component: Any,
        path: Path,
        *,
        map_location: Any,
        tensor_load_kwargs: Mapping[str, Any],
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
    ) -> Any:
        """Validate, decode and check the payload, then ``component.load_state_dict``."""
        from torchrl.checkpoint._checkpoint import _decode_state_dict_value

        from tdckpt._restore.engine import load_memmap

        path = Path(path)
        where = _where(path, None)
        options = {"map_location": map_location, "tensor_load_kwargs": tensor_load_kwargs}
        if (path / self.state_torch).exists():
            if not self.allow_pickle:
                raise PickleNotAllowedError(
                    f"{where}: {self.state_torch} is a torch.save payload (a pickle); nothing "
                    "was loaded. Pass CheckedStateDictAdapter(allow_pickle=True) to load it "
                    "if you trust where it came from.",
                    path=str(path / self.state_torch),
                )
            return super().load(component, path, args=args, kwargs=kwargs, **options)
        payload = next(
            (p for p in (path / self.state_directory, path / self.state_archive) if p.exists()),
            None,
        )
        if payload is None:  # a consolidated payload, or none: TorchRL says which
            return super().load(component, path, args=args, kwargs=kwargs, **options)
        tensors = load_memmap(payload, allow_pickle=False, mode="r")
        try:
            schema = json.loads((path / self.schema_filename).read_bytes())
            state = _decode_state_dict_value(schema, tensors, map_location)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise MetadataError(
                f"{where}: {self.schema_filename} is missing or does not match the payload "
                f"({type(exc).__name__}: {exc}); nothing was loaded.",
                path=str(path / self.schema_filename),
            ) from exc
        problems: list[str] = []
        compare_structure(component.state_dict(), state, "", problems)
        if problems:
            raise RestoreError(
                f"{where}: the saved state does not fit the live object; nothing was loaded:\n  "
                + "\n  ".join(problems),
                path=str(path),
                problems=problems,
            )
        component.load_state_dict(state, *args, **kwargs)
        return None


def use_tdckpt(checkpoint: Checkpoint, adapter: TdckptAdapter | None = None) -> Checkpoint:
    """Make ``checkpoint`` write its modules, optimizers, schedulers, TensorDicts and RNG state
    through tdckpt (``Checkpoint.register_adapter`` for each of those types); returns it.

    Components registered with an adapter of their own keep it; JSON values, replay buffers
    (``dump``/``load``) and other objects keep TorchRL's adapters.

    Example::

        ckpt = use_tdckpt(Checkpoint(policy=policy, optim=optim, rng=GlobalRNGState()))
    """
    from tensordict import TensorDictBase

    adapter = adapter if adapter is not None else TdckptAdapter()
    for cls in (
        torch.nn.Module,
        torch.optim.Optimizer,
        torch.optim.lr_scheduler.LRScheduler,
        TensorDictBase,
        GlobalRNGState,
    ):
        checkpoint.register_adapter(cls, adapter)
    return checkpoint


def save(checkpoint: Checkpoint, path: str | os.PathLike[str], **kwargs: Any) -> Path:
    """``checkpoint.save(path, **kwargs)``, then make the whole checkpoint durable.

    TorchRL writes its ``manifest.json``, the files of its own adapters (JSON values, a
    replay buffer's ``dump``) and renames the checkpoint into place without syncing any of
    it. This fsyncs every file and folder of the checkpoint (a component :class:`TdckptAdapter`
    wrote is already synced: its fsync costs a system call) and the folder it was renamed
    into, so that once this returns the checkpoint survives a power loss.

    Returns:
        The checkpoint's path, as ``Checkpoint.save`` returns it.
    """
    dest = Path(checkpoint.save(path, **kwargs))
    if dest.is_dir():
        for dirpath, _, filenames in os.walk(dest, topdown=False):
            for name in filenames:
                fsync_file(os.path.join(dirpath, name))
            fsync_dir(dirpath)
    else:
        fsync_file(os.fspath(dest))
    fsync_dir(dest.parent)
    return dest


class JSONComponent:
    """A JSON value of a TorchRL ``Checkpoint`` (a config dict, a list, a number) as a
    state-dict object, so :class:`tdckpt.CheckpointManager` saves and restores it.

    A dict or list is restored in place (as TorchRL's ``JSONCheckpointAdapter`` does);
    another value replaces :attr:`value`.
    """

    def __init__(self, value: Any) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        value = state["value"]
        if isinstance(self.value, MutableMapping) and isinstance(value, Mapping):
            self.value.clear()
            self.value.update(value)
        elif isinstance(self.value, list) and isinstance(value, list):
            self.value[:] = value
        else:
            self.value = value


def training_state(
    checkpoint: Checkpoint, components: Collection[str] | None = None
) -> dict[str, Any]:
    """A TorchRL ``Checkpoint``'s components as a training state for the manager.

    ``mgr.save(step, training_state(ckpt))`` / ``mgr.restore_into(training_state(ckpt),
    step)``: steps, retention, verify, object storage, ranks and ``save_async`` for the
    objects TorchRL users already register. Live objects are passed as they are (a replay
    buffer through its ``state_dict``); JSON values are wrapped in :class:`JSONComponent`.
    """
    live = checkpoint.components
    names = list(live) if components is None else list(components)
    unknown = sorted(set(names) - set(live))
    if unknown:
        raise KeyError(f"not components of this Checkpoint: {unknown} (it has {sorted(live)})")
    out: dict[str, Any] = {}
    for name in names:
        value = live[name]
        has_state = callable(getattr(value, "state_dict", None)) and callable(
            getattr(value, "load_state_dict", None)
        )
        out[name] = value if has_state or _is_tensordict(value) else JSONComponent(value)
    return out


def restore_checkpoint(
    manager: Any,
    checkpoint: Checkpoint,
    step: int | None = None,
    *,
    components: Collection[str] | None = None,
    verify: bool = True,
    allow_pickle: bool | None = False,
) -> CheckpointLoadResult:
    """Restore ``checkpoint``'s components from a step of ``manager``, all or nothing.

    Every selected component is checked against the step before the first one changes
    (tdckpt's training-state restore); the step may hold more entries than selected.

    Returns:
        TorchRL's ``CheckpointLoadResult``: ``loaded`` (every selected component),
        ``unrequested`` (entries of the step not selected), ``values`` (the JSON values).

    Raises:
        tdckpt.errors.RestoreError: a selected component is not in the step, or does not
            fit it (every mismatch listed); nothing was changed.
        tdckpt.errors.IntegrityError: ``verify`` and a file differs from what was saved.
    """
    state = training_state(checkpoint, components)
    resolved = manager.latest_step() if step is None else step
    manager.restore_into(state, resolved, verify=verify, strict=False, allow_pickle=allow_pickle)
    result = CheckpointLoadResult(loaded=set(state))
    result.unrequested = _step_entries(manager, resolved) - set(state)
    result.values = {n: v.value for n, v in state.items() if isinstance(v, JSONComponent)}
    return result


def _step_entries(manager: Any, step: int) -> set[str]:
    """The entry names a local step's manifest records (empty when it cannot be read)."""
    try:
        where = Path(manager.path(step))
        kind = "archive" if where.is_file() else "dir"
        manifest = StepIndex(where.parent, threading.RLock()).manifest(where, kind)
    except (OSError, TypeError, ValueError):  # remote, archived or unreadable: unknown
        return set()
    return set(manifest.state.entries) if manifest.state is not None else set()


def _is_tensordict(value: Any) -> bool:
    from tensordict import is_tensor_collection

    return bool(is_tensor_collection(value))
