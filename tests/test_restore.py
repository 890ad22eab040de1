"""Differential acceptance tests: tdckpt's restore against tensordict 0.15.3's own.

For every 0.14.3 and 0.15.3 fixture case (directories and ``.tdz`` archives) and for every kind
of target (fresh, memory-mapped and locked; default mode and ``mode="r"``),
``tdckpt.load_memmap_(target, prefix, allow_pickle=True)`` and tensordict's
``target2.load_memmap_(prefix2, allow_pickle=True)`` - on separate copies of the checkpoint and
separately built, identical targets - must leave the targets in the same state: keys (stale keys
removed at every level), values, dtypes, shapes, batch sizes, classes, leaf types and file names,
the identity of reused nested objects, lock and memmap state and memmap prefixes.
``tdckpt.load_memmap(prefix)`` must equal ``TensorDict.load_memmap(prefix)`` the same way.

Where tensordict is wrong (format-notes.md §4.2 / §4.3) the difference is listed in
``KNOWN_DIFFERENCES`` with the reason, and the test asserts tdckpt's behaviour instead.

Every restore is also read-only: the checkpoint's files hash the same before and after
(tensordict's own ``load_memmap_`` of a memory-mapped target re-serialises ``meta.json`` into the
checkpoint: shown in ``test_tensordict_rewrites_the_checkpoint_tdckpt_does_not``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from _expected import assert_matches_expected
from _restore_helpers import (
    STALE,
    diff_states,
    drop_empty_leaf_types,
    is_collection,
    make_target,
    objects,
    paths_with_key,
    reference,
    reused,
    settle_non_tensor_differences,
    state,
)
from _tdversion import (
    LOAD_MEMMAP__TAKES_MODE,
    TD_VERSION,
    WRITER_GENERATION,
    reference_load_kwargs,
)
from conftest import FixtureCase, case_id, copy_case, fixture_cases, tree_digest
from packaging.version import Version

tensordict = pytest.importorskip("tensordict")

import fixture_types  # noqa: E402,F401  (the corpus's tensorclass and pickled classes)
from tensordict import (  # noqa: E402
    LazyStackedTensorDict,
    NonTensorData,
    TensorDict,
    TensorDictBase,
    is_tensorclass,
)
from tensordict.memmap import MemoryMappedTensor  # noqa: E402

import tdckpt  # noqa: E402
from tdckpt.errors import RestoreError, TdckptError, ValidationError  # noqa: E402
from tdckpt.warnings import TdckptWarning  # noqa: E402

VERSIONS = ("0.14.3", "0.15.3")
CASES = fixture_cases(versions=VERSIONS)

#: Writer losses documented in the corpus README (JSON cannot hold NaN/inf/tuples exactly).
LOST: dict[str, tuple[str, ...]] = {"non_tensor_lossy": ("f_nan", "f_inf", "tuple")}


def _lost(fc: FixtureCase) -> tuple[str, ...]:
    return LOST.get(fc.name, ())


#: The cases whose writer (orjson, tensordict 0.5-0.15.1) had already lost what null / list
#: stand for; tdckpt says so once per restore, with a TdckptWarning at the caller's line.
WRITER_LOSS_WARNINGS = {("0.14.3", "non_tensor_json"), ("0.14.3", "non_tensor_lossy")}


@contextmanager
def writer_losses(fc: FixtureCase, *, fails: bool = False) -> Iterator[None]:
    """Expect tdckpt's one warning about what an older writer had already lost, if any."""
    if (fc.version, fc.name) not in WRITER_LOSS_WARNINGS or fails:
        yield
        return
    with pytest.warns(
        TdckptWarning,
        match=r"the tensordict release that wrote it had already lost some content: key .*: this "
        r"value holds null, written by orjson \(tensordict 0\.5-0\.15\.1\)",
    ) as rec:
        yield
    assert len(rec) == 1
    assert rec[0].filename == __file__, f"the warning points at {rec[0].filename}:{rec[0].lineno}"


# ------------------------------------------------------------------------ known differences
#
# Each entry: (case name, target kind or "*", mode or "*") -> why tensordict is wrong.
# The test then asserts what tdckpt does (see ``_assert_known_difference``).

TD_CANNOT_READ_FLOAT8 = (
    "tensordict 0.15.3 writes float8 leaves but cannot read them back (bare KeyError "
    "'torch.float8_e4m3fn', format-notes §4.3); tdckpt restores the bytes exactly"
)
TD_DROPS_KEYS_SILENTLY = (
    "written with robust_key=False, the keys 'a/b', '..' and '.' have no directory under the "
    "prefix that the default robust_key=True can find; tensordict silently drops them "
    "(format-notes §4.3, 'nested directory missing'), tdckpt refuses and names them"
)
TD_REMEMMAP_CRASHES = (
    "tensordict re-memmaps a memory-mapped target into the checkpoint with robust names, which "
    "collide with the legacy-named files it just mapped: RuntimeError 'A filename was provided "
    "but the tensor already has a file associated', target left half-loaded; tdckpt never "
    "re-memmaps"
)
TD_LAZY_STACK_UNLOCKED = (
    "tensordict's load_memmap_ never re-memmaps a lazy stack (the stack itself has no prefix), "
    "so a memory-mapped, locked stack ends unlocked and not memory-mapped although the data "
    "has a directory; tdckpt keeps the documented contract: memory-mapped on the loaded "
    "directory and locked"
)
TD_EMPTY_LEAF_REMEMMAPPED = (
    "zero-element leaves have no file; tensordict's memmap_() wraps them in MemoryMappedTensors "
    "naming files that do not exist; tdckpt leaves them plain tensors (nothing to map)"
)

