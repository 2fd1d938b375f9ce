"""scripts/bench-idle-memory: resident memory around idle client connections, sluice's and an nginx proxy's.

Why: 5,000 idle connections once grew RSS by 224 MB, and it stayed after
they left. For each mode this starts a fresh sluice (one route to a sluice-echo member,
`limits.idle_timeout: 10m` so the connections stay while measured) and, for the modes nginx can
serve, a fresh nginx proxy to the same member (one worker, `keepalive_timeout 300s`), and for
each round:

  1. reads VmRSS of the process (/proc/PID/status; nginx: its worker);
  2. opens CONNS connections, in the mode's way (below), and leaves them idle;
  3. waits until sluice_connections_open says CONNS (nginx: stub_status's active connections, if
     it has the module), reads VmRSS;
  4. closes them all, waits until sluice_connections_open is back to 0, reads VmRSS;
  5. if sluice has `sluice_memory_trims_total` (it trims by itself after many connections
     closed, limits::MemoryTrim, looking every 5 s), waits until that counter rises above what
     it was when the count reached 0, for at most 15 s (a trim made while the connections were
     closing may have left less than its threshold to trim), reads VmRSS;
  6. with TRIM_PROBE=1 (and gdb installed), calls glibc's malloc_trim(0) in the process through
     gdb and reads VmRSS again: what the allocator keeps but could give back.

Modes: `request` (one keep-alive GET answered, then idle), `silent` (connected, nothing sent),
`tls` and `tls-silent` (the same through a TLS listener, handshake done), `tunnel` (a CONNECT to
the member answered 200, then idle; nginx does not tunnel) and `tls-tunnel` (the same inside a
TLS connection to the TLS listener).

A second round shows whether what is kept is reused (RSS flat) or leaked (RSS grows again).
Every wait polls a condition with a deadline.

Knobs (environment): CONNS (5000), ROUNDS (2), MODES ("request silent"), PROFILE (release, or
debug: the unoptimised binary, quicker to build), SLUICE_THREADS (2), ARENA_MAX (unset, or a
number for glibc's MALLOC_ARENA_MAX), TRIM_PROBE (1), NGINX (auto: when nginx is installed;
0 or 1), BUILD (1), SLUICE_BIN_DIR, KEEP (0), DOC (docs/benchmark-runs.md).
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

KNOB_NAMES = ["CONNS", "ROUNDS", "MODES", "PROFILE", "SLUICE_THREADS", "ARENA_MAX", "TRIM_PROBE",
              "NGINX"]
MODES = ("request", "silent", "tls", "tls-silent", "tunnel", "tls-tunnel")
# The first connection of each mode, before it is measured (a silent one would allocate nothing).
WARM_UP = {"request": "request", "silent": "request", "tls": "tls", "tls-silent": "tls",
           "tunnel": "tunnel", "tls-tunnel": "tls-tunnel"}
# What nginx can be measured in (it does not tunnel).
NGINX_MODES = ("request", "silent", "tls", "tls-silent")
START = "<!-- bench:idle-memory:start -->"
END = "<!-- bench:idle-memory:end -->"


def rss_kib(pid: int) -> int:
    """VmRSS of PID, in KiB."""
    m = re.search(r"^VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    if not m:
        raise RuntimeError(f"no VmRSS for {pid}")
    return int(m.group(1))


def read_head(s: socket.socket, i: int) -> bytes:
    """One response head and its content-length body off S; fails unless its status is 200."""
    from .procs import Failure
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = s.recv(65536)
        if not chunk:
            raise Failure(f"connection {i} closed before its answer")
        head += chunk
    status = head.split(b" ", 2)[1]
    if status != b"200":
        raise Failure(f"connection {i}: status {status.decode(errors='replace')}")
    m = re.search(rb"(?i)\r\ncontent-length:\s*(\d+)", head)
    body = head.split(b"\r\n\r\n", 1)[1]
    want = int(m.group(1)) if m else 0
    while len(body) < want:
        chunk = s.recv(65536)
        if not chunk:
            raise Failure(f"connection {i} closed mid-answer")
        body += chunk
    return head


def open_connections(port: int, n: int, mode: str, tls: ssl.SSLContext | None = None,
                     member: int = 0, timeout: float = 120.0) -> list[socket.socket]:
    """N connections to 127.0.0.1:PORT, each left as MODE says (see the module's doc); the tls
    modes handshake with the context TLS first; the tunnel modes CONNECT to MEMBER."""
    from .procs import Failure
    request = b"GET /idle HTTP/1.1\r\nHost: idle.test\r\n\r\n"
    connect = f"CONNECT 127.0.0.1:{member} HTTP/1.1\r\nHost: 127.0.0.1:{member}\r\n\r\n".encode()
    conns: list[socket.socket] = []
    deadline = time.monotonic() + timeout
    try:
        for i in range(n):
            if time.monotonic() > deadline:
                raise Failure(f"opened only {i} of {n} connections within {timeout:.0f} s")
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            conns.append(s)
            if mode.startswith("tls"):
                assert tls is not None
                s = tls.wrap_socket(s, server_hostname="localhost")
                conns[-1] = s
            if mode in ("request", "tls"):
                s.sendall(request)
                read_head(s, i)
            elif mode in ("tunnel", "tls-tunnel"):
                s.sendall(connect)
                read_head(s, i)
    except BaseException:
        for s in conns:
            s.close()
        raise
    return conns


def make_certificate(dir: Path) -> tuple[Path, Path]:
    """A self-signed RSA 2048 certificate for localhost and 127.0.0.1, and its key."""
    from .procs import Failure
    dir.mkdir(parents=True, exist_ok=True)
    cert, key = dir / "cert.pem", dir / "key.pem"
    p = subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                        "-subj", "/CN=localhost", "-addext",
                        "subjectAltName=DNS:localhost,IP:127.0.0.1",
                        "-keyout", str(key), "-out", str(cert)],
                       capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        raise Failure(f"openssl could not make a certificate: {p.stderr.strip()[-400:]}")
    return cert, key


def client_tls(cert: Path) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(cert))
    ctx.check_hostname = False
    return ctx


def nginx_active(status_port: int) -> int | None:
    """nginx's active connections from stub_status (its own reading included)."""
    from .servers import http_get
    status, body = http_get(f"http://127.0.0.1:{status_port}/")
    m = re.search(r"Active connections:\s*(\d+)", body)
    return int(m.group(1)) if status == 200 and m else None


def wait_nginx(status_port: int | None, want: int, timeout: float = 60.0) -> None:
    """Waits until nginx holds WANT client connections besides the status reading; without
    stub_status, only a short settle."""
    from .procs import Failure
    if status_port is None:
        time.sleep(1.0)
        return
    deadline = time.monotonic() + timeout
    seen = None
    while time.monotonic() < deadline:
        seen = nginx_active(status_port)
        if seen is not None and seen - 1 == want:
            return
        time.sleep(0.05)
    raise Failure(f"nginx's active connections stayed at {seen}, not {want} + 1, for {timeout:.0f} s")


def gauge(admin: int, name: str) -> int | None:
    """A metric without labels, None when sluice does not export it."""
    from .servers import http_get
    status, body = http_get(f"http://127.0.0.1:{admin}/metrics")
    m = re.search(rf"^{name} (\d+)", body, re.M)
    return int(m.group(1)) if status == 200 and m else None


def connections_open(admin: int) -> int | None:
    return gauge(admin, "sluice_connections_open")


def wait_trim(admin: int, after: int, timeout: float = 15.0) -> bool:
    """Waits until sluice_memory_trims_total is above AFTER; False if it did not rise within
    TIMEOUT (three of sluice's trim periods)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (gauge(admin, "sluice_memory_trims_total") or 0) > after:
            return True
        time.sleep(0.1)
    return False


def wait_open(admin: int, want: int, timeout: float = 60.0) -> None:
    from .procs import Failure
    deadline = time.monotonic() + timeout
    seen = None
    while time.monotonic() < deadline:
        seen = connections_open(admin)
        if seen == want:
            return
        time.sleep(0.05)
    raise Failure(f"sluice_connections_open stayed at {seen}, not {want}, for {timeout:.0f} s")


def malloc_trim(pid: int) -> bool:
    """Calls malloc_trim(0) inside PID through gdb; False when gdb could not."""
    p = subprocess.run(["gdb", "-p", str(pid), "-batch", "-nx", "-ex", "call (int) malloc_trim(0)"],
                       capture_output=True, text=True, timeout=120)
    return p.returncode == 0 and re.search(r"^\$1 = [01]$", p.stdout, re.M) is not None


def binaries(knobs, name: str, profile: str) -> tuple[Path, Path]:
    """(sluice, sluice-echo) of PROFILE, built unless BUILD=0."""
    from . import common
    from .procs import Failure
    if profile == "release":
        sluice = common.sluice_binary(name, knobs, bins=("--bins",))
        return sluice, sluice.parent / "sluice-echo"
    bin_dir = os.environ.get("SLUICE_BIN_DIR")
    if bin_dir:
        d = Path(bin_dir)
    else:
        target = Path(os.environ.get("CARGO_TARGET_DIR", "target"))
        d = (target if target.is_absolute() else common.ROOT / target) / "debug"
        if knobs.choice("BUILD", "1", ("0", "1")) == "1":
            subprocess.run(["cargo", "build", "--bins"], cwd=common.ROOT, check=True,
                           stdout=sys.stderr, timeout=3600)
    for b in ("sluice", "sluice-echo"):
        if not os.access(d / b, os.X_OK):
            raise Failure(f"no executable {d / b} (build it, or set SLUICE_BIN_DIR)")
    return d / "sluice", d / "sluice-echo"


def mib(kib: int) -> str:
    return f"{kib / 1024:.1f}"


def sluice_yaml(port: int, tls_port: int, admin: int, member: int, threads: int, conns: int,
                cert: Path, key: Path) -> str:
    return f"""listen:
  - "127.0.0.1:{port}"
  - addr: "127.0.0.1:{tls_port}"
    tls: {{cert: "{cert}", key: "{key}"}}
threads: {threads}
admin:
  listen: "127.0.0.1:{admin}"
limits:
  idle_timeout: 10m
  header_timeout: 10m
  max_connections: {conns + 1000}
egress:
  allow_cidrs: ["127.0.0.0/8"]
  connect_ports: [{member}]
routes:
  - name: idle
    match:
      hosts: ["idle.test"]
    upstream:
      members:
        - url: "http://127.0.0.1:{member}"
  - name: tunnel
    match:
      hosts: ["127.0.0.1"]
    upstream:
      read_timeout: 10m
      members:
        - direct: true
"""


def nginx_http(port: int, tls_port: int, status_port: int | None, member: int, cert: Path,
               key: Path) -> str:
    status = (f"  server {{ listen 127.0.0.1:{status_port}; access_log off; "
              f"location / {{ stub_status; }} }}\n" if status_port else "")
    proxy = f"""    access_log off;
    location / {{
      proxy_pass http://member;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
    }}"""
    return f"""  upstream member {{ server 127.0.0.1:{member}; keepalive 32; }}
  server {{
    listen 127.0.0.1:{port};
{proxy}
  }}
  server {{
    listen 127.0.0.1:{tls_port} ssl;
    ssl_certificate {cert};
    ssl_certificate_key {key};
{proxy}
  }}
{status}"""


def main(argv: list[str]) -> int:
    from . import common, doc
    from .procs import Failure, Procs, children_of
    from .servers import nginx_has_stub_status, start_nginx, start_sluice

    parser = argparse.ArgumentParser(prog="scripts/bench-idle-memory", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true",
                        help="replace the idle-memory section of docs/benchmark-runs.md with the report")
    opts = parser.parse_args(argv)

    knobs = common.Knobs()
    conns = knobs.int("CONNS", 5000, minimum=1)
    rounds = knobs.int("ROUNDS", 2, minimum=1)
    modes = knobs.str("MODES", "request silent").split()
    if not modes or any(m not in MODES for m in modes):
        raise Failure(f"MODES must be words among {' '.join(MODES)}, not {' '.join(modes)!r}")
    profile = knobs.choice("PROFILE", "release", ("release", "debug"))
    threads = knobs.int("SLUICE_THREADS", 2, minimum=1)
    arena_max = knobs.str("ARENA_MAX", "")
    if arena_max and not arena_max.isdigit():
        raise Failure(f"ARENA_MAX must be a number or empty, not {arena_max!r}")
    trim_probe = knobs.choice("TRIM_PROBE", "1", ("0", "1")) == "1"
    if trim_probe and shutil.which("gdb") is None:
        raise Failure("TRIM_PROBE=1 needs gdb (On Debian: apt-get install -y gdb), or set TRIM_PROBE=0")
    nginx_knob = knobs.choice("NGINX", "auto", ("auto", "0", "1"))
    with_nginx = nginx_knob == "1" or (nginx_knob == "auto" and shutil.which("nginx") is not None)
    if with_nginx:
        common.require("bench-idle-memory", ["nginx"], "nginx-light")
    if any(m.startswith("tls") for m in modes) or with_nginx:
        common.require("bench-idle-memory", ["openssl"], "openssl")
    keep = knobs.choice("KEEP", "0", ("0", "1")) == "1"
    doc_path = Path(knobs.str("DOC", str(common.DOC)))
    command_line = f"{knobs.line(KNOB_NAMES)} scripts/bench-idle-memory" + (" --write" if opts.write else "")

    # The client holds CONNS sockets; sluice raises its own limit at start.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < conns + 100:
        if hard != resource.RLIM_INFINITY and hard < conns + 100:
            raise Failure(f"the open-file hard limit ({hard}) is below CONNS + 100")
        resource.setrlimit(resource.RLIMIT_NOFILE, (conns + 100, hard))

    procs = Procs("bench-idle-memory", keep)
    rows = []
    started = {}
    self_trims = False
    try:
        sluice, echo = binaries(knobs, "bench-idle-memory", profile)
        cert, key = make_certificate(procs.work / "tls")
        tls = client_tls(cert)
        member = procs.free_port()
        m = procs.start([str(echo), "--name", "m", "--listen", f"127.0.0.1:{member}"],
                        out=procs.work / "logs" / "echo.log")
        procs.wait_listening(member, m, "sluice-echo")
        stub_status = with_nginx and nginx_has_stub_status()

        def rounds_of(proxy: str, mode: str, pid: int, port: int, tls_port: int,
                      wait_count, trims_of) -> None:
            """ROUNDS rounds of MODE against the process PID (sluice's, or nginx's worker)."""
            target = tls_port if mode.startswith("tls") else port
            for r in range(1, rounds + 1):
                before = rss_kib(pid)
                held = open_connections(target, conns, mode, tls, member)
                wait_count(conns)
                peak = rss_kib(pid)
                for c in held:
                    c.close()
                held.clear()
                wait_count(0)
                after = rss_kib(pid)
                own = None
                if trims_of is not None:
                    if not wait_trim(trims_of, gauge(trims_of, "sluice_memory_trims_total") or 0):
                        procs.log(f"{mode} round {r}: no trim of sluice's own within 15 s of the close")
                    own = rss_kib(pid)
                trimmed = None
                if trim_probe and proxy == "sluice":
                    if not malloc_trim(pid):
                        raise Failure("gdb could not call malloc_trim in sluice (ptrace not allowed?)")
                    trimmed = rss_kib(pid)
                rows.append((proxy, mode, r, before, peak, after, own, trimmed))
                procs.log(f"{proxy} {mode} round {r}: VmRSS {mib(before)} -> {mib(peak)} with {conns} open "
                          f"({(peak - before) / conns:.1f} KiB each) -> {mib(after)} after they closed"
                          + (f" -> {mib(own)} after sluice's own trim" if own is not None else "")
                          + (f" -> {mib(trimmed)} after malloc_trim(0) by gdb" if trimmed is not None else ""))

        # Each mode on fresh processes: what a round leaves behind (memory freed but kept, or
        # recycled) would otherwise weigh on the next mode.
        for mode in modes:
            port, tls_port, admin = procs.free_port(), procs.free_port(), procs.free_port()
            cfg = procs.work / f"conf-{mode}" / "sluice.yaml"
            cfg.parent.mkdir(parents=True, exist_ok=True)
            cfg.write_text(sluice_yaml(port, tls_port, admin, member, threads, conns, cert, key))
            if arena_max:
                os.environ["MALLOC_ARENA_MAX"] = arena_max
            try:
                s = start_sluice(procs, sluice, f"sluice-{mode}", cfg, port, admin, None)
            finally:
                os.environ.pop("MALLOC_ARENA_MAX", None)
            # One connection of the mode first, so that what the first one allocates once (the
            # route's upstream connection, lazily built state, TLS configuration) is in the
            # baseline.
            for c in open_connections(tls_port if mode.startswith("tls") else port, 1,
                                      WARM_UP[mode], tls, member):
                c.close()
            wait_open(admin, 0)
            started[("sluice", mode)] = rss_kib(s.pid)
            self_trims = gauge(admin, "sluice_memory_trims_total") is not None
            rounds_of("sluice", mode, s.pid, port, tls_port, lambda n: wait_open(admin, n),
                      admin if self_trims else None)
            procs.stop(s.proc)
            if not with_nginx or mode not in NGINX_MODES:
                continue
            port, tls_port = procs.free_port(), procs.free_port()
            status_port = procs.free_port() if stub_status else None
            master = start_nginx(procs, f"nginx-{mode}", port,
                                 nginx_http(port, tls_port, status_port, member, cert, key))
            procs.wait_listening(tls_port, master, "nginx (TLS)")
            workers = children_of(master.pid)
            if len(workers) != 1:
                raise Failure(f"nginx has {len(workers)} workers, not 1")
            for c in open_connections(tls_port if mode.startswith("tls") else port, 1,
                                      WARM_UP[mode], tls, member):
                c.close()
            wait_nginx(status_port, 0)
            started[("nginx", mode)] = rss_kib(workers[0])
            rounds_of("nginx", mode, workers[0], port, tls_port,
                      lambda n: wait_nginx(status_port, n), None)
            procs.stop(master)
    finally:
        procs.cleanup()

    lines = [
        "## Memory around idle client connections (`scripts/bench-idle-memory`)",
        "",
        f"Run on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, sluice {common.git_revision()} "
        f"({profile} build), `nproc` = {common.nproc()}"
        + (f", `MALLOC_ARENA_MAX={arena_max}`" if arena_max else "")
        + (f", against {common.nginx_version()} (one worker) in the same run" if with_nginx else "")
        + ".",
        "",
        "```sh",
        command_line,
        "```",
        "",
        f"VmRSS in MiB of the sluice process (`threads: {threads}`), and of the nginx proxy's "
        "worker; each mode on fresh processes, after one connection of its own. `request`: each "
        "connection sent one keep-alive request, read its answer and stayed idle; `silent`: each "
        "connected and sent nothing; `tls`, `tls-silent`: the same through a TLS listener "
        "(handshake done); `tunnel`, `tls-tunnel`: a CONNECT to the member answered `200`, then "
        "idle. \"closed\": once the connection count is back to 0 (sluice may "
        "have trimmed already while they closed); \"sluice's trim\": once "
        "`sluice_memory_trims_total` has risen after that (or 15 s later if it did not); \"gdb trim\": after glibc's `malloc_trim(0)`, "
        "called in sluice through gdb (what the allocator still held that it could give back).",
        "",
        "| proxy | mode | round | before | " + f"{conns} open | KiB per connection | closed |"
        + (" sluice's trim |" if self_trims else "") + (" gdb trim |" if trim_probe else "")
        + " kept at the end |",
        "|---|---|---:|---:|---:|---:|---:|" + ("---:|" if self_trims else "")
        + ("---:|" if trim_probe else "") + "---:|",
    ]
    for proxy, mode, r, before, peak, after, own, trimmed in rows:
        end = own if own is not None else after
        lines.append(
            f"| {proxy} | {mode} | {r} | {mib(before)} | {mib(peak)} | {(peak - before) / conns:.1f} | "
            f"{mib(after)} |" + ((f" {mib(own)} |" if own is not None else " — |") if self_trims else "")
            + ((f" {mib(trimmed)} |" if trimmed is not None else " — |") if trim_probe else "")
            + f" {mib(end - before)} |")
    lines.append("")
    lines.append("VmRSS after start and the first connection: "
                 + ", ".join(f"{p} {m} {mib(v)} MiB" for (p, m), v in started.items()) + ".")
    report = "\n".join(lines)
    print(report)
    if opts.write:
        doc.replace_section(doc_path, START, END, report)
    return 0
