"""The on-disk format of KV blocks, shared by the local disk tier and a cluster's shared folder
(no torch: a backend's codec turns blocks into bytes and back).

Under `<root>/<layout key>/blocks/` each block is one file named by its chained hash
(`<2 hex>/<32 hex>.kv`): a 38-byte header (magic, version, the hash again, payload size,
XXH3 of the payload) and the payload. The layout key covers what the bytes depend on (model
fingerprint, dtype, block size), and the hash covers every token up to the block's end, so
one name means one KV anywhere: blocks shared by many conversations are stored once. A file is
written under a temporary name and renamed, so a reader sees it whole or not at all; a file
that fails any check raises `CacheCorruptionError` and is dropped by its tier.
"""

from __future__ import annotations

import hashlib
import os
import struct
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import xxhash

from shoal.engine.block_pool import cdiv
from shoal.errors import CacheCorruptionError

MAGIC = b"SHKV"
VERSION = 1
HEADER = struct.Struct("<4sH16sQQ")  # magic, version, hash, payload bytes, xxh3_64


@dataclass(slots=True, frozen=True)
class KVLayout:
    """Identity and shape of the KV a stored block must match to be used."""

    fingerprint: str
    dtype: str
    block_size: int
    num_layers: int
    kv_heads: int
    head_dim: int

    def key(self) -> str:
        text = f"{self.fingerprint}:{self.dtype}:{self.block_size}"
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()

    def root(self) -> str:
        """What the block hash chain is seeded from (`hashing.root_hash`)."""
        return f"{self.fingerprint}:{self.dtype}:{self.block_size}"

    def shape(self, num_tokens: int) -> list[int]:
        return [
            self.num_layers,
            2,
            cdiv(num_tokens, self.block_size),
            self.block_size,
            self.kv_heads,
            self.head_dim,
        ]


def checksum(data: bytes | memoryview) -> int:
    """XXH3: 5x faster than zlib's CRC-32 here."""
    return int(xxhash.xxh3_64_intdigest(data))


class BlockFiles:
    """The block files of one layout in one folder."""

    def __init__(self, folder: Path, block_nbytes: int) -> None:
        self.dir = folder
        self.block_nbytes = block_nbytes
        self.dir.mkdir(parents=True, exist_ok=True)

    def path(self, h: bytes) -> Path:
        name = h.hex()
        return self.dir / name[:2] / f"{name}.kv"

    def exists(self, h: bytes) -> bool:
        return self.path(h).exists()

    def write(self, h: bytes, payload: bytes | memoryview, durable: bool) -> int:
        """Write one block whole or not at all; returns the file's size. With `durable` the
        file is fsynced before its rename (the caller fsyncs the folders)."""
        data = memoryview(payload).cast("B")
        if data.nbytes != self.block_nbytes:
            raise ValueError(f"a block holds {self.block_nbytes} bytes, not {data.nbytes}")
        path = self.path(h)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f"{path.stem}.{uuid.uuid4().hex[:12]}.tmp")
        try:
            with open(tmp, "xb") as f:
                f.write(HEADER.pack(MAGIC, VERSION, h, data.nbytes, checksum(data)))
                f.write(data)
                if durable:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return HEADER.size + data.nbytes

    def read(self, h: bytes) -> bytes:
        """The payload of block `h`, checked whole; `CacheCorruptionError` if it is not."""
        try:
            data = self.path(h).read_bytes()
        except OSError as e:
            raise CacheCorruptionError(f"unreadable: {e}") from e
        if len(data) < HEADER.size:
            raise CacheCorruptionError("truncated header")
        magic, version, stored, nbytes, digest = HEADER.unpack_from(data)
        payload = memoryview(data)[HEADER.size :]
        problems = [
            (magic != MAGIC, "not a KV block file"),
            (version != VERSION, f"version {version}"),
            (stored != h, "another block's file"),
            (nbytes != self.block_nbytes, f"{nbytes} bytes, a block holds {self.block_nbytes}"),
            (payload.nbytes != nbytes, f"truncated: {payload.nbytes} of {nbytes} bytes"),
        ]
        bad = [why for failed, why in problems if failed]
        if not bad and checksum(payload) != digest:
            bad.append("checksum mismatch")
        if bad:
            raise CacheCorruptionError(", ".join(bad))
        return bytes(payload)

    def delete(self, h: bytes) -> None:
        self.path(h).unlink(missing_ok=True)

    def scan(self, sweep_tmp_older_than: float = 0.0) -> Iterator[tuple[bytes, int, float]]:
        """(hash, size, mtime) of every block file; temporaries older than the given age in
        seconds are removed (a dead writer's), and files with foreign names are ignored."""
        cutoff = time.time() - sweep_tmp_older_than
        for sub in self.dir.iterdir():
            if not sub.is_dir():
                continue
            for path in sub.iterdir():
                try:
                    st = path.stat()
                    if path.suffix == ".tmp":
                        if st.st_mtime <= cutoff:
                            path.unlink(missing_ok=True)
                        continue
                    h = bytes.fromhex(path.stem)
                except (OSError, ValueError):
                    continue
                if path.suffix == ".kv" and len(h) == 16:
                    yield h, st.st_size, st.st_mtime
