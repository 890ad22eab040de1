"""Run TorchRL's own checkpoint tests twice: plainly, then with tdckpt's adapter as the default.

Usage::

    python tests/peer/run_torchrl_peer.py /path/to/rl/test/test_checkpoint.py [--out DIR]

The file is ``test/test_checkpoint.py`` of a pytorch/rl checkout, outside this repository
(this script fetches nothing; TorchRL's tests are never committed here), run with an
interpreter that has torchrl installed (the ``tests-0.14`` environment). The second run loads
the ``tdckpt_torchrl_peer`` plugin (this folder): the state-dict components TorchRL would
give its default ``StateDictCheckpointAdapter`` get :class:`tdckpt.torchrl.TdckptAdapter`.

The report lists the tests that fail only with the plugin. Each must be a documented, intended
difference (:data:`DOCUMENTED`, with its reason) or it is a tdckpt bug: the exit status is 0
when every extra failure is documented, 1 otherwise, 2 on a bad path or a run without a report.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

PEER_DIR = Path(__file__).resolve().parent
REPO_ROOT = PEER_DIR.parents[1]
sys.path.insert(0, str(PEER_DIR))
from run_peer import PeerError, _failures, compare  # noqa: E402

#: Tests that fail only with the plugin, on purpose: node id -> why tdckpt differs.
#: TdckptAdapter writes its own payload layout.
_LAYOUT = (
    "the payload is tdckpt's (tdckpt/tdckpt.manifest.json, tdckpt/meta.json, ...), not "
    "TorchRL's state.json + state/: the test asserts TorchRL's file names"
)
#: A payload of TorchRL's adapter is not TdckptAdapter's to load.
_OTHER = (
    "written with TorchRL's StateDictCheckpointAdapter, loaded by a Checkpoint whose default "
    "is now TdckptAdapter: TorchRL itself refuses a component whose manifest adapter id "
    "('torchrl.state_dict') differs from the target's ('tdckpt.state')"
)
#: Tests that fail only with the plugin, on purpose: node id -> why tdckpt differs
#: (pytorch/rl ae9719f17, torchrl 0.14.1: 60 passed plainly, 53 with the plugin).
DOCUMENTED: dict[str, str] = {
    "test_checkpoint.py::test_state_dict_json_and_manifest_roundtrip[directory]": _LAYOUT,
    "test_checkpoint.py::test_state_dict_json_and_manifest_roundtrip[archive]": _LAYOUT,
    "test_checkpoint.py::test_torch_state_dict_tensor_load_options": _OTHER,
    "test_checkpoint.py::test_state_dict_payload_formats[directory-state/meta.json]": _OTHER,
    "test_checkpoint.py::test_state_dict_payload_formats[archive-state.tdz]": _OTHER,
    "test_checkpoint.py::test_state_dict_payload_formats[consolidated-state.tdc]": _OTHER,
    "test_checkpoint.py::test_state_dict_payload_formats[torch-state.pt]": _OTHER,
}


def check_test_file(path: Path) -> Path:
    """The resolved test file, or a :class:`PeerError` saying what is wrong with it."""
    path = path.expanduser()
    if not path.is_file() or path.name != "test_checkpoint.py":
        raise PeerError(f"{path}: not a file named test_checkpoint.py (pytorch/rl's test/).")
    resolved = path.resolve()
    if REPO_ROOT in resolved.parents:
        raise PeerError(f"{path}: inside this repository ({REPO_ROOT}); keep TorchRL's tests out.")
    return resolved


def run(
    test_file: Path, *, routed: bool, out: Path, extra: Sequence[str], timeout: float
) -> dict[str, str]:
    report = out / ("routed.jsonl" if routed else "plain.jsonl")
    report.unlink(missing_ok=True)
    env = dict(os.environ)
    env["TDCKPT_PEER_OUTCOMES"] = str(report)
    paths = [str(PEER_DIR)]
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-p", "peer_outcomes"]
    if routed:
        cmd += ["-p", "tdckpt_torchrl_peer"]
        paths.append(str(REPO_ROOT))
    cmd += [*extra, test_file.name]
    env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [env.get("PYTHONPATH")])])
    print(f"== {'with TdckptAdapter' if routed else 'plain TorchRL'}: {' '.join(cmd[1:])}")
    sys.stdout.flush()
    try:
        proc = subprocess.run(cmd, cwd=test_file.parent, env=env, check=False, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise PeerError(f"the run took more than {timeout:g} s and was stopped.") from exc
    if proc.returncode not in (0, 1):
        raise PeerError(f"pytest exited with status {proc.returncode}: the run did not complete.")
    return _failures(report)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("test_file", type=Path, help="pytorch/rl's test/test_checkpoint.py")
    parser.add_argument("--out", type=Path, help="where the outcome files go (default: a temp dir)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args(argv)
    try:
        test_file = check_test_file(args.test_file)
        out = args.out or Path(tempfile.mkdtemp(prefix="tdckpt-torchrl-peer-"))
        out.mkdir(parents=True, exist_ok=True)
        plain = run(test_file, routed=False, out=out, extra=args.pytest_args, timeout=args.timeout)
        routed = run(test_file, routed=True, out=out, extra=args.pytest_args, timeout=args.timeout)
    except PeerError as exc:
        print(f"run_torchrl_peer: {exc}", file=sys.stderr)
        return 2
    lines, undocumented = compare(plain, routed, DOCUMENTED)
    print(f"\nreports in {out}")
    print("\n".join(lines))
    return 1 if undocumented else 0


if __name__ == "__main__":
    sys.exit(main())
