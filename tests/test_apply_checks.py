"""Every check of ``tdckpt/_restore/apply.py``, one test each (found by a mutation pass).

The apply stage decides, per level, whether the target's object is reused or a new value
replaces it, refuses targets that cannot hold the checkpoint, and sets the lock and memmap
state of a memory-mapped target. ``test_restore_failures.py`` covers most refusals; these
tests cover the decisions it does not: which existing objects are reused (and which are
replaced), the batch checks of non-leaf entries, the device of the target, and the memmap
flags of every level and non-tensor value after restoring into a memory-mapped target.
``tools/mutate.py`` shows that each is needed.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from _restore_helpers import state
from fixture_types import FixtureTC
from tensordict import (
    LazyStackedTensorDict,
    NonTensorData,
    TensorDict,
    TensorDictBase,
    TensorDictParams,
    is_tensorclass,
)
from tensordict.tensorclass import MetaData, NonTensorDataBase

import tdckpt
from tdckpt.errors import RestoreError


def _tc(value: float = 1.0) -> FixtureTC:
    return FixtureTC(
        obs=torch.full((2, 2), value), reward=torch.ones(2), label="l", extra="e", batch_size=[2]
    )


def _saved(tmp_path: Path, td: Any, name: str = "ckpt") -> Path:
    prefix = tmp_path / name
    td.memmap(prefix)
    return prefix


def _refused(target: Any, prefix: Path, match: str) -> None:
    before = state(target)
    with pytest.raises(RestoreError, match=match):
        tdckpt.load_memmap_(target, prefix)
    assert state(target) == before


# -- the kind of the root target ---------------------------------------------------------------


def test_a_tensorclass_checkpoint_into_non_tensor_data(tmp_path: Path) -> None:
    prefix = _saved(tmp_path, _tc())
    _refused(
        NonTensorData("x", batch_size=[2]),
        prefix,
        "holds a tensorclass .*FixtureTC.*the target is a NonTensorData",
    )


def test_a_tensordict_checkpoint_into_a_lazy_stack(tmp_path: Path) -> None:
    prefix = _saved(tmp_path, TensorDict(c=torch.ones(2, 3), batch_size=[2]))
    target = LazyStackedTensorDict(
        TensorDict(c=torch.zeros(3), batch_size=[]), TensorDict(c=torch.zeros(3), batch_size=[])
    )
    _refused(target, prefix, "holds a TensorDict, the target is a LazyStackedTensorDict")


# -- which nested objects are reused, which replaced ------------------------------------------


def test_a_lazy_stack_where_the_checkpoint_holds_a_tensordict_is_replaced(tmp_path: Path) -> None:
    prefix = _saved(
        tmp_path, TensorDict(n=TensorDict(c=torch.ones(2, 3), batch_size=[2]), batch_size=[2])
    )
    stack = LazyStackedTensorDict(
        TensorDict(c=torch.zeros(3), batch_size=[]), TensorDict(c=torch.zeros(3), batch_size=[])
    )
    target = TensorDict(n=stack, batch_size=[2])
    tdckpt.load_memmap_(target, prefix)
    assert type(target["n"]) is TensorDict and target["n"] is not stack
    assert target["n", "c"].tolist() == [[1.0] * 3] * 2


def test_non_tensor_data_where_the_checkpoint_holds_a_tensordict_is_replaced(
    tmp_path: Path,
) -> None:
    prefix = _saved(
        tmp_path, TensorDict(n=TensorDict(c=torch.ones(2, 3), batch_size=[2]), batch_size=[2])
    )
    target = TensorDict(n=NonTensorData("old", batch_size=[2]), batch_size=[2])
    tdckpt.load_memmap_(target, prefix)
    assert type(target.get("n")) is TensorDict and target["n", "c"].tolist() == [[1.0] * 3] * 2


def test_a_tensorclass_of_another_class_is_replaced(tmp_path: Path) -> None:
    from tensordict import tensorclass

    @tensorclass
    class Other:
        obs: torch.Tensor

    prefix = _saved(tmp_path, TensorDict(tc=_tc(3.0), batch_size=[2]))
    other = Other(obs=torch.zeros(2, 2), batch_size=[2])
    target = TensorDict(tc=other, batch_size=[2])
    tdckpt.load_memmap_(target, prefix)
    assert type(target["tc"]) is FixtureTC and target["tc"].obs.tolist() == [[3.0, 3.0]] * 2


def test_a_tensorclass_of_the_saved_class_is_reused(tmp_path: Path) -> None:
    prefix = _saved(tmp_path, TensorDict(tc=_tc(3.0), batch_size=[2]))
    mine = _tc(0.0)
    target = TensorDict(tc=mine, batch_size=[2])
    tdckpt.load_memmap_(target, prefix)
    assert target["tc"] is mine and mine.obs.tolist() == [[3.0, 3.0]] * 2


def test_a_lazy_stack_of_another_length_is_replaced(tmp_path: Path) -> None:
    def stack(n: int, value: float) -> LazyStackedTensorDict:
        return LazyStackedTensorDict(
            *[TensorDict(x=torch.full((2,), value), batch_size=[2]) for _ in range(n)], stack_dim=1
        )

    prefix = _saved(tmp_path, TensorDict(s=stack(2, 1.0), batch_size=[2]))
    three = stack(3, 0.0)
    target = TensorDict(s=three, batch_size=[2])
    tdckpt.load_memmap_(target, prefix)
    assert target["s"] is not three and len(target["s"].tensordicts) == 2
    same = stack(2, 0.0)
    target = TensorDict(s=same, batch_size=[2])
    tdckpt.load_memmap_(target, prefix)
    assert target["s"] is same and same.tensordicts[1]["x"].tolist() == [1.0, 1.0]


def test_non_tensor_data_is_reused_with_the_saved_value(tmp_path: Path) -> None:
    prefix = _saved(tmp_path, TensorDict(v=NonTensorData("new", batch_size=[2]), batch_size=[2]))
    old = NonTensorData("old", batch_size=[2])
    target = TensorDict(v=old, batch_size=[2])
    tdckpt.load_memmap_(target, prefix)
    assert target.get("v") is old and target["v"] == "new"


def test_non_tensor_data_where_metadata_was_saved_is_replaced(tmp_path: Path) -> None:
    prefix = _saved(tmp_path, TensorDict(m=MetaData("info", batch_size=[2]), batch_size=[2]))
    old = NonTensorData("old", batch_size=[2])
    target = TensorDict(m=old, batch_size=[2])
    tdckpt.load_memmap_(target, prefix)
    assert type(target.get("m")) is MetaData and target["m"] == "info"


def test_nested_plain_dicts_are_reused(tmp_path: Path) -> None:
    prefix = _saved(
        tmp_path, TensorDict(n=TensorDict(c=torch.ones(2), batch_size=[2]), batch_size=[2])
    )
    inner: dict[str, Any] = {"c": torch.zeros(2), "stale": 1}
    target: dict[str, Any] = {"n": inner}
    tdckpt.load_memmap_(target, prefix)
    assert target["n"] is inner and list(inner) == ["c"] and inner["c"].tolist() == [1.0, 1.0]


# -- batch checks of entries -------------------------------------------------------------------


def test_a_nested_leaf_is_checked_by_its_elements_not_its_size_table(tmp_path: Path) -> None:
    with warnings.catch_warnings():  # torch: "nested tensors are in prototype stage"
        warnings.simplefilter("ignore", UserWarning)
        nt = torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(2, 1)])
    prefix = _saved(tmp_path, TensorDict(nt=nt, batch_size=[2]))  # size table [2, 2]
    _refused(
        TensorDict(batch_size=[2, 2]),
        prefix,
        r"shape \[2\], which the target's batch size \[2, 2\]",
    )


def test_a_leaf_that_does_not_fit_the_target_batch(tmp_path: Path) -> None:
    prefix = _saved(tmp_path, TensorDict(a=torch.ones(2), batch_size=[2]))
    _refused(TensorDict(a=torch.zeros(3), batch_size=[3]), prefix, r"leaf 'a' has shape \[2\]")


@pytest.mark.parametrize("entry", ["td", "non-tensor", "tensorclass"])
def test_an_entry_that_does_not_fit_the_target_batch(tmp_path: Path, entry: str) -> None:
    value: Any = {
        "td": TensorDict(c=torch.ones(2), batch_size=[2]),
        "non-tensor": NonTensorData("x", batch_size=[2]),
        "tensorclass": _tc(),
    }[entry]
    prefix = _saved(tmp_path, TensorDict(e=value, batch_size=[2]))
    _refused(TensorDict(batch_size=[3]), prefix, r"entry 'e' has shape \[2\]")


# -- the target's device -------------------------------------------------------------------------


def test_a_target_on_the_meta_device_gets_structure_only(tmp_path: Path) -> None:
    prefix = _saved(tmp_path, TensorDict(a=torch.ones(2), batch_size=[2]))
    target = TensorDict(a=torch.zeros(2, device="meta"), batch_size=[2], device="meta")
    tdckpt.load_memmap_(target, prefix)
    assert target["a"].device.type == "meta" and tuple(target["a"].shape) == (2,)


# -- a memory-mapped target ends memory-mapped on the checkpoint -----------------------------------


def _full() -> TensorDict:
    return TensorDict(
        a=torch.ones(2),
        v=NonTensorData("v", batch_size=[2]),
        n=TensorDict(w=NonTensorData("w", batch_size=[2]), batch_size=[2]),
        s=LazyStackedTensorDict(
            *[
                TensorDict(
                    x=torch.ones(2), t=NonTensorData(f"m{i}", batch_size=[2]), batch_size=[2]
                )
                for i in range(2)
            ],
            stack_dim=1,
        ),
        tc=_tc(),
        batch_size=[2],
    )


def _levels(obj: Any, key: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """Every TensorDict level and NonTensorData of obj, by key."""
    if isinstance(obj, NonTensorDataBase) and not isinstance(obj, LazyStackedTensorDict):
        return [(key, obj)]
    if is_tensorclass(obj):
        return _levels(obj._tensordict, key)
    if isinstance(obj, LazyStackedTensorDict):
        return [lvl for i, m in enumerate(obj.tensordicts) for lvl in _levels(m, (*key, str(i)))]
    assert isinstance(obj, TensorDictBase)
    return [(key, obj)] + [
        lvl
        for k, v in obj._tensordict.items()
        if not isinstance(v, torch.Tensor)
        for lvl in _levels(v, (*key, k))
    ]


@pytest.mark.parametrize("reuse", [True, False], ids=["reused", "new"])
def test_a_memmapped_target_ends_memmapped_at_every_level(tmp_path: Path, reuse: bool) -> None:
    prefix = _saved(tmp_path, _full())
    target = (_full() if reuse else TensorDict(a=torch.zeros(2), batch_size=[2])).memmap_(
        tmp_path / "own"
    )
    tdckpt.load_memmap_(target, prefix)
    assert target.is_locked and target.is_memmap()
    levels = _levels(target)
    assert {k for k, _ in levels} >= {
        (),
        ("v",),
        ("n",),
        ("n", "w"),
        ("s", "0"),
        ("s", "1"),
        ("s", "1", "t"),
        ("tc",),
        ("tc", "label"),
    }
    for key, lvl in levels:
        td = lvl._tensordict if isinstance(lvl, NonTensorDataBase) else lvl
        parts = list(key)
        if parts[:1] == ["tc"]:  # a tensorclass's levels live under tc/_tensordict
            parts.insert(1, "_tensordict")
        # a NonTensorData's (file-less) TensorDict is recorded under <its dir>/_tensordict
        where = (
            prefix.joinpath(*parts) / "_tensordict"
            if isinstance(lvl, NonTensorDataBase)
            else prefix.joinpath(*parts)
        )
        assert td._is_memmap, key
        assert Path(td._memmap_prefix) == where, (key, td._memmap_prefix)


def test_after_mode_r_no_level_is_memmapped(tmp_path: Path) -> None:
    prefix = _saved(tmp_path, _full())
    target = _full().memmap_(tmp_path / "own")
    tdckpt.load_memmap_(target, prefix, mode="r")
    assert not target.is_locked
    for key, lvl in _levels(target):
        td = lvl._tensordict if isinstance(lvl, NonTensorDataBase) else lvl
        assert not td._is_memmap and td._memmap_prefix is None, key


# -- CheckpointManager.restore_into(strict=True) on lazy stacks ------------------------------------


def _hetero(value: float, extra: str = "y") -> LazyStackedTensorDict:
    return LazyStackedTensorDict(
        TensorDict(x=torch.full((2,), value), batch_size=[2]),
        TensorDict({extra: torch.full((2, 3), value)}, batch_size=[2]),
        stack_dim=1,
    )


def test_strict_restore_into_a_stack_whose_members_hold_different_keys(tmp_path: Path) -> None:
    """tensordict's nested key walk raises TypeError on such a stack; strict compares members."""
    mgr = tdckpt.CheckpointManager(tmp_path / "run", fsync=False)
    mgr.save(1, TensorDict(s=_hetero(1.0), batch_size=[2]))
    target = TensorDict(s=_hetero(0.0), batch_size=[2])
    mgr.restore_into(target)
    assert target["s"].tensordicts[1]["y"].tolist() == [[1.0] * 3] * 2
    other = TensorDict(s=_hetero(0.0, extra="w"), batch_size=[2])
    before = state(other)
    with pytest.raises(RestoreError, match="strict=True") as info:
        mgr.restore_into(other)
    assert info.value.missing == [("s", "1", "w")] and info.value.unexpected == [("s", "1", "y")]
    assert state(other) == before


