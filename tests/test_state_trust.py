"""Values restored into live objects are checked before the first ``load_state_dict``.

Each test saves a real training state, edits the step's saved structure (or a leaf) the way a
damaged or hostile step would hold it - the manifest kept consistent, so only tdckpt's own
checks can catch it - and restores: the restore must refuse with a RestoreError naming the
entry and the key, and no live object (module, optimizer, scheduler, generators) changes.
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _state_tamper import item, pairs, rewrite, set_item, tamper

import tdckpt
from tdckpt import CheckpointManager, RandomState
from tdckpt.errors import RestoreError, UnsupportedContentError


def _train(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(5, 3)).square().mean().backward()
        opt.step()
        sched.step()
    return {"model": model, "optim": opt, "sched": sched, "rng": RandomState()}


def _fresh(seed: int = 7) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return {"model": model, "optim": opt, "sched": sched, "rng": RandomState()}


def _snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """Everything a restore could change: module tensors, optimizer and scheduler state,
    every generator of the process."""
    return {
        "model": {k: v.clone() for k, v in state["model"].state_dict().items()},
        "params": [id(p) for p in state["model"].parameters()],
        "optim": copy.deepcopy(state["optim"].state_dict()),
        "sched": copy.deepcopy(state["sched"].state_dict()),
        "rng": (random.getstate(), np.random.get_state(legacy=True), torch.get_rng_state()),
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(_same(x, y) for x, y in zip(a, b, strict=True))
        )
    return bool(a == b or (a != a and b != b))


@pytest.fixture
def step(tmp_path: Path) -> Path:
    random.seed(1)
    np.random.seed(2)
    np.random.normal()  # a cached gaussian in the legacy state
    with CheckpointManager(tmp_path / "run") as mgr:
        return mgr.save(1, _train())


def _refused(step: Path, *says: str, target: dict[str, Any] | None = None) -> RestoreError:
    """Restoring the step into fresh objects raises naming ``says``; nothing changes."""
    target = target if target is not None else _fresh()
    before = _snapshot(target)
    with CheckpointManager(step.parent) as mgr, pytest.raises(RestoreError) as info:
        mgr.restore_into(target, step=int(step.name), allow_pickle=False)
    message = str(info.value)
    assert "nothing was changed" in message, message
    for text in says:
        assert text in message, message
    assert _same(_snapshot(target), before)
    return info.value


def _restores(step: Path) -> dict[str, Any]:
    target = _fresh()
    with CheckpointManager(step.parent) as mgr:
        mgr.restore_into(target, step=int(step.name), allow_pickle=False)
    return target


def _sd(node: Any) -> Any:
    return node["state_dict"]  # the top level is plain JSON: {"state_dict": ..., ...}


# -- generator states --------------------------------------------------------------------------


def _numpy(node: Any) -> Any:
    return item(_sd(node), "numpy")


def _python(node: Any) -> Any:
    return item(_sd(node), "python")


_RNG_EDITS = {
    "pos out of bounds": (lambda s: set_item(_numpy(s), "pos", 100000), "'numpy.pos' is 100000"),
    "pos negative": (lambda s: set_item(_numpy(s), "pos", -1), "'numpy.pos' is -1"),
    "pos 625": (lambda s: set_item(_numpy(s), "pos", 625), "'numpy.pos' is 625"),
    "pos a str": (lambda s: set_item(_numpy(s), "pos", "3"), "'numpy.pos' is '3'"),
    "pos a float": (lambda s: set_item(_numpy(s), "pos", 3.0), "'numpy.pos' is 3.0"),
    "pos a bool": (lambda s: set_item(_numpy(s), "pos", True), "'numpy.pos' is True"),
    "kind": (lambda s: set_item(_numpy(s), "kind", "PCG64"), "'numpy.kind' is 'PCG64'"),
    "has_gauss 2": (lambda s: set_item(_numpy(s), "has_gauss", 2), "'numpy.has_gauss' is 2"),
    "has_gauss a str": (
        lambda s: set_item(_numpy(s), "has_gauss", "1"),
        "'numpy.has_gauss' is '1'",
    ),
    "cached_gaussian a str": (
        lambda s: set_item(_numpy(s), "cached_gaussian", "x"),
        "'numpy.cached_gaussian' is 'x'",
    ),
    "keys of another length": (
        lambda s: set_item(_numpy(s), "keys", {"tensor": "python.state"}),
        "'numpy.keys' is int64[625], expected int64[624]",
    ),
    "numpy unknown field": (lambda s: set_item(_numpy(s), "extra", 1), "unknown keys 'extra'"),
    "python version": (lambda s: set_item(_python(s), "version", 2), "'python.version' is 2"),
    "python version a str": (
        lambda s: set_item(_python(s), "version", "3"),
        "'python.version' is '3'",
    ),
    "python gauss a str": (
        lambda s: set_item(_python(s), "gauss", "x"),
        "'python.gauss' is 'x'",
    ),
    "python state of another length": (
        lambda s: set_item(_python(s), "state", {"tensor": "numpy.keys"}),
        "'python.state' is int64[624], expected int64[625]",
    ),
    "torch state of another shape": (
        lambda s: set_item(_sd(s), "torch", {"tensor": "numpy.keys"}),
        "'torch' is not a torch.uint8 tensor of shape (5056,)",
    ),
    "cuda not a list": (lambda s: set_item(_sd(s), "cuda", 3), "'cuda' is a int"),
    "cuda state not uint8": (
        lambda s: set_item(_sd(s), "cuda", [{"tensor": "numpy.keys"}]),
        "'cuda.0' is not a uint8 vector",
    ),
    "unknown generator": (lambda s: set_item(_sd(s), "jax", 1), "unknown keys 'jax'"),
}


@pytest.mark.parametrize("edit", sorted(_RNG_EDITS))
def test_a_generator_state_the_generator_cannot_take_is_refused(step: Path, edit: str) -> None:
    change, says = _RNG_EDITS[edit]
    tamper(step, "rng", change)
    _refused(step, "entry 'rng'", says)


def _leaf(step: Path, rel: str, values: torch.Tensor) -> None:
    rewrite(step, rel, values.numpy().tobytes())


@pytest.mark.parametrize(
    ("rel", "edit", "says"),
    [
        ("numpy.keys.memmap", lambda t: t.index_fill_(0, torch.tensor([3]), -1), "'numpy.keys'"),
        ("numpy.keys.memmap", lambda t: t.index_fill_(0, torch.tensor([0]), 2**32), "'numpy.keys'"),
        (
            "python.state.memmap",
            lambda t: t.index_fill_(0, torch.tensor([624]), 625),
            "'python.state' ends with index 625",
        ),
        (
            "python.state.memmap",
            lambda t: t.index_fill_(0, torch.tensor([5]), 2**40),
            "'python.state' holds 1 words outside 0..2**32-1 (first at 5)",
        ),
    ],
)
def test_generator_words_out_of_range_are_refused(
    step: Path, rel: str, edit: Any, says: str
) -> None:
    path = step / "rng" / rel
    words = torch.from_numpy(np.fromfile(path, dtype=np.int64).copy())
    _leaf(step, f"rng/{rel}", edit(words))
    _refused(step, "entry 'rng'", says)


def test_a_torch_generator_state_torch_refuses_is_refused_first(step: Path) -> None:
    garbage = torch.randint(0, 256, (5056,), dtype=torch.uint8, generator=torch.Generator())
    rewrite(step, "rng/torch.memmap", garbage.numpy().tobytes())
    _refused(step, "entry 'rng'", "'torch' is refused by torch's generator")


def test_random_state_load_state_dict_checks_pos_itself() -> None:
    rng = RandomState()
    state = rng.state_dict()
    state["numpy"]["pos"] = 100000
    before = np.random.get_state(legacy=True)
    with pytest.raises(ValueError, match=r"'numpy.pos' is 100000, expected an int in 0..624"):
        rng.load_state_dict(state)
    assert _same(np.random.get_state(legacy=True), before)


def test_a_valid_generator_state_still_restores_exactly(step: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    np.random.normal()
    expected = (random.random(), np.random.normal(), np.random.randint(1 << 30))
    random.seed(5)
    np.random.seed(5)
    _restores(step)
    assert (random.random(), np.random.normal(), np.random.randint(1 << 30)) == expected


# -- the decoder's budgets are the encoder's -------------------------------------------------


def _nested(depth: int) -> Any:
    node: Any = [0.5]
    for _ in range(depth - 1):
        node = [node]
    return node


def test_a_structure_nested_900_deep_is_refused_by_validate_and_restore(step: Path) -> None:
    # Before: validate said ok and restore_into died with a RecursionError.
    tamper(step, "sched", lambda s: set_item(_sd(s), "base_lrs", _nested(900)))
    report = tdckpt.validate(step)
    assert [p.code for p in report.errors] == ["state-structure"], report.errors
    assert "nests more than 100 levels deep" in report.errors[0].message
    assert report.errors[0].key == ("sched", "__state__")
    _refused(step, "entry 'sched'", "nests more than 100 levels deep (at 'state_dict.base_lrs")


def test_a_4000_digit_integer_is_refused_by_validate_and_restore(step: Path) -> None:
    tamper(step, "sched", lambda s: set_item(_sd(s), "last_epoch", 10**3999))
    report = tdckpt.validate(step)
    assert [p.code for p in report.errors] == ["state-structure"], report.errors
    assert "an integer of 13285 bits at 'state_dict.last_epoch'" in report.errors[0].message
    _refused(step, "entry 'sched'", "an integer of 13285 bits", "more than the 1024 bits")


class Holder:
    """Any object with state_dict/load_state_dict: its state is whatever it was given."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


