"""The plugin caps glibc's malloc arenas: threads allocating at once share two of them."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap

import pytest

from flexgpu.kubelet_plugin.malloc_arenas import limit_malloc_arenas

# Eight threads allocate at the same moment, then malloc_info lists the arenas ("heaps").
PROBE = textwrap.dedent(
    """
    import ctypes, re, sys, tempfile, threading
    from flexgpu.kubelet_plugin.malloc_arenas import limit_malloc_arenas
    if sys.argv[1] == "limit":
        assert limit_malloc_arenas({})
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    start = threading.Barrier(8)
    def allocate():
        start.wait()
        for _ in range(2000):
            libc.free(libc.malloc(4000))
    threads = [threading.Thread(target=allocate) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    libc.fopen.restype, libc.fopen.argtypes = ctypes.c_void_p, (ctypes.c_char_p, ctypes.c_char_p)
    libc.malloc_info.argtypes = (ctypes.c_int, ctypes.c_void_p)
    libc.fclose.argtypes = (ctypes.c_void_p,)
    with tempfile.NamedTemporaryFile() as out:
        stream = libc.fopen(out.name.encode(), b"w")
        libc.malloc_info(0, stream)
        libc.fclose(stream)
        print(len(re.findall(r"<heap nr=", open(out.name).read())))
    """
)

glibc = pytest.mark.skipif(
    not hasattr(ctypes.CDLL(None), "malloc_info"), reason="malloc_info is glibc's"
)


def _arenas(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env=env,
    )
    return int(done.stdout.strip())


@glibc
def test_threads_allocating_at_once_share_two_arenas() -> None:
    assert _arenas("limit") <= 2
    # Without the cap the same threads get arenas of their own: the probe can tell.
    assert _arenas("default") > 2


def test_an_admins_malloc_arena_max_is_left_in_force() -> None:
    assert limit_malloc_arenas({"MALLOC_ARENA_MAX": "4"}) is False
