"""A sharded step's manifest checked against its shards, before anything is restored.

The step manifest says which global rows each shard holds; the shards are plain tensordict
prefixes with metadata of their own (a ``meta.json`` per level, or - in a step the manifest
records as ``layout="consolidated"`` - one consolidated data file per shard, whose layout is
checked too). Nothing a restore returns may rest on the manifest alone: :func:`open_checked`
opens every shard once, as a restore opens it, and reads its validated metadata (no leaf is
mapped, no value unpickled; a shard of TensorDict levels and tensors is described from its
nodes, any other by ``build.StructureBuilder``'s ``device="meta"`` stand-ins). It refuses,
naming the shard's file and the key, a shard whose real row count is not the rows the
manifest gives it, whose dims after dim 0 are not the manifest's, or whose keys, dtypes or
shapes differ from shard 0's; and a replicated entry that the replicated prefix does not
hold. Rows shifted in the manifest would otherwise give the wrong rows silently, a huge
batch size would "restore", and shards that disagree would be promoted or raise
tensordict's bare KeyError.

Every shard is checked, not only those whose rows are read: the global row numbers of a
shard rest on every shard before it. The cost is one metadata read per shard - per group
in a collective restore, where the ranks share the check out (:class:`SplitCheck`) and
compare what they found in the all_gather that closes the restore. The shards a
restore reads stay open (:class:`CheckedShards`), and the restore maps them as checked: their
metadata is read once, and a shard whose files are replaced after the check is not read.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tdckpt._read.nodes import LeafNode, Node, TensorDictNode
from tdckpt.errors import MetadataError, TdckptError
from tdckpt.schema import MANIFEST_NAME, ShardedManifest

if TYPE_CHECKING:
    from tdckpt._read.pipeline import OpenedCheckpoint
    from tdckpt._restore.reading import Admitted

__all__ = [
    "CheckedShards",
    "ShardStructure",
    "SplitCheck",
    "check_shards",
    "open_checked",
    "prefix_digest",
    "shard_problems",
    "structure_digest",
]

Key = tuple[str, ...]
#: ``(kind, dtype, shape after the root's batch dims)`` of a leaf; kind is "tensor" or
#: "non-tensor" (non-tensor data: no dtype or shape compared).
Leaf = tuple[str, str, tuple[int, ...]]


@dataclass(frozen=True)
class ShardStructure:
    """What a shard's metadata says it holds (no leaf read)."""

    root: str  # the root's kind and class, e.g. "TensorDictNode tensordict:TensorDict"
    batch_size: tuple[int, ...]
    leaves: dict[Key, Leaf]
    keys: frozenset[Key]  # every nested key, inner levels included


def _root_kind(node: Any) -> str:
    name = type(node).__name__
    detail = getattr(node, "class_id", None) or getattr(node, "type_str", None) or ""
    return f"{name} {detail}".strip()


def _structure(opened: OpenedCheckpoint) -> ShardStructure:
    """The structure of a validated prefix: from its nodes alone where it holds TensorDict
    levels of dense tensors (the usual shard), else from stand-ins."""
    assert opened.root is not None
    return _plain_structure(opened.root) or _built_structure(opened)


def _built_structure(opened: OpenedCheckpoint) -> ShardStructure:
    """The structure of a validated prefix from stand-ins built with ``device="meta"``
    leaves (``build.StructureBuilder``: nothing read, unpickled or run): any tree."""
    assert opened.root is not None
    import torch

    from tdckpt._restore.build import StructureBuilder
    from tdckpt._restore.keys import saved_structure
    from tdckpt._restore.plan import Mapper

    saved = saved_structure(opened)
    meta = Mapper(opened.storage, "r", torch.device("meta"))
    built = StructureBuilder(opened, meta, False).build(opened.root)
    batch = tuple(int(d) for d in getattr(built, "batch_size", ()))
    leaves: dict[Key, Leaf] = {}
    if hasattr(built, "items"):
        for key, value in built.items(True, True):
            k = key if isinstance(key, tuple) else (key,)
            if k in saved.opaque or not isinstance(value, torch.Tensor):
                leaves[k] = ("non-tensor", "", ())
            else:
                leaves[k] = ("tensor", str(value.dtype), tuple(value.shape[len(batch) :]))
    for key in saved.opaque:  # non-tensor data of a level that is itself non-tensor
        leaves.setdefault(key, ("non-tensor", "", ()))
    return ShardStructure(
        root=_root_kind(opened.root), batch_size=batch, leaves=leaves, keys=frozenset(saved.keys)
    )


