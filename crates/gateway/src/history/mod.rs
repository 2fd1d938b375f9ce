//! `GET /status/history`: a fixed ring of per-second samples per route, for the dashboard's
//! charts. A request adds to its route's [`Live`] counters (one atomic increment); once a
//! second the sampler ([`History`], a background service) reads them, keeps the differences
//! as one sample, and drops the oldest past [`SAMPLES`]. Memory is bounded: [`MAX_ROUTES`]
//! routes (the first ones in the config) with at most [`MAX_MEMBERS`] members each.

pub mod live;

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use async_trait::async_trait;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use serde_json::json;

pub use live::Live;
use live::{BUCKETS, CLASSES, COLUMNS};

use crate::table::Table;

/// Samples kept per route: 5 minutes of seconds.
pub const SAMPLES: usize = 300;

/// Routes with a history: the first ones of the config. The others have none.
pub const MAX_ROUTES: usize = 64;

/// Members whose share of assignments is kept, per route: the first ones of the route.
pub const MAX_MEMBERS: usize = 32;

/// Samples over which `rate` is taken: enough that a slow, steady flow never reads 0.
const RATE_SAMPLES: usize = 10;

/// How often a sample is taken.
const INTERVAL: Duration = Duration::from_secs(1);

/// One second of a route.
struct Sample {
    /// Requests ended in that second, per class of [`CLASSES`].
    counts: [u32; CLASSES.len()],
    /// Latency quantiles of those with one, in microseconds; `None` when there was none.
    p50_us: Option<f32>,
    p99_us: Option<f32>,
    /// Requests in flight when the sample was taken.
    in_flight: u32,
    /// Attempts sent to each member in that second (as `RouteRing::members`).
    members: Box<[u32]>,
}

/// What the sampler reads of a route each second.
pub struct RouteNow<'a> {
    pub name: &'a Arc<str>,
    pub live: &'a Arc<Live>,
    pub in_flight: i64,
    /// Each member's name and its attempts so far (the first [`MAX_MEMBERS`]).
    pub members: Vec<(Arc<str>, u64)>,
}

/// A route's ring and what the next sample is taken against.
struct RouteRing {
    live: Arc<Live>,
    /// The counters at the last sample.
    before: Box<[u32]>,
    members: Vec<Arc<str>>,
    members_before: Vec<u64>,
    /// Samples taken with the current member list (the older ones name other members).
    members_since: usize,
    samples: VecDeque<Sample>,
}

/// Every route's ring, and when the last sample was taken.
#[derive(Default)]
pub struct Rings {
    routes: HashMap<Arc<str>, RouteRing>,
    /// Routes in the order of the config, as last sampled.
    order: Vec<Arc<str>>,
    /// Routes past [`MAX_ROUTES`], left without a history.
    left_out: usize,
    /// Wall clock of the last sample, in ms since the epoch.
    end_ms: u64,
    /// A scratch read of a route's counters.
    scratch: Vec<u32>,
}

