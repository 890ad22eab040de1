"""A sharded restore opens each shard once, checks it, and maps it as checked.

Every shard of a step is checked against the step manifest before anything is restored
(:mod:`tdckpt._shard.check`); the shards whose rows are read stay open and are restored
from that same opened, validated checkpoint, not read a second time. Real files throughout
(steps written by tdckpt's own shard writer, ``tests/_shard_local.py``). Counted by spies
whose real code runs: each ``OpenedCheckpoint`` made (a prefix read and validated), and
each storage's constructor and ``close`` (none left open, a refused step's included).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from _shard_child import make_case
from _shard_compare import assert_same
from _shard_local import edit_manifest, write_sharded
from tensordict import TensorDict

from tdckpt import CheckpointManager
from tdckpt._read.consolidated import DATA_NAME, ConsolidatedStorage
from tdckpt._read.directory import DirectoryStorage
from tdckpt._read.pipeline import OpenedCheckpoint
from tdckpt.errors import MetadataError

BOUNDS = [(0, 4), (4, 9), (9, 12)]  # three shards of uneven rows


def _rows(start: int, stop: int) -> TensorDict:
    n = stop - start
    return TensorDict(
        x=torch.arange(start, stop, dtype=torch.float32),
        nested=TensorDict(y=torch.arange(start, stop).reshape(-1, 1).expand(-1, 3).clone()),
        batch_size=[n],
    )


def _whole() -> TensorDict:
    return _rows(0, BOUNDS[-1][1])


@dataclass
class Opens:
    """Each prefix under the step opened and validated (an ``OpenedCheckpoint`` made of it),
    by prefix; and the storages opened under the step that are not closed yet."""

    step: Path
    count: Counter[str] = field(default_factory=Counter)
    live: set[int] = field(default_factory=set)

    def per_prefix(self) -> dict[str, int]:
        return dict(self.count)

    def under_step(self, prefix: Any) -> str | None:
        path = Path(prefix)
        if path.name == DATA_NAME:  # a consolidated shard is its one data file
            path = path.parent
        return path.relative_to(self.step).as_posix() if path.is_relative_to(self.step) else None


@pytest.fixture
def opens(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Opens]:
    """Spies (the real code runs): every validated open counted, every storage tracked."""
    seen = Opens(step=tmp_path / "1")
    real_opened = OpenedCheckpoint.__init__

    def opened(self: OpenedCheckpoint, *args: Any, **kwargs: Any) -> None:
        real_opened(self, *args, **kwargs)
        rel = seen.under_step(self.prefix)
        if rel is not None:
            seen.count[rel] += 1

    monkeypatch.setattr(OpenedCheckpoint, "__init__", opened)
    for cls in (DirectoryStorage, ConsolidatedStorage):
        real_init, real_close = cls.__init__, cls.close

        def init(self: Any, *args: Any, _init: Any = real_init, **kwargs: Any) -> None:
            _init(self, *args, **kwargs)
            if seen.under_step(self.location) is not None:
                seen.live.add(id(self))

        def close(self: Any, _close: Any = real_close) -> None:
            seen.live.discard(id(self))
            _close(self)

        monkeypatch.setattr(cls, "__init__", init)
        monkeypatch.setattr(cls, "close", close)
    yield seen


def _attempt_of(folder: Path) -> str:
    (attempt,) = [p.name for p in folder.iterdir() if p.name.startswith("attempt-")]
    return attempt


def _write(root: Path, layout: str = "memmap", replicated: bool = False) -> Path:
    shards: list[Any] = [_rows(a, b) for a, b in BOUNDS]
    if replicated:
        for td in shards:
            td["config"] = "the same on every rank"
    extra = ("config",) if replicated else ()
    return write_sharded(root, 1, shards, replicated=extra, layout=layout)


def _shard_prefixes(folder: Path, replicated: bool = False) -> dict[str, int]:
    attempt = _attempt_of(folder)
    out = {f"{attempt}/shard-{rank}": 1 for rank in range(len(BOUNDS))}
    if replicated:
        out[f"{attempt}/replicated"] = 1
    return out


@pytest.mark.parametrize("layout", ["memmap", "consolidated"])
def test_a_whole_restore_opens_each_shard_once(tmp_path: Path, opens: Opens, layout: str) -> None:
    folder = _write(tmp_path, layout)
    opens.count.clear()
    got = CheckpointManager(tmp_path).restore(1)
    assert (got == _whole()).all()
    assert opens.per_prefix() == _shard_prefixes(folder)
    assert not opens.live, "a shard's storage was left open"


@pytest.mark.parametrize("rows", [slice(5, 8), slice(2, 11), slice(0, 0)])
def test_rows_of_some_shards_open_every_shard_once(
    tmp_path: Path, opens: Opens, rows: slice
) -> None:
    """Every shard is checked (the global row numbers rest on each), none opened twice."""
    folder = _write(tmp_path)
    opens.count.clear()
    got = CheckpointManager(tmp_path).restore(1, rows=rows)
    assert (got == _whole()[rows]).all()
    assert opens.per_prefix() == _shard_prefixes(folder)
    assert not opens.live


def test_replicated_entries_and_a_selection_are_opened_once(tmp_path: Path, opens: Opens) -> None:
    folder = _write(tmp_path, replicated=True)
    opens.count.clear()
    got = CheckpointManager(tmp_path).restore(1)
    assert got["config"] == "the same on every rank"
    assert (got["x"] == _whole()["x"]).all()
    assert opens.per_prefix() == _shard_prefixes(folder, replicated=True)
    assert not opens.live
    opens.count.clear()
    part = CheckpointManager(tmp_path).restore(1, keys="nested")
    assert set(part.keys(True, True)) == {("nested", "y")}
    assert opens.per_prefix() == _shard_prefixes(folder, replicated=True)
    assert not opens.live


@pytest.mark.parametrize("case", ["nontensor", "tensorclass"])
def test_shards_the_general_read_opens_are_opened_once(
    tmp_path: Path, opens: Opens, case: str
) -> None:
    """Non-tensor data and tensorclasses: not the current-form lane's, the general read's."""
    whole = make_case(case, BOUNDS[-1][1])
    folder = write_sharded(tmp_path, 1, [whole[a:b] for a, b in BOUNDS])
    opens.count.clear()
    got = CheckpointManager(tmp_path).restore(1, allow_pickle=True, rows=slice(3, 10))
    assert_same(got, whole[3:10], case)
    assert opens.per_prefix() == _shard_prefixes(folder)
    assert not opens.live


def test_restore_into_opens_each_shard_once(tmp_path: Path, opens: Opens) -> None:
    folder = _write(tmp_path)
    target = _whole().zero_()
    opens.count.clear()
    out = CheckpointManager(tmp_path).restore_into(target, 1)
    assert out is target and (target == _whole()).all()
    assert opens.per_prefix() == _shard_prefixes(folder)
    assert not opens.live


def test_a_refused_step_leaves_no_shard_open(tmp_path: Path, opens: Opens) -> None:
    """Shard 2's rows misstated: refused after shards 0 and 1 were opened (and kept, their
    rows being read): each is closed again."""
    folder = _write(tmp_path)

    def shift(doc: dict[str, Any]) -> None:
        doc["shards"][2]["stop"] += 1
        doc["batch_size"][0] += 1

    edit_manifest(folder, shift)
    opens.count.clear()
    with pytest.raises(MetadataError, match=r"shard 2 holds 3 rows"):
        CheckpointManager(tmp_path).restore(1)
    assert opens.per_prefix() == _shard_prefixes(folder)
    assert not opens.live


@pytest.mark.parametrize("batch", [[4], [4, 3]])
def test_a_plain_shard_s_structure_read_off_its_nodes_is_the_stand_ins(
    tmp_path: Path, batch: list[int]
) -> None:
    """The shard check describes a shard of TensorDict levels and dense tensors from its
    nodes (no stand-in tensors); that description is the one the stand-ins give, for every
    dtype, nested levels and batch dims past the rows."""
    from tdckpt._read.pipeline import open_checkpoint
    from tdckpt._shard.check import _built_structure, _plain_structure

    dtypes = [torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8, torch.bool]
    td = TensorDict(
        {f"d{i}": torch.zeros(*batch, 2, dtype=dt) for i, dt in enumerate(dtypes)},
        batch_size=batch,
    )
    td["inner", "deep", "v"] = torch.ones(*batch, 5, 1, dtype=torch.complex64)
    td["inner", "s"] = torch.zeros(*batch, dtype=torch.int64)
    td.memmap(tmp_path / "shard")
    opened = open_checkpoint(tmp_path / "shard", robust_key=True)
    try:
        assert opened.root is not None
        plain = _plain_structure(opened.root)
        assert plain is not None  # a plain shard: read off its nodes
        assert plain == _built_structure(opened)
        assert plain.leaves[("inner", "deep", "v")] == ("tensor", "torch.complex64", (5, 1))
    finally:
        opened.close()
