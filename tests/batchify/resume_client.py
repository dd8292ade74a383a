"""A user's script, run in a subprocess by the crash tests: chat calls inside a scope, the
replies written as JSON. `python resume_client.py URL MODEL CACHE POLL_S OUT`."""

from __future__ import annotations

import asyncio
import json
import sys

import openai

from shoal.batchify import batchify

PROMPTS = [f"resume me {i}" for i in range(5)]


async def main(url: str, model: str, cache: str, poll_s: float, out: str) -> None:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k1", max_retries=0)
    async with batchify(
        cache_path=cache,
        window_s=0.1,
        poll_interval_s=poll_s,
        max_poll_interval_s=poll_s,
        live_progress=False,
    ) as b:
        got = await asyncio.gather(
            *(
                client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": p}],
                    max_tokens=4,
                    temperature=0,
                )
                for p in PROMPTS
            )
        )
    replies = [r.choices[0].message.content for r in got]
    with open(out, "w") as f:
        json.dump({"replies": replies, "batches": b.stats.batches, "hits": b.stats.cache_hits}, f)


if __name__ == "__main__":
    url, model, cache, poll_s, out = sys.argv[1:6]
    asyncio.run(main(url, model, cache, float(poll_s), out))
