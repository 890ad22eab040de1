"""A whole training state through the manager: modules, optimizers, schedulers, generators."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _direct_io import o_direct_works
from tensordict import TensorDict

import tdckpt
from tdckpt import CheckpointManager, RandomState
from tdckpt._state import to_state_dicts, to_tensordict
from tdckpt.errors import RestoreError, UnsupportedContentError
from tdckpt.schema import MANIFEST_NAME

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def child_env() -> dict[str, str]:
    """This checkout's tdckpt (not an installed one) in child processes."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TESTS)])
    return env


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
        self.head = torch.nn.Linear(4, 10)
        self.head.weight = self.emb.weight  # tied
        self.register_buffer("scale", torch.tensor(2.0))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(x))) * self.scale


def trained(steps: int = 3, seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = Tied()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randint(0, 10, (8,))).square().mean().backward()
        opt.step()
        sched.step()
    return {"model": model, "optim": opt, "sched": sched, "rng": RandomState()}


def fresh(seed: int = 7) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = Tied()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return {"model": model, "optim": opt, "sched": sched, "rng": RandomState()}


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Equal values of equal types, recursively (tensors: dtype, shape and bits)."""
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and a != a:
        assert b != b, path
    else:
        assert a == b, path


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    import copy

    return {
        "model": {k: v.clone() for k, v in state["model"].state_dict().items()},
        "optim": copy.deepcopy(state["optim"].state_dict()),
        "sched": copy.deepcopy(state["sched"].state_dict()),
    }


# -- save and restore ------------------------------------------------------------------------


def test_round_trip_in_place(tmp_path: Path) -> None:
    state = trained()
    expected = snapshot(state)
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(3, state, metadata={"loss": 0.5})
        target = fresh()
        params = list(target["model"].parameters())
        assert mgr.restore_into(target) is target
    got = snapshot(target)
    assert_same(got["model"], expected["model"])
    assert_same(got["optim"], expected["optim"])
    assert_same(got["sched"], expected["sched"])
    # In place: the same parameter objects (the optimizer still refers to them), still tied.
    assert list(target["model"].parameters()) == params
    assert target["model"].head.weight is target["model"].emb.weight
    assert target["optim"].param_groups[0]["params"] == params
    # Adam's step counts stay tensors.
    assert isinstance(target["optim"].state_dict()["state"][0]["step"], torch.Tensor)


def test_training_continues_identically_after_restore(tmp_path: Path) -> None:
    state = trained()
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(3, state)
        target = fresh()
        mgr.restore_into(target)
    for s in (state, target):  # one more step each, from the same restored generators
        s["rng"].load_state_dict(state["rng"].state_dict())
    for s in (state, target):
        torch.manual_seed(5)
        s["optim"].zero_grad()
        s["model"](torch.randint(0, 10, (8,))).square().mean().backward()
        s["optim"].step()
        s["sched"].step()
    assert_same(snapshot(target), snapshot(state))


def test_step_is_plain_tensordict_and_manifest_records_kinds(tmp_path: Path) -> None:
    state = trained()
    state["extra"] = TensorDict(a=torch.arange(3))
    with CheckpointManager(tmp_path) as mgr:
        path = mgr.save(3, state)
    loaded = TensorDict.load_memmap(path)
    assert set(loaded.keys()) == {"model", "optim", "sched", "rng", "extra"}
    # Tied weights are saved once.
    model_keys = set(loaded["model"].keys())
    assert "emb.weight" in model_keys and "head.weight" not in model_keys
    assert torch.equal(loaded["model", "emb.weight"], state["model"].emb.weight.detach())
    assert torch.equal(
        loaded["optim", "state.0.exp_avg"],
        state["optim"].state[state["model"].emb.weight]["exp_avg"],
    )
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    kinds = {k: v["kind"] for k, v in manifest["state"]["entries"].items()}
    assert kinds == {
        "model": "module",
        "optim": "optimizer",
        "sched": "scheduler",
        "rng": "rng",
        "extra": "tensordict",
    }
    assert manifest["state"]["entries"]["optim"]["type"] == "torch.optim.adam:Adam"
    assert manifest["pickles"] == []  # everything is tensors and JSON data
    # param_groups are JSON non-tensor data in meta.json (betas a tuple, params int ids).
    meta = json.loads((path / "optim" / "__state__" / "meta.json").read_text())
    assert "param_groups" in json.dumps(meta["data"])


def test_restore_returns_a_tensordict_and_state_dicts(tmp_path: Path) -> None:
    state = trained()
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(3, state)
        td = mgr.restore(3)
        manifest_state = mgr._resolve(3)[2].state
    assert isinstance(td, TensorDict)
    sds = to_state_dicts(td, manifest_state)
    assert_same(sds["optim"], state["optim"].state_dict())
    assert_same(dict(sds["sched"]), state["sched"].state_dict())
    model_sd = state["model"].state_dict()
    assert list(sds["model"]) == list(model_sd)
    for k in model_sd:
        assert torch.equal(sds["model"][k], model_sd[k]), k
    # Without the manifest record too.
    assert list(to_state_dicts(td)["model"]) == list(model_sd)


def test_verify_covers_every_file_of_a_state_step(tmp_path: Path) -> None:
    state = trained()
    with CheckpointManager(tmp_path) as mgr:
        path = mgr.save(3, state)
        manifest = json.loads((path / MANIFEST_NAME).read_text())
        listed = {f["path"] for f in manifest["files"]}
        on_disk = {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()} - {
            MANIFEST_NAME
        }
        assert listed == on_disk
        assert mgr.verify(3).ok
        # A flipped byte in an optimizer moment is caught, naming its key.
        leaf = path / "optim" / "state.0.exp_avg_sq.memmap"
        data = bytearray(leaf.read_bytes())
        data[0] ^= 0xFF
        leaf.write_bytes(bytes(data))
        report = mgr.verify(3)
        assert not report.ok
        assert "state.0.exp_avg_sq" in report.summary()
        target = fresh()
        before = snapshot(target)
        with pytest.raises(tdckpt.errors.IntegrityError):
            mgr.restore_into(target, verify=True)
        assert_same(snapshot(target), before)


class Holder:
    """A stateful object whose state_dict is the value it holds."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return self.value

    def load_state_dict(self, value: dict[str, Any]) -> None:
        self.value = value


