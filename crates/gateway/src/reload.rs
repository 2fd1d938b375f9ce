//! Hot reload (SPEC §5): the file changing on disk, SIGHUP, or `POST /reload`.
//!
//! A reload reads and validates the whole file, builds the new table off the hot path (carrying
//! state over, see [`Table::build`]), and only then swaps it in with `arc-swap`. Requests in
//! flight keep the table they started with; the next request sees the new one. A file that
//! fails validation changes nothing: the error is logged, counted, and shown in `/status`.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use async_trait::async_trait;
use notify::{EventKind, RecursiveMode, Watcher};
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use sluice_allocator::StateStore;
use tokio::signal::unix::{signal, SignalKind};

use crate::checks::HealthSupervisor;
use crate::config::Config;
use crate::egress::Resolver;
use crate::metrics::Metrics;
use crate::table::Table;

/// Where the platform reports no close of a written file (polling watchers, some container
/// mounts), a change is loaded once the file's content has stayed the same this long: a writer
/// that pauses mid-file for less than this is never caught half-way.
const SETTLE: Duration = Duration::from_secs(2);

/// A close (or a rename into place) is acted on this long after it, if no write came in the
/// meantime: a writer that reopens the file at once to write it again is not read half-way,
/// and the events of one save (an editor's write, rename and chmod) make one reload.
const CLOSE_GRACE: Duration = Duration::from_millis(100);

/// Once a close has been seen for the file, the platform reports them, so a change without one
/// means a writer still holds the file open: it is waited for this long before the content is
/// trusted anyway (a writer that never closes, or an edit by path such as `truncate`).
const SETTLE_WITH_CLOSES: Duration = Duration::from_secs(30);

/// Performs reloads, one at a time.
pub struct Reloader {
    source: Option<PathBuf>,
    table: Arc<ArcSwap<Table>>,
    metrics: Arc<Metrics>,
    state: Arc<dyn StateStore>,
    supervisor: Arc<HealthSupervisor>,
    resolver: Resolver,
    last_error: Mutex<Option<String>>,
    one_at_a_time: tokio::sync::Mutex<()>,
}

impl Reloader {
    /// A reloader for the config file `source` (`None`: the embedded default, which has no file).
    pub fn new(
        source: Option<PathBuf>,
        table: Arc<ArcSwap<Table>>,
        metrics: Arc<Metrics>,
        state: Arc<dyn StateStore>,
        supervisor: Arc<HealthSupervisor>,
        resolver: Resolver,
    ) -> Reloader {
        Reloader {
            source,
            table,
            metrics,
            state,
            supervisor,
            resolver,
            last_error: Mutex::new(None),
            one_at_a_time: tokio::sync::Mutex::new(()),
        }
    }

    /// The config file, if there is one.
    pub fn source(&self) -> Option<&Path> {
        self.source.as_deref()
    }

