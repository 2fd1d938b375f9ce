"""scripts/bench-latency: the latency sluice adds to a request, open-loop at fixed rates.

  scripts/bench-latency            run and print a Markdown report
  scripts/bench-latency --write    also replace the latency section of docs/benchmark-runs.md

wrk is closed-loop: when a response is late the next request is not sent, so a stall hides
behind the requests it delayed (coordinated omission) and the tail reads too short. This driver
uses `oha` at a fixed rate with `--latency-correction`: each request's latency counts from the
moment it was due, not from when a free connection sent it, so a stall shows in every request
it held up.

Targets, each loaded in turn at each rate:
  direct  the nginx backend itself (access_log off, as in every driver);
  nginx   an nginx proxy (1 worker, upstream keepalive, access_log on) over both backends;
  rr      sluice (`threads: SLUICE_THREADS`, its JSON access log on) on a round_robin route;
  qlu     the same sluice on a quota + least_used route on a local Redis (one fused script
          call for the requests that wait together, up to 32; a lone request goes at once);
  qlu1    a second sluice, the same route with `state.redis.batch: false`: one call per request.
The added latency of a target is its percentile minus direct's, taken within a round.
Last, LONE_RATE req/s on 1 connection to each target: a request on the Redis route that finds
no call out must not wait for company, so qlu should read rr plus one Redis call there.

The Redis route's target is its added p99 over Redis's own round trip. That round trip is taken
as two parts, each measured here: the network's, the p99 of `redis-benchmark -c 1` PINGs to the
same Redis after each round (closed-loop, one connection, nothing else loaded), and the script's,
the mean time Redis spent per FCALL in that run (INFO commandstats). The report gives qlu's and
qlu1's added p99 less both.

qlu and qlu1 are the same route with batching on and off; the report gives the FCALLs per
request, which is 1.00 where no batch formed and always for qlu1.

Knobs (environment): ROUNDS (1), RATES ("1000 5000 10000"), DURATION (10s), WARMUP (2s),
CONNECTIONS (32), LONE_RATE (100), SLUICE_THREADS (1), SLUICE_BIN_DIR (a directory holding a
release sluice; no build), BUILD (1; 0 uses ${CARGO_TARGET_DIR:-target}/release as it is),
WAIT_QUIET (1: first wait until no other benchmark runs), KEEP (0; 1 keeps the work directory),
DOC (docs/benchmark-runs.md: the file --write rewrites).

Needs oha (not in Debian): `cargo install oha --locked` (it lands in ~/.cargo/bin, looked for on
PATH and there), and nginx, curl, redis-server, redis-cli and redis-benchmark (`sudo apt-get install -y
nginx-light curl redis-server`; the last two come with it, from redis-tools). Everything runs on 127.0.0.1 and stops, by PID, on exit (Ctrl-C included).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional, Sequence

from . import common, doc, stats, wrk
from .bench import start_nginx_proxy
from .procs import Failure, Procs
from .servers import commandstats, start_backends, start_redis, start_sluice, store_errors, wait_ok
from .staterun import QUOTA_YAML, wait_quiet

START_MARK = "<!-- bench:latency:start -->"
END_MARK = "<!-- bench:latency:end -->"
KNOBS = ["ROUNDS", "RATES", "DURATION", "WARMUP", "CONNECTIONS", "LONE_RATE", "SLUICE_THREADS"]
TARGETS = ["direct", "nginx", "rr", "qlu", "qlu1"]
REDIS_TARGETS = ("qlu", "qlu1")
LABELS = {"direct": "direct to the backend", "nginx": "nginx proxy (access_log on)",
          "rr": "sluice, round_robin", "qlu": "sluice, quota + least_used on Redis",
          "qlu1": "the same, `batch: false` (one call per request)"}
PCTS = [("p50", "p50"), ("p99", "p99"), ("p99.9", "p99.9")]
OHA_INSTALL = "cargo install oha --locked (it goes to ~/.cargo/bin, where this driver also looks)"


def oha_path() -> str:
    """oha on PATH or in ~/.cargo/bin, where `cargo install` puts it."""
    found = shutil.which("oha") or shutil.which("oha", path=str(Path.home() / ".cargo" / "bin"))
    if found is None:
        raise Failure(f"oha is missing (it is not packaged in Debian): {OHA_INSTALL}")
    return found


def oha_flags(oha: str) -> tuple[list[str], list[str]]:
    """(JSON output flags, no-TUI flags) for this oha: `--output-format json` since 1.5, `-j`
    before. Fails if it lacks the rate or the latency correction."""
    help_text = subprocess.run([oha, "--help"], capture_output=True, text=True, timeout=30).stdout
    for needed in ("--latency-correction", "-q"):
        if needed not in help_text:
            raise Failure(f"{oha} has no {needed} option; install a newer one: {OHA_INSTALL}")
    out = ["--output-format", "json"] if "--output-format" in help_text else ["-j"]
    no_tui = ["--no-tui"] if "--no-tui" in help_text else []
    return out, no_tui


class Latency:
    def __init__(self, procs: Procs, knobs: common.Knobs, oha: str):
        self.procs, self.knobs, self.oha = procs, knobs, oha
        self.rounds = knobs.int("ROUNDS", 1, minimum=1)
        raw_rates = knobs.str("RATES", "1000 5000 10000").split()
        if not raw_rates or not all(r.isdigit() and int(r) > 0 for r in raw_rates):
            raise Failure(f"RATES must be positive integers, not {' '.join(raw_rates)!r}")
        self.rates = [int(r) for r in raw_rates]
        self.duration = knobs.str("DURATION", "10s")
        self.warmup = knobs.str("WARMUP", "2s")
        wrk.seconds(self.duration), wrk.seconds(self.warmup)  # fail early on a bad duration
        self.connections = knobs.int("CONNECTIONS", 32, minimum=1)
        self.lone_rate = knobs.int("LONE_RATE", 100, minimum=1)
        self.threads = knobs.int("SLUICE_THREADS", 1, minimum=1)
        self.out_flags, self.no_tui = oha_flags(oha)
        # (target, rate, connections, round) -> result row
        self.res: dict[tuple[str, int, int, int], dict] = {}
        # per round: the p99 of a PING round trip to the Redis, µs
        self.ping_p99: list[Optional[float]] = []

    def oha_cmd(self, url: str, host: Optional[str], rate: int, conns: int, duration: str) -> list[str]:
        # -w: the requests still out at the deadline are waited for, not counted as errors.
        return [self.oha, "-z", duration, "-w", "-c", str(conns), "-q", str(rate), "--latency-correction",
                *self.no_tui, *self.out_flags, *(["--host", host] if host else []), url]

    def measure(self, id: str, url: str, host: Optional[str], rate: int, conns: int, r: int,
                redis_port: Optional[int] = None) -> None:
        """An unrecorded WARMUP at the same rate, then the recorded run."""
        self.procs.run(self.oha_cmd(url, host, rate, conns, self.warmup),
                       timeout=wrk.seconds(self.warmup) + 60)
        before = commandstats(redis_port) if redis_port else {}
        text = self.procs.run(self.oha_cmd(url, host, rate, conns, self.duration),
                              timeout=wrk.seconds(self.duration) + 120)
        after = commandstats(redis_port) if redis_port else {}
        try:
            j = json.loads(text)
        except json.JSONDecodeError:
            raise Failure(f"could not read oha's JSON output: {text[:300]}")
        pct = j.get("latencyPercentiles") or {}
        codes = j.get("statusCodeDistribution") or {}
        summary = j.get("summary") or {}
        ok = int(codes.get("200", 0))
        row = {k: (pct[src] * 1e3 if pct.get(src) is not None else None) for k, src in PCTS}
        row.update(rps=summary.get("requestsPerSec"), ok=ok,
                   other=sum(int(n) for c, n in codes.items() if c != "200"),
                   errors=sum(int(n) for n in (j.get("errorDistribution") or {}).values()))
        if redis_port and ok:
            fc = after.get("fcall", (0, 0))[0] - before.get("fcall", (0, 0))[0]
            us = after.get("fcall", (0, 0))[1] - before.get("fcall", (0, 0))[1]
            row["fcall_per_req"] = fc / ok
            row["fcall_us"] = us / fc if fc else None
        self.res[id, rate, conns, r] = row
        self.procs.log(f"round {r} {id} {rate} req/s c{conns}: {stats.fmt(row['rps'])} req/s, "
                       + ", ".join(f"{k} {stats.fmt(row[k], '.3f')} ms" for k, _ in PCTS)
                       + f", non-200 {row['other']}, errors {row['errors']}"
                       + (f", FCALL/req {stats.fmt(row.get('fcall_per_req'), '.2f')}" if redis_port else ""))

    def med(self, id: str, rate: int, conns: int, what: str) -> Optional[float]:
        return stats.median(self.res.get((id, rate, conns, r), {}).get(what)
                            for r in range(1, self.rounds + 1))

    def added(self, id: str, rate: int, conns: int, what: str, base: str = "direct") -> Optional[float]:
        """Median over rounds of (target - BASE), in µs."""
        return stats.median(
            None if a is None or b is None else (a - b) * 1e3
            for a, b in ((self.res.get((id, rate, conns, r), {}).get(what),
                          self.res.get((base, rate, conns, r), {}).get(what))
                         for r in range(1, self.rounds + 1)))


def redis_ping_p99(procs: Procs, port: int) -> Optional[float]:
    """The p99 of a PING round trip to Redis at PORT in µs: `redis-benchmark` on one connection,
    one PING at a time (its CSV reports the percentiles in ms). None, logged, if it could not be
    read: the round's latencies are kept whatever happens to this side measurement."""
    try:
        text = procs.run(["redis-benchmark", "-p", str(port), "-c", "1", "-P", "1", "-n", "20000",
                          "-t", "ping_mbulk", "--csv"], timeout=120)
    except Failure as e:
        procs.log(f"redis-benchmark failed, no PING round trip this round: {e}")
        return None
    rows = list(csv.reader(line for line in text.splitlines() if line.startswith('"')))
    if len(rows) < 2 or "p99_latency_ms" not in rows[0] or len(rows[1]) != len(rows[0]):
        procs.log(f"could not read redis-benchmark's CSV output, no PING round trip this round: {text[:300]}")
        return None
    head, vals = rows[0], rows[1]
    try:
        return float(vals[head.index("p99_latency_ms")]) * 1e3
    except ValueError:
        procs.log(f"redis-benchmark's p99 is not a number: {vals}")
        return None


