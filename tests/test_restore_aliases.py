"""In-place restores refuse aliased targets: one object reachable under two saved keys.

``load_memmap_`` reuses the target's nested objects. If the target holds the same
sub-tensordict (lazy stack member, tensorclass, NonTensorData) under two keys that the
checkpoint saved as two levels, both levels would be loaded into the one object and the
last would silently win. tdckpt refuses that in the prepare stage, before anything is
touched: a RestoreError names both keys and the fix, and the target keeps its keys, values
and nested objects. Aliases that the restore does not load into twice (the other key is
stale, or holds a leaf in the checkpoint) are restored as usual.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _restore_helpers import objects, state
from conftest import tree_digest
from fixture_types import FixtureTC
from tensordict import LazyStackedTensorDict, NonTensorData, TensorDict

import tdckpt
from tdckpt.errors import RestoreError


def _saved(tmp_path: Path, td: TensorDict) -> Path:
    prefix = tmp_path / "ckpt"
    td.memmap(prefix)
    return prefix


def _snapshot(target: Any) -> tuple[Any, dict[Any, int]]:
    return state(target), {k: id(v) for k, v in objects(target).items()}


def _refused(target: Any, prefix: Path, *keys: str) -> RestoreError:
    before = _snapshot(target)
    disk = tree_digest(prefix)
    with pytest.raises(RestoreError) as info:
        tdckpt.load_memmap_(target, prefix)
    message = str(info.value)
    for key in keys:
        assert repr(key) in message, message
    assert "clone" in message and "nothing was changed" in message
    assert _snapshot(target) == before
    assert tree_digest(prefix) == disk
    return info.value


def test_same_sub_tensordict_under_two_keys_is_refused(tmp_path: Path) -> None:
    prefix = _saved(
        tmp_path,
        TensorDict(
            a=TensorDict(x=torch.ones(2), batch_size=[2]),
            b=TensorDict(x=torch.full((2,), 2.0), batch_size=[2]),
            batch_size=[2],
        ),
    )
    sub = TensorDict(x=torch.zeros(2), batch_size=[2])
    target = TensorDict(a=sub, b=sub, batch_size=[2])
    err = _refused(target, prefix, "a", "b")
    assert err.facts["keys"] == ["a", "b"]
    assert target["a"] is sub and target["b"] is sub
    # The documented fix works: clone one of them, and each gets its own saved values.
    target["b"] = target["b"].clone()
    tdckpt.load_memmap_(target, prefix)
    assert target["a"] is sub
    assert target["a", "x"].tolist() == [1.0, 1.0] and target["b", "x"].tolist() == [2.0, 2.0]


def test_aliases_at_different_depths_are_refused(tmp_path: Path) -> None:
    inner = TensorDict(x=torch.ones(2), batch_size=[2])
    prefix = _saved(
        tmp_path,
        TensorDict(
            a=inner.clone(),
            n=TensorDict(m=inner.clone() * 3, batch_size=[2]),
            batch_size=[2],
        ),
    )
    sub = TensorDict(x=torch.zeros(2), batch_size=[2])
    target = TensorDict(a=sub, n=TensorDict(m=sub, batch_size=[2]), batch_size=[2])
    _refused(target, prefix, "a", "n.m")


def test_a_level_that_holds_its_own_parent_is_refused(tmp_path: Path) -> None:
    prefix = _saved(
        tmp_path,
        TensorDict(
            n=TensorDict(back=TensorDict(x=torch.ones(2), batch_size=[2]), batch_size=[2]),
            batch_size=[2],
        ),
    )
    target = TensorDict(batch_size=[2])
    child = TensorDict(batch_size=[2])
    target["n"] = child
    child._tensordict["back"] = target  # tensordict refuses only a direct self-reference
    with pytest.raises(RestoreError) as info:
        tdckpt.load_memmap_(target, prefix)
    assert "'<root>' and 'n.back'" in str(info.value)
    assert list(target._tensordict) == ["n"] and target._tensordict["n"] is child
    assert list(child._tensordict) == ["back"] and child._tensordict["back"] is target


def test_lazy_stack_holding_one_member_twice_is_refused(tmp_path: Path) -> None:
    prefix = _saved(
        tmp_path,
        TensorDict(
            s=LazyStackedTensorDict(
                TensorDict(x=torch.ones(2), batch_size=[2]),
                TensorDict(x=torch.full((2,), 2.0), batch_size=[2]),
            ),
            batch_size=[2],
        ),
    )
    member = TensorDict(x=torch.zeros(2), batch_size=[2])
    target = TensorDict(s=LazyStackedTensorDict(member, member), batch_size=[2])
    _refused(target, prefix, "s.0", "s.1")


def test_same_tensorclass_under_two_keys_is_refused(tmp_path: Path) -> None:
    def tc(value: float) -> FixtureTC:
        return FixtureTC(
            obs=torch.full((2,), value), reward=torch.ones(2), label="l", extra="e", batch_size=[2]
        )

    prefix = _saved(tmp_path, TensorDict(p=tc(1.0), q=tc(2.0), batch_size=[2]))
    point = tc(0.0)
    target = TensorDict(p=point, q=point, batch_size=[2])
    _refused(target, prefix, "p", "q")


def test_same_non_tensor_data_under_two_keys_is_refused(tmp_path: Path) -> None:
    prefix = _saved(
        tmp_path,
        TensorDict(
            u=NonTensorData("one", batch_size=[2]),
            v=NonTensorData("two", batch_size=[2]),
            batch_size=[2],
        ),
    )
    value = NonTensorData("old", batch_size=[2])
    target = TensorDict(u=value, v=value, batch_size=[2])
    _refused(target, prefix, "u", "v")
    assert target["u"] == "old"


def test_plain_dict_target_with_aliases_is_refused(tmp_path: Path) -> None:
    prefix = _saved(
        tmp_path,
        TensorDict(
            a=TensorDict(x=torch.ones(2), batch_size=[2]),
            b=TensorDict(x=torch.full((2,), 2.0), batch_size=[2]),
            batch_size=[2],
        ),
    )
    sub: dict[str, Any] = {"x": torch.zeros(2)}
    target = {"a": sub, "b": sub}
    with pytest.raises(RestoreError, match="'a' and 'b'"):
        tdckpt.load_memmap_(target, prefix)
    assert target["a"] is sub and target["b"] is sub and list(sub) == ["x"]
    assert sub["x"].tolist() == [0.0, 0.0]


def test_manager_restore_into_refuses_aliases(tmp_path: Path) -> None:
    mgr = tdckpt.CheckpointManager(tmp_path / "run")
    mgr.save(
        1,
        TensorDict(
            a=TensorDict(x=torch.ones(2), batch_size=[2]),
            b=TensorDict(x=torch.full((2,), 2.0), batch_size=[2]),
            batch_size=[2],
        ),
    )
    sub = TensorDict(x=torch.zeros(2), batch_size=[2])
    target = TensorDict(a=sub, b=sub, batch_size=[2])
    before = _snapshot(target)
    with pytest.raises(RestoreError, match="'a' and 'b'"):
        mgr.restore_into(target)
    assert _snapshot(target) == before


@pytest.mark.parametrize("other", ["stale", "leaf"])
def test_an_alias_loaded_into_once_restores(tmp_path: Path, other: str) -> None:
    """Only a double load is refused: a stale alias is removed, a leaf replaces the other."""
    saved = TensorDict(a=TensorDict(x=torch.ones(2), batch_size=[2]), batch_size=[2])
    if other == "leaf":
        saved["b"] = torch.full((2,), 5.0)
    prefix = _saved(tmp_path, saved)
    sub = TensorDict(x=torch.zeros(2), batch_size=[2])
    target = TensorDict(a=sub, b=sub, batch_size=[2])
    tdckpt.load_memmap_(target, prefix)
    assert target["a"] is sub and target["a", "x"].tolist() == [1.0, 1.0]
    if other == "leaf":
        assert target["b"].tolist() == [5.0, 5.0]
    else:
        assert "b" not in target
