"""Process-wide settings that the package's executables (``gp-mapping``, the nodes) apply at start; importing the
library changes nothing.

glibc's malloc serves blocks above an adaptive threshold (128 KiB to start) with mmap and returns them to the
system when freed, and trims the top of the heap when more than twice that is free. Torch's CPU tensors come
straight from malloc, so every tile of a map (a (cells, M) kernel matrix and its products, 4 MiB each at the
default 2048 cells and M = 256) was a fresh mapping whose pages fault in on first touch, which made drawing a
map markedly slower. Blocks of up to 16 MiB come from the heap (a tile's buffers at M = 512 are 8 MiB) and up to
64 MiB of free heap is kept before trimming; larger settings draw no faster and cost resident memory. The bench's
speed section times the grid, its explore section watches the resident memory of a node's work.

Torch's CPU threads: one, unless ``OMP_NUM_THREADS`` says otherwise (:func:`set_cpu_threads`; where torch is
not yet imported it sets ``OMP_NUM_THREADS``, which an OpenMP BLAS and child processes read too). On a robot's
shared CPU the threads of one operation wait on each other for cores that other processes hold, which stalls every
update: beside two busy processes the demo bag replayed in 468 s with torch's default of two threads on a two-core
machine, and in 21.5 s with one. On the same machine idle, two threads take 0.78x the wall time of one (19.1
against 24.4 s, median of 3 paired runs) for 1.38x the CPU time (2026-11-30), too little to risk the stall; set
OMP_NUM_THREADS on a machine of its own. The benches run with one thread, so their figures are what the
executables do.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

#: torch CPU threads of the executables when OMP_NUM_THREADS is not set (module docstring)
DEFAULT_CPU_THREADS = 1

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: blocks up to this size come from the heap
HEAP_BLOCK_BYTES = 16 << 20
#: free memory at the top of the heap kept for reuse before it is returned to the system
KEPT_FREE_BYTES = 64 << 20


def keep_freed_memory() -> bool:
    """Apply the malloc settings of the module docstring; True when glibc took them (False on other C
    libraries and systems, where nothing is changed)."""
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, HEAP_BLOCK_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, KEPT_FREE_BYTES))


def set_cpu_threads() -> None:
    """Torch's CPU threads for this process: OMP_NUM_THREADS where the user set it (torch reads it itself), else
    DEFAULT_CPU_THREADS (module docstring). Before torch is imported this only sets OMP_NUM_THREADS, which torch
    reads when it is, so a command that never needs torch (``gp-mapping magnetometer``) does not pay its import
    (about a second) at start."""
    if os.environ.get("OMP_NUM_THREADS", "").strip():
        return
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(DEFAULT_CPU_THREADS)
    else:
        os.environ["OMP_NUM_THREADS"] = str(DEFAULT_CPU_THREADS)
