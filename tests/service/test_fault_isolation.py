"""An unexpected exception in any phase of a call fails that call alone: INTERNAL, health still SERVING, no block
leaked, and every live sequence continues exactly as a replay on a worker where nothing failed. Only the device's
own errors (ops.device_errors, DeviceFault) take the worker out of rotation."""

import inspect

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from metrale.runtime.errors import DeviceFault
from metrale.runtime.step import Step
from metrale.service import convert
from metrale.v1 import worker_pb2 as pb
from service_harness import start_worker

PROMPTS = {1: [5, 17, 99, 3, 42, 200, 7, 8, 150, 33], 2: [9, 8, 7, 6, 5, 4, 3, 2, 1, 250, 11, 12, 13, 14, 15, 16, 17]}
# No return_logits: with run-ahead on, the worker then guesses each next decode step, whose undo is tested too.
OUT = pb.OutputOptions(logprobs=True, top_logprobs=5)
DECODE_STEPS = 4
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def start(directory, run_ahead: str):
    return start_worker(directory, max_model_len=512, max_batch_tokens=512, run_ahead=run_ahead)


def prefill(stub) -> list[int]:
    r = stub.Prefill(pb.PrefillRequest(slices=[pb.PrefillSlice(seq_id=i, tokens=p, is_last_chunk=True, output=OUT)
                                               for i, p in PROMPTS.items()]))
    return list(r.tokens)


def decode(stub, tokens: list[int]) -> pb.ForwardResponse:
    return stub.Decode(pb.DecodeRequest(seq_ids=list(PROMPTS), tokens=tokens))


def answers(response: pb.ForwardResponse) -> tuple:
    """What a replay must match bit for bit: the sampled tokens, their logprobs and the top logprobs."""
    top = tuple((tuple(t.token_ids), tuple(t.logprobs)) for t in response.top_logprobs)
    return tuple(response.tokens), tuple(response.logprobs), top


@pytest.fixture(scope="module")
def replay(tiny_model_dir) -> list[tuple]:
    """The live sequences' decode steps on a worker where nothing fails."""
    worker = start(tiny_model_dir, "off")
    try:
        tokens, steps = prefill(worker.stub), []
        for _ in range(DECODE_STEPS):
            response = decode(worker.stub, tokens)
            steps.append(answers(response))
            tokens = list(response.tokens)
        return steps
    finally:
        worker.stop()


def health(worker) -> int:
    stub = health_pb2_grpc.HealthStub(worker.channel)
    return stub.Check(health_pb2.HealthCheckRequest(service="metrale.v1.Worker")).status


def raising_on_call(n: int, error: Exception, call):
    """call, but raising `error` on its n-th call (1-based)."""
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise error
        return call(*args, **kwargs)
    return wrapped


def mixed_call(tokens: list[int]):
    """Decode stream 1 plus a new, chunked sequence 5: a step of two rounds, with a sequence it creates."""
    return "MixedForward", pb.MixedForwardRequest(
        decode=pb.DecodeRequest(seq_ids=[1], tokens=tokens[:1]),
        prefill=pb.PrefillRequest(slices=[pb.PrefillSlice(seq_id=5, tokens=[4] * 40, is_last_chunk=True,
                                                          chunk_size=20, output=OUT)]))


def decode_call(tokens: list[int]):
    """The live sequences' next decode step itself (with run-ahead on, the step the worker guessed)."""
    return "Decode", pb.DecodeRequest(seq_ids=list(PROMPTS), tokens=tokens)


def beam_call(_tokens):
    return "BeamGenerate", pb.BeamGenerateRequest(requests=[pb.BeamRequest(
        request_id=1, prompt_tokens=[3, 1, 4, 1, 5], num_beams=3, max_new_tokens=6)])


def inject_validation(worker, monkeypatch):
    monkeypatch.setattr(Step, "check", lambda *args: (_ for _ in ()).throw(RuntimeError("injected in validation")))


def inject_planning(worker, monkeypatch):
    # Raised by the call's first block allocation: after the step has created sequence 5, before it holds its blocks.
    # Run-ahead's reservations of guessed steps (run_ahead.py's _reserve: a guess's chained successor is reserved on
    # the stream's thread while the test goes on) pass through.
    blocks = worker.engine.cache.blocks
    original = blocks.allocate
    raising = raising_on_call(1, RuntimeError("injected in planning"), original)

    def allocate(num_blocks):
        if any(frame.filename.endswith("run_ahead.py") and frame.function == "_reserve" for frame in inspect.stack()):
            return original(num_blocks)
        return raising(num_blocks)
    monkeypatch.setattr(blocks, "allocate", allocate)


