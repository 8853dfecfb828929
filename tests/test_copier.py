"""The native copier (streamer_client._native_copier, _copier.c): bad batches refused, files cut short
answered, the SIGBUS handler safe to run on any copying thread.

Cases that could crash the interpreter run in a child process, so a regression fails one test.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from held_pages import HeldPages

from streamer_client import _native_copier as copier

pytestmark = pytest.mark.skipif(not copier.available(), reason="the native copier is not built")


def _child(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


def test_copies_are_byte_exact_across_chunks_and_ranges():
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, 5 * copier.CHUNK_BYTES + 12345, dtype=np.uint8)
    dst = np.zeros_like(src)
    pieces = [(0, 1), (1, copier.CHUNK_BYTES + 7), (copier.CHUNK_BYTES + 8, src.nbytes - copier.CHUNK_BYTES - 8)]
    failed = copier.copy(
        [dst.ctypes.data + o for o, _ in pieces], [src.ctypes.data + o for o, _ in pieces], [n for _, n in pieces]
    )
    assert failed == -1
    assert np.array_equal(dst, src)


def test_a_copy_past_the_end_of_the_address_space_is_refused_not_a_crash():
    # A size near 2**64: its chunk count and the end of its range wrap around.
    result = _child(
        """
        import numpy as np
        from streamer_client import _native_copier as copier
        buf = np.zeros(4096, dtype=np.uint8)
        for srcs, sizes in (([buf.ctypes.data] * 2, [16, 2**64 - 1]), ([2**64 - 8], [16])):
            try:
                copier.submit([buf.ctypes.data] * len(sizes), srcs, sizes)
            except ValueError as exc:
                print("refused:", exc)
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "refused: copier: copy 1 (18446744073709551615 bytes) runs past the end of the address space",
        "refused: copier: copy 0 (16 bytes) runs past the end of the address space",  # its source wraps
    ]


def test_a_negative_wait_timeout_waits_until_the_batch_is_done():
    buf = np.zeros(4096, dtype=np.uint8)
    buf[2048:3072] = 7
    ticket = copier.submit([buf.ctypes.data], [buf.ctypes.data + 2048], [1024])
    assert copier._copier.wait(copier.pool(), ticket, -1) == -1 and (buf[:1024] == 7).all()
    with pytest.raises(ValueError, match=f"no batch {ticket} is queued"):  # answered once, then gone
        copier._copier.wait(copier.pool(), ticket, 0)


def test_a_wait_with_a_timeout_ends_with_none_and_the_batch_stays_to_be_waited_for():
    """The copy's destination is held by the kernel (``held_pages``): a zero wait ends with None
    and the batch stays queued; once the pages are let go the batch is copied and answered."""
    src = np.full(4 * 1024 * 1024, 5, dtype=np.uint8)
    dst = HeldPages(src.nbytes)
    ticket = copier.submit([dst.array.ctypes.data], [src.ctypes.data], [src.nbytes])
    assert copier.wait(ticket, 0) is None
    dst.release()
    assert copier.wait(ticket, 60) == -1 and np.array_equal(dst.array, src)


def test_a_batch_nobody_waited_for_holds_its_slot_not_the_pool():
    buf = np.zeros(8192, dtype=np.uint8)
    copier.submit([buf.ctypes.data], [buf.ctypes.data + 4096], [16])  # never waited for
    for _ in range(4100):  # more batches than there are slots, one at a time
        assert copier.copy([buf.ctypes.data + 1024], [buf.ctypes.data + 4096], [16]) == -1


# A batch of 256 MiB and a Ctrl-C sent as the copier's native wait is first called: its
# KeyboardInterrupt is raised at once, while the batch is still copying.
_INTERRUPTED = """
    import os, signal, sys, numpy as np
    from streamer_client import _native_copier as copier

    src = np.arange(256 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    copier.pool()
    # Python's own handler, as in a terminal (a process started in the background inherits SIGINT ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def ctrl_c(frame, event, arg):
        if event == "c_call" and getattr(arg, "__module__", "") == "streamer_client._copier" and arg.__name__ == "wait":
            sys.setprofile(None)
            os.kill(os.getpid(), signal.SIGINT)

    sys.setprofile(ctrl_c)
    try:
        copier.wait(copier.submit([dst.ctypes.data], [src.ctypes.data], [src.nbytes]))
        print("not interrupted")
    except KeyboardInterrupt:
        # Raised only once every byte is copied: the last chunk (the threads take them in order)
        # is there the moment it is caught, and so is everything before it.
        print("interrupted", np.array_equal(dst[-4096:], src[-4096:]) and np.array_equal(dst, src))
"""


def test_a_ctrl_c_while_waiting_for_a_batch_is_raised_once_the_copying_threads_are_done():
    # copy() cannot be interrupted at all: it submits and waits in C, with no interpreter between.
    result = _child(_INTERRUPTED)
    assert (result.returncode, result.stdout.split()) == (0, ["interrupted", "True"]), result.stderr


