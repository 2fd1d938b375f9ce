"""scripts/bench-dwell: how long a request stays inside each proxy, read to send, per direction.

  scripts/bench-dwell      run and print a Markdown report

The open-loop latency of scripts/bench-latency is the sum of everything on the path: the load
generator, the backend, two loopback hops and the VM's wake-ups of idle CPUs, which on this
machine put several milliseconds into the direct path's own p99.9. What a proxy adds of its own
is the time between the system call that reads a request from the client and the one that sends
it to the backend, and between reading the backend's answer and sending it to the client. This
driver records the proxy's system calls with perf (`raw_syscalls` tracepoints of its process,
no sampling) while `oha` sends a fixed rate, and reports those two dwell times at p50, p90, p99
and p99.9, for an nginx proxy and sluice on a round-robin route, access logs on for both, one
worker or thread each (as scripts/bench sets them up). A dwell includes whatever else the
proxy's thread ran in between (other requests ready at the same moment) and the time it was
preempted: both are part of what the proxy adds. Tracing slows every system call by a few
microseconds, for both proxies alike.

A client socket is one the proxy accepted during the trace (oha connects once the trace has
started); every other socket it reads is a backend connection. Also reported: the system calls
per request of the proxy's process, by name.

Knobs (environment): RATES ("1000 5000"), DURATION (6s), CONNECTIONS (32), ROUNDS (1),
BUILD / SLUICE_BIN_DIR (the sluice binary, as in scripts/bench), SLUICE_BIN_DIR_B (a second
sluice, measured as a third target: an A/B of two builds), KEEP (0). Needs perf (Debian:
linux-perf), root or kernel.perf_event_paranoid <= 1, oha (`cargo install oha --locked`), nginx.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import time
from datetime import datetime, timezone
from typing import Optional

from . import common, stats, wrk
from .bench import Target, sluice_config, start_nginx_proxy
from .latency import oha_flags, oha_path
from .procs import Failure, Procs
from .servers import start_backends, start_sluice

KNOB_NAMES = ["RATES", "DURATION", "CONNECTIONS", "ROUNDS"]
READS = {0: "read", 19: "readv", 45: "recvfrom", 47: "recvmsg"}
SENDS = {1: "write", 20: "writev", 44: "sendto", 46: "sendmsg"}
NAMES = {**READS, **SENDS, 7: "poll", 28: "madvise", 43: "accept", 52: "getpeername", 55: "getsockopt",
         202: "futex", 230: "clock_nanosleep", 232: "epoll_wait", 233: "epoll_ctl", 281: "epoll_pwait",
         288: "accept4", 3: "close", 42: "connect", 41: "socket", 54: "setsockopt", 51: "getsockname",
         16: "ioctl", 9: "mmap", 11: "munmap", 10: "mprotect", 24: "sched_yield"}
LINE = re.compile(r"^\s*\S.*?\s+(\d+)\s+\[\d+\]\s+([\d.]+):\s+raw_syscalls:sys_(enter|exit):\s+NR (\d+)"
                  r"(?: \(([^)]*)\))?(?: = (-?\d+))?")
PCTS = (50, 90, 99, 99.9)


def dwell(script: str) -> dict:
    """Dwell times (µs) per direction and system calls per request, from `perf script` text."""
    pending: dict[str, tuple[int, int]] = {}   # tid -> (nr, fd) of the call in progress
    clients: set[int] = set()
    last_read: dict[str, tuple[float, int]] = {}  # tid -> (time, fd) of its last read with data
    req: list[float] = []
    resp: list[float] = []
    calls: dict[int, int] = {}
    for line in script.splitlines():
        m = LINE.match(line)
        if not m:
            continue
        tid, t, kind, nr, args, ret = m.group(1), float(m.group(2)), m.group(3), int(m.group(4)), m.group(5), m.group(6)
        if kind == "enter":
            fd = int(args.split(",")[0], 16) if args else -1
            pending[tid] = (nr, fd)
            if nr in SENDS and nr != 1 and tid in last_read:
                t0, rfd = last_read[tid]
                if fd != rfd and (rfd in clients) != (fd in clients):
                    (req if rfd in clients else resp).append((t - t0) * 1e6)
                    del last_read[tid]
            continue
        nr0, fd = pending.pop(tid, (None, -1))
        if nr0 is None:
            continue
        calls[nr0] = calls.get(nr0, 0) + 1
        n = int(ret) if ret is not None else -1
        if nr0 in (43, 288) and n >= 0:
            clients.add(n)
        elif nr0 == 3:
            clients.discard(fd)
        elif nr0 in READS and n > 0:
            last_read[tid] = (t, fd)
    return {"req": req, "resp": resp, "calls": calls}


def pct(values: list[float], p: float) -> Optional[float]:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(p / 100 * len(v)))]


def measure(procs: Procs, oha: str, flags: list[str], t: Target, host: Optional[str], pid: int,
            rate: int, conns: int, duration: str, tag: str) -> dict:
    data = procs.work / f"sys-{tag}.data"
    seconds = wrk.seconds(duration)
    perf = procs.start(["perf", "record", "-q", "-e", "raw_syscalls:sys_enter,raw_syscalls:sys_exit",
                        "-p", str(pid), "-o", str(data), "--", "sleep", str(seconds + 3)])
    time.sleep(1.0)  # perf attached before oha connects, so the accepts are in the trace
    out = procs.run([oha, "-z", duration, "-w", "-c", str(conns), "-q", str(rate), "--latency-correction",
                     *flags, *(["--host", host] if host else []), f"http://127.0.0.1:{t.port}/"],
                    timeout=seconds + 120)
    perf.wait(timeout=seconds + 60)
    script = subprocess.run(["perf", "script", "-i", str(data)], capture_output=True, text=True,
                            timeout=600).stdout
    row = dwell(script)
    j = json.loads(out)
    row["ok"] = int((j.get("statusCodeDistribution") or {}).get("200", 0))
    p = j.get("latencyPercentiles") or {}
    row["oha"] = {k: (p[k] * 1e6 if p.get(k) is not None else None) for k in ("p50", "p99", "p99.9")}
    if not row["ok"] or not row["req"]:
        raise Failure(f"{t.label}: no request traced ({row['ok']} answered 200); is perf allowed?")
    return row


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="scripts/bench-dwell", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args(argv)
    knobs = common.Knobs()
    rates = [int(r) for r in knobs.str("RATES", "1000 5000").split() if r.isdigit() and int(r) > 0]
    if not rates:
        raise Failure("RATES must hold positive integers")
    duration = knobs.str("DURATION", "6s")
    wrk.seconds(duration)
    conns = knobs.int("CONNECTIONS", 32, minimum=1)
    rounds = knobs.int("ROUNDS", 1, minimum=1)
    keep = knobs.choice("KEEP", "0", ("0", "1")) == "1"
    common.require("bench-dwell", ["perf", "nginx", "curl"], "sudo apt-get install -y linux-perf nginx-light curl")
    oha = oha_path()
    out_flags, no_tui = oha_flags(oha)
    procs = Procs("bench-dwell", keep)
    try:
        bins = common.sluice_binaries("bench-dwell", knobs, "sluice", "sluice, round_robin (JSON access log on)")
        backends = start_backends(procs)
        nginx = start_nginx_proxy(procs, "nginx_on", backends, log_on=True)
        nginx.label = "nginx proxy (access_log on)"
        # (target, pid whose calls are traced, Host header)
        targets: dict[str, tuple[Target, int, Optional[str]]] = {"nginx": (nginx, nginx.pids[-1], None)}
        for key, label, path in bins:
            cfg, port, admin = sluice_config(procs, key, backends, 1)
            s = start_sluice(procs, path, key, cfg, port, admin, None)
            targets[key] = (Target(key, label, port, [s.pid]), s.pid, None)
        res: dict[tuple[str, int, int], dict] = {}
        for r in range(1, rounds + 1):
            for i, rate in enumerate(rates):
                for key in stats.order_of(r + i, list(targets)):
                    t, pid, host = targets[key]
                    row = res[key, rate, r] = measure(procs, oha, [*no_tui, *out_flags], t, host, pid, rate,
                                                      conns, duration, f"{key}-{rate}-{r}")
                    procs.log(f"round {r} {rate} req/s {key}: request dwell p50 {pct(row['req'], 50):.0f} µs, "
                              f"answer p50 {pct(row['resp'], 50):.0f} µs, {len(row['req'])} traced")
        command = f"{knobs.line(KNOB_NAMES)} {common.bin_dirs()}scripts/bench-dwell"
        print(report(targets, res, rates, rounds, command, conns, duration))
    finally:
        procs.cleanup()
    return 0


def report(targets: dict, res: dict, rates: list[int], rounds: int, command: str, conns: int,
           duration: str) -> str:
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    out = [
        f"Run on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, sluice {common.git_revision()}, "
        f"`nproc` = {common.nproc()}, {os.uname().release}, {common.nginx_version()}; load average at the "
        f"end {load}.",
        "",
        "```sh",
        command,
        "```",
        "",
        f"`oha -q RATE -c {conns} -z {duration} --latency-correction` while perf traces the proxy's system "
        f"calls; {rounds} round(s), the last shown. Dwell: µs from the read of a request (or answer) to its "
        "send onward.",
        "",
        "| rate | proxy | request dwell p50 / p90 / p99 / p99.9 | answer dwell p50 / p90 / p99 / p99.9 | oha p50 / p99 / p99.9 (traced) | system calls per request |",
        "|---:|---|---|---|---|---|",
    ]
    for rate in rates:
        for key, (t, _, _) in targets.items():
            row = res.get((key, rate, rounds))
            if not row:
                continue
            d = lambda v: " / ".join(stats.fmt(pct(v, p), ".0f") for p in PCTS)  # noqa: E731
            per = ", ".join(f"{NAMES.get(nr, str(nr))} {n / row['ok']:.2f}"
                            for nr, n in sorted(row["calls"].items(), key=lambda x: -x[1]) if n / row["ok"] >= 0.05)
            o = row["oha"]
            out.append(f"| {rate} | {t.label} | {d(row['req'])} | {d(row['resp'])} | "
                       f"{' / '.join(stats.fmt(o[k], '.0f') for k in ('p50', 'p99', 'p99.9'))} | {per} |")
    return "\n".join(out)