def _plain_structure(root: Node) -> ShardStructure | None:
    """The structure of a tree of TensorDict levels and dense tensors, read off its nodes
    (what the stand-ins would show, without making one); None for any other tree."""
    from tdckpt._restore.plan import has_tensordict

    if type(root) is not TensorDictNode or not has_tensordict():
        return None
    batch = tuple(root.batch_size)
    dims = len(batch)
    leaves: dict[Key, Leaf] = {}
    keys: set[Key] = set()
    stack: list[tuple[TensorDictNode, Key]] = [(root, ())]
    while stack:
        level, prefix = stack.pop()
        for name, sub in level.entries.items():
            key = (*prefix, name)
            keys.add(key)
            kind = type(sub)
            if kind is LeafNode:
                assert isinstance(sub, LeafNode)
                if sub.is_nested:
                    return None
                leaves[key] = ("tensor", str(sub.dtype), tuple(sub.shape[dims:]))
            elif kind is TensorDictNode:
                assert isinstance(sub, TensorDictNode)
                stack.append((sub, key))
            else:
                return None
    return ShardStructure(
        root=_root_kind(root), batch_size=batch, leaves=leaves, keys=frozenset(keys)
    )


def _show(key: Key) -> str:
    return repr(".".join(key))


def _leaf(info: Leaf) -> str:
    kind, dtype, shape = info
    return f"a tensor of {dtype} {list(shape)}" if kind == "tensor" else "non-tensor data"


def _refuse(where: Path, step_path: Path, problem: str, key: Key | None = None) -> MetadataError:
    return MetadataError(
        f"{where}: {problem}. The step manifest ({step_path / 'tdckpt.manifest.json'}) and its "
        "shards disagree, so nothing was restored and the target is unchanged. The step is "
        "damaged or was edited: restore another step (see steps()).",
        path=str(where),
        key=key,
    )


@dataclass
class CheckedShards:
    """The shards of a step, each opened and checked once; those a restore reads kept open.

    ``structures``: each shard's structure, in rank order. ``opened``: the shards kept open
    (by rank) and ``replicated``, the replicated entries kept open: a restore maps them as
    they were checked (:func:`~tdckpt._restore.engine.load_local` with ``opened=``), never
    reading their metadata again. Whatever is not taken is closed by :meth:`close`.
    """

    structures: list[ShardStructure]
    opened: dict[int, Admitted] = field(default_factory=dict)
    replicated: Admitted | None = None

    def take(self, rank: int) -> Admitted | None:
        """Shard ``rank`` as it was checked (the caller closes it), or None if not kept."""
        return self.opened.pop(rank, None)

    def take_replicated(self) -> Admitted | None:
        """The replicated entries as they were checked (the caller closes them)."""
        rep, self.replicated = self.replicated, None
        return rep

    def close(self) -> None:
        held = [*self.opened.values(), *([self.replicated] if self.replicated else [])]
        self.opened, self.replicated = {}, None
        for admitted in held:
            admitted.close()

    def __enter__(self) -> CheckedShards:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class SplitCheck:
    """A collective restore's share of the shard check.

    Alone, a reader checks every shard. In a group of ``world`` ranks, rank ``rank`` checks
    the shards it reads and each shard ``i`` with ``i % world == rank``: every shard is still
    checked (rows, trailing dims, its own metadata) by some rank, and each shard's metadata
    is read about once per group instead of once per rank. Whether the shards agree with one
    another is then decided across the ranks: ``digest`` sums up the structure this rank's
    shards share, and the restore's closing all_gather compares every rank's
    :meth:`outcome`. Where a rank's check ``refused`` a shard or the digests differ, every
    rank checks every shard (:func:`check_shards`) and raises the same error, naming the
    shard and key - as when each rank checked every shard itself.
    """

    rank: int
    world: int
    digest: str | None = None
    refused: bool = False

    def wants(self, index: int) -> bool:
        """Whether this rank checks the shard at ``index`` (besides those it reads)."""
        return index % self.world == self.rank

    def outcome(self) -> tuple[bool, str | None]:
        """What this rank's share of the check found, for the ranks to compare."""
        return self.refused, self.digest

    @staticmethod
    def settled(outcomes: list[Any]) -> bool:
        """Whether the ranks' :meth:`outcome` values show every shard checked and alike:
        no rank refused one, and every digest (None: a rank that checked none) is one."""
        digests = {digest for _, digest in outcomes if digest is not None}
        return not any(refused for refused, _ in outcomes) and len(digests) <= 1


