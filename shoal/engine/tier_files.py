"""The shared session tier's file format: a session's KV as a chain of chunk files, so a turn
writes only the blocks its session did not have in the tier before (no torch here).

Under `<tier>/<layout key>/` a session has `<session key>.json`, its manifest (session id,
token ids, model fingerprint, dtype, block size, last use, and the chunks), and one
`<session key>.<nonce>.safetensors` per chunk: one tensor `kv` shaped `[layers, 2, blocks,
block_size, kv_heads, head_dim]` holding the chunk's blocks, with its own size and XXH3
checksum in the manifest. The chunks cover the session's blocks from 0, in order.

A block's KV depends only on the tokens up to its end, so a later turn of the same
conversation keeps every chunk whose blocks are full and lie in the tokens both turns share:
it writes its new full blocks as one chunk and its last, partly filled block as another (the
one the next turn replaces). A chain that would grow past `MAX_CHUNKS` is written anew, which
bounds the files a restore reads.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from dataclasses import dataclass
from pathlib import Path

from shoal.engine.block_pool import cdiv
from shoal.engine.session_files import KVLayout, session_key
from shoal.errors import CacheCorruptionError

TIER_VERSION = 3  # chunked (2 was one tensor file per session, the disk tier's format)
MAX_CHUNKS = 16


@dataclass(slots=True)
class Chunk:
    file: str
    first_block: int
    num_blocks: int
    checksum: str
    nbytes: int


@dataclass(slots=True)
class TierManifest:
    version: int
    session_id: str
    token_ids: list[int]
    fingerprint: str
    dtype: str
    block_size: int
    chunks: list[Chunk]
    last_used: float

    @property
    def files(self) -> set[str]:
        return {c.file for c in self.chunks}

    @classmethod
    def parse(cls, data: dict[str, object]) -> TierManifest:
        chunks = data.pop("chunks")
        if not isinstance(chunks, list):
            raise TypeError("chunks is not a list")
        return cls(**data, chunks=[Chunk(**c) for c in chunks])  # type: ignore[arg-type]


def manifest_name(session_id: str) -> str:
    return f"{session_key(session_id)}.json"


def read_manifest(path: Path) -> TierManifest | None:
    """The manifest as written (unchecked): enough to order writes and clean up."""
    try:
        return TierManifest.parse(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def check_manifest(path: Path, layout: KVLayout) -> TierManifest:
    """The manifest at `path`, checked against `layout` and the chunk files beside it (their
    sizes; checksums are checked when a copy is loaded). Raises `CacheCorruptionError` (or
    the read's own error) when it must not be used."""
    m = TierManifest.parse(json.loads(path.read_text()))
    covered = 0
    for c in m.chunks:
        if c.first_block != covered or c.num_blocks < 1 or Path(c.file).name != c.file:
            raise CacheCorruptionError(f"chunk {c.file!r} out of place")
        covered += c.num_blocks
    problems = [
        (m.version != TIER_VERSION, f"version {m.version}"),
        (path.name != manifest_name(m.session_id), "misnamed"),
        (m.fingerprint != layout.fingerprint, "another model's fingerprint"),
        (m.dtype != layout.dtype, f"dtype {m.dtype}"),
        (m.block_size != layout.block_size, f"block size {m.block_size}"),
        (not m.token_ids or covered != cdiv(len(m.token_ids), m.block_size), "blocks"),
    ]
    bad = [why for failed, why in problems if failed]
    if bad:
        raise CacheCorruptionError(", ".join(bad))
    for c in m.chunks:
        if (path.parent / c.file).stat().st_size != c.nbytes:
            raise CacheCorruptionError(f"chunk {c.file} truncated")
    return m


@dataclass(slots=True)
class Held:
    """What the tier holds of a session as this engine last wrote or read it: the chunks and,
    for each chunk of full blocks, a digest of the tokens up to its end (small, where the
    token ids would not be: a later turn keeps the chunks whose digests it matches)."""

    chunks: list[Chunk]
    digests: list[bytes | None]

    @classmethod
    def of(cls, m: TierManifest) -> Held:
        ends = [(c.first_block + c.num_blocks) * m.block_size for c in m.chunks]
        digests = prefix_digests(m.token_ids, [e for e in ends if e <= len(m.token_ids)])
        return cls(list(m.chunks), [*digests, *[None] * (len(ends) - len(digests))])


def prefix_digests(token_ids: list[int], ends: list[int]) -> list[bytes]:
    """A digest of `token_ids[:end]` for each of the ascending `ends`, in one pass."""
    tokens = memoryview(array("q", token_ids))
    h, out, pos = hashlib.blake2b(digest_size=16), [], 0
    for end in ends:
        h.update(tokens[pos:end])
        pos = end
        out.append(h.copy().digest())
    return out


def reusable(held: Held | None, token_ids: list[int], block_size: int) -> list[Chunk]:
    """The chunks of `held` a copy of `token_ids` can keep: the leading ones of full blocks
    whose tokens `token_ids` shares (never its last block, so a turn always has a block of its
    own to write); none when the two chunks a turn adds would make the chain longer than
    `MAX_CHUNKS`."""
    if held is None:
        return []
    ends = []
    for c in held.chunks:
        end = (c.first_block + c.num_blocks) * block_size
        if end > len(token_ids) - 1:
            break
        ends.append(end)
    kept: list[Chunk] = []
    for chunk, stored, digest in zip(
        held.chunks, held.digests, prefix_digests(token_ids, ends), strict=False
    ):
        if stored != digest:
            break
        kept.append(chunk)
    return kept if len(kept) + 2 <= MAX_CHUNKS else []
