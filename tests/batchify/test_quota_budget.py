"""A batchify scope with a quota policy: each batch reserves before it is submitted and is
reconciled with the tokens its results used; a batch the budget refuses is never submitted."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from batchify_helpers import FAST
from fake_providers import FakeOpenAI

from shoal.batchify import BatchSpec, BatchSubmitError, QuotaPolicy, batchify
from shoal.quota import Limit, LimitKind, QuotaClient, QuotaService, Requirement
from shoal.quota.sqlite_backend import SQLiteBackend

URL = "http://openai.fake/v1"


@pytest.fixture
def service(tmp_path: Path) -> Iterator[QuotaService]:
    service = QuotaService(SQLiteBackend(tmp_path / "q.db"))
    service.put_limits(
        [Limit("rpm", LimitKind.RATE, 6, 60), Limit("tpm", LimitKind.RATE, 1000, 60)]
    )
    yield service
    service.close()


def _requirements(spec: BatchSpec) -> list[Requirement]:
    assert spec.adapter == "openai" and spec.model == "m"
    assert spec.endpoint == "/v1/chat/completions"
    n = len(spec.bodies)
    return [Requirement("rpm", n), Requirement("tpm", 100 * n)]


async def _run(tmp_path: Path, fake: FakeOpenAI, policy: QuotaPolicy, n: int) -> list[object]:
    client = openai.AsyncOpenAI(base_url=URL, api_key="k", max_retries=0)
    kw = {**FAST, "cache_path": tmp_path / "c.sqlite3", "provider_transport": fake.transport()}
    async with batchify(batch_size=3, quota=policy, **kw):
        asks = [[{"role": "user", "content": f"{i}"}] for i in range(n)]
        calls = [client.chat.completions.create(model="m", messages=m) for m in asks]  # type: ignore[arg-type]
        return await asyncio.gather(*calls, return_exceptions=True)


def _used(service: QuotaService) -> dict[str, int]:
    return {u.key: u.used for u in service.usage()}


async def test_each_batch_reserves_and_is_charged_the_tokens_it_used(
    tmp_path: Path, service: QuotaService
) -> None:
    fake = FakeOpenAI()
    policy = QuotaPolicy(QuotaClient(service), _requirements, tokens_key="tpm")
    got = await _run(tmp_path, fake, policy, 6)
    texts = [g.choices[0].message.content for g in got]  # type: ignore[attr-defined]
    assert texts == [f"echo {i}" for i in range(6)]
    assert len([b for b in fake.batches if b.startswith("batch_")]) == 2
    # 6 requests as reserved; 300 tokens reserved per batch, reconciled to 5 per request.
    assert _used(service) == {"rpm": 6, "tpm": 30}


async def test_a_batch_the_budget_refuses_is_never_submitted(
    tmp_path: Path, service: QuotaService
) -> None:
    service.put_limits([Limit("rpm", LimitKind.RATE, 2, 60)])
    fake = FakeOpenAI()
    policy = QuotaPolicy(QuotaClient(service), _requirements, max_wait_s=0)
    got = await _run(tmp_path, fake, policy, 3)
    assert all(isinstance(g, BatchSubmitError) for g in got)
    assert "quota" in str(got[0])
    assert not [b for b in fake.batches if b.startswith("batch_")]
    assert _used(service) == {"rpm": 0, "tpm": 0}
