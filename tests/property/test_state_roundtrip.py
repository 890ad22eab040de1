"""Property: a training state - module trees, optimizers, schedulers - restores exactly.

Hypothesis draws module trees (nested children, parameters of several shapes, persistent
and non-persistent buffers, parameters tied across modules), optimizers (SGD with momentum,
Adam, AdamW, with their options) after a few steps, and LR schedulers after a few epochs.
Each state is saved through a CheckpointManager and restored into objects built
separately (another seed, other hyperparameters); every state_dict must come back with
equal values of equal types (tensor step counts stay tensors, ints stay ints), tied
parameters stay one object, and every parameter keeps its identity.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("tensordict")

from tdckpt import CheckpointManager

EXAMPLES = int(os.environ.get("TDCKPT_HYPOTHESIS_EXAMPLES", "15"))
SHAPES = [(3,), (2, 3), (4, 1), (), (0, 2)]

NodeSpec = dict[str, Any]


def _node(children: st.SearchStrategy[list[NodeSpec]]) -> st.SearchStrategy[NodeSpec]:
    return st.fixed_dictionaries(
        {
            "params": st.lists(st.sampled_from(SHAPES), max_size=3),
            "buffers": st.lists(st.tuples(st.sampled_from(SHAPES), st.booleans()), max_size=2),
            "children": children,
        }
    )


TREES = st.recursive(
    _node(st.just([])),
    lambda inner: _node(st.lists(inner, min_size=1, max_size=3)),
    max_leaves=6,
)


def build(spec: NodeSpec, ties: list[tuple[int, int]], seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)

    def make(node: NodeSpec) -> torch.nn.Module:
        m = torch.nn.Module()
        for i, shape in enumerate(node["params"]):
            m.register_parameter(f"p{i}", torch.nn.Parameter(torch.randn(shape, generator=g)))
        for i, (shape, persistent) in enumerate(node["buffers"]):
            m.register_buffer(f"b{i}", torch.randn(shape, generator=g), persistent=persistent)
        for i, child in enumerate(node["children"]):
            m.add_module(f"c{i}", make(child))
        return m

    root = make(spec)
    named = list(root.named_parameters())
    for i, j in ties:
        if i < len(named) and j < len(named) and i != j:
            (_, source), (name_j, target) = named[i], named[j]
            if source.shape == target.shape:
                owner, _, attr = name_j.rpartition(".")
                setattr(root.get_submodule(owner), attr, source)
    return root


def assert_same(a: Any, b: Any, path: str = "") -> None:
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b or (a != a and b != b), (path, a, b)


def tie_groups(module: torch.nn.Module) -> list[list[str]]:
    groups: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return sorted(groups.values())


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    spec=TREES,
    ties=st.lists(st.tuples(st.integers(0, 8), st.integers(0, 8)), max_size=3),
    archive=st.booleans(),
)
def test_module_trees_round_trip(
    spec: NodeSpec, ties: list[tuple[int, int]], archive: bool
) -> None:
    saved = build(spec, ties, seed=1)
    target = build(spec, ties, seed=2)
    params = dict(target.named_parameters(remove_duplicate=False))
    with tempfile.TemporaryDirectory() as root, CheckpointManager(root, archive=archive) as mgr:
        mgr.save(1, {"model": saved})
        mgr.restore_into({"model": target})
        assert_same(target.state_dict(), saved.state_dict())
    assert tie_groups(target) == tie_groups(saved)
    for name, p in target.named_parameters(remove_duplicate=False):
        assert p is params[name], name


OPTIMIZERS = st.one_of(
    st.builds(
        lambda lr, m, nesterov, wd: (
            torch.optim.SGD,
            {
                "lr": lr,
                "momentum": m,
                "nesterov": nesterov and m > 0,
                "weight_decay": wd,
            },
        ),
        st.floats(1e-4, 0.5),
        st.sampled_from([0.0, 0.5, 0.9]),
        st.booleans(),
        st.sampled_from([0.0, 1e-3]),
    ),
    st.builds(
        lambda lr, b1, amsgrad: (
            torch.optim.Adam,
            {"lr": lr, "betas": (b1, 0.999), "amsgrad": amsgrad},
        ),
        st.floats(1e-4, 0.1),
        st.floats(0.0, 0.99),
        st.booleans(),
    ),
    st.builds(
        lambda lr, wd: (torch.optim.AdamW, {"lr": lr, "weight_decay": wd}),
        st.floats(1e-4, 0.1),
        st.floats(0.0, 0.1),
    ),
)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 3, generator=g)).square().mean().backward()
        opt.step()


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(optimizer=OPTIMIZERS, steps=st.integers(0, 3), groups=st.booleans())
def test_optimizers_round_trip(
    optimizer: tuple[type[torch.optim.Optimizer], dict[str, Any]], steps: int, groups: bool
) -> None:
    cls, options = optimizer

    def make(model: torch.nn.Module, **kw: Any) -> torch.optim.Optimizer:
        if groups:  # two parameter groups, the second with its own lr
            return cls(
                [
                    {"params": list(model[0].parameters())},
                    {"params": list(model[2].parameters()), "lr": 0.003},
                ],
                **kw,
            )
        return cls(model.parameters(), **kw)

    model = _model(0)
    opt = make(model, **options)
    _train(model, opt, steps, seed=3)
    target_model = _model(1)
    target = make(target_model, lr=0.123)
    with tempfile.TemporaryDirectory() as root, CheckpointManager(root) as mgr:
        mgr.save(1, {"model": model, "opt": opt})
        mgr.restore_into({"model": target_model, "opt": target})
    assert_same(target.state_dict(), opt.state_dict())
    # And both continue identically.
    _train(model, opt, 2, seed=4)
    _train(target_model, target, 2, seed=4)
    assert_same(target.state_dict(), opt.state_dict())
    assert_same(target_model.state_dict(), model.state_dict())


def _scheduler(kind: str, opt: torch.optim.Optimizer) -> Any:
    lr = torch.optim.lr_scheduler
    if kind == "step":
        return lr.StepLR(opt, step_size=2, gamma=0.5)
    if kind == "multistep":
        return lr.MultiStepLR(opt, milestones=[1, 3], gamma=0.3)
    if kind == "exponential":
        return lr.ExponentialLR(opt, gamma=0.9)
    if kind == "cosine":
        return lr.CosineAnnealingLR(opt, T_max=5)
    if kind == "onecycle":
        return lr.OneCycleLR(opt, max_lr=0.5, total_steps=20)
    if kind == "lambda":
        return lr.LambdaLR(opt, lr_lambda=lambda epoch: 0.95**epoch)
    if kind == "plateau":
        return lr.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    raise AssertionError(kind)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(
        ["step", "multistep", "exponential", "cosine", "onecycle", "lambda", "plateau"]
    ),
    epochs=st.integers(0, 6),
)
def test_schedulers_round_trip(kind: str, epochs: int) -> None:
    model = _model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = _scheduler(kind, opt)
    for epoch in range(epochs):
        _train(model, opt, 1, seed=epoch)
        sched.step(1.0) if kind == "plateau" else sched.step()
    target_model = _model(1)
    target_opt = torch.optim.SGD(target_model.parameters(), lr=0.1, momentum=0.9)
    target = _scheduler(kind, target_opt)
    with tempfile.TemporaryDirectory() as root, CheckpointManager(root) as mgr:
        mgr.save(1, {"model": model, "opt": opt, "sched": sched})
        mgr.restore_into({"model": target_model, "opt": target_opt, "sched": target})
    assert_same(target.state_dict(), sched.state_dict())
    assert_same(target_opt.state_dict(), opt.state_dict())
    assert [g["lr"] for g in target_opt.param_groups] == [g["lr"] for g in opt.param_groups]