def test_what_the_encoder_writes_at_its_budgets_reads_back(tmp_path: Path) -> None:
    from tdckpt._read.state_structure import MAX_STATE_DEPTH, MAX_STATE_INT_BITS

    # The state_dict is level 0, its "value" list level 1: the innermost float is at the limit.
    deep = _nested(MAX_STATE_DEPTH - 2)
    big = (1 << MAX_STATE_INT_BITS) - 1
    with CheckpointManager(tmp_path) as mgr:
        path = mgr.save(1, {"h": Holder([deep, big, -big, (1 << 128) + 5])})
        assert tdckpt.validate(path).ok
        target = Holder(None)
        mgr.restore_into({"h": target})
    assert target.value == [deep, big, -big, (1 << 128) + 5]


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (_nested(100), "nests more than 100 levels deep"),
        (1 << 1024, "an integer of 1025 bits"),
        ({1 << 2000: 1}, "an integer of 2001 bits"),
        (-(10**3999), "an integer of 13285 bits"),
        (10**5000, "an integer of 16610 bits"),  # past Python's int-to-str limit too
    ],
    ids=["deep", "1025 bits", "dict key", "4000 digits", "5001 digits"],
)
def test_the_encoder_refuses_what_the_decoder_would(tmp_path: Path, value: Any, says: str) -> None:
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(UnsupportedContentError, match="entry 'h': its state_dict") as info:
            mgr.save(1, {"h": Holder(value)})
        assert says in str(info.value)
        assert mgr.steps() == []


