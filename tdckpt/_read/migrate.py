"""Migrations: discover the step scripts, check the chain, run it on a virtual tree.

``migrations/NNNN_<slug>.py`` (shipped in the wheel as ``tdckpt/_migrations``) holds one
script per pair of adjacent layout generations (format-notes.md §7). Each declares
``FROM_VERSION = k`` and ``TO_VERSION = k + 1`` (generation numbers: 1 = ``meta.pt``, ...,
8 = tensordict 0.15.3 format v1) and ``upgrade(tree, ctx) -> tree``, which rewrites the
virtual tree (:class:`~tdckpt._read.tree.VDir`) **in memory**: metadata dicts and directory
structure only. Scripts never write to disk, never unpickle, never rename key-named
files (the names stage, :mod:`tdckpt._read.names`, does that after the chain, guided by
``VDir.leaf_encoding``/``dir_encoding``), and import only the helper API below.

The runner works **per directory**: detection (:mod:`tdckpt._read.detect`) sets
``VDir.generation`` on every directory; step ``k -> k+1`` is given the whole tree and
rewrites the directories whose generation is ``k`` (:meth:`MigrationContext.targets`);
then those directories, and any the step created, are marked ``k+1``. A tree written by
one release (the normal case) thus runs the steps from its generation to G8 once each;
a tree whose directories differ still converges. A current-form (G8) tree runs no step
and does not even load the scripts.

The chain itself is checked by :func:`check_chain`, fed by a loader callable so it can
be tested without files (alembic's ``RevisionMap(generator)``).
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from tdckpt._keys import encode_key, legacy_components
from tdckpt._read.detect import (
    CLASS_IDS,
    CURRENT_GENERATION,
    LAZY_STACK_NAMES,
    NON_TENSOR_NAMES,
    TD_LIKE_NAMES,
    class_id_for,
    detect,
    entries_of,
    gen_name,
    gen_number,
    level_kind,
    parse_type,
    type_name,
)
from tdckpt._read.storage import Storage
from tdckpt._read.tree import VDir, VFile
from tdckpt._report import Problem
from tdckpt.errors import MigrationChainError, MigrationError

__all__ = [
    # the helper API for migration scripts (keep it small and stable)
    "CLASS_IDS",
    "CURRENT_GENERATION",
    "LAZY_STACK_NAMES",
    "LAZY_STACK_TYPE",
    "NON_TENSOR_NAMES",
    "NON_TENSOR_STACK_TYPE",
    "TD_LIKE_NAMES",
    "TENSORDICT_TYPE",
    "MigrationContext",
    "MigrationResult",
    "MigrationScript",
    "Problem",
    "Target",
    "VDir",
    "VFile",
    "check_chain",
    "child_type_name",
    "class_id_for",
    "default_scripts",
    "encode_key",
    "entries_of",
    "insert_entry",
    "legacy_components",
    "level_kind",
    "load_scripts",
    "migrate_tree",
    "migrations_dir",
    "parse_type",
    "type_name",
]

#: The ``_type`` strings tensordict writes for its built-in levels.
TENSORDICT_TYPE = "<class 'tensordict._td.TensorDict'>"
LAZY_STACK_TYPE = "<class 'tensordict._lazy.LazyStackedTensorDict'>"
NON_TENSOR_STACK_TYPE = "<class 'tensordict.tensorclass.NonTensorStack'>"

#: Fields of a TensorDict level that follow its entries, in tensordict's order.
_TD_FIELDS = ("shape", "device", "_type", "_format_version", "_class", "_names")

_SCRIPT_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.py$")


# -- scripts -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class MigrationScript:
    """One step of the chain.

    Attributes:
        name: the script's file stem, e.g. ``"0002_g2_list_children"``.
        from_version, to_version: generation numbers (``to == from + 1``).
        upgrade: ``upgrade(tree, ctx) -> tree``.
        doc: the first line of the script's docstring.
        path: where it was loaded from (None for scripts built in tests).
    """

    name: str
    from_version: int
    to_version: int
    upgrade: Callable[[VDir, MigrationContext], VDir]
    doc: str = ""
    path: Path | None = None


def migrations_dir() -> Path:
    """The folder of step scripts: the repository's ``migrations/`` or the wheel's copy."""
    here = Path(__file__).resolve().parents[1]  # the tdckpt package (this is tdckpt/_read)
    for candidate in (here / "_migrations", here.parent / "migrations"):
        if candidate.is_dir():
            return candidate
    raise MigrationChainError(
        f"no migration scripts found: neither {here / '_migrations'} (installed wheel) nor "
        f"{here.parent / 'migrations'} (source tree) exists. The installation is incomplete; "
        "reinstall tdckpt.",
        script=None,
    )


def _load_module(path: Path) -> ModuleType:
    """Import one script by path (alembic ``Script._from_path`` style), uncached."""
    module_name = f"tdckpt._migrations_loaded.{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise MigrationChainError(f"{path}: cannot be loaded as a Python module.", script=path.name)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise MigrationChainError(
            f"{path}: importing the migration script failed ({type(exc).__name__}: {exc}).",
            script=path.name,
        ) from exc
    return module


def script_from_module(module: ModuleType, name: str, path: Path | None = None) -> MigrationScript:
    """Read ``FROM_VERSION``/``TO_VERSION``/``upgrade`` off a loaded script."""
    where = str(path) if path is not None else name
    missing = [a for a in ("FROM_VERSION", "TO_VERSION", "upgrade") if not hasattr(module, a)]
    if missing:
        raise MigrationChainError(
            f"{where}: a migration script must define FROM_VERSION, TO_VERSION and "
            f"upgrade(tree, ctx); missing {', '.join(missing)}.",
            script=name,
        )
    frm, to = module.FROM_VERSION, module.TO_VERSION
    if not (isinstance(frm, int) and isinstance(to, int)) or isinstance(frm, bool):
        raise MigrationChainError(
            f"{where}: FROM_VERSION and TO_VERSION must be integers (generation numbers), "
            f"found {frm!r} and {to!r}.",
            script=name,
        )
    if to != frm + 1:
        raise MigrationChainError(
            f"{where}: steps go between adjacent generations; found FROM_VERSION={frm}, "
            f"TO_VERSION={to} (expected TO_VERSION={frm + 1}).",
            script=name,
        )
    doc = (module.__doc__ or "").strip().splitlines()
    return MigrationScript(name, frm, to, module.upgrade, doc[0] if doc else "", path)


def load_scripts(directory: str | Path) -> list[MigrationScript]:
    """Load every ``NNNN_<slug>.py`` of ``directory`` (other files are ignored)."""
    directory = Path(directory)
    scripts = []
    for path in sorted(directory.glob("*.py")):
        if not _SCRIPT_NAME.match(path.name):
            continue
        scripts.append(script_from_module(_load_module(path), path.stem, path))
    return scripts


def check_chain(
    loader: Callable[[], Iterable[MigrationScript]], *, current: int = CURRENT_GENERATION
) -> list[MigrationScript]:
    """Return the scripts as one chain ``1 -> 2 -> ... -> current``, or raise.

    Raises:
        MigrationChainError: a duplicate step, a gap, a chain that does not start at 1,
            or one that does not end at ``current``; the message names the scripts.
    """
    scripts = sorted(loader(), key=lambda s: (s.from_version, s.name))
    by_from: dict[int, MigrationScript] = {}
    for s in scripts:
        if s.from_version in by_from:
            other = by_from[s.from_version]
            raise MigrationChainError(
                f"duplicate migration step: {other.name} and {s.name} both go from "
                f"G{s.from_version}; keep exactly one script per step.",
                script=s.name,
                from_version=s.from_version,
                to_version=s.to_version,
            )
        by_from[s.from_version] = s
    names = ", ".join(s.name for s in scripts) or "none"
    if not scripts or scripts[0].from_version != 1:
        first = scripts[0].name if scripts else None
        raise MigrationChainError(
            f"the migration chain must start at G1 (tensordict's meta.pt layout); the first "
            f"script is {first or 'missing'} (scripts: {names}).",
            script=first,
            from_version=scripts[0].from_version if scripts else None,
            to_version=1,
        )
    for prev, nxt in itertools.pairwise(scripts):
        if nxt.from_version != prev.to_version:
            raise MigrationChainError(
                f"gap in the migration chain: {prev.name} ends at G{prev.to_version} but the "
                f"next script, {nxt.name}, starts at G{nxt.from_version}; a step "
                f"G{prev.to_version} -> G{prev.to_version + 1} is missing (scripts: {names}).",
                script=nxt.name,
                from_version=prev.to_version,
                to_version=nxt.from_version,
            )
    last = scripts[-1]
    if last.to_version != current:
        raise MigrationChainError(
            f"the migration chain ends at G{last.to_version} ({last.name}), not at the current "
            f"G{current} (tensordict format v1); a step is missing (scripts: {names}).",
            script=last.name,
            from_version=last.to_version,
            to_version=current,
        )
    return scripts


@functools.cache
def default_scripts() -> tuple[MigrationScript, ...]:
    """The checked chain from :func:`migrations_dir` (loaded once per process)."""
    directory = migrations_dir()
    return tuple(check_chain(lambda: load_scripts(directory)))


# -- the context scripts receive ---------------------------------------------------------------


@dataclass
class Target:
    """A directory a step rewrites, with where it sits in the tree."""

    node: VDir
    parent: VDir | None
    key: str | None  # the key naming it in the parent (None: root, lazy-stack member...)

    @property
    def where(self) -> str:
        return self.node.source or "."


@dataclass
class MigrationContext:
    """What a step may use besides the tree.

    Attributes:
        step_from: the generation number the running step starts from.
        lost: content the *writer* destroyed, as sentences naming the key.
        problems: what the step could not migrate (severity error) or wants known.
        styles: ``id(VDir)`` -> ``"compact"`` (orjson) / ``"spaced"`` (stdlib json).
        state: scratch space shared by the steps of one run.
    """

    step_from: int = 0
    lost: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    styles: dict[int, str] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)

    def targets(self, tree: VDir, *, order: str = "pre") -> list[Target]:
        """The directories at ``step_from``, parents first (``"pre"``) or last (``"post"``)."""
        want = gen_name(self.step_from)
        out: list[Target] = []
        stack: list[tuple[VDir, VDir | None, str | None, bool]] = [(tree, None, None, False)]
        while stack:
            node, parent, key, expanded = stack.pop()
            if order == "post" and not expanded:
                stack.append((node, parent, key, True))
                for name, child in reversed(list(node.dirs.items())):
                    stack.append((child, node, _key_for(node, name), False))
                continue
            if node.generation == want:
                out.append(Target(node, parent, key))
            if order == "pre":
                for name, child in reversed(list(node.dirs.items())):
                    stack.append((child, node, _key_for(node, name), False))
        return out

    def lose(self, target: Target | str, message: str) -> None:
        """Record content the writer destroyed (never silently)."""
        where = target if isinstance(target, str) else _describe(target)
        text = f"{where}: {message}"
        if text not in self.lost:
            self.lost.append(text)

    def problem(
        self, code: str, severity: str, target: Target, message: str, *, key: str | None = None
    ) -> None:
        k = key if key is not None else target.key
        self.problems.append(
            Problem(code, severity, target.node.source, (k,) if k else (), message)  # type: ignore[arg-type]
        )

    def is_compact(self, node: VDir) -> bool:
        """Whether the directory's meta.json was written by orjson (0.5 - 0.15.1)."""
        return self.styles.get(id(node)) == "compact"


