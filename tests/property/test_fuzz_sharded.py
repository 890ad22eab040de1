"""Metadata fuzzer, sharded target: a mutated sharded step is restored correctly or refused.

Seeds are sharded steps written by tdckpt's shard writer (tests/_shard_local.py): uneven
shards, an empty one, nested keys, replicated entries. Each example copies the root and
mutates the step manifest - any value anywhere (the generic JSON mutations of
test_fuzz_metadata.py), and the sharded fields on purpose: a shard's rows, rank and folder,
the global batch size, the world size, shards swapped or dropped, the replicated entries -
then either seals it again with its checksum (so the mutation reaches the checks of the
shards) or leaves the checksum stale; sometimes it also mutates a shard's own ``meta.json``.

For every mutant, through ``CheckpointManager``: ``verify`` gives a report or a
TdckptError; ``restore`` (whole, and a slice of rows) and ``restore_into`` either give
exactly the reference rows, or raise a :class:`~tdckpt.errors.TdckptError` with the target
unchanged - never another exception, never a hang, never a write to the step. (Where a
shard's own ``meta.json`` was mutated, a restore may legitimately give other values - that
is the plain-prefix fuzzer's ground - so only "a TdckptError or a result" is required.)

``--fuzz-examples=N`` (or ``TDCKPT_FUZZ_EXAMPLES``) sets the number of examples, as for the
other metadata fuzzers:
``python -m pytest tests/property/test_fuzz_sharded.py --fuzz-examples=2000``.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import fuzz_settings, tree_digest
from hypothesis import event, given
from hypothesis import strategies as st

pytest.importorskip("tensordict")
from _shard_compare import assert_same
from _shard_local import write_sharded
from tensordict import TensorDict
from test_fuzz_metadata import WATCHDOG_S, Mutable, snapshot, watchdog

from tdckpt import CheckpointManager
from tdckpt._shard.manifest import manifest_digest
from tdckpt.errors import TdckptError
from tdckpt.schema import MANIFEST_NAME

#: Rows of each seed's shards (an empty shard; two of equal size, which only their names
#: tell apart).
SEEDS = {1: [3, 0, 3, 2], 2: [4, 4], 3: [5]}
_EDGE = [0, 1, 2, 3, 4, 5, 7, 8, 9, -1, 2**31, 2**40, 2**63 - 1, 2**63, 10**30]


def whole(step: int) -> TensorDict:
    rows = sum(SEEDS[step])
    td = TensorDict(
        a=torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2),
        n=TensorDict(b=torch.arange(rows, dtype=torch.int64), batch_size=[rows]),
        batch_size=[rows],
    )
    if step != 3:
        td["run"] = "exp-1"
    return td


def _shards(step: int) -> list[TensorDict]:
    td, out, row = whole(step), [], 0
    for n in SEEDS[step]:
        shard = td[row : row + n]
        if step != 3:
            shard["run"] = "exp-1"
        out.append(shard)
        row += n
    return out


@pytest.fixture(scope="module")
def sharded_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fuzz-sharded") / "run"
    for step in SEEDS:
        replicated = ("run",) if step != 3 else ()
        write_sharded(root, step, _shards(step), replicated=replicated, metadata={"s": step})
    return root


def test_the_sharded_seeds_restore(sharded_root: Path) -> None:
    with CheckpointManager(sharded_root) as mgr:
        for step in SEEDS:
            assert mgr.verify(step).ok
            assert_same(mgr.restore(step), whole(step), f"seed {step}")


def _mutate_sharded(data: Any, doc: dict[str, Any]) -> str:
    """One mutation of a sharded field, on purpose."""
    shards = doc.get("shards")
    ops = ["batch_size", "world_size", "replicated"]
    # (an earlier generic mutation may have left the list holding other things than shards:
    # the shard mutations below edit shard records only)
    if isinstance(shards, list) and shards and all(isinstance(x, dict) for x in shards):
        ops += ["shard", "shard", "shard", "swap", "drop"]
    op = data.draw(st.sampled_from(ops), label="sharded op")
    if op == "batch_size":
        doc["batch_size"] = data.draw(
            st.lists(st.sampled_from(_EDGE), min_size=1, max_size=3), label="batch_size"
        )
        return f"batch_size = {doc['batch_size']}"
    if op == "world_size":
        doc["world_size"] = data.draw(st.sampled_from(_EDGE), label="world_size")
        return f"world_size = {doc['world_size']}"
    if op == "replicated":
        attempt = str(doc.get("attempt"))
        value = data.draw(
            st.sampled_from(
                [
                    None,
                    {"prefix": f"{attempt}/replicated", "keys": []},
                    {"prefix": f"{attempt}/replicated", "keys": [["run"], ["ghost"]]},
                    {"prefix": f"{attempt}/replicated", "keys": [["a"]]},
                    {"prefix": f"{attempt}/replicated", "keys": [["n", "b"]]},
                    {"prefix": f"{attempt}/shard-0", "keys": [["run"]]},
                    {"prefix": f"{attempt}/replicated", "keys": [["run"], ["run"]]},
                ]
            ),
            label="replicated",
        )
        doc["replicated"] = value
        return f"replicated = {value}"
    assert isinstance(shards, list)
    if op == "swap" and len(shards) > 1:
        i, j = data.draw(st.permutations(range(len(shards))), label="swap")[:2]
        field = data.draw(st.sampled_from(["prefix", "all"]), label="swap what")
        if field == "all":
            shards[i], shards[j] = shards[j], shards[i]
        else:
            # (a generic mutation may have deleted a prefix: a missing one moves as missing)
            a, b = shards[i].pop("prefix", None), shards[j].pop("prefix", None)
            if b is not None:
                shards[i]["prefix"] = b
            if a is not None:
                shards[j]["prefix"] = a
        return f"swap {field} of shards {i} and {j}"
    if op == "drop":
        i = data.draw(st.integers(0, len(shards) - 1), label="drop")
        gone = shards.pop(i)
        if data.draw(st.booleans(), label="keep coverage") and _int_rows(shards, doc):
            doc["world_size"] = len(shards)
            row = 0
            for rank, shard in enumerate(shards):
                n = shard["stop"] - shard["start"]
                shard.update(rank=rank, start=row, stop=row + n)
                row += n
            doc["batch_size"] = [row, *doc["batch_size"][1:]]
        return f"drop shard {gone.get('rank')}"
    i = data.draw(st.integers(0, len(shards) - 1), label="shard")
    field = data.draw(st.sampled_from(["start", "stop", "rank", "prefix", "root_type"]))
    if field == "prefix":
        attempt = str(doc.get("attempt"))
        value: Any = data.draw(
            st.sampled_from(
                [
                    f"{attempt}/shard-{i + 1}",
                    f"{attempt}/replicated",
                    f"{attempt}/shard-9",
                    f"{attempt}/shard-{i}/n",
                    f"{attempt}",
                    "elsewhere/shard-0",
                ]
            ),
            label="prefix",
        )
    elif field == "root_type":
        value = data.draw(st.sampled_from(["tensordict:TensorDict", "x:Y", ""]))
    else:
        value = data.draw(st.sampled_from(_EDGE), label=field)
    shards[i][field] = value
    if (
        field in ("start", "stop")
        and data.draw(st.booleans(), label="shift the rest")
        and _int_rows(shards, doc)
    ):
        # keep the coverage consistent: shift the next shard and the batch size along
        delta = value - (shards[i]["stop"] if field == "stop" else shards[i]["start"])
        for later in shards[i + 1 :]:
            later["start"] += delta
            later["stop"] += delta
        doc["batch_size"] = [shards[-1]["stop"], *doc["batch_size"][1:]]
    return f"shards[{i}].{field} = {value}"


def _int_rows(shards: list[Any], doc: dict[str, Any]) -> bool:
    """Whether the rows and batch size are still numbers (a consistent lie can be told)."""
    return (
        all(type(s.get(k)) is int for s in shards for k in ("start", "stop"))
        and isinstance(doc.get("batch_size"), list)
        and bool(doc["batch_size"])
    )


def _check(root: Path, step: int, data: Any, strict: bool, what: str) -> str:
    """The contract on one mutant (module doc); returns the outcome of restore()."""
    before = tree_digest(root)
    reference = whole(step)
    total = reference.batch_size[0]
    lo = data.draw(st.integers(0, total), label="rows from")
    hi = data.draw(st.integers(lo, total), label="rows to")
    outcome = "refused"
    with CheckpointManager(root) as mgr:
        try:
            report = mgr.verify(step)
        except TdckptError:
            pass
        else:
            assert hasattr(report, "ok"), what
        for rows in (None, slice(lo, hi)):
            try:
                got = mgr.restore(step, rows=rows)
            except TdckptError:
                continue
            if rows is None:
                outcome = "restored"
            if strict:
                want = reference if rows is None else reference[lo:hi]
                if step != 3:
                    want["run"] = "exp-1"
                assert_same(got, want, f"{what}: rows {rows}")
        take = data.draw(st.integers(1, max(total, 1)), label="restore_into rows")
        target = whole(step)[:take].clone() if take <= total else whole(step).clone()
        target = target.apply(lambda t: t.zero_())
        if step != 3:
            target["run"] = "other"
        state = snapshot(target)
        try:
            mgr.restore_into(target, step)
        except TdckptError:
            assert snapshot(target) == state, f"{what}: a refused restore_into changed it"
        else:
            if strict:
                want = reference[: target.batch_size[0]]
                if step != 3:
                    want["run"] = "exp-1"
                assert_same(target, want, f"{what}: restore_into")
    assert tree_digest(root) == before, f"{what}: verify or restore wrote to the step"
    return outcome


def test_fuzz_sharded_manifests(fuzz_examples: int, sharded_root: Path) -> None:
    outcomes = {"refused": 0, "restored": 0}

    @fuzz_settings(fuzz_examples)
    @given(data=st.data())
    def run(data: Any) -> None:
        with tempfile.TemporaryDirectory(prefix="tdckpt-fuzz-sharded-") as tmp:
            root = Path(tmp) / "run"
            shutil.copytree(sharded_root, root, symlinks=True)
            step = data.draw(st.sampled_from(sorted(SEEDS)), label="step")
            folder = root / str(step)
            doc = json.loads((folder / MANIFEST_NAME).read_text())
            done = []
            for _ in range(data.draw(st.integers(1, 3), label="mutations")):
                if data.draw(st.integers(0, 2), label="generic?") == 0:
                    ck = Mutable.__new__(Mutable)
                    ck.docs, ck.pts, ck.dirty = {MANIFEST_NAME: doc}, {}, set()
                    done.append(ck.mutate_json(data))
                    doc = ck.docs[MANIFEST_NAME]
                elif isinstance(doc, dict):
                    done.append(_mutate_sharded(data, doc))
            if isinstance(doc, dict) and data.draw(st.integers(0, 4), label="reseal") > 0:
                doc["manifest_checksum"] = manifest_digest(doc)
                done.append("resealed")
            (folder / MANIFEST_NAME).write_text(json.dumps(doc))
            strict = True
            if data.draw(st.integers(0, 5), label="shard meta?") == 0:
                metas = sorted(folder.glob("attempt-*/*/meta.json"))
                shard = data.draw(st.sampled_from(metas), label="shard").parent
                ck = Mutable(shard)
                done.append(f"{shard.name}: {ck.mutate_json(data)}")
                ck.write()
                strict = False
            what = f"step {step}: {'; '.join(map(str, done))}"
            with watchdog(WATCHDOG_S, what), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                outcome = _check(root, step, data, strict, what)
            outcomes[outcome] += 1
            event(outcome)

    run()
    print(f"sharded metadata fuzzer: {outcomes}")
    if fuzz_examples >= 50:  # not a vacuous run: mutants were both refused and restored
        assert outcomes["refused"] and outcomes["restored"], outcomes
