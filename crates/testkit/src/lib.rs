//! sluice-testkit: real services for tests.
//!
//! Tests talk to a real `redis-server` (Debian's package), started on a free loopback port for
//! each test so that the test can kill it and start it again. Nothing here is a mock.
//!
//! [`architecture`] reads a crate's module graph from its source, for the test in each crate
//! that keeps module cycles out.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use redis::IntoConnectionInfo;

pub mod architecture;
mod ports;

/// A `redis-server` child process on 127.0.0.1.
pub struct RedisServer {
    port: u16,
    dir: PathBuf,
    child: Option<Child>,
    extra: Vec<String>,
    /// The TLS port of a server from [`RedisServer::start_tls`].
    tls_port: Option<u16>,
}

impl RedisServer {
    /// Starts a server on a free port, with no persistence, and waits until it answers PING.
    ///
    /// Panics with a clear message when `redis-server` is not installed: `.ci/run` installs it.
    pub fn start() -> RedisServer {
        RedisServer::start_on(free_port(), &[])
    }

    /// Starts a server on `port` with extra command-line arguments (kept for restarts).
    pub fn start_on(port: u16, extra: &[&str]) -> RedisServer {
        let dir = RedisServer::fresh_dir(port);
        let mut server = RedisServer {
            port,
            dir,
            child: None,
            extra: extra.iter().map(|a| a.to_string()).collect(),
            tls_port: None,
        };
        server.restart();
        server
    }

    /// Starts a server that also takes TLS connections, on a port of their own, with a server
    /// certificate for `IP:127.0.0.1` signed by a CA made for this server alone
    /// ([`RedisServer::ca_file`]). Clients need no certificate. The plain port stays open, so
    /// [`RedisServer::command`] and the other inspection helpers work as with any server.
    pub fn start_tls() -> RedisServer {
        let (port, tls_port) = (free_port(), free_port());
        let dir = RedisServer::fresh_dir(port);
        make_certificates(&dir, "IP:127.0.0.1");
        RedisServer::start_tls_in(dir.clone(), port, tls_port, &dir, &[])
    }

    /// A TLS server in `dir` on `port` (plain) and `tls_port`, with the certificates of
    /// [`make_certificates`] in `certs`, and `extra` arguments.
    fn start_tls_in(
        dir: PathBuf,
        port: u16,
        tls_port: u16,
        certs: &std::path::Path,
        extra: &[&str],
    ) -> RedisServer {
        let file = |name: &str| certs.join(name).to_string_lossy().into_owned();
        let mut args = vec![
            "--tls-port".to_string(),
            tls_port.to_string(),
            "--tls-cert-file".to_string(),
            file("server.pem"),
            "--tls-key-file".to_string(),
            file("server.key"),
            "--tls-ca-cert-file".to_string(),
            file("ca.pem"),
            "--tls-auth-clients".to_string(),
            "no".to_string(),
        ];
        args.extend(extra.iter().map(|a| a.to_string()));
        let mut server = RedisServer {
            port,
            dir,
            child: None,
            extra: args,
            tls_port: Some(tls_port),
        };
        server.restart();
        server
    }

