"""The pickle policy and its deprecation, in one place.

``allow_pickle``:

* ``True``  - pickled non-tensor data is loaded (trusted data only: pickle runs code);
* ``False`` - a checkpoint with pickled data is refused before anything is touched,
  naming every pickled key and file; nothing is ever unpickled;
* ``None``  - the default. Until the tensordict release in :data:`PICKLE_DEFAULT_FLIP`
  it loads with one :class:`~tdckpt.warnings.TdckptDeprecationWarning` (a
  ``FutureWarning``) per call; from that release on, it behaves as ``False``.

The flip is this one constant, compared with :func:`policy_version` through
``packaging.version``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Sequence
from types import FrameType

from packaging.version import Version

from tdckpt.errors import PickleNotAllowedError
from tdckpt.warnings import TdckptDeprecationWarning

__all__ = [
    "PICKLE_DEFAULT_FLIP",
    "PICKLE_WARNING_SINCE",
    "check_allow_pickle",
    "policy_version",
    "resolve_pickle_policy",
    "user_stacklevel",
]

#: The tensordict release from which ``allow_pickle=None`` means ``False``.
PICKLE_DEFAULT_FLIP = Version("0.16")
#: The tdckpt release that announced the flip.
PICKLE_WARNING_SINCE = "0.1"
#: The newest tensordict release whose format this tdckpt knows.
KNOWN_TENSORDICT = Version("0.15.3")

#: The tdckpt package directory (this module is tdckpt/_restore/policy.py).
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Frames of the stdlib context-manager machinery that tdckpt's own ``with`` blocks run
#: through (``@contextmanager`` generators are entered from ``contextlib``).
_GLUE_FILES = frozenset({os.path.abspath(contextlib.__file__)})


def _inside_package(filename: str) -> bool:
    directory = os.path.dirname(os.path.abspath(filename))
    return directory == _PACKAGE_DIR or directory.startswith(_PACKAGE_DIR + os.sep)


def policy_version() -> Version:
    """The tensordict release whose policy applies: the installed one, else the newest known."""
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover
        return KNOWN_TENSORDICT
    try:
        return Version(version("tensordict"))
    except (PackageNotFoundError, ValueError):
        return KNOWN_TENSORDICT


def check_allow_pickle(allow_pickle: object) -> None:
    """Refuse a non-bool, non-None ``allow_pickle`` (a common typo is ``"False"``).

    ``0``, ``1`` and NumPy bools are refused too, as tensordict refuses them, with the
    words of tensordict's TypeError ("allow_pickle must be a bool or None").
    """
    if allow_pickle is not None and not isinstance(allow_pickle, bool):
        raise TypeError(
            f"allow_pickle must be a bool or None (True, False or None), got {allow_pickle!r} "
            f"({type(allow_pickle).__module__}.{type(allow_pickle).__qualname__})."
        )


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning point at the first frame outside tdckpt.

    ``contextlib`` frames between tdckpt frames are skipped too: a warning raised inside
    one of tdckpt's ``@contextmanager`` blocks would otherwise point at ``contextlib.py``.
    """
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and (
        _inside_package(frame.f_code.co_filename)
        or os.path.abspath(frame.f_code.co_filename) in _GLUE_FILES
    ):
        frame = frame.f_back
        level += 1
    return level


def _describe(items: Sequence[tuple[tuple[str, ...], str]]) -> str:
    shown = [f"{'.'.join(key) or '<root>'} ({path})" for key, path in items[:10]]
    more = f" and {len(items) - 10} more" if len(items) > 10 else ""
    return ", ".join(shown) + more


def resolve_pickle_policy(
    allow_pickle: bool | None,
    pickled: Sequence[tuple[tuple[str, ...], str]],
    *,
    prefix: str,
) -> None:
    """Apply the policy to the pickled entries of a checkpoint (key, file); raise or warn.

    Called after validation and before anything is touched or unpickled.
    """
    check_allow_pickle(allow_pickle)
    if not pickled or allow_pickle is True:
        return
    listing = _describe(pickled)
    if allow_pickle is False:
        raise PickleNotAllowedError(
            f"{prefix}: refusing to load pickled non-tensor data under allow_pickle=False: "
            f"{listing}. Pickle can run arbitrary code. Pass allow_pickle=True only if you "
            "trust this checkpoint, or run `tdckpt upgrade --convert-pickles` on a trusted "
            "copy to store plain values as JSON.",
            prefix=prefix,
            keys=[key for key, _ in pickled],
            files=[path for _, path in pickled],
        )
    flipped = policy_version() >= PICKLE_DEFAULT_FLIP
    if flipped:
        raise PickleNotAllowedError(
            f"{prefix}: this checkpoint holds pickled non-tensor data ({listing}), and since "
            f"tensordict {PICKLE_DEFAULT_FLIP} the default allow_pickle=None refuses pickles. "
            "Pass allow_pickle=True if you trust this checkpoint (pickle can run arbitrary "
            "code), or run `tdckpt upgrade --convert-pickles` on a trusted copy.",
            prefix=prefix,
            keys=[key for key, _ in pickled],
            files=[path for _, path in pickled],
        )
    warnings.warn(
        TdckptDeprecationWarning(
            f"{prefix}: loading pickled non-tensor data ({listing}) because allow_pickle was "
            f"not given. Pickle can run arbitrary code. Starting with tensordict "
            f"{PICKLE_DEFAULT_FLIP}, the default becomes allow_pickle=False and this load "
            "will be refused. Pass allow_pickle=True to load trusted data, or "
            "allow_pickle=False to refuse pickles now.",
            since=PICKLE_WARNING_SINCE,
            removal=str(PICKLE_DEFAULT_FLIP),
        ),
        stacklevel=user_stacklevel(),
    )
