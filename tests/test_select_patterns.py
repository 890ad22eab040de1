"""The pattern sets behind ``keys=`` / ``exclude=`` agree with the one-by-one fnmatch rule.

Literal patterns are looked up in sets (a 10,000-leaf selective restore checked each key
against each pattern with fnmatch); the answer must be the one the rule gives.
"""

from __future__ import annotations

import itertools

import pytest

from tdckpt._restore.select import Selection, _covers, _Patterns

NAMES = ("a", "b", "a.b", "w0", "w1", "[x]")
KEYS = [k for n in (1, 2, 3) for k in itertools.product(NAMES, repeat=n)]
PATTERNS = [
    ("a",),
    ("a", "b"),
    ("w0",),
    ("*",),
    ("w?",),
    ("a", "*", "b"),
    ("[[]x]",),
    ("b", "w1", "a"),
    ("a.b",),
]


@pytest.mark.parametrize("size", [1, 2, 4, len(PATTERNS)])
def test_pattern_sets_agree_with_fnmatch(size: int) -> None:
    for patterns in itertools.combinations(PATTERNS, size):
        sets = _Patterns.of(list(patterns))
        for key in KEYS:
            assert sets.cover(key) == any(_covers(p, key) for p in patterns), (patterns, key)
            below = any(len(p) > len(key) and _covers(p[: len(key)], key) for p in patterns)
            assert sets.below(key) == below, (patterns, key)


def test_selection_with_literal_and_wildcard_patterns() -> None:
    sel = Selection.of(["model.encoder", "opt.*.step"], ["model.encoder.bias"])
    assert sel is not None
    assert sel.selects(("model", "encoder", "weight"))
    assert not sel.selects(("model", "encoder", "bias"))
    assert not sel.selects(("model", "decoder", "weight"))
    assert sel.selects(("opt", "0", "step")) and not sel.selects(("opt", "0", "exp_avg"))
    assert sel.touches(("model",)) and sel.touches(("opt", "0"))
    assert not sel.touches(("sched",))


@pytest.mark.parametrize("size", [1, 2, 3])
def test_names_below_holds_every_child_a_pattern_selects_or_reaches(size: int) -> None:
    # The lane drops a child whose name is not in names_below(key) without asking more:
    # no such child may be selected or reached below.
    literal = [p for p in PATTERNS if not any(ch in "".join(p) for ch in "*?[")]
    for patterns in itertools.combinations(literal, size):
        sel = Selection.of(list(patterns), None)
        assert sel is not None
        for key in [(), *KEYS]:
            if key and sel.selects(key):
                continue  # kept whole: never asked
            names = sel.names_below(key)
            assert names is not None
            for name in NAMES:
                child = (*key, name)
                if sel.selects(child) or sel.reaches_below(child):
                    assert name in names, (patterns, key, name)
    # wildcards and exclude: any name may be, so none is ruled out
    assert Selection.of(["a.*"], None).names_below(("a",)) is None  # type: ignore[union-attr]
    assert Selection.of(["a"], ["a.b"]).names_below(()) is None  # type: ignore[union-attr]
    assert Selection.of(None, ["a"]).names_below(()) is None  # type: ignore[union-attr]
