"""A manifest's file records: what their patterns accept, and how a refusal reads.

``FileRecord.path`` and ``.checksum`` are checked by patterns in pydantic's core (fast enough
for a 10,000-leaf manifest read on every restore of its step); these tests hold the patterns
to the rule in words, and the messages to saying it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pydantic
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tensordict import TensorDict

import tdckpt
from tdckpt import CheckpointManager
from tdckpt.schema import MANIFEST_NAME, FileRecord, explain

ALGORITHMS = {"crc32": 8} | {
    a: hashlib.new(a).digest_size * 2
    for a in hashlib.algorithms_guaranteed
    if not a.startswith("shake")
}


def _path_is_inside(path: str) -> bool:
    """The rule: a relative POSIX path of components other than "", "." and "..", no NUL."""
    return "\x00" not in path and all(part not in ("", ".", "..") for part in path.split("/"))


@given(st.text(alphabet="a./\x00%-é", max_size=12))
def test_a_record_path_is_accepted_exactly_when_it_names_a_file_inside(path: str) -> None:
    try:
        FileRecord(path=path, size=0)
    except pydantic.ValidationError as exc:
        assert not _path_is_inside(path)
        assert "is not a relative POSIX path inside the checkpoint" in explain(exc)
    else:
        assert _path_is_inside(path)


@given(
    st.sampled_from([*sorted(ALGORITHMS), "md4", "shake_128", "CRC32", ""]),
    st.integers(min_value=0, max_value=130),
    st.sampled_from(["0", "f", "F", "g"]),
)
def test_a_record_checksum_needs_a_known_algorithm_and_its_digest_length(
    algorithm: str, digits: int, digit: str
) -> None:
    checksum = f"{algorithm}:{digit * digits}"
    expected = ALGORITHMS.get(algorithm) == digits and digit in "0f"
    try:
        FileRecord(path="a.memmap", size=0, checksum=checksum)
    except pydantic.ValidationError as exc:
        assert not expected
        assert "with an algorithm tdckpt computes" in explain(exc)
    else:
        assert expected


def test_explain_names_each_error_and_says_how_many_more() -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        pydantic.TypeAdapter(list[FileRecord]).validate_python([{"path": "../x", "size": -1}] * 4)
    text = explain(info.value, limit=3)
    assert text.startswith("0.path: '../x' is not a relative POSIX path")
    assert "0.size: Input should be greater than or equal to 0" in text
    assert text.endswith("; and 5 more")


@pytest.mark.parametrize("path", ["../outside", "n/./b.memmap", "a\x00.memmap"])
def test_a_bad_record_path_is_reported_in_words(tmp_path: Path, path: str) -> None:
    with CheckpointManager(tmp_path / "run", fsync=False) as mgr:
        step_dir = mgr.save(1, TensorDict(a=torch.ones(2)))
    manifest = json.loads((step_dir / MANIFEST_NAME).read_text())
    manifest["files"].append({"path": path, "size": 6, "checksum": None, "key": None})
    (step_dir / MANIFEST_NAME).write_text(json.dumps(manifest))
    at = len(manifest["files"]) - 1
    words = f"files.{at}.path: {path!r} is not a relative POSIX path inside the checkpoint"
    [problem] = [p for p in tdckpt.validate(step_dir).errors if p.code == "bad-manifest"]
    assert words in problem.message
    with CheckpointManager(tmp_path / "run") as mgr:
        [reported] = mgr.verify(1).problems
        assert words in str(reported)