impl Rings {
    /// Takes one sample of each route (at most [`MAX_ROUTES`] of `routes`), at `end_ms`.
    pub fn roll<'a>(&mut self, routes: impl Iterator<Item = RouteNow<'a>>, end_ms: u64) {
        let mut order = Vec::new();
        self.left_out = 0;
        self.scratch.resize(CLASSES.len() * COLUMNS, 0);
        for route in routes {
            if order.len() == MAX_ROUTES {
                self.left_out += 1;
                continue;
            }
            order.push(route.name.clone());
            route.live.read(&mut self.scratch);
            let Some(ring) = self.routes.get_mut(route.name) else {
                // A route seen for the first time: what it counted so far is where its first
                // second starts, not a second of its own.
                let ring = RouteRing {
                    live: route.live.clone(),
                    before: self.scratch.clone().into(),
                    members: route.members.iter().map(|(n, _)| n.clone()).collect(),
                    members_before: route.members.iter().map(|(_, c)| *c).collect(),
                    members_since: 0,
                    samples: VecDeque::with_capacity(SAMPLES),
                };
                self.routes.insert(route.name.clone(), ring);
                continue;
            };
            if !Arc::ptr_eq(&ring.live, route.live) {
                // A route of that name built anew: its counters start again.
                ring.live = route.live.clone();
                ring.before.copy_from_slice(&self.scratch);
            }
            ring.sample(&self.scratch, &route);
        }
        // Routes gone from the config lose their history.
        self.routes.retain(|name, _| order.contains(name));
        self.order = order;
        self.end_ms = end_ms;
    }

    /// The `/status/history` document.
    pub fn json(&self) -> serde_json::Value {
        let routes: Vec<_> = self
            .order
            .iter()
            .filter_map(|name| Some((name, self.routes.get(name)?)))
            .map(|(name, ring)| ring.json(name))
            .collect();
        json!({
            "interval_ms": INTERVAL.as_millis() as u64,
            "capacity": SAMPLES,
            "end_ms": self.end_ms,
            "classes": CLASSES,
            "routes": routes,
            "routes_left_out": self.left_out,
        })
    }
}

impl RouteRing {
    fn sample(&mut self, now: &[u32], route: &RouteNow<'_>) {
        let mut counts = [0u32; CLASSES.len()];
        let mut latencies = [0u32; BUCKETS];
        for (i, (now, before)) in now.iter().zip(self.before.iter_mut()).enumerate() {
            let n = now.wrapping_sub(*before);
            *before = *now;
            counts[i / COLUMNS] = counts[i / COLUMNS].saturating_add(n);
            if let Some(l) = latencies.get_mut(i % COLUMNS) {
                *l = l.saturating_add(n);
            }
        }
        let names_changed = self.members.len() != route.members.len()
            || self
                .members
                .iter()
                .zip(&route.members)
                .any(|(a, (b, _))| a != b);
        if names_changed {
            self.members = route.members.iter().map(|(n, _)| n.clone()).collect();
            self.members_before = route.members.iter().map(|(_, c)| *c).collect();
            self.members_since = 0;
        }
        let members = route
            .members
            .iter()
            .zip(self.members_before.iter_mut())
            .map(|((_, now), before)| {
                // A counter that went back (its series was removed and made again) counts from 0.
                let n = now.checked_sub(*before).unwrap_or(*now);
                *before = *now;
                u32::try_from(n).unwrap_or(u32::MAX)
            })
            .collect();
        if self.samples.len() == SAMPLES {
            self.samples.pop_front();
        }
        self.samples.push_back(Sample {
            counts,
            p50_us: quantile(&latencies, 0.50),
            p99_us: quantile(&latencies, 0.99),
            in_flight: u32::try_from(route.in_flight.max(0)).unwrap_or(u32::MAX),
            members,
        });
        self.members_since = (self.members_since + 1).min(SAMPLES);
    }

    fn json(&self, name: &str) -> serde_json::Value {
        let mut requests = serde_json::Map::new();
        for (c, class) in CLASSES.iter().enumerate() {
            let series: Vec<u32> = self.samples.iter().map(|s| s.counts[c]).collect();
            requests.insert((*class).into(), series.into());
        }
        // Milliseconds with 3 decimals: a microsecond is as fine as a bucket gets.
        let ms = |us: Option<f32>| us.map(|us| f64::from(us).round() / 1000.0);
        let p50: Vec<_> = self.samples.iter().map(|s| ms(s.p50_us)).collect();
        let p99: Vec<_> = self.samples.iter().map(|s| ms(s.p99_us)).collect();
        let in_flight: Vec<u32> = self.samples.iter().map(|s| s.in_flight).collect();
        // Each member's attempts over the samples taken with the current member list, and its
        // share of them all.
        let recent = self.samples.len().min(self.members_since);
        let from = self.samples.len() - recent;
        let per_member: Vec<Vec<u32>> = (0..self.members.len())
            .map(|m| {
                self.samples
                    .range(from..)
                    .map(|s| s.members.get(m).copied().unwrap_or(0))
                    .collect()
            })
            .collect();
        let total: u64 = per_member.iter().flatten().map(|&n| u64::from(n)).sum();
        let members: Vec<_> = self
            .members
            .iter()
            .zip(&per_member)
            .map(|(name, series)| {
                let sum: u64 = series.iter().map(|&n| u64::from(n)).sum();
                json!({
                    "name": &**name,
                    "assignments": series,
                    "share": if total > 0 { sum as f64 / total as f64 } else { 0.0 },
                })
            })
            .collect();
        json!({
            "name": name,
            "samples": self.samples.len(),
            "rate": self.rate(),
            "requests": requests,
            "p50_ms": p50,
            "p99_ms": p99,
            "in_flight": in_flight,
            "members": members,
        })
    }