# -- optimizer states ------------------------------------------------------------------------


def _groups(s: Any) -> list[Any]:
    return item(_sd(s), "param_groups")  # type: ignore[no-any-return]


def _group(s: Any) -> Any:
    return _groups(s)[0]


def _pstate(s: Any, i: int) -> Any:
    return item(item(_sd(s), "state"), i)


def _del(node: Any, key: Any) -> None:
    ((_, body),) = node.items()
    body[:] = [pair for pair in body if pair[0] != key]


_OPTIM_EDITS: dict[str, tuple[Any, str]] = {
    "moment of another shape": (
        lambda s: set_item(_pstate(s, 0), "exp_avg", {"tensor": "state.1.exp_avg"}),
        "state[0]['exp_avg'] is a float32[4] tensor, its parameter a float32[4, 3] tensor",
    ),
    "moment not a tensor": (
        lambda s: set_item(_pstate(s, 2), "exp_avg_sq", 0.5),
        "state[2]['exp_avg_sq'] is 0.5, expected a tensor",
    ),
    "moment None": (  # found by the state fuzzer: the restore took it, the next step failed
        lambda s: set_item(_pstate(s, 2), "exp_avg", None),
        "state[2]['exp_avg'] is None, expected a tensor: the optimizer's next step reads it",
    ),
    "moment missing": (
        lambda s: _del(_pstate(s, 1), "exp_avg_sq"),
        "state[1] lacks 'exp_avg_sq'",
    ),
    "state not a dict": (lambda s: set_item(item(_sd(s), "state"), 0, 5), "state[0] is 5"),
    "state of an unknown parameter": (
        lambda s: set_item(item(_sd(s), "state"), 9, {"dict": []}),
        "state holds entries for parameter ids no group lists: [9]",
    ),
    "step negative": (
        lambda s: set_item(_pstate(s, 0), "step", -1),
        "state[0]['step'] is -1, expected a finite step count >= 0",
    ),
    "step a str": (lambda s: set_item(_pstate(s, 0), "step", "x"), "state[0]['step'] is 'x'"),
    "step a vector": (
        lambda s: set_item(_pstate(s, 0), "step", {"tensor": "state.1.exp_avg"}),
        "state[0]['step'] is a float32[4] tensor, expected a step count",
    ),
    "signature emptied": (
        lambda s: s.update(params=[]),
        "the step's parameter signature lists 0 parameters, the target 4",
    ),
    "signature missing": (
        lambda s: s.__delitem__("params"),
        "the step's parameter signature lists None parameters",
    ),
    "signature changed": (
        lambda s: s["params"].__setitem__(0, [[3, 4], "float32"]),
        "parameter 0 is float32[4, 3] in the target, float32[3, 4] in the step",
    ),
    "group params emptied": (
        lambda s: set_item(_group(s), "params", []),
        "parameters per group: [4] in the target, [0] in the step",
    ),
    "group params twice": (
        lambda s: set_item(_group(s), "params", [0, 0, 2, 3]),
        "name a parameter id twice",
    ),
    "group params not ids": (
        lambda s: set_item(_group(s), "params", ["a", 1, 2, 3]),
        "params are not lists of parameter ids",
    ),
    "group not a dict": (lambda s: _groups(s).__setitem__(0, 3), "param_groups are not all dicts"),
    "lr a str": (
        lambda s: set_item(_group(s), "lr", "fast"),
        "param_groups[0]['lr'] is 'fast', expected a number",
    ),
    "lr a bool": (lambda s: set_item(_group(s), "lr", True), "param_groups[0]['lr'] is True"),
    "lr negative": (
        lambda s: set_item(_group(s), "lr", -0.1),
        "param_groups[0]['lr'] is -0.1, expected a finite number >= 0",
    ),
    "lr nan": (
        lambda s: set_item(_group(s), "lr", {"float": "nan"}),
        "param_groups[0]['lr'] is nan",
    ),
    "lr missing": (lambda s: _del(_group(s), "lr"), "param_groups[0]['lr'] is missing"),
    "eps a list": (
        lambda s: set_item(_group(s), "eps", [1e-8]),
        "param_groups[0]['eps'] is [1e-08]",
    ),
    "foreach a list": (
        lambda s: set_item(_group(s), "foreach", [1]),
        "param_groups[0]['foreach'] is [1], expected None, a bool, number or str",
    ),
    "amsgrad an int": (
        lambda s: set_item(_group(s), "amsgrad", 1),
        "param_groups[0]['amsgrad'] is 1, expected a bool",
    ),
    "betas of one item": (
        lambda s: set_item(_group(s), "betas", {"tuple": [0.9]}),
        "param_groups[0]['betas'] is (0.9,), expected a tuple of 2",
    ),
    "betas a list": (
        lambda s: set_item(_group(s), "betas", [0.9, 0.999]),
        "expected a tuple of 2",
    ),
    "betas of strs": (
        lambda s: set_item(_group(s), "betas", {"tuple": ["a", 0.9]}),
        "param_groups[0]['betas'][0] is 'a', expected a number",
    ),
    "beta past 1": (
        lambda s: set_item(_group(s), "betas", {"tuple": [0.9, 1.5]}),
        "param_groups[0]['betas'][1] is 1.5, expected a number in [0, 1)",
    ),
    "a huge int": (
        lambda s: set_item(_group(s), "weight_decay", 2**100),
        "param_groups[0]['weight_decay'] is an int of 101 bits, expected an int within 64 bits",
    ),
}


