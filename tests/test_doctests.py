"""The examples in docstrings run and print what they say."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "tdckpt._write.atomic",
    "tdckpt._write.checksum",
    "tdckpt._upgrade.convert",
    "tdckpt._read.detect",
    "tdckpt._read.inspect",
    "tdckpt._keys",
    "tdckpt._restore.engine",
    "tdckpt._write.save",
    "tdckpt.manager",
    "tdckpt._store.objects",
    "tdckpt._remote.urls",
    "tdckpt.retention",
    "tdckpt.save_policy",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(name)
    failures, tried = doctest.testmod(
        module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    )
    assert tried > 0, f"{name} has no examples"
    assert failures == 0