# Two differences in the NonTensorData entries of a memory-mapped target, for every case:
TD_NTD_METADATA_BOOKKEEPING = (
    "tensordict re-memmaps the target, which stores its memmap bookkeeping ({'memmap_prefix': "
    "<ckpt>/<key>, 'memmaped': False, ...}) in each NonTensorData's _metadata field; tdckpt "
    "restores the _metadata the checkpoint holds"
)
TD_NTD_STALE_PREFIX = (
    "after an archive or mode='r', tensordict leaves each NonTensorData's memmap prefix "
    "pointing into the target's old directory although nothing is memory-mapped any more; "
    "tdckpt clears it, like the prefixes of the TensorDict levels (both agree on those)"
)

TD014_SET_REMEMMAP_CRASHES = (
    "tensordict 0.14 re-memmaps a memory-mapped target after loading, and its writer takes a "
    "set for JSON, then fails: TypeError 'Type is not JSON serializable: set' (format-notes, "
    "0.15.0 pickles sets), target left half-loaded; tdckpt never re-memmaps"
)

TD014_LAZY_STACK_ANONYMOUS = (
    "tensordict 0.14's load_memmap_ re-memmaps a memory-mapped, locked lazy stack, but into "
    "anonymous memory: its members end locked and memory-mapped with no prefix, their leaves "
    "with no file; tdckpt keeps them on the loaded directory's files"
)

TD014_ARCHIVE_REMEMMAPPED = (
    "tensordict 0.14's load_memmap_ re-memmaps a memory-mapped target after loading an "
    "archive: its leaves become MemoryMappedTensors outside the checkpoint, and each "
    "NonTensorData's _metadata records the re-memmap ({'_share_non_tensor': False}); tdckpt "
    "restores plain tensors (an archive maps nothing) and the _metadata the checkpoint holds"
)


KNOWN_DIFFERENCES: dict[tuple[str, str, str], str] = {
    ("float8_dtypes", "*", "*"): TD_CANNOT_READ_FLOAT8,
    ("odd_nested__robust_false", "*", "*"): TD_DROPS_KEYS_SILENTLY,
    ("odd_keys__robust_false", "memmapped", "None"): TD_REMEMMAP_CRASHES,
    ("lazy_stack", "memmapped", "None"): TD_LAZY_STACK_UNLOCKED,
    ("zero_numel", "memmapped", "None"): TD_EMPTY_LEAF_REMEMMAPPED,
}


def reference_mode(mode: str | None, prefix: Path) -> str | None:
    """How tensordict's own ``load_memmap_`` maps when asked for tdckpt's ``mode``: the same
    on 0.15; on 0.14 (no ``mode`` argument) shared for a directory, copy-on-write for an
    archive, whatever was asked."""
    if LOAD_MEMMAP__TAKES_MODE:
        return mode
    return None if prefix.is_dir() else "r"


def known_difference(
    name: str, kind: str, mode: str | None, prefix: Path | None = None, version: str | None = None
) -> str | None:
    """Why tensordict differs from tdckpt for this case, or None. With ``prefix``, ``mode`` is
    the mode tdckpt is asked for and the difference is that of tensordict's in-place loader
    (which maps as :func:`reference_mode`)."""
    if prefix is not None:
        mode = reference_mode(mode, prefix)
        if (
            not LOAD_MEMMAP__TAKES_MODE
            and (name, kind) == ("non_tensor_pickle", "memmapped")
            and (version is None or Version(version) >= Version("0.15"))
        ):
            return TD014_SET_REMEMMAP_CRASHES  # a 0.14 checkpoint holds no set
        if not LOAD_MEMMAP__TAKES_MODE and kind == "memmapped" and not prefix.is_dir():
            return TD014_ARCHIVE_REMEMMAPPED
    for (n, k, m), why in KNOWN_DIFFERENCES.items():
        if why == TD_LAZY_STACK_UNLOCKED and not LOAD_MEMMAP__TAKES_MODE:
            why = TD014_LAZY_STACK_ANONYMOUS  # 0.14 re-memmaps the stack, to no file
        if n == name and k in ("*", kind) and m in ("*", str(mode)):
            return why
    return None


# --------------------------------------------------------------------------------- helpers


def _content(fc: FixtureCase, tmp_path: Path) -> Any:
    """What the checkpoint holds, loaded from a scratch copy (the shape of the targets)."""
    prefix = copy_case(tmp_path / "content", fc)
    if known_difference(fc.name, "fresh", None) == TD_CANNOT_READ_FLOAT8:
        with writer_losses(fc):
            return tdckpt.load_memmap(prefix)
    with reference():
        return TensorDict.load_memmap(prefix, allow_pickle=True)


@dataclass
class Side:
    """One side of a differential run: its own checkpoint copy, target and own memmap dir."""

    root: Path
    prefix: Path
    target: Any
    own: Path | None
    before: dict[tuple[Any, ...], Any] = field(default_factory=dict)
    digest: dict[str, str] = field(default_factory=dict)
    own_digest: dict[str, str] = field(default_factory=dict)
    result: Any = None
    error: BaseException | None = None

    @classmethod
    def make(cls, fc: FixtureCase, root: Path, content: Any, kind: str) -> Side:
        prefix = copy_case(root, fc)
        target = make_target(content)
        own = None
        if kind == "memmapped":
            own = root / "own"
            with reference():  # tensordict's own memmap_ (nested-tensor prototype warning)
                target.memmap_(str(own))
            assert target.is_locked
        side = cls(root, prefix, target, own)
        side.before = objects(target)
        side.digest = tree_digest(prefix)
        side.own_digest = tree_digest(own) if own is not None else {}
        return side

    def run(self, call: Callable[[Any, Path], Any]) -> None:
        try:
            self.result = call(self.target, self.prefix)
        except Exception as exc:
            self.error = exc

    def state(self, *, memmap: bool = True) -> Any:
        roots = [(self.prefix, "<ckpt>")]
        if self.own is not None:
            roots.append((self.own, "<own>"))
        return state(self.target, *roots, memmap=memmap)


