"""CPU tests of bootstrap/heap: import without the GPU extras, argument checks, clear errors."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mxcomm.transport as tp
from mxcomm.transport import bootstrap

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def good_env(monkeypatch):
    for k, v in tp.required_env().items():
        monkeypatch.setenv(k, v)


@pytest.fixture
def no_gpu_extras(monkeypatch):
    """Make nvshmem4py / cuda-python unimportable (None in sys.modules blocks the import)."""
    for name in ("nvshmem", "nvshmem.core", "cuda", "cuda.core", "cuda.core.experimental"):
        monkeypatch.setitem(sys.modules, name, None)


def test_import_without_gpu_extras():
    code = (
        "import sys\n"
        "for m in ('nvshmem', 'nvshmem.core', 'cuda', 'cuda.core', 'triton'):\n"
        "    sys.modules[m] = None\n"
        "import mxcomm.transport as tp\n"
        "assert not tp.is_initialized()\n"
        "assert tp.symmetric_size_for(0) == '256M'\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_init_without_nvshmem_says_what_to_install(good_env, no_gpu_extras):
    with pytest.raises(tp.NvshmemUnavailable) as ei:
        tp.init_nvshmem(uid=b"\0" * 128, rank=0, nranks=1)
    assert "mxcomm[gpu]" in str(ei.value) and "nvshmem4py" in str(ei.value)
    assert isinstance(ei.value, ImportError)
    with pytest.raises(tp.NvshmemUnavailable):
        tp.new_unique_id()
    assert not tp.is_initialized()


def test_init_checks_multicast_env_first(monkeypatch, no_gpu_extras):
    monkeypatch.delenv("NVSHMEM_DISABLE_NVLS", raising=False)
    with pytest.raises(RuntimeError, match="NVSHMEM_DISABLE_NVLS"):
        tp.init_nvshmem(uid=b"\0" * 128, rank=0, nranks=1)


class _FakeComm:
    def __init__(self, rank=0, size=2):
        self.rank, self.size = rank, size

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size

    def bcast(self, obj, root=0):  # pragma: no cover - never reached on CPU
        raise AssertionError("must not communicate before the arguments are checked")


@pytest.mark.parametrize(
    "kwargs,exc",
    [
        ({}, ValueError),  # no route
        ({"uid": b"x", "rank": 0, "nranks": 1, "mpi_comm": _FakeComm()}, ValueError),  # two routes
        ({"mpi_comm": _FakeComm(), "rank": 0}, ValueError),  # rank only with uid
        ({"uid": b"x"}, ValueError),  # uid without rank/nranks
        ({"uid": b"x", "rank": 1, "nranks": 1}, ValueError),
        ({"uid": b"x", "rank": -1, "nranks": 2}, ValueError),
        ({"uid": b"x", "rank": 0, "nranks": 0}, ValueError),
        ({"uid": b"x", "rank": 0.0, "nranks": 1}, TypeError),
        ({"uid": b"x", "rank": True, "nranks": 2}, TypeError),
        ({"uid": "text", "rank": 0, "nranks": 1}, TypeError),
        ({"mpi_comm": object()}, TypeError),
        ({"group": object()}, ValueError),  # torch.distributed not initialised
    ],
)
def test_init_argument_errors(kwargs, exc, good_env, no_gpu_extras):
    with pytest.raises(exc):
        tp.init_nvshmem(**kwargs)
    assert not tp.is_initialized()


def test_no_context_before_init():
    assert not tp.is_initialized()
    with pytest.raises(RuntimeError, match="init_nvshmem"):
        tp.current_context()
    with pytest.raises(RuntimeError, match="init_nvshmem"):
        tp.SymmetricHeap()
    tp.finalize()  # no-op when not initialised


def test_context_peer_queries():
    ctx = tp.NvshmemContext(rank=1, world=4, device=torch.device("cuda", 0), route="uid", local_peers=(0, 1))
    assert ctx.has_peer_pointer(0) and ctx.has_peer_pointer(1)
    assert not ctx.has_peer_pointer(2) and not ctx.has_peer_pointer(3)
    assert ctx.remote_peers == (2, 3) and not ctx.all_local
    with pytest.raises(ValueError):
        ctx.has_peer_pointer(4)
    with pytest.raises(AttributeError):
        ctx.rank = 2  # frozen


def test_uid_bytes_roundtrip_with_struct_like_nvshmem():
    """The bytes <-> UniqueID conversion on an object shaped like nvshmem4py's (a 128-byte record)."""
    import numpy as np

    dt = np.dtype([("version", np.int32), ("internal", np.int8, (124,))], align=True)

    class _Uid:
        def __init__(self):
            self._data = np.zeros(1, dtype=dt).view(np.recarray)

    class _Core:
        @staticmethod
        def get_unique_id(empty=False):
            return _Uid()

    payload = bytes(np.random.default_rng(5).integers(0, 256, 128, dtype=np.uint8))
    uid = bootstrap._uid_from(_Core, payload)
    assert bootstrap._uid_to_bytes(uid) == payload
    assert bootstrap._uid_from(_Core, uid) is uid
    with pytest.raises(ValueError, match="128"):
        bootstrap._uid_from(_Core, payload[:100])


def test_buffer_spec():
    s = tp.BufferSpec("x", (3, 5), torch.bfloat16)
    assert s.numel == 15 and s.nbytes == 30
    assert tp.BufferSpec("y", 7, torch.float8_e4m3fn).shape == (7,)
    assert tp.BufferSpec("y", [2, 2], torch.int64).shape == (2, 2)
    specs = [s, tp.BufferSpec("f", (4,), torch.int64), tp.BufferSpec("q", (2, 64), torch.uint8)]
    assert tp.SymmetricHeap.plan_bytes(specs) == 30 + 32 + 128
    for args, exc in [
        (("", (1,), torch.float32), TypeError),
        (("a", (), torch.float32), TypeError),
        (("a", (2, 0), torch.float32), ValueError),
        (("a", (2, -1), torch.float32), ValueError),
        (("a", (2.0,), torch.float32), TypeError),
        (("a", (True,), torch.float32), TypeError),
        (("a", (2,), "float32"), TypeError),
    ]:
        with pytest.raises(exc):
            tp.BufferSpec(*args)
