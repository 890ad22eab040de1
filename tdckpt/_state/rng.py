"""``RandomState``: one object with the state of every random generator a run draws from.

Python's :mod:`random`, NumPy's global generator (when NumPy is installed), torch's CPU
generator and, when CUDA is available, every CUDA device's default generator. Its
:meth:`~RandomState.state_dict` holds only tensors and plain values, so a training-state
step stores it without pickle.
"""

from __future__ import annotations

import random
from typing import Any

import torch

__all__ = ["RandomState"]


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy is optional
        return None
    return numpy


class RandomState:
    """The random generators of this process, as a ``state_dict`` / ``load_state_dict`` object.

    Save it with the rest of a training state and a resumed run draws the same random
    numbers (dropout masks, shuffles, augmentations) as an uninterrupted one.

    Args:
        cuda: include every CUDA device's default generator (when CUDA is available).

    Example:
        >>> import random, torch
        >>> from tdckpt import RandomState
        >>> rng = RandomState()
        >>> saved = rng.state_dict()
        >>> first = (random.random(), torch.rand(1).item())
        >>> rng.load_state_dict(saved)
        >>> (random.random(), torch.rand(1).item()) == first
        True
    """

    def __init__(self, *, cuda: bool = True) -> None:
        self.cuda = bool(cuda)

    def __repr__(self) -> str:
        return f"RandomState(cuda={self.cuda})"

    def _cuda_devices(self) -> int:
        if not self.cuda or not torch.cuda.is_available():
            return 0
        return int(torch.cuda.device_count())

    def state_dict(self) -> dict[str, Any]:
        """The state of every generator: tensors and plain values only."""
        version, internal, gauss = random.getstate()
        out: dict[str, Any] = {
            "python": {
                "version": version,
                "state": torch.tensor(internal, dtype=torch.int64),
                "gauss": gauss,
            },
            "torch": torch.get_rng_state(),
        }
        np = _numpy()
        if np is not None:
            kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
            out["numpy"] = {
                "kind": str(kind),
                "keys": torch.from_numpy(keys.astype(np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            }
        out["cuda"] = [torch.cuda.get_rng_state(i) for i in range(self._cuda_devices())]
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Set every generator from :meth:`state_dict`'s output.

        Saved CUDA generators are set on the devices present, in order; a machine with
        fewer devices sets the first ones (a CPU-only machine none).

        Raises:
            ValueError: ``state`` is not what :meth:`state_dict` returns (nothing is set).
        """
        self._check(state)
        python = state["python"]
        internal = tuple(int(x) for x in python["state"].tolist())
        gauss = python["gauss"]
        torch_state = state["torch"]
        numpy_state = state.get("numpy")
        np = _numpy()
        random.setstate((int(python["version"]), internal, gauss))
        torch.set_rng_state(torch_state.to("cpu", torch.uint8).contiguous())
        if numpy_state is not None and np is not None:
            np.random.set_state(
                (
                    numpy_state["kind"],
                    numpy_state["keys"].numpy().astype(np.uint32),
                    int(numpy_state["pos"]),
                    int(numpy_state["has_gauss"]),
                    float(numpy_state["cached_gaussian"]),
                )
            )
        for i, cuda_state in enumerate(list(state.get("cuda") or [])[: self._cuda_devices()]):
            torch.cuda.set_rng_state(cuda_state.to("cpu", torch.uint8).contiguous(), i)

    @staticmethod
    def _check(state: Any) -> None:
        """Refuse a state that is not :meth:`state_dict`'s output, before setting anything."""
        problems = []
        if not isinstance(state, dict):
            raise ValueError(f"expected RandomState.state_dict() output, got a {type(state)}")
        python = state.get("python")
        if not (
            isinstance(python, dict)
            and isinstance(python.get("state"), torch.Tensor)
            and python["state"].dim() == 1
            and isinstance(python.get("version"), int)
            and (python.get("gauss") is None or isinstance(python.get("gauss"), float))
        ):
            problems.append("'python' is not Python's random state")
        torch_state = state.get("torch")
        expected = torch.get_rng_state()
        if not (
            isinstance(torch_state, torch.Tensor)
            and torch_state.shape == expected.shape
            and torch_state.dtype == expected.dtype
        ):
            problems.append(
                f"'torch' is not a {expected.dtype} tensor of shape {tuple(expected.shape)}"
            )
        numpy_state = state.get("numpy")
        if numpy_state is not None and not (
            isinstance(numpy_state, dict)
            and isinstance(numpy_state.get("keys"), torch.Tensor)
            and numpy_state["keys"].shape == (624,)
            and numpy_state.get("kind") == "MT19937"
        ):
            problems.append("'numpy' is not NumPy's MT19937 state")
        cuda = state.get("cuda", [])
        if not isinstance(cuda, list) or not all(isinstance(t, torch.Tensor) for t in cuda):
            problems.append("'cuda' is not a list of generator states")
        if problems:
            raise ValueError("not a RandomState state: " + "; ".join(problems))
