"""scripts/profile: where sluice spends its instructions, one callgrind profile under wrk.

  scripts/profile              build, profile, print a summary (instructions per request,
                               top functions, copies of 4 KiB or more, cost grouped by
                               component)

Knobs (environment): REQUEST_SECONDS (5), CONNECTIONS (8), LOG (on | off, default on),
BUILD (1; 0 profiles ${CARGO_TARGET_DIR:-target}/release/sluice as it is), SLUICE_BIN_DIR (a
directory holding a release sluice; no build), KEEP (0; 1 keeps the work directory with
callgrind.out for callgrind_annotate / kcachegrind), OTLP (off | on: span export on, every
request sampled, to a loopback OTLP/HTTP sink this script runs, which answers 200 and keeps
nothing), ROUTE (rr | lu | qlu | kp: the route profiled, see below), CACHE_SIM (0; 1 also simulates
the caches, valgrind's `--cache-sim=yes`, and prints data-cache misses per request: the hardware
counters of `perf stat` are not there on every VM, this one's included), CLIENTS (off | header |
basic: a `clients` section in enforce mode, and wrk sends that client's Basic
Proxy-Authorization; `header` sends the same header to a gateway without clients).

ROUTE=rr (the default): one round_robin route over two nginx backends answering "ok\\n". ROUTE=lu
and ROUTE=kp: bench-state key-pool's `lu` and `kp` routes (least_used over three named members on one
nginx, state on a redis-server this script starts; `kp` with a header, a member quota and a
cooldown per member), so that sluice's own cost of a key pool can be told from Redis's. ROUTE=qlu:
`lu` with bench-state's route quota (one window that never fills), the fused quota + least-used
call of the benchmarks' Redis row.

sluice (threads: 1) runs under
`valgrind --tool=callgrind --instr-atstart=no`. After an unrecorded warm-up, instrumentation is
switched on for one `wrk -t1 -cCONNECTIONS -dREQUEST_SECONDS` run and the counters are dumped;
instructions per request = instructions in that window / requests wrk completed. Callgrind
counts user-space instructions only: syscalls and the kernel are not in these figures.
"""

from __future__ import annotations

import argparse
import http.server
import re
import threading
import time
from pathlib import Path

from . import common, key_pool, wrk
from .procs import Failure, Procs
from .servers import start_backends, start_redis, start_sluice

# Self cost grouped by the function the instructions ran in (code inlined into a function
# counts as that function's). First match wins; matched against the function name, except the
# "other libc" rule, against the whole "file:function".
ALLOCATION = "allocation (malloc: glibc, mimalloc or jemalloc; Rust alloc glue)"
# The C sources of the optional allocators (features `mimalloc`, `jemalloc`): their static
# functions carry no common prefix, so they are told by file.
ALLOCATOR_FILES = re.compile(r"libmimalloc-sys|tikv-jemalloc-sys|/mimalloc/|/jemalloc/")
GROUPS = [
    (r"tracing|serde_json|logging|sharded_slab|crossbeam|zmij|itoa",
     "tracing / JSON access log (tracing*, serde_json, the log channel)"),
    (r"prometheus|metrics", "prometheus metrics"),
    (r"^(malloc|free|realloc|calloc|cfree|_int_[a-z_]+|malloc_consolidate|unlink_chunk[a-z.0-9]*"
     r"|tcache[a-z_]*|posix_memalign|_mid_memalign.*)$|__rust_alloc|__rust_dealloc|__rust_realloc"
     r"|__rdl_|alloc::raw_vec|alloc::alloc::|^_?mi_|^_rjem_|mimalloc::|tikv_jemallocator::",
     ALLOCATION),
    (r"memmove|memcpy|memset|memcmp|bcmp", "memcpy / memmove / memset"),
    (r"^<?sluice_", "sluice code (crates/*)"),
    (r"pingora_pool|connectors", "Pingora upstream connection pool / connector"),
    (r"httparse|pingora_http|(^|[<( ])(http|bytes)::",
     "HTTP headers (httparse, http::HeaderMap, pingora_http, bytes)"),
    (r"pingora", "other Pingora (proxy state machine, HTTP/1 sessions)"),
    (r"tokio|mio::", "tokio runtime / mio"),
    (r"fmt|std::io::Write|String", "core::fmt / io::Write"),
    (r"time|clock_gettime|Instant", "clock (Instant::now and friends)"),
    (r"hashbrown|hash", "hashing / hash maps"),
    (r"core::str", "UTF-8 validation (core::str)"),
]
# Inclusive listings leave these out: they include everything.
WRAPPERS = re.compile(r"run_endpoint|process_new|LocalKey|PROGRAM TOTALS|std::rt|std::sys"
                      r"|start_thread|clone3|0x|__libc_start")


