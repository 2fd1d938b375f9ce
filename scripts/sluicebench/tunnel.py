"""scripts/bench-tunnel: CONNECT tunnels through sluice against a direct connection, tinyproxy and
squid: throughput, setup rate, and bytes/s per core of proxy CPU.

  scripts/bench-tunnel             run both parts and print a Markdown report
  scripts/bench-tunnel --write     also replace the tunnel section of docs/benchmark-runs.md

  throughput  SIZE_MIB through one tunnel, each way (down: the sink sends, the client counts;
              up: the client sends, the sink counts and acknowledges), against the sink reached
              directly, and through sluice (a `direct` route), tinyproxy and squid (if installed).
              Wall clock from the first byte of the request after the `200` to the last byte
              (down) or to the sink's acknowledgement (up); the proxy's CPU (utime + stime from
              /proc) over the transfer gives bytes/s per core.
  setup       CONNECTIONS concurrent clients (in CLIENT_PROCS processes) each open a tunnel, read
              the 200, close and start again, for SETUP_DURATION seconds: tunnels per second and
              the proxy's CPU per tunnel, sluice against tinyproxy and squid.

Knobs (environment): ROUNDS (3), SIZE_MIB (1024), DIRECTIONS ("down up"), SETUP_DURATION (5),
CONNECTIONS (32), CLIENT_PROCS (2), SLUICE_THREADS (1), SQUID (auto: used if installed; 0: not),
BUILD (1; 0 uses ${CARGO_TARGET_DIR:-target}/release as it is), SLUICE_BIN_DIR (a directory
holding a release sluice; no build), WAIT_QUIET (1: first wait until no other wrk, cargo bench
or valgrind runs), DOC (docs/benchmark-runs.md), KEEP (0; 1 keeps the work directory).

The sink and the clients are this module run as `python3 -m sluicebench.tunnel sink|transfer|setup`
in processes of their own, so that none of them shares a GIL with another or with the driver.
Everything runs on 127.0.0.1 and stops, by PID, on exit (Ctrl-C included).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional, Sequence

# The peer modes (sink, transfer, setup) run in child processes and need nothing but the standard
# library; the driver's imports are done in main(), so a child does not pay for them.

START_MARK = "<!-- bench:tunnel:start -->"
END_MARK = "<!-- bench:tunnel:end -->"
KNOB_NAMES = ["ROUNDS", "SIZE_MIB", "DIRECTIONS", "SETUP_DURATION", "CONNECTIONS", "CLIENT_PROCS",
              "SLUICE_THREADS"]
CHUNK = 1 << 20  # bytes per send/recv: large, so the endpoints cost little next to the proxy
HEADER = 16  # the request sent through the tunnel: b"D" or b"U" and the byte count, zero-padded
# Where the peers meet: loopback here; scripts/tunnel-link moves them into network namespaces
# joined by shaped links, where the proxy and the sink have addresses of their own.
PROXY_HOST = os.environ.get("BENCH_PROXY_HOST", "127.0.0.1")
SINK_HOST = os.environ.get("BENCH_SINK_HOST", "127.0.0.1")


# === the peers (child processes) =================================================================
def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            raise ConnectionError(f"connection closed after {len(buf)} of {n} bytes")
        buf += got
    return bytes(buf)


def open_tunnel(proxy: Optional[int], target: int, timeout: float = 10.0) -> socket.socket:
    """A connection to SINK_HOST:TARGET, through a CONNECT on PROXY_HOST:PROXY unless PROXY is None."""
    sock = socket.create_connection((PROXY_HOST, proxy) if proxy else (SINK_HOST, target), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if proxy is None:
        return sock
    sock.sendall(f"CONNECT {SINK_HOST}:{target} HTTP/1.1\r\nHost: {SINK_HOST}:{target}\r\n\r\n".encode())
    head = bytearray()
    while b"\r\n\r\n" not in head:  # byte by byte: nothing after the head may be consumed here
        b = sock.recv(1)
        if not b or len(head) > 8192:
            raise ConnectionError(f"no complete CONNECT response: {bytes(head)[:200]!r}")
        head += b
    status = head.split(b"\r\n", 1)[0]
    if status.split()[1:2] != [b"200"]:
        raise ConnectionError(f"CONNECT refused: {status.decode(errors='replace')}")
    return sock


def transfer_main(proxy: Optional[int], target: int, direction: str, size: int) -> dict:
    """One timed transfer of SIZE bytes; prints {"seconds": ...}."""
    sock = open_tunnel(proxy, target)
    sock.settimeout(300)
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    t0 = time.perf_counter()
    sock.sendall((b"D" if direction == "down" else b"U") + str(size).zfill(HEADER - 1).encode())
    if direction == "down":
        got = 0
        while got < size:
            n = sock.recv_into(view, min(CHUNK, size - got))
            if n == 0:
                raise ConnectionError(f"closed after {got} of {size} bytes")
            got += n
    else:
        left = size
        while left > 0:
            n = min(CHUNK, left)
            sock.sendall(view[:n])
            left -= n
        if recv_exact(sock, 1) != b"K":
            raise ConnectionError("no acknowledgement from the sink")
    seconds = time.perf_counter() - t0
    sock.close()
    return {"seconds": seconds, "bytes": size}


async def _setup_worker(proxy: int, target: int, deadline: float, counts: list[int]) -> None:
    request = f"CONNECT 127.0.0.1:{target} HTTP/1.1\r\nHost: 127.0.0.1:{target}\r\n\r\n".encode()
    while time.monotonic() < deadline:
        writer = None
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", proxy), 10)
            writer.write(request)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            if head.split(b"\r\n", 1)[0].split()[1:2] == [b"200"]:
                counts[0] += 1
            else:
                counts[1] += 1
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            counts[1] += 1
            await asyncio.sleep(0.01)  # a refused connection must not spin
        finally:
            if writer is not None:
                writer.close()
                try:
                    await writer.wait_closed()
                except OSError:
                    pass


def setup_main(proxy: int, target: int, conns: int, seconds: float) -> dict:
    """CONNS loops of CONNECT, 200, close for SECONDS; prints {"ok": ..., "errors": ..., "seconds": ...}."""
    counts = [0, 0]

    async def all_workers() -> float:
        t0 = time.monotonic()
        await asyncio.gather(*(_setup_worker(proxy, target, t0 + seconds, counts) for _ in range(conns)))
        return time.monotonic() - t0

    elapsed = asyncio.run(all_workers())
    return {"ok": counts[0], "errors": counts[1], "seconds": elapsed}


async def _sink_conn(loop: asyncio.AbstractEventLoop, conn: socket.socket) -> None:
    try:
        head = bytearray()
        while len(head) < HEADER:
            got = await loop.sock_recv(conn, HEADER - len(head))
            if not got:
                return  # a tunnel opened and closed (the setup part): nothing to do
            head += got
        kind, size = head[:1], int(head[1:])
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        if kind == b"D":
            left = size
            while left > 0:
                n = min(CHUNK, left)
                await loop.sock_sendall(conn, view[:n])
                left -= n
        else:
            got = 0
            while got < size:
                n = await loop.sock_recv_into(conn, view[:min(CHUNK, size - got)])
                if n == 0:
                    return
                got += n
            await loop.sock_sendall(conn, b"K")
        # Wait for the client to close first, so the TIME_WAIT is on its side.
        await asyncio.wait_for(loop.sock_recv(conn, 1), 60)
    except (OSError, ValueError, asyncio.TimeoutError):
        pass
    finally:
        conn.close()


def sink_main(port: int) -> None:
    """Serves SINK_HOST:PORT until killed: down requests get the bytes, up requests an 'K'."""
    async def serve() -> None:
        loop = asyncio.get_running_loop()
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((SINK_HOST, port))
        srv.listen(4096)
        srv.setblocking(False)
        tasks = set()
        while True:
            conn, _ = await loop.sock_accept(srv)
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t = loop.create_task(_sink_conn(loop, conn))
            tasks.add(t)
            t.add_done_callback(tasks.discard)

    asyncio.run(serve())


def peer(argv: list[str]) -> int:
    """python3 -m sluicebench.tunnel sink PORT | transfer PROXY|- TARGET down|up SIZE |
    setup PROXY TARGET CONNS SECONDS"""
    mode, args = argv[0], argv[1:]
    if mode == "sink":
        sink_main(int(args[0]))
        return 0
    if mode == "transfer":
        out = transfer_main(None if args[0] == "-" else int(args[0]), int(args[1]), args[2], int(args[3]))
    elif mode == "setup":
        out = setup_main(int(args[0]), int(args[1]), int(args[2]), float(args[3]))
    else:
        print(peer.__doc__, file=sys.stderr)
        return 2
    print(json.dumps(out), flush=True)
    return 0


# === the driver ==================================================================================
def peer_argv(*args: object) -> list[str]:
    return [sys.executable, "-B", "-m", "sluicebench.tunnel", *map(str, args)]


def peer_env() -> dict:
    env = dict(os.environ)
    scripts = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = scripts + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def main(argv: list[str]) -> int:
    from . import common, doc, stats
    from .procs import CLK_TCK, Failure, Procs, children_of, cpu_ticks, waited_children_ticks
    from .servers import start_sluice
    from .staterun import wait_quiet

    parser = argparse.ArgumentParser(prog="scripts/bench-tunnel", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true",
                        help="replace the tunnel section of docs/benchmark-runs.md with the report")
    opts = parser.parse_args(argv)

    knobs = common.Knobs()
    rounds = knobs.int("ROUNDS", 3, minimum=1)
    size = knobs.int("SIZE_MIB", 1024, minimum=1) << 20
    directions = knobs.str("DIRECTIONS", "down up").split()
    if not directions or any(d not in ("down", "up") for d in directions):
        raise Failure(f"DIRECTIONS must be words among down and up, not {' '.join(directions)!r}")
    setup_seconds = knobs.int("SETUP_DURATION", 5, minimum=1)
    conns = knobs.int("CONNECTIONS", 32, minimum=1)
    client_procs = knobs.int("CLIENT_PROCS", 2, minimum=1)
    sluice_threads = knobs.int("SLUICE_THREADS", 1, minimum=1)
    squid_knob = knobs.choice("SQUID", "auto", ("auto", "0"))
    keep = knobs.choice("KEEP", "0", ("0", "1")) == "1"
    doc_path = Path(knobs.str("DOC", str(common.DOC)))
    command_line = f"{knobs.line(KNOB_NAMES)} scripts/bench-tunnel" + (" --write" if opts.write else "")
    common.require("bench-tunnel", ["tinyproxy"], "sudo apt-get install -y tinyproxy")
    use_squid = squid_knob == "auto" and shutil.which("squid") is not None

    procs = Procs("bench-tunnel", keep)
    env = peer_env()
    try:
        if knobs.choice("WAIT_QUIET", "1", ("0", "1")) == "1":
            wait_quiet(procs.log)
        sluice = common.sluice_binary("bench-tunnel", knobs, bins=("--bins",))
        if rounds < 3:
            procs.log(f"warning: ROUNDS={rounds}; use at least 3 for figures worth reporting")

        # --- the sink and the proxies --------------------------------------------------------
        sink_port = procs.free_port()
        sink = procs.start(peer_argv("sink", sink_port), out=procs.work / "logs" / "sink.log", env=env)
        procs.wait_listening(sink_port, sink, "the sink")

        proxies: dict[str, tuple[int, list[int], str]] = {}  # key: (port, pids, label)

        port, admin = procs.free_port(), procs.free_port()
        cfg = procs.work / "conf" / "sluice.yaml"
        cfg.parent.mkdir(parents=True, exist_ok=True)
        cfg.write_text(f"""listen: ["127.0.0.1:{port}"]
