"""`SessionAffinityRouter`: Ray Serve's request router for the engine replicas.

It lives inside the ingress's `DeploymentHandle` and is called for every request sent through
it. The request's `Route` travels as the `route` keyword argument; the decision itself is
`routing.rank`: a session goes to its home (`routing.HOMES`: where it went last, or placed by
rendezvous hashing with bounded loads), the prompt prefix to its rendezvous home, with a
fallback to the least-loaded replica past an imbalance threshold. Queue
lengths come from Ray Serve's cache, probed when missing or stale. Requests are matched to
replicas by their own id (no FIFO mixin), so a replica chosen for one session never serves
another request that happened to wait longer.

Ray Serve ships this module to the handle by value (cloudpickle): what it shares with the
ingress (`routing.STATS`, `routing.HOMES`) is reached through the `routing` module, which
travels by name.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from shoal.cluster import routing


def route_of(pending: PendingRequest | None) -> routing.Route:
    route = pending.kwargs.get("route") if pending is not None else None
    return route if isinstance(route, routing.Route) else routing.Route()


class SessionAffinityRouter(RequestRouter):
    def initialize_state(
        self, imbalance_threshold: int = 8, policy: str = "affine", **kwargs: Any
    ) -> None:
        """`policy`: "affine", or "round_robin" (each request to the next replica in turn,
        as a generic load balancer would send them: the baseline the benchmark measures)."""
        self.imbalance_threshold = imbalance_threshold
        self.round_robin = policy == "round_robin"
        self._turn = 0

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        route = route_of(pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if self.round_robin and route.replica is None and by_id:
            self._turn += 1
            return [[by_id[sorted(by_id)[self._turn % len(by_id)]]]]
        loads = await self._queue_lengths(candidate_replicas) if route.key else {}
        live = list(by_id)
        home = routing.HOMES.home(route.session_id, live) if route.session_id else None
        ranks = routing.rank(route, live, loads, self.imbalance_threshold, home)
        return [[by_id[r] for r in group] for group in ranks]

    async def _queue_lengths(self, replicas: list[RunningReplica]) -> dict[str, int]:
        loads: dict[str, int] = {}
        missing = []
        for r in replicas:
            n = self.replica_queue_len_cache.get(r.replica_id)
            if n is None:
                missing.append(r)
            else:
                loads[r.replica_id.unique_id] = n
        if missing:
            for r, n in await self._probe_queue_lens(missing, 0):
                if n is not None:
                    loads[r.replica_id.unique_id] = n
        return loads

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        routing.STATS.replicas = sorted(r.replica_id.unique_id for r in replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        routing.STATS.replicas = [r for r in routing.STATS.replicas if r != replica_id.unique_id]
