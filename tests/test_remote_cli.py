# ruff: noqa: F811  (pytest fixtures imported from _remote_fixtures are parameters here)
"""The CLI on URLs: ``tdckpt ls / verify / gc / inspect / validate s3://...`` with
``--storage-option KEY=VALUE`` (issue 15)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

pytest.importorskip("fsspec")
from _remote_fixtures import Remote, _timeout, moto_s3, remote  # noqa: F401

from tdckpt import CheckpointManager
from tdckpt.cli import main

TensorDict = pytest.importorskip("tensordict").TensorDict


def _flags(r: Remote) -> list[str]:
    """The storage options as --storage-option flags (what a user types)."""
    if r.storage_options is None:
        return []
    so = r.storage_options
    return [
        "--storage-option",
        f"key={so['key']}",
        "--storage-option",
        f"secret={so['secret']}",
        "--storage-option",
        f"client_kwargs.endpoint_url={so['client_kwargs']['endpoint_url']}",
        "--storage-option",
        "client_kwargs.region_name=us-east-1",
        "--storage-option",
        "skip_instance_cache=true",
    ]


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    try:
        return code, json.loads(out.out), out.err
    except ValueError:
        return code, out.out, out.err


def test_ls_verify_gc_on_a_url(remote: Remote, capsys: pytest.CaptureFixture[str]) -> None:
    td = TensorDict(a=torch.arange(100.0), b=torch.ones(4, 4))
    with CheckpointManager(remote.url, storage_options=remote.storage_options) as mgr:
        mgr.save(3, td, metadata={"loss": 1.5})
        mgr.save(7, td)
    fs = remote.fs()
    fs.pipe_file(remote.path("9.attempt-" + "b" * 32 + "/data-0"), b"partial")

    code, rows, _ = _run(capsys, "ls", remote.url, "--json", *_flags(remote))
    assert code == 0
    assert [(r["step"], r["status"]) for r in rows] == [
        (3, "committed"),
        (7, "committed"),
        (9, "incomplete"),
    ]
    assert rows[0]["metadata"] == {"loss": 1.5}
    code, text, _ = _run(capsys, "ls", remote.url, *_flags(remote))
    assert code == 0 and "committed" in text and "incomplete" in text

    code, report, _ = _run(capsys, "verify", remote.url, "--step", "3", "--json", *_flags(remote))
    assert code == 0 and report["ok"] and report["step"] == 3

    code, removed, _ = _run(capsys, "gc", remote.url, "--json", *_flags(remote))
    assert code == 0 and removed == []  # within the grace period
    code, removed, _ = _run(
        capsys, "gc", remote.url, "--grace-period", "0", "--json", *_flags(remote)
    )
    assert code == 0 and removed == [remote.url + "/9.attempt-" + "b" * 32]

    # a damaged object: verify exits 1 and names the file
    record = json.loads(fs.cat_file(remote.path("7.tdckpt.json")))
    obj = remote.path(f"7.attempt-{record['attempt']}/{record['objects'][0]['name']}")
    data = bytearray(fs.cat_file(obj))
    data[-1] ^= 0xFF
    fs.pipe_file(obj, bytes(data))
    code, report, err = _run(capsys, "verify", remote.url, "--json", *_flags(remote))
    assert code == 1 and not report["ok"]
    assert {p["kind"] for p in report["problems"]} == {"changed"}
    assert "differ from what was saved" in err


def test_inspect_and_validate_a_plain_prefix_url(
    remote: Remote, capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    TensorDict(x=torch.zeros(5, 2), batch_size=[5]).memmap(tmp_path / "p")
    remote.fs().put(str(tmp_path / "p"), remote.path("p"), recursive=True)
    url = remote.url + "/p"
    code, info, _ = _run(capsys, "inspect", url, "--json", *_flags(remote))
    assert code == 0 and info["prefix"] == url and info["leaf_count"] == 1
    code, report, _ = _run(capsys, "validate", url, "--json", *_flags(remote))
    assert code == 0 and report["ok"]
    code, plan, _ = _run(capsys, "upgrade", url, "--dry-run", "--json", *_flags(remote))
    assert code == 0 and plan["dry_run"]


def test_storage_options_are_refused_for_local_paths(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["ls", str(tmp_path), "--storage-option", "anon=true"])
    assert exit_info.value.code == 2
    assert "--storage-option is for fsspec URLs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["ls", "s3://b/x", "--storage-option", "novalue"])
    assert "expected KEY=VALUE" in capsys.readouterr().err
