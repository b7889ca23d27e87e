"""The default model through gRPC: Generate, Tokenize and Detokenize with the GGUF's own tokenizer."""

import grpc
import pytest
import transformers

from metrale.v1 import worker_pb2 as pb


def test_greedy_generate_says_paris(default_worker):
    stream = default_worker.stub.Generate(pb.GenerateRequest(prompt="The capital of France is", max_new_tokens=3))
    responses = list(stream)
    assert [r.index for r in responses] == [0, 1, 2]
    assert responses[0].text == " Paris"
    assert responses[-1].finish_reason == "length"
    info = default_worker.stub.Info(pb.InfoRequest())
    assert info.live_sequences == 0 and info.free_kv_blocks == info.num_kv_blocks


def test_generate_stops_at_a_stop_token(default_worker):
    stub = default_worker.stub
    tokens = [r.token for r in stub.Generate(pb.GenerateRequest(prompt="The capital of France is",
                                                                  max_new_tokens=6))]
    stopped = list(stub.Generate(pb.GenerateRequest(prompt="The capital of France is", max_new_tokens=6,
                                                     stop_token_ids=[tokens[2]])))
    assert [r.token for r in stopped] == tokens[:3] and stopped[-1].finish_reason == "stop"


def test_tokenize_detokenize_round_trip(default_worker, default_gguf):
    stub = default_worker.stub
    info = stub.Info(pb.InfoRequest())
    assert info.architecture == "LlamaForCausalLM" and info.vocab_size == 49152
    reference = transformers.AutoTokenizer.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)
    tokens = stub.Tokenize(pb.TokenizeRequest(text="The capital of France is")).tokens
    assert list(tokens) == reference("The capital of France is", add_special_tokens=False).input_ids
    assert stub.Detokenize(pb.DetokenizeRequest(tokens=tokens)).text == "The capital of France is"
    with pytest.raises(grpc.RpcError) as caught:
        stub.Detokenize(pb.DetokenizeRequest(tokens=[49152]))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_info_carries_the_chat_template(default_worker, default_gguf):
    """The GGUF's template, which rendered as transformers renders it gives the prompt a gateway sends."""
    reference = transformers.AutoTokenizer.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)
    assert default_worker.stub.Info(pb.InfoRequest()).chat_template == reference.chat_template != ""