    /// An empty directory for the server on `port`.
    fn fresh_dir(port: u16) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("sluice-redis-{}-{port}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create the redis dir");
        dir
    }

    /// The TLS port of a server from [`RedisServer::start_tls`].
    pub fn tls_port(&self) -> u16 {
        self.tls_port
            .expect("a server from RedisServer::start_tls has a TLS port")
    }

    /// `rediss://127.0.0.1:<tls port>/0`, for a server from [`RedisServer::start_tls`].
    pub fn tls_url(&self) -> String {
        format!("rediss://127.0.0.1:{}/0", self.tls_port())
    }

    /// The PEM file of the CA that signed the TLS certificate of a server from
    /// [`RedisServer::start_tls`].
    pub fn ca_file(&self) -> PathBuf {
        let at = self
            .extra
            .iter()
            .position(|a| a == "--tls-ca-cert-file")
            .expect("only TLS servers have a CA");
        PathBuf::from(&self.extra[at + 1])
    }

    /// The server's port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// What the server logged.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("redis.log")).unwrap_or_default()
    }

    /// `redis://127.0.0.1:<port>/0`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// The server's address.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// The URL of a user that may run everything but Redis functions (`FCALL`, `FUNCTION`), as
    /// on Redis 6 or behind an ACL that denies them: the store's calls go as `EVALSHA`.
    pub fn url_without_functions(&self) -> String {
        self.user_url("sluice-eval", &["-fcall", "-fcall_ro", "-function"])
    }

    /// Creates (or resets) `user`, password `secret`, allowed every key, channel and command
    /// but as `rules` say (ACL rules: `-zadd`, `-@scripting`...), and returns its URL.
    pub fn user_url(&self, user: &str, rules: &[&str]) -> String {
        let mut acl = vec![
            "ACL", "SETUSER", user, "reset", "on", ">secret", "~*", "&*", "+@all",
        ];
        acl.extend_from_slice(rules);
        let reply = self.command(&acl).expect("ACL SETUSER");
        assert!(reply.starts_with("+OK"), "ACL SETUSER {user}: {reply}");
        format!("redis://{user}:secret@127.0.0.1:{}/0", self.port)
    }

    /// Kills the server (SIGKILL): connections break at once, as in a crash.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port, empty. Kills it first if it runs.
    pub fn restart(&mut self) {
        self.kill();
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .args(&self.extra)
            // Kept beside the node's data for post-mortems; removed with it.
            .stdout(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(self.dir.join("redis.log"))
                    .map_or_else(|_| Stdio::null(), Stdio::from),
            )
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server must be installed (apt-get install redis-server)");
        self.child = Some(child);
        // A process start on a loaded 2-core machine can take seconds.
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if self
                .command(&["PING"])
                .is_ok_and(|r| r.starts_with("+PONG"))
            {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("redis-server on port {} did not answer PING", self.port);
    }

    /// Sends one command and returns its reply as text (see [`command_at`]): enough for tests
    /// (`INFO`, `SCRIPT FLUSH`, `KEYS`...).
    pub fn command(&self, args: &[&str]) -> std::io::Result<String> {
        command_at(self.addr(), args)
    }

    /// Members and scores of a sorted set, lowest score first.
    pub fn zrange_with_scores(&self, key: &str) -> Vec<(String, f64)> {
        zrange_with_scores_at(self.addr(), key)
    }

    /// What the quota log `key` holds ([`log_held_at`]).
    pub fn log_held(&self, key: &str) -> u64 {
        log_held_at(self.addr(), key)
    }

    /// The integer reply of a command, e.g. `ZCARD` or `MEMORY USAGE`.
    pub fn integer(&self, args: &[&str]) -> Option<i64> {
        query(self.addr(), args).ok()
    }

    /// Calls of a command since start or `CONFIG RESETSTAT`, from `INFO commandstats`.
    pub fn command_calls(&self, name: &str) -> u64 {
        let Ok(info) = query::<redis::InfoDict>(self.addr(), &["INFO", "commandstats"]) else {
            return 0;
        };
        // `cmdstat_<name>:calls=N,usec=...`
        info.get::<String>(&format!("cmdstat_{}", name.to_ascii_lowercase()))
            .and_then(|stats| {
                stats
                    .split(',')
                    .find_map(|f| f.strip_prefix("calls=")?.parse().ok())
            })
            .unwrap_or(0)
    }
}

