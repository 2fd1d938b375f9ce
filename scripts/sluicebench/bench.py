"""scripts/bench: wrk against sluice, nginx and HAProxy as reverse proxies, and a backend hit directly.

  scripts/bench            run and print a Markdown table
  scripts/bench --write    also replace the wrk section of docs/benchmark-runs.md with it

Knobs (environment): ROUNDS (3), DURATION (10s), CONNECTIONS (64), WRK_THREADS (2),
WARMUP (2s), SLUICE_THREADS (1), CLIENTS (off | header | basic: sluice with a `clients` section in
enforce mode, and every target sent that client's Basic Proxy-Authorization; `header` sends
it with no clients), BUILD (1; 0 uses ${CARGO_TARGET_DIR:-target}/release as it is),
SLUICE_BIN_DIR (a directory holding a release sluice; no build), KEEP (0; 1 keeps the work
directory with configs, logs and wrk outputs), DOC (docs/benchmark-runs.md: the file --write
rewrites).

Everything runs on 127.0.0.1: two nginx backends answering a fixed "ok\\n"; nginx and HAProxy
as reverse proxies over both (one worker / one thread, upstream keepalive); and sluice over
both. Each proxy runs twice, as two processes: with its access log off, and with it on, written
to a file (nginx `access_log`, HAProxy `option httplog` to stdout appended to a file, sluice's
JSON access log on stderr appended to a file). Each round runs every target once, in a
different order; figures are medians over rounds and ratios are taken within a round, since
the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from . import common, doc, stats, wrk
from .procs import (CLK_TCK, Failure, Procs, busiest_share, busiest_thread_ns, children_of,
                    cpu_split, cpu_ticks, machine_cpu, waited_children_ticks)
from .servers import Backends, start_backends, start_nginx, start_sluice, nginx_has_stub_status

START_MARK = "<!-- bench:wrk:start -->"
END_MARK = "<!-- bench:wrk:end -->"
KNOB_NAMES = ["ROUNDS", "DURATION", "CONNECTIONS", "WRK_THREADS", "WARMUP", "SLUICE_THREADS", "CLIENTS"]


@dataclass
class Target:
    key: str
    label: str
    port: int
    pids: list[int] = field(default_factory=list)  # whose CPU a run is charged to (the proxy)
    log: Optional[Path] = None  # the access log to check against wrk's request count
    log_needle: Optional[bytes] = None  # a log line counts if it holds this (None: every line)


def with_workers(master: int) -> list[int]:
    """An nginx master and its worker. The master can accept connections before it has forked
    the worker, so wait (boundedly) for the worker to exist."""
    for _ in range(50):
        kids = children_of(master)
        if kids:
            return [master, *kids]
        time.sleep(0.1)
    raise Failure(f"nginx master {master} has no worker process")


def count_lines(path: Path, needle: Optional[bytes]) -> int:
    n = 0
    with open(path, "rb") as f:
        for line in f:
            if needle is None or needle in line:
                n += 1
    return n


# --- the proxies ------------------------------------------------------------------------------
def start_nginx_proxy(procs: Procs, name: str, backends: Backends, log_on: bool) -> Target:
    port = procs.free_port()
    log = procs.work / name / "access.log"
    proc = start_nginx(procs, name, port, f"""  access_log {log if log_on else "off"};
  upstream backends {{
    server 127.0.0.1:{backends.ports[0]};
    server 127.0.0.1:{backends.ports[1]};
    keepalive 128;
    keepalive_requests 10000000;
    keepalive_timeout 300s;
  }}
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    location / {{
      proxy_pass http://backends;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
    }}
  }}""")
    # The master and its worker: the worker does the work, the master is charged for little,
    # but both are the proxy.
    label = "nginx proxy (access_log on)" if log_on else "nginx proxy (access_log off)"
    return Target(name, label, port, with_workers(proc.pid), log if log_on else None)


def start_haproxy(procs: Procs, name: str, backends: Backends, log_on: bool) -> Target:
    port = procs.free_port()
    dir = procs.work / name
    dir.mkdir(parents=True, exist_ok=True)
    conf = dir / "haproxy.cfg"
    # `log stdout format raw`: one line per request on stdout, which is appended to a file
    # (like sluice's stderr); with the log off there is no `log` line at all.
    log_global = "  log stdout format raw local0 info\n" if log_on else ""
    log_defaults = "  log global\n  option httplog\n" if log_on else ""
    conf.write_text(f"""global
  nbthread 1
  maxconn 4096
{log_global}
defaults
  mode http
{log_defaults}  option http-keep-alive
  http-reuse always
  timeout connect 5s
  timeout client 300s
  timeout server 300s
  timeout http-keep-alive 300s

