"""glibc malloc settings for XLA:CPU, whose buffers are the host's heap.

XLA:CPU allocates every step's results and temporaries with malloc and frees them after. glibc
serves blocks above its mmap threshold (128 KB, rising to at most 32 MB) with fresh mmaps and
returns freed heap tops to the kernel, so each step page-faulted its big buffers in again and
had the kernel zero them, a cost that showed in a prefill's wall time (docs/performance.md,
'Prefill was the larger gap'). Freed memory is kept for the next step instead: no mmaps, no
trimming. The price: the process keeps its peak heap, which a serving engine reaches again at
its next busy step anyway.

Left alone when the user chose: a MALLOC_* setting in the environment, or another allocator
preloaded (tcmalloc, jemalloc: glibc's malloc is not the one in use then).
"""

from __future__ import annotations

import ctypes
import logging
import os

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4  # glibc's malloc.h
_TOP_PAD = 64 << 20  # heap growth per brk: fewer, larger extensions
_USER_SETTINGS = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
                  "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")


def keep_freed_memory() -> bool:
    """Apply the settings (once per process; idempotent); True if they are in effect."""
    preload = os.environ.get("LD_PRELOAD", "")
    if any(os.environ.get(name) for name in _USER_SETTINGS) or "malloc" in preload:
        logger.info("host malloc: left as configured (MALLOC_*/GLIBC_TUNABLES or a preloaded "
                    "allocator)")
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    ok = all(mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1), (_M_TOP_PAD, _TOP_PAD)))
    if not ok:
        logger.warning("host malloc: glibc refused a setting; freed buffers may be unmapped")
    return ok
