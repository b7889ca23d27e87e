"""A reference gateway for metrale-worker: continuous batching over one or more workers' Steps channels."""
