"""The shared-memory collectives against gloo's, in two real processes: the same all-reduce
bits on both ranks, the gather and broadcast, and the process-group fallback for what does not
fit a slot (tiny slots here, so each collective takes both paths)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from loraplex.testing.server import free_port
from loraplex.testing.sync import EVENT_TIMEOUT_S

_RANK = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    from loraplex.model.tensor_parallel.collectives import GlooCollectives, ShmCollectives
    rank, port, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    if rank == 0:
        ShmCollectives.create_at(path, 2, 256)
    dist.barrier()
    shm = ShmCollectives(path, rank, 2, 256, dist.group.WORLD, lambda: True, 60.0)
    ref = GlooCollectives(dist.group.WORLD, rank, 2)
    g = torch.Generator().manual_seed(rank)
    for shape in ((4, 8), (64, 8), (3, 1)):  # 64 x 8 float32 is over the 256-byte slot
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(shape, generator=g).to(dtype)
            a, b = shm.all_reduce(x.clone()), ref.all_reduce(x.clone())
            assert torch.equal(a, b), (shape, dtype)  # two addends: one rounding, same bits
            got = shm.gather(x)
            want = ref.gather(x)
            assert (got is None) == (rank != 0)
            if rank == 0:
                assert all(torch.equal(u, v) for u, v in zip(got, want))
    for msg in ({"op": "forward", "ids": list(range(10))}, {"big": list(range(500))}):
        assert shm.broadcast(msg if rank == 0 else None) == msg
    print("ok", rank, flush=True)
    # as TPWorkers.close does: no reference to the group left when it is destroyed (a group
    # object alive into the interpreter's teardown may abort the process there: "terminate
    # called without an active exception")
    shm.release()
    ref.release()
    dist.barrier()
    dist.destroy_process_group()
    """
)


def test_shared_memory_collectives_match_gloo(tmp_path) -> None:  # type: ignore[no-untyped-def]
    port, path = str(free_port()), str(tmp_path / "tp.shm")
    procs = [
        subprocess.Popen([sys.executable, "-c", _RANK, str(r), port, path],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in (0, 1)
    ]  # fmt: skip
    outs = [p.communicate(timeout=EVENT_TIMEOUT_S)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert all(f"ok {r}" in out for r, out in enumerate(outs)), outs