def _tdckpt_call(mode: str | None) -> Callable[[Any, Path], Any]:
    return lambda target, prefix: tdckpt.load_memmap_(target, prefix, allow_pickle=True, mode=mode)


def _tensordict_call(mode: str | None) -> Callable[[Any, Path], Any]:
    """tensordict's own ``load_memmap_`` mapping as tdckpt's ``mode`` does, where the
    installed tensordict can (see :func:`_exact`); else with that tensordict's default."""

    def call(target: Any, prefix: Path) -> Any:
        kwargs = reference_load_kwargs(mode, prefix, in_place=True) or {}
        with reference():
            return target.load_memmap_(prefix, allow_pickle=True, **kwargs)

    return call


def _exact(mode: str | None, prefix: Path, *, in_place: bool) -> bool:
    """Whether tensordict's own loader maps as ``mode`` (so the lock / memmap state and the
    files of the two results are compared too, not only their contents). tensordict 0.14
    has no copy-on-write directory and no ``mode`` for ``load_memmap_``: there tdckpt's own
    contract (:func:`_assert_tdckpt_contract`) checks the mode, and the contents are
    compared with what 0.14 loads."""
    return reference_load_kwargs(mode, prefix, in_place=in_place) is not None


def _td_levels(obj: Any) -> list[Any]:
    """The TensorDict levels of ``obj`` (through tensorclasses and lazy stacks)."""
    return [
        o
        for o in objects(obj).values()
        if isinstance(o, TensorDictBase)
        and not isinstance(o, (LazyStackedTensorDict, NonTensorData))
        and not is_tensorclass(o)
    ]


def _leaves(obj: Any) -> dict[tuple[Any, ...], torch.Tensor]:
    return {p: o for p, o in objects(obj).items() if isinstance(o, torch.Tensor)}


def _assert_tdckpt_contract(side: Side, fc: FixtureCase, kind: str, mode: str | None) -> None:
    """What tdckpt's in-place restore guarantees, whatever tensordict does."""
    assert side.error is None, f"tdckpt failed: {side.error!r}"
    assert side.result is side.target
    assert paths_with_key(side.target, STALE) == []
    assert paths_with_key(side.target, f"{STALE}_nested") == []
    assert_matches_expected(side.target, fc.expected, lost=_lost(fc))
    # Every collection present before and after is the same object; no leaf is reused.
    after = objects(side.target)
    for path, obj in after.items():
        old = side.before.get(path)
        if is_collection(obj) and is_collection(old) and type(old) is type(obj):
            assert old is obj, f"{path}: the nested {type(obj).__name__} was replaced"
        if isinstance(obj, torch.Tensor) and obj.numel():
            assert obj is not old, f"{path}: the old leaf object was kept"
    # Read-only: the checkpoint is byte for byte the same, and so is the target's old directory.
    assert tree_digest(side.prefix) == side.digest, "tdckpt wrote to the checkpoint"
    if side.own is not None:
        assert tree_digest(side.own) == side.own_digest, "tdckpt touched the target's old files"
    # Lock and memmap state.
    directory = side.prefix.is_dir()
    keeps_dir = directory and mode != "r"
    for level in _td_levels(side.target):
        if kind == "memmapped" and keeps_dir:
            assert level.is_locked and level.is_memmap()
        else:
            assert not level.is_locked and not level.is_memmap()
        if keeps_dir:
            assert level._memmap_prefix is not None
            assert Path(level._memmap_prefix).resolve().is_relative_to(side.prefix.resolve())
        else:
            assert level._memmap_prefix is None
    # NonTensorData entries follow their level (tensordict's memmap_() flags them too).
    for obj in objects(side.target).values():
        if isinstance(obj, NonTensorData):
            memmapped = kind == "memmapped" and keeps_dir
            assert obj.is_memmap() == memmapped and obj.is_locked == memmapped
            if not keeps_dir:
                assert obj._tensordict._memmap_prefix is None
    # Leaf types: directories give MemoryMappedTensors on the checkpoint's files.
    for path, leaf in _leaves(side.target).items():
        if not directory:
            assert not isinstance(leaf, MemoryMappedTensor), path
        elif leaf.numel():
            assert isinstance(leaf, MemoryMappedTensor), path
            assert Path(leaf.filename).resolve().is_relative_to(side.prefix.resolve()), path
            if TD_VERSION is not None and TD_VERSION.release >= (0, 15):  # 0.14 records none
                assert leaf._mode == mode
            else:
                assert "_mode" not in vars(leaf), path  # the attributes 0.14's leaves have


