"""Consolidated restores build their leaves a run at a time: each leaf must be exactly the
leaf tensordict's ``from_consolidated`` gives, wherever a run starts, breaks or is refused.

``ConsolidatedStorage.map_leaves`` views a run of consecutive leaves (one dtype and shape,
evenly spaced in the file) through one ``as_strided`` + ``unbind``; a level that is one
such run is found without a per-leaf loop. These tests build levels whose runs break on
every rule (dtype, shape, size, spacing, a gap, a zero-element leaf, order in the file),
compare each restored leaf bit for bit, dtype, shape and strides with tensordict's, and
check that offsets a run would cover but the file does not own are still refused.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import NonTensorData, TensorDict

import tdckpt
from tdckpt._read.consolidated import open_consolidated
from tdckpt.errors import MetadataError


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def assert_same_leaves(ours: Any, theirs: Any) -> None:
    """Every leaf of ``ours`` is ``theirs``'s: keys, dtype, shape, contiguous, same bits;
    every leaf with bytes a view of one mapping."""
    assert sorted(map(str, ours.keys(True, True))) == sorted(map(str, theirs.keys(True, True)))
    ptrs = set()
    for key in theirs.keys(True, True):
        a, b = ours.get(key), theirs.get(key)
        if not isinstance(b, torch.Tensor):
            assert a == b, key
            continue
        assert type(a) is torch.Tensor, key  # a plain view, as from_consolidated gives
        assert a.dtype == b.dtype and a.shape == b.shape, key
        assert a.is_contiguous() and a.stride() == b.contiguous().stride(), key
        assert _bits(a) == _bits(b), key
        if a.numel():
            ptrs.add(a.untyped_storage().data_ptr())
    assert len(ptrs) <= 1


def mixed_td() -> TensorDict:
    """Runs of every kind, broken by every rule, at two levels."""
    gen = torch.Generator().manual_seed(0)
    leaves: dict[str, Any] = {}
    for i in range(40):  # one long run: float32 (4,), 16 bytes apart
        leaves[f"run{i}"] = torch.randn(2, 4, generator=gen)
    leaves["nan"] = torch.tensor([[float("nan"), -0.0, float("inf"), 1e-45]] * 2)
    for i in range(3):  # float32, the same bytes and spacing, another shape: a run of its own
        leaves[f"cube{i}"] = torch.randn(2, 2, 2, generator=gen)
    for i in range(5):  # int64 (2, 3): a second run, another dtype and shape
        leaves[f"i64_{i}"] = torch.randint(-(2**62), 2**62, (2, 3), generator=gen)
    for i in range(6):  # float16 (2, 3): 12 bytes padded to 16 - spacing > size
        leaves[f"f16_{i}"] = torch.randn(2, 3, generator=gen).half()
    leaves["empty"] = torch.zeros(2, 0)  # no bytes: breaks the run around it
    for i in range(4):
        leaves[f"u8_{i}"] = torch.randint(0, 255, (2, 5), dtype=torch.uint8, generator=gen)
    for i, dtype in enumerate([torch.bool, torch.bfloat16, torch.float64, torch.int8] * 3):
        leaves[f"alt{i}"] = (torch.randn(2, 3, generator=gen) > 0).to(dtype)  # no runs
    leaves["scalar_rows"] = torch.arange(2, dtype=torch.int32)
    sub = {f"s{i}": torch.randn(2, 7, generator=gen) for i in range(9)}  # 28 bytes, step 32
    sub["deeper"] = {f"d{i}": torch.randint(0, 9, (2,), generator=gen) for i in range(3)}
    leaves["sub"] = sub
    td = TensorDict(leaves, batch_size=[2])
    td["note"] = NonTensorData("between runs", batch_size=[2])
    return td


@pytest.mark.parametrize("in_place", [False, True])
def test_runs_are_tensordicts_leaves(tmp_path: Path, in_place: bool) -> None:
    path = tmp_path / "mixed.bin"
    mixed_td().consolidate(filename=path)
    theirs = TensorDict.from_consolidated(path)
    if in_place:
        ours = mixed_td().apply(torch.zeros_like)
        tdckpt.load_memmap_(ours, path, allow_pickle=False)
    else:
        ours = tdckpt.load_memmap(path, allow_pickle=False)
    assert_same_leaves(ours, theirs)


def test_a_level_that_is_one_run(tmp_path: Path) -> None:
    """10,000 leaves of one dtype and shape: the whole level one strided view, unbound."""
    td = TensorDict({f"k{i}": torch.full((4,), float(i)) for i in range(10_000)}, [4])
    path = tmp_path / "one_run.bin"
    td.consolidate(filename=path)
    target = td.apply(torch.zeros_like)
    tdckpt.load_memmap_(target, path, allow_pickle=False)
    assert_same_leaves(target, TensorDict.from_consolidated(path))
    assert target["k9999"].storage_offset() == 9999 * 4


# -- files tensordict does not write, but may: leaves out of file order, gaps ------------
def _write_raw(path: Path, data: bytes, meta: dict[str, Any]) -> Path:
    blob = json.dumps(meta).encode()
    path.write_bytes(data + blob + struct.pack("<q", len(blob)))
    return path


def _level(leaves: dict[str, list[Any]]) -> dict[str, Any]:
    return {
        "cls": "TensorDict",
        "non_tensors": {},
        "leaves": leaves,
        "cls_metadata": {"batch_size": [], "device": None, "names": None, "is_locked": False},
    }


@pytest.mark.parametrize(
    "starts",
    [
        [0, 16, 32, 48, 64, 80],  # one run
        [0, 16, 32, 64, 80, 96],  # a gap after the third: two runs
        [0, 32, 64, 96, 128, 160],  # spaced wider than each leaf: one run, step 32
        [80, 64, 48, 32, 16, 0],  # reverse file order: each on its own
        [0, 16, 48, 32, 64, 96],  # two swapped: runs broken around them
        [0, 24, 48, 72, 96, 120],  # steps of 24 bytes: 6 float32 apart, one run
    ],
)
def test_spacing_decides_the_runs(tmp_path: Path, starts: list[int]) -> None:
    data = bytes(range(200))
    leaves = {f"x{i}": ["torch.float32", [4], s, s + 16, 0] for i, s in enumerate(starts)}
    path = _write_raw(tmp_path / "spaced.bin", data, _level(leaves))
    ours = tdckpt.load_memmap(path, allow_pickle=False)
    for i, s in enumerate(starts):
        leaf = ours[f"x{i}"]
        expected = torch.frombuffer(bytearray(data[s : s + 16]), dtype=torch.float32)
        assert leaf.shape == (4,) and leaf.is_contiguous()
        assert _bits(leaf) == _bits(expected), (i, s)


@pytest.mark.parametrize("mode", [None, "r"])
def test_map_leaves_equals_map_per_leaf(tmp_path: Path, mode: Any) -> None:
    """``map_leaves`` (runs) gives, leaf by leaf, what ``map`` of that leaf alone gives and
    what ``from_consolidated`` gives."""
    td = mixed_td()
    del td["note"]
    path = tmp_path / "leaves.bin"
    td.consolidate(filename=path)
    storage = open_consolidated(path)
    assert storage is not None
    try:
        root = storage.validated_root()
        assert root is not None  # TensorDict levels of dense leaves: built while parsing
        nodes = [n for n in root.entries.values() if hasattr(n, "dtype")]
        assert len(nodes) > 60
        views = storage.map_leaves(nodes, mode)
        theirs = TensorDict.from_consolidated(path)
        for node, view in zip(nodes, views, strict=True):
            if not node.numel:
                assert view is None  # no bytes: the caller maps it on its own
                continue
            assert view is not None and view.shape == node.shape
            assert node.file is not None and node.file.source is not None
            alone = storage.map(node.file.source, node.dtype, node.numel, mode=mode)
            assert _bits(view) == _bits(alone.view(node.shape)), node.key
            assert _bits(view) == _bits(theirs.get(node.key)), node.key
            assert view.stride() == theirs.get(node.key).contiguous().stride()
    finally:
        storage.close()


# -- offsets a run would cover, refused --------------------------------------------------
@pytest.mark.parametrize(
    ("starts", "match"),
    [
        ([0, 8, 16, 24], "overlap"),  # evenly spaced, closer than each leaf's 16 bytes
        ([0, 16, 32, 192], "not inside"),  # the last one past the end of the leaf bytes
        ([0, 16, 32, 34], "not aligned|overlap"),  # a misaligned last one
    ],
)
def test_hostile_offsets_are_refused(tmp_path: Path, starts: list[int], match: str) -> None:
    data = bytes(200)
    leaves = {f"x{i}": ["torch.float32", [4], s, s + 16, 0] for i, s in enumerate(starts)}
    path = _write_raw(tmp_path / "hostile.bin", data, _level(leaves))
    target = TensorDict({f"x{i}": torch.ones(4) for i in range(4)}, [])
    with pytest.raises(MetadataError, match=match) as info:
        tdckpt.load_memmap_(target, path, allow_pickle=False)
    assert "x" in str(info.value)  # names the leaf
    assert all(torch.equal(v, torch.ones(4)) for v in target.values())


# -- a level that is one run: found by the parse, used only for the parse's own nodes ---------
def _uniform(tmp_path: Path, count: int = 300) -> Path:
    td = TensorDict({f"k{i}": torch.arange(3.0) + 10 * i for i in range(count)}, [3])
    td["sub"] = TensorDict({f"s{i}": torch.full((3, 2), float(i)) for i in range(5)}, [3])
    path = tmp_path / "uniform.bin"
    td.consolidate(filename=path)
    return path


def test_the_parse_records_levels_that_are_one_run(tmp_path: Path) -> None:
    storage = open_consolidated(_uniform(tmp_path))
    assert storage is not None
    try:
        root = storage.validated_root()
        assert root is not None
        runs = storage._parsed.runs
        top = [n for n in root.entries.values() if hasattr(n, "dtype")]
        sub = list(root.entries["sub"].entries.values())  # type: ignore[union-attr]
        assert len(runs) == 2
        assert runs[id(top[0])].nodes == top and runs[id(top[0])].step == 16  # 12 -> 16 bytes
        assert runs[id(sub[0])].nodes == sub and runs[id(sub[0])].shape == (3, 2)
    finally:
        storage.close()


@pytest.mark.parametrize(
    "pick",
    [
        lambda nodes: nodes,  # the whole level: the run's one view
        lambda nodes: nodes[::-1],  # reordered: leaf by leaf
        lambda nodes: nodes[1:],  # a part (a selective restore): leaf by leaf
        lambda nodes: nodes[:1] + nodes[2:] + nodes[1:2],  # same first node, same length
    ],
)
def test_map_leaves_uses_a_run_only_for_its_own_nodes(tmp_path: Path, pick: Any) -> None:
    storage = open_consolidated(_uniform(tmp_path))
    assert storage is not None
    try:
        root = storage.validated_root()
        assert root is not None
        nodes = pick([n for n in root.entries.values() if hasattr(n, "dtype")])
        views = storage.map_leaves(nodes, None)
        for node, view in zip(nodes, views, strict=True):
            assert view is not None and view.shape == node.shape
            assert torch.equal(view, torch.arange(3.0) + 10 * int(node.key[-1][1:])), node.key
    finally:
        storage.close()


def test_selective_restore_of_a_run(tmp_path: Path) -> None:
    path = _uniform(tmp_path)
    target = TensorDict({"k7": torch.zeros(3), "k250": torch.zeros(3)}, [3])
    tdckpt.load_memmap_(target, path, allow_pickle=False, strict=False)
    assert torch.equal(target["k7"], torch.arange(3.0) + 70)
    assert torch.equal(target["k250"], torch.arange(3.0) + 2500)


@pytest.mark.parametrize("other_shape", [[4], [[4]]])
def test_a_list_inside_a_shape_is_refused(tmp_path: Path, other_shape: list[Any]) -> None:
    """A dim that is a list (unhashable) among leaves of other shapes: a MetadataError naming
    the leaf, not a TypeError from the column checks."""
    leaves = {
        "x0": ["torch.float32", [[4]], 0, 16, 0],
        "x1": ["torch.float32", other_shape, 16, 32, 0],
        "x2": ["torch.float32", [2, 2], 32, 48, 0],
    }
    path = _write_raw(tmp_path / "listdim.bin", bytes(64), _level(leaves))
    target = TensorDict({"x0": torch.ones(4)}, [])
    with pytest.raises(MetadataError, match=r"'x0'.*shape"):
        tdckpt.load_memmap_(target, path, allow_pickle=False, strict=False)
    assert torch.equal(target["x0"], torch.ones(4))
