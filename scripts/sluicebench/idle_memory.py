"""scripts/bench-idle-memory: sluice's resident memory around 5,000 idle client connections.

Why: 5,000 idle connections once grew RSS by 224 MB, and it stayed after
they left. This starts sluice (one route to a sluice-echo member, `limits.idle_timeout: 10m` so
the connections stay while measured), and for each round:

  1. reads VmRSS of the sluice process (/proc/PID/status);
  2. opens CONNS connections; in mode `request` each sends one keep-alive request and reads the
     answer, then sits idle; in mode `silent` each connects and sends nothing;
  3. waits until sluice_connections_open says CONNS, reads VmRSS;
  4. closes them all, waits until sluice_connections_open is back to 0, reads VmRSS;
  5. if sluice has `sluice_memory_trims_total` (it trims by itself after many connections
     closed, limits::MemoryTrim, looking every 5 s), waits until that counter rises above what
     it was when the count reached 0, for at most 15 s (a trim made while the connections were
     closing may have left less than its threshold to trim), reads VmRSS;
  6. with TRIM_PROBE=1 (and gdb installed), calls glibc's malloc_trim(0) in the process through
     gdb and reads VmRSS again: what the allocator keeps but could give back.

A second round shows whether what is kept is reused (RSS flat) or leaked (RSS grows again).
Every wait polls a condition with a deadline.

Knobs (environment): CONNS (5000), ROUNDS (2), MODES ("request silent"), PROFILE (release, or
debug: the unoptimised binary, quicker to build), SLUICE_THREADS (2), ARENA_MAX (unset, or a
number for glibc's MALLOC_ARENA_MAX), TRIM_PROBE (1), BUILD (1), SLUICE_BIN_DIR, KEEP (0),
DOC (docs/benchmark-runs.md).
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

KNOB_NAMES = ["CONNS", "ROUNDS", "MODES", "PROFILE", "SLUICE_THREADS", "ARENA_MAX", "TRIM_PROBE"]
START = "<!-- bench:idle-memory:start -->"
END = "<!-- bench:idle-memory:end -->"


def rss_kib(pid: int) -> int:
    """VmRSS of PID, in KiB."""
    m = re.search(r"^VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    if not m:
        raise RuntimeError(f"no VmRSS for {pid}")
    return int(m.group(1))


def open_connections(port: int, n: int, mode: str, timeout: float = 120.0) -> list[socket.socket]:
    """N connections to 127.0.0.1:PORT; in mode `request`, each has had one request answered."""
    from .procs import Failure
    request = b"GET /idle HTTP/1.1\r\nHost: idle.test\r\n\r\n"
    conns: list[socket.socket] = []
    deadline = time.monotonic() + timeout
    try:
        for i in range(n):
            if time.monotonic() > deadline:
                raise Failure(f"opened only {i} of {n} connections within {timeout:.0f} s")
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            conns.append(s)
            if mode == "request":
                s.sendall(request)
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
    except BaseException:
        for s in conns:
            s.close()
        raise
    return conns


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


def main(argv: list[str]) -> int:
    from . import common, doc
    from .procs import Failure, Procs
    from .servers import start_sluice

    parser = argparse.ArgumentParser(prog="scripts/bench-idle-memory", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true",
                        help="replace the idle-memory section of docs/benchmark-runs.md with the report")
    opts = parser.parse_args(argv)

    knobs = common.Knobs()
    conns = knobs.int("CONNS", 5000, minimum=1)
    rounds = knobs.int("ROUNDS", 2, minimum=1)
    modes = knobs.str("MODES", "request silent").split()
    if not modes or any(m not in ("request", "silent") for m in modes):
        raise Failure(f"MODES must be words among request and silent, not {' '.join(modes)!r}")
    profile = knobs.choice("PROFILE", "release", ("release", "debug"))
    threads = knobs.int("SLUICE_THREADS", 2, minimum=1)
    arena_max = knobs.str("ARENA_MAX", "")
    if arena_max and not arena_max.isdigit():
        raise Failure(f"ARENA_MAX must be a number or empty, not {arena_max!r}")
    trim_probe = knobs.choice("TRIM_PROBE", "1", ("0", "1")) == "1"
    if trim_probe and shutil.which("gdb") is None:
        raise Failure("TRIM_PROBE=1 needs gdb (On Debian: apt-get install -y gdb), or set TRIM_PROBE=0")
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
    try:
        sluice, echo = binaries(knobs, "bench-idle-memory", profile)
        member = procs.free_port()
        m = procs.start([str(echo), "--name", "m", "--listen", f"127.0.0.1:{member}"],
                        out=procs.work / "logs" / "echo.log")
        procs.wait_listening(member, m, "sluice-echo")
        port, admin = procs.free_port(), procs.free_port()
        cfg = procs.work / "conf" / "sluice.yaml"
        cfg.parent.mkdir(parents=True, exist_ok=True)
        cfg.write_text(f"""listen: ["127.0.0.1:{port}"]
