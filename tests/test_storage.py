"""``DirectoryStorage``: listing, reading, zero-copy mapping, and refusing to leave the prefix."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _unprivileged import run_unprivileged
from conftest import tree_digest

from tdckpt._read.dir_tree import _MAX_DIR_FDS
from tdckpt._read.directory import DirectoryStorage
from tdckpt._read.opener import open_storage
from tdckpt._read.storage import MAX_JSON_BYTES, UNKNOWN_SIZE, check_component, join, parse_json
from tdckpt.errors import (
    CheckpointNotFoundError,
    MetadataError,
    TdckptError,
    UnsafePathError,
)

SECRET = b"TDCKPT-OUTSIDE-SECRET-1b7e\n"


@pytest.fixture
def layout(tmp_path: Path) -> tuple[Path, Path]:
    """A prefix ``ckpt/`` with a file, a sub-directory, and a secret file outside it."""
    prefix = tmp_path / "ckpt"
    (prefix / "sub").mkdir(parents=True)
    (prefix / "meta.json").write_text('{"shape": [2]}')
    (prefix / "a.memmap").write_bytes(torch.arange(4, dtype=torch.float32).numpy().tobytes())
    (prefix / "sub" / "b.memmap").write_bytes(b"\x01\x02\x03")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "passwd").write_bytes(SECRET)
    return prefix, outside


# -- listing and reading ------------------------------------------------------------------


def test_listdir(layout: tuple[Path, Path]) -> None:
    prefix, _ = layout
    storage = DirectoryStorage(prefix)
    root = storage.listdir("")
    assert root.files == {"meta.json": 14, "a.memmap": 16}
    assert root.dirs == {"sub"}
    assert root.unsafe == {}
    assert storage.listdir("sub").files == {"b.memmap": 3}


def test_listdir_missing_and_file(layout: tuple[Path, Path]) -> None:
    storage = DirectoryStorage(layout[0])
    with pytest.raises(CheckpointNotFoundError):
        storage.listdir("nope")
    with pytest.raises(MetadataError, match="expected a directory"):
        storage.listdir("a.memmap")


def test_read_bytes_and_json(layout: tuple[Path, Path]) -> None:
    storage = DirectoryStorage(layout[0])
    assert storage.read_bytes("sub/b.memmap") == b"\x01\x02\x03"
    assert storage.read_json("meta.json") == {"shape": [2]}
    with pytest.raises(CheckpointNotFoundError, match="no such file"):
        storage.read_bytes("missing.json")
    with pytest.raises(MetadataError, match="found a directory"):
        storage.read_bytes("sub")


def test_open_storage_lists_the_prefix_once(layout: tuple[Path, Path]) -> None:
    # open_storage opens the prefix's listing to tell a directory from an archive; the
    # first listdir("") reads that listing, later ones list again (and see changes).
    prefix, _ = layout
    storage = open_storage(prefix)
    assert storage.listdir("").files == DirectoryStorage(prefix).listdir("").files
    (prefix / "new.memmap").write_bytes(b"x")
    assert "new.memmap" in storage.listdir("").files
    storage.close()


def test_open_storage_closed_unlisted_leaves_nothing_open(layout: tuple[Path, Path]) -> None:
    import gc
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        with open_storage(layout[0]) as storage:
            assert storage.kind == "directory"
        storage = open_storage(layout[0])
        storage.close()
        storage.close()  # idempotent
        del storage
        gc.collect()


def test_open_storage(layout: tuple[Path, Path], tmp_path: Path) -> None:
    with open_storage(layout[0]) as storage:
        assert storage.kind == "directory"
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint here"):
        open_storage(tmp_path / "absent")


def test_join_and_display(layout: tuple[Path, Path]) -> None:
    assert join("", "a") == "a"
    assert join("x/y", "a") == "x/y/a"
    storage = DirectoryStorage(layout[0])
    assert storage.display("") == str(layout[0])
    assert storage.display("sub/b.memmap") == str(layout[0] / "sub" / "b.memmap")


# -- mapping ------------------------------------------------------------------------------


def test_map_shared_is_zero_copy(layout: tuple[Path, Path]) -> None:
    prefix, _ = layout
    storage = DirectoryStorage(prefix)
    t = storage.map("a.memmap", torch.float32, 4, mode="r+")
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0]
    # A write through the file is seen by the tensor, and the other way round: one buffer.
    with open(prefix / "a.memmap", "r+b") as fh:
        fh.seek(4)
        fh.write(torch.tensor([42.0]).numpy().tobytes())
    assert t[1].item() == 42.0
    t[0] = -1.0
    assert (
        torch.frombuffer(bytearray((prefix / "a.memmap").read_bytes()), dtype=torch.float32)[0]
        == -1.0
    )


def test_map_default_mode_shares_a_writable_file(layout: tuple[Path, Path]) -> None:
    prefix, _ = layout
    t = DirectoryStorage(prefix).map("a.memmap", torch.float32, 4, mode=None)
    with open(prefix / "a.memmap", "r+b") as fh:
        fh.write(torch.tensor([7.0]).numpy().tobytes())
    assert t[0].item() == 7.0


def test_map_mode_r_is_copy_on_write(layout: tuple[Path, Path]) -> None:
    prefix, _ = layout
    before = tree_digest(prefix)
    t = DirectoryStorage(prefix).map("a.memmap", torch.float32, 4, mode="r")
    t.add_(100)
    assert t.tolist() == [100.0, 101.0, 102.0, 103.0]
    del t
    assert tree_digest(prefix) == before


def _mapped_addresses() -> set[int]:
    with open("/proc/self/maps") as fh:
        return {int(line.split("-", 1)[0], 16) for line in fh}


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps")
@pytest.mark.parametrize("mode", [None, "r", "r+"])
def test_listed_leaf_maps_through_the_fast_path_and_unmaps_with_its_last_view(
    layout: tuple[Path, Path], mode: str | None
) -> None:
    """A leaf ``listdir`` saw as a regular file takes map()'s inline path: same modes, and
    the mapping lives exactly as long as some tensor views it (no leak, no early unmap)."""
    prefix, _ = layout
    storage = DirectoryStorage(prefix)
    storage.listdir("")
    assert "a.memmap" in storage._tree.regular  # the fast path's precondition
    t = storage.map("a.memmap", torch.float32, 4, mode=mode)  # type: ignore[arg-type]
    addr = t.data_ptr()
    assert addr in _mapped_addresses() and t.tolist() == [0.0, 1.0, 2.0, 3.0]
    t[0] = 5.0
    on_disk = torch.frombuffer(bytearray((prefix / "a.memmap").read_bytes()), dtype=torch.float32)
    assert on_disk[0].item() == (0.0 if mode == "r" else 5.0)  # copy-on-write only with "r"
    view = t[1:]
    del t
    assert addr in _mapped_addresses() and view.tolist() == [1.0, 2.0, 3.0]
    del view
    assert addr not in _mapped_addresses()
    storage.close()


def test_fast_path_refuses_a_listed_leaf_truncated_before_mapping(
    layout: tuple[Path, Path],
) -> None:
    """The inline path checks the descriptor it maps, as the general path does."""
    prefix, _ = layout
    storage = DirectoryStorage(prefix)
    storage.listdir("")
    os.truncate(prefix / "a.memmap", 6)
    with pytest.raises(MetadataError, match=r"6 bytes, but 4 elements of torch\.float32 need 16"):
        storage.map("a.memmap", torch.float32, 4, mode=None)
    assert (prefix / "a.memmap").stat().st_size == 6  # never regrown
    storage.close()


def test_a_restore_listing_leaves_leaf_sizes_to_the_mapping(layout: tuple[Path, Path]) -> None:
    """``defer_leaf_sizes``: *.memmap files are listed without a stat (their size unknown);
    every other file keeps its size, and the mapping checks the leaf's size itself."""
    prefix, _ = layout
    (prefix / "x.shape.memmap").write_bytes(b"\x00" * 16)  # a nested size table: read, so sized
    storage = DirectoryStorage(prefix, defer_leaf_sizes=True)
    listing = storage.listdir("")
    assert listing.files == {
        "meta.json": len('{"shape": [2]}'),
        "a.memmap": UNKNOWN_SIZE,
        "x.shape.memmap": 16,
    }
    assert storage.listdir("sub").files == {"b.memmap": UNKNOWN_SIZE}
    assert storage.map("a.memmap", torch.float32, 4, mode=None).tolist() == [0.0, 1.0, 2.0, 3.0]
    assert not storage.deferred_size_refused
    with pytest.raises(MetadataError, match=r"3 bytes, but 1 elements of torch\.float32 need 4"):
        storage.map("sub/b.memmap", torch.float32, 1, mode="r")
    assert storage.deferred_size_refused  # the restore reads again, every size listed
    assert (prefix / "sub" / "b.memmap").stat().st_size == 3  # never regrown
    storage.close()
    assert DirectoryStorage(prefix).listdir("").files["a.memmap"] == 16  # the default: sized


