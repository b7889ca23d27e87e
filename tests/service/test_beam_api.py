"""BeamGenerate through gRPC: transformers' hypotheses for a batch of requests, unset fields taking transformers'
defaults, and each bad input refused with its status code while the pool and a live sequence stay as they were."""

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import tokenizers
import transformers

from metrale.runtime.beam.params import BeamParams
from metrale.v1 import worker_pb2 as pb
from beam_reference import check_hypotheses, load_references
from service_harness import WORKER_DEVICE, start_worker
from tiny_models import write_tiny_m2m100


@pytest.fixture
def llama(stub):
    assert stub.Info(pb.InfoRequest()).supports_beam
    return stub


def hypotheses(result) -> list[tuple[list[int], float]]:
    return [(list(h.tokens), h.score) for h in result.hypotheses]


def test_a_batch_of_requests_matches_transformers(llama, tiny_model_dir):
    stub = llama
    references = load_references(tiny_model_dir, WORKER_DEVICE["device"])
    requests = [
        pb.BeamRequest(request_id=7, prompt_tokens=[5, 17, 99, 3], num_beams=4, max_new_tokens=12,
                       num_return_sequences=3, no_repeat_ngram_size=2),
        pb.BeamRequest(request_id=3, prompt_tokens=[9] * 20, num_beams=2, max_new_tokens=8, length_penalty=0.0,
                       early_stopping=pb.EARLY_STOPPING_NEVER, min_new_tokens=4),
        pb.BeamRequest(request_id=11, prompt_tokens=[40, 41], num_beams=1, max_new_tokens=5),
    ]
    expected_params = [BeamParams(4, 12, no_repeat_ngram_size=2, num_return_sequences=3),
                       BeamParams(2, 8, min_new_tokens=4, length_penalty=0.0, early_stopping="never"),
                       BeamParams(1, 5)]
    response = stub.BeamGenerate(pb.BeamGenerateRequest(requests=requests, stream=1))
    assert [r.request_id for r in response.results] == [7, 3, 11]
    compared = [check_hypotheses(hypotheses(result), references, list(request.prompt_tokens), params, (2,))
                for request, params, result in zip(requests, expected_params, response.results)]
    assert any(compared)        # on CUDA, requests bf16 rounding decides are not compared: not all of them
    info = stub.Info(pb.InfoRequest())
    assert info.free_kv_blocks == info.num_kv_blocks


def beam(**fields) -> pb.BeamRequest:
    return pb.BeamRequest(**{"request_id": 1, "prompt_tokens": [5, 6, 7], "num_beams": 2, "max_new_tokens": 4,
                             **fields})


LOGPROBS = pb.OutputOptions(logprobs=True)
BAD = [
    (grpc.StatusCode.INVALID_ARGUMENT, [beam(num_beams=0)], "num_beams"),
    (grpc.StatusCode.INVALID_ARGUMENT, [beam(num_beams=33)], "num_beams"),
    (grpc.StatusCode.INVALID_ARGUMENT, [beam(num_return_sequences=3)], "num_return_sequences"),
    (grpc.StatusCode.INVALID_ARGUMENT, [beam(prompt_tokens=[])], "prompt_tokens is empty"),
    (grpc.StatusCode.INVALID_ARGUMENT, [beam(prompt_tokens=[5, 256])], "256"),
    (grpc.StatusCode.INVALID_ARGUMENT, [beam(src_tokens=[5, 6])], "decoder-only"),
    (grpc.StatusCode.INVALID_ARGUMENT, [beam(max_new_tokens=0)], "max_new_tokens"),
    (grpc.StatusCode.INVALID_ARGUMENT, [beam(min_new_tokens=5)], "min_new_tokens"),
    (grpc.StatusCode.INVALID_ARGUMENT, [beam(), beam(prompt_tokens=[8])], "more than once"),
    (grpc.StatusCode.INVALID_ARGUMENT, [], "empty"),
    (grpc.StatusCode.OUT_OF_RANGE, [beam(prompt_tokens=[5] * 90, max_new_tokens=7)], "max_model_len"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, [beam(num_beams=32, max_new_tokens=90, prompt_tokens=[5])], "KV blocks"),
]


