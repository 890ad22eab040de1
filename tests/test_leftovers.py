"""Leftovers of the hostile rounds: legal or hostile inputs that died with a bare Python error.

- a checkpoint with more leaf files than the process may still map (``vm.max_map_count``);
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import subprocess_env
from tensordict import TensorDict

import tdckpt
from tdckpt._restore.budget import MAX_MAP_COUNT_PATH, mapped_leaf_files

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
