//! The member set of a pool and its health, apart from any way of choosing among the members.
//!
//! Round-robin needs a precomputed schedule over the healthy members; priority and least-used
//! need only to know who is up, who is down and whose trial is due. Keeping the set apart (as
//! pingora-load-balancing keeps `Backends` apart from `LoadBalancer`) lets those policies carry
//! no schedule, and lets a structure derived from the healthy set ([`Rebuild`]) be rebuilt
//! exactly when that set changes, without the member set knowing what it is.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

use arc_swap::ArcSwap;

use crate::health::{HealthPolicy, MemberHealth, Transition};

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

/// Told about every health transition, once, after the member set and everything derived from
/// it have reacted to it.
pub trait HealthObserver: Send + Sync {
    /// `member` went up or down; `cause` says what decided it ("probe", "connect", "trial").
    fn health_changed(&self, member: &MemberSpec, transition: Transition, cause: &'static str);
}

/// A structure derived from the healthy set, such as a round-robin schedule, that must be
/// recomputed whenever a member goes up or down.
///
/// `rebuild` runs on the thread that reported the change, before the [`HealthObserver`] hears
/// of it, and under a lock that serialises rebuilds: the last result stored therefore always
/// reflects the latest health. It must not call back into the [`Members`] it is given except
/// to read it.
pub trait Rebuild: Send + Sync {
    /// Recomputes the structure from `members` as they are now.
    fn rebuild(&self, members: &Members);
}

/// Sentinel for "no member waits for a trial".
const NO_TRIAL: u64 = u64::MAX;

/// The members of a pool, their health, and what follows from it: which members are down and
/// when the next trial of a down member is due.
///
/// Reading it is lock-free (`is_up` per member, the down list behind `ArcSwap`, one atomic for
/// the next due trial); only a health change takes a lock.
pub struct Members {
    members: Box<[MemberSpec]>,
    policy: HealthPolicy,
    observer: Arc<dyn HealthObserver>,
    /// Indices of the members that are down, kept up to date on every change, so that callers
    /// that exclude them (least-used selection) never scan the whole pool per request.
    down: ArcSwap<Vec<u32>>,
    /// Nanoseconds after `epoch` at which the earliest pending trial becomes due, so that
    /// selection looks for trials only when one can actually be claimed.
    earliest_trial: AtomicU64,
    epoch: Instant,
    /// What to rebuild on a change. Weak, so that a schedule dropped with its routing table
    /// does not live on with a member set a newer table still uses; the lock also serialises
    /// rebuilds.
    derived: Mutex<Vec<Weak<dyn Rebuild>>>,
}

impl std::fmt::Debug for Members {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Members")
            .field("members", &self.members)
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

impl Members {
    /// Builds the member set. Members already down (shared health from before a reload) are in
    /// the down list from the start.
    pub fn new(
        members: Vec<MemberSpec>,
        policy: HealthPolicy,
        observer: Arc<dyn HealthObserver>,
    ) -> Members {
        let set = Members {
            members: members.into_boxed_slice(),
            policy,
            observer,
            down: ArcSwap::from_pointee(Vec::new()),
            earliest_trial: AtomicU64::new(NO_TRIAL),
            epoch: Instant::now(),
            derived: Mutex::new(Vec::new()),
        };
        set.refresh();
        set
    }

    /// The members, in config order.
    pub fn members(&self) -> &[MemberSpec] {
        &self.members
    }

    /// The thresholds this member set applies.
    pub fn policy(&self) -> &HealthPolicy {
        &self.policy
    }

    /// Rebuilds `derived` now and on every later health change, for as long as it lives.
    ///
    /// The first rebuild happens under the same lock as later ones, so no change that lands
    /// while subscribing is missed.
    pub fn subscribe(&self, derived: Weak<dyn Rebuild>) {
        let mut all = self.lock_derived();
        if let Some(d) = derived.upgrade() {
            d.rebuild(self);
            all.push(derived);
        }
    }

    /// The members that are down, by index; cheap to call on every request.
    pub fn down_members(&self) -> arc_swap::Guard<Arc<Vec<u32>>> {
        self.down.load()
    }

    /// Claims a down member's single trial request if one is due.
    pub fn take_due_trial(&self, now: Instant) -> Option<usize> {
        self.take_due_trial_except(now, |_| false)
    }

