"""Tensor-parallel execution: the process group, rank 0's side (``driver``) and a worker
process (``worker``)."""