def prefix_digest(prefix: Path) -> str:
    """:func:`structure_digest` of the shard written at ``prefix`` (its metadata read back,
    as a restore will read it): a save compares the ranks' digests before it commits."""
    from tdckpt._read.pipeline import open_checkpoint

    opened = open_checkpoint(prefix, robust_key=True)
    try:
        return structure_digest(_structure(opened))
    finally:
        opened.close()


def structure_digest(structure: ShardStructure) -> str:
    """What every shard of a step must share (all but its row count), as one string."""
    import hashlib

    shared = (
        structure.root,
        structure.batch_size[1:],
        sorted(structure.leaves.items()),
        sorted(structure.keys),
    )
    return hashlib.sha256(repr(shared).encode()).hexdigest()


def check_shards(
    step_path: Path, manifest: ShardedManifest, prefix_of: Any = None
) -> list[ShardStructure]:
    """Check every shard (and the replicated entries) of ``manifest`` against it.

    ``prefix_of(prefix)`` gives a shard's folder (default ``step_path / prefix``; the
    restore passes its link-refusing resolver). Returns each shard's structure in rank
    order. Raises as :func:`open_checked`.
    """
    with open_checked(step_path, manifest, prefix_of) as checked:
        return checked.structures


def open_checked(
    step_path: Path,
    manifest: ShardedManifest,
    prefix_of: Any = None,
    *,
    keep: Collection[int] = (),
    keep_replicated: bool = False,
    split: SplitCheck | None = None,
) -> CheckedShards:
    """Open every shard (and the replicated entries) of ``manifest`` once and check it.

    Each shard is opened and validated as a restore opens it
    (:func:`~tdckpt._restore.reading.admit`); the shards whose rank is in ``keep`` (and the
    replicated entries, with ``keep_replicated``) stay open for the restore, the others are
    closed once checked. ``prefix_of(prefix)``: as :func:`check_shards`. ``split``: in a
    group, only this rank's share of the shards is checked (see :class:`SplitCheck`), and
    the digest of their structure left in it. On any error every shard opened so far is
    closed.

    Raises:
        MetadataError: naming the shard's ``meta.json`` and the key that disagrees.
        ValidationError: a shard's own metadata has problems.
        RestoreError, UnsafePathError: a shard folder is missing or not a folder.
    """
    checked = CheckedShards(structures=[])
    try:
        _open_checked(step_path, manifest, prefix_of, set(keep), keep_replicated, checked, split)
    except BaseException:
        checked.close()
        raise
    return checked


def _open(folder: Path, hold: bool) -> tuple[Admitted | None, ShardStructure]:
    """Open and validate ``folder``: (the opened prefix if ``hold``, else None: closed; its
    structure)."""
    from tdckpt._restore.reading import admit

    admitted = admit(folder, robust_key=True)
    try:
        got = _structure(admitted.opened)
    except BaseException:
        admitted.close()
        raise
    if not hold:
        admitted.close()
    return (admitted if hold else None), got