@pytest.mark.parametrize("edit", sorted(_OPTIM_EDITS))
def test_an_optimizer_state_the_optimizer_cannot_step_with_is_refused(
    step: Path, edit: str
) -> None:
    change, says = _OPTIM_EDITS[edit]
    tamper(step, "optim", change)
    _refused(step, "entry 'optim' (a Adam)", says)


def test_a_moment_of_a_non_floating_dtype_is_refused(step: Path) -> None:
    meta = json.loads((step / "optim" / "meta.json").read_text())
    meta["state.0.exp_avg"]["dtype"] = "torch.int32"  # same item size: the file still fits
    rewrite(step, "optim/meta.json", json.dumps(meta).encode())
    _refused(step, "state[0]['exp_avg'] is a int32[4, 3] tensor, expected the parameter's kind")


def test_a_required_entry_of_none_is_refused_for_a_trained_target_too(step: Path) -> None:
    tamper(step, "optim", lambda s: set_item(_pstate(s, 1), "exp_avg_sq", None))
    _refused(step, "state[1]['exp_avg_sq'] is None, expected a tensor", target=_train(seed=3))


@pytest.mark.parametrize(
    ("optimizer", "key", "value", "shown"),
    [
        (torch.optim.NAdam, "mu_product", "x", "'x'"),
        (torch.optim.ASGD, "eta", None, "None"),
        (torch.optim.ASGD, "mu", 1.0, "1.0"),
        (torch.optim.Adagrad, "sum", [1.0, 2.0], "[1.0, 2.0]"),
    ],
    ids=["NAdam mu_product a str", "ASGD eta None", "ASGD mu a float", "Adagrad sum a list"],
)
def test_an_entry_the_step_reads_as_a_tensor_must_be_one(
    tmp_path: Path, optimizer: Any, key: str, value: Any, shown: str
) -> None:
    model = torch.nn.Linear(3, 2)
    opt = optimizer(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    for state in opt.state.values():
        state[key] = value  # what a damaged or hostile step holds after its metadata is read
    target_model = torch.nn.Linear(3, 2)
    target = optimizer(target_model.parameters(), lr=0.1)  # no state yet: nothing to compare
    before = target.state_dict()
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"model": model, "optim": opt})
        with pytest.raises(RestoreError, match="nothing was changed") as info:
            mgr.restore_into({"model": target_model, "optim": target})
    assert f"state[0][{key!r}] is {shown}, expected a tensor" in str(info.value)
    assert target.state_dict() == before


