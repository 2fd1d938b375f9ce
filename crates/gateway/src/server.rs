//! Assembling and running the Pingora server: the proxy service, the admin API and the health
//! checks, plus a graceful stop that waits for exactly the requests in flight.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use async_trait::async_trait;
use pingora::apps::HttpServerOptions;
use pingora::server::configuration::{Opt, ServerConf};
use pingora::server::{RunArgs, Server, ShutdownSignal, ShutdownSignalWatch};
use pingora::services::background::background_service;
use pingora::services::listening::Service;
use tokio::signal::unix::{signal, SignalKind};

use crate::admin::AdminApi;
use crate::checks::{HealthChecks, HealthSupervisor};
use crate::config::{Config, ConfigErrors};
use crate::limits::LimitedApp;
use crate::metrics::Metrics;
use crate::reload::{ReloadTriggers, Reloader};
use crate::request::Gateway;
use crate::request::Tunnels;
use crate::table::Table;

/// The longest a graceful stop waits for requests in flight before it cuts them, unless
/// [`DRAIN_PERIOD_ENV`] says otherwise.
const DRAIN_LIMIT: Duration = Duration::from_secs(30);

/// The drain period instead of [`DRAIN_LIMIT`], as a duration (`500ms`, `10s`, `2m`): for
/// deployments whose orchestrator kills sooner or later than 30 s, and for tests.
pub const DRAIN_PERIOD_ENV: &str = "SLUICE_DRAIN_PERIOD";

/// The exit status of a graceful stop whose drain period ended with requests still in flight,
/// cut (SPEC §1); 0 when every request finished.
pub const EXIT_REQUESTS_CUT: i32 = 3;

/// The drain period: [`DRAIN_PERIOD_ENV`] when set, else [`DRAIN_LIMIT`].
fn drain_period() -> Result<Duration, String> {
    match std::env::var(DRAIN_PERIOD_ENV) {
        Ok(text) if !text.trim().is_empty() => {
            humantime::parse_duration(text.trim()).map_err(|e| {
                format!("{DRAIN_PERIOD_ENV}: {text:?} is not a duration such as 10s: {e}")
            })
        }
        _ => Ok(DRAIN_LIMIT),
    }
}

/// Where the config comes from.
pub enum ConfigSource<'a> {
    /// A file on disk.
    File(&'a Path),
    /// The embedded default.
    Embedded,
}

/// Loads and validates the config, the selection policies' own rules included.
pub fn load(source: &ConfigSource<'_>) -> Result<(Config, Vec<u8>), ConfigErrors> {
    match source {
        ConfigSource::File(path) => Config::load_with(path, &crate::select::RULES),
        ConfigSource::Embedded => {
            let text = crate::config::EMBEDDED_DEFAULT;
            Config::parse_with("<embedded default>", text, &crate::select::RULES)
                .map(|c| (c, text.as_bytes().to_vec()))
        }
    }
}

