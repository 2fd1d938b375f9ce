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

With QLU=1, a third sluice target serves a quota + least_used route on a local Redis (batched
calls, as scripts/bench-latency's qlu), and the trace follows redis-server's system calls too, so
that the store's part of a request splits into what each side did. For each call that leaves
sluice for Redis:
  to the store    a request's read from its client to the send of the call that decides it
                  (the requests read since the call before; waiting for a call out included);
  to Redis        sluice's send to Redis's read of it: Redis waking up, or busy with another;
  in Redis        Redis's read to its reply's write: the script and the command's own work;
  back            Redis's write to sluice's read of the reply: sluice waking up, or busy;
  from the store  the last reply's read to each send of a request to a backend after it.
The sockets between sluice and Redis are told apart by their ports (/proc/PID/fd and
/proc/net/tcp) before the trace starts.

Knobs (environment): RATES ("1000 5000"), DURATION (6s), CONNECTIONS (32), ROUNDS (1),
BUILD / SLUICE_BIN_DIR (the sluice binary, as in scripts/bench), SLUICE_BIN_DIR_B (a second
sluice, measured as a third target: an A/B of two builds), QLU (0; 1 adds the Redis route),
KEEP (0). Needs redis-server with QLU=1, and perf (Debian:
linux-perf), root or kernel.perf_event_paranoid <= 1, oha (`cargo install oha --locked`), nginx.
"""

from __future__ import annotations

import argparse
import bisect
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
from .servers import start_backends, start_redis, start_sluice, wait_ok
from .staterun import QUOTA_YAML

KNOB_NAMES = ["RATES", "DURATION", "CONNECTIONS", "ROUNDS", "QLU"]
READS = {0: "read", 19: "readv", 45: "recvfrom", 47: "recvmsg"}
SENDS = {1: "write", 20: "writev", 44: "sendto", 46: "sendmsg"}
NAMES = {**READS, **SENDS, 7: "poll", 28: "madvise", 43: "accept", 52: "getpeername", 55: "getsockopt",
         202: "futex", 230: "clock_nanosleep", 232: "epoll_wait", 233: "epoll_ctl", 281: "epoll_pwait",
         288: "accept4", 3: "close", 42: "connect", 41: "socket", 54: "setsockopt", 51: "getsockname",
         16: "ioctl", 9: "mmap", 11: "munmap", 10: "mprotect", 24: "sched_yield"}
LINE = re.compile(r"^\s*\S.*?\s+(\d+)\s+\[\d+\]\s+([\d.]+):\s+raw_syscalls:sys_(enter|exit):\s+NR (\d+)"
                  r"(?: \(([^)]*)\))?(?: = (-?\d+))?")
PCTS = (50, 90, 99, 99.9)


def dwell(script: str, skip: frozenset = frozenset(), tids: Optional[set] = None) -> dict:
    """Dwell times (µs) per direction and system calls per request, from `perf script` text:
    the calls of threads `tids` (None: every thread), sockets `skip` (the store's) left out."""
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
        if tids is not None and tid not in tids:
            continue
        if kind == "enter":
            fd = int(args.split(",")[0], 16) if args else -1
            pending[tid] = (nr, fd)
            if fd in skip:
                continue
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
        elif nr0 in READS and n > 0 and fd not in skip:
            last_read[tid] = (t, fd)
    return {"req": req, "resp": resp, "calls": calls}


def events(script: str, tids: set) -> list[tuple[float, str, int, int, int]]:
    """The completed system calls of threads `tids`: (time of exit, tid, nr, fd, result), in order;
    a send's time is its entry's (the bytes are on their way from then)."""
    pending: dict[str, tuple[int, int, float]] = {}
    out = []
    for line in script.splitlines():
        m = LINE.match(line)
        if not m or m.group(1) not in tids:
            continue
        tid, t, kind, nr, args, ret = m.group(1), float(m.group(2)), m.group(3), int(m.group(4)), m.group(5), m.group(6)
        if kind == "enter":
            pending[tid] = (nr, int(args.split(",")[0], 16) if args else -1, t)
            continue
        nr0, fd, t0 = pending.pop(tid, (None, -1, 0.0))
        if nr0 is not None:
            out.append((t0 if nr0 in SENDS else t, tid, nr0, fd, int(ret) if ret is not None else -1))
    # In time order: a send is stamped at its entry but completes later, after calls of other
    # threads may have.
    out.sort(key=lambda e: e[0])
    return out


def store_legs(script: str, sluice_tids: set, redis_tids: set, sluice_fds: frozenset,
               redis_fds: frozenset) -> dict:
    """The store's part of each request (µs): the five legs the docstring names, from the two
    processes' system calls. A call is a send of sluice's on a store socket; its legs end at the
    first matching event after it (Redis's read of it, Redis's reply, sluice's read of that)."""
    s_ev, r_ev = events(script, sluice_tids), events(script, redis_tids)
    r_reads = [t for t, _, nr, fd, n in r_ev if nr in READS and fd in redis_fds and n > 0]
    r_writes = [t for t, _, nr, fd, n in r_ev if nr in SENDS and fd in redis_fds and n > 0]
    s_reads = [t for t, _, nr, fd, n in s_ev if nr in READS and fd in sluice_fds and n > 0]
    clients: set[int] = set()
    legs: dict[str, list[float]] = {k: [] for k in ("to_store", "to_redis", "in_redis", "back", "from_store", "round_trip")}
    waiting: list[float] = []     # reads of client requests since the last call left
    reply: Optional[float] = None  # the last read of a reply

    def after(times: list[float], t: float) -> Optional[float]:
        i = bisect.bisect_left(times, t)
        return times[i] if i < len(times) else None

    for t, _, nr, fd, n in s_ev:
        if nr in (43, 288) and n >= 0:
            clients.add(n)
        elif nr == 3:
            clients.discard(fd)
        elif nr in READS and n > 0 and fd in clients:
            waiting.append(t)
        elif nr in SENDS and fd in sluice_fds:
            legs["to_store"].extend((t - w) * 1e6 for w in waiting)
            waiting = []
            r1 = after(r_reads, t)
            w1 = after(r_writes, r1) if r1 is not None else None
            s2 = after(s_reads, w1) if w1 is not None else None
            if s2 is not None:
                legs["to_redis"].append((r1 - t) * 1e6)
                legs["in_redis"].append((w1 - r1) * 1e6)
                legs["back"].append((s2 - w1) * 1e6)
                legs["round_trip"].append((s2 - t) * 1e6)
        elif nr in READS and n > 0 and fd in sluice_fds:
            reply = t
        elif nr in SENDS and nr != 1 and fd not in clients and fd not in sluice_fds and reply is not None:
            # A request sent on to a backend, timed from the last reply read before it (a later
            # reply's requests are timed from that one). `write` is an eventfd's wake-up or a
            # log's, never a request.
            legs["from_store"].append((t - reply) * 1e6)
    return legs


def tcp_sockets(pid: int) -> dict[int, tuple[int, int]]:
    """The TCP sockets of process `pid` over IPv4: fd -> (local port, remote port)."""
    inodes: dict[str, tuple[int, int]] = {}
    for line in open(f"/proc/{pid}/net/tcp").read().splitlines()[1:]:
        f = line.split()
        inodes[f[9]] = (int(f[1].split(":")[1], 16), int(f[2].split(":")[1], 16))
    out = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:[") and link[8:-1] in inodes:
            out[int(fd)] = inodes[link[8:-1]]
    return out


def threads(pid: int) -> set:
    return set(os.listdir(f"/proc/{pid}/task"))


def pct(values: list[float], p: float) -> Optional[float]:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(p / 100 * len(v)))]


def measure(procs: Procs, oha: str, flags: list[str], t: Target, host: Optional[str], pid: int,
            rate: int, conns: int, duration: str, tag: str, store: Optional[tuple[int, int]] = None) -> dict:
    """One traced run of `oha` at `rate`; `store`: (redis-server's pid, its port) for a target
    whose route calls Redis, traced too."""
    data = procs.work / f"sys-{tag}.data"
    seconds = wrk.seconds(duration)
    traced = str(pid) if store is None else f"{pid},{store[0]}"
    skip, legs_of = frozenset(), None
    if store is not None:
        rpid, rport = store
        mine = {fd: ports for fd, ports in tcp_sockets(pid).items() if ports[1] == rport}
        local = {ports[0] for ports in mine.values()}
        theirs = frozenset(fd for fd, (lp, remote) in tcp_sockets(rpid).items() if lp == rport and remote in local)
        if not mine or not theirs:
            raise Failure(f"{t.label}: no connection between sluice and Redis found in /proc")
        skip = frozenset(mine)
        legs_of = (threads(pid), threads(rpid), skip, theirs)
    perf = procs.start(["perf", "record", "-q", "-e", "raw_syscalls:sys_enter,raw_syscalls:sys_exit",
                        "-p", traced, "-o", str(data), "--", "sleep", str(seconds + 3)])
    time.sleep(1.0)  # perf attached before oha connects, so the accepts are in the trace
    out = procs.run([oha, "-z", duration, "-w", "-c", str(conns), "-q", str(rate), "--latency-correction",
                     *flags, *(["--host", host] if host else []), f"http://127.0.0.1:{t.port}/"],
                    timeout=seconds + 120)
    perf.wait(timeout=seconds + 60)
    script = subprocess.run(["perf", "script", "-i", str(data)], capture_output=True, text=True,
                            timeout=600).stdout
    row = dwell(script, skip, None if legs_of is None else legs_of[0])
    if legs_of is not None:
        row["legs"] = store_legs(script, *legs_of)
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
    qlu = knobs.choice("QLU", "0", ("0", "1")) == "1"
    if qlu:
        common.require("bench-dwell", ["redis-server"], "sudo apt-get install -y redis-server")
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
        store: Optional[tuple[int, int]] = None
        if qlu:
            # One Redis; each build's process serves the route in turn, on the same keys.
            rport = procs.free_port()
            redis = start_redis(procs, "redis", rport)
            store = (redis.pid, rport)
            for key, label, path in bins:
                q = key.replace("sluice", "qlu", 1)
                port, admin = procs.free_port(), procs.free_port()
                cfg = procs.work / f"conf-{q}" / "sluice.yaml"
                cfg.parent.mkdir(parents=True)
                cfg.write_text(
                    f'listen: ["127.0.0.1:{port}"]\nthreads: 1\nadmin:\n  listen: "127.0.0.1:{admin}"\n'
                    f'state:\n  backend: redis\n  redis:\n    url: "redis://127.0.0.1:{rport}/0"\nroutes:\n'
                    + backends.route_yaml("qlu", "least_used", "qlu.bench") + QUOTA_YAML)
                s = start_sluice(procs, path, q, cfg, port, admin, None)
                wait_ok(f"http://127.0.0.1:{port}/", "qlu.bench", f"route qlu ({q})")
                name = label.split(",")[0].split(" (")[0]
                targets[q] = (Target(q, f"{name}, quota + least_used on Redis (JSON access log on)", port, [s.pid]),
                              s.pid, "qlu.bench")
        res: dict[tuple[str, int, int], dict] = {}
        for r in range(1, rounds + 1):
            for i, rate in enumerate(rates):
                for key in stats.order_of(r + i, list(targets)):
                    t, pid, host = targets[key]
                    row = res[key, rate, r] = measure(procs, oha, [*no_tui, *out_flags], t, host, pid, rate,
                                                      conns, duration, f"{key}-{rate}-{r}",
                                                      store if key.startswith("qlu") else None)
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
    legs = [(rate, targets[key][0].label.split(",")[0], res[key, rate, rounds]["legs"]) for rate in rates
            for key in targets if "legs" in res.get((key, rate, rounds), {})]
    if legs:
        out += [
            "",
            "The Redis route's store part, from sluice's and redis-server's system calls (µs, p50 / p90 / p99 / "
            "p99.9; the docstring of scripts/sluicebench/dwell.py defines each leg). Its request dwell above is "
            "the request read last before each send to a backend, so the legs are the figure to read.",
            "",
            "| rate | build | calls | requests a call | to the store | to Redis | in Redis | back | round trip | from the store |",
            "|---:|---|---:|---:|---|---|---|---|---|---|",
        ]
        for rate, build, lg in legs:
            d = lambda v: " / ".join(stats.fmt(pct(v, p), ".0f") for p in PCTS)  # noqa: E731
            n = len(lg["round_trip"])
            per = len(lg["to_store"]) / n if n else 0
            out.append(f"| {rate} | {build} | {n} | {per:.2f} | {d(lg['to_store'])} | {d(lg['to_redis'])} | "
                       f"{d(lg['in_redis'])} | {d(lg['back'])} | {d(lg['round_trip'])} | {d(lg['from_store'])} |")
    return "\n".join(out)
