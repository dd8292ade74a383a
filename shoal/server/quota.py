"""`shoal serve --quota CONFIG`: admission through `shoal.quota`, per tenant (or API key)
and model.

CONFIG is a limits file as `shoal quota serve` reads it, plus a `[serve]` table giving each
(API key, model) pair its budget over a rolling window:

    [serve]
    rpm = 60          # requests, counted on arrival
    tpm = 40000       # tokens: prompt + max_tokens reserved on arrival, then reconciled
    window_s = 60     # with the tokens the answer really used

A request over budget is refused at once with 429, `Retry-After` and an OpenAI-style error
(the official SDKs wait and retry); one that could never fit is a 400. With `--keys`, the
budget is the tenant's (`serve:tenant-<quota_key>:<model>:...`, with the tenant's own `rpm`
and `tpm` when its entry gives them); without, the API key is the caller's Bearer token,
kept only as a hash in limit keys, and without one the caller is `anonymous`. The quota
routes (`/v1/reserve/batch`, ...) are served beside the OpenAI ones, so jobs elsewhere can
share the same budgets (with `--keys`, to the `default` tenant only: the operator's).
Batch API lines are not metered here.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
from collections.abc import AsyncGenerator, Mapping
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.outputs import RequestOutput
from shoal.quota import (
    Actual,
    AsyncQuotaClient,
    CompleteRequest,
    ItemError,
    Limit,
    LimitKind,
    QuotaConfig,
    QuotaError,
    QuotaService,
    Requirement,
    ReserveRequest,
    new_lease_id,
)
from shoal.quota.limits import (
    check_fields,
    parse_config,
    positive_int,
    positive_number,
    read_toml,
)
from shoal.server import formatting as fmt
from shoal.server.errors import APIError
from shoal.server.serving import Prepared
from shoal.server.tenancy import Tenant

log = logging.getLogger("shoal.server")
_RETRY = {"Retry-After": "1"}
Output = tuple[int, RequestOutput]
Outputs = AsyncGenerator[Output]


@dataclass(frozen=True, slots=True)
class ServeBudget:
    """Each (API key, model) pair's budget; None: not limited."""

    rpm: int | None = None
    tpm: int | None = None
    window_s: float = 60.0


def _budget(table: Mapping[str, Any]) -> ServeBudget:
    check_fields(table, {"rpm", "tpm", "window_s"}, "[serve]")
    return ServeBudget(
        positive_int(table, "rpm"),
        positive_int(table, "tpm"),
        positive_number(table, "window_s", 60),
    )


def read_config(path: str | Path) -> tuple[QuotaConfig, ServeBudget]:
    """CONFIG's limits and its [serve] budget; raises `QuotaInvalidError` or `OSError`."""
    data = read_toml(path)
    budget = _budget(data.pop("serve", {}))
    return parse_config(data), budget


