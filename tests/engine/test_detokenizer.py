"""Incremental detokenization decodes a few tokens a step yet releases exactly the text a full
decode gives, for byte-level BPE (split UTF-8 characters included) and word-level tokenizers."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from server_tiny_model import build_tiny_model

from shoal.engine.detokenizer import Detokenizer
from shoal.engine.sequence import Sequence
from shoal.sampling_params import SamplingParams


def stream(tokenizer: Any, ids: list[int], stop: list[str] | None = None) -> Sequence:
    seq = Sequence("r", [1], SamplingParams(max_tokens=10_000, stop=stop))
    detok = Detokenizer(tokenizer)
    for i, t in enumerate(ids):
        seq.output_token_ids.append(t)
        released = seq.text
        if detok.update(seq, finishing=i == len(ids) - 1):
            break
        assert seq.text.startswith(released)  # streamed text is never taken back
    return seq


def check_against_full_decode(tokenizer: Any, texts: list[str], seed: int = 0) -> None:
    rng = random.Random(seed)
    vocab = len(tokenizer)
    for trial in range(200):
        if trial % 2:
            ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 50))]
        else:
            ids = tokenizer.encode(rng.choice(texts) * 2, add_special_tokens=False)
        assert stream(tokenizer, ids).text == tokenizer.decode(ids, skip_special_tokens=True)


def test_byte_level_bpe_matches_a_full_decode(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "m"))
    texts = ["Hello world, this is a tiny model.", "Héllo wörld ✓ 🐟", "a\n\n  b\tc"]
    check_against_full_decode(tok, texts)


def test_word_level_matches_a_full_decode(tiny_model_dir: Any) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir("llama", tokenizer=True))
    check_against_full_decode(tok, ["w5 w6 w7", "user w9 assistant w10 w11"])


def test_stop_string_cuts_the_text_before_it(tiny_model_dir: Any) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir("llama", tokenizer=True))
    ids = tok.encode("w5 w6 w7 w8 w9", add_special_tokens=False)
    seq = stream(tok, ids, stop=["w7 w8"])
    assert seq.text == "w5 w6 "


@pytest.mark.slow
def test_smollm2_tokenizer_matches_a_full_decode(bundled_llm: Any) -> None:
    texts = ["Héllo wörld! 你好，世界。 🐟🐠", "def f(x):\n    return x ** 2", "The quick fox."]
    check_against_full_decode(bundled_llm.tokenizer, texts)
