"""Bounded, named collectives (``mxcomm.transport.bounded``) in spawned gloo worlds on the CPU.

Every world is time-bounded by ``run_world`` (and the process group's own timeout, 60 s, is far
above the bounded timeouts used here), so a hang fails the test instead of blocking CI. Workers
check elapsed times against the bound themselves and raise on any deviation.
"""
import datetime
import os
import pickle
import time

import pytest

from _dist import WorkerError, run_world

TIMEOUT_S = 2.0
CENSUS_S = 1.0
#: Slack on top of timeout_s + census_s for a loaded 2-core machine.
SLACK_S = 1.0


def _bg(**kw):
    from mxcomm.transport import BoundedGroup

    return BoundedGroup(timeout_s=kw.pop("timeout_s", TIMEOUT_S), census_s=kw.pop("census_s", CENSUS_S), **kw)


def _side_store():
    """The default store under a test-only prefix (for test coordination outside the library)."""
    import torch.distributed as dist

    return dist.PrefixStore("test_bounded/", dist.distributed_c10d._get_default_store())


def _splits(src: int, world: int) -> list[int]:
    """Uneven rows that rank ``src`` sends to each rank (some zero)."""
    return [(src + 2 * p) % 4 for p in range(world)]


def _rows(src: int, dst: int, n: int):
    import torch

    return torch.arange(n, dtype=torch.float32).unsqueeze(1) * 0.5 + (100 * src + dst) + torch.zeros(n, 3)


def happy_worker(rank, world):
    import torch
    import torch.distributed as dist

    from mxcomm.transport import CallTag

    bg, bg2 = _bg(), _bg(timeout_s=5.0)
    assert bg2.instance == bg.instance + 1
    tag = CallTag("dispatch", 0, "T=4")
    got = bg.all_gather(torch.tensor([rank, 10 * rank], dtype=torch.int64), tag)
    assert [t.tolist() for t in got] == [[r, 10 * r] for r in range(world)], got

    send = _splits(rank, world)
    recv = [_splits(p, world)[rank] for p in range(world)]
    inp = torch.cat([_rows(rank, p, n) for p, n in enumerate(send)])
    out = torch.full((sum(recv), 3), -1.0)
    res = bg.all_to_all_single(out, inp, recv, send, CallTag("dispatch", 0, "payload"))
    assert res is out
    want = torch.cat([_rows(p, rank, n) for p, n in enumerate(recv)])
    assert torch.equal(out, want), (out, want)

    objs = bg2.all_gather_object({"rank": rank, "s": "x" * (7 * rank)}, CallTag("combine", 0))
    assert objs == [{"rank": r, "s": "x" * (7 * r)} for r in range(world)], objs
    bg.agree(True, "", CallTag("EPConfig", 0))

    if world == 4:  # a sub-group: group ranks differ from global ranks, its store is its own
        sub = dist.new_group([1, 3])
        if rank in (1, 3):
            sb = _bg(group=sub)
            got = sb.all_gather(torch.tensor([float(rank)]), CallTag("sub", 0))
            assert [t.item() for t in got] == [1.0, 3.0], got
    return bg.instance


@pytest.mark.parametrize("world", [2, 4])
def test_happy_path(world):
    instances = run_world(world, happy_worker, timeout=90)
    assert len(set(instances)) == 1


