"""bench-state reload: how long a hot reload takes, and what a reload storm does to requests."""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

from . import common, stats
from .procs import Failure, now_ms
from .servers import Backends, http_get, start_sluice, wait_ok
from .staterun import Run, when


def gen_routes_config(file: Path, n: int, variant: str, port: int, admin: int, threads: int,
                      backends: Backends) -> None:
    """N routes, each its own host and two members; route 0 goes to the nginx backends (the
    one wrk loads), the others to ports nothing listens on (no health checks, so nothing
    connects to them); every 10th route has a quota. Variant b changes one route: the second
    member of the middle route."""
    out = [f'listen: ["127.0.0.1:{port}"]', f"threads: {threads}", "admin:", f'  listen: "127.0.0.1:{admin}"',
           "state:", "  backend: memory", "routes:"]
    changed = n // 2
    for i in range(n):
        p1, p2 = (backends.ports[0], backends.ports[1]) if i == 0 else (10000 + (2 * i) % 50000, 10001 + (2 * i) % 50000)
        if i == changed and variant == "b":
            p2 = 65000
        out += [f"  - name: r{i}", "    match:", f'      hosts: ["r{i}.bench"]', "    upstream:", "      members:",
                f'        - url: "http://127.0.0.1:{p1}"', f'        - url: "http://127.0.0.1:{p2}"']
        if i % 10 == 5:
            out += ["    quota:", "      windows:", "        - { name: m, limit: 1000, window: 1m }",
                    "        - { name: h, limit: 10000, window: 1h }"]
    file.write_text("\n".join(out) + "\n")


def swap_config(src: Path, dst: Path) -> None:
    """Replaces DST by a copy of SRC with a rename (atomic, like an editor's save)."""
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.copyfile(src, tmp)
    tmp.replace(dst)


def reload_lines(log: Path) -> list[tuple[str, float]]:
    """(trigger, duration_ms) of every "config reloaded" line of sluice's JSON log."""
    out = []
    if not log.exists():
        return out
    for line in log.read_text(errors="replace").splitlines():
        if "config reloaded" not in line:
            continue
        trigger = re.search(r'"trigger":"([a-z]*)"', line)
        duration = re.search(r'"duration_ms":([0-9.e+-]+)', line)
        if trigger and duration:
            out.append((trigger.group(1), float(duration.group(1))))
    return out


def one_decimal(values) -> str:
    return ", ".join(f"{v:.1f}" for v in values)