/// Runs the gateway in the foreground until SIGTERM or SIGINT, then drains and returns.
/// Must not be called from inside a tokio runtime: Pingora makes its own. An error means the
/// gateway could not start.
pub fn run(config: Config, bytes: Vec<u8>, source: Option<PathBuf>) -> Result<(), String> {
    // Before anything else starts: a port that is taken must stop the process at once.
    check_listeners(&config)?;
    let drain = drain_period()?;
    warn_if_proxy_open(&config);
    warn_if_admin_exposed(&config);
    let limits = crate::limits::prepare(&config.limits);
    crate::logging::set_log_query(config.log.query);
    if let Some(otlp) = &config.tracing.otlp {
        crate::otel::start(otlp)?;
    }
    let metrics = Arc::new(Metrics::new());
    let state = crate::state::open(&config)?;
    // The process's one resolver: member names (crate::dns) and client-chosen destinations
    // (crate::egress). Its cache outlives reloads. hickory spawns a lookup's background I/O on
    // the runtime that asks, so lookups happen on runtimes that live as long as the process.
    let resolver = crate::dns::process_resolver(&config.dns)?;
    // Build the first table (and resolve member names) on a runtime of its own, before Pingora
    // starts its own. It lives as long as the gateway: the resolver's connections to its name
    // servers run there, and later lookups from other runtimes reuse them.
    let boot = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("sluice-boot")
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let table = boot.block_on(Table::build(
        &config, &bytes, &metrics, &state, &resolver, None,
    ));
    let table = Arc::new(ArcSwap::from_pointee(table));
    let supervisor = Arc::new(HealthSupervisor::new());
    let reloader = Arc::new(Reloader::new(
        source,
        table.clone(),
        metrics.clone(),
        state.clone(),
        supervisor.clone(),
        resolver.clone(),
    ));
    let in_flight = Arc::new(AtomicUsize::new(0));

    let threads = config
        .threads
        .map(|t| t.get())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let mut conf = ServerConf {
        threads,
        // Pingora sleeps the whole grace period and then returns from `run`, which would
        // exit 0; the drain thread exits first, as soon as the drain is done and with the
        // status that says whether requests were cut. The margin keeps it first.
        grace_period_seconds: Some(drain.as_secs() + 5),
        graceful_shutdown_timeout_seconds: Some(1),
        // Pool at least as many idle upstream connections as there are concurrent clients,
        // or requests keep opening new ones.
        upstream_keepalive_pool_size: 4096,
        ..ServerConf::default()
    };
    // Two gateways on one machine must not share Pingora's pid file and upgrade socket.
    let scratch = std::env::temp_dir();
    let pid = std::process::id();
    conf.pid_file = scratch
        .join(format!("sluice-{pid}.pid"))
        .display()
        .to_string();
    conf.upgrade_sock = scratch
        .join(format!("sluice-{pid}.sock"))
        .display()
        .to_string();

    let mut server = Server::new_with_opt_and_conf(Opt::default(), conf);
    server.bootstrap();

    let gateway = Gateway::new(
        table.clone(),
        metrics.clone(),
        in_flight.clone(),
        state.clone(),
        config.limits.max_header_bytes.get() as usize,
        resolver.clone(),
    )
    .on_head_parsed(crate::limits::head_parsed);
    let mut http = pingora::proxy::http_proxy(&server.configuration, gateway);
    let mut options = HttpServerOptions::default();
    // A CONNECT later on a kept-alive connection reaches request_filter, which answers 405.
    options.allow_connect_method_proxying = true;
    http.server_options = Some(options);
    // CONNECT tunnels (crate::tunnel): each new connection is looked at first, and anything
    // but a CONNECT goes to Pingora's HttpProxy, unchanged; both run inside the connection
    // limits.
    let tunnels = Tunnels::new(
        table.clone(),
        metrics.clone(),
        in_flight.clone(),
        state.clone(),
        resolver.clone(),
    );
    let mut app = LimitedApp::new(http, limits, &metrics)
        .with_tunnels(tunnels)
        .with_trusted_proxies(table.clone());
    // TLS listeners (listen[].tls, crate::listen_tls): LimitedApp does the handshake, inside the
    // connection cap and its timers (Pingora would do it outside both), then requests and
    // CONNECT tunnels run as on a plain listener. To Pingora every listener is plain TCP. The
    // certificate and the client CA are read here, once: a new one takes a restart.
    for listener in &config.listen {
        if let Some(tls) = &listener.tls {
            let client = tls
                .client_ca
                .as_deref()
                .map(|ca| crate::listen_tls::ClientAuth {
                    ca,
                    required: tls.client_cert == crate::config::ClientCertMode::Required,
                });
            let settings = crate::listen_tls::settings(&tls.cert, &tls.key, client)
                .map_err(|e| format!("cannot listen on {} with TLS: {e}", listener.addr))?;
            app = app.with_tls(listener.addr, settings);
        }
    }
    let mut trim = background_service("sluice memory trim", app.memory_trim());
    trim.threads = Some(1);
    let mut proxy = Service::new("sluice proxy".to_string(), app);
    for listener in &config.listen {
        // No read buffer under the HTTP parser: Pingora's own head and body buffers already
        // batch reads, and the 64 KiB one it would add by default stays with every connection,
        // idle keep-alives included (docs/benchmarks.md, "Idle connections").
        let unbuffered = pingora::listeners::L4BufferSettings {
            read: Some(0),
            write: None,
        };
        proxy.add_listener(
            pingora::listeners::ListenerConfig::tcp(listener.addr.to_string())
                .l4_buffer(unbuffered),
        );
    }
    proxy.threads = Some(threads);

    let admin_api = AdminApi::new(table.clone(), metrics.clone(), state, reloader.clone());
    let mut history = background_service(
        "sluice history",
        crate::history::Sampler(admin_api.history()),
    );
    history.threads = Some(1);
    let mut admin = Service::new("sluice admin".to_string(), admin_api);
    admin.add_tcp(&config.admin.listen.0.to_string());
    admin.threads = Some(1);

    let mut checks = background_service(
        "sluice health checks",
        HealthChecks::new(table.clone(), supervisor),
    );
    checks.threads = Some(1);

    server.add_service(proxy);
    server.add_service(admin);
    server.add_service(checks);
    let mut dns = background_service(
        "sluice member dns",
        crate::dns_refresh::DnsRefresher::new(table.clone(), resolver),
    );
    dns.threads = Some(1);
    server.add_service(dns);
    let mut triggers = background_service("sluice reload triggers", ReloadTriggers::new(reloader));
    triggers.threads = Some(1);
    server.add_service(triggers);
    server.add_service(trim);
    server.add_service(history);

    let (stop_tx, stop_rx) = mpsc::channel();
    std::thread::Builder::new()
        .name("sluice-drain".into())
        .spawn(move || drain_then_exit(stop_rx, in_flight, drain))
        .expect("spawn the drain thread");

    tracing::info!(
        target: "sluice::server",
        listen = ?config.listen.iter().map(|l| l.addr).collect::<Vec<_>>(),
        tls_listen = ?config.listen.iter().filter(|l| l.tls.is_some()).map(|l| l.addr).collect::<Vec<_>>(),
        admin = %config.admin.listen.0,
        routes = config.routes.len(),
        version = %table.load().version,
        "sluice started"
    );
    server.run(RunArgs {
        shutdown_signal: Box::new(StopSignals { stop: stop_tx }),
    });
    Ok(())
}

