"""Every id the server hands out, made one way: a prefix and 24 random hex digits.

Ids are opaque: nothing parses them back, so their format can change freely.
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