threads: {threads}
admin:
  listen: "127.0.0.1:{admin}"
limits:
  idle_timeout: 10m
  header_timeout: 10m
  max_connections: {conns + 1000}
routes:
  - name: idle
    match:
      hosts: ["idle.test"]
    upstream:
      members:
        - url: "http://127.0.0.1:{member}"
""")
        if arena_max:
            os.environ["MALLOC_ARENA_MAX"] = arena_max
        try:
            s = start_sluice(procs, sluice, "sluice", cfg, port, admin, None)
        finally:
            os.environ.pop("MALLOC_ARENA_MAX", None)
        # One request first, so that what every request allocates once (the route's upstream
        # connection, lazily built state) is in the baseline.
        for c in open_connections(port, 1, "request"):
            c.close()
        wait_open(admin, 0)
        started_kib = rss_kib(s.pid)
        procs.log(f"sluice {sluice} (pid {s.pid}) started; VmRSS {mib(started_kib)} MiB")

        self_trims = gauge(admin, "sluice_memory_trims_total") is not None
        rows = []
        for mode in modes:
            for r in range(1, rounds + 1):
                before = rss_kib(s.pid)
                held = open_connections(port, conns, mode)
                wait_open(admin, conns)
                peak = rss_kib(s.pid)
                for c in held:
                    c.close()
                held.clear()
                wait_open(admin, 0)
                after = rss_kib(s.pid)
                own = None
                if self_trims:
                    if not wait_trim(admin, gauge(admin, "sluice_memory_trims_total") or 0):
                        procs.log(f"{mode} round {r}: no trim of sluice's own within 15 s of the close")
                    own = rss_kib(s.pid)
                trimmed = None
                if trim_probe:
                    if not malloc_trim(s.pid):
                        raise Failure("gdb could not call malloc_trim in sluice (ptrace not allowed?)")
                    trimmed = rss_kib(s.pid)
                rows.append((mode, r, before, peak, after, own, trimmed))
                procs.log(f"{mode} round {r}: VmRSS {mib(before)} -> {mib(peak)} with {conns} open "
                          f"({(peak - before) / conns:.1f} KiB each) -> {mib(after)} after they closed"
                          + (f" -> {mib(own)} after sluice's own trim" if own is not None else "")
                          + (f" -> {mib(trimmed)} after malloc_trim(0) by gdb" if trimmed is not None else ""))
    finally:
        procs.cleanup()

    lines = [
        "## Memory around idle client connections (`scripts/bench-idle-memory`)",
        "",
        f"Run on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, sluice {common.git_revision()} "
        f"({profile} build), `nproc` = {common.nproc()}, glibc malloc"
        + (f" with `MALLOC_ARENA_MAX={arena_max}`" if arena_max else "") + ".",
        "",
        "```sh",
        command_line,
        "```",
        "",
        f"VmRSS of the sluice process (`threads: {threads}`), in MiB. `request`: each connection "
        "sent one keep-alive request, read its answer and stayed idle; `silent`: each connected "
        "and sent nothing. \"closed\": once `sluice_connections_open` is back to 0 (sluice may "
        "have trimmed already while they closed); \"sluice's trim\": once "
        "`sluice_memory_trims_total` has risen after that (or 15 s later if it did not); \"gdb trim\": after glibc's `malloc_trim(0)`, "
        "called in the process through gdb (what the allocator still held that it could give back).",
        "",
        "| mode | round | before | " + f"{conns} open | KiB per connection | closed |"
        + (" sluice's trim |" if self_trims else "") + (" gdb trim |" if trim_probe else "")
        + " kept at the end |",
        "|---|---:|---:|---:|---:|---:|" + ("---:|" if self_trims else "")
        + ("---:|" if trim_probe else "") + "---:|",
    ]
    for mode, r, before, peak, after, own, trimmed in rows:
        end = own if own is not None else after
        lines.append(
            f"| {mode} | {r} | {mib(before)} | {mib(peak)} | {(peak - before) / conns:.1f} | "
            f"{mib(after)} |" + (f" {mib(own)} |" if own is not None else "")
            + (f" {mib(trimmed)} |" if trimmed is not None else "")
            + f" {mib(end - before)} |")
    lines.append("")
    lines.append(f"sluice's VmRSS after start and one request: {mib(started_kib)} MiB.")
    report = "\n".join(lines)
    print(report)
    if opts.write:
        doc.replace_section(doc_path, START, END, report)
    return 0
