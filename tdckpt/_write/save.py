"""Write a checkpoint in tensordict 0.15.3's format ("format v1"), plus tdckpt's manifest.

:func:`write_checkpoint` writes exactly the tree ``obj.memmap(prefix)`` writes with
tensordict 0.15.3 - the same file names (robust percent-encoded keys), the same
``meta.json`` bytes (stdlib ``json``, as 0.15.3 by default), pickles only where tensordict
pickles - so plain ``TensorDict.load_memmap`` reads it. It adds ``tdckpt.manifest.json``,
which tensordict ignores. Unlike ``memmap`` it:

* never memory-maps, locks or otherwise changes the object it saves;
* checks the whole object before creating any file, and refuses, naming every offending
  key, what tensordict would lose or corrupt silently (a key named ``shape``, two keys
  sharing a file, ...) or cannot write (jagged nested tensors, names too long);
* streams each leaf from the tensor's memory in large sequential writes, and checksums
  those same bytes while they are written (one pass; files are never re-read);
* with fsync on, writes leaves of 1 MiB or more with ``O_DIRECT`` (Linux) through aligned
  staging buffers, straight to the disk, and starts the writeback of the other files as
  their bytes are written (see :class:`~tdckpt._write.writer.Writer`);
* fsyncs every file (on helper threads, while the next files are written), then the
  directories bottom-up, then writes the manifest last.

What to write, and how that mirrors tensordict, is planned by :mod:`tdckpt._write.save_plan`;
:mod:`tdckpt._write.writer` writes the planned files; this module checks the object and the
options, claims the folder, drives the writer and writes the manifest last. The checksum
algorithms, and the measurements behind the CRC-32 default, are in
:mod:`tdckpt._write.checksum`.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from tdckpt._version import __version__
from tdckpt._write import writer as _writer
from tdckpt._write.checksum import (
    CHECKSUM_ALGORITHMS,
    DEFAULT_CHECKSUM,
    new_hasher,
)
from tdckpt._write.incremental import IncrementalSave, remember_files
from tdckpt._write.save_plan import Plan, class_id, plan_checkpoint
from tdckpt._write.writer import Writer, op_bytes
from tdckpt.errors import CheckpointExistsError, MetadataError, UnsupportedContentError
from tdckpt.schema import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    MANIFEST_SCHEMA_VERSION,
    MAX_MANIFEST_BYTES,
    Manifest,
    StateRecord,
    WriterVersions,
    manifest_bytes,
)

__all__ = [
    "CHECKSUM_ALGORITHMS",
    "DEFAULT_CHECKSUM",
    "PreparedCheckpoint",
    "UnsupportedContentError",
    "check_json_data",
    "check_save_options",
    "claim_dest",
    "class_id",
    "discard_written",
    "new_hasher",
    "new_manifest",
    "prepare_checkpoint",
    "write_checkpoint",
    "write_manifest_last",
    "writer_versions",
]


# -- JSON rules ------------------------------------------------------------------------------


#: The longest int JSON data may hold, in decimal digits: Python's default limit on int <->
#: str conversion (``sys.get_int_max_str_digits()``), which every reader of the file has.
MAX_INT_DIGITS = 4300
_INT_BOUND = 10**MAX_INT_DIGITS
#: Ints of at most this many bits have fewer digits: no comparison with the bound needed.
_MAX_INT_BITS = 14_000


def check_json_data(value: Any, *, where: str = "metadata") -> None:
    """Refuse anything but plain JSON data: it must come back from JSON exactly as given.

    Accepted: ``dict`` with ``str`` keys, ``list``, ``str``, ``int``, finite ``float``,
    ``bool`` and ``None``, nested. Tuples, sets, NaN, numpy scalars, enums... are refused,
    as they would come back as something else (or not at all).

    Raises:
        MetadataError: naming the first offending path inside ``value``.
    """
    stack: list[tuple[str, Any, int]] = [(where, value, 0)]
    while stack:
        path, item, depth = stack.pop()
        if depth > 100:
            raise MetadataError(
                f"{path}: nested more than 100 levels deep; expected plain JSON data.",
                path=path,
            )
        kind = type(item)
        if kind is dict:
            for key, sub in item.items():
                if type(key) is not str:
                    raise MetadataError(
                        f"{path}: the key {key!r} is a {type(key).__name__}; JSON object keys "
                        "must be str. Convert it with str() first.",
                        path=path,
                        field=repr(key),
                    )
                if not key.isascii():
                    _check_text(key, path, "the key")
                stack.append((f"{path}[{key!r}]", sub, depth + 1))
        elif kind is str:
            if not item.isascii():
                _check_text(item, path, "the string")
        elif kind is list:
            stack.extend((f"{path}[{i}]", sub, depth + 1) for i, sub in enumerate(item))
        elif kind is float:
            if item != item or item in (float("inf"), float("-inf")):
                raise MetadataError(
                    f"{path}: {item!r} is not valid JSON; use None or a finite number.",
                    path=path,
                )
        elif kind is int:
            if item.bit_length() > _MAX_INT_BITS and not -_INT_BOUND < item < _INT_BOUND:
                raise MetadataError(
                    f"{path}: an int of more than {MAX_INT_DIGITS} decimal digits "
                    f"({item.bit_length()} bits); Python reads and writes no longer int as "
                    "JSON text (sys.get_int_max_str_digits), so it could not be saved or read "
                    "back. Store it as a str, or a float if its precision may go.",
                    path=path,
                )
        elif kind not in (str, int, bool, type(None)):
            hint = "use a list" if kind is tuple else "convert it to str, int, float or a list"
            raise MetadataError(
                f"{path}: found a {kind.__name__} ({item!r:.80}); expected plain JSON data "
                f"(dict with str keys, list, str, int, finite float, bool, None): {hint}.",
                path=path,
            )
    # A manifest holds the value (as ASCII JSON, at least this long): one larger than any
    # reader accepts would make a step saved but never listed.
    size = len(json.dumps(value, allow_nan=False))
    if size > MAX_MANIFEST_BYTES:
        raise MetadataError(
            f"{where}: {size} bytes as JSON, more than the {MAX_MANIFEST_BYTES} a step's "
            "manifest may hold (readers refuse a larger one). Keep large values out of "
            "metadata: save them as tensors of the step.",
            path=where,
        )


def _check_text(text: str, path: str, what: str) -> None:
    """Refuse a str that UTF-8 cannot encode (a lone surrogate, such as ``"\\udcff"`` from
    ``os.fsdecode`` of a non-UTF-8 name): a manifest holding one could be written but never
    read back, and the step would be lost."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start : exc.end]
        raise MetadataError(
            f"{path}: {what} {text!r:.80} holds {bad!r}, a lone surrogate that UTF-8 (and so "
            "JSON) cannot encode; nothing was saved. Make it text first, e.g. "
            "text.encode('utf-8', 'backslashreplace').decode(), or store its bytes as a list "
            "of ints.",
            path=path,
        ) from None


