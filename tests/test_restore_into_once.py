"""``CheckpointManager.restore_into(strict=True)`` restores once (issue 10, part 2).

The strict key check runs on the validated node tree, before anything is read: every leaf is
mapped once, every pickle unpickled once, the pickle FutureWarning emitted once, and a key
mismatch is refused before any leaf is mapped or value unpickled, with the target unchanged.

Counted on real checkpoints with the real tensordict: leaf maps by wrapping the storages'
``map`` (the one place a leaf's file is opened and mapped), unpickles by a class whose
``__reduce__`` rebuilds it through a counting function, warnings by ``pytest.warns``.
The node-tree walk is checked against the keys of what ``restore`` returns, over the whole
fixture corpus and every view kind.
"""

from __future__ import annotations

import sys
import warnings
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from _restore_helpers import reference, state
from conftest import EXTRA_FIXTURES, FIXTURES, fixture_cases

tensordict = pytest.importorskip("tensordict")

import fixture_types  # noqa: E402
from tensordict import LazyStackedTensorDict, NonTensorData, NonTensorStack, TensorDict  # noqa: E402

from tdckpt._read.archive import ArchiveStorage  # noqa: E402
from tdckpt._read.directory import DirectoryStorage  # noqa: E402
from tdckpt._read.pipeline import open_checkpoint  # noqa: E402
from tdckpt._restore.engine import load_memmap, restore_in_place  # noqa: E402
from tdckpt._restore.keys import key_difference, saved_structure, target_structure  # noqa: E402
from tdckpt._restore.reading import open_for_restore  # noqa: E402
from tdckpt.errors import RestoreError, TdckptError  # noqa: E402
from tdckpt.manager import CheckpointManager  # noqa: E402
from tdckpt.schema import MANIFEST_NAME  # noqa: E402
from tdckpt.warnings import TdckptDeprecationWarning  # noqa: E402

#: Every value of :class:`Counted` that was unpickled, in order.
UNPICKLED: list[str] = []


def _rebuild(tag: str) -> Counted:
    UNPICKLED.append(tag)
    return Counted(tag)


class Counted:
    """A non-JSON value (so it is pickled) whose unpickling is counted in :data:`UNPICKLED`."""

    def __init__(self, tag: str) -> None:
        self.tag = tag

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (_rebuild, (self.tag,))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Counted) and other.tag == self.tag

    def __hash__(self) -> int:
        return hash(self.tag)


