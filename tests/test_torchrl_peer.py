"""The TorchRL peer-run tools of tests/peer/: the adapter plugin and its runner script.

``tdckpt_torchrl_peer`` must give the state-dict components TorchRL would give its inferred
default adapter tdckpt's ``TdckptAdapter`` (and leave explicit adapters alone), and put
TorchRL's resolution back; ``run_torchrl_peer.py`` must refuse a file that is not TorchRL's
``test_checkpoint.py`` or lies inside this repository. Runs in the ``tests-0.14`` session.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchrl.checkpoint", reason="torchrl: the tests-0.14 session")

from torchrl.checkpoint import Checkpoint, StateDictCheckpointAdapter

from tdckpt.torchrl import ADAPTER_ID, TdckptAdapter

PEER = Path(__file__).resolve().parent / "peer"
sys.path.insert(0, str(PEER))
import run_torchrl_peer  # noqa: E402
import tdckpt_torchrl_peer  # noqa: E402


def test_the_plugin_routes_only_the_inferred_default(tmp_path: Path) -> None:
    explicit = StateDictCheckpointAdapter()
    tdckpt_torchrl_peer.install()
    try:
        ckpt = Checkpoint(policy=torch.nn.Linear(2, 2), config={"lr": 0.1})
        ckpt.register("kept", torch.nn.Linear(2, 2), adapter=explicit)
        path = ckpt.save(tmp_path / "ckpt")
        adapters = {n: r["adapter"] for n, r in Checkpoint.manifest(path)["components"].items()}
        assert adapters == {
            "policy": ADAPTER_ID,
            "config": "torchrl.json",
            "kept": "torchrl.state_dict",
        }
    finally:
        tdckpt_torchrl_peer.uninstall()
    plain = Checkpoint(policy=torch.nn.Linear(2, 2))
    resolved = plain._resolve_adapter(plain._components["policy"])
    assert type(resolved) is StateDictCheckpointAdapter and not isinstance(resolved, TdckptAdapter)


def test_the_runner_refuses_a_wrong_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(run_torchrl_peer.PeerError, match="not a file named"):
        run_torchrl_peer.check_test_file(tmp_path / "test_other.py")
    other = tmp_path / "rl" / "test" / "test_checkpoint.py"
    other.parent.mkdir(parents=True)
    other.write_text("")
    assert run_torchrl_peer.check_test_file(other) == other.resolve()
    monkeypatch.setattr(run_torchrl_peer, "REPO_ROOT", tmp_path.resolve())  # as if it were ours
    with pytest.raises(run_torchrl_peer.PeerError, match="inside this repository"):
        run_torchrl_peer.check_test_file(other)
    assert run_torchrl_peer.main([str(other)]) == 2