def sleeper_worker(rank, world, sleeper):
    import torch

    from mxcomm.transport import CallTag, PeerTimeout, TransportError

    bg = _bg()
    side = _side_store()
    if rank == sleeper:
        time.sleep(TIMEOUT_S + CENSUS_S + 2.0)  # the others gave up and finished their census
        t0 = time.monotonic()
        try:  # gloo may complete this call from the data the others sent before giving up
            bg.all_gather(torch.ones(2), CallTag("dispatch", 0))
            bg.all_gather(torch.ones(2), CallTag("combine", 0))
            raise AssertionError("the late rank did not raise")
        except PeerTimeout as exc:
            err = exc
        elapsed = time.monotonic() - t0
        side.set(f"late_done/{rank}", "1")
        others = tuple(r for r in range(world) if r != sleeper)
        assert elapsed <= 2 * TIMEOUT_S + CENSUS_S + SLACK_S, elapsed
        assert err.peers == others and err.rank == sleeper, (err.peers, str(err))
        assert "gave up" in str(err) and "rank 0" in str(err), str(err)
        return {"elapsed": elapsed, "msg": str(err)}
    t0 = time.monotonic()
    with pytest.raises(PeerTimeout) as ei:
        bg.all_gather(torch.ones(2), CallTag("dispatch", 0, "T=2"))
    elapsed = time.monotonic() - t0
    err = ei.value
    assert TIMEOUT_S - 0.1 <= elapsed <= TIMEOUT_S + CENSUS_S + SLACK_S, elapsed
    assert err.peers == (sleeper,) and err.missing == (sleeper,) and err.peer == sleeper, (err.peers, str(err))
    assert f"rank {sleeper} did not arrive" in str(err) and "dispatch #0 (T=2)" in str(err), str(err)
    with pytest.raises(TransportError, match="unusable"):  # at once, no second wait
        bg.all_gather(torch.ones(2), CallTag("dispatch", 1))
    assert time.monotonic() - t0 <= TIMEOUT_S + CENSUS_S + SLACK_S
    pickle.loads(pickle.dumps(err))  # crosses process boundaries intact
    # Stay alive (this process serves the store on rank 0) until the late rank has raised.
    side.wait([f"late_done/{sleeper}"], datetime.timedelta(seconds=30))
    return {"elapsed": elapsed, "msg": str(err)}


def test_sleeper_is_named_and_late_rank_raises():
    """World of 3, rank 2 sleeps past the timeout: ranks 0 and 1 name it within the bound; rank 2,
    arriving late, raises naming ranks 0 and 1; then every rank shuts down cleanly (run_world
    destroys the process group on each rank and returns only if all of them finish)."""
    res = run_world(3, sleeper_worker, 2, timeout=60)
    assert all(r["elapsed"] > 0 for r in res)


def dead_worker(rank, world, dead, marker_dir):
    import torch
    import torch.distributed as dist

    from mxcomm.transport import CallTag, PeerTimeout

    bg = _bg()
    if rank == dead:
        os._exit(1)
    t0 = time.monotonic()
    with pytest.raises(PeerTimeout) as ei:
        bg.all_gather(torch.ones(3), CallTag("dispatch", 0))
    elapsed = time.monotonic() - t0
    err = ei.value
    assert elapsed <= TIMEOUT_S + CENSUS_S + SLACK_S, elapsed
    assert err.peers == (dead,) and err.missing == (dead,), (err.peers, str(err))
    assert f"rank {dead} did not arrive" in str(err), str(err)
    t1 = time.monotonic()
    dist.destroy_process_group()  # must not hang with the failed collective pending
    shutdown = time.monotonic() - t1
    assert shutdown < 5.0, shutdown
    with open(os.path.join(marker_dir, f"rank{rank}"), "w") as f:
        f.write(f"{elapsed} {shutdown}\n{err}")
    # A local one-rank world, so the launcher's own destroy_process_group() has a group to destroy.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def test_dead_peer_is_named(tmp_path):
    with pytest.raises(WorkerError) as ei:
        run_world(3, dead_worker, 2, str(tmp_path), timeout=60)
    text = str(ei.value)
    assert text.startswith("1 of 3 ranks failed") and "--- rank 2 ---" in text and "exited with code 1" in text, text
    for r in (0, 1):
        body = (tmp_path / f"rank{r}").read_text()
        assert "rank 2 did not arrive" in body, body


