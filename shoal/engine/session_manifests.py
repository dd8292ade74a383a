"""A session's manifest on disk: its id, token ids, salt and last use (no torch, no KV).

A session's KV is its blocks, stored once in the block files (`block_files.py`) whatever
shares them; the manifest says which: the block hashes follow from the token ids and the
session's salt (recomputed on load, so a manifest cannot name KV that its tokens do not).
Under `<root>/<layout key>/sessions/` each session has `<session key>.json`, written whole or
not at all; one whose layout, version or shape does not match is discarded with a warning.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

from shoal.durable import atomic_write
from shoal.engine.block_files import KVLayout
from shoal.engine.hashing import Salt
from shoal.errors import CacheCorruptionError

VERSION = 3  # 3: token ids over content-addressed blocks (2: one tensor file per session)


@dataclass(slots=True)
class SessionManifest:
    version: int
    session_id: str
    token_ids: list[int]
    fingerprint: str
    dtype: str
    block_size: int
    last_used: float
    salt: str | None = None  # the session's `Salt` (its key in hex); absent: unsalted
    shared_blocks: int = 0

    @classmethod
    def new(
        cls,
        layout: KVLayout,
        session_id: str,
        token_ids: list[int],
        last_used: float,
        salt: Salt | None = None,
    ) -> SessionManifest:
        return cls(
            VERSION,
            session_id,
            list(token_ids),
            layout.fingerprint,
            layout.dtype,
            layout.block_size,
            last_used,
            salt.key.hex() if salt is not None else None,
            salt.shared_blocks if salt is not None else 0,
        )

    def cache_salt(self) -> Salt | None:
        return Salt(bytes.fromhex(self.salt), self.shared_blocks) if self.salt else None

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()


def session_key(session_id: str) -> str:
    return hashlib.blake2b(session_id.encode(), digest_size=12).hexdigest()


def manifest_name(session_id: str) -> str:
    return f"{session_key(session_id)}.json"


def read_manifest(path: Path, layout: KVLayout) -> SessionManifest:
    """The manifest at `path`, checked against `layout`; raises `CacheCorruptionError` (or the
    read's own error) when it must not be used."""
    m = SessionManifest(**json.loads(path.read_text()))
    problems = [
        (m.version != VERSION, f"version {m.version}"),
        (path.name != manifest_name(m.session_id), "misnamed"),
        (m.fingerprint != layout.fingerprint, "another model's fingerprint"),
        (m.dtype != layout.dtype, f"dtype {m.dtype}"),
        (m.block_size != layout.block_size, f"block size {m.block_size}"),
        (not m.token_ids or not all(isinstance(t, int) for t in m.token_ids), "token ids"),
        (not _salt_ok(m.salt, m.shared_blocks), "salt"),
    ]
    bad = [why for failed, why in problems if failed]
    if bad:
        raise CacheCorruptionError(", ".join(bad))
    return m


def _salt_ok(salt: object, shared_blocks: object) -> bool:
    if not isinstance(shared_blocks, int) or shared_blocks < 0:
        return False
    if salt is None:
        return True
    return isinstance(salt, str) and len(salt) == 32 and all(c in HEX for c in salt)


HEX = frozenset("0123456789abcdef")


class SessionManifests:
    """This engine's session manifests (in the cache dir; none without one)."""

    def __init__(self, root: Path | None, layout: KVLayout) -> None:
        self.layout = layout
        self.persistent = root is not None
        self.dir = (root / layout.key() / "sessions") if root is not None else None
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)

    def scan(self) -> list[SessionManifest]:
        """The manifests a previous run left; temporaries and bad ones are removed."""
        if self.dir is None:
            return []
        for tmp in self.dir.glob("*.tmp"):
            tmp.unlink(missing_ok=True)
        found = []
        for path in sorted(self.dir.glob("*.json")):
            try:
                found.append(read_manifest(path, self.layout))
            except Exception as e:  # unreadable, malformed or mismatched: never used
                warnings.warn(f"discarding session manifest {path.name}: {e}", stacklevel=2)
                path.unlink(missing_ok=True)
        return found

    def write(
        self, session_id: str, token_ids: list[int], last_used: float, salt: Salt | None = None
    ) -> bool:
        if self.dir is None:
            return False
        m = SessionManifest.new(self.layout, session_id, token_ids, last_used, salt)
        try:
            atomic_write(self.dir / manifest_name(session_id), m.encode())
        except OSError as e:
            warnings.warn(f"could not save session {session_id!r}: {e}", stacklevel=2)
            return False
        return True

    def delete(self, session_id: str) -> None:
        if self.dir is not None:
            (self.dir / manifest_name(session_id)).unlink(missing_ok=True)