@pytest.fixture
def maps(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Every leaf file mapped while the test runs (relative path -> times mapped)."""
    counts: Counter[str] = Counter()
    # A directory maps every leaf through map_listed (a level's leaves at once; map() of one
    # leaf calls it too); an archive through map.
    listed = DirectoryStorage.map_listed

    def counting_listed(self: Any, leaves: Any, *args: Any, **kwargs: Any) -> Any:
        counts.update(rel for rel, _, _ in leaves if rel)
        return listed(self, leaves, *args, **kwargs)

    monkeypatch.setattr(DirectoryStorage, "map_listed", counting_listed)
    original = ArchiveStorage.map

    def counting(self: Any, rel: str, *args: Any, **kwargs: Any) -> Any:
        counts[rel] += 1
        return original(self, rel, *args, **kwargs)

    monkeypatch.setattr(ArchiveStorage, "map", counting)
    return counts


@pytest.fixture
def unpickled() -> Any:
    UNPICKLED.clear()
    yield UNPICKLED
    UNPICKLED.clear()


def _content(value: float, *, pickles: bool = True) -> TensorDict:
    """Leaves at several levels, a lazy stack whose members differ, a tensorclass, and (with
    ``pickles``) pickled non-tensor data at the root, in a nested level and in a stack member."""
    td = TensorDict(
        a=torch.full((2,), value),
        n=TensorDict(
            b=torch.full((2, 3), value),
            m=TensorDict(c=torch.full((2,), value), batch_size=[2]),
            batch_size=[2],
        ),
        s=LazyStackedTensorDict(
            TensorDict(x=torch.full((3,), value)),
            TensorDict(y=torch.full((4,), value)),
            stack_dim=0,
        ),
        tc=fixture_types.FixtureTC(
            obs=torch.full((2, 1), value),
            reward=torch.full((2,), value),
            label="l",
            extra=None,
            batch_size=[2],
        ),
        batch_size=[2],
    )
    td.set_non_tensor("text", "json, not a pickle")
    if pickles:
        td.set_non_tensor("p", Counted("root"))
        td["n"].set_non_tensor("p", Counted("nested"))
        td["s"].tensordicts[1].set_non_tensor("p", Counted("member"))
    return td


#: The pickled values of :func:`_content`.
PICKLED = 3


def _saved(
    tmp_path: Path, *, archive: bool = False, pickles: bool = True
) -> tuple[CheckpointManager, Path]:
    mgr = CheckpointManager(tmp_path / "run", fsync=False, archive=archive)
    path = mgr.save(1, _content(1.0, pickles=pickles))
    return mgr, path


def _line() -> int:
    return sys._getframe(1).f_lineno


# -- once ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("archive", [False, True], ids=["directory", "archive"])
def test_strict_restore_into_maps_each_leaf_once(
    tmp_path: Path, archive: bool, maps: Counter[str]
) -> None:
    mgr, _ = _saved(tmp_path, archive=archive, pickles=False)
    mgr.restore(1)  # a new object: each leaf file mapped once
    leaves = len(maps)
    assert leaves == 7 and set(maps.values()) == {1}, maps
    maps.clear()
    target = _content(0.0, pickles=False)
    assert mgr.restore_into(target) is target
    assert len(maps) == leaves and set(maps.values()) == {1}, maps
    assert target["n", "m", "c"].tolist() == [1.0, 1.0]
    assert target["s"].tensordicts[1]["y"].tolist() == [1.0] * 4


@pytest.fixture
def manifest_reads(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Every validation of a step manifest: by the manager's step index, by the read path."""
    import tdckpt._manage.steps as steps_mod
    import tdckpt._read.pipeline as pipeline_mod

    counts: Counter[str] = Counter()
    parse, read = steps_mod.parse_step_manifest, pipeline_mod._read_manifest_model

    def counting_parse(data: bytes) -> Any:
        counts["manager"] += 1
        return parse(data)

    def counting_read(*args: Any) -> Any:
        counts["read path"] += 1
        return read(*args)

    monkeypatch.setattr(steps_mod, "parse_step_manifest", counting_parse)
    monkeypatch.setattr(pipeline_mod, "_read_manifest_model", counting_read)
    return counts


def test_a_manager_restore_validates_the_manifest_once(
    tmp_path: Path, manifest_reads: Counter[str]
) -> None:
    _, path = _saved(tmp_path, pickles=False)
    for restore in ("restore_into", "restore"):
        manifest_reads.clear()
        with CheckpointManager(tmp_path / "run") as mgr:  # a fresh manager: nothing cached
            if restore == "restore_into":
                target = _content(0.0, pickles=False)
                assert mgr.restore_into(target) is target
                assert target["n", "m", "c"].tolist() == [1.0, 1.0]
            else:
                assert mgr.restore(1)["a"].tolist() == [1.0, 1.0]
        assert manifest_reads == {"manager": 1}, (restore, manifest_reads)
    manifest_reads.clear()
    load_memmap(path)  # the plain loader on the step's folder checks its manifest itself
    assert manifest_reads == {"read path": 1}


def test_strict_restore_into_unpickles_once(
    tmp_path: Path, maps: Counter[str], unpickled: list[str]
) -> None:
    mgr, _ = _saved(tmp_path)
    target = _content(0.0)
    unpickled.clear()  # building the target's own values unpickles nothing, but be sure
    mgr.restore_into(target, allow_pickle=True)
    assert sorted(unpickled) == ["member", "nested", "root"]
    assert target["p"] == Counted("root") and target["n", "p"] == Counted("nested")
    assert target["s"].tensordicts[1]["p"] == Counted("member")
    assert set(maps.values()) == {1}


def test_strict_restore_into_warns_once_at_the_callers_line(
    tmp_path: Path, unpickled: list[str]
) -> None:
    mgr, path = _saved(tmp_path)
    target = _content(0.0)
    with pytest.warns(TdckptDeprecationWarning) as rec:
        line = _line() + 1
        mgr.restore_into(target)  # allow_pickle=None: load, with the FutureWarning
    assert len(rec) == 1, [str(w.message) for w in rec]
    w = rec[0]
    assert issubclass(w.category, FutureWarning)
    assert w.filename == __file__ and w.lineno == line
    text = str(w.message)
    assert text.startswith(f"{path}: loading pickled non-tensor data (")
    assert "because allow_pickle was not given" in text and "tensordict 0.16" in text
    for key in ("p", "n.p", "s.1.p"):
        assert f"{key} (" in text
    assert len(unpickled) == PICKLED


# -- a key mismatch: refused before anything is mapped ------------------------------------------


def _mismatches() -> dict[str, tuple[Any, list[tuple[str, ...]], list[tuple[str, ...]]]]:
    """name -> (how the target differs, expected missing, expected unexpected)."""

    def extra_leaf(td: TensorDict) -> None:
        td["n", "m", "extra"] = torch.zeros(2)

    def lost_level(td: TensorDict) -> None:
        del td["n"]

    def member_keys(td: TensorDict) -> None:
        member = td["s"].tensordicts[0]
        member["w"] = member.pop("x")

    def tensorclass_key(td: TensorDict) -> None:
        del td["tc"]._tensordict["reward"]

    def non_tensor(td: TensorDict) -> None:
        del td["n"]["p"]

    return {
        "extra_leaf": (extra_leaf, [("n", "m", "extra")], []),
        "lost_level": (
            lost_level,
            [],
            [("n",), ("n", "b"), ("n", "m"), ("n", "m", "c"), ("n", "p")],
        ),
        "member_keys": (member_keys, [("s", "0", "w")], [("s", "0", "x")]),
        "tensorclass_key": (tensorclass_key, [], [("tc", "reward")]),
        "non_tensor": (non_tensor, [], [("n", "p")]),
    }


@pytest.mark.parametrize("name", sorted(_mismatches()))
@pytest.mark.parametrize("allow_pickle", [True, None], ids=["allow", "default"])
def test_key_mismatch_is_refused_before_any_map(
    tmp_path: Path, name: str, allow_pickle: bool | None, maps: Counter[str], unpickled: list[str]
) -> None:
    change, missing, unexpected = _mismatches()[name]
    mgr, path = _saved(tmp_path)
    target = _content(0.0)
    change(target)
    with reference():
        before = state(target)
    maps.clear()
    unpickled.clear()
    with pytest.raises(RestoreError, match=r"strict=True\); nothing was changed") as info:
        if allow_pickle is None:
            with pytest.warns(TdckptDeprecationWarning):  # the policy runs first, then the check
                mgr.restore_into(target)
        else:
            mgr.restore_into(target, allow_pickle=allow_pickle)
    assert info.value.missing == missing  # type: ignore[attr-defined]
    assert info.value.unexpected == unexpected  # type: ignore[attr-defined]
    assert str(path) in info.value.message and "step 1" in info.value.message
    assert sum(maps.values()) == 0, maps
    assert unpickled == []
    with reference():
        assert state(target) == before
    # strict=False gives the target the checkpoint's structure, in one pass too
    mgr.restore_into(target, strict=False, allow_pickle=True)
    assert set(maps.values()) == {1}
    assert len(unpickled) == PICKLED


def test_a_checkpoint_saved_on_a_gpu_restores_strictly(tmp_path: Path) -> None:
    """The former probe built a new object, which refuses a level recorded on another device
    than the CPU (its leaves are CPU maps); the in-place restore takes the target's device,
    as ``tdckpt.load_memmap_`` always did. (meta.json edited as tensordict writes it on a GPU.)"""
    import json

    mgr, path = _saved(tmp_path, pickles=False)
    manifest_path = path / MANIFEST_NAME
    manifest = json.loads(manifest_path.read_text())
    records = {record["path"]: record for record in manifest["files"]}
    for meta in (path / "meta.json", path / "n" / "meta.json", path / "n" / "m" / "meta.json"):
        saved = json.loads(meta.read_text())
        assert saved["device"] == "cpu"
        saved["device"] = "cuda:0"
        data = json.dumps(saved).encode()
        meta.write_bytes(data)
        # as the writer records it: a restore checks every meta.json against the manifest
        record = records[meta.relative_to(path).as_posix()]
        record["size"], record["checksum"] = len(data), f"crc32:{zlib.crc32(data):08x}"
    manifest_path.write_text(json.dumps(manifest))
    target = _content(0.0, pickles=False)
    assert mgr.restore_into(target) is target
    assert target["n", "m", "c"].tolist() == [1.0, 1.0] and target.device is None


# -- the rules ---------------------------------------------------------------------------------


def test_a_dict_valued_non_tensor_field_is_a_leaf(tmp_path: Path) -> None:
    """Non-tensor data are leaves, in a tensorclass too: a dict field's own keys are its value."""
    mgr = CheckpointManager(tmp_path / "run", fsync=False)
    saved = fixture_types.FixtureTC(
        obs=torch.ones(2, 1), reward=torch.ones(2), label="l", extra={"k": 1}, batch_size=[2]
    )
    mgr.save(1, saved)
    target = fixture_types.FixtureTC(
        obs=torch.zeros(2, 1), reward=torch.zeros(2), label="t", extra={"other": 2}, batch_size=[2]
    )
    assert mgr.restore_into(target, allow_pickle=False) is target
    assert target.extra == {"k": 1} and target.label == "l"


def _cases() -> list[Any]:
    return [
        pytest.param(fc, id=fc.id)
        for root in (FIXTURES, EXTRA_FIXTURES)
        for fc in fixture_cases(root=root)
    ]


@pytest.mark.parametrize("fc", _cases())
def test_node_tree_keys_are_the_restored_objects_keys(fc: Any) -> None:
    """Over the whole corpus: the keys read from the node tree are those of what a restore gives."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # content the writer lost: reported, not the point here
        try:
            restored = load_memmap(fc.target, robust_key=True, allow_pickle=True)
        except TdckptError as exc:
            # Refused on purpose (a writer put files outside the checkpoint, ...): refused
            # when opened, before the key check, so a strict restore_into says the same.
            with pytest.raises(type(exc)):
                open_for_restore(fc.target, robust_key=True, allow_pickle=True)[0].close()
            return
        opened = open_checkpoint(fc.target, robust_key=True)
    try:
        saved = saved_structure(opened)
    finally:
        opened.close()
    assert saved.keys == target_structure(restored, opaque=saved.opaque)


def _views() -> dict[str, Any]:
    from test_views import _views as views

    src = TensorDict(
        ls=LazyStackedTensorDict(
            TensorDict(a=torch.zeros(2)),
            TensorDict(b=torch.zeros(2)),
            TensorDict(a=torch.ones(2)),
            stack_dim=0,
        ),
        batch_size=[3],
    )
    src["nt"] = NonTensorData("hello", batch_size=[3])
    out = {f"nested_{k}": TensorDict(v=v, x=torch.zeros(())) for k, v in views().items()}
    out.update(
        {
            f"stack_{i}": TensorDict(v=src._get_sub_tensordict(idx))
            for i, idx in enumerate((slice(0, 2), 1, torch.tensor([2, 0])))
        }
    )
    # pickled non-tensor data (a value, a stack of values, a tensorclass field) under a view
    pickled = TensorDict(a=torch.zeros(3, 2), batch_size=[3])
    pickled["ns"] = NonTensorStack(*(NonTensorData(Counted(f"s{i}")) for i in range(3)))
    pickled.set_non_tensor("p", Counted("p"))
    pickled["tc"] = fixture_types.FixtureTC(
        obs=torch.ones(3, 1), reward=torch.ones(3), label="l", extra=Counted("tc"), batch_size=[3]
    )
    out.update(
        {
            f"pickled_{i}": TensorDict(v=pickled._get_sub_tensordict(idx))
            for i, idx in enumerate((slice(0, 2), 1))
        }
    )
    return out


@pytest.mark.parametrize("name", sorted(_views()))
def test_views_show_the_keys_tensordict_shows(
    tmp_path: Path, name: str, maps: Counter[str], unpickled: list[str]
) -> None:
    """A nested sub-tensordict or lazy view: its keys (a lazy stack under an index included)
    are those of the restored view, and a strict restore into a same-keyed target works."""
    content = _views()[name]
    with reference():
        content.memmap(tmp_path / "ckpt")
    restored = load_memmap(tmp_path / "ckpt", allow_pickle=True)
    unpickled.clear()
    opened = open_checkpoint(tmp_path / "ckpt", robust_key=True)
    try:
        saved = saved_structure(opened)
    finally:
        opened.close()
    assert unpickled == []  # the view's stand-ins unpickle nothing
    assert saved.keys == target_structure(restored, opaque=saved.opaque)
    assert ("v",) in saved.keys and len(saved.keys) > 1
    # restore_into's pipeline (the manager saves no views: tensordict wrote this one)
    target = load_memmap(tmp_path / "ckpt", allow_pickle=True)
    maps.clear()
    unpickled.clear()

    def same_keys(opened: Any) -> None:
        saved = saved_structure(opened)
        assert key_difference(saved, target_structure(target, opaque=saved.opaque)) == ([], [])
        assert sum(maps.values()) == 0 and unpickled == []

    restore_in_place(target, tmp_path / "ckpt", True, allow_pickle=True, mode="r", check=same_keys)
    assert maps and set(maps.values()) == {1}
    # the view's source is saved whole: each of its five values unpickled once
    assert sorted(unpickled) == (
        ["p", "s0", "s1", "s2", "tc"] if name.startswith("pickled") else []
    )


# -- without tensordict ------------------------------------------------------------------------

_NO_TD_CHILD = """
import json, sys, warnings
sys.modules["tensordict"] = None
warnings.simplefilter("ignore")
from tdckpt._read.pipeline import open_checkpoint
from tdckpt._restore.engine import load_memmap
from tdckpt._restore.keys import saved_structure, target_structure
from tdckpt.errors import RestoreError
from tdckpt.manager import CheckpointManager
out = {}
for prefix in sys.argv[2:]:
    opened = open_checkpoint(prefix, robust_key=True)
    saved = saved_structure(opened)
    opened.close()
    restored = load_memmap(prefix, allow_pickle=True)
    out[prefix] = saved.keys == target_structure(restored, opaque=saved.opaque)
mgr = CheckpointManager(sys.argv[1], fsync=False)
target = mgr.restore(allow_pickle=True)
out["same"] = mgr.restore_into(target, allow_pickle=True) is target
target["lvl1"]["new"] = 0
try:
    mgr.restore_into(target, allow_pickle=True)
except RestoreError as exc:
    out["missing"] = exc.missing
print(json.dumps(out))
"""


def test_node_tree_keys_without_tensordict(tmp_path: Path) -> None:
    """The plain-dict back-end: lazy stacks are lists, tensorclasses and non-tensor values
    dicts and values; the node walk gives the keys of what that restore returns."""
    import json
    import subprocess

    from conftest import copy_case, subprocess_env

    names = [
        "nested",
        "non_tensor_json",
        "non_tensor_lossy",
        "lazy_stack",
        "tensorclass",
        "tensorclass_in_td",
    ]
    prefixes = [str(copy_case(tmp_path, "0.15.3", name)) for name in names]
    with reference():
        content = load_memmap(copy_case(tmp_path / "m", "0.15.3", "nested"), allow_pickle=False)
    CheckpointManager(tmp_path / "run", fsync=False).save(1, content)
    proc = subprocess.run(
        [sys.executable, "-c", _NO_TD_CHILD, str(tmp_path / "run"), *prefixes],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
        env=subprocess_env(),
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result.pop("missing") == [["lvl1", "new"]]
    assert result == {**{p: True for p in prefixes}, "same": True}
