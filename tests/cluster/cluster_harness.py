"""The cluster the cluster tests share (its fixture is in this folder's conftest)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import ray

APP = "shoal"
KEYS = {"key-alpha": "alpha", "key-beta": "beta"}  # the cluster's tenants besides `default`
# How long a cluster test waits for what must happen (a replica restarted after a kill, the
# session tier's writes, a batch's end) before it fails: a bound on liveness, never a way to
# synchronise. A replica's restart imports torch and loads the model, which takes minutes on a
# busy 2-core machine.
PATIENCE_S = 600


@dataclass
class Cluster:
    url: str
    model: str
    model_dir: Path
    tier: Path
    gate: Path  # the replicas' batch line gate (`batch_helpers.HeldLines`)

    def replica_actor(self, replica: str) -> object:
        return ray.get_actor(f"SERVE_REPLICA::{APP}#engine#{replica}", namespace="serve")
