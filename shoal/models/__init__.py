"""Model definitions and loaders (HF folders, GGUF files, the bundled SmolLM2)."""
