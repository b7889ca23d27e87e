"""The engine: sequences, paged KV, step planning, sampling and models. Knows nothing of gRPC."""
