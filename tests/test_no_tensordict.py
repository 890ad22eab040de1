"""Everything on disk works without tensordict installed (design.md, Contracts).

Each test runs in a subprocess where ``import tensordict`` fails, as on a machine that
has only tdckpt's runtime dependencies.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import copy_case, load_manifest

_BLOCK = "import sys; sys.modules['tensordict'] = None\n"


def _run(code: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _BLOCK + code],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_tensordict_is_really_blocked() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _BLOCK + "import tensordict"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode != 0
    assert "ImportError" in out.stderr or "ModuleNotFoundError" in out.stderr


def test_load_memmap_returns_plain_nested_dicts(tmp_path: Path) -> None:
    prefix = copy_case(tmp_path, "0.15.3", "nested")
    result = _run(
        "import json, tdckpt\n"
        f"r = tdckpt.load_memmap({str(prefix)!r})\n"
        "def walk(x):\n"
        "    return {k: walk(v) if isinstance(v, dict)\n"
        "            else [str(v.dtype), list(v.shape), v.sum().item()] for k, v in x.items()}\n"
        "print(json.dumps(walk(r)))\n"
    )
    assert set(result) == {"top", "lvl1", "sibling"}
    expected = load_manifest("0.15.3")["cases"]["nested"]["expected"]["entries"]
    z = expected["lvl1"]["entries"]["lvl2"]["entries"]["lvl3"]["entries"]["z"]
    assert result["lvl1"]["lvl2"]["lvl3"]["z"][:2] == [z["dtype"], z["shape"]]
    assert result["top"][:2] == [expected["top"]["dtype"], expected["top"]["shape"]]


def test_load_memmap_into_a_plain_dict_reuses_nested_dicts(tmp_path: Path) -> None:
    prefix = copy_case(tmp_path, "0.15.3", "nested")
    result = _run(
        "import json, torch, tdckpt\n"
        "inner = {'x': torch.zeros(1), 'old': torch.zeros(1)}\n"
        "target = {'lvl1': inner, 'stale': torch.ones(2)}\n"
        f"out = tdckpt.load_memmap_(target, {str(prefix)!r})\n"
        "print(json.dumps({'same': out is target, 'reused': target['lvl1'] is inner,\n"
        "  'keys': sorted(target), 'inner_keys': sorted(inner)}))\n"
    )
    assert result == {
        "same": True,
        "reused": True,
        "keys": ["lvl1", "sibling", "top"],
        "inner_keys": ["lvl2", "x"],
    }


def test_validate_and_inspect_without_tensordict(tmp_path: Path) -> None:
    prefix = copy_case(tmp_path, "0.15.3", "lazy_stack")
    result = _run(
        "import json, tdckpt\n"
        f"r = tdckpt.validate({str(prefix)!r}); i = tdckpt.inspect({str(prefix)!r})\n"
        "print(json.dumps({'ok': r.ok, 'gen': i.generation, 'leaves': i.leaf_count}))\n"
    )
    assert result["ok"] is True
    assert result["gen"] == "G8"
    assert result["leaves"] == 9


@pytest.mark.parametrize("version", ["0.3.2", "0.12.4"])
def test_old_generations_restore_without_tensordict(tmp_path: Path, version: str) -> None:
    prefix = copy_case(tmp_path, version, "nested")
    result = _run(
        "import json, tdckpt\n"
        f"r = tdckpt.load_memmap({str(prefix)!r}, robust_key=None, allow_pickle=False)\n"
        "print(json.dumps(sorted(r)))\n"
    )
    assert result == ["lvl1", "sibling", "top"]