def test_a_sigbus_sent_to_the_process_still_ends_it():
    # Not a copy's fault: what it would do without the copier's guard, which stays in place. Raised
    # in this thread: a signal sent to the whole process may be taken by a copying thread while
    # this one goes on and prints before the process ends.
    result = _child("""
        import signal
        from streamer_client import _native_copier as copier
        copier.pool()
        signal.raise_signal(signal.SIGBUS)
        print("survived")
    """)
    assert result.returncode == -signal.SIGBUS and "survived" not in result.stdout


def test_a_pool_made_by_a_thread_that_blocks_every_signal_still_catches_a_file_cut_short(tmp_path):
    path = tmp_path / "shard"
    path.write_bytes(b"x" * 3 * 65536)
    result = _child(f"""
        import os, signal, threading, numpy as np
        from streamer_client import _native_copier as copier

        def make():  # helper threads often block every signal
            signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
            copier.pool()
        thread = threading.Thread(target=make)
        thread.start()
        thread.join()
        fd = os.open({str(path)!r}, os.O_RDONLY)
        address = copier.map_file(fd, 3 * 65536)
        os.truncate({str(path)!r}, 65536)
        dst = np.zeros(3 * 65536, dtype=np.uint8)
        print(copier.copy([dst.ctypes.data], [address], [3 * 65536]))
    """)
    assert (result.returncode, result.stdout.strip()) == (0, "0"), result.stderr


