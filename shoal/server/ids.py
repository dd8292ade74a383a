"""Every id the server hands out, made one way: a prefix and 24 random hex digits.

Ids are opaque to clients. One is read back by shoal itself: a response id starts with its
chain's id (the chain's first response's), so the chain, an engine session, can be routed to
the replica holding it from any of its ids.
"""

from __future__ import annotations

import uuid

MAX_ID = 512


def new_id(prefix: str) -> str:
    """`new_id("batch_")` -> `batch_5f0c...`; the prefix carries its own separator."""
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def storable(value: object) -> bool:
    """Whether `value` can name something in the store: a string of 1..512 characters, no
    NUL, valid UTF-8 (PostgreSQL's text refuses NUL and lone surrogates). Any other id is
    simply unknown, so it gets a 404 rather than a database error."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_ID or "\x00" in value:
        return False
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


RESPONSE_PREFIX = "resp_"
CHAIN_ID_LEN = len(RESPONSE_PREFIX) + 24


def new_response_id(chain: str | None) -> str:
    """A new response's id: the first of a new chain (None), or one more in `chain`."""
    return new_id(chain or RESPONSE_PREFIX)


def chain_of(response_id: str) -> str | None:
    """The chain a response id belongs to (None: not a response id shoal made)."""
    if not response_id.startswith(RESPONSE_PREFIX) or len(response_id) < CHAIN_ID_LEN:
        return None
    return response_id[:CHAIN_ID_LEN]
