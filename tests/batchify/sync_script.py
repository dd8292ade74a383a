"""An unmodified sync script for `shoal batchify`: a thread pool of `openai.OpenAI` calls,
the replies printed as JSON. `python sync_script.py URL MODEL`."""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor

import openai

PROMPTS = ["sync one", "sync two", "sync three"]


def main(url: str, model: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="k1", max_retries=0)

    def ask(prompt: str) -> str | None:
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=4,
            temperature=0,
        )
        return reply.choices[0].message.content

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        print(json.dumps(list(pool.map(ask, PROMPTS))))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
