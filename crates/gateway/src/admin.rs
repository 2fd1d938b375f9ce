//! The admin API (SPEC §4): health, readiness, metrics and status.

use std::sync::Arc;

use arc_swap::ArcSwap;
use async_trait::async_trait;
use http::{Response, StatusCode};
use pingora::apps::http_app::ServeHttp;
use pingora::protocols::http::ServerSession;
use serde_json::json;

use sluice_limiter::QuotaStore;

use crate::metrics::Metrics;
use crate::table::Table;

/// Serves the admin endpoints on `admin.listen`.
pub struct AdminApi {
    table: Arc<ArcSwap<Table>>,
    metrics: Arc<Metrics>,
    quotas: Arc<dyn QuotaStore>,
}

impl AdminApi {
    /// An admin API over the current table, the metrics and the quota store.
    pub fn new(
        table: Arc<ArcSwap<Table>>,
        metrics: Arc<Metrics>,
        quotas: Arc<dyn QuotaStore>,
    ) -> AdminApi {
        AdminApi {
            table,
            metrics,
            quotas,
        }
    }

    /// The `/status` document.
    pub fn status(&self) -> serde_json::Value {
        let table = self.table.load();
        let routes: Vec<_> = table
            .routes
            .iter()
            .map(|r| {
                let members: Vec<_> = r
                    .pool
                    .members()
                    .iter()
                    .map(
                        |m| json!({"url": &*m.id, "healthy": m.health.is_up(), "weight": m.weight}),
                    )
                    .collect();
                let quota: Vec<_> = r
                    .quota
                    .iter()
                    .flat_map(|q| &q.windows)
                    .map(|w| json!({"name": &*w.name, "limit": w.limit, "window_ms": w.length_us / 1000}))
                    .collect();
                json!({
                    "name": &*r.name,
                    "selection": "round_robin",
                    "members": members,
                    "quota": quota,
                })
            })
            .collect();
        json!({
            "version": table.version,
            "loaded_at": table.loaded_at,
            "last_reload_error": null,
            "routes": routes,
        })
    }
}

fn reply(status: StatusCode, content_type: &str, body: impl Into<Vec<u8>>) -> Response<Vec<u8>> {
    let body = body.into();
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .header("content-length", body.len())
        .body(body)
        .expect("valid response")
}

#[async_trait]
impl ServeHttp for AdminApi {
    async fn response(&self, session: &mut ServerSession) -> Response<Vec<u8>> {
        let req = session.req_header();
        let get = req.method == http::Method::GET;
        match (get, req.uri.path()) {
            (true, "/healthz") => reply(StatusCode::OK, "text/plain", "ok\n"),
            // A config is loaded by the time this service listens; what is left to check is
            // the store (always ready in memory, a PING for Redis).
            (true, "/readyz") => {
                if self.quotas.ready().await {
                    reply(StatusCode::OK, "text/plain", "ready\n")
                } else {
                    reply(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "text/plain",
                        "state store unreachable\n",
                    )
                }
            }
            (true, "/metrics") => reply(
                StatusCode::OK,
                "text/plain; version=0.0.4",
                self.metrics.render(),
            ),
            (true, "/status") => {
                let mut body = serde_json::to_vec_pretty(&self.status()).unwrap_or_default();
                body.push(b'\n');
                reply(StatusCode::OK, "application/json", body)
            }
            (false, "/healthz" | "/readyz" | "/metrics" | "/status") => reply(
                StatusCode::METHOD_NOT_ALLOWED,
                "application/json",
                r#"{"error":"method not allowed"}"#,
            ),
            _ => reply(
                StatusCode::NOT_FOUND,
                "application/json",
                r#"{"error":"not found"}"#,
            ),
        }
    }
}