def test_a_deferred_listing_still_refuses_what_is_not_a_regular_file(
    layout: tuple[Path, Path],
) -> None:
    prefix, _ = layout
    (prefix / "a.memmap").unlink()
    os.mkfifo(prefix / "a.memmap")
    (prefix / "d.memmap").mkdir()
    listing = DirectoryStorage(prefix, defer_leaf_sizes=True).listdir("")
    assert listing.unsafe == {"a.memmap": "not a regular file or directory"}
    assert "d.memmap" in listing.dirs and "a.memmap" not in listing.files


def test_map_prefix_of_a_longer_file(layout: tuple[Path, Path]) -> None:
    prefix, _ = layout
    # Files may be longer than needed (tensordict's own fixture has a trailing byte).
    t = DirectoryStorage(prefix).map("a.memmap", torch.float32, 2, mode="r")
    assert t.tolist() == [0.0, 1.0]
    assert (prefix / "a.memmap").stat().st_size == 16


def test_map_zero_elements_needs_no_file(layout: tuple[Path, Path]) -> None:
    t = DirectoryStorage(layout[0]).map("no-such.memmap", torch.int64, 0, mode="r")
    assert t.shape == (0,) and t.dtype == torch.int64


@pytest.mark.parametrize("mode", ["r", None, "r+"])
def test_map_never_grows_a_short_file(layout: tuple[Path, Path], mode: str | None) -> None:
    prefix, _ = layout
    (prefix / "short.memmap").write_bytes(b"\x01" * 6)
    before = tree_digest(prefix)
    with pytest.raises(TdckptError, match=r"short\.memmap"):
        DirectoryStorage(prefix).map("short.memmap", torch.float32, 4, mode=mode)  # type: ignore[arg-type]
    assert (prefix / "short.memmap").stat().st_size == 6
    assert tree_digest(prefix) == before


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A prefix any user can read (pytest's tmp_path is private to root)."""
    base = Path(tempfile.mkdtemp(prefix="tdckpt-perm-"))
    base.chmod(0o755)
    prefix = base / "ckpt"
    prefix.mkdir()
    prefix.chmod(0o755)
    values = torch.arange(4, dtype=torch.float32).numpy().tobytes()
    (prefix / "ro.memmap").write_bytes(values)
    (prefix / "ro.memmap").chmod(0o444)
    (prefix / "rw.memmap").write_bytes(values)
    (prefix / "rw.memmap").chmod(0o666)  # writable through "other" bits, not as owner
    try:
        yield prefix
    finally:
        shutil.rmtree(base)


def test_map_r_plus_needs_a_writable_file(shared_dir: Path) -> None:
    def attempt() -> str:
        try:
            DirectoryStorage(shared_dir).map("ro.memmap", torch.float32, 4, mode="r+")
        except PermissionError as exc:
            return str(exc)
        return "mapped"

    message = run_unprivileged(attempt)
    assert "ro.memmap" in str(message) and "mode='r+' needs a writable file" in str(message)


def test_map_default_mode_is_copy_on_write_for_a_read_only_file(shared_dir: Path) -> None:
    def attempt() -> list[float]:
        storage = DirectoryStorage(shared_dir)
        t = storage.map("ro.memmap", torch.float32, 4, mode=None)
        t.add_(1)  # copy-on-write: the file keeps its bytes
        return t.tolist()

    assert run_unprivileged(attempt) == [1.0, 2.0, 3.0, 4.0]
    assert (shared_dir / "ro.memmap").read_bytes() == torch.arange(
        4, dtype=torch.float32
    ).numpy().tobytes()


def test_a_deferred_listing_maps_a_read_only_file_copy_on_write(shared_dir: Path) -> None:
    # Listed without a stat, the mode bits are unknown: open() itself says not writable.
    def attempt() -> list[float]:
        storage = DirectoryStorage(shared_dir, defer_leaf_sizes=True)
        storage.listdir("")
        t = storage.map("ro.memmap", torch.float32, 4, mode=None)
        t.add_(1)
        return t.tolist()

    assert run_unprivileged(attempt) == [1.0, 2.0, 3.0, 4.0]
    assert (shared_dir / "ro.memmap").read_bytes() == torch.arange(
        4, dtype=torch.float32
    ).numpy().tobytes()


def test_map_default_mode_shares_a_file_writable_through_group_or_other_bits(
    shared_dir: Path,
) -> None:
    # Not the owner: the mode bits do not answer, access() does (and says writable).
    def attempt() -> None:
        storage = DirectoryStorage(shared_dir)
        storage.map("rw.memmap", torch.float32, 4, mode=None).fill_(9.0)
        storage.map("rw.memmap", torch.float32, 4, mode="r+")[0] = 5.0

    run_unprivileged(attempt)
    raw = (shared_dir / "rw.memmap").read_bytes()
    assert torch.frombuffer(bytearray(raw), dtype=torch.float32).tolist() == [5.0, 9.0, 9.0, 9.0]


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file immutable needs root")
def test_map_falls_back_when_a_shared_open_is_refused_despite_the_mode_bits(
    layout: tuple[Path, Path],
) -> None:
    # Root passes every mode-bit check, but an immutable file (like a read-only mount)
    # still refuses O_RDWR: mode=None falls back to copy-on-write, "r+" is refused.
    prefix, _ = layout
    path = prefix / "a.memmap"
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here")
    try:
        storage = DirectoryStorage(prefix)
        storage.listdir("")
        t = storage.map("a.memmap", torch.float32, 4, mode=None)
        t.add_(1)
        assert t.tolist() == [1.0, 2.0, 3.0, 4.0]
        with pytest.raises(PermissionError, match=r"mode='r\+' needs a writable file"):
            storage.map("a.memmap", torch.float32, 4, mode="r+")
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)
    assert path.read_bytes() == torch.arange(4, dtype=torch.float32).numpy().tobytes()


