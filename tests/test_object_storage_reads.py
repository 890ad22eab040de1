# ruff: noqa: F811  (pytest fixtures imported from _remote_fixtures are parameters here)
"""Ranged reads of object storage land straight in the buffers the restored tensors own.

``tdckpt/_read/object_storage._read_into`` reads each range into a slice of the buffer its
file's tensor will own (on s3fs, a ``GetObject`` body read into the buffer as it arrives);
nothing is assembled afterwards. Checked on a moto S3 server (requests and body bytes
counted at the server's WSGI app) and on ``memory://``: every byte exact, the ranges
requested counted, each range's buffer inside the restored tensor's memory, and a failed
request retried alone, not the whole batch.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("fsspec")
from _remote_fixtures import Remote, _timeout, moto_s3, remote, s3_remote  # noqa: F401

import tdckpt
from tdckpt._read import object_storage
from tdckpt._read.object_open import open_url_storage
from tdckpt._read.object_storage import ObjectStorage

tensordict = pytest.importorskip("tensordict")
TensorDict = tensordict.TensorDict

PIECE = 64 << 10  # RANGE_BYTES for these tests: a leaf of 200 KiB is 4 ranges


def _data() -> Any:
    g = torch.Generator().manual_seed(3)
    return TensorDict(
        big=torch.randn(50 * 1024 + 7, generator=g),  # 200 KiB + 28 bytes: 4 pieces
        exact=torch.randint(0, 255, (PIECE,), dtype=torch.uint8, generator=g),  # one piece
        small=TensorDict({f"s{i}": torch.randn(10 + i, generator=g) for i in range(5)}),
        batch_size=[],
    )


def _put(remote: Remote, tmp_path: Path) -> str:
    _data().memmap(tmp_path / "p")
    remote.fs().put(str(tmp_path / "p"), remote.path("p"), recursive=True)
    return f"{remote.url}/p"


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int, int]]:
    """Every range read, as ``(path, offset, length, buffer address)``: a spy that runs the
    real ``_read_into``."""
    monkeypatch.setattr(object_storage, "RANGE_BYTES", PIECE)
    seen: list[tuple[str, int, int, int]] = []
    real = object_storage._read_into

    def spy(store: Any, ranges: list[tuple[str, int, memoryview]]) -> list[int]:
        seen.extend((path, off, buf.nbytes, _address(buf)) for path, off, buf in ranges)
        return real(store, ranges)

    monkeypatch.setattr(object_storage, "_read_into", spy)
    return seen


def test_leaf_ranges_are_read_into_the_tensor_s_own_memory(
    remote: Remote, tmp_path: Path, reads: list[tuple[str, int, int, int]]
) -> None:
    url = _put(remote, tmp_path)
    storage = open_url_storage(url, remote.storage_options)
    assert isinstance(storage, ObjectStorage)
    reads.clear()  # the metadata read ahead at opening
    ranges, fetched = storage.ranges_fetched, storage.bytes_fetched
    want = _data()
    big = want["big"]
    nbytes = big.numel() * 4
    storage.prefetch(["big.memmap"])
    assert (storage.ranges_fetched - ranges, storage.bytes_fetched - fetched) == (4, nbytes)
    got = storage.map("big.memmap", torch.float32, big.numel(), mode="r")
    assert torch.equal(got, big)  # every byte exact
    # 4 ranges of at most PIECE bytes, covering the file once, in order
    assert [(p.rpartition("/")[2], off, n) for p, off, n, _ in reads] == [
        ("big.memmap", off, min(PIECE, nbytes - off)) for off in range(0, nbytes, PIECE)
    ]
    # each range was read straight into its place in the tensor's memory: no copy after
    base = got.data_ptr()
    assert [addr - base for _, _, _, addr in reads] == list(range(0, nbytes, PIECE))
    storage.close()


def test_a_load_is_byte_exact_and_requests_only_its_ranges(
    s3_remote: Remote, tmp_path: Path, reads: list[tuple[str, int, int, int]]
) -> None:
    url = _put(s3_remote, tmp_path)
    assert s3_remote.s3 is not None
    storage = open_url_storage(url, s3_remote.storage_options)
    before, sent_before = s3_remote.s3.snapshot()
    reads.clear()
    storage.prefetch(["big.memmap", "exact.memmap"])
    after, sent_after = s3_remote.s3.snapshot()
    want = _data()
    big = storage.map("big.memmap", torch.float32, want["big"].numel(), mode="r")
    exact = storage.map("exact.memmap", torch.uint8, PIECE, mode="r")
    assert torch.equal(big, want["big"]) and torch.equal(exact, want["exact"])
    nbytes = want["big"].numel() * 4 + PIECE
    # one GET per range, exactly the leaves' bytes sent: nothing read twice or around them
    assert after - before == len(reads) == 4 + 1
    assert sent_after - sent_before == nbytes == sum(n for _, _, n, _ in reads)
    storage.close()
    # the whole load through the public API: every leaf exact
    out = tdckpt.load_memmap(url, storage_options=s3_remote.storage_options)
    for key in want.keys(True, True):
        assert torch.equal(out[key], want[key]), key


def test_a_failed_range_is_retried_alone(
    s3_remote: Remote, tmp_path: Path, reads: list[tuple[str, int, int, int]]
) -> None:
    """A 500 answering one ranged GET: that request alone is sent again (retried per
    request, by s3fs's retry wrapper around the request and its body, or botocore's below
    it); the other ranges of the batch are not (the store's own retry loop re-sends a whole
    batch only when a request fails for good)."""
    url = _put(s3_remote, tmp_path)
    s3 = s3_remote.s3
    assert s3 is not None
    storage = open_url_storage(url, s3_remote.storage_options)
    failed: list[str] = []

    def once(method: str, path: str) -> bool:
        if method == "GET" and path.endswith("/big.memmap") and not failed:
            failed.append(path)
            return True
        return False

    before, _ = s3.snapshot()
    reads.clear()
    s3.failing = once
    try:
        storage.prefetch(["big.memmap"])
    finally:
        s3.failing = None
    after, _ = s3.snapshot()
    assert failed and len(reads) == 4
    assert after - before == 4 + 1  # the failed range once more, nothing else
    got = storage.map("big.memmap", torch.float32, _data()["big"].numel(), mode="r")
    assert torch.equal(got, _data()["big"])
    storage.close()
