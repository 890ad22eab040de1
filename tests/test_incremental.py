"""Incremental saves on a local root: unchanged leaves are linked, never written again.

Every test uses real files, real tensordict loading and the real manager; what is checked is
on disk (inodes, link counts, modes, ``du``) and in the restored values.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from tdckpt import CheckpointManager
from tdckpt.errors import RestoreError
from tdckpt.retention import KeepLast

MiB = 1 << 20


def _state(n: int = 4, numel: int = 1024) -> TensorDict:
    return TensorDict(
        {f"w{i}": torch.arange(numel, dtype=torch.float32) + i for i in range(n)}
        | {"nested": TensorDict(ids=torch.arange(64, dtype=torch.int64))}
    )


def _ino(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _plain(path: Path) -> TensorDict:
    """The step as plain tensordict loads it, copied out of the mapping."""
    return TensorDict.load_memmap(path).clone()


def test_unchanged_leaves_are_linked_read_only_and_load_with_plain_tensordict(
    tmp_path: Path,
) -> None:
    td = _state()
    with CheckpointManager(tmp_path, incremental=True, fsync=False) as mgr:
        first = mgr.save(1, td)
        td["w1"] += 1
        second = mgr.save(2, td)
        assert mgr.verify(1).ok and mgr.verify(2).ok
    for rel in ("w0.memmap", "w2.memmap", "w3.memmap", "nested/ids.memmap"):
        assert _ino(first / rel) == _ino(second / rel), rel
        assert os.stat(second / rel).st_nlink == 2
    assert _ino(first / "w1.memmap") != _ino(second / "w1.memmap")
    for step in (first, second):
        for name in ("w0.memmap", "w1.memmap", "nested/ids.memmap"):
            assert stat.S_IMODE(os.stat(step / name).st_mode) == 0o444, name
        # meta.json and the manifest are never shared: written afresh, writable
        assert os.stat(step / "meta.json").st_nlink == 1
    assert (_plain(first)["w1"] == torch.arange(1024) + 1).all()
    assert (_plain(second)["w1"] == torch.arange(1024) + 2).all()
    assert (_plain(second) == td).all()


def test_a_changed_leaf_of_the_same_size_dtype_or_shape_is_written(tmp_path: Path) -> None:
    td = TensorDict(a=torch.zeros(16, dtype=torch.int32), b=torch.zeros(4, 4), c=torch.ones(8))
    with CheckpointManager(tmp_path, incremental=True, fsync=False) as mgr:
        one = mgr.save(1, td)
        # same bytes, other dtype; same bytes, other shape; same size, other bytes
        td2 = TensorDict(a=torch.zeros(16, dtype=torch.float32), b=torch.zeros(16), c=td["c"] * 2)
        two = mgr.save(2, td2)
        assert mgr.verify(2).ok
    for name in ("a.memmap", "b.memmap", "c.memmap"):
        assert _ino(one / name) != _ino(two / name), name
    restored = _plain(two)
    assert restored["a"].dtype == torch.float32 and restored["b"].shape == (16,)
    assert (restored["c"] == 2).all()


def test_files_of_a_full_save_are_never_shared(tmp_path: Path) -> None:
    """A writable file (a save without incremental) may be mapped writable by someone: an
    incremental save that follows writes its own copy."""
    td = _state()
    with CheckpointManager(tmp_path, fsync=False) as mgr:
        one = mgr.save(1, td)
        two = mgr.save(2, td, incremental=True)
        three = mgr.save(3, td, incremental=True)
    assert stat.S_IMODE(os.stat(one / "w0.memmap").st_mode) & 0o200
    assert _ino(one / "w0.memmap") != _ino(two / "w0.memmap")
    assert _ino(two / "w0.memmap") == _ino(three / "w0.memmap")


def _du(path: Path) -> int:
    """Bytes of disk the tree uses, as ``du`` counts them (each inode once)."""
    out = subprocess.run(["du", "-s", "-B1", str(path)], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[0])


def test_ten_steps_with_one_percent_changed_grow_the_root_by_the_changed_bytes(
    tmp_path: Path,
) -> None:
    leaves, leaf = 100, MiB
    td = TensorDict({f"l{i:03d}": torch.zeros(leaf // 4) + i for i in range(leaves)})
    with CheckpointManager(tmp_path, incremental=True, fsync=False) as mgr:
        mgr.save(0, td)
        base = _du(tmp_path)
        changed = 0
        for step in range(1, 10):
            td[f"l{step:03d}"] += 1  # one leaf of 100: 1% of the bytes
            changed += leaf
            mgr.save(step, td)
        grown = _du(tmp_path) - base
        for step in (0, 5, 9):
            assert mgr.verify(step).ok
        assert (mgr.restore(9) == td).all()
    print(
        f"\n10 incremental steps of {leaves * leaf / MiB:.0f} MiB, 1% changed per step: "
        f"first step {base / MiB:.1f} MiB on disk; the 9 later steps grew the root by "
        f"{grown / MiB:.2f} MiB for {changed / MiB:.0f} MiB changed ({grown / changed:.3f}x)"
    )
    assert changed <= grown <= 1.05 * changed


def test_retention_deleting_the_step_that_wrote_a_file_keeps_the_others(tmp_path: Path) -> None:
    td = _state()
    with CheckpointManager(tmp_path, incremental=True, retention=KeepLast(2), fsync=False) as mgr:
        first = mgr.save(1, td)
        inode = _ino(first / "w0.memmap")
        for step in (2, 3, 4):
            td["w3"] += 1
            mgr.save(step, td)
        assert mgr.steps() == [3, 4]
        assert not first.exists()
        assert _ino(mgr.path(4) / "w0.memmap") == inode
        # the link count is the reference count: two steps name the bytes now
        assert os.stat(mgr.path(4) / "w0.memmap").st_nlink == 2
        assert mgr.verify(3).ok and mgr.verify(4).ok
        assert (mgr.restore(4) == td).all()
        assert (mgr.restore(3)["w0"] == torch.arange(1024)).all()
        mgr.gc()
        assert mgr.verify(3).ok and mgr.verify(4).ok


def test_overwriting_the_base_step_keeps_the_bytes_of_the_step_that_shares_them(
    tmp_path: Path,
) -> None:
    td = _state()
    with CheckpointManager(tmp_path, incremental=True, fsync=False) as mgr:
        mgr.save(1, td)
        mgr.save(2, td)
        other = td.clone()
        other["w0"] += 100
        mgr.save(1, other, overwrite=True)
        assert mgr.verify(1).ok and mgr.verify(2).ok
        assert (mgr.restore(2) == td).all()
        assert (mgr.restore(1) == other).all()


def test_restore_r_plus_writes_reach_that_step_only(tmp_path: Path) -> None:
    td = _state()
    with CheckpointManager(tmp_path, incremental=True, fsync=False) as mgr:
        mgr.save(1, td)
        mgr.save(2, td)
        assert os.stat(mgr.path(2) / "w0.memmap").st_nlink == 2
        live = mgr.restore(1, mode="r+")
        live["w0"][:] = -7.0  # through a shared mapping: reaches step 1's file
        live["nested", "ids"][:] = -1
        del live
        assert mgr.verify(2).ok
        assert (mgr.restore(2) == td).all()
        assert (_plain(mgr.path(1))["w0"] == -7).all()  # the step the user wrote into
        assert os.stat(mgr.path(2) / "w0.memmap").st_nlink == 1
        # restore_into as well, on the other step
        target = td.clone()
        mgr.restore_into(target, 2, mode="r+")
        target["w2"][:] = 5.0
        del target
        assert (_plain(mgr.path(1))["w2"] == torch.arange(1024) + 2).all()
        # files made writable by an r+ restore are never linked again: step 3 (based on
        # step 2) writes its own; step 4 shares step 3's
        expected = _plain(mgr.path(2))
        three = mgr.save(3, expected)
        assert all(os.stat(p).st_nlink == 1 for p in three.rglob("*.memmap"))
        four = mgr.save(4, expected)
        assert _ino(three / "w1.memmap") == _ino(four / "w1.memmap")
        assert (mgr.restore(4)["w2"] == 5).all()


def _write_as_plain_tensordict(path: Path) -> int:
    """In a forked child (as user "nobody" when this runs as root, who ignores the
    read-only mode): load ``path`` with plain tensordict (its default mode) and write into
    a leaf. The child's exit status: 0 when the write was seen in its memory."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 2
        try:
            if os.geteuid() == 0:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
            loaded = TensorDict.load_memmap(path)
            loaded["w0"][:] = -3.0
            code = 0 if float(loaded["w0"][0]) == -3.0 else 3
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_plain_tensordict_writes_into_one_step_never_reach_another() -> None:
    # A root that user "nobody" can read (pytest's tmp_path is private to its user).
    root = Path(tempfile.mkdtemp(prefix="tdckpt-incr-"))
    try:
        os.chmod(root, 0o755)
        td = _state()
        with CheckpointManager(root, incremental=True, fsync=False) as mgr:
            mgr.save(1, td)
            mgr.save(2, td)
        for path in root.rglob("*"):
            if path.is_dir():
                os.chmod(path, 0o755)
        assert _write_as_plain_tensordict(root / "1") == 0
        with CheckpointManager(root) as mgr:
            assert mgr.verify(1).ok and mgr.verify(2).ok  # the write stayed in memory
            assert (mgr.restore(2) == td).all()
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="runs as root")
def test_root_restoring_in_tensordicts_default_mode_breaks_the_sharing_first(
    tmp_path: Path,
) -> None:
    """root ignores the read-only mode: mode=None maps writable files shared, so tdckpt
    gives the step private copies first (see docs/incremental.rst)."""
    td = _state()
    with CheckpointManager(tmp_path, incremental=True, fsync=False) as mgr:
        mgr.save(1, td)
        mgr.save(2, td)
        live = mgr.restore(1, mode=None)
        live["w0"][:] = -9.0
        del live
        assert mgr.verify(2).ok
        assert (mgr.restore(2) == td).all()