def _assert_known_difference(
    why: str, ours: Side, theirs: Side, fc: FixtureCase, kind: str, mode: str | None
) -> None:
    if why == TD_DROPS_KEYS_SILENTLY:
        if kind == "memmapped" and reference_mode(mode, theirs.prefix) is None:
            # dropped, then TD_REMEMMAP_CRASHES on top
            assert isinstance(theirs.error, RuntimeError)
            assert "already has a file associated" in str(theirs.error)
        else:
            assert theirs.error is None
            assert {"a/b", "..", "."}.isdisjoint(theirs.target.keys()), "tensordict got stricter"
        assert isinstance(ours.error, ValidationError)
        for encoded in ("a%2Fb", "%2E%2E", "%2E"):
            assert encoded in str(ours.error)
        assert "nothing was changed" in str(ours.error)
        # all or nothing: the target is exactly as before, the checkpoint untouched
        assert objects(ours.target).keys() == ours.before.keys()
        assert all(objects(ours.target)[p] is o for p, o in ours.before.items())
        assert tree_digest(ours.prefix) == ours.digest
        return
    _assert_tdckpt_contract(ours, fc, kind, mode)
    if why == TD_CANNOT_READ_FLOAT8:
        assert isinstance(theirs.error, KeyError) and "float8" in str(theirs.error)
    elif why == TD_REMEMMAP_CRASHES:
        assert isinstance(theirs.error, RuntimeError)
        assert "already has a file associated" in str(theirs.error)
    elif why == TD014_SET_REMEMMAP_CRASHES:
        assert isinstance(theirs.error, TypeError)
        assert "not JSON serializable: set" in str(theirs.error)
    elif why == TD_LAZY_STACK_UNLOCKED:
        assert theirs.error is None
        assert not theirs.target.is_locked and not theirs.target.is_memmap()
        assert ours.target.is_locked and ours.target.is_memmap()
        assert ours.state(memmap=False) == theirs.state(memmap=False)
    elif why == TD014_ARCHIVE_REMEMMAPPED:
        assert theirs.error is None
        theirs_leaves = [t for t in _leaves(theirs.target).values() if t.numel()]
        assert theirs_leaves and all(isinstance(t, MemoryMappedTensor) for t in theirs_leaves)
        exact = _exact(mode, theirs.prefix, in_place=True)
        differences = diff_states(ours.state(memmap=exact), theirs.state(memmap=exact))
        assert differences, "tensordict 0.14 no longer re-memmaps: drop this difference"
        for d in differences:  # only what a MemoryMappedTensor (on no file) adds
            assert (
                d.endswith("/leaf: 'Tensor' != 'MemoryMappedTensor'")
                or re.search(r"/(filename|mode|handler): '<absent>' != ", d)
                or re.search(r"/(is_memmap|is_locked|locked|memmap): False != True$", d)
                or ("/metadata/" in d and ("_share_non_tensor" in d or "NoneType" in d))
            ), d
    elif why == TD014_LAZY_STACK_ANONYMOUS:
        assert theirs.error is None
        for member in theirs.target.tensordicts:
            assert member.is_memmap() and member._memmap_prefix is None
        assert all(
            isinstance(t, MemoryMappedTensor) and t._filename is None
            for t in _leaves(theirs.target).values()
        )
        assert ours.state(memmap=False) == theirs.state(memmap=False)
    elif why == TD_EMPTY_LEAF_REMEMMAPPED:
        assert theirs.error is None
        empty = [p for p, t in _leaves(theirs.target).items() if not t.numel()]
        assert empty and all(
            isinstance(_leaves(theirs.target)[p], MemoryMappedTensor) for p in empty
        )
        assert not any(os.path.exists(_leaves(theirs.target)[p].filename) for p in empty)
        assert all(type(_leaves(ours.target)[p]) is torch.Tensor for p in empty)
        exact = _exact(mode, theirs.prefix, in_place=True)
        ours_state, theirs_state = ours.state(memmap=exact), theirs.state(memmap=exact)
        drop_empty_leaf_types(ours_state)
        drop_empty_leaf_types(theirs_state)
        assert ours_state == theirs_state
    else:  # pragma: no cover
        raise AssertionError(why)


# ------------------------------------------------------------------ load_memmap_ (in place)


@pytest.mark.parametrize("mode", [None, "r"], ids=["mode=None", "mode=r"])
@pytest.mark.parametrize("kind", ["fresh", "memmapped"])
@pytest.mark.parametrize("fc", CASES, ids=case_id)
def test_load_memmap__matches_tensordict(
    fc: FixtureCase, kind: str, mode: str | None, tmp_path: Path
) -> None:
    content = _content(fc, tmp_path)
    ours = Side.make(fc, tmp_path / "tdckpt", content, kind)
    theirs = Side.make(fc, tmp_path / "tensordict", content, kind)
    assert ours.state() == theirs.state(), "the two targets must start identical"

    why = known_difference(fc.name, kind, mode, ours.prefix, fc.version)
    with writer_losses(fc, fails=why == TD_DROPS_KEYS_SILENTLY):
        ours.run(_tdckpt_call(mode))
    theirs.run(_tensordict_call(mode))

    if why is not None:
        _assert_known_difference(why, ours, theirs, fc, kind, mode)
        return
    assert theirs.error is None, f"tensordict failed: {theirs.error!r}"
    _assert_tdckpt_contract(ours, fc, kind, mode)
    exact = _exact(mode, theirs.prefix, in_place=True)
    ours_state, theirs_state = ours.state(memmap=exact), theirs.state(memmap=exact)
    settle_non_tensor_differences(
        ours_state,
        theirs_state,
        kind,
        ours.prefix.is_dir() and reference_mode(mode, theirs.prefix) != "r",
    )
    differences = diff_states(ours_state, theirs_state)
    assert not differences, "\n".join(differences)
    assert reused(ours.before, ours.target) == reused(theirs.before, theirs.target)