def writer_versions() -> WriterVersions:
    import tensordict

    return WriterVersions(
        tdckpt=__version__,
        tensordict=getattr(tensordict, "__version__", None),
        torch=str(torch.__version__),
        python=platform.python_version(),
    )


def new_manifest(created: str | None = None, **fields: Any) -> Manifest:
    """A manifest of this tdckpt's format with ``fields``, written now (or ``created``)."""
    return Manifest(
        schema_version=MANIFEST_SCHEMA_VERSION,
        format_version=FORMAT_VERSION,
        created=created or datetime.now(timezone.utc).isoformat(),
        writer=writer_versions(),
        key_encoding="robust",
        **fields,
    )


@dataclass(frozen=True)
class PreparedCheckpoint:
    """An object checked and planned for :func:`write_checkpoint`, nothing written yet.

    ``plan`` holds every directory, small file (``meta.json`` and pickles, already
    serialized) and leaf tensor to write; ``root_type`` is the saved object's class id.
    :mod:`tdckpt._write.snapshot` swaps the leaves for staged copies, so that a background
    thread writes the values of the moment the snapshot was taken.
    """

    plan: Plan
    root_type: str


def prepare_checkpoint(obj: Any, where: str | os.PathLike[str]) -> PreparedCheckpoint:
    """Check ``obj`` and plan its files; nothing is written (``where`` names it in errors).

    Raises:
        UnsupportedContentError: ``obj`` is not a tensor collection, or holds what the
            format cannot store (every such key is listed).
    """
    from tensordict import is_tensor_collection

    dest = os.fspath(where)  # as given: Path() would fold a URL's "//" into "/"
    if not is_tensor_collection(obj):
        raise UnsupportedContentError(
            f"{dest}: cannot save a {type(obj).__name__}; expected a TensorDict, "
            "LazyStackedTensorDict, tensorclass instance, NonTensorData or NonTensorStack. "
            "Wrap plain data first, e.g. TensorDict(obj).",
            path=str(dest),
            problems=[f"the root is a {type(obj).__name__}"],
            keys=[()],
        )
    plan = plan_checkpoint(obj)
    if plan.problems:
        listing = "\n  ".join(plan.problems)
        raise UnsupportedContentError(
            f"{dest}: nothing was written; {len(plan.problems)} "
            f"entr{'y' if len(plan.problems) == 1 else 'ies'} cannot be stored faithfully:\n  "
            f"{listing}",
            path=str(dest),
            problems=list(plan.problems),
            keys=list(plan.problem_keys),
        )
    return PreparedCheckpoint(plan=plan, root_type=class_id(type(obj)))