threads: {sluice_threads}
admin:
  listen: "127.0.0.1:{admin}"
egress:
  allow_cidrs: ["127.0.0.0/8"]
  connect_ports: [{sink_port}]
routes:
  - name: tunnel
    match:
      hosts: ["*"]
    upstream:
      members:
        - direct: true
""")
        s = start_sluice(procs, sluice, "sluice", cfg, port, admin, None)
        proxies["sluice"] = (port, [s.pid], f"sluice (`threads: {sluice_threads}`, access log on)")

        port = procs.free_port()
        tdir = procs.work / "tinyproxy"
        tdir.mkdir(parents=True, exist_ok=True)
        (tdir / "tinyproxy.conf").write_text(f"""Port {port}
Listen 127.0.0.1
Timeout 600
MaxClients {max(1024, 4 * conns)}
Allow 127.0.0.1
ConnectPort {sink_port}
LogFile "{tdir / 'tinyproxy.log'}"
LogLevel Info
""")
        proc = procs.start(["tinyproxy", "-d", "-c", str(tdir / "tinyproxy.conf")], out=tdir / "stdout.log")
        procs.wait_listening(port, proc, "tinyproxy")
        proxies["tinyproxy"] = (port, [proc.pid], "tinyproxy (LogLevel Info)")

        if use_squid:
            port = procs.free_port()
            qdir = procs.work / "squid"
            qdir.mkdir(parents=True, exist_ok=True)
            # squid drops root for its cache_effective_user: that user must write its logs.
            os.chmod(procs.work, 0o755)
            os.chmod(qdir, 0o777)
            (qdir / "squid.conf").write_text(f"""http_port 127.0.0.1:{port}
