"""Property-based requests generated from the server's own OpenAPI schema: never a 5xx."""

from __future__ import annotations

from typing import Any

import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from server_harness import LiveServer

EXAMPLES = 10
CAP = {"max_tokens": 4, "max_completion_tokens": 4, "max_output_tokens": 4, "n": 2, "best_of": 2}


def _clamp(body: Any, model: str) -> None:
    """Name the served model (so bodies get past the 404) and keep generations tiny."""
    if not isinstance(body, dict):
        return
    if "model" in body:
        body["model"] = model
    for key, cap in CAP.items():
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[key] = cap
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 4:
        body["prompt"] = prompt[:4]


def test_no_server_errors(server: LiveServer) -> None:
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    checked = []
    for result in schema.get_all_operations():
        op = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            strategy = op.as_strategy(generation_mode=mode)

            @given(case=strategy)
            @settings(
                max_examples=EXAMPLES,
                deadline=None,
                database=None,
                derandomize=True,
                suppress_health_check=list(HealthCheck),
            )
            def run(case: Any) -> None:
                _clamp(case.body, server.model)
                response = case.call(base_url=server.url, timeout=60)
                assert response.status_code < 500, (
                    case.method,
                    case.path,
                    case.body,
                    response.text,
                )

            try:
                run()
            except Unsatisfiable:  # nothing to make invalid (no parameters, no body)
                assert mode is GenerationMode.NEGATIVE, op.label
        checked.append(op.label)
    assert len(checked) >= 14, checked
