"""What tensordict 0.14 - 0.15.2 write, read by tdckpt on any installed tensordict.

The trees here are the exact bytes tensordict 0.14.3 writes (copied from its output), so
these tests run the same on every tensordict of the matrix.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import tdckpt

ROOT_014 = (
    '{"ns":{"type":"NonTensorStack"},"shape":[2],"device":"cpu",'
    '"_type":"<class \'tensordict._td.TensorDict\'>"}'
)


def _stack_014(prefix: Path, data: list[object]) -> Path:
    """The tree tensordict 0.14.3 writes for ``TensorDict(ns=NonTensorStack(*data))``."""
    (prefix / "ns").mkdir(parents=True)
    (prefix / "meta.json").write_text(ROOT_014, encoding="utf-8")
    ns = {
        "_type": "<class 'tensordict.tensorclass.NonTensorStack'>",
        "stack_dim": 0,
        "device": None,
        "data": data,
    }
    (prefix / "ns" / "meta.json").write_text(
        json.dumps(ns, separators=(",", ":")), encoding="utf-8"
    )
    return prefix


def _values(out: object) -> list[object]:
    ns = out.get("ns") if hasattr(out, "get") else out["ns"]  # type: ignore[index]
    return list(ns.tolist()) if hasattr(ns, "tolist") else list(ns)


def test_a_stack_of_strings_from_014_restores_without_a_loss_warning(tmp_path: Path) -> None:
    # Regression: the stack's own list of members was taken for a tuple turned list, so every
    # NonTensorStack that tensordict 0.14 - 0.15.2 wrote restored with a TdckptWarning.
    prefix = _stack_014(tmp_path / "ckpt", ["p", "q"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = tdckpt.load_memmap(prefix)
    assert _values(out) == ["p", "q"]
    report = tdckpt.validate(prefix)
    assert report.ok and not [p for p in report.problems if p.severity == "warning"]


def test_a_stack_whose_members_hold_lists_restores_without_a_warning(tmp_path: Path) -> None:
    # NonTensorStack(("a", 1), ("b", 2)) or (["a", 1], ["b", 2]): the same bytes. tensordict
    # (0.15.3 too) writes tuples as JSON lists and loads lists, without a word; tdckpt says it
    # in validate/inspect as an info, not a loss warned on every restore.
    prefix = _stack_014(tmp_path / "ckpt", [["a", 1], ["b", 2]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = tdckpt.load_memmap(prefix)
    assert _values(out) == [["a", 1], ["b", 2]]
    report = tdckpt.validate(prefix)
    assert report.ok
    infos = [p for p in report.problems if p.code == "json-list"]
    assert [(p.severity, p.key) for p in infos] == [("info", ("ns",))]
    assert "values of this NonTensorStack holds a list" in infos[0].message
