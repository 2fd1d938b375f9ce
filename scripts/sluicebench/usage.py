"""bench-state usage: what a window in tokens costs next to the same window counted in requests."""

from __future__ import annotations

from . import stats
from .servers import http_get, rcli, start_nginx, start_redis, start_sluice, store_errors, wait_ok
from .staterun import Run, when

# What the backend answers: a chat completion's usage, as a provider reports it.
ANSWER = '{"id":"c","object":"chat.completion","usage":{"prompt_tokens":5,"completion_tokens":7,"total_tokens":12}}'
# What wrk sends: a JSON body whose max_tokens is the reservation.
BODY = '{"model":"m","max_tokens":16,"messages":[{"role":"user","content":"hi"}]}'
# The largest limit a window in a unit takes (`check`): no run fills it.
TOKEN_LIMIT = 9000000000


def wrk_script(host: str) -> str:
    return (f'wrk.method = "POST"\nwrk.body = \'{BODY}\'\n'
            f'wrk.headers["Content-Type"] = "application/json"\nwrk.headers["Host"] = "{host}"\n')


def run(run: Run) -> str:
    procs = run.procs
    bport = procs.free_port()
    start_nginx(procs, "usage-backend", bport, f"""  access_log off;
  server {{
    listen 127.0.0.1:{bport} backlog=4096;
    location / {{
      default_type application/json;
      return 200 '{ANSWER}';
    }}
  }}""")
    rport = procs.free_port()
    start_redis(procs, "redis-usage", rport)
    port, admin = procs.free_port(), procs.free_port()
    cfg = run.work / "conf-usage" / "sluice.yaml"
    cfg.parent.mkdir(parents=True)
    member = f'      members:\n        - url: "http://127.0.0.1:{bport}"\n'
    cfg.write_text(f"""listen: ["127.0.0.1:{port}"]
threads: {run.sluice_threads}
admin:
  listen: "127.0.0.1:{admin}"
state:
  backend: redis
  redis:
    url: "redis://127.0.0.1:{rport}/0"
routes:
  - name: req
    match: {{ hosts: ["req.bench"] }}
    upstream:
{member}    quota:
      windows:
        - {{ name: w, limit: 1000000000000, window: 1h }}
  - name: tok
    match: {{ hosts: ["tok.bench"] }}
    upstream:
{member}    quota:
      windows:
        - {{ name: w, limit: {TOKEN_LIMIT}, window: 1h, unit: tokens }}
      usage:
        tokens:
          reserve: {{ json: "max_tokens", default: 4096 }}
          settle: {{ json: "usage.total_tokens" }}
""")
    s = start_sluice(procs, run.sluice, "usage", cfg, port, admin, "warn")
    for h in ("req", "tok"):
        wait_ok(f"http://127.0.0.1:{port}/", f"{h}.bench", f"route {h}")
    scripts = {}
    for h in ("req", "tok"):
        scripts[h] = run.work / f"usage-{h}.lua"
        scripts[h].write_text(wrk_script(f"{h}.bench"))

    run.label.update({"req": "window in requests", "tok": "window in tokens (reserve + settle)"})
    run.run_rounds("usage", lambda id, r: run.wrk_run(id, r, port, lua=scripts[id], cpu=[s.pid],
                                                      redis_ports=[rport]),
                   ["req", "tok"])
    errors = store_errors(admin, s.log)
    # Requests whose client left before the answer (wrk stops mid-request) keep their
    # reservation of 16 tokens; every other settles the answer's 12.
    _, metrics = http_get(f"http://127.0.0.1:{admin}/metrics")
    unanswered = sum(int(float(line.split()[-1])) for line in metrics.splitlines()
                     if line.startswith("sluice_usage_unsettled_total") and 'route="tok"' in line)
    procs.stop(s.proc)

    # Redis memory per admitted request: every key of each route over its log's entries.
    mem = []
    for h in ("req", "tok"):
        keys = rcli(rport, "--scan", "--pattern", f"sluice:{{{h}}}:*").split()
        total = sum(int(rcli(rport, "MEMORY", "USAGE", k, "SAMPLES", "0")) for k in keys)
        log = f"sluice:{{{h}}}:q:w:route"
        n = int(rcli(rport, "ZCARD", log))
        held = rcli(rport, "HGET", f"sluice:{{{h}}}:qm:route", "s:w").strip()
        opened = rcli(rport, "HGET", f"sluice:{{{h}}}:qm:route", "r:w").strip()
        # Requests: a tokens window keeps an entry per reservation; a window of requests (cost 1)
        # holds one unit a request, and the requests one call admits share one entry.
        requests = n if h == "tok" else int(held or 0)
        mem.append((h, requests, total, len(keys), held, opened))
        run.log(f"memory {h}: {n} entries, {total} bytes over {len(keys)} keys; total {held}, open {opened}")

    ratio = run.ratio_num("rps", "tok", "req")
    out = [
        "### Usage-metered windows (one Redis)",
        "",
        run.header(),
        "",
        "```sh",
        run.command("usage"),
        "```",
        "",
        f"**wrk through sluice.** One sluice (`threads: {run.sluice_threads}`, `RUST_LOG=warn`, `state.backend: redis`",
        "on one local redis-server), one nginx backend answering a chat completion with `usage.total_tokens: 12`.",
        "Two routes over it: `req`, a window of 10^12 requests an hour; `tok`, a window of 9×10^9 tokens an hour",
        "reserving the request's `max_tokens` (16) and settling `usage.total_tokens` from the JSON answer.",
        f"wrk POSTs `{BODY}`; {run.rounds} rounds, order rotated. Script calls per request count admission",
        "and settlement calls (settlements that come due together share one).",
        "",
        *run.wrk_table(["req", "tok"]),
        "",
        *run.budget_table(["req", "tok"]),
        "",
        f"- tokens / requests, req/s: {run.ratio('rps', 'tok', 'req')}; p99: {run.ratio('p99', 'tok', 'req')}",
        f"- errors reported by wrk: {run.wrk_errors(['req', 'tok'])}; sluice store errors and fallbacks: {errors}.",
        f"- order: {run.orders['usage']}",
        "",
        f"Reading: a window in tokens runs at {stats.fmt(ratio, '.2f')}× the rate of the same window in requests"
        + when(ratio, lambda x: x >= 0.8, ", within the 0.8× target.", ", BELOW the 0.8× target."),
        "",
        "**Redis memory per admitted request.** After the rounds, `MEMORY USAGE k SAMPLES 0` summed over every key",
        "of the route (`SCAN` for `sluice:{ROUTE}:*`), over its requests (`req`: what its window holds, `s:w`; `tok`: its log's entries, one a reservation, `ZCARD`); and what the",
        "window holds (`s:w`, millionths for tokens) and its open reservations (`r:w`), which must be 0 once every",
        "answer has settled. Target: at most 150 bytes per request.",
        "",
        "| route | requests | bytes (all keys) | keys | bytes per request | total held | open |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *[f"| {h} | {n} | {total} | {k} | {total / n:.1f} | {held} | {opened} |" if n else
          f"| {h} | 0 | {total} | {k} | - | {held} | {opened} |" for h, n, total, k, held, opened in mem],
    ]
    per = [total / n for _, n, total, _, _, _ in mem if n]
    if per:
        worst = max(per)
        out += ["", f"Reading: at most {worst:.1f} bytes of Redis per admitted request"
                + when(worst, lambda x: x <= 150, ", within the 150-byte target.", ", OVER the 150-byte target.")]
    tok = next(m for m in mem if m[0] == "tok")
    # A reservation still open (its admission call timed out in sluice after Redis made it, so
    # nothing settles it) holds its 16 tokens too.
    opened = int(tok[5] or 0) // 16_000_000
    kept = unanswered + opened
    want = (tok[1] - kept) * 12_000_000 + kept * 16_000_000
    exact = tok[4] == str(want)
    out += ["", f"Exactness: the tokens window holds {tok[4]} millionths over {tok[1]} entries, of which "
            f"{unanswered} lost their client before the answer (`sluice_usage_unsettled_total`) and {opened} "
            "are reservations left open by a store call that timed out"
            + (": 12 tokens for each answer, the 16 reserved for each of the others, exactly."
               if exact else f": NOT the {want} expected; look again.")]
    return "\n".join(out)
