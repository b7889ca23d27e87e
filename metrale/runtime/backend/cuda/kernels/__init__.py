"""Python launchers, one module per kernel family of metrale/cuda_kernels/."""

from metrale.runtime.backend.cuda.kernels import (activation, attention, beam, beam_step, embedding, fp8, hyper,
                                                  latent_attention, moe, norm, rope_kv, sampling, skinny_gemm,
                                                  sparse_index, ssm)

__all__ = ["activation", "attention", "beam", "beam_step", "embedding", "fp8", "hyper", "latent_attention", "moe",
           "norm", "rope_kv", "sampling", "skinny_gemm", "sparse_index", "ssm"]
