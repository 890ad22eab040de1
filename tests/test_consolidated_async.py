"""``CheckpointManager(layout="consolidated").save_async``: a detached copy now, one
consolidated data file written in the background (it used to refuse with a ValueError)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tensordict import NonTensorData, TensorDict

import tdckpt
from tdckpt._read.consolidated import DATA_NAME
from tdckpt.errors import AsyncSaveError, CheckpointExistsError, UnsupportedContentError
from tdckpt.schema import MANIFEST_NAME


def _state(shift: float = 0.0) -> TensorDict:
    return TensorDict(
        {
            "w": torch.arange(6.0).reshape(2, 3) + shift,
            "nested": {"b": torch.full((2, 2), 7.0 + shift, dtype=torch.float64)},
            "note": NonTensorData("hello", batch_size=[2]),
        },
        batch_size=[2],
    )


def test_save_async_writes_one_consolidated_file_of_the_state_as_it_was(tmp_path: Path) -> None:
    with tdckpt.CheckpointManager(tmp_path / "run", layout="consolidated") as mgr:
        state = _state()
        future = mgr.save_async(1, state, metadata={"loss": 0.5})
        state["w"].add_(100.0)  # training goes on: the step keeps what was passed
        state["nested", "b"].zero_()
        path = future.result()
        assert sorted(p.name for p in path.iterdir()) == sorted([DATA_NAME, MANIFEST_NAME])
        assert mgr.verify(1).ok
        assert mgr.metadata(1) == {"loss": 0.5}
        loaded = TensorDict.from_consolidated(path / DATA_NAME)  # tensordict reads it
        restored = mgr.restore(1, allow_pickle=False)
        for got in (loaded, restored):
            assert torch.equal(got["w"], _state()["w"])
            assert torch.equal(got["nested", "b"], _state()["nested", "b"])
        target = _state(shift=3.0)
        mgr.restore_into(target, allow_pickle=False)
        assert torch.equal(target["w"], _state()["w"]) and target["note"] == "hello"
        mgr.save_async(2, _state(1.0))
        mgr.wait()
        assert mgr.steps() == [1, 2]


def test_save_async_consolidated_refuses_at_the_call(tmp_path: Path) -> None:
    with tdckpt.CheckpointManager(tmp_path / "run", layout="consolidated") as mgr:
        with pytest.raises(UnsupportedContentError, match="layout='consolidated' saves a"):
            mgr.save_async(1, [torch.ones(2)])
        mgr.save(1, _state())
        with pytest.raises(CheckpointExistsError, match="already exists"):
            mgr.save_async(1, _state())
        assert mgr.steps() == [1]


def test_save_async_consolidated_background_failure_is_reported(tmp_path: Path) -> None:
    """Non-tensor data tensordict cannot write into the file fails in the background: the
    future raises it, nothing is committed; unretrieved, the next save raises it."""
    bad = TensorDict(w=torch.ones(2), note=NonTensorData(object(), batch_size=[2]), batch_size=[2])
    with tdckpt.CheckpointManager(tmp_path / "run", layout="consolidated") as mgr:
        future = mgr.save_async(1, bad)
        with pytest.raises(UnsupportedContentError, match="layout='memmap'"):
            future.result()
        assert mgr.steps() == []
        mgr.save(2, _state())  # retrieved: the next save does not raise it again
        assert mgr.steps() == [2]


def test_save_async_consolidated_unretrieved_failure_raised_by_the_next_save(
    tmp_path: Path,
) -> None:
    bad = TensorDict(w=torch.ones(2), note=NonTensorData(object(), batch_size=[2]), batch_size=[2])
    mgr = tdckpt.CheckpointManager(tmp_path / "run", layout="consolidated")
    mgr.save_async(1, bad)
    with pytest.raises(AsyncSaveError) as info:
        mgr.save(2, _state())
    assert isinstance(info.value.__cause__, UnsupportedContentError)
    assert mgr.steps() == []
    mgr.close()
