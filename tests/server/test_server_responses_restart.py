"""A response chain across a restart: the stored responses are still there, the third turn
reuses the session KV the second turn left on disk (restored, not recomputed), and its
answer equals that of a server that has the stored responses but no KV at all."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from server_harness import SpawnedServer

from shoal.server.state import STORE_FILE

GREEDY: dict[str, Any] = {"temperature": 0, "max_output_tokens": 12}


def test_a_chain_keeps_its_kv_across_a_restart(
    spawn_server: Callable[..., SpawnedServer], tmp_path: Path
) -> None:
    data, bare = tmp_path / "data", tmp_path / "bare"
    srv = spawn_server(data)
    c = srv.client()
    model = c.models.list().data[0].id
    r1 = c.responses.create(model=model, input="Tell a story about a fox.", **GREEDY)
    r2 = c.responses.create(model=model, input="And then?", previous_response_id=r1.id, **GREEDY)
    assert r2.usage and r2.usage.input_tokens_details.cached_tokens > 0
    assert srv.terminate() in (0, -15)  # a clean stop saves the sessions
    bare.mkdir()
    for f in data.glob(f"{STORE_FILE}*"):  # the stored responses, without any session KV
        shutil.copy(f, bare / f.name)

    again = spawn_server(data).client()
    assert again.responses.retrieve(r2.id).model_dump() == r2.model_dump()
    r3 = again.responses.create(
        model=model, input="How did it end?", previous_response_id=r2.id, **GREEDY
    )
    assert r3.usage is not None
    cached = r3.usage.input_tokens_details.cached_tokens
    assert cached == r2.usage.input_tokens + r2.usage.output_tokens - 1

    cold = (
        spawn_server(bare)
        .client()
        .responses.create(
            model=model, input="How did it end?", previous_response_id=r2.id, **GREEDY
        )
    )
    assert cold.usage is not None and cold.usage.input_tokens_details.cached_tokens == 0
    assert cold.usage.input_tokens == r3.usage.input_tokens
    assert cold.output_text == r3.output_text
    assert cold.usage.output_tokens == r3.usage.output_tokens