def test_a_nested_lazy_stack_along_another_dim_is_replaced(tmp_path: Path) -> None:
    # As one of another length: the target's stack cannot take the saved one (it was
    # refused with a message naming no fix, while another length was replaced).
    members = [TensorDict(x=torch.full((2, 2), 1.0), batch_size=[2, 2]) for _ in range(2)]
    prefix = _saved(
        tmp_path, TensorDict(s=LazyStackedTensorDict(*members, stack_dim=2), batch_size=[2])
    )
    mine = LazyStackedTensorDict(
        *[TensorDict(x=torch.zeros(2, 2), batch_size=[2, 2]) for _ in range(2)], stack_dim=1
    )
    target = TensorDict(s=mine, batch_size=[2])
    tdckpt.load_memmap_(target, prefix)
    assert target["s"] is not mine and target["s"].stack_dim == 2
    assert target["s"]["x"].tolist() == torch.ones(2, 2, 2).tolist()


# -- found by a red-team review: what tensordict's own load_memmap_ gives (or refuses) ------


def test_a_level_new_to_a_named_target_takes_its_names(tmp_path: Path) -> None:
    saved = TensorDict(
        a=torch.ones(3, 2),
        n=TensorDict(x=torch.ones(3, 2, 5), batch_size=[3, 2]),
        batch_size=[3, 2],
    )
    prefix = _saved(tmp_path, saved)
    target = TensorDict(a=torch.zeros(3, 2), batch_size=[3, 2], names=["time", "env"])
    tdckpt.load_memmap_(target, prefix)
    assert target["n"].names == ["time", "env"] and target[0]["n"].names == ["env"]


