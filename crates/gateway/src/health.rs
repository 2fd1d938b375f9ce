//! Active health checks wired to Pingora: the HTTP probe and the background service that runs
//! one check task per member.

use std::sync::Arc;

use arc_swap::ArcSwap;
use async_trait::async_trait;
use pingora::connectors::http::Connector;
use pingora::http::RequestHeader;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use pingora::upstreams::peer::HttpPeer;
use sluice_balancer::{spawn_active_check, ActiveCheck, Probe, TcpProbe};
use tokio::task::JoinHandle;

use crate::config::CheckKind;
use crate::table::Table;

/// `GET path` answered 2xx, over the same connector code as live traffic, so https members are
/// checked with TLS and SNI just like requests reach them.
pub struct HttpProbe {
    connector: Arc<Connector>,
    peer: HttpPeer,
    path: String,
    host: String,
}

#[async_trait]
impl Probe for HttpProbe {
    async fn check(&self) -> Result<(), String> {
        let (mut session, _) = self
            .connector
            .get_http_session(&self.peer)
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

/// Starts one check task per member of every route with a `health_check`, on the current
/// runtime.
pub fn spawn_checks(table: &Table, connector: &Arc<Connector>) -> Vec<JoinHandle<()>> {
    let mut tasks = Vec::new();
    for route in &table.routes {
        let Some(hc) = &route.config.upstream.health_check else {
            continue;
        };
        let check = ActiveCheck {
            interval: hc.interval.0,
            timeout: hc.timeout.0,
        };
        for (i, member) in route.members.iter().enumerate() {
            let Some(peer) = &member.peer else { continue };
            let probe: Arc<dyn Probe> = match hc.kind {
                CheckKind::Tcp => Arc::new(TcpProbe {
                    addr: peer
                        ._address
                        .as_inet()
                        .copied()
                        .expect("members are TCP peers"),
                }),
                CheckKind::Http => Arc::new(HttpProbe {
                    connector: connector.clone(),
                    peer: peer.clone(),
                    path: hc
                        .path
                        .as_ref()
                        .map_or_else(|| "/healthz".to_string(), |p| p.0.clone()),
                    host: member.url.authority(),
                }),
            };
            tasks.push(spawn_active_check(route.pool.clone(), i, probe, check));
        }
    }
    tasks
}

/// The Pingora background service that owns the check tasks.
pub struct HealthChecks {
    table: Arc<ArcSwap<Table>>,
}

impl HealthChecks {
    /// Checks for the routes of the current table.
    pub fn new(table: Arc<ArcSwap<Table>>) -> HealthChecks {
        HealthChecks { table }
    }
}

#[async_trait]
impl BackgroundService for HealthChecks {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let connector = Arc::new(Connector::new(None));
        let tasks = spawn_checks(&self.table.load(), &connector);
        let _ = shutdown.changed().await;
        for t in tasks {
            t.abort();
        }
    }
}
