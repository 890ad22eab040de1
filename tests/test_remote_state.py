"""A training state (module + optimizer) through an object-storage root (memory://)."""

from __future__ import annotations

import uuid

import pytest
import torch

from tdckpt import CheckpointManager

pytest.importorskip("fsspec")  # the [remote] extra; the [test] extra installs it


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return model, opt


def test_a_training_state_round_trips_through_memory_url() -> None:
    root = f"memory://tdckpt-state-{uuid.uuid4().hex}"
    model, opt = _model()
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"model": model, "optim": opt})
        assert mgr.steps() == [1]
        assert mgr.verify(1).ok
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1.0)
    with CheckpointManager(root) as mgr:
        mgr.restore_into({"model": fresh, "optim": fresh_opt})
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    saved, restored = opt.state_dict(), fresh_opt.state_dict()
    assert saved["param_groups"] == restored["param_groups"]
    for pid, state in saved["state"].items():
        for name, value in state.items():
            assert torch.equal(value, restored["state"][pid][name]), (pid, name)


def test_save_async_to_an_object_store_is_refused_clearly() -> None:
    root = f"memory://tdckpt-state-{uuid.uuid4().hex}"
    model, _ = _model()
    with CheckpointManager(root) as mgr:
        with pytest.raises(ValueError, match="save_async is not supported for object-storage"):
            mgr.save_async(1, {"model": model})
        assert mgr.steps() == []
