"""The light parts of shoal import on a machine without torch: client libraries, the pure
engine modules (so property tests, `shoal.batchify` and `shoal.quota` need no model stack) and
what callers type against (`LLM`, `AsyncEngine`, `EngineProtocol`), which load a backend only
when one is asked for. Nothing on the torch path imports MLX."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

PURE = [
    "shoal",
    "shoal.errors",
    "shoal.config",
    "shoal.durable",
    "shoal.sampling_params",
    "shoal.outputs",
    "shoal.engine.sequence",
    "shoal.engine.hashing",
    "shoal.engine.block_pool",
    "shoal.engine.sessions",
    "shoal.engine.block_files",
    "shoal.engine.block_store",
    "shoal.engine.host_tier",
    "shoal.engine.disk_tier",
    "shoal.engine.pins",
    "shoal.engine.session_manifests",
    "shoal.engine.shared_tier",
    "shoal.cluster.routing",
    "shoal.cluster.cli",
    "shoal.engine.kv_cache_manager",
    "shoal.engine.scheduler",
    "shoal.engine.stats",
    "shoal.engine.protocol",
    "shoal.engine.requests",
    "shoal.engine.input_processor",
    "shoal.engine.output_processor",
    "shoal.engine.async_engine",
    "shoal.llm",
    "shoal.tool_calls",
]
CLIENTS = ["shoal.batchify", "shoal.quota"]

BLOCK_TORCH = """
import importlib.abc, sys

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers", "safetensors", "numpy"):
            raise ImportError(f"{name} is not installed here")
        return None

sys.meta_path.insert(0, NoTorch())
import importlib
for name in sys.argv[1:]:
    importlib.import_module(name)
heavy = sorted(
    m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "numpy", "mlx", "mlx_lm")
)
assert not heavy, heavy
print("ok")
"""


def test_pure_modules_and_clients_import_without_torch() -> None:
    modules = PURE + [m for m in CLIENTS if importlib.util.find_spec(m) is not None]
    done = subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH, *modules], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_public_names_still_load_lazily() -> None:
    import shoal

    assert shoal.SamplingParams(max_tokens=3).max_tokens == 3
    assert "LLM" in dir(shoal)
    try:
        shoal.NoSuchThing  # noqa: B018
    except AttributeError as e:
        assert "NoSuchThing" in str(e)
    else:
        raise AssertionError("unknown names must raise AttributeError")


def test_the_server_and_the_torch_engine_never_import_mlx() -> None:
    code = (
        "import sys, shoal.server.app, shoal.engine.llm_engine; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_only_shoal_cluster_imports_ray() -> None:
    """`shoal serve` (the command and the app) runs where Ray is not installed."""
    code = (
        "import shoal.cli, shoal.server.app, shoal.cluster.cli, shoal.cluster.routing, sys; "
        "assert 'ray' not in sys.modules, 'ray imported'; print('ok')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "ok", done.stderr
