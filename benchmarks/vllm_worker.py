"""The vLLM side of `benchmarks/vllm_peer.py`: runs inside the vLLM venv, not shoal's.

    <vllm venv>/bin/python benchmarks/vllm_worker.py JOB.json RESULT.json

JOB names the HF folder, dtype, engine limits and the work: `"w1"` (every prompt at once, one
`LLM.generate`, timed) or `"w2"` (turns of sessions: each turn sends every session's whole
history plus its new user tokens; TTFT per request from vLLM's own request metrics). Token ids
in, token ids out (`TokensPrompt`, greedy, EOS ignored, no detokenization: shoal's output text
is not compared, so vLLM is not made to produce it). A short warm-up on token ids no prompt
starts with runs before anything is timed. It imports nothing from shoal; the spawned engine
process re-imports this file, hence everything under `__main__`.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


def _generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[Any]]:
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False
    )
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    start = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False)
    return time.perf_counter() - start, outs


def w1(llm: Any, job: dict[str, Any]) -> dict[str, Any]:
    elapsed, outs = _generate(llm, job["prompts"], job["max_tokens"])
    return {"elapsed": elapsed, "outputs": [list(o.outputs[0].token_ids) for o in outs]}


def w2(llm: Any, job: dict[str, Any]) -> dict[str, Any]:
    histories: list[list[int]] = job["histories"]
    turns = []
    for users in job["turns"]:
        prompts = [h + u for h, u in zip(histories, users, strict=True)]
        seconds, outs = _generate(llm, prompts, job["max_tokens"])
        histories = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs, strict=True)]
        turns.append({"seconds": seconds, "ttfts": [o.metrics.first_token_latency for o in outs]})
    return {"turns": turns, "histories": histories}


def main() -> None:
    import vllm
    from vllm import LLM

    job = json.loads(Path(sys.argv[1]).read_text())
    llm = LLM(
        model=job["model"],
        dtype=job["dtype"],
        max_num_seqs=job["max_num_seqs"],
        max_num_batched_tokens=job["max_num_batched_tokens"],
        enable_prefix_caching=job["enable_prefix_caching"],
        disable_log_stats=job["work"] != "w2",  # w2 reads each request's TTFT
        generation_config="vllm",  # the job's sampling parameters, nothing from the folder
        seed=0,
        speculative_config=job.get("speculative_config"),
    )
    _generate(llm, [[1, 2, 3, 4, 5, 6, 7, 8]] * 2, 8)  # warm-up, untimed
    result = w1(llm, job) if job["work"] == "w1" else w2(llm, job)
    result["version"] = vllm.__version__
    Path(sys.argv[2]).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
