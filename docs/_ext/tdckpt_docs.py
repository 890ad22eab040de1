"""Sphinx extension: ``.. tdckpt-help:: [COMMAND]`` inserts the CLI's own ``--help`` text.

The text comes from tdckpt.cli's argparse parser at build time, so the CLI page shows every
option of every command exactly as the installed tdckpt has them; it cannot drift.
"""

from __future__ import annotations

import os
from typing import Any

from docutils import nodes
from docutils.parsers.rst import Directive


def help_text(command: str | None) -> str:
    """``tdckpt [COMMAND] --help`` as a terminal 88 columns wide prints it."""
    from tdckpt.cli import _parser

    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "88"
    try:
        parser = _parser()
        if command is not None:
            sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
            parser = sub.choices[command]  # type: ignore[attr-defined]
        return parser.format_help().rstrip()
    finally:
        if before is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = before


class TdckptHelp(Directive):
    optional_arguments = 1
    has_content = False

    def run(self) -> list[nodes.Node]:
        command = self.arguments[0] if self.arguments else None
        try:
            text = help_text(command)
        except StopIteration:  # pragma: no cover - the parser always has subcommands
            raise self.error("tdckpt's parser has no subcommands") from None
        except KeyError:
            raise self.error(f"tdckpt has no command {command!r}") from None
        block = nodes.literal_block(text, text)
        block["language"] = "text"
        return [block]


def setup(app: Any) -> dict[str, Any]:
    app.add_directive("tdckpt-help", TdckptHelp)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