def function_of(location: str) -> str:
    return location.split(":", 1)[1] if ":" in location else location


def group(location: str) -> str:
    fn = function_of(location)
    if ALLOCATOR_FILES.search(location):
        return ALLOCATION
    for pattern, name in GROUPS:
        if re.search(pattern, fn):
            return name
    return "other libc" if location.startswith("./") else "other"


def rows(annotated: str, requests: int, root: Path) -> list[tuple[float, str]]:
    """callgrind_annotate's rows, "1,234 (12.34%)  file:function [object]", as (instructions
    per request, "file:function"), with the object and long path prefixes dropped."""
    out = []
    listing = started = False
    for line in annotated.splitlines():
        if "file:function" in line:
            listing = True
            continue
        if listing and re.fullmatch(r"-+", line):
            if started:
                break
            started = True
            continue
        m = re.match(r"^\s*([\d,]+) \(\s*[\d.]+%\)\s+(.*)$", line) if listing and started else None
        if not m:
            continue
        where = re.sub(r" \[[^]]*\]$", "", m.group(2))
        where = re.sub(r"^.*index\.crates\.io-[0-9a-f]+/", "", where)
        where = re.sub(r"^/rustc/[0-9a-f]+/library/", "rust/", where)
        where = where.removeprefix(f"{root}/")
        out.append((int(m.group(1).replace(",", "")) / requests, where))
    return out


def by_function(rows_: list[tuple[float, str]], pattern: str, limit: int) -> list[str]:
    """One line per function (callgrind splits a function by the source file of its inlined
    code: keep the largest of its lines), the LIMIT most costly matching PATTERN."""
    best: dict[str, float] = {}
    for cost, where in rows_:
        fn = function_of(where)
        if re.search(pattern, fn) and cost > best.get(fn, -1):
            best[fn] = cost
    top = sorted(best.items(), key=lambda kv: -kv[1])[:limit]
    return [f"    {cost:7.0f}  {fn[:160]}" for fn, cost in top]


# A copy this many bytes long or longer is reported on its own. glibc's memcpy moves a large
# block with `rep movsb`, whose every byte callgrind counts as an instruction, so such a copy
# weighs in the figure per request far beyond its cost in time: it must be seen, not hidden in
# the memcpy line. It is a real cost too (it runs through the first-level data cache), and the
# usual one is a large value moved whole, such as a future, where it was meant to be built in
# place.
LARGE_COPY = 4096
COPY_FUNCTION = re.compile(r"\*\s+\S*:_*(memcpy|memmove)\S*")
CALLER = re.compile(r"^\s*([\d,]+)\s+(?:\([^)]*\)\s+)?<\s+(\S+?):(.*?)\s+\(([\d,]+)x\)")


