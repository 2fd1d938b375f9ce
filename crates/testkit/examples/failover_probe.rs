//! Kills the master of a slot and reports how long the cluster takes to promote its replica.
use std::time::{Duration, Instant};
fn main() {
    let mut c = sluice_testkit::RedisCluster::start();
    let key = "{f1}";
    let m = c.master_of(key).expect("a master for the key");
    let t = Instant::now();
    c.kill(c.index_of(m));
    while t.elapsed() < Duration::from_secs(20) {
        if let Some(now) = c.master_of(key).filter(|&p| p != m) {
            println!(
                "slot of {key} served by {now} after {} ms",
                t.elapsed().as_millis()
            );
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    println!("no failover within 20 s");
}
