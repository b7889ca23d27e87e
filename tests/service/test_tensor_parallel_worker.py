"""`serve --tensor-parallel 2` on the CPU backend, as a gateway sees it: one endpoint whose steps run on two ranks
(processes) give the one-process worker's tokens; a rank that dies turns health NOT_SERVING (at once, with no call
under way) and fails the next step with UNAVAILABLE; SIGTERM ends every rank."""

import os
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from metrale.v1 import worker_pb2 as pb
from tiny_models import write_tiny
from worker_process import WorkerProcess

PROMPTS = {1: list(range(3, 23)), 2: list(range(40, 53))}


def greedy(stub, steps: int = 12) -> dict[int, list[int]]:
    """Both prompts prefilled in one step, then decode steps of both, each fed its last token."""
    out = stub.Prefill(pb.PrefillRequest(slices=[pb.PrefillSlice(seq_id=seq, tokens=tokens, is_last_chunk=True)
                                                 for seq, tokens in PROMPTS.items()]), timeout=60)
    chosen = {seq: [token] for seq, token in zip(out.seq_ids, out.tokens)}
    for _ in range(steps):
        out = stub.Decode(pb.DecodeRequest(seq_ids=list(chosen), tokens=[t[-1] for t in chosen.values()]),
                          timeout=60)
        for seq, token in zip(out.seq_ids, out.tokens):
            chosen[seq].append(token)
    return chosen


def rank_pids(worker: WorkerProcess) -> list[int]:
    """The worker's other ranks: its child processes named metrale-rank-N."""
    children = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                stat = open(f"/proc/{pid}/stat").read().split()
            except OSError:
                continue
            if int(stat[3]) == worker.process.pid:
                children.append(int(pid))
    return children


@pytest.fixture
def checkpoint(tmp_path):
    return write_tiny("qwen3", tmp_path / "qwen3")


def test_two_ranks_serve_the_one_process_tokens_and_stop_together(checkpoint, tmp_path):
    single = WorkerProcess(checkpoint, tmp_path / "single.log", ("--kv-blocks", "64")).start(timeout=120)
    try:
        expected = greedy(single.stub)
    finally:
        single.stop()
    worker = WorkerProcess(checkpoint, tmp_path / "tp.log", ("--kv-blocks", "64", "--tensor-parallel", "2"))
    worker.start(timeout=120)
    try:
        assert greedy(worker.stub) == expected
        followers = rank_pids(worker)
        assert followers, worker.log_tail()
    finally:
        assert worker.stop() == 0, worker.log_tail()
    deadline = time.monotonic() + 15
    while any(os.path.exists(f"/proc/{pid}") for pid in followers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(os.path.exists(f"/proc/{pid}") for pid in followers), "a rank outlived the worker"


def test_a_dead_rank_turns_the_worker_not_serving(checkpoint, tmp_path):
    worker = WorkerProcess(checkpoint, tmp_path / "tp.log", ("--kv-blocks", "64", "--tensor-parallel", "2"))
    worker.start(timeout=120)
    try:
        chosen = greedy(worker.stub, steps=1)
        for pid in rank_pids(worker):
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as caught:
            worker.stub.Decode(pb.DecodeRequest(seq_ids=list(chosen), tokens=[t[-1] for t in chosen.values()]),
                               timeout=60)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value.details()
        deadline = time.monotonic() + 10
        while worker.health_status() != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() < deadline, "health stayed SERVING"
            time.sleep(0.05)
    finally:
        worker.stop()


def test_a_rank_that_dies_while_the_worker_is_idle_turns_it_not_serving_at_once(checkpoint, tmp_path):
    worker = WorkerProcess(checkpoint, tmp_path / "tp.log", ("--kv-blocks", "64", "--tensor-parallel", "2"))
    worker.start(timeout=120)
    try:
        chosen = greedy(worker.stub, steps=1)
        assert worker.health_status() == health_pb2.HealthCheckResponse.SERVING
        for pid in rank_pids(worker):
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while worker.health_status() != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() < deadline, "health stayed SERVING with no call under way"
            time.sleep(0.05)
        with pytest.raises(grpc.RpcError) as caught:
            worker.stub.Decode(pb.DecodeRequest(seq_ids=list(chosen), tokens=[t[-1] for t in chosen.values()]),
                               timeout=60)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value.details()
        assert "ended (exit code -9)" in caught.value.details(), caught.value.details()
    finally:
        worker.stop()
