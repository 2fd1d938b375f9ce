//! `sluice demo`: the embedded default config with its upstreams, all in this process (three
//! echo servers, a key-limited API stub and a TLS origin), and a client ([`client`]) that sends
//! traffic to every route of the config, so each policy visibly works with nothing else
//! installed: round-robin, least-used, a quota refusing, a pool of API keys where one key cools
//! down after a 429 and comes back, an `https://` request through a CONNECT tunnel
//! ([`tunnel`]), and a named client refused a route.

mod client;
mod tunnel;

use std::net::SocketAddr;
use std::time::Duration;

use sluice_echo::{EchoOptions, EchoServer};

/// Demo upstream names and addresses; they match `configs/default.yaml`.
pub const UPSTREAMS: [(&str, &str); 3] = [
    ("demo-1", "127.0.0.1:9001"),
    ("demo-2", "127.0.0.1:9002"),
    ("demo-3", "127.0.0.1:9003"),
];

/// The API stub behind the `keys` route, as `configs/default.yaml` names it.
pub const API: (&str, &str) = ("api", "127.0.0.1:9004");

/// The admin listener of `configs/default.yaml`: the demo client reads `/status` there to see
/// what the gateway decided (a key cooling, and when it comes back).
pub const ADMIN: &str = "127.0.0.1:9901";

/// Starts the demo upstreams and the demo client on a thread of their own.
pub fn start(gateway: SocketAddr) {
    std::thread::Builder::new()
        .name("sluice-demo".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    tracing::error!(target: "sluice::demo", error = %e, "cannot start the demo");
                    return;
                }
            };
            rt.block_on(async move {
                for (name, addr) in UPSTREAMS {
                    if let Err(e) = EchoServer::start(name, parse(addr)).await {
                        tracing::error!(target: "sluice::demo", upstream = name, %addr, error = %e, "cannot start demo upstream");
                    }
                }
                // The stub limits each key far above what the demo sends: the one 429 the
                // demo shows is scripted (see `client`), so it comes when the demo says.
                let api = match EchoServer::start_with(
                    API.0,
                    parse(API.1),
                    EchoOptions {
                        key_limit: Some((100, Duration::from_secs(10))),
                        ratelimit_headers: true,
                        log_requests: false,
                    },
                )
                .await
                {
                    Ok(api) => Some(api),
                    Err(e) => {
                        tracing::error!(target: "sluice::demo", upstream = API.0, addr = API.1, error = %e, "cannot start the demo API stub");
                        None
                    }
                };
                let tls = match tunnel::Tls::new() {
                    Ok(tls) => match tls.serve_origin().await {
                        Ok(()) => Some(tls),
                        Err(e) => {
                            tracing::error!(target: "sluice::demo", error = %e, "cannot start the demo TLS origin");
                            None
                        }
                    },
                    Err(e) => {
                        tracing::error!(target: "sluice::demo", error = %e, "cannot start the demo TLS origin");
                        None
                    }
                };
                // The gateway's listeners open on other threads: the first request waits for
                // them rather than for a guessed delay, which a loaded machine can outlast
                // (the demo's first answers were then "connection refused").
                for addr in [gateway, parse(ADMIN)] {
                    if !listening(addr).await {
                        tracing::warn!(target: "sluice::demo", %addr, "the gateway is not listening yet; the demo client starts anyway");
                    }
                }
                client::run(gateway, parse(ADMIN), api, tls).await;
            });
        })
        .expect("spawn the demo thread");
}

/// Whether `addr` accepts a connection within [`LISTEN_WAIT`], tried every few milliseconds.
async fn listening(addr: SocketAddr) -> bool {
    let deadline = tokio::time::Instant::now() + LISTEN_WAIT;
    loop {
        if tokio::net::TcpStream::connect(addr).await.is_ok() {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// How long the demo client waits for the gateway's listeners before its first request.
const LISTEN_WAIT: Duration = Duration::from_secs(30);

/// The constants above are valid addresses.
fn parse(addr: &str) -> SocketAddr {
    addr.parse().expect("a valid demo address")
}
