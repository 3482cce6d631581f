"""A removed instance's freed memory goes back to the OS: glibc keeps a thread's malloc arena
mapped after the thread's buffers are freed, and each instance steps on a thread of its own."""
import threading
from pathlib import Path

import pytest

from aserve.cluster.lifecycle import _libc_trim, release_freed_memory
from aserve.soak.probe import rss_bytes  # the soak's own RSS reading


@pytest.mark.skipif(_libc_trim() is None or not Path("/proc/self/statm").exists(),
                    reason="no glibc malloc_trim, or no /proc, here")
def test_trim_hands_a_finished_threads_free_pages_back():
    kept = []

    def step_buffers():  # 2,000 blocks of 100 KB (under the mmap threshold: they come from the arena)
        blocks = [bytearray(100_000) for _ in range(2000)]
        kept.extend(blocks[::50])  # a few stay alive, so the arena cannot just shrink from its top
        del blocks

    worker = threading.Thread(target=step_buffers)
    worker.start()
    worker.join()
    before = rss_bytes()
    assert release_freed_memory()
    after = rss_bytes()
    assert before - after > 100 * 2**20, (before, after)  # most of the 200 MB freed comes back
    assert len(kept) == 40