# -- names that would leave the prefix ----------------------------------------------------


@pytest.mark.parametrize(
    "rel",
    [
        "..",
        "../outside/passwd",
        "sub/../../outside/passwd",
        "/etc/passwd",
        "a//b",
        "./meta.json",
        "sub/.",
        "sub/",
        "x\0y",
    ],
)
def test_refuses_escaping_names(layout: tuple[Path, Path], rel: str) -> None:
    storage = DirectoryStorage(layout[0])
    with pytest.raises(UnsafePathError):
        storage.read_bytes(rel)
    with pytest.raises(UnsafePathError):
        storage.map(rel, torch.uint8, 1, mode="r")
    with pytest.raises(UnsafePathError):
        storage.listdir(rel)


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "a\0b"])
def test_check_component(name: str) -> None:
    with pytest.raises(UnsafePathError) as info:
        check_component(name, where="somewhere")
    assert info.value.name == name  # type: ignore[attr-defined]
    assert "somewhere" in str(info.value)


def test_check_component_accepts_ordinary_names() -> None:
    for name in ["a", "...", ".hidden", "%2E%2E", "a b", "ünï"]:
        check_component(name, where="x")


# -- symlinks -----------------------------------------------------------------------------


def test_symlinked_file_outside_is_unsafe(layout: tuple[Path, Path]) -> None:
    prefix, outside = layout
    (prefix / "leak.memmap").symlink_to(outside / "passwd")
    storage = DirectoryStorage(prefix)
    listing = storage.listdir("")
    assert "leak.memmap" in listing.unsafe
    assert "outside" in listing.unsafe["leak.memmap"]
    assert "leak.memmap" not in listing.files
    with pytest.raises(UnsafePathError, match=r"leak\.memmap"):
        storage.read_bytes("leak.memmap")
    with pytest.raises(UnsafePathError, match=r"leak\.memmap"):
        storage.map("leak.memmap", torch.uint8, 4, mode="r")
    with pytest.raises(UnsafePathError):
        storage.physical_path("leak.memmap")