def check_save_options(user_metadata: dict[str, Any] | None, checksum: str) -> dict[str, Any]:
    """The user metadata a save records (``{}`` for None), once ``checksum`` is an algorithm
    tdckpt knows and the metadata a dict of plain JSON data: every writer checks both
    before it writes anything.

    Raises:
        ValueError: an unknown checksum algorithm.
        MetadataError: metadata that is not a dict of plain JSON data (naming the entry).
    """
    new_hasher(checksum)
    metadata = {} if user_metadata is None else user_metadata
    if type(metadata) is not dict:
        raise MetadataError(
            f"user metadata must be a dict of plain JSON data, got a {type(metadata).__name__}.",
            path="metadata",
        )
    check_json_data(metadata)
    return metadata


def claim_dest(dest: Path) -> bool:
    """Create the folder ``dest`` (True), or check it is an empty folder (False).

    Raises:
        CheckpointExistsError: ``dest`` exists and is not an empty directory.
    """
    if not dest.exists():
        dest.mkdir(parents=True)
        return True
    if not dest.is_dir() or any(dest.iterdir()):
        raise CheckpointExistsError(
            f"{dest}: exists and is not an empty directory; a checkpoint is written into a "
            "new or empty directory. Choose another path or remove it.",
            path=str(dest),
        )
    return False


