//! The Redis client writes the commands that tasks send in one turn of the runtime in one system
//! call (third_party/redis, "one write per runtime turn").
//!
//! A test binary with one test: it counts the write system calls of the whole process
//! (`/proc/self/io`), which tests running beside it in the same process would add to. That the
//! deferred write still goes while the runtime never runs out of work is in redis_store.rs.

use std::sync::Arc;
use std::time::Duration;

use sluice_store::RedisConnection;
use sluice_testkit::RedisServer;

/// Write system calls (`write`, `writev`, ...) made by this process so far.
#[cfg(target_os = "linux")]
fn writes() -> u64 {
    let io = std::fs::read_to_string("/proc/self/io").expect("/proc/self/io");
    io.lines()
        .find_map(|line| line.strip_prefix("syscw: "))
        .and_then(|n| n.trim().parse().ok())
        .expect("a syscw line")
}

/// Pingora's runtime: Tokio's multi-thread scheduler, here with one worker.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("a runtime")
}

/// 16 tasks that each send a command, all ready at once, make one write to Redis, or two when
/// the runtime's periodic check of its drivers (every 61 polls; the 16 tasks and the driver's
/// polls between them are fewer) falls among them. As released, and with the wait turned off,
/// the client writes each command on its own: the multi-thread scheduler runs a task it was
/// just woken by right after the waker, so the connection's driver takes the commands one at a
/// time.
#[cfg(target_os = "linux")]
#[test]
fn commands_sent_in_one_turn_leave_in_one_write() {
    let server = RedisServer::start();
    let connection =
        Arc::new(RedisConnection::new(&server.url(), Duration::from_secs(10)).unwrap());
    let rt = runtime();
    let made = rt.block_on(sixteen_at_once(connection.clone()));
    assert!(
        (1..=2).contains(&made),
        "16 commands of one turn took {made} writes"
    );

    // Turned off, as the gateway does while its workers are mostly idle: each command leaves as
    // soon as the connection's task runs, which the scheduler runs right after each sender.
    sluice_store::load::under_load(false);
    let made = rt.block_on(sixteen_at_once(connection.clone()));
    sluice_store::load::under_load(true);
    assert!(
        made > 2,
        "with the wait off, 16 commands of one turn took {made} writes, as if still together"
    );
    let made = rt.block_on(sixteen_at_once(connection));
    assert!(
        (1..=2).contains(&made),
        "on again: 16 commands of one turn took {made} writes"
    );
}

/// The write system calls that 16 tasks, all ready at once (as when one read of the network
/// wakes many requests), each sending a command, make.
#[cfg(target_os = "linux")]
async fn sixteen_at_once(connection: Arc<RedisConnection>) -> u64 {
    // On the worker, where Pingora's requests run: `block_on` runs its future on this thread.
    tokio::spawn(async move {
        assert!(connection.ping().await, "Redis answers");
        let before = writes();
        let tasks: Vec<_> = (0..16)
            .map(|_| {
                let connection = connection.clone();
                tokio::spawn(async move { connection.ping().await })
            })
            .collect();
        for task in tasks {
            assert!(task.await.unwrap(), "every command is answered");
        }
        writes() - before
    })
    .await
    .unwrap()
}