def test_non_json_values_are_pickled_and_inventoried(tmp_path: Path) -> None:
    value = {
        "dtype": torch.float16,
        "nums": (1, 2.5, float("inf"), float("nan")),
        3: "int key",
        "arr": np.arange(4, dtype=np.int32),
        "od": OrderedDict(b=1, a=2),
        "same": None,
    }
    t = torch.ones(2)
    value["t1"], value["t2"] = t, t
    value["shape"] = torch.zeros(1)  # tensordict's own meta.json fields are no problem
    value["__state__"] = "a key like the structure's"
    with CheckpointManager(tmp_path) as mgr:
        path = mgr.save(1, {"holder": Holder(value)})
        manifest = json.loads((path / MANIFEST_NAME).read_text())
        assert [p["key"] for p in manifest["pickles"]] == [["holder", "dtype"]]
        with pytest.raises(tdckpt.errors.PickleNotAllowedError):
            mgr.restore_into({"holder": Holder({})}, allow_pickle=False)
        target = Holder({k: None for k in value})
        mgr.restore_into({"holder": target}, allow_pickle=True)
    got = target.value
    assert got["dtype"] is torch.float16
    assert type(got["nums"]) is tuple and got["nums"][:3] == (1, 2.5, float("inf"))
    assert got["nums"][3] != got["nums"][3]
    assert got[3] == "int key"
    assert isinstance(got["arr"], np.ndarray) and got["arr"].dtype == np.int32
    assert type(got["od"]) is OrderedDict and list(got["od"]) == ["b", "a"]
    assert got["t1"] is got["t2"]  # the same tensor twice: saved once, restored as one
    assert torch.equal(got["shape"], torch.zeros(1))
    assert got["__state__"] == "a key like the structure's"