def _key_for(parent: VDir, name: str) -> str:
    meta = parent.meta
    if meta and level_kind(meta) == "tensordict":
        if name in meta and isinstance(meta[name], dict):
            return name
        for key, value in meta.items():
            if isinstance(value, dict) and encode_key(key) == name:
                return key
    return name


def _describe(target: Target) -> str:
    source = target.node.source
    if not target.key:
        return f"{source}/" if source else "the root"
    if "/" in source or (source and source != target.key):
        return f"key {target.key!r} (in {source}/)"
    return f"key {target.key!r}"


# -- helpers for scripts -----------------------------------------------------------------------


def child_type_name(meta: dict[str, Any] | None) -> str:
    """The ``{"type": ...}`` a parent lists for a child: its class's bare ``__name__``."""
    return type_name(meta) or "TensorDict"


def insert_entry(meta: dict[str, Any], key: str, entry: dict[str, Any]) -> dict[str, Any]:
    """Return ``meta`` with ``key: entry`` added after the other entries, before the fields.

    tensordict writes a level's entries first and its fields (``shape``, ``device``,
    ``_type``, ...) last; keeping that order keeps the rewritten file like a real one.
    """
    out: dict[str, Any] = {}
    tail: dict[str, Any] = {}
    for k, v in meta.items():
        if k in _TD_FIELDS and not isinstance(v, dict):
            tail[k] = v
        else:
            out[k] = v
    out[key] = entry
    out.update(tail)
    return out