def test_a_level_whose_saved_names_disagree_is_refused(tmp_path: Path) -> None:
    child = TensorDict(x=torch.ones(3, 2, 5), batch_size=[3, 2, 5], names=["p", "q", "r"])
    prefix = tmp_path / "ckpt"  # tdckpt.save records names (tensordict 0.14's memmap does not)
    tdckpt.save(TensorDict(a=torch.ones(3, 2), n=child, batch_size=[3, 2]), prefix)
    target = TensorDict(a=torch.zeros(3, 2), batch_size=[3, 2], names=["time", "env"])
    _refused(target, prefix, r"names dim 0 'p', the target names it 'time'.*td.rename_")


def test_a_level_locked_on_its_own_is_refused(tmp_path: Path) -> None:
    # td["n"].memmap_() locks "n" only: the commit (which unlocks a locked root) wrote
    # through its lock, leaving a locked level holding an unlocked new child.
    saved = TensorDict(
        n=TensorDict(
            b=torch.ones(3), m=TensorDict(q=torch.ones(3), batch_size=[3]), batch_size=[3]
        ),
        batch_size=[3],
    )
    prefix = _saved(tmp_path, saved)
    target = TensorDict(n=TensorDict(b=torch.zeros(3), batch_size=[3]), batch_size=[3])
    target["n"].memmap_(tmp_path / "own-n")
    _refused(target, prefix, r"at 'n' is locked \(memory-mapped on its own\).*unlock_")
    target["n"].unlock_()
    tdckpt.load_memmap_(target, prefix)
    assert target["n", "m", "q"].tolist() == [1.0] * 3


