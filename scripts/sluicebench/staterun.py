"""What the parts of scripts/bench-state share: settings, the processes, the backends, wrk
results by round, and the doc section's marks. Its own module, apart from the command
(state.py), so that the parts import it and the command imports the parts, never round."""

from __future__ import annotations

import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional, Sequence

from . import common, servers, stats, wrk
from .procs import (CLK_TCK, Failure, Procs, cpu_ticks, machine_ticks, now_ms, sched_delta,
                    sched_stats)
from .servers import Backends, commandstats, rcli, script_stats, start_backends

START_MARK = "<!-- bench:state:start -->"
END_MARK = "<!-- bench:state:end -->"
PARTS = ["quota", "least-used", "key-pool", "usage", "reload", "cluster", "lease-wake"]
WRK_KNOBS = ["ROUNDS", "DURATION", "CONNECTIONS", "WRK_THREADS", "WARMUP", "SLUICE_THREADS"]
# What the fused and quota scripts are called with: a window "w" no benchmark ever fills.
BIG_WINDOW = ["w", "1000000000000", "3600000000"]
# Processes whose CPU time budget_table shows, by /proc/PID/comm ("children": the driver's
# finished children, wrk among them; "idle": the machine's idle time), and the result keys.
BUDGET_NAMES = {"sluice": "bcpu_sluice", "redis-server": "bcpu_redis", "nginx": "bcpu_nginx",
                "children": "bcpu_wrk", "idle": "bcpu_idle"}
QUOTA_YAML = "    quota:\n      windows:\n        - { name: w, limit: 1000000000000, window: 1h }\n"


