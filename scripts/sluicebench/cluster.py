"""bench-state cluster: quota + least_used on one Redis against a Redis Cluster ."""

from __future__ import annotations

import time

from . import common, stats
from .procs import Failure, machine_cpu, now_ms
from .servers import (lua_script, load_script, populate_pool, rcli, script_stats, start_redis,
                      start_sluice, store_errors, wait_ok)
from .staterun import BIG_WINDOW, QUOTA_YAML, Run

ROTATE_HOSTS_LUA = """local reqs, i = {}, 0
function init(args)
  for k, h in ipairs(hosts) do reqs[k] = wrk.format(nil, nil, { ["Host"] = h }) end
end
function request()
  i = i % #reqs + 1
  return reqs[i]
end
"""


def masters_of(port: int) -> list[tuple[int, list[str]]]:
    """(port, slot ranges) of every master that is not failing, from CLUSTER NODES."""
    out = []
    for line in rcli(port, "CLUSTER", "NODES").splitlines():
        f = line.split()
        if len(f) >= 8 and "master" in f[2] and "fail" not in f[2]:
            out.append((int(f[1].split("@")[0].rsplit(":", 1)[1]), f[8:]))
    return sorted(out)


def master_of_slot(slot: int, masters: list[tuple[int, list[str]]]) -> int:
    for port, ranges in masters:
        for r in ranges:
            if r.startswith("["):  # a slot being migrated or imported
                continue
            lo, _, hi = r.partition("-")
            if int(lo) <= slot <= int(hi or lo):
                return port
    raise Failure(f"no master holds slot {slot}")


