"""scripts/build-pgo: a profile-guided release build of sluice and sluice-echo.

  scripts/build-pgo [--out DIR]     DIR defaults to ${CARGO_TARGET_DIR:-target}/pgo

Four steps:
1. an instrumented release build (`-Cprofile-generate`);
2. training: that binary serves a few seconds of wrk traffic on each kind of route the
   benchmarks measure (round-robin with the access log on and off, least-used and a quota on
   the memory store, then least-used, quota + least-used and a key pool on a redis-server this
   script starts), plus forward-proxy requests and admin scrapes;
3. `llvm-profdata merge` of the profiles the gateway wrote;
4. the release build again, with `-Cprofile-use`, copied to DIR.

With BOLT=1, three more (Debian's `bolt-19`; LLVM_BOLT names another llvm-bolt):
5. the `-Cprofile-use` build is linked with `--emit-relocs`, so that BOLT may move functions;
6. `llvm-bolt -instrument` of it serves the memory-store part of the training again, and each
   process writes the branches it took;
7. `llvm-bolt` lays out the gateway by that profile (blocks by ext-tsp, functions by cdsort, cold
   blocks split off into a cold section), and that binary is what goes to DIR.

Why BOLT on top of the profile-guided build: LLVM lays out blocks within a function and can
order hot and cold functions apart, but only BOLT reorders the whole binary's hot blocks by the
calls actually made, across crates. On this VM it took about 3% off a request's thread time,
better in 10 rounds of 12 (docs/benchmarks.md, "Build"): small, so it is
not the default. Its instrumentation trains on the memory store only: BOLT 19's runtime
aborts while it writes the profile of a process that ran the Redis client's decoder (a Rust
symbol name longer than its buffer), so the Redis paths keep the layout LLVM gave them. The
bolted binary carries no debug sections (function names remain).

Why: the gateway's code does not fit the first-level instruction cache (docs/benchmarks.md,
"Build"). With a profile, LLVM lays hot code
together, inlines by measured frequency and moves cold paths out of the way. The profile belongs
to one compiler and one source tree, so it is made by every build rather than committed.

Builds pass `--target HOST`, which keeps RUSTFLAGS off build scripts and proc macros: only the
shipped code is instrumented, and the two builds use their own target directories (pgo-gen,
pgo-use) so that neither invalidates the other or a plain `cargo build --release`.

Needs cargo, llvm-profdata of rustc's own LLVM (`rustup component add llvm-tools`; or set
LLVM_PROFDATA), wrk, nginx (the training backends) and redis-server.
Knobs (environment): TRAIN_SECONDS (4: the round-robin run; the others get half), CONNECTIONS
(64), KEEP (0; 1 keeps the work directory with the raw profiles and logs), BOLT (0; 1 adds the
three steps above).
"""

from __future__ import annotations

import argparse
import http.client
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from . import common, key_pool, wrk
from .procs import Failure, Procs, log
from .servers import http_get, start_backends, start_redis, start_sluice, wait_ok
from .staterun import QUOTA_YAML

NAME = "build-pgo"
BINS = ("sluice", "sluice-echo")


