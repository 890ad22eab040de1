"""Store parity found by a red-team review: the same misuse or damage gets the same outcome on
a local folder, an archive root, memory:// and S3 (moto), and nothing a reader would refuse
is ever committed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _remote_fixtures import moto_s3  # noqa: F401
from tensordict import TensorDict
from test_substitution import root  # noqa: F401

import tdckpt.schema
from tdckpt import CheckpointManager
from tdckpt.errors import MetadataError


def _td(v: float) -> TensorDict:
    return TensorDict(w=torch.full((3,), v))


def _local(root: dict[str, Any]) -> bool:
    return "archive" in root  # the fixture's local roots (folders of steps or archives)


def _replacing(root: dict[str, Any]) -> dict[str, Any]:
    """``overwrite=True`` where the store can replace a step (a local root); object storage
    refuses it (no atomic swap), so there the same step number is saved afresh."""
    return {"overwrite": True} if _local(root) else {}


def test_metadata_larger_than_a_manifest_is_refused_before_anything_is_written(
    root: dict[str, Any],  # noqa: F811
) -> None:
    # 257 MiB of metadata: the step would be saved but never listed (every reader refuses
    # a manifest that large); with overwrite=True it replaced the good step.
    with CheckpointManager(**root) as mgr:
        mgr.save(1, _td(1.0))
        step = 1 if _local(root) else 2
        with pytest.raises(MetadataError, match="more than the 268435456 a step's manifest"):
            mgr.save(step, _td(2.0), metadata={"s": "x" * (257 << 20)}, **_replacing(root))
        assert mgr.steps() == [1]
        assert torch.equal(mgr.restore(1)["w"], torch.full((3,), 1.0))


def test_a_manifest_over_the_cap_is_never_committed(
    root: dict[str, Any],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Metadata small enough on its own, a manifest (or commit record) that is not: the
    # writer refuses before the commit, and the step it would have replaced stays.
    with CheckpointManager(**root) as mgr:
        mgr.save(1, _td(1.0))
        monkeypatch.setattr(tdckpt.schema, "MAX_MANIFEST_BYTES", 3000)
        if _local(root):
            with pytest.raises(MetadataError, match="would be [0-9]+ bytes, more than the 3000"):
                mgr.save(1, _td(2.0), metadata={"pad": "y" * 3000}, overwrite=True)
        with pytest.raises(MetadataError, match="would be [0-9]+ bytes, .*nothing was committed"):
            mgr.save(2, _td(2.0), metadata={"pad": "y" * 3000})
        with pytest.raises(MetadataError, match="nothing was committed"):
            mgr.save_async(3, _td(3.0), metadata={"pad": "y" * 3000}).result()
        monkeypatch.undo()
        assert mgr.steps() == [1]
        assert mgr.list_steps()[0].status == "committed"
        assert torch.equal(mgr.restore(1)["w"], torch.full((3,), 1.0))
        assert mgr.gc(grace_period=0) == []  # the refused attempts left nothing behind
