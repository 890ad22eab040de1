"""Leftovers of the hostile rounds: legal or hostile inputs that died with a bare Python error.

- a checkpoint with more leaf files than the process may still map (``vm.max_map_count``);
- a zero-element leaf whose other dims overflow torch's strides;
- a nested tensor whose size table is another key's data file;
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from conftest import subprocess_env
from tensordict import TensorDict

import tdckpt
from tdckpt._restore.budget import MAX_MAP_COUNT_PATH, mapped_leaf_files
from tdckpt.errors import ValidationError

# -- the mapping budget ----------------------------------------------------------------------------

_MAP_CHILD = textwrap.dedent(
    """
    import mmap, sys, torch
    import tdckpt
    from tdckpt.errors import RestoreError
    from tensordict import TensorDict

    prefix, leaves = sys.argv[1], int(sys.argv[2])
    limit = int(open("/proc/sys/vm/max_map_count").read())
    current = sum(1 for _ in open("/proc/self/maps"))
    # Shared anonymous mappings never merge: each holds one of the process's mappings.
    hog = [mmap.mmap(-1, 4096) for _ in range(limit - current - leaves // 2)]
    target = TensorDict(a=torch.zeros(1))
    for call in (
        lambda: tdckpt.load_memmap(prefix),
        lambda: tdckpt.load_memmap_(target, prefix),
    ):
        try:
            call()
        except RestoreError as exc:
            print("REFUSED", exc)
        except BaseException as exc:
            print("CRASHED", type(exc).__name__, exc)
        else:
            print("RESTORED")
    print("TARGET", sorted(target.keys()), target["a"].tolist())
    del hog
    print("AFTER", len(tdckpt.load_memmap(prefix).keys()))
    """
)


@pytest.mark.skipif(not Path(MAX_MAP_COUNT_PATH).exists(), reason="Linux's mapping limit")
def test_more_leaves_than_the_process_may_map_are_refused_before_mapping(tmp_path: Path) -> None:
    """Before: a bare MemoryError (or RuntimeError from mmap) part-way through the leaves."""
    limit = int(Path(MAX_MAP_COUNT_PATH).read_text())
    if limit > 300_000:  # the child holds all but a few of them: keep it cheap
        pytest.skip(f"vm.max_map_count is {limit}; the test fills it up to the limit")
    leaves = 2000
    td = TensorDict({f"k{i}": torch.full((1,), float(i)) for i in range(leaves)})
    tdckpt.save(td, tmp_path / "ck")
    child = tmp_path / "child.py"
    child.write_text(_MAP_CHILD)
    proc = subprocess.run(
        [sys.executable, str(child), str(tmp_path / "ck"), str(leaves)],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=300,
        check=False,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    lines = out.splitlines()
    assert [line.split()[0] for line in lines] == ["REFUSED", "REFUSED", "TARGET", "AFTER"], out
    assert f"restoring maps {leaves} leaf files" in lines[0]
    assert MAX_MAP_COUNT_PATH in lines[0] and "sysctl -w vm.max_map_count=" in lines[0]
    assert "archive=True" in lines[0] and "Nothing was changed" in lines[0]
    assert lines[2] == "TARGET ['a'] [0.0]"  # untouched
    assert lines[3] == f"AFTER {leaves}"  # with the mappings free again, it restores


def test_mapped_leaf_files_counts_only_what_is_mapped(tmp_path: Path) -> None:
    td = TensorDict(
        a=torch.ones(3),
        empty=torch.ones(0),
        nested=TensorDict(b=torch.ones(2, 2), c=torch.zeros(2, 0)),
    )
    td.memmap(tmp_path / "ck")
    from tdckpt._read.pipeline import open_checkpoint

    opened = open_checkpoint(tmp_path / "ck", robust_key=True)
    try:
        assert opened.root is not None
        assert mapped_leaf_files(opened.root) == 2
    finally:
        opened.close()


# -- shapes torch cannot build ---------------------------------------------------------------------


def _with_leaf_shape(prefix: Path, shape: list[int]) -> Path:
    TensorDict(a=torch.ones(0)).memmap(prefix)
    meta = json.loads((prefix / "meta.json").read_text())
    meta["a"]["shape"] = shape
    (prefix / "meta.json").write_text(json.dumps(meta))
    return prefix


@pytest.mark.parametrize(
    "shape", [[0, 2**62, 2**62], [0, 2**40, 2**40, 2**40], [2**31, 2**31, 2**2, 0]]
)
def test_a_zero_element_leaf_whose_strides_overflow_is_refused(
    tmp_path: Path, shape: list[int]
) -> None:
    """Before: validate said ok, load_memmap_ raised torch's bare RuntimeError "Stride
    calculation overflowed" (load_memmap wrapped it as "passed validation but cannot be
    rebuilt")."""
    prefix = _with_leaf_shape(tmp_path / "ck", shape)
    report = tdckpt.validate(prefix)
    assert not report.ok
    (problem,) = report.errors  # (tensordict 0.14 also leaves an info about its writer)
    assert problem.code == "bad-shape" and problem.key == ("a",)
    assert "past the 2**63 - 1 a tensor's strides can hold" in problem.message
    target = TensorDict(a=torch.ones(0))
    with pytest.raises(ValidationError, match="strides can hold"):
        tdckpt.load_memmap_(target, prefix)
    assert target["a"].shape == (0,)
    with pytest.raises(ValidationError, match="strides can hold"):
        tdckpt.load_memmap(prefix)


def test_a_zero_element_leaf_with_large_dims_that_fit_restores(tmp_path: Path) -> None:
    prefix = _with_leaf_shape(tmp_path / "ck", [0, 2**31, 2**31])
    assert tdckpt.validate(prefix).ok
    assert tdckpt.load_memmap(prefix)["a"].shape == (0, 2**31, 2**31)


# -- a file read as two things ---------------------------------------------------------------------


def test_a_nested_tensors_size_table_that_is_another_keys_data_is_refused(tmp_path: Path) -> None:
    """Key "nt" (nested) reads its size table from nt.shape.memmap, the data file of a key
    "nt.shape": before, both were accepted and restored from the one file."""
    prefix = tmp_path / "ck"
    with warnings.catch_warnings():  # torch's, and only once per process: not asserted
        warnings.filterwarnings("ignore", "The PyTorch API of nested tensors", UserWarning)
        nt = torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(4, 3)])
    TensorDict(nt=nt).memmap(prefix)
    meta = json.loads((prefix / "meta.json").read_text())
    meta["nt.shape"] = {
        "device": "cpu",
        "shape": [2, 2],
        "dtype": "torch.int64",
        "is_nested": False,
    }
    (prefix / "meta.json").write_text(json.dumps(meta))
    report = tdckpt.validate(prefix)
    assert not report.ok
    (problem,) = [p for p in report.problems if p.severity == "error"]
    assert problem.code == "shared-file" and problem.path == "nt.shape.memmap"
    assert "read both for key 'nt' and for key 'nt.shape'" in problem.message
    assert "Remove one of the two keys from meta.json" in problem.message
    target = TensorDict(x=torch.zeros(1))
    with pytest.raises(ValidationError, match="read both for key"):
        tdckpt.load_memmap_(target, prefix)
    assert list(target.keys()) == ["x"]


