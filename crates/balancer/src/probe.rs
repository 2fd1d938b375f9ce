//! Active health checks: one background task per member, never per request.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use tokio::task::JoinHandle;

use crate::members::Members;

/// One way of asking a member whether it is healthy. The gateway implements HTTP probes over
/// its own connector; [`TcpProbe`] is the simplest kind.
#[async_trait]
pub trait Probe: Send + Sync + 'static {
    /// Ok when the member looks healthy, else a short reason for the logs.
    async fn check(&self) -> Result<(), String>;
}

/// Healthy when a TCP connection can be opened.
#[derive(Debug, Clone)]
pub struct TcpProbe {
    /// Where to connect.
    pub addr: SocketAddr,
}

#[async_trait]
impl Probe for TcpProbe {
    async fn check(&self) -> Result<(), String> {
        tokio::net::TcpStream::connect(self.addr)
            .await
            .map(drop)
            .map_err(|e| e.to_string())
    }
}

/// How often and how patiently a member is probed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ActiveCheck {
    /// Time between the starts of two probes.
    pub interval: Duration,
    /// A probe that takes longer counts as a failure.
    pub timeout: Duration,
}

/// Where a check loop sends its results. A config reload can point an existing loop at the
/// member's place in a new pool, so an unchanged member keeps its task and its health.
pub type ProbeReport = Arc<dyn Fn(bool, Instant) + Send + Sync>;

/// Reports to member `index` of `pool`.
pub fn report_to(pool: Arc<Members>, index: usize) -> ProbeReport {
    Arc::new(move |ok, now| pool.report_probe(index, ok, now))
}

/// Spawns a check loop on the current tokio runtime: every `check.interval` it runs `probe`
/// (a run longer than `check.timeout` fails) and hands the result to `report`. The task runs
/// until aborted through the returned handle; dropping the handle does not stop it.
pub fn spawn_active_check(
    probe: Arc<dyn Probe>,
    check: ActiveCheck,
    report: ProbeReport,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut ticker = tokio::time::interval(check.interval);
        // A stalled runtime must not make probes fire in a burst afterwards.
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            let ok = matches!(
                tokio::time::timeout(check.timeout, probe.check()).await,
                Ok(Ok(()))
            );
            report(ok, Instant::now());
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{HealthObserver, HealthPolicy, MemberHealth, MemberSpec, Transition};
    use std::sync::Mutex;

    #[derive(Default)]
    struct Recorder(Mutex<Vec<Transition>>);
    impl HealthObserver for Recorder {
        fn health_changed(&self, _: &MemberSpec, t: Transition, _: &'static str) {
            self.0.lock().unwrap().push(t);
        }
    }

    #[tokio::test]
    async fn tcp_probes_take_a_closed_port_down_and_an_open_one_up() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);

        let recorder = Arc::new(Recorder::default());
        let pool = Arc::new(Members::new(
            vec![MemberSpec {
                id: "m".into(),
                weight: 1,
                health: Arc::new(MemberHealth::new()),
            }],
            HealthPolicy {
                passive_fall: 1,
                cooldown: Duration::from_secs(1),
                active: Some((2, 2)),
            },
            recorder.clone(),
        ));
        let check = ActiveCheck {
            interval: Duration::from_millis(20),
            timeout: Duration::from_millis(500),
        };
        let task = spawn_active_check(
            Arc::new(TcpProbe { addr }),
            check,
            report_to(pool.clone(), 0),
        );

        let deadline = Instant::now() + Duration::from_secs(5);
        while pool.healthy_count() != 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(pool.healthy_count(), 0, "closed port must be marked down");

        let _listener = tokio::net::TcpListener::bind(addr).await.unwrap();
        while pool.healthy_count() != 1 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(pool.healthy_count(), 1, "open port must come back up");
        task.abort();
        assert_eq!(
            recorder.0.lock().unwrap().as_slice(),
            &[Transition::Down, Transition::Up]
        );
    }
}