def test_a_wrapper_target_is_refused_with_the_way_to_copy_in(tmp_path: Path) -> None:
    prefix = _saved(tmp_path, TensorDict(a=torch.ones(2), batch_size=[2]))
    params = TensorDictParams(TensorDict(a=torch.zeros(2), batch_size=[2]))
    before = params["a"]
    with pytest.raises(RestoreError, match=r"TensorDictParams.*params.data.update_\(tdckpt"):
        tdckpt.load_memmap_(params, prefix)
    assert params["a"] is before and before.tolist() == [0.0, 0.0]
    params.data.update_(tdckpt.load_memmap(prefix))  # the fix the message gives works
    assert params["a"].tolist() == [1.0, 1.0] and isinstance(params["a"], torch.nn.Parameter)


def test_non_tensor_data_new_to_the_target_takes_the_saved_level_device(tmp_path: Path) -> None:
    prefix = _saved(tmp_path, TensorDict(s=NonTensorData("hi", batch_size=[3]), batch_size=[3]))
    expected = TensorDict.load_memmap(prefix).get("s").device
    for target in (TensorDict(batch_size=[3]), TensorDict(s=torch.zeros(3), batch_size=[3])):
        tdckpt.load_memmap_(target, prefix)
        assert target.get("s").device == expected == torch.device("cpu")
