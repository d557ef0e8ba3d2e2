"""The multi-process test harness (``tests/_dist.py``): a world whose rendezvous port was taken between picking it and
rank 0 binding it starts again on another port."""
from __future__ import annotations

import socket

import _dist


def _size_and_rank(rank: int, world: int) -> int:
    import torch.distributed as dist

    return dist.get_world_size() * 10 + rank


def test_taken_rendezvous_port_starts_the_world_again(monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        ports = iter([taken])
        real = _dist.free_port
        picked = []

        def pick():
            port = next(ports, None) or real()
            picked.append(port)
            return port

        monkeypatch.setattr(_dist, "free_port", pick)
        assert _dist.run_world(2, _size_and_rank, timeout=120.0) == [20, 21]
    assert picked[0] == taken and len(picked) == 2 and picked[1] != taken
