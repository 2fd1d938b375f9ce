//! The background service that keeps every named member's address as fresh as its TTL (see
//! [`crate::dns`] for the cells it refreshes). It reads the current table, so it sits above it.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use async_trait::async_trait;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;

use crate::dns::IDLE_PASS;
use crate::resolve::Resolver;
use crate::table::Table;

/// The background service that keeps every named member's address as fresh as its TTL.
pub struct DnsRefresher {
    table: Arc<ArcSwap<Table>>,
    resolver: Resolver,
}

impl DnsRefresher {
    /// Refreshes the members of whatever table is current, with `resolver`.
    pub fn new(table: Arc<ArcSwap<Table>>, resolver: Resolver) -> DnsRefresher {
        DnsRefresher { table, resolver }
    }

    /// Starts a lookup for every member that is due; returns when the next one will be.
    fn pass(&self, now: Instant) -> Instant {
        let mut next = now + IDLE_PASS;
        let table = self.table.load_full();
        for route in &table.routes {
            for cell in route.members.iter().filter_map(|m| m.cell.as_ref()) {
                if !cell.named {
                    continue;
                }
                if let Some(due) = cell.not_due_until(now) {
                    next = next.min(due);
                    continue;
                }
                // Routes with unchanged upstreams share cells; one lookup each.
                if cell.busy.swap(true, Ordering::AcqRel) {
                    continue;
                }
                let (cell, resolver) = (cell.clone(), self.resolver.clone());
                tokio::spawn(async move {
                    cell.refresh(&resolver).await;
                    cell.busy.store(false, Ordering::Release);
                });
            }
        }
        next.max(now + Duration::from_millis(50))
    }
}

#[async_trait]
impl BackgroundService for DnsRefresher {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        loop {
            let next = self.pass(Instant::now());
            tokio::select! {
                _ = tokio::time::sleep_until(next.into()) => {}
                _ = shutdown.changed() => return,
            }
        }
    }
}