def _open_checked(
    step_path: Path,
    manifest: ShardedManifest,
    prefix_of: Any,
    keep: set[int],
    keep_replicated: bool,
    checked: CheckedShards,
    split: SplitCheck | None = None,
) -> None:
    resolve = prefix_of if prefix_of is not None else (lambda p: step_path / p)
    _check_layout(step_path, manifest)
    tail = tuple(manifest.batch_size[1:])
    structures = checked.structures
    first: ShardStructure | None = None
    first_shard = manifest.shards[0]  # the shard ``first`` describes
    for index, shard in enumerate(manifest.shards):
        if split is not None and shard.rank not in keep and not split.wants(index):
            continue  # another rank of the group checks it
        folder = resolve(shard.prefix)
        where = _check_shard_layout(folder, manifest.layout, shard.rank, step_path)
        try:
            admitted, got = _open(folder, shard.rank in keep)
        except TdckptError as exc:
            if manifest.layout == "consolidated":
                _check_consolidated(where, shard.rank, step_path, exc)
            raise
        if admitted is not None:
            checked.opened[shard.rank] = admitted
        if not got.batch_size:
            raise _refuse(
                where,
                step_path,
                f"shard {shard.rank} has batch size [], so it holds no rows; the step "
                f"manifest gives it rows {shard.start}..{shard.stop}",
            )
        rows = got.batch_size[0]
        if rows != shard.stop - shard.start:
            raise _refuse(
                where,
                step_path,
                f"shard {shard.rank} holds {rows} rows, but the step manifest gives it rows "
                f"{shard.start}..{shard.stop} ({shard.stop - shard.start} rows) of a global "
                f"batch of {manifest.batch_size[0]}",
            )
        if got.batch_size[1:] != tail:
            raise _refuse(
                where,
                step_path,
                f"shard {shard.rank} has batch size {list(got.batch_size)}; the step manifest "
                f"says [rows, {', '.join(map(str, tail))}]"
                if tail
                else f"shard {shard.rank} has batch size {list(got.batch_size)}; the step "
                "manifest says [rows]",
            )
        if first is None:
            first, first_shard = got, shard
        else:
            _agree(first, got, shard.rank, where, step_path, first_shard.rank)
        structures.append(got)
    if split is not None and first is not None:
        split.digest = structure_digest(first)
    if manifest.replicated is not None:
        folder = resolve(manifest.replicated.prefix)
        checked.replicated, rep = _open(folder, keep_replicated)
        assert first is not None
        named = [tuple(key) for key in manifest.replicated.keys]
        for leaf in sorted(rep.leaves):
            if not any(leaf[: len(k)] == k for k in named):
                raise _refuse(
                    folder / "meta.json",
                    step_path,
                    f"the replicated entries hold {_show(leaf)}, which the step manifest does "
                    "not name as replicated",
                    leaf,
                )
        for k in named:
            if k not in rep.keys:
                raise _refuse(
                    folder / "meta.json",
                    step_path,
                    f"the replicated entry {_show(k)} named by the step manifest is not in the "
                    "replicated entries saved",
                    k,
                )
            if k in first.keys:
                raise _refuse(
                    resolve(first_shard.prefix) / "meta.json",
                    step_path,
                    f"the replicated entry {_show(k)} is also in shard {first_shard.rank}: the two "
                    "would replace each other",
                    k,
                )


def _check_shard_layout(folder: Path, layout: str, rank: int, step_path: Path) -> Path:
    """The file that describes shard ``rank`` (its ``meta.json``, or its one consolidated
    data file), refusing a shard saved in another layout than the step manifest records:
    the manifest's per-file records and a verify would otherwise not describe what a
    restore reads."""
    import os

    from tdckpt._read.consolidated import DATA_NAME

    data, meta = folder / DATA_NAME, folder / "meta.json"
    has_data, has_meta = os.path.lexists(data), os.path.lexists(meta)
    if layout == "consolidated":
        if has_meta or not has_data:
            found = "a meta.json (the memmap layout)" if has_meta else f"no {DATA_NAME}"
            raise _refuse(
                data,
                step_path,
                f"the step manifest records layout 'consolidated' (one {DATA_NAME} per "
                f"shard), but shard {rank} holds {found}",
            )
        return data
    if has_data and not has_meta:
        raise _refuse(
            meta,
            step_path,
            f"the step manifest records layout 'memmap' (a meta.json per shard), but shard "
            f"{rank} holds a consolidated {DATA_NAME} instead",
        )
    return meta


def _check_consolidated(data: Path, rank: int, step_path: Path, exc: TdckptError) -> None:
    """After shard ``rank`` could not be read: refuse, naming it, a data file that is not a
    consolidated file at all (read as a folder without ``meta.json`` otherwise)."""
    from tdckpt._read.consolidated import open_consolidated

    opened = open_consolidated(data, follow=False)  # checks its footer first
    if opened is not None:
        opened.close()
        return
    raise _refuse(
        data,
        step_path,
        f"shard {rank}'s file is not a consolidated data file (it does not end with the "
        "metadata and its length: truncated or overwritten)",
    ) from exc


