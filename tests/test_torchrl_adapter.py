"""``tdckpt.torchrl.TdckptAdapter`` under TorchRL's own ``torchrl.checkpoint.Checkpoint``.

Real torchrl 0.14.1 objects: a policy (a ``TensorDictModule``), an optimizer,
``GlobalRNGState`` and a ``ReplayBuffer`` on ``LazyMemmapStorage``. torchrl is not a
dependency of the default test environment: these tests run in the ``tests-0.14`` nox
session (torchrl pins ``tensordict<0.15``) and skip elsewhere.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

checkpoint_api = pytest.importorskip("torchrl.checkpoint", reason="torchrl: the tests-0.14 session")

from tensordict import TensorDict  # noqa: E402
from tensordict.nn import TensorDictModule  # noqa: E402
from torchrl.checkpoint import Checkpoint, CheckpointError, GlobalRNGState  # noqa: E402
from torchrl.data import LazyMemmapStorage, ReplayBuffer  # noqa: E402

import tdckpt  # noqa: E402
from tdckpt.errors import IntegrityError, PickleNotAllowedError, RestoreError  # noqa: E402
from tdckpt.torchrl import ADAPTER_ID, PAYLOAD, TdckptAdapter, use_tdckpt  # noqa: E402


def _policy(seed: int, hidden: int = 8) -> TensorDictModule:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(
        torch.nn.Linear(3, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 2)
    )
    return TensorDictModule(net, in_keys=["obs"], out_keys=["action"])


def _transitions(n: int, seed: int) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    return TensorDict(
        {
            "obs": torch.randn(n, 3, generator=g),
            "target": torch.randn(n, 2, generator=g),
            "next": {"reward": torch.randn(n, 1, generator=g)},
        },
        batch_size=[n],
    )


class _Run:
    """A small off-policy training loop: a policy, Adam, a buffer, the global RNGs."""

    def __init__(self, tmp: Path, name: str, seed: int) -> None:
        self.policy = _policy(seed)
        self.optim = torch.optim.Adam(self.policy.parameters(), lr=1e-2)
        self.buffer = ReplayBuffer(
            storage=LazyMemmapStorage(64, scratch_dir=tmp / f"scratch-{name}"), batch_size=8
        )
        self.rng = GlobalRNGState()

    def checkpoint(self) -> Checkpoint:
        ckpt = Checkpoint(policy=self.policy, optim=self.optim, rng=self.rng, buffer=self.buffer)
        return use_tdckpt(ckpt)

    def step(self, i: int) -> None:
        self.buffer.extend(_transitions(4, seed=100 + i))
        batch = self.buffer.sample()  # the global torch RNG picks the rows
        out = self.policy(batch.clone())
        loss = ((out["action"] - batch["target"]) ** 2).mean() + torch.randn(()) * 1e-3
        self.optim.zero_grad()
        loss.backward()
        self.optim.step()


def _state(run: _Run) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in run.policy.state_dict().items()}


def _component(root: Path, name: str) -> Path:
    manifest = json.loads((root / "manifest.json").read_text())
    return root / manifest["components"][name]["path"]


def _leaf(root: Path, name: str) -> Path:
    payload = _component(root, name) / PAYLOAD
    return max(payload.rglob("*.memmap"), key=lambda p: p.stat().st_size)


def test_components_are_tdckpt_checkpoints(tmp_path: Path) -> None:
    run = _Run(tmp_path, "a", seed=0)
    run.step(0)
    root = run.checkpoint().save(tmp_path / "ckpt")
    manifest = json.loads((root / "manifest.json").read_text())
    adapters = {name: rec["adapter"] for name, rec in manifest["components"].items()}
    assert adapters == {
        "policy": ADAPTER_ID,
        "optim": ADAPTER_ID,
        "rng": ADAPTER_ID,
        "buffer": "torchrl.dump_load",  # replay buffers keep TorchRL's dump/load
    }
    for name in ("policy", "optim", "rng"):
        payload = _component(root, name) / PAYLOAD
        report = tdckpt.validate(payload)
        assert report.ok, report.problems
        # TorchRL's file inventory lists the payload's files, tdckpt's manifest among them
        files = manifest["components"][name]["files"]
        assert f"{PAYLOAD}/tdckpt.manifest.json" in files
        saved = json.loads((payload / "tdckpt.manifest.json").read_text())
        assert all(rec["checksum"] for rec in saved["files"])
        assert saved["state"]["entries"]["component"]["kind"] in ("module", "optimizer", "stateful")


@pytest.mark.parametrize("fmt", ["directory", "archive"])
def test_exact_resume(tmp_path: Path, fmt: str) -> None:
    torch.manual_seed(1234)
    full = _Run(tmp_path, "full", seed=0)
    for i in range(3):
        full.step(i)
    path = full.checkpoint().save(tmp_path / "ckpt", format=fmt)
    for i in range(3, 6):
        full.step(i)
    full_next = torch.randn(4)

    torch.manual_seed(999)  # a different RNG state and different weights: the load must fix both
    resumed = _Run(tmp_path, "resumed", seed=7)
    result = resumed.checkpoint().load(path)
    assert result.loaded == {"policy", "optim", "rng", "buffer"}
    assert len(resumed.buffer) == 12
    for i in range(3, 6):
        resumed.step(i)
    final, again = _state(full), _state(resumed)
    assert final.keys() == again.keys()
    for key in final:
        assert torch.equal(final[key], again[key]), key
    # the global RNG was restored too: both runs draw the same numbers from here on
    assert torch.equal(torch.randn(4), full_next)


def test_parameters_keep_their_identity(tmp_path: Path) -> None:
    source = _Run(tmp_path, "s", seed=0)
    source.step(0)
    path = source.checkpoint().save(tmp_path / "ckpt", components=["policy", "optim"])
    target = _Run(tmp_path, "t", seed=5)
    params = list(target.policy.parameters())
    target.checkpoint().load(path, components=["policy", "optim"])
    assert list(target.policy.parameters()) == params  # the optimizer still holds them
    assert target.optim.param_groups[0]["params"] == params
    for (k, v), w in zip(
        source.policy.state_dict().items(), target.policy.state_dict().values(), strict=True
    ):
        assert torch.equal(v, w), k


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_component_leaves_the_live_object_unchanged(tmp_path: Path, damage: str) -> None:
    source = _Run(tmp_path, "s", seed=0)
    root = source.checkpoint().save(tmp_path / "ckpt", components=["policy"])
    leaf = _leaf(root, "policy")
    data = bytearray(leaf.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    else:
        del data[-4:]
    leaf.write_bytes(bytes(data))

    target = _Run(tmp_path, "t", seed=5)
    before = _state(target)
    with pytest.raises(CheckpointError, match="'policy'") as caught:
        target.checkpoint().load(root, components=["policy"])
    cause = caught.value.__cause__
    assert isinstance(cause, IntegrityError)
    assert "component 'policy'" in str(cause)
    assert leaf.name in str(cause)
    after = _state(target)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_damaged_archive_member_is_refused(tmp_path: Path) -> None:
    source = _Run(tmp_path, "s", seed=0)
    root = source.checkpoint().save(tmp_path / "ckpt.zip", components=["policy"], format="archive")
    damaged = tmp_path / "damaged.zip"
    with zipfile.ZipFile(root) as src, zipfile.ZipFile(damaged, "w") as dst:
        names = [n for n in src.namelist() if n.endswith(".memmap")]
        for info in src.infolist():
            data = src.read(info)
            if info.filename == names[0]:
                data = bytes([data[0] ^ 0xFF]) + data[1:]
            dst.writestr(info, data)
    target = _Run(tmp_path, "t", seed=5)
    before = _state(target)
    with pytest.raises(CheckpointError) as caught:
        target.checkpoint().load(damaged, components=["policy"])
    assert isinstance(caught.value.__cause__, IntegrityError)
    after = _state(target)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_mismatched_policy_is_refused_before_any_change(tmp_path: Path) -> None:
    source = _Run(tmp_path, "s", seed=0)
    root = source.checkpoint().save(tmp_path / "ckpt", components=["policy", "optim"])
    wider = _policy(3, hidden=16)
    before = {k: v.clone() for k, v in wider.state_dict().items()}
    ckpt = use_tdckpt(Checkpoint(policy=wider))
    with pytest.raises(CheckpointError) as caught:
        ckpt.load(root, components=["policy"])
    cause = caught.value.__cause__
    assert isinstance(cause, RestoreError) and not isinstance(cause, IntegrityError)
    assert "component 'policy'" in str(cause) and "[16, 3]" in str(cause)
    assert all(torch.equal(before[k], v) for k, v in wider.state_dict().items())


class _Counter:
    """A stateful component whose state holds a value that is not JSON data."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