frontend fe
  bind 127.0.0.1:{port}
  default_backend be

backend be
  balance roundrobin
  server b1 127.0.0.1:{backends.ports[0]}
  server b2 127.0.0.1:{backends.ports[1]}
""")
    procs.run(["haproxy", "-c", "-q", "-f", str(conf)], timeout=30)  # fails with haproxy's alerts
    log = dir / "access.log"
    # -db: stay in the foreground, one process (no master-worker), so its PID is the proxy's.
    proc = procs.start(["haproxy", "-db", "-f", str(conf)], out=log)
    procs.wait_listening(port, proc, f"haproxy ({name})")
    label = "HAProxy (option httplog on)" if log_on else "HAProxy (no log)"
    return Target(name, label, port, [proc.pid], log if log_on else None)


def sluice_config(procs: Procs, name: str, backends: Backends, threads: int,
                  clients: str = "off") -> tuple[Path, int, int]:
    port, admin = procs.free_port(), procs.free_port()
    # Config and logs in different directories: sluice watches its config's directory.
    cfg = procs.work / "conf" / f"{name}.yaml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text(f"""listen: ["127.0.0.1:{port}"]
threads: {threads}
admin:
  listen: "127.0.0.1:{admin}"
{common.clients_yaml(clients)}{backends.round_robin_routes_yaml()}""")
    return cfg, port, admin


# --- the run ----------------------------------------------------------------------------------
def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="scripts/bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true",
                        help="replace the wrk section of docs/benchmark-runs.md with the report")
    opts = parser.parse_args(argv)

    knobs = common.Knobs()
    rounds = knobs.int("ROUNDS", 3, minimum=1)
    duration = knobs.str("DURATION", "10s")
    connections = knobs.int("CONNECTIONS", 64, minimum=1)
    wrk_threads = knobs.int("WRK_THREADS", 2, minimum=1)
    warmup = knobs.str("WARMUP", "2s")
    sluice_threads = knobs.int("SLUICE_THREADS", 1, minimum=1)
    clients = knobs.choice("CLIENTS", "off", ("off", "header", "basic"))
    keep = knobs.choice("KEEP", "0", ("0", "1")) == "1"
    doc_path = Path(knobs.str("DOC", str(common.DOC)))
    wrk.seconds(duration), wrk.seconds(warmup)  # fail early on a bad duration
    command_line = f"{knobs.line(KNOB_NAMES)} scripts/bench" + (" --write" if opts.write else "")

    common.require("bench", ["wrk", "nginx", "haproxy"],
                   "sudo apt-get install -y wrk nginx-light haproxy")
    procs = Procs("bench", keep)
    try:
        if rounds < 3:
            procs.log(f"warning: ROUNDS={rounds}; use at least 3 for figures worth reporting")
        has_status = nginx_has_stub_status()
        if not has_status:
            procs.log("warning: this nginx lacks stub_status; backend connection counts will be missing")
        sluice = common.sluice_binary("bench", knobs)
        report = run(procs, sluice, rounds, duration, connections, wrk_threads, warmup,
                     sluice_threads, has_status, command_line, clients)
    finally:
        procs.cleanup()
    print(report)
    if opts.write:
        doc.replace_section(doc_path, START_MARK, END_MARK, report)
        procs.log(f"wrote the wrk section of {doc_path}")
    return 0


def run(procs: Procs, sluice: Path, rounds: int, duration: str, connections: int,
        wrk_threads: int, warmup: str, sluice_threads: int, has_status: bool,
        command_line: str, clients: str = "off") -> str:
    backends = start_backends(procs, status=has_status)
    targets: dict[str, Target] = {"direct": Target("direct", "direct (backend 1, no proxy)",
                                                   backends.ports[0])}
    targets["nginx_off"] = start_nginx_proxy(procs, "nginx_off", backends, log_on=False)
    targets["nginx_on"] = start_nginx_proxy(procs, "nginx_on", backends, log_on=True)
    targets["haproxy_off"] = start_haproxy(procs, "haproxy_off", backends, log_on=False)
    targets["haproxy_on"] = start_haproxy(procs, "haproxy_on", backends, log_on=True)
    for key, rust_log, label in (("sluice_off", "warn", "sluice (access log off, RUST_LOG=warn)"),
                                 ("sluice_on", None, "sluice (JSON access log on)")):
        cfg, port, admin = sluice_config(procs, key, backends, sluice_threads, clients)
        s = start_sluice(procs, sluice, key, cfg, port, admin, rust_log)
        targets[key] = Target(key, label, port, [s.pid], s.log if rust_log is None else None,
                              b'"sluice::access"' if rust_log is None else None)
    procs.log("targets: " + ", ".join(f"{t.key} 127.0.0.1:{t.port}" for t in targets.values()))

    keys = list(targets)
    res: dict[tuple[str, int], dict] = {}
    log_checks: dict[str, list[str]] = {k: [] for k in keys if targets[k].log}
    orders = []
    # Every target gets the same header: nginx and HAProxy pass it on, sluice identifies by it.
    base = wrk.args(wrk_threads, connections, common.clients_headers(clients))
    # Every server this run started, nginx workers included (wrk is counted apart, below).
    our_pids = [pid for p in procs.running for pid in (p.pid, *children_of(p.pid))]
    cpu0, ours0, kids0 = machine_cpu(), cpu_ticks(our_pids), waited_children_ticks()
    for r in range(1, rounds + 1):
        order = stats.order_of(r, keys)
        orders.append(f"round {r}: {' '.join(order)}")
        procs.log(f"round {r}/{rounds}: {' '.join(order)}")
        for key in order:
            t = targets[key]
            url = f"http://127.0.0.1:{t.port}/"
            wrk.run(procs, url, base, warmup, latency=False)
            if t.log:
                t.log.write_bytes(b"")  # the writers append (O_APPEND): truncating is safe
            before = cpu_split(t.pids) if t.pids else (0, 0)
            threads0 = busiest_thread_ns(t.pids)
            accepts0 = backends.accepts() if has_status else None
            out = wrk.run(procs, url, base, duration)
            accepts1 = backends.accepts() if has_status else None
            after = cpu_split(t.pids) if t.pids else (0, 0)
            threads1 = busiest_thread_ns(t.pids)
            (procs.work / f"wrk-{key}-{r}.txt").write_text(out.text)

            def per_request(ticks: int) -> Optional[float]:
                return ticks / CLK_TCK * 1e6 / out.requests if t.pids else None

            user, system = after[0] - before[0], after[1] - before[1]
            busiest = busiest_share(threads0, threads1, out.requests / out.rps)
            row = {"rps": out.rps, "p50": out.p50_ms, "p99": out.p99_ms, "errors": out.errors,
                   "cpu": per_request(user + system), "user": per_request(user),
                   "sys": per_request(system),
                   "busiest": 100 * busiest if busiest is not None else None, "opened": None}
            if accepts0 is not None and accepts1 is not None:
                # Each stub_status reading is one accept per backend: subtract the second's.
                row["opened"] = accepts1 - accepts0 - len(backends.status_ports)
            res[key, r] = row
            if t.log:
                lines = count_lines(t.log, t.log_needle)
                log_checks[key].append(f"round {r}: {lines} lines for {out.requests} requests")
            procs.log(f"round {r} {key}: {out.rps:.0f} req/s, p50 {stats.fmt(out.p50_ms, '.3f')} ms, "
                      f"p99 {stats.fmt(out.p99_ms, '.3f')} ms, proxy CPU {stats.fmt(row['cpu'], '.1f')} µs/req "
                      f"(user {stats.fmt(row['user'], '.1f')}, kernel {stats.fmt(row['sys'], '.1f')}; "
                      f"busiest thread {stats.fmt(row['busiest'], '.0f')}% busy), "
                      f"backend connections opened {stats.fmt(row['opened'], 'd')} {out.errors}")
    cpu1, ours1, kids1 = machine_cpu(), cpu_ticks(our_pids), waited_children_ticks()
    # What else used the machine: all busy CPU time minus that of this run's own processes
    # (the servers from /proc/<pid>/stat, wrk as this process's waited-for children).
    total = cpu1["total"] - cpu0["total"]
    other = 100 * ((cpu1["busy"] - cpu0["busy"]) - (ours1 - ours0) - (kids1 - kids0)) / total
    steal = 100 * (cpu1["steal"] - cpu0["steal"]) / total
    return report(targets, res, rounds, duration, connections, wrk_threads, warmup,
                  sluice_threads, command_line, orders, log_checks, other, steal)


def report(targets: dict[str, Target], res: dict, rounds: int, duration: str, connections: int,
           wrk_threads: int, warmup: str, sluice_threads: int, command_line: str,
           orders: list[str], log_checks: dict[str, list[str]], other: float, steal: float) -> str:
    def per(key: str, what: str) -> list:
        return [res[key, r][what] for r in range(1, rounds + 1)]

    def ratio(what: str, a: str, b: str) -> str:
        return stats.fmt_ratio(per(a, what), per(b, what), sep=" ")

    cores = common.nproc()
    out = [
        f"Run on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, sluice {common.git_revision()}, "
        f"machine: `nproc` = {cores}, {os.uname().sysname} {os.uname().release}, "
        f"{common.nginx_version()}, {common.haproxy_version()}, {common.wrk_version()}.",
        "",
        "```sh",
        command_line,
        "```",
        "",
        f"Each run: `wrk -t{wrk_threads} -c{connections} -d{duration} --latency` after an unrecorded "
        f"{warmup} warm-up, {rounds} rounds.",
        f"Client (wrk), proxies and backends all share the same {cores} cores, with no pinning: the absolute",
        "figures mean little, the ratios taken within one round are what to compare. During the rounds, processes",
        "other than the benchmark's own (and interrupt work charged to none of them) used "
        f"{other:.1f}% of the machine's",
        f"CPU time, from `/proc/stat` and `/proc/<pid>/stat`; the hypervisor stole {steal:.1f}%.",
        "",
        "| target | req/s | p50 ms | p99 ms | proxy CPU µs/req | of it user / kernel | busiest proxy thread busy | backend connections opened | req/s per round |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for key, t in targets.items():
        opened = per(key, "opened")
        out.append(
            f"| {t.label} | {stats.fmt(stats.median(per(key, 'rps')))} "
            f"| {stats.fmt(stats.median(per(key, 'p50')), '.3f')} "
            f"| {stats.fmt(stats.median(per(key, 'p99')), '.3f')} "
            f"| {stats.fmt(stats.median(per(key, 'cpu')), '.1f')} "
            f"| {stats.fmt(stats.median(per(key, 'user')), '.1f')} / "
            f"{stats.fmt(stats.median(per(key, 'sys')), '.1f')} "
            f"| {stats.fmt(stats.median(per(key, 'busiest')), '.0f')}"
            f"{'' if stats.median(per(key, 'busiest')) is None else '%'} "
            f"| {'-' if None in opened else sum(opened)} "
            f"| {', '.join(f'{v:.0f}' for v in per(key, 'rps'))} |")
    out += [
        "",
        "req/s, p50, p99 and CPU are medians over rounds. Ratios are taken per round, then their median is shown.",
        "",
        "Access logs off:",
        "",
        f"- sluice / nginx, req/s: {ratio('rps', 'sluice_off', 'nginx_off')}",
        f"- sluice / HAProxy, req/s: {ratio('rps', 'sluice_off', 'haproxy_off')}",
        f"- HAProxy / nginx, req/s: {ratio('rps', 'haproxy_off', 'nginx_off')}",
        f"- sluice / nginx, p99: {ratio('p99', 'sluice_off', 'nginx_off')}",
        f"- sluice / nginx, CPU per request: {ratio('cpu', 'sluice_off', 'nginx_off')}; "
        f"user {ratio('user', 'sluice_off', 'nginx_off')}; kernel {ratio('sys', 'sluice_off', 'nginx_off')}",
        f"- sluice / HAProxy, p99: {ratio('p99', 'sluice_off', 'haproxy_off')}",
        f"- sluice / direct, req/s: {ratio('rps', 'sluice_off', 'direct')}",
        f"- nginx / direct, req/s: {ratio('rps', 'nginx_off', 'direct')}",
        "",
        "Access logs on, on all three:",
        "",
        f"- sluice / nginx, req/s: {ratio('rps', 'sluice_on', 'nginx_on')}",
        f"- sluice / HAProxy, req/s: {ratio('rps', 'sluice_on', 'haproxy_on')}",
        f"- HAProxy / nginx, req/s: {ratio('rps', 'haproxy_on', 'nginx_on')}",
        f"- sluice / nginx, p99: {ratio('p99', 'sluice_on', 'nginx_on')}",
        f"- sluice / nginx, CPU per request: {ratio('cpu', 'sluice_on', 'nginx_on')}; "
        f"user {ratio('user', 'sluice_on', 'nginx_on')}; kernel {ratio('sys', 'sluice_on', 'nginx_on')}",
        f"- sluice / HAProxy, p99: {ratio('p99', 'sluice_on', 'haproxy_on')}",
        "",
        "What the access log costs each proxy, log on / log off:",
        "",
    ]
    for name, off, on in (("nginx", "nginx_off", "nginx_on"), ("HAProxy", "haproxy_off", "haproxy_on"),
                          ("sluice", "sluice_off", "sluice_on")):
        out.append(f"- {name}: req/s {ratio('rps', on, off)}, CPU per request {ratio('cpu', on, off)}")
    errors = " ".join(f"{k} round {r}: {res[k, r]['errors']}" for k in targets
                      for r in range(1, rounds + 1) if res[k, r]["errors"])
    checks = "; ".join(f"{targets[k].label}: {', '.join(v)}" for k, v in log_checks.items())
    out += [
        "",
        '- Setup: two nginx backends (`worker_processes 1`, `access_log off`, `return 200 "ok\\n"`);',
        "  nginx proxy: `worker_processes 1`, upstream `keepalive 128`, `proxy_http_version 1.1`,",
        '  `proxy_set_header Connection ""`, and `access_log off` or `access_log FILE` (the default',
        "  `combined` format, unbuffered: one write per request);",
        "  HAProxy: `nbthread 1`, `mode http`, `http-reuse always`, `option http-keep-alive`, `balance roundrobin`",
        "  over both backends, and no `log` line, or `log stdout format raw local0 info` with `option httplog`,",
        "  its stdout appended to a file (one write per request);",
        f"  sluice: `threads: {sluice_threads}`, one `round_robin` route over both backends, `hosts: [\"*\"]`,",
        "  its JSON access log on stderr appended to a file (log on; its writer thread batches lines), or",
        "  `RUST_LOG=warn` (log off). Every proxy with its log on is a process of its own, next to its log-off twin.",
        "- Proxy CPU: utime+stime of the proxy's processes (all threads; nginx master and worker) from `/proc/<pid>/stat`",
        "  across the recorded run, divided by wrk's request count; user / kernel splits it into utime and stime.",
        "  The backends' CPU is not included. Busiest proxy thread: the largest time on CPU of any one of the",
        "  proxy's threads (`/proc/<pid>/task/<tid>/schedstat`) over wrk's elapsed time. Near 100%, that one",
        "  event-loop thread is what limits the proxy's req/s, and its CPU per request sets it; well below, the",
        "  shared cores do.",
        "- Backend connections opened: the backends' `stub_status` accepts during the recorded runs, all rounds together",
        f"  (for direct, wrk's own connections, about {connections} per round). A proxy that reuses its upstream connections",
        "  opens almost none after warm-up; one that does not opens about one per request.",
        f"- Errors reported by wrk: {errors or 'none'}.",
        f"- Access log check (lines in the log vs requests wrk completed; lines written after wrk stopped count too): {checks}.",
        f"- Order: {'; '.join(orders)}.",
    ]
    return "\n".join(out)
