"""The Helm chart (helm/metrale-worker) through a real Helm, offline: helm-python-sdk binds Helm v4's Go SDK
(load, schema validation, render, lint). Rendered with the default values and each ci/*-values.yaml, linted, and
every manifest validated against the Kubernetes schemas (kubernetes-validate, strict); the worker's own parser
reads the rendered arguments; bad values are refused by values.schema.json or by the templates' checks."""

import argparse
import json
from pathlib import Path

import pytest
import yaml

helm = pytest.importorskip("helm_python")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

from metrale.service.config import SERVE_FLAGS, add_serve_flags, config_from_args  # noqa: E402

CHART = Path(__file__).resolve().parents[2] / "helm" / "metrale-worker"
VALUES_FILES = sorted((CHART / "ci").glob("*-values.yaml"))
KUBERNETES = "1.35.0"
# Kinds the Kubernetes schemas do not hold (custom resources): checked by the assertions below instead.
CUSTOM_KINDS = {"ServiceMonitor"}
# Flags the chart sets itself, from its own sections (ports, the model, the cache, TLS, tokens).
CHART_FLAGS = {"model", "host", "port", "metrics-port", "health-port", "cache-dir", "tls-cert", "tls-key",
               "tls-client-ca", "auth-tokens-file"}


@pytest.fixture(scope="module")
def chart():
    loaded = helm.Chart.load(CHART)
    yield loaded
    loaded.close()


def values_of(path: Path | None) -> dict:
    return yaml.safe_load(path.read_text()) if path else {}


def render(chart, values: dict) -> dict[str, list[dict]]:
    """template path -> its manifests (NOTES.txt as text under 'NOTES')."""
    out = {}
    for path, text in chart.render(values, name="mw", namespace="serving").items():
        if path.endswith("NOTES.txt"):
            out["NOTES"] = text
        else:
            out[path.rsplit("/", 1)[-1]] = [doc for doc in yaml.safe_load_all(text) if doc]
    return out


def manifests(rendered: dict) -> list[dict]:
    return [doc for key, docs in rendered.items() if key != "NOTES" for doc in docs]


def container(rendered: dict) -> dict:
    (deployment,) = rendered["deployment.yaml"]
    (worker,) = deployment["spec"]["template"]["spec"]["containers"]
    return worker


def parsed_args(rendered: dict):
    args = container(rendered)["args"]
    assert args[0] == "serve"
    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    return config_from_args(parser.parse_args(args[1:]), environ={})


