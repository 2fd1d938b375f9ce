//! A pool: members, their health, and the round-robin schedule over the healthy ones.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use arc_swap::ArcSwap;

use crate::health::{HealthPolicy, MemberHealth, Transition};
use crate::schedule::Schedule;

/// A member as the pool sees it. `health` is shared so that a member that survives a config
/// reload keeps its state.
#[derive(Debug, Clone)]
pub struct MemberSpec {
    /// The member's identity, its URL in sluice.
    pub id: Arc<str>,
    /// Round-robin weight, at least 1.
    pub weight: u32,
    /// Shared health state.
    pub health: Arc<MemberHealth>,
}

/// Told about every health transition, once, after the pool has reacted to it.
pub trait HealthObserver: Send + Sync {
    /// `member` went up or down; `cause` says what decided it ("probe", "connect", "trial").
    fn health_changed(&self, member: &MemberSpec, transition: Transition, cause: &'static str);
}

/// The outcome of [`Pool::pick`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pick {
    /// Index of the chosen member in [`Pool::members`].
    pub index: usize,
    /// True when this request is the single trial of a member that is down. Its outcome must be
    /// reported, or the trial released, or the member waits forever.
    pub trial: bool,
}

/// Sentinel for "no member waits for a trial".
const NO_TRIAL: u64 = u64::MAX;

/// Members, their health and a health-aware smooth weighted round-robin.
///
/// The hot path (`pick`, `report_success` on a healthy member) is lock-free: an atomic cursor
/// into an immutable schedule behind `ArcSwap`. The schedule is rebuilt only when a member's
/// health changes.
pub struct Pool {
    members: Box<[MemberSpec]>,
    policy: HealthPolicy,
    observer: Arc<dyn HealthObserver>,
    schedule: ArcSwap<Schedule>,
    /// Indices of the members that are down, kept with the schedule, so that callers that
    /// exclude them (least-used selection) never scan the whole pool per request.
    down: ArcSwap<Vec<u32>>,
    cursor: AtomicUsize,
    /// Nanoseconds after `epoch` at which the earliest pending trial becomes due, so that `pick`
    /// looks for trials only when one can actually be claimed.
    earliest_trial: AtomicU64,
    epoch: Instant,
    /// Serialises schedule rebuilds so the last one stored always reflects the latest health.
    rebuild: Mutex<()>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("members", &self.members)
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

impl Pool {
    /// Builds a pool. Members already down (shared health from before a reload) are left out of
    /// the schedule from the start.
    pub fn new(
        members: Vec<MemberSpec>,
        policy: HealthPolicy,
        observer: Arc<dyn HealthObserver>,
    ) -> Pool {
        let pool = Pool {
            members: members.into_boxed_slice(),
            policy,
            observer,
            schedule: ArcSwap::from_pointee(Schedule::default()),
            down: ArcSwap::from_pointee(Vec::new()),
            cursor: AtomicUsize::new(0),
            earliest_trial: AtomicU64::new(NO_TRIAL),
            epoch: Instant::now(),
            rebuild: Mutex::new(()),
        };
        pool.rebuild_schedule();
        pool
    }

    /// The members, in config order.
    pub fn members(&self) -> &[MemberSpec] {
        &self.members
    }

    /// The thresholds this pool applies.
    pub fn policy(&self) -> &HealthPolicy {
        &self.policy
    }

    /// The round-robin position, to carry over to a pool that replaces this one.
    pub fn cursor(&self) -> usize {
        self.cursor.load(Ordering::Relaxed)
    }

    /// Continues round-robin from `cursor` (the position of the pool this one replaces).
    pub fn resume_at(&self, cursor: usize) {
        self.cursor.store(cursor, Ordering::Relaxed);
    }

