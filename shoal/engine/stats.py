"""`EngineStats`: one snapshot of the engine, and what each figure means to a scraper.

Each field says whether it is a gauge (a level that goes up and down) or a counter (a total
that only grows), so `/metrics` exports it as the right Prometheus type without a second list
of names to keep in step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["gauge", "counter"]


def _stat(kind: Kind, doc: str, metric: str | None = None, default: Any = 0) -> Any:
    return field(default=default, metadata={"kind": kind, "doc": doc, "metric": metric})


@dataclass(slots=True)
class EngineStats:
    step_id: int = _stat("counter", "Engine steps run.", "engine_steps")
    num_running: int = _stat("gauge", "Requests in the running batch.", "num_requests_running")
    num_waiting: int = _stat("gauge", "Requests waiting to be scheduled.", "num_requests_waiting")
    blocks_used: int = _stat("gauge", "KV blocks in use.", "kv_cache_blocks_used")
    blocks_free: int = _stat("gauge", "KV blocks free.", "kv_cache_blocks_free")
    kv_bytes_used: int = _stat("gauge", "Bytes of KV blocks in use.", "kv_cache_bytes_used")
    kv_usage_ratio: float = _stat("gauge", "Fraction of KV blocks in use.", "kv_cache_usage_ratio")
    prefix_cache_hit_rate: float = _stat("gauge", "Prompt tokens served from the prefix cache.")
    num_preemptions: int = _stat("counter", "Requests preempted.")
    num_generated_tokens: int = _stat("counter", "Tokens generated.", "generation_tokens")
    num_sessions: int = _stat("gauge", "Agent sessions held in memory or on disk.")
    session_hits: int = _stat("counter", "Session requests admitted reusing their session's KV.")
    session_tokens_reused: int = _stat("counter", "Prompt tokens of session requests not computed.")
    session_tokens_recomputed: int = _stat("counter", "Prompt tokens of session requests computed.")
    disk_reads: int = _stat("counter", "Session KV restores read from disk.")
    disk_writes: int = _stat("counter", "Session KV copies written to disk.")
    restore_latency_p50_ms: float = _stat(
        "gauge", "Median session restore (disk read, validation, copy into the pool), ms."
    )
    restore_latency_p95_ms: float = _stat("gauge", "95th percentile session restore, ms.")
