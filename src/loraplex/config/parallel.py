"""Where the tensor-parallel ranks meet: the rendezvous value an engine config derives
(``EngineConfig.rendezvous``) and the tensor-parallel processes read."""

from __future__ import annotations

import socket
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet (torch.distributed's TCP store) and which ranks this node runs."""

    size: int
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: a free port, picked by rank 0 (one node only)
    first_rank: int = 0  # this node's first rank (0 on the node that serves)
    local_ranks: int = 0  # ranks on this node (0: all of ``size``)

    @property
    def ranks_here(self) -> int:
        """How many ranks this node runs."""
        return self.local_ranks or self.size

    @property
    def init_method(self) -> str:
        return f"tcp://{self.master_addr}:{self.master_port}"

    def with_port(self) -> Rendezvous:
        """A copy with a concrete port (a free one on loopback when none was given)."""
        if self.master_port:
            return self
        with socket.socket() as s:
            s.bind((self.master_addr, 0))
            return replace(self, master_port=s.getsockname()[1])
