"""Anthropic prompt caching on shoal's KV store: `cache_control` breakpoints, cache usage, and
what Claude Code sends that would defeat any prefix cache.

- `cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}` on system blocks, message
  content blocks and tool definitions, or at the top level (the last block of the last
  message): the prompt's prefix up to each breakpoint is pinned in the store for its TTL
  (`engine.pins.CachePin`), so host memory and disk keep it longest. More than 4 → 400, as
  Anthropic answers. A breakpoint's position in tokens is where the prompt rendered up to that
  block stops agreeing with the whole prompt.
- Usage: `cache_read_input_tokens` are the prompt tokens served from any tier of the store,
  `cache_creation_input_tokens` those computed up to the last breakpoint, `input_tokens` the
  rest (Anthropic's split: the three add up to the prompt).
- Claude Code puts a per-request `x-anthropic-billing-header: ...; cch=...` line first in its
  first system block; it changes every request, so nothing after it could ever be reused
  (llama.cpp strips it too). It is removed before tokenising unless the server is told to
  keep it (`--keep-billing-header`).
"""

from __future__ import annotations

from typing import Any, TypeVar

from shoal.engine.pins import CachePin
from shoal.engine.sessions import common_prefix_len
from shoal.server.anthropic.protocol import ContentBlock, MessageParam, MessagesRequest, Prompt
from shoal.server.errors import APIError

MAX_BREAKPOINTS = 4
TTLS = {"5m": 300.0, "1h": 3600.0}
BILLING_HEADER = "x-anthropic-billing-header:"
R = TypeVar("R", bound=Prompt)


def strip_billing_header(req: R) -> R:
    """`req` without Claude Code's per-request billing line in its first system block."""
    system = req.system
    if isinstance(system, str):
        if system.startswith(BILLING_HEADER):
            return req.model_copy(update={"system": _without_first_line(system)})
        return req
    if not system or not (system[0].text or "").startswith(BILLING_HEADER):
        return req
    first = system[0].model_copy(update={"text": _without_first_line(system[0].text or "")})
    blocks = [first, *system[1:]] if first.text else list(system[1:])
    return req.model_copy(update={"system": blocks})


def _without_first_line(text: str) -> str:
    return text.split("\n", 1)[1] if "\n" in text else ""


def _ttl(control: Any, where: str) -> float:
    if not isinstance(control, dict) or control.get("type") != "ephemeral":
        raise APIError(400, f"{where}.cache_control: type must be 'ephemeral'")
    ttl = control.get("ttl", "5m")
    if ttl not in TTLS:
        raise APIError(400, f"{where}.cache_control.ttl: must be '5m' or '1h', not {ttl!r}")
    return TTLS[ttl]


def _control(obj: Any) -> Any:
    extra = getattr(obj, "model_extra", None) or {}
    return extra.get("cache_control")


# A breakpoint: (message index or -1 for the system prompt and tools, block index, TTL).
Breakpoint = tuple[int, int, float]


def breakpoints(req: MessagesRequest) -> list[Breakpoint]:
    """Where `req` asks for caching, checked (400 for a bad one, or more than 4)."""
    found: list[Breakpoint] = []
    for i, tool in enumerate(req.tools or []):
        if (c := _control(tool)) is not None:
            found.append((-1, -1, _ttl(c, f"tools.{i}")))
    if isinstance(req.system, list):
        for j, block in enumerate(req.system):
            if (c := _control(block)) is not None:
                found.append((-1, j, _ttl(c, f"system.{j}")))
    for i, m in enumerate(req.messages):
        for j, block in enumerate(m.content if isinstance(m.content, list) else []):
            if (c := _control(block)) is not None:
                found.append((i, j, _ttl(c, f"messages.{i}.content.{j}")))
    if (c := _control(req)) is not None:  # the top level marks the last block
        last = req.messages[-1]
        n = len(last.content) if isinstance(last.content, list) else 1
        found.append((len(req.messages) - 1, n - 1, _ttl(c, "request")))
    if len(found) > MAX_BREAKPOINTS:
        raise APIError(
            400,
            f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. "
            f"Found {len(found)}.",
        )
    return found


def truncated(req: MessagesRequest, bp: Breakpoint) -> MessagesRequest:
    """`req` cut just after the breakpoint's block (a placeholder user turn after the system
    prompt: the render agrees with the whole prompt up to where that turn starts)."""
    i, j, _ = bp
    if i < 0:
        system = req.system[: j + 1] if isinstance(req.system, list) and j >= 0 else req.system
        filler = MessageParam(role="user", content=[ContentBlock(type="text", text="\x00")])
        return req.model_copy(update={"system": system, "messages": [filler]})
    m = req.messages[i]
    content = m.content[: j + 1] if isinstance(m.content, list) else m.content
    messages = [*req.messages[:i], m.model_copy(update={"content": content})]
    return req.model_copy(update={"messages": messages})


def cache_pins(positions: list[tuple[int, float]]) -> tuple[CachePin, ...]:
    return tuple(CachePin(None, n, ttl) for n, ttl in positions if n > 0)


def position(full: list[int], prefix: list[int]) -> int:
    return common_prefix_len(full, prefix)


def usage(
    prompt_tokens: int, cached: int, output_tokens: int, positions: list[tuple[int, float]]
) -> dict[str, Any]:
    """Anthropic's usage: read from the cache, written at a breakpoint, and the rest."""
    last = max(positions, default=(0, TTLS["5m"]))
    created = max(0, min(last[0], prompt_tokens) - cached)
    split = {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0}
    split["ephemeral_1h_input_tokens" if last[1] > 300 else "ephemeral_5m_input_tokens"] = created
    return {
        "input_tokens": prompt_tokens - cached - created,
        "cache_creation_input_tokens": created,
        "cache_read_input_tokens": cached,
        "cache_creation": split,
        "output_tokens": output_tokens,
    }
