"""Inputs, row bookkeeping and a fault scenario shared by the tests that run the nvshmem backend's multi-rank paths
on CPU (``test_put_path_ranks``: threads; ``test_peer_paths_ranks``: processes) and its one-rank loopback tests."""
import time

import torch


def rank_inputs(W: int, T, E: int, k: int, H: int, seed: int, hot=None):
    """Every rank's ``(x, topk_idx, topk_weights)`` for ``T[r]`` tokens: bf16 ``[T, H]``, distinct experts per token
    (``hot``: among the first ``hot`` experts only, ``hot >= k``) with about 15 % of the slots dropped (-1), fp32
    weights in ``[0, 1)``. Returns three lists, by rank."""
    g = torch.Generator().manual_seed(seed)
    xs, idxs, ws = [], [], []
    for r in range(W):
        t = T[r]
        x = (torch.randn(t, H, generator=g) * 3).to(torch.bfloat16)
        idx = (torch.argsort(torch.rand(t, hot or E, generator=g), dim=1)[:, :k] if t
               else torch.zeros(0, k, dtype=torch.int64))
        if t:
            idx[torch.rand(t, k, generator=g) < 0.15] = -1
        xs.append(x)
        idxs.append(idx)
        ws.append(torch.rand(t, k, generator=g))
    return xs, idxs, ws


def real_rows(want) -> torch.Tensor:
    """The real rows of an oracle dispatch result (the first ``counts[e]`` rows of each group), int64."""
    offs, counts = want.offs.tolist(), want.counts.tolist()
    rows, start = [], 0
    for end, c in zip(offs, counts):
        rows += range(start, start + c)
        start = end
    return torch.tensor(rows, dtype=torch.int64)


def in_group_tile_rows(offs: torch.Tensor) -> int:
    """Rows of a grouped-along-M blocked scale matrix that belong to its groups (each padded to 128 rows)."""
    starts = torch.cat([offs.new_zeros(1), offs[:-1]])
    return int(((offs - starts + 127) // 128 * 128).sum())


def refusal_clean_absent(be, rank: int, xs, idxs, ws, want, timeout_s: float) -> list:
    """Three dispatches of rank ``rank`` on backend ``be`` (bf16 precision): (a) rank 1's ids hold an expert id out of
    range; (b) a clean dispatch and a combine; (c) rank 1 stays away (it returns before). ``want``: this rank's
    oracle dispatch of the clean inputs. Returns what each raised or checked: (a) ``("ValueError", detailed?)`` or
    ``("PeerTimeout", peer, "refused" named?)``; (b) whether the rows equal the oracle's and combine's shape is
    right; (c) ``("PeerTimeout", peer, within 4 timeouts?)``."""
    from mxcomm.transport.errors import PeerTimeout

    H = xs[rank].shape[1]
    bad = idxs[1].clone()
    bad[0, 0] = be.config.num_experts
    got = []
    try:
        be.dispatch(xs[rank], bad if rank == 1 else idxs[rank], ws[rank])
        got.append("returned")
    except ValueError as e:
        got.append(("ValueError", "expert id" in str(e)))
    except PeerTimeout as e:
        got.append(("PeerTimeout", e.peer, "refused" in str(e)))
    d, h = be.dispatch(xs[rank], idxs[rank], ws[rank])  # (b): the group is still usable
    n = int(want.offs[-1])
    y = be.combine(torch.ones(d.num_rows, H, dtype=torch.bfloat16), h, False)
    got.append(bool(torch.equal(d.x.view(torch.int16)[:n], want.x.view(torch.int16)[:n]))
               and tuple(y.shape) == (xs[rank].shape[0], H))
    if rank == 1:  # (c): away; the others' waits are bounded and name it
        return got
    start = time.monotonic()
    try:
        be.dispatch(xs[rank], idxs[rank], ws[rank])
        got.append("returned")
    except PeerTimeout as e:
        got.append(("PeerTimeout", e.peer, time.monotonic() - start < 4 * timeout_s))
    return got