def test_training_state_frozen_parameters_are_linked(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))
    for p in model[0].parameters():
        p.requires_grad_(False)  # frozen backbone
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with CheckpointManager(tmp_path, incremental=True, fsync=False) as mgr:
        one = mgr.save(1, {"model": model, "optim": opt})
        model(torch.randn(8, 64)).sum().backward()
        opt.step()
        two = mgr.save(2, {"model": model, "optim": opt})
        frozen = sorted((one / "model").glob("0.*.memmap"))  # model/0.weight, model/0.bias
        assert len(frozen) == 2
        for path in frozen:
            rel = path.relative_to(one)
            assert _ino(path) == _ino(two / rel), rel
        trained = sorted((one / "model").glob("1.*.memmap"))
        assert len(trained) == 2 and all(_ino(p) != _ino(two / p.relative_to(one)) for p in trained)
        fresh = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))
        fresh[0].requires_grad_(False)
        fresh_opt = torch.optim.SGD([p for p in fresh.parameters() if p.requires_grad], lr=0.1)
        mgr.restore_into({"model": fresh, "optim": fresh_opt}, 2)
        for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
            assert torch.equal(a, b)


def test_save_async_is_incremental_too(tmp_path: Path) -> None:
    td = _state()
    with CheckpointManager(tmp_path, incremental=True, fsync=False) as mgr:
        mgr.save_async(1, td).result()
        td["w0"] += 1
        two = mgr.save_async(2, td).result()
        assert _ino(mgr.path(1) / "w1.memmap") == _ino(two / "w1.memmap")
        assert _ino(mgr.path(1) / "w0.memmap") != _ino(two / "w0.memmap")
        assert (mgr.restore(2) == td).all()


