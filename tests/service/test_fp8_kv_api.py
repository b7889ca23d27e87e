"""A CPU worker with --kv-dtype fp8 through gRPC: Info says so and counts the blocks its memory holds; prompts
and decode steps run, chunked or whole alike (the CUDA backend's refusal: tests/runtime/test_fp8_kv_cache.py)."""

from metrale.runtime.config import EngineConfig
from metrale.runtime.loading import load_checkpoint
from metrale.service.config import WorkerConfig
from metrale.v1 import worker_pb2 as pb
from service_harness import serve_checkpoint

PROMPT = list(range(5, 30))


def test_a_worker_with_an_fp8_kv_cache(tiny_model_dir):
    config = WorkerConfig(host="127.0.0.1", port=0, drain_timeout=5.0,
                          engine=EngineConfig(device="cpu", kv_blocks=32, kv_dtype="fp8"))
    worker = serve_checkpoint(load_checkpoint(tiny_model_dir), config)
    try:
        stub = worker.stub
        info = stub.Info(pb.InfoRequest())
        assert info.kv_dtype == "float8_e4m3fn" and info.dtype == "float32" and info.num_kv_blocks == 32
        whole = stub.Prefill(pb.PrefillRequest(slices=[pb.PrefillSlice(seq_id=1, tokens=PROMPT, is_last_chunk=True)]))
        chunked = stub.Prefill(pb.PrefillRequest(slices=[pb.PrefillSlice(seq_id=2, tokens=PROMPT, is_last_chunk=True,
                                                                         chunk_size=7)]))
        assert chunked.tokens[0] == whole.tokens[0]
        steps = stub.Decode(pb.DecodeRequest(seq_ids=[1, 2], tokens=[whole.tokens[0]] * 2))
        assert steps.tokens[0] == steps.tokens[1]
        stub.Release(pb.ReleaseRequest(seq_ids=[1, 2]))
        assert stub.Info(pb.InfoRequest()).free_kv_blocks == 32
    finally:
        worker.stop()

