"""The two warning categories tdckpt emits.

``TdckptWarning`` means "it worked, but ...": a stray file, a skipped incomplete step,
content the writer had already lost. ``TdckptDeprecationWarning`` announces a change of
default or behaviour, and carries when it was announced and when it takes effect.
Every warning is emitted with a ``stacklevel`` that points at the caller's line.
"""

from __future__ import annotations

__all__ = ["TdckptDeprecationWarning", "TdckptWarning"]


class TdckptWarning(UserWarning):
    """Something worked, but the user should know about it."""


class TdckptDeprecationWarning(FutureWarning):
    """A default or behaviour that will change.

    A ``FutureWarning`` subclass, so it is shown to end users by default (unlike
    ``DeprecationWarning``), as the change affects what their code does.

    Attributes:
        since: the release that announced the change.
        removal: the release in which the change takes effect.
    """

    def __init__(self, message: str, *, since: str, removal: str) -> None:
        super().__init__(message)
        self.message = message
        self.since = since
        self.removal = removal

    def __str__(self) -> str:
        return self.message
