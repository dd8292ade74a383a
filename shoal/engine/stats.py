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
    disk_reads: int = _stat(
        "counter", "Session admissions that read KV back from disk or the shared folder."
    )
    disk_writes: int = _stat("counter", "Sessions persisted (blocks on disk, then a manifest).")
    restore_latency_p50_ms: float = _stat(
        "gauge", "Median read of a session's KV from below the pool (checked), ms."
    )
    restore_latency_p95_ms: float = _stat("gauge", "95th percentile session KV read, ms.")
    kv_host_blocks: int = _stat("gauge", "KV blocks held in host memory.")
    kv_host_bytes: int = _stat("gauge", "Bytes of KV blocks held in host memory.")
    kv_host_hits: int = _stat("counter", "Prefix lookups that found a block in host memory.")
    kv_host_promotions: int = _stat("counter", "Blocks copied from host memory into the pool.")
    kv_host_demotions: int = _stat("counter", "Blocks the pool evicted, copied to host memory.")
    kv_disk_blocks: int = _stat("gauge", "KV blocks held on the local disk.")
    kv_disk_bytes: int = _stat("gauge", "Bytes of KV block files on the local disk.")
    kv_disk_hits: int = _stat("counter", "Prefix lookups that found a block on disk.")
    kv_disk_promotions: int = _stat("counter", "Blocks read from disk back into the pool.")
    kv_disk_demotions: int = _stat("counter", "Blocks queued for the disk (host overflow, saves).")
    kv_disk_dropped: int = _stat("counter", "Unpinned blocks not written: the disk queue was full.")
    kv_shared_hits: int = _stat("counter", "Lookups that found a block in the shared folder.")
    kv_shared_promotions: int = _stat("counter", "Blocks read from the shared folder to the pool.")
    kv_pins: int = _stat("gauge", "Named pins (sessions, cache keys, breakpoints) on stored KV.")
    tier_writes: int = _stat("counter", "Finished turns written to the shared folder.")
    tier_reads: int = _stat("counter", "Session admissions that read KV from the shared folder.")
    tier_write_failures: int = _stat("counter", "Turns the shared folder failed to take.")
    tier_pending: int = _stat("gauge", "Turns queued for the shared folder.")
    tier_lag_p95_ms: float = _stat(
        "gauge", "95th percentile lag from a turn's end to its durable tier copy, ms."
    )
    tier_lag_max_ms: float = _stat("gauge", "Longest lag to a durable tier copy so far, ms.")
    grammar_cache_hits: int = _stat(
        "counter", "Structured-output constraints found compiled in the grammar cache."
    )
    grammar_cache_misses: int = _stat("counter", "Structured-output constraints compiled.")
    grammar_cache_bytes: int = _stat("gauge", "Bytes of compiled grammars in the grammar cache.")
    grammar_compile_seconds: float = _stat(
        "counter", "Seconds spent compiling grammars (in a worker, then in the engine)."
    )
    grammar_compile_refusals: int = _stat(
        "counter", "Constraints refused for their compile cost (time, memory) or a full queue."
    )
    grammar_compiles_pending: int = _stat("gauge", "Grammar compiles queued or running.")
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
        grammars: Any = None,
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
            tier_reads=ss.tier_reads,
            **_store_stats(sessions),
            **_grammar_stats(grammars),
            spec_draft_tokens=spec_draft_tokens,
            spec_accepted_tokens=spec_accepted_tokens,
            weight_bytes=weight_bytes or {},
        )


def _grammar_stats(grammars: Any) -> dict[str, Any]:
    """The counters of an `engine/structured.Grammars`, if the backend has one."""
    if grammars is None:
        return {}
    return {
        "grammar_cache_hits": grammars.hits,
        "grammar_cache_misses": grammars.misses,
        "grammar_cache_bytes": grammars.cached_bytes,
        "grammar_compile_seconds": grammars.compile_seconds,
        "grammar_compile_refusals": grammars.refusals,
        "grammar_compiles_pending": grammars.pending,
    }


def _store_stats(sessions: SessionManager) -> dict[str, Any]:
    store = sessions.store
    t = store.stats.tiers
    out: dict[str, Any] = {
        "kv_host_blocks": len(store.host),
        "kv_host_bytes": store.host.stored_bytes,
        "kv_disk_blocks": len(store.disk),
        "kv_disk_bytes": store.disk.stored_bytes,
        "kv_disk_dropped": store.disk.dropped,
        "kv_pins": len(store.pins),
    }
    for tier in ("host", "disk", "shared"):
        out[f"kv_{tier}_hits"] = t[tier].hits
        out[f"kv_{tier}_promotions"] = t[tier].promotions
    out["kv_host_demotions"] = t["host"].demotions
    out["kv_disk_demotions"] = t["disk"].demotions
    shared = store.shared
    if shared is not None:
        st = shared.stats
        out.update(
            tier_writes=st.writes,
            tier_write_failures=st.write_failures,
            tier_pending=shared.pending,
            tier_lag_p95_ms=1e3 * st.lag_percentile(0.95),
            tier_lag_max_ms=1e3 * st.max_lag,
        )
    return out
