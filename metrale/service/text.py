"""The tokenizer's work for Tokenize, Detokenize and Generate's text prompt: bounded by bytes before it starts, and
run on its own threads, never on the event loop (a megabyte of text takes seconds to tokenize)."""

import asyncio
from concurrent.futures import ThreadPoolExecutor

from metrale.runtime.errors import FailedPrecondition, InvalidArgument
from metrale.runtime.step import check_token_ids

# Tokenizer calls at once; more wait their turn (the tokenizer runs its own threads inside a call).
TEXT_THREADS = 2


class TextWork:
    def __init__(self, tokenizer, max_text_bytes: int, vocab_size: int, max_tokens: int, missing_note: str):
        """max_tokens: the most ids one Detokenize takes (the longest sequence, max_model_len)."""
        self.tokenizer = tokenizer
        self.max_text_bytes = max_text_bytes
        self.vocab_size = vocab_size
        self.max_tokens = max_tokens
        self.missing_note = missing_note
        self._threads = ThreadPoolExecutor(TEXT_THREADS, thread_name_prefix="text")

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        tokenizer = self._tokenizer()
        self._check_size(text)
        return await self._run(tokenizer.encode, text, add_special_tokens=add_special_tokens)

    async def decode(self, tokens, skip_special_tokens: bool) -> str:
        tokenizer = self._tokenizer()
        if len(tokens) > self.max_tokens:
            raise InvalidArgument(f"{len(tokens)} token ids to detokenize, over the {self.max_tokens} of the "
                                  f"longest sequence (max_model_len)")
        check_token_ids("Detokenize", tokens, self.vocab_size)
        return await self._run(tokenizer.decode, list(tokens), skip_special_tokens=skip_special_tokens)

    def _check_size(self, text: str) -> None:
        # A character is 1 to 4 UTF-8 bytes: only a text between the two bounds is measured exactly.
        if len(text) > self.max_text_bytes or (4 * len(text) > self.max_text_bytes
                                               and len(text.encode()) > self.max_text_bytes):
            raise InvalidArgument(f"the text is over {self.max_text_bytes} bytes (--max-text-bytes); send it in "
                                  f"parts, or token ids")

    def _tokenizer(self):
        if self.tokenizer is None:
            raise FailedPrecondition(f"this model has no tokenizer ({self.missing_note}); send token ids")
        return self.tokenizer

    async def _run(self, function, *args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._threads, lambda: function(*args, **kwargs))

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
