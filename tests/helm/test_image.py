"""The Dockerfile as the chart expects it (no container runtime here to build it): an NVIDIA CUDA runtime base,
the worker as entrypoint, the chart's user, a writable kernel cache, and the image name the chart defaults to."""

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
VALUES = yaml.safe_load((ROOT / "helm" / "metrale-worker" / "values.yaml").read_text())


def instructions(name: str) -> list[str]:
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    return [line.split(None, 1)[1] for line in text.splitlines() if line.startswith(name + " ")]


def test_the_base_is_an_nvidia_cuda_runtime_image():
    (base,) = [a for a in instructions("ARG") if a.startswith("CUDA_IMAGE=")]
    assert re.fullmatch(r"CUDA_IMAGE=nvidia/cuda:13\.\d+\.\d+-runtime-ubuntu\d+\.\d+", base)
    assert instructions("FROM") == ["${CUDA_IMAGE}"]


def test_it_runs_the_worker_as_the_charts_non_root_user():
    (user,) = instructions("USER")
    uid, gid = (int(part) for part in user.split(":"))
    assert uid != 0 and (uid, gid) == (VALUES["podSecurityContext"]["runAsUser"],
                                       VALUES["podSecurityContext"]["runAsGroup"])
    assert instructions("ENTRYPOINT") == ['["metrale-worker"]'] and instructions("CMD") == ['["serve"]']


def test_the_kernel_cache_is_writable_and_the_chart_points_at_the_image():
    assert any("chown 10001:10001 /cache" in run for run in instructions("RUN"))
    assert any("METRALE_CACHE_DIR=/cache" in env for env in instructions("ENV"))
    (label,) = instructions("LABEL")
    assert f'org.opencontainers.image.ref.name="{VALUES["image"]["repository"]}"' in label
    ports = instructions("EXPOSE")[0].split()
    assert ports == [str(VALUES["grpcPort"]), str(VALUES["healthPort"]), str(VALUES["metrics"]["port"])]
