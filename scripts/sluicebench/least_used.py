"""bench-state least-used: least-used selection, in memory and in Redis."""

from __future__ import annotations

from . import common, stats
from .servers import (lua_script, load_script, populate_pool, rcli, start_redis, start_sluice,
                      store_errors, wait_ok)
from .staterun import BIG_WINDOW, QUOTA_YAML, Run, when

TARGETS = ["rr_mem", "lu_mem", "lu_redis", "lif_redis", "qlu_redis", "rr_redis"]
LABELS = {
    "rr_mem": "round_robin (memory process)",
    "lu_mem": "least_used, memory store",
    "rr_redis": "round_robin (Redis process)",
    "lu_redis": "least_used, Redis",
    "lif_redis": "least_in_flight, Redis (lease taken and released)",
    "qlu_redis": "quota + least_used, Redis (fused script)",
}


def route(run: Run, name: str, selection: str, quota: bool = False) -> str:
    return run.backends.route_yaml(name, selection, f"{name}.bench") + (QUOTA_YAML if quota else "")


def run(run: Run) -> str:
    procs = run.procs
    rport = procs.free_port()
    start_redis(procs, "redis-lu", rport)
    mport, madmin, rpt, radmin = (procs.free_port() for _ in range(4))
    # Two processes: the memory store and Redis (state is per process). Each has a round_robin
    # route too, as a same-process reference.
    mem_cfg = run.work / "conf-lu-mem" / "sluice.yaml"
    redis_cfg = run.work / "conf-lu-redis" / "sluice.yaml"
    mem_cfg.parent.mkdir(parents=True)
    redis_cfg.parent.mkdir(parents=True)
    mem_cfg.write_text(
        f'listen: ["127.0.0.1:{mport}"]\nthreads: {run.sluice_threads}\nadmin:\n  listen: "127.0.0.1:{madmin}"\n'
        "state:\n  backend: memory\nroutes:\n"
        + route(run, "rr", "round_robin") + route(run, "lu", "least_used"))
    redis_cfg.write_text(
        f'listen: ["127.0.0.1:{rpt}"]\nthreads: {run.sluice_threads}\nadmin:\n  listen: "127.0.0.1:{radmin}"\n'
        f'state:\n  backend: redis\n  redis:\n    url: "redis://127.0.0.1:{rport}/0"\nroutes:\n'
        + route(run, "rr", "round_robin") + route(run, "lu", "least_used")
        + route(run, "lif", "least_in_flight")
        + route(run, "qlu", "least_used", quota=True))
    mem = start_sluice(procs, run.sluice, "lu-mem", mem_cfg, mport, madmin, "warn")
    red = start_sluice(procs, run.sluice, "lu-redis", redis_cfg, rpt, radmin, "warn")
    for name, port in (("rr", mport), ("lu", mport), ("rr", rpt), ("lu", rpt), ("lif", rpt), ("qlu", rpt)):
        wait_ok(f"http://127.0.0.1:{port}/", f"{name}.bench", f"route {name} on port {port}")

    run.label.update(LABELS)

    def runner(id: str, r: int) -> None:
        route_name, where = id.split("_")
        if where == "mem":
            run.wrk_run(id, r, mport, host=f"{route_name}.bench", cpu=[mem.pid])
        else:
            run.wrk_run(id, r, rpt, host=f"{route_name}.bench", cpu=[red.pid], redis_ports=[rport])

    run.run_rounds("least-used", runner, TARGETS)
    errors = (f"memory process: {store_errors(madmin, mem.log)}; "
              f"Redis process: {store_errors(radmin, red.log)}")
    counts = " / ".join(" ".join(rcli(rport, "ZRANGE", f"sluice:{{{n}}}:pool", "0", "-1", "WITHSCORES").split())
                        for n in ("lu", "qlu"))
    procs.stop(mem.proc)
    procs.stop(red.proc)

    # --- the allocator script against the pool size ---
    asha = load_script(rport, lua_script(common.ROOT, "allocator.lua", "allocator_run.lua"))
    fsha = load_script(rport, lua_script(common.ROOT, "quota.lua", "allocator.lua", "fused_run.lua"))
    for size in (10, 10000):
        populate_pool(rport, f"sluice:{{p{size}}}:pool", size)
    rb = []
    for kind, size in (("allocator", 10), ("allocator", 10000), ("fused", 10), ("fused", 10000),
                       ("allocator", 10), ("allocator", 10000)):
        if kind == "allocator":
            cmd = ["evalsha", asha, "1", f"sluice:{{p{size}}}:pool", "assign", "0"]
        else:
            cmd = ["evalsha", fsha, "3", f"sluice:{{p{size}}}:qm:k", f"sluice:{{p{size}}}:q:w:k",
                   f"sluice:{{p{size}}}:pool", "", *BIG_WINDOW, "1", "1", "0"]
        m = run.rb_measure(rport, run.rb_requests, run.rb_clients, *cmd)
        run.log(f"{kind} script, pool {size}: {m} (calls/s, usec per call, calls, failed)")
        rb.append((kind, size, *m))
    spread = ""
    for size in (10, 10000):
        least = rcli(rport, "ZRANGE", f"sluice:{{p{size}}}:pool", "0", "0", "WITHSCORES").split()
        most = rcli(rport, "ZRANGE", f"sluice:{{p{size}}}:pool", "-1", "-1", "WITHSCORES").split()
        spread += f"pool {size}: least {least[1] if len(least) > 1 else '?'}; most {most[1] if len(most) > 1 else '?'}. "

    q = run.ratio_num("rps", "qlu_redis", "rr_mem")
    a10 = stats.median(usec for kind, size, _, usec, _, _ in rb if kind == "allocator" and size == 10)
    a10k = stats.median(usec for kind, size, _, usec, _, _ in rb if kind == "allocator" and size == 10000)
    ar = a10k / a10 if a10 else None
    out = [
        "### Least-used",
        "",
        run.header(),
        "",
        "```sh",
        run.command("least-used"),
        "```",
        "",
        f"**wrk through sluice, one run.** Two sluice processes (`threads: {run.sluice_threads}`, `RUST_LOG=warn`), both running all the",
        "time, each loaded in turn: one on the memory store (routes `rr`: round_robin, `lu`: least_used), one on a local Redis",
        "(routes `rr`, `lu`: least_used, `lif`: least_in_flight, `qlu`: least_used with the quota `{ name: w, limit: 1000000000000, window: 1h }`,",
        "one fused script call for the requests of the route that wait together). Every route has the same two nginx backends as members.",
        f"Each target: `{run.wrk_cmd['qlu_redis']}` with the route's Host, after an unrecorded {run.warmup} warm-up; {run.rounds} rounds.",
        "",
        *run.wrk_table(TARGETS),
        "",
        f"- quota + least_used (Redis) / round_robin (memory process), req/s: {run.ratio('rps', 'qlu_redis', 'rr_mem')} — target ≥ 0.5×",
        f"- quota + least_used (Redis) / round_robin (same Redis process), req/s: {run.ratio('rps', 'qlu_redis', 'rr_redis')}",
        f"- least_used (Redis) / round_robin (memory process), req/s: {run.ratio('rps', 'lu_redis', 'rr_mem')}",
        f"- least_in_flight (Redis) / least_used (Redis), req/s: {run.ratio('rps', 'lif_redis', 'lu_redis')} — target ≥ 0.8×"
        " (a lease is taken in the assignment's call and released in a second, shared by the releases that come due together)",
        f"- least_used (memory) / round_robin (memory process), req/s: {run.ratio('rps', 'lu_mem', 'rr_mem')}",
        f"- p99, quota + least_used (Redis) / round_robin (memory process): {run.ratio('p99', 'qlu_redis', 'rr_mem')}",
        f"- errors reported by wrk: {run.wrk_errors(TARGETS)}; sluice store errors and fallbacks: {errors}.",
        f"- Redis pool counts after the rounds (member, count; `lu` / `qlu`): {counts}",
        f"- order: {run.orders['least-used']}",
        "",
        "**Where the machine's CPU time went, µs per request** (medians over rounds): each process's utime + stime",
        "(`/proc/PID/stat`, summed by command name: both sluice processes, both nginx backends, every redis-server;",
        "wrk from the driver's own `RUSAGE_CHILDREN`) and the machine's idle time (`/proc/stat`) across the recorded",
        "run, divided by the requests wrk completed. The last column is all the CPUs' time: what is not in the others",
        "went to interrupts or to other processes.",
        "",
        *run.budget_table(TARGETS),
        "",
        f"Reading: quota + least_used on Redis runs at {stats.fmt(q, '.2f')}× the round_robin route's req/s"
        + when(q, lambda x: x >= 0.5, ", meeting the ≥ 0.5× target", ", MISSING the ≥ 0.5× target")
        + when(q, lambda x: x >= 0.66, " and the ≥ 0.66× target", " but not the ≥ 0.66× target")
        + "; its extra cost is the wait for the Redis round trip",
        f"and the fused script, in sluice's CPU (see its µs/req) and in Redis, {run.shared_cores}.",
        "",
        "**The allocator script against the pool size.** Pools `sluice:{p10}:pool` and `sluice:{p10000}:pool` filled with",
        f"`ZADD` (10 and 10,000 members at count 0), then `redis-benchmark -p PORT -n {run.rb_requests} -c {run.rb_clients} "
        "--csv evalsha SHA 1 sluice:{pN}:pool assign 0`",
        '(SHA of `lua/allocator.lua` + "\\n" + `lua/allocator_run.lua`), and the fused script',
        '(`evalsha FSHA 3 sluice:{pN}:qm:k sluice:{pN}:q:w:k sluice:{pN}:pool "" w 1000000000000 3600000000 1 1 0`), after `CONFIG RESETSTAT`;',
        "in the order listed.",
        "",
        "| script | pool size | calls/s (redis-benchmark) | µs per call in Redis | calls | failed |",
        "|---|---:|---:|---:|---:|---:|",
        *[f"| {kind} | {size} | {rps:.0f} | {usec:.2f} | {calls} | {failed} |"
          for kind, size, rps, usec, calls, failed in rb],
        "",
        f"- counts afterwards: {spread}",
        "",
        f"Reading: the allocator script costs {stats.fmt(ar, '.2f')}× as much per call at 10,000 members as at 10 "
        f"(medians {stats.fmt(a10k, '.2f')} and",
        f"{stats.fmt(a10, '.2f')} µs)"
        + when(ar, lambda x: x <= 2, ": 1,000 times the members, about the same work (O(log n)), not linear.",
               ": it grew, look again."),
    ]
    return "\n".join(out)
