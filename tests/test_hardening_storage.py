"""Race-free leaf mapping: what validation checked is exactly what the restore maps.

Between validating a checkpoint and mapping its leaves, anyone who can write the prefix can
truncate a leaf, swap it for a symlink to a file outside, for a FIFO or a directory, or swap a
whole directory for a symlink. ``torch.from_file(path, shared=True)`` (what tdckpt used) opens
the path again, follows the links, and ftruncates a short file up to the mapping: a truncated
leaf was silently regrown and loaded as zeros, and an outside file was read and grown.

Every case here attacks after validation (through the storage API: list, attack, map; and
through a whole restore, attacking from inside the plan stage) and asserts: a clear
TdckptError, no hang, no file grown, created or changed (size, mtime, bytes), nothing outside
read, the target unchanged.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

tensordict = pytest.importorskip("tensordict")

from _restore_helpers import diff_states, make_target, objects, reference, state  # noqa: E402
from tensordict import MemoryMappedTensor, TensorDict  # noqa: E402

import tdckpt  # noqa: E402
from tdckpt._read.archive import ArchiveStorage  # noqa: E402
from tdckpt._read.directory import DirectoryStorage  # noqa: E402
from tdckpt._read.lane import open_current  # noqa: E402
from tdckpt._restore import plan as plan_mod  # noqa: E402
from tdckpt.errors import (  # noqa: E402
    CheckpointNotFoundError,
    MetadataError,
    TdckptError,
    UnsafePathError,
    ValidationError,
)

MODES = [None, "r", "r+"]
VALUES = torch.arange(4, dtype=torch.float32)  # a.memmap: 16 bytes
SECRET = b"TDCKPT-OUTSIDE-SECRET-0123456789"  # 32 bytes: large enough for a.memmap


# -------------------------------------------------------------------------------- helpers


def snapshot(root: Path) -> dict[str, tuple[str, int, int, str]]:
    """Every entry under ``root`` (links not followed): kind, size, mtime_ns, content digest."""
    out: dict[str, tuple[str, int, int, str]] = {}
    paths = [root] if not root.is_dir() or root.is_symlink() else [root, *root.rglob("*")]
    for p in paths:
        st_ = p.lstat()
        if stat.S_ISLNK(st_.st_mode):
            kind, digest = "link", os.readlink(p)
        elif stat.S_ISREG(st_.st_mode):
            kind, digest = "file", hashlib.sha256(p.read_bytes()).hexdigest()
        elif stat.S_ISDIR(st_.st_mode):
            kind, digest = "dir", ""
        else:
            kind, digest = "other", ""
        size = st_.st_size if kind != "dir" else 0
        out[p.relative_to(root).as_posix() if p != root else "."] = (
            kind,
            size,
            st_.st_mtime_ns,
            digest,
        )
    return out


@contextlib.contextmanager
def no_hang(seconds: int = 10) -> Iterator[None]:
    """Fail (instead of hanging the suite) if the body blocks for ``seconds``."""

    def alarm(signum: int, frame: Any) -> None:
        raise TimeoutError(
            f"blocked for {seconds} s (a FIFO opened for reading waits for a writer)"
        )

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def ckpt(tmp_path: Path) -> tuple[Path, Path]:
    """A small prefix (``a.memmap``, ``n/c.memmap``) and an outside directory with a secret."""
    prefix = tmp_path / "ckpt"
    (prefix / "n").mkdir(parents=True)
    (prefix / "a.memmap").write_bytes(VALUES.numpy().tobytes())
    (prefix / "n" / "c.memmap").write_bytes(VALUES.numpy().tobytes())
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(SECRET)
    (outside / "short").write_bytes(b"\x07" * 3)
    (outside / "c.memmap").write_bytes(SECRET)
    return prefix, outside


def listed(prefix: Path) -> DirectoryStorage:
    """A storage that has listed (validated) the whole prefix, as a restore does first."""
    storage = DirectoryStorage(prefix)
    assert storage.listdir("").files == {"a.memmap": 16}
    assert storage.listdir("n").files == {"c.memmap": 16}
    return storage


# ------------------------------------------------------- the storage API: list, attack, map


@pytest.mark.parametrize("mode", MODES)
def test_leaf_truncated_after_listing_is_refused_and_not_regrown(
    ckpt: tuple[Path, Path], mode: Any
) -> None:
    prefix, _ = ckpt
    storage = listed(prefix)
    leaf = prefix / "a.memmap"
    leaf.write_bytes(leaf.read_bytes()[:6])  # truncated after validation saw 16 bytes
    before = snapshot(prefix)
    with pytest.raises(MetadataError, match=r"a\.memmap: 6 bytes, but 4 elements .* never grows"):
        storage.map("a.memmap", torch.float32, 4, mode=mode)
    assert leaf.stat().st_size == 6, "the leaf was regrown"
    assert snapshot(prefix) == before


@pytest.mark.parametrize("target", ["secret", "short"])
@pytest.mark.parametrize("mode", MODES)
def test_leaf_swapped_for_a_symlink_out_after_listing_is_refused(
    ckpt: tuple[Path, Path], mode: Any, target: str
) -> None:
    # "secret" is large enough to be read; "short" would be grown by a shared mapping.
    prefix, outside = ckpt
    storage = listed(prefix)
    leaf = prefix / "a.memmap"
    leaf.unlink()
    leaf.symlink_to(outside / target)
    before, outside_before = snapshot(prefix), snapshot(outside)
    with pytest.raises(
        UnsafePathError, match=rf"a\.memmap: a symlink to .*{target}, outside the checkpoint"
    ):
        storage.map("a.memmap", torch.float32, 4, mode=mode)
    assert snapshot(outside) == outside_before, "the outside file was changed"
    assert snapshot(prefix) == before


def test_metadata_file_swapped_for_a_symlink_out_after_listing_is_refused(
    ckpt: tuple[Path, Path],
) -> None:
    prefix, outside = ckpt
    (prefix / "meta.json").write_text("{}")
    storage = DirectoryStorage(prefix)
    assert "meta.json" in storage.listdir("").files
    (prefix / "meta.json").unlink()
    (prefix / "meta.json").symlink_to(outside / "secret")
    with pytest.raises(UnsafePathError, match="outside the checkpoint"):
        storage.read_bytes("meta.json")


@pytest.mark.parametrize("mode", MODES)
def test_leaf_replaced_by_a_fifo_is_refused_without_hanging(
    ckpt: tuple[Path, Path], mode: Any
) -> None:
    prefix, _ = ckpt
    storage = listed(prefix)
    leaf = prefix / "a.memmap"
    leaf.unlink()
    os.mkfifo(leaf)
    before = snapshot(prefix)
    with (
        no_hang(),
        pytest.raises(UnsafePathError, match=r"a\.memmap: a FIFO where a regular file belongs"),
    ):
        storage.map("a.memmap", torch.float32, 4, mode=mode)
    with no_hang(), pytest.raises(UnsafePathError, match="a FIFO"):
        storage.read_bytes("a.memmap")
    assert snapshot(prefix) == before


@pytest.mark.parametrize("mode", MODES)
def test_leaf_replaced_by_a_directory_is_refused(ckpt: tuple[Path, Path], mode: Any) -> None:
    prefix, _ = ckpt
    storage = listed(prefix)
    leaf = prefix / "a.memmap"
    leaf.unlink()
    leaf.mkdir()
    before = snapshot(prefix)
    with pytest.raises(MetadataError, match=r"a\.memmap: expected a file, found a directory"):
        storage.map("a.memmap", torch.float32, 4, mode=mode)
    assert snapshot(prefix) == before


@pytest.mark.parametrize("target", ["outside", "file"])
@pytest.mark.parametrize("mode", MODES)
def test_parent_directory_swapped_for_a_symlink_out_is_refused(
    ckpt: tuple[Path, Path], mode: Any, target: str
) -> None:
    prefix, outside = ckpt
    storage = listed(prefix)
    (prefix / "n").rename(prefix.parent / "n-moved")
    if target == "outside":  # outside/c.memmap holds the secret
        (prefix / "n").symlink_to(outside)
        expected: tuple[type[TdckptError], str] = (
            UnsafePathError,
            r"ckpt/n: a symlink to .*outside, outside",
        )
    else:  # a file where the directory was
        (prefix / "n").write_bytes(b"x" * 64)
        expected = (MetadataError, r"ckpt/n: expected a directory, found a regular file")
    before, outside_before = snapshot(prefix), snapshot(outside)
    with pytest.raises(expected[0], match=expected[1]):
        storage.map("n/c.memmap", torch.float32, 4, mode=mode)
    assert snapshot(outside) == outside_before
    assert snapshot(prefix) == before


@pytest.mark.parametrize("mode", MODES)
def test_a_directory_already_opened_keeps_mapping_what_was_listed(
    ckpt: tuple[Path, Path], mode: Any
) -> None:
    # Once a directory is open, swapping its path for a link changes nothing: the leaves
    # still come from the directory that was listed (held open), never from outside.
    prefix, outside = ckpt
    (prefix / "n" / "d.memmap").write_bytes((VALUES + 10).numpy().tobytes())
    storage = DirectoryStorage(prefix)
    storage.listdir("")
    storage.listdir("n")
    first = storage.map("n/c.memmap", torch.float32, 4, mode=mode)
    (prefix / "n").rename(prefix.parent / "n-moved")
    (prefix / "n").symlink_to(outside)
    (outside / "d.memmap").write_bytes(SECRET)
    outside_before = snapshot(outside)
    second = storage.map("n/d.memmap", torch.float32, 4, mode=mode)
    assert first.tolist() == VALUES.tolist() and second.tolist() == (VALUES + 10).tolist()
    assert snapshot(outside) == outside_before
    storage.close()
    # After close() nothing is held open: the link is seen, and refused.
    with pytest.raises(UnsafePathError, match="outside the checkpoint"):
        storage.map("n/d.memmap", torch.float32, 4, mode=mode)


@pytest.mark.parametrize("mode", MODES)
def test_a_safe_symlink_inside_the_prefix_is_still_followed(
    ckpt: tuple[Path, Path], mode: Any
) -> None:
    prefix, _ = ckpt
    (prefix / "b.memmap").symlink_to("a.memmap")
    (prefix / "m").symlink_to("n")
    storage = DirectoryStorage(prefix)
    assert storage.listdir("").files == {"a.memmap": 16, "b.memmap": 16}
    assert storage.map("b.memmap", torch.float32, 4, mode=mode).tolist() == VALUES.tolist()
    assert storage.listdir("m").files == {"c.memmap": 16}
    assert storage.map("m/c.memmap", torch.float32, 4, mode=mode).tolist() == VALUES.tolist()


def test_a_missing_leaf_is_reported_not_created(ckpt: tuple[Path, Path]) -> None:
    prefix, _ = ckpt
    storage = listed(prefix)
    (prefix / "a.memmap").unlink()
    for mode in MODES:
        with pytest.raises(CheckpointNotFoundError, match=r"a\.memmap: no such file"):
            storage.map("a.memmap", torch.float32, 4, mode=mode)  # type: ignore[arg-type]
    assert not (prefix / "a.memmap").exists(), "a shared mapping created the file"


def test_mappings_hold_no_file_descriptor(ckpt: tuple[Path, Path]) -> None:
    # One descriptor per mapping would exhaust the limit (often 1024) on a large checkpoint.
    prefix, _ = ckpt
    storage = listed(prefix)
    before = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    if before is None:
        pytest.skip("needs /proc/self/fd")
    tensors = [
        storage.map("n/c.memmap", torch.float32, 4, mode=m) for m in MODES for _ in range(200)
    ]
    # The storage keeps its directory descriptors (prefix and n), nothing per leaf.
    assert len(os.listdir("/proc/self/fd")) <= before + 2
    storage.close()
    assert len(os.listdir("/proc/self/fd")) <= before
    assert all(t.tolist() == VALUES.tolist() for t in tensors)  # mappings outlive the storage


def test_many_directories_keep_a_bounded_number_of_descriptors(tmp_path: Path) -> None:
    prefix = tmp_path / "wide"
    for i in range(150):
        (prefix / f"d{i}").mkdir(parents=True)
        (prefix / f"d{i}" / "x.memmap").write_bytes(torch.tensor([float(i)]).numpy().tobytes())
    storage = DirectoryStorage(prefix)
    before = len(os.listdir("/proc/self/fd"))
    values = [storage.map(f"d{i}/x.memmap", torch.float32, 1, mode="r").item() for i in range(150)]
    assert values == [float(i) for i in range(150)]
    assert len(os.listdir("/proc/self/fd")) <= before + 64
    storage.close()


# ------------------------------------------------------------- a whole restore, attacked mid-way


def _saved(tmp_path: Path, *, current: bool = False) -> tuple[Path, Path]:
    """The checkpoint (written by tensordict, or with ``current`` by tdckpt in the current
    form, which the current-form lane reads whatever tensordict is installed) and a folder
    outside it with a secret."""
    td = TensorDict(
        a=torch.arange(4.0),
        n=TensorDict(c=torch.arange(12.0).reshape(4, 3), batch_size=[4]),
        batch_size=[4],
    )
    prefix = tmp_path / "ckpt"
    if current:
        tdckpt.save(td, prefix)
        opened = open_current(prefix, robust_key=True)
        assert opened is not None, "the lane does not read tdckpt's own checkpoint"
        opened.close()
    else:
        with reference():
            td.memmap(prefix)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(SECRET * 4)
    (outside / "short").write_bytes(b"\x07" * 3)
    return prefix, outside


def _attack_in_plan(monkeypatch: pytest.MonkeyPatch, attack: Callable[[], None]) -> list[int]:
    """Run ``attack`` once, when the plan stage maps its first leaf (validation is done)."""
    calls: list[int] = []
    real = plan_mod.Mapper.leaves

    def leaves(self: plan_mod.Mapper, nodes: Any) -> list[torch.Tensor]:
        if not calls:
            attack()
        calls.append(1)
        return real(self, nodes)

    monkeypatch.setattr(plan_mod.Mapper, "leaves", leaves)
    return calls


def _truncate(prefix: Path, outside: Path) -> None:
    for leaf in (prefix / "a.memmap", prefix / "n" / "c.memmap"):
        leaf.write_bytes(leaf.read_bytes()[:5])


def _swap_leaf_out(prefix: Path, outside: Path, target: str) -> None:
    for leaf in (prefix / "a.memmap", prefix / "n" / "c.memmap"):
        leaf.unlink()
        leaf.symlink_to(outside / target)


def _fifo(prefix: Path, outside: Path) -> None:
    for leaf in (prefix / "a.memmap", prefix / "n" / "c.memmap"):
        leaf.unlink()
        os.mkfifo(leaf)


def _directory(prefix: Path, outside: Path) -> None:
    for leaf in (prefix / "a.memmap", prefix / "n" / "c.memmap"):
        leaf.unlink()
        leaf.mkdir()


def _swap_parent_out(prefix: Path, outside: Path) -> None:
    shutil.copy(prefix / "n" / "c.memmap", outside / "c.memmap")
    (outside / "c.memmap").write_bytes(SECRET * 2)
    shutil.copy(prefix / "a.memmap", outside / "a.memmap")
    (outside / "a.memmap").write_bytes(SECRET)
    moved = prefix.parent / "moved"
    moved.mkdir()
    (prefix / "n").rename(moved / "n")
    (prefix / "a.memmap").rename(moved / "a.memmap")
    (prefix / "n").symlink_to(outside)
    (prefix / "a.memmap").symlink_to(outside / "a.memmap")


#: attack -> (do it, what the mapping raises, its message, what the full report then says).
ATTACKS: dict[str, tuple[Callable[[Path, Path], None], type[TdckptError], str, str]] = {
    "truncated": (
        _truncate,
        MetadataError,
        r"5 bytes, but 4 elements of torch\.float32 need 16",
        r"5 bytes, but torch\.float32 \[4\] needs 16",
    ),
    "symlink-out": (
        lambda p, o: _swap_leaf_out(p, o, "secret"),
        UnsafePathError,
        "outside the checkpoint",
        "outside the checkpoint",
    ),
    "symlink-out-short": (
        lambda p, o: _swap_leaf_out(p, o, "short"),
        UnsafePathError,
        "outside the checkpoint",
        "outside the checkpoint",
    ),
    "fifo": (
        _fifo,
        UnsafePathError,
        "a FIFO where a regular file belongs",
        "not a regular file or directory",
    ),
    "directory": (
        _directory,
        MetadataError,
        "expected a file, found a directory",
        "the data file is missing",
    ),
    "parent-symlink-out": (
        _swap_parent_out,
        UnsafePathError,
        "outside the checkpoint",
        "outside the checkpoint",
    ),
}

#: How the restore reads the prefix: "lane" is the current-form lane (robust_key=True, the
#: default: nothing listed, each leaf checked on the descriptor it maps; a failure there reads
#: the prefix again in full, whose ValidationError reports the attacked leaves); "listed" is
#: the general read (robust_key=None: every directory listed, leaves without a stat).
READS = {"lane": True, "listed": None}


def _expected(attack: str, read: str) -> tuple[type[TdckptError], str]:
    _, error, message, report = ATTACKS[attack]
    if read == "lane" or (attack == "truncated" and read == "listed"):
        # A listed leaf's size is checked when mapped, too: a short one reads in full.
        return ValidationError, report
    return error, message


@pytest.mark.parametrize("read", sorted(READS))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_restore_attacked_after_validation_fails_cleanly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, attack: str, mode: Any, read: str
) -> None:
    prefix, outside = _saved(tmp_path, current=read == "lane")
    target = make_target(tdckpt.load_memmap(prefix).clone())
    objs, before_state = objects(target), state(target)
    do = ATTACKS[attack][0]
    error, message = _expected(attack, read)
    states: dict[str, Any] = {}

    def run_attack() -> None:
        do(prefix, outside)
        states["prefix"], states["outside"] = snapshot(prefix), snapshot(outside)

    calls = _attack_in_plan(monkeypatch, run_attack)
    with no_hang(), pytest.raises(error, match=message):
        tdckpt.load_memmap_(target, prefix, READS[read], mode=mode)
    assert calls, "the attack never ran: the seam moved"
    # Nothing grown, created or changed, inside or outside; the target as it was.
    assert snapshot(prefix) == states["prefix"]
    assert snapshot(outside) == states["outside"]
    now = objects(target)
    assert now.keys() == objs.keys() and all(now[k] is objs[k] for k in objs)
    assert diff_states(state(target), before_state) == []


@pytest.mark.parametrize("read", sorted(READS))
@pytest.mark.parametrize("mode", MODES)
def test_load_memmap_attacked_after_validation_fails_cleanly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: Any, read: str
) -> None:
    prefix, outside = _saved(tmp_path, current=read == "lane")
    states: dict[str, Any] = {}

    def run_attack() -> None:
        _swap_leaf_out(prefix, outside, "short")
        states["outside"] = snapshot(outside)

    _attack_in_plan(monkeypatch, run_attack)
    error = ValidationError if read == "lane" else UnsafePathError
    with pytest.raises(error, match="outside the checkpoint"):
        tdckpt.load_memmap(prefix, robust_key=READS[read], mode=mode)
    assert (outside / "short").read_bytes() == b"\x07" * 3
    assert snapshot(outside) == states["outside"]


# ---------------------------------------------------------------------------------- archives


def _archive(tmp_path: Path) -> tuple[Path, Path]:
    td = TensorDict(
        a=torch.arange(4.0), n=TensorDict(c=torch.arange(8.0), batch_size=[]), batch_size=[]
    )
    path = tmp_path / "x.tdz"
    with reference():
        td.memmap(path)
    other = tmp_path / "other.tdz"
    td2 = TensorDict(
        a=torch.full((4,), 7.0), n=TensorDict(c=torch.full((8,), 7.0), batch_size=[]), batch_size=[]
    )
    with reference():
        td2.memmap(other)
    return path, other


@pytest.mark.parametrize("mode", MODES)
def test_archive_maps_the_file_it_opened_even_if_the_path_is_swapped(
    tmp_path: Path, mode: Any
) -> None:
    path, other = _archive(tmp_path)
    storage = ArchiveStorage(path)
    moved = tmp_path / "moved.tdz"
    path.rename(moved)
    path.symlink_to(other)  # the path now names another archive, of the same size
    assert other.stat().st_size == moved.stat().st_size
    other_before = snapshot(other)
    a = storage.map("a.memmap", torch.float32, 4, mode=mode)
    c = storage.map("n/c.memmap", torch.float32, 8, mode=mode)
    assert a.tolist() == [0.0, 1.0, 2.0, 3.0] and c.tolist() == list(map(float, range(8)))
    assert storage.read_bytes("a.memmap") == torch.arange(4.0).numpy().tobytes()
    if mode == "r+":
        a[0] = 42.0  # reaches the opened archive, never the one the path names now
        with ArchiveStorage(moved) as reread:  # leaves written in place keep a stale CRC
            assert (
                torch.frombuffer(bytearray(reread.read_bytes("a.memmap")), dtype=torch.float32)[0]
                == 42.0
            )
    storage.close()
    assert snapshot(other) == other_before


def test_archive_that_is_a_fifo_is_refused_without_hanging(tmp_path: Path) -> None:
    fifo = tmp_path / "x.tdz"
    os.mkfifo(fifo)
    with no_hang(), pytest.raises(MetadataError, match="not a regular file"):
        ArchiveStorage(fifo)


@pytest.mark.parametrize("mode", MODES)
def test_archive_truncated_after_opening_is_refused(tmp_path: Path, mode: Any) -> None:
    path, _ = _archive(tmp_path)
    storage = ArchiveStorage(path)
    size = path.stat().st_size
    with open(path, "r+b") as fh:
        fh.truncate(size - 100)
    refused = r"changed size since it was opened|replaced or resized"
    with pytest.raises(MetadataError, match=refused):
        storage.map("a.memmap", torch.float32, 4, mode=mode)
    assert path.stat().st_size == size - 100, "the archive was regrown"
    storage.close()


# ------------------------------------------------- a restore never changes a file, in any mode

_DTYPES = [torch.float32, torch.int64, torch.uint8, torch.bfloat16, torch.bool]


@st.composite
def _contents(draw: st.DrawFn) -> TensorDict:
    batch = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)

    def leaf() -> torch.Tensor:
        dtype = draw(st.sampled_from(_DTYPES))
        shape = (batch, *draw(st.lists(st.integers(1, 3), max_size=2)))
        raw = torch.randint(
            0,
            256,
            (int(torch.Size(shape).numel()) * dtype.itemsize,),
            dtype=torch.uint8,
            generator=gen,
        )
        if dtype is torch.bool:
            return (raw % 2).bool().reshape(shape)
        return raw.view(dtype).reshape(shape)

    def level(depth: int) -> dict[str, Any]:
        out: dict[str, Any] = {f"k{i}": leaf() for i in range(draw(st.integers(1, 3)))}
        if depth < 2 and draw(st.booleans()):
            out["sub"] = TensorDict(level(depth + 1), batch_size=[batch])
        return out

    return TensorDict(level(0), batch_size=[batch])


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(content=_contents(), archive=st.booleans())
def test_restore_never_changes_a_file_in_any_mode(
    tmp_path_factory: pytest.TempPathFactory, content: TensorDict, archive: bool
) -> None:
    base = tmp_path_factory.mktemp("never")
    prefix = base / ("x.tdz" if archive else "x")
    with reference():
        content.memmap(prefix)
    before = snapshot(prefix)
    for mode in MODES:
        if archive and mode == "r+":
            continue  # r+ on an archive maps it shared: covered by the archive tests above
        loaded = tdckpt.load_memmap(prefix, mode=mode)
        into = tdckpt.load_memmap_(make_target(content.clone()), prefix, mode=mode)
        for out in (loaded, into):
            assert set(out.keys(True, True)) == set(content.keys(True, True))
            for key in content.keys(True, True):
                ours, theirs = out[key], content[key]
                assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, (mode, key)
                # Bytes, not values: random bits make NaNs, which never compare equal.
                assert torch.equal(ours.contiguous().view(torch.uint8), theirs.view(torch.uint8)), (
                    mode,
                    key,
                )
                # Directory leaves are tensordict MemoryMappedTensors on their file, as before.
                assert isinstance(ours, MemoryMappedTensor) == (not archive), (mode, key)
                if not archive:
                    assert Path(ours.filename).parent.is_relative_to(prefix.resolve()), (mode, key)
        del loaded, into
        assert snapshot(prefix) == before, f"mode={mode}: a file changed (size, mtime or bytes)"
