"""The engine: sequences, the cache, step planning, sampling, models and backends. Knows nothing of gRPC."""
