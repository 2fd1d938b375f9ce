//! Smooth weighted round-robin over the healthy members of a [`Members`] set.
//!
//! The schedule is derived from the healthy set, so it subscribes to it ([`Rebuild`]) and is
//! recomputed on the thread that reports a health change; picking stays an atomic cursor into
//! an immutable schedule, with no lock and no check of whether the set changed.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Instant;

use arc_swap::ArcSwap;

use crate::members::{Members, Rebuild};
use crate::schedule::Schedule;

/// The outcome of [`WeightedRoundRobin::pick`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pick {
    /// Index of the chosen member in [`Members::members`].
    pub index: usize,
    /// True when this request is the single trial of a member that is down. Its outcome must be
    /// reported, or the trial released, or the member waits forever.
    pub trial: bool,
}

/// Health-aware smooth weighted round-robin over a member set.
pub struct WeightedRoundRobin {
    members: Arc<Members>,
    schedule: ArcSwap<Schedule>,
    cursor: AtomicUsize,
}

impl std::fmt::Debug for WeightedRoundRobin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeightedRoundRobin")
            .field("members", &self.members)
            .field("cursor", &self.cursor)
            .finish_non_exhaustive()
    }
}

impl WeightedRoundRobin {
    /// Round-robin over `members`, starting at the first position. The schedule covers the
    /// members up now and follows their health for as long as the returned value lives.
    pub fn new(members: Arc<Members>) -> Arc<WeightedRoundRobin> {
        let rr = Arc::new(WeightedRoundRobin {
            members: members.clone(),
            schedule: ArcSwap::from_pointee(Schedule::default()),
            cursor: AtomicUsize::new(0),
        });
        let derived: Weak<dyn Rebuild> = Arc::downgrade(&rr) as Weak<WeightedRoundRobin>;
        members.subscribe(derived);
        rr
    }

    /// The member set this schedule is over.
    pub fn members(&self) -> &Arc<Members> {
        &self.members
    }

    /// The round-robin position, to carry over to a schedule that replaces this one.
    pub fn cursor(&self) -> usize {
        self.cursor.load(Ordering::Relaxed)
    }

    /// Continues round-robin from `cursor` (the position of the schedule this one replaces).
    pub fn resume_at(&self, cursor: usize) {
        self.cursor.store(cursor, Ordering::Relaxed);
    }

    /// Picks the next member, skipping members that are down and those `excluded` (already
    /// tried by this request). A down member whose cooldown is over gets one trial request
    /// first: without it a passively ejected member would never be seen again.
    pub fn pick(&self, now: Instant, excluded: impl Fn(usize) -> bool) -> Option<Pick> {
        if let Some(index) = self.members.take_due_trial_except(now, &excluded) {
            return Some(Pick { index, trial: true });
        }
        let members = self.members.members();
        let schedule = self.schedule.load();
        let start = self.cursor.fetch_add(1, Ordering::Relaxed);
        for step in 0..schedule.len() {
            let index = schedule.at(start.wrapping_add(step))? as usize;
            // The schedule may lag a health change by a moment, so check the member itself.
            if members[index].health.is_up() && !excluded(index) {
                return Some(Pick {
                    index,
                    trial: false,
                });
            }
        }
        None
    }
}

