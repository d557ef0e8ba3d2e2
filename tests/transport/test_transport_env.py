"""CPU tests of mxcomm.transport.env: required variables, the multicast check, heap size strings."""
import random

import pytest

from mxcomm.transport import check_env, launcher_env, parse_size, required_env, symmetric_size_for

MIB = 1 << 20
MULTICAST = {"NVSHMEM_DISABLE_NVLS": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0"}


def test_required_env_single_and_multi_node():
    single = required_env()
    assert single == {**MULTICAST, "NVSHMEM_REMOTE_TRANSPORT": "none", "NVSHMEM_DISABLE_NCCL": "1"}
    multi = required_env(multi_node=True)
    assert multi == MULTICAST
    single["X"] = "y"  # a fresh dict each call
    assert "X" not in required_env()


def test_check_env_accepts_required_env():
    check_env(required_env())
    check_env(required_env(multi_node=True))
    check_env({"NVSHMEM_DISABLE_NVLS": "true", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "YES", "NCCL_NVLS_ENABLE": "off"})


@pytest.mark.parametrize("name", sorted(MULTICAST))
@pytest.mark.parametrize("bad", [None, "", "2", "maybe", "flip"])
def test_check_env_rejects_missing_or_wrong(name, bad):
    env = dict(MULTICAST)
    if bad is None:
        del env[name]
    else:
        env[name] = bad if bad != "flip" else ("0" if MULTICAST[name] == "1" else "1")
    with pytest.raises(RuntimeError) as ei:
        check_env(env)
    msg = str(ei.value)
    assert name in msg and "multicast" in msg.lower()
    assert all(f"{k}={v}" in msg for k, v in MULTICAST.items())  # tells how to fix it


def test_check_env_reads_os_environ_and_never_writes(monkeypatch):
    for k in MULTICAST:
        monkeypatch.delenv(k, raising=False)
    import os

    before = dict(os.environ)
    with pytest.raises(RuntimeError):
        check_env()
    assert dict(os.environ) == before
    for k, v in MULTICAST.items():
        monkeypatch.setenv(k, v)
    check_env()


def test_symmetric_size_worked_example_and_bounds():
    assert symmetric_size_for(0) == "256M"  # the docstring's example: the fixed reserve only
    rng = random.Random(1234)
    sizes = [1, 31, MIB - 1, MIB, 3 << 30] + [rng.randrange(1, 64 << 30) for _ in range(200)]
    prev = 0
    for n in sorted(sizes):
        text = symmetric_size_for(n)
        got = parse_size(text)
        need = n + -(-n // 4) + 256 * MIB
        assert need <= got < need + MIB, (n, text)
        assert got % MIB == 0 and got >= prev
        assert text.endswith("G") == (got % (1 << 30) == 0)
        prev = got


@pytest.mark.parametrize("bad,exc", [(-1, ValueError), (1.5, TypeError), ("1G", TypeError), (True, TypeError)])
def test_symmetric_size_rejects(bad, exc):
    with pytest.raises(exc):
        symmetric_size_for(bad)


def test_parse_size():
    assert parse_size("4096") == 4096
    assert parse_size("1G") == 1 << 30 and parse_size("1g") == 1 << 30
    assert parse_size("1280M") == 1280 * MIB and parse_size("2k") == 2048 and parse_size("1T") == 1 << 40
    for bad in ["", "G", "1.5G", "-1M", "12Q"]:
        with pytest.raises(ValueError):
            parse_size(bad)


def test_launcher_env():
    n = 5 << 30
    env = launcher_env(n)
    assert env == {**required_env(), "NVSHMEM_SYMMETRIC_SIZE": symmetric_size_for(n)}
    check_env(env)
    assert "NVSHMEM_REMOTE_TRANSPORT" not in launcher_env(n, multi_node=True)
