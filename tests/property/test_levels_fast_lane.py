"""The exact-form fast lane of level validation never disagrees with the pydantic model.

``tdckpt._read.levels`` accepts the form tensordict writes with plain type checks and sends
everything else to ``schema.TensorDictMeta``. Whatever the fast lane accepts, the model must
accept with identical values; whatever the model refuses, ``read_td_level`` must refuse.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pydantic
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tdckpt import schema
from tdckpt._read.levels import _exact_form, read_td_level

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "tensordict"

# Values that sit on both sides of every check: exact types, look-alikes pydantic coerces
# (1.0, True, "1"), and out-of-range ints.
odd_scalar = st.sampled_from(
    [0, 1, 3, -1, 2**62, 2**62 + 1, True, False, 1.0, 2.5, "1", "", "cpu", "None", None]
)
dims = st.lists(st.one_of(st.integers(0, 8), odd_scalar), max_size=4) | st.lists(
    st.just(1), min_size=64, max_size=66
)


def _maybe(draw: st.DrawFn, good: st.SearchStrategy[Any], odd: st.SearchStrategy[Any]) -> Any:
    """Mostly a value tensordict writes; sometimes one of the look-alikes."""
    return draw(odd) if draw(st.integers(0, 11)) == 0 else draw(good)


@st.composite
def leaf_entry(draw: st.DrawFn) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "device": _maybe(
            draw, st.sampled_from(["cpu", None]), st.sampled_from(["cuda:0", 0, True])
        ),
        "shape": _maybe(draw, st.lists(st.integers(0, 8), max_size=4), st.one_of(dims, odd_scalar)),
        "dtype": _maybe(
            draw, st.sampled_from(["torch.float32", "torch.int64"]), st.sampled_from([7, None])
        ),
        "is_nested": _maybe(draw, st.booleans(), st.sampled_from([0, 1, "false", None])),
    }
    if draw(st.integers(0, 5)) == 0:
        for name in draw(st.sets(st.sampled_from(list(entry)), min_size=1, max_size=2)):
            del entry[name]
    if draw(st.integers(0, 7)) == 0:
        entry[draw(st.sampled_from(["type", "extra", "_class"]))] = "TensorDict"
    return entry


@st.composite
def level(draw: st.DrawFn) -> dict[str, Any]:
    raw: dict[str, Any] = {}
    names = (
        ["a", "b", "c", "d"]
        if draw(st.integers(0, 5))
        else ["a", "_names", "_format_version", "_class", "shape"]
    )
    for key in draw(st.lists(st.sampled_from(names), max_size=4, unique=True)):
        raw[key] = _maybe(
            draw,
            st.one_of(leaf_entry(), st.just({"type": "TensorDict"})),
            st.sampled_from([{"type": 3}, {}, {"type": "TensorDict", "x": 1}]),
        )
    fields = {
        "shape": _maybe(draw, st.lists(st.integers(0, 8), max_size=3), st.one_of(dims, odd_scalar)),
        "device": _maybe(
            draw, st.sampled_from(["cpu", "None", None]), st.sampled_from([1, "cuda:0", True])
        ),
        "_type": _maybe(
            draw, st.just("<class 'tensordict._td.TensorDict'>"), st.sampled_from([3, None])
        ),
        "_format_version": _maybe(draw, st.just(1), st.sampled_from([2, True, 1.0, "1", None])),
        "_class": _maybe(draw, st.just("tensordict:TensorDict"), st.sampled_from(["", 5])),
        "_names": _maybe(
            draw, st.sampled_from([None, ["a"], [None, "b"]]), st.sampled_from([[1], "a", ("a",)])
        ),
    }
    if draw(st.integers(0, 5)) == 0:
        for name in draw(st.sets(st.sampled_from(list(fields)), min_size=1, max_size=2)):
            del fields[name]
    if draw(st.integers(0, 7)) == 0:
        fields["stray"] = 1
    for name, value in fields.items():
        raw.setdefault(name, value)  # a key entry named like a field wins, as in tensordict
    return raw


def _via_model(raw: dict[str, Any]) -> tuple[Any, ...]:
    model = schema.TensorDictMeta.model_validate(raw)
    entries = {
        name: (e.dtype, tuple(e.shape), e.device, e.is_nested)
        if isinstance(e, schema.LeafEntry)
        else e.type
        for name, e in model.entries.items()
    }
    return (model.class_, model.type_, tuple(model.shape), model.device, model.names, entries)


def _fields(level: Any) -> tuple[Any, ...]:
    return (level.class_, level.type_, level.shape, level.device, level.names, level.entries)


_LEVEL = {
    "shape": [2],
    "device": "cpu",
    "_type": "<class 'tensordict._td.TensorDict'>",
    "_format_version": 1,
    "_class": "tensordict:TensorDict",
}
_LEAF = {"device": "cpu", "shape": [2, 3], "dtype": "torch.float32", "is_nested": False}


@settings(max_examples=600, deadline=None)
@given(level())
@example({**_LEVEL, "a": _LEAF})
@example({**_LEVEL, "a": {**_LEAF, "shape": [2, True]}})
@example({**_LEVEL, "a": {**_LEAF, "shape": [2, 3.0]}})
@example({**_LEVEL, "a": {**_LEAF, "shape": [2, 2**62 + 1]}})
@example({**_LEVEL, "a": {**_LEAF, "is_nested": 0}})
@example({**_LEVEL, "a": {**_LEAF, "device": None}})
@example({**_LEVEL, "shape": [True]})
@example({**_LEVEL, "_format_version": True})
@example({**_LEVEL, "_format_version": 1.0})
@example({**_LEVEL, "device": "None"})
@example({**_LEVEL, "_names": ["x"]})
@example({**_LEVEL, "a": {"type": "TensorDict"}, "_class": {"type": "TensorDict"}})
@example({**_LEVEL, "_format_version": {"dtype": "torch.float32", "shape": [2]}})
def test_fast_lane_accepts_only_what_the_model_accepts_identically(raw: dict[str, Any]) -> None:
    snapshot = json.dumps(raw, sort_keys=True, default=repr)
    fast = _exact_form(raw)
    try:
        expected = _via_model(raw)
    except pydantic.ValidationError:
        assert fast is None, f"the fast lane accepted what the model refuses: {raw!r}"
        with pytest.raises(pydantic.ValidationError):
            read_td_level(raw)
    else:
        if fast is not None:
            assert _fields(fast) == expected
            # Same values and same types (1.0 == 1, but a float shape is not an int shape).
            assert [type(d) for d in fast.shape] == [type(d) for d in expected[2]]
        assert _fields(read_td_level(raw)) == expected
    assert json.dumps(raw, sort_keys=True, default=repr) == snapshot  # the input is not changed


def _tensordict_levels() -> list[dict[str, Any]]:
    out = []
    for meta in sorted(FIXTURES.glob("0.15.3/**/meta.json")):
        raw = json.loads(meta.read_text())
        if (
            isinstance(raw, dict)
            and "shape" in raw
            and raw.get("_class", "").startswith("tensordict:")
        ):
            out.append(raw)
    return out


def test_fast_lane_takes_every_level_tensordict_writes() -> None:
    # The lane exists for what tensordict 0.15.3 writes: every such level takes it.
    levels = _tensordict_levels()
    assert len(levels) >= 20
    for raw in levels:
        fast = _exact_form(raw)
        assert fast is not None, raw
        assert _fields(fast) == _via_model(raw)
