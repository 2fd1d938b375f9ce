//! `WeightedRoundRobin::pick` on the request path, and the schedule rebuild a health change
//! triggers.
//!
//! Run: `cargo bench -p sluice-balancer --bench pick -- --warm-up-time 1 --measurement-time 3`.
//! Every `pick` measured here includes one `Instant::now()`, as on the request path; the
//! `instant_now` case measures that call alone so it can be subtracted.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use sluice_balancer::{
    HealthObserver, HealthPolicy, MemberHealth, MemberSpec, Members, Schedule, Transition,
    WeightedRoundRobin,
};

const SIZES: [usize; 3] = [3, 100, 10_000];

struct Quiet;

impl HealthObserver for Quiet {
    fn health_changed(&self, _: &MemberSpec, _: Transition, _: &'static str) {}
}

/// Equal weights (all 1), or weights cycling through 1..=5.
#[derive(Clone, Copy)]
enum Weights {
    Equal,
    Mixed,
}

impl Weights {
    fn of(self, i: usize) -> u32 {
        match self {
            Weights::Equal => 1,
            Weights::Mixed => 1 + (i % 5) as u32,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Weights::Equal => "equal",
            Weights::Mixed => "mixed1-5",
        }
    }
}

fn pool(n: usize, weights: Weights) -> Arc<WeightedRoundRobin> {
    let members = (0..n)
        .map(|i| MemberSpec {
            id: format!("http://10.0.{}.{}:80", i / 256, i % 256).into(),
            weight: weights.of(i),
            health: Arc::new(MemberHealth::new()),
        })
        .collect();
    // A cooldown far longer than any run: no member comes up for a trial while we measure.
    let policy = HealthPolicy {
        passive_fall: 1,
        cooldown: Duration::from_secs(24 * 3600),
        active: None,
    };
    WeightedRoundRobin::new(Arc::new(Members::new(members, policy, Arc::new(Quiet))))
}

/// Marks every tenth member down (at least one), through the same passive path live traffic uses.
fn mark_tenth_down(pool: &Members) -> usize {
    let n = pool.members().len();
    let down = (n / 10).max(1);
    let now = Instant::now();
    for k in 0..down {
        pool.report_connect_failure(k * 10 % n, now);
    }
    assert_eq!(pool.healthy_count(), n - down);
    down
}

fn bench_pick(c: &mut Criterion) {
    let mut group = c.benchmark_group("pick");
    for weights in [Weights::Equal, Weights::Mixed] {
        for n in SIZES {
            let p = pool(n, weights);
            group.bench_function(
                BenchmarkId::new(format!("{}/all_up", weights.name()), n),
                |b| b.iter(|| black_box(p.pick(Instant::now(), |_| false))),
            );
            let p = pool(n, weights);
            mark_tenth_down(p.members());
            group.bench_function(
                BenchmarkId::new(format!("{}/tenth_down", weights.name()), n),
                |b| b.iter(|| black_box(p.pick(Instant::now(), |_| false))),
            );
        }
    }
    group.finish();
    c.bench_function("instant_now", |b| b.iter(|| black_box(Instant::now())));
}

/// What one health change costs: the schedule over all members is computed again.
fn bench_rebuild(c: &mut Criterion) {
    let mut group = c.benchmark_group("schedule_rebuild");
    for weights in [Weights::Equal, Weights::Mixed] {
        for n in SIZES {
            let members: Vec<(u32, u32)> = (0..n).map(|i| (i as u32, weights.of(i))).collect();
            group.bench_function(BenchmarkId::new(weights.name(), n), |b| {
                b.iter(|| black_box(Schedule::new(black_box(&members))))
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench_pick, bench_rebuild);
criterion_main!(benches);
