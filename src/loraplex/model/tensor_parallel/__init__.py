"""Tensor parallelism, the model's part: what shards the model over the ranks.

    sharding       which heads, columns and vocabulary rows each rank holds (``ShardLayout``),
                   the rank's cut of every weight and LoRA module and its collectives
                   (``TensorParallel``), the vocab-parallel embedding (``VocabShard``)
    collectives    all-reduce, gather and broadcast: through shared memory when every rank is
                   on one host, else through the process group (gloo)
    lora_binding   LoRA with A and B both cut (``--fully-sharded-loras``)

The slot bank's mirroring is ``lora.tensor_parallel``; the ranks' processes and their group
are ``engine.tensor_parallel``.
"""
