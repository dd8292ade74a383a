"""Where the agent CLIs the tests run are installed: `make codex` and `make claude-code` put
them under .tools/ (npm packages that ship their programs); `SHOAL_CODEX` / `SHOAL_CLAUDE` or
the PATH name others. None where npm could not install them (their tests skip, saying so)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NOT_INSTALLED = "{} is not installed: `make {}` (npm) could not install it here"


def _find(env: str, tool: str, program: str) -> str | None:
    return (
        os.environ.get(env)
        or shutil.which(str(REPO / f".tools/{tool}/node_modules/.bin/{program}"))
        or shutil.which(program)
    )


def codex() -> str | None:
    return _find("SHOAL_CODEX", "codex", "codex")


def claude_code() -> str | None:
    return _find("SHOAL_CLAUDE", "claude-code", "claude")