def large_copies(tree: str, requests: int) -> list[str]:
    """From `callgrind_annotate --tree=caller`: the callers of memcpy and memmove whose calls
    averaged LARGE_COPY instructions or more, made at least once per ten requests; one line
    each, with the calls per request and the bytes each moved (about its instructions)."""
    lines = tree.splitlines()
    found = []
    for i, line in enumerate(lines):
        if not COPY_FUNCTION.search(line):
            continue
        j = i - 1
        while j >= 0 and "<" in lines[j]:
            m = CALLER.match(lines[j])
            j -= 1
            if not m:
                continue
            instructions, calls = int(m.group(1).replace(",", "")), int(m.group(4).replace(",", ""))
            if calls and instructions / calls >= LARGE_COPY and calls * 10 >= requests:
                found.append((calls / requests, instructions / calls,
                              f"{function_of(m.group(2) + ':' + m.group(3))[:120]}"
                              f" ({m.group(2).rsplit('/', 1)[-1]})"))
    return [f"    {per:5.2f} a request, about {size:,.0f} bytes each: {where}"
            for per, size, where in sorted(found, key=lambda f: -f[0] * f[1])]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="scripts/profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args(argv)
    knobs = common.Knobs()
    seconds = knobs.int("REQUEST_SECONDS", 5, minimum=1)
    connections = knobs.int("CONNECTIONS", 8, minimum=1)
    log_on = knobs.choice("LOG", "on", ("on", "off")) == "on"
    keep = knobs.choice("KEEP", "0", ("0", "1")) == "1"
    otlp_on = knobs.choice("OTLP", "off", ("off", "on")) == "on"
    route = knobs.choice("ROUTE", "rr", ("rr", "lu", "qlu", "kp"))
    cache_sim = knobs.choice("CACHE_SIM", "0", ("0", "1")) == "1"
    clients = knobs.choice("CLIENTS", "off", ("off", "header", "basic"))
    common.require("profile", ["valgrind", "callgrind_control", "callgrind_annotate", "wrk", "nginx"],
                   "sudo apt-get install -y valgrind wrk nginx-light")
    procs = Procs("profile", keep)
    try:
        sluice = common.sluice_binary("profile", knobs)
        print(profile(procs, sluice, seconds, connections, log_on, otlp_on, route, cache_sim,
                      clients))
    finally:
        procs.cleanup()
    return 0


class _OtlpSink(http.server.BaseHTTPRequestHandler):
    """Takes an OTLP/HTTP export and answers 200, keeping nothing."""

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:  # noqa: N802 (the handler's name is http.server's)
        self.rfile.read(int(self.headers.get("content-length", "0")))
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def otlp_sink(procs: Procs) -> str:
    """Starts the sink on a thread of this process; its endpoint."""
    port = procs.free_port()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), _OtlpSink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{port}"


def cache_misses(dump: Path, requests: int) -> str:
    """Simulated cache misses per request, from the totals of a `--cache-sim=yes` dump: first
    level data (D1) reads and writes, last level (LL) data, and instructions' first level (I1)."""
    events, totals = [], []
    for line in dump.read_text(errors="replace").splitlines():
        if line.startswith("events:"):
            events = line.split()[1:]
        elif line.startswith(("summary:", "totals:")):
            totals = [int(v) for v in line.split()[1:]]
    got = dict(zip(events, totals))
    per = {name: got.get(name, 0) / requests for name in ("D1mr", "D1mw", "DLmr", "DLmw", "I1mr")}
    return (f"cache simulation, per request: D1 misses {per['D1mr'] + per['D1mw']:.0f} "
            f"({per['D1mr']:.0f} reads, {per['D1mw']:.0f} writes), LL data misses "
            f"{per['DLmr'] + per['DLmw']:.0f}, I1 misses {per['I1mr']:.0f}")