# -------------------------------------------------------------------- load_memmap (new object)


@pytest.mark.parametrize("mode", [None, "r"], ids=["mode=None", "mode=r"])
@pytest.mark.parametrize("fc", CASES, ids=case_id)
def test_load_memmap_matches_tensordict(fc: FixtureCase, mode: str | None, tmp_path: Path) -> None:
    ours_prefix = copy_case(tmp_path / "tdckpt", fc)
    theirs_prefix = copy_case(tmp_path / "tensordict", fc)
    digest = tree_digest(ours_prefix)

    why = known_difference(fc.name, "new", mode)
    if why == TD_DROPS_KEYS_SILENTLY:
        with pytest.raises(ValidationError, match=r"a%2Fb"):
            tdckpt.load_memmap(ours_prefix, allow_pickle=True, mode=mode)
        with reference():
            theirs = TensorDict.load_memmap(
                theirs_prefix,
                allow_pickle=True,
                **(reference_load_kwargs(mode, theirs_prefix, in_place=False) or {}),
            )
        assert {"a/b", "..", "."}.isdisjoint(theirs.keys())
        assert tree_digest(ours_prefix) == digest
        return
    with writer_losses(fc):
        ours = tdckpt.load_memmap(ours_prefix, allow_pickle=True, mode=mode)
    assert tree_digest(ours_prefix) == digest
    assert_matches_expected(ours, fc.expected, lost=_lost(fc))
    if why == TD_CANNOT_READ_FLOAT8:
        with reference(), pytest.raises(KeyError, match="float8"):
            TensorDict.load_memmap(
                theirs_prefix,
                allow_pickle=True,
                **(reference_load_kwargs(mode, theirs_prefix, in_place=False) or {}),
            )
        return
    kwargs = reference_load_kwargs(mode, theirs_prefix, in_place=False)
    with reference():
        theirs = TensorDict.load_memmap(theirs_prefix, allow_pickle=True, **(kwargs or {}))
    exact = kwargs is not None
    assert state(ours, (ours_prefix, "<ckpt>"), memmap=exact) == state(
        theirs, (theirs_prefix, "<ckpt>"), memmap=exact
    )


# ------------------------------------------------------------------------ read-only restores


def test_tensordict_rewrites_the_checkpoint_tdckpt_does_not(tmp_path: Path) -> None:
    """format-notes §4.2: re-memmapping a memory-mapped target re-serialises meta.json."""
    # a checkpoint the installed writer spells differently (0.14 rewrites 0.14.3 files as
    # they are: the 0.15.3 ones then show the rewrite)
    version = "0.15.3" if WRITER_GENERATION == "G6" else "0.14.3"
    fc = next(c for c in fixture_cases(versions=[version]) if c.name == "nested")
    content = _content(fc, tmp_path)
    ours = Side.make(fc, tmp_path / "tdckpt", content, "memmapped")
    theirs = Side.make(fc, tmp_path / "tensordict", content, "memmapped")

    with writer_losses(fc):
        ours.run(_tdckpt_call(None))
    theirs.run(_tensordict_call(None))

    assert ours.error is None and theirs.error is None
    assert tree_digest(ours.prefix) == ours.digest
    after = tree_digest(theirs.prefix)
    rewritten = sorted(p for p in after if after[p] != theirs.digest.get(p))
    # tensordict rewrote every meta.json (0.14.3 orjson -> 0.15.3 format, or back) and no
    # data file.
    assert rewritten == sorted(p for p in theirs.digest if p.endswith("meta.json"))
    assert all(p in theirs.digest for p in after), "tensordict added files"
    # The restored contents agree nevertheless (the state includes lock and memmap state).
    assert ours.state() == theirs.state()


@pytest.mark.parametrize(
    "setup",
    ["fresh", "memmapped", "mode=r", "mode=r+", "memmapped+mode=r"],
)
def test_restore_reads_only(setup: str, tmp_path: Path) -> None:
    """Every restore leaves every file of a directory checkpoint as it was (and adds none)."""
    fc = next(c for c in fixture_cases(versions=["0.15.3"]) if c.name == "tensorclass_in_td")
    content = _content(fc, tmp_path)
    side = Side.make(fc, tmp_path / "x", content, "memmapped" if "memmapped" in setup else "fresh")
    mode = setup.partition("mode=")[2] or None
    tdckpt.load_memmap_(side.target, side.prefix, allow_pickle=True, mode=mode)
    tdckpt.load_memmap(side.prefix, allow_pickle=True, mode=mode)
    assert tree_digest(side.prefix) == side.digest
    if side.own is not None:
        assert tree_digest(side.own) == side.own_digest


def test_truncated_leaf_is_refused_not_grown(tmp_path: Path) -> None:
    """tensordict grows a short file with zeros (format-notes §4.3); tdckpt refuses, reads only."""
    fc = next(c for c in fixture_cases(versions=["0.15.3"]) if c.name == "flat")
    prefix = copy_case(tmp_path, fc)
    leaf = prefix / "f32.memmap"
    leaf.write_bytes(leaf.read_bytes()[:6])
    digest = tree_digest(prefix)
    target = TensorDict(f32=torch.zeros(3), batch_size=[3])
    with pytest.raises(ValidationError, match=r"f32\.memmap.*6 bytes"):
        tdckpt.load_memmap_(target, prefix, allow_pickle=True)
    assert tree_digest(prefix) == digest
    assert leaf.stat().st_size == 6


# ---------------------------------------------------------------- targets, kinds and objects


