"""Builds a ready engine from a checkpoint: backend, model, cache, and what Info reports."""

from dataclasses import dataclass
from pathlib import Path

from metrale.runtime.backend import create_backend
from metrale.runtime.backend.layer_math import LM_HEAD_PADDING_ROWS
from metrale.runtime.backend.runner import MemoryShapes, Runner
from metrale.runtime.cache.manager import CacheManager, blocks_that_fit, snapshots_for, state_slots_for
from metrale.runtime.cache.specs import PAGED, slot_bytes, with_kv_dtype
from metrale.runtime.default_model import default_cache_dir
from metrale.runtime.config import EngineConfig
from metrale.runtime.engine import Engine
from metrale.runtime.errors import InvalidArgument
from metrale.runtime.cache.blocks import blocks_for
from metrale.runtime.loading import Checkpoint, fp8
from metrale.runtime.models import Family, family_of
from metrale.runtime.parallel.leader import LeaderRunner
from metrale.runtime.parallel.sharding import ShardedTensors

VERSION = "0.1.0"


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    architecture: str
    dtype: str
    device: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    pad_token_id: int | None
    # Why there is no tokenizer, where there is none.
    tokenizer_note: str = ""
    # The tokenizer's chat template ("": none).
    chat_template: str = ""
    # The architecture's hyper-connection streams (0 = none), multi-head latent attention, SSM layers.
    hc_mult: int = 0
    is_mla: bool = False
    has_ssm: bool = False
    # Whether prompts reuse cached blocks (--prefix-cache, where the model allows it).
    prefix_cache: bool = False
    # The attention K/V cache's element type: dtype's, or "float8_e4m3fn" (--kv-dtype fp8).
    kv_dtype: str = ""


def build_engine(checkpoint: Checkpoint, config: EngineConfig, cache_dir: Path | None = None, group=None
                 ) -> tuple[Engine, ModelInfo]:
    """cache_dir: where compiled kernels are kept (default ~/.cache/metrale); group: the ranks of a tensor-parallel
    worker (parallel/group.py), this one rank 0, whose runner hands the others its calls (parallel/leader.py); None:
    one device."""
    model_config, max_model_len, runner, model = _load(checkpoint, config, cache_dir, group)
    if group is not None:
        runner = LeaderRunner(runner, group)
    specs = with_kv_dtype(model.cache_specs(), config.kv_dtype)
    cache = _allocate_cache(runner, specs, config, max_model_len,
                            # an encoder-decoder's prompts are its sources, whose cross K/V no token prefix names
                            config.prefix_cache and not getattr(model_config, "is_encoder_decoder", False))
    engine = Engine(model, runner, cache, config, max_model_len)
    runner.warm_up(engine.forwards.forward, config.cuda_graph_batch_sizes, max_model_len, engine.limits.max_source_len)
    tokenizer = checkpoint.tokenizer
    eos = model_config.eos_token_ids or tuple(getattr(tokenizer, "eos_token_ids", ()) or ())
    dtype = str(runner.dtype).removeprefix("torch.")
    info = ModelInfo(model_id=checkpoint.source, architecture=model_config.architecture, dtype=dtype,
                     device=runner.device,
                     vocab_size=model_config.vocab_size, max_model_len=max_model_len, eos_token_ids=eos,
                     bos_token_id=model_config.bos_token_id, pad_token_id=model_config.pad_token_id,
                     tokenizer_note=checkpoint.metadata.get("tokenizer_unsupported", "the checkpoint has none"),
                     chat_template=getattr(checkpoint.tokenizer, "chat_template", None) or "",
                     hc_mult=model_config.hc_mult, is_mla=model_config.is_mla, has_ssm=model_config.has_ssm,
                     prefix_cache=cache.prefix_cache,
                     # with_kv_dtype made every K/V layer FP8 or refused the model
                     kv_dtype="float8_e4m3fn" if config.kv_dtype == "fp8" else dtype)
    return engine, info


def build_follower(checkpoint: Checkpoint, config: EngineConfig, group, cache_dir: Path | None = None):
    """A tensor-parallel worker's other rank: its shard of the model, its runner and its cache's specs, for
    parallel/follower.py's follow(group, model, runner, specs)."""
    _, _, runner, model = _load(checkpoint, config, cache_dir, group)
    return model, runner, with_kv_dtype(model.cache_specs(), config.kv_dtype)


def _load(checkpoint: Checkpoint, config: EngineConfig, cache_dir: Path | None, group):
    """The model's config, max_model_len, and the runner and model (this rank's shard) of a new backend."""
    family = family_of(checkpoint.config)
    model_config = family.config_from_hf(checkpoint.config)
    max_model_len = config.max_model_len or model_config.max_position_embeddings
    if max_model_len > model_config.max_position_embeddings:
        raise InvalidArgument(f"max_model_len={max_model_len} is over the model's max_position_embeddings="
                              f"{model_config.max_position_embeddings}")
    if config.kv_dtype == "fp8" and getattr(model_config, "is_encoder_decoder", False):
        raise InvalidArgument(f"--kv-dtype fp8 does not run {model_config.architecture}: its encoder's attention "
                              f"works in the decoder's cache blocks, which would round it too")
    local_config, tensors = _shard(family, model_config, checkpoint, group)
    backend = create_backend(config.device, config.dtype, cache_dir or default_cache_dir(), config.programmatic_launch,
                             config.dequantize, group)
    if config.kv_dtype not in backend.runner.kv_dtypes:
        raise InvalidArgument(f"--kv-dtype {config.kv_dtype} does not run on the {backend.runner.device} backend "
                              f"(it runs {', '.join(backend.runner.kv_dtypes)})")
    backend.runner.plan(_weight_bytes(tensors, getattr(tensors, "numel", checkpoint.numel), local_config, max_model_len,
                                      family.model_class, group.shard.size if group else None),
                        _memory_shapes(local_config, config, max_model_len,
                                       fp8.widest_fp8_input(tensors, config.quantize == "fp8")))
    tensors = fp8.QuantizedTensors(tensors) if config.quantize == "fp8" else tensors
    return model_config, max_model_len, backend.runner, family.model_class(local_config, tensors, backend.math,
                                                                          max_model_len)


