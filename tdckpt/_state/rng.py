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

__all__ = ["MT_WORDS", "RandomState"]

#: MT19937's state words (Python's and NumPy's generators).
MT_WORDS = 624


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
        """Refuse a state that is not :meth:`state_dict`'s output, before setting anything.

        Every generator's state is checked as the generator itself would read it, on a
        scratch generator where one exists (so the process's generators are untouched):
        Python's version, its 625 words (each a 32-bit value, the last an index up to 624)
        and ``gauss``; torch's CPU state (size, dtype and content); NumPy's kind, its 624
        32-bit keys, ``pos`` (0..624: NumPy itself does not check it and reads out of
        bounds), ``has_gauss`` and ``cached_gaussian``; every CUDA state's shape and dtype.

        Raises:
            ValueError: naming every key that is wrong (``'numpy.pos'``, ...).
        """
        if not isinstance(state, dict):
            raise ValueError(f"not a RandomState state: expected a dict, got a {type(state)}")
        problems = [*_python_problems(state.get("python")), *_torch_problems(state.get("torch"))]
        if state.get("numpy") is not None:
            problems += _numpy_problems(state["numpy"])
        problems += _cuda_problems(state.get("cuda", []))
        unknown = sorted(map(repr, set(state) - {"python", "torch", "numpy", "cuda"}))
        if unknown:
            problems.append(f"unknown keys {', '.join(unknown)}")
        if problems:
            raise ValueError("not a RandomState state: " + "; ".join(problems))


def _is_int(value: Any) -> bool:
    return type(value) is int


def _words(tensor: Any, key: str, length: int) -> tuple[list[str], list[int]]:
    """``tensor`` as a list of ``length`` ints (an int64 vector), or the problems with it."""
    if not isinstance(tensor, torch.Tensor):
        return [f"{key!r} is a {type(tensor).__name__}, expected an int64 tensor"], []
    if tensor.dtype != torch.int64 or tuple(tensor.shape) != (length,):
        got = f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}"
        return [f"{key!r} is {got}, expected int64[{length}]"], []
    return [], [int(x) for x in tensor.tolist()]


def _python_problems(python: Any) -> list[str]:
    if not isinstance(python, dict):
        return [f"'python' is a {type(python).__name__}, expected Python's random state"]
    problems = []
    version = random.getstate()[0]
    if not _is_int(python.get("version")) or python["version"] != version:
        problems.append(f"'python.version' is {python.get('version')!r:.40}, expected {version}")
    gauss = python.get("gauss")
    if gauss is not None and type(gauss) is not float:
        problems.append(f"'python.gauss' is {gauss!r:.40}, expected None or a float")
    more, words = _words(python.get("state"), "python.state", MT_WORDS + 1)
    problems += more
    if words:
        bad = [i for i, w in enumerate(words[:-1]) if not 0 <= w < 2**32]
        if bad:
            problems.append(
                f"'python.state' holds {len(bad)} words outside 0..2**32-1 (first at {bad[0]})"
            )
        if not 0 <= words[-1] <= MT_WORDS:
            problems.append(f"'python.state' ends with index {words[-1]}, expected 0..{MT_WORDS}")
    if not problems:
        try:
            random.Random().setstate((version, tuple(words), gauss))
        except (ValueError, TypeError, OverflowError) as exc:
            problems.append(f"'python' is refused by random.setstate ({exc})")
    return problems


def _torch_problems(torch_state: Any) -> list[str]:
    expected = torch.get_rng_state()
    if not (
        isinstance(torch_state, torch.Tensor)
        and torch_state.shape == expected.shape
        and torch_state.dtype == expected.dtype
    ):
        return [f"'torch' is not a {expected.dtype} tensor of shape {tuple(expected.shape)}"]
    try:
        torch.Generator().set_state(torch_state.to("cpu").contiguous())
    except RuntimeError as exc:
        return [f"'torch' is refused by torch's generator ({exc})"]
    return []


def _numpy_problems(numpy_state: Any) -> list[str]:
    if not isinstance(numpy_state, dict):
        return [f"'numpy' is a {type(numpy_state).__name__}, expected NumPy's MT19937 state"]
    problems = []
    if numpy_state.get("kind") != "MT19937":
        problems.append(f"'numpy.kind' is {numpy_state.get('kind')!r:.40}, expected 'MT19937'")
    more, keys = _words(numpy_state.get("keys"), "numpy.keys", MT_WORDS)
    problems += more
    bad = [i for i, w in enumerate(keys) if not 0 <= w < 2**32]
    if bad:
        problems.append(
            f"'numpy.keys' holds {len(bad)} values outside 0..2**32-1 (first at {bad[0]})"
        )
    pos: Any = numpy_state.get("pos")
    if not _is_int(pos) or not 0 <= pos <= MT_WORDS:
        problems.append(f"'numpy.pos' is {pos!r:.40}, expected an int in 0..{MT_WORDS}")
    has_gauss = numpy_state.get("has_gauss")
    if not _is_int(has_gauss) or has_gauss not in (0, 1):
        problems.append(f"'numpy.has_gauss' is {has_gauss!r:.40}, expected 0 or 1")
    if type(numpy_state.get("cached_gaussian")) is not float:
        problems.append(
            f"'numpy.cached_gaussian' is {numpy_state.get('cached_gaussian')!r:.40}, "
            "expected a float"
        )
    unknown = set(numpy_state) - {"kind", "keys", "pos", "has_gauss", "cached_gaussian"}
    if unknown:
        problems.append(f"'numpy' has unknown keys {', '.join(sorted(map(repr, unknown)))}")
    return problems


def _cuda_problems(cuda: Any) -> list[str]:
    if not isinstance(cuda, list):
        return [f"'cuda' is a {type(cuda).__name__}, expected a list of generator states"]
    problems = []
    live = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for i, t in enumerate(cuda):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1:
            problems.append(f"'cuda.{i}' is not a uint8 vector (a CUDA generator's state)")
        elif i < live and t.shape != torch.cuda.get_rng_state(i).shape:
            expected = tuple(torch.cuda.get_rng_state(i).shape)
            problems.append(
                f"'cuda.{i}' has shape {tuple(t.shape)}, device {i}'s generator state {expected}"
            )
    return problems
