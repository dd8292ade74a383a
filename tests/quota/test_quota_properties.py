"""Hypothesis: the backends against the in-memory oracle.

Sequentially every answer and every usage figure must equal the oracle's. SQLite runs on a
hand-moved clock (windows roll, leases expire, the clock even steps back); Redis keeps its own
clock, so there windows are long, time-dependent `retry_after_ms` is compared within the
test's duration, and the rest exactly.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from quota_helpers import complete, concurrency, rate, reserve, used
from quota_oracle import Oracle
from ulid import ULID

from shoal.quota import LeasePolicy, QuotaService, ReserveResult
from shoal.quota.redis_backend import RedisBackend
from shoal.quota.sqlite_backend import SQLiteBackend
from shoal.quota.testing import LocalRedis, ManualClock

POLICY = LeasePolicy(ttl_s=40, concurrency_retry_s=1)
LIMITS = [rate("r1", 5, 10), rate("r2", 20, 30), concurrency("c1", 2, 20)]
KEYS = st.sampled_from(["r1", "r1", "r2", "r2", "c1", "c1", "zz"])  # zz: unknown

requirements = st.lists(st.tuples(KEYS, st.integers(1, 6)), min_size=1, max_size=3).map(
    lambda reqs: list(dict(reqs).items())  # one amount per key
)
reserve_item = st.tuples(
    requirements,
    st.one_of(st.none(), st.integers(0, 1000)),  # replay an earlier lease id?
    st.booleans(),  # ...with its own requirements (else with these: a conflict, mostly)
)
actuals = st.lists(st.tuples(KEYS, st.integers(0, 12)), max_size=2).map(
    lambda acts: list(dict(acts).items())
)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("reserve"), st.lists(reserve_item, min_size=1, max_size=4)),
        st.tuples(
            st.just("complete"),
            st.lists(st.tuples(st.integers(0, 1000), actuals), min_size=1, max_size=3),
        ),
        st.tuples(st.just("advance"), st.integers(-2000, 25_000)),
    ),
    max_size=25,
)


def _service(kind: str, clock: ManualClock, redis: LocalRedis | None, tmp: Path) -> QuotaService:
    if kind == "sqlite":
        backend: SQLiteBackend | RedisBackend = SQLiteBackend(
            tmp / f"{ULID()}.db", policy=POLICY, clock=clock
        )
    else:
        assert redis is not None
        backend = RedisBackend(redis.client(), policy=POLICY, prefix=f"p:{ULID()}")
    service = QuotaService(backend)
    service.put_limits(LIMITS)
    return service


def _same(kind: str, got: ReserveResult, want: ReserveResult) -> bool:
    if kind == "sqlite":
        return got == want
    # Redis: its own clock. Decisions and errors exactly; times within the test's duration.
    return (
        (got.allowed, got.error) == (want.allowed, want.error)
        and abs(got.retry_after_ms - want.retry_after_ms) <= 5000
        and (got.reserved_at_unix_ms > 0) == (want.reserved_at_unix_ms > 0)
    )


def _run(kind: str, ops: list[Any], redis: LocalRedis | None) -> None:
    clock = ManualClock()
    with tempfile.TemporaryDirectory() as tmp:
        service = _service(kind, clock, redis, Path(tmp))
        oracle = Oracle(LIMITS, POLICY, clock.now)
        leases: list[tuple[str, list[tuple[str, int]]]] = []
        try:
            for op, arg in ops:
                if op == "advance":
                    if kind == "sqlite":
                        clock.advance(arg)
                    continue
                if op == "reserve":
                    items = []
                    for reqs, replay, own in arg:
                        if replay is not None and leases:
                            lease_id, first = leases[replay % len(leases)]
                            reqs = first if own else reqs
                        else:
                            lease_id = str(ULID())
                            leases.append((lease_id, reqs))
                        items.append(reserve(*reqs, lease_id=lease_id))
                    got = service.batch_reserve(items)
                    want = [
                        oracle.reserve(
                            i.lease_id, "", [(r.key, r.amount) for r in i.requirements], clock.now
                        )
                        for i in items
                    ]
                    assert all(_same(kind, g, w) for g, w in zip(got, want, strict=True)), (
                        got,
                        want,
                    )
                else:
                    if not leases:
                        continue
                    done = [complete(leases[ref % len(leases)][0], *acts) for ref, acts in arg]
                    got_c = service.batch_complete(done)
                    want_c = [
                        oracle.complete(
                            c.lease_id, [(a.key, a.actual_amount) for a in c.actuals], clock.now
                        )
                        for c in done
                    ]
                    assert got_c == want_c
                assert used(service) == oracle.usage(clock.now)
        finally:
            service.close()


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=operations)
def test_backends_match_the_oracle_step_by_step(
    kind: str, ops: list[Any], request: pytest.FixtureRequest
) -> None:
    redis = request.getfixturevalue("redis_server") if kind == "redis" else None
    _run(kind, ops, redis)