def test_incremental_is_refused_where_steps_cannot_share_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not with archive=True"):
        CheckpointManager(tmp_path, incremental=True, archive=True)
    with pytest.raises(ValueError, match="layout='consolidated'"):
        CheckpointManager(tmp_path, incremental=True, layout="consolidated")
    with pytest.raises(TypeError, match="incremental must be True or False"):
        CheckpointManager(tmp_path, incremental="yes")  # type: ignore[arg-type]
    with CheckpointManager(tmp_path, archive=True) as mgr:
        with pytest.raises(ValueError, match="not with archive=True"):
            mgr.save(1, _state(), incremental=True)
        assert mgr.steps() == []
        assert not list(tmp_path.glob("1*"))


def test_load_memmap_never_maps_a_shared_leaf_writable(tmp_path: Path) -> None:
    """Outside the manager nothing breaks the sharing: r+ is refused naming the file, and
    tensordict's default mode (None) maps a shared file copy-on-write, even for root."""
    import tdckpt

    td = _state()
    with CheckpointManager(tmp_path, incremental=True, fsync=False) as mgr:
        one = mgr.save(1, td)
        mgr.save(2, td)
    with pytest.raises(
        RestoreError, match=r"\.memmap: mode='r\+' would map shared a file that 2 names"
    ):
        tdckpt.load_memmap(one, mode="r+")
    loaded = tdckpt.load_memmap(one, mode=None)
    loaded["w0"][:] = -1.0
    loaded["nested", "ids"][:] = -1
    del loaded
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.verify(1).ok and mgr.verify(2).ok
        assert (mgr.restore(2) == td).all()


