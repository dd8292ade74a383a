"""Two tenants on one server (`--keys`): the keys file the tenancy tests share, and clients of
each SDK per key."""

from __future__ import annotations

from pathlib import Path

import anthropic
import openai
from server_harness import LiveServer

from shoal.server.keys import hash_key

ALPHA, BETA, GAMMA, OPERATOR = "key-alpha", "key-beta", "key-gamma", "key-operator"
SHARED_SYSTEM = "You are a careful assistant. " * 12  # declared shareable in the keys file
LONG = "Tell me everything about the sea, the rivers and the rain. " * 5  # several KV blocks


def keys_file(folder: Path) -> Path:
    """alpha, beta and gamma (1 request a minute under `--quota`), each with a key; the shared
    system prompt as the template renders it."""
    shared = f"<|im_start|>system\\n{SHARED_SYSTEM}<|im_end|>\\n"
    text = f'shared_prefix = ["{shared}"]\n'
    for key, tenant in ((ALPHA, "alpha"), (BETA, "beta"), (GAMMA, "gamma")):
        text += f'[[key]]\nsha256 = "{hash_key(key)}"\ntenant = "{tenant}"\n'
    text += "[tenant.gamma]\nrpm = 1\n"
    path = folder / "keys.toml"
    path.write_text(text)
    return path


def oai(live: LiveServer, key: str) -> openai.OpenAI:
    return live.client(api_key=key)


def claude(live: LiveServer, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live.url, api_key=key, max_retries=0, timeout=60)


def cached_chat(client: openai.OpenAI, model: str, messages: list, **kw: object) -> int:
    """Prompt tokens a chat answer says the server did not compute."""
    chat = client.chat.completions.create(
        model=model, messages=messages, max_tokens=2, temperature=0, **kw
    )
    assert chat.usage is not None and chat.usage.prompt_tokens_details is not None
    return chat.usage.prompt_tokens_details.cached_tokens or 0
