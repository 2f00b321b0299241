"""Keeping OpenMP's spinning workers to the thread that steps the engine.

GNU OpenMP (torch's CPU build, and our kernels, which share its runtime) keeps a pool of
worker threads for every thread that has run a parallel region, for as long as that
thread lives. Once the pools' threads outnumber the cores, its workers stop spinning
between regions and sleep instead, and a decode step's ~150 regions each pay a futex
wake-up: on 2 cores SmolLM2's decode went from 12 to 25 ms/token. Two ways a process got
there:

- the model was loaded on one thread (its parallel ops made a pool) and stepped on another
  (AsyncEngine's loop): `release_pool()` on the loading thread before the loop starts;
- a long-lived helper thread (context-file I/O) ran one parallel op: its jobs run through
  `run_then_release`, which ends its workers again after each.

(torch.set_num_threads(1) on the helper would not do: torch's thread count is one per
process, so it would slow the engine's own ops.)
"""

import ctypes
import os
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep the settings


def release_pool() -> bool:
    """End the calling thread's OpenMP workers (OpenMP 5's omp_pause_resource_all; the
    next parallel region on this thread starts new ones). False where the runtime is not
    GNU OpenMP or lacks the call."""
    try:
        gomp = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD)  # torch's, already loaded
        return gomp.omp_pause_resource_all(_OMP_PAUSE_SOFT) == 0
    except (OSError, AttributeError):
        return False


def run_then_release(fn: Callable[..., T], *args: object) -> T:
    """fn(*args), then end the OpenMP workers its parallel ops started on this thread."""
    try:
        return fn(*args)
    finally:
        release_pool()
