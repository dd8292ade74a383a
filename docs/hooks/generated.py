"""MkDocs hook: pages' markers become references rendered from the code at each build, so
they cannot drift from it: every `shoal` command's options (`shoal.cli.reference`, from the
command line's own parsers) and the engine's Prometheus metrics (`EngineStats`' fields)."""

from __future__ import annotations

import dataclasses
from typing import Any

CLI = "<!-- shoal cli reference -->"
ENGINE_METRICS = "<!-- shoal engine metrics -->"


def engine_metrics() -> str:
    from shoal.engine.stats import EngineStats

    rows = ["| metric | type | what it counts |", "| --- | --- | --- |"]
    for f in dataclasses.fields(EngineStats):
        name = f"shoal_{f.metadata['metric'] or f.name}"
        kind = f.metadata["kind"]
        series = f"{name}_total" if kind == "counter" else name
        rows.append(f"| `{series}` | {kind} | {f.metadata['doc']} |")
    return "\n".join(rows)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    if CLI in markdown:
        from shoal.cli.reference import markdown as reference

        markdown = markdown.replace(CLI, reference())
    if ENGINE_METRICS in markdown:
        markdown = markdown.replace(ENGINE_METRICS, engine_metrics())
    return markdown
