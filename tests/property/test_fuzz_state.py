"""Training-state fuzzer: a mutated saved state restores into usable objects or is refused.

Real training-state steps (a module with batch norm, Adam with AMSGrad and a MultiStepLR;
SGD with momentum and a StepLR; the process's generators; a plain stateful object) are
copied and the saved structure of one entry (``<entry>/__state__/meta.json``) or the dtype
of one of its tensors is mutated: values replaced by other values of every JSON kind and
every tag tdckpt writes (tensors, aliases, tuples, dicts, NaN, huge integers, structures
nested hundreds deep), items deleted or duplicated; or the manifest's record of what the
entry was (its kind, its class) is changed. The manifest is kept consistent, so
only the restore's own checks stand between the mutant and the live objects. For every
mutant, ``restore_into`` (``allow_pickle=False``) into freshly built objects either

* raises a :class:`~tdckpt.errors.TdckptError`, and then no live object changed (module
  tensors and parameter identities, optimizer and scheduler state, every generator of the
  process), and a ``validate`` error implies exactly this outcome; or
* succeeds, and then the module holds the step's tensors, the scheduler and the
  optimizer's parameter groups the step's values, and one more training step (forward,
  backward, optimizer and scheduler step, random draws) runs without an exception.

Never another exception type. The number of examples is ``--fuzz-examples=N`` (or
``TDCKPT_FUZZ_EXAMPLES``), as for ``test_fuzz_metadata.py``::

    python -m pytest -p no:cacheprovider -n 0 tests/property/test_fuzz_state.py --fuzz-examples=2000
"""

from __future__ import annotations

import copy
import json
import random
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _state_tamper import rewrite
from conftest import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("tensordict")

import tdckpt
from tdckpt import CheckpointManager, RandomState
from tdckpt._state import to_state_dicts
from tdckpt.errors import TdckptError
from tdckpt.schema import MANIFEST_NAME, STATE_KINDS


