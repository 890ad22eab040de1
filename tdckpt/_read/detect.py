"""Detection: which tensordict layout generation wrote each directory of a checkpoint.

format-notes.md §1/§7 names nine generations; every directory of a virtual tree
(:func:`tdckpt._read.tree.read_tree`) gets ``VDir.generation`` = ``"G1"`` .. ``"G8"``:

====  ==================  ===============================================================
G1    0.0.3 - 0.2.1       ``meta.pt`` / ``<key>.meta.pt`` (torch.save metadata)
G2    0.3.0 - 0.3.2       ``meta.json``; child collections *not* listed in the parent
G3    0.4.0               ``{"type": ...}`` child entries; no ``is_nested``
G4    0.5.0 - 0.12.4      ``is_nested``; flat NonTensorData; orjson (compact) JSON
G5    0.13.0              percent-encoded leaf names, raw directory names
G6    0.14.0 - 0.14.3     encoded directory names; ``.tdz`` archives
G7    0.15.0 - 0.15.2     ``json_types.json``; no format marker yet
G8    0.15.3              ``"_format_version": 1`` and ``"_class"`` (the current form)
====  ==================  ===============================================================

(G0, the unreleased temp-file layout, stored no shapes or dtypes: it is refused.)

How it decides. Each directory yields an *interval* ``[low, high]`` of the generations
consistent with what is on disk (the rules are in :func:`_evidence`; each cites the
marker of format-notes §6). One writer wrote the whole tree, so the intervals are
intersected; when they agree, every directory gets the **oldest** generation of the
common interval. Older is the safe choice: every migration step is a no-op on content
that is already in its target form, while skipping a step that was needed would leave
old content unconverted. (The interval often has one element; when it has more - e.g. a
0.4.0 TensorDict with only leaves is indistinguishable from a 0.3.2 one - the result
says so in :attr:`Detection.low`/:attr:`Detection.high`.) When the intervals do not
agree (a tree assembled from different writers), each directory keeps its own oldest
generation, or its parent's when that fits.

Reading the raw bytes of meta.json (JSON spacing) needs the storage: pass it for the
formatting evidence (compact orjson output means 0.5 - 0.15.1). Without it, detection
uses the parsed metadata only, which is all an in-memory tree keeps.

The level-classification helpers here (:func:`level_kind`, :func:`type_name`, ...) are
shared with the migration scripts through :mod:`tdckpt._read.migrate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tdckpt._keys import LEAF_SUFFIX, encode_key
from tdckpt._read.storage import Storage, join
from tdckpt._read.tree import VDir
from tdckpt.errors import TdckptError, UnsupportedFormatError

__all__ = [
    "CURRENT_GENERATION",
    "FORMAT_VERSION_MAX",
    "Detection",
    "class_id_for",
    "detect",
    "detect_tree",
    "entries_of",
    "gen_name",
    "gen_number",
    "json_style",
    "level_kind",
    "parse_type",
    "type_name",
]

#: The newest generation (tensordict 0.15.3, format version 1).
CURRENT_GENERATION = 8
CURRENT_NAME = "G8"
#: The newest tensordict ``_format_version`` this tdckpt reads.
FORMAT_VERSION_MAX = 1

#: Bare class name -> the ``_class`` id tensordict 0.15.3 writes (``_class_id``): exported
#: classes use the module ``tensordict``, private ones their real module.
CLASS_IDS: dict[str, str] = {
    "TensorDict": "tensordict:TensorDict",
    "LazyStackedTensorDict": "tensordict:LazyStackedTensorDict",
    "NonTensorStack": "tensordict:NonTensorStack",
    "PersistentTensorDict": "tensordict:PersistentTensorDict",
    "TensorDictParams": "tensordict:TensorDictParams",
    "TypedTensorDict": "tensordict:TypedTensorDict",
    "TensorDictStore": "tensordict:TensorDictStore",
    "LazyStackedTensorDictStore": "tensordict:LazyStackedTensorDictStore",
    "_SubTensorDict": "tensordict._td:_SubTensorDict",
    "_CustomOpTensorDict": "tensordict._lazy:_CustomOpTensorDict",
    "_UnsqueezedTensorDict": "tensordict._lazy:_UnsqueezedTensorDict",
    "_SqueezedTensorDict": "tensordict._lazy:_SqueezedTensorDict",
    "_PermutedTensorDict": "tensordict._lazy:_PermutedTensorDict",
    "_TransposedTensorDict": "tensordict._lazy:_TransposedTensorDict",
    "_ViewedTensorDict": "tensordict._lazy:_ViewedTensorDict",
}
NON_TENSOR_NAMES = frozenset({"NonTensorData", "MetaData", "NonTensorDataBase"})
LAZY_STACK_NAMES = frozenset({"LazyStackedTensorDict", "LazyStackedTensorDictStore"})
#: Classes whose directory is a plain TensorDict layout.
TD_LIKE_NAMES = frozenset(
    {"TensorDict", "PersistentTensorDict", "TensorDictParams", "TypedTensorDict", "TensorDictStore"}
)
#: Levels that carry ``_format_version`` / ``_class`` in G8 (tensorclass and non-tensor
#: levels never do).
MARKED_KINDS = frozenset(
    {"tensordict", "lazy-stack", "non-tensor-stack", "sub-tensordict", "lazy-view"}
)


def gen_name(number: int) -> str:
    """``8`` -> ``"G8"``."""
    return f"G{number}"


def gen_number(name: str) -> int:
    """``"G8"`` -> ``8``."""
    if len(name) < 2 or name[0] != "G" or not name[1:].isdigit():
        raise ValueError(f"not a generation name: {name!r}")
    return int(name[1:])


# -- classifying a level ---------------------------------------------------------------------


def parse_type(type_str: Any) -> tuple[str, str] | None:
    """``"<class 'a.b.C'>"`` -> ``("a.b", "C")``; None for anything else.

    >>> parse_type("<class 'tensordict._td.TensorDict'>")
    ('tensordict._td', 'TensorDict')
    """
    if not isinstance(type_str, str):
        return None
    inner = type_str.removeprefix("<class '").removesuffix("'>")
    if inner == type_str or not inner:
        return None
    module, _, name = inner.rpartition(".")
    return module, name


def type_name(meta: dict[str, Any] | None) -> str:
    """The bare class name of a level (``__name__``), from ``_class`` then ``_type``."""
    if not meta:
        return ""
    cls = meta.get("_class")
    if isinstance(cls, str) and ":" in cls:
        return cls.rpartition(":")[2].rpartition(".")[2]
    parsed = parse_type(meta.get("_type"))
    return parsed[1] if parsed else ""


def class_id_for(meta: dict[str, Any]) -> str:
    """The ``_class`` id tensordict 0.15.3 writes for this level's class."""
    name = type_name(meta)
    if name in CLASS_IDS:
        return CLASS_IDS[name]
    parsed = parse_type(meta.get("_type"))
    if parsed is None:
        return "tensordict:TensorDict"
    module, name = parsed
    return f"{module}:{name}"