impl RedisServer {
    /// Starts `MONITOR` on a connection of its own; [`Monitor::stop`] returns what it saw.
    ///
    /// Returns once Redis has confirmed the monitor (`+OK`): every command Redis runs after
    /// that is in the stream, so nothing the test sends next can be missed.
    pub fn monitor(&self) -> Monitor {
        static MONITORS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let mut conn = connect(self.addr()).expect("connect for MONITOR");
        conn.set_read_timeout(Some(MONITOR_DEADLINE))
            .expect("timeout");
        let confirmed: redis::RedisResult<()> = redis::cmd("MONITOR").query(&mut conn);
        if let Err(err) = confirmed {
            panic!("MONITOR on port {} was not confirmed: {err}", self.port);
        }
        // Before `stop` there is no bound: a test may monitor for a long time. `stop` bounds
        // the wait for the marker on its side.
        conn.set_read_timeout(None).expect("timeout");
        let marker = format!(
            "sluice-monitor-end-{}-{}-{}",
            std::process::id(),
            self.port,
            MONITORS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let (sender, seen) = std::sync::mpsc::channel();
        {
            let marker = marker.clone();
            // Each command Redis runs comes as one status line: `<time> [<db> <client>]
            // "<name>" "<arg>"...`.
            std::thread::spawn(move || {
                let mut lines = Vec::new();
                let complete = loop {
                    match conn.recv_response() {
                        Ok(redis::Value::SimpleString(line)) if line.contains(&marker) => {
                            break true
                        }
                        Ok(redis::Value::SimpleString(line)) => lines.push(line),
                        Ok(_) => {}
                        Err(_) => break false,
                    }
                };
                let _ = sender.send((lines, complete));
            });
        }
        Monitor {
            addr: self.addr(),
            marker,
            seen,
        }
    }
}

/// How long `MONITOR` may take to confirm, and to show the end marker after [`Monitor::stop`].
/// Generous: after a busy test the monitor thread may still be reading a long backlog.
const MONITOR_DEADLINE: Duration = Duration::from_secs(30);

/// A running `MONITOR`.
pub struct Monitor {
    addr: SocketAddr,
    /// Sent as `PING <marker>` by [`Monitor::stop`]: once the stream shows it, it has shown
    /// every command Redis ran before it.
    marker: String,
    /// The lines before the marker, and whether the marker came (not the connection's end).
    seen: std::sync::mpsc::Receiver<(Vec<String>, bool)>,
}

impl Monitor {
    /// Stops and returns the names of the commands clients sent, in order, leaving out the
    /// commands scripts ran inside Redis (shown by MONITOR as coming from `lua`).
    ///
    /// Every command Redis ran before this call is included: Redis runs commands one at a time
    /// and feeds each to the monitors as it runs it, so the stream is read up to a marker
    /// command sent now, not for a while.
    pub fn stop(self) -> Vec<String> {
        command_at(self.addr, &["PING", &self.marker]).expect("send the MONITOR end marker");
        let (seen, complete) = self.seen.recv_timeout(MONITOR_DEADLINE).unwrap_or_default();
        assert!(
            complete,
            "MONITOR on {} never showed the end marker within {MONITOR_DEADLINE:?}",
            self.addr
        );
        seen.iter()
            .filter(|l| l.contains('[') && !l.contains(" lua]"))
            .filter_map(|l| l.split('"').nth(1).map(str::to_ascii_uppercase))
            .collect()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A real Redis Cluster on loopback: three masters with one replica each, created with
/// `redis-cli --cluster create`, torn down (by PID) when dropped.
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
    /// The CA and node certificates of a TLS cluster.
    certs: Option<PathBuf>,
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        // A test that fails on a cluster shows what each node went through (failovers, role
        // changes): a store error seen by the gateway is often explained only there.
        if std::thread::panicking() {
            for n in &self.nodes {
                let log = n.log();
                let tail: Vec<&str> = log.lines().rev().take(40).collect();
                eprintln!("--- redis cluster node {} (last lines) ---", n.port());
                for line in tail.iter().rev() {
                    eprintln!("{line}");
                }
            }
        }
        // The nodes go first (by their own Drop, after this), then nothing refers to the CA.
        if let Some(certs) = &self.certs {
            let _ = std::fs::remove_dir_all(certs);
        }
    }
}

/// One line of `CLUSTER NODES`: the node's port, whether it is a live master, and its slot
/// ranges.
type NodeView = (u16, bool, Vec<(u16, u16)>);

/// Ports for a cluster node: the node's own and its bus port (+10000) must both be free.
fn cluster_ports(n: usize) -> Vec<u16> {
    (0..n).map(|_| ports::reserve(true)).collect()
}

impl RedisCluster {
    /// Starts six nodes and joins them into a cluster (3 masters, 3 replicas); waits until every
    /// node reports `cluster_state:ok`.
    pub fn start() -> RedisCluster {
        RedisCluster::start_with(false)
    }

    /// Like [`RedisCluster::start`], but the nodes serve clients, each other (cluster bus) and
    /// their replicas over TLS only, with certificates from one CA made for this cluster
    /// ([`RedisCluster::ca_file`]); [`RedisCluster::urls`] are then `rediss://`. Each node keeps
    /// a plain port for the inspection helpers, which the cluster does not announce.
    pub fn start_tls() -> RedisCluster {
        RedisCluster::start_with(true)
    }