def write_checkpoint(
    obj: Any,
    dest_dir: str | os.PathLike[str],
    *,
    step: int | None = None,
    user_metadata: dict[str, Any] | None = None,
    fsync: bool = True,
    checksum: str = DEFAULT_CHECKSUM,
    progress: Callable[[int, int], None] | None = None,
    state: StateRecord | None = None,
    direct: bool = True,
    incremental: IncrementalSave | None = None,
) -> Manifest:
    """Write ``obj`` into ``dest_dir`` in tensordict 0.15.3's format, then the manifest.

    The tree is what ``obj.memmap(dest_dir)`` writes with tensordict 0.15.3, file for file
    and byte for byte in every ``meta.json``; ``TensorDict.load_memmap(dest_dir)`` reads it.
    ``obj`` is never memory-mapped, locked or modified.

    Args:
        obj: a TensorDict (any nesting), a LazyStackedTensorDict, a tensorclass instance,
            a NonTensorData or a NonTensorStack - or what :func:`prepare_checkpoint`
            returned for one (then it is not checked or planned again).
        dest_dir: an empty or missing directory.
        step: recorded in the manifest.
        user_metadata: plain JSON data, recorded in the manifest.
        fsync: fsync every file, the directories bottom-up, and the manifest, which is
            written last. Off only for throw-away data.
        checksum: ``"crc32"`` (default) or a hashlib algorithm such as ``"sha256"``.
        progress: called as ``progress(bytes_done, bytes_total)`` after each file (each
            piece of a large leaf) is written.
        state: what each entry was, when ``obj`` was built from a training state
            (:func:`tdckpt._state.to_tensordict`); recorded in the manifest.
        direct: with fsync on, write large leaves with ``O_DIRECT`` where the platform
            and file system allow (see :class:`~tdckpt._write.writer.Writer`). False keeps
            every file in the page cache: for a staging folder that is read back at once
            (packed into an archive).

    Returns:
        The manifest written to ``dest_dir/tdckpt.manifest.json``.

    Raises:
        UnsupportedContentError: ``obj`` holds what the format cannot store (all such keys
            are listed); nothing has been written.
        MetadataError: ``user_metadata`` is not plain JSON data.
        CheckpointExistsError: ``dest_dir`` exists and is not empty.

    Example:
        >>> import tempfile, torch
        >>> from tensordict import TensorDict
        >>> with tempfile.TemporaryDirectory() as d:
        ...     m = write_checkpoint(TensorDict(a=torch.zeros(3)), d + "/ckpt", step=1)
        ...     sorted(f.path for f in m.files)
        ['a.memmap', 'meta.json']
    """
    metadata = check_save_options(user_metadata, checksum)
    dest = Path(dest_dir)
    prepared = obj if isinstance(obj, PreparedCheckpoint) else prepare_checkpoint(obj, dest)
    plan = prepared.plan
    created = claim_dest(dest)
    total = sum(map(op_bytes, plan.ops)) if progress is not None else 0
    writer = Writer(
        dest,
        algorithm=checksum,
        fsync=fsync,
        progress=progress,
        total=total,
        direct=direct,
        incremental=incremental,
    )
    if incremental is not None:
        incremental.plan_meta(plan.ops)
    try:
        if incremental is not None:
            writer.prehash(plan.ops)
        for op in plan.ops:
            if op.kind == "dir":
                writer.mkdir(op.rel)
            elif op.kind == "bytes":
                assert op.data is not None
                writer.write_bytes(op.rel, op.data, op.key)
            else:
                assert op.tensor is not None
                writer.write_tensor(op.rel, op.tensor, op.key)
        writer.sync_dirs()
        manifest = new_manifest(
            step=step,
            root_type=prepared.root_type,
            pickles=plan.pickles,
            files=sorted(writer.records, key=lambda r: r.path),
            user_metadata=metadata,
            state=state,
        )
        write_manifest_last(dest, manifest, fsync=fsync)
    except BaseException:
        discard_written(dest, created=created)
        raise
    finally:
        writer.close()
    if incremental is not None:  # the next save of this process links them unread
        remember_files(dest, manifest.files)
    return manifest


def write_manifest_last(dest: Path, manifest: Manifest, *, fsync: bool) -> None:
    """Write ``manifest`` into ``dest`` as its last file - its presence means every other
    file is complete - then make the folder's entries durable."""
    data = manifest_bytes(manifest.model_dump(mode="json"), str(dest / MANIFEST_NAME))
    # through the module: the crash tests make this write fail
    _writer.write_small(dest / MANIFEST_NAME, data, fsync=fsync)
    if fsync:
        from tdckpt._write.atomic import fsync_dir

        fsync_dir(dest)


def discard_written(dest: Path, *, created: bool) -> None:
    """After a failed write into ``dest``: remove it if the write created it, else what the
    write put into it (the folder was new or empty)."""
    from tdckpt._write.atomic import remove_tree

    if created:
        remove_tree(dest, ignore_errors=True)
    else:
        for child in dest.iterdir():
            remove_tree(child, ignore_errors=True)