def run(lat: Latency, sluice: Path, write: bool) -> str:
    procs = lat.procs
    backends = start_backends(procs)
    nginx = start_nginx_proxy(procs, "nginx-proxy", backends, log_on=True)
    rport, sport, admin = procs.free_port(), procs.free_port(), procs.free_port()
    sport1, admin1 = procs.free_port(), procs.free_port()
    start_redis(procs, "redis", rport)
    (procs.work / "conf").mkdir(parents=True)

    def config(name: str, port: int, admin_port: int, batch: bool) -> Path:
        cfg = procs.work / "conf" / f"{name}.yaml"
        cfg.write_text(
            f'listen: ["127.0.0.1:{port}"]\nthreads: {lat.threads}\nadmin:\n  listen: "127.0.0.1:{admin_port}"\n'
            f'state:\n  backend: redis\n  redis:\n    url: "redis://127.0.0.1:{rport}/0"\n'
            f'    batch: {"true" if batch else "false"}\nroutes:\n'
            + backends.route_yaml("rr", "round_robin", "rr.bench")
            + backends.route_yaml("qlu", "least_used", "qlu.bench") + QUOTA_YAML)
        return cfg

    # RUST_LOG unset: sluice's default, its JSON access log on (stderr, appended to a file). The
    # second process only serves qlu1; it idles while the others are measured.
    sl = start_sluice(procs, sluice, "sluice", config("sluice", sport, admin, True), sport, admin, None)
    sl1 = start_sluice(procs, sluice, "sluice-unbatched", config("sluice-unbatched", sport1, admin1, False),
                       sport1, admin1, None)
    wait_ok(f"http://127.0.0.1:{backends.ports[0]}/", "direct.bench", "the backend")
    wait_ok(f"http://127.0.0.1:{nginx.port}/", "nginx.bench", "the nginx proxy")
    for name in ("rr", "qlu"):
        wait_ok(f"http://127.0.0.1:{sport}/", f"{name}.bench", f"route {name}")
    wait_ok(f"http://127.0.0.1:{sport1}/", "qlu.bench", "route qlu, unbatched")
    where = {"direct": (backends.ports[0], None), "nginx": (nginx.port, None),
             "rr": (sport, "rr.bench"), "qlu": (sport, "qlu.bench"), "qlu1": (sport1, "qlu.bench")}

    def one(id: str, rate: int, conns: int, r: int) -> None:
        port, host = where[id]
        lat.measure(id, f"http://127.0.0.1:{port}/", host, rate, conns, r,
                    redis_port=rport if id in REDIS_TARGETS else None)

    orders = []
    for r in range(1, lat.rounds + 1):
        for i, rate in enumerate(lat.rates):
            # A different order per rate and round, so that no target is always first (after the
            # rate changed) or always follows the same one.
            order = stats.order_of(r + i, TARGETS)
            orders.append(f"round {r} {rate}: {' '.join(order)}")
            for id in order:
                one(id, rate, lat.connections, r)
        for id in TARGETS:
            one(id, lat.lone_rate, 1, r)
        lat.ping_p99.append(redis_ping_p99(procs, rport))
        procs.log(f"round {r}: Redis PING p99 {stats.fmt(lat.ping_p99[-1], '.0f')} µs (redis-benchmark -c 1)")
    errors = "batched: " + store_errors(admin, sl.log) + "; unbatched: " + store_errors(admin1, sl1.log)
    return report(lat, sluice, orders, errors, write)