def profile(procs: Procs, sluice: Path, seconds: int, connections: int, log_on: bool,
            otlp_on: bool = False, route: str = "rr", cache_sim: bool = False,
            clients: str = "off") -> str:
    backends = start_backends(procs)
    port, admin = procs.free_port(), procs.free_port()
    tracing = f"tracing:\n  otlp:\n    endpoint: {otlp_sink(procs)}\n" if otlp_on else ""
    if route == "rr":
        routes = backends.round_robin_routes_yaml()
    else:
        rport = procs.free_port()
        start_redis(procs, "redis", rport)
        routes = (f'state:\n  backend: redis\n  redis:\n    url: "redis://127.0.0.1:{rport}/0"\n'
                  "routes:\n" + key_pool.route(route, backends.ports[0], key_pool=route == "kp",
                                                quota=route == "qlu")
                  .replace(f'hosts: ["{route}.bench"]', 'hosts: ["*"]'))
    # Config and log in different directories: sluice watches its config's directory.
    cfg = procs.work / "conf" / "sluice.yaml"
    cfg.parent.mkdir(parents=True)
    cfg.write_text(f"""listen: ["127.0.0.1:{port}"]
threads: 1
admin:
  listen: "127.0.0.1:{admin}"
{tracing}{common.clients_yaml(clients)}{routes}""")
    procs.log(f"starting sluice under callgrind (access log {'on' if log_on else 'off'})")
    s = start_sluice(procs, sluice, "sluice", cfg, port, admin, None if log_on else "warn",
                     timeout=120, wrapper=["valgrind", "--tool=callgrind", "--instr-atstart=no",
                                           *(["--cache-sim=yes"] if cache_sim else []),
                                           f"--callgrind-out-file={procs.work}/callgrind.out.%p"])
    url = f"http://127.0.0.1:{port}/"
    base = wrk.args(1, connections, common.clients_headers(clients))
    procs.log(f"warm-up (not recorded): wrk -t1 -c{connections} -d3s {url}")
    wrk.run(procs, url, base, "3s", latency=False)
    procs.run(["callgrind_control", "-i", "on", str(s.pid)], timeout=60)
    procs.log(f"recorded: wrk -t1 -c{connections} -d{seconds}s {url}")
    out = wrk.run(procs, url, base, f"{seconds}s", latency=False)
    procs.run(["callgrind_control", "--dump=measured", str(s.pid)], timeout=120)
    procs.run(["callgrind_control", "-i", "off", str(s.pid)], timeout=60)
    if out.errors:
        procs.log(f"wrk reported errors: {out.errors}")

    # The explicit dump is the first numbered file; wait for valgrind to finish writing it.
    dump = None
    for _ in range(100):
        dumps = sorted(procs.work.glob(f"callgrind.out.{s.pid}.*"))
        if dumps:
            dump = dumps[0]
            break
        time.sleep(0.1)
    if dump is None:
        raise Failure("no callgrind dump appeared")
    time.sleep(1)

    annotate = ["callgrind_annotate", "--threshold=100", "--auto=no", "--show=Ir"]
    self_txt = procs.run([*annotate, str(dump)], timeout=600)
    incl_txt = procs.run([*annotate, "--inclusive=yes", str(dump)], timeout=600)
    totals = [line.split()[0] for line in self_txt.splitlines() if "PROGRAM TOTALS" in line]
    if not totals or not out.requests:
        raise Failure(f"could not read the totals (dump {dump})")
    total = int(totals[0].replace(",", ""))
    tree_txt = procs.run([*annotate, "--tree=caller", str(dump)], timeout=600)
    copies = large_copies(tree_txt, out.requests)
    self_rows = rows(self_txt, out.requests, common.ROOT)
    incl_rows = rows(incl_txt, out.requests, common.ROOT)

    lines = [
        *([cache_misses(dump, out.requests), ""] if cache_sim else []),
        f"sluice {common.git_revision()}, route {route}, clients {clients}, access log {'on' if log_on else 'off'}, "
        f"OTLP export {'on' if otlp_on else 'off'}, threads: 1,",
        f"wrk -t1 -c{connections} -d{seconds}s: {out.requests} requests in the recorded window;",
        f"{total} instructions, {total / out.requests:.0f} per request (user space, all threads).",
        "",
        "Top functions, self instructions per request (source file:function):",
        "",
        *[f"    {cost:7.0f}  {where[:160]}" for cost, where in self_rows[:15]],
        "",
        "Top functions, inclusive instructions per request (tokio and service wrappers left out):",
        "",
        *[line for line in by_function(incl_rows, r"^[^t]|^t[^o]", 60) if not WRAPPERS.search(line)][:30],
        "",
        "sluice's own functions, inclusive instructions per request:",
        "",
        *by_function(incl_rows, r"sluice", 15),
        "",
        f"Copies of {LARGE_COPY:,} bytes or more, in the memcpy line above (each byte counts as an "
        "instruction):",
        "",
        *(copies or ["    none"]),
        "",
        "Self instructions per request, grouped:",
        "",
    ]
    grouped: dict[str, float] = {}
    for cost, where in self_rows:
        grouped[group(where)] = grouped.get(group(where), 0) + cost
    all_ = sum(grouped.values()) or 1
    for name, cost in sorted(grouped.items(), key=lambda kv: -kv[1]):
        lines.append(f"    {cost:8.0f}  {100 * cost / all_:5.1f}%  {name}")
    return "\n".join(lines)