    fn start_with(tls: bool) -> RedisCluster {
        // With TLS these are the TLS ports, which the cluster announces (bus: +10000).
        let ports = cluster_ports(6);
        let certs = tls.then(|| {
            let dir = std::env::temp_dir().join(format!(
                "sluice-redis-cluster-ca-{}-{}",
                std::process::id(),
                ports[0]
            ));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).expect("create the CA dir");
            make_certificates(&dir, "IP:127.0.0.1");
            dir
        });
        const CLUSTER_ARGS: [&str; 8] = [
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            // A node that answers no ping for this long is failed over. On a loaded 2-core
            // machine a master can be starved for seconds (3 s was seen to be too short): it
            // is then replaced while a test runs, and the gateway's next write reaches the
            // demoted node (READONLY), a store error that `on_store_error: open` admits
            // uncounted. So no test's master is failed over unless the test asks for it,
            // with [`RedisCluster::fail_over_after`], right before it kills one.
            "--cluster-node-timeout",
            "30000",
            // Replicas sync at once instead of waiting 5 s for company: a
            // replica that never synced cannot be promoted.
            "--repl-diskless-sync-delay",
            "0",
        ];
        let nodes: Vec<RedisServer> = ports
            .iter()
            .map(|&p| match &certs {
                None => RedisServer::start_on(p, &CLUSTER_ARGS),
                Some(certs) => {
                    let plain = free_port();
                    let mut extra = CLUSTER_ARGS.to_vec();
                    extra.extend(["--tls-cluster", "yes", "--tls-replication", "yes"]);
                    RedisServer::start_tls_in(
                        RedisServer::fresh_dir(plain),
                        plain,
                        p,
                        certs,
                        &extra,
                    )
                }
            })
            .collect();
        let mut create = Command::new("redis-cli");
        if let Some(certs) = &certs {
            create
                .arg("--tls")
                .arg("--cacert")
                .arg(certs.join("ca.pem"));
        }
        create.arg("--cluster").arg("create");
        for p in &ports {
            create.arg(format!("127.0.0.1:{p}"));
        }
        let out = create
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .expect("redis-cli must be installed (it comes with redis-server)");
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let cluster = RedisCluster { nodes, certs };
        // Six processes syncing and agreeing on a loaded 2-core machine: a bound, not a wait.
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            let replicas_synced = cluster
                .nodes
                .iter()
                .filter_map(|n| n.command(&["INFO", "replication"]).ok())
                .filter(|i| i.contains("role:slave"))
                .filter(|i| {
                    i.contains("master_link_status:up") && i.contains("master_sync_in_progress:0")
                })
                .count()
                == 3;
            if replicas_synced
                && cluster.nodes.iter().all(|n| {
                    n.command(&["CLUSTER", "INFO"])
                        .is_ok_and(|i| i.contains("cluster_state:ok"))
                })
                && cluster.masters().len() == 3
                && cluster.converged()
            {
                return cluster;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("the cluster did not become ready");
    }

    /// `redis://127.0.0.1:<port>` of every node, for `state.redis.cluster`.
    pub fn urls(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|n| match n.tls_port {
                None => format!("redis://127.0.0.1:{}", n.port()),
                Some(tls) => format!("rediss://127.0.0.1:{tls}"),
            })
            .collect()
    }

    /// The CA file of a cluster from [`RedisCluster::start_tls`].
    pub fn ca_file(&self) -> PathBuf {
        self.certs
            .as_ref()
            .expect("only start_tls clusters have a CA")
            .join("ca.pem")
    }

