# ruff: noqa: F811  (pytest fixtures imported from _remote_fixtures are parameters here)
"""Object storage read in place (``tdckpt/_read/object_storage.py``): a restore fetches only
the bytes it uses, by ranged reads, and never makes a local copy.

Requests and bytes are counted at the moto S3 server itself (its WSGI app, see
``_remote_fixtures.py``): what the client really asked for, not a mock's bookkeeping.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("fsspec")
from _remote_fixtures import Remote, _timeout, moto_s3, remote, s3_remote  # noqa: F401

import tdckpt
from tdckpt import CheckpointManager
from tdckpt._read.object_open import open_url_storage
from tdckpt._read.object_storage import ObjectStorage
from tdckpt.errors import IntegrityError, TdckptError

tensordict = pytest.importorskip("tensordict")
TensorDict = tensordict.TensorDict

BIG = 1 << 20  # float32 elements: 4 MiB, an object of its own
SMALL = 4096  # 16 KiB: packed with the others


def _step() -> Any:
    g = torch.Generator().manual_seed(0)
    return TensorDict(
        big=TensorDict({f"b{i}": torch.randn(BIG, generator=g) for i in range(8)}),
        small=TensorDict({f"s{i:03d}": torch.randn(SMALL, generator=g) for i in range(64)}),
        batch_size=[],
    )


def _mgr(r: Remote, **kw: Any) -> Any:
    return CheckpointManager(r.url, storage_options=r.storage_options, **kw)


def _fetched(r: Remote, fn: Any) -> tuple[Any, int, int]:
    """``fn()``, with the GET requests and body bytes it cost at the server."""
    assert r.s3 is not None
    requests, sent = r.s3.snapshot()
    out = fn()
    requests2, sent2 = r.s3.snapshot()
    return out, requests2 - requests, sent2 - sent


def test_selective_restore_fetches_only_the_selected_ranges(s3_remote: Remote) -> None:
    td = _step()
    with _mgr(s3_remote) as mgr:
        mgr.save(1, td)
    with _mgr(s3_remote) as mgr:
        whole, _, whole_bytes = _fetched(s3_remote, lambda: mgr.restore(1))
        assert torch.equal(whole["big", "b3"], td["big", "b3"])
        assert whole_bytes >= 8 * BIG * 4 + 64 * SMALL * 4

        part, requests, nbytes = _fetched(s3_remote, lambda: mgr.restore(1, keys="big.b3"))
        assert list(part.keys(True, True)) == [("big", "b3")]
        assert torch.equal(part["big", "b3"], td["big", "b3"])
        # the record, one listing of the step's objects, the metadata, one leaf's range
        leaf = BIG * 4
        assert leaf <= nbytes < leaf + (256 << 10), nbytes
        assert requests <= 8, requests

        # one small leaf out of a pack: its range, not the pack
        part, requests, nbytes = _fetched(s3_remote, lambda: mgr.restore(1, keys="small.s010"))
        assert torch.equal(part["small", "s010"], td["small", "s010"])
        assert nbytes < (256 << 10), nbytes
        assert requests <= 8, requests

        target = _step().apply(torch.zeros_like)
        _, requests, nbytes = _fetched(
            s3_remote, lambda: mgr.restore_into(target, 1, keys=["big.b0", "big.b1"])
        )
        assert torch.equal(target["big", "b0"], td["big", "b0"])
        assert torch.equal(target["big", "b1"], td["big", "b1"])
        assert not target["big", "b2"].any()  # outside the selection: untouched
        assert 2 * BIG * 4 <= nbytes < 2 * BIG * 4 + (256 << 10), nbytes


def test_load_memmap_of_a_url_fetches_only_the_selected_leaves(
    s3_remote: Remote, tmp_path: Path
) -> None:
    td = _step()
    td.memmap(tmp_path / "p")
    s3_remote.fs().put(str(tmp_path / "p"), s3_remote.path("p"), recursive=True)
    url = f"{s3_remote.url}/p"
    so = s3_remote.storage_options
    out, requests, nbytes = _fetched(
        s3_remote, lambda: tdckpt.load_memmap(url, storage_options=so, keys="big.b5")
    )
    assert torch.equal(out["big", "b5"], td["big", "b5"])
    assert BIG * 4 <= nbytes < BIG * 4 + (256 << 10), nbytes
    # the listing, the three meta.json files (one batch of ranges), the leaf
    assert requests <= 8, requests
    # validate and inspect read no leaf byte
    report, _, nbytes = _fetched(s3_remote, lambda: tdckpt.validate(url, storage_options=so))
    assert report.ok and report.prefix == url
    assert nbytes < 64 << 10, nbytes
    info, _, nbytes = _fetched(s3_remote, lambda: tdckpt.inspect(url, storage_options=so))
    assert info.leaf_count == 72 and info.storage == "object"
    assert nbytes < 64 << 10, nbytes


def _no_tmp(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any temporary folder an error: object storage is read in place."""

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a temporary folder was created")

    monkeypatch.setattr(tempfile, "mkdtemp", refused)
    monkeypatch.setattr(tempfile, "TemporaryDirectory", refused)