# -- step numbers and metadata ints beyond what can be written ------------------------------------


@pytest.mark.parametrize("step", [10**300, 2**63, 10**5000], ids=["1e300", "2**63", "1e5000"])
def test_a_step_beyond_the_bound_is_refused_before_anything_is_written(
    tmp_path: Path, step: int
) -> None:
    """Before: save(10**300) raised OSError "File name too long" (and 10**5000 a ValueError
    from printing the int)."""
    from tdckpt.manager import CheckpointManager

    with CheckpointManager(tmp_path / "root", fsync=False) as mgr:
        with pytest.raises(ValueError, match=r"a step must be at most 2\*\*63 - 1") as info:
            mgr.save(step, TensorDict(a=torch.ones(1)))
        assert f"an int of {step.bit_length()} bits" in str(info.value)
        assert len(str(info.value)) < 400
        root = tmp_path / "root"
        assert mgr.steps() == [] and (not root.exists() or not list(root.glob("[0-9]*")))
        with pytest.raises(ValueError, match=r"at most 2\*\*63 - 1"):
            mgr.restore(step)
        last = 2**63 - 1
        assert mgr.save(last, TensorDict(a=torch.ones(1))).name == str(last)
        assert mgr.steps() == [last]


def test_the_cli_refuses_a_step_beyond_the_bound(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tdckpt.cli import main

    with pytest.raises(SystemExit) as info:
        main(["verify", str(tmp_path), "--step", str(2**63)])
    assert info.value.code == 2
    assert "the largest step is 2**63 - 1" in capsys.readouterr().err


def test_metadata_with_an_int_of_more_than_4300_digits_is_refused_naming_the_key(
    tmp_path: Path,
) -> None:
    """Before: save raised Python's bare ValueError "Exceeds the limit (4300 digits) for
    integer string conversion" from the JSON dump."""
    from tdckpt.errors import MetadataError
    from tdckpt.manager import CheckpointManager

    with CheckpointManager(tmp_path / "root", fsync=False) as mgr:
        for big in (10**4300, -(10**5000)):
            with pytest.raises(MetadataError, match=r"metadata\['run'\]\['seed'\]: an int of") as e:
                mgr.save(1, TensorDict(a=torch.ones(1)), metadata={"run": {"seed": big}})
            assert "more than 4300 decimal digits" in str(e.value)
            assert "Store it as a str" in str(e.value)
        assert mgr.steps() == []
        mgr.save(1, TensorDict(a=torch.ones(1)), metadata={"seed": 10**4299})
        assert mgr.metadata(1)["seed"] == 10**4299
