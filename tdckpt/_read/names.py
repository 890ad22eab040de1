"""Key-name normalization: find each key's file, whatever convention named it.

After the migration chain, every collection directory has current-form metadata, but its
files still carry the names the writer gave them: percent-encoded ("robust"), raw
("legacy"), or raw directories with encoded leaves (tensordict 0.13). This stage maps
every key to its file or directory and renames the entries of the virtual tree to the
robust names the current format uses, so later stages only ever compute
``encode_key(key)``.

The convention is decided once per directory - separately for leaf files and for child
directories - never per key: a per-key probe reads the wrong file when both ``a b.memmap``
and ``a%20b.memmap`` exist (format-notes.md §2.3). ``robust_key``:

* ``True``: tensordict's rule - the robust name, else the raw name of a *safe* legacy key;
* ``False``: raw names only (a key with ``/`` names a chain of directories);
* ``None``: decide per directory. The hint a migration set from the writer's generation
  wins; otherwise the convention under which every key finds its file. When both do and
  they disagree the directory is ambiguous, and it is refused.

A key whose raw name would leave the directory (``..``, ``.``, empty or absolute
components) is never followed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tdckpt._keys import (
    LEAF_SUFFIX,
    NESTED_SHAPE_SUFFIX,
    encode_key,
    is_safe_legacy_key,
    legacy_components,
)
from tdckpt._read.detect import entries_of, level_kind
from tdckpt._read.storage import Storage, join
from tdckpt._read.tree import VDir, VFile
from tdckpt._report import Problem

__all__ = ["SIDECARS", "NamesResult", "is_keyed_level", "normalize_names"]

#: Files that belong to a level itself, never to a key. ``storage_metadata.json`` is what
#: torchrl's ``TensorStorageCheckpointer`` writes beside the storage's tensordict
#: (``ReplayBuffer.dumps(path)`` -> ``path/storage/``); no key's file ends in ``.json``.
SIDECARS = frozenset(
    {
        "meta.json",
        "other.pickle",
        "pickle.pkl",
        "json_types.json",
        "tdckpt.manifest.json",
        "storage_metadata.json",
    }
)

ROBUST = "robust"
LEGACY = "legacy"


@dataclass
class NamesResult:
    """The tree with robust names, what went wrong, and the convention found."""

    tree: VDir
    problems: list[Problem] = field(default_factory=list)
    encoding: str = ROBUST  # "robust" | "legacy" | "mixed"
    decisions: dict[str, str] = field(default_factory=dict)  # dir path -> "robust"/"legacy"


def is_keyed_level(meta: dict[str, object] | None) -> bool:
    """Whether a meta.json describes a TensorDict level, whose dict entries are keys."""
    return level_kind(meta) == "tensordict"


def normalize_names(tree: VDir, *, robust_key: bool | None, storage: Storage) -> NamesResult:
    """Rename every key-named entry of ``tree`` to its robust name (in memory)."""
    result = NamesResult(tree=tree)
    stack = [tree]
    while stack:
        node = stack.pop()
        if is_keyed_level(node.meta):
            _normalize_dir(node, robust_key, result)
        stack.extend(node.dirs.values())
    used = set(result.decisions.values())
    result.encoding = used.pop() if len(used) == 1 else (ROBUST if not used else "mixed")
    return result


# -- one directory -------------------------------------------------------------------------


def _legacy_file(node: VDir, key: str, suffix: str) -> VFile | None:
    # The raw file name is the key plus its suffix: "..", "." and "" are ordinary file
    # names once suffixed ("...memmap"); only a "/" can lead out of the directory.
    parts = legacy_components(key + suffix)
    if parts is None:
        return None
    cur = node
    for part in parts[:-1]:
        nxt = cur.dirs.get(part)
        if nxt is None:
            return None
        cur = nxt
    return cur.files.get(parts[-1])


def _legacy_dir(node: VDir, key: str) -> VDir | None:
    parts = legacy_components(key)
    if parts is None:
        return None
    cur: VDir | None = node
    for part in parts:
        cur = cur.dirs.get(part) if cur is not None else None
    return cur


def _robust_file(node: VDir, key: str, suffix: str, encoded: str | None = None) -> VFile | None:
    found = node.files.get((encode_key(key) if encoded is None else encoded) + suffix)
    if found is None and key in ("", ".", ".."):
        # tensordict 0.13 percent-encoded leaf names but did not yet special-case the
        # empty and dot keys: "" was ".memmap" and ".." was "...memmap".
        found = node.files.get(key + suffix)
    return found


def _choose(
    node: VDir,
    keys: list[str],
    enc: dict[str, str],
    find_robust: Callable[[str], object],
    find_legacy: Callable[[str], object],
    needs_file: Callable[[str], bool],
    *,
    robust_key: bool | None,
    hint: str | None,
    is_collection: bool,
    result: NamesResult,
    what: str,
    lost: list[str],
) -> dict[str, tuple[str, object]]:
    """Pick each key's entry under one convention; return key -> (convention, entry).

    ``enc`` holds every key's robust name; ``needs_file(key)`` says whether the key must
    have a file (zero-element leaves need none), and is only asked when deciding.
    """
    picked: dict[str, tuple[str, object]] = {}
    if robust_key is True:
        # tensordict's rule, key by key: the robust name, else the raw name of a safe
        # legacy key. A key that encodes to itself has one name under both conventions.
        for k in keys:
            found = find_robust(k)
            if found is not None:
                picked[k] = (ROBUST, found)
            elif enc[k] != k and is_safe_legacy_key(k, is_collection=is_collection):
                found = find_legacy(k)
                if found is not None:
                    picked[k] = (LEGACY, found)
        return picked
    robust = {k: find_robust(k) for k in keys}
    # A key that encodes to itself has one name under both conventions (no "/" in it),
    # so its legacy lookup is its robust one: only the other keys are looked up again.
    legacy = {k: robust[k] if enc[k] == k else find_legacy(k) for k in keys}
    if robust_key is False:
        conv = LEGACY
    elif hint in (ROBUST, LEGACY):
        conv = hint
    else:
        distinct = [k for k in keys if enc[k] != k and needs_file(k)]
        r_ok = all(robust[k] is not None for k in distinct)
        l_ok = all(legacy[k] is not None for k in distinct)
        # Keys whose two names find two different entries (".." may find "...memmap"
        # under both conventions: that is no ambiguity).
        both = [k for k in distinct if robust[k] is not legacy[k]]
        ambiguous = bool(both) and r_ok and l_ok
        if ambiguous:
            suffix = "" if is_collection else LEAF_SUFFIX
            robust_name, raw_name = enc[both[0]] + suffix, both[0] + suffix
            result.problems.append(
                Problem(
                    "ambiguous-key-encoding",
                    "error",
                    join(node.source, robust_name),
                    (),
                    f"the {what} of this directory can be read under both key encodings "
                    f"(e.g. key {both[0]!r} has both {robust_name!r} and the raw name "
                    f"{raw_name!r} on disk), so which file holds which key is unknown. Pass "
                    "robust_key=True for files written by tensordict >= 0.13 defaults, or "
                    "robust_key=False for files written with raw (legacy) names.",
                )
            )
            # Refused above; the other checks go on under tensordict's own reading, so
            # the key's files are not also reported missing.
            conv = ROBUST
        elif r_ok or not distinct:
            conv = ROBUST
        elif l_ok:
            conv = LEGACY
        else:
            r_n = sum(robust[k] is not None for k in distinct)
            l_n = sum(legacy[k] is not None for k in distinct)
            conv = ROBUST if r_n >= l_n else LEGACY
        if distinct and not ambiguous:
            result.decisions[f"{node.source}:{what}"] = conv
    if (robust_key is False or hint in (ROBUST, LEGACY)) and keys:
        # The convention is known (asked for, or from the writer's generation) even when
        # no key of this directory would be named differently under the other one; a
        # directory with no such entries at all (no child directories) names nothing.
        result.decisions[f"{node.source}:{what}"] = conv
    table = robust if conv == ROBUST else legacy
    for k in keys:
        if (
            conv == LEGACY
            and needs_file(k)
            and legacy_components(k + ("" if is_collection else LEAF_SUFFIX)) is None
        ):
            lost.append(k)
            result.problems.append(
                Problem(
                    "lost-key",
                    "warning",
                    node.source,
                    (k,),
                    f"under raw (legacy) names the key {k!r} names a path outside this "
                    "directory or the directory itself: tdckpt never follows it. The writer "
                    "could not store it inside the checkpoint, so its content is lost and "
                    "the key is left out.",
                )
            )
            continue
        if table[k] is not None:
            picked[k] = (conv, table[k])
    return picked


def _needs_file(entry: object) -> bool:
    """Whether a leaf entry must have a data file (zero-element dense leaves have none)."""
    assert isinstance(entry, dict)
    if entry.get("is_nested"):
        return True
    shape = entry.get("shape")
    if not isinstance(shape, list):
        return True
    n = 1
    for d in shape:
        n *= d if isinstance(d, int) else 1
    return n != 0


def _already_robust(node: VDir, meta: dict[str, object]) -> bool:
    """If every key of ``node`` has its robust name on disk and nothing else is there,
    put the entries in the general rule's order (keys first, in file order) and say so.

    Then ``robust_key=True`` has nothing to rename, choose or report: the usual case
    (what tensordict >= 0.14 writes), decided without the general bookkeeping.
    """
    files, dirs = node.files, node.dirs
    new_files: dict[str, VFile] = {}
    new_dirs: dict[str, VDir] = {}
    for key, entry in meta.items():
        if type(entry) is not dict:
            continue
        if "type" in entry and "dtype" not in entry:  # a child collection (entries_of's rule)
            name = encode_key(key)
            child = dirs.get(name)
            if child is None:
                return False
            new_dirs[name] = child
        else:
            name = encode_key(key) + LEAF_SUFFIX
            vfile = files.get(name)
            if vfile is None or entry.get("is_nested"):
                return False
            new_files[name] = vfile
    if len(new_files) != len(files):
        # Whatever no key names must be a level's own file (a stray goes the long way).
        for name, vfile in files.items():
            if name not in new_files:
                if name not in SIDECARS and not name.endswith(".meta.pt"):
                    return False
                new_files[name] = vfile
    if len(new_dirs) != len(dirs):
        for name, vdir in dirs.items():
            if name not in new_dirs:
                if name not in ("_tensordict", "_source"):
                    return False
                new_dirs[name] = vdir
    node.files = new_files
    node.dirs = new_dirs
    return True


def _normalize_dir(node: VDir, robust_key: bool | None, result: NamesResult) -> None:
    meta = node.meta
    assert meta is not None
    if robust_key is True and _already_robust(node, meta):
        return
    leaves, children = entries_of(meta)
    enc = {k: encode_key(k) for k in leaves}
    child_enc = {k: encode_key(k) for k in children}
    lost: list[str] = []
    picked_leaves = _choose(
        node,
        leaves,
        enc,
        lambda k: _robust_file(node, k, LEAF_SUFFIX, enc[k]),
        lambda k: _legacy_file(node, k, LEAF_SUFFIX),
        lambda k: _needs_file(meta[k]),
        robust_key=robust_key,
        hint=node.leaf_encoding,
        is_collection=False,
        result=result,
        what="leaf files",
        lost=lost,
    )
    picked_dirs: dict[str, tuple[str, object]] = {}
    if children:
        picked_dirs = _choose(
            node,
            children,
            child_enc,
            lambda k: node.dirs.get(child_enc[k]),
            lambda k: _legacy_dir(node, k),
            lambda k: True,
            robust_key=robust_key,
            hint=node.dir_encoding,
            is_collection=True,
            result=result,
            what="child directories",
            lost=lost,
        )
    for k in lost:
        del meta[k]

    claimed_files: set[int] = set()
    claimed_dirs: set[int] = set()
    new_files: dict[str, VFile] = {}
    new_dirs: dict[str, VDir] = {}
    for k, (conv, vfile) in picked_leaves.items():
        assert isinstance(vfile, VFile)
        new_files[enc[k] + LEAF_SUFFIX] = vfile
        claimed_files.add(id(vfile))
        entry = meta[k]
        if isinstance(entry, dict) and entry.get("is_nested"):
            shape_file = (
                _robust_file(node, k, NESTED_SHAPE_SUFFIX, enc[k])
                if conv == ROBUST
                else _legacy_file(node, k, NESTED_SHAPE_SUFFIX)
            )
            if shape_file is not None:
                new_files[enc[k] + NESTED_SHAPE_SUFFIX] = shape_file
                claimed_files.add(id(shape_file))
    for k in leaves:
        entry = meta.get(k)
        if k in picked_leaves or not isinstance(entry, dict) or not entry.get("is_nested"):
            continue
        # a nested tensor without values: tensordict writes no data file, only the size
        # table; keep it (under the robust name), or the leaf cannot be rebuilt
        shape_file = _robust_file(node, k, NESTED_SHAPE_SUFFIX, enc[k]) or _legacy_file(
            node, k, NESTED_SHAPE_SUFFIX
        )
        if shape_file is not None:
            new_files[enc[k] + NESTED_SHAPE_SUFFIX] = shape_file
            claimed_files.add(id(shape_file))
    for k, (_conv, vdir) in picked_dirs.items():
        assert isinstance(vdir, VDir)
        new_dirs[child_enc[k]] = vdir
        claimed_dirs.add(id(vdir))

    # What no key claimed: sidecars stay; other files and metadata-less directories
    # are strays (left behind by tensordict's own quirks, or foreign).
    for name, vfile in node.files.items():
        if id(vfile) in claimed_files:
            continue
        if name in SIDECARS or name.endswith(".meta.pt"):
            new_files.setdefault(name, vfile)
            continue
        result.problems.append(
            Problem(
                "stray-file",
                "warning",
                join(node.source, name),
                (),
                "no key of this directory's meta.json names this file; it is ignored "
                "(tensordict leaves such files behind when a key is renamed or lost).",
            )
        )
    for name, vdir in node.dirs.items():
        if id(vdir) in claimed_dirs or _holds_claimed(vdir, claimed_dirs):
            continue
        if name in ("_tensordict", "_source"):
            new_dirs.setdefault(name, vdir)
            continue
        result.problems.append(
            Problem(
                "stray-directory",
                "warning",
                vdir.source,
                (),
                "no key of the parent meta.json names this directory; it is ignored.",
            )
        )
    node.files = new_files
    node.dirs = new_dirs


def _holds_claimed(vdir: VDir, claimed: set[int]) -> bool:
    """Whether a legacy chain directory (``a`` of key ``a/b``) leads to a claimed one."""
    return any(id(sub) in claimed or _holds_claimed(sub, claimed) for sub in vdir.dirs.values())