def test_a_file_cut_short_under_its_mapping_is_the_failed_copy_s_index(tmp_path):
    path = tmp_path / "shard"
    data = np.random.default_rng(1).integers(0, 256, 3 * copier.CHUNK_BYTES, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        address = copier.map_file(fd, data.nbytes)
    finally:
        os.close(fd)
    try:
        os.truncate(path, copier.CHUNK_BYTES)  # the mapping's last two chunks are past the end now
        dst = np.zeros_like(data)
        head = copier.CHUNK_BYTES // 2
        failed = copier.copy([dst.ctypes.data, dst.ctypes.data + head], [address, address + head], [head, data.nbytes - head])
        assert failed == 1  # the second copy ran into the cut; the process lives
        assert np.array_equal(dst[:head], data[:head])
    finally:
        copier.unmap(address, data.nbytes)


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs nm (binutils)")
def test_the_signal_handler_s_thread_local_needs_no_dynamic_tls_lookup():
    # A SIGBUS handler that reaches its thread-local through __tls_get_addr may allocate on a
    # thread's first access: not async-signal-safe. Initial-exec TLS is a fixed offset.
    import streamer_client._copier as module

    symbols = subprocess.run(["nm", "-D", "--undefined-only", module.__file__], capture_output=True, text=True, check=True).stdout
    assert "__tls_get_addr" not in symbols


def test_a_rank_takes_its_share_of_the_hosts_cpus_for_copying(monkeypatch):
    monkeypatch.setattr(copier, "COPY_THREADS", 12)
    assert [copier.threads_for(ranks, 16) for ranks in (1, 2, 4, 8, 16)] == [12, 8, 4, 2, 2]
    assert copier.threads_for(8, 128) == 12 and copier.threads_for(0, 3) == 3


@pytest.mark.parametrize(("local_world", "shared", "ranks"), [(None, 4, 4), ("3", 2, 3), ("3", 5, 5), ("x", 1, 1)])
def test_the_ranks_on_the_host_come_from_torchrun_or_the_daemon_session(local_world, shared, ranks):
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_WORLD_SIZE"}
    if local_world is not None:
        env["LOCAL_WORLD_SIZE"] = local_world
    code = f"import streamer_client._native_copier as c; c.share_host({shared}); print(c._ranks_on_host)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stdout.strip()) == (0, str(ranks)), out.stderr


# A file of three 64 KiB pieces, mapped, then cut to one: the copy of the whole mapping faults in
# its second piece. MAPPED is the child's preamble; `path` is formatted in.
MAPPED = """
    import ctypes, faulthandler, mmap, os, signal, sys, numpy as np
    from streamer_client import _native_copier as copier, _delivery as delivery
    from streamer_client.errors import ObjectChangedError
    path = {path!r}
    with open(path, "r+b") as f:
        mapping = mmap.mmap(f.fileno(), 3 * 65536, prot=mmap.PROT_READ)
    view = np.frombuffer(mapping, dtype=np.uint8)
    dst = np.zeros(3 * 65536, dtype=np.uint8)

    def cut_short(i):
        return ObjectChangedError(f"tensor {{i}} was cut short", key=str(i))

    def copy_to_cpu(nbytes):
        try:
            delivery.copy_to_cpu([(view[:65536], "U8", [65536]), (view[:nbytes], "U8", [nbytes])], cut_short)
        except ObjectChangedError as exc:
            return str(exc)
"""


def _mapped_child(tmp_path, code: str) -> subprocess.CompletedProcess:
    path = tmp_path / "shard"
    path.write_bytes(b"x" * 3 * 65536)
    return _child(MAPPED.format(path=str(path)) + textwrap.dedent(code).replace("\n", "\n    "))


def test_a_handler_installed_after_the_pool_does_not_cost_the_guard(tmp_path):
    # faulthandler (pytest's, an engine's) takes SIGBUS over after the pool was made: the next batch
    # puts the guard back over it, so a file cut short under a copy is the copy's error, not a crash.
    result = _mapped_child(
        tmp_path,
        """
        copier.pool()
        faulthandler.enable()
        os.truncate(path, 65536)
        print(copier.copy([dst.ctypes.data], [view.ctypes.data], [view.nbytes]))
        print(copy_to_cpu(3 * 65536))
        faulthandler.disable()  # puts back the guard it replaced, which still knows what came before
        print(copier.copy([dst.ctypes.data], [view.ctypes.data], [view.nbytes]))
        signal.raise_signal(signal.SIGBUS)  # not a copy's: the process ends as it would without us
        print("survived")
        """,
    )
    assert result.returncode == -signal.SIGBUS, result.stderr
    assert result.stdout.splitlines() == ["0", "tensor 1 was cut short", "0"]


def test_a_fault_that_is_not_a_copy_s_reaches_a_handler_installed_after_the_pool(tmp_path):
    result = _mapped_child(
        tmp_path,
        """
        copier.pool()
        faulthandler.enable()
        print(copier.copy([dst.ctypes.data], [view.ctypes.data], [65536]))  # the guard goes back over it
        os.truncate(path, 65536)
        sys.stdout.flush()
        print(int(view[-1]))  # read here, by no copy: faulthandler reports it, the process ends
        """,
    )
    assert result.returncode == -signal.SIGBUS and result.stdout.splitlines() == ["-1"], result.stderr
    assert "Fatal Python error: Bus error" in result.stderr


def test_small_copies_from_a_file_cut_short_are_guarded_too(tmp_path):
    # Under 256 KiB a batch is copied on the calling thread (no hand-off to the pool's threads),
    # under the same guard, with or without the pool made.
    result = _mapped_child(
        tmp_path,
        """
        os.truncate(path, 65536)
        print(copier.copy_here([dst.ctypes.data, dst.ctypes.data], [view.ctypes.data, view.ctypes.data + 65536], [65536, 4096]))
        print(copy_to_cpu(65536 + 4096))
        print(copy_to_cpu(65536))  # bytes still in the file: copied
        """,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["1", "tensor 1 was cut short", "None"]


@pytest.mark.parametrize("code", [4, 5], ids=["BUS_MCEERR_AR", "BUS_MCEERR_AO"])
def test_a_hardware_memory_error_during_a_copy_is_not_a_file_cut_short(code):
    # A copying thread holds its guard while it writes pages the kernel holds (held_pages); a SIGBUS
    # with the si_code the kernel gives a corrupted page (BUS_MCEERR_*) arrives there: every other
    # thread blocks SIGBUS, and a process may send itself a signal with a kernel's si_code
    # (pidfd_send_signal). It is not a file cut short: the copy is not reported failed, the process
    # ends as it would without the guard.
    result = _child(f"""
        import signal
        signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGBUS}})  # every thread made from now on too
        import ctypes, os, sys, numpy as np
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from held_pages import HeldPages
        from streamer_client import _native_copier as copier

        src = np.ones(65536, dtype=np.uint8)
        dst = HeldPages(src.nbytes)
        pool = copier._copier.pool(1, copier.CHUNK_BYTES)  # its one thread unblocks SIGBUS
        ticket = copier._copier.submit(pool, *(copier._words(v) for v in ([dst.array.ctypes.data], [src.ctypes.data], [src.nbytes])))
        assert dst.wait_for_fault(30)
        info = (ctypes.c_int * 32)()
        info[0], info[2] = signal.SIGBUS, {code}  # si_signo, si_code
        ctypes.cast(ctypes.byref(info, 16), ctypes.POINTER(ctypes.c_void_p))[0] = dst.array.ctypes.data  # si_addr
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        pidfd = os.pidfd_open(os.getpid())
        sent = libc.syscall(ctypes.c_long(424), ctypes.c_long(pidfd), ctypes.c_long(signal.SIGBUS), info, ctypes.c_long(0))  # pidfd_send_signal
        assert sent == 0, os.strerror(ctypes.get_errno())
        dst.release()
        print("copied", copier._copier.wait(pool, ticket, 30000))
    """)
    assert result.returncode == -signal.SIGBUS, (result.returncode, result.stdout, result.stderr)
    assert "copied" not in result.stdout
