"""What ``mode`` means for writes into restored tensors (pinned per storage and mode).

A restore itself never writes a checkpoint. But directory leaves are memory maps of the
leaf files, so whether a later in-place write into a restored tensor reaches the file
depends on ``mode``:

* ``"r"``: a private copy-on-write map; writes change memory only, never the file.
* ``"r+"``: a shared map; writes reach the file. A file this process cannot write is
  refused (RestoreError, target unchanged).
* ``None`` (tensordict's default for ``load_memmap``): shared when the file is writable by
  this process - writes reach the file -, copy-on-write otherwise.
* archives: ``None`` and ``"r"`` map a stored entry copy-on-write (a deflated one is an
  inflated copy); ``"r+"`` maps a stored archive shared (writes reach the archive) and
  refuses one with compressed entries.

A leaf file truncated while it is mapped makes any later access to the lost pages raise
SIGBUS, in every mode (a private map reads through to the file until a page is written).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _restore_helpers import state
from _unprivileged import run_unprivileged
from conftest import subprocess_env
from tensordict import TensorDict

import tdckpt
from tdckpt.errors import TdckptError


def _saved(tmp_path: Path, *, archive: str | None = None) -> Path:
    td = TensorDict(
        a=torch.arange(4.0),
        n=TensorDict(b=torch.ones(4, dtype=torch.int64), batch_size=[4]),
        batch_size=[4],
    )
    if archive is None:
        prefix = tmp_path / "ckpt"
        tdckpt.save(td, prefix, fsync=False)
        return prefix
    mgr = tdckpt.CheckpointManager(tmp_path / "run", archive=True, compression=archive, fsync=False)
    return mgr.save(1, td)


def _file_bytes(prefix: Path) -> bytes:
    return (prefix / "a.memmap").read_bytes() if prefix.is_dir() else prefix.read_bytes()


def _write(restored: TensorDict) -> None:
    restored["a"][0] = 42.0
    restored["n", "b"][1] = 7


def _restore(prefix: Path, mode: str | None, in_place: bool) -> TensorDict:
    if in_place:
        target = TensorDict(
            a=torch.zeros(4),
            n=TensorDict(b=torch.zeros(4, dtype=torch.int64), batch_size=[4]),
            batch_size=[4],
        )
        return tdckpt.load_memmap_(target, prefix, mode=mode)  # type: ignore[no-any-return]
    return tdckpt.load_memmap(prefix, mode=mode)  # type: ignore[no-any-return]


@pytest.mark.parametrize("in_place", [False, True], ids=["load_memmap", "load_memmap_"])
@pytest.mark.parametrize(("mode", "reaches"), [(None, True), ("r+", True), ("r", False)])
def test_writes_into_a_directory_restore(
    tmp_path: Path, mode: str | None, reaches: bool, in_place: bool
) -> None:
    prefix = _saved(tmp_path)
    before = _file_bytes(prefix)
    nested_before = (prefix / "n" / "b.memmap").read_bytes()
    restored = _restore(prefix, mode, in_place)
    assert _file_bytes(prefix) == before  # the restore itself wrote nothing
    _write(restored)
    assert restored["a"][0].item() == 42.0 and restored["n", "b"][1].item() == 7
    after = _file_bytes(prefix)
    if reaches:
        assert torch.frombuffer(bytearray(after), dtype=torch.float32)[0].item() == 42.0
        assert (
            torch.frombuffer(
                bytearray((prefix / "n" / "b.memmap").read_bytes()), dtype=torch.int64
            )[1].item()
            == 7
        )
    else:
        assert after == before and (prefix / "n" / "b.memmap").read_bytes() == nested_before
        assert tdckpt.load_memmap(prefix)["a"].tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.fixture
def readable_prefix() -> Iterator[Path]:
    """A saved prefix any user can read, its leaf ``a.memmap`` read-only (pytest's tmp_path is
    private to root, and root writes every file: the check runs as uid 65534 below)."""
    base = Path(tempfile.mkdtemp(prefix="tdckpt-modes-"))
    try:
        base.chmod(0o755)
        prefix = _saved(base)
        for path in [prefix, *prefix.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        (prefix / "a.memmap").chmod(0o444)
        yield prefix
    finally:
        shutil.rmtree(base)


def test_mode_none_on_a_read_only_file_is_copy_on_write(readable_prefix: Path) -> None:
    before = _file_bytes(readable_prefix)

    def write_through_restore() -> float:
        restored = tdckpt.load_memmap(readable_prefix, mode=None)
        restored["a"][0] = 42.0
        return float(restored["a"][0].item())

    assert run_unprivileged(write_through_restore) == 42.0  # the write landed in memory...
    assert _file_bytes(readable_prefix) == before  # ...not in the file


def test_mode_r_plus_on_a_read_only_file_is_refused(readable_prefix: Path) -> None:
    def refused() -> str:
        target = TensorDict(a=torch.zeros(4), batch_size=[4])
        before = state(target)
        try:
            tdckpt.load_memmap_(target, readable_prefix, mode="r+")
        except TdckptError as exc:
            assert state(target) == before
            return str(exc)
        raise AssertionError("mode='r+' on a read-only leaf was not refused")

    message = run_unprivileged(refused)
    assert isinstance(message, str) and "r+" in message


@pytest.mark.parametrize(("mode", "reaches"), [(None, False), ("r", False), ("r+", True)])
def test_writes_into_a_stored_archive_restore(
    tmp_path: Path, mode: str | None, reaches: bool
) -> None:
    prefix = _saved(tmp_path, archive="stored")
    before = _file_bytes(prefix)
    restored = tdckpt.load_memmap(prefix, mode=mode)
    assert _file_bytes(prefix) == before
    _write(restored)
    assert (_file_bytes(prefix) != before) is reaches
    assert tdckpt.load_memmap(prefix)["a"][0].item() == (42.0 if reaches else 0.0)


@pytest.mark.parametrize("mode", [None, "r"])
def test_writes_into_a_deflated_archive_restore_stay_in_memory(
    tmp_path: Path, mode: str | None
) -> None:
    prefix = _saved(tmp_path, archive="deflate")
    before = _file_bytes(prefix)
    _write(tdckpt.load_memmap(prefix, mode=mode))
    assert _file_bytes(prefix) == before


def test_mode_r_plus_on_a_deflated_archive_is_refused(tmp_path: Path) -> None:
    prefix = _saved(tmp_path, archive="deflate")
    with pytest.raises(TdckptError, match="compressed"):
        tdckpt.load_memmap(prefix, mode="r+")


def test_the_manager_restores_copy_on_write_by_default(tmp_path: Path) -> None:
    mgr = tdckpt.CheckpointManager(tmp_path / "run", fsync=False)
    path = mgr.save(1, TensorDict(a=torch.arange(4.0), batch_size=[4]))
    before = (path / "a.memmap").read_bytes()
    restored = mgr.restore(1)
    restored["a"][0] = 42.0
    target = TensorDict(a=torch.zeros(4), batch_size=[4])
    mgr.restore_into(target)["a"][1] = 43.0
    assert (path / "a.memmap").read_bytes() == before
    assert mgr.verify(1).ok


@pytest.mark.parametrize("mode", [None, "r"])
def test_a_mapped_file_truncated_later_gives_sigbus(tmp_path: Path, mode: str | None) -> None:
    prefix = tmp_path / "ckpt"
    tdckpt.save(TensorDict(a=torch.arange(4096.0), batch_size=[4096]), prefix, fsync=False)
    code = textwrap.dedent(
        f"""
        import os, tdckpt
        td = tdckpt.load_memmap({str(prefix)!r}, mode={mode!r})
        assert td["a"][-1].item() == 4095.0  # mapped and read
        os.truncate({str(prefix / "a.memmap")!r}, 0)
        print("truncated", flush=True)
        td["a"].sum().item()
        print("survived", flush=True)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=subprocess_env(),
        cwd=Path(tdckpt.__file__).parent.parent,
    )
    assert "truncated" in proc.stdout and "survived" not in proc.stdout, (proc.stdout, proc.stderr)
    assert proc.returncode == -signal.SIGBUS, (proc.returncode, proc.stderr)
