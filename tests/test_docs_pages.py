"""The documentation cannot drift from the code: every CLI command and option, every exit
code, and every public name has its place in docs/ (no Sphinx needed; the nox ``docs``
session builds the site itself with warnings as errors and runs its examples)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

import tdckpt
from tdckpt.cli import EXIT_INTERRUPTED, EXIT_OK, EXIT_PROBLEM, EXIT_USAGE, _parser

DOCS = Path(__file__).resolve().parent.parent / "docs"


#: Options of (nearly) every command, explained once on the page.
_COMMON = ("--json", "--traceback")


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = _parser()
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _section(text: str, command: str) -> str:
    """The text of the ``tdckpt COMMAND`` section of cli.rst (up to the next heading)."""
    title = f"``tdckpt {command}``"
    match = re.search(rf"^{re.escape(title)}\n-+\n(.*?)(?=^\S[^\n]*\n-+\n|\Z)", text, re.M | re.S)
    assert match is not None, f"docs/cli.rst has no section titled {title}"
    return match.group(1)


def test_the_cli_page_has_a_section_for_every_command() -> None:
    text = (DOCS / "cli.rst").read_text(encoding="utf-8")
    commands = _subcommands()
    assert {"inspect", "validate", "upgrade", "ls", "verify", "gc", "demo"} <= set(commands)
    for name, sub in commands.items():
        section = _section(text, name)
        # The parser's own --help text is inserted there at build time ...
        assert f".. tdckpt-help:: {name}\n" in section, name
        # ... and every option is also explained in the prose: in the command's section,
        # or for the options every command has, in their own section of the page.
        for action in sub._actions:
            for option in action.option_strings:
                if option in ("-h", "--help"):
                    continue
                where = text if option in _COMMON else section
                assert f"``{option}" in where, (
                    f"docs/cli.rst: the section of `tdckpt {name}` does not mention {option}"
                )


def test_the_cli_page_lists_the_exit_codes_and_json() -> None:
    text = (DOCS / "cli.rst").read_text(encoding="utf-8")
    for code in (EXIT_OK, EXIT_PROBLEM, EXIT_USAGE, EXIT_INTERRUPTED):
        assert re.search(rf"^``{code}``\s", text, re.M), f"exit code {code} is not in the table"
    assert '{"error": {"type", "message", "path", "exit_code", "details"}}' in text
    assert ".. tdckpt-help::\n" in text  # the top-level help (--traceback)


def test_the_cli_section_finder_fails_on_a_missing_command() -> None:
    with pytest.raises(AssertionError, match="no section titled"):
        _section("``tdckpt ls``\n----\n\ntext\n", "verify")


def test_the_api_page_documents_every_public_name() -> None:
    text = (DOCS / "api.rst").read_text(encoding="utf-8")
    documented = set(
        re.findall(r"^\.\. (?:autofunction|autoclass|data):: tdckpt\.(\w+)$", text, re.M)
    )
    assert documented == set(tdckpt.__all__)


def test_every_page_is_in_the_toctree() -> None:
    index = (DOCS / "index.rst").read_text(encoding="utf-8")
    listed = set(re.findall(r"^   ([\w-]+)$", index, re.M))
    pages = {p.stem for p in DOCS.glob("*.rst")} - {"index"}
    assert pages <= listed, f"pages missing from docs/index.rst's toctree: {pages - listed}"


def _first_bash_block(text: str, marker: str) -> list[str]:
    """The lines of the first ``bash`` code block after ``marker`` (Markdown or reST)."""
    rest = text[text.index(marker) :]
    fenced = re.search(r"```bash\n(.*?)```", rest, re.S)
    indented = re.search(r"\.\. code-block:: bash\n\n((?:   .*\n)+)", rest)
    block = fenced.group(1) if fenced else indented.group(1) if indented else ""
    return [line.strip() for line in block.splitlines() if line.strip()]


def test_getting_started_gives_the_readme_two_commands() -> None:
    readme = (DOCS.parent / "README.md").read_text(encoding="utf-8")
    page = (DOCS / "getting-started.rst").read_text(encoding="utf-8")
    commands = _first_bash_block(readme, "# tdckpt")
    assert len(commands) == 2, commands
    assert _first_bash_block(page, "Install and run the demo") == commands