class Holder:
    """A plain stateful object: whatever its state_dict was, it takes back."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


#: The steps: 1 is Adam (AMSGrad) + MultiStepLR, 2 is SGD with momentum + StepLR.
KINDS = (1, 2)


def build(kind: int, seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2)
    )
    if kind == 1:
        opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=0.01, amsgrad=True)
        sched: Any = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[1, 3], gamma=0.5)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    holder = Holder({"count": 3, "names": ["a", "b"], "t": torch.arange(3), "pair": (1, 2.5)})
    return {"model": model, "optim": opt, "sched": sched, "rng": RandomState(), "holder": holder}


def train(state: dict[str, Any], steps: int) -> None:
    for _ in range(steps):
        state["optim"].zero_grad()
        state["model"](torch.randn(5, 3)).square().mean().backward()
        state["optim"].step()
        state["sched"].step()
        random.random()
        np.random.normal()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fuzz-state") / "run"
    with CheckpointManager(root, fsync=False) as mgr:
        for kind in KINDS:
            state = build(kind, seed=kind)
            train(state, 3)
            mgr.save(kind, state)
    return root


def snapshot(state: dict[str, Any]) -> Any:
    return {
        "model": {k: v.clone() for k, v in state["model"].state_dict().items()},
        "params": [id(p) for p in state["model"].parameters()],
        "optim": copy.deepcopy(state["optim"].state_dict()),
        "sched": copy.deepcopy(state["sched"].state_dict()),
        "holder": copy.deepcopy(state["holder"].value),
        "rng": (random.getstate(), np.random.get_state(legacy=True), torch.get_rng_state()),
    }


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(torch.equal(a, b) or (a.is_floating_point() and a.isnan().all()))
        )
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b, equal_nan=a.dtype.kind == "f")
    if isinstance(a, dict):  # keys compared as values too: a NaN key is no other NaN key
        return (
            isinstance(b, dict)
            and len(a) == len(b)
            and all(
                same(ka, kb) and same(va, vb)
                for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=True)
            )
        )
    if isinstance(a, (list, tuple)):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(same(x, y) for x, y in zip(a, b, strict=True))
        )
    if isinstance(a, float) and a != a:
        return isinstance(b, float) and b != b
    return type(a) is type(b) and bool(a == b)


# -- mutations ---------------------------------------------------------------------------------


def _nodes(root: Any) -> list[tuple[Any, Any]]:
    """(container, index or key) of every node below ``root``, without recursion."""
    out: list[tuple[Any, Any]] = []
    stack = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            children = list(enumerate(node))
        elif isinstance(node, dict):
            children = list(node.items())
        else:
            continue
        for key, child in children:
            out.append((node, key))
            stack.append(child)
    return out


def _values(leaves: list[str]) -> st.SearchStrategy[Any]:
    names = st.sampled_from([*leaves, "nope", ""]) if leaves else st.just("nope")
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.sampled_from([0, 1, -1, 624, 625, 100000, 2**63, 2**1024, 10**3999, -(10**400)]),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=6),
        st.sampled_from(["fast", "abc", "MT19937", "PCG64", "float32", "state_dict"]),
    )
    tagged = st.one_of(
        st.builds(lambda t: {"float": t}, st.sampled_from(["nan", "inf", "-inf", "x"])),
        st.builds(
            lambda tag, n: {tag: n},
            st.sampled_from(["tensor", "alias", "ndarray", "td", "pickle"]),
            names,
        ),
        st.builds(lambda v: {"tuple": v}, st.lists(scalars, max_size=3)),
        st.builds(
            lambda tag, kv: {tag: [list(p) for p in kv]},
            st.sampled_from(["dict", "odict", "counter"]),
            st.lists(st.tuples(scalars, scalars), max_size=3),
        ),
        st.builds(lambda k, v: {k: v}, st.text(max_size=5), scalars),
        st.dictionaries(st.text(max_size=3), scalars, min_size=2, max_size=3),
    )
    deep = st.builds(_nested, st.sampled_from([50, 99, 100, 101, 150, 450, 900]))
    return st.one_of(scalars, tagged, st.lists(scalars, max_size=4), deep)


def _nested(depth: int) -> Any:
    node: Any = 0.5
    for _ in range(depth):
        node = [node]
    return node


#: Other dtypes for a leaf (of the same item size or not: a file longer than the new dtype
#: needs is legal, a shorter one a validation error).
_OTHER_DTYPES = {
    "torch.float32": ["torch.int32", "torch.float16"],
    "torch.float64": ["torch.int64", "torch.complex64"],
    "torch.int64": ["torch.float64", "torch.int32", "torch.bool"],
    "torch.uint8": ["torch.int8", "torch.bool"],
}


def mutate(data: Any, step: Path) -> str:
    """Mutate one entry of ``step`` in place; return what was done (for failure messages)."""
    entry = data.draw(st.sampled_from(["model", "optim", "sched", "rng", "holder"]), "entry")
    meta_rel = f"{entry}/meta.json"
    leaves_meta = json.loads((step / meta_rel).read_text())
    leaves = sorted(k for k, v in leaves_meta.items() if isinstance(v, dict) and "dtype" in v)
    ops = ["replace", "replace", "delete", "duplicate", "dtype", "record"]
    op = data.draw(st.sampled_from(ops), "op")
    if op == "record":  # what the manifest says the entry was
        manifest = json.loads((step / MANIFEST_NAME).read_text())
        record = manifest["state"]["entries"][entry]
        field = data.draw(st.sampled_from(["kind", "type"]), "field")
        record[field] = data.draw(
            st.sampled_from(STATE_KINDS)
            if field == "kind"
            else st.sampled_from(
                [
                    "torch.optim.sgd:SGD",
                    "torch.optim.adam:Adam",
                    "torch.optim.lr_scheduler:StepLR",
                    "torch.optim.lr_scheduler:MultiStepLR",
                    "tdckpt._state.rng:RandomState",
                    "builtins:object",
                ]
            ),
            "record",
        )
        (step / MANIFEST_NAME).write_text(json.dumps(manifest))
        return f"{entry}: manifest record {field} -> {record[field]}"
    if op == "dtype" and leaves:
        leaf = data.draw(st.sampled_from(leaves), "leaf")
        old = leaves_meta[leaf]["dtype"]
        new = data.draw(st.sampled_from(_OTHER_DTYPES.get(old, [old])), "dtype")
        leaves_meta[leaf]["dtype"] = new
        rewrite(step, meta_rel, json.dumps(leaves_meta).encode())
        return f"{entry}: leaf {leaf} dtype {old} -> {new}"
    rel = f"{entry}/__state__/meta.json"
    meta = json.loads((step / rel).read_text())
    nodes = _nodes(meta["data"])
    parent, key = nodes[data.draw(st.integers(0, len(nodes) - 1), "node")]
    before = json.dumps(parent[key])[:80]
    if op == "delete":
        del parent[key]
        what = f"deleted {before}"
    elif op == "duplicate":
        donor_parent, donor_key = nodes[data.draw(st.integers(0, len(nodes) - 1), "donor")]
        parent[key] = copy.deepcopy(donor_parent[donor_key])
        what = f"{before} -> copy of {json.dumps(parent[key])[:80]}"
    else:
        parent[key] = data.draw(_values(leaves), "value")
        shown = json.dumps(parent[key]) if not _huge(parent[key]) else "<huge int>"
        what = f"{before} -> {shown[:80]}"
    rewrite(step, rel, json.dumps(meta).encode())
    return f"{entry}: {op} {what}"


def _huge(value: Any) -> bool:
    return type(value) is int and value.bit_length() > 1000


# -- the property ------------------------------------------------------------------------------


def _check_restored(target: dict[str, Any], root: Path, kind: int, what: str) -> None:
    """The restored objects hold the step's values and can train."""
    with CheckpointManager(root) as mgr:
        _, _, manifest = mgr._resolve(kind)
        saved = to_state_dicts(mgr.restore(kind, allow_pickle=False), manifest.state)
    for k, v in saved["model"].items():
        assert same(target["model"].state_dict()[k], v.as_subclass(torch.Tensor)), (what, k)
    live_sched = target["sched"].state_dict()
    for k, v in saved["sched"].items():
        assert same(live_sched[k], v), (what, k)
    live_groups = target["optim"].param_groups
    for live_group, saved_group in zip(live_groups, saved["optim"]["param_groups"], strict=True):
        for k, v in saved_group.items():
            if k != "params":
                assert same(live_group[k], v), (what, k)
    train(target, 1)