def report(lat: Latency, sluice: Path, orders: Sequence[str], store_errs: str, write: bool) -> str:
    c = lat.connections
    cmd = f"{lat.knobs.line(KNOBS + ['BUILD'])} scripts/bench-latency" + (" --write" if write else "")
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    version = common.version_of([lat.oha, "--version"], r"oha (\S+)", r"oha \1")
    shown = " ".join(lat.oha_cmd("http://127.0.0.1:PORT/", "ROUTE.bench", 0, c, lat.duration)[1:])
    shown = shown.replace("-q 0", "-q RATE")
    built = datetime.fromtimestamp(sluice.stat().st_mtime, timezone.utc)
    binary = (f"the release sluice of SLUICE_BIN_DIR (built {built:%Y-%m-%d %H:%M} UTC), tree at {common.git_revision()}"
              if os.environ.get("SLUICE_BIN_DIR") else f"sluice {common.git_revision()}")
    out = [
        "## Added latency, open-loop (`scripts/bench-latency`)",
        "",
        f"Run on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {binary}, "
        f"`nproc` = {common.nproc()}, {common.redis_version()}, nginx {common.nginx_version()}, {version}. "
        f"The machine is shared (other engineers' builds and tests may run): load average at the end {load} (1 / 5 / 15 min).",
        "",
        "```sh",
        cmd,
        "```",
        "",
        f"Each target: `oha {shown}` (`--host` only for sluice's routes) after an unrecorded {lat.warmup} warm-up at the "
        f"same rate; {lat.rounds} round(s). Latencies count from when each request was due (`--latency-correction`). "
        f"{c} keep-alive connections; sluice `threads: {lat.threads}` against 1 nginx worker; access logs on for both "
        "(the backend's off). qlu and qlu1 are one route with `state.redis.batch` on and off (two sluice "
        "processes, one idle while the other is measured); FCALLs per request below show how much was batched.",
        "",
        "| rate req/s | target | req/s done | p50 ms | p99 ms | p99.9 ms | added p50 µs | added p99 µs | added p99.9 µs | non-200 / errors | FCALL per request (µs in Redis per FCALL) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for rate, conns in [*((rate, c) for rate in lat.rates), (lat.lone_rate, 1)]:
        for id in TARGETS:
            if (id, rate, conns, 1) not in lat.res:
                continue
            f = lambda what: lat.med(id, rate, conns, what)  # noqa: E731
            added = ["-", "-", "-"] if id == "direct" else [stats.fmt(lat.added(id, rate, conns, k), ".0f") for k, _ in PCTS]
            fc = (f"{stats.fmt(f('fcall_per_req'), '.2f')} ({stats.fmt(f('fcall_us'), '.1f')})"
                  if id in REDIS_TARGETS else "")
            label = f"{rate}" + (" (1 connection)" if conns == 1 else "")
            out.append(f"| {label} | {LABELS[id]} | {stats.fmt(f('rps'))} | {stats.fmt(f('p50'), '.3f')} "
                       f"| {stats.fmt(f('p99'), '.3f')} | {stats.fmt(f('p99.9'), '.3f')} | {' | '.join(added)} "
                       f"| {stats.fmt(f('other'))} / {stats.fmt(f('errors'))} | {fc} |")
    def share(id: str) -> str:
        return "; ".join(
            f"{rate}{' (1 connection)' if conns == 1 else ''}: "
            + ", ".join(f"{k} {stats.fmt(lat.added(id, rate, conns, k, base='rr'), '.0f')}" for k, _ in PCTS)
            for rate, conns in [*((rate, c) for rate in lat.rates), (lat.lone_rate, 1)])
    ping = stats.median(lat.ping_p99)

    def over_rtt(id: str) -> str:
        """Added p99 less Redis's round trip (PING p99 + the mean FCALL time), per rate."""
        parts = []
        for rate, conns in [*((rate, c) for rate in lat.rates), (lat.lone_rate, 1)]:
            added, script = lat.added(id, rate, conns, "p99"), lat.med(id, rate, conns, "fcall_us")
            left = None if added is None or ping is None or script is None else added - ping - script
            parts.append(f"{rate}{' (1 connection)' if conns == 1 else ''}: {stats.fmt(left, '.0f')}")
        return "; ".join(parts)

    out += [
        "",
        f"- Redis's own round trip: PING p99 {stats.fmt(ping, '.0f')} µs (`redis-benchmark -c 1`, after each "
        "round, median of rounds) plus the mean FCALL time in the table's last column.",
        f"- the Redis route's added p99 less that round trip, µs (target ≤ 300 at 5,000 req/s), batched: "
        f"{over_rtt('qlu')}; unbatched: {over_rtt('qlu1')}.",
        f"- the Redis route over the round-robin one (the store call's share), µs, batched: {share('qlu')}.",
        f"- the same, unbatched: {share('qlu1')}.",
        f"- sluice store errors and fallbacks: {store_errs}.",
        f"- order: {'; '.join(orders)}; then, at {lat.lone_rate} req/s on 1 connection: {' '.join(TARGETS)}.",
    ]
    return "\n".join(out)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="scripts/bench-latency", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true",
                        help="replace the latency section of docs/benchmark-runs.md with the report")
    opts = parser.parse_args(argv)
    knobs = common.Knobs()
    doc_path = Path(knobs.str("DOC", str(common.DOC)))
    keep = knobs.choice("KEEP", "0", ("0", "1")) == "1"
    common.require("bench-latency", ["nginx", "curl", "redis-server", "redis-cli", "redis-benchmark"],
                   "sudo apt-get install -y nginx-light curl redis-server")
    oha = oha_path()
    procs = Procs("bench-latency", keep)
    try:
        if knobs.choice("WAIT_QUIET", "1", ("0", "1")) == "1":
            wait_quiet(procs.log)
        sluice = common.sluice_binary("bench-latency", knobs)
        lat = Latency(procs, knobs, oha)
        text = run(lat, sluice, opts.write)
        print(text, flush=True)
    finally:
        procs.cleanup()
    if opts.write:
        doc.replace_section(doc_path, START_MARK, END_MARK, text)
        procs.log(f"wrote the latency section of {doc_path}")
    return 0
