"""tdckpt reads checkpoints written by plain TorchRL (``torchrl.checkpoint.Checkpoint``).

``check_torchrl_checkpoint`` and ``tdckpt inspect`` / ``validate`` of such a checkpoint, a
directory or a zip archive: every listed file present, every tensordict payload valid by
tdckpt's reader, ``torch.save`` payloads and pickles reported, a component written by
``TdckptAdapter`` verified against its checksums. Runs in the ``tests-0.14`` session.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torchrl.checkpoint", reason="torchrl: the tests-0.14 session")

from tensordict import TensorDict
from torchrl.checkpoint import (
    Checkpoint,
    CheckpointError,
    GlobalRNGState,
    StateDictCheckpointAdapter,
)
from torchrl.data import LazyMemmapStorage, ReplayBuffer

import tdckpt
from tdckpt._interop.torchrl_checkpoint import (
    check_torchrl_checkpoint,
    is_torchrl_checkpoint,
)
from tdckpt.cli import EXIT_OK, EXIT_PROBLEM, main
from tdckpt.torchrl import TdckptAdapter


def _checkpoint(tmp: Path) -> Checkpoint:
    torch.manual_seed(0)
    policy = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    optim = torch.optim.Adam(policy.parameters())
    policy(torch.randn(2, 3)).sum().backward()
    optim.step()
    buffer = ReplayBuffer(storage=LazyMemmapStorage(8, scratch_dir=tmp / "scratch"))
    buffer.extend(TensorDict(obs=torch.randn(5, 3), batch_size=[5]))
    ckpt = Checkpoint(policy=policy, rng=GlobalRNGState(), buffer=buffer, config={"lr": 0.1})
    ckpt.register("optim", optim, adapter=StateDictCheckpointAdapter(payload_format="torch"))
    ckpt.register("durable", torch.nn.Linear(2, 2), adapter=TdckptAdapter())
    return ckpt


def _components(root: Path) -> dict[str, Any]:
    components: dict[str, Any] = json.loads((root / "manifest.json").read_text())["components"]
    return components


@pytest.mark.parametrize("fmt", ["directory", "archive"])
def test_a_plain_torchrl_checkpoint_is_valid(tmp_path: Path, fmt: str) -> None:
    path = _checkpoint(tmp_path).save(tmp_path / "ckpt", format=fmt)
    assert is_torchrl_checkpoint(path)
    report = check_torchrl_checkpoint(path)
    assert report.ok, [str(p) for p in report.errors]
    assert report.container == fmt
    comps = {c.name: c for c in report.components}
    assert set(comps) == {"policy", "rng", "buffer", "config", "optim", "durable"}
    assert comps["policy"].tensordicts and comps["policy"].leaves == 4
    assert comps["buffer"].leaves == 1  # the storage's "obs"
    assert comps["durable"].verified
    assert [Path(p).name for p in comps["optim"].pickles] == ["state.pt"]
    pickles = {p.path for p in report.problems if p.code == "pickle"}
    assert any(p.endswith("state.pt") for p in pickles)
    assert all(p.severity == "info" for p in report.problems if p.code == "pickle")


def test_a_plain_torchrl_payload_restores_through_tdckpt(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path)
    path = ckpt.save(tmp_path / "ckpt")
    state_dir = path / _components(path)["policy"]["path"] / "state"
    td = tdckpt.load_memmap(state_dir, allow_pickle=False)
    saved = sorted(td.flatten_keys().values(), key=lambda t: t.numel())
    live = sorted(ckpt.components["policy"].state_dict().values(), key=lambda t: t.numel())
    assert all(torch.equal(a, b) for a, b in zip(saved, live, strict=True))


def test_a_truncated_or_missing_file_is_reported(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path).save(tmp_path / "ckpt")
    comps = _components(path)
    policy = path / comps["policy"]["path"]
    leaf = max(policy.rglob("*.memmap"), key=lambda p: p.stat().st_size)
    leaf.write_bytes(leaf.read_bytes()[:-4])
    (path / comps["config"]["path"] / comps["config"]["files"][0]).unlink()
    report = check_torchrl_checkpoint(path)
    assert not report.ok
    errors = {(p.code, p.path) for p in report.errors}
    short = [e for e in report.errors if e.path.endswith(leaf.name)]
    assert short and all("component 'policy'" in e.message for e in short)
    assert ("missing-file", f"{comps['config']['path']}/{comps['config']['files'][0]}") in errors


def test_a_flipped_byte_in_a_tdckpt_component_is_found(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path).save(tmp_path / "ckpt")
    comp = path / _components(path)["durable"]["path"]
    leaf = max(comp.rglob("*.memmap"), key=lambda p: p.stat().st_size)
    data = bytearray(leaf.read_bytes())
    data[0] ^= 0x10
    leaf.write_bytes(bytes(data))
    report = check_torchrl_checkpoint(path)
    (error,) = report.errors
    assert error.code == "checksum-changed" and error.path.endswith(leaf.name)
    assert "component 'durable'" in error.message


def test_cli_inspect_and_validate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _checkpoint(tmp_path).save(tmp_path / "ckpt")
    assert main(["inspect", str(path)]) == EXIT_OK
    out = capsys.readouterr().out
    assert out.startswith(f"torchrl checkpoint {path} (directory;")
    assert "  policy  torchrl.state_dict  (" in out and "checksums verified" in out
    assert main(["validate", str(path)]) == EXIT_OK
    out = capsys.readouterr().out
    assert "state.pt: component 'optim': a torch.save payload" in out
    assert out.rstrip().endswith(": ok, 0 warning(s)")
    assert main(["validate", "--json", str(path)]) == EXIT_OK
    data = json.loads(capsys.readouterr().out)
    assert data["format"] == "torchrl.checkpoint" and data["ok"] is True

    comps = _components(path)
    leaf = next((path / comps["policy"]["path"]).rglob("*.memmap"))
    leaf.write_bytes(b"")
    assert main(["validate", str(path)]) == EXIT_PROBLEM
    captured = capsys.readouterr()
    assert leaf.name in captured.out and "component 'policy'" in captured.out
    assert "error(s) in the TorchRL checkpoint" in captured.err


def test_an_archive_too_large_to_unpack_is_not_unpacked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _checkpoint(tmp_path).save(tmp_path / "ckpt", format="archive")
    import shutil

    from tdckpt._interop import torchrl_checkpoint

    # a disk with 100 bytes free: no component may be unpacked to be checked
    monkeypatch.setattr(
        torchrl_checkpoint.shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(100, 0, 100)
    )
    report = check_torchrl_checkpoint(path)
    assert {p.code for p in report.errors} == {"too-large"}
    errors = {p.path for p in report.errors}
    comps = _components_of_archive(path)
    assert comps["policy"]["path"] in errors and comps["durable"]["path"] in errors
    assert all(c.files == 0 for c in report.components if c.path in errors)


def _components_of_archive(path: Path) -> dict[str, Any]:
    import zipfile

    with zipfile.ZipFile(path) as archive:
        components: dict[str, Any] = json.loads(archive.read("manifest.json"))["components"]
    return components


def test_ls_and_verify_of_a_rotation_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from torchrl.checkpoint import CheckpointRotation

    ckpt = _checkpoint(tmp_path)
    rotation = CheckpointRotation(tmp_path / "rot", keep_last=2)
    for step in (1, 2, 3):
        rotation.save(ckpt, step=step, metadata={"reward": float(step)})
    before = sorted(p.name for p in (tmp_path / "rot").iterdir())
    assert main(["ls", str(tmp_path / "rot")]) == EXIT_OK
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["step", "format", "size"]
    assert [line.split()[0] for line in lines[1:]] == ["2", "3"]  # keep_last=2 pruned step 1
    assert "buffer,config,durable,optim,policy,rng" in lines[2] and '"reward": 3.0' in lines[2]
    assert main(["ls", "--json", str(tmp_path / "rot")]) == EXIT_OK
    assert [e["step"] for e in json.loads(capsys.readouterr().out)] == [2, 3]

    assert main(["verify", str(tmp_path / "rot")]) == EXIT_OK  # the latest step
    assert "checkpoint-000000000003" in capsys.readouterr().out
    latest = rotation.latest()
    assert latest is not None
    comp = latest / _components(latest)["durable"]["path"]
    leaf = max(comp.rglob("*.memmap"), key=lambda p: p.stat().st_size)
    data = bytearray(leaf.read_bytes())
    data[0] ^= 0x01
    leaf.write_bytes(bytes(data))
    assert main(["verify", str(tmp_path / "rot")]) == EXIT_PROBLEM
    captured = capsys.readouterr()
    assert "checksum-changed" not in captured.err and leaf.name in captured.out
    assert main(["verify", str(tmp_path / "rot"), "--step", "2"]) == EXIT_OK
    capsys.readouterr()
    assert main(["verify", str(tmp_path / "rot"), "--step", "7"]) == EXIT_PROBLEM
    assert "no TorchRL checkpoint of step 7" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "rot").iterdir()) == before  # nothing written


def _plain(tmp: Path, hidden: int = 4, seed: int = 0) -> Checkpoint:
    torch.manual_seed(seed)
    policy = torch.nn.Sequential(
        torch.nn.Linear(3, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 2)
    )
    optim = torch.optim.Adam(policy.parameters())
    policy(torch.randn(2, 3)).sum().backward()
    optim.step()
    return Checkpoint(policy=policy, optim=optim, rng=GlobalRNGState())


def _checked(ckpt: Checkpoint, **kwargs: Any) -> Checkpoint:
    from tdckpt.torchrl import CheckedStateDictAdapter

    return ckpt.register_adapter(object, CheckedStateDictAdapter(**kwargs))


def test_a_plain_torchrl_checkpoint_is_restored_checked(tmp_path: Path) -> None:
    source = _plain(tmp_path, seed=0)
    path = source.save(tmp_path / "ckpt")  # plain TorchRL: no tdckpt anywhere
    expected = torch.randn(3)
    target = _checked(_plain(tmp_path, seed=1))
    assert target.load(path).loaded == {"policy", "optim", "rng"}
    assert torch.equal(torch.randn(3), expected)
    for a, b in zip(
        source.components["policy"].parameters(),
        target.components["policy"].parameters(),
        strict=True,
    ):
        assert torch.equal(a, b)
    # and what it writes, plain TorchRL reads
    again = _checked(_plain(tmp_path, seed=2)).save(tmp_path / "again")
    assert _plain(tmp_path, seed=3).load(again).loaded == {"policy", "optim", "rng"}


def test_a_truncated_or_mismatched_plain_checkpoint_changes_nothing(tmp_path: Path) -> None:
    from tdckpt.errors import PickleNotAllowedError, RestoreError, TdckptError

    path = _plain(tmp_path, seed=0).save(tmp_path / "ckpt")
    wider = _checked(Checkpoint(policy=_plain(tmp_path, hidden=8, seed=1).components["policy"]))
    before = [p.clone() for p in wider.components["policy"].parameters()]
    with pytest.raises(CheckpointError) as caught:  # torch would copy what fits, then raise
        wider.load(path, components=["policy"])
    assert isinstance(caught.value.__cause__, RestoreError)
    assert "0.weight: the target has float32[8, 3], the step float32[4, 3]" in str(caught.value)
    assert all(
        torch.equal(a, b)
        for a, b in zip(before, wider.components["policy"].parameters(), strict=True)
    )

    leaf = max(
        (path / _components(path)["policy"]["path"]).rglob("*.memmap"),
        key=lambda p: p.stat().st_size,
    )
    leaf.write_bytes(leaf.read_bytes()[:-4])
    target = _checked(_plain(tmp_path, seed=1))
    before = [p.clone() for p in target.components["policy"].parameters()]
    with pytest.raises(CheckpointError) as caught:
        target.load(path, components=["policy"])
    assert isinstance(caught.value.__cause__, TdckptError) and leaf.name in str(caught.value)
    assert all(
        torch.equal(a, b)
        for a, b in zip(before, target.components["policy"].parameters(), strict=True)
    )

    torch_path = (
        Checkpoint()
        .register(
            "policy",
            torch.nn.Linear(2, 2),
            adapter=StateDictCheckpointAdapter(payload_format="torch"),
        )
        .save(tmp_path / "pt")
    )
    with pytest.raises(CheckpointError) as caught:
        _checked(Checkpoint(policy=torch.nn.Linear(2, 2))).load(torch_path)
    assert isinstance(caught.value.__cause__, PickleNotAllowedError)
    assert _checked(Checkpoint(policy=torch.nn.Linear(2, 2)), allow_pickle=True).load(
        torch_path
    ).loaded == {"policy"}
