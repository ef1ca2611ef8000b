"""Tensor-parallel execution: one engine core on rank 0, workers that only execute.

Rank 0 (the serving process) owns the scheduler, the adapter cache, sampling and its own
shard of the model; ranks 1.. are worker processes holding the other shards. They form one
``torch.distributed`` process group (gloo on CPU) with two communicators::

    step group   rank 0 broadcasts each model call (the step's ForwardBatch: token ids,
                 positions, slot mapping, block tables, LoRA plan); every rank runs its shard,
                 the layers' all-reduces and the logits' gather ride on the same group
    slot group   every slot-bank mutation (fill, reset, compaction) in rank 0's order, each
                 answered by every worker with its resulting layout before rank 0's returns

so a slot write has finished on all ranks before the engine can schedule a step that reads it
(rank 0's write returns only then), and the row layouts of all ranks stay equal (checked on
every mutation). Host, disk and store tiers exist once, on rank 0: it loads and verifies an
adapter, and each worker takes its cut of the whole weights (``TensorParallel.shard_lora``).
When every rank is on this host the weights travel through shared memory: rank 0 writes them
once into a private file in ``/dev/shm`` and the slot group carries only where each tensor
lies in it (``lora.tensor_parallel.SharedWeights``); ranks on other hosts receive them pickled through the
slot group. Workers never decide anything.

A worker that dies breaks the group: rank 0's next collective raises (gloo sees the closed
connection, or the group's timeout expires) and the step fails with that error; the engine
marks itself dead (``TPWorkers.failure``) and every later step fails at once.

Tensor parallelism has one part in each package it touches, each named ``tensor_parallel``::

    model/tensor_parallel/   what shards the model: the shard plan and its cuts (sharding),
                             the collectives (shared memory or gloo), the fully sharded
                             LoRA binding
    lora/tensor_parallel.py  what mirrors the slot bank: rank 0's MirroredSlotBank, the
                             shared-memory file a slot write's weights travel in, the
                             worker's side of each mutation
    engine/tensor_parallel/  what runs the ranks (this package): the process group and the
                             start-up agreement (group), rank 0's side (driver: TPWorkers,
                             DriverModel, WorkerProcess), a worker process and a headless
                             node (worker: ``python -m loraplex.engine.tensor_parallel.worker``)

The flags (``--tensor-parallel-size``, ``--fully-sharded-loras``, the multi-node ones) and
``Rendezvous`` are configuration (``loraplex.config``); ``engine.builder`` starts the workers
and builds rank 0's parts with them.
"""
