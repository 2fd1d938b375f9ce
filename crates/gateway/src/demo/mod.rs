//! `sluice demo`: the embedded default config with its three demo upstreams and a client that
//! sends a request every half second, so traffic visibly flows with nothing else installed;
//! and, every few seconds, one `https://` request through a CONNECT tunnel to the demo's own
//! TLS origin ([`tunnel`]).

mod tunnel;

use std::net::SocketAddr;
use std::time::Duration;

use sluice_echo::EchoServer;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Demo upstream names and addresses; they match `configs/default.yaml`.
pub const UPSTREAMS: [(&str, &str); 3] = [
    ("demo-1", "127.0.0.1:9001"),
    ("demo-2", "127.0.0.1:9002"),
    ("demo-3", "127.0.0.1:9003"),
];

/// Starts the demo upstreams and the demo client on a thread of their own.
pub fn start(gateway: SocketAddr) {
    std::thread::Builder::new()
        .name("sluice-demo".into())
        .spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a tokio runtime");
            rt.block_on(async move {
                let mut servers = Vec::new();
                for (name, addr) in UPSTREAMS {
                    match EchoServer::start(name, addr.parse().expect("valid address")).await {
                        Ok(s) => servers.push(s),
                        Err(e) => {
                            tracing::error!(target: "sluice::demo", upstream = name, %addr, error = %e, "cannot start demo upstream");
                        }
                    }
                }
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
                // Let the gateway come up before the first request.
                tokio::time::sleep(Duration::from_millis(500)).await;
                let mut n: u64 = 0;
                loop {
                    n += 1;
                    if let Some(tls) = tls.as_ref().filter(|_| n % 10 == 1) {
                        match tls.get(gateway).await {
                            Ok(status) => tracing::info!(
                                target: "sluice::demo",
                                request = n, status,
                                "demo client: GET https://{}:9443/ through a CONNECT tunnel, TLS end to end",
                                tunnel::HOST
                            ),
                            Err(e) => tracing::warn!(target: "sluice::demo", request = n, error = %e, "demo client: https through a tunnel"),
                        }
                    }
                    match get(gateway, n).await {
                        Ok((status, upstream)) => tracing::info!(
                            target: "sluice::demo",
                            request = n, status, upstream = %upstream,
                            "demo client: GET http://demo.local/hello"
                        ),
                        Err(e) => tracing::warn!(target: "sluice::demo", request = n, error = %e, "demo client"),
                    }
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            });
        })
        .expect("spawn the demo thread");
}

/// One request through the gateway; returns the status and the `x-upstream` that answered.
async fn get(gateway: SocketAddr, n: u64) -> std::io::Result<(u16, String)> {
    let mut conn = tokio::time::timeout(
        Duration::from_secs(2),
        tokio::net::TcpStream::connect(gateway),
    )
    .await
    .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out"))??;
    let req = format!(
        "GET http://demo.local/hello?n={n} HTTP/1.1\r\nHost: demo.local\r\nConnection: close\r\n\r\n"
    );
    conn.write_all(req.as_bytes()).await?;
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), conn.read_to_end(&mut buf))
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "response timed out"))??;
    let text = String::from_utf8_lossy(&buf);
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let upstream = text
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("x-upstream")
                .then(|| v.trim().to_string())
        })
        .unwrap_or_else(|| "-".into());
    Ok((status, upstream))
}
