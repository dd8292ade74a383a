"""URLs of services shoal connects to (a batch store, a quota backend), as they may be shown."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


def redact(url: str) -> str:
    """`url` without its password, for messages, logs and metrics."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))
