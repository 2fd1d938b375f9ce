"""bench-state key-pool: a key-pool route (member quotas and cooldowns) on Redis
against a plain least-used route: req/s, Redis commands per request (INFO
commandstats and a MONITOR sample) and Redis memory per admitted request."""

from __future__ import annotations

import http.client
import os
import re
import subprocess
import threading
import time

from . import common, stats
from .servers import rcli, start_redis, start_sluice, store_errors, wait_ok
from .staterun import QUOTA_YAML, Run, when

TARGETS = ["lu", "qlu", "kp"]
LABELS = {
    "lu": "least_used, Redis (3 named members)",
    "qlu": "route quota + least_used, Redis (fused script)",
    "kp": "key pool: member quotas + cooldown",
}
MEMBERS = ("key-a", "key-b", "key-c")
# Member windows no run can fill: the benchmark measures the work, never a refusal.
MEMBER_QUOTA = "{ windows: [{ name: m, limit: 1000000000000, window: 1h }] }"
# Routes that exist in the config but are only touched by the MONITOR sample and the memory run.
SIDE = ("kpmon", "kpmem")


def route(name: str, port: int, key_pool: bool = False, quota: bool = False) -> str:
    """A least_used route of three named members on one upstream; with KEY_POOL each member
    carries its own Authorization header and quota, and the route has `cooldown: {}` (so the
    script reads the cooldowns and checks the member windows). A route quota on top costs what
    `qlu` shows over `lu`, and a second log entry per request; it is left out, as the key-pool
    benchmark is about member quotas and cooldowns only."""
    text = (f'  - name: {name}\n    match:\n      hosts: ["{name}.bench"]\n    upstream:\n'
            "      selection: least_used\n      members:\n")
    for m in MEMBERS:
        text += f'        - url: "http://127.0.0.1:{port}"\n          name: {m}\n'
        if key_pool:
            text += (f'          headers: {{ Authorization: "Bearer bench-{m}" }}\n'
                     f"          quota: {MEMBER_QUOTA}\n")
    if key_pool:
        text += "      cooldown: {}\n"
    return text + (QUOTA_YAML if quota else "")