def _write(tmp_path: Path, td: Any, name: str = "ckpt") -> Path:
    prefix = tmp_path / name
    td.memmap(prefix)
    return prefix


def _pair(tmp_path: Path, td: Any) -> tuple[Path, Path]:
    return _write(tmp_path, td, "ours"), _write(tmp_path, td, "theirs")


def test_returns_the_target_and_reuses_nested_objects(tmp_path: Path) -> None:
    saved = TensorDict(
        a=torch.arange(3.0),
        nested=TensorDict(
            b=torch.ones(3, 2), deeper=TensorDict(c=torch.zeros(3), batch_size=[3]), batch_size=[3]
        ),
        batch_size=[3],
    )
    p = _write(tmp_path, saved)
    target = TensorDict(
        a=torch.zeros(3),
        stale=torch.zeros(3),
        nested=TensorDict(
            b=torch.zeros(3, 2),
            old=torch.zeros(3),
            deeper=TensorDict(c=torch.ones(3), x=torch.ones(3), batch_size=[3]),
            batch_size=[3],
        ),
        batch_size=[3],
    )
    nested, deeper, old_a = target["nested"], target["nested", "deeper"], target["a"]
    out = tdckpt.load_memmap_(target, p)
    assert out is target
    assert target["nested"] is nested and target["nested", "deeper"] is deeper
    assert set(target.keys(include_nested=True, leaves_only=True)) == {
        "a",
        ("nested", "b"),
        ("nested", "deeper", "c"),
    }
    assert target["a"] is not old_a and old_a.eq(0).all(), "the old leaf storage is not written"
    assert target["a"].tolist() == [0.0, 1.0, 2.0]


def test_leaf_and_nested_swap_kinds_like_tensordict(tmp_path: Path) -> None:
    """format-notes §4.2: a nested TD where the save has a leaf (and vice versa) is replaced."""
    saved = TensorDict(
        x=torch.ones(2), y=TensorDict(z=torch.ones(2), batch_size=[2]), batch_size=[2]
    )
    ours_p, theirs_p = _pair(tmp_path, saved)

    def target() -> TensorDict:
        return TensorDict(
            x=TensorDict(q=torch.zeros(2), batch_size=[2]), y=torch.zeros(2), batch_size=[2]
        )

    ours, theirs = target(), target()
    tdckpt.load_memmap_(ours, ours_p)
    with reference():
        theirs.load_memmap_(theirs_p)
    assert state(ours, (ours_p, "<ckpt>")) == state(theirs, (theirs_p, "<ckpt>"))
    assert isinstance(ours["x"], MemoryMappedTensor) and isinstance(ours["y"], TensorDict)


def test_target_device_is_kept_like_tensordict(tmp_path: Path) -> None:
    saved = TensorDict(a=torch.arange(3), batch_size=[3])
    ours_p, theirs_p = _pair(tmp_path, saved)
    ours = TensorDict(a=torch.zeros(3), batch_size=[3], device="cpu")
    theirs = TensorDict(a=torch.zeros(3), batch_size=[3], device="cpu")
    tdckpt.load_memmap_(ours, ours_p)
    with reference():
        theirs.load_memmap_(theirs_p)
    assert state(ours, (ours_p, "<ckpt>")) == state(theirs, (theirs_p, "<ckpt>"))
    assert ours.device == torch.device("cpu") and isinstance(ours["a"], MemoryMappedTensor)


def test_target_names_and_batch_are_kept(tmp_path: Path) -> None:
    saved = TensorDict(a=torch.arange(6).reshape(3, 2), batch_size=[3], names=["t"])
    ours_p, theirs_p = _pair(tmp_path, saved)
    ours = TensorDict(a=torch.zeros(3), batch_size=[3], names=["time"])
    theirs = TensorDict(a=torch.zeros(3), batch_size=[3], names=["time"])
    tdckpt.load_memmap_(ours, ours_p)
    with reference():
        theirs.load_memmap_(theirs_p)
    # "The batch size, names and device of out are never updated from the file" (§4.1).
    assert ours.names == theirs.names == ["time"]
    assert state(ours, (ours_p, "<ckpt>")) == state(theirs, (theirs_p, "<ckpt>"))


def test_plain_dict_target(tmp_path: Path) -> None:
    saved = TensorDict(
        a=torch.arange(3), n=TensorDict(b=torch.ones(3), batch_size=[3]), batch_size=[3]
    )
    p = _write(tmp_path, saved)
    inner: dict[str, Any] = {"b": torch.zeros(3), "old": 1}
    target: dict[str, Any] = {"a": torch.zeros(3), "n": inner, "stale": torch.zeros(1)}
    out = tdckpt.load_memmap_(target, p)
    assert out is target and target["n"] is inner
    assert sorted(target) == ["a", "n"] and sorted(inner) == ["b"]
    assert target["a"].tolist() == [0, 1, 2] and inner["b"].tolist() == [1.0, 1.0, 1.0]


