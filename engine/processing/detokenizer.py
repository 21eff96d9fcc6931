"""Incremental detokenization: text grows token by token and never ends in a broken character.

Each step decodes a short window of recent tokens twice, with and without the new ones, and
emits the difference once it no longer ends in U+FFFD (an incomplete UTF-8 sequence). Decoding
a window with some context before it keeps tokenizers that drop a leading space at the start
of a decode (SentencePiece) correct.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from engine.processing.tokenization import flat_decoder

_CONTEXT = 6  # prompt tokens decoded as left context of the first output token
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._decode = flat_decoder(tokenizer, skip_special_tokens)
        self.tokens = list(prompt_token_ids[-_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)

    def add(self, token_id: int) -> str:
        """The text this token completes (possibly empty)."""
        self.tokens.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end of a sequence: whatever is held back, even an incomplete character."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self.read_offset == len(self.tokens):
            return ""
        prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        text = self._decode(self.tokens[self.prefix_offset :])
        # A prompt that ends in the middle of a character leaves U+FFFD in the prefix.
        start = len(prefix) if text.startswith(prefix) else len(prefix.rstrip(_REPLACEMENT))
        if len(text) <= start or (text.endswith(_REPLACEMENT) and not final):
            return ""
        delta = text[start:]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        return delta