    /// The nodes, in start order.
    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }

    /// From now on, a master that answers no ping for `timeout` is failed over. The cluster
    /// starts with a timeout no loaded machine's stall reaches, so that only a test that kills
    /// a master on purpose, and calls this first, sees a failover.
    pub fn fail_over_after(&self, timeout: Duration) {
        let ms = timeout.as_millis().to_string();
        for (i, n) in self.nodes.iter().enumerate() {
            let set = n.command(&["CONFIG", "SET", "cluster-node-timeout", &ms]);
            assert!(
                set.is_ok(),
                "CONFIG SET cluster-node-timeout on node {i}: {set:?}"
            );
        }
    }

    /// Kills node `i` (SIGKILL), as a crash would.
    pub fn kill(&mut self, i: usize) {
        self.nodes[i].kill();
    }

    /// `CLUSTER NODES`, as a live node sees it.
    fn topology(&self) -> Vec<NodeView> {
        for n in &self.nodes {
            let Ok(raw) = n.command(&["CLUSTER", "NODES"]) else {
                continue;
            };
            let mut out = Vec::new();
            for line in raw.lines() {
                let fields: Vec<&str> = line.split(' ').collect();
                if fields.len() < 8 {
                    continue;
                }
                let port = fields[1]
                    .split('@')
                    .next()
                    .and_then(|a| a.rsplit(':').next())
                    .and_then(|p| p.parse().ok())
                    .unwrap_or(0);
                let master = fields[2].contains("master") && !fields[2].contains("fail");
                let slots = fields[8..]
                    .iter()
                    .filter_map(|r| {
                        let mut it = r.split('-');
                        let a: u16 = it.next()?.parse().ok()?;
                        let b: u16 = it.next().map_or(Some(a), |b| b.parse().ok())?;
                        Some((a, b))
                    })
                    .collect();
                out.push((port, master, slots));
            }
            return out;
        }
        Vec::new()
    }

    /// Whether every node sees the same cluster: six nodes, each a master with its slots or a
    /// replica, none flagged failing or still in handshake. `cluster_state:ok` on each node is
    /// not enough: a node may be ok while its view of who serves a slot is older than another's,
    /// and the cluster client takes its slot map from whichever node it asks first.
    fn converged(&self) -> bool {
        let views: Vec<Option<Vec<String>>> = self
            .nodes
            .iter()
            .map(|n| {
                let raw = n.command(&["CLUSTER", "NODES"]).ok()?;
                let mut view = Vec::new();
                for line in raw.lines().filter(|l| !l.trim().is_empty()) {
                    let fields: Vec<&str> = line.split(' ').collect();
                    let flags = *fields.get(2)?;
                    if ["fail", "handshake", "noaddr"]
                        .iter()
                        .any(|f| flags.contains(f))
                    {
                        return None;
                    }
                    let role = if flags.contains("master") {
                        "master"
                    } else {
                        "replica"
                    };
                    // id, role, the master's id (replicas), slots (masters).
                    let mut entry = vec![fields[0], role, fields.get(3)?];
                    entry.extend(fields.iter().skip(8));
                    view.push(entry.join(" "));
                }
                view.sort();
                (view.len() == self.nodes.len()).then_some(view)
            })
            .collect();
        views.iter().all(|v| v.is_some()) && views.windows(2).all(|w| w[0] == w[1])
    }

    /// Ports of the masters that serve slots.
    pub fn masters(&self) -> Vec<u16> {
        self.topology()
            .into_iter()
            .filter(|(_, m, slots)| *m && !slots.is_empty())
            .map(|(p, _, _)| p)
            .collect()
    }

    /// The slot of `key`.
    pub fn slot(&self, key: &str) -> u16 {
        self.nodes
            .iter()
            .find_map(|n| n.integer(&["CLUSTER", "KEYSLOT", key]))
            .expect("a node answers CLUSTER KEYSLOT") as u16
    }

    /// The port of the master serving `key` right now.
    pub fn master_of(&self, key: &str) -> Option<u16> {
        let slot = self.slot(key);
        self.topology()
            .into_iter()
            .find(|(_, m, slots)| *m && slots.iter().any(|&(a, b)| (a..=b).contains(&slot)))
            .map(|(p, _, _)| p)
    }

    /// The port of a replica of the master on `master_port`, as that master reports it.
    pub fn replica_of(&self, master_port: u16) -> Option<u16> {
        let info = self.nodes[self.index_of(master_port)]
            .command(&["INFO", "replication"])
            .ok()?;
        info.lines()
            .filter(|l| l.starts_with("slave"))
            .find_map(|l| l.split(',').find_map(|f| f.strip_prefix("port=")))
            .and_then(|p| p.parse().ok())
    }

    /// What the quota log `key` holds on the replica on `port` ([`log_held_at`]), read after
    /// `READONLY`; `None` when the replica does not answer.
    pub fn replica_log_held(&self, port: u16, key: &str) -> Option<u64> {
        let mut conn = connect(self.nodes[self.index_of(port)].addr()).ok()?;
        cmd(&["READONLY"]).query::<()>(&mut conn).ok()?;
        let entries: Vec<(String, f64)> = cmd(&["ZRANGE", key, "0", "-1", "WITHSCORES"])
            .query(&mut conn)
            .ok()?;
        Some(held_of(&entries))
    }

    /// The integer reply of a read command run on the replica on `port` (after `READONLY`,
    /// without which a cluster replica redirects reads to its master).
    pub fn replica_integer(&self, port: u16, args: &[&str]) -> Option<i64> {
        let reply = commands_at(
            self.nodes[self.index_of(port)].addr(),
            &[&["READONLY"], args],
        )
        .ok()?;
        reply
            .strip_prefix("+OK\r\n")?
            .strip_prefix(':')?
            .trim()
            .parse()
            .ok()
    }

    /// The index (in [`RedisCluster::nodes`]) of the node on `port`.
    pub fn index_of(&self, port: u16) -> usize {
        self.nodes
            .iter()
            .position(|n| n.port() == port)
            .expect("a node of this cluster")
    }
}

