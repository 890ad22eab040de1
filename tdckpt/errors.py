"""Every error a user can cause, in one tree.

::

    TdckptError(Exception)                       the CLI catches only this
    ├─ CheckpointNotFoundError(.., FileNotFoundError)
    ├─ CheckpointExistsError(.., FileExistsError)
    │  └─ CommitConflictError                    another writer committed the step first
    ├─ IncompleteCheckpointError                 no commit / leftover tmp folder
    ├─ UnsafePathError(.., ValueError)           a name that would leave the prefix
    ├─ MetadataError(.., ValueError)             unreadable or invalid metadata; .path .field
    │  └─ UnsupportedFormatError                 written by a newer tensordict / tdckpt
    ├─ ValidationError(.., ValueError)           a checkpoint with problems; .report
    ├─ UnsupportedContentError(.., ValueError)   a value the format cannot store (on save)
    ├─ PickleNotAllowedError(.., RuntimeError)   pickled data under allow_pickle=False
    ├─ MigrationError                            .from_version .to_version .script
    │  └─ MigrationChainError                    gap / duplicate / does not reach the end
    ├─ RestoreError                              target cannot take the checkpoint
    │  └─ IntegrityError                         checksum or size differs from the manifest
    ├─ LockError                                 another writer holds the root
    ├─ CollectiveError                           a rank of a sharded save died or failed
    ├─ AsyncSaveError                            a background save failed, unretrieved; .step
    └─ RemoteError                               an object store kept failing

Every message states what was found, what was expected and what to do, and names the
prefix, the key and the file involved. The same facts are kept as attributes.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AsyncSaveError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CollectiveError",
    "CommitConflictError",
    "IncompleteCheckpointError",
    "IntegrityError",
    "LockError",
    "MetadataError",
    "MigrationChainError",
    "MigrationError",
    "PickleNotAllowedError",
    "RemoteError",
    "RestoreError",
    "TdckptError",
    "UnsafePathError",
    "UnsupportedContentError",
    "UnsupportedFormatError",
    "ValidationError",
]


class TdckptError(Exception):
    """Root of every error tdckpt raises on purpose.

    Keyword arguments become attributes (``path``, ``key``, ...), so callers can act on
    the facts without parsing the message. ``__reduce__`` keeps them across pickling
    (errors cross process boundaries in multiprocessing data loaders).
    """

    def __init__(self, message: str, **facts: Any) -> None:
        super().__init__(message)
        self.message = message
        self.facts = facts
        for name, value in facts.items():
            setattr(self, name, value)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.message, self.facts))

    def __str__(self) -> str:
        return self.message


def _rebuild(cls: type[TdckptError], message: str, facts: dict[str, Any]) -> TdckptError:
    return cls(message, **facts)


class CheckpointNotFoundError(TdckptError, FileNotFoundError):
    """The prefix, step or file does not exist."""


class CheckpointExistsError(TdckptError, FileExistsError):
    """A step or destination already exists and overwriting was not asked for."""


class IncompleteCheckpointError(TdckptError):
    """A step was never committed (a crashed save left a temporary folder)."""


class UnsafePathError(TdckptError, ValueError):
    """A key or entry name would resolve outside the prefix (``..``, absolute, symlink)."""


class MetadataError(TdckptError, ValueError):
    """Metadata that cannot be read or does not fit the schema."""


class UnsupportedFormatError(MetadataError):
    """Metadata written by a newer format than this tdckpt reads."""


class ValidationError(TdckptError, ValueError):
    """A checkpoint has problems; ``report`` lists every one."""


class UnsupportedContentError(TdckptError, ValueError):
    """The object holds something the checkpoint format cannot store faithfully.

    Attributes:
        problems: one message per offending key (all of them, not just the first).
        keys: the nested keys concerned, in the same order.
    """


class PickleNotAllowedError(TdckptError, RuntimeError):
    """The checkpoint holds pickled data and ``allow_pickle`` is False.

    A ``RuntimeError`` too, as tensordict's own refusal is: code that catches tensordict's
    error catches tdckpt's.
    """


class MigrationError(TdckptError):
    """A migration step failed or cannot apply."""


class MigrationChainError(MigrationError):
    """The migration scripts do not form one contiguous chain to the current version."""


class RestoreError(TdckptError):
    """The target cannot take the checkpoint (kind, batch size, device or class differ)."""


class IntegrityError(RestoreError):
    """A file's size or checksum differs from what the manifest recorded."""


class LockError(TdckptError):
    """Another live writer holds the checkpoint root."""


class CollectiveError(TdckptError):
    """A collective save or restore failed: a rank died, timed out or raised.

    Attributes:
        rank: the rank reporting it (None before the group exists).
        phase: the protocol step that failed (``"gather shard records"``, ...).
    """


class AsyncSaveError(TdckptError):
    """A background save (``save_async``) failed and nobody retrieved its error.

    Raised by the next save and by ``close()``; the original error is ``__cause__``, and
    ``step`` names the step that was not committed.
    """


class RemoteError(TdckptError):
    """An object store kept failing (after retries), or cannot be opened."""


class CommitConflictError(CheckpointExistsError):
    """Another writer committed the same step first (object stores: the conditional create
    of the step's commit record failed); this save's data is not listed and gc removes it."""
