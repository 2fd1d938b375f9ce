//! The naive quota model both quota suites replay traces against (`quota_behaviour`,
//! `quota_props`): every decision is recomputed from the full list of admitted requests.

use std::collections::HashMap;

use sluice_limiter::{Outcome, Window, WindowState};

/// The obviously-correct model: a request admitted at t counts in a window of length L while
/// now < t + L.
#[derive(Default)]
pub struct Model {
    admitted: HashMap<String, Vec<(u64, u64)>>,
}

impl Model {
    pub fn decide(&mut self, key: &str, windows: &[Window], cost: u64, now: u64) -> Outcome {
        let entries = self.admitted.entry(key.to_string()).or_default();
        fn counted(entries: &[(u64, u64)], w: &Window, now: u64) -> Vec<(u64, u64)> {
            let mut v: Vec<(u64, u64)> = entries
                .iter()
                .copied()
                .filter(|&(t, _)| t + w.length_us > now)
                .collect();
            v.sort();
            v
        }
        let mut admitted = true;
        let mut retry_after_us = 0;
        for w in windows {
            let live = counted(entries, w, now);
            let used: u64 = live.iter().map(|e| e.1).sum();
            if used + cost > w.limit {
                admitted = false;
                // The earliest moment at which enough old entries have left.
                let mut left = used;
                let mut wait = w.length_us;
                for &(t, c) in &live {
                    left -= c;
                    if left + cost <= w.limit {
                        wait = t + w.length_us - now;
                        break;
                    }
                }
                retry_after_us = retry_after_us.max(wait);
            }
        }
        if admitted {
            entries.push((now, cost));
        }
        let states = windows
            .iter()
            .map(|w| {
                let live = counted(entries, w, now);
                let used: u64 = live.iter().map(|e| e.1).sum();
                WindowState {
                    remaining: w.limit.saturating_sub(used),
                    reset_us: live.first().map_or(0, |&(t, _)| t + w.length_us - now),
                }
            })
            .collect();
        Outcome {
            admitted,
            retry_after_us,
            windows: states,
        }
    }
}
