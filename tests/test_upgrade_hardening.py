"""Hardening of the on-disk upgrade (issue 9).

* a planted journal never makes ``upgrade`` rename or delete anything but what tdckpt
  derives from the prefix (python API and CLI, with and without ``--dry-run``);
* the backup shares no file with the upgraded tree: a write through either never
  reaches the other;
* an upgraded manifest checksums every leaf (kept from an old tdckpt manifest, or
  computed while copying), so ``verify`` detects a changed byte;
* ``upgrade .``, the file-system root, an unwritable directory, a symlinked prefix, two
  concurrent upgrades and leaves changed under a running upgrade all end in a clear
  TdckptError with nothing lost.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _unprivileged import run_unprivileged
from conftest import copy_case, subprocess_env, tree_digest

tensordict = pytest.importorskip("tensordict")
from tensordict import TensorDict  # noqa: E402

import tdckpt  # noqa: E402
from tdckpt import CheckpointManager, cli, schema  # noqa: E402
from tdckpt._upgrade.journal import (  # noqa: E402
    BACKUP_MARK,
    JOURNAL_SUFFIX,
    MAX_JOURNAL_BYTES,
    STAGING_MARK,
)
from tdckpt._upgrade.upgrade import upgrade  # noqa: E402
from tdckpt.errors import (  # noqa: E402
    LockError,
    MigrationError,
    TdckptError,
    UnsafePathError,
)

TESTS = Path(__file__).resolve().parent
TOKEN = "0123456789ab"
STAMP = "20300102T030405Z"


def backups(prefix: Path) -> list[Path]:
    mark = prefix.name + BACKUP_MARK
    return sorted(p for p in prefix.parent.iterdir() if p.name.startswith(mark))


def leftovers(prefix: Path) -> list[str]:
    return sorted(
        p.name
        for p in prefix.parent.iterdir()
        if STAGING_MARK in p.name or p.name.endswith(JOURNAL_SUFFIX) or p.name.endswith(".tmp")
    )


def journal_of(prefix: Path) -> Path:
    return prefix.parent / f"{prefix.name}{JOURNAL_SUFFIX}"


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def run_module(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m tdckpt ...`` with this checkout's tdckpt first on the path (any ``cwd``)."""
    env = subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent), env["PYTHONPATH"]])
    return subprocess.run(
        [sys.executable, "-m", "tdckpt", *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=120,
        check=False,
    )


# -- planted journals --------------------------------------------------------------------------


def _journal(prefix: Path, /, **override: Any) -> dict[str, Any]:
    """A journal as tdckpt writes it for ``prefix``, with ``override`` applied."""
    state: dict[str, Any] = {
        "version": 1,
        "kind": "directory",
        "prefix": prefix.name,
        "staging": f"{prefix.name}{STAGING_MARK}{TOKEN}",
        "new_archive": None,
        "backup": f"{prefix.name}{BACKUP_MARK}{STAMP}",
        "keep_backup": True,
        "phase": "staging",
        "old": None,
        "new": None,
    }
    state.update(override)
    return state


@pytest.fixture(params=[("0.15.3", "nested"), ("0.8.3", "flat")], ids=["current", "legacy"])
def prefix(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    return copy_case(tmp_path / "work", *request.param)


@pytest.fixture
def victims(tmp_path: Path) -> dict[str, Path]:
    """An outside directory (with a file in it) and an outside file."""
    victim_dir = tmp_path / "victim"
    victim_dir.mkdir()
    (victim_dir / "precious.txt").write_text("keep me")
    victim_file = tmp_path / "victim.txt"
    victim_file.write_text("keep me too")
    return {"dir": victim_dir, "file": victim_file}


def _planted_cases(prefix: Path, victims: dict[str, Path]) -> dict[str, dict[str, Any]]:
    """Journals naming what tdckpt never derives from ``prefix``.

    Every path named stays inside the test's temporary directory (a regression must not
    be able to remove anything else) - except ``"/"``, which is only ever named where even
    the code before the fix did not remove it (the backup of a swap that cannot happen).
    """
    name = prefix.name
    outside_dir, outside_file = str(victims["dir"]), str(victims["file"])
    rel_dir = os.path.relpath(victims["dir"], prefix.parent)
    return {
        "staging-outside-dir": _journal(prefix, staging=outside_dir),
        "staging-outside-file": _journal(prefix, staging=outside_file),
        "staging-parent-of-prefix": _journal(prefix, staging=str(prefix.parent)),
        "staging-dotdot": _journal(prefix, staging=".."),
        "staging-traversal": _journal(prefix, staging=f"{name}{STAGING_MARK}{TOKEN}/../{rel_dir}"),
        "staging-relative-outside": _journal(prefix, staging=rel_dir),
        "staging-other-prefix": _journal(prefix, staging=f"other{STAGING_MARK}{TOKEN}"),
        "archive-outside-file": _journal(
            prefix,
            kind="archive",
            staging=f"{name}{STAGING_MARK}{TOKEN}",
            new_archive=outside_file,
        ),
        "backup-outside-dir": _journal(
            prefix,
            phase="swapped",
            keep_backup=False,
            backup=outside_dir,
            old=[victims["dir"].stat().st_dev, victims["dir"].stat().st_ino],
            new=[prefix.stat().st_dev, prefix.stat().st_ino],  # "the swap is done"
        ),
        "backup-root": _journal(prefix, phase="staged", keep_backup=False, backup="/"),
        "backup-dotdot": _journal(prefix, phase="swapped", keep_backup=False, backup=".."),
        "prefix-mismatch": _journal(prefix, prefix="someone-else"),
        "unknown-field": _journal(prefix, extra="x"),
        "bad-phase": _journal(prefix, phase="delete-everything"),
        "bad-inode": _journal(prefix, old="/etc"),
        "bad-version": _journal(prefix, version=99),
    }


PLANTED = [
    "staging-outside-dir",
    "staging-outside-file",
    "staging-parent-of-prefix",
    "staging-dotdot",
    "staging-traversal",
    "staging-relative-outside",
    "staging-other-prefix",
    "archive-outside-file",
    "backup-outside-dir",
    "backup-root",
    "backup-dotdot",
    "prefix-mismatch",
    "unknown-field",
    "bad-phase",
    "bad-inode",
    "bad-version",
]


def _assert_refused(exc: BaseException, prefix: Path, remove: Path | None = None) -> None:
    message = str(exc)
    assert isinstance(exc, TdckptError)
    assert str(journal_of(prefix)) in message, message
    assert "refusing this upgrade journal" in message
    assert "nothing was renamed or removed" in message
    assert f"rm {remove or journal_of(prefix)})" in message  # what to do


@pytest.mark.parametrize("case", PLANTED)
@pytest.mark.parametrize("dry_run", [False, True], ids=["real", "dry-run"])
def test_planted_journal_is_refused_and_nothing_removed(
    case: str, dry_run: bool, prefix: Path, victims: dict[str, Path], tmp_path: Path
) -> None:
    journal = journal_of(prefix)
    journal.write_text(json.dumps(_planted_cases(prefix, victims)[case]))
    before = tree_digest(tmp_path)
    with pytest.raises(TdckptError) as info:
        upgrade(prefix, dry_run=dry_run)
    _assert_refused(info.value, prefix)
    assert victims["dir"].is_dir() and (victims["dir"] / "precious.txt").read_text() == "keep me"
    assert victims["file"].read_text() == "keep me too"
    assert tree_digest(tmp_path) == before, "a refused journal must not change anything"


@pytest.mark.parametrize("case", ["staging-outside-dir", "staging-parent-of-prefix", "backup-root"])
@pytest.mark.parametrize("dry_run", [False, True], ids=["real", "dry-run"])
def test_planted_journal_via_the_cli(
    case: str,
    dry_run: bool,
    prefix: Path,
    victims: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    journal_of(prefix).write_text(json.dumps(_planted_cases(prefix, victims)[case]))
    before = tree_digest(tmp_path)
    code, out, err = run_cli(capsys, "upgrade", str(prefix), *(["--dry-run"] if dry_run else []))
    assert code == 1 and out == ""
    (line,) = err.splitlines()
    assert line.startswith("error: ") and "Traceback" not in err
    assert str(journal_of(prefix)) in line and "nothing was renamed or removed" in line
    assert tree_digest(tmp_path) == before
    assert (victims["dir"] / "precious.txt").exists() and victims["file"].exists()


MALFORMED: dict[str, bytes] = {
    "empty": b"",
    "not-json": b"{not json",
    "not-utf8": b"\xff\xfe{}",
    "a-list": b"[]",
    "a-string": b'"staging"',
    "too-deep": b"[" * 200_000 + b"]" * 200_000,
    "huge": b"{" + b" " * (MAX_JOURNAL_BYTES + 10) + b"}",
    "truncated": json.dumps({"version": 1, "kind": "directory"}).encode()[:-5],
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
@pytest.mark.parametrize("dry_run", [False, True], ids=["real", "dry-run"])
def test_malformed_journal_is_refused(
    case: str, dry_run: bool, prefix: Path, tmp_path: Path
) -> None:
    journal_of(prefix).write_bytes(MALFORMED[case])
    before = tree_digest(tmp_path)
    with pytest.raises(TdckptError) as info:
        upgrade(prefix, dry_run=dry_run)
    _assert_refused(info.value, prefix)
    assert tree_digest(tmp_path) == before


@pytest.mark.parametrize("dry_run", [False, True], ids=["real", "dry-run"])
def test_journal_that_is_a_symlink_is_refused(
    dry_run: bool, prefix: Path, victims: dict[str, Path], tmp_path: Path
) -> None:
    # the link's target is a journal that names only derived paths: the link is what is refused
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps(_journal(prefix)))
    journal_of(prefix).symlink_to(elsewhere)
    before = tree_digest(tmp_path)
    with pytest.raises(UnsafePathError) as info:
        upgrade(prefix, dry_run=dry_run)
    _assert_refused(info.value, prefix)
    assert "symlink" in str(info.value)
    assert tree_digest(tmp_path) == before


def test_journal_that_is_a_fifo_is_refused_without_hanging(prefix: Path, tmp_path: Path) -> None:
    os.mkfifo(journal_of(prefix))
    with pytest.raises(UnsafePathError, match="not a regular file") as info:
        upgrade(prefix)
    _assert_refused(info.value, prefix)


@pytest.mark.parametrize("which", ["staging", "backup"])
def test_derived_path_that_is_a_symlink_is_refused(
    which: str, prefix: Path, victims: dict[str, Path], tmp_path: Path
) -> None:
    state = _journal(prefix, phase="swapped" if which == "backup" else "staging", keep_backup=False)
    (prefix.parent / state[which]).symlink_to(victims["dir"], target_is_directory=True)
    journal_of(prefix).write_text(json.dumps(state))
    before = tree_digest(tmp_path)
    with pytest.raises(UnsafePathError, match="which is a symlink") as info:
        upgrade(prefix)
    _assert_refused(info.value, prefix)
    assert tree_digest(tmp_path) == before


def test_planted_temporary_journal_symlink_is_never_written_through(
    prefix: Path, victims: dict[str, Path], tmp_path: Path
) -> None:
    tmp_journal = prefix.parent / f".{prefix.name}{JOURNAL_SUFFIX}.tmp"
    tmp_journal.symlink_to(victims["file"])
    before = tree_digest(tmp_path)
    with pytest.raises(UnsafePathError, match="not a regular file") as info:
        upgrade(prefix)
    # the advice names the file to remove (not the journal, which does not exist)
    _assert_refused(info.value, prefix, remove=tmp_journal)
    assert victims["file"].read_text() == "keep me too"
    assert tree_digest(tmp_path) == before


def test_a_planted_temporary_journal_folder_is_named_with_how_to_remove_it(
    prefix: Path, tmp_path: Path
) -> None:
    tmp_journal = prefix.parent / f".{prefix.name}{JOURNAL_SUFFIX}.tmp"
    tmp_journal.mkdir()
    with pytest.raises(UnsafePathError, match="not a regular file") as info:
        upgrade(prefix)
    assert f"(rm -r {tmp_journal})" in str(info.value)
    tmp_journal.rmdir()  # following it, the upgrade runs
    upgrade(prefix)


def test_a_genuine_interrupted_journal_is_still_recovered(tmp_path: Path) -> None:
    """The checks refuse only what tdckpt never writes: a real staging is cleaned up."""
    prefix = copy_case(tmp_path, "0.8.3", "flat")
    staging = prefix.parent / f"{prefix.name}{STAGING_MARK}{TOKEN}"
    shutil.copytree(prefix, staging)
    st = prefix.stat()
    journal_of(prefix).write_text(json.dumps(_journal(prefix, old=[st.st_dev, st.st_ino])))
    report = upgrade(prefix)
    assert report.recovered and "staging was removed" in report.recovered
    assert not staging.exists() and leftovers(prefix) == [] and len(backups(prefix)) == 1


# -- the backup is independent of the upgraded tree ------------------------------------------


def _leaves(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.memmap") if p.is_file() and p.stat().st_size)


def test_backup_and_upgraded_tree_share_no_file(tmp_path: Path) -> None:
    prefix = copy_case(tmp_path, "0.8.3", "flat")
    original = tree_digest(prefix)
    report = upgrade(prefix)
    (backup,) = backups(prefix)
    assert report.copied_bytes + report.reflinked_bytes == sum(
        p.stat().st_size for p in prefix.rglob("*.memmap")
    )
    new_leaves = _leaves(prefix)
    assert new_leaves
    # write through the upgraded tree's files: the backup keeps what the user had
    for leaf in new_leaves:
        with open(leaf, "r+b") as fh:
            fh.write(b"\xaa")
    assert tree_digest(backup) == original
    # ... and the other way round
    upgraded = tree_digest(prefix)
    for leaf in _leaves(backup):
        with open(leaf, "r+b") as fh:
            fh.write(b"\x55")
    assert tree_digest(prefix) == upgraded


def test_writes_into_a_restored_r_plus_tensor_do_not_reach_the_backup(tmp_path: Path) -> None:
    prefix = copy_case(tmp_path, "0.8.3", "flat")
    original = tree_digest(prefix)
    upgrade(prefix)
    (backup,) = backups(prefix)
    td = tdckpt.load_memmap(prefix, mode="r+")
    td["f32"].fill_(42.0)  # a shared mapping: written into the upgraded file
    del td
    assert (prefix / "f32.memmap").read_bytes() != original["f32.memmap"]  # it did write
    assert tree_digest(backup) == original
    with open(backup / "i64.memmap", "r+b") as fh:
        fh.write(b"\x01" * 8)
    assert (
        tdckpt.load_memmap(prefix)["i64"].tolist() == TensorDict.load_memmap(prefix)["i64"].tolist()
    )
    assert (prefix / "i64.memmap").read_bytes() != (backup / "i64.memmap").read_bytes()


def test_archive_backup_is_independent(tmp_path: Path) -> None:
    prefix = copy_case(tmp_path, "0.14.3", "archive_stored")
    original = tree_digest(prefix)
    upgrade(prefix)
    (backup,) = backups(prefix)
    assert prefix.stat().st_ino != backup.stat().st_ino
    with open(prefix, "r+b") as fh:
        fh.seek(-1, os.SEEK_END)
        fh.write(b"\x00")
    assert tree_digest(backup) == original


def test_without_a_backup_leaves_are_linked_and_the_old_tree_is_gone(tmp_path: Path) -> None:
    prefix = copy_case(tmp_path, "0.8.3", "flat")
    report = upgrade(prefix, backup=False)
    kinds = [op.kind for op in report.operations]
    assert kinds.count("link") == len(list(prefix.rglob("*.memmap"))) and "copy" not in kinds
    assert backups(prefix) == [] and report.copied_bytes == 0
    for leaf in _leaves(prefix):
        assert leaf.stat().st_nlink == 1, "the old tree (the other name) was removed"


def _ficlone_works(directory: Path) -> bool:
    a, b = directory / "probe-a", directory / "probe-b"
    a.write_bytes(b"x" * 4096)
    try:
        with open(a, "rb") as src, open(b, "wb") as dst:
            fcntl.ioctl(dst.fileno(), 0x40049409, src.fileno())
        return True
    except OSError:
        return False
    finally:
        a.unlink()
        b.unlink(missing_ok=True)


def test_reflink_where_the_file_system_has_it(tmp_path: Path) -> None:
    if not _ficlone_works(tmp_path):
        pytest.skip("this file system has no FICLONE (reflink); the copy path is tested above")
    prefix = copy_case(tmp_path, "0.8.3", "flat")
    original = tree_digest(prefix)
    report = upgrade(prefix)
    assert report.reflinked_bytes > 0 and report.copied_bytes == 0
    (backup,) = backups(prefix)
    for leaf in _leaves(prefix):
        with open(leaf, "r+b") as fh:
            fh.write(b"\xaa")
    assert tree_digest(backup) == original


# -- checksums ---------------------------------------------------------------------------------


def _manifest(path: Path) -> schema.Manifest:
    return schema.Manifest.model_validate(json.loads((path / schema.MANIFEST_NAME).read_text()))


def _flip_one_byte(path: Path, offset: int = 0) -> None:
    size = path.stat().st_size
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0x01]))
    assert path.stat().st_size == size


@pytest.mark.parametrize("backup", [True, False], ids=["backup", "no-backup"])
def test_verify_after_an_upgrade_detects_a_changed_byte(backup: bool, tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    step = root / "7"
    shutil.copytree(copy_case(tmp_path, "0.8.3", "flat"), step)
    upgrade(step, backup=backup)
    for record in _manifest(step).files:
        assert record.checksum is not None, record.path
    mgr = CheckpointManager(root)
    assert mgr.verify(7).ok
    _flip_one_byte(step / "f32.memmap", 5)
    report = mgr.verify(7)
    assert [(p.path, p.kind) for p in report.problems] == [("f32.memmap", "changed")]


def test_verify_after_an_archive_upgrade_detects_a_changed_byte(tmp_path: Path) -> None:
    from tdckpt._manage.verify import verify_files

    prefix = copy_case(tmp_path, "0.14.3", "archive_stored")
    upgrade(prefix)
    import zipfile

    with zipfile.ZipFile(prefix) as zf:
        manifest = schema.Manifest.model_validate(json.loads(zf.read(schema.MANIFEST_NAME)))
        leaf = next(i for i in zf.infolist() if i.filename.endswith(".memmap") and i.file_size)
    with open(prefix, "rb") as fh:  # the local header's own name and extra lengths
        fh.seek(leaf.header_offset)
        header = fh.read(30)
    offset = leaf.header_offset + 30 + int.from_bytes(header[26:28], "little")
    offset += int.from_bytes(header[28:30], "little")
    assert all(r.checksum for r in manifest.files)
    assert verify_files(1, prefix, manifest).ok
    with open(prefix, "r+b") as fh:  # stored: the entry's bytes sit at its data offset
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0x01]))
    report = verify_files(1, prefix, manifest)
    assert [(p.path, p.kind) for p in report.problems] == [(leaf.filename, "changed")]


