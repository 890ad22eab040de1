"""The wheel ships what tdckpt needs at run time: migrations, the demo checkpoint, py.typed.

``migrations/`` lives at the repo root (one script per step, as alembic keeps
``versions/``) and is force-included into the wheel as ``tdckpt/_migrations``; hatchling's
force-include skips exclude rules, so the file list is checked here.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    pytest.importorskip("hatchling")
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = out.glob("tdckpt-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        return zf.namelist()


def test_wheel_ships_every_migration_script(wheel_names: list[str]) -> None:
    scripts = sorted(p.name for p in (ROOT / "migrations").glob("[0-9][0-9][0-9][0-9]_*.py"))
    assert scripts, "no migration scripts found in migrations/"
    shipped = sorted(
        n.rsplit("/", 1)[1]
        for n in wheel_names
        if n.startswith("tdckpt/_migrations/") and n.endswith(".py")
    )
    assert shipped == scripts


def test_wheel_ships_demo_checkpoint_and_typing_marker(wheel_names: list[str]) -> None:
    assert "tdckpt/py.typed" in wheel_names
    assert "tdckpt/_demo/tensordict-0.3.2-nested/meta.json" in wheel_names
    assert "tdckpt/_demo/tensordict-0.3.2-nested/lvl1/lvl2/lvl3/z.memmap" in wheel_names


def test_wheel_has_no_tests_or_caches(wheel_names: list[str]) -> None:
    assert not [
        n for n in wheel_names if n.startswith("tests/") or "__pycache__" in n or n.endswith(".pyc")
    ]
