# sluice image: the gateway and the demo upstream (sluice-echo) in one small runtime image.
#
#   docker build -t sluice .                 (--build-arg PGO=0: a plain release build, faster)
#   docker run --rm -v "$PWD/configs:/etc/sluice:ro" -p 8080:8080 sluice run -c /etc/sluice/demo.yaml
#
# The default command runs /etc/sluice/sluice.yaml: mount a directory holding it (not the single
# file, so that an editor's save-by-rename reaches the container and hot reload sees it).

# --- build ----------------------------------------------------------------------------------
FROM rust:1-bookworm AS builder
# PGO=1 (the default): a profile-guided build, scripts/build-pgo. It builds twice and trains the
# first build on loopback traffic in between: about twice as long as a plain build, for a
# fifth fewer instructions per request (docs/benchmarks.md). PGO=0: one plain release build.
ARG PGO=1
# cmake: pingora builds zlib-ng with it. The training (PGO=1) runs wrk against the gateway,
# with nginx as its members and a redis-server for the shared-state routes, all on loopback.
RUN apt-get update \
 && apt-get install -y --no-install-recommends cmake \
 && if [ "$PGO" = 1 ]; then \
      apt-get install -y --no-install-recommends python3 wrk nginx-light redis-server \
      && rustup component add llvm-tools; \
    fi \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# The whole workspace: every crate, the Lua scripts and configs/default.yaml are compiled in,
# and cargo reads the test and bench targets the manifests declare. .dockerignore keeps
# target/ and .git/ out of the context.
COPY . .
RUN if [ "$PGO" = 1 ]; then \
      scripts/build-pgo --out /out; \
    else \
      cargo build --release --locked --bins \
      && install -D -m 0755 target/release/sluice target/release/sluice-echo -t /out/; \
    fi

# --- runtime --------------------------------------------------------------------------------
FROM debian:bookworm-slim
# ca-certificates: https members are verified against the system roots.
# curl: the HEALTHCHECK below and the demo client. jq: the demo client.
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates curl jq \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 sluice \
 && useradd --system --uid 10001 --gid sluice --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin sluice \
 && mkdir -p /etc/sluice
COPY --from=builder /out/sluice /out/sluice-echo /usr/local/bin/
COPY configs/demo.yaml /etc/sluice/sluice.yaml
USER sluice
# 8080: proxy listener, 9901: admin API (as in configs/demo.yaml).
EXPOSE 8080 9901
# The admin API answers /healthz once the gateway runs. Containers that reuse this image for
# something else (sluice-echo, the demo client) disable or replace this check.
HEALTHCHECK --interval=5s --timeout=3s --start-period=10s --retries=3 \
  CMD curl -fsS --max-time 2 http://127.0.0.1:9901/healthz >/dev/null || exit 1
ENTRYPOINT ["sluice"]
CMD ["run", "-c", "/etc/sluice/sluice.yaml"]