@pytest.mark.parametrize("values_file", [None, *VALUES_FILES], ids=lambda p: p.name if p else "defaults")
def test_renders_lints_and_validates(chart, values_file):
    values = values_of(values_file)
    chart.validate_schema(values)
    rendered = render(chart, values)
    report = helm.lint(CHART, values, strict=True)
    assert not report["errors"] and not [m for m in report["messages"] if m["severity"] >= 2], report
    for doc in manifests(rendered):
        if doc["kind"] in CUSTOM_KINDS:
            continue
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
    config = parsed_args(rendered)                       # the worker's own parser reads every rendered flag
    assert config.port == 50051 and config.health_port == 50052 and config.cache_dir == "/cache"
    worker = container(rendered)
    assert worker["securityContext"]["readOnlyRootFilesystem"] is True
    assert worker["securityContext"]["capabilities"]["drop"] == ["ALL"]
    pod = rendered["deployment.yaml"][0]["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["terminationGracePeriodSeconds"] > config.drain_timeout
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert worker[probe]["grpc"]["port"] == config.health_port        # plaintext health port
    assert all(worker[p]["grpc"]["service"] == "metrale.v1.Worker"
               for p in ("startupProbe", "readinessProbe", "livenessProbe"))
    mounts = {m["name"]: m["mountPath"] for m in worker["volumeMounts"]}
    assert mounts["kernel-cache"] == "/cache" and "emptyDir" in next(
        v for v in pod["volumes"] if v["name"] == "kernel-cache")
    assert "grpcurl" in rendered["NOTES"]


def test_defaults_ask_for_one_gpu_and_serve_the_default_model(chart):
    rendered = render(chart, {})
    worker = container(rendered)
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    config = parsed_args(rendered)
    assert config.model is None and config.engine.device == "cuda" and config.tls_cert is None
    assert {p["name"] for p in rendered["service.yaml"][0]["spec"]["ports"]} == {"grpc", "metrics"}
    assert rendered["servicemonitor.yaml"] == [] and rendered["pdb.yaml"] == []
    assert "-plaintext" in rendered["NOTES"]


def test_tls_values_mount_the_secrets_and_turn_on_mutual_tls_and_tokens(chart):
    rendered = render(chart, values_of(CHART / "ci" / "tls-values.yaml"))
    config = parsed_args(rendered)
    assert (config.tls_cert, config.tls_key, config.tls_client_ca) == (
        "/etc/metrale/tls/tls.crt", "/etc/metrale/tls/tls.key", "/etc/metrale/tls/ca.crt")
    assert config.auth_tokens_file == "/etc/metrale/auth/tokens" and config.reflection is False
    assert config.model == "/models/nllb-200-distilled-600M"
    volumes = {v["name"]: v for v in rendered["deployment.yaml"][0]["spec"]["template"]["spec"]["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "metrale-worker-tls"
    assert volumes["auth"]["secret"]["secretName"] == "metrale-worker-tokens"
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    assert "-cacert ca.crt" in rendered["NOTES"] and "authorization: Bearer" in rendered["NOTES"]


def test_servicemonitor_values_scrape_metrics_and_place_pods_on_gpu_nodes(chart):
    rendered = render(chart, values_of(CHART / "ci" / "servicemonitor-values.yaml"))
    (monitor,) = rendered["servicemonitor.yaml"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "15s"}]
    assert monitor["spec"]["selector"]["matchLabels"] == rendered["service.yaml"][0]["spec"]["selector"]
    (budget,) = rendered["pdb.yaml"]
    assert budget["spec"]["maxUnavailable"] == 1
    pod = rendered["deployment.yaml"][0]["spec"]["template"]["spec"]
    assert pod["runtimeClassName"] == "nvidia" and pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    config = parsed_args(rendered)
    engine = config.engine
    assert (engine.kv_memory_fraction, engine.max_batch_tokens, engine.max_seqs, engine.num_streams) == (
        0.9, 16384, 256, 2)
    assert engine.cuda_graph_batch_sizes == (1, 2, 4, 8, 16, 32, 64) and engine.run_ahead == "on"
    assert config.max_message_mb == 128 and config.drain_timeout == 45 and config.metrics_port == 9400


def test_cpu_dev_values_ask_for_no_gpu(chart):
    rendered = render(chart, values_of(CHART / "ci" / "cpu-dev-values.yaml"))
    assert "nvidia.com/gpu" not in container(rendered)["resources"]["limits"]
    config = parsed_args(rendered)
    assert config.engine.device == "cpu" and config.engine.kv_blocks == 256
    assert config.engine.cuda_graph_batch_sizes == () and config.metrics_port is None


def test_every_worker_flag_is_reachable_from_values(chart):
    schema = json.loads((CHART / "values.schema.json").read_text())
    settable = set(schema["properties"]["worker"]["properties"])
    assert settable | CHART_FLAGS == {flag for flag, *_ in SERVE_FLAGS}
    assert not settable & CHART_FLAGS
    # each one set at once, whole numbers rendered without an exponent
    values = {"worker": {"device": "cpu", "dtype": "bfloat16", "kv-blocks": 1000000, "kv-memory-fraction": 0.5,
                         "kv-block-size": 32, "max-batch-tokens": 4096, "max-seqs": 64, "max-model-len": 2048,
                         "cuda-graph-batch-sizes": "1,2", "num-streams": 3, "run-ahead": "off", "prefix-cache": "off",
                         "dequantize": True, "quantize": "fp8", "kv-dtype": "fp8", "tensor-parallel": 2,
                         "max-message-mb": 8, "max-text-bytes": 4096, "drain-timeout": 2.5, "reflection": False,
                         "log-format": "console",
                         "max-concurrent-rpcs": 128, "keepalive-time": 30, "keepalive-timeout": 7.5,
                         "keepalive-min-client-ping": 5, "ssm-snapshot-memory": 2000000000, "sequence-ttl": 90}}
    assert set(values["worker"]) == settable
    rendered = render(chart, {**values, "gpu": {"count": 2}})
    assert container(rendered)["resources"]["limits"]["nvidia.com/gpu"] == 2      # a GPU a rank
    config = parsed_args(rendered)
    assert config.tensor_parallel == 2
    engine = config.engine
    assert (engine.device, engine.dtype, engine.kv_blocks, engine.kv_memory_fraction, engine.kv_block_size) == (
        "cpu", "bfloat16", 1000000, 0.5, 32)
    assert (engine.max_batch_tokens, engine.max_seqs, engine.max_model_len, engine.num_streams) == (4096, 64, 2048, 3)
    assert (engine.run_ahead, engine.prefix_cache, engine.ssm_snapshot_memory) == ("off", False, 2000000000)
    assert engine.dequantize is True and engine.quantize == "fp8" and engine.kv_dtype == "fp8"
    assert (config.max_message_mb, config.max_text_bytes, config.drain_timeout, config.reflection,
            config.log_format) == (8, 4096, 2.5, False, "console")
    assert (config.max_concurrent_rpcs, config.keepalive_time, config.keepalive_timeout,
            config.keepalive_min_client_ping, config.sequence_ttl) == (128, 30.0, 7.5, 5.0, 90.0)


def test_a_gpu_count_other_than_the_ranks_is_refused(chart):
    with pytest.raises(Exception, match="must equal worker.tensor-parallel"):
        render(chart, {"worker": {"tensor-parallel": 4}, "gpu": {"count": 2}})


def test_a_tensor_parallel_worker_gets_shared_memory_for_its_ranks_and_extra_env(chart):
    """/dev/shm in memory for NCCL's buffers between the ranks' processes (none for one rank); extraEnv reaches
    the worker's environment (and so every rank's)."""
    env = [{"name": "NCCL_DEBUG", "value": "WARN"}]
    rendered = render(chart, {"worker": {"tensor-parallel": 2}, "gpu": {"count": 2}, "extraEnv": env,
                              "sharedMemory": {"sizeLimit": "4Gi"}})
    worker = container(rendered)
    assert {"name": "shared-memory", "mountPath": "/dev/shm"} in worker["volumeMounts"]
    (deployment,) = rendered["deployment.yaml"]
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["shared-memory"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "4Gi"}
    assert worker["env"][-1] == env[0]
    one = container(render(chart, {}))
    assert all(m["mountPath"] != "/dev/shm" for m in one["volumeMounts"])


# Values files the schema must refuse, one mistake each (their first line says which).
BAD_VALUES_FILES = sorted((Path(__file__).parent / "bad-values").glob("*.yaml"))


@pytest.mark.parametrize("values_file", BAD_VALUES_FILES, ids=lambda p: p.stem)
def test_the_schema_refuses_bad_values_files(chart, values_file):
    assert len(BAD_VALUES_FILES) >= 10
    with pytest.raises(helm.HelmValuesError):
        chart.validate_schema(values_of(values_file))
    with pytest.raises(helm.HelmError):              # and an install would stop there too
        chart.render(values_of(values_file), name="mw", namespace="serving")


@pytest.mark.parametrize("values, message", [
    ({"terminationGracePeriodSeconds": 30}, "longer than worker.drain-timeout"),
    ({"model": {"source": "pvc", "path": "/models/m"}}, "model.pvc.claimName"),
    ({"model": {"source": "hostPath", "path": "/models/m"}}, "model.hostPath.path"),
])
def test_the_templates_refuse_inconsistent_values(chart, values, message):
    with pytest.raises(helm.HelmError, match=message.replace(".", r"\.")):
        chart.render(values, name="mw", namespace="serving")
