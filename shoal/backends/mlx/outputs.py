"""What `BlockPoolBatchEngine` hands back: a finished turn and the agent's blocks after it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class AgentBlocks:
    """An agent's KV after a turn: the tokens it holds and the pool blocks holding them."""

    agent_id: str
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    block_tokens: int

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class CompletedGeneration:
    uid: int
    agent_id: str
    text: str
    token_ids: list[int]  # generated, a stop token included
    blocks: AgentBlocks
    finish_reason: str  # "stop", "length", "pool_exhausted" or "abort"
    token_count: int
    num_cached_tokens: int  # prompt tokens served from the agent's KV
