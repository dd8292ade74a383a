"""`shoal.quota` imports and works where torch cannot be imported (a quota server or a job
runner has no business loading an LLM stack)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PROGRAM = """
import sys

HEAVY = {"torch", "numpy", "transformers", "tokenizers", "safetensors", "gguf"}


class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HEAVY:
            raise ImportError(f"{name} is not installed here")
        return None


sys.meta_path.insert(0, Blocker())
import shoal.quota.cli, shoal.quota.http, shoal.quota.redis_backend  # noqa: E401
from shoal.quota import Limit, LimitKind, QuotaService, Requirement, ReserveRequest, new_lease_id
from shoal.quota.sqlite_backend import SQLiteBackend

service = QuotaService(SQLiteBackend(sys.argv[1]))
service.put_limits([Limit("rpm", LimitKind.RATE, 1, 60)])
assert service.reserve(ReserveRequest(new_lease_id(), [Requirement("rpm", 1)])).allowed
loaded = [m for m in sys.modules if m.startswith(("shoal.engine", "shoal.llm", "shoal.models"))]
assert not loaded, loaded
print("ok")
"""


def test_quota_imports_and_works_without_torch(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(tmp_path / "q.db")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
