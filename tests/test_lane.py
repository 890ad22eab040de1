"""The current-form lane (``tdckpt/_read/lane.py``): a restore's read of untouched trees.

The lane must never change what a restore accepts, refuses or builds. Held here by:

* equivalence: on every fixture of the corpus and on generated TensorDicts (any keys, dtypes,
  shapes, nesting, batch sizes, names), the lane either declines or builds exactly the nodes
  the general read (``open_checkpoint``) builds, and the restored values are equal;
* declining: on everything that is not a TensorDict of tensors in the exact current form;
* use: a plain ``td.memmap`` restore takes it (the general read is never called);
* failure: a leaf the lane did not list and that turns out missing or wrong makes the
  restore read again in full, whose error reports every problem.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pickle
import string
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import EXTRA_FIXTURES, FIXTURES, fixture_cases
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

tensordict = pytest.importorskip("tensordict")

from tensordict import LazyStackedTensorDict, TensorDict  # noqa: E402

import tdckpt  # noqa: E402
import tdckpt._read.lane as lane_mod  # noqa: E402
import tdckpt._read.pipeline as pipeline_mod  # noqa: E402
import tdckpt._read.tree as tree_mod  # noqa: E402
from tdckpt._read.lane import open_current  # noqa: E402
from tdckpt._read.nodes import LeafNode, Node  # noqa: E402
from tdckpt._read.pipeline import open_checkpoint  # noqa: E402
from tdckpt._read.tree import VFile  # noqa: E402
from tdckpt.errors import ValidationError  # noqa: E402


def _plain(node: Any) -> Any:
    """A node tree as comparable data: files by their source (the lane lists no sizes)."""
    if isinstance(node, VFile):
        return ("file", node.source, node.data)
    if isinstance(node, torch.Tensor):
        return ("tensor", node.tolist())
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return (
            type(node).__name__,
            {f.name: _plain(getattr(node, f.name)) for f in dataclasses.fields(node)},
        )
    if isinstance(node, dict):
        return {k: _plain(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(_plain(v) for v in node)
    return node


def _same_as_general(prefix: Path) -> bool:
    """Whether the lane reads ``prefix``; if it does, assert it built the general read's nodes."""
    lane = open_current(prefix, robust_key=True)
    if lane is None:
        return False
    try:
        general = open_checkpoint(prefix, robust_key=True)
        try:
            assert not general.errors
            assert _plain(lane.root) == _plain(general.root)
            assert (lane.generation, lane.key_encoding) == (general.generation, "robust")
            assert lane.problems == [] and lane.lost == [] and lane.migrations == []
            assert _plain(lane.manifest_model) == _plain(general.manifest_model)
        finally:
            general.close()
    finally:
        lane.close()
    return True


# -- equivalence -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fc",
    fixture_cases() + fixture_cases(root=EXTRA_FIXTURES),
    ids=lambda fc: f"{fc.version}-{fc.name}",
)
def test_the_lane_builds_what_the_general_read_builds_on_every_fixture(fc: Any) -> None:
    if fc.target.is_dir():
        _same_as_general(fc.target)


def test_the_corpus_has_trees_the_lane_reads() -> None:
    # The check above is not vacuous: the releases that write the current form are read by it.
    read = [fc for fc in fixture_cases() if fc.target.is_dir() and _same_as_general(fc.target)]
    assert len(read) >= 5, [f"{fc.version}-{fc.name}" for fc in read]
    assert {fc.version for fc in read} >= {"0.15.3"}
    assert FIXTURES.is_dir()


_KEY = st.text(alphabet=string.ascii_letters + "._-/% é\u00e9", min_size=0, max_size=6)
_DTYPES = st.sampled_from([torch.float32, torch.int64, torch.uint8, torch.bool, torch.float16])