def _managed_old_layout(root: Path, checksum: str) -> Path:
    """A step saved by tdckpt (manifest with checksums), then put back in an older layout."""
    td = TensorDict({"a": torch.arange(6.0), "n": {"b": torch.ones(3, dtype=torch.int64)}})
    with CheckpointManager(root, checksum=checksum) as mgr:
        path = Path(mgr.save(5, td))
    meta = json.loads((path / "meta.json").read_text())
    for name in ("_format_version", "_class"):
        meta.pop(name)
    (path / "meta.json").write_text(json.dumps(meta))
    return path


def test_checksums_of_an_old_manifest_are_kept(tmp_path: Path) -> None:
    step = _managed_old_layout(tmp_path / "root", "sha256")
    old = {r.path: r.checksum for r in _manifest(step).files if r.path.endswith(".memmap")}
    report = upgrade(step)
    assert report.steps
    new = {r.path: r.checksum for r in _manifest(step).files if r.path.endswith(".memmap")}
    assert new == old and all(c and c.startswith("sha256:") for c in new.values())
    assert not [p for p in report.problems if p.code == "checksum-mismatch"]
    assert CheckpointManager(tmp_path / "root").verify(5).ok


def test_a_leaf_changed_before_the_upgrade_is_not_laundered(tmp_path: Path) -> None:
    step = _managed_old_layout(tmp_path / "root", "crc32")
    _flip_one_byte(step / "a.memmap")  # bit rot after the save
    report = upgrade(step)
    (problem,) = [p for p in report.problems if p.code == "checksum-mismatch"]
    assert problem.severity == "warning" and problem.path == "a.memmap"
    assert "verify" in problem.message and str(problem) in str(report)
    verify = CheckpointManager(tmp_path / "root").verify(5)
    assert [(p.path, p.kind) for p in verify.problems] == [("a.memmap", "changed")]


