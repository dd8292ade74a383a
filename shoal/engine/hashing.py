"""Chained block hashes for prefix caching.

A full block's hash covers its tokens and, through its parent's hash, every token before it.
The chain is seeded from the model fingerprint, not from process randomness, so a hash means
the same KV after a restart (vLLM seeds from `os.urandom` unless PYTHONHASHSEED is set).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def root_hash(model_fingerprint: str) -> bytes:
    return hashlib.blake2b(model_fingerprint.encode(), digest_size=16).digest()


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


def chain_hashes(
    root: bytes, tokens: Sequence[int], block_size: int, known: Sequence[bytes] = ()
) -> list[bytes]:
    """Hashes of every full block of `tokens`, reusing the `known` prefix of the chain."""
    hashes = list(known)
    parent = hashes[-1] if hashes else root
    for start in range(len(hashes) * block_size, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tokens[start : start + block_size])
        hashes.append(parent)
    return hashes


def partial_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a block holding fewer than `block_size` tokens (a session's last block): its
    own domain, so it never names a full block's KV."""
    data = b"partial" + parent + array("q", tokens).tobytes()
    return hashlib.blake2b(data, digest_size=16).digest()


def session_hashes(
    root: bytes, tokens: Sequence[int], block_size: int, known: Sequence[bytes] = ()
) -> list[bytes]:
    """The keys of every block holding `tokens`: the full blocks' chain, then the partly
    filled last block's `partial_hash` when `tokens` ends inside a block."""
    full = chain_hashes(root, tokens, block_size, known[: len(tokens) // block_size])
    rest = len(tokens) % block_size
    if rest:
        full.append(partial_hash(full[-1] if full else root, tokens[len(tokens) - rest :]))
    return full
