//! Smooth weighted round-robin, precomputed.
//!
//! nginx's smooth weighted round-robin (SWRR) spreads a heavy member's turns evenly instead of
//! sending them in a burst. Running SWRR live needs a lock around its running weights, so we run
//! it once, when the member set or its health changes, and store one full period. The hot path is
//! then an atomic cursor into an immutable slice.

/// Above this many `members × total weight` steps, computing the exact SWRR period would stall a
/// worker thread on a health change, so we order by virtual time instead (see [`Schedule::new`]).
const MAX_EXACT_WORK: u64 = 1 << 22;

/// One period of a weighted round-robin order over member indices.
#[derive(Debug, Clone, Default)]
pub struct Schedule {
    order: Box<[u32]>,
}

impl Schedule {
    /// Builds the order for `members`, given as `(index, weight)` pairs.
    ///
    /// Weights are divided by their greatest common divisor first, so `[2, 4]` costs no more
    /// than `[1, 2]`. Equal weights give plain index order. Otherwise the period is the exact
    /// SWRR sequence, in which after any K picks each member of weight w has K·w/W ± 1 of them.
    /// Pools too large for that get an order by virtual time, `(k + ½)·W/w` for a member's k-th
    /// turn, which is as smooth in practice and costs O(W log W).
    pub fn new(members: &[(u32, u32)]) -> Schedule {
        let members: Vec<(u32, u32)> = members.iter().copied().filter(|m| m.1 > 0).collect();
        if members.is_empty() {
            return Schedule::default();
        }
        let divisor = members.iter().fold(0, |g, m| gcd(g, m.1));
        let weights: Vec<u64> = members.iter().map(|m| u64::from(m.1 / divisor)).collect();
        let total: u64 = weights.iter().sum();

        let order: Vec<u32> = if weights.iter().all(|&w| w == 1) {
            members.iter().map(|m| m.0).collect()
        } else if total.saturating_mul(members.len() as u64) <= MAX_EXACT_WORK {
            smooth_weighted(&members, &weights, total)
        } else {
            by_virtual_time(&members, &weights, total)
        };
        Schedule {
            order: order.into_boxed_slice(),
        }
    }

    /// The member index at position `cursor` of the repeating period, or `None` when empty.
    #[inline]
    pub fn at(&self, cursor: usize) -> Option<u32> {
        if self.order.is_empty() {
            None
        } else {
            Some(self.order[cursor % self.order.len()])
        }
    }

    /// Length of one period.
    pub fn len(&self) -> usize {
        self.order.len()
    }

    /// True when no member can be scheduled.
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }
}

fn gcd(a: u32, b: u32) -> u32 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

fn smooth_weighted(members: &[(u32, u32)], weights: &[u64], total: u64) -> Vec<u32> {
    let total = total as i64;
    let mut current = vec![0i64; members.len()];
    let mut order = Vec::with_capacity(total as usize);
    for _ in 0..total {
        let mut best = 0;
        for i in 0..members.len() {
            current[i] += weights[i] as i64;
            // Strictly greater keeps ties on the first member, which makes the order stable.
            if current[i] > current[best] {
                best = i;
            }
        }
        current[best] -= total;
        order.push(members[best].0);
    }
    order
}

fn by_virtual_time(members: &[(u32, u32)], weights: &[u64], total: u64) -> Vec<u32> {
    let mut turns: Vec<(u128, u32)> = Vec::with_capacity(total as usize);
    for (slot, &w) in weights.iter().enumerate() {
        for k in 0..w {
            // 2·(k + ½)·W/w in 32.32 fixed point: integer math keeps the order deterministic.
            let time = (((2 * u128::from(k) + 1) * u128::from(total)) << 32) / u128::from(w);
            turns.push((time, slot as u32));
        }
    }
    turns.sort_unstable();
    turns
        .into_iter()
        .map(|(_, slot)| members[slot as usize].0)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Checks the K·w/W ± 1 bound after every prefix of two full periods.
    fn assert_fair(weights: &[u32]) {
        let members: Vec<(u32, u32)> = weights
            .iter()
            .enumerate()
            .map(|(i, &w)| (i as u32, w))
            .collect();
        let schedule = Schedule::new(&members);
        let total: u64 = weights.iter().map(|&w| u64::from(w)).sum();
        let mut counts = vec![0u64; weights.len()];
        for k in 1..=(2 * schedule.len()) {
            counts[schedule.at(k - 1).unwrap() as usize] += 1;
            for (i, &w) in weights.iter().enumerate() {
                let expected = k as f64 * f64::from(w) / total as f64;
                let got = counts[i] as f64;
                assert!(
                    (got - expected).abs() <= 1.0,
                    "weights {weights:?}: after {k} picks member {i} has {got}, expected {expected:.2} ± 1"
                );
            }
        }
    }

    #[test]
    fn equal_weights_go_in_index_order() {
        let s = Schedule::new(&[(0, 1), (1, 1), (2, 1)]);
        let order: Vec<u32> = (0..6).map(|c| s.at(c).unwrap()).collect();
        assert_eq!(order, [0, 1, 2, 0, 1, 2]);
    }

    #[test]
    fn smooth_order_matches_nginx() {
        // The classic example from nginx's commit: weights 5, 1, 1 give a a b a c a a.
        let s = Schedule::new(&[(0, 5), (1, 1), (2, 1)]);
        let order: Vec<u32> = (0..7).map(|c| s.at(c).unwrap()).collect();
        assert_eq!(order, [0, 0, 1, 0, 2, 0, 0]);
    }

    #[test]
    fn every_prefix_is_within_one_of_its_share() {
        for weights in [
            vec![1, 1, 1],
            vec![5, 1, 1],
            vec![3, 2],
            vec![10, 1],
            vec![7, 3, 11, 2, 1],
            vec![100, 1, 1, 1],
            vec![2, 4, 6],
        ] {
            assert_fair(&weights);
        }
    }

    #[test]
    fn random_weights_are_fair() {
        // A small deterministic generator keeps the test reproducible without a dependency.
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..200 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let n = 1 + (seed % 6) as usize;
            let weights: Vec<u32> = (0..n)
                .map(|i| 1 + ((seed >> (i * 7)) % 20) as u32)
                .collect();
            assert_fair(&weights);
        }
    }

    #[test]
    fn large_pools_use_virtual_time_and_stay_fair() {
        let weights: Vec<u32> = (0..3000).map(|i| 1 + (i % 3)).collect();
        let members: Vec<(u32, u32)> = weights
            .iter()
            .enumerate()
            .map(|(i, &w)| (i as u32, w))
            .collect();
        let schedule = Schedule::new(&members);
        assert_eq!(schedule.len(), weights.iter().sum::<u32>() as usize);
        let mut counts = vec![0u32; weights.len()];
        for c in 0..schedule.len() {
            counts[schedule.at(c).unwrap() as usize] += 1;
        }
        assert_eq!(
            counts, weights,
            "one period gives each member exactly its weight"
        );
    }

    #[test]
    fn zero_weight_and_empty_pools_schedule_nothing() {
        assert!(Schedule::new(&[]).is_empty());
        assert!(Schedule::new(&[(0, 0)]).at(0).is_none());
    }
}