def test_random_state_round_trip(tmp_path: Path) -> None:
    rng = RandomState()
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.normal()  # leaves a cached gaussian in the legacy state
    random.gauss(0, 1)
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"rng": rng})
        expected = (random.random(), random.gauss(0, 1), np.random.normal(), torch.rand(2))
        random.seed(9)
        np.random.seed(9)
        torch.manual_seed(9)
        mgr.restore_into({"rng": rng})
    got = (random.random(), random.gauss(0, 1), np.random.normal(), torch.rand(2))
    assert got[:3] == expected[:3]
    assert torch.equal(got[3], expected[3])
    assert repr(rng) == "RandomState(cuda=True)"


def test_random_state_refuses_foreign_state() -> None:
    with pytest.raises(ValueError, match="not a RandomState state"):
        RandomState().load_state_dict({"python": 1, "torch": torch.zeros(3)})


def test_meta_module_restored_onto_a_device(tmp_path: Path) -> None:
    state = trained()
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(3, {"model": state["model"]})
        with torch.device("meta"):
            model = Tied()
        mgr.restore_into({"model": model}, device="cpu")
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert model.head.weight is model.emb.weight  # still one parameter
    for k, v in state["model"].state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    assert model.scratch.device.type == "meta"  # not in the state dict: left as it was


def test_module_with_custom_loading_goes_through_load_state_dict(tmp_path: Path) -> None:
    class Custom(torch.nn.Linear):
        def get_extra_state(self) -> Any:
            return {"calls": self.calls}

        def set_extra_state(self, state: Any) -> None:
            self.calls = state["calls"]

    torch.manual_seed(0)
    saved = Custom(3, 2)
    saved.calls = 5
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"m": saved})
        target = Custom(3, 2)
        target.calls = 0
        weight = target.weight
        mgr.restore_into({"m": target})
    assert target.calls == 5 and target.weight is weight
    assert torch.equal(target.weight, saved.weight)


# -- checks before anything changes ----------------------------------------------------------


def test_every_mismatch_reported_and_nothing_changed(tmp_path: Path) -> None:
    state = trained()
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(3, state)
        target = fresh()
        target["model"].body[0] = torch.nn.Linear(4, 4, bias=False)  # a key less
        target["model"].head.bias = torch.nn.Parameter(torch.zeros(10, dtype=torch.float64))
        target["optim"] = torch.optim.SGD(target["model"].parameters(), lr=0.1)
        target["sched"] = torch.optim.lr_scheduler.StepLR(target["optim"], 2)
        before = {k: v.clone() for k, v in target["model"].state_dict().items()}
        rng_before = target["rng"].state_dict()
        with pytest.raises(RestoreError) as info:
            mgr.restore_into(target)
    message = str(info.value)
    assert "nothing was changed" in message
    assert "'body.0.bias'" in message  # a key the target lacks
    assert "'head.bias' is float64[10] in the target, float32[10] in the step" in message
    assert "torch.optim.adam.Adam" in message  # the optimizer class differs
    assert len(info.value.facts["problems"]) >= 3
    for k, v in target["model"].state_dict().items():
        assert torch.equal(v, before[k]), k
    assert torch.equal(torch.get_rng_state(), rng_before["torch"])


def test_kind_and_entry_mismatches(tmp_path: Path) -> None:
    state = trained()
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(3, state)
        with pytest.raises(RestoreError, match=r"the target is a tensordict .* holds a module"):
            mgr.restore_into({"model": TensorDict(), "optim": fresh()["optim"]}, strict=False)
        with pytest.raises(RestoreError, match="'missing': not in the step"):
            mgr.restore_into({"missing": fresh()["model"]}, strict=False)
        with pytest.raises(RestoreError, match="holds entries the target lacks: 'optim'"):
            mgr.restore_into({"model": fresh()["model"]})
        only = fresh()["model"]
        mgr.restore_into({"model": only}, strict=False)  # only the model
        assert torch.equal(only.emb.weight, state["model"].emb.weight)
        mgr.save(4, TensorDict(a=torch.zeros(1)))
        with pytest.raises(RestoreError, match="saved from a TensorDict, not a training state"):
            mgr.restore_into({"model": only}, step=4)
        with pytest.raises(ValueError, match="device= applies to a training state"):
            mgr.restore_into(TensorDict(a=torch.zeros(1)), step=4, device="cpu")