def test_restore_verify_and_reads_make_no_local_copy(
    remote: Remote, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: every object-storage read went through a downloaded temporary folder."""
    td = _step()
    td.memmap(tmp_path / "p")
    remote.fs().put(str(tmp_path / "p"), remote.path("p"), recursive=True)
    with _mgr(remote) as mgr:
        mgr.save(1, td)
    so = remote.storage_options
    url = f"{remote.url}/p"
    _no_tmp(monkeypatch)
    with _mgr(remote) as mgr:
        assert torch.equal(mgr.restore(1)["small", "s001"], td["small", "s001"])
        target = _step().apply(torch.zeros_like)
        mgr.restore_into(target, 1)
        assert torch.equal(target["big", "b7"], td["big", "b7"])
        assert mgr.verify(1).ok
    assert torch.equal(tdckpt.load_memmap(url, storage_options=so)["big", "b1"], td["big", "b1"])
    assert tdckpt.validate(url, storage_options=so).ok


def _flip(r: Remote, path: str, at: int = 100) -> None:
    """Flip one byte of ``path`` (a file of step 1) in its object, at rest."""
    fs = r.fs()
    record = json.loads(fs.cat_file(r.path("1.tdckpt.json")))
    loc = record["locations"][path]
    obj = r.path(f"1.attempt-{record['attempt']}/{record['objects'][loc['object']]['name']}")
    data = bytearray(fs.cat_file(obj))
    data[loc["offset"] + at] ^= 0x01
    fs.pipe_file(obj, bytes(data))


def test_a_damaged_leaf_is_refused_by_name_and_key_only_when_read(remote: Remote) -> None:
    td = _step()
    with _mgr(remote) as mgr:
        mgr.save(1, td)
    _flip(remote, "big/b2.memmap")
    with _mgr(remote) as mgr:
        step_url = mgr.path(1)
        target = _step().apply(torch.zeros_like)
        with pytest.raises(IntegrityError) as info:
            mgr.restore_into(target, 1)
        text = str(info.value)
        assert text.startswith(f"{step_url}: step 1 is damaged in the store: changed: ")
        assert "big/b2.memmap" in text and "('big', 'b2')" in text
        (problem,) = info.value.problems  # type: ignore[attr-defined]
        assert (problem.path, problem.key, problem.kind) == (
            "big/b2.memmap",
            ("big", "b2"),
            "changed",
        )
        assert not target["big", "b0"].any()  # all or nothing
        # a restore that does not select the damaged leaf never reads it
        part = mgr.restore(1, keys="big.b3")
        assert torch.equal(part["big", "b3"], td["big", "b3"])
        # verify reads everything and reports it
        assert [p.path for p in mgr.verify(1).problems] == ["big/b2.memmap"]


def test_damaged_metadata_is_refused_before_anything_is_parsed(remote: Remote) -> None:
    with _mgr(remote) as mgr:
        mgr.save(1, _step())
    _flip(remote, "small/meta.json", at=5)
    with _mgr(remote) as mgr:
        with pytest.raises(IntegrityError, match=r"small/meta\.json") as info:
            mgr.restore(1, keys="big.b0")  # the metadata of every level is read
        assert str(info.value).startswith(f"{mgr.path(1)}: step 1 is damaged")


def test_a_url_prefix_with_a_manifest_is_checked_as_read(remote: Remote, tmp_path: Path) -> None:
    """A plain prefix that carries a tdckpt manifest (a step folder uploaded as is): its
    leaves are checked against it; the error names the URL and the key."""
    local = tmp_path / "root"
    with CheckpointManager(local) as mgr:
        mgr.save(1, _step())
        step = mgr.path(1)
    fs = remote.fs()
    fs.put(str(step), remote.path("s"), recursive=True)
    leaf = remote.path("s/small/s005.memmap")
    data = bytearray(fs.cat_file(leaf))
    data[0] ^= 1
    fs.pipe_file(leaf, bytes(data))
    url = f"{remote.url}/s"
    so = remote.storage_options
    with pytest.raises(TdckptError) as info:
        tdckpt.load_memmap(url, storage_options=so)
    assert f"{url}/small/s005.memmap" in str(info.value) or "small/s005.memmap" in str(info.value)
    assert str(info.value).startswith(url)
    assert "/tmp" not in str(info.value)
    part = tdckpt.load_memmap(url, storage_options=so, keys="small.s006")
    assert list(part.keys(True, True)) == [("small", "s006")]


def test_object_storage_capabilities_and_mode(remote: Remote, tmp_path: Path) -> None:
    TensorDict(a=torch.arange(4.0)).memmap(tmp_path / "p")
    remote.fs().put(str(tmp_path / "p"), remote.path("p"), recursive=True)
    storage = open_url_storage(f"{remote.url}/p", remote.storage_options)
    assert isinstance(storage, ObjectStorage)
    assert (storage.file_backed, storage.ranged_reads, storage.writable_in_place) == (
        False,
        True,
        False,
    )
    assert storage.listdir("").files == {
        "a.memmap": 16,
        "meta.json": storage.listdir("").files["meta.json"],
    }
    with pytest.raises(PermissionError, match="mode='r\\+'"):
        storage.map("a.memmap", torch.float32, 4, mode="r+")
    out = storage.map("a.memmap", torch.float32, 4, mode="r")
    out += 1  # a private buffer: writable, never reaches the store
    assert out.tolist() == [1.0, 2.0, 3.0, 4.0]
    again = tdckpt.load_memmap(f"{remote.url}/p", storage_options=remote.storage_options)
    assert again["a"].tolist() == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="mode='r\\+'"):
        tdckpt.load_memmap(f"{remote.url}/p", storage_options=remote.storage_options, mode="r+")


FIXTURES = Path(__file__).parent / "fixtures" / "tensordict"


def test_upgrade_dry_run_of_a_legacy_url_plans_in_place(
    remote: Remote, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tensordict 0.2.1 checkpoint at a URL: the plan is read from the store (its metadata
    only), and names the URL, not a downloaded copy."""
    remote.fs().put(str(FIXTURES / "0.2.1" / "nested" / "ckpt"), remote.path("old"), recursive=True)
    url = f"{remote.url}/old"
    so = remote.storage_options
    _no_tmp(monkeypatch)
    plan = tdckpt.upgrade(url, dry_run=True, storage_options=so)
    assert plan.dry_run and plan.prefix == url and plan.steps
    shown = [op.path for op in plan.operations if op.kind in ("backup", "swap")]
    assert shown and all(p == url for p in shown), shown
    with pytest.raises(TdckptError, match="not supported"):
        tdckpt.upgrade(url, storage_options=so)


def test_a_single_archive_object_at_a_url_is_read_in_memory(
    remote: Remote, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A .tdz at a URL: read whole into an anonymous in-memory file (no temporary folder),
    opened by the archive reader, every message naming the URL."""
    from tdckpt._write.archive_write import write_archive

    td = TensorDict(a=torch.arange(4.0), sub=TensorDict(b=torch.ones(2, 3)), batch_size=[])
    td.memmap(tmp_path / "p")
    archive = tmp_path / "p.tdz"
    write_archive(tmp_path / "p", archive)
    fs = remote.fs()
    fs.put_file(str(archive), remote.path("p.tdz"))
    url = f"{remote.url}/p.tdz"
    so = remote.storage_options
    _no_tmp(monkeypatch)
    out = tdckpt.load_memmap(url, storage_options=so)
    assert out["a"].tolist() == [0.0, 1.0, 2.0, 3.0] and out["sub", "b"].sum() == 6
    info = tdckpt.inspect(url, storage_options=so)
    assert (info.prefix, info.storage, info.leaf_count) == (url, "archive", 2)
    assert tdckpt.validate(url, storage_options=so).ok
    fs.pipe_file(remote.path("p.tdz"), archive.read_bytes()[:-30])  # its index cut off
    with pytest.raises(TdckptError) as error:
        tdckpt.load_memmap(url, storage_options=so)
    assert str(error.value).startswith(url) and "/proc/" not in str(error.value)
    report = tdckpt.validate(url, storage_options=so)
    assert not report.ok and report.problems[0].message.startswith(url)


def test_restoring_only_the_model_of_a_training_state_skips_the_optimizer_bytes(
    s3_remote: Remote,
) -> None:
    """``restore(step, keys="model")`` of a training state: the optimizer's moments (twice
    the model's bytes) are never fetched."""
    model = torch.nn.Linear(512, 1024)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 512)).sum().backward()
    opt.step()
    with _mgr(s3_remote) as mgr:
        mgr.save(1, {"model": model, "optim": opt})
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    with _mgr(s3_remote) as mgr:
        part, _, nbytes = _fetched(s3_remote, lambda: mgr.restore(1, keys="model"))
        _, _, whole = _fetched(s3_remote, lambda: mgr.restore(1))
    assert set(part.keys()) == {"model"}
    assert torch.equal(part["model", "weight"], model.weight.detach())
    assert model_bytes <= nbytes < model_bytes + (256 << 10), (nbytes, model_bytes)
    assert whole >= 3 * model_bytes


