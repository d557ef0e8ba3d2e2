"""bench/gpu/ab.sh on the CPU: what it refuses before it extracts a revision or starts anything (a GPU call must not
spend its minutes on a typo)."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _ab(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "bench" / "gpu" / "ab.sh"), *args], cwd=REPO,
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=60)


def test_an_unknown_case_is_refused_before_the_revision_is_read():
    # the revision does not exist either: the case must be refused first, without git being asked for it
    r = _ab("no-such-revision", CASES="t4096_graph t999")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "unknown case t999 (t128_graph, t128, t4096_graph)" in r.stderr
    assert "no-such-revision" not in r.stderr


def test_a_revision_is_required():
    r = _ab()
    assert r.returncode != 0
    assert "usage: bash bench/gpu/ab.sh REV [ROUNDS]" in r.stderr


def test_a_revision_that_does_not_exist_fails_and_leaves_no_folder():
    before = set(Path("/tmp").glob("mxcomm-ab.*"))
    r = _ab("HEAD", NEW="no-such-revision", CASES="t4096_graph")
    assert r.returncode == 1
    assert "no-such-revision" in r.stderr  # git's refusal, before anything starts
    assert set(Path("/tmp").glob("mxcomm-ab.*")) == before


def test_a_list_with_one_bad_revision_fails_and_leaves_no_folder():
    before = set(Path("/tmp").glob("mxcomm-ab.*"))
    r = _ab("HEAD,no-such-revision,HEAD~1", CASES="t4096_graph")
    assert r.returncode == 1
    assert "no-such-revision" in r.stderr
    assert set(Path("/tmp").glob("mxcomm-ab.*")) == before


def test_an_empty_revision_list_is_refused():
    r = _ab(",", CASES="t4096_graph")
    assert r.returncode == 2
    assert "no revision in ','" in r.stderr