# -- prefixes, directories, races ------------------------------------------------------------


def test_upgrade_dot_upgrades_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix = copy_case(tmp_path, "0.8.3", "flat")
    original = tree_digest(prefix)
    monkeypatch.chdir(prefix)
    report = upgrade(".")
    monkeypatch.chdir(tmp_path)
    assert report.prefix == str(prefix) and report.operations
    (backup,) = backups(prefix)
    assert tree_digest(backup) == original
    assert not [p for p in prefix.iterdir() if "tdckpt-" in p.name], "nothing written inside"
    assert leftovers(prefix) == []
    assert tdckpt.load_memmap(prefix)["f32"].tolist() == tdckpt.load_memmap(backup)["f32"].tolist()


def test_cli_upgrade_dot(tmp_path: Path) -> None:
    prefix = copy_case(tmp_path, "0.8.3", "flat")
    original = tree_digest(prefix)
    proc = run_module("upgrade", ".", cwd=prefix)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    (backup,) = backups(prefix)
    assert tree_digest(backup) == original and leftovers(prefix) == []
    root = run_module("upgrade", "/")
    assert root.returncode == 1 and "Traceback" not in root.stderr
    assert root.stderr.startswith("error: ") and "file-system root" in root.stderr


def test_file_system_root_is_refused() -> None:
    with pytest.raises(UnsafePathError, match="file-system root"):
        upgrade("/", dry_run=True)