class QuotaGate:
    """The server's quota: its service (also served over HTTP) and the admission rules."""

    def __init__(self, service: QuotaService, budget: ServeBudget) -> None:
        self.service = service
        self.budget = budget
        self.client = AsyncQuotaClient.local(service)  # concurrent arrivals share batches
        self._declared: set[Limit] = set()

    @classmethod
    def open(cls, path: str | Path, data_dir: str | Path) -> QuotaGate:
        """The quota store is the file's backend, else `quota.db` in `data_dir`."""
        config, budget = read_config(path)
        return cls(QuotaService.open(config, data_dir=data_dir), budget)

    def _limits(
        self, tenant: Tenant, authorization: str | None, model: str
    ) -> tuple[Limit | None, Limit | None]:
        if tenant.quota_key is not None:
            who = f"tenant-{tenant.quota_key}"
        else:
            scheme, _, token = (authorization or "").partition(" ")
            token = token.strip() if scheme.lower() == "bearer" else ""
            who = "key-" + hashlib.sha256(token.encode()).hexdigest()[:16] if token else "anonymous"
        base = f"serve:{who}:{re.sub(r'[^!-~]', '_', model)[:120]}"
        b = self.budget
        rate = LimitKind.RATE
        rpm_cap = tenant.rpm if tenant.rpm is not None else b.rpm
        tpm_cap = tenant.tpm if tenant.tpm is not None else b.tpm
        rpm = Limit(f"{base}:rpm", rate, rpm_cap, b.window_s) if rpm_cap else None
        tpm = Limit(f"{base}:tpm", rate, tpm_cap, b.window_s) if tpm_cap else None
        return rpm, tpm

    async def admit(
        self, tenant: Tenant, authorization: str | None, prep: Prepared
    ) -> Meter | Unmetered:
        """Reserve one request and its most tokens (prompt + max_tokens of every choice)
        against the tenant's budget (or the Bearer key's, without `--keys`); raises
        `APIError` when refused."""
        rpm, tpm = self._limits(tenant, authorization, prep.model)
        limits = [lim for lim in (rpm, tpm) if lim is not None]
        if not limits:  # no [serve] budget: the quota routes only
            return UNMETERED
        new = [lim for lim in limits if lim not in self._declared]
        if new:  # the first request of a pair declares its limits (an upsert: restarts are fine)
            try:
                await self.client.put_limits(new)
            except QuotaError as e:
                log.error("quota: declaring %s failed: %s", [lim.key for lim in new], e)
                raise APIError(503, "the quota service is unavailable", headers=_RETRY) from e
            self._declared.update(new)
        needs = [Requirement(rpm.key, 1)] if rpm else []
        if tpm:
            most = prompt_tokens(prep) + sum(params.max_tokens for _, params in prep.jobs)
            needs.append(Requirement(tpm.key, most))
        lease_id = new_lease_id()
        result = await self.client.reserve(ReserveRequest(lease_id, needs))
        if result.allowed:
            return Meter(self.client, lease_id, tpm.key if tpm else None, prep)
        if result.error.startswith(ItemError.EXCEEDS_CAPACITY):
            raise APIError(
                400,
                f"this request may use more than the {tpm.capacity if tpm else 0} tokens "
                f"allowed per {self.budget.window_s:g} s: lower max_tokens",
                param="max_tokens",
                code="request_too_large",
            )
        if result.error:
            log.error("quota admission failed: %s", result.error)
            raise APIError(503, "the quota service is unavailable", headers=_RETRY)
        wait_s = result.retry_after_ms / 1000
        raise APIError(
            429,
            f"Rate limit reached for {prep.model}: please try again in {wait_s:.3g}s.",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(max(1, math.ceil(wait_s)))},
        )

    async def aclose(self) -> None:
        await self.client.aclose()


def prompt_tokens(prep: Prepared) -> int:
    """Prompt tokens of a request, each prompt counted once whatever its `n` choices.
    `prepare_*` hands over token ids (a text prompt would count its characters: more)."""
    return sum(len(prompt) for prompt, _ in prep.jobs[:: prep.n])


class Meter:
    """One admitted request's lease: sees its outputs, then settles it with the tokens used."""

    def __init__(
        self, client: AsyncQuotaClient, lease_id: str, tpm_key: str | None, prep: Prepared
    ) -> None:
        self.client = client
        self.lease_id = lease_id
        self.tpm_key = tpm_key
        self.n = prep.n
        self.outs: list[RequestOutput | None] = [None] * len(prep.jobs)

    def watch(self, gen: Outputs, first: Output) -> tuple[Outputs, Output]:
        """A stream's outputs, noted as they pass, so its usage is known however it ends."""
        self.outs[first[0]] = first[1]
        return self._noted(gen), first

    async def _noted(self, gen: Outputs) -> Outputs:
        async with aclosing(gen):
            async for i, out in gen:
                self.outs[i] = out
                yield i, out

    async def settling(self, body: AsyncGenerator[bytes]) -> AsyncGenerator[bytes]:
        """A streamed body that settles the lease when it ends, however it ends (closing it
        closes `body` at once, which aborts a request whose client went away)."""
        try:
            async with aclosing(body):
                async for chunk in body:
                    yield chunk
        finally:
            await self.done(int(fmt.usage(self.outs, self.n)["total_tokens"]))

    async def done(self, used_tokens: int | None) -> None:
        """Report the tokens really used (None: unknown, the reserved amount stays charged)."""
        actuals: tuple[Actual, ...] = ()
        if self.tpm_key is not None and used_tokens is not None:
            actuals = (Actual(self.tpm_key, used_tokens),)
        try:
            result = await self.client.complete(CompleteRequest(self.lease_id, actuals))
        except Exception:
            log.exception("quota: lease %s not completed", self.lease_id)
            return
        if not result.ok:
            log.warning("quota: lease %s: %s", self.lease_id, result.error)


class Unmetered:
    """No `--quota`: admission and every hook pass straight through."""

    async def admit(self, tenant: Tenant, authorization: str | None, prep: Prepared) -> Unmetered:
        return self

    def watch(self, gen: Outputs, first: Output) -> tuple[Outputs, Output]:
        return gen, first

    def settling(self, body: AsyncGenerator[bytes]) -> AsyncGenerator[bytes]:
        return body

    async def done(self, used_tokens: int | None) -> None:
        return None


UNMETERED = Unmetered()
