"""Exit of the mpirun rank scripts (imported by them; they run with tests/mpi on sys.path)."""
import os
import sys


def hard_exit(code: int) -> None:
    """Exit without interpreter finalization: gloo's worker threads can still be dropping Python
    references then, which aborts the process (seen in CI: ProcessGroupGloo::runLoop during
    shutdown -> SIGABRT, rc 134) after all results were written. MPI is finalized first."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
