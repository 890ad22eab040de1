"""Run tensordict's own memmap tests twice: plainly, then with its loaders routed to tdckpt.

Usage::

    python tests/peer/run_peer.py /path/to/tensordict/test [--keyword EXPR] [--out DIR]

The path is the ``test/`` folder of a tensordict checkout or archive, outside this repository
(this script fetches nothing, and tensordict's tests are never committed here). Both runs use
the same interpreter, files and keyword; the second loads the ``tdckpt_peer`` plugin (this
folder), which makes ``TensorDictBase.load_memmap_`` call :func:`tdckpt.load_memmap_` and the
classmethod ``TensorDictBase.load_memmap`` (hence ``TensorDict.load`` and tensorclass loaders)
call :func:`tdckpt.load_memmap` (``TDCKPT_PEER_ROUTE`` narrows it).

The report lists the tests that fail only with the plugin. Each must be a documented, intended
difference (:data:`DOCUMENTED`, with its reason) or it is a tdckpt bug: the exit status is 0
when every extra failure is documented, 1 otherwise, 2 on a bad path or a run that did not
produce a report.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

PEER_DIR = Path(__file__).resolve().parent
REPO_ROOT = PEER_DIR.parents[1]

#: The memmap-related test files of tensordict's suite (relative to its ``test/`` folder).
FILES = (
    "tensordict/test_methods.py",
    "memmap/test_memmap.py",
    "tensordict/test_generic.py",
    "tensordict/test_nontensor.py",
    "tensorclass/test_tensorclass.py",
)
KEYWORD = "memmap or load"

_METHODS = "test/tensordict/test_methods.py"

#: Tests that fail only with the plugin, on purpose: node id -> why tdckpt differs.
DOCUMENTED: dict[str, str] = {
    f"{_METHODS}::TestEmptyTensorMemmapRoundtrip::"
    "test_missing_nonempty_leaf_is_not_reconstructed": (
        "tdckpt refuses a checkpoint whose meta.json lists a leaf that has no file "
        "(ValidationError, 'missing-file'); tensordict silently drops the key"
    ),
    f"{_METHODS}::TestMemmapArchive::test_archive_mode_rplus_rejects_non_writable_layouts": (
        "mode='r+' on a compressed or misaligned archive is refused as by tensordict, but "
        "with tdckpt's MetadataError (a ValueError) in its own words, not a RuntimeError; a "
        "nested tensor in an archive is mapped shared like any leaf (its writes reach the "
        "file), where tensordict refuses it"
    ),
}


class PeerError(Exception):
    """A bad path or a run without a report (exit status 2)."""


def check_test_dir(path: Path) -> Path:
    """The resolved ``test/`` folder, or a :class:`PeerError` saying what is wrong with it."""
    path = path.expanduser()
    if not path.is_dir():
        raise PeerError(f"{path}: not a directory. Pass the test/ folder of a tensordict checkout.")
    resolved = path.resolve()
    if resolved == REPO_ROOT or REPO_ROOT in resolved.parents:
        raise PeerError(
            f"{path}: inside this repository ({REPO_ROOT}). tensordict's tests stay out of it: "
            "extract them elsewhere (e.g. `git archive <commit> test | tar -x -C /tmp/td`)."
        )
    missing = [f for f in ("conftest.py", *FILES) if not (resolved / f).is_file()]
    if missing:
        raise PeerError(f"{path}: not tensordict's test/ folder (missing {', '.join(missing)}).")
    return resolved


def _failures(report: Path) -> dict[str, str]:
    """Node id -> the last line of the error, for every test that failed or errored."""
    try:
        lines = report.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise PeerError(f"{report}: the run wrote no outcomes ({exc}).") from exc
    out: dict[str, str] = {}
    for line in lines:
        row = json.loads(line)
        if row["outcome"] in ("failed", "error"):
            out[row["node"]] = " ".join(row.get("message") or [])[:200]
    if not lines:
        raise PeerError(f"{report}: the run recorded no test (wrong keyword or files?).")
    return out


def run(
    test_dir: Path,
    *,
    routed: bool,
    keyword: str,
    out: Path,
    extra: Sequence[str],
    timeout: float = 3600.0,
) -> dict[str, str]:
    report = out / ("routed.jsonl" if routed else "plain.jsonl")
    report.unlink(missing_ok=True)
    env = dict(os.environ)
    env["TDCKPT_PEER_OUTCOMES"] = str(report)
    paths = [str(PEER_DIR)]
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-q",
        "-p",
        "peer_outcomes",
        "-k",
        keyword,
        *extra,
        *(f"test/{f}" for f in FILES),
    ]
    if routed:
        cmd[3:3] = ["-p", "tdckpt_peer"]
        paths.append(str(REPO_ROOT))
    env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [env.get("PYTHONPATH")])])
    print(f"== {'routed through tdckpt' if routed else 'plain tensordict'}: {' '.join(cmd[1:])}")
    sys.stdout.flush()
    try:
        proc = subprocess.run(cmd, cwd=test_dir.parent, env=env, check=False, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise PeerError(f"the run took more than {timeout:g} s and was stopped.") from exc
    if proc.returncode not in (0, 1):  # 0 all passed, 1 some failed; else no usable run
        raise PeerError(f"pytest exited with status {proc.returncode}: the run did not complete.")
    return _failures(report)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("test_dir", type=Path, help="the test/ folder of tensordict")
    parser.add_argument("--keyword", "-k", default=KEYWORD, help=f"pytest -k (default {KEYWORD!r})")
    parser.add_argument("--out", type=Path, help="where the outcome files go (default: a temp dir)")
    parser.add_argument(
        "--runs",
        default="plain,routed",
        help="the runs to do now (default both); one not done is read from --out (empty: "
        "compare the files already there)",
    )
    parser.add_argument(
        "--timeout", type=float, default=3600.0, help="seconds per run (default 3600)"
    )
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args(argv)
    try:
        test_dir = check_test_dir(args.test_dir)
        runs = {r.strip() for r in args.runs.split(",") if r.strip()}
        if not runs <= {"plain", "routed"} or (runs != {"plain", "routed"} and not args.out):
            raise PeerError("--runs takes plain, routed or both; a single run needs --out.")
        out = args.out or Path(tempfile.mkdtemp(prefix="tdckpt-peer-"))
        out.mkdir(parents=True, exist_ok=True)
        found = {}
        for name in ("plain", "routed"):
            if name in runs:
                found[name] = run(
                    test_dir,
                    routed=name == "routed",
                    keyword=args.keyword,
                    out=out,
                    extra=args.pytest_args,
                    timeout=args.timeout,
                )
            else:
                found[name] = _failures(out / f"{name}.jsonl")
        plain, routed = found["plain"], found["routed"]
    except PeerError as exc:
        print(f"run_peer: {exc}", file=sys.stderr)
        return 2
    lines, undocumented = compare(plain, routed)
    print(f"\nreports in {out}")
    print("\n".join(lines))
    return 1 if undocumented else 0


def compare(
    plain: dict[str, str], routed: dict[str, str], documented: dict[str, str] | None = None
) -> tuple[list[str], list[str]]:
    """The report's lines, and the failures only the routed run has that are not documented."""
    documented = DOCUMENTED if documented is None else documented
    only_routed = sorted(set(routed) - set(plain))
    only_plain = sorted(set(plain) - set(routed))
    lines = [
        f"plain failures: {len(plain)}; routed failures: {len(routed)}",
        f"failing only when routed through tdckpt: {len(only_routed)}",
    ]
    undocumented = []
    for node in only_routed:
        reason = documented.get(node)
        if reason:
            lines.append(f"  documented: {node} - {reason}")
        else:
            lines.append(f"  NEW: {node} - {routed[node]}")
            undocumented.append(node)
    lines.append(f"failing only in the plain run: {len(only_plain)}")
    lines.extend(f"  {node}" for node in only_plain)
    return lines, undocumented


if __name__ == "__main__":
    sys.exit(main())