def _shard(family: Family, model_config, checkpoint: Checkpoint, group):
    """The rank's config and checkpoint tensors (the whole model's on one device)."""
    if group is None:
        return model_config, checkpoint.tensors
    if family.tensor_parallel is None:
        raise InvalidArgument(f"tensor parallel does not run {model_config.architecture} yet (one device does)")
    local_config, splits = family.tensor_parallel(model_config, group.shard)
    return local_config, ShardedTensors(checkpoint.tensors, splits, group.shard)


def _weight_bytes(names, numel, c, max_model_len: int, model_class: type, ranks: int | None = None) -> int:
    """An upper bound: every checkpoint tensor (names, each of numel(name) elements: this rank's part) in bf16, rope
    tables in float32, each 256-byte aligned, and what the model uploads beside its checkpoint's tensors
    (model_class.extra_weight_bytes, where it has one, and the LM head's padding rows; in a group of ranks (None:
    none), even of one, a tied table's part of the vocabulary beside the whole table)."""
    tensors = sum(2 * numel(name) + 256 for name in names)
    extra = getattr(model_class, "extra_weight_bytes", lambda config: 0)(c) + 2 * LM_HEAD_PADDING_ROWS * c.hidden_size
    if ranks is not None:
        extra += 2 * (-(-c.vocab_size // ranks) + LM_HEAD_PADDING_ROWS) * c.hidden_size + 256
    return tensors + 2 * (4 * max_model_len * c.head_dim // 2 + 256) + extra


def _memory_shapes(c, config: EngineConfig, max_model_len: int, fp8_width: int = 0) -> MemoryShapes:
    """fp8_width: the widest input of a linear whose weight may be FP8 (0: none is)."""
    return MemoryShapes(
        hidden=c.hidden_size, q_size=c.num_heads * c.head_dim, kv_size=c.num_kv_heads * c.head_dim,
        intermediate=c.intermediate_size, vocab=c.vocab_size, max_batch_tokens=config.max_batch_tokens,
        max_seqs=config.max_seqs, max_blocks_per_seq=blocks_for(max_model_len, config.kv_block_size),
        head_dim=c.head_dim, kv_block_size=config.kv_block_size, streams=config.num_streams,
        ssm_width=c.mixer.activation_width if getattr(c, "mixer", None) else 0,
        ssm_chunk_size=c.mixer.chunk_size if getattr(c, "mixer", None) else 0,
        moe_width=c.moe.activation_width(c.hidden_size) if getattr(c, "moe", None) else 0,
        fp8_width=fp8_width, **_latent_shapes(c))


def _latent_shapes(c) -> dict:
    """MemoryShapes' latent fields of a multi-head latent attention model (none for the others): the latent-space
    query and output a token and layer, the latent and its norm, the query's low-rank projection; and its
    hyper-connection streams and sparse attention indexer, where it has them."""
    if not getattr(c, "kv_lora_rank", 0):
        return {}
    width = c.kv_lora_rank + c.qk_rope_head_dim
    shapes = dict(latent_heads=c.num_heads, latent_rank=c.kv_lora_rank, latent_rope=c.qk_rope_head_dim,
                  latent_nope=c.qk_nope_head_dim, latent_v=c.v_head_dim,
                  latent_width=c.num_heads * (width + c.kv_lora_rank + c.v_head_dim) + 2 * width + c.q_lora_rank)
    if getattr(c, "hyper", None):
        shapes["hc_mult"] = c.hyper.hc_mult
    if getattr(c, "indexer", None):
        shapes.update(index_heads=c.indexer.num_heads, index_dim=c.indexer.head_dim, index_topk=c.indexer.topk)
    return shapes


def _allocate_cache(runner: Runner, specs: tuple, config: EngineConfig, max_model_len: int,
                    prefix_cache: bool) -> CacheManager:
    """The cache the model's specs describe: config.kv_blocks blocks, or as many as the share of the memory left
    (kv_memory_fraction, else the runner's default) holds beside the recurrent layers' state slots (and, with the
    prefix cache, their snapshots). The slots take at most that share (half of it where the model also has paged
    layers): fewer than 2 x max_seqs + snapshots where those would not fit, and a step that then finds none free
    is refused (OutOfStateSlots)."""
    snapshots = snapshots_for(specs, config.ssm_snapshot_memory, config.max_seqs) if prefix_cache else 0
    fraction = config.kv_memory_fraction or runner.default_kv_memory_fraction
    runs_ahead = config.run_ahead == "on" or (config.run_ahead == "auto" and runner.runs_ahead_by_default)
    slots = state_slots_for(specs, config.max_seqs, snapshots, runs_ahead)
    available = runner.available_cache_bytes(fraction) if slots or not config.kv_blocks else 0
    if slots:
        paged = any(isinstance(spec, PAGED) for spec in specs)
        slots = min(slots, max(2, (available // 2 if paged else available) // slot_bytes(specs)))
    num_blocks = config.kv_blocks or blocks_that_fit(specs, config.kv_block_size, runner.dtype.itemsize, available,
                                                     slots, max_model_len)
    layers = runner.allocate_cache(specs, num_blocks, config.kv_block_size, slots)
    return CacheManager(specs, layers, config.kv_block_size, num_blocks, slots, prefix_cache, snapshots)