/// A port on 127.0.0.1 that is free and that nothing else in this process will be handed; see
/// [`ports`].
pub fn free_port() -> u16 {
    ports::reserve(false)
}

/// A port on 127.0.0.1 that refuses every connection until this process exits, and that no
/// server can take in the meantime: for members and targets that must stay dead.
pub fn refused_port() -> u16 {
    ports::refused()
}

/// In `dir`: a CA (`ca.pem`, `ca.key`), and a server certificate it signed (`server.pem`,
/// `server.key`) for `subject_alt_names` (e.g. `DNS:localhost,IP:127.0.0.1`), both valid from a
/// day ago to a day from now (clocks may differ a little).
pub fn make_certificates(dir: &std::path::Path, subject_alt_names: &str) {
    make_certificates_valid(dir, subject_alt_names, 1);
}

/// Like [`make_certificates`], with a server certificate that expired a day ago (the CA is
/// valid).
pub fn make_expired_certificates(dir: &std::path::Path, subject_alt_names: &str) {
    make_certificates_valid(dir, subject_alt_names, -1);
}

/// [`make_certificates`] with the server certificate valid from `days_until_expiry - 1` days
/// before until `days_until_expiry` days after now.
fn make_certificates_valid(dir: &std::path::Path, subject_alt_names: &str, days_until_expiry: i64) {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};
    let day = time::Duration::days(1);
    let now = time::OffsetDateTime::now_utc();
    let write = |name: &str, pem: String| {
        std::fs::write(dir.join(name), pem).unwrap_or_else(|err| panic!("write {name}: {err}"))
    };

    let ca_key = KeyPair::generate().expect("a CA key");
    let mut ca = CertificateParams::default();
    ca.distinguished_name
        .push(DnType::CommonName, "sluice test CA");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    (ca.not_before, ca.not_after) = (now - day, now + day);
    let ca = ca.self_signed(&ca_key).expect("the CA certificate");

    let server_key = KeyPair::generate().expect("a server key");
    let mut server = CertificateParams::default();
    server
        .distinguished_name
        .push(DnType::CommonName, "sluice test server");
    server.subject_alt_names = subject_alt_names
        .split(',')
        .map(|san| match san.trim().split_once(':') {
            Some(("DNS", name)) => {
                rcgen::SanType::DnsName(name.try_into().expect("an ASCII DNS name"))
            }
            Some(("IP", ip)) => rcgen::SanType::IpAddress(ip.parse().expect("an IP address")),
            _ => panic!("a subject alt name is DNS:<name> or IP:<address>, not {san:?}"),
        })
        .collect();
    server.not_after = now + time::Duration::days(days_until_expiry);
    server.not_before = server.not_after - day - day;
    let server = server
        .signed_by(&server_key, &ca, &ca_key)
        .expect("the server certificate");

    write("ca.pem", ca.pem());
    write("ca.key", ca_key.serialize_pem());
    write("server.pem", server.pem());
    write("server.key", server_key.serialize_pem());
}

/// A connection to the Redis at `addr` that sends nothing but what the caller asks: no `CLIENT
/// SETINFO` on connect, which would show in `MONITOR` and in `INFO commandstats`.
fn connect(addr: SocketAddr) -> redis::RedisResult<redis::Connection> {
    let info =
        redis::ConnectionAddr::Tcp(addr.ip().to_string(), addr.port()).into_connection_info()?;
    let settings = info.redis_settings().clone().set_skip_set_lib_name();
    let client = redis::Client::open(info.set_redis_settings(settings))?;
    // Bounds against a hang, not a measure: a Redis on a loaded machine may answer late, and a
    // test's inspection must not fail for that.
    let conn = client.get_connection_with_timeout(Duration::from_secs(5))?;
    conn.set_read_timeout(Some(Duration::from_secs(15)))?;
    conn.set_write_timeout(Some(Duration::from_secs(15)))?;
    Ok(conn)
}

