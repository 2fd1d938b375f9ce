//! TLS origins for the egress and TLS-listener tests: certificates from a CA made per test, and
//! `openssl s_server` on loopback. The certificates come from the testkit, which makes the
//! same ones for TLS Redis.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::free_port;

/// In `dir`: `ca.pem` (and its key), and `server.pem`/`server.key` signed by it for localhost
/// and 127.0.0.1.
pub fn make_certificates(dir: &Path) {
    sluice_testkit::make_certificates(dir, "DNS:localhost,IP:127.0.0.1");
}

/// A child process killed and reaped on drop.
pub struct Process(pub Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Waits until something accepts on 127.0.0.1:`port`; kills `child` and panics after 30 s (a
/// bound for a loaded machine, as for Redis and the gateway).
pub fn wait_listening(port: u16, child: &mut Child, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    let _ = child.kill();
    let _ = child.wait();
    panic!("{what} did not listen on {port}");
}

/// `openssl s_server -www` on 127.0.0.1 with the certificates of [`make_certificates`] in
/// `dir`: a TLS origin answering GET with a status page.
pub fn tls_origin(dir: &Path) -> (Process, u16) {
    let port = free_port();
    let mut child = Command::new("openssl")
        .args([
            "s_server",
            "-accept",
            &format!("127.0.0.1:{port}"),
            "-www",
            "-quiet",
        ])
        .args(["-cert", "server.pem", "-key", "server.key"])
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("openssl s_server");
    wait_listening(port, &mut child, "openssl s_server");
    (Process(child), port)
}
