"""How session KV bytes move: the interface the session manager drives (pure Python, no torch).

`SessionManager` (`sessions.py`) decides what moves and when; an implementation of `SessionIO`
moves the bytes: `kv_store.SessionStore` over the torch runner's caches, `backends/mlx/kv.py`
over MLX slabs, both with the disk tier of `session_files.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(slots=True, frozen=True)
class StoredSession:
    """A disk copy a previous run left behind."""

    session_id: str
    token_ids: list[int]
    last_used: float


class SessionIO(Protocol):
    """Moves KV bytes for the session manager: block copies and the disk tier."""

    @property
    def persistent(self) -> bool:
        """Whether the disk tier outlives the process (worth saving to on close)."""
        ...

    @property
    def disk_bytes(self) -> int: ...

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one pool block's KV into another (copy on write of a partial block)."""
        ...

    def save(
        self, session_id: str, token_ids: list[int], block_ids: list[int], last_used: float
    ) -> bool:
        """Write the KV of `block_ids` as the session's disk copy; False if it failed."""
        ...

    def load(self, session_id: str, token_ids: list[int]) -> Any | None:
        """Read and validate the disk copy of `token_ids`; None (discarded) if unusable."""
        ...

    def restore(self, data: Any, block_ids: list[int]) -> None:
        """Write KV returned by `load` into freshly allocated pool blocks."""
        ...

    def delete(self, session_id: str) -> None: ...

    def has(self, session_id: str) -> bool: ...

    def stored(self) -> list[StoredSession]: ...