def test_pickles_load_only_when_allowed(tmp_path: Path) -> None:
    path = (
        Checkpoint()
        .register("thing", _Counter(complex(1, 2)), adapter=TdckptAdapter())
        .save(tmp_path / "ckpt")
    )
    target = _Counter(None)
    ckpt = Checkpoint().register("thing", target, adapter=TdckptAdapter())
    with pytest.raises(CheckpointError) as caught:
        ckpt.load(path)
    assert isinstance(caught.value.__cause__, PickleNotAllowedError)
    assert target.value is None
    ckpt.load(path, tensor_load_kwargs={"weights_only": False})
    assert target.value == complex(1, 2)
    allowed = _Counter(None)
    Checkpoint().register("thing", allowed, adapter=TdckptAdapter(allow_pickle=True)).load(path)
    assert allowed.value == complex(1, 2)


def test_unsupported_options_are_refused(tmp_path: Path) -> None:
    policy = _policy(0)
    ckpt = Checkpoint().register("policy", policy, adapter=TdckptAdapter())
    path = ckpt.save(tmp_path / "ckpt")
    with pytest.raises(CheckpointError) as caught:
        ckpt.load(path, map_location=lambda storage, _: storage)
    assert isinstance(caught.value.__cause__, TypeError)
    with pytest.raises(CheckpointError) as caught:
        ckpt.load(path, tensor_load_kwargs={"map_location": "cpu"})
    assert "torch.load options" in str(caught.value.__cause__)
    ckpt.load(path, map_location="cpu")


