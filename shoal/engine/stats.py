"""`EngineStats`: one snapshot of the engine, and what each figure means to a scraper.

Each field says whether it is a gauge (a level that goes up and down) or a counter (a total
that only grows), so `/metrics` exports it as the right Prometheus type without a second list
of names to keep in step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from shoal.engine.kv_cache_manager import KVCacheManager
    from shoal.engine.sessions import SessionManager

Kind = Literal["gauge", "counter"]


def _stat(kind: Kind, doc: str, metric: str | None = None, default: Any = 0) -> Any:
    return field(default=default, metadata={"kind": kind, "doc": doc, "metric": metric})


def _by_label(doc: str, metric: str, label: str) -> dict[str, Any]:
    """The metadata of a gauge per value of `label` (the field is a dict from label value to
    level)."""
    return {"kind": "gauge", "doc": doc, "metric": metric, "label": label}


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
    tier_writes: int = _stat("counter", "Finished turns written to the shared session tier.")
    tier_reads: int = _stat("counter", "Sessions restored from the shared session tier.")
    tier_write_failures: int = _stat("counter", "Turns the shared session tier failed to write.")
    tier_pending: int = _stat("gauge", "Turns queued for the shared session tier.")
    tier_lag_p95_ms: float = _stat(
        "gauge", "95th percentile lag from a turn's end to its durable tier copy, ms."
    )
    tier_lag_max_ms: float = _stat("gauge", "Longest lag to a durable tier copy so far, ms.")
    grammar_cache_hits: int = _stat(
        "counter", "Structured-output constraints found compiled in the grammar cache."
    )
    grammar_cache_misses: int = _stat("counter", "Structured-output constraints compiled.")
    spec_draft_tokens: int = _stat("counter", "Draft tokens proposed by prompt lookup.")
    spec_accepted_tokens: int = _stat("counter", "Draft tokens the model agreed with and kept.")
    weight_bytes: dict[str, int] = field(
        default_factory=dict,
        metadata=_by_label(
            "Resident bytes of the model's weights, by storage format.",
            "model_weight_bytes",
            "format",
        ),
    )

    @classmethod
    def collect(
        cls,
        kv: KVCacheManager,
        sessions: SessionManager,
        bytes_per_block: int,
        *,
        step_id: int,
        num_running: int,
        num_waiting: int,
        num_preemptions: int,
        num_generated_tokens: int,
        grammar_cache_hits: int = 0,
        grammar_cache_misses: int = 0,
        spec_draft_tokens: int = 0,
        spec_accepted_tokens: int = 0,
        weight_bytes: dict[str, int] | None = None,
    ) -> EngineStats:
        """The snapshot of any backend: its own counters plus what the shared pool, KV manager
        and session manager know, read the same way for each."""
        pool = kv.pool
        ss = sessions.stats
        return cls(
            step_id=step_id,
            num_running=num_running,
            num_waiting=num_waiting,
            blocks_used=pool.num_used,
            blocks_free=pool.num_free,
            kv_bytes_used=pool.num_used * bytes_per_block,
            kv_usage_ratio=pool.num_used / pool.num_blocks,
            prefix_cache_hit_rate=kv.prefix_stats.hit_rate,
            num_preemptions=num_preemptions,
            num_generated_tokens=num_generated_tokens,
            num_sessions=len(sessions),
            session_hits=ss.hits,
            session_tokens_reused=ss.tokens_reused,
            session_tokens_recomputed=ss.tokens_recomputed,
            disk_reads=ss.disk_reads,
            disk_writes=ss.disk_writes,
            restore_latency_p50_ms=1e3 * ss.restore_percentile(0.50),
            restore_latency_p95_ms=1e3 * ss.restore_percentile(0.95),
            **_tier_stats(sessions),
            grammar_cache_hits=grammar_cache_hits,
            grammar_cache_misses=grammar_cache_misses,
            spec_draft_tokens=spec_draft_tokens,
            spec_accepted_tokens=spec_accepted_tokens,
            weight_bytes=weight_bytes or {},
        )


def _tier_stats(sessions: SessionManager) -> dict[str, Any]:
    tier = sessions.tier
    if tier is None:
        return {}
    ts = tier.stats
    return {
        "tier_writes": ts.writes,
        "tier_reads": ts.reads,
        "tier_write_failures": ts.write_failures,
        "tier_pending": tier.pending,
        "tier_lag_p95_ms": 1e3 * ts.lag_percentile(0.95),
        "tier_lag_max_ms": 1e3 * ts.max_lag,
    }
