"""``core.ops.adopt_thread_count``: OpenMP keeps its thread count per thread, so a thread Python starts after
``torch.set_num_threads(1)`` ran its ops on OpenMP's default team (one thread per core) -- serve's scheduler,
the reward workers and the overlapped rollout thread did, 1.4-8x slower on the busy 2-core machine. Read
with libgomp's own ``omp_get_max_threads`` in each thread (``torch.get_num_threads`` reports the set value
everywhere)."""

from __future__ import annotations

import ctypes
import os
import re
import threading

import pytest
import torch

from lmforge.core.ops import adopt_thread_count


@pytest.fixture
def openmp():
    """libgomp as torch loaded it, and torch set to one intra-op thread for the test."""
    try:
        maps = open("/proc/self/maps").read()
    except OSError:
        pytest.skip("needs /proc/self/maps (Linux)")
    # torch's own copy: other packages bring theirs (scikit-learn's is loaded when a test imported it)
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    libraries = sorted(
        p for p in set(re.findall(r"/\S*libgomp\S*\.so[.0-9]*", maps)) if os.path.dirname(p) == torch_lib
    )
    if not libraries:
        pytest.skip("torch is not linked against its own libgomp here")
    if (os.cpu_count() or 1) < 2 or os.environ.get("OMP_NUM_THREADS"):
        pytest.skip("OpenMP's default team is one thread here: nothing to tell apart")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield ctypes.CDLL(libraries[0])
    torch.set_num_threads(before)


def in_thread(fn):
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join(30)
    return out[0]


def test_a_new_thread_runs_on_the_set_count_once_it_adopts_it(openmp):
    assert openmp.omp_get_max_threads() == 1
    assert in_thread(openmp.omp_get_max_threads) > 1  # the premise: OpenMP's default, not the set count
    assert in_thread(lambda: (adopt_thread_count(), openmp.omp_get_max_threads())[1]) == 1


def test_the_serve_scheduler_thread_adopts_it(openmp, make_tiny):
    from lmforge.serve import BatchScheduler

    model, tokenizer = make_tiny()
    scheduler = BatchScheduler(model, tokenizer.pad_token_id, tokenizer.decode)
    try:
        threads, _ = scheduler.run_job(lambda m: openmp.omp_get_max_threads()).result(30)
    finally:
        scheduler.shutdown()
    assert threads == 1
