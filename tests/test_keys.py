"""Key encodings (``tdckpt._keys``): properties, and byte-for-byte agreement with tensordict.

tensordict's own helpers (``tensordict._utils_key_json``) are the reference: tdckpt must name
every file exactly as tensordict 0.15.3 does, or it reads the wrong file.
"""

from __future__ import annotations

import doctest
import re

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import tdckpt._keys as keys_mod
from tdckpt._keys import (
    LEAF_SUFFIX,
    NESTED_SHAPE_SUFFIX,
    KeyEncoding,
    decode_key,
    encode_key,
    is_safe_legacy_key,
    leaf_file_name,
    legacy_components,
    nested_shape_file_name,
)

td_keys = pytest.importorskip("tensordict._utils_key_json")

#: The characters tensordict percent-encodes (format-notes.md §2.1).
UNSAFE = '/<>:"|?*\\ \0%' + "".join(chr(i) for i in range(1, 32)) + chr(127)
#: Keys that matter on their own: empty, dots, the percent forms, drive prefixes.
SPECIAL = [
    "",
    ".",
    "..",
    "...",
    "%",
    "%%",
    "%2E",
    "%2E%2E",
    "%25",
    "%zz",
    "%2",
    "a%2",
    "% 1",
    "%+1",
    "%-1",
    "C:payload",
    "c:",
    "a/b",
    "../x",
    "/abs",
    "a\\b",
    "\0",
    "a b",
    "a%20b",
    ".hidden",
    "ünïcode",
    "日本語",
    "emoji 🎉",
    "meta.json",
    "other.pickle",
    "x.shape",
    "\x7f",
    "\x1f\x01",
]

# Characters drawn from the unsafe set, hex digits and '%' (to build valid and malformed
# escapes), dots, and arbitrary unicode (surrogates excluded: not valid in file names).
_alphabet = st.one_of(
    st.sampled_from(UNSAFE),
    st.sampled_from("0123456789abcdefABCDEF%.+- _"),
    st.characters(exclude_categories=("Cs",)),
)
keys = st.one_of(st.sampled_from(SPECIAL), st.text(alphabet=_alphabet, max_size=24))
# File names as found on disk (to decode): anything, including malformed escapes.
names = st.one_of(st.sampled_from(SPECIAL), st.text(alphabet=_alphabet, max_size=24))


def _examples(fn):  # type: ignore[no-untyped-def]
    for key in SPECIAL:
        fn = example(key)(fn)
    return fn


@settings(max_examples=250, deadline=None)
@given(keys)
@_examples
def test_decode_inverts_encode(key: str) -> None:
    assert decode_key(encode_key(key)) == key


@settings(max_examples=250, deadline=None)
@given(keys)
@_examples
def test_encoded_name_is_a_safe_single_component(key: str) -> None:
    name = encode_key(key)
    assert name not in ("", ".", "..")
    # Only '%' of the unsafe set survives, and only as the start of an escape (or as the
    # lone '%' of the empty key).
    assert not (set(name) & (set(UNSAFE) - {"%"}))
    if key:
        assert all(
            re.fullmatch(r"[0-9A-F]{2}", name[i + 1 : i + 3])
            for i, c in enumerate(name)
            if c == "%"
        )
    else:
        assert name == "%"
    assert legacy_components(name) == [name]


@settings(max_examples=250, deadline=None)
@given(keys, keys)
def test_encode_is_injective(a: str, b: str) -> None:
    if a != b:
        assert encode_key(a) != encode_key(b)
        assert leaf_file_name(a) != leaf_file_name(b)


def test_encode_is_injective_on_the_special_keys() -> None:
    encoded = [encode_key(k) for k in SPECIAL]
    assert len(set(encoded)) == len(set(SPECIAL))


@settings(max_examples=300, deadline=None)
@given(keys)
@_examples
def test_encode_agrees_with_tensordict(key: str) -> None:
    assert encode_key(key) == td_keys._encode_key_for_filesystem(key)
    assert encode_key(key, robust=True) == td_keys._encode_key_for_filesystem(key, robust=True)
    assert encode_key(key, robust=False) == td_keys._encode_key_for_filesystem(key, robust=False)
    assert encode_key(key).encode("utf-8", "surrogatepass") == td_keys._encode_key_for_filesystem(
        key
    ).encode("utf-8", "surrogatepass")


