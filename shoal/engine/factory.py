"""Builds an engine's parts from an `EngineConfig` and wires them, once, in dependency order:
model → pool → runner → disk tier (and the shared session tier) → sessions → KV manager →
scheduler → input and output processors. The `Engine` only runs the step loop over what it is
given."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shoal.config import EngineConfig
from shoal.engine.block_pool import BlockPool
from shoal.engine.detokenizer import Detokenizer
from shoal.engine.hashing import root_hash
from shoal.engine.input_processor import InputProcessor
from shoal.engine.kv_cache_manager import KVCacheManager
from shoal.engine.kv_store import SessionStore
from shoal.engine.model_runner import ModelRunner
from shoal.engine.output_processor import OutputProcessor
from shoal.engine.scheduler import Scheduler
from shoal.engine.session_files import KVLayout
from shoal.engine.session_tier import SessionTier
from shoal.engine.sessions import SessionManager
from shoal.engine.structured import Grammars
from shoal.layers.quantized_linear import ACTIVATIONS
from shoal.models.config import ModelConfig
from shoal.models.llama import LlamaForCausalLM
from shoal.models.loader import DTYPES, load_model


@dataclass(slots=True)
class EngineParts:
    config: EngineConfig
    model_name: str
    model_config: ModelConfig
    tokenizer: Any
    max_model_len: int
    bytes_per_block: int
    pool: BlockPool
    runner: ModelRunner
    sessions: SessionManager
    kv: KVCacheManager
    scheduler: Scheduler
    inputs: InputProcessor
    outputs: OutputProcessor


def build_engine_parts(config: EngineConfig) -> EngineParts:
    loaded = load_model(config.model, config.dtype, config.quantization)
    cfg = loaded.config
    max_model_len = min(
        config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings
    )
    bytes_per_block = config.block_size * cfg.kv_bytes_per_token(DTYPES[config.dtype].itemsize)
    num_blocks = config.num_blocks or max(1, config.kv_cache_bytes // bytes_per_block)
    pool = BlockPool(num_blocks, config.block_size)
    model = LlamaForCausalLM(cfg, loaded.weights, max_model_len, loaded.dtype)
    model.use_activation_levels(ACTIVATIONS[config.quantized_activations])
    runner = ModelRunner(model, num_blocks, config.block_size, config.device)
    layout = KVLayout(
        loaded.fingerprint,
        config.dtype,
        config.block_size,
        cfg.num_layers,
        cfg.num_kv_heads,
        cfg.head_dim,
    )
    store = SessionStore(runner, layout, config.cache_dir)
    tier = SessionTier(layout, config.session_tier_dir, store) if config.session_tier_dir else None
    sessions = SessionManager(pool, store, config.disk_cache_bytes, tier)
    root = root_hash(f"{loaded.fingerprint}:{config.dtype}")
    kv = KVCacheManager(pool, root, config.enable_prefix_caching, sessions)
    return EngineParts(
        config=config,
        model_name=loaded.name,
        model_config=cfg,
        tokenizer=loaded.tokenizer,
        max_model_len=max_model_len,
        bytes_per_block=bytes_per_block,
        pool=pool,
        runner=runner,
        sessions=sessions,
        kv=kv,
        scheduler=Scheduler(config, kv, max_model_len),
        inputs=InputProcessor(
            loaded.tokenizer,
            cfg.vocab_size,
            max_model_len,
            num_blocks,
            config.block_size,
            seeded=lambda seed: torch.Generator(config.device).manual_seed(seed),
            grammars=Grammars(loaded.tokenizer, cfg.vocab_size, list(cfg.eos_token_ids))
            if loaded.tokenizer is not None
            else None,
        ),
        outputs=OutputProcessor(
            Detokenizer(loaded.tokenizer), set(cfg.eos_token_ids), max_model_len
        ),
    )
