"""`MLXEngine`: the MLX backend behind the surface `LLM`, `AsyncEngine` and the server use.

It is `EngineProtocol` over `BlockPoolBatchEngine`, made from an `EngineConfig` as the torch
`Engine` is: requests are validated and tokenized by the shared `InputProcessor` in the
caller's thread, submitted as `Sequence`s, and every step hands back a `RequestOutput` snapshot
of each request that gained a token or finished, so callers stream on both backends alike.
The backend's own finish reason (`pool_exhausted`) reaches them unchanged. The block engine
has its own lock, so session control is safe from any thread.

How `EngineConfig` maps: `block_size` is the pool's block size, `kv_cache_bytes` (or
`num_blocks`) its size, `max_num_seqs` the generator's batch, `max_num_batched_tokens` its
prefill chunk; the model is a llama .gguf (the bundled SmolLM2 by default) in the dtype its
loader gives (float32 for the bundled one). MLX has no cross-request prefix cache, so the
config this engine reports says `enable_prefix_caching=False`.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

import mlx.core as mx

from shoal.backends.mlx.engine import BlockPoolBatchEngine
from shoal.backends.mlx.kv import ModelCacheSpec
from shoal.backends.mlx.loader import MLXModel, load_gguf
from shoal.config import EngineConfig
from shoal.engine.block_pool import BlockPool
from shoal.engine.hashing import Salt
from shoal.engine.output_processor import OutputProcessor
from shoal.engine.pins import CachePin
from shoal.engine.requests import RequestTable
from shoal.engine.sequence import Sequence
from shoal.engine.sessions import SessionInfo
from shoal.engine.stats import EngineStats
from shoal.errors import InvalidRequestError
from shoal.outputs import RequestOutput
from shoal.sampling_params import SamplingParams, StructuredOutput


class MLXEngine:
    def __init__(self, config: EngineConfig, model: MLXModel | None = None) -> None:
        """`model`: an already loaded model (else `config.model`'s .gguf is loaded)."""
        if config.min_batch_size != 1:
            raise InvalidRequestError("min_batch_size: the MLX backend does not wait for batches")
        loaded = model or load_gguf(config.model)
        if config.dtype != loaded.dtype:
            raise InvalidRequestError(
                f"dtype: the MLX backend runs {loaded.name} in {loaded.dtype}, not {config.dtype}"
            )
        max_model_len = min(config.max_model_len or loaded.max_model_len, loaded.max_model_len)
        spec = ModelCacheSpec.from_model(loaded.model, loaded.fingerprint, config.block_size)
        num_blocks = config.num_blocks or max(1, config.kv_cache_bytes // spec.bytes_per_block)
        self.core = BlockPoolBatchEngine(
            loaded.model,
            loaded.tokenizer,
            BlockPool(num_blocks, config.block_size),
            spec,
            eos_token_ids=loaded.eos_token_ids,
            max_model_len=max_model_len,
            cache_dir=config.cache_dir,
            host_kv_bytes=config.host_kv_bytes,
            disk_kv_bytes=config.disk_kv_bytes,
            shared_dir=config.session_tier_dir,
            completion_batch_size=config.max_num_seqs,
            prefill_step_size=config.max_num_batched_tokens,
            stream_text=True,
        )
        device = "gpu" if mx.default_device().type == mx.DeviceType.gpu else "cpu"
        self.config = dataclasses.replace(config, device=device, enable_prefix_caching=False)
        self.model_name = loaded.name
        self.tokenizer = loaded.tokenizer
        self.max_model_len = max_model_len
        self.pool = self.core.pool
        self.sessions = self.core.sessions
        self.step_thread: threading.Thread | None = None  # set while an AsyncEngine owns it
        self._requests: RequestTable[int] = RequestTable(config.max_waiting)  # id -> core uid

    # -- submission (any thread) -------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        return self.core.inputs.encode(prompt)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        check_length: bool = True,
    ) -> list[int]:
        return self.core.inputs.apply_chat_template(messages, tools, check_length=check_length)

    def compile_structured(self, spec: StructuredOutput) -> Future[Any]:
        return self.core.inputs.compile_structured(spec)  # refused: this backend has no grammars

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        session_id: str | None = None,
        cache_pins: Iterable[CachePin] = (),
        cache_salt: Salt | str | None = None,
    ) -> str:
        """Validate and queue a request; returns its id (see `Engine.add_request`; cache pins
        need prefix caching, which this backend does not do, so they keep nothing here)."""
        self._requests.check_open()
        seq = self.core.inputs.process(prompt, params, request_id, priority, session_id, cache_salt)
        seq.cache_pins = tuple(cache_pins)
        with self._requests.lock:
            self._requests.check_new(seq.request_id)
            self._requests[seq.request_id] = self.core.submit_sequence(seq)
        return seq.request_id

    def abort(self, request_id: str) -> None:
        with self._requests.lock:
            uid = self._requests.get(request_id)
            if uid is not None:
                self.core.cancel(uid)

    def has_unfinished_requests(self) -> bool:
        return len(self._requests) > 0

    # -- the step loop (the step thread) --------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration: returns a snapshot of every request that gained text or finished."""
        outputs = self._outputs(self.core.step_sequences())
        if self._requests.closed and not self.has_unfinished_requests():
            self.core.save_sessions()  # the last request of a closing engine is done
        return outputs

    def _outputs(self, seqs: list[Sequence]) -> list[RequestOutput]:
        for seq in seqs:
            if seq.is_finished:
                self._requests.pop(seq.request_id)
        return [OutputProcessor.snapshot(seq) for seq in seqs]

    def reset(self) -> list[RequestOutput]:
        """Abort everything; only sessions keep blocks."""
        for uid in self._requests.values():
            self.core.cancel(uid)
        return self._outputs(self.core.step_sequences(decode=False))

    def close(self) -> None:
        """Take no new requests; unsaved session KV goes to `cache_dir` once nothing runs."""
        self._requests.closed = True
        if self.step_thread is None and not self.has_unfinished_requests():
            self.core.close()

    # -- sessions and stats -------------------------------------------------------------
    def save_sessions(self) -> int:
        return self.core.save_sessions()

    def drop_session(self, session_id: str) -> bool:
        return self.core.drop_session(session_id)

    def list_sessions(self) -> list[SessionInfo]:
        return self.core.list_sessions()

    def session_info(self, session_id: str) -> SessionInfo | None:
        return self.core.session_info(session_id)

    def stats(self) -> EngineStats:
        core = self.core
        return EngineStats.collect(
            core.kv,
            core.sessions,
            core.spec.bytes_per_block,
            step_id=core.step_id,
            num_running=core.num_running,
            num_waiting=core.num_waiting,
            num_preemptions=0,  # a running request is never preempted: it ends pool_exhausted
            num_generated_tokens=core.num_generated_tokens,
        )