    /// Picks the next member, skipping members that are down and those `excluded` (already
    /// tried by this request). A down member whose cooldown is over gets one trial request
    /// first: without it a passively ejected member would never be seen again.
    pub fn pick(&self, now: Instant, excluded: impl Fn(usize) -> bool) -> Option<Pick> {
        if self.nanos(now) >= self.earliest_trial.load(Ordering::Acquire) {
            if let Some(index) = self.claim_trial(now, &excluded) {
                return Some(Pick { index, trial: true });
            }
        }
        let schedule = self.schedule.load();
        let start = self.cursor.fetch_add(1, Ordering::Relaxed);
        for step in 0..schedule.len() {
            let index = schedule.at(start.wrapping_add(step))? as usize;
            // The schedule may lag a health change by a moment, so check the member itself.
            if self.members[index].health.is_up() && !excluded(index) {
                return Some(Pick {
                    index,
                    trial: false,
                });
            }
        }
        None
    }

    /// The members that are down, by index; cheap to call on every request.
    pub fn down_members(&self) -> arc_swap::Guard<Arc<Vec<u32>>> {
        self.down.load()
    }

    /// Claims a down member's single trial request if one is due, for selection policies other
    /// than round-robin (round-robin's `pick` does this itself).
    pub fn take_due_trial(&self, now: Instant) -> Option<usize> {
        if self.nanos(now) < self.earliest_trial.load(Ordering::Acquire) {
            return None;
        }
        self.claim_trial(now, &|_| false)
    }

    /// Live traffic reached member `index` (a connection was made and a response came back).
    pub fn report_success(&self, index: usize) {
        if let Some(t) = self.members[index].health.record_success() {
            self.changed(index, t, "trial");
        }
    }

    /// Live traffic failed to connect to member `index`, or timed out connecting.
    pub fn report_connect_failure(&self, index: usize, now: Instant) {
        let t = self.members[index]
            .health
            .record_connect_failure(&self.policy, now);
        match t {
            Some(t) => self.changed(index, t, "connect"),
            // A failed trial re-arms the cooldown without a transition.
            None => self.refresh_earliest_trial(),
        }
    }

    /// An active probe of member `index` finished.
    pub fn report_probe(&self, index: usize, ok: bool, now: Instant) {
        if let Some(t) = self.members[index]
            .health
            .record_probe(ok, &self.policy, now)
        {
            self.changed(index, t, "probe");
        }
    }

    /// A trial pick was not used (the request ended before connecting); let another request
    /// take it.
    pub fn release_trial(&self, index: usize, now: Instant) {
        self.members[index].health.release_trial(now);
        self.refresh_earliest_trial();
    }

    /// Number of members currently up.
    pub fn healthy_count(&self) -> usize {
        self.members.iter().filter(|m| m.health.is_up()).count()
    }

    fn nanos(&self, t: Instant) -> u64 {
        u64::try_from(t.saturating_duration_since(self.epoch).as_nanos()).unwrap_or(NO_TRIAL - 1)
    }

    fn claim_trial(&self, now: Instant, excluded: &impl Fn(usize) -> bool) -> Option<usize> {
        let claimed = (0..self.members.len())
            .find(|&i| !excluded(i) && self.members[i].health.try_claim_trial(now));
        self.refresh_earliest_trial();
        claimed
    }

    fn refresh_earliest_trial(&self) {
        let earliest = self
            .members
            .iter()
            .filter_map(|m| m.health.trial_due())
            .map(|t| self.nanos(t))
            .min()
            .unwrap_or(NO_TRIAL);
        self.earliest_trial.store(earliest, Ordering::Release);
    }

    fn rebuild_schedule(&self) {
        let _serialised = self.rebuild.lock().unwrap_or_else(|p| p.into_inner());
        let healthy: Vec<(u32, u32)> = self
            .members
            .iter()
            .enumerate()
            .filter(|(_, m)| m.health.is_up())
            .map(|(i, m)| (i as u32, m.weight))
            .collect();
        self.schedule.store(Arc::new(Schedule::new(&healthy)));
        let down: Vec<u32> = (0..self.members.len() as u32)
            .filter(|&i| !self.members[i as usize].health.is_up())
            .collect();
        self.down.store(Arc::new(down));
        self.refresh_earliest_trial();
    }