def test_a_tensordict_component_is_restored_in_place(tmp_path: Path) -> None:
    data = _transitions(5, seed=0)
    path = use_tdckpt(Checkpoint(data=data)).save(tmp_path / "ckpt")
    target = _transitions(5, seed=1)
    ckpt = use_tdckpt(Checkpoint(data=target))
    ckpt.load(path)
    assert ckpt.components["data"] is target
    assert (target == data).all()


@pytest.mark.parametrize("fmt", ["directory", "archive"])
def test_save_makes_the_whole_checkpoint_durable(
    tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    from tdckpt.torchrl import save

    run = _Run(tmp_path, "a", seed=0)
    run.step(0)
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:  # records what is synced, then syncs it
        synced.append(os.path.realpath(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    path = save(run.checkpoint(), tmp_path / "ckpt", format=fmt)
    monkeypatch.undo()
    assert path == (tmp_path / "ckpt").absolute()
    everything = [path] if fmt == "archive" else [*path.rglob("*"), path]
    assert {os.path.realpath(p) for p in everything} <= set(synced)  # manifest.json included
    assert os.path.realpath(tmp_path) in synced  # the rename into place
    resumed = _Run(tmp_path, "b", seed=3)
    assert resumed.checkpoint().load(path).loaded == {"policy", "optim", "rng", "buffer"}


def test_errors_name_the_file_inside_the_archive_not_a_temporary_folder(tmp_path: Path) -> None:
    source = _Run(tmp_path, "s", seed=0)
    root = source.checkpoint().save(tmp_path / "ckpt.zip", components=["policy"], format="archive")
    damaged = tmp_path / "damaged.zip"
    with zipfile.ZipFile(root) as src, zipfile.ZipFile(damaged, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith(".memmap"):
                data = data[:-4]
            dst.writestr(info, data)
    with pytest.raises(CheckpointError) as caught:
        _Run(tmp_path, "t", seed=5).checkpoint().load(damaged, components=["policy"])
    message = str(caught.value.__cause__)
    assert "component 'policy' (components/0000-policy/tdckpt)" in message
    assert "torchrl-checkpoint-load-" not in message
