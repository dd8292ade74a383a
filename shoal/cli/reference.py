"""The command line's reference as Markdown, read from the parsers themselves, so the docs'
configuration page (rendered at every docs build) cannot drift from the flags."""

from __future__ import annotations

import argparse
from collections.abc import Iterator


def markdown(parser: argparse.ArgumentParser | None = None) -> str:
    """One section per command (`shoal`, `shoal serve`, `shoal quota serve`...): its
    description, a table of options per group, and its examples."""
    if parser is None:
        from shoal.cli import build_parser

        parser = build_parser()
    out: list[str] = []
    for path, p in _commands(parser, ("shoal",)):
        out += [f"## `{' '.join(path)}`", ""]
        if p.description:
            out += [p.description.replace("\n", " "), ""]
        for group in p._action_groups:
            rows = [_row(a) for a in group._group_actions if _documented(a)]
            if rows:
                title = group.title or "options"
                out += [f"**{title[0].upper()}{title[1:]}**", ""]
                out += ["| option | default | what it does |", "| --- | --- | --- |", *rows, ""]
        if p.epilog:
            out += ["```bash", *(line.strip() for line in p.epilog.splitlines()[1:]), "```", ""]
    return "\n".join(out)


def _commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...]
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*path, name))


def _documented(action: argparse.Action) -> bool:
    return not isinstance(action, argparse._HelpAction | argparse._SubParsersAction)


def _row(action: argparse.Action) -> str:
    if action.option_strings:
        flag = action.option_strings[-1]
        takes_value = action.nargs != 0
        name = f"{flag} {_metavar(action)}" if takes_value else flag
    else:
        name = _metavar(action) + (" ..." if action.nargs in ("*", "+", "...") else "")
    if action.required and action.option_strings:
        default = "required"
    elif action.default is None or action.default is False or not action.option_strings:
        default = ""
    else:
        default = f"`{action.default}`"
    what = (action.help or "").replace("|", "\\|")
    return f"| `{name}` | {default} | {what} |"


def _metavar(action: argparse.Action) -> str:
    if isinstance(action.metavar, str):
        return action.metavar
    if action.choices:
        return "{" + ",".join(str(c) for c in action.choices) + "}"
    return action.dest.upper() if action.option_strings else action.dest
