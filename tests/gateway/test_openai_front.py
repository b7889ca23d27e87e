"""The OpenAI-compatible front through the official `openai` client, against the embedded default model behind the
gateway: a completion, a chat rendered with the model's template, streaming, stop strings, n = 2, seeded sampling
reproducible, logprobs, and bad requests refused in OpenAI's error shape."""

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import transformers
import uvicorn

from metrale.v1 import worker_pb2 as pb
from metrale_gateway import chat
from metrale_gateway.openai_front import create_app, held_back

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def client(default_worker):
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app([default_worker.address], "smollm2"), host="127.0.0.1",
                                           port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.05)
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    server.should_exit = True
    thread.join(timeout=10)


def greedy_text(default_worker, prompt_tokens: list[int], n: int) -> str:
    tokens = [r.token for r in default_worker.stub.Generate(pb.GenerateRequest(
        prompt_tokens=prompt_tokens, max_new_tokens=n, ignore_eos=True))]
    return default_worker.stub.Detokenize(pb.DetokenizeRequest(tokens=tokens, skip_special_tokens=True)).text


def test_models_lists_the_model(client):
    assert [m.id for m in client.models.list().data] == ["smollm2"]


def test_completion_is_the_workers_greedy_text(client, default_worker):
    prompt = "The capital of France is"
    answer = client.completions.create(model="smollm2", prompt=prompt, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    tokens = list(default_worker.stub.Tokenize(pb.TokenizeRequest(text=prompt, add_special_tokens=True)).tokens)
    assert answer.choices[0].text == greedy_text(default_worker, tokens, 8)
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 8
    assert "Paris" in answer.choices[0].text


def test_chat_renders_the_models_template(client, default_worker, default_gguf):
    reference = transformers.AutoTokenizer.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)
    text = reference.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    info = default_worker.stub.Info(pb.InfoRequest())
    special = {"bos_token": reference.bos_token or "", "eos_token": reference.eos_token or ""}
    assert chat.render(info.chat_template, QUESTION, special) == text
    answer = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=12, temperature=0)
    tokens = reference(text, add_special_tokens=False)["input_ids"]
    message = answer.choices[0].message
    assert message.role == "assistant" and "<|im_end|>" not in message.content
    assert message.content == greedy_text(default_worker, tokens, answer.usage.completion_tokens)
    assert answer.usage.prompt_tokens == len(tokens)


def test_streaming_gives_the_same_text(client):
    whole = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=16, temperature=0)
    stream = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=16, temperature=0,
                                            stream=True)
    pieces, finish = [], None
    for chunk in stream:
        choice = chunk.choices[0]
        pieces.append(choice.delta.content or "")
        finish = choice.finish_reason or finish
    assert "".join(pieces) == whole.choices[0].message.content and finish == whole.choices[0].finish_reason


def test_a_stop_string_cuts_the_text_before_it(client):
    full = client.completions.create(model="smollm2", prompt="Count: 1, 2, 3,", max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    for stream in (False, True):
        answer = client.completions.create(model="smollm2", prompt="Count: 1, 2, 3,", max_tokens=20, temperature=0,
                                           stop=[stop], stream=stream, extra_body={"ignore_eos": True})
        if stream:
            chunks = list(answer)
            text, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            text, finish = answer.choices[0].text, answer.choices[0].finish_reason
        assert text == full[:full.index(stop)] and finish == "stop"


def test_n_seeded_samples_differ_and_repeat(client):
    def sample():
        answer = client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=12,
                                           temperature=1.0, top_p=0.95, seed=7, n=2,
                                           extra_body={"ignore_eos": True})
        return [c.text for c in sorted(answer.choices, key=lambda c: c.index)]
    first = sample()
    assert first == sample() and first[0] != first[1]


def test_logprobs_are_the_chosen_tokens(client):
    answer = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=5, temperature=0,
                                            logprobs=True, top_logprobs=3)
    content = answer.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token          # greedy: the most likely
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)


@pytest.mark.parametrize("request_args, message", [
    (dict(prompt="hi", max_tokens=0), "max_tokens"),
    (dict(prompt="hi", n=0), "n"),
    (dict(prompt="hi", temperature=3.0), "temperature"),
    (dict(prompt="hi", max_tokens=100000), "passes the model's length"),
    (dict(prompt="hi", stop=[""]), "stop string is empty"),
    (dict(prompt=[5, 10 ** 7, 6], max_tokens=2), "INVALID_ARGUMENT"),      # the worker's refusal of a token id
])
def test_bad_requests_get_400_in_openais_shape(client, request_args, message):
    with pytest.raises(openai.BadRequestError, match=message):
        client.completions.create(model="smollm2", **request_args)


def test_held_back_keeps_what_could_become_a_stop():
    assert held_back("Paris is", ("is nice",)) == "Paris "
    assert held_back("Paris is nice", ("is nice",)) == "Paris "
    assert held_back("abc\ufffd", ()) == "abc"
    assert held_back("no stop here", ("zz",)) == "no stop here"


def test_32_concurrent_greedy_requests_give_what_each_gives_alone(client):
    prompts = [f"Write the number {i} in words:" for i in range(32)]

    def one(prompt):
        return client.completions.create(model="smollm2", prompt=prompt, max_tokens=6, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text
    alone = [one(p) for p in prompts]
    with ThreadPoolExecutor(32) as pool:
        together = list(pool.map(one, prompts))
    assert together == alone


def test_a_client_that_leaves_mid_stream_frees_its_blocks(client, default_worker):
    stream = client.completions.create(model="smollm2", prompt="Tell me a long story.", max_tokens=80,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()                          # the client disconnects after its first chunk
    for _ in range(200):
        if default_worker.stub.Info(pb.InfoRequest()).live_sequences == 0:
            break
        time.sleep(0.05)
    info = default_worker.stub.Info(pb.InfoRequest())
    assert info.live_sequences == 0 and info.free_kv_blocks == info.num_kv_blocks
