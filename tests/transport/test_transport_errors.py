"""CPU tests of the device error words and PeerTimeout."""
import pickle
import random

import pytest
import torch

from mxcomm.transport import (
    ERR_CODE_SHIFT,
    TIMEOUT_CODE,
    PeerTimeout,
    TransportError,
    check_errors,
    decode_error_word,
    error_word,
)


def test_error_word_roundtrip():
    rng = random.Random(7)
    cases = [(TIMEOUT_CODE, 0), (TIMEOUT_CODE, (1 << 32) - 1), ((1 << 31) - 1, 5)]
    cases += [(rng.randrange(1, 1 << 31), rng.randrange(0, 1 << 32)) for _ in range(500)]
    for code, peer in cases:
        w = error_word(code, peer)
        assert decode_error_word(w) == (code, peer)
        assert w == (code << ERR_CODE_SHIFT) | peer
        assert -(1 << 63) <= w < (1 << 63)  # fits the int64 device word
    assert decode_error_word(0) == (0, 0)


@pytest.mark.parametrize("code,peer", [(0, 1), (-1, 1), (1 << 31, 1), (1, -1), (1, 1 << 32)])
def test_error_word_rejects(code, peer):
    with pytest.raises(ValueError):
        error_word(code, peer)


def test_check_errors_clean():
    check_errors(torch.zeros(3, dtype=torch.int64))
    check_errors(torch.zeros((2, 2), dtype=torch.int64))


def test_check_errors_names_peer():
    err = torch.zeros(4, dtype=torch.int64)
    err[2] = error_word(TIMEOUT_CODE, 5)
    with pytest.raises(PeerTimeout) as ei:
        check_errors(err, what="dispatch rows", rank=3)
    e = ei.value
    assert (e.peer, e.peers, e.what, e.rank) == (5, (5,), "dispatch rows", 3)
    msg = str(e)
    assert "rank 3" in msg and "peer 5" in msg and "dispatch rows" in msg
    assert isinstance(e, TransportError) and isinstance(e, RuntimeError)


def test_check_errors_several_peers():
    rng = random.Random(3)
    peers = rng.sample(range(64), 5)
    err = torch.tensor([error_word(TIMEOUT_CODE, p) for p in peers] + [0, 0], dtype=torch.int64)
    with pytest.raises(PeerTimeout) as ei:
        check_errors(err)
    assert ei.value.peer == max(peers) and ei.value.peers == tuple(sorted(peers))
    assert str(sorted(peers)) in str(ei.value)


def test_check_errors_unknown_code():
    err = torch.tensor([error_word(7, 2)], dtype=torch.int64)
    with pytest.raises(TransportError) as ei:
        check_errors(err, what="combine", rank=1)
    assert not isinstance(ei.value, PeerTimeout) and "code 7" in str(ei.value)


@pytest.mark.parametrize("bad", [torch.zeros(2, dtype=torch.int32), [0, 0], None])
def test_check_errors_type(bad):
    with pytest.raises(TypeError):
        check_errors(bad)


def test_peer_timeout_pickles():
    e = PeerTimeout(4, "flags", rank=2, peers=(1, 4))
    f = pickle.loads(pickle.dumps(e))
    assert (f.peer, f.what, f.rank, f.peers, str(f)) == (e.peer, e.what, e.rank, e.peers, str(e))