def test_an_optional_buffer_of_none_is_restored(tmp_path: Path) -> None:
    # SGD's step starts a momentum buffer that is None (older torch saved it so): that None
    # is the state, not damage.
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    for state in opt.state.values():
        state["momentum_buffer"] = None
    target_model = torch.nn.Linear(3, 2)
    target = torch.optim.SGD(target_model.parameters(), lr=0.1, momentum=0.9)
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"model": model, "optim": opt})
        mgr.restore_into({"model": target_model, "optim": target})
    assert [v["momentum_buffer"] for v in target.state_dict()["state"].values()] == [None, None]
    target_model(torch.randn(4, 3)).sum().backward()
    target.step()
    assert all(isinstance(v["momentum_buffer"], torch.Tensor) for v in target.state.values())


def test_a_trained_target_checks_the_state_against_its_own(step: Path) -> None:
    tamper(step, "optim", lambda s: set_item(_pstate(s, 0), "extra", 1))
    target = _train(seed=3)  # holds state for every parameter already
    _refused(step, "state[0] holds ['exp_avg', 'exp_avg_sq', 'extra', 'step']", target=target)


def test_numbers_may_change_kind_and_the_restored_optimizer_steps(step: Path) -> None:
    # An int where the target holds a float (and back) is a number all the same.
    tamper(step, "optim", lambda s: set_item(_group(s), "lr", 1))
    tamper(step, "sched", lambda s: set_item(_sd(s), "gamma", 1))
    target = _restores(step)
    assert target["optim"].param_groups[0]["lr"] == 1
    target["optim"].zero_grad()
    target["model"](torch.randn(5, 3)).square().mean().backward()
    target["optim"].step()
    target["sched"].step()


# -- scheduler states --------------------------------------------------------------------------

_SCHED_EDITS: dict[str, tuple[Any, str]] = {
    "last_epoch a str": (
        lambda s: set_item(_sd(s), "last_epoch", "abc"),
        "'last_epoch' is 'abc', expected a number (the target holds 0)",
    ),
    "last_epoch past 64 bits": (
        lambda s: set_item(_sd(s), "last_epoch", 2**70),
        "'last_epoch' is an int of 71 bits, expected an int within 64 bits",
    ),
    "last_epoch a bool": (lambda s: set_item(_sd(s), "last_epoch", False), "'last_epoch' is False"),
    "gamma nan": (lambda s: set_item(_sd(s), "gamma", {"float": "nan"}), "'gamma' is nan"),
    "base_lrs longer": (
        lambda s: set_item(_sd(s), "base_lrs", [0.1, 0.2]),
        "'base_lrs' is [0.1, 0.2], expected a list of 1",
    ),
    "last lr a str": (
        lambda s: set_item(_sd(s), "_last_lr", ["x"]),
        "'_last_lr'[0] is 'x', expected a number",
    ),
    "a flag an int": (
        lambda s: set_item(_sd(s), "_get_lr_called_within_step", 0),
        "'_get_lr_called_within_step' is 0, expected a bool",
    ),
}


@pytest.mark.parametrize("edit", sorted(_SCHED_EDITS))
def test_a_scheduler_state_of_other_types_is_refused(step: Path, edit: str) -> None:
    change, says = _SCHED_EDITS[edit]
    tamper(step, "sched", change)
    _refused(step, "entry 'sched' (a StepLR)", says)


# -- what the training-state fuzzer found ----------------------------------------------------


def _holder_step(tmp_path: Path) -> Path:
    with CheckpointManager(tmp_path / "run") as mgr:
        return mgr.save(1, {"h": Holder({"count": 3, "arr": np.arange(3), "t": torch.ones(2)})})