def test_cli_symlinked_prefix_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = copy_case(tmp_path, "0.8.3", "flat")
    link = tmp_path / "link"
    link.symlink_to(prefix)
    before = tree_digest(tmp_path)
    code, _out, err = run_cli(capsys, "upgrade", str(link))
    assert code == 1 and err.startswith("error: ") and "is a symlink" in err
    assert len(err.splitlines()) == 1
    assert tree_digest(tmp_path) == before


def test_prefix_under_a_symlinked_directory_is_upgraded_in_the_real_one(tmp_path: Path) -> None:
    prefix = copy_case(tmp_path, "0.8.3", "flat")
    alias = tmp_path / "alias"
    alias.symlink_to(prefix.parent, target_is_directory=True)
    upgrade(alias / prefix.name)
    assert alias.is_symlink() and len(backups(prefix)) == 1 and leftovers(prefix) == []


@pytest.fixture
def read_only_parent() -> Iterator[Path]:
    """A legacy prefix in a directory the (unprivileged) upgrader cannot write."""
    base = Path(tempfile.mkdtemp(prefix="tdckpt-ro-"))
    try:
        base.chmod(0o755)
        prefix = copy_case(base, "0.8.3", "flat")
        for p in [base, *base.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        prefix.parent.chmod(0o555)
        yield prefix
    finally:
        for p in [base, *base.rglob("*")]:
            if p.is_dir() and not p.is_symlink():
                p.chmod(0o755)
        shutil.rmtree(base)


def test_read_only_parent_gets_a_clear_error_and_nothing_changes(read_only_parent: Path) -> None:
    prefix = read_only_parent
    before = tree_digest(prefix.parent)

    def attempt() -> object:
        dry = upgrade(prefix, dry_run=True)  # a dry run only reads
        try:
            upgrade(prefix)
        except TdckptError as exc:
            return (len(dry.operations), type(exc).__name__, str(exc))
        return "upgraded"

    n_ops, kind, message = run_unprivileged(attempt)  # type: ignore[misc]
    assert n_ops > 0 and kind == "MigrationError"
    assert "is not writable" in message and "Nothing was changed" in message
    assert str(prefix.parent) in message
    assert tree_digest(prefix.parent) == before


def test_concurrent_upgrades_of_one_prefix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = copy_case(tmp_path, "0.3.2", "nested")
    original = tree_digest(prefix)
    proc = subprocess.Popen(
        [sys.executable, str(TESTS / "_upgrade_child.py"), str(prefix), "--sleep", "0.3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=subprocess_env(),
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "start"
        assert proc.stdout.readline().startswith("op 1 "), "the first upgrade is under way"
        with pytest.raises(LockError, match="another tdckpt upgrade is running"):
            upgrade(prefix)
        with pytest.raises(LockError, match="another tdckpt upgrade is running"):
            upgrade(prefix, dry_run=True)  # its journal exists: not "interrupted", running
        code, _out, err = run_cli(capsys, "upgrade", str(prefix))
        assert code == 1 and "another tdckpt upgrade is running" in err
        assert len(err.splitlines()) == 1
        _out, child_err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, child_err
    (backup,) = backups(prefix)
    assert tree_digest(backup) == original and leftovers(prefix) == []
    assert upgrade(prefix).operations == []


def _last_leaf_after(
    prefix: Path, done: int, change: Callable[[Path], None]
) -> Callable[[int, int, str], None]:
    """A progress callback that changes the leaf the upgrade stages last, after op ``done``."""
    target = sorted(p for p in prefix.rglob("*.memmap") if p.stat().st_size)[-1]

    def progress(n: int, total: int, what: str) -> None:
        if n == done:
            change(target)

    return progress


@pytest.mark.parametrize("backup", [True, False], ids=["backup", "no-backup"])
def test_leaf_replaced_by_a_symlink_after_validation_is_refused(
    backup: bool, tmp_path: Path, victims: dict[str, Path]
) -> None:
    prefix = copy_case(tmp_path, "0.8.3", "flat")
    outside = victims["file"]

    def swap(target: Path) -> None:
        outside.write_bytes(b"S" * target.stat().st_size)
        target.unlink()
        target.symlink_to(outside)

    with pytest.raises(MigrationError, match=r"is no longer a regular file|cannot be opened"):
        upgrade(prefix, backup=backup, progress=_last_leaf_after(prefix, 1, swap))
    assert leftovers(prefix) == [] and backups(prefix) == []
    assert outside.read_bytes().startswith(b"S")


def test_leaf_truncated_after_validation_is_refused(tmp_path: Path) -> None:
    prefix = copy_case(tmp_path, "0.8.3", "flat")

    def truncate(target: Path) -> None:
        os.truncate(target, target.stat().st_size - 1)

    changed = r"bytes, not \d+,? since the checkpoint was validated"
    with pytest.raises(MigrationError, match=changed):
        upgrade(prefix, progress=_last_leaf_after(prefix, 1, truncate))
    assert leftovers(prefix) == [] and backups(prefix) == []


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (root only): a real ENOSPC."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr!r}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_out_of_space_while_copying_is_a_clear_error(small_fs: Path) -> None:
    prefix = small_fs / "ckpt"
    prefix.mkdir()
    (prefix / "big.memmap").write_bytes(b"\x07" * (600 * 1024))  # a copy does not fit
    meta = {
        "big": {"device": "cpu", "shape": [600 * 1024], "dtype": "torch.uint8", "is_nested": False},
        "shape": [],
        "device": "cpu",
        "_type": "<class 'tensordict._td.TensorDict'>",
    }
    (prefix / "meta.json").write_text(json.dumps(meta, separators=(",", ":")))
    before = tree_digest(small_fs)
    with pytest.raises(MigrationError) as info:
        upgrade(prefix)
    message = str(info.value)
    assert "not enough space" in message and f"{600 * 1024} bytes" in message
    assert "--no-backup" in message and "Nothing was changed" in message
    assert tree_digest(small_fs) == before and leftovers(prefix) == []
    report = upgrade(prefix, backup=False)  # hard links: no space needed for the leaves
    assert report.operations and backups(prefix) == []
    assert tdckpt.load_memmap(prefix)["big"].sum().item() == 7 * 600 * 1024


def test_copy_without_copy_file_range_is_checksummed_and_independent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the kernel has no copy_file_range, the chunked copy path is taken."""
    monkeypatch.delattr(os, "copy_file_range", raising=False)
    root = tmp_path / "root"
    root.mkdir()
    step = root / "3"
    shutil.copytree(copy_case(tmp_path, "0.8.3", "flat"), step)
    original = tree_digest(step)
    report = upgrade(step)
    assert report.copied_bytes > 0
    (backup,) = backups(step)
    assert CheckpointManager(root).verify(3).ok
    _flip_one_byte(step / "i64.memmap", 3)
    assert tree_digest(backup) == original
    assert [(p.path, p.kind) for p in CheckpointManager(root).verify(3).problems] == [
        ("i64.memmap", "changed")
    ]
