//! Active health checks wired to Pingora: the probes (TCP, HTTP, and CONNECT through a proxy
//! member) and the background service that runs one check task per member.
//!
//! A probe reads its member's address from the member's [`PeerCell`] at every probe, so a check
//! follows the member's DNS (see [`crate::dns`]) with no restart: the check is the member's, not
//! an address's.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use arc_swap::ArcSwap;
use async_trait::async_trait;
use http::HeaderValue;
use pingora::connectors::http::Connector;
use pingora::http::RequestHeader;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use pingora::upstreams::peer::HttpPeer;
use sluice_balancer::{spawn_active_check, ActiveCheck, Members, Probe, ProbeReport};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::runtime::Handle;
use tokio::task::JoinHandle;

use crate::config::{CheckKind, MemberKind};
use crate::dns::PeerCell;
use crate::table::Table;

/// The member's current peer, or why there is none.
fn current_peer(cell: &PeerCell) -> Result<HttpPeer, String> {
    cell.peer()
        .ok_or_else(|| "the member's host did not resolve".to_string())
}

/// A TCP connection opens to the member's current address.
pub struct TcpProbe {
    cell: Arc<PeerCell>,
}

#[async_trait]
impl Probe for TcpProbe {
    async fn check(&self) -> Result<(), String> {
        let addr = self
            .cell
            .address()
            .ok_or_else(|| "the member's host did not resolve".to_string())?;
        TcpStream::connect(addr)
            .await
            .map(drop)
            .map_err(|e| e.to_string())
    }
}

/// `GET path` answered 2xx, over the same connector code as live traffic, so https members are
/// checked with TLS and SNI just like requests reach them.
pub struct HttpProbe {
    connector: Arc<Connector>,
    cell: Arc<PeerCell>,
    path: String,
    host: String,
}

#[async_trait]
impl Probe for HttpProbe {
    async fn check(&self) -> Result<(), String> {
        let peer = current_peer(&self.cell)?;
        let (mut session, _) = self
            .connector
            .get_http_session(&peer)
            .await
            .map_err(|e| e.to_string())?;
        let mut req =
            RequestHeader::build("GET", self.path.as_bytes(), None).map_err(|e| e.to_string())?;
        req.insert_header("host", &self.host)
            .map_err(|e| e.to_string())?;
        req.insert_header("user-agent", "sluice-health-check")
            .map_err(|e| e.to_string())?;
        // A fresh connection per probe: a probe must see what a new request would see.
        req.insert_header("connection", "close")
            .map_err(|e| e.to_string())?;
        session
            .write_request_header(Box::new(req))
            .await
            .map_err(|e| e.to_string())?;
        session
            .finish_request_body()
            .await
            .map_err(|e| e.to_string())?;
        session
            .read_response_header()
            .await
            .map_err(|e| e.to_string())?;
        let status = session
            .response_header()
            .map(|h| h.status.as_u16())
            .unwrap_or(0);
        if (200..300).contains(&status) {
            Ok(())
        } else {
            Err(format!("status {status}"))
        }
    }
}

/// The longest answer head a CONNECT probe reads.
const MAX_CONNECT_ANSWER: usize = 16 * 1024;

/// For a forward proxy member: `CONNECT target` (with the member's `Proxy-Authorization`)
/// answered 2xx, which proves the proxy up, accepting sluice's credentials, and able to reach
/// the outside, where a TCP check proves only the first.
pub struct ConnectProbe {
    cell: Arc<PeerCell>,
    target: String,
    authorization: Option<HeaderValue>,
}

impl ConnectProbe {
    /// The request head sent to the proxy.
    fn head(&self) -> Vec<u8> {
        let mut head = format!(
            "CONNECT {t} HTTP/1.1\r\nHost: {t}\r\nUser-Agent: sluice-health-check\r\n",
            t = self.target
        )
        .into_bytes();
        if let Some(auth) = &self.authorization {
            head.extend_from_slice(b"Proxy-Authorization: ");
            head.extend_from_slice(auth.as_bytes());
            head.extend_from_slice(b"\r\n");
        }
        head.extend_from_slice(b"\r\n");
        head
    }
}

#[async_trait]
impl Probe for ConnectProbe {
    async fn check(&self) -> Result<(), String> {
        let addr = self
            .cell
            .address()
            .ok_or_else(|| "the member's host did not resolve".to_string())?;
        let mut stream = TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect {addr}: {e}"))?;
        stream
            .write_all(&self.head())
            .await
            .map_err(|e| format!("write: {e}"))?;
        let mut buf = Vec::with_capacity(1024);
        loop {
            let mut headers = [httparse::EMPTY_HEADER; 64];
            let mut answer = httparse::Response::new(&mut headers);
            match answer.parse(&buf) {
                Ok(httparse::Status::Complete(_)) => {
                    let status = answer.code.unwrap_or(0);
                    // The tunnel is dropped here, unused: the probe only asks whether it opens.
                    return if (200..300).contains(&status) {
                        Ok(())
                    } else {
                        Err(format!("CONNECT {} answered {status}", self.target))
                    };
                }
                Ok(httparse::Status::Partial) if buf.len() < MAX_CONNECT_ANSWER => {}
                Ok(httparse::Status::Partial) => return Err("answer head too long".into()),
                Err(e) => return Err(format!("bad answer: {e}")),
            }
            let mut chunk = [0u8; 1024];
            let n = stream
                .read(&mut chunk)
                .await
                .map_err(|e| format!("read: {e}"))?;
            if n == 0 {
                return Err("the proxy closed the connection before answering".into());
            }
            buf.extend_from_slice(&chunk[..n]);
        }
    }
}

