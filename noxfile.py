"""The test matrix: ``nox`` runs every session, ``nox -s tests-0.14`` one of them.

Sessions (each in its own virtualenv, all on torch 2.13 CPU):

* ``tests-0.15``: the suite on the newest tensordict 0.15.x.
* ``tests-0.14``: the suite on the newest tensordict 0.14.x with torchrl 0.14.1 (TorchRL
  pins ``tensordict<0.15``, so every TorchRL user has 0.14); ``tests/test_torchrl.py``
  runs here.
* ``lint``: ``ruff check`` with the rules of pyproject.toml and ``ruff format --check``.
* ``typing``: ``mypy`` (strict, configured in pyproject.toml).
* ``docs``: the Sphinx site built with warnings as errors, and its examples run
  (``-b doctest``).

Arguments after ``--`` go to pytest (``nox -s tests-0.14 -- -x tests/test_restore.py``).
Reuse the virtualenvs with ``nox -r``.
"""

from __future__ import annotations

import os
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


def _tests(session: nox.Session, *extra: str, deselect: tuple[str, ...] = ()) -> None:
    session.install(TORCH, "-e", ".[test]", *extra)
    session.run(
        "python", "-c", "import tensordict, torch; print(tensordict.__version__, torch.__version__)"
    )
    junit = ROOT / ".nox" / f"junit-{session.name}.xml"
    session.run(
        "python",
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
        # its own temporary root, outside the checkout (tests/peer refuses test folders inside
        # this repository): sessions (or checkouts) running at once never share one
        f"--basetemp={tempfile.mkdtemp(prefix=f'tdckpt-{session.name}-')}",
        *(f"--deselect={test}" for test in deselect),
        *session.posargs,
        env={"PYTHONPATH": str(ROOT)},
    )


@nox.session(name="tests-0.15")
def tests_015(session: nox.Session) -> None:
    """The suite on the newest tensordict 0.15.x."""
    # mypy against 0.15 is the typing session's; tests-0.14 keeps test_typing (0.14's stubs).
    _tests(session, TENSORDICT["0.15"], deselect=("tests/test_typing.py",))


@nox.session(name="tests-0.14")
def tests_014(session: nox.Session) -> None:
    """The suite on the newest tensordict 0.14.x, with torchrl 0.14.1 (test_torchrl.py)."""
    _tests(session, TENSORDICT["0.14"], TORCHRL)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check (pyproject's rules) and ruff format --check over the whole tree."""
    session.install(RUFF)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typing(session: nox.Session) -> None:
    """mypy --strict (pyproject's [tool.mypy]) against the newest tensordict."""
    session.install(TORCH, "-e", ".[test]", TENSORDICT["0.15"])
    session.run("mypy")


@nox.session
def docs(session: nox.Session) -> None:
    """The Sphinx site with warnings as errors, then its examples (doctest builder)."""
    session.install(TORCH, "-e", ".[docs]", TENSORDICT["0.15"])
    out = Path(session.create_tmp())
    session.run("sphinx-build", "-W", "--keep-going", "-b", "html", "docs", os.fspath(out / "html"))
    session.run(
        "sphinx-build", "-W", "--keep-going", "-b", "doctest", "docs", os.fspath(out / "doctest")
    )
