"""The safetensors writer's mechanics: gathered writes from the tensors' memory, the size set
first, writeback while writing; each file checked against the reference reader."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import tdckpt
from tdckpt._interop import safetensors_write
from tdckpt._interop.safetensors_write import GATHER_BYTES, _bytes_of
from tdckpt._write.preallocate import preallocate


def test_preallocate_sets_the_final_size(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        reserved = preallocate(fd, 3 * 4096 + 5)
        assert os.fstat(fd).st_size == 3 * 4096 + 5
        assert preallocate(fd, 3 * 4096 + 5) is reserved  # the same size again: no change
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == bytes(3 * 4096 + 5)
    if hasattr(os, "posix_fallocate") and reserved:
        # reserved blocks: the file is not sparse
        assert os.stat(tmp_path / "f").st_blocks * 512 >= 3 * 4096 + 5


def test_preallocate_without_fallocate_truncates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A platform without posix_fallocate (macOS): the size is set by ftruncate alone.
    monkeypatch.delattr(os, "posix_fallocate", raising=False)
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        assert preallocate(fd, 10_000) is False
        assert os.fstat(fd).st_size == 10_000
        assert preallocate(fd, 0) is False
    finally:
        os.close(fd)


def test_preallocate_refuses_a_negative_size_and_reports_real_errors(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "f", os.O_RDONLY | os.O_CREAT)
    try:
        with pytest.raises(ValueError, match=">= 0"):
            preallocate(fd, -1)
        with pytest.raises(OSError):  # read-only descriptor: EBADF, not "unsupported"
            preallocate(fd, 100)
    finally:
        os.close(fd)


def test_byte_views_share_the_tensor_memory() -> None:
    t = torch.arange(10, dtype=torch.float32)
    view = _bytes_of(t)
    assert len(view) == 40
    assert np.frombuffer(view, dtype=np.uint8).ctypes.data == t.data_ptr()
    bf = torch.ones(3, dtype=torch.bfloat16)  # numpy has no bfloat16: viewed as bytes
    assert bytes(_bytes_of(bf)) == bf.view(torch.uint8).numpy().tobytes()


def test_many_small_and_a_few_large_tensors_match_the_reference(tmp_path: Path) -> None:
    # More tensors than one writev takes buffers, several calls' worth of one tensor, a
    # view that is not contiguous, a conjugate and a negative view, an empty tensor.
    g = torch.Generator().manual_seed(1)
    tensors = {f"s{i:04d}": torch.randint(0, 100, (i % 3 + 1,), generator=g) for i in range(2500)}
    tensors["big"] = torch.randn(3 * GATHER_BYTES // 4 + 7, generator=g)
    tensors["strided"] = torch.randn(64, 33, generator=g)[:, ::2]
    tensors["conj"] = torch.randn(5, dtype=torch.complex64, generator=g).conj()
    tensors["neg"] = torch.randn(4, dtype=torch.complex64, generator=g).conj().imag
    assert tensors["conj"].is_conj() and tensors["neg"].is_neg()
    tensors["empty"] = torch.empty(0, 3)
    tensors["scalar"] = torch.tensor(2.5, dtype=torch.float64)
    ours = tmp_path / "ours.safetensors"
    report = tdckpt.export_safetensors(tensors, ours)
    reference = tmp_path / "ref.safetensors"
    save_file(
        {k: v.resolve_conj().resolve_neg().contiguous() for k, v in tensors.items()}, reference
    )
    back = load_file(ours)
    assert sorted(back) == sorted(tensors)
    for name, tensor in tensors.items():
        expected = tensor.resolve_conj().resolve_neg()
        assert back[name].dtype == expected.dtype and back[name].shape == expected.shape
        assert torch.equal(
            back[name].reshape(-1).view(torch.uint8),
            expected.contiguous().reshape(-1).view(torch.uint8),
        )
    assert report.total_bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    # The same data bytes as the reference writer (headers differ only in ordering/metadata).
    assert os.path.getsize(ours) - _header_len(ours) == os.path.getsize(reference) - _header_len(
        reference
    )
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def _header_len(path: Path) -> int:
    with open(path, "rb") as fh:
        return 8 + int.from_bytes(fh.read(8), "little")


def test_writeback_is_started_while_writing_and_the_file_is_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Writeback every 2 MiB (instead of 32): the synced file is byte-for-byte the unsynced one.
    calls: list[tuple[int, int]] = []
    real = safetensors_write.start_writeback

    def counting(fd: int, offset: int = 0, nbytes: int = 0) -> bool:
        calls.append((offset, nbytes))
        return real(fd, offset, nbytes)

    monkeypatch.setattr(safetensors_write, "WRITEBACK_BYTES", 2 << 20)
    monkeypatch.setattr(safetensors_write, "start_writeback", counting)
    g = torch.Generator().manual_seed(2)
    tensors = {f"w{i}": torch.randn(GATHER_BYTES // 4, generator=g) for i in range(9)}
    tdckpt.export_safetensors(tensors, tmp_path / "sync.safetensors", fsync=True)
    assert calls, "no writeback was started"
    assert calls[0][0] == 0 and all(n >= 2 << 20 for _, n in calls)
    # the ranges follow each other: every byte written is handed to the disk once
    assert all(a[0] + a[1] == b[0] for a, b in itertools.pairwise(calls))
    written = len(calls)
    tdckpt.export_safetensors(tensors, tmp_path / "nosync.safetensors", fsync=False)
    assert len(calls) == written  # no writeback without fsync
    assert (tmp_path / "sync.safetensors").read_bytes() == (
        tmp_path / "nosync.safetensors"
    ).read_bytes()


@pytest.mark.skipif(not hasattr(os, "posix_fallocate"), reason="POSIX file size limits")
def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    # A real failure: the process may not write files larger than 1 MiB (RLIMIT_FSIZE), so
    # the new file cannot get its size (EFBIG) - as on a full disk, before anything is written.
    import resource
    import signal

    out = tmp_path / "model.safetensors"
    tdckpt.export_safetensors({"a": torch.ones(3)}, out)
    before = out.read_bytes()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
    try:
        with pytest.raises(OSError):
            tdckpt.export_safetensors({"a": torch.zeros(1 << 20)}, out, overwrite=True)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
