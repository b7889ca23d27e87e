"""The gRPC side: CLI, config, servicer, status mapping, health, reflection. Speaks gRPC and nothing else."""
