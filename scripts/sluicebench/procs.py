"""Process lifecycle for the benchmark drivers.

Every process a driver starts goes through ``Procs``, which records it and stops it by PID on
exit: SIGTERM, then SIGKILL after a grace period, always reaped. Children run in their own
process group, so Ctrl-C reaches only the driver (which then stops them in order) and not, say,
nginx halfway through a run. Everything listens on 127.0.0.1; every wait is bounded.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterable, Sequence


class Failure(Exception):
    """A benchmark cannot go on; the message says why. The entry point prints it and exits 1."""


def log(name: str, message: str) -> None:
    print(f"{name}: {message}", file=sys.stderr, flush=True)


class Procs:
    """The work directory and the processes of one driver run."""

    def __init__(self, name: str, keep: bool = False):
        self.name = name
        self.keep = keep
        self.work = Path(tempfile.mkdtemp(prefix=f"sluice-{name}."))
        self.running: list[subprocess.Popen] = []
        self.taken_ports: set[int] = set()

    def log(self, message: str) -> None:
        log(self.name, message)

    # --- starting and stopping ------------------------------------------------------------
    def start(self, argv: Sequence[str], *, out: Path | None = None,
              env: dict | None = None) -> subprocess.Popen:
        """Starts ARGV in the background, its stdout and stderr appended to OUT (or discarded).

        Appending (O_APPEND) lets a driver truncate a log file between runs while the process
        keeps writing to it."""
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            sink = open(out, "ab")
        else:
            sink = subprocess.DEVNULL
        try:
            proc = subprocess.Popen(
                list(argv), stdin=subprocess.DEVNULL, stdout=sink, stderr=sink, env=env,
                process_group=0)
        finally:
            if out is not None:
                sink.close()  # the child holds its own descriptor
        self.running.append(proc)
        return proc

    def run(self, argv: Sequence[str], *, timeout: float, env: dict | None = None,
            check: bool = True) -> str:
        """Runs ARGV to completion (killed after TIMEOUT seconds) and returns its stdout.

        Registered while it runs, so that Ctrl-C stops it too."""
        proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=env, process_group=0)
        self.running.append(proc)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop(proc)
            raise Failure(f"{argv[0]} did not finish within {timeout:.0f} s: {' '.join(argv)}")
        finally:
            if proc in self.running and proc.poll() is not None:
                self.running.remove(proc)
        if check and proc.returncode != 0:
            raise Failure(f"{' '.join(argv)} exited with {proc.returncode}: "
                          f"{err.decode(errors='replace').strip()[-500:]}")
        return out.decode(errors="replace")

    def stop(self, proc: subprocess.Popen, grace: float = 5.0) -> None:
        """SIGTERM, up to GRACE seconds, SIGKILL; reaped either way, and forgotten."""
        if proc.poll() is None:
            try:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
            except ProcessLookupError:
                pass
        if proc in self.running:
            self.running.remove(proc)

    def cleanup(self) -> None:
        """Stops everything still running (in reverse start order), removes the work directory."""
        # A second Ctrl-C must not interrupt the cleanup and leave processes behind.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for proc in self.running:
            if proc.poll() is None:
                try:
                    proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 5
        for proc in reversed(list(self.running)):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self.running.clear()
        if self.keep:
            self.log(f"kept {self.work}")
        else:
            shutil.rmtree(self.work, ignore_errors=True)

    # --- ports and readiness --------------------------------------------------------------
    def free_port(self, bus: bool = False) -> int:
        """A port on 127.0.0.1 that nothing uses now and that this run has not handed out.

        Chosen below the kernel's ephemeral range, so an outgoing connection (wrk's, a
        proxy's) cannot take it between this check and the server's bind. With BUS, port +
        10000 must be free too (a Redis Cluster node's bus port)."""
        ephemeral_low = 32768
        try:
            ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass
        low, high = (12000, ephemeral_low - 10001) if bus else (20000, ephemeral_low - 1)
        for _ in range(500):
            port = random.randint(low, high)
            wanted = [port, port + 10000] if bus else [port]
            if any(p in self.taken_ports for p in wanted):
                continue
            if all(_bindable(p) for p in wanted):
                self.taken_ports.update(wanted)
                return port
        raise Failure("no free port found on 127.0.0.1")

    def wait_listening(self, port: int, proc: subprocess.Popen, what: str,
                       timeout: float = 30.0) -> None:
        """Waits until 127.0.0.1:PORT accepts connections, while PROC lives."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise Failure(f"{what} exited during startup (status {proc.returncode}); "
                              f"see {self.work} (KEEP=1 keeps it)")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.1)
        raise Failure(f"{what} did not listen on 127.0.0.1:{port} within {timeout:.0f} s")


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def install_signal_handlers() -> None:
    """SIGTERM ends the driver like Ctrl-C does: through its finally blocks (the cleanup)."""
    def on_term(signum, frame):
        raise SystemExit(143)
    signal.signal(signal.SIGTERM, on_term)


# --- CPU time ---------------------------------------------------------------------------------
CLK_TCK = os.sysconf("SC_CLK_TCK")


def machine_ticks(names: Iterable[str]) -> dict[str, int]:
    """Clock ticks of CPU time so far: per command name in NAMES, `cpu_ticks` of every process
    of that name (`/proc/PID/comm`); "children", `waited_children_ticks` (wrk, once it has
    exited); "idle", the machine's idle time (`machine_cpu`). The differences of two readings
    split a run's CPUs' time among the processes that share them."""
    out = {name: 0 for name in names}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            comm = (entry / "comm").read_text().strip()
            if comm in out:
                out[comm] += cpu_ticks([int(entry.name)])
        except OSError:
            continue  # gone meanwhile
    out["children"] = round(waited_children_ticks())
    out["idle"] = machine_cpu()["idle"]
    return out


def cpu_ticks(pids: Sequence[int]) -> int:
    """utime + stime of the processes (all their threads), in clock ticks."""
    return sum(cpu_split(pids))


def sched_stats(pids: Sequence[int]) -> dict[int, tuple[int, int]]:
    """Per thread of the processes: nanoseconds spent runnable but waiting for a CPU (the second
    field of /proc/TID/schedstat), and involuntary context switches (preemptions). A proxy that
    is the bottleneck yet shows idle CPUs is being preempted on its own: these say so. Keyed by
    thread id, so that a thread gone between two readings (or born) is left out of the
    difference rather than making it negative."""
    out: dict[int, tuple[int, int]] = {}
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                wait = int((task / "schedstat").read_text().split()[1])
                status = (task / "status").read_text()
            except (OSError, IndexError, ValueError):
                continue  # the thread ended meanwhile, or the kernel keeps no schedstat
            switches = next((int(line.split()[1]) for line in status.splitlines()
                             if line.startswith("nonvoluntary_ctxt_switches:")), 0)
            out[int(task.name)] = (wait, switches)
    return out


def sched_delta(before: dict[int, tuple[int, int]],
                after: dict[int, tuple[int, int]]) -> tuple[int, int]:
    """(ns waiting for a CPU, preemptions) between two sched_stats readings, over the threads
    present in both."""
    wait = switches = 0
    for tid, (w1, s1) in after.items():
        if tid in before:
            w0, s0 = before[tid]
            wait += max(0, w1 - w0)
            switches += max(0, s1 - s0)
    return wait, switches


def cpu_split(pids: Sequence[int]) -> tuple[int, int]:
    """utime and stime of the processes (all their threads), in clock ticks: user space and
    kernel apart. A proxy on loopback spends most of its time in the kernel's socket work, which
    callgrind's instruction counts do not see; this is the figure that does."""
    user = system = 0
    for pid in pids:
        stat = Path(f"/proc/{pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2:].split()  # the command name may hold spaces
        user += int(fields[11])
        system += int(fields[12])
    return user, system


def busiest_thread_ns(pids: Sequence[int]) -> dict[int, int]:
    """Time on CPU, in ns, of every thread of the processes (`/proc/<pid>/task/<tid>/schedstat`).
    Taken before and after a run, the largest difference over the run's wall time says whether
    the proxy's one event-loop thread was saturated: when it is, that thread's CPU per request
    sets the proxy's req/s; when it is not, the machine's shared cores do."""
    out: dict[int, int] = {}
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                out[int(task.name)] = int((task / "schedstat").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                pass  # a thread that ended meanwhile, or a kernel without schedstats
    return out


def busiest_thread(before: dict[int, int], after: dict[int, int]) -> tuple[int, int] | None:
    """The thread that was on CPU longest between two `busiest_thread_ns` readings, and for how
    many ns; None if no thread was there for both."""
    deltas = [(t, after[t] - before[t]) for t in after if t in before]
    return max(deltas, key=lambda d: d[1]) if deltas else None


def busiest_share(before: dict[int, int], after: dict[int, int], wall_s: float) -> float | None:
    """The busiest thread's share of the wall time between two `busiest_thread_ns` readings."""
    busiest = busiest_thread(before, after)
    if busiest is None or wall_s <= 0:
        return None
    return busiest[1] / 1e9 / wall_s


def children_of(pid: int) -> list[int]:
    """Direct children of PID (an nginx master's workers, which do the work)."""
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            kids += [int(k) for k in task.read_text().split()]
        except OSError:
            pass
    return kids


def machine_cpu() -> dict[str, int]:
    """Machine-wide CPU ticks from /proc/stat.

    Busy = user + nice + system + irq + softirq: with tick-based accounting, a tick spent in an
    interrupt is charged both to the interrupted process and to the irq/softirq columns."""
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("cpu "):
            v = [int(x) for x in line.split()[1:9]]
            user, nice, system, idle, iowait, irq, softirq, steal = v
            return {"busy": user + nice + system + irq + softirq, "idle": idle + iowait,
                    "steal": steal, "total": sum(v)}
    raise Failure("no cpu line in /proc/stat")


def waited_children_ticks() -> float:
    """CPU time of the children this process has waited for (wrk, redis-benchmark), in ticks."""
    t = os.times()
    return (t.children_user + t.children_system) * CLK_TCK


def now_ms() -> float:
    return time.time() * 1000
