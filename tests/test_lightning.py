"""``tdckpt.lightning.TdckptCheckpointIO`` under a real Lightning ``Trainer``.

Lightning's own warnings (dataloader workers, its pytree shim on this torch) are not
tdckpt's and are ignored here; every other warning is still an error.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import lightning
import pytest
import torch
from conftest import subprocess_env
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import tdckpt
from tdckpt.errors import IntegrityError, PickleNotAllowedError
from tdckpt.lightning import TdckptCheckpointIO

pytestmark = [
    pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:.*litlogger.*"),
    # resuming into the folder of the run it continues (Lightning warns; top-k needs it)
    pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty"),
]


class _Model(lightning.LightningModule):
    def __init__(self, lr: float = 0.1, extra: Any = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, _: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)]


def _data() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
    return DataLoader(ds, batch_size=16)


def _trainer(epochs: int, callbacks: list[Any], io: TdckptCheckpointIO | None) -> Any:
    return lightning.Trainer(
        max_epochs=epochs,
        plugins=[io] if io is not None else [],
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        enable_checkpointing=bool(callbacks),
        deterministic=True,
    )


def _fit(epochs: int, ckpt: Path | None, dirpath: Path, io: TdckptCheckpointIO) -> Any:
    torch.manual_seed(0)
    model = _Model()
    callback = ModelCheckpoint(dirpath=dirpath, monitor="val_loss", save_top_k=2, save_last=True)
    _trainer(epochs, [callback], io).fit(model, _data(), _data(), ckpt_path=ckpt)
    return model, callback


def test_top_k_and_resume_bit_exact(tmp_path: Path) -> None:
    io = TdckptCheckpointIO()
    _, callback = _fit(3, None, tmp_path / "ck", io)
    files = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert len(files) == 3 and "last.ckpt" in files  # top-2 + last: the third removed
    for name in files:
        path = tmp_path / "ck" / name
        assert path.is_file() and zipfile.is_zipfile(path)  # one file per checkpoint
        assert tdckpt.validate(path).ok  # ... that tdckpt reads like any checkpoint
    assert Path(callback.best_model_path).exists()
    # Resuming from last.ckpt to 5 epochs gives exactly an uninterrupted 5-epoch run.
    resumed, _ = _fit(5, tmp_path / "ck" / "last.ckpt", tmp_path / "ck", io)
    straight, _ = _fit(5, None, tmp_path / "ck3", io)
    for (name, a), (_, b) in zip(
        resumed.state_dict().items(), straight.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_the_saved_dict_comes_back_exactly(tmp_path: Path) -> None:
    io = TdckptCheckpointIO(archive=False)
    checkpoint = {
        "epoch": 3,
        "global_step": 12,
        "state_dict": {"net.weight": torch.randn(2, 2), "net.bias": torch.zeros(2)},
        "optimizer_states": [
            {
                "state": {0: {"step": torch.tensor(3.0)}},
                "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0, 1]}],
            }
        ],
        "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 3}}}},
        "hyper_parameters": {"lr": float("inf"), "layers": [1, 2]},
    }
    path = tmp_path / "x.ckpt"
    io.save_checkpoint(checkpoint, path)
    assert path.is_dir() and tdckpt.inspect(path).manifest["user_metadata"] == {  # type: ignore[index]
        "epoch": 3,
        "global_step": 12,
    }
    back = io.load_checkpoint(path)
    assert back.keys() == checkpoint.keys()
    assert back["optimizer_states"][0]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert list(back["optimizer_states"][0]["state"]) == [0]  # an int key stays an int
    assert back["hyper_parameters"] == {"lr": float("inf"), "layers": [1, 2]}
    assert torch.equal(back["state_dict"]["net.weight"], checkpoint["state_dict"]["net.weight"])
    io.remove_checkpoint(path)
    assert not path.exists()


def test_a_flipped_byte_is_refused_before_lightning_sees_it(tmp_path: Path) -> None:
    io = TdckptCheckpointIO()
    path = tmp_path / "x.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.arange(64.0)}}, path)
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo("lightning/state_dict.w.memmap")
    raw = bytearray(path.read_bytes())
    at = info.header_offset
    name_len = int.from_bytes(raw[at + 26 : at + 28], "little")
    extra_len = int.from_bytes(raw[at + 28 : at + 30], "little")
    raw[at + 30 + name_len + extra_len + 5] ^= 1  # a byte of the leaf's payload
    path.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match=r"(?s)x\.ckpt: 1 file\(s\) differ.*state_dict\.w"):
        io.load_checkpoint(path)
    assert TdckptCheckpointIO(verify=False).load_checkpoint(path)["state_dict"]["w"][1] != 1.0


def test_pickles_follow_weights_only(tmp_path: Path) -> None:
    io = TdckptCheckpointIO()
    path = tmp_path / "x.ckpt"
    namespace = argparse.Namespace(lr=0.1)  # not data: stored as a pickle
    io.save_checkpoint({"hyper_parameters": namespace, "state_dict": {}}, path)
    with pytest.raises(PickleNotAllowedError):
        io.load_checkpoint(path)  # weights_only=None: the plug-in's allow_pickle (False)
    with pytest.raises(PickleNotAllowedError):
        io.load_checkpoint(path, weights_only=True)
    assert io.load_checkpoint(path, weights_only=False)["hyper_parameters"] == namespace
    assert (
        TdckptCheckpointIO(allow_pickle=True).load_checkpoint(path)["hyper_parameters"] == namespace
    )


def test_refusals(tmp_path: Path) -> None:
    io = TdckptCheckpointIO()
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint({}, tmp_path / "x.ckpt", storage_options={"a": 1})
    io.save_checkpoint({"state_dict": {}}, tmp_path / "x.ckpt")
    with pytest.raises(TypeError, match="map_location"):
        io.load_checkpoint(tmp_path / "x.ckpt", map_location=lambda s, loc: s)
    with pytest.raises(FileNotFoundError):
        io.load_checkpoint(tmp_path / "absent.ckpt")
    # A crash mid-save leaves the old checkpoint under the name: the new one is staged beside.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.ckpt"]
    # A URL is refused, not written to a local folder named after its scheme ("./s3:/...").
    for url in ("s3://bucket/run/epoch=0.ckpt", "memory://b/x.ckpt"):
        with pytest.raises(ValueError, match=r"is a URL; TdckptCheckpointIO writes"):
            io.save_checkpoint({"state_dict": {}}, url)
        with pytest.raises(ValueError, match=r"is a URL"):
            io.load_checkpoint(url)
    assert not Path("s3:").exists() and not Path("memory:").exists()
    with pytest.raises(TypeError, match="checkpoint dict, not list"):
        io.save_checkpoint([1, 2], tmp_path / "y.ckpt")  # type: ignore[arg-type]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.ckpt"]


@pytest.mark.parametrize("archive", [True, False])
def test_resume_from_last_ckpt_that_is_a_link(tmp_path: Path, archive: bool) -> None:
    """``ModelCheckpoint(save_last="link")`` makes last.ckpt a symlink to the newest
    checkpoint; ``fit(ckpt_path="last")`` loads through it. Before, the link was verified as
    if it were the checkpoint itself: a raw NotADirectoryError (archive) or an
    IntegrityError listing intact files (folder), so such a run could never resume."""
    io = TdckptCheckpointIO(archive=archive)
    dirpath = tmp_path / "ck"

    def fit(epochs: int, ckpt: str | None) -> Any:
        torch.manual_seed(0)
        model = _Model()
        callback = ModelCheckpoint(dirpath=dirpath, save_top_k=1, save_last="link")
        _trainer(epochs, [callback], io).fit(model, _data(), _data(), ckpt_path=ckpt)
        return model

    fit(2, None)
    assert (dirpath / "last.ckpt").is_symlink()
    resumed = fit(3, "last")
    torch.manual_seed(0)
    straight = _Model()
    _trainer(3, [], None).fit(straight, _data(), _data())
    for (name, a), (_, b) in zip(
        resumed.state_dict().items(), straight.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_import_tdckpt_does_not_import_lightning() -> None:
    code = (
        "import sys, tdckpt; print('lightning' in sys.modules, 'pytorch_lightning' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        check=True,
        timeout=120,
    )
    assert out.stdout.split() == ["False", "False"], out.stderr