def run(run: Run) -> str:
    procs, b = run.procs, run.backends
    reloads = run.knobs.int("RELOADS", 5, minimum=1)
    sizes = [int(s) for s in run.knobs.str("RELOAD_SIZES", "100 1000 10000").split()]
    storm_routes = run.knobs.int("STORM_ROUTES", 1000, minimum=1)
    storm_interval = run.knobs.str("STORM_INTERVAL", "0.1")
    interval = float(storm_interval)
    if not sizes:
        raise Failure("RELOAD_SIZES is empty")
    rows, medians = [], {}
    for size in sizes:
        port, admin = procs.free_port(), procs.free_port()
        dir = run.work / f"conf-reload-{size}"
        dir.mkdir(parents=True)
        a, bb = dir / "a.yaml.src", dir / "b.yaml.src"
        gen_routes_config(a, size, "a", port, admin, run.sluice_threads, b)
        gen_routes_config(bb, size, "b", port, admin, run.sluice_threads, b)
        # sluice check alone (a new process: read, parse, validate; no table built), 3 times.
        checks = []
        for _ in range(3):
            t0 = now_ms()
            subprocess.run([str(run.sluice), "check", "-c", str(a)], check=True, capture_output=True, timeout=300)
            checks.append(now_ms() - t0)
        shutil.copyfile(a, dir / "sluice.yaml")
        t0 = now_ms()
        s = start_sluice(procs, run.sluice, f"reload-{size}", dir / "sluice.yaml", port, admin,
                         "warn,sluice::reload=info", timeout=120)
        startup = now_ms() - t0
        wait_ok(f"http://127.0.0.1:{port}/", "r0.bench", f"route r0 of the {size}-route config")
        rts, ok = [], 0
        for k in range(1, reloads + 1):
            swap_config(bb if k % 2 else a, dir / "sluice.yaml")
            # curl, as in earlier runs of this benchmark: its time_total is the round trip.
            body = run.work / "reload-body.txt"
            reply = procs.run(["curl", "-s", "-m", "60", "-o", str(body), "-w", "%{http_code} %{time_total}",
                               "-X", "POST", "-H", "X-Sluice-Admin: 1", f"http://127.0.0.1:{admin}/reload"], timeout=90, check=False).split()
            status, seconds = (reply + ["0", "0"])[:2]
            rts.append(float(seconds) * 1000)
            if status == "200":
                ok += 1
            else:
                run.log(f"reload {k} of {size} routes answered: {status} {body.read_text(errors='replace') if body.exists() else ''}")
            time.sleep(1)  # lets the file watcher's own (no-op: same version) reload of this change pass
        lines = reload_lines(s.log)
        admin_d = [d for t, d in lines if t == "admin"]
        others = sum(1 for t, _ in lines if t != "admin")
        run.log(f"{size} routes: startup {startup:.0f} ms; reload ms (log): {one_decimal(admin_d)}; "
                f"round trip ms: {one_decimal(rts)}")
        medians[size] = stats.median(admin_d)
        rows.append(f"| {size} | {stats.median(checks):.0f} | {startup:.0f} | {stats.fmt(medians[size], '.1f')} "
                    f"| {stats.fmt(max(admin_d, default=None), '.1f')} | {stats.median(rts):.1f} | {max(rts):.1f} "
                    f"| {one_decimal(admin_d)} | {ok}/{reloads} | {len(admin_d)} | {others} |")
        procs.stop(s.proc)

    # --- request p99 during a reload storm ---
    port, admin = procs.free_port(), procs.free_port()
    dir = run.work / "conf-storm"
    dir.mkdir(parents=True)
    a, bb = dir / "a.yaml.src", dir / "b.yaml.src"
    gen_routes_config(a, storm_routes, "a", port, admin, run.sluice_threads, b)
    gen_routes_config(bb, storm_routes, "b", port, admin, run.sluice_threads, b)
    shutil.copyfile(a, dir / "sluice.yaml")
    s = start_sluice(procs, run.sluice, "storm", dir / "sluice.yaml", port, admin,
                     "warn,sluice::reload=info", timeout=120)
    storm_reloads, storm_posts = {}, {}

    def storm(stop: threading.Event, posts: list[int]) -> None:
        """Renames config a or b over the file, POSTs /reload, sleeps; bounded to 120 s."""
        deadline = time.monotonic() + 120
        k = 0
        while not stop.is_set() and time.monotonic() < deadline:
            k += 1
            swap_config(bb if k % 2 else a, dir / "sluice.yaml")
            posts.append(http_get(f"http://127.0.0.1:{admin}/reload", timeout=5, method="POST",
                                  headers={"X-Sluice-Admin": "1"})[0])
            stop.wait(interval)

    def runner(id: str, r: int) -> None:
        if id == "none":
            run.wrk_run(id, r, port, host="r0.bench", cpu=[s.pid])
            return
        before = len(reload_lines(s.log))
        stop, posts = threading.Event(), []
        loop = threading.Thread(target=storm, args=(stop, posts), daemon=True)
        loop.start()
        try:
            run.wrk_run(id, r, port, host="r0.bench", cpu=[s.pid])
        finally:
            stop.set()
            loop.join(timeout=70)
        storm_reloads[r] = len(reload_lines(s.log)) - before
        storm_posts[r] = f"{posts.count(200)} of {len(posts)}"
        run.log(f"storm round {r}: {storm_reloads[r]} reloads (warm-up included), POST 200: {storm_posts[r]}")

    run.label.update({"none": "no reloads",
                      "storm": f"reload storm (POST /reload every {storm_interval}s, alternating two configs)"})
    run.run_rounds("reload", runner, ["none", "storm"])
    storm_durations = [d for t, d in reload_lines(s.log) if t == "admin"]
    procs.stop(s.proc)

    big = sizes[-1]
    sizes_txt = " / ".join(f"{stats.fmt(medians[sz], '.1f')} ms at {sz}" for sz in sizes)
    per_round = "".join(f"round {r}: {storm_reloads.get(r, '?')} reloads, POST 200 for {storm_posts.get(r, '?')}; "
                        for r in range(1, run.rounds + 1))
    errors = run.wrk_errors(["none", "storm"])
    out = [
        "### Hot reload",
        "",
        run.header(),
        "",
        "```sh",
        run.command("reload", "RELOADS", "RELOAD_SIZES", "STORM_ROUTES", "STORM_INTERVAL"),
        "```",
        "",
        "**Reload time against the number of routes.** Generated configs: route `rN` has host `rN.bench` and two members",
        "on 127.0.0.1 (route 0 on the nginx backends, the others on ports nothing listens on: no health checks, so nothing",
        f"connects), every 10th route a two-window quota; `state.backend: memory`, `threads: {run.sluice_threads}`,",
        '`RUST_LOG=warn,sluice::reload=info`. sluice starts with `sluice run -c sluice.yaml` ("startup": launch to both',
        "listeners accepting; `sluice check` ms: `sluice check -c` of the same file as a new process, the median of 3, i.e.",
        f"reading, parsing and validating without building anything). Then {reloads} times: rename config a or b "
        "(alternately; they differ in one member of the middle",
        'route) over `sluice.yaml`, `curl -X POST http://127.0.0.1:ADMIN/reload` at once, wait 1 s. "Reload ms" is',
        "`duration_ms` of sluice's `config reloaded` log line (trigger `admin`: read, parse, validate, build, swap); the round",
        "trip is curl's `time_total`. The file watcher also sees each rename; its reload, 150 ms later, finds the version",
        "unchanged and does nothing (lines with another trigger are counted in the last column). Target: < 200 ms at 10,000.",
        "",
        "| routes | `sluice check` ms | startup ms | reload ms (median) | reload ms (max) | POST round trip ms (median) "
        "| round trip ms (max) | reload ms, each | POST 200 | admin reload lines | other reload lines |",
        "|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
        *rows,
        "",
        f"Reading: a reload that changes one route takes {sizes_txt} routes (median): it rebuilds the whole table,",
        f"so it grows with the number of routes; at {big} routes it is"
        + when(medians[big], lambda x: x < 200, " within", " OVER") + " the 200 ms target.",
        "",
        f"**Requests during a reload storm.** A {storm_routes}-route config as above; wrk loads route `r0`",
        f"(`{run.wrk_cmd['none']}`) once with a loop renaming config a or b over the file and POSTing `/reload` then sleeping",
        f"{storm_interval} s, once without; {run.warmup} warm-up each (the storm runs through it too); {run.rounds} rounds, alternating order.",
        "",
        *run.wrk_table(["none", "storm"]),
        "",
        f"- storm / none, p99: {run.ratio('p99', 'storm', 'none')}; p50: {run.ratio('p50', 'storm', 'none')}; "
        f"req/s: {run.ratio('rps', 'storm', 'none')}",
        f"- reloads done during each storm (warm-up included): {per_round} reload ms during the storms: "
        f"median {stats.fmt(stats.median(storm_durations), '.1f')}, max {stats.fmt(max(storm_durations, default=None), '.1f')}",
        f"- errors reported by wrk: {errors}",
        f"- order: {run.orders['reload']}",
        "",
        f"Reading: during a reload every {storm_interval} s, route `r0`'s p99 was "
        f"{stats.fmt(run.ratio_num('p99', 'storm', 'none'), '.2f')}× and its req/s "
        f"{stats.fmt(run.ratio_num('rps', 'storm', 'none'), '.2f')}× those without",
        f"reloads, with {'no' if errors == 'none' else errors} errors: each reload's read, parse and build takes CPU "
        f"on the same {common.nproc()} cores.",
    ]
    return "\n".join(out)
