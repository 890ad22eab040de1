"""A step's manifest is read from one open file: never through a link, never blocking.

The listing judges a step by ``lstat`` first; these cases swap the manifest (or a step
archive) after that check, by calling the reader the listing calls with what was swapped in.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from tdckpt import CheckpointManager
from tdckpt._manage.steps import StepIndex
from tdckpt.errors import MetadataError
from tdckpt.schema import MANIFEST_NAME


def _step(tmp_path: Path, *, archive: bool) -> tuple[CheckpointManager, Path]:
    mgr = CheckpointManager(tmp_path / "run", archive=archive, fsync=False)
    path = mgr.save(1, TensorDict(a=torch.arange(3.0), batch_size=[3]))
    return mgr, path


@pytest.mark.parametrize("archive", [False, True], ids=["dir", "tdz"])
def test_a_fifo_swapped_in_for_the_manifest_is_refused_without_blocking(
    tmp_path: Path, archive: bool, no_hang: None
) -> None:
    _, path = _step(tmp_path, archive=archive)
    where = path if archive else path / MANIFEST_NAME
    where.unlink()
    os.mkfifo(where)
    with pytest.raises(MetadataError, match="not a regular file"):
        StepIndex._manifest_bytes(where, "tdz" if archive else "dir", 100)


@pytest.mark.parametrize("archive", [False, True], ids=["dir", "tdz"])
def test_a_symlink_swapped_in_for_the_manifest_is_never_followed(
    tmp_path: Path, archive: bool
) -> None:
    mgr, path = _step(tmp_path, archive=archive)
    where = path if archive else path / MANIFEST_NAME
    outside = tmp_path / "outside"
    outside.write_bytes(where.read_bytes())  # a valid manifest, but not the step's own file
    where.unlink()
    where.symlink_to(outside)
    with pytest.raises(MetadataError, match="cannot be opened"):
        StepIndex._manifest_bytes(where, "tdz" if archive else "dir", 100)
    assert mgr.steps() == []  # and the listing does not count the step as committed


def test_a_listing_races_a_writer_swapping_manifests(tmp_path: Path, no_hang: None) -> None:
    """Manifests flipping between a file, a FIFO and a link while steps are listed."""
    mgr, path = _step(tmp_path, archive=False)
    where = path / MANIFEST_NAME
    good = where.read_bytes()
    stop = threading.Event()

    def flip() -> None:
        while not stop.is_set():
            for make in (
                lambda: os.mkfifo(where),
                lambda: where.symlink_to("/dev/zero"),
                lambda: where.write_bytes(good),
            ):
                with contextlib.suppress(FileNotFoundError):
                    where.unlink()
                make()

    flipper = threading.Thread(target=flip, daemon=True)
    flipper.start()
    try:
        for _ in range(300):
            assert mgr.steps() in ([], [1])
    finally:
        stop.set()
        flipper.join()
