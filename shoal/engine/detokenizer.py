"""Incremental detokenization with stop strings.

Text is released only when it is final: a tail that could still grow into a stop string, or
an unfinished UTF-8 character, is held back until the next token decides it. So streamed
text never has to be taken back.
"""

from __future__ import annotations

from typing import Any

from shoal.engine.sequence import Sequence


class Detokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def _full_text(self, seq: Sequence) -> str:
        """All the output's text so far. Only the last few tokens are decoded each step (a
        window that starts a token or more back, so a tokenizer that drops a leading space
        decodes both sides alike); an unfinished UTF-8 character stays in the window."""
        ids = seq.output_token_ids
        before = self._decode(ids[seq.prefix_offset : seq.read_offset])
        window = self._decode(ids[seq.prefix_offset :])
        tail = window[len(before) :]
        if len(window) > len(before) and not window.endswith("\ufffd"):
            seq.decoded += tail
            seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
            return seq.decoded
        return seq.decoded + tail

    def update(self, seq: Sequence, finishing: bool) -> bool:
        """Refresh `seq.text`; True if a stop string was hit (the text is cut before it)."""
        if self.tokenizer is None:
            return False
        full = self._full_text(seq)
        stops = seq.params.stop_strings
        if stops:
            start = max(0, len(seq.text) - max(len(s) for s in stops))
            hits = [i for i in (full.find(s, start) for s in stops) if i >= 0]
            if hits:
                seq.text = full[: min(hits)]
                return True
        if finishing:
            seq.text = full
            return False
        hold = max((len(s) - 1 for s in stops), default=0)
        end = len(full) - hold
        while end > len(seq.text) and full[end - 1] == "\ufffd":
            end -= 1
        if end > len(seq.text):
            seq.text = full[:end]
        return False
