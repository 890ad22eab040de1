"""What tensordict's own suite showed once its classmethod loader was routed through tdckpt.

tests/peer routes ``TensorDict.load_memmap`` (hence ``TensorDict.load`` and tensorclass
loaders) as well as ``load_memmap_``; each case here is a test of tensordict's suite that failed
only when routed, reduced to what tdckpt got wrong.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict

import tdckpt

pytestmark = pytest.mark.filterwarnings(
    "ignore:The legacy lazy mode:DeprecationWarning",
)


def _legacy_permuted(dims: tuple[int, ...]) -> Any:
    from tensordict import set_lazy_legacy

    g = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with set_lazy_legacy(True):
            return TensorDict(
                a=torch.randn(3, 1, 4, 2, 5, generator=g),
                c=torch.randint(10, (3, 1, 4, 2, 3), generator=g),
                batch_size=[3, 1, 4, 2],
            ).permute(*dims)


@pytest.mark.parametrize("dims", [(2, 0, 3, 1), (1, 2, 0, 3), (1, 0, 2, 3)])
def test_a_lazy_legacy_permute_loads_as_tensordict_loads_it(
    tmp_path: Path, dims: tuple[int, ...]
) -> None:
    """tensordict writes a permute's inverse as the forward dims (``inv_op_kwargs`` =
    ``custom_op_kwargs``) and derives the real inverse from them; tdckpt refused every
    permutation that is not its own inverse as "damaged" (test_methods.py permute_td)."""
    view = _legacy_permuted(dims)
    from tensordict._lazy import _PermutedTensorDict

    assert type(view) is _PermutedTensorDict
    view.memmap(tmp_path / "ck")
    theirs = TensorDict.load_memmap(tmp_path / "ck")
    assert tdckpt.validate(tmp_path / "ck").ok
    ours = tdckpt.load_memmap(tmp_path / "ck", allow_pickle=False)
    assert type(ours) is type(theirs) is _PermutedTensorDict
    assert ours.batch_size == theirs.batch_size == view.batch_size
    assert ours.inv_op_kwargs == theirs.inv_op_kwargs
    assert ours.custom_op_kwargs == theirs.custom_op_kwargs
    for key in ("a", "c"):
        assert torch.equal(ours[key], view[key]) and torch.equal(ours[key], theirs[key])
    # the inverse undoes the view: its source is the saved source
    assert torch.equal(ours._source["a"], view._source["a"])
    assert torch.equal(ours._source["a"], theirs._source["a"])


def test_a_permute_whose_inverse_is_not_a_permutation_is_still_refused(tmp_path: Path) -> None:
    import json

    view = _legacy_permuted((2, 0, 3, 1))
    view.memmap(tmp_path / "ck")
    meta_path = tmp_path / "ck" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["inv_op_kwargs"] = {"dims": [0, 0, 1, 2]}
    meta_path.write_text(json.dumps(meta))
    report = tdckpt.validate(tmp_path / "ck")
    assert not report.ok
    assert any("inverse permute" in str(p) for p in report.problems), report
