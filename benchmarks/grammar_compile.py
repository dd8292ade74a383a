"""What compiling each new grammar in a killable worker first costs (issue 31): the 22 answer
schemas of issue 18's acceptance run, compiled for the bundled SmolLM2's 49k-token vocabulary
once in-process (xgrammar alone, as shoal did before) and once through `Grammars` (a worker
process compiles it within the budget, then the engine compiles it again), each on a fresh
cache, workers already started. Prints both times per schema and the ratio of the totals.

    .venv/bin/python benchmarks/grammar_compile.py
"""

from __future__ import annotations

import json
import time

import xgrammar as xgr
from structured_schemas import SCHEMAS

from shoal.bench import cpu_info
from shoal.engine.grammar_specs import build
from shoal.engine.structured import Grammars
from shoal.models.files import bundled_model_path, gguf_metadata
from shoal.sampling_params import StructuredOutput


def main() -> None:
    _, tokenizer, _ = gguf_metadata(bundled_model_path())
    vocab = len(tokenizer.get_vocab())
    stop = [tokenizer.eos_token_id]
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=stop)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    grammars = Grammars(tokenizer, vocab, stop)
    grammars.compile(StructuredOutput(json_object=True))  # starts the fork server and workers
    print(f"CPU: {cpu_info().describe()}")
    print(f"{'schema':<20} {'in-process':>11} {'worker+engine':>14}")
    totals = [0.0, 0.0]
    for what, schema in SCHEMAS:
        start = time.perf_counter()
        build(compiler, "json", json.dumps(schema))
        alone = time.perf_counter() - start
        start = time.perf_counter()
        grammars.compile(StructuredOutput(json=schema))
        piped = time.perf_counter() - start
        totals[0] += alone
        totals[1] += piped
        print(f"{what:<20} {alone * 1e3:>9.1f}ms {piped * 1e3:>12.1f}ms")
    print(f"{'total':<20} {totals[0] * 1e3:>9.1f}ms {totals[1] * 1e3:>12.1f}ms")
    print(f"ratio {totals[1] / totals[0]:.2f}x")
    grammars.close()


if __name__ == "__main__":
    main()
