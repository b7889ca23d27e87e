"""Tensor parallel: one worker's model over several devices. Each rank holds a shard of every layer's heads and MLP
columns (sharding.py) and its backend's layer math sums partial results and gathers the vocabulary over the ranks'
group (group.py)."""