@pytest.mark.parametrize("range_bytes", [4096, 1000, 16 << 20])
def test_ranges_split_and_merged_give_every_byte(
    range_bytes: int, remote: Remote, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Leaves larger than a range (read as pieces), packs of small files (merged ranges),
    and pieces that end inside a file: every byte arrives where it belongs, checked."""
    from tdckpt._read import object_storage

    monkeypatch.setattr(object_storage, "RANGE_BYTES", range_bytes)
    g = torch.Generator().manual_seed(1)
    td = TensorDict(
        # more than one range: 20 MiB against the real 16 MiB ranges, 256 KiB against the
        # tiny ones (thousands of requests to moto otherwise)
        big=torch.randn((5 << 20) if range_bytes == 16 << 20 else (64 << 10), generator=g),
        odd=torch.randint(0, 255, (12_345,), dtype=torch.uint8, generator=g),
        small=TensorDict({f"s{i}": torch.randn(100 + i, generator=g) for i in range(40)}),
        batch_size=[],
    )
    with _mgr(remote) as mgr:
        mgr.save(1, td)
    with _mgr(remote) as mgr:
        out = mgr.restore(1)
        for key in td.keys(True, True):
            assert torch.equal(out[key], td[key]), key
        part = mgr.restore(1, keys=["odd", "small.s7", "small.s30"])
        assert torch.equal(part["small", "s30"], td["small", "s30"])
        assert torch.equal(part["odd"], td["odd"])


def test_a_pickle_larger_than_the_metadata_cap_is_read_on_demand(
    remote: Remote, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only JSON metadata has the JSON cap: a pickled value (the restore's own 1 GiB cap)
    over it is not read ahead but read when unpickled, as from a local folder."""
    from tdckpt._read import object_storage, storage

    for module in (storage, object_storage):
        monkeypatch.setattr(module, "MAX_JSON_BYTES", 8192)
    value = set(range(5000))  # pickles to about 25 KB
    td = TensorDict(a=torch.zeros(2), obj=tensordict.NonTensorData(data=value), batch_size=[])
    with _mgr(remote) as mgr:
        mgr.save(1, td)
    with _mgr(remote) as mgr:
        out = mgr.restore(1, allow_pickle=True)
    assert out["obj"] == value


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
def test_a_nested_tensor_at_a_url_round_trips(remote: Remote, tmp_path: Path) -> None:
    """Its size table is metadata (read with the rest); its values are a leaf."""
    nt = torch.nested.nested_tensor([torch.arange(3.0), torch.arange(5.0)])
    TensorDict(nt=nt, x=torch.ones(2, 4096), batch_size=[2]).memmap(tmp_path / "p")  # 32 KiB
    remote.fs().put(str(tmp_path / "p"), remote.path("p"), recursive=True)
    url = f"{remote.url}/p"
    storage = open_url_storage(url, remote.storage_options)
    assert isinstance(storage, ObjectStorage)
    assert storage.ranges_fetched >= 1
    before = storage.bytes_fetched
    assert before < 4096  # metadata only: no leaf read ahead
    out = tdckpt.load_memmap(url, storage_options=remote.storage_options)
    assert [t.tolist() for t in out["nt"].unbind()] == [[0.0, 1.0, 2.0], [0.0, 1.0, 2.0, 3.0, 4.0]]


def test_a_gone_object_is_reported_from_the_listing(remote: Remote) -> None:
    """The listing and the metadata reads run together; the listing's finding is the error
    (the object gone, by name), whatever the concurrent read ran into."""
    with _mgr(remote) as mgr:
        mgr.save(1, TensorDict(a=torch.zeros(3), batch_size=[]))
    fs = remote.fs()
    record = json.loads(fs.cat_file(remote.path("1.tdckpt.json")))
    (obj,) = record["objects"]
    fs.rm_file(remote.path(f"1.attempt-{record['attempt']}/{obj['name']}"))
    with _mgr(remote) as mgr, pytest.raises(IntegrityError) as info:
        mgr.restore(1)
    assert {p.kind for p in info.value.problems} == {"missing"}  # type: ignore[attr-defined]
    assert f"no object {obj['name']}" in str(info.value)
    assert str(info.value).startswith(f"{remote.url}/1.attempt-")


def test_a_url_prefix_s_metadata_is_checked_against_its_manifest(
    remote: Remote, tmp_path: Path
) -> None:
    """The manifest is read in the same batch as the metadata; the metadata read ahead is
    then checked against it before anything parses it."""
    local = tmp_path / "root"
    with CheckpointManager(local) as mgr:
        mgr.save(1, _step())
        step = mgr.path(1)
    fs = remote.fs()
    fs.put(str(step), remote.path("s"), recursive=True)
    meta = remote.path("s/small/meta.json")
    fs.pipe_file(meta, bytes(fs.cat_file(meta)).replace(b'"shape"', b'"shapE"', 1))
    url = f"{remote.url}/s"
    with pytest.raises(IntegrityError, match=r"small/meta\.json") as info:
        tdckpt.load_memmap(url, storage_options=remote.storage_options)
    assert str(info.value).startswith(url)
    (problem,) = info.value.problems  # type: ignore[attr-defined]
    assert problem.kind == "changed"


def test_metadata_read_ahead_is_bounded(
    remote: Remote, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read ahead stops at the read path's budget for all metadata together (what is left is
    read on demand, where the read path's own budget applies); many small files go out in
    several batches."""
    from tdckpt._read import object_storage, tree

    td = TensorDict({f"l{i}": TensorDict(x=torch.ones(3)) for i in range(6)}, batch_size=[])
    td.memmap(tmp_path / "p")
    remote.fs().put(str(tmp_path / "p"), remote.path("p"), recursive=True)
    url = f"{remote.url}/p"
    monkeypatch.setattr(object_storage, "BATCH_RANGES", 2)
    storage = open_url_storage(url, remote.storage_options)
    assert isinstance(storage, ObjectStorage)
    assert storage.ranges_fetched == 7  # the 7 meta.json files (in batches of at most 2)
    out = tdckpt.load_memmap(url, storage_options=remote.storage_options)
    assert out["l5", "x"].tolist() == [1.0, 1.0, 1.0]
    monkeypatch.setattr(tree, "MAX_METADATA_BYTES", 300)
    storage = open_url_storage(url, remote.storage_options)
    assert isinstance(storage, ObjectStorage)
    assert storage.bytes_fetched <= 300
    assert 0 < storage.ranges_fetched < 7
    # what was not read ahead is read when the read path asks for it
    out = tdckpt.load_memmap(url, storage_options=remote.storage_options)
    assert out["l0", "x"].tolist() == [1.0, 1.0, 1.0]


def test_a_consolidated_file_at_a_url_is_read_in_memory(remote: Remote, tmp_path: Path) -> None:
    td = TensorDict(a=torch.arange(6.0), sub=TensorDict(b=torch.ones(2)), batch_size=[])
    path = tmp_path / "c.bin"
    td.consolidate(filename=path)
    remote.fs().put_file(str(path), remote.path("c.bin"))
    url = f"{remote.url}/c.bin"
    out = tdckpt.load_memmap(url, storage_options=remote.storage_options)
    assert out["a"].tolist() == list(range(6)) and out["sub", "b"].tolist() == [1.0, 1.0]
    info = tdckpt.inspect(url, storage_options=remote.storage_options)
    assert (info.prefix, info.storage) == (url, "consolidated")


def test_a_damaged_archive_object_at_a_url_reports_its_problems(
    remote: Remote, tmp_path: Path
) -> None:
    """Regression: a restore read an opened storage a second time after closing it (to list
    every problem), which an archive cannot be: the ValidationError must come out."""
    from tdckpt._write.archive_write import write_archive
    from tdckpt.errors import ValidationError

    TensorDict(a=torch.arange(4.0), batch_size=[]).memmap(tmp_path / "p")
    meta = tmp_path / "p" / "meta.json"
    meta.write_bytes(meta.read_bytes().replace(b"torch.float32", b"torch.float99"))
    write_archive(tmp_path / "p", tmp_path / "p.tdz")
    remote.fs().put_file(str(tmp_path / "p.tdz"), remote.path("p.tdz"))
    url = f"{remote.url}/p.tdz"
    with pytest.raises(ValidationError) as info:
        tdckpt.load_memmap(url, storage_options=remote.storage_options)
    assert str(info.value).startswith(url) and "float99" in str(info.value)
