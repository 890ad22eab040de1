"""A selective restore on the current-form lane prunes before validating (``lane_prune.py``).

What the selection leaves out is dropped right after the metadata is read: a damaged entry
outside the selection no longer refuses the restore on this path; anything damaged inside it
still does, all or nothing. And the lane's report is the general read's, key for key.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import NonTensorData, TensorDict, tensorclass

import tdckpt
import tdckpt._restore.reading as reading_mod
from tdckpt.errors import RestoreError, ValidationError


def _td() -> TensorDict:
    return TensorDict(
        a=torch.arange(4.0),
        b=torch.ones(4, dtype=torch.int64),
        n=TensorDict(c=torch.full((4, 2), 3.0), d=torch.zeros(4), batch_size=[4]),
        batch_size=[4],
    )


@pytest.fixture
def prefix(tmp_path: Path) -> Path:
    tdckpt.save(_td(), tmp_path / "ck")  # the current form (the lane's)
    return tmp_path / "ck"


@pytest.fixture
def lane_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail any restore that leaves the lane for the general read."""

    def general(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the general read ran")

    monkeypatch.setattr(reading_mod, "open_checkpoint", general)


def _damage_entry(level: Path, key: str, **fields: Any) -> None:
    meta = json.loads((level / "meta.json").read_text())
    meta[key].update(fields)
    (level / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize(
    "damage",
    ["unknown-dtype", "bad-shape", "missing-file", "short-file", "nested-level-entry"],
)
def test_damage_outside_the_selection_does_not_refuse_it(
    prefix: Path, damage: str, request: pytest.FixtureRequest
) -> None:
    if damage == "unknown-dtype":
        _damage_entry(prefix, "b", dtype="torch.float99")
    elif damage == "bad-shape":
        _damage_entry(prefix, "b", shape=[5])  # not under the batch size [4]
    elif damage == "missing-file":
        (prefix / "b.memmap").unlink()
    elif damage == "short-file":
        (prefix / "b.memmap").write_bytes(b"\0" * 3)
    else:
        _damage_entry(prefix / "n", "d", dtype="torch.float99")
    with pytest.raises(ValidationError):  # the whole step is damaged
        tdckpt.load_memmap(prefix)
    request.getfixturevalue("lane_only")
    out, report = tdckpt.load_memmap(prefix, keys=["a", "n.c"], report=True)
    assert set(out.keys(True, True)) == {"a", ("n", "c")}
    assert out["a"].tolist() == [0.0, 1.0, 2.0, 3.0] and out["n", "c"].sum().item() == 24.0
    assert report.loaded == [("a",), ("n", "c")]
    assert report.skipped == [("b",), ("n", "d")]
    # in place: only the selection is replaced, the rest of the target stays
    target = TensorDict(
        a=torch.zeros(4), b=torch.full((4,), 7), other=torch.ones(4), batch_size=[4]
    )
    tdckpt.load_memmap_(target, prefix, keys="a")
    assert target["a"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert target["b"].tolist() == [7, 7, 7, 7] and "other" in target.keys()  # noqa: SIM118 (TensorDict refuses `in`)


@pytest.mark.parametrize("damage", ["unknown-dtype", "short-file", "missing-file"])
def test_damage_inside_the_selection_refuses_and_changes_nothing(prefix: Path, damage: str) -> None:
    if damage == "unknown-dtype":
        _damage_entry(prefix, "b", dtype="torch.float99")
    elif damage == "short-file":
        (prefix / "b.memmap").write_bytes(b"\0" * 3)
    else:
        (prefix / "b.memmap").unlink()
    with pytest.raises(ValidationError, match="b"):
        tdckpt.load_memmap(prefix, keys=["a", "b"])
    target = TensorDict(a=torch.zeros(4), b=torch.full((4,), 7), batch_size=[4])
    a_before, b_before = target["a"], target["b"]
    with pytest.raises(ValidationError, match="b"):
        tdckpt.load_memmap_(target, prefix, keys="b")
    assert target["a"] is a_before and target["b"] is b_before
    assert target["b"].tolist() == [7, 7, 7, 7] and target["a"].tolist() == [0.0] * 4


def test_a_pattern_that_selects_nothing_names_the_whole_top_level(
    prefix: Path, request: pytest.FixtureRequest
) -> None:
    with pytest.raises(RestoreError, match=r"top-level keys: a, b, n"):
        tdckpt.load_memmap(prefix, keys=["a", "nope"])
    request.getfixturevalue("lane_only")
    out, report = tdckpt.load_memmap(prefix, keys=["a", "nope"], strict=False, report=True)
    assert list(out.keys()) == ["a"] and report.missing == [("nope",)]


def test_a_pattern_that_selects_nothing_is_the_error_whatever_lies_outside(
    prefix: Path, lane_only: None
) -> None:
    # Damage outside the selection and a pattern of keys that selects nothing: the error is
    # the pattern's (the lane's answer is final), not the damage's.
    _damage_entry(prefix, "b", dtype="torch.float99")
    with pytest.raises(RestoreError, match=r"select nothing: nope.*top-level keys: a, b, n"):
        tdckpt.load_memmap(prefix, keys=["a", "nope"])


@tensorclass
class _Pair:
    x: torch.Tensor
    y: torch.Tensor


def test_values_of_other_kinds_outside_the_selection_are_dropped_whole(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    td = TensorDict(
        a=torch.ones(2),
        note=NonTensorData("hello"),
        pair=_Pair(x=torch.zeros(2), y=torch.ones(2), batch_size=[2]),
        n=TensorDict(b=torch.ones(1), note=NonTensorData("inner")),
    )
    tdckpt.save(td, tmp_path / "ck")
    general = tdckpt.load_memmap(tmp_path / "ck", keys="a", report=True, robust_key=None)
    request.getfixturevalue("lane_only")
    out, report = tdckpt.load_memmap(tmp_path / "ck", keys="a", report=True)
    assert list(out.keys()) == ["a"] and torch.equal(out["a"], torch.ones(2))
    assert report == general[1]
    assert report.skipped == [("note",), ("pair",), ("n", "b"), ("n", "note")]
    out = tdckpt.load_memmap(tmp_path / "ck", keys=["a", "n.b"])
    assert set(out.keys(True, True)) == {"a", ("n", "b")}


def test_a_level_of_another_kind_outside_the_selection_is_read_the_general_way(
    tmp_path: Path,
) -> None:
    # A lazy stack is not a TensorDict level: it is kept, the lane declines, the general
    # read prunes it and reports its leaves.
    from tensordict import LazyStackedTensorDict

    td = TensorDict(
        a=torch.ones(2),
        s=LazyStackedTensorDict(TensorDict(x=torch.ones(1)), TensorDict(x=torch.zeros(1))),
    )
    tdckpt.save(td, tmp_path / "ck")
    out, report = tdckpt.load_memmap(tmp_path / "ck", keys="a", report=True)
    assert list(out.keys()) == ["a"]
    assert report.skipped == [("s", "x")]


_NAMES = st.sampled_from(["a", "b", "c", "w0", "w1"])


@st.composite
def _nested(draw: st.DrawFn, depth: int = 0) -> TensorDict:
    entries: dict[str, Any] = {}
    for name in draw(st.lists(_NAMES, min_size=1, max_size=4, unique=True)):
        if depth < 2 and draw(st.booleans()):
            entries[name] = draw(_nested(depth + 1))
        elif draw(st.integers(0, 4)) == 0:  # a non-tensor value: a level of its own
            entries[name] = NonTensorData(f"text {name}")
        else:
            entries[name] = torch.full((2,), float(len(entries)))
    return TensorDict(entries)


_PATTERN = st.lists(
    st.sampled_from(["a", "b", "c", "w0", "w1", "w?", "*", "x"]), min_size=1, max_size=3
)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    td=_nested(),
    keys=st.none() | st.lists(_PATTERN, min_size=1, max_size=3),
    exclude=st.none() | st.lists(_PATTERN, min_size=1, max_size=2),
)
def test_the_lane_reports_and_restores_what_the_general_read_does(
    tmp_path_factory: pytest.TempPathFactory,
    td: TensorDict,
    keys: list[list[str]] | None,
    exclude: list[list[str]] | None,
) -> None:
    prefix = tmp_path_factory.mktemp("sel") / "ck"
    tdckpt.save(td, prefix)
    k = None if keys is None else [tuple(p) for p in keys]
    x = None if exclude is None else [tuple(p) for p in exclude]
    # robust_key=None: the general read (the lane reads robust names only)
    lane = tdckpt.load_memmap(prefix, keys=k, exclude=x, strict=False, report=True)
    general = tdckpt.load_memmap(
        prefix, keys=k, exclude=x, strict=False, report=True, robust_key=None
    )
    assert lane[1] == general[1]
    assert sorted(lane[0].keys(True), key=str) == sorted(general[0].keys(True), key=str)
    for key in general[0].keys(True, True):
        assert torch.equal(lane[0][key], general[0][key])