def test_tied_target_refuses_untied_step(tmp_path: Path) -> None:
    class Untied(Tied):
        def __init__(self) -> None:
            super().__init__()
            self.head.weight = torch.nn.Parameter(self.emb.weight.detach().clone() + 1)

    torch.manual_seed(0)
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"model": Untied()})
        tied = Tied()
        with pytest.raises(RestoreError, match="the target ties"):
            mgr.restore_into({"model": tied})
        # The other way round: each of the target's two parameters gets the value.
        mgr.save(2, {"model": Tied()})
        untied = Untied()
        mgr.restore_into({"model": untied}, step=2)
        assert torch.equal(untied.head.weight, untied.emb.weight)
        assert untied.head.weight is not untied.emb.weight


def test_failure_while_restoring_puts_earlier_entries_back(tmp_path: Path) -> None:
    class Exploding:
        def state_dict(self) -> dict[str, Any]:
            return {"x": 1}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            raise RuntimeError("boom")

    state = trained()
    state["explode"] = Exploding()
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(3, state)
        target = fresh()
        target["explode"] = Exploding()
        before = snapshot(target)
        params = list(target["model"].parameters())
        torch.manual_seed(42)
        rng_before = torch.get_rng_state()
        with pytest.raises(
            RestoreError, match=r"restoring entry 'explode' failed .*boom.* put back"
        ):
            mgr.restore_into(target)
    assert_same(snapshot(target), before)
    assert list(target["model"].parameters()) == params
    assert torch.equal(torch.get_rng_state(), rng_before)


