"""Helpers for Batch API tests: build JSONL, poll to a terminal state, read result files."""

from __future__ import annotations

import io
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai

TERMINAL = ("completed", "failed", "cancelled", "expired")


def chat_line(
    custom_id: str, model: str, content: str, max_tokens: int = 8, **extra: Any
) -> dict[str, Any]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return ("\n".join(json.dumps(x) for x in lines) + "\n").encode()


def upload(client: openai.OpenAI, data: bytes, name: str = "in.jsonl") -> str:
    return client.files.create(file=(name, io.BytesIO(data)), purpose="batch").id


def submit_batch(
    client: openai.OpenAI, lines: list[dict[str, Any]], endpoint: str = "/v1/chat/completions"
) -> Any:
    """Upload `lines` as a batch file and start a batch over it."""
    return client.batches.create(
        input_file_id=upload(client, jsonl(lines)), endpoint=endpoint, completion_window="24h"
    )  # type: ignore[arg-type]


def wait_batch(
    client: openai.OpenAI, batch_id: str, timeout: float = 120, until: tuple[str, ...] = TERMINAL
) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        b = client.batches.retrieve(batch_id)
        if b.status in until:
            return b
        time.sleep(0.1)
    raise AssertionError(f"batch {batch_id} still {b.status} after {timeout}s")


def read_lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    text = client.files.content(file_id).text
    return [json.loads(ln) for ln in text.splitlines() if ln.strip()]


@dataclass
class HeldLines:
    """The test's side of `shoal.server.line_gate`: closing the gate holds every answered
    batch line before its result is stored, so a kill or a cancel provably lands while lines
    are claimed and in flight, on any CPU."""

    folder: Path

    def close(self, let_through: int = 0) -> None:
        """Hold every answered line from now on, but the next `let_through` ones."""
        self.folder.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.folder / "passes", ignore_errors=True)
        staged = self.folder / "closed.new"
        staged.write_text(str(let_through))
        staged.replace(self.folder / "closed")

    def open(self) -> None:
        (self.folder / "closed").unlink(missing_ok=True)

    def by_process(self) -> dict[int, list[str]]:
        """{pid: custom ids} of the lines held now."""
        held: dict[int, list[str]] = {}
        for marker in (self.folder / "held").glob("*-*"):
            try:
                custom_id = marker.read_text()
            except FileNotFoundError:  # released meanwhile
                continue
            held.setdefault(int(marker.name.split("-")[0]), []).append(custom_id)
        return held

    def wait(self, what: Callable[[dict[int, list[str]]], bool], timeout: float = 120) -> None:
        """Until `what(by_process())` holds (bounded)."""
        deadline = time.monotonic() + timeout
        while not what(held := self.by_process()):
            assert time.monotonic() < deadline, f"held lines never matched: {held}"
            time.sleep(0.02)