def _refused_holder(step: Path, says: str) -> None:
    target = Holder("untouched")
    with CheckpointManager(step.parent) as mgr, pytest.raises(RestoreError, match=says) as info:
        mgr.restore_into({"h": target}, allow_pickle=False)
    assert "nothing was changed" in str(info.value)
    assert target.value == "untouched"


def test_a_dict_key_that_cannot_be_a_key_is_refused(tmp_path: Path) -> None:
    # Before: TypeError: unhashable type: 'dict' (a tagged dict as a dict's key).
    step = _holder_step(tmp_path)
    tamper(step, "h", lambda s: set_item(_sd(s), "value", {"dict": [[{"dict": []}, 1]]}))
    _refused_holder(step, "not what tdckpt writes")


def test_a_leaf_name_that_is_not_a_str_is_refused(tmp_path: Path) -> None:
    # Before: TypeError: unhashable type: 'dict' ({"tensor": {...}}).
    step = _holder_step(tmp_path)
    tamper(step, "h", lambda s: set_item(_sd(s), "value", {"tensor": {"dict": []}}))
    _refused_holder(step, "names the leaf")


def test_an_array_leaf_numpy_cannot_hold_is_refused(tmp_path: Path) -> None:
    # tdckpt stores only bool, int and float arrays; before, a complex leaf came back as an
    # array it never writes, and a bfloat16 one raised TypeError from Tensor.numpy().
    step = _holder_step(tmp_path)
    meta = json.loads((step / "h" / "meta.json").read_text())
    (leaf,) = (k for k in meta if k.startswith("value.arr"))
    assert meta[leaf]["dtype"] == "torch.int64"
    meta[leaf]["dtype"] = "torch.complex64"  # the same item size: the file still fits
    rewrite(step, "h/meta.json", json.dumps(meta).encode())
    _refused_holder(step, "has no NumPy equivalent")


def test_a_scheduler_state_with_a_key_that_is_no_attribute_name_is_refused(step: Path) -> None:
    # Before: restored (a NaN attribute on the scheduler), found by the fuzzer.
    tamper(step, "sched", lambda s: _sd(s)["dict"].append([{"float": "nan"}, 1]))
    _refused(step, "entry 'sched'", "keys that are not attribute names")


def test_a_tensordict_entry_leaf_of_another_shape_or_dtype_is_refused(tmp_path: Path) -> None:
    from tensordict import TensorDict

    # Before: the target's leaf was replaced by the step's, whatever its dtype or shape.
    with CheckpointManager(tmp_path) as mgr:
        saved = TensorDict(a=torch.arange(6.0).reshape(2, 3), b=torch.ones(2))
        mgr.save(1, {"buf": saved, "rng": RandomState()})
        target = TensorDict(a=torch.zeros(2, 3, dtype=torch.int64), b=torch.zeros(2, 1))
        with pytest.raises(RestoreError) as info:
            mgr.restore_into({"buf": target, "rng": RandomState()})
    assert "'a' is int64[2, 3] in the target, float32[2, 3] in the step" in str(info.value)
    assert "'b' is float32[2, 1] in the target, float32[2] in the step" in str(info.value)
    assert torch.equal(target["a"], torch.zeros(2, 3, dtype=torch.int64))


@pytest.mark.parametrize("value", [{"ndarray": "state.0.exp_avg"}, {"tensor": "state.0.exp_avg"}])
def test_a_signature_entry_that_is_an_array_is_refused(step: Path, value: Any) -> None:
    # Found by the fuzzer: "Boolean value of Tensor with more than one value is ambiguous".
    tamper(step, "optim", lambda s: s["params"].__setitem__(1, value))
    _refused(step, "entry 'optim'", "parameter 1 is float32[4] in the target, a")


def test_a_module_state_with_a_key_that_is_no_name_is_refused(step: Path) -> None:
    # Found by the fuzzer: a tensor as a state-dict key ("Boolean value of Tensor with more
    # than one value is ambiguous" from the tied-parameter check).
    tamper(step, "model", lambda s: _sd(s)["odict"].append([{"tensor": "0.weight"}, 1]))
    _refused(step, "entry 'model'", "keys that are not names")


def test_every_entry_s_problems_are_reported_at_once(step: Path) -> None:
    tamper(step, "rng", lambda s: set_item(_numpy(s), "pos", 100000))
    tamper(step, "optim", lambda s: set_item(_group(s), "lr", "fast"))
    tamper(step, "sched", lambda s: set_item(_sd(s), "base_lrs", _nested(900)))
    err = _refused(step, "'numpy.pos' is 100000", "'lr'] is 'fast'", "nests more than 100")
    assert len(err.facts["problems"]) == 3


