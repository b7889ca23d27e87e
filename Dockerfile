# The worker's image: the NVIDIA CUDA runtime (libcublasLt, which nvmath-python loads; the driver comes from the
# node), Python, and the worker; it runs as a non-root user, and the kernel cache is the one writable path it
# needs besides /tmp (the Helm chart mounts emptyDirs on both and keeps the root filesystem read-only).
# Build: docker build -t ghcr.io/metrale/metrale-worker:0.1.0 .
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

LABEL org.opencontainers.image.title="metrale-worker" \
      org.opencontainers.image.source="https://github.com/metrale/metrale-worker" \
      org.opencontainers.image.ref.name="ghcr.io/metrale/metrale-worker"

ENV DEBIAN_FRONTEND=noninteractive PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/metrale
ENV PATH=/opt/metrale/bin:$PATH

# torch only hands checkpoint tensors over at load time: its CPU build is enough (the GPU path is cuda-python,
# NVRTC and cuBLASLt), and it keeps a CUDA build of torch out of the image.
RUN pip install torch --index-url https://download.pytorch.org/whl/cpu
# NCCL's library for tensor parallel's collectives (nccl4py loads it; the CPU build of torch does not bring it).
RUN pip install nvidia-nccl-cu13
COPY pyproject.toml README.md /src/
COPY protos /src/protos
COPY metrale /src/metrale
RUN pip install /src && rm -rf /src

RUN groupadd --gid 10001 metrale \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin metrale \
    && mkdir -p /cache && chown 10001:10001 /cache
ENV METRALE_CACHE_DIR=/cache HOME=/tmp
USER 10001:10001

EXPOSE 50051 50052 9400
ENTRYPOINT ["metrale-worker"]
CMD ["serve"]