def test_fuzz_training_state(fuzz_examples: int, pristine: Path) -> None:
    @fuzz_settings(fuzz_examples)
    @given(data=st.data())
    def run(data: Any) -> None:
        kind = data.draw(st.sampled_from(KINDS), "step")
        with tempfile.TemporaryDirectory(prefix="tdckpt-fuzz-state-") as tmp:
            root = Path(tmp) / "run"
            shutil.copytree(pristine, root)
            step = root / str(kind)
            what = mutate(data, step)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                report = tdckpt.validate(step)
                target = build(kind, seed=11)
                before = snapshot(target)
                try:
                    with CheckpointManager(root) as mgr:
                        mgr.restore_into(target, step=kind, allow_pickle=False)
                except TdckptError:
                    assert same(snapshot(target), before), f"{what}: refused, but changed"
                    return
                assert report.ok, f"{what}: validate reported {report.errors}, restore took it"
                _check_restored(target, root, kind, what)

    run()


def test_the_pristine_steps_restore_and_train(pristine: Path) -> None:
    for kind in KINDS:
        target = build(kind, seed=11)
        with CheckpointManager(pristine) as mgr:
            mgr.restore_into(target, step=kind, allow_pickle=False)
        _check_restored(target, pristine, kind, f"pristine step {kind}")