def host_triple() -> str:
    out = subprocess.run(["rustc", "-vV"], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    for line in out.splitlines():
        if line.startswith("host: "):
            return line.removeprefix("host: ").strip()
    raise Failure("rustc -vV names no host triple")


def llvm_profdata(host: str) -> Path:
    """LLVM_PROFDATA, else the llvm-tools component's: its LLVM is rustc's own, so it reads the
    raw profiles the instrumented binary writes (another LLVM's may not)."""
    if os.environ.get("LLVM_PROFDATA"):
        return Path(os.environ["LLVM_PROFDATA"])
    sysroot = subprocess.run(["rustc", "--print", "sysroot"], capture_output=True, text=True,
                             timeout=60, check=True).stdout.strip()
    path = Path(sysroot) / "lib" / "rustlib" / host / "bin" / "llvm-profdata"
    if not os.access(path, os.X_OK):
        raise Failure(f"no {path}: run `rustup component add llvm-tools` (or set LLVM_PROFDATA)")
    return path


def cargo_build(host: str, target_dir: Path, rustflags: str, bins: Sequence[str]) -> Path:
    """A locked release build of BINS for HOST; the directory holding them."""
    env = dict(os.environ)
    # RUSTFLAGS replaces, rather than adds to, any configured flags; keep the caller's.
    env["RUSTFLAGS"] = " ".join(f for f in (os.environ.get("RUSTFLAGS", ""), rustflags) if f)
    argv = ["cargo", "build", "--release", "--locked", *(a for b in bins for a in ("--bin", b)),
            "--target", host, "--target-dir", str(target_dir)]
    log(NAME, f"RUSTFLAGS={env['RUSTFLAGS']!r} {' '.join(argv)}")
    subprocess.run(argv, cwd=common.ROOT, env=env, check=True, stdout=sys.stderr, timeout=7200)
    return target_dir / host / "release"


def forward_proxy_requests(port: int, host: str, n: int) -> None:
    """N absolute-form requests on one connection, as an HTTP_PROXY client sends them."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        for _ in range(n):
            conn.request("GET", f"http://{host}/v1/items?id=7")
            resp = conn.getresponse()
            resp.read()
            if resp.status != 200:
                raise Failure(f"forward-proxy request to {host} answered {resp.status}")
    finally:
        conn.close()


def llvm_bolt() -> tuple[Path, Path]:
    """llvm-bolt and merge-fdata: LLVM_BOLT (merge-fdata beside it), else on PATH, else the
    newest /usr/lib/llvm-N/bin that has both."""
    if os.environ.get("LLVM_BOLT"):
        bolt = Path(os.environ["LLVM_BOLT"])
        return bolt, bolt.with_name("merge-fdata")
    if shutil.which("llvm-bolt") and shutil.which("merge-fdata"):
        return Path(shutil.which("llvm-bolt")), Path(shutil.which("merge-fdata"))
    def version(d: Path) -> int:
        tail = d.name.removeprefix("llvm-")
        return int(tail) if tail.isdigit() else -1
    for d in sorted(Path("/usr/lib").glob("llvm-*"), key=version, reverse=True):
        if (d / "bin" / "llvm-bolt").exists() and (d / "bin" / "merge-fdata").exists():
            return d / "bin" / "llvm-bolt", d / "bin" / "merge-fdata"
    raise Failure("BOLT=1 needs llvm-bolt and merge-fdata: sudo apt-get install -y bolt-19 "
                  "(or set LLVM_BOLT)")


def bolt(procs: Procs, built: Path, out: Path, seconds: int, connections: int,
         keep: bool) -> None:
    """Steps 6 and 7: BUILT (linked with --emit-relocs), laid out by its own training, to OUT."""
    llvm_bolt_, merge = llvm_bolt()
    fdata = procs.work / "bolt"
    fdata.mkdir()
    instrumented = procs.work / "sluice.bolt-instrumented"
    procs.run([str(llvm_bolt_), str(built), "-instrument", "-o", str(instrumented),
               f"--instrumentation-file={fdata / 'sluice'}",
               "--instrumentation-file-append-pid"], timeout=1800)
    # A work directory of its own: the training's configs, logs and backends are named alike.
    training = Procs(f"{NAME}-bolt", keep)
    try:
        train(training, instrumented, seconds, connections, redis=False)
    finally:
        training.cleanup()
    profiles = sorted(fdata.glob("sluice*.fdata"))
    if not profiles:
        raise Failure(f"the BOLT training wrote no profile into {fdata}")
    merged = procs.work / "sluice.fdata"
    merged.write_text(procs.run([str(merge), *map(str, profiles)], timeout=600))
    procs.run([str(llvm_bolt_), str(built), "-o", str(out), f"-data={merged}",
               "-reorder-blocks=ext-tsp", "-reorder-functions=cdsort", "-split-functions",
               "-split-all-cold", "-split-eh", "-icf=1", "-use-gnu-stack"], timeout=1800)
    procs.log(f"laid out by BOLT from {len(profiles)} profiles: {out}")


def train(procs: Procs, sluice: Path, seconds: int, connections: int, redis: bool = True) -> None:
    backends = start_backends(procs)

    # The benchmarks' routes and host names (NAME.bench), so that key_pool.route serves as is.
    def route(name: str, selection: str, quota: bool = False) -> str:
        return backends.route_yaml(name, selection, f"{name}.bench") + (QUOTA_YAML if quota else "")

    def serve(label: str, state: str, routes: str, runs: list[tuple[str, int]],
              rust_log: str | None = None) -> None:
        port, admin = procs.free_port(), procs.free_port()
        cfg = procs.work / f"conf-{label}" / "sluice.yaml"
        cfg.parent.mkdir(parents=True)
        cfg.write_text(f'listen: ["127.0.0.1:{port}"]\nthreads: 1\nadmin:\n'
                       f'  listen: "127.0.0.1:{admin}"\n{state}routes:\n{routes}')
        s = start_sluice(procs, sluice, label, cfg, port, admin, rust_log, timeout=60)
        url = f"http://127.0.0.1:{port}/"
        for name, secs in runs:
            wait_ok(url, f"{name}.bench", f"route {name} ({label})")
            procs.log(f"{label}: wrk -c{connections} -d{secs}s, Host {name}.bench")
            out = wrk.run(procs, url, wrk.args(1, connections, [f"Host: {name}.bench"]),
                          f"{secs}s", latency=False)
            if out.errors:
                raise Failure(f"training run {label}/{name}: wrk reported {out.errors}")
            forward_proxy_requests(port, f"{name}.bench", 200)
        for path in ("/metrics", "/status", "/healthz"):
            status, _ = http_get(f"http://127.0.0.1:{admin}{path}")
            if status != 200:
                raise Failure(f"training: admin {path} answered {status}")
        # The profile is written when the process exits normally: SIGTERM is a graceful stop.
        procs.stop(s.proc, grace=30)
        if s.proc.returncode != 0:
            raise Failure(f"training gateway {label} exited with {s.proc.returncode}: {s.log}")

    half = max(1, seconds // 2)
    serve("memory", "", route("rr", "round_robin") + route("lu", "least_used")
          + route("q", "round_robin", quota=True), [("rr", seconds), ("lu", half), ("q", half)])
    serve("memory-log-off", "", route("rr", "round_robin"), [("rr", half)], rust_log="warn")
    if not redis:
        return
    rport = procs.free_port()
    start_redis(procs, "redis", rport)
    redis_state = f'state:\n  backend: redis\n  redis:\n    url: "redis://127.0.0.1:{rport}/0"\n'
    kp = key_pool.route("kp", backends.ports[0], key_pool=True)
    serve("redis", redis_state,
          route("lu", "least_used") + route("qlu", "least_used", quota=True) + kp,
          [("lu", half), ("qlu", half), ("kp", half)])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="scripts/build-pgo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    target = Path(os.environ.get("CARGO_TARGET_DIR", "target"))
    if not target.is_absolute():
        target = common.ROOT / target
    parser.add_argument("--out", type=Path, default=target / "pgo",
                        help="where the two binaries go (default: %(default)s)")
    args = parser.parse_args(argv)
    knobs = common.Knobs()
    seconds = knobs.int("TRAIN_SECONDS", 4, minimum=1)
    connections = knobs.int("CONNECTIONS", 64, minimum=1)
    keep = knobs.choice("KEEP", "0", ("0", "1")) == "1"
    with_bolt = knobs.choice("BOLT", "0", ("0", "1")) == "1"
    common.require(NAME, ["cargo", "rustc", "wrk", "nginx", "redis-server", "redis-cli"],
                   "sudo apt-get install -y wrk nginx-light redis-server")
    host = host_triple()
    profdata = llvm_profdata(host)

    procs = Procs(NAME, keep)
    try:
        raw = procs.work / "raw"
        raw.mkdir()
        # Both binaries in both builds, so that cargo unifies the same features of the crates
        # they share and the profile matches the code it is applied to. Only the gateway is
        # trained.
        gen = cargo_build(host, target / "pgo-gen", f"-Cprofile-generate={raw}", BINS)
        # Every instrumented process (the `sluice check` of each config too) writes a file of
        # its own; %m keeps two runs of one binary apart, %p two processes.
        os.environ["LLVM_PROFILE_FILE"] = str(raw / "sluice-%p-%m.profraw")
        train(procs, gen / "sluice", seconds, connections)
        del os.environ["LLVM_PROFILE_FILE"]
        profiles = sorted(raw.glob("*.profraw"))
        if not profiles:
            raise Failure(f"the training wrote no profile into {raw}")
        merged = procs.work / "sluice.profdata"
        procs.run([str(profdata), "merge", "-o", str(merged), *map(str, profiles)], timeout=600)
        procs.log(f"merged {len(profiles)} profiles into {merged.stat().st_size} bytes")
        if with_bolt:
            llvm_bolt()  # fail before the build, not after it
            # A directory of its own: the link flag would otherwise rebuild pgo-use each time.
            use = cargo_build(host, target / "pgo-bolt",
                              f"-Cprofile-use={merged} -Clink-arg=-Wl,--emit-relocs", BINS)
        else:
            use = cargo_build(host, target / "pgo-use", f"-Cprofile-use={merged}", BINS)
        args.out.mkdir(parents=True, exist_ok=True)
        for b in BINS:
            shutil.copy2(use / b, args.out / b)
        if with_bolt:
            bolt(procs, use / "sluice", args.out / "sluice", seconds, connections, keep)
        procs.log(f"profile-guided binaries: {', '.join(str(args.out / b) for b in BINS)}")
    finally:
        procs.cleanup()
    return 0
