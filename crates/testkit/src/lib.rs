//! sluice-testkit: real services for tests.
//!
//! Tests talk to a real `redis-server` (Debian's package), started on a free loopback port for
//! each test so that the test can kill it and start it again. Nothing here is a mock.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A `redis-server` child process on 127.0.0.1.
pub struct RedisServer {
    port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

impl RedisServer {
    /// Starts a server on a free port, with no persistence, and waits until it answers PING.
    ///
    /// Panics with a clear message when `redis-server` is not installed: `.ci/run` installs it.
    pub fn start() -> RedisServer {
        let port = {
            let l = TcpListener::bind("127.0.0.1:0").expect("bind a free port");
            l.local_addr().expect("local address").port()
        };
        let dir = std::env::temp_dir().join(format!("sluice-redis-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create the redis dir");
        let mut server = RedisServer {
            port,
            dir,
            child: None,
        };
        server.restart();
        server
    }

    /// `redis://127.0.0.1:<port>/0`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// The server's address.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
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
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server must be installed (apt-get install redis-server)");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
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

    /// Sends one command and returns the raw RESP reply (enough for tests: `INFO`, `MEMORY
    /// USAGE`, `SCRIPT FLUSH`, `ZCARD`...).
    pub fn command(&self, args: &[&str]) -> std::io::Result<String> {
        let mut conn = TcpStream::connect_timeout(&self.addr(), Duration::from_secs(2))?;
        conn.set_read_timeout(Some(Duration::from_secs(5)))?;
        let mut req = format!("*{}\r\n", args.len());
        for a in args {
            req.push_str(&format!("${}\r\n{a}\r\n", a.len()));
        }
        conn.write_all(req.as_bytes())?;
        conn.write_all(b"*1\r\n$4\r\nQUIT\r\n")?;
        let mut reply = String::new();
        conn.read_to_string(&mut reply)?;
        // Drop QUIT's "+OK".
        Ok(reply.strip_suffix("+OK\r\n").unwrap_or(&reply).to_string())
    }

    /// The integer of a `:N` reply, e.g. from `ZCARD` or `MEMORY USAGE`.
    pub fn integer(&self, args: &[&str]) -> Option<i64> {
        let r = self.command(args).ok()?;
        r.strip_prefix(':')?.trim().parse().ok()
    }

    /// Calls of a command since start or `CONFIG RESETSTAT`, from `INFO commandstats`.
    pub fn command_calls(&self, name: &str) -> u64 {
        let info = self.command(&["INFO", "commandstats"]).unwrap_or_default();
        let needle = format!("cmdstat_{}:calls=", name.to_ascii_lowercase());
        info.lines()
            .find_map(|l| l.strip_prefix(&needle))
            .and_then(|rest| rest.split(',').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    }
}

impl RedisServer {
    /// Starts `MONITOR` on a connection of its own; [`Monitor::stop`] returns what it saw.
    pub fn monitor(&self) -> Monitor {
        let mut conn = TcpStream::connect(self.addr()).expect("connect for MONITOR");
        conn.write_all(b"*1\r\n$7\r\nMONITOR\r\n")
            .expect("send MONITOR");
        conn.set_read_timeout(Some(Duration::from_millis(200)))
            .expect("timeout");
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let reader = std::thread::spawn(move || {
            let mut seen = String::new();
            let mut buf = [0u8; 8192];
            loop {
                match conn.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => seen.push_str(&String::from_utf8_lossy(&buf[..n])),
                    Err(_) if flag.load(std::sync::atomic::Ordering::Relaxed) => break,
                    Err(_) => {}
                }
            }
            seen
        });
        // MONITOR answers +OK once it is on; wait a moment so nothing sent after this is missed.
        std::thread::sleep(Duration::from_millis(100));
        Monitor { stop, reader }
    }
}

/// A running `MONITOR`.
pub struct Monitor {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    reader: std::thread::JoinHandle<String>,
}

impl Monitor {
    /// Stops and returns the commands clients sent, as `(command, source)` pairs, leaving out
    /// the commands scripts ran inside Redis (shown by MONITOR as coming from `lua`).
    pub fn stop(self) -> Vec<String> {
        std::thread::sleep(Duration::from_millis(100));
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let seen = self.reader.join().unwrap_or_default();
        seen.lines()
            .filter(|l| l.starts_with('+') && l.contains('[') && !l.contains(" lua]"))
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