@settings(max_examples=300, deadline=None)
@given(names)
@_examples
def test_decode_agrees_with_tensordict(name: str) -> None:
    # Includes names no encoder produces: malformed and sign-prefixed escapes stay literal
    # exactly where tensordict keeps them literal.
    assert decode_key(name) == td_keys._decode_key_from_filesystem(name)


@settings(max_examples=250, deadline=None)
@given(keys)
@_examples
def test_is_safe_legacy_key_agrees_with_tensordict(key: str) -> None:
    for is_collection in (False, True):
        assert is_safe_legacy_key(key, is_collection=is_collection) == (
            td_keys._is_safe_legacy_key(key, is_collection=is_collection)
        )


def test_unsafe_set_is_tensordicts() -> None:
    theirs = getattr(td_keys, "_FS_UNSAFE_CHARS", None)  # 0.15; 0.14 keeps it local
    if theirs is None:  # what 0.14's encoder percent-encodes, char by char
        enc = td_keys._encode_key_for_filesystem
        theirs = {c for c in map(chr, range(0x300)) if enc(f"a{c}b") != f"a{c}b"}
    assert set(UNSAFE) == set(theirs)
    for ch in UNSAFE:
        assert encode_key(ch) == f"%{ord(ch):02X}"
        assert encode_key(f"x{ch}y") == f"x%{ord(ch):02X}y"


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("", "%"),
        (".", "%2E"),
        ("..", "%2E%2E"),
        ("...", "..."),
        (".hidden", ".hidden"),
        ("a b", "a%20b"),
        ("p%q", "p%25q"),
        ("a/b", "a%2Fb"),
        ("\0", "%00"),
        ("\x7f", "%7F"),
        ("ünï", "ünï"),
        ("C:x", "C%3Ax"),
    ],
)
def test_encode_examples(key: str, expected: str) -> None:
    assert encode_key(key) == expected
    assert decode_key(expected) == key


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("%zz", "%zz"),
        ("%2", "%2"),
        ("a%2", "a%2"),
        ("%-1", "%-1"),
        ("% 1", "\x01"),
        ("%+1", "\x01"),
    ],
)
def test_decode_malformed_like_tensordict(name: str, expected: str) -> None:
    assert decode_key(name) == expected == td_keys._decode_key_from_filesystem(name)


@settings(max_examples=300, deadline=None)
@given(keys)
@_examples
def test_legacy_components_refuses_every_escape(key: str) -> None:
    parts = legacy_components(key)
    raw = key.split("/")
    if any(p in ("", ".", "..") for p in raw):
        assert parts is None
    else:
        assert parts == raw
        assert "/".join(parts) == key


@pytest.mark.parametrize("key", ["..", "../x", "/abs", "a//b", "a/./b", "", ".", "x/"])
def test_legacy_components_escaping_keys(key: str) -> None:
    assert legacy_components(key) is None


@settings(max_examples=200, deadline=None)
@given(keys)
def test_file_names(key: str) -> None:
    assert leaf_file_name(key) == encode_key(key) + LEAF_SUFFIX == encode_key(key) + ".memmap"
    assert nested_shape_file_name(key) == encode_key(key) + NESTED_SHAPE_SUFFIX
    assert leaf_file_name(key, robust=False) == key + ".memmap"
    assert nested_shape_file_name(key, robust=False) == key + ".shape.memmap"


def test_key_encoding_enum() -> None:
    assert str(KeyEncoding.ROBUST) == "robust"
    assert str(KeyEncoding.LEGACY) == "legacy"
    assert KeyEncoding("legacy") is KeyEncoding.LEGACY


def test_doctests() -> None:
    result = doctest.testmod(keys_mod, raise_on_error=False, verbose=False)
    assert result.attempted >= 10
    assert result.failed == 0