class Run:
    """What the parts share: settings, the processes, the backends, and wrk results by
    (target, round)."""

    def __init__(self, procs: Procs, knobs: common.Knobs, sluice: Path, write: bool, doc_path: Path):
        self.procs, self.knobs, self.sluice, self.write, self.doc = procs, knobs, sluice, write, doc_path
        self.rounds = knobs.int("ROUNDS", 3, minimum=1)
        self.duration = knobs.str("DURATION", "10s")
        self.connections = knobs.int("CONNECTIONS", 64, minimum=1)
        self.wrk_threads = knobs.int("WRK_THREADS", 2, minimum=1)
        self.warmup = knobs.str("WARMUP", "2s")
        self.sluice_threads = knobs.int("SLUICE_THREADS", 1, minimum=1)
        self.rb_requests = knobs.int("RB_REQUESTS", 200000, minimum=1)
        self.rb_clients = knobs.int("RB_CLIENTS", 50, minimum=1)
        redis_cpu = knobs.str("REDIS_CPU", "")
        if redis_cpu:
            if not redis_cpu.isdigit():
                raise Failure(f"REDIS_CPU must be a CPU number, not {redis_cpu!r}")
            servers.pin_redis(int(redis_cpu))
        self.redis_cpu = servers.REDIS_CPU
        wrk.seconds(self.duration), wrk.seconds(self.warmup)  # fail early on a bad duration
        self._backends: Optional[Backends] = None
        self.res: dict[tuple[str, int], dict] = {}
        self.call_rate: dict[tuple[str, int, int], float] = {}
        self.wrk_cmd: dict[str, str] = {}
        self.orders: dict[str, str] = {}
        self.label: dict[str, str] = {}

    def log(self, message: str) -> None:
        self.procs.log(message)

    @property
    def work(self) -> Path:
        return self.procs.work

    @property
    def backends(self) -> Backends:
        """The two nginx backends, started by the first part that needs them."""
        if self._backends is None:
            self._backends = start_backends(self.procs)
        return self._backends

    def knob_line(self, *extra: str) -> str:
        pinned = ["REDIS_CPU"] if self.redis_cpu is not None else []
        return self.knobs.line(WRK_KNOBS + pinned + list(extra))

    def command(self, part: str, *extra: str) -> str:
        return f"{self.knob_line(*extra)} scripts/bench-state {part}" + (" --write" if self.write else "")

    def header(self) -> str:
        return (f"Run on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, sluice {common.git_revision()}, "
                f"`nproc` = {common.nproc()}, {common.redis_version()}, {common.wrk_version()}."
                + ("" if self.redis_cpu is None else
                   f" Redis pinned to CPU {self.redis_cpu} alone (`REDIS_CPU={self.redis_cpu}`, as a Redis on a host of"
                   " its own); wrk, nginx and sluice share the other CPUs."))

    @property
    def shared_cores(self) -> str:
        """Where the script's work competes with sluice's, for the reports' readings."""
        return ("on a core of its own, apart from sluice and wrk" if self.redis_cpu is not None
                else f"on the same {common.nproc()} cores as sluice and wrk")

    # --- wrk ---------------------------------------------------------------------------------
    def wrk_run(self, id: str, r: int, port: int, host: Optional[str] = None,
                lua: Optional[Path] = None, cpu: Sequence[int] = (),
                redis_ports: Sequence[int] = ()) -> None:
        """A warm-up, then the recorded run against 127.0.0.1:PORT with Host HOST (or the wrk
        script LUA). Records req/s, latencies, the CPU of the CPU pids per request, and script calls (FCALL, EVALSHA)
        calls on REDIS_PORTS per request."""
        if lua is not None:
            args = wrk.args(self.wrk_threads, self.connections, script=str(lua))
            shown = f"-s {lua.name}"
        else:
            args = wrk.args(self.wrk_threads, self.connections, headers=[f"Host: {host}"])
            shown = f"-H 'Host: {host}'"
        self.wrk_cmd[id] = (f"wrk -t{self.wrk_threads} -c{self.connections} {shown} "
                            f"-d{self.duration} --latency http://127.0.0.1:PORT/")
        url = f"http://127.0.0.1:{port}/"
        wrk.run(self.procs, url, args, self.warmup, latency=False)
        before = cpu_ticks(cpu) if cpu else 0
        sched0 = sched_stats(cpu)
        calls0 = {p: script_stats(p)[0] for p in redis_ports}
        cmd0 = {p: commandstats(p) for p in redis_ports}
        machine0 = machine_ticks(BUDGET_NAMES)
        t0 = now_ms()
        out = wrk.run(self.procs, url, args, self.duration)
        t1 = now_ms()
        machine1 = machine_ticks(BUDGET_NAMES)
        after = cpu_ticks(cpu) if cpu else 0
        waited, preempted = sched_delta(sched0, sched_stats(cpu))
        calls = 0
        cmds: dict[str, list[int]] = {}  # command: [calls, usec] during the recorded run
        for p in redis_ports:
            for name, (c, us) in commandstats(p).items():
                c0, us0 = cmd0[p].get(name, (0, 0))
                if c > c0 and name != "info":  # INFO: this driver's own readings
                    acc = cmds.setdefault(name, [0, 0])
                    acc[0] += c - c0
                    acc[1] += us - us0
            d = script_stats(p)[0] - calls0[p]
            calls += d
            self.call_rate[id, r, p] = d * 1000 / (t1 - t0)
        (self.work / f"wrk-{id}-{r}.txt").write_text(out.text)
        row = {"rps": out.rps, "p50": out.p50_ms, "p99": out.p99_ms, "errors": out.errors,
               "cpu": (after - before) / CLK_TCK * 1e6 / out.requests if cpu else None,
               # Runnable but not running (another process had its CPU), as a share of the
               # run's wall time; and how often it was taken off its CPU so.
               "wait": waited / 1e6 / (t1 - t0) * 100 if cpu and t1 > t0 else None,
               "preempt": preempted * 1000 / out.requests if cpu else None,
               "calls": calls / out.requests if redis_ports else None,
               "requests": out.requests, "cmds": cmds if redis_ports else None}
        if out.requests:
            # Where the machine's CPU time went, per request (see budget_table).
            for name, key in BUDGET_NAMES.items():
                row[key] = (machine1[name] - machine0[name]) / CLK_TCK * 1e6 / out.requests
            row["all"] = common.nproc() * (t1 - t0) * 1e3 / out.requests
        self.res[id, r] = row
        self.log(f"round {r} {id}: {out.rps:.0f} req/s, p50 {stats.fmt(out.p50_ms, '.3f')} ms, "
                 f"p99 {stats.fmt(out.p99_ms, '.3f')} ms, sluice CPU {stats.fmt(row['cpu'], '.1f')} µs/req "
                 f"(waiting for a CPU {stats.fmt(row['wait'], '.1f')}% of the run, preempted "
                 f"{stats.fmt(row['preempt'], '.0f')} times per 1k req), "
                 f"script calls/req {stats.fmt(row['calls'], '.2f')} {out.errors}")

    def per(self, id: str, what: str) -> list:
        return [self.res.get((id, r), {}).get(what) for r in range(1, self.rounds + 1)]

    def med(self, id: str, what: str) -> Optional[float]:
        return stats.median(self.per(id, what))

    def ratio(self, what: str, a: str, b: str) -> str:
        return stats.fmt_ratio(self.per(a, what), self.per(b, what))

    def ratio_num(self, what: str, a: str, b: str) -> Optional[float]:
        return stats.median(stats.ratios(self.per(a, what), self.per(b, what)))

    def run_rounds(self, part: str, runner: Callable[[str, int], None], ids: Sequence[str]) -> None:
        """ROUNDS rounds; RUNNER(id, round) runs one target."""
        orders = []
        for r in range(1, self.rounds + 1):
            order = stats.order_of(r, ids)
            orders.append(f"round {r}: {' '.join(order)}; ")
            self.log(f"{part} round {r}/{self.rounds}: {' '.join(order)}")
            for id in order:
                runner(id, r)
        self.orders[part] = "".join(orders)

    def wrk_table(self, ids: Sequence[str]) -> list[str]:
        out = ["| target | req/s | p50 ms | p99 ms | sluice CPU µs/req | sluice waiting for a CPU, % of the run | sluice preempted per 1k req | script calls (FCALL) per request | req/s per round | p99 ms per round |",
               "|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
        for id in ids:
            out.append(
                f"| {self.label[id]} | {stats.fmt(self.med(id, 'rps'))} | {stats.fmt(self.med(id, 'p50'), '.3f')} "
                f"| {stats.fmt(self.med(id, 'p99'), '.3f')} | {stats.fmt(self.med(id, 'cpu'), '.1f')} "
                f"| {stats.fmt(self.med(id, 'wait'), '.1f')} | {stats.fmt(self.med(id, 'preempt'), '.0f')} "
                f"| {stats.fmt(self.med(id, 'calls'), '.2f')} "
                f"| {', '.join(stats.fmt(v) for v in self.per(id, 'rps'))} "
                f"| {', '.join(stats.fmt(v, '.2f') for v in self.per(id, 'p99'))} |")
        return out

    def budget_table(self, ids: Sequence[str]) -> list[str]:
        """Where the machine's CPU time went per request, process by process (medians over
        rounds). On cores that every process shares, a route's req/s is set by the sum, not by
        sluice's part alone: a Redis call costs the route Redis's time, and the wake-ups and
        idle gaps it brings to nginx and wrk, as well as sluice's own."""
        out = ["| target | sluice | redis-server | nginx (backends) | wrk | idle | all: CPUs × run time / requests |",
               "|---|---:|---:|---:|---:|---:|---:|"]
        for id in ids:
            out.append(f"| {self.label[id]} | "
                       + " | ".join(stats.fmt(self.med(id, key), ".1f")
                                    for key in ("bcpu_sluice", "bcpu_redis", "bcpu_nginx", "bcpu_wrk",
                                                "bcpu_idle", "all"))
                       + " |")
        return out

    def wrk_errors(self, ids: Sequence[str]) -> str:
        out = " ".join(f"{id} round {r}: {self.res[id, r]['errors']}" for id in ids
                       for r in range(1, self.rounds + 1)
                       if (id, r) in self.res and self.res[id, r]["errors"])
        return out or "none"

    # --- redis-benchmark -------------------------------------------------------------------
    def rb_measure(self, port: int, n: int, clients: int, *cmd: str) -> tuple[float, float, int, int]:
        """CONFIG RESETSTAT, one redis-benchmark run: (calls/s, µs per call in Redis, calls, failed)."""
        rcli(port, "CONFIG", "RESETSTAT")
        out = self.procs.run(["redis-benchmark", "-p", str(port), "-n", str(n), "-c", str(clients),
                              "--csv", *cmd], timeout=1800)
        lines = [l.replace('"', "") for l in out.replace("\r", "").splitlines() if l.strip()]
        if len(lines) < 2:
            raise Failure(f"could not read redis-benchmark's output: {out}")
        rps = float(lines[1].split(",")[1])
        calls, usec, failed = script_stats(port)
        return rps, (usec / calls if calls else 0.0), calls, failed


def when(x: Optional[float], test: Callable[[float], bool], yes: str, no: str) -> str:
    """YES if X passes TEST, else NO (a missing X fails)."""
    return yes if x is not None and test(x) else no


def wait_quiet(run_log: Callable[[str], None]) -> None:
    """Waits (at most 30 minutes) until no other benchmark runs, which would skew the figures."""
    pattern = "wrk |cargo bench|valgrind|callgrind"
    for _ in range(90):
        p = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True, timeout=30)
        if not p.stdout.strip():
            return
        run_log(f"another benchmark runs ({' '.join(p.stdout.split())}); waiting 20 s")
        time.sleep(20)
    run_log("warning: other benchmarks still run after 30 minutes; going on anyway")