def _check_layout(step_path: Path, manifest: ShardedManifest) -> None:
    """The attempt holds exactly ``shard-<rank>`` per rank (+ ``replicated``), as written.

    A manifest that names the shards in another order, leaves one out or forgets the
    replicated entries would otherwise restore other rows, or fewer, without a word.
    """
    import os

    attempt = step_path / manifest.attempt
    expected = {f"{manifest.attempt}/shard-{s.rank}" for s in manifest.shards}
    for shard in manifest.shards:
        if shard.prefix != f"{manifest.attempt}/shard-{shard.rank}":
            raise _refuse(
                step_path / shard.prefix,
                step_path,
                f"the step manifest gives rank {shard.rank} the folder {shard.prefix!r}; a "
                f"sharded save writes it as '{manifest.attempt}/shard-{shard.rank}'",
            )
    if manifest.replicated is not None:
        if manifest.replicated.prefix != f"{manifest.attempt}/replicated":
            raise _refuse(
                step_path / manifest.replicated.prefix,
                step_path,
                f"the step manifest names the replicated entries' folder "
                f"{manifest.replicated.prefix!r}; a sharded save writes it as "
                f"'{manifest.attempt}/replicated'",
            )
        expected.add(manifest.replicated.prefix)
    try:
        found = {f"{manifest.attempt}/{name}" for name in os.listdir(attempt)}
    except OSError:
        return  # reading the shards raises the error that names what is missing
    extra = sorted(found - expected)
    if extra:
        raise _refuse(
            step_path / extra[0],
            step_path,
            "the attempt folder holds this entry, which the step manifest does not name (a "
            "shard or replicated entries left out of the manifest)",
        )


def _agree(
    first: ShardStructure, got: ShardStructure, rank: int, where: Path, step: Path, of: int = 0
) -> None:
    """Refuse shard ``rank`` (structure ``got``) unless it holds what shard ``of`` does."""
    if got.root == first.root and got.keys == first.keys and got.leaves == first.leaves:
        return  # the usual answer, in three comparisons; else find what differs, below
    if got.root != first.root:
        raise _refuse(where, step, f"shard {rank} holds a {got.root}, shard {of} a {first.root}")
    missing = sorted(first.keys - got.keys)
    if missing:
        raise _refuse(
            where,
            step,
            f"shard {rank} has no key {_show(missing[0])}, which shard {of} has",
            missing[0],
        )
    extra = sorted(got.keys - first.keys)
    if extra:
        raise _refuse(
            where,
            step,
            f"shard {rank} has the key {_show(extra[0])}, which shard {of} has not",
            extra[0],
        )
    for key in sorted(first.leaves.keys() | got.leaves.keys()):
        a, b = first.leaves.get(key), got.leaves.get(key)
        if a != b:
            raise _refuse(
                where,
                step,
                f"the key {_show(key)} is {_leaf(b) if b else 'a level'} in shard {rank} and "
                f"{_leaf(a) if a else 'a level'} in shard {of}",
                key,
            )


def shard_problems(step_path: Path, manifest: ShardedManifest) -> list[Any]:
    """What :func:`check_shards` refuses, as ``verify`` problems (kind ``"manifest"``).

    ``verify`` of a sharded step checks its files against the manifest and, with this,
    the manifest against its shards: the one check a step written before the manifest's
    checksum was recorded has on its manifest.
    """
    from tdckpt._manage.verify import VerifyProblem
    from tdckpt.errors import TdckptError

    try:
        check_shards(step_path, manifest)
    except TdckptError as exc:
        key = exc.facts.get("key")
        where = exc.facts.get("path") or str(step_path)
        try:
            rel = Path(where).relative_to(step_path).as_posix()
        except ValueError:
            rel = MANIFEST_NAME
        return [
            VerifyProblem(
                path=rel,
                key=tuple(key) if key is not None else None,
                kind="manifest",
                expected="what the step manifest says of this shard",
                found=exc.message.splitlines()[0] if exc.message else str(exc),
            )
        ]
    return []
