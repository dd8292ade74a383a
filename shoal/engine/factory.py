"""Builds an engine's parts from an `EngineConfig` and wires them, once, in dependency order:
model → pool → runner → KV store (host memory, disk, the shared folder) → sessions → KV
manager → scheduler → input and output processors. The `Engine` only runs the step loop over
what it is given."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shoal.config import EngineConfig
from shoal.engine.block_files import KVLayout
from shoal.engine.block_pool import BlockPool
from shoal.engine.block_store import BlockStore, build_store
from shoal.engine.cuda_graphs import graph_sizes
from shoal.engine.detokenizer import Detokenizer
from shoal.engine.input_processor import InputProcessor
from shoal.engine.kv_cache_manager import KVCacheManager
from shoal.engine.kv_store import TorchBlockCodec
from shoal.engine.model_runner import ModelRunner
from shoal.engine.output_processor import OutputProcessor
from shoal.engine.scheduler import Scheduler
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
    store: BlockStore
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
    graphs = None
    if torch.device(config.device).type == "cuda" and not config.enforce_eager:
        graphs = graph_sizes(config.max_num_seqs, config.cuda_graph_sizes)
    runner = ModelRunner(model, num_blocks, config.block_size, config.device, max_model_len, graphs)
    layout = KVLayout(
        loaded.fingerprint,
        config.dtype,
        config.block_size,
        cfg.num_layers,
        cfg.num_kv_heads,
        cfg.head_dim,
    )
    store, sessions = build_store(
        layout,
        pool,
        TorchBlockCodec(runner),
        cache_dir=config.cache_dir,
        host_kv_bytes=config.host_kv_bytes,
        disk_kv_bytes=config.disk_kv_bytes,
        shared_dir=config.session_tier_dir,
    )
    kv = KVCacheManager(pool, sessions.root, config.enable_prefix_caching, sessions)
    return EngineParts(
        config=config,
        model_name=loaded.name,
        model_config=cfg,
        tokenizer=loaded.tokenizer,
        max_model_len=max_model_len,
        bytes_per_block=bytes_per_block,
        pool=pool,
        runner=runner,
        store=store,
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
            grammars=Grammars(
                loaded.tokenizer,
                cfg.vocab_size,
                list(cfg.eos_token_ids),
                config.grammar_budget(),
                config.grammar_cache_bytes,
            )
            if loaded.tokenizer is not None
            else None,
        ),
        outputs=OutputProcessor(
            Detokenizer(loaded.tokenizer), set(cfg.eos_token_ids), max_model_len
        ),
    )
