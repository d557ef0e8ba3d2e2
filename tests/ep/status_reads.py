"""A test helper: how often the nvshmem backend reads its status words with and without waiting for the device."""
import contextlib


@contextlib.contextmanager
def status_reads(sw):
    """Counts of the backend's reads of its status words inside the block: ``sync``, the reads that wait for the
    device (:meth:`StatusWords.check` called by the backend), and ``no_sync``, the checks that only start a copy on a
    GPU (:meth:`StatusWords.check_async`; on CPU it reads at once through ``check``, which is not counted as a sync)."""
    counts = {"sync": 0, "no_sync": 0}
    check, check_async = sw.check, sw.check_async

    def counted_check(*a, **kw):
        counts["sync"] += 1
        return check(*a, **kw)

    def counted_async(*a, **kw):
        counts["no_sync"] += 1
        counts["sync"] -= 1 if sw.device.type != "cuda" else 0  # (its CPU read goes through check)
        return check_async(*a, **kw)

    sw.check, sw.check_async = counted_check, counted_async
    try:
        yield counts
    finally:
        del sw.check, sw.check_async
