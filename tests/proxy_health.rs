//! Active health checks of `proxy` members with `kind: connect`: the probe asks the proxy for a
//! tunnel to `target`, with the member's credentials, and only a 2xx counts as healthy.

mod support;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use support::{wait_until, wait_until_async, Gateway};

const WAIT: Duration = Duration::from_secs(20);

/// A forward proxy that answers every CONNECT with `status` and closes, keeping each request
/// head it received.
struct FakeProxy {
    addr: SocketAddr,
    status: Arc<AtomicU16>,
    heads: Arc<Mutex<Vec<String>>>,
}

impl FakeProxy {
    async fn start(status: u16) -> FakeProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let status = Arc::new(AtomicU16::new(status));
        let heads = Arc::new(Mutex::new(Vec::new()));
        let (answer, seen) = (status.clone(), heads.clone());
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let (answer, seen) = (answer.clone(), seen.clone());
                tokio::spawn(async move {
                    let mut head = Vec::new();
                    let mut buf = [0u8; 1024];
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                        match stream.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                    }
                    seen.lock()
                        .unwrap()
                        .push(String::from_utf8_lossy(&head).into_owned());
                    let status = answer.load(Ordering::SeqCst);
                    let reply = format!("HTTP/1.1 {status} Whatever\r\nContent-Length: 0\r\n\r\n");
                    let _ = stream.write_all(reply.as_bytes()).await;
                });
            }
        });
        FakeProxy {
            addr,
            status,
            heads,
        }
    }

    fn heads(&self) -> Vec<String> {
        self.heads.lock().unwrap().clone()
    }
}

/// The probe's timeout is long: the fake proxy answers every probe at once, and with `fall: 1`
/// one probe a loaded machine delayed past a short timeout would take a healthy member down.
fn config(proxy: SocketAddr) -> String {
    format!(
        "listen: [\"{{PROXY}}\"]
admin: {{listen: \"{{ADMIN}}\"}}
threads: 1
routes:
  - name: out
    match: {{hosts: [out.test]}}
    upstream:
      members:
        - proxy: \"http://user:secret@{proxy}\"
      health_check: {{kind: connect, target: \"upstream.test:443\", interval: 100ms, timeout: 5s, rise: 1, fall: 1}}
"
    )
}

async fn healthy(gw: &Gateway, member: &str) -> Option<f64> {
    gw.metric(
        "sluice_member_healthy",
        &[("route", "out"), ("member", member)],
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_member_is_healthy_while_it_answers_connect_with_2xx() {
    let proxy = FakeProxy::start(200).await;
    let gw = Gateway::start_with_ports(&config(proxy.addr));
    let member = format!("http://{}", proxy.addr);

    // The probe is a CONNECT to the target, with the member's own credentials.
    assert!(
        wait_until(WAIT, || !proxy.heads().is_empty()).await,
        "no probe reached the proxy: {}",
        gw.logs()
    );
    let head = proxy.heads()[0].clone();
    assert!(
        head.starts_with("CONNECT upstream.test:443 HTTP/1.1\r\n"),
        "{head}"
    );
    // base64("user:secret")
    assert!(
        head.contains("Proxy-Authorization: Basic dXNlcjpzZWNyZXQ=\r\n"),
        "{head}"
    );
    assert_eq!(healthy(&gw, &member).await, Some(1.0));

    // A refusal (here the proxy's own 407 or 502) is a failed probe.
    proxy.status.store(502, Ordering::SeqCst);
    assert!(
        wait_until_async(WAIT, || async { healthy(&gw, &member).await == Some(0.0) }).await,
        "the member never went down: {}",
        gw.logs()
    );
    // The line goes out through the log writer's thread, after the gauge moved: waited for.
    assert!(gw.wait_for_log("member down", WAIT).await, "{}", gw.logs());

    proxy.status.store(200, Ordering::SeqCst);
    assert!(
        wait_until_async(WAIT, || async { healthy(&gw, &member).await == Some(1.0) }).await,
        "the member never came back: {}",
        gw.logs()
    );
    // The credentials never reach the logs.
    assert!(!gw.logs().contains("secret"), "{}", gw.logs());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_that_only_accepts_connections_is_down_under_a_connect_check() {
    let proxy = FakeProxy::start(407).await;
    let gw = Gateway::start_with_ports(&config(proxy.addr));
    let member = format!("http://{}", proxy.addr);
    assert!(
        wait_until_async(WAIT, || async { healthy(&gw, &member).await == Some(0.0) }).await,
        "a proxy refusing every CONNECT must be down: {}",
        gw.logs()
    );
}
