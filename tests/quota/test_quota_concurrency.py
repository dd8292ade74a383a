"""Hypothesis: many clients at once, as threads sharing a service and as processes each with
its own connection, on SQLite and on the real Redis.

While they run, a watcher samples usage: it never exceeds a capacity. Afterwards the final
usage must equal what the oracle derives from the clients' own observations (every admitted
lease's charge, every release), replays must have answered their first decision, and a key
that only ever gets single-unit requests must have admitted exactly min(demand, capacity):
no lost update over-admits, no spurious denial under-admits. Windows are long, so nothing
expires mid-test and the checks need no clock.
"""

from __future__ import annotations

import multiprocessing
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from quota_helpers import complete, concurrency, rate, reserve, used
from ulid import ULID

from shoal.quota import LeasePolicy, QuotaService
from shoal.quota.redis_backend import RedisBackend
from shoal.quota.sqlite_backend import SQLiteBackend
from shoal.quota.testing import LocalRedis

POLICY = LeasePolicy(ttl_s=3600)
Job = tuple[list[tuple[str, int]], bool, bool, float]  # requirements, replay, complete, spent


@dataclass(frozen=True)
class Spec:
    """How a worker opens the backend: a SQLite file, or a Redis port and key prefix."""

    kind: str
    where: str
    prefix: str = ""

    def open(self) -> QuotaService:
        if self.kind == "sqlite":
            return QuotaService(SQLiteBackend(self.where, policy=POLICY))
        import redis

        client = redis.Redis(host="127.0.0.1", port=int(self.where))
        return QuotaService(RedisBackend(client, policy=POLICY, prefix=self.prefix))


@dataclass(frozen=True)
class Seen:
    reqs: tuple[tuple[str, int], ...]
    allowed: bool
    replay_same: bool
    completed: bool
    spent: tuple[tuple[str, int], ...]


def run_jobs(service: QuotaService, batches: list[list[Job]]) -> list[Seen]:
    seen = []
    for batch in batches:
        items = [reserve(*reqs, lease_id=str(ULID())) for reqs, *_ in batch]
        results = service.batch_reserve(items)
        replays = [item for item, (_, replay, *_) in zip(items, batch, strict=True) if replay]
        again = iter(service.batch_reserve(replays) if replays else [])
        dones = []
        for item, result, (reqs, replay, done, frac) in zip(items, results, batch, strict=True):
            # solo is never refunded, so its admissions can be counted against its capacity.
            spent = (
                tuple((k, int(a * frac)) for k, a in reqs if k in ("rpm", "tpm")) if done else ()
            )
            same = next(again) == result if replay else True
            completed = done and result.allowed
            if completed:
                dones.append(complete(item.lease_id, *spent))
            seen.append(Seen(tuple(reqs), result.allowed, same, completed, spent))
        if dones:
            assert all(r.ok for r in service.batch_complete(dones))
    return seen


def run_in_process(spec: Spec, batches: list[list[Job]]) -> list[Seen]:
    service = spec.open()
    try:
        return run_jobs(service, batches)
    finally:
        service.close()


jobs = st.tuples(
    st.sampled_from(
        [
            [("solo", 1)],
            [("rpm", 1), ("tpm", 40)],
            [("rpm", 1), ("tpm", 90), ("jobs", 1)],
            [("tpm", 30), ("jobs", 1)],
            [("rpm", 2)],
        ]
    ),
    st.booleans(),
    st.booleans(),
    st.sampled_from([0.0, 0.5, 1.0]),
)
workloads = st.tuples(
    st.integers(1, 12),  # solo capacity
    st.integers(3, 15),  # rpm capacity
    st.integers(100, 600),  # tpm capacity
    st.integers(1, 3),  # jobs (concurrency) capacity
    st.lists(
        st.lists(st.lists(jobs, min_size=1, max_size=3), min_size=2, max_size=5),
        min_size=3,
        max_size=3,
    ),
)


@pytest.fixture(scope="module")
def processes() -> Iterator[ProcessPoolExecutor]:
    # spawn, not fork: by now this process has threads (servers of other tests) whose locks
    # a forked child would inherit held. shoal.quota imports no torch, so spawning is quick.
    with ProcessPoolExecutor(3, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield pool


def _check(
    service: QuotaService, spec: Spec, caps: dict[str, int], plans: list[Any], start: Any
) -> None:
    samples: list[dict[str, int]] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(0.002):
            samples.append(used(service))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        futures: list[Future[list[Seen]]] = [start(spec, plan) for plan in plans]
        seen = [s for f in futures for s in f.result(timeout=60)]
    finally:
        stop.set()
        watcher.join()
    samples.append(used(service))
    for sample in samples:
        assert all(sample[k] <= caps[k] for k in caps), sample
    assert all(s.replay_same for s in seen)
    admitted = [s for s in seen if s.allowed]
    want = dict.fromkeys(caps, 0)
    for s in admitted:
        spent = dict(s.spent)
        for key, amount in s.reqs:
            if key == "jobs":
                want[key] += 0 if s.completed else amount
            else:
                want[key] += spent.get(key, amount) if s.completed else amount
    assert samples[-1] == want
    solo = [s for s in seen if s.reqs == (("solo", 1),)]
    assert sum(s.allowed for s in solo) == min(len(solo), caps["solo"])


def _limits(caps: dict[str, int]) -> list[Any]:
    return [
        rate("solo", caps["solo"], 3600),
        rate("rpm", caps["rpm"], 3600),
        rate("tpm", caps["tpm"], 3600),
        concurrency("jobs", caps["jobs"], 3600),
    ]


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
@pytest.mark.parametrize("how", ["threads", "processes"])
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(workload=workloads)
def test_concurrent_clients_never_exceed_capacity(
    kind: str, how: str, workload: Any, request: pytest.FixtureRequest
) -> None:
    solo, rpm, tpm, jobs_cap, plans = workload
    caps = {"solo": solo, "rpm": rpm, "tpm": tpm, "jobs": jobs_cap}
    with tempfile.TemporaryDirectory() as tmp:
        if kind == "sqlite":
            spec = Spec("sqlite", str(Path(tmp) / "q.db"))
        else:
            server: LocalRedis = request.getfixturevalue("redis_server")
            spec = Spec("redis", str(server.port), f"c:{ULID()}")
        service = spec.open()
        try:
            service.put_limits(_limits(caps))
            if how == "processes":
                pool = request.getfixturevalue("processes")
                _check(service, spec, caps, plans, lambda s, p: pool.submit(run_in_process, s, p))
            else:
                with ThreadPoolExecutor(len(plans)) as threads:
                    _check(
                        service,
                        spec,
                        caps,
                        plans,
                        lambda _s, p: threads.submit(run_jobs, service, p),
                    )
        finally:
            service.close()