    /// The error of the last failed reload, cleared by the next good one.
    pub fn last_error(&self) -> Option<String> {
        self.last_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Reloads the file; `trigger` names what asked (for the log). Returns the version in force
    /// afterwards, or the validation errors, one `FILE:LINE:COL: PATH: message` per line.
    pub async fn reload(&self, trigger: &'static str) -> Result<String, String> {
        let _serial = self.one_at_a_time.lock().await;
        let Some(path) = &self.source else {
            return Err(
                "sluice runs on the embedded default config: there is no file to reload".into(),
            );
        };
        let started = Instant::now();
        // The watcher calls only once the writer is done (the file closed or renamed into
        // place, or its content settled), so one read is the whole file.
        let read = std::fs::read(path).map_err(|e| e.to_string());
        let bytes = match read {
            Ok(bytes) => bytes,
            Err(e) => {
                let message = format!("{}:0:0: .: cannot read the file: {e}", path.display());
                return Err(self.failed(trigger, message));
            }
        };
        let old = self.table.load_full();
        // An unchanged file (an editor touched it, a watcher event after our own reload, a bad
        // edit reverted) costs a hash, not a parse.
        if crate::table::sha256_hex(&bytes) == old.version {
            *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = None;
            if trigger != "file" {
                tracing::info!(target: "sluice::reload", trigger, version = %old.version, "config unchanged");
            }
            return Ok(old.version.clone());
        }
        // Parsing ten thousand routes takes a while: off the runtime, so that neither the admin
        // API (a POST /reload) nor the watcher's runtime stalls meanwhile.
        let name = path.display().to_string();
        let text = String::from_utf8_lossy(&bytes).into_owned();
        let parsed = tokio::task::spawn_blocking(move || {
            Config::parse_with(&name, &text, &crate::select::RULES)
        })
        .await;
        let config = match parsed {
            Ok(Ok(config)) => config,
            Ok(Err(errors)) => return Err(self.failed(trigger, errors.to_string())),
            Err(e) => return Err(self.failed(trigger, format!("the config parser failed: {e}"))),
        };
        let new = Table::build(
            &config,
            &bytes,
            &self.metrics,
            &self.state,
            &self.resolver,
            Some(&old),
        )
        .await;
        if new.settings.needs_restart_for(&old.settings) {
            tracing::warn!(
                target: "sluice::reload",
                "listen, admin.listen, threads, state, limits and dns apply at the next restart; the running gateway keeps its own"
            );
        }
        let version = new.version.clone();
        let routes = new.routes.len();
        let new = Arc::new(new);
        self.table.store(new.clone());
        self.supervisor.apply(&new);
        forget_departed(&self.metrics, &old, &new);
        // What the store keeps in process for routes that left would otherwise stay for good.
        let names: Vec<&str> = new.routes.iter().map(|r| &*r.name).collect();
        self.state.retain_routes(&names).await;
        *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = None;
        self.metrics.config_reloads.with_label_values(&["ok"]).inc();
        tracing::info!(
            target: "sluice::reload",
            trigger, version = %version, routes,
            duration_ms = started.elapsed().as_secs_f64() * 1000.0,
            "config reloaded"
        );
        // Freeing ten thousand routes takes a while; the caller need not wait for it.
        tokio::task::spawn_blocking(move || drop(old));
        Ok(version)
    }

    fn failed(&self, trigger: &'static str, message: String) -> String {
        tracing::error!(target: "sluice::reload", trigger, error = %message, "config reload failed; the previous config stays in force");
        self.metrics
            .config_reloads
            .with_label_values(&["error"])
            .inc();
        *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(message.clone());
        message
    }
}

/// Drops the metric series of routes and members that left, so dashboards do not show ghosts.
fn forget_departed(metrics: &Metrics, old: &Table, new: &Table) {
    // By name, so that a reload stays linear in the number of routes.
    let by_name: std::collections::HashMap<&str, &crate::table::Route> =
        new.routes.iter().map(|r| (&*r.name, &**r)).collect();
    for route in &old.routes {
        let kept = by_name.get(&*route.name);
        for member in route.pool.members() {
            let still = kept.is_some_and(|k| k.pool.members().iter().any(|m| m.id == member.id));
            if !still {
                let labels = [&*route.name, &*member.id];
                let _ = metrics.member_healthy.remove_label_values(&labels);
                let _ = metrics.member_duration.remove_label_values(&labels);
                let _ = metrics.member_cooldowns.remove_label_values(&labels);
                let windows = route.members.iter().filter(|m| m.name == member.id);
                for w in windows.flat_map(|m| m.windows.iter()) {
                    let _ = metrics.member_quota_remaining.remove_label_values(&[
                        &route.name,
                        &member.id,
                        &w.name,
                    ]);
                }
                for outcome in ["ok", "connect_failure", "error"] {
                    let _ = metrics.upstream_attempts.remove_label_values(&[
                        &route.name,
                        &member.id,
                        outcome,
                    ]);
                }
            }
        }
    }
}

/// What a file event means for the config file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FileEvent {
    /// The file is complete: its writer closed it, or a whole file was renamed into place.
    Complete,
    /// Its writer closed it (a `Complete` too, and proof that the platform reports closes).
    Closed,
    /// It changed, and may still be being written.
    Changed,
    /// Its metadata changed (permissions, times): an editor may do that right after its
    /// close, which must not put the load off.
    Touched,
}

/// Classifies a watcher event on the config file's directory; `None` when it is not a change of
/// the config file.
fn classify(event: &notify::Event, name: &std::ffi::OsStr) -> Option<FileEvent> {
    use notify::event::{AccessKind, AccessMode, ModifyKind, RenameMode};
    // Other files in the directory (logs, say) are none of our business; a ConfigMap
    // announces a new version by swapping its `..data` link.
    let ours = event.paths.iter().any(|p| {
        p.file_name()
            .is_some_and(|f| f == name || f.to_string_lossy().starts_with("..data"))
    });
    if !ours {
        return None;
    }
    match event.kind {
        EventKind::Access(AccessKind::Close(AccessMode::Write)) => Some(FileEvent::Closed),
        // The file (or the `..data` link) moved away: a new one is still to come.
        EventKind::Modify(ModifyKind::Name(RenameMode::From)) => Some(FileEvent::Changed),
        // A rename is atomic: what was renamed in was written whole elsewhere.
        EventKind::Modify(ModifyKind::Name(_)) => Some(FileEvent::Complete),
        EventKind::Modify(ModifyKind::Metadata(_)) => Some(FileEvent::Touched),
        // A creation may be `open(O_CREAT)` with the writes still to come, so it waits like a
        // write; a writer's close (or the content settling) loads it.
        EventKind::Create(_) | EventKind::Modify(_) | EventKind::Remove(_) => {
            Some(FileEvent::Changed)
        }
        // Reads (ours included) are not changes.
        _ => None,
    }
}

