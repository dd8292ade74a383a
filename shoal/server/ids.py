"""Every id the server hands out, made one way: a prefix and 24 random hex digits.

Ids are opaque: nothing parses them back, so their format can change freely.
"""

from __future__ import annotations

import uuid


def new_id(prefix: str) -> str:
    """`new_id("batch_")` -> `batch_5f0c...`; the prefix carries its own separator."""
    return f"{prefix}{uuid.uuid4().hex[:24]}"