@st.composite
def _tds(draw: st.DrawFn, depth: int = 0, batch: tuple[int, ...] | None = None) -> TensorDict:
    if batch is None:
        batch = tuple(draw(st.lists(st.integers(0, 3), max_size=2)))
    entries: dict[str, Any] = {}
    for key in draw(st.lists(_KEY, max_size=4, unique=True)):
        if depth < 2 and draw(st.booleans()) and draw(st.booleans()):
            entries[key] = draw(
                _tds(depth + 1, batch + tuple(draw(st.lists(st.integers(0, 2), max_size=1))))
            )
        else:
            tail = tuple(draw(st.lists(st.integers(0, 3), max_size=2)))
            dtype = draw(_DTYPES)
            entries[key] = torch.zeros(batch + tail, dtype=dtype).random_(0, 2)
    td = TensorDict(entries, batch_size=batch)
    if depth == 0 and batch and draw(st.booleans()):
        td.names = ["a", None][: len(batch)] if draw(st.booleans()) else ["x", "y"][: len(batch)]
    return td


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(td=_tds())
def test_the_lane_builds_what_the_general_read_builds_on_any_tensordict(
    tmp_path_factory: pytest.TempPathFactory, td: TensorDict
) -> None:
    # Written by the installed tensordict (0.14 writes no format marker: the lane declines
    # all of it) and by tdckpt (the current form, whatever tensordict is installed).
    for writer in ("tensordict", "tdckpt"):
        prefix = tmp_path_factory.mktemp("lane") / "ck"
        if writer == "tensordict":
            td.memmap(prefix)
        else:
            tdckpt.save(td, prefix)
        if not _same_as_general(prefix):
            # Only a leaf without a file (zero elements), a name fallback or an older
            # writer's form makes the lane decline.
            continue
        via_lane = tdckpt.load_memmap(prefix)
        via_general = tdckpt.load_memmap(prefix, robust_key=None)
        keys = sorted(via_general.keys(True, True), key=str)
        assert sorted(via_lane.keys(True, True), key=str) == keys
        assert all(torch.equal(via_lane[k], via_general[k]) for k in keys)
        assert via_lane.batch_size == via_general.batch_size
        assert via_lane.names == via_general.names


def test_generated_tensordicts_are_read_by_the_lane(tmp_path: Path) -> None:
    td = TensorDict(
        {
            "a": torch.ones(2, 3),
            "b/c": torch.zeros(2),
            "n": TensorDict(x=torch.ones(2, 1), batch_size=[2]),
        },
        batch_size=[2],
    )
    tdckpt.save(td, tmp_path / "ck")  # the current form, whatever tensordict is installed
    assert _same_as_general(tmp_path / "ck")


# -- declining ---------------------------------------------------------------------------------