    fn changed(&self, index: usize, transition: Transition, cause: &'static str) {
        self.rebuild_schedule();
        self.observer
            .health_changed(&self.members[index], transition, cause);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[derive(Default)]
    struct Recorder(Mutex<Vec<(String, Transition, &'static str)>>);

    impl HealthObserver for Recorder {
        fn health_changed(&self, m: &MemberSpec, t: Transition, cause: &'static str) {
            self.0.lock().unwrap().push((m.id.to_string(), t, cause));
        }
    }

    fn pool(weights: &[u32], policy: HealthPolicy) -> (Pool, Arc<Recorder>) {
        let recorder = Arc::new(Recorder::default());
        let members = weights
            .iter()
            .enumerate()
            .map(|(i, &weight)| MemberSpec {
                id: format!("m{i}").into(),
                weight,
                health: Arc::new(MemberHealth::new()),
            })
            .collect();
        (Pool::new(members, policy, recorder.clone()), recorder)
    }

    fn counts(pool: &Pool, k: usize, now: Instant) -> Vec<usize> {
        let mut counts = vec![0; pool.members().len()];
        for _ in 0..k {
            counts[pool.pick(now, |_| false).unwrap().index] += 1;
        }
        counts
    }

    #[test]
    fn each_member_gets_its_weighted_share() {
        let weights = [3, 1, 2];
        let (pool, _) = pool(&weights, HealthPolicy::default());
        let now = Instant::now();
        for k in [1usize, 5, 6, 17, 600, 1001] {
            pool.resume_at(0);
            let got = counts(&pool, k, now);
            for (i, &w) in weights.iter().enumerate() {
                let expected = k as f64 * f64::from(w) / 6.0;
                assert!(
                    (got[i] as f64 - expected).abs() <= 1.0,
                    "K={k}: member {i} got {}, expected {expected:.2} ± 1",
                    got[i]
                );
            }
        }
    }

    #[test]
    fn down_members_are_skipped_and_the_rest_share_evenly() {
        let (pool, recorder) = pool(&[1, 1, 1], HealthPolicy::default());
        let now = Instant::now();
        pool.report_connect_failure(1, now);
        assert_eq!(
            recorder.0.lock().unwrap().as_slice(),
            &[("m1".to_string(), Transition::Down, "connect")]
        );
        assert_eq!(counts(&pool, 100, now), [50, 0, 50]);
    }

    #[test]
    fn excluded_members_are_not_picked_again() {
        let (pool, _) = pool(&[1, 1, 1], HealthPolicy::default());
        let now = Instant::now();
        for _ in 0..10 {
            let p = pool.pick(now, |i| i != 2).unwrap();
            assert_eq!(p.index, 2);
        }
        assert!(pool.pick(now, |_| true).is_none());
    }

    #[test]
    fn down_members_and_due_trials_are_visible_to_other_policies() {
        let policy = HealthPolicy {
            passive_fall: 1,
            cooldown: Duration::from_secs(5),
            active: None,
        };
        let (pool, _) = pool(&[1, 1, 1], policy);
        let t0 = Instant::now();
        assert!(pool.down_members().is_empty());
        pool.report_connect_failure(2, t0);
        assert_eq!(**pool.down_members(), [2]);
        assert_eq!(pool.take_due_trial(t0 + Duration::from_secs(4)), None);
        assert_eq!(pool.take_due_trial(t0 + Duration::from_secs(5)), Some(2));
        assert_eq!(
            pool.take_due_trial(t0 + Duration::from_secs(6)),
            None,
            "one trial"
        );
        pool.report_success(2);
        assert!(pool.down_members().is_empty());
    }

    #[test]
    fn all_down_gives_no_member() {
        let (pool, _) = pool(&[1, 1], HealthPolicy::default());
        let now = Instant::now();
        pool.report_connect_failure(0, now);
        pool.report_connect_failure(1, now);
        assert!(pool.pick(now, |_| false).is_none());
        assert_eq!(pool.healthy_count(), 0);
    }

    #[test]
    fn empty_pool_gives_no_member() {
        let (pool, _) = pool(&[], HealthPolicy::default());
        assert!(pool.pick(Instant::now(), |_| false).is_none());
    }

    #[test]
    fn cooldown_gives_exactly_one_trial_then_restores() {
        let policy = HealthPolicy {
            passive_fall: 1,
            cooldown: Duration::from_secs(5),
            active: None,
        };
        let (pool, recorder) = pool(&[1, 1], policy);
        let t0 = Instant::now();
        pool.report_connect_failure(0, t0);
        // Before the cooldown, member 0 gets nothing.
        assert_eq!(counts(&pool, 10, t0 + Duration::from_secs(4)), [0, 10]);
        // After it, the very next pick is member 0's trial, and only one.
        let t1 = t0 + Duration::from_secs(5);
        assert_eq!(
            pool.pick(t1, |_| false),
            Some(Pick {
                index: 0,
                trial: true
            })
        );
        assert_eq!(counts(&pool, 10, t1), [0, 10], "one trial at a time");
        pool.report_success(0);
        assert_eq!(counts(&pool, 10, t1), [5, 5]);
        let events = recorder.0.lock().unwrap();
        assert_eq!(
            events.last().unwrap(),
            &("m0".to_string(), Transition::Up, "trial")
        );
    }

    #[test]
    fn failed_trial_rearms_the_cooldown() {
        let policy = HealthPolicy {
            passive_fall: 1,
            cooldown: Duration::from_secs(5),
            active: None,
        };
        let (pool, _) = pool(&[1, 1], policy);
        let t0 = Instant::now();
        pool.report_connect_failure(0, t0);
        let t1 = t0 + Duration::from_secs(5);
        assert!(pool.pick(t1, |_| false).unwrap().trial);
        pool.report_connect_failure(0, t1);
        assert_eq!(counts(&pool, 10, t1 + Duration::from_secs(4)), [0, 10]);
        assert!(
            pool.pick(t1 + Duration::from_secs(5), |_| false)
                .unwrap()
                .trial
        );
    }

    #[test]
    fn active_checks_restore_after_rise() {
        let policy = HealthPolicy {
            passive_fall: 1,
            cooldown: Duration::from_secs(1),
            active: Some((2, 3)),
        };
        let (pool, recorder) = pool(&[1, 1], policy);
        let t = Instant::now();
        pool.report_connect_failure(0, t);
        assert_eq!(
            counts(&pool, 4, t + Duration::from_secs(60)),
            [0, 4],
            "no trial with active checks"
        );
        pool.report_probe(0, true, t);
        assert_eq!(pool.healthy_count(), 1);
        pool.report_probe(0, true, t);
        assert_eq!(pool.healthy_count(), 2);
        assert_eq!(
            recorder.0.lock().unwrap().last().unwrap(),
            &("m0".to_string(), Transition::Up, "probe")
        );
    }

    #[test]
    fn concurrent_picks_stay_fair() {
        let (pool, _) = pool(&[1, 2, 1], HealthPolicy::default());
        let pool = Arc::new(pool);
        let now = Instant::now();
        let per_thread = 4000;
        let totals: Vec<Vec<usize>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4)
                .map(|_| s.spawn(|| counts(&pool, per_thread, now)))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let mut sum = [0usize; 3];
        for t in &totals {
            for i in 0..3 {
                sum[i] += t[i];
            }
        }
        // 16000 picks over weights 1:2:1 is whole periods, so the split is exact.
        assert_eq!(sum, [4000, 8000, 4000]);
    }
}
