"""A restore racing ``tdckpt.save(prefix, overwrite=True)``: the old or the new tree, not an error.

An overwrite swaps the new tree in (``renameat2(RENAME_EXCHANGE)``) and removes the old one; a
reader that had opened the old tree sees its files vanish and must read the prefix again. The
reader tells "the whole tree was replaced" (read again) from "a file inside the tree changed"
(refused) by the tree's identity. The directory's inode number alone is not one: the old
tree's folder is removed, and a later save's new folder may get the freed number. Here that
happens deterministically: while a restore maps its first leaf, the prefix is overwritten
until its folder has the inode number the restore saw, holding another tree.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

tensordict = pytest.importorskip("tensordict")

from tensordict import TensorDict  # noqa: E402

import tdckpt  # noqa: E402
from tdckpt._restore import plan as plan_mod  # noqa: E402
from tdckpt._restore import reading  # noqa: E402
from tdckpt.errors import TdckptError  # noqa: E402

#: Overwrites tried before concluding the file system does not hand the freed number out again.
_MAX_OVERWRITES = 300


def _make(value: int) -> TensorDict:
    leaf = torch.full((64,), float(value))
    return TensorDict({"a": leaf, "n": {"b": leaf.clone()}}, batch_size=[])


def _overwrite_until_the_inode_comes_back(prefix: Path, ino: int) -> int | None:
    """Overwrite ``prefix`` until its folder is a new tree with inode number ``ino`` again;
    the value that tree holds, or None if the number never came back."""
    for value in range(1, _MAX_OVERWRITES + 1):
        tdckpt.save(_make(value), prefix, overwrite=True, fsync=False)
        if os.stat(prefix).st_ino == ino:
            return value
    return None


def _replace_twice(monkeypatch: pytest.MonkeyPatch, prefix: Path) -> list[int | None]:
    """The race, step by step: the restore notes what the prefix names (tree A, inode X);
    an overwrite swaps tree B in and removes A (X is free); the restore opens and validates B;
    when it maps its first leaf, overwrites go on until the prefix is a tree at inode X
    again. B's files vanish under the restore. The value of the last tree is recorded."""
    ino = os.stat(prefix).st_ino
    replaced: list[int | None] = []
    real_identity = reading._identity
    real_leaves = plan_mod.Mapper.leaves
    noted: list[object] = []

    def identity(where: Any) -> Any:
        out = real_identity(where)
        if not noted:  # the first read's note: the old tree is replaced right after it
            noted.append(out)
            tdckpt.save(_make(1000), prefix, overwrite=True, fsync=False)
        return out

    def leaves(self: plan_mod.Mapper, nodes: Any) -> list[torch.Tensor]:
        if not replaced:
            replaced.append(_overwrite_until_the_inode_comes_back(prefix, ino))
        return real_leaves(self, nodes)

    monkeypatch.setattr(reading, "_identity", identity)
    monkeypatch.setattr(plan_mod.Mapper, "leaves", leaves)
    return replaced


# robust_key=None takes the general read; True the current-form lane first (which reads
# again, generally, after any failure of its own) - both must end on the new tree.
_LOADS: dict[str, Callable[[Path], Any]] = {
    "load_memmap": lambda prefix: tdckpt.load_memmap(prefix, robust_key=None),
    "load_memmap_": lambda prefix: tdckpt.load_memmap_(_make(-1), prefix, robust_key=None),
    "load_memmap-lane": lambda prefix: tdckpt.load_memmap(prefix),
    "load_memmap_-lane": lambda prefix: tdckpt.load_memmap_(_make(-1), prefix),
}


@pytest.mark.parametrize("load", sorted(_LOADS))
def test_a_prefix_replaced_by_a_tree_at_the_same_inode_number_is_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, load: str
) -> None:
    prefix = tmp_path / "ckpt"
    tdckpt.save(_make(-2), prefix, fsync=False)
    tdckpt.save(_make(0), prefix, overwrite=True, fsync=False)  # a folder an overwrite made
    replaced = _replace_twice(monkeypatch, prefix)
    try:
        out = _LOADS[load](prefix)
    except TdckptError as exc:
        if replaced == [None]:
            pytest.skip("this file system never handed the freed inode number out again")
        raise AssertionError(f"the replaced tree was refused instead of read again: {exc}") from exc
    if replaced == [None]:
        pytest.skip("this file system never handed the freed inode number out again")
    [value] = replaced
    assert value is not None and value > 0
    # the tree the prefix holds now, whole: not the vanished one, not a mix
    assert out["a"].tolist() == [float(value)] * 64
    assert out["n", "b"].tolist() == [float(value)] * 64