def test_lazy_stack_checkpoint_into_a_tensordict_is_refused(tmp_path: Path) -> None:
    """tensordict silently loads nothing (format-notes §4.2: the data goes into temporary unbind
    pieces): no error, the target keeps its old values and its stale keys."""
    saved = LazyStackedTensorDict(
        TensorDict(a=torch.ones(2)), TensorDict(a=torch.zeros(3)), stack_dim=0
    )
    ours_p, theirs_p = _pair(tmp_path, saved)
    ours = TensorDict(a=torch.full((2, 2), 5.0), stale=torch.ones(2), batch_size=[2])
    theirs = TensorDict(a=torch.full((2, 2), 5.0), stale=torch.ones(2), batch_size=[2])
    with reference():
        out = theirs.load_memmap_(theirs_p)
    assert out is theirs and sorted(theirs.keys()) == ["a", "stale"], "tensordict got stricter"
    assert theirs["a"].eq(5).all(), "tensordict now loads something"
    before = objects(ours)
    with pytest.raises(RestoreError, match=r"lazy stack of 2 tensordicts.*load nothing"):
        tdckpt.load_memmap_(ours, ours_p)
    assert objects(ours).keys() == before.keys()
    assert all(objects(ours)[p] is o for p, o in before.items())


def test_batch_mismatch_is_refused(tmp_path: Path) -> None:
    """tensordict accepts it and leaves batch [5] with a leaf of shape (3,) (format-notes §4.2)."""
    saved = TensorDict(a=torch.arange(3), batch_size=[3])
    ours_p, theirs_p = _pair(tmp_path, saved)
    ours = TensorDict(a=torch.zeros(5), batch_size=[5])
    theirs = TensorDict(a=torch.zeros(5), batch_size=[5])
    with reference():
        theirs.load_memmap_(theirs_p)
    assert theirs.batch_size == (5,) and theirs["a"].shape == (3,), "tensordict got stricter"
    a = ours["a"]
    with pytest.raises(RestoreError, match=r"shape \[3\].*batch size \[5\]"):
        tdckpt.load_memmap_(ours, ours_p)
    assert ours["a"] is a and ours.batch_size == (5,)


def test_locked_memmapped_target_is_relocked_on_the_checkpoint(tmp_path: Path) -> None:
    saved = TensorDict(
        a=torch.arange(3), n=TensorDict(b=torch.ones(3), batch_size=[3]), batch_size=[3]
    )
    p = _write(tmp_path, saved)
    target = TensorDict(
        a=torch.zeros(3), n=TensorDict(b=torch.zeros(3), batch_size=[3]), batch_size=[3]
    )
    target.memmap_(tmp_path / "own")
    own_files = tree_digest(tmp_path / "own")
    tdckpt.load_memmap_(target, p)
    assert target.is_locked and target.is_memmap() and target["n"].is_locked
    assert Path(target._memmap_prefix) == p and Path(target["n"]._memmap_prefix) == p / "n"
    assert Path(target.saved_path) == p
    assert tree_digest(tmp_path / "own") == own_files, "the old directory is left as it was"
    with pytest.raises(RuntimeError, match="locked"):
        target["new"] = torch.zeros(3)


def test_archive_into_memmapped_target_leaves_it_unlocked(tmp_path: Path) -> None:
    saved = TensorDict(a=torch.arange(3), batch_size=[3])
    archive = tmp_path / "ckpt.tdz"
    with reference():
        saved.save(archive)
    digest = tree_digest(archive)
    target = TensorDict(a=torch.zeros(3), batch_size=[3])
    target.memmap_(tmp_path / "own")
    tdckpt.load_memmap_(target, archive)
    assert not target.is_locked and not target.is_memmap() and target._memmap_prefix is None
    assert type(target["a"]) is torch.Tensor and target["a"].tolist() == [0, 1, 2]
    assert tree_digest(archive) == digest


@pytest.mark.parametrize("source", ["directory", "mode=r", "archive"])
def test_memmapped_lazy_stack_target_state(source: str, tmp_path: Path) -> None:
    """A memory-mapped lazy stack follows the contract for every source.

    Directory: memory-mapped on the checkpoint and locked (tensordict leaves it unlocked, see
    TD_LAZY_STACK_UNLOCKED). Archive or mode="r": unlocked and no longer memory-mapped, as
    tensordict.
    """

    def stack() -> LazyStackedTensorDict:
        return LazyStackedTensorDict(
            TensorDict(a=torch.ones(2), batch_size=[2]),
            TensorDict(a=torch.ones(2) * 2, b=torch.zeros(2), batch_size=[2]),
            stack_dim=0,
        )

    prefix = tmp_path / ("ckpt.tdz" if source == "archive" else "ckpt")
    with reference():
        stack().memmap(prefix)
    mode = "r" if source == "mode=r" else None
    ours, theirs = stack(), stack()
    ours.memmap_(tmp_path / "own_ours")
    theirs.memmap_(tmp_path / "own_theirs")
    members = list(ours.tensordicts)
    tdckpt.load_memmap_(ours, prefix, mode=mode)
    with reference():
        theirs.load_memmap_(prefix, **(reference_load_kwargs(mode, prefix, in_place=True) or {}))
    exact = _exact(mode, prefix, in_place=True)
    assert list(ours.tensordicts) == members and all(
        a is b for a, b in zip(ours.tensordicts, members, strict=True)
    )
    if source == "directory":
        assert ours.is_locked and ours.is_memmap()
        assert [Path(m._memmap_prefix) for m in ours.tensordicts] == [prefix / "0", prefix / "1"]
        assert state(ours, memmap=False) == state(theirs, memmap=False)
    else:
        assert not ours.is_locked and not ours.is_memmap()
        assert all(m._memmap_prefix is None for m in ours.tensordicts)
        differences = diff_states(
            state(ours, (prefix, "<ckpt>"), memmap=exact),
            state(theirs, (prefix, "<ckpt>"), memmap=exact),
        )
        if not LOAD_MEMMAP__TAKES_MODE and source == "archive":
            # TD014_ARCHIVE_REMEMMAPPED: 0.14 re-memmaps the stack's members after an
            # archive, to MemoryMappedTensors on no file; tdckpt's leaves are plain tensors
            assert differences
            assert all(d.endswith("/leaf: 'Tensor' != 'MemoryMappedTensor'") for d in differences)
            differences = []
        assert not differences, "\n".join(differences)


