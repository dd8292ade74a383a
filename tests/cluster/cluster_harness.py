"""The cluster the cluster tests share (its fixture is in this folder's conftest)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import ray

APP = "shoal"
KEYS = {"key-alpha": "alpha", "key-beta": "beta"}  # the cluster's tenants besides `default`


@dataclass
class Cluster:
    url: str
    model: str
    model_dir: Path
    tier: Path
    gate: Path  # the replicas' batch line gate (`batch_helpers.HeldLines`)

    def replica_actor(self, replica: str) -> object:
        return ray.get_actor(f"SERVE_REPLICA::{APP}#engine#{replica}", namespace="serve")