def level_kind(meta: dict[str, Any] | None) -> str:
    """What a meta.json describes.

    One of ``"tensordict"``, ``"lazy-stack"``, ``"non-tensor"``, ``"non-tensor-stack"``,
    ``"sub-tensordict"``, ``"lazy-view"``, ``"tensorclass"`` or ``"unknown"``.

    >>> level_kind({"shape": [3], "device": "cpu", "_type": "<class 'tensordict._td.TensorDict'>"})
    'tensordict'
    >>> level_kind({"_type": "<class 'mod.MyTC'>"})
    'tensorclass'
    """
    if not meta:
        return "unknown"
    name = type_name(meta)
    if name in LAZY_STACK_NAMES:
        return "lazy-stack"
    if name == "NonTensorStack":
        return "non-tensor-stack"
    if name in NON_TENSOR_NAMES:
        return "non-tensor"
    if name == "_SubTensorDict":
        return "sub-tensordict"
    if "custom_op" in meta and "inv_op" in meta:
        return "lazy-view"
    if "shape" in meta:
        return "tensordict"
    if meta.get("_is_non_tensor") is True:
        return "non-tensor"
    if "_type" in meta:
        return "tensorclass"
    return "unknown"


def entries_of(meta: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Split the keys of a TensorDict level into (leaf keys, child keys), in file order.

    Every dict value of a TensorDict level is a key's entry (a key named like a format
    field keeps its dict entry, as in tensordict): ``{"type": ...}`` is a child collection,
    anything else a leaf.
    """
    leaves: list[str] = []
    children: list[str] = []
    for key, value in meta.items():
        if not isinstance(value, dict):
            continue
        if "type" in value and "dtype" not in value:
            children.append(key)
        else:
            leaves.append(key)
    return leaves, children


def json_style(raw: bytes) -> str | None:
    """How a JSON object was spaced: ``"compact"`` (orjson), ``"spaced"`` (stdlib json).

    Looks at what follows the first key: stdlib ``json.dumps`` writes ``": "``, orjson
    ``":"``. None when the document has no key.

    >>> json_style(b'{"a":{"b":1}}'), json_style(b'{"a": {"b": 1}}'), json_style(b"{}")
    ('compact', 'spaced', None)
    """
    s = raw.lstrip()
    n = len(s)
    if not s.startswith(b"{"):
        return None
    i = 1
    while i < n and s[i : i + 1] in b" \t\r\n":
        i += 1
    if i >= n or s[i : i + 1] != b'"':
        return None
    i += 1
    while i < n:
        c = s[i : i + 1]
        if c == b"\\":
            i += 2
            continue
        if c == b'"':
            break
        i += 1
    i += 1
    if s[i : i + 2] == b": ":
        return "spaced"
    if s[i : i + 1] == b":":
        return "compact"
    return None


# -- detection ---------------------------------------------------------------------------------


@dataclass
class Detection:
    """What detection found.

    Attributes:
        generation: the root's generation (``"G1"`` .. ``"G8"``).
        low, high: the interval of generations consistent with the whole tree (equal
            when the evidence pins one down); per-tree fallback when directories
            disagree sets ``consistent`` False.
        consistent: whether one generation fits every directory.
        styles: ``id(VDir)`` -> ``"compact"``/``"spaced"`` JSON formatting (only with
            a storage, and only for directories below G8).
        reasons: human-readable evidence, for ``tdckpt inspect``.
    """

    generation: str
    low: int
    high: int
    consistent: bool = True
    styles: dict[int, str] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)


@dataclass
class _Flags:
    leaf_robust: bool = False
    dir_legacy: bool = False
    reasons: list[str] = field(default_factory=list)


def detect_tree(root: VDir, *, storage: Storage | None = None) -> str:
    """Set ``generation`` on every directory of ``root``; return the root's.

    Raises:
        UnsupportedFormatError: a ``_format_version`` newer than this tdckpt reads, or a
            prefix without any metadata (G0, not migratable).
    """
    return detect(root, storage=storage).generation


def detect(root: VDir, *, storage: Storage | None = None) -> Detection:
    """Like :func:`detect_tree`, returning the evidence too."""
    if root.meta is None and root.pt is None and not root.problems:
        raise UnsupportedFormatError(
            f"{_where(storage, '')}: not migratable: no shapes or dtypes on disk (no meta.json "
            "or meta.pt at the top level). This is either not a tensordict checkpoint or the "
            "pre-release temp-file layout (G0, tensordict tags before 0.0.2b), which stored "
            "no metadata at all.",
            path=_where(storage, ""),
        )
    current = _marked_current(root)
    if current is not None:
        # The usual case: every directory carries "_format_version": 1, which pins it to
        # the current generation before any other evidence is weighed (see _evidence).
        for node in current:
            node.generation = CURRENT_NAME
        return Detection(generation=CURRENT_NAME, low=CURRENT_GENERATION, high=CURRENT_GENERATION)
    flags = _Flags()
    styles: dict[int, str] = {}
    archive = storage is not None and getattr(storage, "kind", "") == "archive"
    ranges: dict[int, tuple[int, int]] = {}
    nodes: list[tuple[VDir, VDir | None]] = []
    stack: list[tuple[VDir, VDir | None]] = [(root, None)]
    while stack:
        node, parent = stack.pop()
        nodes.append((node, parent))
        if node.meta is not None or node.pt is not None:
            lo, hi = _evidence(node, flags, storage)
            if archive and hi >= 6:
                lo = max(lo, 6)
            ranges[id(node)] = (lo, hi)
        stack.extend((child, node) for child in node.dirs.values())

    lo, hi = _intersect(ranges)
    if storage is not None and lo < CURRENT_GENERATION:
        # Only below the current form is the JSON spacing worth reading (a second read of
        # each undecided meta.json): a current tree never pays for it.
        for node, _parent in nodes:
            r = ranges.get(id(node))
            if r is not None and r[0] < r[1] and node.meta:
                ranges[id(node)] = _style_evidence(node, r, storage, styles)
        lo, hi = _intersect(ranges)
    if flags.leaf_robust and flags.dir_legacy:
        # encoded leaf names beside raw directory names: tensordict 0.13 (or 0.11/0.12 with
        # robust_key=True); 0.14+ encodes both or (robust_key=False) neither.
        hi = min(hi, 5)
        flags.reasons.append("encoded leaf names beside raw directory names: <= 0.13")
    if not ranges:  # nothing readable anywhere: nothing to migrate; validation reports it
        lo = hi = CURRENT_GENERATION
    consistent = lo <= hi
    chosen: dict[int, int] = {}
    if consistent:
        for node, _parent in nodes:
            chosen[id(node)] = lo
    else:
        for node, parent in nodes:  # parents come first in `nodes`
            own = ranges.get(id(node))
            inherited = chosen.get(id(parent)) if parent is not None else None
            if own is None:
                chosen[id(node)] = inherited if inherited is not None else CURRENT_GENERATION
            elif inherited is not None and own[0] <= inherited <= own[1]:
                chosen[id(node)] = inherited
            else:
                chosen[id(node)] = own[0] if own[0] <= own[1] else own[1]
        flags.reasons.append("directories disagree: detected per directory")
    for node, _parent in nodes:
        node.generation = gen_name(chosen[id(node)])
    root_gen = chosen[id(root)]
    return Detection(
        generation=gen_name(root_gen),
        low=lo if consistent else root_gen,
        high=hi if consistent else root_gen,
        consistent=consistent,
        styles=styles,
        reasons=flags.reasons,
    )


def _marked_current(root: VDir) -> list[VDir] | None:
    """Every directory of ``root`` if each has a meta.json with ``_format_version`` 1, else None."""
    out: list[VDir] = []
    stack = [root]
    while stack:
        node = stack.pop()
        meta = node.meta
        if meta is None or node.pt is not None:
            return None
        fv = meta.get("_format_version")
        if type(fv) is not int or fv != 1:
            return None
        out.append(node)
        stack.extend(node.dirs.values())
    return out


def _where(storage: Storage | None, rel: str) -> str:
    return storage.display(rel) if storage is not None else (rel or ".")


def _check_version(node: VDir, storage: Storage | None) -> int | None:
    meta = node.meta
    assert meta is not None
    fv = meta.get("_format_version")
    if isinstance(fv, bool) or not isinstance(fv, int):
        return None  # absent, or the dict entry of a key named "_format_version"
    if fv > FORMAT_VERSION_MAX:
        where = _where(storage, join(node.source, "meta.json"))
        raise UnsupportedFormatError(
            f"{where}: written by a newer tensordict format ({fv}); this tdckpt reads up to "
            f"{FORMAT_VERSION_MAX}: upgrade tdckpt (pip install -U tdckpt).",
            path=where,
            format_version=fv,
        )
    return fv


def _evidence(node: VDir, flags: _Flags, storage: Storage | None) -> tuple[int, int]:
    """The interval of generations consistent with one directory (format-notes §6)."""
    if node.pt is not None and node.meta is None:
        return 1, 1  # meta.pt files: G1
    meta = node.meta
    assert meta is not None
    fv = _check_version(node, storage)
    kind = level_kind(meta)
    if fv == 1:
        return CURRENT_GENERATION, CURRENT_GENERATION
    if kind in MARKED_KINDS and (
        isinstance(meta.get("_class"), str)
        or isinstance(meta.get("_names"), list)
        or (kind == "lazy-stack" and "stack_dim_name" in meta)
    ):
        # a key named "_format_version" hides the version (the file "reads as version
        # 0"), but only 0.15.3 writes _class, _names and stack_dim_name
        return CURRENT_GENERATION, CURRENT_GENERATION
    lo, hi = 2, CURRENT_GENERATION
    if kind in MARKED_KINDS:
        hi = 7  # no format marker: written before 0.15.3
    if kind == "tensordict":
        lo, hi = _td_evidence(node, meta, flags, lo, hi)
    elif kind == "non-tensor":
        if "_tensordict" in node.dirs:
            hi = min(hi, 3)  # 0.3-0.4 wrote an empty _tensordict/ under NonTensorData
        else:
            lo = max(lo, 4)
        if "json_types.json" in node.files:
            lo = max(lo, 7)  # 0.15.0+
        if "data" in meta and "_metadata" not in meta and "other.pickle" in node.files:
            hi = min(hi, 6)  # the accidental `_metadata` pickle of 0.5-0.14
    elif kind == "non-tensor-stack":
        lo = max(lo, 3)  # NonTensorStack arrived in 0.4.0 (#711)
        if any(name.isdigit() for name in node.dirs):
            hi = min(hi, 3)  # vestigial 0/ 1/ ... of 0.4.0
        else:
            lo = max(lo, 4)
    elif kind == "tensorclass" and "json_types.json" in node.files:
        lo = max(lo, 7)
    return lo, hi


def _intersect(ranges: dict[int, tuple[int, int]]) -> tuple[int, int]:
    lo, hi = 1, CURRENT_GENERATION
    for r_lo, r_hi in ranges.values():
        lo, hi = max(lo, r_lo), min(hi, r_hi)
    return lo, hi


def _style_evidence(
    node: VDir, r: tuple[int, int], storage: Storage, styles: dict[int, str]
) -> tuple[int, int]:
    """Narrow a directory's interval by how its meta.json is spaced."""
    lo, hi = r
    if level_kind(node.meta) == "non-tensor-stack":
        return lo, hi  # 0.15.3 writes NonTensorStack compact too
    try:
        raw = storage.read_bytes(join(node.source, "meta.json"))
    except (TdckptError, OSError):
        return lo, hi
    style = json_style(raw)
    if style is not None:
        styles[id(node)] = style
    if style == "compact":
        # orjson: 0.5 to 0.15.1 (0.15.2+ write stdlib json by default)
        lo, hi = max(lo, 4), min(hi, 7)
    return lo, hi


