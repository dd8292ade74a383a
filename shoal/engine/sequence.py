"""A request as the engine sees it: tokens, progress and its KV block table."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shoal.sampling_params import SamplingParams

if TYPE_CHECKING:
    from shoal.engine.hashing import Salt
    from shoal.engine.ngram import NgramIndex
    from shoal.engine.pins import CachePin


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Sequence:
    """One request. `num_computed_tokens` chases `num_tokens`: a prefill is just a long chase.

    Tokens `[0, num_computed_tokens)` have their KV in the blocks of `block_table`.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    session_id: str | None = None
    prompt: str | None = None
    cache_pins: tuple[CachePin, ...] = ()  # prefixes to keep pinned in the store once it ends
    salt: Salt | None = None  # only requests with the same salt reuse its KV (`hashing.Salt`)

    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_committed_blocks: int = 0  # leading blocks of block_table already published as cached
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache on first admission
    num_preemptions: int = 0
    finish_reason: str | None = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    first_token_time: float | None = None
    # Speculation (`engine/ngram.py`): the tokens proposed after the last one for this step to
    # verify (their KV is computed past `num_tokens`), and the n-gram index they came from.
    draft_token_ids: list[int] = field(default_factory=list)
    ngram_index: NgramIndex | None = None
    # A seeded torch.Generator lives here untyped so this module stays free of torch.
    generator: Any = None
    # A constrained request's grammar matcher (`engine/structured.GrammarState`), untyped for
    # the same reason: it has accepted exactly `output_token_ids`. Dropped when it finishes.
    grammar: Any = None
    text: str = ""  # released text: final, never taken back
    # Incremental detokenization: `decoded` is the text of output tokens [0, read_offset);
    # the window from `prefix_offset` gives the next token's text its context.
    decoded: str = ""
    prefix_offset: int = 0
    read_offset: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def tokens_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]
