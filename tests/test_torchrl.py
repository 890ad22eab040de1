"""TorchRL replay buffers: what ``ReplayBuffer.dumps(path)`` writes, read by tdckpt.

``dumps`` writes ``path/storage/`` (the storage's tensordict, saved by tensordict's own
``memmap``, plus TorchRL's ``storage_metadata.json``), ``path/writer/metadata.json``,
``path/buffer_metadata.json`` and ``path/prefetch.pkl``. tdckpt inspects, validates,
upgrades and restores ``path/storage`` - in place, into the buffer's storage - and names
``storage/`` when it is given the buffer's folder.

torchrl is not a test dependency of the default environment: these tests run in the
``tests-0.14`` nox session, which installs torchrl 0.14.1 (it pins ``tensordict<0.15``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

torchrl_data = pytest.importorskip("torchrl.data", reason="torchrl: the tests-0.14 nox session")

from _tdversion import WRITES_FORMAT_VERSION  # noqa: E402
from tensordict import TensorDict  # noqa: E402

import tdckpt  # noqa: E402
from tdckpt.errors import CheckpointNotFoundError  # noqa: E402

CAPACITY = 16
STORAGES = {
    "LazyMemmapStorage": torchrl_data.LazyMemmapStorage,
    "LazyTensorStorage": torchrl_data.LazyTensorStorage,
}


def _batch(n: int, seed: int) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    return TensorDict(
        {
            "obs": torch.randn(n, 3, generator=g),
            "action": torch.randint(0, 4, (n,), generator=g),
            "next": {
                "obs": torch.randn(n, 3, generator=g),
                "reward": torch.randn(n, 1, generator=g),
                "done": torch.zeros(n, 1, dtype=torch.bool),
            },
        },
        batch_size=[n],
    )


def _buffer(kind: str, tmp_path: Path, name: str) -> Any:
    storage_cls = STORAGES[kind]
    if kind == "LazyMemmapStorage":
        storage = storage_cls(CAPACITY, scratch_dir=tmp_path / f"scratch-{name}")
    else:
        storage = storage_cls(CAPACITY)
    return torchrl_data.ReplayBuffer(storage=storage)


@pytest.fixture(params=sorted(STORAGES))
def dumped(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, Path, TensorDict]:
    """A real buffer of 5 transitions, dumped: (storage kind, buffer folder, the data)."""
    rb = _buffer(request.param, tmp_path, "saved")
    data = _batch(5, seed=0)
    rb.extend(data)
    path = tmp_path / "buffer"
    rb.dumps(path)
    return request.param, path, data


def _leaves(node: Any) -> list[Any]:
    if node.kind == "leaf":
        return [node]
    return [leaf for child in node.children for leaf in _leaves(child)]


def _files(root: Path) -> dict[str, bytes]:
    return {
        os.path.relpath(os.path.join(d, f), root): Path(d, f).read_bytes()
        for d, _, fs in os.walk(root)
        for f in fs
    }


def test_dumps_layout_is_what_the_tests_assume(dumped: tuple[str, Path, TensorDict]) -> None:
    _, path, _ = dumped
    assert (path / "buffer_metadata.json").is_file()
    assert (path / "storage" / "meta.json").is_file()
    meta = json.loads((path / "storage" / "storage_metadata.json").read_text())
    assert meta["is_pytree"] is False and meta["len"] == 5


def test_validate_and_inspect_the_storage(dumped: tuple[str, Path, TensorDict]) -> None:
    _, path, _ = dumped
    report = tdckpt.validate(path / "storage")
    assert report.ok, report.problems
    # storage_metadata.json is TorchRL's sidecar, not a stray file.
    assert [p for p in report.problems if p.severity != "info"] == []
    info = tdckpt.inspect(path / "storage")
    shapes = {".".join(n.key): n.shape for n in _leaves(info.root)}
    assert shapes == {
        "obs": [CAPACITY, 3],
        "action": [CAPACITY],
        "next.obs": [CAPACITY, 3],
        "next.reward": [CAPACITY, 1],
        "next.done": [CAPACITY, 1],
    }


def test_the_buffer_folder_names_its_storage(dumped: tuple[str, Path, TensorDict]) -> None:
    _, path, _ = dumped
    report = tdckpt.validate(path)
    assert not report.ok
    (problem,) = report.problems
    assert "TorchRL replay buffer" in problem.message
    assert repr(str(path / "storage")) in problem.message
    with pytest.raises(CheckpointNotFoundError, match=r"Pass .*storage"):
        tdckpt.load_memmap(path)


def test_restore_in_place_into_the_buffer_storage(
    dumped: tuple[str, Path, TensorDict], tmp_path: Path
) -> None:
    kind, path, data = dumped
    before = _files(path)
    rb = _buffer(kind, tmp_path, "resumed")
    rb.extend(_batch(1, seed=1))  # a lazy storage gets its tensordict on the first write
    storage_td = rb.storage._storage
    out = tdckpt.load_memmap_(storage_td, path / "storage", mode="r")
    assert out is storage_td and rb.storage._storage is storage_td
    rb.storage._len = json.loads((path / "storage" / "storage_metadata.json").read_text())["len"]
    rb.writer.loads(path / "writer")

    assert len(rb) == 5
    assert (rb[:5] == data).all()
    assert rb.sample(3).batch_size == torch.Size([3])
    rb.extend(_batch(2, seed=2))  # the writer goes on at the saved cursor
    assert len(rb) == 7
    assert (rb[:5] == data).all() and (rb[5:7] == _batch(2, seed=2)).all()
    # mode="r" maps copy-on-write: the buffer's writes never reach the checkpoint.
    assert _files(path) == before
    # and TorchRL itself still loads what tdckpt read
    again = _buffer(kind, tmp_path, "torchrl")
    again.loads(path)
    assert len(again) == 5 and (again[:5] == data).all()


def test_upgrade_keeps_what_torchrl_needs(
    dumped: tuple[str, Path, TensorDict], tmp_path: Path
) -> None:
    kind, path, data = dumped
    report = tdckpt.upgrade(path / "storage")
    assert report.to_generation == "G8"
    assert bool(report.steps) == (not WRITES_FORMAT_VERSION)  # 0.14 writes G6: migrated
    assert tdckpt.validate(path / "storage").ok
    assert (path / "storage" / "storage_metadata.json").is_file()
    rb = _buffer(kind, tmp_path, "after-upgrade")
    rb.loads(path)
    assert len(rb) == 5 and (rb[:5] == data).all()