def _edit_meta(prefix: Path, **fields: Any) -> None:
    meta = json.loads((prefix / "meta.json").read_text())
    meta.update(fields)
    (prefix / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize(
    "case",
    [
        "robust_key=None",
        "robust_key=False",
        "nested-tensor",
        "non-tensor",
        "lazy-stack",
        "extra-field",
        "float-shape",
        "symlinked-child",
        "no-meta",
        "archive",
        "stray-file",
        "stray-directory",
        "symlink-out",
        "raw-names",
        "unknown-dtype",
        "batch-mismatch",
    ],
)
def test_the_lane_declines_what_it_does_not_read(tmp_path: Path, case: str) -> None:
    prefix = tmp_path / "ck"
    td = TensorDict(a=torch.ones(2), n=TensorDict(b=torch.ones(2), batch_size=[2]), batch_size=[2])
    robust_key: bool | None = True
    if case == "nested-tensor":
        with warnings.catch_warnings():  # torch's prototype-API UserWarning
            warnings.simplefilter("ignore", UserWarning)
            nt = torch.nested.nested_tensor([torch.ones(2), torch.ones(1)])
        td = TensorDict(nt=nt, batch_size=[2])
    elif case == "non-tensor":
        td.set_non_tensor("text", "hello")
    elif case == "lazy-stack":
        td = LazyStackedTensorDict(TensorDict(a=torch.ones(1)), TensorDict(b=torch.ones(2)))
    if case == "archive":
        prefix = tmp_path / "ck.tdz"
    tdckpt.save(td, prefix)  # the current form: only the case's own change makes it decline
    if case.startswith("robust_key="):
        robust_key = {"robust_key=None": None, "robust_key=False": False}[case]
    elif case == "extra-field":
        _edit_meta(prefix, extra=1)
    elif case == "float-shape":
        _edit_meta(prefix, shape=[2.0])
    elif case == "symlinked-child":
        (prefix / "n").rename(tmp_path / "n-real")
        (prefix / "n").symlink_to(tmp_path / "n-real")
    elif case == "no-meta":
        (prefix / "meta.json").unlink()
    elif case == "stray-file":
        (prefix / "n" / "notes.txt").write_text("not a key's")
    elif case == "stray-directory":
        (prefix / "n" / "junk").mkdir()
    elif case == "symlink-out":  # the general read refuses it (unsafe-path), named or not
        (prefix / "n" / "x.memmap").symlink_to("/etc/hostname")
    elif case == "raw-names":  # a key whose robust name is not on disk: the general rules
        (prefix / "a.memmap").rename(prefix / "b.memmap")
    elif case in ("unknown-dtype", "batch-mismatch"):  # exact form, refused by validation
        meta = json.loads((prefix / "meta.json").read_text())
        if case == "unknown-dtype":
            meta["a"]["dtype"] = "torch.float33"
        else:
            meta["a"]["shape"] = [3]
        (prefix / "meta.json").write_text(json.dumps(meta))
    assert open_current(prefix, robust_key=robust_key) is None
    if case in ("unknown-dtype", "batch-mismatch"):
        target = TensorDict(
            a=torch.zeros(2), n=TensorDict(b=torch.zeros(2), batch_size=[2]), batch_size=[2]
        )
        a = target["a"]
        with pytest.raises(
            ValidationError, match="float33" if case == "unknown-dtype" else "batch"
        ):
            tdckpt.load_memmap_(target, prefix)
        assert target["a"] is a


@pytest.mark.parametrize("budget", ["max_entries", "max_metadata_bytes"])
def test_the_lane_reads_with_the_general_walker_and_its_budgets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, budget: str
) -> None:
    # The lane reads with tree.read_tree: past one of its budgets the walker refuses, the
    # lane declines, and the general read refuses with its own message; at it, the lane reads.
    prefix = tmp_path / "ck"
    tdckpt.save(TensorDict(a=torch.ones(1), n=TensorDict(b=torch.ones(1))), prefix)
    if budget == "max_entries":  # meta.json, the manifest, a.memmap, n/; n's meta.json, b.memmap
        at = 6
    else:
        at = (prefix / "meta.json").stat().st_size + (prefix / "n" / "meta.json").stat().st_size
    walker = tree_mod.read_tree
    monkeypatch.setattr(lane_mod, "read_tree", functools.partial(walker, **{budget: at}))
    assert open_current(prefix, robust_key=True) is not None
    monkeypatch.setattr(lane_mod, "read_tree", functools.partial(walker, **{budget: at - 1}))
    assert open_current(prefix, robust_key=True) is None


def test_the_lane_declines_a_level_whose_child_is_missing(tmp_path: Path) -> None:
    # The general read then reports the missing child (validation's missing-child).
    prefix = tmp_path / "ck"
    tdckpt.save(TensorDict(a=torch.ones(1), n=TensorDict(b=torch.ones(1))), prefix)
    (prefix / "n" / "b.memmap").unlink()
    (prefix / "n" / "meta.json").unlink()
    (prefix / "n").rmdir()
    assert open_current(prefix, robust_key=True) is None
    with pytest.raises(ValidationError, match="missing"):
        tdckpt.load_memmap(prefix)


# -- use ---------------------------------------------------------------------------------------


