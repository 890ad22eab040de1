"""The public API is exactly what ``__all__`` says, sorted (house-style.md §5)."""

from __future__ import annotations

import tdckpt
import tdckpt.errors
import tdckpt.schema
import tdckpt.warnings


def test_all_is_sorted_and_complete() -> None:
    assert list(tdckpt.__all__) == sorted(tdckpt.__all__)
    public = {name for name in vars(tdckpt) if not name.startswith("_")}
    modules = {"errors", "warnings", "schema", "retention", "save_policy", "manager", "cli"}
    modules |= {
        "lightning",
        "torchrl",
    }  # public, imported by their users only (they import Lightning, TorchRL)
    assert public - modules - {"annotations"} == set(tdckpt.__all__) - {"__version__"}


def test_every_exported_name_resolves() -> None:
    for name in tdckpt.__all__:
        assert getattr(tdckpt, name) is not None, name


def test_error_tree_roots_at_tdckpt_error() -> None:
    for name in tdckpt.errors.__all__:
        cls = getattr(tdckpt.errors, name)
        assert issubclass(cls, tdckpt.errors.TdckptError), name


def test_errors_survive_pickling() -> None:
    import pickle

    err = tdckpt.errors.RestoreError("boom", key=("a", "b"), path="/x")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is tdckpt.errors.RestoreError
    assert str(back) == "boom"
    assert back.key == ("a", "b")
    assert back.path == "/x"


def test_version_is_a_pep440_string() -> None:
    from packaging.version import Version

    assert Version(tdckpt.__version__)