def test_tensordict_entry_restored_in_place(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as mgr:
        saved = TensorDict(a=torch.arange(3.0), n=TensorDict(b=torch.ones(2)))
        mgr.save(1, {"buf": saved, "rng": RandomState()})
        target = TensorDict(a=torch.zeros(3), n=TensorDict(b=torch.zeros(2)))
        inner = target["n"]
        mgr.restore_into({"buf": target, "rng": RandomState()})
        assert target["a"].tolist() == [0.0, 1.0, 2.0] and target["n"] is inner
        assert inner["b"].tolist() == [1.0, 1.0]
        with pytest.raises(RestoreError, match="keys the target lacks"):
            mgr.restore_into({"buf": TensorDict(a=torch.zeros(3)), "rng": RandomState()})
        with pytest.raises(RestoreError, match=r"batch size \[2\] in the target"):
            mgr.restore_into(
                {
                    "buf": TensorDict(
                        a=torch.zeros(3), n=TensorDict(b=torch.zeros(2)), batch_size=[]
                    ).expand(2),
                    "rng": RandomState(),
                }
            )
        # Without any live object, a mapping is a nested-dict target, restored as before.
        mgr.save(2, TensorDict(buf=saved.clone()))
        plain: dict[str, Any] = {"buf": {"a": torch.zeros(3), "n": {"b": torch.zeros(2)}}}
        mgr.restore_into(plain, step=2)
        assert plain["buf"]["a"].tolist() == [0.0, 1.0, 2.0]


def test_bad_entries_refused_before_anything_is_written(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(UnsupportedContentError) as info:
            mgr.save(1, {"w": torch.zeros(2), 3: torch.nn.Linear(1, 1), "ok": RandomState()})
        assert "entry 'w': a torch.Tensor is neither" in str(info.value)
        assert "the entry name 3 is not a non-empty str" in str(info.value)
        with pytest.raises(UnsupportedContentError, match="no entries"):
            mgr.save(1, {})
        assert mgr.steps() == []
    assert not any(tmp_path.iterdir()) or sorted(os.listdir(tmp_path)) == []


def test_to_tensordict_is_pure_and_references_tensors() -> None:
    state = trained()
    td, record = to_tensordict(state)
    assert td["model", "emb.weight"].data_ptr() == state["model"].emb.weight.data_ptr()
    assert record.entries["model"].kind == "module"
    assert state["model"].emb.weight.requires_grad  # untouched


def test_inspect_shows_a_state_step(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as mgr:
        path = mgr.save(3, trained())
    out = subprocess.run(
        [sys.executable, "-m", "tdckpt", "inspect", str(path)],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=120,
        check=True,
    ).stdout
    assert "training state" in out
    assert "model" in out and "module" in out and "torch.optim.adam.Adam" in out


# -- an interrupted run resumes exactly ------------------------------------------------------


def test_exact_resume_in_a_fresh_process(tmp_path: Path) -> None:
    child = str(TESTS / "_state_train_child.py")
    root = tmp_path / "run"

    def run(*args: str) -> None:
        subprocess.run(
            [sys.executable, child, *args], env=child_env(), timeout=300, check=True, cwd=REPO
        )

    run("full+first", str(root), str(tmp_path / "full.pt"))
    run("resume", str(root), str(tmp_path / "resumed.pt"))
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert_same(resumed, full)
    with warnings.catch_warnings():
        assert CheckpointManager(root).verify(10).ok


# -- SIGKILL during a training-state save ----------------------------------------------------


STAGES = ("partial", "manifest", "commit", "committed", "direct", "direct-manifest")


def test_sigkill_during_state_save_keeps_the_previous_step(
    tmp_path: Path, fault_trials: int
) -> None:
    if not hasattr(os, "fork"):
        pytest.skip("the crash helper forks savers")
    import signal

    from _state_crash_child import make_state, value_of

    from tdckpt._write.atomic import is_tmp_name

    stderr = (tmp_path / "child.stderr").open("w")
    child = subprocess.Popen(
        [sys.executable, str(TESTS / "_state_crash_child.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=child_env(),
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        for trial in range(fault_trials):
            for stage in STAGES:
                if stage.startswith("direct") and not o_direct_works(tmp_path):
                    continue  # this file system has no O_DIRECT: the saver never uses it
                root = tmp_path / f"root-{trial}-{stage}"
                with CheckpointManager(root) as mgr:
                    mgr.save(1, make_state(1))
                child.stdin.write(f"run {root} 2 {stage} 2\n")
                child.stdin.flush()
                line = child.stdout.readline()
                status = int(line.split()[1])
                assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (
                    stage,
                    (tmp_path / "child.stderr").read_text()[-2000:],
                )
                mgr = CheckpointManager(root)
                committed = stage == "committed"
                assert mgr.steps() == ([1, 2] if committed else [1]), stage
                for step in mgr.steps():
                    assert mgr.verify(step).ok, (stage, step)
                target = make_state(0)
                mgr.restore_into(target)  # the latest committed step
                assert value_of(target) == (2 if committed else 1), stage
                leftovers = [n for n in os.listdir(root) if is_tmp_name(n)]
                assert bool(leftovers) == (not committed), (stage, leftovers)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # the killed saver's lock is taken over
                    with CheckpointManager(root) as writer:
                        assert sorted(p.name for p in writer.gc()) == sorted(leftovers)
                assert CheckpointManager(root).steps() == ([1, 2] if committed else [1])
    finally:
        child.stdin.write("quit\n")
        child.stdin.close()
        child.wait(timeout=60)
        child.stdout.close()
        stderr.close()


def test_docs_examples_run() -> None:
    import doctest
    import importlib

    for name in ("tdckpt._state.rng", "tdckpt._state.decode"):
        failures, tried = doctest.testmod(importlib.import_module(name))
        assert tried > 0 and failures == 0, name
    failures, tried = doctest.testfile(
        str(REPO / "docs" / "training-state.rst"),
        module_relative=False,
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
    )
    assert tried > 10 and failures == 0


def test_every_file_is_fsynced_before_the_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files are fsynced on helper threads; all of them before the directories and manifest."""
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc/self/fd to name an fsynced descriptor")
    from tdckpt._write import atomic as _atomic
    from tdckpt._write import writer as _writer

    events: list[str] = []
    real_fsync, real_small, real_dir = os.fsync, _writer.write_small, _atomic.fsync_dir

    def fsync(fd: int) -> None:
        events.append("file " + os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    def write_small(path: Path, data: bytes, *, fsync: bool) -> None:
        events.append(f"manifest {path}")
        real_small(path, data, fsync=fsync)

    def fsync_dir(path: Any) -> None:
        events.append(f"dir {path}")
        real_dir(path)

    monkeypatch.setattr(_writer.os, "fsync", fsync)
    monkeypatch.setattr(_writer, "write_small", write_small)
    monkeypatch.setattr(_atomic, "fsync_dir", fsync_dir)
    with CheckpointManager(tmp_path / "run") as mgr:
        path = mgr.save(1, trained())
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    names = {Path(f["path"]).name for f in manifest["files"]}
    leaf_syncs = [
        i for i, e in enumerate(events) if e.startswith("file ") and Path(e[5:]).name in names
    ]
    staging_dirs = [i for i, e in enumerate(events) if e.startswith("dir ") and ".tmp-" in e]
    at_manifest = next(i for i, e in enumerate(events) if e.startswith("manifest "))
    # Every listed file was fsynced, all before the staging directories and the manifest.
    assert {Path(events[i][5:]).name for i in leaf_syncs} == names
    assert staging_dirs and max(leaf_syncs) < min(staging_dirs) < at_manifest


class _LongKeys:
    """A stateful object whose state_dict is keyed by long file paths (Lightning's top-k)."""

    def __init__(self) -> None:
        self.state = {
            ("/very/long/path/" * 20) + f"epoch={i}.ckpt": torch.tensor(float(i)) for i in range(3)
        }

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = dict(state)


def test_tensors_under_keys_too_long_for_a_file_name_are_saved(tmp_path: Path) -> None:
    # Each tensor is a leaf named after its path in the state_dict; a path too long for a
    # file name gets a short leaf name (the saved structure records which), not a refusal.
    live = _LongKeys()
    with CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, {"paths": live})
        fresh = _LongKeys()
        fresh.state = {k: torch.zeros(()) for k in fresh.state}
        mgr.restore_into({"paths": fresh})
    assert list(fresh.state) == list(live.state)
    assert all(torch.equal(fresh.state[k], live.state[k]) for k in live.state)


class _Color(__import__("enum").IntEnum):
    RED = 1


class _Mode(str, __import__("enum").Enum):
    TRAIN = "train"


_Pair = __import__("collections").namedtuple("_Pair", "a b")


def test_subclasses_of_json_types_and_numpy_scalars_come_back_as_themselves(
    tmp_path: Path,
) -> None:
    """tensordict writes any value json.dumps takes as JSON: an IntEnum read back as an int,
    a namedtuple as a list, a defaultdict as a dict (its missing keys then KeyErrors), a
    NumPy float64 as a float - silently. They now come back as they were saved: NumPy
    scalars as 0-d tensor leaves (no pickle), the others pickled (so only with
    allow_pickle) and listed in the manifest's pickle inventory."""
    from collections import defaultdict

    scalars = {"f64": np.float64(1.5), "i32": np.int32(-3), "b": np.bool_(True), "u8": np.uint8(7)}
    subclasses = {
        "enum": _Color.RED,
        "strenum": _Mode.TRAIN,
        "pair": _Pair(1, [2]),
        "dd": defaultdict(list, {"k": [1]}),
        _Mode.TRAIN: "a key that is a str Enum",
    }
    with CheckpointManager(tmp_path, fsync=False) as mgr:
        mgr.save(1, {"holder": Holder(scalars)})
        path = mgr.save(2, {"holder": Holder(subclasses)})
        manifest = json.loads((path / MANIFEST_NAME).read_text())
        assert len(manifest["pickles"]) == len(subclasses)
        target = Holder(dict.fromkeys(scalars))
        mgr.restore_into({"holder": target}, 1, allow_pickle=False)  # no pickle needed
        for name, value in scalars.items():
            assert type(target.value[name]) is type(value) and target.value[name] == value
        with pytest.raises(tdckpt.errors.PickleNotAllowedError):
            mgr.restore_into({"holder": Holder(dict.fromkeys(subclasses))}, 2, allow_pickle=False)
        target = Holder(dict.fromkeys(subclasses))
        mgr.restore_into({"holder": target}, 2, allow_pickle=True)
    got = target.value
    assert got.keys() == subclasses.keys()
    for name, value in subclasses.items():
        assert type(got[name]) is type(value) and got[name] == value, name
    assert type(next(k for k in got if k == "train")) is _Mode
    got["dd"]["missing"].append(1)  # still a defaultdict


def test_a_lazy_module_before_its_first_forward_is_refused_clearly(tmp_path: Path) -> None:
    """Its parameters have no values yet: an UnsupportedContentError naming the entry and
    the key (was torch's raw ValueError from deep inside the encoder)."""
    with CheckpointManager(tmp_path, fsync=False) as mgr:
        with pytest.raises(
            UnsupportedContentError, match=r"entry 'model'.*uninitialized parameter at 'weight'"
        ):
            mgr.save(1, {"model": torch.nn.LazyLinear(3)})
        lazy = torch.nn.LazyLinear(3)
        lazy(torch.zeros(2, 4))  # materialized: saved like any module
        mgr.save(1, {"model": lazy})
        assert mgr.steps() == [1]


def test_an_optimizer_over_meta_parameters_restored_in_the_same_call_is_refused(
    tmp_path: Path,
) -> None:
    """The restore replaces a module's meta parameters with new ones: an optimizer built
    over the meta ones and restored in the same call kept stepping the discarded ones (the
    model never changed again). Refused, nothing changed; the documented flow - modules
    first, the optimizer built after and restored in a second call - works."""

    def build() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))

    torch.manual_seed(0)
    model = build()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    with CheckpointManager(tmp_path, fsync=False) as mgr:
        mgr.save(1, {"model": model, "opt": opt})
        with torch.device("meta"):
            fresh_model = build()
        meta_opt = torch.optim.Adam(fresh_model.parameters(), lr=0.1)
        with pytest.raises(RestoreError, match=r"entry 'opt': it optimizes parameters of 'model'"):
            mgr.restore_into({"model": fresh_model, "opt": meta_opt}, device="cpu")
        assert {p.device.type for p in fresh_model.parameters()} == {"meta"}
        mgr.restore_into({"model": fresh_model}, device="cpu", strict=False)
        new_opt = torch.optim.Adam(fresh_model.parameters(), lr=0.1)
        mgr.restore_into({"opt": new_opt}, strict=False)
    for a, b in zip(fresh_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    before = [p.clone() for p in fresh_model.parameters()]
    fresh_model(torch.randn(5, 3)).sum().backward()
    new_opt.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, fresh_model.parameters(), strict=True))


class _FailsToLoad:
    def state_dict(self) -> dict[str, Any]:
        return {"x": 1}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise RuntimeError("cannot load")


def test_a_lazy_module_before_its_first_forward_is_restored_or_put_back(tmp_path: Path) -> None:
    """torch's load_state_dict materializes a lazy module's parameters; the restore failed
    on its own snapshot (clone of an uninitialized parameter). It now restores them, and
    when a later entry fails, puts them back uninitialized."""
    torch.manual_seed(0)
    trained = torch.nn.Sequential(torch.nn.LazyLinear(3))
    trained(torch.randn(2, 4))
    with CheckpointManager(tmp_path, fsync=False) as mgr:
        mgr.save(1, {"model": trained, "h": _FailsToLoad()})
        lazy = torch.nn.Sequential(torch.nn.LazyLinear(3))
        with pytest.raises(RestoreError, match=r"restoring entry 'h' failed .*put back"):
            mgr.restore_into({"model": lazy, "h": _FailsToLoad()})
        assert isinstance(lazy[0].weight, torch.nn.parameter.UninitializedParameter)
        lazy(torch.randn(2, 5))  # still lazy: takes another input size
        lazy = torch.nn.Sequential(torch.nn.LazyLinear(3))
        mgr.restore_into({"model": lazy}, strict=False)
    assert torch.equal(lazy[0].weight, trained[0].weight)
    assert torch.equal(lazy(torch.ones(1, 4)), trained(torch.ones(1, 4)))
