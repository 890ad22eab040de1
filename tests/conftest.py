"""Shared test helpers: the tensordict fixture corpus, case copies, tree digests, tiny TensorDicts.

The corpus lives in ``tests/fixtures/tensordict/<version>/<case>/`` with one
``<version>/manifest.json`` per tensordict release (see that folder's README.md). Tests never
touch the checked-in files: they restore from :func:`copy_case` copies in ``tmp_path``.

Typical use::

    from conftest import FIXTURES, case_id, copy_case, fixture_cases

    @pytest.mark.parametrize("fc", fixture_cases(versions=["0.15.3"]), ids=case_id)
    def test_restore(fc, tmp_path):
        target = copy_case(tmp_path, fc)
        ...

``tests/`` is put on ``sys.path`` here, so ``import fixture_types`` (the module the corpus's
pickles and tensorclass refer to) works in every test; :func:`subprocess_env` / the
``fixture_types_env`` fixture do the same for child processes.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import os
import shutil
import signal
import stat
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings

TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

# CI (``CI=true``) draws the same examples on every run, so a red run reproduces and a green
# one stays green for the same code; locally every run explores new ones (more with
# ``--fuzz-examples`` / ``TDCKPT_HYPOTHESIS_EXAMPLES``).
hypothesis_settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}:
    hypothesis_settings.load_profile("ci")

#: Trials per fault-injection loop (SIGKILL at random points, injected errors) when neither
#: ``--fault-trials`` nor ``TDCKPT_FAULT_TRIALS`` says otherwise (sized for CI).
DEFAULT_FAULT_TRIALS = 3

#: Examples per metadata-fuzzer test when neither ``--fuzz-examples`` nor the
#: ``TDCKPT_FUZZ_EXAMPLES`` environment variable says otherwise (sized for CI).
DEFAULT_FUZZ_EXAMPLES = 150


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fuzz-examples",
        type=int,
        default=None,
        metavar="N",
        help="examples per metadata-fuzzer test (tests/property/test_fuzz_metadata.py); "
        f"default: $TDCKPT_FUZZ_EXAMPLES or {DEFAULT_FUZZ_EXAMPLES}",
    )
    parser.addoption(
        "--fault-trials",
        type=int,
        default=None,
        metavar="N",
        help="trials per fault-injection loop (kills and injected errors at random points); "
        f"default: $TDCKPT_FAULT_TRIALS or {DEFAULT_FAULT_TRIALS}",
    )


@pytest.fixture(scope="session")
def fault_trials(request: pytest.FixtureRequest) -> int:
    """Trials per fault-injection loop: the option, else the env var, else the default."""
    value = request.config.getoption("--fault-trials")
    if value is None:
        env = os.environ.get("TDCKPT_FAULT_TRIALS", "").strip()
        value = int(env) if env else DEFAULT_FAULT_TRIALS
    if value < 1:
        raise pytest.UsageError(f"--fault-trials / TDCKPT_FAULT_TRIALS must be >= 1, got {value}")
    return int(value)


@pytest.fixture(scope="session")
def fuzz_examples(request: pytest.FixtureRequest) -> int:
    """``max_examples`` for the metadata fuzzer: the option, else the env var, else the default."""
    value = request.config.getoption("--fuzz-examples")
    if value is None:
        env = os.environ.get("TDCKPT_FUZZ_EXAMPLES", "").strip()
        value = int(env) if env else DEFAULT_FUZZ_EXAMPLES
    if value < 1:
        raise pytest.UsageError(f"--fuzz-examples / TDCKPT_FUZZ_EXAMPLES must be >= 1, got {value}")
    return int(value)


#: Root of the copied tensordict fixture corpus.
FIXTURES = TESTS_DIR / "fixtures" / "tensordict"
#: Root of the cross-version corpus: the same cases, written by the releases FIXTURES lacks
#: (``fixtures/extra/README.md``; ``fixtures/extra/generate.py`` wrote it).
EXTRA_FIXTURES = TESTS_DIR / "fixtures" / "extra"


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def _corpus_versions(root: Path) -> tuple[str, ...]:
    return tuple(
        sorted(
            (p.name for p in root.iterdir() if (p / "manifest.json").is_file()), key=_version_key
        )
    )


#: Every tensordict release in the corpus, oldest first.
VERSIONS: tuple[str, ...] = _corpus_versions(FIXTURES)
#: Every tensordict release in the cross-version corpus, oldest first.
EXTRA_VERSIONS: tuple[str, ...] = _corpus_versions(EXTRA_FIXTURES)


@functools.cache
def load_manifest(version: str, root: Path = FIXTURES) -> dict[str, Any]:
    """Return ``<root>/<version>/manifest.json`` (parsed once; treat it as read-only)."""
    return json.loads((root / version / "manifest.json").read_text(encoding="utf-8"))


class FixtureCase(NamedTuple):
    """One written case: unpacks as ``(version, name, case, target)``."""

    version: str
    name: str
    case: Mapping[str, Any]
    target: Path  # the checked-in ``<case>/ckpt`` directory or ``<case>/ckpt.tdz`` archive

    @property
    def id(self) -> str:
        return f"{self.version}-{self.name}"

    @property
    def expected(self) -> Mapping[str, Any]:
        return self.case["expected"]

    def reload(self, reader: str, call: str) -> Mapping[str, Any] | None:
        """The manifest's record of ``call`` (e.g. ``"TensorDict.load_memmap(prefix)"``).

        ``reader`` is ``"same_version"`` or ``"0.15.3"``; None when the call was not recorded.
        """
        section = self.case[
            "reload_same_version" if reader == "same_version" else f"reload_by_{reader}"
        ]
        for record in section["calls"]:
            if record["call"] == call:
                return record
        return None


def fixture_cases(
    *,
    versions: Iterable[str] | None = None,
    where: Callable[[FixtureCase], bool] | None = None,
    root: Path = FIXTURES,
) -> list[FixtureCase]:
    """Every case whose status is ``written``, oldest version first, in manifest order.

    Args:
        versions: restrict to these tensordict versions (default: every version under root).
        where: keep only the cases for which this returns True.
        root: the corpus, :data:`FIXTURES` (default) or :data:`EXTRA_FIXTURES`.

    Use with ``pytest.mark.parametrize("fc", fixture_cases(...), ids=case_id)``, or see
    :func:`fixture_params` for one argument per field.
    """
    have = VERSIONS if root == FIXTURES else _corpus_versions(root)
    chosen = have if versions is None else tuple(versions)
    unknown = set(chosen) - set(have)
    if unknown:
        raise ValueError(f"no fixtures for tensordict {sorted(unknown)}; have {list(have)}")
    out = []
    for version in chosen:
        for name, case in load_manifest(version, root)["cases"].items():
            if case.get("status") != "written":
                continue
            fc = FixtureCase(version, name, case, root / version / name / case["target"])
            if where is None or where(fc):
                out.append(fc)
    return out


def case_id(value: Any) -> str | None:
    """``ids=`` callable: ``"0.13.0-odd_keys__default"`` for a :class:`FixtureCase`."""
    return value.id if isinstance(value, FixtureCase) else None


def fixture_params(**kwargs: Any) -> list[Any]:
    """:func:`fixture_cases` as ``pytest.param(version, name, case, target, id=...)`` values.

    For ``@pytest.mark.parametrize(("version", "name", "case", "target"), fixture_params())``.
    """
    return [pytest.param(*fc, id=fc.id) for fc in fixture_cases(**kwargs)]


def copy_case(tmp_path: Path, version: str | FixtureCase, name: str | None = None) -> Path:
    """Copy a whole case folder into ``tmp_path`` and return the copied target.

    The whole ``<case>/`` folder is copied, not just the target: a few old writers put files
    next to the prefix (``files_outside_target`` in the manifest, e.g. a key ``".."``). The
    copy lands in ``tmp_path/<version>/<case>/`` and is made writable; the checked-in corpus is
    never modified.
    """
    if isinstance(version, FixtureCase):
        if name is not None:
            raise TypeError("copy_case(tmp_path, fixture_case) takes no name")
        fc = version
        version, name, case, src = fc.version, fc.name, fc.case, fc.target.parent
    elif name is None:
        raise TypeError("copy_case(tmp_path, version, name) needs a case name")
    else:
        case = load_manifest(version)["cases"][name]
        src = FIXTURES / version / name
    dst = Path(tmp_path) / version / name
    shutil.copytree(src, dst, symlinks=True)
    for root, dirs, files in os.walk(dst):
        for entry in (*dirs, *files):
            path = Path(root) / entry
            if not path.is_symlink():
                path.chmod(path.stat().st_mode | stat.S_IWUSR | stat.S_IRUSR)
    return dst / case["target"]


#: The writers whose JSON went through orjson (compact files; NaN and +-inf written as null).
ORJSON_WRITERS = ((0, 5, 0), (0, 15, 1))


def writer_losses(fc: FixtureCase) -> tuple[dict[str, Any], list[Any]]:
    """The case's ``expected`` as its writer could store it, and the ``lost=`` paths.

    ``expected`` is what the writer was asked to save. Some releases destroyed part of it on
    disk (fixtures/tensordict/README.md; format-notes.md §2.3, §3.1, G1), from the release's
    version and the case alone:

    * a child collection named ``".."`` or ``"."`` under raw (legacy) directory names (the
      writer then put files outside the prefix): ``".."`` went outside the checkpoint and
      ``"."`` over its parent's own files, so both keys are gone. Under ``meta.pt`` (<= 0.2)
      nothing lists the children either, so the leaves of ``"."`` read as the parent's;
    * ``non_tensor_lossy``: a tuple is stored as a JSON list; orjson writers
      (:data:`ORJSON_WRITERS`) stored NaN and +-inf as null;
    * a tensorclass written by a ``meta.pt`` release (<= 0.2): neither its class nor its
      non-tensor fields were stored; a ``TensorClass``-subclass instance written by 0.10-0.13:
      no class (a plain TensorDict directory).

    Returns a deep copy of ``expected`` without the destroyed entries, and the paths for
    ``assert_matches_expected(..., lost=...)``.
    """
    exp = copy.deepcopy(dict(fc.expected))
    release = _version_key(fc.version)
    meta_pt = release < (0, 3)
    lost: list[Any] = []
    if fc.name.startswith("odd_nested") and fc.case.get("files_outside_target"):
        entries = exp["entries"]
        entries.pop("..", None)
        dot = entries.pop(".", None)
        if meta_pt and dot is not None:
            entries.update(dot["entries"])
    if fc.name == "non_tensor_lossy":
        orjson = ORJSON_WRITERS[0] <= release <= ORJSON_WRITERS[1]
        lost = ["tuple", *(["f_nan", "f_inf"] if orjson else [])]
    if meta_pt and fc.name == "tensorclass":
        lost = [(), "label", "extra"]
    if meta_pt and fc.name == "tensorclass_in_td":
        lost = [("tc",), ("tc", "label"), ("tc", "extra")]
    if fc.name == "tensorclass_subclass_in_td" and (0, 10) <= release < (0, 14):
        lost = [("tc",)]  # TensorClass-subclass instances were saved as plain TensorDicts
    return exp, lost


def tree_digest(path: Path | str) -> dict[str, str]:
    """Return ``{relative POSIX path: sha256 hex}`` for every file under ``path``.

    A file ``path`` (a ``.tdz`` archive) gives ``{".": sha256}``. Symlinks are never followed:
    they are recorded as ``"symlink:<link text>"``. Compare two digests to prove that a prefix
    was not modified (same files, same bytes, nothing added or removed).
    """
    root = Path(path)

    def digest(p: Path) -> str:
        if p.is_symlink():
            return f"symlink:{os.readlink(p)}"
        h = hashlib.sha256()
        with p.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()

    if root.is_file() or root.is_symlink():
        return {".": digest(root)}
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        base = Path(dirpath)
        for entry in (*filenames, *(d for d in dirnames if (base / d).is_symlink())):
            p = base / entry
            out[p.relative_to(root).as_posix()] = digest(p)
    return dict(sorted(out.items()))


def subprocess_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Return a copy of ``os.environ`` whose ``PYTHONPATH`` starts with ``tests/``.

    Child processes can then ``import fixture_types`` (the corpus's pickles and tensorclass).
    """
    env = dict(os.environ)
    parts = [str(TESTS_DIR), *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
    env.update(extra or {})
    return env


@pytest.fixture
def fixture_types_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Export ``PYTHONPATH`` with ``tests/`` for child processes of this test; return the env."""
    env = subprocess_env()
    monkeypatch.setenv("PYTHONPATH", env["PYTHONPATH"])
    return env


def tiny_td(
    *,
    batch_size: Sequence[int] = (3,),
    nested: bool = True,
    non_tensor: bool = False,
    seed: int = 0,
) -> Any:
    """A small CPU TensorDict with deterministic contents.

    Keys: ``"a"`` float32 ``[*batch, 2]``, ``"b"`` int64 ``[*batch]``, plus (``nested``)
    ``("nested", "c")`` bool ``[*batch, 1]`` and (``non_tensor``) ``"s"`` = ``"hello"``.
    """
    import torch
    from tensordict import TensorDict

    gen = torch.Generator().manual_seed(seed)
    batch = list(batch_size)
    td = TensorDict(
        {
            "a": torch.randn(*batch, 2, generator=gen),
            "b": torch.arange(int(torch.Size(batch).numel()), dtype=torch.int64).reshape(batch),
        },
        batch_size=batch,
        device="cpu",
    )
    if nested:
        td["nested"] = TensorDict(
            {"c": torch.rand(*batch, 1, generator=gen) > 0.5}, batch_size=batch, device="cpu"
        )
    if non_tensor:
        td.set_non_tensor("s", "hello")
    return td


def fuzz_settings(examples: int) -> hypothesis_settings:
    """What every fuzzer runs with: ``examples`` examples (``--fuzz-examples``), no deadline
    (a mutant may be slow to refuse), no example database, no health check on slow or large
    draws (each example builds and reads a checkpoint)."""
    return hypothesis_settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


@contextlib.contextmanager
def alarm(seconds: int, error: BaseException) -> Iterator[None]:
    """Raise ``error`` in the body when it runs longer than ``seconds`` (SIGALRM), instead of
    hanging the suite: a blocking open of a FIFO, a lock waited on, a hostile input's loop."""

    def fire(signum: int, frame: object) -> None:
        raise error

    previous = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def no_hang() -> Iterator[None]:
    """Fail (instead of hanging the suite) when the test body blocks for 10 s."""
    with alarm(10, AssertionError("blocked for 10 s (a FIFO or a lock waited on?)")):
        yield