def test_symlinked_directory_outside_is_unsafe(layout: tuple[Path, Path]) -> None:
    prefix, outside = layout
    (prefix / "out").symlink_to(outside, target_is_directory=True)
    storage = DirectoryStorage(prefix)
    assert "out" in storage.listdir("").unsafe
    assert "out" not in storage.listdir("").dirs
    # Not only the link itself: nothing beneath it is reachable either.
    with pytest.raises(UnsafePathError):
        storage.read_bytes("out/passwd")
    with pytest.raises(UnsafePathError):
        storage.map("out/passwd", torch.uint8, 4, mode="r")
    with pytest.raises(UnsafePathError):
        storage.listdir("out")


def test_relative_symlink_escaping_is_unsafe(layout: tuple[Path, Path]) -> None:
    prefix, _ = layout
    (prefix / "sub" / "rel.memmap").symlink_to("../../outside/passwd")
    storage = DirectoryStorage(prefix)
    assert "rel.memmap" in storage.listdir("sub").unsafe
    with pytest.raises(UnsafePathError):
        storage.read_bytes("sub/rel.memmap")


@pytest.mark.parametrize("target", [".", "..", "../.."])
def test_symlink_to_own_directory_or_ancestor_is_a_cycle(
    layout: tuple[Path, Path], target: str
) -> None:
    prefix, _ = layout
    (prefix / "sub" / "loop").symlink_to(target, target_is_directory=True)
    storage = DirectoryStorage(prefix)
    listing = storage.listdir("sub")
    assert "loop" in listing.unsafe
    assert "loop" not in listing.dirs
    with pytest.raises(UnsafePathError):
        storage.read_bytes("sub/loop/b.memmap" if target == "." else "sub/loop/meta.json")
    with pytest.raises(UnsafePathError):
        storage.listdir("sub/loop")