/// `args` as a command.
fn cmd(args: &[&str]) -> redis::Cmd {
    let mut cmd = redis::cmd(args.first().copied().unwrap_or_default());
    cmd.arg(&args[1..]);
    cmd
}

/// Runs `args` on a connection of its own.
fn query<T: redis::FromRedisValue>(addr: SocketAddr, args: &[&str]) -> redis::RedisResult<T> {
    cmd(args).query(&mut connect(addr)?)
}

/// A reply as text for tests to search: a status as `+STATUS` (`+OK`, `+PONG`), an integer as
/// `:N`, a string as itself, the items of an array one per line.
fn text_of(value: &redis::Value) -> String {
    use redis::Value;
    match value {
        Value::Nil => String::new(),
        Value::Okay => "+OK".to_string(),
        Value::SimpleString(s) => format!("+{s}"),
        Value::Int(n) => format!(":{n}"),
        Value::BulkString(bytes) => String::from_utf8_lossy(bytes).into_owned(),
        Value::VerbatimString { text, .. } => text.clone(),
        Value::Array(items) | Value::Set(items) => lines_of(items),
        Value::Map(pairs) => lines_of(pairs.iter().flat_map(|(k, v)| [k, v])),
        Value::Double(d) => d.to_string(),
        Value::Boolean(b) => b.to_string(),
        other => format!("{other:?}"),
    }
}

/// [`text_of`] of each value, one per line.
fn lines_of<'a>(values: impl IntoIterator<Item = &'a redis::Value>) -> String {
    values
        .into_iter()
        .map(text_of)
        .collect::<Vec<_>>()
        .join("\r\n")
}

/// Sends one command to the Redis at `addr` and returns its reply as text ([`text_of`]); an
/// error reply is an `Err`.
pub fn command_at(addr: SocketAddr, args: &[&str]) -> std::io::Result<String> {
    commands_at(addr, &[args])
}

/// Sends several commands on one connection, in order, and returns their replies as text, one
/// per line. For what needs a connection state, e.g. `READONLY` before reading a key on a
/// cluster replica.
pub fn commands_at(addr: SocketAddr, commands: &[&[&str]]) -> std::io::Result<String> {
    let mut conn = connect(addr).map_err(std::io::Error::other)?;
    let mut replies = Vec::with_capacity(commands.len());
    for args in commands {
        let reply = cmd(args).query::<redis::Value>(&mut conn);
        replies.push(reply.map_err(std::io::Error::other)?);
    }
    Ok(lines_of(&replies))
}

/// Members and scores of the sorted set `key` on the Redis at `addr`, lowest score first.
pub fn zrange_with_scores_at(addr: SocketAddr, key: &str) -> Vec<(String, f64)> {
    query(addr, &["ZRANGE", key, "0", "-1", "WITHSCORES"]).unwrap_or_default()
}

/// What the quota log `key` on the Redis at `addr` holds: the summed cost of its entries, 0 when
/// it does not exist. An entry is `<seq>:<cost>` (or `r<seq>:<amount>`, an open reservation),
/// and the requests one call admits share its clock and one entry of their summed cost
/// (lua/quota.lua): how many entries a log has is not how many requests it counts. Panics when
/// Redis does not answer, so that "nothing held" is never read from an error.
pub fn log_held_at(addr: SocketAddr, key: &str) -> u64 {
    let entries: Vec<(String, f64)> = query(addr, &["ZRANGE", key, "0", "-1", "WITHSCORES"])
        .unwrap_or_else(|e| panic!("ZRANGE {key} on {addr}: {e}"));
    held_of(&entries)
}

fn held_of(entries: &[(String, f64)]) -> u64 {
    entries
        .iter()
        .map(|(member, _)| {
            member
                .rsplit_once(':')
                .and_then(|(_, cost)| cost.parse::<u64>().ok())
                .unwrap_or_else(|| panic!("not a quota log's entry: {member:?}"))
        })
        .sum()
}

/// No module of this crate depends on one that depends on it back, at any depth
/// (`sluice_testkit::architecture`).
#[cfg(test)]
#[test]
fn no_module_cycles() {
    architecture::assert_no_cycles(&std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
}
