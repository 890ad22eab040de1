"""The step protocol: what a :class:`~tdckpt.manager.CheckpointManager` asks of any root.

A root holds numbered steps. A step is written into an *attempt* that nobody lists, then
committed by one atomic act - a rename on a file system, a conditional create of a commit
record on object storage - so a writer killed at any instant leaves every committed step
intact and nothing half-written listed. Deleting a step (retention) *retires* it first (it
stops being listed at once), then removes its data; garbage collection removes what crashed
attempts and interrupted deletions left, and never anything a step record may name.

Two implementations: :class:`tdckpt._store.local.LocalStepStore` (a folder: ``<step>/``,
``<step>.tdz``) and :class:`tdckpt._store.objects.ObjectStepStore` (an fsspec URL). A caller
asks :attr:`StepStore.capabilities` what a store can do; it never tests its type.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from tdckpt._manage.steps import StepStatus
from tdckpt._manage.verify import Progress, VerifyReport
from tdckpt.errors import CheckpointExistsError
from tdckpt.schema import Manifest, StateRecord

if TYPE_CHECKING:
    from tdckpt._read.storage import Storage

__all__ = ["Attempt", "Capabilities", "StepRecord", "StepStore"]


@dataclass(frozen=True)
class Capabilities:
    """What a store can do; callers ask these instead of testing the store's type.

    Attributes:
        atomic_rename: a commit is a rename, so a committed step can be replaced
            atomically (``overwrite=True``).
        file_backed: a committed step's files are read in place (mapped); writes through a
            shared mapping (``mode="r+"``) reach them.
        collective: several processes (the ranks of a group) can write the parts of one
            step (a shared file system); a step can be sharded.
        verifies_reads: every byte a restore reads was checked against the manifest on the
            way (``verify=True`` has nothing to add).
        archives: steps can be saved as one ``.tdz`` archive each.
    """

    atomic_rename: bool
    file_backed: bool
    collective: bool
    verifies_reads: bool
    archives: bool


@dataclass(frozen=True)
class StepRecord:
    """One committed step: its number, what names it to a user, and its manifest."""

    step: int
    where: Path | str  # a folder / archive of a local root, the URL of a step's data
    manifest: Manifest
    handle: Any = None  # the store's own record of the step (a commit record, ...)


@dataclass
class Attempt:
    """A step being written: ``where`` is the attempt nobody lists (a staging folder, an
    attempt prefix); ``pending`` is what the store keeps until :meth:`StepStore.commit`."""

    step: int
    where: Path | str
    overwrite: bool
    pending: Any = None
    #: listings the write made that the commit's check may reuse (object storage: the
    #: earlier steps' prefixes whose objects an incremental save refers to)
    listed: dict[str, Any] = field(default_factory=dict)


class StepStore(Protocol):
    """The seam under the manager (see the module docstring)."""

    @property
    def root(self) -> Path | str:
        """The root as the user named it (a Path for a folder, the URL for object storage)."""
        ...

    @property
    def capabilities(self) -> Capabilities: ...

    # -- listing ---------------------------------------------------------------------------
    def records(self) -> dict[int, StepRecord]:
        """The committed steps (a valid manifest / commit record)."""
        ...

    def resolve(self, step: int | None) -> StepRecord:
        """The committed ``step`` (None: the latest); CheckpointNotFoundError /
        IncompleteCheckpointError (a step-named entry tdckpt cannot read) otherwise."""
        ...

    def damaged(self, step: int) -> VerifyReport | None:
        """A report of the problem when ``step`` is named but not readable, else None."""
        ...

    def statuses(self) -> list[StepStatus]:
        """Every step-like entry, committed, damaged or incomplete (``tdckpt ls``)."""
        ...

    def exists(self) -> bool:
        """Whether the root exists at all (a local folder not yet created: no)."""
        ...

    # -- exclusive writing -----------------------------------------------------------------
    def lock(self) -> None:
        """Take (or check and extend) the single-writer lock: LockError if another holds it."""
        ...

    def unlock(self) -> None: ...

    # -- writing ---------------------------------------------------------------------------
    def existing(self, step: int) -> bool:
        """Whether anything occupies ``step`` (a save without ``overwrite`` refuses it)."""
        ...

    def exists_error(self, step: int) -> CheckpointExistsError: ...

    def commit_point(self, step: int) -> Path | str:
        """What the commit of ``step`` creates (its folder, its commit record): messages
        about a committed step name it."""
        ...

    def begin(self, step: int, *, overwrite: bool) -> Attempt:
        """Open an attempt for ``step`` that nobody lists (refuses an existing step unless
        ``overwrite``)."""
        ...

    def write(
        self,
        attempt: Attempt,
        obj: Any,
        *,
        metadata: dict[str, Any] | None,
        state: StateRecord | None,
        progress: Progress | None,
        incremental: bool = False,
    ) -> None:
        """Write ``obj`` (an object, or a staged snapshot of one) into the attempt.

        ``incremental``: what the latest committed step already holds is not written
        again; the new step shares it (a linked file, a reference to an earlier object)."""
        ...

    def commit(self, attempt: Attempt, *, stacklevel: int) -> Path | str:
        """Commit the attempt by one atomic act; return what names the step."""
        ...

    def abort(self, attempt: Attempt) -> None:
        """Drop an attempt that will not be committed (best effort; gc finishes)."""
        ...

    # -- deleting --------------------------------------------------------------------------
    def retire(self, records: list[StepRecord]) -> list[Any]:
        """Make these steps unlisted now (their data is removed by :meth:`remove`)."""
        ...

    def remove(self, retired: list[Any], *, stacklevel: int) -> list[Path | str]:
        """Delete retired steps' data; what cannot be deleted is left for gc (a warning)."""
        ...

    def gc(self, grace_period: float | None, *, stacklevel: int) -> list[Path | str]:
        """Remove what crashed writes and deletions left and nothing may name."""
        ...

    def shared_bytes(self) -> dict[int, int]:
        """``step -> bytes of its files that another committed step names too`` (what
        incremental saves share)."""
        ...

    # -- reading ---------------------------------------------------------------------------
    def open(
        self, record: StepRecord, *, writes: bool = False
    ) -> contextlib.AbstractContextManager[Path | Storage]:
        """What a restore reads the step from, while the block runs: a local folder or
        archive, or a :class:`~tdckpt._read.storage.Storage` reading the store in place.

        ``writes``: the restore maps files shared and writable (``mode="r+"``): a file the
        step shares with another step is first given a private copy, so writes reach this
        step only."""
        ...

    def verify(
        self, record: StepRecord, progress: Progress | None, *, shared: dict[Any, Any] | None = None
    ) -> VerifyReport:
        """Re-read every byte of the step and compare it with the manifest. ``shared``:
        filled and consulted across the steps of one verification, so what several steps
        share (incremental saves) is read once."""
        ...
