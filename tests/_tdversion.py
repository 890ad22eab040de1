"""Which tensordict the suite runs against, and what that release's own reader and writer do.

tdckpt supports every tensordict minor that pyproject allows (0.14.x and 0.15.x; the
``tests-0.14`` and ``tests-0.15`` nox sessions run the whole suite on each). Tests that
compare tdckpt with tensordict's own ``load_memmap`` / ``load_memmap_`` / ``memmap``, or
with checkpoints the installed tensordict writes, ask here what to expect instead of
assuming 0.15.3. No test is skipped because the installed tensordict is older: where
0.14 lacks a feature (the ``mode=`` argument of ``load_memmap_``, copy-on-write
directories), the test compares with what 0.14 does instead.

Facts are detected from the installed package where they can be (signatures), and taken
from the release notes (/work/shared/format-notes.md, section G6-G8) where they cannot.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from packaging.version import Version

try:
    import tensordict
    from tensordict import TensorDict
except ImportError:  # pragma: no cover - the no-tensordict tests import nothing from here
    tensordict = None
    TensorDict = None

__all__ = [
    "LOAD_MEMMAP__TAKES_MODE",
    "READS_JSON_TYPES",
    "TD_VERSION",
    "WRITER_GENERATION",
    "WRITES_FORMAT_VERSION",
    "WRITES_ORJSON",
    "as_installed_warning",
    "reference_load_kwargs",
    "writer_nulls",
]

#: The installed tensordict's version (None without tensordict).
TD_VERSION: Version | None = Version(tensordict.__version__) if tensordict is not None else None


def _takes(func: Any, name: str) -> bool:
    try:
        return name in inspect.signature(func).parameters
    except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
        return False


#: ``TensorDict.load_memmap_(prefix, mode=...)`` exists (0.15.0+; 0.14 has no ``mode``).
LOAD_MEMMAP__TAKES_MODE: bool = TensorDict is not None and _takes(TensorDict.load_memmap_, "mode")
#: ``TensorDict.load_memmap(prefix, mode=None)`` is accepted (0.15; 0.14 takes "r"/"r+" only,
#: with "r" the default, and applies it to archives only: directories are always shared).
LOAD_MEMMAP_TAKES_MODE_NONE: bool = (
    TensorDict is not None
    and inspect.signature(TensorDict.load_memmap).parameters["mode"].default is None
)

#: meta.json carries ``"_format_version": 1`` and ``"_class"`` (0.15.3+, generation G8).
WRITES_FORMAT_VERSION: bool = TD_VERSION is not None and Version("0.15.3") <= TD_VERSION
#: The loader reads json_types.json (0.15.0+), the sidecar that names the container types
#: a types-only other.pickle holds, so it needs no unpickling; 0.14 has to unpickle them.
READS_JSON_TYPES: bool = TD_VERSION is not None and Version("0.15") <= TD_VERSION
#: The writer is orjson (compact JSON, NaN/inf written as null): up to 0.15.1, when orjson
#: is importable; 0.15.2 switched to the standard library (NaN, Infinity and spaces).
WRITES_ORJSON: bool
try:
    import orjson  # noqa: F401

    WRITES_ORJSON = TD_VERSION is not None and Version("0.15.2") > TD_VERSION
except ImportError:
    WRITES_ORJSON = False

#: The generation tdckpt detects in what the installed tensordict writes.
WRITER_GENERATION: str | None = (
    None
    if TD_VERSION is None
    else "G8"
    if WRITES_FORMAT_VERSION
    else "G7"
    if Version("0.15.0") <= TD_VERSION
    else "G6"
)


def reference_load_kwargs(
    mode: str | None, prefix: str | Path, *, in_place: bool
) -> dict[str, Any] | None:
    """Arguments that make the installed tensordict's loader map leaves as tdckpt's ``mode``.

    ``in_place`` selects ``load_memmap_`` (else ``load_memmap``). Returns None when the
    installed tensordict cannot map that way (0.14: directories are always mapped shared and
    writable, so there is no copy-on-write ``mode="r"`` for them; ``load_memmap_`` takes no
    ``mode`` at all, so an archive is always copy-on-write there). The caller then compares
    with what that tensordict does by default (``{}``), contents only.
    """
    if LOAD_MEMMAP__TAKES_MODE or (not in_place and LOAD_MEMMAP_TAKES_MODE_NONE):
        return {"mode": mode}  # 0.15: the same argument, the same meaning
    archive = not Path(prefix).is_dir()
    if not archive:
        # 0.14 maps a directory shared (tensordict 0.15's mode=None on a writable file).
        return {} if mode is None else None
    # 0.14 archives: "r" (the default) is copy-on-write, "r+" shared; None means "r+" on a
    # writable archive for tdckpt (as tensordict 0.15), which load_memmap_ cannot express.
    if mode == "r":
        return {} if in_place else {"mode": "r"}
    return None


#: The release that tensordict's own pickle FutureWarning names as the one where
#: ``allow_pickle=False`` becomes the default: 0.14 says "TensorDict 0.15", 0.15 says 0.16.
PICKLE_WARNING_FLIP: str = (
    "0.15" if TD_VERSION is not None and Version("0.15") > TD_VERSION else "0.16"
)


def as_installed_warning(message: str) -> str:
    """A warning text recorded with tensordict 0.15.3 (the corpus manifests), as the
    installed tensordict words it (its pickle FutureWarning names another release)."""
    return message.replace(
        "Starting with TensorDict 0.16,", f"Starting with TensorDict {PICKLE_WARNING_FLIP},"
    )


@contextmanager
def writer_nulls(calls: int = 1) -> Iterator[None]:
    """Expect tdckpt's TdckptWarning that the writer's nulls may have been NaN or inf, once
    per restore in the block, when the installed tensordict writes orjson (0.14 - 0.15.1);
    nothing otherwise. For checkpoints the installed tensordict writes with a ``None`` in a
    non-tensor value."""
    if not WRITES_ORJSON:
        yield
        return
    import pytest

    from tdckpt.warnings import TdckptWarning

    with pytest.warns(TdckptWarning, match=r"holds null, written by orjson") as rec:
        yield
    assert len(rec) == calls, [str(w.message) for w in rec]


@contextmanager
def old_writer_losses() -> Iterator[None]:
    """Allow tdckpt's TdckptWarning about what a writer before format version 1 may have
    lost (orjson nulls, tuples written as lists): generated content (property tests) holds
    such values at random; the warning itself is tested where the content is known."""
    if WRITES_FORMAT_VERSION:
        yield
        return
    import warnings

    from tdckpt.warnings import TdckptWarning

    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore",
            r".*: restored what the checkpoint holds, but the tensordict release",
            TdckptWarning,
        )
        yield
