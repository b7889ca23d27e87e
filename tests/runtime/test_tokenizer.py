"""Tokenizer against transformers' own GGUF tokenizer conversion, on the default model and tiny vocabularies."""

import json

import gguf
import pytest
import tokenizers
import transformers

from metrale.runtime import errors
from metrale.runtime.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces,\ttabs\t\tand\n\nnewlines   \n",
    "Ünïcödé façade — naïve café, 日本語のテキスト, 한국어, Ελληνικά, русский",
    "emoji 🎉🚀 and a family 👩‍👩‍👧 and flags 🇫🇷",
    "def square(x):\n    return x ** 2  # comment\n\nprint([square(i) for i in range(10)])",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after end<|endoftext|>",
    "numbers 1234567890 3.14159 -2e-10 0x1F",
    "I'm sure they'll say we'd've DONE it, WON'T they?",
    "<jupyter_code>x = 1<jupyter_output>1<empty_output>",
    "\u00a0no-break\u2009thin\u3000ideographic spaces\r\n",
    "",
]


@pytest.fixture(scope="module")
def gguf_fields(default_gguf):
    return {key: field.contents() for key, field in gguf.GGUFReader(str(default_gguf)).fields.items()}


@pytest.fixture(scope="module")
def tokenizer(gguf_fields):
    return Tokenizer.from_gguf_fields(gguf_fields)


@pytest.fixture(scope="module")
def reference(default_gguf):
    return transformers.AutoTokenizer.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)


@pytest.mark.parametrize("add_special_tokens", [False, True])
@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tokenizer, reference, text, add_special_tokens):
    expected = reference(text, add_special_tokens=add_special_tokens)["input_ids"]
    assert tokenizer.encode(text, add_special_tokens=add_special_tokens) == expected


@pytest.mark.parametrize("skip_special_tokens", [False, True])
@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_transformers(tokenizer, reference, text, skip_special_tokens):
    ids = reference(text, add_special_tokens=False)["input_ids"]
    expected = reference.decode(ids, skip_special_tokens=skip_special_tokens)
    assert tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) == expected


def test_special_ids_match_transformers(tokenizer, reference):
    assert tokenizer.eos_token_ids == [reference.eos_token_id]
    assert tokenizer.bos_token_id == reference.bos_token_id
    assert tokenizer.pad_token_id == reference.pad_token_id
    assert tokenizer.vocab_size == len(reference) == 49152


def test_backend_is_the_one_transformers_builds(tokenizer, reference):
    assert json.loads(tokenizer.backend.to_str()) == json.loads(reference.backend_tokenizer.to_str())


def _tiny_vocabulary():
    """Specials, the 256-character byte alphabet, a few merges, a user-defined and a raw UTF-8 token."""
    specials = [("<unk>", 3), ("<s>", 1), ("</s>", 3), ("<pad>", 3)]  # <s> is NORMAL, yet the BOS
    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("Ġ", "w"), ("o", "r"), ("Ġw", "or"),
              ("l", "d"), ("Ġwor", "ld"), ("Ġ", "t"), ("Ġt", "he")]
    tokens = [token for token, _ in specials] + sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tokens += ["".join(merge) for merge in merges] + ["<think>", "日本"]
    token_types = [kind for _, kind in specials] + [1] * (len(tokens) - len(specials) - 2) + [4, 1]
    return tokens, token_types, [" ".join(merge) for merge in merges]


def _write_tokenizer_gguf(path, pre: str, add_bos: bool, add_eos: bool):
    tokens, token_types, merges = _tiny_vocabulary()
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(3)
    writer.add_add_bos_token(add_bos)
    writer.add_add_eos_token(add_eos)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "smollm"])
@pytest.mark.parametrize(("add_bos", "add_eos"), [(True, False), (False, True), (True, True)])
def test_tiny_vocabulary_matches_transformers(tmp_path, pre, add_bos, add_eos):
    path = _write_tokenizer_gguf(tmp_path / "tok.gguf", pre, add_bos, add_eos)
    fields = {key: field.contents() for key, field in gguf.GGUFReader(str(path)).fields.items()}
    ours = Tokenizer.from_gguf_fields(fields)
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    texts = ["hello world", "the <think> hello</s> world<s>", " hello  world\n\n1234", "日本 über"]
    for text in texts:
        for add_special_tokens in (False, True):
            expected = reference(text, add_special_tokens=add_special_tokens)["input_ids"]
            assert ours.encode(text, add_special_tokens=add_special_tokens) == expected, (text, add_special_tokens)
        ids = reference(text, add_special_tokens=True)["input_ids"] + [len(fields["tokenizer.ggml.tokens"]) - 1]
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
    assert (ours.bos_token_id, ours.eos_token_ids, ours.pad_token_id) == (1, [2], 3)
    # transformers' GPT2Tokenizer also appends its default "<|endoftext|>" as id 273 when the vocabulary
    # lacks one: an id past the model's embedding, which we deliberately do not copy.
    assert ours.vocab_size == len(fields["tokenizer.ggml.tokens"]) == len(reference) - 1


def test_unsupported_tokenizer_model_is_invalid_argument():
    with pytest.raises(errors.InvalidArgument, match="'llama' is not supported"):
        Tokenizer.from_gguf_fields({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>"]})


def test_from_hf_dir_reads_tokenizer_json_and_special_ids(tmp_path, reference):
    reference.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0], "bos_token_id": 1}))
    tokenizer = Tokenizer.from_hf_dir(tmp_path)
    for text in TEXTS:
        assert tokenizer.encode(text) == reference(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.encode(text, add_special_tokens=True) == reference(text)["input_ids"]
    assert tokenizer.eos_token_ids == [2, 0]
    assert tokenizer.bos_token_id == 1
    assert tokenizer.pad_token_id == reference.pad_token_id
    assert tokenizer.vocab_size == len(reference)


def test_from_hf_dir_without_tokenizer_json_is_none(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert Tokenizer.from_hf_dir(tmp_path) is None


def test_chat_template_is_the_one_transformers_reads(tokenizer, reference, tmp_path):
    """From the GGUF, and from a Hugging Face directory as save_pretrained writes it (chat_template.jinja) or as
    older tokenizer configs carry it (a string, or named templates)."""
    assert tokenizer.chat_template and tokenizer.chat_template == reference.chat_template
    reference.save_pretrained(tmp_path)
    assert Tokenizer.from_hf_dir(tmp_path).chat_template == reference.chat_template
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    for template in ("{{ messages }}", [{"name": "tool_use", "template": "x"}, {"name": "default", "template": "y"}]):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
        assert Tokenizer.from_hf_dir(tmp_path).chat_template == (template if isinstance(template, str) else "y")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items()
                                                                if k != "chat_template"}))
    assert Tokenizer.from_hf_dir(tmp_path).chat_template is None