    /// Requests per second over the last [`RATE_SAMPLES`] samples (fewer when there are
    /// fewer): a flow of one request every few seconds reads above 0.
    fn rate(&self) -> f64 {
        let n = self.samples.len().min(RATE_SAMPLES);
        if n == 0 {
            return 0.0;
        }
        let sum: u64 = self
            .samples
            .iter()
            .rev()
            .take(n)
            .flat_map(|s| s.counts)
            .map(u64::from)
            .sum();
        (sum as f64 / n as f64 * 100.0).round() / 100.0
    }
}

/// The latency (middle of its bucket) below which `q` of `buckets`' counts fall; `None` for
/// no count at all.
fn quantile(buckets: &[u32], q: f64) -> Option<f32> {
    let total: u64 = buckets.iter().map(|&n| u64::from(n)).sum();
    if total == 0 {
        return None;
    }
    // The rank of the quantile, 1-based: the p99 of 10 requests is the 10th.
    let rank = ((total as f64 * q).ceil() as u64).max(1);
    let mut seen = 0u64;
    for (i, &n) in buckets.iter().enumerate() {
        seen += u64::from(n);
        if seen >= rank {
            return Some(live::bucket_middle_us(i) as f32);
        }
    }
    None
}

/// The rings, and the sampler that rolls them once a second from the current table.
pub struct History {
    table: Arc<ArcSwap<Table>>,
    rings: Mutex<Rings>,
}

impl History {
    pub fn new(table: Arc<ArcSwap<Table>>) -> History {
        History {
            table,
            rings: Mutex::new(Rings::default()),
        }
    }

    /// Takes one sample of every route of the current table.
    pub fn roll(&self) {
        let table = self.table.load();
        let end_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        let routes = table.routes.iter().map(|r| RouteNow {
            name: &r.name,
            live: &r.history,
            in_flight: r.in_flight.get(),
            members: r
                .members
                .iter()
                .take(MAX_MEMBERS)
                .map(|m| {
                    let attempts = m.attempts_ok.get()
                        + m.attempts_error.get()
                        + m.attempts_connect_failure.get();
                    (m.name.clone(), attempts)
                })
                .collect(),
        });
        // Only the sampler and `/status/history` take this lock, never a request.
        let mut rings = self.rings.lock().unwrap_or_else(|e| e.into_inner());
        rings.roll(routes, end_ms);
    }

    /// The `/status/history` document.
    pub fn json(&self) -> serde_json::Value {
        self.rings.lock().unwrap_or_else(|e| e.into_inner()).json()
    }
}

/// The service that rolls a [`History`]'s rings once a second.
pub struct Sampler(pub Arc<History>);

