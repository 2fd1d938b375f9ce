"""The servers the benchmarks start: nginx (backends and proxy), sluice and redis-server."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from .procs import Failure, Procs


def http_get(url: str, timeout: float = 5.0, method: str = "GET",
             headers: Optional[dict] = None) -> tuple[int, str]:
    """(status, body) of one request; status 0 when it could not be sent."""
    req = urllib.request.Request(url, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (urllib.error.URLError, OSError):
        return 0, ""


# --- nginx ------------------------------------------------------------------------------------
def nginx_conf(dir: Path, http_body: str) -> str:
    """A foreground nginx config with every path inside DIR and one worker."""
    return f"""worker_processes 1;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 4096; }}
http {{
  keepalive_requests 10000000;
  keepalive_timeout 300s;
  client_body_temp_path {dir}/tmp/body;
  proxy_temp_path {dir}/tmp/proxy;
  fastcgi_temp_path {dir}/tmp/fastcgi;
  uwsgi_temp_path {dir}/tmp/uwsgi;
  scgi_temp_path {dir}/tmp/scgi;
{http_body}
}}
"""


def start_nginx(procs: Procs, name: str, port: int, http_body: str) -> subprocess.Popen:
    """nginx with its config and logs in WORK/NAME; returns the master."""
    dir = procs.work / name
    (dir / "tmp").mkdir(parents=True, exist_ok=True)
    conf = dir / "nginx.conf"
    conf.write_text(nginx_conf(dir, http_body))
    base = ["nginx", "-p", str(dir), "-c", str(conf), "-e", str(dir / "error.log")]
    test = subprocess.run(base + ["-t", "-q"], capture_output=True, text=True, timeout=30)
    if test.returncode != 0:
        raise Failure(f"nginx rejected {conf}: {test.stderr.strip()}")
    proc = procs.start(base, out=dir / "stdout.log")
    procs.wait_listening(port, proc, f"nginx ({name})")
    return proc


@dataclass
class Backends:
    ports: list[int]
    status_ports: list[int]  # stub_status servers, one per backend (empty without them)

    def members_yaml(self, indent: str) -> str:
        return "".join(f'{indent}- url: "http://127.0.0.1:{p}"\n' for p in self.ports)

    def route_yaml(self, name: str, selection: str, host: str) -> str:
        """One entry of `routes:`, NAME, over both backends, for requests to HOST."""
        return (f'  - name: {name}\n    match:\n      hosts: ["{host}"]\n    upstream:\n'
                f"      selection: {selection}\n      members:\n" + self.members_yaml("        "))

    def round_robin_routes_yaml(self) -> str:
        """`routes:` with one round_robin route, `bench`, over both backends, matching any host."""
        return "routes:\n" + self.route_yaml("bench", "round_robin", "*")

    def accepts(self) -> Optional[int]:
        """Connections accepted so far by both backends, from stub_status (None if unreadable).
        Each reading adds one accept per backend (its own); the difference of two readings
        therefore counts those twice over, which callers subtract."""
        total = 0
        for p in self.status_ports:
            status, body = http_get(f"http://127.0.0.1:{p}/")
            m = re.search(r"server accepts handled requests\s+(\d+)", body)
            if status != 200 or not m:
                return None
            total += int(m.group(1))
        return total


def start_backends(procs: Procs, status: bool = False) -> Backends:
    """Two nginx backends (one worker, access_log off) answering a fixed "ok\\n"; with STATUS,
    each with a stub_status server on a port of its own, so that reading the counters never
    touches the measured server."""
    ports, status_ports = [], []
    for b in (1, 2):
        port = procs.free_port()
        status_server = ""
        if status:
            sp = procs.free_port()
            status_ports.append(sp)
            status_server = f"""  server {{
    listen 127.0.0.1:{sp};
    location / {{ stub_status; }}
  }}"""
        start_nginx(procs, f"backend{b}", port, f"""  access_log off;
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    location / {{
      default_type text/plain;
      return 200 "ok\\n";
    }}
  }}
{status_server}""")
        ports.append(port)
    procs.log(f"nginx backends on 127.0.0.1:{ports[0]} and 127.0.0.1:{ports[1]}")
    return Backends(ports, status_ports)


def nginx_has_stub_status() -> bool:
    p = subprocess.run(["nginx", "-V"], capture_output=True, text=True, timeout=30)
    return "http_stub_status_module" in p.stdout + p.stderr


# --- sluice -----------------------------------------------------------------------------------
@dataclass
class Sluice:
    proc: subprocess.Popen
    port: int
    admin: int
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid


def check_config(sluice: Path, cfg: Path) -> None:
    p = subprocess.run([str(sluice), "check", "-c", str(cfg)], capture_output=True, text=True,
                       timeout=120)
    if p.returncode != 0:
        raise Failure(f"sluice check rejected {cfg}: {(p.stdout + p.stderr).strip()[-800:]}")


def start_sluice(procs: Procs, sluice: Path, name: str, cfg: Path, port: int, admin: int,
                 rust_log: Optional[str], timeout: float = 30.0,
                 wrapper: Sequence[str] = ()) -> Sluice:
    """`sluice run -c CFG`, its output appended to WORK/logs/NAME.log. RUST_LOG=None leaves
    it unset (sluice's default: the JSON access log on). The config should sit in a directory
    of its own: sluice watches its config's directory."""
    check_config(sluice, cfg)
    env = dict(os.environ)
    env.pop("RUST_LOG", None)
    if rust_log is not None:
        env["RUST_LOG"] = rust_log
    log = procs.work / "logs" / f"{name}.log"
    proc = procs.start([*wrapper, str(sluice), "run", "-c", str(cfg)], out=log, env=env)
    procs.wait_listening(port, proc, f"sluice ({name})", timeout)
    procs.wait_listening(admin, proc, f"sluice admin ({name})", timeout)
    return Sluice(proc, port, admin, log)


def store_errors(admin: int, log: Optional[Path] = None) -> str:
    """sluice_store_errors_total + sluice_selection_fallbacks_total: "0", or the sum with the
    series and the first logged store error."""
    _, metrics = http_get(f"http://127.0.0.1:{admin}/metrics")
    total, series = 0.0, []
    for line in metrics.splitlines():
        if line.startswith(("sluice_store_errors_total", "sluice_selection_fallbacks_total")):
            value = float(line.split()[-1])
            if value > 0:
                total += value
                series.append(f"`{line}`")
    if not total:
        return "0"
    out = f"{total:.0f} ({'; '.join(series)})"
    if log is not None and log.exists():
        first = "(no log line found)"
        for line in log.read_text(errors="replace").splitlines():
            if "state store failed" in line:
                m = re.search(r'"error":"[^"]*"', line)
                first = m.group(0) if m else first
                break
        out += f", first logged {first}"
    return out


def wait_ok(url: str, host: str, what: str) -> None:
    """Fails unless URL answers 200 with this Host (a route must work before it is measured)."""
    status, _ = http_get(url, headers={"Host": host})
    if status != 200:
        raise Failure(f"{what} answered {status}")


# --- Redis ------------------------------------------------------------------------------------
# The CPU every redis-server runs on, or None to leave them where the scheduler puts them.
# Set by pin_redis(); read by start_redis().
REDIS_CPU: Optional[int] = None


def pin_redis(cpu: int) -> None:
    """Gives Redis CPU CPU to itself: every redis-server started from now on runs there, and this
    process (so everything else it starts: wrk, nginx, sluice) runs on the other CPUs.

    In production Redis is a service on a host of its own, shared by every gateway instance. On
    a 2-core box that also holds wrk, the backends and sluice, an unpinned Redis competes with the
    load generator for the same cores, so a route that asks more of Redis loses req/s that a
    gateway host would never lose. Pinned, the req/s measure the gateway side; Redis's own cost
    per call is still read from its commandstats."""
    global REDIS_CPU
    cpus = os.sched_getaffinity(0)
    if cpu not in cpus or len(cpus) < 2:
        raise Failure(f"REDIS_CPU={cpu}: this process may run on CPUs {sorted(cpus)}; "
                      "Redis needs one of them, and the rest need at least one other")
    os.sched_setaffinity(0, cpus - {cpu})
    REDIS_CPU = cpu


def start_redis(procs: Procs, name: str, port: int, *args: str) -> subprocess.Popen:
    """A redis-server on 127.0.0.1:PORT, nothing saved, its files in WORK/NAME."""
    dir = procs.work / name
    dir.mkdir(parents=True, exist_ok=True)
    # taskset sets its own affinity and then execs redis-server, so every thread Redis starts
    # inherits it and the pid stays Redis's own.
    pin = [] if REDIS_CPU is None else ["taskset", "-c", str(REDIS_CPU)]
    proc = procs.start([*pin, "redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                        "--appendonly", "no", "--dir", str(dir), "--logfile", str(dir / "redis.log"),
                        "--daemonize", "no", *args])
    procs.wait_listening(port, proc, f"redis-server ({name})")
    for _ in range(100):
        if rcli(port, "PING", check=False).strip() == "PONG":
            return proc
        time.sleep(0.1)
    raise Failure(f"redis-server ({name}) does not answer PING")


def rcli(port: int, *args: str, stdin: Optional[bytes] = None, check: bool = True) -> str:
    """redis-cli -p PORT ARGS..., its output without carriage returns."""
    p = subprocess.run(["redis-cli", "-p", str(port), *args], input=stdin, capture_output=True,
                       timeout=120)
    if check and p.returncode != 0:
        raise Failure(f"redis-cli -p {port} {' '.join(args[:3])}...: {p.stderr.decode(errors='replace')}")
    return p.stdout.decode(errors="replace").replace("\r", "")


def script_stats(port: int) -> tuple[int, int, int]:
    """(calls, usec, failed_calls) of script calls since the last CONFIG RESETSTAT: FCALL (sluice's
    function library) and EVALSHA (its scripts, where Redis takes no functions; redis-benchmark)."""
    total = [0, 0, 0]
    for line in rcli(port, "INFO", "commandstats").splitlines():
        if line.startswith(("cmdstat_evalsha:", "cmdstat_fcall:")):
            v = dict(kv.split("=", 1) for kv in line.split(":", 1)[1].split(","))
            for i, k in enumerate(("calls", "usec", "failed_calls")):
                total[i] += int(v.get(k, 0))
    return total[0], total[1], total[2]


def commandstats(port: int) -> dict[str, tuple[int, int]]:
    """Every command's (calls, usec) since the last CONFIG RESETSTAT. Commands a script runs
    (redis.call) are counted under their own names too."""
    out = {}
    for line in rcli(port, "INFO", "commandstats").splitlines():
        if line.startswith("cmdstat_"):
            name, rest = line[len("cmdstat_"):].split(":", 1)
            v = dict(kv.split("=", 1) for kv in rest.split(","))
            out[name] = (int(v.get("calls", 0)), int(v.get("usec", 0)))
    return out


def lua_script(root: Path, *parts: str) -> bytes:
    """The script exactly as the Rust code builds it: the files joined by "\\n", byte for byte."""
    return b"\n".join((root / "lua" / p).read_bytes() for p in parts)


def load_script(port: int, script: bytes) -> str:
    """SCRIPT LOAD with the exact bytes (redis-cli -x reads the last argument from stdin,
    unaltered); checks that Redis answers the SHA-1 of those bytes."""
    sha = rcli(port, "-x", "SCRIPT", "LOAD", stdin=script).strip()
    expect = hashlib.sha1(script).hexdigest()
    if sha != expect:
        raise Failure(f"SCRIPT LOAD answered {sha!r}, expected {expect}")
    return sha


def populate_pool(port: int, key: str, size: int) -> None:
    """A least_used pool of SIZE members at count 0."""
    rcli(port, "DEL", key)
    for start in range(1, size + 1, 1000):
        args = []
        for i in range(start, min(start + 1000, size + 1)):
            args += ["0", f"http://10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}:8080"]
        rcli(port, "ZADD", key, *args)
    if rcli(port, "ZCARD", key).strip() != str(size):
        raise Failure(f"pool {key} does not hold {size} members")