/// Binds every listen address once, and lets go at once, so that a taken port stops the start
/// with a message naming it. Pingora itself retries a taken port for 30 s, then panics a thread
/// and leaves the process up, answering `/healthz` with no proxy listening
/// (pingora-core 0.9.1 src/listeners/l4.rs:243-287, src/services/listening.rs:293). The socket
/// is set up as Pingora sets up its own (SO_REUSEADDR), so a port in TIME_WAIT is no failure.
/// A port taken in the instant between this check and Pingora's bind still meets Pingora's
/// behaviour.
fn check_listeners(config: &Config) -> Result<(), String> {
    let proxy = config.listen.iter().map(|l| (l.addr, "listen"));
    let admin = std::iter::once((config.admin.listen.0, "admin.listen"));
    for (addr, what) in proxy.chain(admin) {
        let socket = if addr.is_ipv4() {
            tokio::net::TcpSocket::new_v4()
        } else {
            tokio::net::TcpSocket::new_v6()
        };
        socket
            .and_then(|s| {
                s.set_reuseaddr(true)?;
                s.bind(addr)
            })
            .map_err(|e| format!("cannot listen on {addr} ({what}): {e}"))?;
    }
    Ok(())
}

/// Without `clients`, whoever reaches a proxy listener may use every route, with the keys the
/// routes hold: say so when a listener is reachable from beyond this machine.
fn warn_if_proxy_open(config: &Config) {
    if config.clients.is_some() {
        return;
    }
    for listener in config.listen.iter().filter(|l| !l.addr.ip().is_loopback()) {
        tracing::warn!(
            target: "sluice::server",
            listen = %listener.addr,
            "a proxy listener is on a non-loopback address and there is no clients section: anyone who can reach it can use every route; add clients (docs/config.md, \"Clients\")"
        );
    }
}

/// The admin API can reload the config and shows its internals: say so when it listens beyond
/// this machine with no token.
fn warn_if_admin_exposed(config: &Config) {
    let admin = config.admin.listen.0;
    if !admin.ip().is_loopback() && config.admin.token_env.is_none() {
        tracing::warn!(
            target: "sluice::server",
            admin = %admin,
            "the admin API listens on a non-loopback address without admin.token_env: anyone who can reach it can POST /reload"
        );
    }
}

/// Turns SIGTERM and SIGINT into Pingora's graceful terminate (its own default makes SIGINT a
/// fast stop that cuts requests), and tells the drain thread.
struct StopSignals {
    stop: mpsc::Sender<()>,
}

#[async_trait]
impl ShutdownSignalWatch for StopSignals {
    async fn recv(&self) -> ShutdownSignal {
        let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
        let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
        let name = tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        };
        tracing::info!(target: "sluice::server", signal = name, "stopping: no new connections, draining requests in flight");
        let _ = self.stop.send(());
        ShutdownSignal::GracefulTerminate
    }
}

/// After the stop signal, waits until no request is in flight (or the drain period ends),
/// then exits rather than sitting out Pingora's fixed grace period: with status 0 when every
/// request finished, [`EXIT_REQUESTS_CUT`] when some were still in flight and are cut.
fn drain_then_exit(stop: mpsc::Receiver<()>, in_flight: Arc<AtomicUsize>, drain: Duration) {
    if stop.recv().is_err() {
        return;
    }
    let deadline = Instant::now() + drain;
    // Listeners close right after the signal; give a request accepted at that instant time to
    // reach its first hook and be counted.
    std::thread::sleep(Duration::from_millis(100).min(drain));
    while in_flight.load(Ordering::Acquire) > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let left = in_flight.load(Ordering::Acquire);
    if left > 0 {
        tracing::warn!(
            target: "sluice::server",
            cut = left,
            drain_ms = drain.as_millis() as u64,
            "sluice stopped: the drain period ended with requests in flight, which are cut"
        );
    } else {
        tracing::info!(target: "sluice::server", cut = left, "sluice stopped");
    }
    crate::otel::flush();
    crate::logging::flush();
    std::process::exit(if left > 0 { EXIT_REQUESTS_CUT } else { 0 });
}
