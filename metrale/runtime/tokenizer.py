"""The model's tokenizer (text <-> token ids), built from GGUF metadata or a Hugging Face tokenizer.json."""

import json
from collections.abc import Mapping
from pathlib import Path

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from metrale.runtime import errors

# Characters (or ids) past which encode and decode use the tokenizer's batch form, which releases the GIL.
LONG_TEXT = 1 << 14
# llama.cpp's token_type values (tokenizer.ggml.token_type).
CONTROL = 3
USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> the split regex its merges were learned with, as transformers maps it.
# A value not listed ("smollm", "gpt-2", ...) keeps GPT-2's own ByteLevel regex.
GGUF_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                     "lfm2", "jina-v5-nano", "dbrx", "smaug-bpe"], _LLAMA3_SPLIT),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"], _QWEN2_SPLIT),
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], _GPT4O_SPLIT),
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the alphabet byte-level BPE vocabularies are spelled in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


class Tokenizer:
    def __init__(self, backend: tokenizers.Tokenizer, eos_token_ids: list[int],
                 bos_token_id: int | None, pad_token_id: int | None, chat_template: str | None = None):
        self.backend = backend
        # The model's chat template (Jinja, as its GGUF or tokenizer config carries it), or None.
        self.chat_template = chat_template
        self._eos_token_ids = list(eos_token_ids)
        self._bos_token_id = bos_token_id
        self._pad_token_id = pad_token_id

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if len(text) <= LONG_TEXT:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        # The batch form lets go of the GIL while it works; encode holds it (a megabyte: ~1.4 s of a stalled loop).
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        if len(ids) <= LONG_TEXT:
            return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.backend.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self._eos_token_ids)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def pad_token_id(self) -> int | None:
        return self._pad_token_id

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_gguf_fields(cls, fields: Mapping[str, object]) -> "Tokenizer":
        """From GGUF metadata (key -> value, as GGUFReader field.contents() gives), as transformers converts it."""
        tokenizer_model = fields.get("tokenizer.ggml.model")
        if tokenizer_model != "gpt2":
            raise errors.InvalidArgument(
                f"GGUF tokenizer model {tokenizer_model!r} is not supported; only byte-level BPE ('gpt2') is")
        if missing := [key for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges") if key not in fields]:
            raise errors.InvalidArgument(f"GGUF byte-level BPE tokenizer lacks {missing}")
        tokens = list(fields["tokenizer.ggml.tokens"])
        backend = _byte_level_bpe(tokens, list(fields.get("tokenizer.ggml.token_type") or []),
                                  fields["tokenizer.ggml.merges"], fields.get("tokenizer.ggml.pre"))

        def token_id(key: str) -> int | None:
            value = fields.get(f"tokenizer.ggml.{key}")
            return None if value is None else int(value)

        bos_token_id, eos_token_id = token_id("bos_token_id"), token_id("eos_token_id")
        # The special-token roles transformers gives these ids make them special (whole, skippable) too.
        role_ids = [bos_token_id, eos_token_id, token_id("unknown_token_id"), token_id("padding_token_id")]
        backend.add_special_tokens([AddedToken(tokens[i], normalized=False, special=True)
                                    for i in role_ids if i is not None and i < len(tokens)])
        add_bos = bool(fields.get("tokenizer.ggml.add_bos_token", False)) and bos_token_id is not None
        add_eos = bool(fields.get("tokenizer.ggml.add_eos_token", False)) and eos_token_id is not None
        backend.post_processor = _template(tokens, bos_token_id if add_bos else None,
                                           eos_token_id if add_eos else None)

        eos_ids = [i for i in (eos_token_id, token_id("eot_token_id"), token_id("eom_token_id")) if i is not None]
        template = fields.get("tokenizer.chat_template")
        return cls(backend, list(dict.fromkeys(eos_ids)), bos_token_id, token_id("padding_token_id"),
                   template if isinstance(template, str) else None)

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "Tokenizer | None":
        """From a Hugging Face model directory; None where it has no tokenizer.json."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            return None
        backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        tokenizer_config = _read_json(path / "tokenizer_config.json")
        config = _read_json(path / "config.json")
        generation_config = _read_json(path / "generation_config.json")

        def special_id(role: str) -> int | None:
            for source in (generation_config, config):
                value = source.get(f"{role}_token_id")
                if isinstance(value, int):
                    return value
            token = tokenizer_config.get(f"{role}_token")
            if isinstance(token, dict):
                token = token.get("content")
            return backend.token_to_id(token) if isinstance(token, str) else None

        eos_ids: list[int] = []
        for source in (generation_config, config):
            value = source.get("eos_token_id")
            eos_ids += value if isinstance(value, list) else [value] if isinstance(value, int) else []
        if (eos_id := special_id("eos")) is not None:
            eos_ids.append(eos_id)
        return cls(backend, list(dict.fromkeys(eos_ids)), special_id("bos"), special_id("pad"),
                   _hf_chat_template(path, tokenizer_config))


def _byte_level_bpe(tokens: list[str], token_types: list[int], merges: list[str],
                    pre: str | None) -> tokenizers.Tokenizer:
    """GPT-2 style byte-level BPE with the control / user-defined tokens kept whole, as transformers builds it."""
    merge_pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    # A token written in plain UTF-8 rather than the byte alphabet is respelled byte by byte.
    vocab = {token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
             for index, token in enumerate(tokens)}
    try:
        bpe = models.BPE(vocab=vocab, merges=merge_pairs, dropout=None, continuing_subword_prefix="",
                         end_of_word_suffix="", fuse_unk=False)
    except Exception as error:  # tokenizers raises a bare Exception for a merge outside the vocabulary
        raise errors.InvalidArgument(f"GGUF tokenizer vocabulary and merges do not agree: {error}") from error
    backend = tokenizers.Tokenizer(bpe)
    split = GGUF_PRE_TOKENIZER_SPLITS.get(pre)
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()

    # Control tokens stay whole and are special; a "control" token outside the byte alphabet is a
    # llama.cpp mislabel that transformers skips, and so do we. User-defined tokens stay whole too.
    backend.add_special_tokens([
        AddedToken(token, normalized=False, special=True)
        for token, kind in zip(tokens, token_types) if kind == CONTROL and set(token) <= alphabet])
    backend.add_tokens([
        AddedToken(token, normalized=False, special=False)
        for token, kind in zip(tokens, token_types) if kind == USER_DEFINED and token in vocab])
    return backend


def _template(tokens: list[str], bos_token_id: int | None,
              eos_token_id: int | None) -> processors.TemplateProcessing:
    """The post-processor transformers builds for add_bos_token / add_eos_token (None: do not add)."""
    bos = tokens[bos_token_id] if bos_token_id is not None else None
    eos = tokens[eos_token_id] if eos_token_id is not None else None
    single = [*([f"{bos}:0"] if bos else []), "$A:0", *([f"{eos}:0"] if eos else [])]
    pair = [*single, *([f"{bos}:1"] if bos else []), "$B:1", *([f"{eos}:1"] if eos else [])]
    special = [(token, token_id) for token, token_id in {bos: bos_token_id, eos: eos_token_id}.items() if token]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _hf_chat_template(path: Path, tokenizer_config: dict) -> str | None:
    """A Hugging Face directory's chat template: chat_template.jinja, else tokenizer_config.json's (a string, or
    named templates of which the one named "default")."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    return template if isinstance(template, str) else None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as file:
        value = json.load(file)
    return value if isinstance(value, dict) else {}
