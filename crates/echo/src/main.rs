//! `sluice-echo`: runs one echo server from the command line.
//!
//! ```text
//! sluice-echo --name blue --listen 127.0.0.1:9001
//! sluice-echo --name api --listen 127.0.0.1:9004 --key-limit 5/10s
//! ```
//!
//! `--key-limit` makes it a key-limited API stub (see the library docs): at
//! most LIMIT requests per `Authorization` value in any WINDOW, 429 with
//! Retry-After past that, and its own RateLimit fields on every answer.
//!
//! The first SIGINT or SIGTERM stops the server the way
//! [`EchoServer::stop`] does and leaves a short grace period for open
//! keep-alive connections to receive their final `Connection: close`
//! answer; a second signal exits at once.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use sluice_echo::{EchoOptions, EchoServer};

const USAGE: &str = "usage: sluice-echo --name NAME [--listen ADDR] [--key-limit LIMIT/WINDOW]

  --name NAME         name reported in the x-upstream header and JSON body
  --listen ADDR       socket address to listen on (default 127.0.0.1:9001)
  --key-limit L/W     act as an API that limits each key (its Authorization value) to L
                      requests in any window W (ms, s, m or h: 5/10s, 100/1m): past it,
                      429 with Retry-After; RateLimit-Policy and RateLimit on every answer.
                      Any request with an x-force-429: VALUE header gets 429 with
                      Retry-After: VALUE, with or without --key-limit.";

const DEFAULT_LISTEN: &str = "127.0.0.1:9001";

/// How long to keep serving open connections after a stop signal.
const DRAIN_GRACE: Duration = Duration::from_secs(2);

/// Validated command line options.
struct Options {
    name: String,
    listen: SocketAddr,
    key_limit: Option<(u64, Duration)>,
}

/// Parses the arguments after the program name. `Ok(None)` means help was requested.
fn parse_args(mut args: impl Iterator<Item = String>) -> Result<Option<Options>, String> {
    let mut name = None;
    let mut listen = None;
    let mut key_limit = None;
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "-h" | "--help" => return Ok(None),
            "--name" => {
                name = Some(args.next().ok_or("--name needs a value")?);
            }
            "--listen" => {
                let value = args.next().ok_or("--listen needs a value")?;
                let addr = value
                    .parse()
                    .map_err(|_| format!("--listen: not a socket address: {value}"))?;
                listen = Some(addr);
            }
            "--key-limit" => {
                let value = args.next().ok_or("--key-limit needs a value")?;
                let limit = EchoOptions::parse_key_limit(&value)
                    .map_err(|reason| format!("--key-limit: {reason}"))?;
                key_limit = Some(limit);
            }
            other => return Err(format!("unexpected argument: {other}")),
        }
    }
    Ok(Some(Options {
        name: name.ok_or("--name is required")?,
        listen: listen.unwrap_or_else(|| DEFAULT_LISTEN.parse().expect("valid default")),
        key_limit,
    }))
}

#[tokio::main]
async fn main() -> ExitCode {
    let options = match parse_args(std::env::args().skip(1)) {
        Ok(Some(options)) => options,
        Ok(None) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(message) => {
            eprintln!("sluice-echo: {message}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };

    // No request log: a long-running process would only grow it.
    let echo_options = EchoOptions {
        key_limit: options.key_limit,
        ratelimit_headers: options.key_limit.is_some(),
        log_requests: false,
    };
    let server = match EchoServer::start_with(&options.name, options.listen, echo_options).await {
        Ok(server) => server,
        Err(err) => {
            eprintln!("sluice-echo: cannot listen on {}: {err}", options.listen);
            return ExitCode::FAILURE;
        }
    };
    // Scripts wait for this line to know the port is open.
    println!(
        "sluice-echo {} listening on {}",
        server.name(),
        server.local_addr()
    );

    stop_signal().await;
    server.stop().await;
    eprintln!(
        "sluice-echo {}: stopped accepting, draining for {:?}",
        server.name(),
        DRAIN_GRACE
    );
    tokio::select! {
        _ = tokio::time::sleep(DRAIN_GRACE) => {}
        _ = stop_signal() => {}
    }
    ExitCode::SUCCESS
}

/// Resolves on SIGINT or (on Unix) SIGTERM.
async fn stop_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut terminate) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = terminate.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Option<Options>, String> {
        parse_args(args.iter().map(|s| s.to_string()))
    }

    #[test]
    fn parses_name_and_listen() {
        let options = parse(&["--name", "blue", "--listen", "127.0.0.1:9100"])
            .unwrap()
            .unwrap();
        assert_eq!(options.name, "blue");
        assert_eq!(options.listen, "127.0.0.1:9100".parse().unwrap());
        assert_eq!(options.key_limit, None);
    }

    #[test]
    fn parses_a_key_limit() {
        let options = parse(&["--name", "api", "--key-limit", "5/10s"])
            .unwrap()
            .unwrap();
        assert_eq!(options.key_limit, Some((5, Duration::from_secs(10))));
        assert!(parse(&["--name", "api", "--key-limit"]).is_err());
        assert!(parse(&["--name", "api", "--key-limit", "5"]).is_err());
        assert!(parse(&["--name", "api", "--key-limit", "0/1s"]).is_err());
    }

    #[test]
    fn listen_has_a_default() {
        let options = parse(&["--name", "blue"]).unwrap().unwrap();
        assert_eq!(options.listen, DEFAULT_LISTEN.parse().unwrap());
    }

    #[test]
    fn rejects_bad_input() {
        assert!(parse(&[]).is_err());
        assert!(parse(&["--name"]).is_err());
        assert!(parse(&["--name", "x", "--listen", "nowhere"]).is_err());
        assert!(parse(&["--name", "x", "--bogus"]).is_err());
        assert!(parse(&["--help"]).unwrap().is_none());
    }
}