def _td_evidence(
    node: VDir, meta: dict[str, Any], flags: _Flags, lo: int, hi: int
) -> tuple[int, int]:
    leaves, children = entries_of(meta)
    persistent = type_name(meta) == "PersistentTensorDict"  # never writes is_nested
    for k in leaves:
        entry = meta[k]
        if "is_nested" in entry:
            lo = max(lo, 4)
        elif not persistent and "dtype" in entry:
            hi = min(hi, 3)
    if children:
        lo = max(lo, 3)  # {"type": ...} child entries arrived in 0.4.0 (#719)
    elif _has_unlisted_collection(node, leaves):
        hi = min(hi, 2)  # 0.3.x did not list sub-collections in the parent
    # file names: which convention named the entries that need encoding
    for k in leaves:
        enc = encode_key(k)
        if enc == k or "/" in k:
            continue
        robust = enc + LEAF_SUFFIX in node.files
        raw = k + LEAF_SUFFIX in node.files
        if robust and not raw:
            lo = max(lo, 4)  # encoded leaf names: 0.11+ (robust_key=True), default 0.13+
            flags.leaf_robust = True
    for k in children:
        entry = meta[k]
        enc = encode_key(k)
        if enc != k and "/" not in k:
            robust = enc in node.dirs
            raw = k not in ("", ".", "..") and k in node.dirs
            if robust and not raw:
                lo = max(lo, 6)  # encoded directory names: 0.14+ (#1762)
            elif raw and not robust:
                flags.dir_legacy = True
        elif "/" in k and enc in node.dirs:
            # a directory named "a%2Fb" for the key "a/b": only an encoding writer makes one
            # (raw names nest "a/b" as a/b); without this a 0.14 tree whose only encoded
            # directory names hold a "/" passed for 0.5 - 0.13 and the upgrade dropped them
            lo = max(lo, 6)
        child = node.dirs.get(enc) or (node.dirs.get(k) if k not in ("", ".", "..") else None)
        t = entry.get("type")
        if (
            child is not None
            and child.meta is not None
            and isinstance(t, str)
            and t not in TD_LIKE_NAMES
            and t not in NON_TENSOR_NAMES
            and t not in LAZY_STACK_NAMES
            and t not in CLASS_IDS
            and level_kind(child.meta) == "tensordict"
        ):
            # a tensorclass entry saved as a plain TensorDict: the TensorClass-subclass bug
            # of 0.10-0.13, fixed in 0.14 (#1722)
            lo, hi = max(lo, 4), min(hi, 5)
    return lo, hi


def _has_unlisted_collection(node: VDir, leaves: list[str]) -> bool:
    """A sub-directory holding a collection that no entry of meta.json names."""
    leaf_names = set(leaves)
    for name, child in node.dirs.items():
        if name in leaf_names:
            continue  # a leaf key with "/" under legacy names, e.g. "a/b.memmap"
        if _holds_meta(child, depth=0):
            return True
    return False


def _holds_meta(node: VDir, depth: int) -> bool:
    if node.meta is not None or node.pt is not None:
        return True
    if depth > 64:
        return False
    return any(_holds_meta(c, depth + 1) for c in node.dirs.values())
