"""scripts/perf-split: where each proxy's event-loop thread spends a request, the kernel included.

  scripts/perf-split       run and print a Markdown table

callgrind (scripts/profile) counts user-space instructions only, and on loopback most of a
proxy's time is the kernel's. This runs nginx, HAProxy and sluice, all three with their access
logs on, as scripts/bench sets them up (two nginx backends, one worker or thread each), and for
each reports per request: the CPU of its busiest thread (which is the event loop), split into
user and kernel; what `perf` samples of that thread put in sending, in waking the peer the send
is for, in receiving and in `epoll_wait`; and how many sleeping tasks the proxy woke.

A send on loopback runs the receiver's side of TCP in the sender's system call, and wakes the
receiver if it sleeps. On a VM whose idle CPUs halt, waking a task on the other CPU costs an
inter-processor interrupt and a hypervisor exit, which is why the wake-ups are counted.

Knobs (environment): ROUNDS (2), DURATION (6s), CONNECTIONS (64), WRK_THREADS (2), WARMUP (2s),
BUILD / SLUICE_BIN_DIR (the sluice binary, as in scripts/bench), SLUICE_BIN_DIR_B (a second
sluice binary, measured as a fourth target next to the first: an A/B of two builds), KEEP (0).
Needs `perf` (Debian: linux-perf) for everything but the CPU split, and root or
kernel.perf_event_paranoid <= 1 for its scheduler tracepoints; without it those columns read -.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import time
from datetime import datetime, timezone
from typing import Optional

from . import common, stats, wrk
from .bench import Target, sluice_config, start_haproxy, start_nginx_proxy
from .procs import CLK_TCK, Failure, Procs, busiest_thread, busiest_thread_ns, cpu_split
from .servers import start_backends, start_sluice

KNOB_NAMES = ["ROUNDS", "DURATION", "CONNECTIONS", "WRK_THREADS", "WARMUP"]

# What the sampled thread's time is grouped into: perf's inclusive ("children") share of each
# kernel symbol. TCP's own entry points, not the system calls', since nginx writes with
# `writev`, HAProxy and tokio with `sendto`: every one of them ends in `tcp_sendmsg`.
SEND = ("tcp_sendmsg",)
RECV = ("tcp_recvmsg",)
WAKE = ("sock_def_readable",)
EPOLL = ("__x64_sys_epoll_wait", "__x64_sys_epoll_pwait")


def perf_ok() -> bool:
    return shutil.which("perf") is not None


def children_shares(report: str) -> dict[str, float]:
    """symbol -> inclusive share (%) from `perf report --children --sort sym -g none --stdio`."""
    out: dict[str, float] = {}
    for m in re.finditer(r"^\s+([\d.]+)%\s+[\d.]+%\s+\[([k.])\]\s+(\S+)", report, re.M):
        out.setdefault(m.group(3), float(m.group(1)))
    return out


def kernel_share(report: str) -> Optional[float]:
    """The kernel's share (%) from `perf report --sort dso -g none --stdio`."""
    m = re.search(r"^\s+([\d.]+)%\s+\[kernel\.kallsyms\]", report, re.M)
    return float(m.group(1)) if m else None


