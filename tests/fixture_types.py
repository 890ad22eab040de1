"""Types that the tensordict fixture corpus refers to by name.

The checkpoints under ``tests/fixtures/tensordict/`` were written with a module importable as
``fixture_types``: pickled non-tensor data holds ``fixture_types.Point`` and the tensorclass
directories record ``_type == "<class 'fixture_types.FixtureTC'>"``. This is the project's own
equivalent of the corpus's ``fixture_types.py`` (same module name, same classes, same fields), so
that both resolve when tests restore those checkpoints. ``tests/conftest.py`` puts ``tests/`` on
``sys.path`` (and on ``PYTHONPATH`` for subprocesses, see ``conftest.subprocess_env``).

Do not rename anything here: the names are part of the on-disk fixtures.
"""

# No ``from __future__ import annotations``: the tensorclass decorator reads the field
# annotations, and they must be real objects, as in the generator's module.
import typing

import torch
from tensordict import tensorclass

try:  # the TensorClass subclass syntax (tensordict 0.7+; the cross-version generator runs older)
    from tensordict import TensorClass
except ImportError:  # pragma: no cover - tensordict < 0.7
    TensorClass = None  # type: ignore[assignment,misc]

__all__ = ["FixtureTC", "FixtureTCSub", "Point"]


class Point:
    """A tiny custom class; not JSON-serialisable, so tensordict pickles it."""

    def __init__(self, x: typing.Any, y: typing.Any) -> None:
        self.x = x
        self.y = y

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Point) and (self.x, self.y) == (other.x, other.y)

    def __hash__(self) -> int:
        return hash((self.x, self.y))

    def __repr__(self) -> str:
        return f"Point(x={self.x!r}, y={self.y!r})"


@tensorclass
class FixtureTC:
    """The corpus's tensorclass: two tensor fields and two non-tensor fields."""

    obs: torch.Tensor
    reward: torch.Tensor
    label: str
    extra: typing.Any


if TensorClass is not None:

    class FixtureTCSub(TensorClass):  # type: ignore[misc,valid-type]
        """A tensorclass written with the subclass syntax (saved as a plain TensorDict by
        tensordict 0.10-0.13, format-notes.md G4); used by ``fixtures/extra`` only."""

        obs: torch.Tensor
        label: str

else:  # pragma: no cover - tensordict < 0.7
    FixtureTCSub = None