def mismatch_worker(rank, world):
    import torch

    from mxcomm.transport import CallTag, PeerTimeout

    bg = _bg()
    t0 = time.monotonic()
    with pytest.raises(PeerTimeout) as ei:
        if rank == 0:
            bg.all_gather(torch.ones(4), CallTag("dispatch", 5, "T=128"))
        else:
            out = torch.zeros(6, 2)
            bg.all_to_all_single(out, torch.ones(6, 2), [3, 3], [3, 3], CallTag("combine", 5))
    elapsed = time.monotonic() - t0
    err, other = ei.value, 1 - rank
    assert elapsed <= TIMEOUT_S + CENSUS_S + SLACK_S, elapsed
    assert err.peers == (other,) and err.missing == (), (err.peers, err.missing, str(err))
    msg = str(err)
    assert "rank 0 called dispatch #5 (T=128)" in msg and "rank 1 called combine #5" in msg, msg
    return msg


def test_mismatched_ops_are_named():
    msgs = run_world(2, mismatch_worker, timeout=60)
    assert "all_gather" in msgs[0] and "all_to_all_single" in msgs[0], msgs[0]


def refused_worker(rank, world):
    import torch

    from mxcomm.transport import CallTag, PeerTimeout

    bg = _bg()
    send = [2] * world if rank != 1 else [2, 2, 5]  # rank 1's splits do not add up to its input
    out = torch.zeros(2 * world, 2)
    tag = CallTag("dispatch", 3)
    if rank == 1:
        with pytest.raises(ValueError, match=r"input_split_sizes \[2, 2, 5\]"):  # here, before sending
            bg.all_to_all_single(out, torch.ones(2 * world, 2), [2] * world, send, tag)
        # Stay alive until the others have taken their census (a closed connection would end their
        # wait early, which is fine too, but this checks the timeout path).
        _side_store().wait(["refused_seen/0", "refused_seen/2"], datetime.timedelta(seconds=30))
        return "refused"
    t0 = time.monotonic()
    with pytest.raises(PeerTimeout) as ei:
        bg.all_to_all_single(out, torch.ones(2 * world, 2), [2] * world, send, tag)
    elapsed = time.monotonic() - t0
    assert elapsed <= TIMEOUT_S + CENSUS_S + SLACK_S, elapsed
    _side_store().set(f"refused_seen/{rank}", "1")
    assert ei.value.peers == (1,) and ei.value.missing == (), str(ei.value)
    assert "rank 1 refused its input: ValueError: input_split_sizes" in str(ei.value), str(ei.value)
    return str(ei.value)


def test_refused_input_is_named():
    """One rank's collective fails its argument check: it raises that error, the others name it."""
    run_world(3, refused_worker, timeout=60)


def agree_worker(rank, world):
    import torch

    from mxcomm.transport import CallTag

    bg = _bg()
    bg.agree(True, "", CallTag("EPConfig", 0), what="EPConfig")  # all ok: no error
    bad = rank == 1
    with pytest.raises(ValueError) as ei:
        bg.agree(not bad, "hidden (48) must be a multiple of 32" if bad else "ignored", CallTag("EPConfig", 1),
                 what="EPConfig")
    got = bg.all_gather(torch.tensor([rank]), CallTag("after", 0))  # the group stays usable
    assert [t.item() for t in got] == list(range(world))
    return str(ei.value)


def test_agree():
    msgs = run_world(3, agree_worker, timeout=60)
    assert msgs == ["EPConfig is invalid on rank 1: hidden (48) must be a multiple of 32"] * 3, msgs


def test_calltag_and_peer_timeout_fields():
    from mxcomm.transport import CallTag, PeerTimeout

    assert str(CallTag("dispatch", 5, "T=128")) == "dispatch #5 (T=128)"
    assert str(CallTag("combine", 5)) == "combine #5"
    with pytest.raises(Exception):
        CallTag("x", 1).op = "y"  # frozen
    e = PeerTimeout(3, "all_gather", rank=0, peers=(3, 1), missing=(3,), message="rank 3 did not arrive")
    e2 = pickle.loads(pickle.dumps(e))
    assert (e2.peer, e2.peers, e2.missing, str(e2)) == (3, (1, 3), (3,), "rank 3 did not arrive")
    assert "timed out waiting for peer 2" in str(PeerTimeout(2, "x"))  # the device-wait text is unchanged