def test_symlink_to_the_prefix_root_is_a_cycle(layout: tuple[Path, Path]) -> None:
    prefix, _ = layout
    (prefix / "self").symlink_to(prefix, target_is_directory=True)
    listing = DirectoryStorage(prefix).listdir("")
    assert "cycle" in listing.unsafe["self"]


def test_symlink_inside_the_tree_is_followed(layout: tuple[Path, Path]) -> None:
    prefix, _ = layout
    (prefix / "alias.memmap").symlink_to("sub/b.memmap")
    (prefix / "alias_dir").symlink_to("sub", target_is_directory=True)
    storage = DirectoryStorage(prefix)
    listing = storage.listdir("")
    assert listing.files["alias.memmap"] == 3
    assert "alias_dir" in listing.dirs
    assert listing.unsafe == {}
    assert storage.read_bytes("alias.memmap") == b"\x01\x02\x03"
    assert storage.read_bytes("alias_dir/b.memmap") == b"\x01\x02\x03"
    assert storage.map("alias.memmap", torch.uint8, 3, mode="r").tolist() == [1, 2, 3]


def test_dangling_symlink_is_unsafe(layout: tuple[Path, Path]) -> None:
    prefix, _ = layout
    (prefix / "dangling.memmap").symlink_to(prefix / "nowhere")
    listing = DirectoryStorage(prefix).listdir("")
    assert "dangling.memmap" in listing.unsafe
    assert "dangling.memmap" not in listing.files


def test_fifo_is_not_a_regular_file(layout: tuple[Path, Path]) -> None:
    prefix, _ = layout
    os.mkfifo(prefix / "fifo.memmap")
    listing = DirectoryStorage(prefix).listdir("")
    assert "fifo.memmap" in listing.unsafe
    assert "not a regular file" in listing.unsafe["fifo.memmap"]


# -- JSON ---------------------------------------------------------------------------------