#[async_trait]
impl BackgroundService for Sampler {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut tick = tokio::time::interval(INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The first tick is at once: it sets where the first second starts.
        loop {
            tokio::select! {
                _ = tick.tick() => self.0.roll(),
                _ = shutdown.changed() => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn now<'a>(name: &'a Arc<str>, live: &'a Arc<Live>, members: &[(&str, u64)]) -> RouteNow<'a> {
        RouteNow {
            name,
            live,
            in_flight: 2,
            members: members.iter().map(|(n, c)| ((*n).into(), *c)).collect(),
        }
    }

    #[test]
    fn each_second_holds_what_ended_in_it_and_the_ring_is_bounded() {
        let name: Arc<str> = "api".into();
        let live = Arc::new(Live::new());
        let mut rings = Rings::default();
        rings.roll(std::iter::once(now(&name, &live, &[("a", 0), ("b", 0)])), 0);
        for _ in 0..3 {
            live.record(200, Some(Duration::from_millis(2)));
        }
        live.record(429, Some(Duration::from_micros(100)));
        live.record(502, Some(Duration::from_secs(1)));
        rings.roll(
            std::iter::once(now(&name, &live, &[("a", 3), ("b", 1)])),
            1000,
        );
        let doc = rings.json();
        let route = &doc["routes"][0];
        assert_eq!(route["samples"], 1);
        assert_eq!(route["requests"]["2xx"], json!([3]));
        assert_eq!(route["requests"]["429"], json!([1]));
        assert_eq!(route["requests"]["5xx"], json!([1]));
        assert_eq!(route["in_flight"], json!([2]));
        let p50 = route["p50_ms"][0].as_f64().unwrap();
        let p99 = route["p99_ms"][0].as_f64().unwrap();
        assert!((1.5..=2.5).contains(&p50), "{p50}");
        assert!((750.0..=1250.0).contains(&p99), "{p99}");
        assert_eq!(route["members"][0]["assignments"], json!([3]));
        assert_eq!(route["members"][0]["share"], 0.75);
        assert_eq!(route["rate"], 5.0);

        // A second with nothing: no latency; the rate is over both seconds.
        rings.roll(
            std::iter::once(now(&name, &live, &[("a", 3), ("b", 1)])),
            2000,
        );
        let route = &rings.json()["routes"][0];
        assert_eq!(route["p50_ms"][1], serde_json::Value::Null);
        assert_eq!(route["rate"], 2.5);

        for s in 0..2 * SAMPLES as u64 {
            live.record(200, None);
            rings.roll(std::iter::once(now(&name, &live, &[("a", 3)])), s);
        }
        let route = &rings.json()["routes"][0];
        assert_eq!(route["samples"], SAMPLES);
        assert_eq!(route["requests"]["2xx"].as_array().unwrap().len(), SAMPLES);
        assert_eq!(route["rate"], 1.0, "a steady flow reads as its rate");
        assert_eq!(
            route["p99_ms"][SAMPLES - 1],
            serde_json::Value::Null,
            "tunnels have no latency"
        );
    }

    #[test]
    fn a_sample_is_as_small_as_the_docs_say() {
        // docs/operations.md states the ring's memory from this size.
        assert!(std::mem::size_of::<Sample>() <= 64);
    }

    #[test]
    fn routes_past_the_bound_and_routes_gone_have_no_history() {
        let names: Vec<Arc<str>> = (0..MAX_ROUTES + 3)
            .map(|i| format!("r{i}").into())
            .collect();
        let lives: Vec<Arc<Live>> = names.iter().map(|_| Arc::new(Live::new())).collect();
        let mut rings = Rings::default();
        rings.roll(names.iter().zip(&lives).map(|(n, l)| now(n, l, &[])), 0);
        let doc = rings.json();
        assert_eq!(doc["routes"].as_array().unwrap().len(), MAX_ROUTES);
        assert_eq!(doc["routes_left_out"], 3);
        rings.roll(
            names
                .iter()
                .zip(&lives)
                .skip(1)
                .take(1)
                .map(|(n, l)| now(n, l, &[])),
            1,
        );
        assert_eq!(rings.routes.len(), 1);
        assert_eq!(rings.json()["routes"][0]["name"], "r1");
    }
}
