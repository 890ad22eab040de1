"""Progress bars (tqdm) for the long operations: save, verify, upgrade.

The operations themselves only call a plain callback, ``progress(done, total)`` (save, verify:
bytes) or ``progress(done, total, what)`` (upgrade: operations). :class:`Bar` is the callback
that draws a tqdm bar on stderr, and only on a terminal: in a pipe, a log file or under
``--json`` it draws nothing. ``progress=True`` in the public API means "a :class:`Bar`".
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["Bar", "ProgressArg", "isatty", "progress_bar"]

#: What the public API accepts as ``progress``: a callback, True (a bar on a terminal),
#: or False / None (nothing).
ProgressArg = bool | Callable[..., None] | None


def isatty(stream: Any) -> bool:
    """Whether ``stream`` is a terminal (False for a closed, missing or odd stream)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def _clean(text: str) -> str:
    """``text`` with what a terminal must not interpret escaped (a hostile key name)."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)


class Bar:
    """A tqdm progress bar on stderr, drawn only when it is a terminal.

    Args:
        label: the bar's description (``"verify"``, ``"upgrade"``, ``"save"``).
        unit: ``"B"`` counts bytes (shown scaled: KiB, MiB, ...), anything else items.
        enabled: draw at all; default: stderr is a terminal.

    Call it as the operation's progress callback; :meth:`close` (or leaving a ``with``
    block) ends the line, also when the operation failed or was interrupted.
    """

    def __init__(self, label: str, *, unit: str = "B", enabled: bool | None = None) -> None:
        self.label = label
        self.unit = unit
        self.enabled = isatty(sys.stderr) if enabled is None else enabled
        self._bar: Any = None

    def __call__(self, done: int, total: int, what: str = "") -> None:
        if not self.enabled or total <= 0:
            return
        bar = self._bar
        if bar is None or bar.total != total:
            if bar is not None:
                bar.close()
            from tqdm import tqdm

            by_bytes = self.unit == "B"
            bar = self._bar = tqdm(
                total=total,
                desc=self.label,
                unit=self.unit,
                unit_scale=by_bytes,
                unit_divisor=1024 if by_bytes else 1000,
                file=sys.stderr,
                dynamic_ncols=True,
                leave=True,
            )
        if what:
            bar.set_postfix_str(_clean(what)[:40], refresh=False)
        bar.update(max(0, min(done, total)) - bar.n)
        if done >= total:
            self.close()

    def close(self) -> None:
        """End the bar's line (idempotent)."""
        bar, self._bar = self._bar, None
        if bar is not None:
            bar.close()

    def __enter__(self) -> Bar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def progress_bar(
    progress: ProgressArg, label: str, *, unit: str = "B"
) -> Iterator[Callable[..., None] | None]:
    """The callback for a public ``progress`` argument: True gives a :class:`Bar`.

    A bar made here is closed on leaving the block, also when the operation fails or is
    interrupted; a callback passed in is the caller's own and is left alone.
    """
    if progress is None or progress is False:
        yield None
        return
    if progress is True:
        with Bar(label, unit=unit) as bar:
            yield bar
        return
    if not callable(progress):
        raise TypeError(
            f"progress must be True, False, None or a callable, got a {type(progress).__name__}"
        )
    yield progress
