"""ArchiveStorage and write_archive: real tensordict archives, the shared fixtures, hostile zips."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from _tdversion import WRITES_FORMAT_VERSION
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict, pack_memmap

import tdckpt._read.archive as archive_mod
import tdckpt._write.archive_write as archive_write_mod
from tdckpt._keys import encode_key
from tdckpt._read.archive import ArchiveStorage
from tdckpt._read.directory import DirectoryStorage
from tdckpt._read.opener import open_storage
from tdckpt._write.archive_write import ALIGNMENT, write_archive
from tdckpt.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    MetadataError,
    TdckptError,
    UnsafePathError,
)

FIXTURES = Path("/work/shared/fixtures/0.15.3")


# -- helpers ---------------------------------------------------------------------------
def make_td() -> TensorDict:
    """Nested, odd keys, several dtypes, zero-element leaves."""
    return TensorDict(
        {
            "f32": torch.arange(6, dtype=torch.float32).reshape(3, 2),
            "i64": torch.tensor([1, -2, 3]),
            "with space": torch.tensor([5, 6, 7], dtype=torch.int16),
            "a.b%c": torch.tensor([0.5, 1.5, 2.5], dtype=torch.float64),
            "é": torch.tensor([1, 2, 3], dtype=torch.bfloat16),
            "empty": torch.zeros(3, 0),
            "nested": {
                "b": torch.tensor([True, False, True]),
                "c64": torch.randn(3, 2, dtype=torch.complex64),
                "deep space": {"u8": torch.tensor([7, 8, 9], dtype=torch.uint8)},
            },
        },
        batch_size=[3],
    )


def entry_name(key: tuple[str, ...]) -> str:
    return "/".join(encode_key(part) for part in key) + ".memmap"


def leaves(td: TensorDict) -> list[tuple[tuple[str, ...], torch.Tensor]]:
    out: list[tuple[tuple[str, ...], torch.Tensor]] = []
    for k, v in td.items(include_nested=True, leaves_only=True):
        assert isinstance(v, torch.Tensor)
        out.append(((k,) if isinstance(k, str) else tuple(k), v))
    return out


def payload_offset(path: Path, name: str) -> int:
    """Where the payload of ``name`` starts, read independently of tdckpt."""
    info = zipfile.ZipFile(path).getinfo(name)
    with open(path, "rb") as fh:
        fh.seek(info.header_offset)
        header = fh.read(30)
    name_len, extra_len = struct.unpack_from("<2H", header, 26)
    return int(info.header_offset + 30 + name_len + extra_len)


# central-directory offset, local-header offset, struct format
_FIELDS = {
    "flags": (8, 6, "<H"),
    "method": (10, 8, "<H"),
    "crc": (16, 14, "<I"),
    "csize": (20, 18, "<I"),
    "usize": (24, 22, "<I"),
}


def patch_zip(path: Path, name: str, **values: int) -> None:
    """Overwrite header fields of ``name`` in both headers (small, non-zip64 archives)."""
    data = bytearray(path.read_bytes())
    eocd = data.rindex(b"PK\x05\x06")
    count, _, pos = struct.unpack_from("<HII", data, eocd + 10)
    for _ in range(count):
        name_len, extra_len, comment_len = struct.unpack_from("<3H", data, pos + 28)
        if bytes(data[pos + 46 : pos + 46 + name_len]) == name.encode():
            (local,) = struct.unpack_from("<I", data, pos + 42)
            for field, value in values.items():
                central_off, local_off, fmt = _FIELDS[field]
                struct.pack_into(fmt, data, pos + central_off, value)
                struct.pack_into(fmt, data, local + local_off, value)
            path.write_bytes(bytes(data))
            return
        pos += 46 + name_len + extra_len + comment_len
    raise AssertionError(f"{name} not in {path}")


def make_zip(path: Path, entries: list[tuple[str, bytes]], *, method: int = 0) -> Path:
    with zipfile.ZipFile(path, "w", compression=method) as zf:
        for name, data in entries:
            zf.writestr(name, data)
    return path


META = ("meta.json", b'{"shape": [], "device": null}')


def all_files(storage: Any, rel: str = "") -> dict[str, int]:
    listing = storage.listdir(rel)
    out = {f"{rel}/{n}" if rel else n: size for n, size in listing.files.items()}
    for d in listing.dirs:
        out.update(all_files(storage, f"{rel}/{d}" if rel else d))
    return out


# -- reading tensordict's archives -----------------------------------------------------
@pytest.mark.parametrize("compression", ["stored", "deflate", "bzip2", "lzma"])
def test_reads_tensordict_archive(tmp_path: Path, compression: str) -> None:
    td = make_td()
    path = tmp_path / "x.tdz"
    td.memmap(path, compression=compression)
    zf = zipfile.ZipFile(path)
    with ArchiveStorage(path) as storage:
        assert storage.kind == "archive" and storage.physical_path("meta.json") is None
        # every entry, byte for byte, against zipfile as the reference reader
        assert all_files(storage) == {i.filename: i.file_size for i in zf.infolist()}
        for info in zf.infolist():
            expected = zf.read(info.filename)
            assert storage.read_bytes(info.filename) == expected
            mapped = storage.map(info.filename, torch.uint8, info.file_size, mode=None)
            assert bytes(mapped.numpy()) == expected
        for key, value in leaves(td):
            got = storage.map(entry_name(key), value.dtype, value.numel(), mode="r")
            assert torch.equal(got, value.reshape(-1)), key
        # 0.15.3 marks format version 1; 0.14 - 0.15.2 wrote no marker
        version = storage.read_json("meta.json").get("_format_version")
        assert version == (1 if WRITES_FORMAT_VERSION else None)


@pytest.mark.parametrize(
    ("writer", "compression"),
    [
        ("tensordict", "stored"),
        ("tensordict", "deflate"),
        ("tdckpt", "stored"),  # tdckpt.save writes stored archives
        ("manager", "stored"),
        ("manager", "deflate"),
    ],
)
def test_nested_tensors_read_back_from_an_archive(
    tmp_path: Path, compression: str, writer: str
) -> None:
    # A stored entry is a slice of the archive's one mapping: the nested tensor must be built
    # from its own bytes, not from the start of the file (found: tdckpt showed the zip headers).
    import warnings

    import tdckpt

    with warnings.catch_warnings():  # torch's prototype-API UserWarning
        warnings.simplefilter("ignore", UserWarning)
        nt = torch.nested.nested_tensor(
            [torch.arange(6.0).view(2, 3), torch.arange(100, 109.0).view(3, 3)]
        )
    td = TensorDict(nt=nt, x=torch.arange(4))
    path = tmp_path / "x.tdz"
    if writer == "tensordict":
        td.memmap(path, compression=compression)
        loaded = tdckpt.load_memmap(path)
    elif writer == "tdckpt":
        tdckpt.save(td, path)
        loaded = tdckpt.load_memmap(path)
    else:
        with tdckpt.CheckpointManager(
            tmp_path / "run", archive=True, compression=compression, fsync=False
        ) as mgr:
            mgr.save(1, td)
            loaded = mgr.restore(1)
    expected = [p.tolist() for p in nt.unbind(0)]
    assert [p.tolist() for p in loaded["nt"].unbind(0)] == expected
    assert loaded["x"].tolist() == [0, 1, 2, 3]
    if writer != "manager":
        theirs = TensorDict.load_memmap(path)["nt"]
        assert [p.tolist() for p in theirs.unbind(0)] == expected


def test_listing_matches_the_directory_form(tmp_path: Path) -> None:
    td = make_td()
    td.memmap(tmp_path / "dir")
    td.memmap(tmp_path / "x.tdz")
    directory, archive = DirectoryStorage(tmp_path / "dir"), ArchiveStorage(tmp_path / "x.tdz")
    assert all_files(archive) == all_files(directory)
    for rel in ["", "nested", "nested/deep%20space"]:
        assert archive.listdir(rel) == directory.listdir(rel)
    archive.close()


def test_tensordict_save_archive_and_zero_element_leaf(tmp_path: Path) -> None:
    td = make_td()
    td.save(tmp_path / "s.tdz")
    with open_storage(tmp_path / "s.tdz") as storage:
        assert isinstance(storage, ArchiveStorage)
        empty = storage.map("empty.memmap", torch.float32, 0, mode="r+")
        assert empty.shape == (0,) and empty.dtype == torch.float32
        assert torch.equal(storage.map("i64.memmap", torch.int64, 3, mode=None), td["i64"])
        # the first elements only
        assert torch.equal(storage.map("i64.memmap", torch.int64, 2, mode=None), td["i64"][:2])


def test_stored_leaves_are_views_of_one_aligned_mapping(tmp_path: Path) -> None:
    path = tmp_path / "x.tdz"
    make_td().memmap(path)
    with ArchiveStorage(path) as storage:
        a = storage.map("f32.memmap", torch.float32, 6, mode=None)
        b = storage.map("nested/b.memmap", torch.bool, 3, mode=None)
        again = storage.map("f32.memmap", torch.float32, 6, mode=None)
        off_a, off_b = payload_offset(path, "f32.memmap"), payload_offset(path, "nested/b.memmap")
        assert off_a % ALIGNMENT == 0 and off_b % ALIGNMENT == 0
        # same mapping: pointers differ exactly by the file offsets; no copy was made
        assert b.data_ptr() - a.data_ptr() == off_b - off_a
        assert again.data_ptr() == a.data_ptr()


@pytest.mark.parametrize("mode", [None, "r"])
def test_private_mapping_keeps_writes_in_memory(tmp_path: Path, mode: str | None) -> None:
    path = tmp_path / "x.tdz"
    make_td().memmap(path)
    before = path.read_bytes()
    with ArchiveStorage(path) as storage:
        leaf = storage.map("f32.memmap", torch.float32, 6, mode=mode)  # type: ignore[arg-type]
        leaf.add_(100)
        assert leaf[0] == 100
    assert path.read_bytes() == before
    with ArchiveStorage(path) as storage:
        assert storage.map("f32.memmap", torch.float32, 6, mode="r")[0] == 0
    assert leaf[0] == 100  # still valid after close: it keeps its mapping alive


def test_shared_mapping_writes_reach_the_file(tmp_path: Path) -> None:
    path = tmp_path / "x.tdz"
    make_td().memmap(path)
    with ArchiveStorage(path) as storage:
        storage.map("i64.memmap", torch.int64, 3, mode="r+").fill_(42)
    with ArchiveStorage(path) as storage:
        assert storage.map("i64.memmap", torch.int64, 3, mode="r").tolist() == [42, 42, 42]
        # its CRC is now stale, as after tensordict's own r+ writes: still readable
        assert storage.read_bytes("i64.memmap") == struct.pack("<3q", 42, 42, 42)
    assert TensorDict.load_memmap(path)["i64"].tolist() == [42, 42, 42]


def test_shared_mapping_refuses_compressed_archive(tmp_path: Path) -> None:
    path = tmp_path / "x.tdz"
    make_td().memmap(path, compression="deflate")
    with ArchiveStorage(path) as storage, pytest.raises(MetadataError, match="compressed"):
        storage.map("i64.memmap", torch.int64, 3, mode="r+")


def test_shared_mapping_refuses_read_only_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "x.tdz"
    make_td().memmap(path)
    path.chmod(0o444)
    if os.geteuid() == 0:  # root opens read-only files for writing: simulate the refusal
        real_open = os.open

        def deny_write(file: Any, flags: int, *args: Any) -> int:
            if flags & os.O_RDWR:
                raise PermissionError(13, "Permission denied", str(file))
            return real_open(file, flags, *args)

        monkeypatch.setattr(os, "open", deny_write)
    with ArchiveStorage(path) as storage, pytest.raises(PermissionError, match=r"r\+"):
        storage.map("i64.memmap", torch.int64, 3, mode="r+")


def test_unaligned_stored_entry_is_copied(tmp_path: Path) -> None:
    values = torch.arange(5, dtype=torch.float32)
    raw = values.numpy().tobytes()
    path = make_zip(tmp_path / "plain.tdz", [META, ("ab.memmap", raw)])  # `zip -0` style
    assert payload_offset(path, "ab.memmap") % 4 != 0
    with ArchiveStorage(path) as storage:
        assert torch.equal(storage.map("ab.memmap", torch.float32, 5, mode="r"), values)
        with pytest.raises(MetadataError, match="aligned"):
            storage.map("ab.memmap", torch.float32, 5, mode="r+")
        # uint8 needs no alignment: still a view
        assert bytes(storage.map("ab.memmap", torch.uint8, len(raw), mode="r").numpy()) == raw


def test_inflates_in_small_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(archive_mod, "_READ_CHUNK", 7)
    monkeypatch.setattr(archive_mod, "_INFLATE_CHUNK", 13)
    value = torch.arange(20_000, dtype=torch.int32) % 97
    td = TensorDict({"v": value}, [])
    for compression in ["deflate", "bzip2", "lzma"]:
        path = tmp_path / f"{compression}.tdz"
        td.memmap(path, compression=compression)
        with ArchiveStorage(path) as storage:
            assert torch.equal(storage.map("v.memmap", torch.int32, 20_000, mode=None), value)
            assert torch.equal(storage.map("v.memmap", torch.int32, 10, mode=None), value[:10])


@pytest.mark.parametrize("case", ["archive_stored", "archive_deflate"])
def test_shared_fixtures(tmp_path: Path, case: str) -> None:
    path = tmp_path / "ckpt.tdz"
    shutil.copyfile(FIXTURES / case / "ckpt.tdz", path)
    expected = json.loads((FIXTURES / "manifest.json").read_text())["cases"][case]["expected"]
    with ArchiveStorage(path) as storage:
        assert storage.listdir("").dirs == {"nested", "s"}
        for key, name in [
            (("f32",), "f32.memmap"),
            (("i64",), "i64.memmap"),
            (("with space",), "with%20space.memmap"),
            (("nested", "b"), "nested/b.memmap"),
        ]:
            spec = expected
            for part in key:
                spec = spec["entries"][part]
            dtype = getattr(torch, spec["dtype"].removeprefix("torch."))
            numel = int(torch.Size(spec["shape"]).numel())
            leaf = storage.map(name, dtype, numel, mode=None)
            assert (
                hashlib.sha256(leaf.view(torch.uint8).numpy().tobytes()).hexdigest()
                == (spec["sha256"])
            )
            assert leaf.reshape(spec["shape"]).tolist() == spec["values"]
        assert storage.read_json("s/meta.json")["data"] == "in-archive"
        assert storage.read_json("meta.json")["_class"] == "tensordict:TensorDict"


# -- writing -----------------------------------------------------------------------------
def layout(path: Path) -> list[tuple[str, int, int, int]]:
    return [
        (i.filename, i.header_offset, i.compress_type, i.file_size)
        for i in zipfile.ZipFile(path).infolist()
    ]


@pytest.mark.parametrize("compression", ["stored", "deflate"])
def test_write_archive_matches_tensordict(tmp_path: Path, compression: str) -> None:
    td = make_td()
    source = tmp_path / "ckpt"
    td.memmap(source)
    manifest = b'{"schema_version": 1}'
    (source / "tdckpt.manifest.json").write_bytes(manifest)
    dest = tmp_path / "out.tdz"
    write_archive(source, dest, compression=compression)
    # the same layout as tensordict's own packer (only timestamps differ)
    pack_memmap(source, tmp_path / "ref.tdz", compression=compression)
    assert layout(dest) == layout(tmp_path / "ref.tdz")
    loaded = TensorDict.load_memmap(dest)
    assert (loaded == td).all()
    infos = zipfile.ZipFile(dest).infolist()
    assert infos[0].filename == "meta.json"
    for info in infos:
        leaf = info.filename.endswith(".memmap")
        assert info.compress_type == (
            zipfile.ZIP_DEFLATED if leaf and compression == "deflate" else 0
        )
        if leaf and compression == "stored":
            assert payload_offset(dest, info.filename) % ALIGNMENT == 0
    with ArchiveStorage(dest) as storage, DirectoryStorage(source) as directory:
        assert all_files(storage) == all_files(directory)
        for rel in all_files(directory):
            assert storage.read_bytes(rel) == (source / rel).read_bytes()
        assert storage.read_bytes("tdckpt.manifest.json") == manifest


def test_write_archive_is_deterministic_and_replaces(tmp_path: Path) -> None:
    source = tmp_path / "ckpt"
    make_td().memmap(source)
    write_archive(source, tmp_path / "a.tdz", fsync=False)
    (tmp_path / "b.tdz").write_bytes(b"old")
    write_archive(source, tmp_path / "b.tdz")
    assert (tmp_path / "a.tdz").read_bytes() == (tmp_path / "b.tdz").read_bytes()


def test_write_archive_streams_in_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(archive_write_mod, "_COPY_CHUNK", 1000)
    td = TensorDict({"big": torch.arange(10_000, dtype=torch.int64)}, [])
    td.memmap(tmp_path / "ckpt")
    write_archive(tmp_path / "ckpt", tmp_path / "out.tdz")
    assert torch.equal(TensorDict.load_memmap(tmp_path / "out.tdz")["big"], td["big"])


def test_write_archive_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "ckpt"
    make_td().memmap(source)
    dest = tmp_path / "out" / "x.tdz"
    dest.parent.mkdir()
    dest.write_bytes(b"previous archive")
    calls = []

    def crash(src: Any, dst: Any) -> None:
        calls.append(src)
        if len(calls) == 3:
            raise OSError("disk full")
        shutil.copyfileobj(src, dst)

    monkeypatch.setattr(archive_write_mod, "_copy", crash)
    with pytest.raises(OSError, match="disk full"):
        write_archive(source, dest)
    assert dest.read_bytes() == b"previous archive"
    assert os.listdir(dest.parent) == ["x.tdz"]  # no temporary file left behind


def test_write_archive_refuses_bad_arguments(tmp_path: Path) -> None:
    source = tmp_path / "ckpt"
    make_td().memmap(source)
    with pytest.raises(UnsafePathError, match="inside the directory"):
        write_archive(source, source / "nested" / "x.tdz")
    with pytest.raises(CheckpointNotFoundError):
        write_archive(tmp_path / "missing", tmp_path / "x.tdz")
    (tmp_path / "bare").mkdir()
    with pytest.raises(MetadataError, match=r"no meta.json"):
        write_archive(tmp_path / "bare", tmp_path / "x.tdz")
    with pytest.raises(CheckpointExistsError, match="is a directory"):
        write_archive(source, tmp_path / "bare")
    with pytest.raises(ValueError, match="compression"):
        write_archive(source, tmp_path / "x.tdz", compression="zstd")
    (source / "evil").symlink_to("/etc")
    with pytest.raises(UnsafePathError, match="outside the checkpoint"):
        write_archive(source, tmp_path / "x.tdz")
    assert not (tmp_path / "x.tdz").exists()


# -- hostile archives ------------------------------------------------------------------
@pytest.mark.parametrize(
    "name", ["../evil", "/etc/x", "a/../../b", "a/./b", "a//b", "a\\b", "a/..", "./a"]
)
def test_refuses_escaping_names(tmp_path: Path, name: str) -> None:
    path = make_zip(tmp_path / "evil.tdz", [META, (name, b"x")])
    with pytest.raises(UnsafePathError, match=re.escape(f"entry {name!r}")) as info:
        ArchiveStorage(path)
    assert str(path) in str(info.value)


def test_refuses_nul_in_name(tmp_path: Path) -> None:
    path = make_zip(tmp_path / "evil.tdz", [META, ("aXb.memmap", b"x")])
    path.write_bytes(path.read_bytes().replace(b"aXb", b"a\0b"))
    with pytest.raises(UnsafePathError, match="NUL"):
        ArchiveStorage(path)


def test_refuses_duplicates_and_file_dir_clashes(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="Duplicate name"):
        dup = make_zip(tmp_path / "dup.tdz", [META, ("a.memmap", b"1"), ("a.memmap", b"2")])
    with pytest.raises(UnsafePathError, match=r"'a.memmap'.*twice"):
        ArchiveStorage(dup)
    clash = make_zip(tmp_path / "clash.tdz", [META, ("a", b"1"), ("a/b.memmap", b"2")])
    with pytest.raises(UnsafePathError, match=r"'a'.*both a file and a directory"):
        ArchiveStorage(clash)
    clash2 = make_zip(tmp_path / "clash2.tdz", [META, ("a/", b""), ("a", b"1")])
    with pytest.raises(UnsafePathError, match="both a file and a directory"):
        ArchiveStorage(clash2)


def test_explicit_directory_entries_are_listed(tmp_path: Path) -> None:
    path = make_zip(tmp_path / "dirs.tdz", [META, ("empty/", b""), ("x/y/z.memmap", b"1")])
    with ArchiveStorage(path) as storage:
        assert storage.listdir("").dirs == {"empty", "x"}
        assert storage.listdir("empty").files == {}
        assert storage.listdir("x").dirs == {"y"}
        assert storage.listdir("x/y").files == {"z.memmap": 1}


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"flags": 1}, "encrypted"),
        ({"method": 99}, "compression method 99"),
        ({"csize": 10**6, "usize": 10**6}, "past the end"),
    ],
)
def test_refuses_bad_entry_headers(tmp_path: Path, fields: dict[str, int], match: str) -> None:
    path = make_zip(tmp_path / "bad.tdz", [META, ("a.memmap", b"12345678")])
    patch_zip(path, "a.memmap", **fields)
    with pytest.raises(MetadataError, match=match) as info:
        ArchiveStorage(path)
    assert "'a.memmap'" in str(info.value) and str(path) in str(info.value)


def test_refuses_local_header_mismatch(tmp_path: Path) -> None:
    path = make_zip(tmp_path / "bad.tdz", [META, ("a.memmap", b"12345678")])
    data = path.read_bytes()
    first = data.index(b"a.memmap")  # the local header's copy comes first
    path.write_bytes(data[:first] + b"b.memmap" + data[first + 8 :])
    with pytest.raises(MetadataError, match=r"'a.memmap'.*local header names b'b.memmap'"):
        ArchiveStorage(path)
    path = make_zip(tmp_path / "bad2.tdz", [META, ("a.memmap", b"12345678")])
    raw = bytearray(path.read_bytes())
    local = raw.index(b"PK\x03\x04", 1)
    struct.pack_into("<H", raw, local + 8, 8)  # local says deflate, central says stored
    path.write_bytes(bytes(raw))
    with pytest.raises(MetadataError, match="compression method 8"):
        ArchiveStorage(path)


def test_refuses_overlapping_entries(tmp_path: Path) -> None:
    path = make_zip(tmp_path / "overlap.tdz", [META, ("a.memmap", b"1234"), ("b.memmap", b"5678")])
    patch_zip(path, "a.memmap", csize=20, usize=20)  # now swallows b's header
    with pytest.raises(MetadataError, match=r"'b.memmap'.*inside the data of entry 'a.memmap'"):
        ArchiveStorage(path)


@pytest.mark.parametrize(
    "content", [b"", b"not a zip at all", b"PK\x05\x06" + b"\xff" * 18, b"PK\x03\x04" * 100]
)
def test_refuses_non_zip(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "x.tdz"
    path.write_bytes(content)
    with pytest.raises(MetadataError, match="not a memory-mapped tensordict archive"):
        ArchiveStorage(path)


def test_refuses_zip_without_meta_json(tmp_path: Path) -> None:
    path = make_zip(tmp_path / "x.tdz", [("sub/meta.json", b"{}")])
    with pytest.raises(MetadataError, match=r"not a memory-mapped tensordict archive.*meta.json"):
        ArchiveStorage(path)


@pytest.mark.parametrize("keep", [0.3, 0.6, 0.95])
def test_refuses_truncated_archive(tmp_path: Path, keep: float) -> None:
    path = tmp_path / "x.tdz"
    make_td().memmap(path)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(MetadataError, match="not a memory-mapped tensordict archive"):
        ArchiveStorage(path)


def test_size_limit_is_checked_before_inflating(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = make_zip(tmp_path / "bomb.tdz", [META, ("big.json", b"0" * 5_000_000)], method=8)
    assert zipfile.ZipFile(path).getinfo("big.json").compress_size < 50_000

    def no_inflate(entry: Any) -> Any:
        raise AssertionError("inflated")

    monkeypatch.setattr(archive_mod, "_decoder", no_inflate)
    with ArchiveStorage(path) as storage:
        with pytest.raises(MetadataError, match=r"'big.json': declares 5000000 bytes"):
            storage.read_bytes("big.json", max_bytes=1_000_000)
        with pytest.raises(MetadataError, match=r"meta.json.*declares"):
            storage.read_bytes("meta.json", max_bytes=3)


def test_refuses_deflate_bomb_with_false_sizes(tmp_path: Path) -> None:
    path = make_zip(tmp_path / "bomb.tdz", [META, ("a.memmap", b"x" * 1000)], method=8)
    patch_zip(path, "a.memmap", usize=2**31)  # tiny payload, huge declared size
    with ArchiveStorage(path) as storage:
        assert storage.listdir("").files["a.memmap"] == 2**31
        with pytest.raises(MetadataError, match=r"'a.memmap'.*inflates to 1000 bytes"):
            storage.read_bytes("a.memmap", max_bytes=2**32)
        with pytest.raises(MetadataError, match="inflates to 1000 bytes"):
            storage.map("a.memmap", torch.uint8, 2**31, mode=None)
    path = make_zip(tmp_path / "bomb2.tdz", [META, ("a.memmap", b"x" * 10**6)], method=8)
    patch_zip(path, "a.memmap", usize=100)  # inflates to more than it declares
    with ArchiveStorage(path) as storage, pytest.raises(MetadataError, match="more bytes"):
        storage.map("a.memmap", torch.uint8, 100, mode="r")


@pytest.mark.parametrize("method", [0, 8])
def test_refuses_bad_crc(tmp_path: Path, method: int) -> None:
    path = make_zip(tmp_path / "crc.tdz", [META, ("a.json", b"{}" * 50)], method=method)
    patch_zip(path, "a.json", crc=12345)
    with ArchiveStorage(path) as storage, pytest.raises(MetadataError, match=r"'a.json'.*CRC-32"):
        storage.read_bytes("a.json")


def test_map_never_reads_past_the_entry(tmp_path: Path) -> None:
    path = tmp_path / "x.tdz"
    make_td().memmap(path)
    with ArchiveStorage(path) as storage, pytest.raises(MetadataError, match="holds 24 bytes"):
        storage.map("i64.memmap", torch.int64, 4, mode="r")


def test_lookup_errors(tmp_path: Path) -> None:
    path = tmp_path / "x.tdz"
    make_td().memmap(path)
    storage = ArchiveStorage(path)
    with pytest.raises(CheckpointNotFoundError):
        storage.listdir("missing")
    with pytest.raises(CheckpointNotFoundError):
        storage.read_bytes("missing.json")
    with pytest.raises(MetadataError, match="expected a directory"):
        storage.listdir("meta.json")
    with pytest.raises(MetadataError, match="expected a file"):
        storage.read_bytes("nested")
    with pytest.raises(UnsafePathError):
        storage.read_bytes("nested/../meta.json")
    with pytest.raises(ValueError, match="mode"):
        storage.map("i64.memmap", torch.int64, 3, mode="w")  # type: ignore[arg-type]
    storage.close()
    storage.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        storage.read_bytes("meta.json")
    with pytest.raises(CheckpointNotFoundError):
        ArchiveStorage(tmp_path / "nope.tdz")


def test_opens_ten_thousand_entries_quickly(tmp_path: Path) -> None:
    path = tmp_path / "many.tdz"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(*META)
        for i in range(10_000):
            zf.writestr(f"d{i % 50}/k{i}.memmap", b"12345678")
    start = time.perf_counter()
    with ArchiveStorage(path) as storage:
        elapsed = time.perf_counter() - start
        assert len(storage.listdir("").dirs) == 50
        assert len(storage.listdir("d7").files) == 200
    # About 1 s on a loaded 2-core machine; a quadratic index would take minutes.
    assert elapsed < 10.0, elapsed


@pytest.fixture(scope="module")
def small_archives() -> list[bytes]:
    td = TensorDict({"a": torch.arange(4.0), "n": {"b": torch.ones(2, dtype=torch.int16)}}, [])
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for compression in ["stored", "deflate"]:
            path = Path(tmp) / f"{compression}.tdz"
            td.memmap(path, compression=compression)
            out.append(path.read_bytes())
    return out


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_corrupted_archives_fail_only_with_tdckpt_errors(
    small_archives: list[bytes], data: st.DataObject
) -> None:
    """Random byte damage: either it still reads, or a TdckptError says why."""
    blob = bytearray(data.draw(st.sampled_from(small_archives)))
    for _ in range(data.draw(st.integers(1, 4))):
        blob[data.draw(st.integers(0, len(blob) - 1))] = data.draw(st.integers(0, 255))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "x.tdz"
        path.write_bytes(bytes(blob))
        try:
            with ArchiveStorage(path) as storage:
                for rel, size in all_files(storage).items():
                    storage.read_bytes(rel)
                    storage.map(rel, torch.uint8, size, mode="r")
        except TdckptError:
            pass
