"""bench-state lease-wake: how long a request waiting at a `max_in_flight` cap takes to go once
the lease that held the cap is released on another gateway.

Two sluice processes share one Redis and one route capped at one request in flight, with
`quota.max_wait`, in front of a sluice-echo member. Each round a holder takes the one slot
through the first gateway with a request the member answers after HOLD_MS; once the member has
it, a waiter goes through the second gateway and waits at the cap. The delay is from the holder's
answer to the waiter's: it is what the release, the waiter's next poll of the store (every 20 ms,
docs/config.md) and one store round trip add. Timing, so it lives here and not in `cargo test`
(`at_the_cap_a_request_waits_with_max_wait` in tests/leases.rs checks that waiters go, on both stores)."""

from __future__ import annotations

import http.client
import threading
import time
from pathlib import Path

from . import stats
from .procs import Failure
from .servers import rcli, start_redis, start_sluice
from .staterun import Run


def request(port: int, host: str, headers: dict[str, str]) -> tuple[int, float]:
    """(status, monotonic time the answer was read) of one GET through sluice at PORT."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("GET", "/", headers={"Host": host, **headers})
        resp = conn.getresponse()
        resp.read()
        return resp.status, time.monotonic()
    finally:
        conn.close()


def run(run: Run) -> str:
    procs = run.procs
    rounds = run.knobs.int("WAKE_ROUNDS", 50, minimum=1)
    hold_ms = run.knobs.int("HOLD_MS", 100, minimum=1)
    echo = run.sluice.parent / "sluice-echo"
    if not echo.exists():
        raise Failure(f"{echo} is missing: build it (`cargo build --release --bins`) or set SLUICE_BIN_DIR "
                      "to a directory holding both sluice and sluice-echo")
    rport, mport = procs.free_port(), procs.free_port()
    start_redis(procs, "redis-wake", rport)
    member = procs.start([str(echo), "--name", "m1", "--listen", f"127.0.0.1:{mport}"],
                         out=procs.work / "logs" / "echo-wake.log")
    procs.wait_listening(mport, member, "sluice-echo")
    gateways = []
    for i in (1, 2):
        port, admin = procs.free_port(), procs.free_port()
        dir = run.work / f"conf-wake-{i}"
        dir.mkdir(parents=True)
        cfg = dir / "sluice.yaml"
        cfg.write_text(
            f'listen: ["127.0.0.1:{port}"]\nthreads: {run.sluice_threads}\nadmin:\n  listen: "127.0.0.1:{admin}"\n'
            f'state:\n  backend: redis\n  redis:\n    url: "redis://127.0.0.1:{rport}/0"\n    timeout: 5s\n'
            "routes:\n  - name: wake\n    match:\n      hosts: [wake.bench]\n    quota: { max_wait: 10s }\n"
            f'    upstream:\n      max_in_flight: 1\n      members:\n        - {{ name: m1, url: "http://127.0.0.1:{mport}" }}\n')
        gateways.append(start_sluice(procs, run.sluice, f"sluice-wake-{i}", cfg, port, admin, "warn"))
    holder_gw, waiter_gw = gateways
    delays_ms: list[float] = []
    for r in range(rounds):
        held: dict[str, tuple[int, float]] = {}
        holder = threading.Thread(
            target=lambda: held.__setitem__("r", request(holder_gw.port, "wake.bench", {"x-delay-ms": str(hold_ms)})))
        holder.start()
        # The waiter must find the slot taken: wait until the holder's lease is in Redis.
        deadline = time.monotonic() + 20
        # The route's lease set (`…:lz`) exists exactly while a lease is held.
        while not any(k.endswith(":lz") for k in redis_keys(rport)):
            if not holder.is_alive() or time.monotonic() > deadline:
                holder.join(timeout=60)
                raise Failure(f"round {r + 1}: the holder's lease was not seen in Redis while it was held "
                              f"(the holder's answer: {held.get('r', (0, 0.0))[0]})")
            time.sleep(0.002)
        status, admitted = request(waiter_gw.port, "wake.bench", {})
        holder.join(timeout=60)
        hs, released = held.get("r", (0, 0.0))
        if (hs, status) != (200, 200):
            raise Failure(f"round {r + 1}: holder {hs}, waiter {status} (both should be 200)")
        delays_ms.append(max(0.0, (admitted - released) * 1000))
    delays_ms.sort()
    median = stats.median(delays_ms)
    p90 = delays_ms[min(len(delays_ms) - 1, int(len(delays_ms) * 0.9))]
    return "\n".join([
        "### Lease wake-up across gateways",
        "",
        run.header(),
        "",
        f"Command: `{run.knobs.line(['SLUICE_THREADS', 'WAKE_ROUNDS', 'HOLD_MS'])} scripts/bench-state lease-wake"
        f"{' --write' if run.write else ''}`. Two sluice processes on one Redis, "
        f"a route with `max_in_flight: 1` and `quota.max_wait`; {rounds} rounds, each a holder of {hold_ms} ms "
        "through one gateway and a waiter through the other. The delay runs from the holder's answer to the "
        "waiter's (the release, the waiter's next poll of the store, one round trip, and the member's own "
        "answer).",
        "",
        "| rounds | median ms | p90 ms | max ms |",
        "|---:|---:|---:|---:|",
        f"| {rounds} | {median:.1f} | {p90:.1f} | {delays_ms[-1]:.1f} |",
    ])


def redis_keys(port: int) -> list[str]:
    """Every key of the Redis at PORT (a handful here)."""
    return [k for k in rcli(port, "--scan").splitlines() if k]
