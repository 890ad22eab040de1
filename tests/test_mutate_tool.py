"""``tools/mutate.py`` stays in step with the source it mutates.

Each mutant quotes a piece of tdckpt's source verbatim; when that source changes, the mutant
no longer applies and the tool stops at it. Every mutant's text must occur exactly once in
its file, the mutated module must still parse, and each file must have tests to run.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "tdckpt_mutate_tool", ROOT / "tools" / "mutate.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and annotations look the module up
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


MUTATE = _tool()


@pytest.mark.parametrize("mutant", MUTATE.MUTANTS, ids=lambda m: m[0])
def test_each_mutant_applies_to_the_current_source(mutant: tuple[str, ...]) -> None:
    mid, file, old, new, _why = mutant
    source = (ROOT / file).read_text(encoding="utf-8")
    assert source.count(old) == 1, f"{mid}: its text occurs {source.count(old)} times in {file}"
    ast.parse(source.replace(old, new, 1))  # the mutant is valid Python


def test_mutant_ids_are_unique_and_every_file_has_tests() -> None:
    ids = [m[0] for m in MUTATE.MUTANTS]
    assert len(ids) == len(set(ids))
    for file in {m[1] for m in MUTATE.MUTANTS}:
        tests = MUTATE.DEFAULT_TESTS.get(file)
        assert tests, f"{file} has mutants but no default tests to run"
        for test in tests:
            assert (ROOT / test).is_file(), f"{file}: the default test {test} does not exist"
