"""``parse_json`` reads exactly what ``json.loads`` reads (tensordict's own parser).

tdckpt parses with pydantic-core's faster parser and hands whatever it refuses to
``json.loads``. The result must never differ: same value (and same types), or a
MetadataError exactly when ``json.loads`` raises.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tdckpt._read.storage import parse_json
from tdckpt.errors import MetadataError

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=20,
)


def _same(a: Any, b: Any) -> bool:
    """Equal values of equal types (NaN equals NaN, 1 is not 1.0, True is not 1)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def _check(data: bytes) -> None:
    try:
        expected = json.loads(data)
    except (ValueError, RecursionError):
        with pytest.raises(MetadataError):
            parse_json(data, where="meta.json")
        return
    assert _same(parse_json(data, where="meta.json"), expected), data[:200]


@settings(max_examples=400, deadline=None)
@given(json_values, st.booleans(), st.booleans())
def test_documents_parse_as_json_loads_parses_them(
    value: Any, ascii_only: bool, compact: bool
) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only, separators=(",", ":") if compact else None)
    _check(text.encode("utf-8"))


@settings(max_examples=400, deadline=None)
@given(json_values, st.data())
def test_damaged_documents_are_judged_as_json_loads_judges_them(
    value: Any, data: st.DataObject
) -> None:
    raw = bytearray(json.dumps(value).encode("utf-8"))
    for _ in range(data.draw(st.integers(1, 3))):
        pos = data.draw(st.integers(0, len(raw)))
        op = data.draw(st.sampled_from(["insert", "delete", "replace"]))
        byte = data.draw(st.sampled_from(list(b'{}[],:"\\ 0-.eE\x00\xff\xef\xbb\xbfuNI\n\t')))
        if op == "insert":
            raw.insert(pos, byte)
        elif raw and pos < len(raw):
            if op == "delete":
                del raw[pos]
            else:
                raw[pos] = byte
    _check(bytes(raw))


@pytest.mark.parametrize(
    "data",
    [
        b'{"a": "\\ud800"}',  # a lone surrogate: json.loads accepts it
        b'\xef\xbb\xbf{"a": 1}',  # a UTF-8 byte-order mark
        '{"a": 1}'.encode("utf-16"),  # UTF-16, which json.loads detects
        b"[" * 150 + b"]" * 150,  # deeper than pydantic-core nests by default
        b"[" * 5000 + b"]" * 5000,  # deeper than json.loads can go
        b"[" + b"1" * 4300 + b"]",  # the longest int Python parses by default
        b"[" + b"1" * 4301 + b"]",
        b'{"a": NaN, "b": -Infinity, "a": 2}',  # NaN, infinities, a repeated key
        b"[1e400, -0, 5e-324, 1E5]",
        b'{"a": 1} trailing',
        b'{"a": "\xff"}',
        b"",
    ],
)
def test_edge_cases(data: bytes) -> None:
    _check(data)