acl tunnel_port port {sink_port}
acl CONNECT method CONNECT
acl loopback src 127.0.0.1
http_access deny CONNECT !tunnel_port
http_access allow loopback
http_access deny all
cache deny all
access_log stdio:{qdir / 'access.log'}
cache_log {qdir / 'cache.log'}
cache_store_log none
pid_filename {qdir / 'squid.pid'}
coredump_dir {qdir}
shutdown_lifetime 0 seconds
max_filedescriptors 16384
dns_nameservers 127.0.0.1
pinger_enable off
""")
            procs.run(["squid", "-k", "parse", "-f", str(qdir / "squid.conf")], timeout=60)
            proc = procs.start(["squid", "-N", "-f", str(qdir / "squid.conf")], out=qdir / "stdout.log")
            procs.wait_listening(port, proc, "squid")
            # -N: no master process; any helpers it forks count as squid too.
            proxies["squid"] = (port, [proc.pid], "squid (access_log on)")

        def pids_of(key: str) -> list[int]:
            base = proxies[key][1]
            return base + [k for p in base for k in children_of(p)]

        def transfer(proxy: Optional[int], direction: str, n: int) -> float:
            out = procs.run(peer_argv("transfer", proxy or "-", sink_port, direction, n),
                            timeout=900, env=env)
            return json.loads(out)["seconds"]

        # Every path must work before anything is measured (egress guard, ConnectPort, http_access).
        for key in ["direct", *proxies]:
            for d in directions:
                transfer(proxies[key][0] if key != "direct" else None, d, 1 << 20)
        procs.log(f"sink on 127.0.0.1:{sink_port}; " +
                  ", ".join(f"{k} on 127.0.0.1:{v[0]}" for k, v in proxies.items()) + "; all tunnel")

        # --- throughput --------------------------------------------------------------------
        t_ids = [f"{key}:{d}" for key in ["direct", *proxies] for d in directions]
        tp: dict[tuple[str, int], dict] = {}
        t_orders = []
        for r in range(1, rounds + 1):
            order = stats.order_of(r, ["direct", *proxies])
            t_orders.append(f"round {r}: {' '.join(order)}")
            procs.log(f"throughput round {r}/{rounds}: {' '.join(order)}")
            for key in order:
                for d in (directions if r % 2 else directions[::-1]):
                    pids = pids_of(key) if key != "direct" else []
                    before = cpu_ticks(pids) if pids else 0
                    secs = transfer(proxies[key][0] if key != "direct" else None, d, size)
                    cpu = (cpu_ticks(pids) - before) / CLK_TCK if pids else None
                    row = {"bps": size / secs, "cpu": cpu,
                           "per_core": size / cpu if cpu else None,
                           "cpu_per_gib": cpu * (1 << 30) / size if cpu is not None else None}
                    tp[f"{key}:{d}", r] = row
                    procs.log(f"  {key} {d}: {row['bps'] / 1e6:.0f} MB/s, proxy CPU "
                              f"{stats.fmt(cpu, '.2f')} s ({stats.fmt(row['per_core'] and row['per_core'] / 1e6)} MB/s per core)")

        # --- setup rate --------------------------------------------------------------------
        su: dict[tuple[str, int], dict] = {}
        s_orders = []
        per_proc = [conns // client_procs + (1 if i < conns % client_procs else 0) for i in range(client_procs)]
        per_proc = [c for c in per_proc if c > 0]
        for r in range(1, rounds + 1):
            order = stats.order_of(r, list(proxies))
            s_orders.append(f"round {r}: {' '.join(order)}")
            procs.log(f"setup round {r}/{rounds}: {' '.join(order)}")
            for key in order:
                time.sleep(1)  # let the previous target's connections finish closing
                pids = pids_of(key)
                before = cpu_ticks(pids)
                client_before = waited_children_ticks()
                clients = [subprocess.Popen(peer_argv("setup", proxies[key][0], sink_port, c, setup_seconds),
                                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                            env=env, process_group=0) for c in per_proc]
                procs.running.extend(clients)
                ok = errors = 0
                elapsed = 0.0
                for c in clients:
                    try:
                        out, _ = c.communicate(timeout=setup_seconds + 120)
                    except subprocess.TimeoutExpired:
                        raise Failure(f"a setup client against {key} did not finish")
                    procs.running.remove(c)
                    if c.returncode != 0:
                        raise Failure(f"a setup client against {key} exited with {c.returncode}")
                    res = json.loads(out)
                    ok, errors, elapsed = ok + res["ok"], errors + res["errors"], max(elapsed, res["seconds"])
                cpu = (cpu_ticks(pids) - before) / CLK_TCK
                client_cpu = (waited_children_ticks() - client_before) / CLK_TCK
                row = {"rate": ok / elapsed, "errors": errors, "cpu_us": cpu * 1e6 / ok if ok else None,
                       "client_us": client_cpu * 1e6 / ok if ok else None}
                su[key, r] = row
                procs.log(f"  {key}: {row['rate']:.0f} tunnels/s, {errors} errors, proxy CPU "
                          f"{stats.fmt(row['cpu_us'], '.0f')} µs/tunnel, clients' CPU "
                          f"{stats.fmt(row['client_us'], '.0f')} µs/tunnel")
    finally:
        procs.cleanup()

    # --- the report --------------------------------------------------------------------------
    def per(res: dict, id: str, what: str) -> list:
        return [res.get((id, r), {}).get(what) for r in range(1, rounds + 1)]

    def med(res: dict, id: str, what: str):
        return stats.median(per(res, id, what))

    label = {"direct": "direct (no proxy)", **{k: v[2] for k, v in proxies.items()}}
    versions = common.version_of(["tinyproxy", "-v"], r"tinyproxy (\S+)", r"tinyproxy \1")
    if use_squid:
        versions += ", " + common.version_of(["squid", "-v"], r"Version (\S+)", r"squid \1")
    mib = size >> 20
    lines = [
        "## Tunnels: sluice against a direct connection, tinyproxy and squid (`scripts/bench-tunnel`)",
        "",
        f"Run on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, sluice {common.git_revision()}, "
        f"`nproc` = {common.nproc()}, {versions}.",
        "",
        "```sh",
        command_line,
        "```",
        "",
        "Everything on 127.0.0.1 on one shared, noisy 2-core machine: the client, the sink, the proxy and other",
        "engineers' builds share the cores, unpinned. Absolute figures move a lot from round to round; the ratios",
        "taken within a round are what count. The sink and the clients are Python (standard library) processes moving",
        "up to 1 MiB per system call; the direct rows show what they move without a proxy, on the same two cores.",
        "sluice routes the CONNECT to a `direct: true` member, with `egress: { allow_cidrs: [127.0.0.0/8],",
        "connect_ports: [SINK] }` (the egress guard denies loopback otherwise).",
        "",
        f"**Throughput: {mib} MiB through one tunnel.** down: the sink sends and the client counts; up: the client",
        "sends and the sink acknowledges the last byte. Wall clock from the request after the `200` to the last",
        "byte (or the acknowledgement). Proxy CPU is utime + stime of the proxy's process(es) over the transfer;",
        "bytes/s per core is the bytes moved divided by those CPU seconds.",
        "",
        "| target | direction | MB/s | per round | × direct (per round) | proxy CPU s per GiB | MB/s per core of proxy CPU |",
        "|---|---|---:|---|---|---:|---:|",
    ]
    for key in ["direct", *proxies]:
        for d in directions:
            id = f"{key}:{d}"
            vs = "-" if key == "direct" else stats.fmt_ratio(per(tp, id, "bps"), per(tp, f"direct:{d}", "bps"))
            lines.append(
                f"| {label[key]} | {d} | {stats.fmt(med(tp, id, 'bps') and med(tp, id, 'bps') / 1e6)} "
                f"| {', '.join(stats.fmt(v and v / 1e6) for v in per(tp, id, 'bps'))} | {vs} "
                f"| {stats.fmt(med(tp, id, 'cpu_per_gib'), '.2f')} "
                f"| {stats.fmt(med(tp, id, 'per_core') and med(tp, id, 'per_core') / 1e6)} |")
    lines += ["", f"Order: {'; '.join(t_orders)} (directions alternate too)."]
    lines.append("")
    for d in directions:
        r = stats.median(stats.ratios(per(tp, f"sluice:{d}", "bps"), per(tp, f"direct:{d}", "bps")))
        verdict = "meets" if r is not None and r >= 0.9 else "misses"
        lines.append(f"- {d}, sluice / direct: "
                     f"{stats.fmt_ratio(per(tp, f'sluice:{d}', 'bps'), per(tp, f'direct:{d}', 'bps'))}: "
                     f"{verdict} the target of ≥ 0.9× direct")
        for other in [k for k in proxies if k != "sluice"]:
            lines.append(f"- {d}, sluice / {other}: "
                         f"{stats.fmt_ratio(per(tp, f'sluice:{d}', 'bps'), per(tp, f'{other}:{d}', 'bps'))}")

    lines += [
        "",
        f"**Setup rate: CONNECT, `200`, close.** {conns} concurrent clients in {len(per_proc)} Python asyncio "
        f"processes, {setup_seconds} s per target per round; tunnels/s counts the `200`s. The clients' own CPU "
        "per tunnel is in the table: where it is close to the proxy's, the two cores are shared between them and "
        "the clients limit the rate too; the proxy's CPU per tunnel does not depend on that. The clients' figure "
        "includes starting Python (roughly 0.1 s of CPU per process), which weighs on it where few tunnels were made.",
        "",
        "| proxy | tunnels/s | per round | proxy CPU µs per tunnel | clients' CPU µs per tunnel | errors |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for key in proxies:
        lines.append(f"| {label[key]} | {stats.fmt(med(su, key, 'rate'))} "
                     f"| {', '.join(stats.fmt(v) for v in per(su, key, 'rate'))} "
                     f"| {stats.fmt(med(su, key, 'cpu_us'))} | {stats.fmt(med(su, key, 'client_us'))} "
                     f"| {sum(v or 0 for v in per(su, key, 'errors'))} |")
    lines += ["", f"Order: {'; '.join(s_orders)}.", ""]
    for other in [k for k in proxies if k != "sluice"]:
        lines.append(f"- sluice / {other}, tunnels/s: "
                     f"{stats.fmt_ratio(per(su, 'sluice', 'rate'), per(su, other, 'rate'))}")
    report = "\n".join(lines)
    print(report)
    if opts.write:
        doc.replace_section(doc_path, START_MARK, END_MARK, report)
        procs.log(f"wrote the tunnel section of {doc_path}")
    return 0


if __name__ == "__main__":
    sys.exit(peer(sys.argv[1:]))
