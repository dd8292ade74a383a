"""Tiny random Llamas for fast tests: one with a real byte-level BPE tokenizer and a chat
template, and one speaking SmolLM2's tokenizer whose every answer ends at once."""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, this is a tiny model used for testing the shoal server.",
    "What is the capital of France? Paris is the capital of France.",
    "Batches of requests run at a lower priority than interactive traffic.",
    "user assistant system: say hello, count to ten, tell a story.",
]
VOCAB = 320


def build_tiny_model(path: Path, max_positions: int = 512) -> Path:
    """Write config, random weights and tokenizer into `path` (idempotent). Prompts that
    present tools need a longer context than the default."""
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return path
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    )
    tok.train_from_iterator(SENTENCES * 4, trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>"
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(path)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        eos_token_id=hf_tok.eos_token_id,
        bos_token_id=hf_tok.bos_token_id,
        tie_word_embeddings=False,
        initializer_range=0.2,  # peaky logits: greedy picks are robust to batching noise
    )
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


def build_terse_smollm2_model(
    path: Path, max_positions: int = 32768, num_layers: int = 2, num_heads: int = 4
) -> Path:
    """A tiny Llama with SmolLM2's tokenizer and chat template (from the bundled GGUF, read
    locally) that answers every prompt with its end-of-turn token at once, even when
    sampling: for clients whose prompts pass SmolLM2's 8,192 tokens (Codex CLI's is ~11k)
    and who need their turn to end (they take a cut-off answer as a failure). Attention and
    MLP outputs are zero and every token embeds alike, so the last hidden state is the same
    for every prompt, and only the end-of-turn token's logit is not zero. Fewer layers and
    heads make a long prompt (Claude Code's ~22k tokens) cheaper to prefill. Idempotent."""
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from shoal.models.files import bundled_model_path, gguf_metadata

    _, tok, _ = gguf_metadata(bundled_model_path())
    path.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(path)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=16 * num_heads,
        intermediate_size=32 * num_heads,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=max(1, num_heads // 2),
        max_position_embeddings=max_positions,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        same = torch.randn(config.hidden_size)
        model.model.embed_tokens.weight.copy_(same.expand_as(model.model.embed_tokens.weight))
        model.lm_head.weight.zero_()
        model.lm_head.weight[tok.eos_token_id] = 40 * same / same.norm()
    model.save_pretrained(path, safe_serialization=True)
    return path
