"""sluice's benchmark drivers: scripts/bench, scripts/bench-state, scripts/bench-tunnel,
scripts/bench-idle-memory and scripts/profile.

Those five entry points are thin wrappers around ``python3 -m sluicebench COMMAND`` (run with
``scripts/`` on ``sys.path``). Layout:

    procs.py      process lifecycle: one work directory, every child registered and stopped by
                  PID on exit (Ctrl-C and SIGTERM included), free ports, waiting for listeners,
                  CPU time from /proc
    stats.py      medians, per-round ratios, the order of targets in a round, number formatting
    wrk.py        running wrk and parsing its output
    doc.py        rewriting a marked section of docs/benchmark-runs.md
    common.py     knobs (environment variables), required tools, locating or building binaries
    servers.py    the nginx backends, sluice and redis-server, as every benchmark starts them
    bench.py      scripts/bench: wrk against direct, nginx, HAProxy and sluice
    latency.py    scripts/bench-latency: oha at fixed rates (open-loop): the latency sluice adds
    state.py      scripts/bench-state: the command and its doc section; quota.py,
                  least_used.py, key_pool.py, usage.py, reload.py, cluster.py and
                  lease_wake.py are its parts
    staterun.py   what bench-state's parts share (settings, processes, backends, results)
    tunnel.py     scripts/bench-tunnel: CONNECT tunnels through sluice, tinyproxy and squid
                  (throughput, setup rate); also the sink and clients it runs as children
    idle_memory.py  scripts/bench-idle-memory: sluice's RSS around 5,000 idle connections
    profile.py    scripts/profile: callgrind instruction counts per request

Why Python and not a Rust xtask: these drivers start external programs (nginx, HAProxy, wrk,
redis-server, valgrind), parse their text output and write Markdown; that is what a scripting
language with subprocess and re in its standard library does in the fewest lines. An xtask
would have to be compiled before it could run, on a 2-core machine where a release build of
the workspace already takes minutes, and would pull crates in for what the standard library of
Python does here. Python 3.11, standard library only, so nothing needs installing beyond the
tools being measured.
"""
