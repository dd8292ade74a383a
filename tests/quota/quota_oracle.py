"""The quota semantics written the slow, obvious way, to check the backends against.

A flat list of holds and a dict of leases; usage is summed on demand, expiry is a filter.
No counters, no indexes, no SQL or Lua: what it computes is easy to believe.
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal.quota import CompleteResult, LeasePolicy, Limit, LimitKind, ReserveResult


@dataclass
class Hold:
    lease: str
    key: str
    part: str  # "r": reserved; "o": debt added at completion
    amount: int
    expires: int


@dataclass
class LeaseRecord:
    fingerprint: tuple[str, tuple[tuple[str, int], ...]]
    result: ReserveResult
    expires: int
    reserved: dict[str, int]
    done: bool = False


class Oracle:
    def __init__(self, limits: list[Limit], policy: LeasePolicy, start_ms: int = 0) -> None:
        """`start_ms`: the time the backend has already seen (it never goes back from it)."""
        self.limits = {lim.key: lim for lim in limits}
        self.policy = policy
        self.holds: list[Hold] = []
        self.leases: dict[str, LeaseRecord] = {}
        self.latest = start_ms

    def _tick(self, t: int) -> int:
        self.latest = max(self.latest, t)
        now = self.latest
        self.holds = [h for h in self.holds if h.expires > now]
        self.leases = {k: v for k, v in self.leases.items() if v.expires > now}
        return now

    def used(self, key: str) -> int:
        return sum(h.amount for h in self.holds if h.key == key)

    def usage(self, t: int) -> dict[str, int]:
        self._tick(t)
        return {key: self.used(key) for key in self.limits}

    def _wait(self, key: str, amount: int, now: int) -> int:
        lim = self.limits[key]
        need = self.used(key) + amount - lim.capacity
        wait, freed = lim.window_ms, 0
        for h in sorted((h for h in self.holds if h.key == key), key=lambda h: h.expires):
            freed += h.amount
            if freed >= need:
                wait = h.expires - now
                break
        if lim.kind is LimitKind.CONCURRENCY:
            wait = min(wait, self.policy.concurrency_retry_ms)
        return max(1, wait)

    def reserve(self, lease: str, job: str, reqs: list[tuple[str, int]], t: int) -> ReserveResult:
        now = self._tick(t)
        fingerprint = (job, tuple(sorted(reqs)))
        if lease in self.leases:
            record = self.leases[lease]
            if record.fingerprint != fingerprint:
                return ReserveResult(False, error="lease_conflict")
            return record.result
        for key, amount in reqs:
            if key not in self.limits:
                return ReserveResult(False, error=f"unknown_limit_key:{key}")
            if amount > self.limits[key].capacity:
                return ReserveResult(False, error=f"exceeds_capacity:{key}")
        over = [(k, a) for k, a in reqs if self.used(k) + a > self.limits[k].capacity]
        if over:
            result = ReserveResult(False, max(self._wait(k, a, now) for k, a in over))
            self.leases[lease] = LeaseRecord(fingerprint, result, now + self.policy.ttl_ms, {})
            return result
        expires = now + self.policy.ttl_ms
        for key, amount in reqs:
            window = self.limits[key].window_ms
            self.holds.append(Hold(lease, key, "r", amount, now + window))
            expires = max(expires, now + window)
        result = ReserveResult(True, 0, now)
        self.leases[lease] = LeaseRecord(fingerprint, result, expires, dict(reqs))
        return result

    def complete(self, lease: str, actuals: list[tuple[str, int]], t: int) -> CompleteResult:
        now = self._tick(t)
        record = self.leases.get(lease)
        if record is None:
            return CompleteResult(False, "lease_not_found")
        if not record.result.allowed:
            return CompleteResult(False, "lease_denied")
        if record.done:
            return CompleteResult(False, "already_completed")
        for key, _ in actuals:
            if key not in self.limits:
                return CompleteResult(False, f"unknown_limit_key:{key}")
            if self.limits[key].kind is not LimitKind.RATE:
                return CompleteResult(False, "invalid_request")
        spent = dict(actuals)
        for key in set(record.reserved) | set(spent):
            lim = self.limits[key]
            reserved = record.reserved.get(key, 0)
            held = [h for h in self.holds if (h.lease, h.key, h.part) == (lease, key, "r")]
            if lim.kind is LimitKind.CONCURRENCY:
                self.holds = [h for h in self.holds if h not in held]
            elif spent.get(key, reserved) < reserved:
                for h in held:
                    h.amount -= reserved - spent[key]
                self.holds = [h for h in self.holds if h.amount > 0]
            elif spent.get(key, reserved) > reserved:
                debt = spent[key] - reserved
                self.holds.append(Hold(lease, key, "o", debt, now + lim.window_ms))
        record.done = True
        return CompleteResult(True)
