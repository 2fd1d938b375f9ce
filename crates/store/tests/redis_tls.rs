//! The Redis store over TLS (`rediss://`), against a real `redis-server` with a TLS port and a
//! certificate from a CA made for the test: quotas and least-used pools work as over plain TCP,
//! and the server's certificate is verified (against the given CA only).

use std::sync::Arc;
use std::time::Duration;

use sluice_allocator::{Assign, Assignment, Order, PoolMember, StateStore};
use sluice_limiter::{Acquire, Window};
use sluice_store::{RedisConnection, RedisStore};
use sluice_testkit::RedisServer;

/// A plain least-used assignment over `members`.
fn least_used<'a>(route: &'a str, members: &'a [PoolMember]) -> Assign<'a> {
    Assign {
        route,
        members,
        order: Order::LeastUsed,
        excluded: &[],
        quota: None,
        cost: 1,
        cooldowns: false,
        at_us: None,
        lease: None,
        sticky: None,
    }
}

fn store_over_tls(server: &RedisServer, ca: Option<&[u8]>) -> RedisStore {
    let connection =
        RedisConnection::new_with_ca(&server.tls_url(), Duration::from_secs(5), ca).unwrap();
    RedisStore::with_connection(Arc::new(connection), "sluice")
}

fn ca_of(server: &RedisServer) -> Vec<u8> {
    std::fs::read(server.ca_file()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quota_and_least_used_over_rediss_with_a_private_ca() {
    let server = RedisServer::start_tls();
    let store = store_over_tls(&server, Some(&ca_of(&server)));
    server.command(&["CONFIG", "RESETSTAT"]).unwrap();

    let windows = vec![Window {
        name: "m".into(),
        limit: 2,
        length_us: 60_000_000,
    }];
    let acquire = Acquire {
        route: "q",
        key: "route",
        windows: &windows,
        cost: 1,
        at_us: None,
        client: None,
    };
    let admitted: Vec<bool> = {
        let mut v = Vec::new();
        for _ in 0..3 {
            v.push(store.acquire(acquire).await.unwrap().admitted);
        }
        v
    };
    assert_eq!(admitted, [true, true, false]);
    // The requests were counted in this Redis (seen through its plain port).
    let log = store.keys().quota_log("q", "m", "route");
    assert_eq!(server.log_held(&log), 2);

    let members: Vec<PoolMember> = ["http://a.test", "http://b.test", "http://c.test"]
        .iter()
        .map(|m| PoolMember::new(*m))
        .collect();
    let mut picked = Vec::new();
    for _ in 0..3 {
        match store.assign(least_used("pool", &members)).await.unwrap() {
            Assignment::Assigned { member, .. } => picked.push(member),
            other => panic!("a member is free: {other:?}"),
        }
    }
    assert_eq!(picked, ["http://a.test", "http://b.test", "http://c.test"]);
    let counts = server.zrange_with_scores(&store.keys().pool("pool"));
    assert_eq!(counts.len(), 3, "{counts:?}");
    assert!(counts.iter().all(|(_, n)| *n == 1.0), "{counts:?}");

    // Everything went through the TLS port: the server counts TLS clients' commands like any.
    assert!(server.command_calls("fcall") >= 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_certificate_is_verified() {
    let server = RedisServer::start_tls();
    let acquire_once = |store: RedisStore| async move {
        let windows = vec![Window {
            name: "m".into(),
            limit: 5,
            length_us: 60_000_000,
        }];
        store
            .acquire(Acquire {
                route: "q",
                key: "route",
                windows: &windows,
                cost: 1,
                at_us: None,
                client: None,
            })
            .await
    };

    // The system's roots do not include the test's CA.
    // (A refused handshake is a backend error, or a timeout if the client keeps retrying.)
    acquire_once(store_over_tls(&server, None))
        .await
        .expect_err("the test CA is not a system root");

    // Nor does another CA, even a valid one.
    let other = RedisServer::start_tls();
    acquire_once(store_over_tls(&server, Some(&ca_of(&other))))
        .await
        .expect_err("another CA did not sign the server's certificate");

    // Nothing was counted.
    let log = sluice_store::keys::Keys::new("sluice").quota_log("q", "m", "route");
    assert_eq!(server.log_held(&log), 0);
}

#[test]
fn a_ca_needs_a_rediss_url() {
    let dir = std::env::temp_dir().join(format!("sluice-rediss-ca-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    sluice_testkit::make_certificates(&dir, "IP:127.0.0.1");
    let ca = &std::fs::read(dir.join("ca.pem")).unwrap()[..];
    let _ = std::fs::remove_dir_all(&dir);
    assert!(RedisConnection::new_with_ca(
        "redis://127.0.0.1:6379/0",
        Duration::from_secs(1),
        Some(ca)
    )
    .is_err());
    assert!(RedisConnection::cluster_with_ca(
        &["redis://127.0.0.1:7000".to_string()],
        Duration::from_secs(1),
        Some(ca)
    )
    .is_err());
}

/// A Redis Cluster whose nodes speak TLS only (clients, cluster bus, replication): the client
/// follows the announced `rediss://` nodes with the same CA, and routes on different masters
/// work as on one Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quota_and_least_used_over_a_rediss_cluster() {
    let cluster = sluice_testkit::RedisCluster::start_tls();
    let ca = std::fs::read(cluster.ca_file()).unwrap();
    // One seed node is enough: the rest are discovered, and reached over TLS too.
    let connection =
        RedisConnection::cluster_with_ca(&cluster.urls()[..1], Duration::from_secs(5), Some(&ca))
            .unwrap();
    let store = RedisStore::with_connection(Arc::new(connection), "sluice");
    let windows = vec![Window {
        name: "m".into(),
        limit: 2,
        length_us: 60_000_000,
    }];
    // Routes whose keys hash to different slots, so to more than one master.
    for route in ["a", "b", "c", "d", "e"] {
        let mut admitted = Vec::new();
        for _ in 0..3 {
            let outcome = store
                .acquire(Acquire {
                    route,
                    key: "route",
                    windows: &windows,
                    cost: 1,
                    at_us: None,
                    client: None,
                })
                .await
                .unwrap();
            admitted.push(outcome.admitted);
        }
        assert_eq!(admitted, [true, true, false], "route {route}");
    }
    let members: Vec<PoolMember> = ["http://a.test", "http://b.test"]
        .iter()
        .map(|m| PoolMember::new(*m))
        .collect();
    for _ in 0..4 {
        let assigned = store.assign(least_used("pool", &members)).await.unwrap();
        assert!(
            matches!(assigned, Assignment::Assigned { .. }),
            "{assigned:?}"
        );
    }
    let mut counts = store.counts("pool").await.unwrap();
    counts.sort();
    assert_eq!(
        counts,
        [
            ("http://a.test".to_string(), 2),
            ("http://b.test".to_string(), 2)
        ]
    );
}