    /// Claims the single trial request of a down member not `excluded`, if one is due. Cheap
    /// (one atomic load) when none is, which is nearly always.
    #[inline]
    pub fn take_due_trial_except(
        &self,
        now: Instant,
        excluded: impl Fn(usize) -> bool,
    ) -> Option<usize> {
        if self.nanos(now) < self.earliest_trial.load(Ordering::Acquire) {
            return None;
        }
        self.claim_trial(now, &excluded)
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

    #[inline]
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

    fn lock_derived(&self) -> std::sync::MutexGuard<'_, Vec<Weak<dyn Rebuild>>> {
        // A panic in a rebuild leaves at worst a stale structure, which the next change
        // replaces; better than refusing every later health report.
        self.derived.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Recomputes everything that follows from the members' health.
    fn refresh(&self) {
        let mut derived = self.lock_derived();
        let down: Vec<u32> = (0..self.members.len() as u32)
            .filter(|&i| !self.members[i as usize].health.is_up())
            .collect();
        self.down.store(Arc::new(down));
        derived.retain(|d| match d.upgrade() {
            Some(d) => {
                d.rebuild(self);
                true
            }
            None => false,
        });
        self.refresh_earliest_trial();
    }

    fn changed(&self, index: usize, transition: Transition, cause: &'static str) {
        self.refresh();
        self.observer
            .health_changed(&self.members[index], transition, cause);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::time::Duration;

    #[derive(Default)]
    pub(crate) struct Recorder(pub(crate) Mutex<Vec<(String, Transition, &'static str)>>);

    impl HealthObserver for Recorder {
        fn health_changed(&self, m: &MemberSpec, t: Transition, cause: &'static str) {
            self.0.lock().unwrap().push((m.id.to_string(), t, cause));
        }
    }

    pub(crate) fn members(weights: &[u32], policy: HealthPolicy) -> (Arc<Members>, Arc<Recorder>) {
        let recorder = Arc::new(Recorder::default());
        let specs = weights
            .iter()
            .enumerate()
            .map(|(i, &weight)| MemberSpec {
                id: format!("m{i}").into(),
                weight,
                health: Arc::new(MemberHealth::new()),
            })
            .collect();
        (
            Arc::new(Members::new(specs, policy, recorder.clone())),
            recorder,
        )
    }

    #[test]
    fn down_members_and_due_trials_are_visible_to_other_policies() {
        let policy = HealthPolicy {
            passive_fall: 1,
            cooldown: Duration::from_secs(5),
            active: None,
        };
        let (pool, _) = members(&[1, 1, 1], policy);
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
    fn excluded_members_do_not_get_the_trial() {
        let policy = HealthPolicy {
            passive_fall: 1,
            cooldown: Duration::ZERO,
            active: None,
        };
        let (pool, _) = members(&[1, 1], policy);
        let t0 = Instant::now();
        pool.report_connect_failure(0, t0);
        assert_eq!(pool.take_due_trial_except(t0, |i| i == 0), None);
        assert_eq!(pool.take_due_trial_except(t0, |_| false), Some(0));
    }

    /// Counts rebuilds and records, at each, which members were down.
    #[derive(Default)]
    struct Snapshots(Mutex<Vec<Vec<u32>>>);

    impl Rebuild for Snapshots {
        fn rebuild(&self, members: &Members) {
            self.0.lock().unwrap().push(members.down_members().to_vec());
        }
    }

    #[test]
    fn derived_structures_follow_every_change_until_dropped() {
        let (pool, recorder) = members(&[1, 1], HealthPolicy::default());
        let t0 = Instant::now();
        pool.report_connect_failure(1, t0);
        let snapshots = Arc::new(Snapshots::default());
        pool.subscribe(Arc::downgrade(&snapshots) as Weak<dyn Rebuild>);
        assert_eq!(
            *snapshots.0.lock().unwrap(),
            [vec![1]],
            "built on subscribing, from the health at that moment"
        );
        pool.report_connect_failure(0, t0);
        assert_eq!(snapshots.0.lock().unwrap().last().unwrap(), &[0, 1]);
        // Neither a success on an up member nor a failure below passive fall changes the set.
        let (steady, _) = members(&[1], HealthPolicy::default());
        steady.subscribe(Arc::downgrade(&snapshots) as Weak<dyn Rebuild>);
        let before = snapshots.0.lock().unwrap().len();
        steady.report_success(0);
        assert_eq!(snapshots.0.lock().unwrap().len(), before);

        drop(snapshots);
        pool.report_probe(0, true, t0);
        assert!(
            pool.lock_derived().is_empty(),
            "a dropped structure is forgotten at the next change"
        );
        assert_eq!(recorder.0.lock().unwrap().len(), 3);
    }
}
