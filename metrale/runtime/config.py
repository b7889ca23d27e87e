"""The engine's typed configuration, checked on creation."""

from dataclasses import dataclass

from metrale.runtime.cache.specs import KV_DTYPES
from metrale.runtime.errors import InvalidArgument

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
RUN_AHEAD = ("auto", "on", "off")
QUANTIZE = ("none", "fp8")


@dataclass(frozen=True)
class EngineConfig:
    device: str = "auto"
    dtype: str = "auto"
    kv_block_size: int = 16
    # The KV pool: kv_blocks when set, else kv_memory_fraction of the memory left after the weights and workspaces;
    # None: the backend's default (its default_kv_memory_fraction).
    kv_blocks: int | None = None
    kv_memory_fraction: float | None = None
    max_batch_tokens: int = 8192
    # Most sequences one forward samples (decode tokens plus finishing prompts).
    max_seqs: int = 512
    num_streams: int = 1
    # None: the model's own max_position_embeddings.
    max_model_len: int | None = None
    # Decode batch sizes captured as CUDA graphs at start (a decode step is padded to the next one); () = off.
    cuda_graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    # Run each stream's guessed next decode step while the gateway reads the last (run_ahead.py); auto: on cuda.
    run_ahead: str = "auto"
    # CUDA on Hopper: kernels launched with programmatic dependent launch (docs/cuda_backend.md); off for A/B timing.
    programmatic_launch: bool = True
    # Full blocks of committed tokens are kept and reused by later prompts that start with the same tokens
    # (cache/prefix.py).
    prefix_cache: bool = True
    # Models with recurrent layers and the prefix cache: bytes of state snapshots kept at block boundaries
    # (cache/states.py); None: as many snapshots as max_seqs.
    ssm_snapshot_memory: int | None = None
    # GGUF's Q4_0 / Q4_1 / Q8_0 weights dequantized at load to dtype; else the CPU backend multiplies their blocks
    # as they are (backend/cpu/quantized.py). The CUDA backend dequantizes them either way.
    dequantize: bool = False
    # "fp8": every linear weight of a bf16/fp16/fp32 checkpoint or a GGUF file's blocks quantized at load to e4m3
    # with one scale a row (loading/fp8.py); "none": as the checkpoint holds them.
    quantize: str = "none"
    # "fp8": attention K and V cached in e4m3 with a scale per KV head (the checkpoint's k_scale / v_scale, else 1),
    # half a bf16 cache's bytes (cache/specs.py's PagedKvFp8); "auto": in the model's dtype.
    kv_dtype: str = "auto"

    def __post_init__(self):
        if self.device not in DEVICES:
            raise InvalidArgument(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.run_ahead not in RUN_AHEAD:
            raise InvalidArgument(f"run_ahead must be one of {RUN_AHEAD}, got {self.run_ahead!r}")
        if self.quantize not in QUANTIZE:
            raise InvalidArgument(f"quantize must be one of {QUANTIZE}, got {self.quantize!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise InvalidArgument(f"kv_dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}")
        if self.dtype not in DTYPES:
            raise InvalidArgument(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_block_size < 1 or self.kv_block_size & (self.kv_block_size - 1):
            raise InvalidArgument(f"kv_block_size must be a power of two, got {self.kv_block_size}")
        if self.kv_blocks is not None and self.kv_blocks < 1:
            raise InvalidArgument(f"kv_blocks must be >= 1, got {self.kv_blocks}")
        if self.kv_memory_fraction is not None and not 0.0 < self.kv_memory_fraction <= 1.0:
            raise InvalidArgument(f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")
        if self.max_batch_tokens < 1:
            raise InvalidArgument(f"max_batch_tokens must be >= 1, got {self.max_batch_tokens}")
        if self.ssm_snapshot_memory is not None and self.ssm_snapshot_memory < 0:
            raise InvalidArgument(f"ssm_snapshot_memory must be >= 0 bytes, got {self.ssm_snapshot_memory}")
        if self.max_seqs < 1:
            raise InvalidArgument(f"max_seqs must be >= 1, got {self.max_seqs}")
        if not 1 <= self.num_streams <= 64:
            raise InvalidArgument(f"num_streams must be in [1, 64], got {self.num_streams}")
        if any(size < 1 for size in self.cuda_graph_batch_sizes):
            raise InvalidArgument(f"cuda_graph_batch_sizes must be >= 1, got {self.cuda_graph_batch_sizes}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise InvalidArgument(f"max_model_len must be >= 1, got {self.max_model_len}")
