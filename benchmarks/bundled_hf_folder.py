"""Write the bundled SmolLM2-135M as an HF folder, for peers that cannot read its GGUF.

The weights are the ones shoal itself loads from the Q4_1 GGUF (`shoal.models.loader`:
dequantized to float32, q/k rows back in HF order), so a peer reading this folder computes
with exactly shoal's numbers; config and tokenizer come from the same GGUF through
transformers.

    .venv/bin/python benchmarks/bundled_hf_folder.py OUT_DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from safetensors.torch import save_file

from shoal.models.files import bundled_model_path, gguf_metadata
from shoal.models.loader import load_model


def write(out: Path) -> None:
    gguf = bundled_model_path()
    loaded = load_model(str(gguf), "float32")
    hf_config, tokenizer, _ = gguf_metadata(gguf)
    out.mkdir(parents=True, exist_ok=True)
    # A GGUF names no HF class; without one vLLM resolves the headless `LlamaModel`.
    hf_config.architectures = ["LlamaForCausalLM"]
    hf_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    # Greedy, EOS from the tokenizer: a peer's "auto" generation config changes nothing.
    eos = loaded.config.eos_token_ids
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}) + "\n")
    weights = {k: v.contiguous() for k, v in loaded.weights.items()}
    if loaded.config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # tied: the embedding is the head
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})

    print(f"wrote {len(weights)} tensors ({gguf.name}, float32) to {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    write(ap.parse_args().out)


if __name__ == "__main__":
    main()
