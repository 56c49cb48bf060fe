"""Incremental detokenisation: text for each new token without breaking multi-byte characters."""

from __future__ import annotations


class IncrementalDecoder:
    """Decodes a growing list of ids; `push` returns the text the newest token completes.

    Byte-level BPE splits one character over several tokens: while the tail decodes to U+FFFD the
    text is held back and released with the token that completes it (the approach of HF's
    TextStreamer and vLLM's incremental detokeniser). Only a short window is re-decoded per token.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # start of the window re-decoded for context (spaces depend on the previous token)
        self.read = 0  # ids before this index have had their text returned

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special, clean_up_tokenization_spaces=False)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix : self.read])
        full = self._decode(self.ids[self.prefix :])
        if full.endswith("\ufffd") or len(full) <= len(before):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return full[len(before) :]
