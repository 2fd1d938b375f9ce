"""bench-state quota: what a sliding-window quota checked in Redis costs."""

from __future__ import annotations

from . import common, stats
from .servers import (lua_script, load_script, rcli, start_redis, start_sluice, store_errors,
                      wait_ok)
from .staterun import BIG_WINDOW, QUOTA_YAML, Run, when


def run(run: Run) -> str:
    procs, b = run.procs, run.backends
    mem_requests = run.knobs.int("MEM_REQUESTS", 10000, minimum=1)
    rport = procs.free_port()
    start_redis(procs, "redis-quota", rport)
    port, admin = procs.free_port(), procs.free_port()
    cfg = run.work / "conf-quota" / "sluice.yaml"
    cfg.parent.mkdir(parents=True)
    text = f"""listen: ["127.0.0.1:{port}"]
threads: {run.sluice_threads}
admin:
  listen: "127.0.0.1:{admin}"
state:
  backend: redis
  redis:
    url: "redis://127.0.0.1:{rport}/0"
routes:
"""
    for name, cost in (("noquota", None), ("q1", 1), ("q100", 100)):
        text += f'  - name: {name}\n    match:\n      hosts: ["{name}.bench"]\n    upstream:\n      members:\n'
        text += b.members_yaml("        ")
        if cost is not None:
            text += QUOTA_YAML + f"      cost:\n        default: {cost}\n"
    cfg.write_text(text)
    s = start_sluice(procs, run.sluice, "quota", cfg, port, admin, "warn")
    for h in ("noquota", "q1", "q100"):  # every route must answer 200 before it is measured
        wait_ok(f"http://127.0.0.1:{port}/", f"{h}.bench", f"route {h}")

    run.label.update({"noquota": "no quota", "q1": "quota, cost 1", "q100": "quota, cost 100"})
    run.run_rounds("quota", lambda id, r: run.wrk_run(id, r, port, host=f"{id}.bench", cpu=[s.pid],
                                                      redis_ports=[rport]),
                   ["noquota", "q1", "q100"])
    errors = store_errors(admin, s.log)
    # Memory of the logs the wrk rounds left (skiplist-encoded sorted sets with many entries).
    wrk_mem = []
    for h in ("q1", "q100"):
        key, meta = f"sluice:{{{h}}}:q:w:route", f"sluice:{{{h}}}:qm:route"
        # The requests the window holds, not its entries: the requests one call admits share one.
        admitted = int(rcli(rport, "HGET", meta, "s:w").strip() or 0) // int(h[1:])
        wrk_mem.append((h, int(rcli(rport, "ZCARD", key)), admitted,
                        int(rcli(rport, "MEMORY", "USAGE", key, "SAMPLES", "0"))))
    procs.stop(s.proc)

    # --- the quota script alone ---
    sha = load_script(rport, lua_script(common.ROOT, "quota.lua", "quota_run.lua"))
    rb = []
    for cost in (1, 100, 1, 100):
        m = run.rb_measure(rport, run.rb_requests, run.rb_clients, "evalsha", sha, "2",
                           f"sluice:{{b{cost}}}:qm:k", f"sluice:{{b{cost}}}:q:w:k", str(cost), "", *BIG_WINDOW)
        run.log(f"quota script, cost {cost}: {m} (calls/s, usec per call, calls, failed)")
        rb.append((cost, *m))

    # --- memory per admitted request ---
    mem = []
    for cost in (1, 100):
        key, meta = f"sluice:{{m{cost}}}:q:w:k", f"sluice:{{m{cost}}}:qm:k"
        rcli(rport, "DEL", key, meta)
        procs.run(["redis-benchmark", "-p", str(rport), "-n", str(mem_requests), "-c", "1", "-q",
                   "evalsha", sha, "2", meta, key, str(cost), "", *BIG_WINDOW], timeout=1800)
        n = int(rcli(rport, "ZCARD", key))
        size = int(rcli(rport, "MEMORY", "USAGE", key, "SAMPLES", "0"))
        meta_size = rcli(rport, "MEMORY", "USAGE", meta, "SAMPLES", "0").strip()
        encoding = rcli(rport, "OBJECT", "ENCODING", key).strip()
        mem.append((cost, n, size, meta_size, encoding))
        run.log(f"memory, cost {cost}: {n} entries, {size} bytes")

    r1, r100 = run.ratio_num("rps", "q1", "noquota"), run.ratio_num("rps", "q100", "q1")
    out = [
        "### Quotas (one Redis)",
        "",
        run.header(),
        "",
        "```sh",
        run.command("quota", "RB_REQUESTS", "RB_CLIENTS", "MEM_REQUESTS"),
        "```",
        "",
        f"**wrk through sluice.** One sluice (`threads: {run.sluice_threads}`, `RUST_LOG=warn`, `state.backend: redis` on one local",
        "redis-server) with three routes over the same two nginx backends: no quota, and a quota of one window",
        "`{ name: w, limit: 1000000000000, window: 1h }` at `cost.default` 1 and 100 (nothing is refused).",
        f"Each target: `{run.wrk_cmd['q1']}` (Host `noquota.bench`, `q1.bench`, `q100.bench`) after an",
        f"unrecorded {run.warmup} warm-up; {run.rounds} rounds, order rotated and reversed every other round. Medians over rounds;",
        "sluice CPU is its utime+stime per request; script calls per request are Redis's `cmdstat_fcall` + `cmdstat_evalsha` calls over wrk's requests.",
        "",
        *run.wrk_table(["noquota", "q1", "q100"]),
        "",
        f"- quota cost 1 / no quota, req/s: {run.ratio('rps', 'q1', 'noquota')}; p99: {run.ratio('p99', 'q1', 'noquota')}",
        f"- quota cost 100 / no quota, req/s: {run.ratio('rps', 'q100', 'noquota')}; p99: {run.ratio('p99', 'q100', 'noquota')}",
        f"- quota cost 100 / cost 1, req/s: {run.ratio('rps', 'q100', 'q1')}",
        f"- errors reported by wrk: {run.wrk_errors(['noquota', 'q1', 'q100'])}; sluice store errors and fallbacks: {errors}.",
        f"- order: {run.orders['quota']}",
        "",
        f"Reading: on this box a quota checked in Redis costs {stats.fmt(None if r1 is None else (1 - r1) * 100)}% "
        "of the no-quota throughput (a round trip",
        f"per request, paid in sluice's CPU and in latency; the requests that wait together share one call), and cost 100 runs at {stats.fmt(r100, '.2f')}× the rate of cost 1"
        + when(r100, lambda x: x >= 0.9, ": the cost does not change the price.",
               ": noticeably slower, see the script figures below."),
        "",
        f"**The quota script alone.** `redis-benchmark -p PORT -n {run.rb_requests} -c {run.rb_clients} --csv evalsha SHA 2 "
        'sluice:{bC}:qm:k sluice:{bC}:q:w:k C "" w 1000000000000 3600000000`',
        '(C = the cost; SHA of `lua/quota.lua` + "\\n" + `lua/quota_run.lua`), after `CONFIG RESETSTAT`; µs per call is',
        "`usec_per_call` of `cmdstat_evalsha` (time inside Redis). Runs in the order listed; a cost's second run goes on",
        f"with the log of its first (a sorted set of {run.rb_requests}, then {2 * run.rb_requests} entries).",
        "",
        "| cost | calls/s (redis-benchmark) | µs per call in Redis | calls | failed |",
        "|---:|---:|---:|---:|---:|",
        *[f"| {c} | {rps:.0f} | {usec:.2f} | {calls} | {failed} |" for c, rps, usec, calls, failed in rb],
    ]
    m1 = stats.median(usec for c, _, usec, _, _ in rb if c == 1)
    m100 = stats.median(usec for c, _, usec, _, _ in rb if c == 100)
    cr = m100 / m1 if m1 else None
    out += [
        "",
        f"Reading: µs per call in Redis at cost 100 / cost 1 = {stats.fmt(cr, '.2f')}× "
        f"(medians {stats.fmt(m100, '.2f')} and {stats.fmt(m1, '.2f')} µs):",
        when(cr, lambda x: x <= 1.25,
             "script time does not grow with the cost (one log entry per request, whatever its cost).",
             "cost 100 took longer than cost 1 in this run, more than run-to-run noise would explain; look again."),
        "",
        f"**Memory per admitted request.** {mem_requests} calls of the same script (`redis-benchmark -n {mem_requests} -c 1 evalsha ...`)",
        "on a new key, one window, then `MEMORY USAGE <log key> SAMPLES 0` / `ZCARD` (one call a request: an entry",
        "each); and the same for the logs the wrk rounds above left behind (route `q1`, `q100`, key",
        "`sluice:{q1}:q:w:route`), over the requests their window holds (`s:w` over the cost: the requests one call",
        "admits share one entry). Target: ≤ 150 bytes whatever the cost.",
        "",
        "| cost | entries (ZCARD) | requests | log bytes | bytes per request | helper hash bytes | encoding |",
        "|---:|---:|---:|---:|---:|---:|---|",
        *[f"| {c} | {n} | {n} | {size} | {size / n:.1f} | {meta} | {enc} |" for c, n, size, meta, enc in mem],
        *[f"| {h[1:]} (wrk rounds) | {n} | {a} | {size} | {size / a:.1f} | - | skiplist |"
          for h, n, a, size in wrk_mem if a],
    ]
    worst = max([size / n for _, n, size, _, _ in mem if n] + [size / a for _, _, a, size in wrk_mem if a])
    out += [
        "",
        f"Reading: at most {worst:.1f} bytes of Redis memory per admitted request, cost 1 or 100"
        + when(worst, lambda x: x <= 150, ": within the 150-byte target.", ": OVER the 150-byte target."),
    ]
    return "\n".join(out)