def run(run: Run) -> str:
    procs, b = run.procs, run.backends
    per_master = run.knobs.int("ROUTES_PER_MASTER", 2, minimum=1)
    scale_seconds = run.knobs.int("SCALE_SECONDS", 5, minimum=1)
    ports = []
    for _ in range(6):
        p = procs.free_port(bus=True)
        start_redis(procs, f"cluster-{p}", p, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", "1000", "--repl-diskless-sync-delay", "0")
        ports.append(p)
    procs.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports),
               "--cluster-replicas", "1", "--cluster-yes"], timeout=120)
    for _ in range(300):
        if all("cluster_state:ok" in rcli(p, "CLUSTER", "INFO") for p in ports):
            break
        time.sleep(0.1)
    else:
        raise Failure("the cluster did not reach cluster_state:ok")
    # Wait until every node agrees on 3 masters with all slots.
    for _ in range(100):
        masters = masters_of(ports[0])
        if len(masters) == 3:
            break
        time.sleep(0.1)
    else:
        raise Failure(f"expected 3 masters: {masters_of(ports[0])}")
    master_ports = [m for m, _ in masters]
    described = "; ".join(f"{m} {' '.join(r)}" for m, r in masters)
    run.log(f"cluster: masters {master_ports} ({described})")

    # Route names whose {name} hash tags spread over the masters: ROUTES_PER_MASTER each.
    names, placement, count = [], "", {m: 0 for m in master_ports}
    for i in range(200):
        if len(names) >= 3 * per_master:
            break
        name = f"qlu-{i}"
        slot = int(rcli(ports[0], "CLUSTER", "KEYSLOT", f"sluice:{{{name}}}:pool"))
        m = master_of_slot(slot, masters)
        if count[m] >= per_master:
            continue
        count[m] += 1
        names.append(name)
        placement += f"`{name}` → slot {slot} on master :{m} (index {master_ports.index(m)}); "
    run.log(f"routes: {placement}")

    # One plain Redis for the comparison.
    single = procs.free_port()
    start_redis(procs, "redis-single", single)
    sport_single, admin_single, sport_cluster, admin_cluster = (procs.free_port() for _ in range(4))

    def write_config(name: str, port: int, admin: int, state_yaml: str):
        cfg = run.work / f"conf-{name}" / "sluice.yaml"
        cfg.parent.mkdir(parents=True)
        text = (f'listen: ["127.0.0.1:{port}"]\nthreads: {run.sluice_threads}\nadmin:\n  listen: "127.0.0.1:{admin}"\n'
                f"{state_yaml}\nroutes:\n")
        for n in names:
            text += (f'  - name: {n}\n    match:\n      hosts: ["{n}.bench"]\n    upstream:\n'
                     f"      selection: least_used\n      members:\n" + b.members_yaml("        ") + QUOTA_YAML)
        cfg.write_text(text)
        return cfg

    nodes = ", ".join(f'"redis://127.0.0.1:{p}"' for p in ports)
    cfg_single = write_config("single", sport_single, admin_single,
                              f'state:\n  backend: redis\n  redis:\n    url: "redis://127.0.0.1:{single}/0"')
    cfg_cluster = write_config("cluster", sport_cluster, admin_cluster,
                               f"state:\n  backend: redis\n  redis:\n    cluster: [{nodes}]")
    s_single = start_sluice(procs, run.sluice, "single", cfg_single, sport_single, admin_single, "warn")
    s_cluster = start_sluice(procs, run.sluice, "cluster", cfg_cluster, sport_cluster, admin_cluster, "warn")
    for name in names:
        for p in (sport_single, sport_cluster):
            wait_ok(f"http://127.0.0.1:{p}/", f"{name}.bench", f"route {name} on port {p}")
    # wrk script: each thread builds one request per route and sends them in turn.
    lua = run.work / "rotate-hosts.lua"
    lua.write_text("local hosts = {" + "".join(f'"{n}.bench", ' for n in names) + "}\n" + ROTATE_HOSTS_LUA)

    def runner(id: str, r: int) -> None:
        if id == "single":
            run.wrk_run(id, r, sport_single, lua=lua, cpu=[s_single.pid], redis_ports=[single])
        else:
            run.wrk_run(id, r, sport_cluster, lua=lua, cpu=[s_cluster.pid], redis_ports=master_ports)

    run.label.update({"single": "one Redis", "cluster": "Redis Cluster, 3 masters + 3 replicas"})
    run.run_rounds("cluster", runner, ["single", "cluster"])
    errors = (f"one Redis: {store_errors(admin_single, s_single.log)}; "
              f"cluster: {store_errors(admin_cluster, s_cluster.log)}")
    procs.stop(s_single.proc)
    procs.stop(s_cluster.proc)

    # --- the Redis-side ceiling on 1, 2, 3 masters ---
    script = lua_script(common.ROOT, "quota.lua", "allocator.lua", "fused_run.lua")
    tags = []
    for m in master_ports:
        sha = load_script(m, script)
        for k in range(500):
            if master_of_slot(int(rcli(m, "CLUSTER", "KEYSLOT", f"{{rb-{k}}}")), masters) == m:
                break
        else:
            raise Failure(f"no hash tag rb-N found on master {m}")
        tags.append(f"rb-{k}")
        populate_pool(m, f"sluice:{{rb-{k}}}:pool", 10)
    rate: dict = {}  # (k, round, master index | "total") -> calls/s
    usec: dict = {}  # (k, round, master index) -> µs per call
    busy: dict = {}  # (k, round) -> % of the machine's CPU busy

    def scale_once(k: int, r: int) -> None:
        """K redis-benchmarks (one per master) for SCALE_SECONDS, counted by the masters."""
        benches = [procs.start(["redis-benchmark", "-p", str(master_ports[j]), "-n", "1000000000",
                                "-c", str(run.rb_clients), "-q", "evalsha", sha, "3",
                                f"sluice:{{{tags[j]}}}:qm:k", f"sluice:{{{tags[j]}}}:q:w:k",
                                f"sluice:{{{tags[j]}}}:pool", "", *BIG_WINDOW, "1", "1", "0"])
                   for j in range(k)]
        try:
            time.sleep(1)
            before = [script_stats(m) for m in master_ports]
            cpu0, t0 = machine_cpu(), now_ms()
            time.sleep(scale_seconds)
            cpu1, t1 = machine_cpu(), now_ms()
            after = [script_stats(m) for m in master_ports]
        finally:
            for p in benches:
                procs.stop(p)
        busy[k, r] = 100 * (cpu1["busy"] - cpu0["busy"]) / (cpu1["total"] - cpu0["total"])
        total = 0.0
        for j in range(3):
            d, du = after[j][0] - before[j][0], after[j][1] - before[j][1]
            rate[k, r, j] = d * 1000 / (t1 - t0)
            usec[k, r, j] = du / d if d > 0 else None
            total += rate[k, r, j]
        rate[k, r, "total"] = total
        run.log(f"scaling round {r}, {k} master(s): {total:.0f} calls/s "
                f"({' '.join(f'{rate[k, r, j]:.0f}' for j in range(3))})")

    scale_orders = ""
    for r in range(1, run.rounds + 1):
        order = stats.order_of(r, ["1", "2", "3"])
        scale_orders += f"round {r}: {' '.join(order)}; "
        for k in order:
            scale_once(int(k), r)

    rounds = range(1, run.rounds + 1)

    def med_rate(k, j):
        return stats.median(rate[k, r, j] for r in rounds)

    one = med_rate(1, "total")
    single_rate = stats.median(run.call_rate.get(("single", r, single)) for r in rounds)
    per_master_rates = "".join(
        f"master {j} (:{m}): {stats.fmt(stats.median(run.call_rate.get(('cluster', r, m)) for r in rounds))}; "
        for j, m in enumerate(master_ports))
    ranges = " ".join(f"{i}:{' '.join(rr)}" for i, (_, rr) in enumerate(masters))
    out = [
        "### Redis Cluster",
        "",
        run.header(),
        "",
        "```sh",
        run.command("cluster", "ROUTES_PER_MASTER", "SCALE_SECONDS"),
        "```",
        "",
        "**Cluster:** 6 `redis-server --cluster-enabled yes --cluster-config-file nodes.conf --cluster-node-timeout 1000",
        "--repl-diskless-sync-delay 0 --save '' --appendonly no`, each in its own directory, then `redis-cli --cluster create",
        "... --cluster-replicas 1 --cluster-yes` and a wait for `cluster_state:ok` on every node: 3 masters",
        f"({ranges}; slots by master index), 3 replicas.",
        "",
        f"**wrk through sluice, one Redis against the cluster.** Two sluice processes (`threads: {run.sluice_threads}`, `RUST_LOG=warn`),",
        f"the same {len(names)} routes, each quota (`{{ name: w, limit: 1000000000000, window: 1h }}`) + least_used over the two nginx",
        "backends (one fused script call for the requests of a route that wait together); one on a plain redis-server (`state.redis.url`), one with",
        f"`state.redis.cluster: [the 6 nodes]`. Route placement (`CLUSTER KEYSLOT`, `CLUSTER NODES`): {placement}",
        f"wrk rotates the Host header over the routes with a Lua script (`{run.wrk_cmd['cluster']}`); {run.warmup} warm-up; "
        f"{run.rounds} rounds.",
        "",
        *run.wrk_table(["single", "cluster"]),
        "",
        f"- cluster / one Redis, req/s: {run.ratio('rps', 'cluster', 'single')}; p99: {run.ratio('p99', 'cluster', 'single')}",
        f"- script calls/s (FCALL, EVALSHA) during the cluster runs (median over rounds), per master: {per_master_rates}",
        f"  one Redis: {stats.fmt(single_rate)}.",
        f"- errors reported by wrk: {run.wrk_errors(['single', 'cluster'])}; sluice store errors and fallbacks: {errors}.",
        f"- order: {run.orders['cluster']}",
        "",
        f"Reading: the cluster served {stats.fmt(run.ratio_num('rps', 'cluster', 'single'), '.2f')}× the one-Redis req/s. "
        "Redis is not what limits this test:",
        f"one Redis answered {stats.fmt(single_rate)} script calls/s during it, while one master alone reached "
        f"{stats.fmt(one)} under redis-benchmark",
        f"(below); the single sluice thread is the limit, and the cluster adds work on the same {common.nproc()} cores "
        "(three replicas applying",
        "every script's writes, six Redis processes instead of one, and the cluster client in sluice: see sluice CPU µs/req).",
        "",
        '**Redis-side ceiling on 1, 2, 3 masters.** The fused script (`lua/quota.lua` + "\\n" + `lua/allocator.lua` + "\\n" +',
        f"`lua/fused_run.lua`, `SCRIPT LOAD` on each master) driven by one `redis-benchmark -p MASTER -c {run.rb_clients} -q evalsha SHA 3",
        'sluice:{T}:qm:k sluice:{T}:q:w:k sluice:{T}:pool "" w 1000000000000 3600000000 1 1 0` per master in use, all at once, where',
        f"the tag T of each lives on that master (tags: {' '.join(tags)}) and each pool holds 10 members. After 1 s, the masters'",
        f"`cmdstat_evalsha` calls are read, and again {scale_seconds} s later: calls/s = delta / elapsed time. "
        f"{run.rounds} rounds (order: {scale_orders}).",
        "",
        "| masters in use | total calls/s (median) | total per round | master 0 calls/s | master 1 calls/s | master 2 calls/s "
        "| µs per call in Redis (masters in use) | machine CPU busy | vs 1 master |",
        "|---:|---:|---|---:|---:|---:|---|---:|---:|",
    ]
    for k in (1, 2, 3):
        tot = med_rate(k, "total")
        cols = " | ".join(stats.fmt(med_rate(k, j)) for j in range(3))
        us = " ".join(stats.fmt(stats.median(usec[k, r, j] for r in rounds), ".2f") for j in range(k))
        totals = ", ".join(f"{rate[k, r, 'total']:.0f}" for r in rounds)
        out.append(f"| {k} | {stats.fmt(tot)} | {totals} | {cols} "
                   f"| {us} | {stats.fmt(stats.median(busy[k, r] for r in rounds))}% | {tot / one:.2f}× |")
    b1, b2, b3 = (stats.fmt(stats.median(busy[k, r] for r in rounds)) for k in (1, 2, 3))
    cores = common.nproc()
    out += [
        "",
        f"Reading: 2 masters served {med_rate(2, 'total') / one:.2f}× and 3 masters {med_rate(3, 'total') / one:.2f}× "
        "the script calls per second of 1 master,",
        f"with the machine's CPU busy {b1}% / {b2}% / {b3}% (1 / 2 / 3 masters, from `/proc/stat`).",
        f"On this {cores}-core machine every master, replica (each replays its master's writes) and redis-benchmark "
        f"shares the same {cores} cores, so the",
        "measured scaling is bounded by the machine (each master is one single-threaded process, and each needs a client",
        "process to drive it): with more masters than free cores, the total cannot keep growing. On separate machines (or",
        "cores) each master adds its own ceiling, since every route's script touches only its own master.",
    ]
    return "\n".join(out)