def test_sigkill_at_every_stage_of_an_incremental_save_keeps_every_step_exact(
    tmp_path: Path,
) -> None:
    """A saver SIGKILLs itself at each stage of an incremental save (linking, writing, the
    commit, retention deleting the base step, an overwrite of a shared step): every step
    listed afterwards verifies and restores bit-exactly, gc leaves nothing behind, and the
    next incremental save works."""
    from _incremental_crash_child import STAGES, make_td
    from conftest import subprocess_env

    from tdckpt._write.atomic import is_tmp_name

    stderr = (tmp_path / "child.stderr").open("w")
    child = subprocess.Popen(
        [sys.executable, str(Path(__file__).parent / "_incremental_crash_child.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=subprocess_env(),
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        for stage in STAGES:
            root = tmp_path / stage
            child.stdin.write(f"run {root} {stage}\n")
            child.stdin.flush()
            status = int(child.stdout.readline().split()[1])
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (
                f"{stage}: the saver did not die at its fault: "
                f"{(tmp_path / 'child.stderr').read_text()[-2000:]}"
            )
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the killed saver's lock is taken over
                mgr = CheckpointManager(root, incremental=True, retention=KeepLast(2))
                mgr.gc()
            try:
                steps = mgr.steps()
                late = stage in ("committed", "retired", "removed")
                assert steps == (
                    [2, 3] if late and stage != "committed" else [1, 2, 3] if late else [1, 2]
                ), (stage, steps)
                assert not [n for n in os.listdir(root) if is_tmp_name(n)], stage
                for step in steps:
                    assert mgr.verify(step).ok, (stage, step, mgr.verify(step).summary())
                    restored = mgr.restore(step)
                    expected = make_td(step)
                    if stage == "overwrite-swapped" and step == 2 and restored["l0"][0] != 0:
                        expected["l0"] += 0.5  # the overwrite's content, committed whole
                    assert (restored == expected).all(), (stage, step)
                    assert (_plain(mgr.path(step)) == expected).all(), (stage, step)
                mgr.save(4, make_td(4))
                assert mgr.verify(4).ok and (mgr.restore(4) == make_td(4)).all(), stage
            finally:
                mgr.close()
    finally:
        child.stdin.write("quit\n")
        child.stdin.close()
        child.wait(timeout=30)
        child.stdout.close()
        stderr.close()


def test_verify_steps_reads_a_shared_file_once_and_reports_per_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from tdckpt import cli

    td = _state()
    with CheckpointManager(tmp_path, incremental=True, fsync=False) as mgr:
        for step in (1, 2, 3):
            td["w3"] += 1
            mgr.save(step, td)
        reports = mgr.verify_steps()
        assert [r.step for r in reports] == [1, 2, 3] and all(r.ok for r in reports)
        # w0, w1, w2 and nested/ids are read for step 1 only; w3 differs in every step
        assert [r.shared_checked for r in reports] == [0, 4, 4]
        assert reports[0].bytes_checked > reports[1].bytes_checked
        assert reports[1].files_checked == reports[0].files_checked
        assert "4 shared files checked once" in reports[2].summary()
        # damage the one copy of w0: every step naming it says so
        os.chmod(mgr.path(2) / "w0.memmap", 0o644)
        with open(mgr.path(2) / "w0.memmap", "r+b") as fh:
            fh.write(b"\xff\xff\xff\xff")
        damaged = mgr.verify_steps()
        assert [[p.path for p in r.problems] for r in damaged] == [["w0.memmap"]] * 3
    capsys.readouterr()
    assert cli.main(["verify", str(tmp_path), "--all", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False
    assert [(r["step"], r["ok"]) for r in out["steps"]] == [(1, False), (2, False), (3, False)]
    with pytest.raises(SystemExit) as usage:
        cli.main(["verify", str(tmp_path), "--all", "--step", "1"])
    assert usage.value.code == 2
    assert "not allowed with argument --all" in capsys.readouterr().err


def test_ls_shows_each_steps_own_bytes_and_its_total(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from tdckpt import cli

    td = TensorDict(big=torch.zeros(64 * 1024), small=torch.zeros(16))
    with CheckpointManager(tmp_path, incremental=True, fsync=False) as mgr:
        mgr.save(1, td)
        td["small"] += 1
        mgr.save(2, td)
        sizes = {s.step: s.size for s in mgr.list_steps()}
    capsys.readouterr()
    assert cli.main(["ls", str(tmp_path), "--json"]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)}
    big = 64 * 1024 * 4
    for step in (1, 2):
        assert rows[step]["size"] == sizes[step]
        assert rows[step]["own_size"] == sizes[step] - big  # big.memmap is shared
    assert cli.main(["ls", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:5] == ["step", "status", "kind", "own", "size"]
    assert lines[2].split()[:5] == ["2", "committed", "dir", str(sizes[2] - big), str(sizes[2])]


def test_diff_of_two_incremental_steps_of_a_training_state(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``tdckpt.diff`` / ``tdckpt diff --root`` on a training state: the trained parameters
    and the optimizer's moments changed, the frozen ones (shared files) did not."""
    import json

    import tdckpt
    from tdckpt import cli

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    model[0].requires_grad_(False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad])
    with CheckpointManager(tmp_path, incremental=True, fsync=False) as mgr:
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        one = mgr.save(1, {"model": model, "optim": opt})
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        two = mgr.save(2, {"model": model, "optim": opt})
    report = tdckpt.diff(one, two)
    changed = {e.key for e in report.entries if e.change == "changed"}
    assert ("model", "1.weight") in changed and ("model", "1.bias") in changed
    assert not any(k[:2] in {("model", "0.weight"), ("model", "0.bias")} for k in changed)
    assert any(k[0] == "optim" for k in changed)  # Adam's moments and step moved
    capsys.readouterr()
    assert cli.main(["diff", "1", "2", "--root", str(tmp_path), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    listed = {tuple(e["key"]) for e in doc["entries"] if e["change"] == "changed"}
    assert listed == changed
    assert cli.main(["diff", "2", "2", "--root", str(tmp_path)]) == 0


def test_sharded_steps_share_each_ranks_unchanged_leaves(tmp_path: Path) -> None:
    """Two gloo ranks save two incremental sharded steps: each rank's unchanged leaf is
    linked from its own shard of the step before; retention of the first keeps the second."""
    from _shard_child import incremental_shard, spawn_ranks

    from tdckpt.schema import ShardedManifest

    root = tmp_path / "root"
    results = spawn_ranks("incremental", 2, {"out": str(tmp_path / "o"), "root": str(root)})
    assert all(r is not None and r.get("ok") == [1, 2] for r in results), results
    mgr = CheckpointManager(root, group=False)
    manifests = [mgr._resolve(step)[2] for step in (1, 2)]
    assert all(isinstance(m, ShardedManifest) for m in manifests)
    for rank in (0, 1):
        one, two = (
            mgr.path(s) / m.shards[rank].prefix for s, m in zip((1, 2), manifests, strict=True)
        )
        assert _ino(one / "frozen.memmap") == _ino(two / "frozen.memmap"), rank
        assert _ino(one / "moving.memmap") != _ino(two / "moving.memmap"), rank
    whole = torch.cat([incremental_shard(2, rank) for rank in (0, 1)])
    assert (mgr.restore(2) == whole).all()
    with pytest.raises(RestoreError, match="would map shared a file"):
        mgr.restore(1, mode="r+")  # a shard's shared file is never mapped writable
    mgr.close()
    with CheckpointManager(root, group=False, retention=KeepLast(1)) as mgr:
        mgr.prune()
        assert mgr.steps() == [2]
        assert mgr.verify(2).ok
        assert (mgr.restore(2) == whole).all()


def test_a_file_with_too_many_links_is_written_instead(tmp_path: Path) -> None:
    """ext4 allows 65,000 names per file: a leaf shared by that many steps is written
    afresh by the next save, never a failed save."""
    import errno

    td = _state()
    root = tmp_path / "root"
    with CheckpointManager(root, incremental=True, fsync=False) as mgr:
        one = mgr.save(1, td)
        links = tmp_path / "links"
        links.mkdir()
        for i in range(70_000):
            try:
                os.link(one / "w0.memmap", links / str(i))
            except OSError as exc:
                if exc.errno != errno.EMLINK:
                    raise
                break
        else:
            pytest.skip("this file system allows more than 70,000 links per file")
        two = mgr.save(2, td)
        assert _ino(two / "w0.memmap") != _ino(one / "w0.memmap")  # written afresh
        assert _ino(two / "w1.memmap") == _ino(one / "w1.memmap")
        assert mgr.verify(2).ok and (mgr.restore(2) == td).all()


def test_a_leaf_written_after_its_commit_is_never_linked(tmp_path: Path) -> None:
    """A committed leaf written into afterwards (by root, whom the read-only mode does not
    stop, or after a chmod) no longer holds its manifest's bytes: the next incremental save
    writes its own copy instead of linking the damaged file."""
    td = _state()
    with CheckpointManager(tmp_path, incremental=True, fsync=False) as mgr:
        one = mgr.save(1, td)
        leaf = one / "w0.memmap"
        os.chmod(leaf, 0o644)
        with open(leaf, "r+b") as fh:
            fh.write(b"\x00\x00\x80\x7f")  # one element of w0 becomes +inf
        os.chmod(leaf, 0o444)
        future = os.stat(mgr.path(1) / "tdckpt.manifest.json").st_mtime_ns + 10**9
        os.utime(leaf, ns=(future, future))  # whatever the clock's resolution
        two = mgr.save(2, td)
        assert _ino(two / "w0.memmap") != _ino(leaf)
        assert _ino(two / "w1.memmap") == _ino(one / "w1.memmap")
        assert mgr.verify(2).ok and not mgr.verify(1).ok
        assert (mgr.restore(2) == td).all()


_SAVE_AGAIN = """
import sys, torch
from tensordict import TensorDict
from tdckpt import CheckpointManager
td = TensorDict.load_memmap(sys.argv[2]).clone()  # the intended bytes, kept beside the root
with CheckpointManager(sys.argv[1], incremental=True, fsync=False) as mgr:
    mgr.save(2, td)
"""


def test_a_base_leaf_damaged_in_place_is_read_and_written_afresh_after_a_restart(
    tmp_path: Path,
) -> None:
    """Bit rot keeps a file's size, mode and modification time, so nothing but its bytes
    tells. A process links a base file only once it has seen it hold its checksum - its own
    saves' files, or read back before the first link - so the first incremental save after
    a restart writes the damaged leaf afresh from memory (and still links the intact ones);
    before, it linked the damaged file into the new step too."""
    td = _state()
    good = tmp_path / "good"
    td.memmap(good)
    root = tmp_path / "root"
    with CheckpointManager(root, incremental=True, fsync=False) as mgr:
        one = mgr.save(1, td)
    leaf = one / "w0.memmap"
    st = os.stat(leaf)
    os.chmod(leaf, 0o644)
    with open(leaf, "r+b") as fh:
        fh.seek(8)
        byte = fh.read(1)
        fh.seek(8)
        fh.write(bytes([byte[0] ^ 0x01]))  # one bit flipped
    os.chmod(leaf, st.st_mode)
    os.utime(leaf, ns=(st.st_atime_ns, st.st_mtime_ns))
    run = subprocess.run(
        [sys.executable, "-c", _SAVE_AGAIN, str(root), str(good)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    two = root / "2"
    assert _ino(two / "w0.memmap") != _ino(leaf)  # written afresh
    assert _ino(two / "w1.memmap") == _ino(one / "w1.memmap")  # read once, then linked
    with CheckpointManager(root) as mgr:
        assert mgr.verify(2).ok and not mgr.verify(1).ok
        assert (mgr.restore(2) == td).all()


def test_the_saves_of_one_process_link_their_own_files_unread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The files a process's incremental save wrote are noted as holding their checksums:
    its next save links them without reading them back (a save's floor stays the hash of
    the new bytes); so are the files a verify of the base read."""
    from tdckpt._write import incremental

    td = _state()
    reads: list[int] = []
    real = os.preadv

    def counting(fd: int, buffers: list[memoryview], offset: int) -> int:
        if offset == 0:  # a file read from its start
            reads.append(fd)
        return real(fd, buffers, offset)

    with CheckpointManager(tmp_path, incremental=True, fsync=False) as mgr:
        one = mgr.save(1, td)
        monkeypatch.setattr(os, "preadv", counting)
        two = mgr.save(2, td)
        assert reads == []
        assert all(_ino(two / f"w{i}.memmap") == _ino(one / f"w{i}.memmap") for i in range(4))
        incremental._SEEN.clear()  # as in a new process: each base file is read once
        three = mgr.save(3, td)
        assert len(reads) == 5  # w0..w3 and nested/ids, each read once
        assert all(_ino(three / f"w{i}.memmap") == _ino(one / f"w{i}.memmap") for i in range(4))
        incremental._SEEN.clear()
        assert mgr.verify(3).ok  # a verify of the base reads its files: the save need not
        reads.clear()
        four = mgr.save(4, td)
        assert reads == []
        assert all(_ino(four / f"w{i}.memmap") == _ino(one / f"w{i}.memmap") for i in range(4))


def _sub_folder_linked_out(step: Path, outside: Path) -> None:
    """Replace the step's folder ``nested`` by a symlink to a copy of it outside the root
    (the same bytes, the files still read-only, their times kept)."""
    shutil.copytree(step / "nested", outside)
    shutil.rmtree(step / "nested")
    os.symlink(outside, step / "nested")


def test_a_base_leaf_reached_through_a_symlinked_folder_is_never_linked(tmp_path: Path) -> None:
    """lstat of a leaf checks its last component only: a base step whose sub-folder was
    made a symlink out of the root had the outside file hard-linked into the new step,
    whose data then changed with that file. Such a leaf is now written, not linked."""
    td = _state()
    root = tmp_path / "run"
    with CheckpointManager(root, incremental=True, fsync=False) as mgr:
        mgr.save(1, td)
        two = mgr.save(2, td)
    outside = tmp_path / "outside"
    _sub_folder_linked_out(two, outside)
    with CheckpointManager(root, incremental=True, fsync=False) as mgr:
        three = mgr.save(3, td)
        for leaf in (three / "nested").iterdir():
            if leaf.suffix == ".memmap":
                assert not os.path.samefile(leaf, outside / leaf.name), leaf.name
                assert os.stat(outside / leaf.name).st_nlink == 1
        assert (mgr.restore(3) == td).all()
        assert _ino(three / "w0.memmap") == _ino(mgr.path(1) / "w0.memmap")  # others still shared


def test_restore_r_plus_never_writes_through_a_symlinked_folder(tmp_path: Path) -> None:
    """A mode='r+' restore gives the step's shared files private copies before it maps them:
    a file reached through a symlinked sub-folder (outside the checkpoint) was replaced by
    a writable copy, even though the restore then refused the step for that symlink."""
    from tdckpt.errors import TdckptError

    td = _state()
    root = tmp_path / "run"
    with CheckpointManager(root, incremental=True, fsync=False) as mgr:
        mgr.save(1, td)
        two = mgr.save(2, td)
    outside = tmp_path / "outside"
    _sub_folder_linked_out(two, outside)
    before = {p.name: (os.stat(p).st_ino, os.stat(p).st_mode) for p in outside.iterdir()}
    with (
        CheckpointManager(root, incremental=True, fsync=False) as mgr,
        pytest.raises(TdckptError, match="outside the checkpoint"),
    ):
        mgr.restore(2, mode="r+")
    assert {p.name: (os.stat(p).st_ino, os.stat(p).st_mode) for p in outside.iterdir()} == before


def test_a_refused_r_plus_restore_leaves_the_steps_sharing_intact(tmp_path: Path) -> None:
    """A mode='r+' restore gives a step's shared files private copies before it maps them;
    it did so before validating, so a step then refused (a leaf deleted) had already lost
    its sharing - 'nothing was changed' was not true. The step is validated first."""
    from tdckpt.errors import ValidationError

    td = _state()
    with CheckpointManager(tmp_path, incremental=True, fsync=False) as mgr:
        mgr.save(1, td)
        two = mgr.save(2, td)
        (two / "w3.memmap").unlink()
        before = {p.name: (_ino(p), os.stat(p).st_nlink) for p in two.glob("*.memmap")}
        with pytest.raises(ValidationError, match="nothing was changed"):
            mgr.restore(2, mode="r+")
        with pytest.raises(ValidationError, match="nothing was changed"):
            mgr.restore_into(td.clone(), 2, mode="r+")
        assert {p.name: (_ino(p), os.stat(p).st_nlink) for p in two.glob("*.memmap")} == before
        assert _ino(two / "w0.memmap") == _ino(mgr.path(1) / "w0.memmap")