def prompt(seq_id: int) -> pb.PrefillRequest:
    return pb.PrefillRequest(slices=[pb.PrefillSlice(seq_id=seq_id, tokens=[3, 4, 5], is_last_chunk=True,
                                                     output=LOGPROBS)])


@pytest.mark.parametrize("code, requests, words", BAD, ids=[words for _, _, words in BAD])
def test_bad_requests_change_nothing(llama, code, requests, words):
    stub = llama
    live = stub.Prefill(prompt(5))
    free = stub.Info(pb.InfoRequest()).free_kv_blocks
    with pytest.raises(grpc.RpcError) as error:
        stub.BeamGenerate(pb.BeamGenerateRequest(requests=requests))
    assert error.value.code() == code and words in error.value.details(), error.value.details()
    assert stub.Info(pb.InfoRequest()).free_kv_blocks == free
    # The live sequence goes on as a fresh twin does.
    twin = stub.Prefill(prompt(6))
    assert live.tokens == twin.tokens
    ours = stub.Decode(pb.DecodeRequest(seq_ids=[5], tokens=[9]))
    theirs = stub.Decode(pb.DecodeRequest(seq_ids=[6], tokens=[9]))
    assert ours.tokens == theirs.tokens and ours.logprobs == theirs.logprobs


def nllb_style_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """NLLB's tokenizer.json layout in miniature: SentencePiece-style BPE (Metaspace), <s> <pad> </s> <unk> first,
    language codes as added tokens, and a template that puts the source language first and </s> last."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, "\u2581": 4}
    vocab.update({c: 5 + i for i, c in enumerate(letters)})
    vocab.update({"\u2581" + c: 31 + i for i, c in enumerate(letters)})
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, [("\u2581", c) for c in letters], unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    backend.decoder = tokenizers.decoders.Metaspace()
    backend.add_special_tokens(["<s>", "<pad>", "</s>", "<unk>", "eng_Latn", "fra_Latn"])
    backend.post_processor = tokenizers.processors.TemplateProcessing(
        single="eng_Latn $A </s>", special_tokens=[("eng_Latn", backend.token_to_id("eng_Latn")), ("</s>", 2)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>", unk_token="<unk>")


@pytest.fixture(scope="module")
def translator(tmp_path_factory):
    """A worker serving a tiny random M2M100 (NLLB's architecture) with an NLLB-style tokenizer.json."""
    directory = write_tiny_m2m100(tmp_path_factory.mktemp("m2m100") / "m2m100")
    nllb_style_tokenizer().save_pretrained(directory)
    running = start_worker(directory, max_model_len=64)
    yield running, directory
    running.stop()


def test_an_encoder_decoder_translates_as_transformers_does(translator):
    worker, directory = translator
    info = worker.stub.Info(pb.InfoRequest())
    assert info.supports_beam and info.is_encoder_decoder and info.architecture == "M2M100ForConditionalGeneration"
    requests = [pb.BeamRequest(request_id=1, src_tokens=[5, 17, 99, 3, 2], decoder_prefix=[200], num_beams=4,
                               max_new_tokens=10, num_return_sequences=2),
                pb.BeamRequest(request_id=2, src_tokens=[7, 8, 2], num_beams=3, max_new_tokens=6)]
    response = worker.stub.BeamGenerate(pb.BeamGenerateRequest(requests=requests))
    references = load_references(directory, WORKER_DEVICE["device"], encoder_decoder=True)
    compared = [check_hypotheses(hypotheses(result), references, [2, *request.decoder_prefix], params, (2,),
                                 source=list(request.src_tokens))
                for request, result, params in zip(requests, response.results,
                                                   (BeamParams(4, 10, num_return_sequences=2), BeamParams(3, 6)))]
    assert any(compared)
    # What an encoder-decoder cannot take says so and changes nothing: a decoder-only prompt, a chunked source.
    chunked = pb.PrefillRequest(slices=[pb.PrefillSlice(seq_id=1, tokens=[5], is_last_chunk=False)])
    for call, request, code in [
            (worker.stub.BeamGenerate, pb.BeamGenerateRequest(requests=[beam()]), grpc.StatusCode.INVALID_ARGUMENT),
            (worker.stub.Prefill, chunked, grpc.StatusCode.FAILED_PRECONDITION)]:
        with pytest.raises(grpc.RpcError) as error:
            call(request)
        assert error.value.code() == code
    info = worker.stub.Info(pb.InfoRequest())
    assert info.free_kv_blocks == info.num_kv_blocks and info.live_sequences == 0


def test_an_encoder_decoder_tokenizes_with_its_tokenizer_json(translator):
    worker, directory = translator
    reference = transformers.PreTrainedTokenizerFast.from_pretrained(directory)
    for text, special in [("hello world", True), ("a quick fox", False), ("", True)]:
        ours = worker.stub.Tokenize(pb.TokenizeRequest(text=text, add_special_tokens=special)).tokens
        assert list(ours) == reference(text, add_special_tokens=special)["input_ids"]
    source = worker.stub.Tokenize(pb.TokenizeRequest(text="hello world", add_special_tokens=True)).tokens
    assert source[0] == reference.convert_tokens_to_ids("eng_Latn") and source[-1] == 2
    text = worker.stub.Detokenize(pb.DetokenizeRequest(tokens=source, skip_special_tokens=True)).text
    assert text == reference.decode(list(source), skip_special_tokens=True) == "hello world"


def test_length_penalty_arrives_as_the_client_wrote_it():
    """A proto float carries 0.6 as 0.6000000238...; the search must see the 0.6 transformers divides by."""
    from metrale.service.convert import beam_requests_from_pb

    requests = beam_requests_from_pb(pb.BeamGenerateRequest(requests=[beam(length_penalty=0.6), beam(request_id=2)]))
    assert [r.params.length_penalty for r in requests] == [0.6, 1.0]


def test_generate_on_an_encoder_decoder_counts_decoder_tokens(translator):
    """max_model_len bounds the decoder's tokens, not the source's: a 60-token source still gets 10 new tokens
    under max_model_len 64 (found in review: Generate counted the source)."""
    worker, _ = translator
    request = pb.GenerateRequest(prompt_tokens=[5] * 59 + [2], max_new_tokens=10, ignore_eos=True)
    messages = list(worker.stub.Generate(request))
    assert len(messages) == 10 and messages[-1].finish_reason == "length"


def test_a_cancelled_call_gives_every_block_back(llama):
    stub = llama
    free = stub.Info(pb.InfoRequest()).free_kv_blocks
    long_call = pb.BeamGenerateRequest(requests=[beam(request_id=i, num_beams=4, max_new_tokens=90,
                                                      min_new_tokens=90) for i in range(2)])
    started = time.monotonic()
    stub.BeamGenerate(long_call)
    whole = time.monotonic() - started
    with pytest.raises(grpc.RpcError) as error:      # cancelled half way, by its deadline
        stub.BeamGenerate(long_call, timeout=whole / 2)
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 30
    while stub.Info(pb.InfoRequest()).free_kv_blocks != free and time.monotonic() < deadline:
        time.sleep(0.05)     # the stream notices the cancel at its next step
    assert stub.Info(pb.InfoRequest()).free_kv_blocks == free


def test_beam_search_beside_decoding_on_another_stream(llama, tiny_model_dir):
    """A BeamGenerate call on stream 1 while a client decodes on stream 0: both get what they get alone."""
    stub = llama
    call = pb.BeamGenerateRequest(requests=[beam(request_id=i, prompt_tokens=[5 + i, 6, 7], num_beams=3,
                                                 max_new_tokens=12) for i in range(3)], stream=1)

    def decode_alone(seq_id):
        r = stub.Prefill(pb.PrefillRequest(slices=[pb.PrefillSlice(seq_id=seq_id, tokens=[9, 8, 7],
                                                                    is_last_chunk=True)]))
        tokens = [r.tokens[0]]
        for _ in range(12):
            tokens.append(stub.Decode(pb.DecodeRequest(seq_ids=[seq_id], tokens=[tokens[-1]])).tokens[0])
        return tokens

    beams_alone, decoded_alone = stub.BeamGenerate(call), decode_alone(20)
    with ThreadPoolExecutor(2) as pool:
        beams = pool.submit(stub.BeamGenerate, call)
        decoded = pool.submit(decode_alone, 21)
        assert beams.result() == beams_alone and decoded.result() == decoded_alone