# -- running -----------------------------------------------------------------------------------


@dataclass
class MigrationResult:
    """The tree in current form and what it took.

    Attributes:
        tree: the same root object, rewritten in place.
        from_generation: the root's generation before the chain (``"G1"`` .. ``"G8"``).
        applied: names of the scripts that rewrote at least one directory, in order.
        lost: content the writer destroyed, one sentence each, naming the key.
        problems: what could not be migrated (errors) and notes (info).
    """

    tree: VDir
    from_generation: str
    applied: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)


def migrate_tree(
    root: VDir,
    *,
    storage: Storage | None = None,
    scripts: Iterable[MigrationScript] | None = None,
) -> MigrationResult:
    """Detect each directory's generation and run every step from there to G8.

    Args:
        root: the tree from :func:`tdckpt._read.tree.read_tree`; rewritten in place.
        storage: lets detection read the raw meta.json bytes (JSON spacing).
        scripts: the chain to run (default: the shipped ``migrations/``, checked).

    Raises:
        UnsupportedFormatError: a newer format, or no metadata at all (from detection).
        MigrationError: a step raised; the message names the script.
    """
    detection = detect(root, storage=storage)
    result = MigrationResult(tree=root, from_generation=detection.generation)
    if detection.consistent and detection.low == CURRENT_GENERATION:
        return result  # every directory is current: nothing to load, nothing to run
    pending = {
        gen_number(node.generation)
        for node in root.walk()
        if node.generation is not None and gen_number(node.generation) < CURRENT_GENERATION
    }
    if not pending:
        return result  # current form: nothing to load, nothing to run
    chain = check_chain(lambda: scripts) if scripts is not None else list(default_scripts())
    ctx = MigrationContext(styles=detection.styles)
    for script in chain:
        want = gen_name(script.from_version)
        if not any(node.generation == want for node in root.walk()):
            continue
        ctx.step_from = script.from_version
        try:
            new_root = script.upgrade(root, ctx)
        except MigrationError:
            raise
        except Exception as exc:
            raise MigrationError(
                f"{storage.display('') if storage else 'checkpoint'}: migration step "
                f"{script.name} (G{script.from_version} -> G{script.to_version}) failed: "
                f"{type(exc).__name__}: {exc}. This is a bug in tdckpt; please report it "
                "with `tdckpt inspect --json` output.",
                script=script.name,
                from_version=script.from_version,
                to_version=script.to_version,
            ) from exc
        if new_root is not root:
            raise MigrationError(
                f"migration step {script.name} returned a different root; steps rewrite the "
                "tree in place and return it.",
                script=script.name,
                from_version=script.from_version,
                to_version=script.to_version,
            )
        done = gen_name(script.to_version)
        for node in root.walk():
            if node.generation in (want, None):
                node.generation = done
        result.applied.append(script.name)
    result.lost = list(ctx.lost)
    result.problems = list(ctx.problems)
    return result


# scripts are loaded under this package name; make it importable for pickling of errors
sys.modules.setdefault("tdckpt._migrations_loaded", ModuleType("tdckpt._migrations_loaded"))
