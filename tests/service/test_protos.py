"""The committed stubs are exactly what scripts/gen_protos.py generates from protos/ now."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_stubs_match_the_proto(tmp_path):
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    gen_protos = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_protos)
    generated = gen_protos.generate(tmp_path)
    assert {p.name for p in generated} == {"worker_pb2.py", "worker_pb2.pyi", "worker_pb2_grpc.py"}
    for path in generated:
        committed = ROOT / path.relative_to(tmp_path)
        assert committed.read_text() == path.read_text(), f"{committed} is stale: run python scripts/gen_protos.py"


def test_service_has_every_rpc_of_the_contract():
    from metrale.v1 import worker_pb2

    service = worker_pb2.DESCRIPTOR.services_by_name["Worker"]
    assert service.full_name == "metrale.v1.Worker"
    assert {m.name for m in service.methods} == {
        "Info", "Prefill", "Decode", "MixedForward", "BeamGenerate", "Release", "PrefillTailSplit",
        "NormalizeSsmStates", "Tokenize", "Detokenize", "Generate", "MatchPrefix", "Fork", "Steps"}
    info_fields = set(worker_pb2.InfoResponse.DESCRIPTOR.fields_by_name)
    assert {"model_id", "architecture", "dtype", "device", "vocab_size", "max_model_len", "kv_block_size",
            "num_kv_blocks", "free_kv_blocks", "is_mla", "hc_mult", "supports_beam", "is_encoder_decoder",
            "has_ssm", "eos_token_ids", "bos_token_id", "pad_token_id", "num_streams", "max_batch_tokens",
            "version", "single_chunk_prefill"} <= info_fields