/// What makes a running check the same check after a reload: the same member of the same
/// route, with the same address cell (so the same URL and peer settings), checked the same
/// way. Anything else starts a new task. The address is not part of it: the probe reads the
/// cell, which follows DNS.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct CheckKey {
    route: Arc<str>,
    member: Arc<str>,
    /// The cell's identity (its address in memory; the running probe holds the cell, so it
    /// cannot be reused by another while the key is in the map).
    cell: usize,
    kind: CheckKind,
    path: String,
    target: Option<String>,
    interval: Duration,
    timeout: Duration,
}

/// A running check and where it reports: the member's place in the current table's pool.
struct Running {
    target: Arc<ArcSwap<(Arc<Members>, usize)>>,
    task: JoinHandle<()>,
}

/// Keeps exactly one check task per checked member of the current table. On a reload, an
/// unchanged member keeps its task (and so its health is never reset, nor re-probed in a
/// burst); its reports simply go to the new table's pool. Checks of members that left stop.
pub struct HealthSupervisor {
    connector: Arc<Connector>,
    /// The runtime of the health service, where tasks live; set when the service starts.
    runtime: OnceLock<Handle>,
    running: Mutex<HashMap<CheckKey, Running>>,
}

impl Default for HealthSupervisor {
    fn default() -> Self {
        HealthSupervisor::new()
    }
}

impl HealthSupervisor {
    /// A supervisor with no checks yet.
    pub fn new() -> HealthSupervisor {
        HealthSupervisor {
            connector: Arc::new(Connector::new(None)),
            runtime: OnceLock::new(),
            running: Mutex::new(HashMap::new()),
        }
    }

    /// Makes the running checks match `table`. Before the health service has started this does
    /// nothing: the service applies the table in force when it starts.
    pub fn apply(&self, table: &Table) {
        let Some(runtime) = self.runtime.get() else {
            return;
        };
        let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        let mut wanted = HashMap::new();
        for route in &table.routes {
            let Some(hc) = &route.config.upstream.health_check else {
                continue;
            };
            let path = hc
                .path
                .as_ref()
                .map_or_else(|| "/healthz".to_string(), |p| p.0.clone());
            for (i, member) in route.members.iter().enumerate() {
                // A direct member has no address of its own to check.
                let Some(cell) = &member.cell else { continue };
                let key = CheckKey {
                    route: route.name.clone(),
                    member: route.pool.members()[i].id.clone(),
                    cell: Arc::as_ptr(cell) as usize,
                    kind: hc.kind,
                    path: path.clone(),
                    target: hc.target.clone(),
                    interval: hc.interval.0,
                    timeout: hc.timeout.0,
                };
                let place = Arc::new((route.pool.clone(), i));
                if let Some(existing) = running.remove(&key) {
                    existing.target.store(place);
                    wanted.insert(key, existing);
                    continue;
                }
                // A forward proxy has no path of its own to GET: `http` probes it by connecting;
                // `connect` asks it for a tunnel. Validation keeps `connect` to proxy members.
                let probe: Arc<dyn Probe> = match (&member.kind, hc.kind, &hc.target) {
                    (MemberKind::Proxy { authorization }, CheckKind::Connect, Some(target)) => {
                        Arc::new(ConnectProbe {
                            cell: cell.clone(),
                            target: target.clone(),
                            authorization: authorization.clone(),
                        })
                    }
                    (MemberKind::Origin, CheckKind::Http, _) => Arc::new(HttpProbe {
                        connector: self.connector.clone(),
                        cell: cell.clone(),
                        path: path.clone(),
                        host: member.url.authority(),
                    }),
                    _ => Arc::new(TcpProbe { cell: cell.clone() }),
                };
                let target = Arc::new(ArcSwap::new(place));
                let sink = target.clone();
                let report: ProbeReport = Arc::new(move |ok, now| {
                    let place = sink.load();
                    place.0.report_probe(place.1, ok, now);
                });
                let check = ActiveCheck {
                    interval: hc.interval.0,
                    timeout: hc.timeout.0,
                };
                let _entered = runtime.enter();
                let task = spawn_active_check(probe, check, report);
                wanted.insert(key, Running { target, task });
            }
        }
        // What is left was not wanted any more.
        for (_, gone) in running.drain() {
            gone.task.abort();
        }
        *running = wanted;
    }

    fn stop_all(&self) {
        for (_, r) in self
            .running
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain()
        {
            r.task.abort();
        }
    }
}

/// The Pingora background service that hosts the check tasks.
pub struct HealthChecks {
    table: Arc<ArcSwap<Table>>,
    supervisor: Arc<HealthSupervisor>,
}

impl HealthChecks {
    /// Checks for whatever table is current, run by `supervisor`.
    pub fn new(table: Arc<ArcSwap<Table>>, supervisor: Arc<HealthSupervisor>) -> HealthChecks {
        HealthChecks { table, supervisor }
    }
}

#[async_trait]
impl BackgroundService for HealthChecks {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let _ = self.supervisor.runtime.set(Handle::current());
        self.supervisor.apply(&self.table.load());
        let _ = shutdown.changed().await;
        self.supervisor.stop_all();
    }
}