# -- what is legal still restores --------------------------------------------------------------

_O = torch.optim
_S = torch.optim.lr_scheduler
_OPTIMIZERS: dict[str, Any] = {
    "SGD": lambda p: _O.SGD(p, lr=0.1),
    "SGD-momentum": lambda p: _O.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    "Adam-amsgrad": lambda p: _O.Adam(p, amsgrad=True),
    "Adam-tensor-lr": lambda p: _O.Adam(p, lr=torch.tensor(0.01)),
    "AdamW": lambda p: _O.AdamW(p),
    "Adagrad": lambda p: _O.Adagrad(p),
    "Adadelta": lambda p: _O.Adadelta(p),
    "Adamax": lambda p: _O.Adamax(p),
    "ASGD": lambda p: _O.ASGD(p),
    "NAdam": lambda p: _O.NAdam(p),
    "RAdam": lambda p: _O.RAdam(p),
    "RMSprop": lambda p: _O.RMSprop(p, centered=True, momentum=0.5),
    "Rprop": lambda p: _O.Rprop(p),
    "LBFGS": lambda p: _O.LBFGS(p, history_size=3, line_search_fn="strong_wolfe"),
    "Adafactor": lambda p: _O.Adafactor(p),
}
_SCHEDULERS: dict[str, Any] = {
    "LambdaLR": lambda o: _S.LambdaLR(o, lambda e: 0.9**e),
    "MultiStepLR": lambda o: _S.MultiStepLR(o, [1, 3]),
    "LinearLR": lambda o: _S.LinearLR(o),
    "SequentialLR": lambda o: _S.SequentialLR(
        o, [_S.ConstantLR(o), _S.ExponentialLR(o, 0.9)], milestones=[2]
    ),
    "ChainedScheduler": lambda o: _S.ChainedScheduler([_S.ConstantLR(o), _S.ExponentialLR(o, 0.9)]),
    "ReduceLROnPlateau": lambda o: _S.ReduceLROnPlateau(o),
    "CyclicLR": lambda o: _S.CyclicLR(o, 0.01, 0.1),
    "OneCycleLR": lambda o: _S.OneCycleLR(o, 0.1, total_steps=20),
    "CosineAnnealingWarmRestarts": lambda o: _S.CosineAnnealingWarmRestarts(o, 3),
    "PolynomialLR": lambda o: _S.PolynomialLR(o),
}


def _build(optimizer: str, scheduler: str, seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = _OPTIMIZERS[optimizer](model.parameters())
    return {"model": model, "optim": opt, "sched": _SCHEDULERS[scheduler](opt)}


def _steps(state: dict[str, Any], n: int) -> None:
    model, opt, sched = state["model"], state["optim"], state["sched"]
    for _ in range(n):

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = model(torch.randn(5, 3)).square().mean()
            loss.backward()
            return loss

        opt.step(closure)
        sched.step(1.0) if isinstance(sched, _S.ReduceLROnPlateau) else sched.step()


@pytest.mark.parametrize(
    ("optimizer", "scheduler"),
    [(name, "MultiStepLR") for name in _OPTIMIZERS]
    + [("SGD-momentum", name) for name in _SCHEDULERS if name != "MultiStepLR"],
)
def test_every_torch_optimizer_and_scheduler_still_restores(
    tmp_path: Path, optimizer: str, scheduler: str
) -> None:
    state = _build(optimizer, scheduler, seed=0)
    _steps(state, 3)
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, state)
        for trained in (0, 2):  # a fresh target, and one that holds state of its own
            target = _build(optimizer, scheduler, seed=1)
            _steps(target, trained)
            mgr.restore_into(target)
            assert _same(target["sched"].state_dict(), state["sched"].state_dict())
            _steps(target, 1)


def test_an_integer_past_python_s_4300_digit_limit_is_refused_too(step: Path) -> None:
    rel = "sched/__state__/meta.json"
    raw = (step / rel).read_text()
    assert '["last_epoch", 2]' in raw
    rewrite(step, rel, raw.replace('["last_epoch", 2]', f'["last_epoch", {"9" * 5000}]').encode())
    assert [p.code for p in tdckpt.validate(step).errors] == ["bad-json"]
    target = _fresh()
    before = _snapshot(target)
    with CheckpointManager(step.parent) as mgr, pytest.raises(tdckpt.errors.TdckptError) as info:
        mgr.restore_into(target)
    assert "4300 digits" in str(info.value) and "nothing was changed" in str(info.value)
    assert _same(_snapshot(target), before)


