"""The test matrix: ``nox`` runs every session, ``nox -s tests-0.14`` one of them.

Run it from the README's virtualenv (``.venv/bin/nox``): the sessions that need only what
``pip install -e '.[test]'`` put there run in that interpreter (the one nox runs from), so
torch is installed once, not once per session; only ``tests-0.14`` (and ``lint``, for its
pinned ruff) gets a virtualenv of its own.

* ``tests-0.15`` (nox's interpreter): the suite on tensordict 0.15.x, the newest that
  ``[test]`` installs; it stops with the fix if that interpreter has another tensordict.
* ``tests-0.14`` (own virtualenv, torch 2.13 CPU): the suite on the newest tensordict 0.14.x
  with torchrl 0.14.1 (TorchRL pins ``tensordict<0.15``, so every TorchRL user has 0.14);
  ``tests/test_torchrl.py`` runs here.
* ``lint`` (own virtualenv): ``ruff check`` with the rules of pyproject.toml and
  ``ruff format --check``.
* ``typing`` (nox's interpreter): ``mypy`` (strict, configured in pyproject.toml).
* ``docs`` (nox's interpreter): the Sphinx site built with warnings as errors, and its
  examples run (``-b doctest``).

The test sessions spread the suite over one pytest-xdist worker per CPU (``-n auto``);
arguments after ``--`` go to pytest and override that (``nox -s tests-0.14 -- -n 0 -x
tests/test_restore.py``). More fault-injection trials: ``-- --fault-trials 50``. Reuse the
virtualenvs with ``nox -r``.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.error_on_missing_interpreters = True

ROOT = Path(__file__).resolve().parent
#: The CPU build of torch that pip finds here; a looser pin pulls the CUDA wheels (GBs).
TORCH = "torch==2.13.0"
#: tensordict minors that pyproject's ``tensordict>=0.14`` allows, newest patch of each.
TENSORDICT = {"0.15": "tensordict>=0.15,<0.16", "0.14": "tensordict>=0.14,<0.15"}
#: TorchRL's newest release; it requires tensordict 0.14.
TORCHRL = "torchrl==0.14.1"
#: The ruff whose rules the tree is clean under (newer minors add rules).
RUFF = "ruff>=0.17,<0.18"
#: The interpreter nox runs from: the README's ``.venv`` (``pip install -e '.[test]'``).
HERE = sys.executable


def _require_here(session: nox.Session, *requirements: str) -> None:
    """Stop ``session`` (run in nox's interpreter) unless that interpreter has ``requirements``."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.requirements import Requirement

    bad, found = [], []
    for spec in requirements:
        req = Requirement(spec)
        try:
            have: str | None = version(req.name)
        except PackageNotFoundError:
            have = None
        if have is None or not req.specifier.contains(have, prereleases=True):
            bad.append(f"{req.name} {have or '(not installed)'}, needs {spec}")
        found.append(f"{req.name} {have}")
    if bad:
        fix = " ".join(repr(spec) for spec in requirements)
        session.error(
            f"{HERE} has {'; '.join(bad)}: run nox from the README's virtualenv "
            f"(pip install -e '.[test]'), or pip install {fix} there"
        )
    session.log(f"in {HERE}: {', '.join(found)}")


def _basetemp(session: nox.Session) -> Path:
    """The test session's temporary root: ``<tmp>/tdckpt-<session>-<checkout hash>``."""
    checkout = hashlib.sha256(str(ROOT).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"tdckpt-{session.name}-{checkout}"


def _pytest(session: nox.Session, python: str, *, deselect: tuple[str, ...] = ()) -> None:
    # The suite starts a few hundred interpreters (crash children, CLI runs, ranks): each would
    # compile tdckpt (and, in tests-0.14, torch: installed --no-compile) from source again where
    # PYTHONDONTWRITEBYTECODE is set; they write and share the __pycache__ folders instead
    # (ignored by git, left out of the wheel). The first run below fills them for torch.
    env = {"PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": None}
    session.run(
        python,
        "-c",
        "import tdckpt.cli, tdckpt.manager, tensordict, torch;"
        " print(tensordict.__version__, torch.__version__)",
        env=env,
        external=True,
    )
    junit = ROOT / ".nox" / f"junit-{session.name}.xml"
    session.run(
        python,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        # one worker per CPU; a test that is long comes early, and an idle worker takes
        # tests still queued on the other (``-- -n 0`` runs in one process)
        "-n",
        "auto",
        "--dist",
        "worksteal",
        f"--junitxml={junit}",
        # its own temporary root, outside the checkout (tests/peer refuses test folders inside
        # this repository), one per session and checkout: sessions (or checkouts) running at
        # once never share one, and pytest empties it at the start of the next run, so a run
        # leaves one folder to inspect (about 1 GiB) instead of one more per run
        f"--basetemp={_basetemp(session)}",
        *(f"--deselect={test}" for test in deselect),
        *session.posargs,
        env=env,
        external=True,
    )


@nox.session(name="tests-0.15", venv_backend="none")
def tests_015(session: nox.Session) -> None:
    """The suite on the newest tensordict 0.15.x (nox's interpreter: the README's venv)."""
    _require_here(session, TENSORDICT["0.15"], "pytest-xdist")
    # mypy against 0.15 is the typing session's; tests-0.14 keeps test_typing (0.14's stubs).
    _pytest(session, HERE, deselect=("tests/test_typing.py",))


@nox.session(name="tests-0.14")
def tests_014(session: nox.Session) -> None:
    """The suite on the newest tensordict 0.14.x, with torchrl 0.14.1 (test_torchrl.py)."""
    # --no-compile: Python compiles (and caches) what the suite imports, not all of torch
    session.install("--no-compile", TORCH, "-e", ".[test]", TENSORDICT["0.14"], TORCHRL)
    _pytest(session, "python")


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check (pyproject's rules) and ruff format --check over the whole tree."""
    session.install(RUFF)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(venv_backend="none")
def typing(session: nox.Session) -> None:
    """mypy --strict (pyproject's [tool.mypy]) against the newest tensordict (nox's interpreter)."""
    _require_here(session, TENSORDICT["0.15"], "mypy")
    session.run(HERE, "-m", "mypy", external=True)


@nox.session(venv_backend="none")
def docs(session: nox.Session) -> None:
    """The Sphinx site with warnings as errors, then its examples (doctest builder)."""
    _require_here(session, TENSORDICT["0.15"], "sphinx", "furo")
    out = Path(session.create_tmp())
    for builder in ("html", "doctest"):
        session.run(
            HERE,
            "-m",
            "sphinx",
            "-W",
            "--keep-going",
            "-b",
            builder,
            "docs",
            os.fspath(out / builder),
            external=True,
        )
