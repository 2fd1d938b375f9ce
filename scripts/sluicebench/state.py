"""scripts/bench-state: benchmarks of sluice's shared state: quotas and least-used in Redis,
hot reload, Redis Cluster.

  scripts/bench-state [PART...] [--write]

PART is quota, least-used, key-pool, usage, reload, cluster or lease-wake (default: all seven, in that order). --write also
replaces each part's section of docs/benchmark-runs.md (between <!-- bench:state:start --> and
<!-- bench:state:end -->, one sub-section per part, so parts can be run one at a time).

  quota       wrk against three routes of one sluice (no quota, quota at cost 1, at cost 100);
              redis-benchmark EVALSHA of the quota script at cost 1 and 100 (calls/s and
              usec_per_call); Redis memory per admitted request (MEMORY USAGE / entries).
  least-used  wrk against round_robin, least_used (memory), least_used and least_in_flight (Redis) and
              quota + least_used (Redis) routes; the allocator (and fused) script at pool
              sizes 10 and 10,000.
  key-pool    wrk against least_used, route quota + least_used and a key-pool route (three
              members with headers, member quotas, `cooldown: {}`, a route quota), all on Redis;
              Redis commands per request (INFO commandstats deltas, and MONITOR over
              MONITOR_REQUESTS sequential requests); Redis memory per admitted request (MEMORY
              USAGE of the route and member logs after the rounds and after MEM_REQUESTS requests).
  usage       wrk POSTing chat requests to a window counted in requests and the same window in
              tokens (reserved from max_tokens, settled from the answer's usage); Redis memory
              per admitted request (every key of the route over its log's entries) and whether
              the tokens window holds exactly what was settled.
  reload      POST /reload duration (sluice's log) and round trip for 100, 1,000 and 10,000
              routes; request p99 during a reload storm against none.
  cluster     quota + least_used on one Redis against a 3-master Redis Cluster (wrk), and the
              Redis-side ceiling with redis-benchmark on 1, 2 and 3 masters at once.
  lease-wake  two sluice processes on one Redis, a route with max_in_flight: 1 and max_wait:
              how long a request waiting at the cap on one takes to go once the other's
              request ends (WAKE_ROUNDS rounds, 50; each holder HOLD_MS, 100).

Knobs (environment): ROUNDS (3), DURATION (10s), CONNECTIONS (64), WRK_THREADS (2), WARMUP (2s),
SLUICE_THREADS (1), RB_REQUESTS (200000), RB_CLIENTS (50), MEM_REQUESTS (10000),
MONITOR_REQUESTS (200), RELOADS (5),
RELOAD_SIZES ("100 1000 10000"), STORM_ROUTES (1000), STORM_INTERVAL (0.1), SCALE_SECONDS (5),
ROUTES_PER_MASTER (2), BUILD (1; 0 uses ${CARGO_TARGET_DIR:-target}/release as it is),
SLUICE_BIN_DIR (a directory holding a release sluice; no build), WAIT_QUIET (1: first wait,
polling every 20 s for at most 30 minutes, until no other wrk, cargo bench or valgrind runs),
DOC (docs/benchmark-runs.md), KEEP (0; 1 keeps the work directory), REDIS_CPU (unset; a CPU number
runs every redis-server alone on that CPU and everything else on the others, as a Redis on a host
of its own would be: the req/s then measure the gateway side, not Redis's share of the same cores).

Every wrk table gives, per target, sluice's CPU per request and two readings of the kernel's
scheduler for sluice's threads: the share of the run they were runnable but waiting for a CPU
(/proc/TID/schedstat), and how often they were preempted (involuntary context switches) per 1,000
requests. A sluice that is the bottleneck on two cores it shares with Redis, nginx and wrk
loses its CPU to them; these show how much. least-used also splits the machine's CPU time per
request among sluice, redis-server, nginx, wrk and idle: on shared cores a Redis route's req/s is
set by that sum, not by sluice's part alone.

Everything runs on 127.0.0.1 and stops, by PID, on exit (Ctrl-C included).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from . import common, doc
from .procs import Procs
from .staterun import END_MARK, PARTS, START_MARK, Run, wait_quiet


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="scripts/bench-state", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("parts", nargs="*", metavar="PART",
                        help="quota, least-used, key-pool, usage, reload, cluster or lease-wake (default: all seven)")
    parser.add_argument("--write", action="store_true",
                        help="replace the parts' sections of docs/benchmark-runs.md with the report")
    opts = parser.parse_args(argv)
    for part in opts.parts:
        if part not in PARTS:
            parser.error(f"unknown part {part!r}: choose from {', '.join(PARTS)}")
    parts = opts.parts or PARTS

    knobs = common.Knobs()
    doc_path = Path(knobs.str("DOC", str(common.DOC)))
    keep = knobs.choice("KEEP", "0", ("0", "1")) == "1"
    common.require("bench-state", ["wrk", "nginx", "curl", "redis-server", "redis-cli", "redis-benchmark"],
                   "sudo apt-get install -y wrk nginx-light curl redis-server")
    procs = Procs("bench-state", keep)
    reports: dict[str, str] = {}
    try:
        if knobs.choice("WAIT_QUIET", "1", ("0", "1")) == "1":
            wait_quiet(procs.log)
        sluice = common.sluice_binary("bench-state", knobs, bins=("--bins",))
        run = Run(procs, knobs, sluice, opts.write, doc_path)
        if run.rounds < 3:
            procs.log(f"warning: ROUNDS={run.rounds}; use at least 3 for figures worth reporting")
        from . import cluster, key_pool, lease_wake, least_used, quota, reload, usage
        modules = {"quota": quota, "least-used": least_used, "key-pool": key_pool, "usage": usage, "reload": reload,
                   "cluster": cluster, "lease-wake": lease_wake}
        for part in parts:
            procs.log(f"=== part: {part} ===")
            reports[part] = modules[part].run(run)
            print(reports[part])
            print(flush=True)
    finally:
        procs.cleanup()

    if opts.write:
        write_doc(doc_path, reports)
        procs.log(f"wrote the state section of {doc_path}")
    return 0


def write_doc(doc_path: Path, reports: dict[str, str]) -> None:
    """Rebuilds the section: this run's parts, and what the file held for the others."""
    body = [
        "## Shared state, reload and Redis Cluster (`scripts/bench-state`)",
        "",
        "Everything on 127.0.0.1 on one shared machine (client, gateway, backends and Redis on the same cores, unless a",
        "part's first line says Redis was pinned to a CPU of its own with `REDIS_CPU`): compare",
        "the ratios taken within one run, not the absolute figures. Each part can be rerun alone",
        "(`scripts/bench-state quota|least-used|key-pool|usage|reload|cluster|lease-wake --write`).",
    ]
    for part in PARTS:
        start, end = f"<!-- bench:state:{part}:start -->", f"<!-- bench:state:{part}:end -->"
        old = doc.section(doc_path, start, end)
        body += ["", start]
        if part in reports:
            body.append(reports[part])
        elif old is not None:
            body.append(old)
        body.append(end)
    doc.replace_section(doc_path, START_MARK, END_MARK, "\n".join(body))
