use super::*;
use sluice_balancer::{HealthObserver, HealthPolicy, MemberHealth, MemberSpec, Transition};
use std::time::Duration;

struct Quiet;
impl HealthObserver for Quiet {
    fn health_changed(&self, _: &MemberSpec, _: Transition, _: &'static str) {}
}

/// A passive-only pool of one member, down and due for its trial.
fn pool_with_a_due_trial() -> Arc<Members> {
    let policy = HealthPolicy {
        passive_fall: 1,
        cooldown: Duration::ZERO,
        active: None,
    };
    let pool = Arc::new(Members::new(
        vec![MemberSpec {
            id: "m".into(),
            weight: 1,
            health: Arc::new(MemberHealth::new()),
        }],
        policy,
        Arc::new(Quiet),
    ));
    pool.report_connect_failure(0, Instant::now());
    pool
}

#[test]
fn a_dropped_attempt_gives_its_trial_back() {
    let pool = pool_with_a_due_trial();
    let index = pool
        .take_due_trial(Instant::now())
        .expect("the trial is due");
    drop(Attempt::new(pool.clone(), index, true));
    assert_eq!(
        pool.take_due_trial(Instant::now()),
        Some(0),
        "the next request gets the trial"
    );
}

#[test]
fn a_settled_attempt_keeps_its_outcome() {
    let pool = pool_with_a_due_trial();
    let index = pool.take_due_trial(Instant::now()).unwrap();
    let mut attempt = Attempt::new(pool.clone(), index, true);
    attempt.connected();
    drop(attempt);
    assert_eq!(pool.healthy_count(), 1, "the trial succeeded");
}

fn three_members() -> Arc<Members> {
    let specs = (0..3)
        .map(|i| MemberSpec {
            id: format!("m{i}").into(),
            weight: 1,
            health: Arc::new(MemberHealth::new()),
        })
        .collect();
    Arc::new(Members::new(
        specs,
        HealthPolicy::default(),
        Arc::new(Quiet),
    ))
}

#[test]
fn a_replacing_policy_goes_on_from_the_previous_position() {
    let route: Arc<str> = "r".into();
    let pool = three_members();
    let old = Policy::new(
        &Selection::named("round_robin"),
        &route,
        &pool,
        None,
        Limits::plain(&pool),
    );
    let schedule = old.schedule().unwrap().clone();
    schedule.pick(Instant::now(), |_| false);
    schedule.pick(Instant::now(), |_| false);

    let same = Policy::new(
        &Selection::named("round_robin"),
        &route,
        &pool,
        Some(&old),
        Limits::plain(&pool),
    );
    assert!(
        Arc::ptr_eq(same.schedule().unwrap(), &schedule),
        "an unchanged member set keeps its schedule, shared with requests of the old table"
    );

    let other = three_members();
    let moved = Policy::new(
        &Selection::named("least_used"),
        &route,
        &other,
        Some(&same),
        Limits::plain(&other),
    );
    let fallback = moved.schedule().unwrap();
    assert!(!Arc::ptr_eq(fallback, &schedule));
    assert_eq!(fallback.cursor(), 2, "a new member set goes on from there");

    let priority = Policy::new(
        &Selection::named("priority"),
        &route,
        &pool,
        Some(&moved),
        Limits::plain(&pool),
    );
    assert!(priority.schedule().is_none(), "priority needs no schedule");
}
/// `sluice check`'s errors for `yaml`, the policies' rules included.
fn check(yaml: &str) -> Vec<String> {
    match Config::parse_with("t.yaml", yaml, &RULES) {
        Ok(_) => Vec::new(),
        Err(e) => {
            e.0.iter()
                .map(|e| format!("{}:{}: {}: {}", e.line, e.column, e.path, e.message))
                .collect()
        }
    }
}

fn one_error(yaml: &str, at: &str, message: &str) {
    let all = check(yaml);
    assert!(
        all.len() == 1 && all[0].starts_with(&format!("{at}: ")) && all[0].contains(message),
        "expected one error `{at}: …{message}…`, got {all:#?}"
    );
}

#[test]
fn each_policy_brings_its_own_rules() {
    one_error(
        "routes:\n  - name: a\n    upstream:\n      selection: least_used\n      members:\n        - url: \"http://127.0.0.1:1\"\n          weight: 2\n",
        "7:19: routes[0].upstream.members[0].weight",
        "weight applies to round_robin only; least_used counts assignments",
    );
    one_error(
        "routes:\n  - name: a\n    upstream:\n      selection: priority\n      members:\n        - {url: \"http://a.test\", weight: 2}\n",
        "6:42: routes[0].upstream.members[0].weight",
        "weight applies to round_robin only; priority follows the list order",
    );
    // Only a policy that counts has a count to restore.
    for policy in ["round_robin", "priority"] {
        one_error(
            &format!("routes:\n  - name: a\n    upstream:\n      selection: {policy}\n      on_restore: keep\n"),
            "5:19: routes[0].upstream.on_restore",
            &format!("on_restore applies to selection: least_used only: {policy} keeps no count"),
        );
    }
    one_error(
        "routes:\n  - name: a\n    upstream:\n      on_restore: min\n",
        "4:19: routes[0].upstream.on_restore",
        "applies to selection: least_used only",
    );
    one_error(
        "routes:\n  - name: a\n    upstream:\n      selection: random\n",
        "4:18: routes[0].upstream.selection",
        "unknown selection \"random\"; one of: round_robin, least_used, priority",
    );
    assert_eq!(
        check("routes:\n  - name: a\n    upstream:\n      selection: least_used\n      on_restore: min\n      members:\n        - url: \"http://a.test\"\n"),
        Vec::<String>::new()
    );
}

#[test]
fn every_policy_is_known_by_its_own_name_in_status() {
    let route: Arc<str> = "r".into();
    let pool = three_members();
    for entry in KINDS {
        let policy = Policy::new(
            &Selection::named(entry.name),
            &route,
            &pool,
            None,
            Limits::plain(&pool),
        );
        assert_eq!(policy.name(), entry.name);
        assert_eq!(policy.counts(), entry.name == "least_used");
    }
}

#[test]
fn calendar_and_unit_windows_pass_check_wherever_a_window_can_be() {
    // A plain request-counting route, a member's and a client's windows: calendar periods
    // and usage units are metered everywhere.
    let plain = "routes:\n  - name: a\n    upstream: {}\n    quota:\n      windows: [{ name: m, limit: 9, window: calendar_month, tz: Europe/Paris }]\n";
    assert_eq!(check(plain), Vec::<String>::new());
    let member = "routes:\n  - name: a\n    upstream:\n      members:\n        - url: \"https://a.test\"\n          quota: { windows: [{ name: d, limit: 9, window: calendar_day }] }\n";
    assert_eq!(check(member), Vec::<String>::new());
    let client = "clients:\n  list:\n    - name: c\n      tokens: [\"0123456789abcdef\"]\n      routes: [\"*\"]\n      quota: { windows: [{ name: d, limit: 9, window: calendar_week, unit: tokens }, { name: r, limit: 9, window: calendar_day }] }\nroutes:\n  - name: a\n    upstream: {}\n    quota:\n      windows: [{ name: t, limit: 9, window: 1m, unit: tokens }]\n      usage:\n        tokens: { reserve: { value: 1 }, settle: { json: usage.total_tokens } }\n";
    assert_eq!(check(client), Vec::<String>::new());
}

/// The member an admission gave (`None` when it said no member is eligible).
fn first_member(admission: &Admission) -> Option<usize> {
    match admission {
        Admission::Admitted { first, .. } => {
            Some(first.as_ref().expect("an in-process pick").index())
        }
        Admission::NoMember { .. } => None,
        _ => panic!("an admission without a quota is admitted or finds no member"),
    }
}

/// Round-robin and priority admit a request without a quota or a reservation in process,
/// without `admit`'s future, only when the route has none of the limits the store must weigh:
/// a cooldown, leases, stickiness or a member's own windows each send it to `admit`.
#[test]
fn the_in_process_admission_is_used_only_without_limits() {
    let route: Arc<str> = "r".into();
    let pool = three_members();
    let state: Arc<dyn StateStore> = Arc::new(sluice_allocator::MemoryStore::new());
    let with = |change: &dyn Fn(&mut Limits)| {
        let mut limits = Limits::plain(&pool);
        change(&mut limits);
        limits
    };
    let windowed: Arc<[PoolMember]> = pool
        .members()
        .iter()
        .enumerate()
        .map(|(i, m)| PoolMember {
            id: m.id.clone(),
            windows: if i == 1 {
                vec![sluice_limiter::Window {
                    name: "w".into(),
                    limit: 10,
                    length_us: 1_000_000,
                }]
                .into()
            } else {
                Vec::new().into()
            },
        })
        .collect();
    let limited = [
        ("a cooldown", with(&|l| l.cooldowns = true)),
        (
            "leases",
            with(&|l| {
                l.leases = Some(LeasePlan::new(
                    route.clone(),
                    Duration::from_secs(60),
                    Some(1),
                    None,
                    &state,
                ))
            }),
        ),
        ("stickiness", with(&|l| l.sticky = true)),
        (
            "a member's windows",
            with(&|l| l.members = windowed.clone()),
        ),
    ];
    for selection in ["round_robin", "priority"] {
        let plain = Policy::new(
            &Selection::named(selection),
            &route,
            &pool,
            None,
            Limits::plain(&pool),
        );
        assert!(
            plain.selector.admit_in_process().is_some(),
            "{selection} without limits"
        );
        for (name, limits) in &limited {
            let policy = Policy::new(
                &Selection::named(selection),
                &route,
                &pool,
                None,
                limits.clone(),
            );
            assert!(
                policy.selector.admit_in_process().is_none(),
                "{selection} with {name}"
            );
        }
    }
    // Least-used counts in the store: never in process. (Least-in-flight always has leases on a
    // route, which the table gives it, so the case above covers it.)
    let least_used = Policy::new(
        &Selection::named("least_used"),
        &route,
        &pool,
        None,
        Limits::plain(&pool),
    );
    assert!(least_used.selector.admit_in_process().is_none());
}

/// The in-process admission answers as `admit` does: two policies over two like pools, one
/// admitted each way, pick the same members in the same order, and both find no member when
/// every member is down.
#[tokio::test]
async fn the_in_process_admission_answers_as_admit_does() {
    let route: Arc<str> = "r".into();
    let state = sluice_allocator::MemoryStore::new();
    for selection in ["round_robin", "priority"] {
        let (fast_pool, slow_pool) = (three_members(), three_members());
        let policy = |pool: &Arc<Members>| {
            Policy::new(
                &Selection::named(selection),
                &route,
                pool,
                None,
                Limits::plain(pool),
            )
        };
        let (fast, slow) = (policy(&fast_pool), policy(&slow_pool));
        let mut picked = Vec::new();
        for round in 0..9 {
            // A member that fails is down for the rest: both skip it alike, and with every
            // member down both find none.
            let failing: &[usize] = match round {
                4 => &[0],
                7 => &[1, 2],
                _ => &[],
            };
            for pool in [&fast_pool, &slow_pool] {
                for &member in failing {
                    for _ in 0..10 {
                        pool.report_connect_failure(member, Instant::now());
                    }
                }
            }
            let quick = fast.selector.admit_in_process().expect("no limits");
            let full = slow.selector.admit(&state, None, 1, None).await;
            assert_eq!(
                first_member(&quick),
                first_member(&full),
                "{selection}, request {round}"
            );
            picked.push(first_member(&quick));
        }
        if selection == "round_robin" {
            assert_eq!(picked[..3], [Some(0), Some(1), Some(2)], "{picked:?}");
        }
        assert!(!picked[4..7].contains(&Some(0)), "{selection}: {picked:?}");
        assert!(
            picked[4..7].iter().all(Option::is_some),
            "{selection}: {picked:?}"
        );
        assert_eq!(picked[7..], [None, None], "{selection}: {picked:?}");
    }
}