def test_deeply_nested_json_is_a_metadata_error(tmp_path: Path) -> None:
    prefix = tmp_path / "ckpt"
    prefix.mkdir()
    depth = 100_000
    (prefix / "meta.json").write_text("[" * depth + "]" * depth)
    (prefix / "obj.json").write_text('{"a":' * depth + "1" + "}" * depth)
    storage = DirectoryStorage(prefix)
    for name in ("meta.json", "obj.json"):
        with pytest.raises(MetadataError, match="nested too deeply") as info:
            storage.read_json(name)
        assert not isinstance(info.value, RecursionError)
        assert name in str(info.value)


def test_oversized_json_is_refused(tmp_path: Path) -> None:
    prefix = tmp_path / "ckpt"
    prefix.mkdir()
    with open(prefix / "meta.json", "wb") as fh:  # sparse: no 256 MB written
        fh.truncate(MAX_JSON_BYTES + 1)
    storage = DirectoryStorage(prefix)
    with pytest.raises(MetadataError, match="more than the") as info:
        storage.read_json("meta.json")
    assert "meta.json" in str(info.value)
    (prefix / "small.json").write_text('{"x": "' + "y" * 100 + '"}')
    with pytest.raises(MetadataError):
        storage.read_bytes("small.json", max_bytes=50)


@pytest.mark.parametrize(
    "data",
    [
        b'{"a": "\xff\xfe"}',
        b"\xc3\x28",
        b'{"shape": [3], ',
        b"",
        b"{'single': 'quotes'}",
        b"1" * 5000,  # an integer beyond Python's digit limit
    ],
)
def test_invalid_json_is_a_metadata_error(tmp_path: Path, data: bytes) -> None:
    prefix = tmp_path / "ckpt"
    prefix.mkdir()
    (prefix / "meta.json").write_bytes(data)
    with pytest.raises(MetadataError, match=r"meta\.json") as info:
        DirectoryStorage(prefix).read_json("meta.json")
    assert info.value.path.endswith("meta.json")  # type: ignore[attr-defined]


@pytest.mark.parametrize("doc", [[1, 2], "text", 3, None, True])
def test_non_object_json_parses_but_is_not_metadata(tmp_path: Path, doc: object) -> None:
    # parse_json returns whatever JSON holds; the metadata stage refuses non-objects.
    from tdckpt._read.tree import read_tree

    assert parse_json(json.dumps(doc).encode(), where="x") == doc
    prefix = tmp_path / "ckpt"
    prefix.mkdir()
    (prefix / "meta.json").write_text(json.dumps(doc))
    tree = read_tree(DirectoryStorage(prefix))
    assert tree.meta is None
    [problem] = tree.problems
    assert problem.code == "bad-json"
    assert problem.severity == "error"
    assert problem.path == "meta.json"
    assert "expected a JSON object" in problem.message


def test_nothing_is_written(layout: tuple[Path, Path]) -> None:
    prefix, outside = layout
    (prefix / "leak").symlink_to(outside / "passwd")
    before, before_out = tree_digest(prefix), tree_digest(outside)
    storage = DirectoryStorage(prefix)
    storage.listdir("")
    storage.listdir("sub")
    storage.read_json("meta.json")
    storage.map("a.memmap", torch.float32, 4, mode="r")
    with pytest.raises(UnsafePathError):
        storage.read_bytes("leak")
    assert tree_digest(prefix) == before
    assert tree_digest(outside) == before_out


def test_a_wide_read_stays_in_the_tree_it_began_with(tmp_path: Path) -> None:
    # More directories than descriptors kept: the cache is reset on the way, but the prefix's
    # own descriptor stays, so a prefix swapped for another tree meanwhile is never read.
    prefix, moved = tmp_path / "ck", tmp_path / "old"
    for tree, tag in ((prefix, "old"), (tmp_path / "new", "new")):
        for i in range(_MAX_DIR_FDS + 6):
            (tree / f"d{i}").mkdir(parents=True)
            (tree / f"d{i}" / "x.json").write_text(json.dumps({"tree": tag}))
    storage = DirectoryStorage(prefix)
    try:
        assert storage.read_json("d0/x.json") == {"tree": "old"}
        prefix.rename(moved)
        (tmp_path / "new").rename(prefix)
        seen = {storage.read_json(f"d{i}/x.json")["tree"] for i in range(_MAX_DIR_FDS + 6)}
        assert seen == {"old"}
    finally:
        storage.close()
