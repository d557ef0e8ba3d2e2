"""bench/gpu/env.sh on the CPU: it installs only the carried wheels built for the running Python, names the others
with how to fetch the right one, and still exports the launcher environment (NVLink multicast off)."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TAG = f"cp{sys.version_info[0]}{sys.version_info[1]}"


def _source(tree: Path) -> subprocess.CompletedProcess:
    """Source ``tree``'s copy of env.sh in bash with this interpreter; print what it exported."""
    script = f'source "{tree}/bench/gpu/env.sh" && echo "NVLS=$NVSHMEM_DISABLE_NVLS" && echo "PYTHONPATH=$PYTHONPATH"'
    env = dict(os.environ, PYTHON=sys.executable)
    return subprocess.run(["bash", "-c", script], cwd=tree, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of env.sh at bench/gpu/ of a fresh tree with an empty .whl/ (mxcomm itself comes from the install)."""
    (tmp_path / "bench" / "gpu").mkdir(parents=True)
    shutil.copy(REPO / "bench" / "gpu" / "env.sh", tmp_path / "bench" / "gpu" / "env.sh")
    (tmp_path / ".whl").mkdir()
    return tmp_path


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_wheels_for_another_python_are_skipped_and_named(tree):
    other = "cp399"  # no interpreter has this tag: the wheel must be skipped, and nothing installed
    name = f"fake_pkg-1.0-{other}-{other}-manylinux_2_17_x86_64.whl"
    (tree / ".whl" / name).write_bytes(b"not a wheel")  # installing it would fail: it must not be tried
    r = _source(tree)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"skipped {name} (not for {TAG};" in r.stderr
    assert f"--python-version {sys.version_info[0]}.{sys.version_info[1]}" in r.stderr
    assert f"no wheels for {TAG}" in r.stderr
    assert "NVLS=1" in r.stdout  # the launcher environment is exported all the same
    assert f"PYTHONPATH=/tmp/site:{tree}" in r.stdout


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_a_wheel_for_this_python_is_installed(tree):
    name = f"fake_pkg-1.0-{TAG}-{TAG}-manylinux_2_17_x86_64.whl"
    (tree / ".whl" / name).write_bytes(b"not a wheel")  # picked, so pip is asked to install it, and refuses
    r = _source(tree)
    assert r.returncode != 0
    assert "skipped" not in r.stderr
    assert f"env.sh: installing {tree}/.whl/{name} failed" in r.stderr