@pytest.mark.parametrize("mode", [None, "r"], ids=["mode=None", "mode=r"])
def test_memmapped_target_gains_new_entries_in_the_same_state(
    mode: str | None, tmp_path: Path
) -> None:
    """Entries the target lacks (a nested level holding non-tensor data) are built new; they
    end in the same lock / memmap state as everything else, as tensordict's memmap_() leaves
    them."""
    saved = TensorDict(
        a=torch.ones(2), n=TensorDict(b=torch.ones(2), batch_size=[2]), batch_size=[2]
    )
    saved["n"].set_non_tensor("s", "new")
    saved.set_non_tensor("t", "top")
    ours_p, theirs_p = _pair(tmp_path, saved)
    ours, theirs = (TensorDict(a=torch.zeros(2), batch_size=[2]) for _ in range(2))
    ours.memmap_(tmp_path / "own_ours")
    theirs.memmap_(tmp_path / "own_theirs")
    tdckpt.load_memmap_(ours, ours_p, mode=mode)
    with reference():
        theirs.load_memmap_(
            theirs_p, **(reference_load_kwargs(mode, theirs_p, in_place=True) or {})
        )
    keeps_dir = mode != "r"
    exact = _exact(mode, theirs_p, in_place=True)
    roots = ((ours_p, "<ckpt>"), (tmp_path / "own_ours", "<own>"))
    ours_state = state(ours, *roots, memmap=exact)
    theirs_state = state(
        theirs, (theirs_p, "<ckpt>"), (tmp_path / "own_theirs", "<own>"), memmap=exact
    )
    # new entries: no old prefix for tensordict to leave behind; tensordict 0.14 (no mode)
    # keeps the directory, so it re-memmaps and records its bookkeeping for mode="r" too
    if keeps_dir or reference_mode(mode, theirs_p) != "r":
        settle_non_tensor_differences(ours_state, theirs_state, "memmapped", True)
    differences = diff_states(ours_state, theirs_state)
    assert not differences, "\n".join(differences)
    assert ours["n"]._tensordict["s"].is_memmap() == keeps_dir


def test_zero_element_key_named_like_another_keys_file(tmp_path: Path) -> None:
    saved = TensorDict({".": torch.tensor(1.0), "%2E": torch.zeros(0)}, batch_size=[])
    ours_p, theirs_p = _pair(tmp_path, saved)
    assert sorted(os.listdir(ours_p)) == ["%2E.memmap", "meta.json"]
    with reference():
        theirs = TensorDict.load_memmap(theirs_p)
    assert tdckpt.load_memmap(ours_p, robust_key=None)["%2E"].shape == (0,)
    ours = tdckpt.load_memmap(ours_p)
    ours_state, theirs_state = state(ours, memmap=False), state(theirs, memmap=False)
    # tensordict maps the zero-element '%2E' from the *other* key's file (its fallback to
    # the raw name finds '.'s robust file) and returns a MemoryMappedTensor of it; tdckpt
    # rebuilds it from its metadata, reading nothing. Same dtype, shape and values.
    assert theirs_state["entries"]["%2E"].pop("leaf") == "MemoryMappedTensor"
    assert ours_state["entries"]["%2E"].pop("leaf") == "Tensor"
    assert ours_state == theirs_state


def test_errors_are_tdckpt_errors() -> None:
    assert issubclass(ValidationError, TdckptError) and issubclass(RestoreError, TdckptError)


@pytest.mark.parametrize(
    "order",
    [
        ["z", "n", "a", "s", "b"],  # the saved order
        ["b", "s", "a", "n", "z"],  # reversed
        ["b", "a"],  # some saved keys new to the target
        ["b", "stale", "n", "a"],  # a stale key too
        ["q", "b"],
        [],
    ],
)
def test_restored_keys_are_in_tensordicts_order(tmp_path: Path, order: list[str]) -> None:
    # Tensors, a nested level and non-tensor data interleaved: a level's leaves are mapped
    # together, and the keys end in tensordict's order - in place, the target's keys where
    # they were, then the saved tensors, then the saved sub-levels; in a new object, the
    # tensors, then the sub-levels (each in saved order).
    prefix = tmp_path / "ck"
    saved = TensorDict(
        {"z": torch.ones(2), "n": TensorDict(x=torch.ones(2), batch_size=[2]), "a": torch.ones(2)},
        batch_size=[2],
    )
    saved.set_non_tensor("s", "text")
    saved["b"] = torch.ones(2)
    saved.memmap(prefix)

    def target() -> TensorDict:
        td = TensorDict(batch_size=[2])
        for key in order:
            if key == "n":
                td[key] = TensorDict(x=torch.zeros(2), batch_size=[2])
            elif key == "s":
                td.set_non_tensor(key, "old")
            else:
                td[key] = torch.zeros(2)
        return td

    theirs = target().load_memmap_(prefix)
    ours = tdckpt.load_memmap_(target(), prefix, allow_pickle=True)
    assert list(ours.keys()) == list(theirs.keys())
    fresh = tdckpt.load_memmap(prefix, allow_pickle=True)
    assert list(fresh.keys()) == list(TensorDict.load_memmap(prefix).keys())
    assert list(fresh.keys()) == ["z", "a", "b", "n", "s"]