def test_a_plain_restore_takes_the_lane(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    td = TensorDict(
        a=torch.arange(3.0), n=TensorDict(b=torch.ones(3, 2), batch_size=[3]), batch_size=[3]
    )
    tdckpt.save(td, tmp_path / "ck")  # tensordict 0.15.3 writes the same form (0.14: no marker)

    def general(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the general read ran")

    monkeypatch.setattr(pipeline_mod, "open_checkpoint", general)
    import tdckpt._restore.reading as reading_mod

    monkeypatch.setattr(reading_mod, "open_checkpoint", general)
    target = TensorDict(
        a=torch.zeros(3), n=TensorDict(b=torch.zeros(3, 2), batch_size=[3]), batch_size=[3]
    )
    assert tdckpt.load_memmap_(target, tmp_path / "ck") is target
    assert target["a"].tolist() == [0.0, 1.0, 2.0] and target["n", "b"].sum().item() == 6.0
    assert tdckpt.load_memmap(tmp_path / "ck")["n", "b"].shape == (3, 2)


# -- failing after the lane --------------------------------------------------------------------


def _leaves(node: Node) -> list[LeafNode]:
    if isinstance(node, LeafNode):
        return [node]
    return [leaf for sub in getattr(node, "entries", {}).values() for leaf in _leaves(sub)]


@pytest.mark.parametrize("damage", ["missing", "short", "directory", "symlink-out"])
def test_a_leaf_the_lane_did_not_list_is_reported_in_full(tmp_path: Path, damage: str) -> None:
    prefix = tmp_path / "ck"
    tdckpt.save(TensorDict(a=torch.ones(4), b=torch.ones(4), n=TensorDict(c=torch.ones(2))), prefix)
    lane = open_current(prefix, robust_key=True)
    assert lane is not None and len(_leaves(lane.root)) == 3  # type: ignore[arg-type]
    lane.close()
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 64)
    for leaf in (prefix / "a.memmap", prefix / "n" / "c.memmap"):
        if damage == "short":
            leaf.write_bytes(b"\0")
            continue
        leaf.unlink()
        if damage == "directory":
            leaf.mkdir()
        elif damage == "symlink-out":
            leaf.symlink_to(secret)
    target = TensorDict(a=torch.zeros(4), b=torch.zeros(4), n=TensorDict(c=torch.zeros(2)))
    before = {k: v for k, v in target.items(True, True)}
    with pytest.raises(ValidationError, match=r"problem\(s\); nothing was changed") as info:
        tdckpt.load_memmap_(target, prefix)
    assert {p.path for p in info.value.report.problems} >= {
        "a.memmap",
        os.path.join("n", "c.memmap"),
    }
    assert all(target.get(k) is v for k, v in before.items())  # nothing changed


# -- the leaves a restore builds -----------------------------------------------------------------


def _mapped_addresses() -> set[int]:
    with open("/proc/self/maps") as fh:
        return {int(line.split("-", 1)[0], 16) for line in fh}


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps")
@pytest.mark.parametrize("mode", [None, "r"])
def test_restored_leaves_are_the_memory_mapped_tensors_tensordict_builds(
    tmp_path: Path, mode: Any
) -> None:
    from tensordict.memmap import MemoryMappedTensor

    prefix = tmp_path / "ck"
    TensorDict(
        flat=torch.arange(6.0), grid=torch.arange(24).reshape(2, 3, 4), one=torch.ones(1, 1)
    ).memmap(prefix)
    ours = tdckpt.load_memmap(prefix, mode=mode)
    theirs = TensorDict.load_memmap(prefix, **({} if mode is None else {"mode": mode}))
    for key in ("flat", "grid", "one"):
        a, b = ours[key], theirs[key]
        assert type(a) is MemoryMappedTensor and type(b) is MemoryMappedTensor
        assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype)
        assert a._base is None and not a._is_view() and a.is_contiguous()
        assert torch.equal(a, b)
        assert {k: v for k, v in vars(a).items()} == {k: v for k, v in vars(b).items()}, key
        # what tensordict's pickling reads (0.14: plain index / parent_shape attributes)
        again = pickle.loads(pickle.dumps(a))
        assert torch.equal(again, b) and again.shape == b.shape
    addr = ours["grid"].data_ptr()
    assert addr in _mapped_addresses()
    grid = ours["grid"]
    del ours
    assert addr in _mapped_addresses() and grid.sum().item() == sum(range(24))
    del grid
    assert addr not in _mapped_addresses()  # unmapped with its last reference