def measure(procs: Procs, t: Target, base: list[str], duration: str, warmup: str,
            use_perf: bool, r: int) -> dict:
    url = f"http://127.0.0.1:{t.port}/"
    wrk.run(procs, url, base, warmup, latency=False)
    # Run 1: the CPU split, the busiest thread, and (perf stat) the wake-ups the proxy caused.
    cpu0, threads0 = cpu_split(t.pids), busiest_thread_ns(t.pids)
    argv = ["wrk", *base, f"-d{duration}", url]
    stat_file = procs.work / f"perf-stat-{t.key}-{r}.txt"
    if use_perf:
        argv = ["perf", "stat", "-e", "sched:sched_waking", "-p", ",".join(map(str, t.pids)),
                "-x,", "-o", str(stat_file), "--", *argv]
    out = wrk.parse(procs.run(argv, timeout=wrk.seconds(duration) + 60))
    cpu1, threads1 = cpu_split(t.pids), busiest_thread_ns(t.pids)
    busiest = busiest_thread(threads0, threads1)
    if busiest is None:
        raise Failure(f"{t.label}: no thread of PIDs {t.pids} lived through the run")
    tid, busiest_ns = busiest
    wall = out.requests / out.rps
    row = {"rps": out.rps, "thread": busiest_ns / 1e3 / out.requests,
           "busy": 100 * busiest_ns / 1e9 / wall,
           "user": (cpu1[0] - cpu0[0]) / CLK_TCK * 1e6 / out.requests,
           "kernel": (cpu1[1] - cpu0[1]) / CLK_TCK * 1e6 / out.requests,
           "wakeups": None, "send": None, "wake": None, "recv": None, "epoll": None,
           "k_share": None}
    if not use_perf:
        return row
    m = re.search(r"^([\d.]+),,sched:sched_waking", stat_file.read_text(), re.M)
    if m:
        row["wakeups"] = float(m.group(1)) / out.requests
    # Run 2: perf's samples of that thread, in the middle of a run of the same length.
    data = procs.work / f"perf-{t.key}-{r}.data"
    seconds = wrk.seconds(duration)
    # Started through Procs, like every process a driver runs, so that Ctrl-C stops it too.
    load = procs.start(["wrk", *base, f"-d{duration}", url])
    try:
        time.sleep(min(1.0, seconds / 4))  # let wrk connect: the samples are of steady state
        procs.run(["perf", "record", "-q", "-e", "cpu-clock", "-F", "1999", "-g", "-t", str(tid),
                   "-o", str(data), "--", "sleep", str(max(1.0, seconds - 2))],
                  timeout=seconds + 60)
        load.wait(timeout=seconds + 60)
    finally:
        procs.stop(load)
    report = procs.run(["perf", "report", "-i", str(data), "--children", "--sort", "sym",
                        "-g", "none", "--stdio"], timeout=120)
    dsos = procs.run(["perf", "report", "-i", str(data), "--no-children", "--sort", "dso",
                      "-g", "none", "--stdio"], timeout=120)
    shares = children_shares(report)

    def us(names: tuple[str, ...]) -> float:
        return sum(shares.get(n, 0.0) for n in names) / 100 * row["thread"]

    row.update(send=us(SEND), wake=us(WAKE), recv=us(RECV), epoll=us(EPOLL),
               k_share=kernel_share(dsos))
    return row


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="scripts/perf-split", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args(argv)
    knobs = common.Knobs()
    rounds = knobs.int("ROUNDS", 2, minimum=1)
    duration = knobs.str("DURATION", "6s")
    connections = knobs.int("CONNECTIONS", 64, minimum=1)
    wrk_threads = knobs.int("WRK_THREADS", 2, minimum=1)
    warmup = knobs.str("WARMUP", "2s")
    keep = knobs.choice("KEEP", "0", ("0", "1")) == "1"
    wrk.seconds(duration), wrk.seconds(warmup)
    common.require("perf-split", ["wrk", "nginx", "haproxy"],
                   "sudo apt-get install -y wrk nginx-light haproxy linux-perf")
    use_perf = perf_ok()
    procs = Procs("perf-split", keep)
    try:
        if not use_perf:
            procs.log("warning: no perf (Debian: linux-perf); only the CPU split is measured")
        bins = common.sluice_binaries("perf-split", knobs, "sluice_on", "sluice")
        backends = start_backends(procs)
        targets = {"nginx_on": start_nginx_proxy(procs, "nginx_on", backends, log_on=True),
                   "haproxy_on": start_haproxy(procs, "haproxy_on", backends, log_on=True)}
        for key, label, path in bins:
            cfg, port, admin = sluice_config(procs, key, backends, 1)
            s = start_sluice(procs, path, key, cfg, port, admin, None)
            targets[key] = Target(key, f"{label} (JSON access log on)", port, [s.pid])
        targets["nginx_on"].label = "nginx (access_log on)"
        targets["haproxy_on"].label = "HAProxy (option httplog on)"
        base = wrk.args(wrk_threads, connections)
        res: dict[tuple[str, int], dict] = {}
        for r in range(1, rounds + 1):
            for key in stats.order_of(r, list(targets)):
                res[key, r] = row = measure(procs, targets[key], base, duration, warmup,
                                            use_perf, r)
                procs.log(f"round {r} {key}: {row['rps']:.0f} req/s, thread "
                          f"{row['thread']:.1f} µs/req ({row['busy']:.0f}% busy), wake-ups "
                          f"{stats.fmt(row['wakeups'], '.2f')}/req")
        command = f"{knobs.line(KNOB_NAMES)} {common.bin_dirs()}scripts/perf-split"
        print(report(targets, res, rounds, command, duration, connections, wrk_threads))
    finally:
        procs.cleanup()
    return 0


def report(targets: dict[str, Target], res: dict, rounds: int, command: str, duration: str,
           connections: int, wrk_threads: int) -> str:
    def med(key: str, what: str) -> Optional[float]:
        return stats.median(res[key, r][what] for r in range(1, rounds + 1))

    out = [
        f"Run on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, sluice {common.git_revision()}, "
        f"`nproc` = {common.nproc()}, {os.uname().release}, {common.nginx_version()}, "
        f"{common.haproxy_version()}.",
        "",
        "```sh",
        command,
        "```",
        "",
        f"`wrk -t{wrk_threads} -c{connections} -d{duration}`, {rounds} rounds; medians. µs per request "
        "of the proxy's busiest thread (its event loop).",
        "",
        "| proxy | req/s | thread µs/req | busy | user | kernel | kernel share (perf) | in sends | of it waking the peer | in receives | in `epoll_wait` | tasks woken / req |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key, t in targets.items():
        ks = med(key, "k_share")
        out.append(
            f"| {t.label} | {stats.fmt(med(key, 'rps'))} | {stats.fmt(med(key, 'thread'), '.1f')} "
            f"| {stats.fmt(med(key, 'busy'))}% | {stats.fmt(med(key, 'user'), '.1f')} "
            f"| {stats.fmt(med(key, 'kernel'), '.1f')} | {stats.fmt(ks, '.0f')}{'' if ks is None else '%'} "
            f"| {stats.fmt(med(key, 'send'), '.1f')} | {stats.fmt(med(key, 'wake'), '.1f')} "
            f"| {stats.fmt(med(key, 'recv'), '.1f')} | {stats.fmt(med(key, 'epoll'), '.1f')} "
            f"| {stats.fmt(med(key, 'wakeups'), '.2f')} |")
    out += [
        "",
        "- user / kernel: utime and stime of the whole process (`/proc/<pid>/stat`) per request.",
        "- kernel share, sends, waking, receives, `epoll_wait`: `perf record -e cpu-clock -g` of the busiest",
        "  thread in a second run: perf's inclusive share of `tcp_sendmsg`, of `sock_def_readable` (the",
        "  receiver's wake-up, which runs inside the send), of `tcp_recvmsg` and of `epoll_wait`, times the",
        "  thread's µs per request.",
        "- tasks woken: `perf stat -e sched:sched_waking -p PID` over the first run, per request: how often",
        "  one of the proxy's sends (or anything else it did) found a task asleep and woke it.",
    ]
    return "\n".join(out)