def inject_forward(worker, monkeypatch):
    # The second forward: the first round (decode token 1, chunk 1 of sequence 5) is already committed.
    model = worker.engine.model
    monkeypatch.setattr(model, "forward", raising_on_call(2, RuntimeError("injected in the forward"), model.forward))


def inject_sampling(worker, monkeypatch):
    runner = worker.engine.runner
    monkeypatch.setattr(runner, "queue_sample", raising_on_call(1, ValueError("injected in sampling"),
                                                            runner.queue_sample))


def inject_beam_search(worker, monkeypatch):
    # The prompts' forward, after the call has reserved its blocks (later steps may run wholly on the device).
    engine = worker.engine
    monkeypatch.setattr(engine.forwards, "beam_forward", raising_on_call(1, RuntimeError("injected in the beam search"),
                                                                         engine.forwards.beam_forward))


def inject_response(worker, monkeypatch):
    monkeypatch.setattr(convert, "forward_response",
                        raising_on_call(1, TypeError("injected in the response"), convert.forward_response))


PHASES = {
    "validation": (inject_validation, mixed_call),
    "planning": (inject_planning, mixed_call),
    "forward": (inject_forward, mixed_call),
    "sampling": (inject_sampling, mixed_call),
    "beam search": (inject_beam_search, beam_call),
    "response building": (inject_response, decode_call),
    "response building, mixed": (inject_response, mixed_call),
}


@pytest.mark.parametrize("run_ahead", ["off", "on"])
@pytest.mark.parametrize("phase", list(PHASES))
def test_an_exception_in_any_phase_fails_that_call_alone(tiny_model_dir, replay, monkeypatch, phase, run_ahead):
    inject, make_call = PHASES[phase]
    worker = start(tiny_model_dir, run_ahead)
    try:
        stub = worker.stub
        first = decode(stub, prefill(stub))
        assert answers(first) == replay[0]
        before = stub.Info(pb.InfoRequest())
        tokens = list(first.tokens)
        rpc, request = make_call(tokens)
        taken = worker.engine.ahead_counts.taken
        with monkeypatch.context() as patch:
            inject(worker, patch)
            with pytest.raises(grpc.RpcError) as caught:
                getattr(stub, rpc)(request)
        assert caught.value.code() == grpc.StatusCode.INTERNAL, caught.value.details()
        if run_ahead == "on" and make_call is decode_call:     # the failed call had taken the guessed step
            assert worker.engine.ahead_counts.taken == taken + 1
        assert "injected in" in caught.value.details()
        assert health(worker) == SERVING
        after = stub.Info(pb.InfoRequest())
        assert (after.free_kv_blocks, after.live_sequences) == (before.free_kv_blocks, before.live_sequences)
        for expected in replay[1:]:
            response = decode(stub, tokens)
            assert answers(response) == expected
            tokens = list(response.tokens)
        # Sequence 5, which the failed call had created, does not exist: its id is free for a new sequence.
        stub.Prefill(pb.PrefillRequest(slices=[pb.PrefillSlice(seq_id=5, tokens=[4, 4], is_last_chunk=True)]))
        stub.Release(pb.ReleaseRequest(all=True))
        assert stub.Info(pb.InfoRequest()).free_kv_blocks == after.num_kv_blocks
    finally:
        worker.stop()


class FakeDriverError(Exception):
    """Stands for a CUDA driver error (cuda.core's CUDAError) on the CPU backend."""


@pytest.mark.parametrize("error", [DeviceFault("injected kernel fault flag"), FakeDriverError("injected driver")])
def test_a_device_error_takes_the_worker_out_of_rotation_and_is_undone(tiny_model_dir, replay, monkeypatch, error):
    worker = start(tiny_model_dir, "off")
    try:
        stub = worker.stub
        tokens = prefill(stub)
        before = stub.Info(pb.InfoRequest())
        runner, model = worker.engine.runner, worker.engine.model
        monkeypatch.setattr(runner, "device_errors", (FakeDriverError,), raising=False)
        monkeypatch.setattr(model, "forward", raising_on_call(2, error, model.forward))
        with pytest.raises(grpc.RpcError) as caught:
            stub.MixedForward(mixed_call(tokens)[1])
        monkeypatch.undo()
        assert caught.value.code() == grpc.StatusCode.INTERNAL and "injected" in caught.value.details()
        assert health(worker) == NOT_SERVING
        after = stub.Info(pb.InfoRequest())
        assert (after.free_kv_blocks, after.live_sequences) == (before.free_kv_blocks, before.live_sequences)
        assert answers(decode(stub, tokens)) == replay[0]
    finally:
        worker.stop()
