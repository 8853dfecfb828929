"""Sample the host every 50 ms while something else runs: the CPU split (with steal time), page
faults and allocations (/proc/vmstat), free memory and shared memory (/proc/meminfo), and the CPU
of each thread name of the daemon (``streamer_service serve``) and of SeaweedFS (``weed``).

    python3 scripts/probes/host_sampler.py OUTFILE SECONDS

One line a sample: ``epoch | usr sys idle steal % | vmstat deltas | meminfo MiB | process[thread name:ticks ...]``
(ticks of 1/CLK_TCK s in that sample, the eight busiest names). Threads that native code starts
carry the name of the thread that made them: Run:ai's workers show as ``python3``, the AWS CRT's
event loops as ``AwsEventLoop N``. Line the samples up with a load by its daemon log line (end
time and duration).
"""

from __future__ import annotations

import os
import sys
import time

VMSTAT = ("pgfault", "pgalloc_normal", "pgfree", "thp_fault_alloc", "compact_stall", "pgscan_direct", "allocstall_normal")
MEMINFO = ("MemFree", "Shmem", "Cached", "AnonPages")


def cpu() -> list[int]:
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:9]]


def vmstat() -> dict[str, int]:
    with open("/proc/vmstat") as f:
        return {k: int(v) for k, v in (line.split() for line in f) if k in VMSTAT}


def meminfo() -> dict[str, int]:
    with open("/proc/meminfo") as f:
        return {k: int(v.split()[0]) // 1024 for k, v in (line.split(":") for line in f) if k in MEMINFO}


def watched() -> dict[str, str]:
    """PIDs of the daemon and SeaweedFS, by kind."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if argv[0].endswith(b"weed"):
            found[pid] = "weed"
        elif b"streamer_service" in argv and b"serve" in argv:
            found[pid] = "daemon"
    return found


def thread_ticks(pid: str) -> dict[str, tuple[str, int]]:
    ticks = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return ticks
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        ticks[tid] = (stat[stat.index("(") + 1 : stat.rindex(")")], int(fields[11]) + int(fields[12]))
    return ticks


def main(out: str, seconds: float) -> None:
    end = time.time() + seconds
    last_cpu, last_vm, last_ticks = cpu(), vmstat(), {}
    pids, pids_at = {}, 0.0
    with open(out, "w") as f:
        while time.time() < end:
            time.sleep(0.05)
            now = time.time()
            if now - pids_at > 1.0:
                pids, pids_at = watched(), now
            now_cpu, now_vm = cpu(), vmstat()
            d = [b - a for a, b in zip(last_cpu, now_cpu)]
            total = sum(d) or 1
            parts = [
                f"{now:.3f}",
                " ".join(
                    f"{name}{100 * ticks / total:.0f}"
                    for name, ticks in (("usr", d[0] + d[1]), ("sys", d[2] + d[5] + d[6]), ("idle", d[3] + d[4]), ("steal", d[7]))
                ),
                " ".join(f"{k}+{now_vm.get(k, 0) - last_vm.get(k, 0)}" for k in VMSTAT),
                " ".join(f"{k}={v}" for k, v in meminfo().items()),
            ]
            for pid, kind in pids.items():
                busy: dict[str, int] = {}
                for tid, (name, ticks) in thread_ticks(pid).items():
                    delta = ticks - last_ticks.get((pid, tid), ticks)
                    last_ticks[pid, tid] = ticks
                    if delta:
                        busy[name] = busy.get(name, 0) + delta
                if busy:
                    top = sorted(busy.items(), key=lambda kv: -kv[1])[:8]
                    parts.append(kind + "[" + " ".join(f"{name}:{n}" for name, n in top) + "]")
            f.write(" | ".join(parts) + "\n")
            last_cpu, last_vm = now_cpu, now_vm


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