@pytest.mark.parametrize("where", ["group", "state"])
def test_an_optimizer_state_with_a_key_that_is_no_name_is_refused(step: Path, where: str) -> None:
    # Found by the fuzzer: a tensor as a param group's key was loaded into the optimizer.
    node = (lambda s: _group(s)) if where == "group" else (lambda s: _pstate(s, 0))
    tamper(step, "optim", lambda s: pairs(node(s)).append([{"tensor": "state.0.step"}, 1]))
    _refused(step, "entry 'optim'", "keys that are not names")


# -- NumPy generator states in any entry, and tensors placed twice ------------------------------


def _rng_holder_step(tmp_path: Path, value: Any) -> Path:
    with CheckpointManager(tmp_path / "run") as mgr:
        return mgr.save(1, {"h": Holder(value)})


def _find(node: Any, test: Any) -> Any:
    """The first tagged node under ``node`` for which ``test`` holds (depth first)."""
    stack = [node]
    while stack:
        cur = stack.pop()
        if test(cur):
            return cur
        if isinstance(cur, dict):
            stack.extend(cur.values())
        elif isinstance(cur, list):
            stack.extend(cur)
    raise LookupError("not found")


@pytest.mark.parametrize("pos", [700, 100_000_000, -1, "3"])
@pytest.mark.parametrize("form", ["legacy", "bit_generator"])
def test_a_numpy_generator_state_in_any_entry_is_checked(
    tmp_path: Path, form: str, pos: Any
) -> None:
    """NumPy does not check an MT19937 state's position: past 624 it reads out of bounds
    (garbage numbers, then a segfault). tdckpt.RandomState checked its own; a state held by
    any other entry (TorchRL's GlobalRNGState, an environment) restored unchecked. Both
    forms - np.random.get_state()'s tuple and a bit generator's state dict - are checked."""
    value = (
        np.random.get_state(legacy=True)
        if form == "legacy"
        else np.random.RandomState(0)._bit_generator.state
    )
    step = _rng_holder_step(tmp_path, value)

    def edit(s: Any) -> None:
        if form == "legacy":
            _find(s, lambda n: isinstance(n, dict) and "tuple" in n)["tuple"][2] = pos
        else:
            holder = _find(
                s, lambda n: isinstance(n, dict) and any(p[0] == "pos" for p in n.get("dict", []))
            )
            set_item(holder, "pos", pos)

    tamper(step, "h", edit)
    before = np.random.get_state(legacy=True)
    _refused_holder(step, r"a NumPy MT19937 generator state with a position")
    after = np.random.get_state(legacy=True)
    assert after[2] == before[2] and np.array_equal(after[1], before[1])
    # an intact state still restores exactly
    good = _rng_holder_step(tmp_path / "good", value)
    target = Holder(None)
    with CheckpointManager(good.parent) as mgr:
        mgr.restore_into({"h": target}, allow_pickle=False)
    assert str(target.value) == str(value)


def test_an_optimizer_alias_is_refused_and_a_leaf_placed_twice_is_two_tensors(
    step: Path,
) -> None:
    """The encoder places each tensor once and a second place of the same tensor object as
    an alias; an optimizer's state never shares one. A crafted step that made two optimizer
    slots one tensor (a step counter shared by two parameters, exp_avg one with exp_avg_sq)
    restored and then trained silently wrong."""
    import shutil

    copy_ = step.parent.parent / "copy"
    shutil.copytree(step.parent, copy_)
    state = lambda s: item(_sd(s), "state")  # noqa: E731
    first = lambda s: item(state(s), 0)  # noqa: E731
    second = lambda s: item(state(s), 1)  # noqa: E731
    # one parameter's step counter made an alias of another's
    tamper(
        step,
        "optim",
        lambda s: set_item(first(s), "step", {"alias": item(second(s), "step")["tensor"]}),
    )
    _refused(step, "entry 'optim'", "makes two of its values one tensor")
    # exp_avg placed on exp_avg_sq's leaf: one leaf in two places gets two tensors
    other = copy_ / "1"
    tamper(
        other, "optim", lambda s: set_item(first(s), "exp_avg", dict(item(first(s), "exp_avg_sq")))
    )
    target = _fresh()
    with CheckpointManager(other.parent) as mgr:
        mgr.restore_into(target, allow_pickle=False)
    slots = target["optim"].state[next(iter(target["optim"].state))]
    assert torch.equal(slots["exp_avg"], slots["exp_avg_sq"])
    assert (
        slots["exp_avg"].untyped_storage().data_ptr()
        != slots["exp_avg_sq"].untyped_storage().data_ptr()
    )