impl Rebuild for WeightedRoundRobin {
    fn rebuild(&self, members: &Members) {
        let healthy: Vec<(u32, u32)> = members
            .members()
            .iter()
            .enumerate()
            .filter(|(_, m)| m.health.is_up())
            .map(|(i, m)| (i as u32, m.weight))
            .collect();
        self.schedule.store(Arc::new(Schedule::new(&healthy)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::members::tests::members;
    use crate::{HealthPolicy, Transition};
    use std::time::Duration;

    fn pool(weights: &[u32], policy: HealthPolicy) -> (Arc<WeightedRoundRobin>, Arc<Members>) {
        let (set, _) = members(weights, policy);
        (WeightedRoundRobin::new(set.clone()), set)
    }

    fn counts(rr: &WeightedRoundRobin, k: usize, now: Instant) -> Vec<usize> {
        let mut counts = vec![0; rr.members().members().len()];
        for _ in 0..k {
            counts[rr.pick(now, |_| false).unwrap().index] += 1;
        }
        counts
    }

    #[test]
    fn each_member_gets_its_weighted_share() {
        let weights = [3, 1, 2];
        let (rr, _) = pool(&weights, HealthPolicy::default());
        let now = Instant::now();
        for k in [1usize, 5, 6, 17, 600, 1001] {
            rr.resume_at(0);
            let got = counts(&rr, k, now);
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
        let (set, recorder) = members(&[1, 1, 1], HealthPolicy::default());
        let rr = WeightedRoundRobin::new(set.clone());
        let now = Instant::now();
        set.report_connect_failure(1, now);
        assert_eq!(
            recorder.0.lock().unwrap().as_slice(),
            &[("m1".to_string(), Transition::Down, "connect")]
        );
        assert_eq!(counts(&rr, 100, now), [50, 0, 50]);
    }

    #[test]
    fn members_already_down_are_left_out_from_the_start() {
        let (set, _) = members(&[1, 1, 1], HealthPolicy::default());
        let now = Instant::now();
        set.report_connect_failure(0, now);
        let rr = WeightedRoundRobin::new(set);
        assert_eq!(counts(&rr, 100, now), [0, 50, 50]);
    }

    #[test]
    fn excluded_members_are_not_picked_again() {
        let (rr, _) = pool(&[1, 1, 1], HealthPolicy::default());
        let now = Instant::now();
        for _ in 0..10 {
            let p = rr.pick(now, |i| i != 2).unwrap();
            assert_eq!(p.index, 2);
        }
        assert!(rr.pick(now, |_| true).is_none());
    }

    #[test]
    fn all_down_gives_no_member() {
        let (rr, set) = pool(&[1, 1], HealthPolicy::default());
        let now = Instant::now();
        set.report_connect_failure(0, now);
        set.report_connect_failure(1, now);
        assert!(rr.pick(now, |_| false).is_none());
        assert_eq!(set.healthy_count(), 0);
    }

    #[test]
    fn empty_pool_gives_no_member() {
        let (rr, _) = pool(&[], HealthPolicy::default());
        assert!(rr.pick(Instant::now(), |_| false).is_none());
    }

    #[test]
    fn cooldown_gives_exactly_one_trial_then_restores() {
        let policy = HealthPolicy {
            passive_fall: 1,
            cooldown: Duration::from_secs(5),
            active: None,
        };
        let (set, recorder) = members(&[1, 1], policy);
        let rr = WeightedRoundRobin::new(set.clone());
        let t0 = Instant::now();
        set.report_connect_failure(0, t0);
        // Before the cooldown, member 0 gets nothing.
        assert_eq!(counts(&rr, 10, t0 + Duration::from_secs(4)), [0, 10]);
        // After it, the very next pick is member 0's trial, and only one.
        let t1 = t0 + Duration::from_secs(5);
        assert_eq!(
            rr.pick(t1, |_| false),
            Some(Pick {
                index: 0,
                trial: true
            })
        );
        assert_eq!(counts(&rr, 10, t1), [0, 10], "one trial at a time");
        set.report_success(0);
        assert_eq!(counts(&rr, 10, t1), [5, 5]);
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
        let (rr, set) = pool(&[1, 1], policy);
        let t0 = Instant::now();
        set.report_connect_failure(0, t0);
        let t1 = t0 + Duration::from_secs(5);
        assert!(rr.pick(t1, |_| false).unwrap().trial);
        set.report_connect_failure(0, t1);
        assert_eq!(counts(&rr, 10, t1 + Duration::from_secs(4)), [0, 10]);
        assert!(
            rr.pick(t1 + Duration::from_secs(5), |_| false)
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
        let (set, recorder) = members(&[1, 1], policy);
        let rr = WeightedRoundRobin::new(set.clone());
        let t = Instant::now();
        set.report_connect_failure(0, t);
        assert_eq!(
            counts(&rr, 4, t + Duration::from_secs(60)),
            [0, 4],
            "no trial with active checks"
        );
        set.report_probe(0, true, t);
        assert_eq!(set.healthy_count(), 1);
        set.report_probe(0, true, t);
        assert_eq!(set.healthy_count(), 2);
        assert_eq!(
            recorder.0.lock().unwrap().last().unwrap(),
            &("m0".to_string(), Transition::Up, "probe")
        );
        assert_eq!(counts(&rr, 4, t), [2, 2], "the schedule has it back");
    }

    #[test]
    fn two_schedules_over_one_set_both_follow_its_health() {
        let (set, _) = members(&[1, 1], HealthPolicy::default());
        let (a, b) = (
            WeightedRoundRobin::new(set.clone()),
            WeightedRoundRobin::new(set.clone()),
        );
        b.resume_at(a.cursor() + 1);
        set.report_connect_failure(0, Instant::now());
        let now = Instant::now();
        assert_eq!(counts(&a, 4, now), [0, 4]);
        assert_eq!(counts(&b, 4, now), [0, 4]);
    }

    #[test]
    fn concurrent_picks_stay_fair() {
        let (rr, _) = pool(&[1, 2, 1], HealthPolicy::default());
        let now = Instant::now();
        let per_thread = 4000;
        let totals: Vec<Vec<usize>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4)
                .map(|_| s.spawn(|| counts(&rr, per_thread, now)))
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
