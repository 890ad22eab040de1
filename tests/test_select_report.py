"""Selective restore, the rest: the report's ``unexpected``, ``device=``, training states, and
what a subset restore touches on disk (counted by the kernel, see ``_fs_access``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _fs_access import Access, mapped_bytes, needs_linux
from tensordict import TensorDict

import tdckpt
from tdckpt import CheckpointManager, RandomState
from tdckpt.errors import RestoreError

MiB = 1 << 20


def _td() -> TensorDict:
    return TensorDict(
        model=TensorDict(
            enc=TensorDict(weight=torch.ones(2), bias=torch.zeros(2)),
            dec=TensorDict(weight=torch.full((3,), 2.0)),
        ),
        buffer=TensorDict(obs=torch.arange(8.0).reshape(4, 2), batch_size=[4]),
        step=torch.tensor(5),
    )


@pytest.fixture
def prefix(tmp_path: Path) -> Path:
    _td().memmap(tmp_path / "p")
    return tmp_path / "p"


def _keys(td: Any) -> set[tuple[str, ...]]:
    return {(k,) if isinstance(k, str) else k for k in td.keys(True, True)}


# -- the report: loaded / skipped / missing / unexpected ------------------------------------


def _target() -> TensorDict:
    """``model.enc`` lacks ``bias`` and has ``old``; no ``model.dec``; ``mine`` outside."""
    return TensorDict(
        model=TensorDict(enc=TensorDict(weight=torch.zeros(2), old=torch.zeros(1))),
        mine=torch.ones(5),
    )


def test_in_place_report_lists_each_of_the_four(prefix: Path) -> None:
    target = _target()
    _, report = tdckpt.load_memmap_(target, prefix, keys="model", report=True)
    assert sorted(report.loaded) == [
        ("model", "dec", "weight"),
        ("model", "enc", "bias"),
        ("model", "enc", "weight"),
    ]
    assert sorted(report.skipped) == [("buffer", "obs"), ("step",)]
    # the target's key within the selection that the checkpoint lacks (removed by the restore)
    assert report.missing == [("model", "enc", "old")]
    # the checkpoint part's keys the target lacked (added), a missing level by its leaves
    assert report.unexpected == [("model", "dec", "weight"), ("model", "enc", "bias")]
    # load_memmap_ keeps tensordict's rule: the target took the checkpoint's structure
    assert _keys(target) == {*report.loaded, ("mine",)}
    assert report.to_json()["unexpected"] == [["model", "dec", "weight"], ["model", "enc", "bias"]]


def test_outside_the_selection_nothing_is_missing_or_unexpected(prefix: Path) -> None:
    target = _target()
    _, report = tdckpt.load_memmap_(target, prefix, keys="model.enc.weight", report=True)
    assert report.loaded == [("model", "enc", "weight")]
    assert report.missing == [] and report.unexpected == []  # enc.old, mine: not selected
    assert torch.equal(target["model", "enc", "old"], torch.zeros(1))


def test_a_pattern_that_selects_nothing_is_missing(prefix: Path) -> None:
    with pytest.raises(RestoreError, match="select nothing: nope"):
        tdckpt.load_memmap_(_target(), prefix, keys=["model.enc", "nope"])
    target = _target()
    _, report = tdckpt.load_memmap_(
        target, prefix, keys=["model.enc", "nope"], strict=False, report=True
    )
    assert report.missing == [("nope",), ("model", "enc", "old")]  # patterns first
    assert report.unexpected == [("model", "enc", "bias")]


def test_a_new_object_has_nothing_unexpected(prefix: Path) -> None:
    _, report = tdckpt.load_memmap(prefix, keys=["model", "x"], strict=False, report=True)
    assert report.unexpected == [] and report.missing == [("x",)]


def test_restore_into_strict_refuses_missing_and_unexpected_keys(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, _td())
        # unexpected only: the checkpoint's model.enc.bias is not in the target
        target = TensorDict(model=TensorDict(enc=TensorDict(weight=torch.zeros(2))))
        with pytest.raises(RestoreError, match=r"not the target: \('model', 'enc', 'bias'\)"):
            mgr.restore_into(target, keys="model.enc")
        assert torch.equal(target["model", "enc", "weight"], torch.zeros(2))  # untouched
        # missing only: the target's model.enc.old is not in the checkpoint
        target = TensorDict(
            model=TensorDict(enc=TensorDict(weight=torch.zeros(2), bias=torch.zeros(2), old=1))
        )
        with pytest.raises(RestoreError, match=r"not the checkpoint: \('model', 'enc', 'old'\)"):
            mgr.restore_into(target, keys="model.enc")
        assert torch.equal(target["model", "enc", "weight"], torch.zeros(2))
        # strict=False: both reported, the selection takes the checkpoint's structure
        target = _target()
        _, report = mgr.restore_into(target, keys="model.enc", strict=False, report=True)
        assert report.missing == [("model", "enc", "old")]
        assert report.unexpected == [("model", "enc", "bias")]
        assert sorted(report.loaded) == [("model", "enc", "bias"), ("model", "enc", "weight")]
        assert sorted(target["model", "enc"].keys()) == ["bias", "weight"]
        assert torch.equal(target["mine"], torch.ones(5))
        # skipped is never an error: a matching target restores with strict=True
        target = TensorDict(model=TensorDict(enc=TensorDict(weight=1.0, bias=1.0)))
        _, report = mgr.restore_into(target, keys="model.enc", report=True)
        assert report.missing == report.unexpected == [] and ("step",) in report.skipped


def _stack(*, target: bool) -> Any:
    from tensordict import LazyStackedTensorDict

    def member() -> TensorDict:
        if target:  # a.y and c: not in the checkpoint
            return TensorDict(a=TensorDict(x=torch.zeros(2), y=torch.zeros(2)), c=torch.zeros(1))
        return TensorDict(a=TensorDict(x=torch.ones(2)), b=torch.zeros(2))

    return LazyStackedTensorDict(member(), member())


def test_a_lazy_stack_is_compared_member_by_member_without_its_indices(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, _stack(target=False))
        target = _stack(target=True)
        # a.y is within keys="a" in every member: strict=True refuses (it was removed silently)
        with pytest.raises(RestoreError, match=r"\('0', 'a', 'y'\), \('1', 'a', 'y'\)"):
            mgr.restore_into(target, keys="a")
        assert "y" in target.tensordicts[0]["a"].keys()  # noqa: SIM118
        _, report = mgr.restore_into(target, keys="a", strict=False, report=True)
        # the report names keys as patterns do: without the member index
        assert report.missing == [("a", "y")] and report.unexpected == []
        assert report.loaded == [("a", "x")] and report.skipped == [("b",)]
        member = target.tensordicts[1]
        assert sorted(member["a"].keys()) == ["x"] and "c" in member.keys()  # noqa: SIM118


# -- device= ----------------------------------------------------------------------------------


def test_device_cpu_keeps_leaves_mapped(prefix: Path, tmp_path: Path) -> None:
    out = tdckpt.load_memmap(prefix, keys="model", device="cpu")
    assert out["model", "enc", "weight"].device.type == "cpu"
    assert mapped_bytes(prefix)  # still memory-mapped from the checkpoint
    with CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, _td())
        part = mgr.restore(1, keys="buffer", device=torch.device("cpu"), dtype=torch.float16)
        assert part["buffer", "obs"].dtype == torch.float16
        assert torch.equal(part["buffer", "obs"], torch.arange(8.0).reshape(4, 2).half())


@needs_linux
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_device_this_process_lacks_is_refused_before_anything_is_read(
    tmp_path: Path,
) -> None:
    model = torch.nn.Linear(4, 2)
    with CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, _td())
        mgr.save(2, {"model": model})
        steps = tmp_path / "run"
        with Access(steps) as seen:
            with pytest.raises(RestoreError, match=r"device='cuda'.*no cuda device.*nothing"):
                mgr.restore(1, device="cuda")
            with pytest.raises(RestoreError, match="not a torch device"):
                mgr.restore(1, keys="model", device="nodevice")
            if not torch.backends.mps.is_available():  # asked through torch.mps
                with pytest.raises(RestoreError, match="no mps device"):
                    mgr.restore(1, device="mps")
            with pytest.raises(RestoreError, match=r"no cuda device"):
                tdckpt.load_memmap(steps / "1", device=torch.device("cuda", 0))
            # a training state in place: refused before anything changes
            fresh = torch.nn.Linear(4, 2)
            before = {k: v.clone() for k, v in fresh.state_dict().items()}
            with pytest.raises(RestoreError, match="no cuda device"):
                mgr.restore_into({"model": fresh}, device="cuda")
            kept = mgr.restore(1, keys="step", device="cpu")  # the watch sees a real restore
        assert seen.leaves_opened() == {"1/step.memmap"}  # and nothing before it
        assert int(kept["step"]) == 5
        assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_cuda_moves_the_selected_leaves(tmp_path: Path) -> None:  # pragma: no cover
    with CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, _td())
        part = mgr.restore(1, keys="model", device="cuda", dtype=torch.bfloat16)
        assert part["model", "dec", "weight"].device.type == "cuda"
        assert part["model", "dec", "weight"].dtype == torch.bfloat16
        assert torch.equal(part["model", "dec", "weight"].cpu(), torch.full((3,), 2.0).bfloat16())
        beyond = f"cuda:{torch.cuda.device_count()}"
        with pytest.raises(RestoreError, match=r"indices 0\.\."):
            mgr.restore(1, device=beyond)


# -- training states --------------------------------------------------------------------------


def _state(width: int = 16) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(width, width)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.ones(1, width)).sum().backward()
    optim.step()
    return {"model": model, "optim": optim, "rng": RandomState()}


def _fresh(width: int = 16) -> dict[str, Any]:
    torch.manual_seed(1)
    model = torch.nn.Linear(width, width)
    return {"model": model, "optim": torch.optim.Adam(model.parameters(), lr=0.01)}


def test_restore_into_a_training_state_restores_only_the_selected_entry(tmp_path: Path) -> None:
    saved = _state()
    with CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, saved)
        state = _fresh()
        weight = state["model"].weight
        _, report = mgr.restore_into(state, keys="model", report=True)
        assert state["model"].weight is weight  # restored in place
        assert torch.equal(weight, saved["model"].weight)
        assert state["optim"].state_dict()["state"] == {}  # not selected: as it was
        assert {k[0] for k in report.loaded} == {"model"}
        assert {k[0] for k in report.skipped} == {"optim", "rng"}
        assert report.missing == report.unexpected == []
        # exclude=, the other way round
        state = _fresh()
        _, report = mgr.restore_into(state, exclude=["model", "rng"], strict=False, report=True)
        assert not torch.equal(state["model"].weight, saved["model"].weight)
        assert state["optim"].state_dict()["state"][0]["step"] == 1
        assert {k[0] for k in report.loaded} == {"optim"}


def test_training_state_selection_report_and_strict(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, _state())
        model = torch.nn.Linear(16, 16)
        before = model.weight.detach().clone()
        # every entry selected, the target lacks optim and rng: unexpected, refused
        with pytest.raises(RestoreError, match="holds entries the target lacks: 'optim', 'rng'"):
            mgr.restore_into({"model": model}, keys="*")
        assert torch.equal(model.weight, before)
        _, report = mgr.restore_into({"model": model}, keys="*", strict=False, report=True)
        assert report.unexpected == [("optim",), ("rng",)]
        assert {k[0] for k in report.loaded} == {"model"}  # unexpected entries are not read
        assert not torch.equal(model.weight, before)
        # a pattern that selects no entry
        with pytest.raises(RestoreError, match=r"select no entry of the step: optimizer\. The "):
            mgr.restore_into({"model": model}, keys=["model", "optimizer"])
        _, report = mgr.restore_into(
            {"model": model}, keys=["model", "optimizer"], strict=False, report=True
        )
        assert report.missing == [("optimizer",)]
        # a target entry the selection names and the step lacks is always an error
        with pytest.raises(RestoreError, match="entry 'ema': not in the step"):
            mgr.restore_into({"model": model, "ema": torch.nn.Linear(16, 16)}, keys="*")
        # outside the selection it stays as it is
        ema = torch.nn.Linear(16, 16)
        mgr.restore_into({"model": model, "ema": ema}, keys="model")
        # patterns name entries: one below an entry is refused, by restore() too
        for call in (
            lambda: mgr.restore_into({"model": model}, keys="model.weight"),
            lambda: mgr.restore(1, exclude="optim.state"),
        ):
            with pytest.raises(RestoreError, match="name entries"):
                call()


@needs_linux
def test_a_training_state_subset_reads_only_its_entry(tmp_path: Path) -> None:
    saved = _state(width=512)  # model 1 MiB, optim's two moments 2 MiB
    with CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, saved)
        step = tmp_path / "run" / "1"
        with Access(step) as seen:
            part = mgr.restore(1, keys="model")
        assert {n.split("/")[0] for n in seen.leaves_opened()} == {"model"}
        mapped = mapped_bytes(step)
        assert {n.split("/")[0] for n in mapped} == {"model"}
        assert MiB <= sum(mapped.values()) < MiB + 64 * 1024  # weight + bias, page-rounded
        del part
        state = _fresh(width=512)
        with Access(step) as seen:
            mgr.restore_into(state, keys="model")
        assert {n.split("/")[0] for n in seen.leaves_opened()} == {"model"}
        assert torch.equal(state["model"].weight, saved["model"].weight)


# -- what a local subset restore touches, counted ----------------------------------------------


@needs_linux
def test_a_subset_restore_opens_and_maps_only_its_leaves(tmp_path: Path) -> None:
    big = TensorDict(
        policy=TensorDict(weight=torch.randn(256, 256), bias=torch.randn(256)),
        replay=TensorDict(obs=torch.randn(1024, 1024), action=torch.randn(1024, 64)),
    )
    prefix = tmp_path / "ckpt"
    big.memmap(prefix)
    with Access(prefix) as seen:
        whole = tdckpt.load_memmap(prefix)
    whole_opened, whole_mapped = seen.leaves_opened(), sum(mapped_bytes(prefix).values())
    assert len(whole_opened) == 4 and whole_mapped >= 4 * MiB + 256 * 1024
    del whole
    assert mapped_bytes(prefix) == {}  # unmapped with the object

    with Access(prefix) as seen:
        part = tdckpt.load_memmap(prefix, keys="policy")
    assert seen.leaves_opened() == {"policy/weight.memmap", "policy/bias.memmap"}
    assert all(seen.opened[name] == 1 for name in seen.leaves_opened())  # each opened once
    mapped = mapped_bytes(prefix)
    assert set(mapped) == {"policy/weight.memmap", "policy/bias.memmap"}
    assert 256 * 1024 + 1024 <= sum(mapped.values()) <= 256 * 1024 + 2 * 4096 + 4096
    assert sum(mapped.values()) * 16 < whole_mapped
    assert torch.equal(part["policy", "weight"], big["policy", "weight"])
    del part

    # in place, through the manager: the same count
    with CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, big)
        step = tmp_path / "run" / "1"
        target = TensorDict(policy=TensorDict(weight=torch.zeros(256, 256), bias=torch.zeros(256)))
        with Access(step) as seen:
            mgr.restore_into(target, keys="policy.weight")
        assert seen.leaves_opened() == {"policy/weight.memmap"}
        assert set(mapped_bytes(step)) == {"policy/weight.memmap"}
        assert torch.equal(target["policy", "bias"], torch.zeros(256))


def test_object_storage_restores_a_training_state_in_part() -> None:
    import uuid

    root = f"memory://tdckpt-select-{uuid.uuid4().hex}"
    saved = _state()
    with CheckpointManager(root) as mgr:
        mgr.save(1, saved)
        state = _fresh()
        _, report = mgr.restore_into(state, keys="model", report=True)
        assert torch.equal(state["model"].weight, saved["model"].weight)
        assert state["optim"].state_dict()["state"] == {}
        assert {k[0] for k in report.loaded} == {"model"}
        assert {k[0] for k in report.skipped} == {"optim", "rng"}
        _, report = mgr.restore_into({"model": state["model"]}, keys="*", strict=False, report=True)
        assert report.unexpected == [("optim",), ("rng",)]
        with pytest.raises(RestoreError, match="name entries"):
            mgr.restore(1, keys="model.weight")
        with pytest.raises(RestoreError, match=r"no cuda device|not a torch device"):
            mgr.restore(1, keys="model", device="cuda" if not torch.cuda.is_available() else "x")