/// A change seen on the file but not loaded yet: it is loaded once the content read at
/// `deadline` equals `seen`, read one settle period before.
struct Pending {
    deadline: tokio::time::Instant,
    seen: Option<Vec<u8>>,
}

/// The Pingora background service that turns SIGHUP and changes of the file into reloads.
pub struct ReloadTriggers {
    reloader: Arc<Reloader>,
}

impl ReloadTriggers {
    /// Triggers for `reloader`.
    pub fn new(reloader: Arc<Reloader>) -> ReloadTriggers {
        ReloadTriggers { reloader }
    }
}

#[async_trait]
impl BackgroundService for ReloadTriggers {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut hangup = match signal(SignalKind::hangup()) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!(target: "sluice::reload", error = %e, "cannot listen for SIGHUP");
                None
            }
        };
        let (events_tx, mut events) = tokio::sync::mpsc::unbounded_channel();
        // Watch the directory, not the file: editors and Kubernetes ConfigMaps replace the file
        // by renaming another over it (ConfigMaps swap a `..data` symlink), which a watch on the
        // file itself would lose. Any change in the directory leads to a reload, which does
        // nothing if the file's content is the one in force.
        let _watcher = self.reloader.source().and_then(|file| {
            let dir = file.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
            let name = file.file_name()?.to_os_string();
            let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
                let Ok(e) = event else { return };
                if let Some(kind) = classify(&e, &name) {
                    let _ = events_tx.send(kind);
                }
            })
            .map_err(|e| tracing::warn!(target: "sluice::reload", error = %e, "cannot watch the config file"))
            .ok()?;
            watcher
                .watch(dir, RecursiveMode::NonRecursive)
                .map_err(|e| tracing::warn!(target: "sluice::reload", error = %e, dir = %dir.display(), "cannot watch the config directory"))
                .ok()?;
            Some(watcher)
        });
        // A change made between the first load and the watch would otherwise go unnoticed;
        // a reload of an unchanged file does nothing.
        if _watcher.is_some() {
            let _ = self.reloader.reload("file").await;
        }
        let read = |reloader: &Reloader| reloader.source().and_then(|p| std::fs::read(p).ok());
        let mut pending: Option<Pending> = None;
        // When a writer's close (or a rename) was seen and nothing changed the file since: the
        // file is loaded then, unless a write comes in the meantime (a new writer already at
        // work), which makes it pending again.
        let mut complete: Option<tokio::time::Instant> = None;
        let mut closes_reported = false;
        loop {
            let deadline = pending.as_ref().map(|p| p.deadline);
            tokio::select! {
                _ = shutdown.changed() => break,
                Some(()) = async { match hangup.as_mut() { Some(h) => h.recv().await, None => std::future::pending().await } } => {
                    let _ = self.reloader.reload("sighup").await;
                }
                Some(event) = events.recv() => match event {
                    FileEvent::Closed | FileEvent::Complete => {
                        closes_reported |= event == FileEvent::Closed;
                        pending = None;
                        complete = Some(tokio::time::Instant::now() + CLOSE_GRACE);
                    }
                    // A close just seen stands: the content did not change.
                    FileEvent::Touched if complete.is_some() => {}
                    FileEvent::Changed | FileEvent::Touched => {
                        complete = None;
                        let settle = if closes_reported { SETTLE_WITH_CLOSES } else { SETTLE };
                        let deadline = tokio::time::Instant::now() + settle;
                        match &mut pending {
                            Some(p) => p.deadline = deadline,
                            None => pending = Some(Pending { deadline, seen: read(&self.reloader) }),
                        }
                    }
                },
                _ = async { match complete { Some(d) => tokio::time::sleep_until(d).await, None => std::future::pending().await } } => {
                    complete = None;
                    let _ = self.reloader.reload("file").await;
                }
                _ = async { match deadline { Some(d) => tokio::time::sleep_until(d).await, None => std::future::pending().await } } => {
                    // No event for a settle period: load the file if its content did not move
                    // either (a polling watcher may miss a write), else give it another period.
                    let now = read(&self.reloader);
                    let settled = pending.as_ref().is_some_and(|p| p.seen == now);
                    if settled {
                        pending = None;
                        let _ = self.reloader.reload("file").await;
                    } else {
                        let settle = if closes_reported { SETTLE_WITH_CLOSES } else { SETTLE };
                        pending = Some(Pending { deadline: tokio::time::Instant::now() + settle, seen: now });
                    }
                }
            }
        }
    }
}
