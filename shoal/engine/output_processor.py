"""After the model: append sampled tokens, detokenize, decide what finished, make snapshots."""

from __future__ import annotations

from dataclasses import dataclass

from shoal.engine.detokenizer import Detokenizer
from shoal.engine.sequence import Sequence
from shoal.outputs import RequestOutput


@dataclass(slots=True)
class Sampled:
    """What a backend's sampler picked for each sequence of a step (plain data, no tensors)."""

    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[dict[int, float]] | None
    # Per sequence, the draft tokens the model agreed with, which come before its token.
    accepted_drafts: list[list[int]] | None = None


class OutputProcessor:
    def __init__(self, detokenizer: Detokenizer, eos_token_ids: set[int], max_model_len: int):
        self.detokenizer = detokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def process(
        self, seqs: list[Sequence], sampled: Sampled, now: float
    ) -> list[tuple[Sequence, str]]:
        """Give each sequence its sampled token; returns those that finished, with why."""
        finished: list[tuple[Sequence, str]] = []
        for i, seq in enumerate(seqs):
            if seq.first_token_time is None:
                seq.first_token_time = now
            if sampled.logprobs is not None and sampled.top_logprobs is not None:
                seq.logprobs.append(sampled.logprobs[i])
                seq.top_logprobs.append(sampled.top_logprobs[i])
            drafts = sampled.accepted_drafts[i] if sampled.accepted_drafts else []
            for token in [*drafts, sampled.token_ids[i]]:  # one at a time: a stop ends them
                reason = self._append(seq, token)
                if reason is not None:
                    finished.append((seq, reason))
                    break
        return finished

    def _append(self, seq: Sequence, token: int) -> str | None:
        """Append one token; why `seq` finished with it, if it did."""
        seq.output_token_ids.append(token)
        if seq.grammar is not None:
            seq.grammar.accept(token)  # the matcher follows output_token_ids exactly
        reason = self._stop_reason(seq, token)
        if self.detokenizer.update(seq, finishing=reason is not None):
            reason = "stop"
        return reason

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if seq.grammar is not None and seq.grammar.finished:
            return "stop"  # the constrained output is complete (even with ignore_eos)
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    @staticmethod
    def snapshot(seq: Sequence) -> RequestOutput:
        want_logprobs = seq.params.logprobs is not None
        metrics = {"arrival_time": seq.arrival_time}
        if seq.first_token_time is not None:
            metrics["first_token_time"] = seq.first_token_time
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            text=seq.text,
            token_ids=list(seq.output_token_ids),
            finish_reason=seq.finish_reason,
            logprobs=list(seq.logprobs) if want_logprobs else None,
            top_logprobs=list(seq.top_logprobs) if want_logprobs else None,
            num_cached_tokens=seq.num_cached_tokens,
            metrics=metrics,
        )
