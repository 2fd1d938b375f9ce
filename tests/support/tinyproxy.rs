//! Debian's `tinyproxy` as a real forward proxy: the `proxy` members of the tests.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use super::free_port;
use super::tls::{wait_listening, Process};

const WAIT: Duration = Duration::from_secs(10);

/// Debian's tinyproxy in the foreground, logging every request line to a file.
pub struct Tinyproxy {
    _process: Process,
    pub port: u16,
    log: PathBuf,
}

impl Tinyproxy {
    pub fn start(dir: &Path, name: &str, basic_auth: Option<(&str, &str)>) -> Tinyproxy {
        let port = free_port();
        let conf = dir.join(format!("{name}.conf"));
        let log = dir.join(format!("{name}.log"));
        let mut text = format!(
            "Port {port}\nListen 127.0.0.1\nTimeout 30\nLogLevel Info\nMaxClients 64\nAllow 127.0.0.1\n"
        );
        if let Some((user, pass)) = basic_auth {
            text.push_str(&format!("BasicAuth {user} {pass}\n"));
        }
        fs::write(&conf, text).unwrap();
        let mut child = Command::new("tinyproxy")
            .arg("-d")
            .arg("-c")
            .arg(&conf)
            .stdin(Stdio::null())
            .stdout(fs::File::create(&log).unwrap())
            .stderr(Stdio::null())
            .spawn()
            .expect("tinyproxy must be installed");
        wait_listening(port, &mut child, "tinyproxy");
        Tinyproxy {
            _process: Process(child),
            port,
            log,
        }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The request lines tinyproxy received that start with `prefix` (e.g. `CONNECT `).
    pub fn requests(&self, prefix: &str) -> Vec<String> {
        let text = fs::read_to_string(&self.log).unwrap_or_default();
        text.lines()
            .filter_map(|l| l.split_once("Request (file descriptor ").map(|(_, r)| r))
            .filter_map(|r| r.split_once("): ").map(|(_, line)| line.to_string()))
            .filter(|line| line.starts_with(prefix))
            .collect()
    }

    pub async fn wait_requests(&self, prefix: &str, n: usize) -> usize {
        super::wait_until(WAIT, || self.requests(prefix).len() >= n).await;
        self.requests(prefix).len()
    }
}
