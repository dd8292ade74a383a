"""How `shoal ... --help` reads: defaults shown, examples kept as written.

Every parser of the command tree is a `ShoalParser`, so a subcommand's own subcommands
(`shoal quota serve`, `shoal cluster deploy`) format the same way without asking.
"""

from __future__ import annotations

import argparse
import textwrap
from typing import Any


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """argparse's default-showing formatter, quiet where the default says nothing (an unset
    option, an off switch), and leaving descriptions and example epilogs as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


class ShoalParser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        if kwargs.get("description"):  # raw descriptions keep their paragraphs, wrapped here
            paragraphs = kwargs["description"].split("\n\n")
            kwargs["description"] = "\n\n".join(
                textwrap.fill(" ".join(p.split()), 88) for p in paragraphs
            )
        super().__init__(*args, **kwargs)


def examples(*lines: str) -> str:
    """An epilog of example command lines, one per line (a trailing `# ...` explains it)."""
    return "examples:\n" + "\n".join(f"  {line}" for line in lines)
