"""A selective restore opens, validates and maps only the selected leaves (counted).

Files opened are counted by wrapping ``os.open`` (the call every storage open goes through);
bytes mapped are read from ``/proc/self/maps`` while the restored tensors are alive; what is
validated is the node tree the lane builds. No timing is asserted.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict

import tdckpt
from tdckpt import CheckpointManager
from tdckpt._read.lane import open_current
from tdckpt._read.nodes import LeafNode, Node, TensorDictNode
from tdckpt._restore.select import Selection

N = 120
LEAF_BYTES = 4 * 4096  # four pages a leaf


def _td() -> TensorDict:
    leaves = {f"w{i:03d}": torch.full((LEAF_BYTES // 4,), float(i)) for i in range(N)}
    return TensorDict(
        {**leaves, "sub": TensorDict({f"x{i}": torch.ones(LEAF_BYTES // 4) for i in range(10)})}
    )


KEYS = ["w007", "sub.x3"]
SELECTED = {"w007.memmap", "x3.memmap"}


@pytest.fixture
def opened_names(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The base name of every leaf file (``*.memmap``) opened."""
    seen: list[str] = []
    real = os.open

    def counting(path: Any, *args: Any, **kwargs: Any) -> int:
        name = os.path.basename(os.fsdecode(path))
        if name.endswith(".memmap"):
            seen.append(name)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", counting)
    return seen


def _mapped_under(prefix: Path) -> dict[str, int]:
    """Bytes of ``prefix``'s files mapped into this process, by file name."""
    out: dict[str, int] = {}
    root = os.path.realpath(prefix)
    with open("/proc/self/maps") as fh:
        for line in fh:
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or not parts[5].strip().startswith(root + os.sep):
                continue
            start, end = (int(x, 16) for x in parts[0].split("-"))
            name = os.path.basename(parts[5].strip())
            out[name] = out.get(name, 0) + end - start
    return out


needs_proc = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="/proc/self/maps is Linux's"
)


@needs_proc
def test_only_the_selected_leaves_are_opened_and_mapped(
    tmp_path: Path, opened_names: list[str]
) -> None:
    prefix = tmp_path / "ck"
    tdckpt.save(_td(), prefix)
    opened_names.clear()
    out = tdckpt.load_memmap(prefix, keys=KEYS)
    assert set(opened_names) == SELECTED
    mapped = _mapped_under(prefix)
    assert set(mapped) == SELECTED
    assert sum(mapped.values()) == 2 * LEAF_BYTES
    assert out["w007"][0].item() == 7.0 and out["sub", "x3"].sum().item() == LEAF_BYTES // 4
    del out
    # the whole restore, for contrast: every leaf
    opened_names.clear()
    whole = tdckpt.load_memmap(prefix)
    assert len(set(opened_names)) == N + 10
    assert len(_mapped_under(prefix)) == N + 10
    del whole


@needs_proc
def test_the_managers_selective_restore_opens_only_the_selection(
    tmp_path: Path, opened_names: list[str]
) -> None:
    with CheckpointManager(tmp_path / "root") as mgr:
        mgr.save(1, _td())
        opened_names.clear()
        out, report = mgr.restore(1, keys=KEYS, report=True)
        assert set(opened_names) == SELECTED
        assert set(_mapped_under(tmp_path / "root")) == SELECTED
        assert len(report.skipped) == N + 10 - 2
        del out


def _leaf_count(node: Node | None) -> int:
    if isinstance(node, TensorDictNode):
        return sum(_leaf_count(child) for child in node.entries.values())
    return 1 if isinstance(node, LeafNode) else 0


def test_the_lane_validates_only_the_selection(tmp_path: Path) -> None:
    prefix = tmp_path / "ck"
    tdckpt.save(_td(), prefix)
    selection = Selection.of(KEYS, None)
    assert selection is not None
    opened = open_current(prefix, robust_key=True, selection=selection)
    assert opened is not None
    try:
        assert _leaf_count(opened.root) == 2  # validated: the selection only
        assert sorted(f for f in opened.tree.files if f.endswith(".memmap")) == ["w007.memmap"]
        assert sorted(opened.tree.dirs["sub"].files) == ["x3.memmap"]
        assert opened.pruned is not None
        assert len(opened.pruned.skipped) == N + 10 - 2
        assert opened.pruned.top[:2] == ["w000", "w001"] and "sub" in opened.pruned.top
    finally:
        opened.close()
    whole = open_current(prefix, robust_key=True)
    assert whole is not None
    try:
        assert _leaf_count(whole.root) == N + 10 and whole.pruned is None
    finally:
        whole.close()