def drive(port: int, host: str, n: int, threads: int) -> tuple[int, int]:
    """N GETs with Host HOST over THREADS keep-alive connections: (2xx answers, others)."""
    ok, bad = [0], [0]
    lock = threading.Lock()

    def worker(count: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        good = other = 0
        for _ in range(count):
            try:
                conn.request("GET", "/", headers={"Host": host})
                resp = conn.getresponse()
                resp.read()
                if 200 <= resp.status < 300:
                    good += 1
                else:
                    other += 1
            except (OSError, http.client.HTTPException):
                other += 1
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.close()
        with lock:
            ok[0] += good
            bad[0] += other

    per = [n // threads + (1 if i < n % threads else 0) for i in range(threads)]
    ts = [threading.Thread(target=worker, args=(c,)) for c in per if c]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return ok[0], bad[0]


MONITOR_LINE = re.compile(r'^\d+\.\d+ \[\d+ ([^\]]+)\] "([^"]+)"')


def monitor_sample(run: Run, rport: int, port: int, host: str, n: int) -> tuple[int, dict, dict]:
    """MONITOR while N sequential requests go to HOST: (2xx answers, commands sent by clients
    by name, commands run by scripts by name)."""
    drive(port, host, 5, 1)  # the route's first request creates its pool: not the steady state
    path = run.work / "monitor.txt"
    proc = run.procs.start(["redis-cli", "-p", str(rport), "MONITOR"], out=path)
    time.sleep(0.5)
    ok, _ = drive(port, host, n, 1)
    time.sleep(0.5)
    run.procs.stop(proc)
    top: dict[str, int] = {}
    inner: dict[str, int] = {}
    for line in path.read_text(errors="replace").splitlines():
        m = MONITOR_LINE.match(line)
        if not m:
            continue
        src, cmd = m.group(1), m.group(2).lower()
        into = inner if src == "lua" else top
        into[cmd] = into.get(cmd, 0) + 1
    return ok, top, inner


def key_kinds(rport: int, name: str) -> dict[str, list[str]]:
    """The route's keys by kind: route logs (q), route hashes (qm), member logs (mq), member
    hashes (mqm), pool, cool."""
    out: dict[str, list[str]] = {}
    keys = rcli(rport, "--scan", "--pattern", f"sluice:{{{name}}}:*").split()
    for k in keys:
        kind = k.split(":", 2)[2].split(":", 1)[0]
        out.setdefault(kind, []).append(k)
    return out


def usage(rport: int, keys: list[str]) -> int:
    return sum(int(rcli(rport, "MEMORY", "USAGE", k, "SAMPLES", "0").strip() or 0) for k in keys)


def held(rport: int, hashes: list[str]) -> int:
    """The requests (cost 1 each) the helper hashes' windows hold: each hash's first window
    total (`s:<window>`), summed. Not the logs' entries: the requests one script call admits
    share one entry (lua/quota.lua)."""
    total = 0
    for h in hashes:
        fields = rcli(rport, "HGETALL", h).split("\n")
        pairs = dict(zip(fields[0::2], fields[1::2]))
        total += next((int(v) for f, v in pairs.items() if f.startswith("s:")), 0)
    return total


def memory(rport: int, name: str) -> dict:
    """Bytes of the route's keys, by kind, and the admitted requests: what the route quota's
    windows hold when the route has one, else what the member windows hold (each admitted
    request counts once in its member's)."""
    kinds = key_kinds(rport, name)
    route_logs = kinds.get("q", [])
    admitted = held(rport, kinds.get("qm", []))
    member_entries = sum(int(rcli(rport, "ZCARD", k)) for k in kinds.get("mq", []))
    admitted = admitted or held(rport, kinds.get("mqm", []))
    enc = sorted({rcli(rport, "OBJECT", "ENCODING", k).strip() for k in route_logs + kinds.get("mq", [])})
    b = {kind: usage(rport, keys) for kind, keys in kinds.items()}
    logs = b.get("q", 0) + b.get("mq", 0)
    return {"admitted": admitted, "member_entries": member_entries, "bytes": b, "logs": logs,
            "all": sum(b.values()), "per": logs / admitted if admitted else None,
            "per_all": sum(b.values()) / admitted if admitted else None, "enc": "/".join(enc),
            "keys": {kind: len(keys) for kind, keys in kinds.items()}}


def fmt_cmds(cmds: dict, requests: int) -> str:
    if not cmds or not requests:
        return "-"
    return ", ".join(f"{c} {n / requests:.2f}" for c, n in sorted(cmds.items(), key=lambda kv: -kv[1]))


def run(run: Run) -> str:
    procs = run.procs
    b = run.backends
    mem_requests = run.knobs.int("MEM_REQUESTS", 10000, minimum=1)
    monitor_requests = run.knobs.int("MONITOR_REQUESTS", 200, minimum=1)
    rport = procs.free_port()
    start_redis(procs, "redis-kp", rport)
    port, admin = procs.free_port(), procs.free_port()
    up = b.ports[0]  # every member of every route: one nginx ("echo") upstream
    cfg = run.work / "conf-kp" / "sluice.yaml"
    cfg.parent.mkdir(parents=True)
    cfg.write_text(
        f'listen: ["127.0.0.1:{port}"]\nthreads: {run.sluice_threads}\nadmin:\n  listen: "127.0.0.1:{admin}"\n'
        f'state:\n  backend: redis\n  redis:\n    url: "redis://127.0.0.1:{rport}/0"\nroutes:\n'
        + route("lu", up) + route("qlu", up, quota=True) + route("kp", up, key_pool=True)
        + "".join(route(n, up, key_pool=True) for n in SIDE))
    s = start_sluice(procs, run.sluice, "kp", cfg, port, admin, "warn")
    for name in TARGETS:
        wait_ok(f"http://127.0.0.1:{port}/", f"{name}.bench", f"route {name}")

    run.label.update(LABELS)
    load0 = os.getloadavg()[0]
    run.run_rounds("key-pool", lambda id, r: run.wrk_run(id, r, port, host=f"{id}.bench", cpu=[s.pid],
                                                         redis_ports=[rport]), TARGETS)
    load1 = os.getloadavg()[0]
    errors = store_errors(admin, s.log)

    # --- Redis commands per request, from the wrk rounds (INFO commandstats deltas) ---
    def cmd_per(id: str, top_only: bool) -> list:
        outs = []
        for r in range(1, run.rounds + 1):
            row = run.res.get((id, r))
            if not row or not row.get("cmds"):
                outs.append(None)
                continue
            c = row["cmds"]
            n = sum(v[0] for k, v in c.items() if not top_only or k in ("fcall", "evalsha", "eval"))
            outs.append(n / row["requests"])
        return outs

    def script_us(id: str) -> list:
        outs = []
        for r in range(1, run.rounds + 1):
            c = (run.res.get((id, r)) or {}).get("cmds") or {}
            calls, us = (sum(c.get(k, [0, 0])[i] for k in ("fcall", "evalsha")) for i in (0, 1))
            outs.append(us / calls if calls else None)
        return outs

    def script_us_per_request(id: str) -> list:
        # Calls decide several requests each when requests wait together (batching): Redis's
        # script time per request is what compares across routes.
        outs = []
        for r in range(1, run.rounds + 1):
            row = run.res.get((id, r)) or {}
            c = row.get("cmds") or {}
            us = sum(c.get(k, [0, 0])[1] for k in ("fcall", "evalsha"))
            outs.append(us / row["requests"] if row.get("requests") else None)
        return outs

    last_kp = run.res.get(("kp", run.rounds), {})
    kp_breakdown = fmt_cmds({k: v[0] for k, v in (last_kp.get("cmds") or {}).items()}, last_kp.get("requests", 0))
    last_lu = run.res.get(("lu", run.rounds), {})
    lu_breakdown = fmt_cmds({k: v[0] for k, v in (last_lu.get("cmds") or {}).items()}, last_lu.get("requests", 0))

    # --- MONITOR: what sluice sends per request, sequential requests on a quiet Redis ---
    mon_ok, mon_top, mon_inner = monitor_sample(run, rport, port, "kpmon.bench", monitor_requests)
    top_total = sum(mon_top.values())
    mon_per = top_total / mon_ok if mon_ok else None
    run.log(f"MONITOR: {mon_ok} requests, top-level {mon_top}, in scripts {mon_inner}")

    # --- memory per admitted request ---
    kp_mem = memory(rport, "kp")
    mem_ok, mem_bad = drive(port, "kpmem.bench", mem_requests, 4)
    fresh = memory(rport, "kpmem")
    qlu_mem = memory(rport, "qlu")
    run.log(f"memory: wrk rounds {kp_mem}; {mem_requests} requests ({mem_ok} 2xx, {mem_bad} other) {fresh}")
    procs.stop(s.proc)

    ratio = run.ratio_num("rps", "kp", "lu")
    kp_calls = stats.median(cmd_per("kp", True))
    worst = max([m["per"] for m in (kp_mem, fresh) if m["per"] is not None], default=None)
    qlu_per = qlu_mem["per"]
    us_kp, us_lu, us_qlu = (stats.median(script_us(i)) for i in ("kp", "lu", "qlu"))
    req_kp, req_lu, req_qlu = (stats.median(script_us_per_request(i)) for i in ("kp", "lu", "qlu"))

    def mem_row(what: str, m: dict) -> str:
        by = m["bytes"]
        return (f"| {what} | {m['admitted']} | {m['member_entries']} | {by.get('q', 0)} | {by.get('mq', 0)} "
                f"| {stats.fmt(m['per'], '.1f')} | {by.get('qm', 0) + by.get('mqm', 0)} "
                f"| {by.get('pool', 0) + by.get('cool', 0)} | {stats.fmt(m['per_all'], '.1f')} | {m['enc']} |")

    out = [
        "### Key pools",
        "",
        run.header(),
        "",
        "```sh",
        run.command("key-pool", "MEM_REQUESTS", "MONITOR_REQUESTS", "WAIT_QUIET", "BUILD"),
        "```",
        "",
        "(`BUILD=0`: the release binary of this revision, built beforehand with `cargo build --release --bins` into",
        "`${CARGO_TARGET_DIR:-target}`; `WAIT_QUIET=0`: run at once, even beside other engineers' builds and benchmarks.)",
        "",
        f"**wrk through sluice, one run.** One sluice (`threads: {run.sluice_threads}`, `RUST_LOG=warn`, `state.backend: redis` on one",
        "local redis-server). Every route is `least_used` over three named members (`key-a`, `key-b`, `key-c`) on the same",
        "nginx upstream: `lu` plain (the allocator script), `qlu` with the route quota",
        "`{ name: w, limit: 1000000000000, window: 1h }` (the fused script), and `kp`, the key pool: each member with",
        f"`headers: {{ Authorization: \"Bearer bench-key-…\" }}` and `quota: {MEMBER_QUOTA}`, `cooldown: {{}}` (so the",
        "script reads the cooldowns), no route quota; nothing is ever refused (`lua/assign_run.lua`).",
        f"Each target: `{run.wrk_cmd['kp']}` with the route's Host, after an unrecorded {run.warmup} warm-up;",
        f"{run.rounds} rounds, order rotated and reversed every other round. Script calls per request are `cmdstat_fcall` + `cmdstat_evalsha` calls over wrk's requests.",
        "",
        *run.wrk_table(TARGETS),
        "",
        f"- key pool / least_used, req/s: {run.ratio('rps', 'kp', 'lu')} — target ≥ 0.9×",
        f"- route quota + least_used / least_used, req/s: {run.ratio('rps', 'qlu', 'lu')}",
        f"- key pool / route quota + least_used, req/s: {run.ratio('rps', 'kp', 'qlu')}",
        f"- p99, key pool / least_used: {run.ratio('p99', 'kp', 'lu')}",
        f"- µs per script call inside Redis (`cmdstat_fcall` + `cmdstat_evalsha` usec / calls; medians): least_used {stats.fmt(us_lu, '.2f')}, "
        f"route quota + least_used {stats.fmt(us_qlu, '.2f')}, key pool {stats.fmt(us_kp, '.2f')}",
        f"- µs of script time inside Redis per request (usec / wrk's requests; medians): least_used {stats.fmt(req_lu, '.2f')}, "
        f"route quota + least_used {stats.fmt(req_qlu, '.2f')}, key pool {stats.fmt(req_kp, '.2f')}",
        f"- FCALL/EVAL/EVALSHA per request, key pool (per round): {', '.join(stats.fmt(v, '.3f') for v in cmd_per('kp', True))}; "
        f"every command Redis counted (scripts' own included) per request: {', '.join(stats.fmt(v, '.2f') for v in cmd_per('kp', False))}",
        f"- commandstats per request, last key-pool round: {kp_breakdown}",
        f"- commandstats per request, last least_used round: {lu_breakdown}",
        f"- errors reported by wrk: {run.wrk_errors(TARGETS)}; sluice store errors and fallbacks: {errors}.",
        f"- order: {run.orders['key-pool']}",
        f"- load average (1 min) before and after the rounds: {load0:.1f}, {load1:.1f} on {common.nproc()} cores.",
        "",
        *([f"The store errors above are sluice's Redis timeouts on a machine this loaded: those requests were answered",
           "with the local fallback choice (their script call still ran in Redis, hence about one per request). The ratios are",
           "of a saturated box; rerun on a quiet one before reading much into them.", ""] if errors != "0" else []),
        f"**Round trips, with MONITOR.** `redis-cli MONITOR` while {monitor_requests} sequential requests (one keep-alive",
        "connection) go to `kpmon.bench`, a key-pool route like `kp` that wrk never touched (after 5 unrecorded requests:",
        "a route's first request also creates its pool). A line from a client is one command sent by it; lines from `lua` are the commands the script ran.",
        "",
        f"- requests answered 2xx: {mon_ok}; commands from clients: {top_total} "
        f"({', '.join(f'{k} {v}' for k, v in sorted(mon_top.items(), key=lambda kv: -kv[1])) or 'none'}); "
        f"per request: {stats.fmt(mon_per, '.3f')}",
        f"- commands run by the script per request: {stats.fmt(sum(mon_inner.values()) / mon_ok if mon_ok else None, '.1f')} "
        f"({', '.join(f'{k} {v}' for k, v in sorted(mon_inner.items(), key=lambda kv: -kv[1]))})",
        "",
        f"**Memory per admitted request.** `MEMORY USAGE <key> SAMPLES 0` over the route's keys (`redis-cli --scan`), divided",
        "by the admitted requests (what the route quota's window holds where there is one, else the member windows:",
        "`s:` of the helper hashes; the requests one call admits share one log entry). \"Logs\" are the route quota's",
        "log plus the three member-window logs; a route with both keeps an entry in each. The helper hashes, the pool and the cooldown set do not grow with the traffic. Rows: what the wrk",
        f"rounds left on `kp`; {mem_requests} requests (4 keep-alive connections; {mem_ok} 2xx, {mem_bad} other) on the",
        "untouched route `kpmem`; and, for reference, the route quota alone (`qlu`). Target: logs ≤ 150 bytes per admitted request.",
        "",
        "| route | admitted | member log entries | route log bytes | member log bytes | logs, bytes per request | hash bytes | pool + cool bytes | all keys, bytes per request | encoding |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        mem_row("kp (wrk rounds)", kp_mem),
        mem_row(f"kpmem ({mem_requests} requests)", fresh),
        mem_row("qlu (wrk rounds, route quota only)", qlu_mem),
        "",
        f"Reading: the key pool costs {stats.fmt(kp_calls, '.2f')} script calls (FCALL) per request during wrk and "
        f"{stats.fmt(mon_per, '.2f')} client commands per request under MONITOR"
        + when(mon_per, lambda x: abs(x - 1) < 0.02, ": one round trip per request.",
               ": NOT exactly one round trip per request, see the commands above.")
        + f" It runs at {stats.fmt(ratio, '.2f')}× the plain least_used route's req/s"
        + when(ratio, lambda x: x >= 0.9, ", meeting the ≥ 0.9× target; the script's work in Redis is"
               f" {stats.fmt(req_kp, '.1f')} µs per request against {stats.fmt(req_lu, '.1f')}, " + run.shared_cores,
               ", MISSING the ≥ 0.9× target: the difference is the script's work in Redis"
               f" ({stats.fmt(req_kp, '.1f')} µs per request against {stats.fmt(req_lu, '.1f')}: the cooldown read, then the"
               " chosen member's window check (hash and log reads) and"
               " the chosen member's log and hash writes), " + run.shared_cores)
        + f". Its logs take {stats.fmt(worst, '.0f')} bytes per admitted request"
        + when(worst, lambda x: x <= 150, ", within the 150-byte target.",
               ", OVER the 150-byte target; a route quota on top adds one more entry per request, the size of a"
               f" route-quota entry ({stats.fmt(qlu_per, '.0f')} bytes for `qlu` alone)."),
    ]
    return "\n".join(out)
