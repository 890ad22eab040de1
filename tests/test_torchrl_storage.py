"""``tdckpt.torchrl.TdckptStorageCheckpointer``: a TorchRL replay buffer's storage through tdckpt.

``ReplayBuffer(storage=..., checkpointer=TdckptStorageCheckpointer())``, torchrl 0.14.1's way
to choose a storage checkpointer; real ``LazyMemmapStorage`` and ``LazyTensorStorage``
buffers. Runs in the ``tests-0.14`` session.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torchrl.checkpoint", reason="torchrl: the tests-0.14 session")

from tensordict import TensorDict
from torchrl.checkpoint import Checkpoint
from torchrl.data import LazyMemmapStorage, LazyTensorStorage, ReplayBuffer

import tdckpt
from tdckpt.errors import IntegrityError, RestoreError, UnsupportedContentError
from tdckpt.torchrl import STORAGE_METADATA, TdckptStorageCheckpointer

CAPACITY = 16


def _batch(n: int, seed: int) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    return TensorDict(
        {
            "obs": torch.randn(n, 3, generator=g),
            "action": torch.randint(0, 4, (n,), generator=g),
            "next": {"reward": torch.randn(n, 1, generator=g)},
        },
        batch_size=[n],
    )


def _buffer(kind: str, tmp: Path, name: str, capacity: int = CAPACITY) -> Any:
    if kind == "memmap":
        storage: Any = LazyMemmapStorage(capacity, scratch_dir=tmp / f"scratch-{name}")
    else:
        storage = LazyTensorStorage(capacity)
    return ReplayBuffer(storage=storage, checkpointer=TdckptStorageCheckpointer())


@pytest.fixture(params=["memmap", "tensor"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_dumps_writes_a_verified_tdckpt_checkpoint(kind: str, tmp_path: Path) -> None:
    rb = _buffer(kind, tmp_path, "a")
    rb.extend(_batch(5, seed=0))
    rb.dumps(tmp_path / "rb")
    storage = tmp_path / "rb" / "storage"
    manifest = json.loads((storage / "tdckpt.manifest.json").read_text())
    assert manifest["user_metadata"][STORAGE_METADATA]["len"] == 5
    assert all(rec["checksum"] for rec in manifest["files"])
    assert tdckpt.validate(storage).ok
    rb.extend(_batch(2, seed=1))
    rb.dumps(tmp_path / "rb")  # a second dump replaces the first
    manifest = json.loads((storage / "tdckpt.manifest.json").read_text())
    assert manifest["user_metadata"][STORAGE_METADATA]["len"] == 7


@pytest.mark.parametrize("initialized", [False, True])
def test_loads_resumes_the_buffer(kind: str, tmp_path: Path, initialized: bool) -> None:
    rb = _buffer(kind, tmp_path, "a")
    data = _batch(5, seed=0)
    rb.extend(data)
    rb.dumps(tmp_path / "rb")
    before = {p: p.read_bytes() for p in (tmp_path / "rb" / "storage").rglob("*.memmap")}

    resumed = _buffer(kind, tmp_path, "b")
    if initialized:
        resumed.extend(_batch(1, seed=9))
    resumed.loads(tmp_path / "rb")
    assert len(resumed) == 5 and (resumed[:5] == data).all()
    resumed.extend(_batch(2, seed=2))  # the writer goes on at the saved cursor
    assert len(resumed) == 7 and (resumed[5:7] == _batch(2, seed=2)).all()
    # the buffer kept its own memory: its writes never reach the dump
    assert {p: p.read_bytes() for p in before} == before


def test_a_damaged_dump_leaves_the_buffer_unchanged(kind: str, tmp_path: Path) -> None:
    rb = _buffer(kind, tmp_path, "a")
    rb.extend(_batch(5, seed=0))
    rb.dumps(tmp_path / "rb")
    leaf = tmp_path / "rb" / "storage" / "obs.memmap"
    data = bytearray(leaf.read_bytes())
    data[7] ^= 0x04
    leaf.write_bytes(bytes(data))

    target = _buffer(kind, tmp_path, "b")
    mine = _batch(1, seed=9)
    target.extend(mine)
    with pytest.raises(IntegrityError, match=r"obs\.memmap"):
        target.loads(tmp_path / "rb")
    assert len(target) == 1 and (target[:1] == mine).all()
    # an empty buffer (its checksums are read while the data is copied) stays empty
    empty = _buffer(kind, tmp_path, "c")
    with pytest.raises(IntegrityError, match=r"obs\.memmap"):
        empty.loads(tmp_path / "rb")
    assert not empty.storage.initialized and len(empty) == 0
    empty.extend(mine)  # and still works
    assert len(empty) == 1 and (empty[:1] == mine).all()


def test_a_mismatched_storage_is_refused_before_any_change(kind: str, tmp_path: Path) -> None:
    rb = _buffer(kind, tmp_path, "a")
    rb.extend(_batch(5, seed=0))
    rb.dumps(tmp_path / "rb")
    small = _buffer(kind, tmp_path, "b", capacity=8)
    mine = _batch(1, seed=9)
    small.extend(mine)
    with pytest.raises(
        RestoreError, match=r"obs: the storage has float32\[8, 3\], the dump float32\[16, 3\]"
    ):
        small.loads(tmp_path / "rb")
    assert len(small) == 1 and (small[:1] == mine).all()
    empty = _buffer(kind, tmp_path, "c", capacity=8)
    with pytest.raises(RestoreError, match="holds 8 rows"):
        empty.loads(tmp_path / "rb")
    assert not empty.storage.initialized


def test_an_empty_storage_is_refused(kind: str, tmp_path: Path) -> None:
    rb = _buffer(kind, tmp_path, "a")
    with pytest.raises(UnsupportedContentError, match="holds no tensordict yet"):
        rb.storage.dumps(tmp_path / "storage")
    assert not (tmp_path / "storage").exists()


def test_through_torchrl_checkpoint(kind: str, tmp_path: Path) -> None:
    rb = _buffer(kind, tmp_path, "a")
    data = _batch(5, seed=0)
    rb.extend(data)
    path = Checkpoint(buffer=rb).save(tmp_path / "ckpt")
    resumed = _buffer(kind, tmp_path, "b")
    assert Checkpoint(buffer=resumed).load(path).loaded == {"buffer"}
    assert len(resumed) == 5 and (resumed[:5] == data).all()
