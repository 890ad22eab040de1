"""Selective restore, the rest: the report's ``unexpected``, ``device=``, training states, and
what a subset restore touches on disk (counted by the kernel, see ``_fs_access``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _fs_access import Access, mapped_bytes, needs_linux
from tensordict import TensorDict

import tdckpt
from tdckpt import CheckpointManager, RandomState
from tdckpt.errors import RestoreError

MiB = 1 << 20


def _td() -> TensorDict:
    return TensorDict(
        model=TensorDict(
            enc=TensorDict(weight=torch.ones(2), bias=torch.zeros(2)),
            dec=TensorDict(weight=torch.full((3,), 2.0)),
        ),
        buffer=TensorDict(obs=torch.arange(8.0).reshape(4, 2), batch_size=[4]),
        step=torch.tensor(5),
    )


@pytest.fixture
def prefix(tmp_path: Path) -> Path:
    _td().memmap(tmp_path / "p")
    return tmp_path / "p"


def _keys(td: Any) -> set[tuple[str, ...]]:
    return {(k,) if isinstance(k, str) else k for k in td.keys(True, True)}


# -- what a local subset restore touches, counted ----------------------------------------------


@needs_linux
def test_a_subset_restore_opens_and_maps_only_its_leaves(tmp_path: Path) -> None:
    big = TensorDict(
        policy=TensorDict(weight=torch.randn(256, 256), bias=torch.randn(256)),
        replay=TensorDict(obs=torch.randn(1024, 1024), action=torch.randn(1024, 64)),
    )
    prefix = tmp_path / "ckpt"
    big.memmap(prefix)
    with Access(prefix) as seen:
        whole = tdckpt.load_memmap(prefix)
    whole_opened, whole_mapped = seen.leaves_opened(), sum(mapped_bytes(prefix).values())
    assert len(whole_opened) == 4 and whole_mapped >= 4 * MiB + 256 * 1024
    del whole
    assert mapped_bytes(prefix) == {}  # unmapped with the object

    with Access(prefix) as seen:
        part = tdckpt.load_memmap(prefix, keys="policy")
    assert seen.leaves_opened() == {"policy/weight.memmap", "policy/bias.memmap"}
    assert all(seen.opened[name] == 1 for name in seen.leaves_opened())  # each opened once
    mapped = mapped_bytes(prefix)
    assert set(mapped) == {"policy/weight.memmap", "policy/bias.memmap"}
    assert 256 * 1024 + 1024 <= sum(mapped.values()) <= 256 * 1024 + 2 * 4096 + 4096
    assert sum(mapped.values()) * 16 < whole_mapped
    assert torch.equal(part["policy", "weight"], big["policy", "weight"])
    del part

    # in place, through the manager: the same count
    with CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, big)
        step = tmp_path / "run" / "1"
        target = TensorDict(policy=TensorDict(weight=torch.zeros(256, 256), bias=torch.zeros(256)))
        with Access(step) as seen:
            mgr.restore_into(target, keys="policy.weight")
        assert seen.leaves_opened() == {"policy/weight.memmap"}
        assert set(mapped_bytes(step)) == {"policy/weight.memmap"}
        assert torch.equal(target["policy", "bias"], torch.zeros(256))
