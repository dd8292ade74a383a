"""Chained block hashes for prefix caching, and the salts that keep them apart.

A full block's hash covers its tokens and, through its parent's hash, every token before it.
The chain is seeded from the model fingerprint, not from process randomness, so a hash means
the same KV after a restart (vLLM seeds from `os.urandom` unless PYTHONHASHSEED is set).

A `Salt` (a tenant, a request's `cache_salt`) is mixed into the chain once, so two requests
share a block only when they agree on every token before it *and* on the salt: no request can
reuse (or time) KV another salt computed, in any tier, since every tier is keyed by these
hashes. It enters at the root, or after the first `shared_blocks` blocks, when those hold a
prefix the operator declared shareable (a common system prompt): the cost is one extra hash per
request, never per token.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Salt:
    """Who may reuse a request's KV: requests with the same `key`; the first `shared_blocks`
    full blocks are hashed unsalted (a declared shared prefix every salt reuses)."""

    key: bytes
    shared_blocks: int = 0

    @classmethod
    def of(cls, text: str, shared_blocks: int = 0) -> Salt:
        key = hashlib.blake2b(text.encode(), digest_size=16, person=b"shoal-salt").digest()
        return cls(key, shared_blocks)


def root_hash(model_fingerprint: str) -> bytes:
    return hashlib.blake2b(model_fingerprint.encode(), digest_size=16).digest()


def salted(parent: bytes, salt: Salt) -> bytes:
    """The chain's state once `salt` is mixed in (its own domain: never a block's hash)."""
    return hashlib.blake2b(b"salt" + parent + salt.key, digest_size=16).digest()


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


def chain_hashes(
    root: bytes,
    tokens: Sequence[int],
    block_size: int,
    known: Sequence[bytes] = (),
    salt: Salt | None = None,
) -> list[bytes]:
    """Hashes of every full block of `tokens`, reusing the `known` prefix of the chain (which
    must have been computed with the same `salt`)."""
    hashes = list(known)
    parent = hashes[-1] if hashes else root
    for start in range(len(hashes) * block_size, len(tokens) - block_size + 1, block_size):
        if salt is not None and start == salt.shared_blocks * block_size:
            parent = salted(parent, salt)
        parent = block_hash(parent, tokens[start : start + block_size])
        hashes.append(parent)
    return hashes


def partial_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a block holding fewer than `block_size` tokens (a session's last block): its
    own domain, so it never names a full block's KV."""
    data = b"partial" + parent + array("q", tokens).tobytes()
    return hashlib.blake2b(data, digest_size=16).digest()


def session_hashes(
    root: bytes,
    tokens: Sequence[int],
    block_size: int,
    known: Sequence[bytes] = (),
    salt: Salt | None = None,
) -> list[bytes]:
    """The keys of every block holding `tokens`: the full blocks' chain, then the partly
    filled last block's `partial_hash` when `tokens` ends inside a block (salted too, unless
    the salt already entered the chain before it)."""
    full = chain_hashes(root, tokens, block_size, known[: len(tokens) // block_size], salt)
    rest = len(tokens) % block_size
    if rest:
        parent = full[-1] if full else root
        if salt is not None and len(full) <= salt.shared_blocks:
            parent = salted(parent, salt)
        full.append(partial_hash(parent, tokens[len(tokens) - rest :]))
    return full
