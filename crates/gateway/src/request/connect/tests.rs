//! A tunnel's life against what it holds: a real table, store and sockets on 127.0.0.1, with
//! the tunnel's task under the test's control (it can be dropped mid-way, as a runtime that
//! shuts down drops it).

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::Tunnels;
use crate::config::Config;
use crate::metrics::Metrics;
use crate::table::Table;

/// Everything a [`Tunnels`] runs on, for one route `t` whose `direct` member takes CONNECTs to
/// 127.0.0.1 on `port`.
struct Harness {
    tunnels: Arc<Tunnels>,
    table: Arc<ArcSwap<Table>>,
    metrics: Arc<Metrics>,
    config: Config,
    text: String,
    state: Arc<dyn sluice_allocator::StateStore>,
    resolver: crate::egress::Resolver,
}

impl Harness {
    async fn new(port: u16) -> Harness {
        let text = format!(
            "listen: [\"127.0.0.1:1\"]\n\
             admin: {{ listen: \"127.0.0.1:2\" }}\n\
             egress: {{ allow_cidrs: [\"127.0.0.0/8\"], connect_ports: [{port}] }}\n\
             routes:\n\
             \x20 - name: t\n\
             \x20   match: {{ hosts: [\"127.0.0.1\"] }}\n\
             \x20   upstream:\n\
             \x20     members: [{{ direct: true }}]\n"
        );
        let config = Config::parse("t.yaml", &text).unwrap_or_else(|e| panic!("{e}"));
        let metrics = Arc::new(Metrics::new());
        let state = crate::state::open(&config).unwrap();
        let resolver = crate::dns::process_resolver(&config.dns).unwrap();
        let first = Table::build(&config, text.as_bytes(), &metrics, &state, &resolver, None).await;
        let table = Arc::new(ArcSwap::from_pointee(first));
        let tunnels = Arc::new(Tunnels::new(
            table.clone(),
            metrics.clone(),
            Arc::new(std::sync::atomic::AtomicUsize::new(0)),
            state.clone(),
            resolver.clone(),
        ));
        Harness {
            tunnels,
            table,
            metrics,
            config,
            text,
            state,
            resolver,
        }
    }

    /// Builds the table again and swaps it in, as a reload does.
    async fn reload(&self) {
        let previous = self.table.load_full();
        let next = Table::build(
            &self.config,
            self.text.as_bytes(),
            &self.metrics,
            &self.state,
            &self.resolver,
            Some(&previous),
        )
        .await;
        self.table.store(Arc::new(next));
    }
}

/// Opens a tunnel through `h` to the upstream listening at `port`: the client's socket, the
/// upstream's end of it, and the tunnel's task.
async fn open_tunnel(
    h: &Harness,
    upstream: &TcpListener,
    port: u16,
) -> (TcpStream, TcpStream, tokio::task::JoinHandle<()>) {
    let front = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut client = TcpStream::connect(front.local_addr().unwrap())
        .await
        .unwrap();
    let (server_side, _) = front.accept().await.unwrap();
    let stream: pingora::protocols::Stream =
        Box::new(pingora::protocols::l4::stream::Stream::from(server_side));
    let tunnels = h.tunnels.clone();
    let task = tokio::spawn(async move {
        tunnels
            .serve(stream, Vec::new(), std::time::Duration::from_secs(30))
            .await;
    });
    client
        .write_all(
            format!("CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n")
                .as_bytes(),
        )
        .await
        .unwrap();
    let (far_end, _) = tokio::time::timeout(Duration::from_secs(10), upstream.accept())
        .await
        .expect("the tunnel connects upstream")
        .unwrap();
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let mut byte = [0u8; 1];
        let n = tokio::time::timeout(Duration::from_secs(10), client.read(&mut byte))
            .await
            .expect("the CONNECT is answered")
            .unwrap();
        assert_eq!(n, 1, "answer so far: {}", String::from_utf8_lossy(&head));
        head.push(byte[0]);
    }
    assert!(
        head.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&head)
    );
    (client, far_end, task)
}

/// Polls `cond` until it holds, for at most 10 s.
async fn eventually(mut cond: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !cond() {
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    true
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tunnel_dropped_mid_way_leaves_the_active_gauge() {
    let upstream = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = upstream.local_addr().unwrap().port();
    let h = Harness::new(port).await;
    let active = h.metrics.tunnels_active.with_label_values(&["t"]);
    let (_client, _far_end, task) = open_tunnel(&h, &upstream, port).await;
    assert!(
        eventually(|| active.get() == 1).await,
        "the tunnel is active"
    );
    task.abort();
    assert!(task.await.unwrap_err().is_cancelled());
    assert_eq!(active.get(), 0, "a dropped tunnel is no longer counted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_tunnel_does_not_hold_the_table_a_reload_replaced() {
    let upstream = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = upstream.local_addr().unwrap().port();
    let h = Harness::new(port).await;
    let (mut client, mut far_end, task) = open_tunnel(&h, &upstream, port).await;
    let old = Arc::downgrade(&h.table.load_full());
    h.reload().await;
    assert!(
        eventually(|| old.upgrade().is_none()).await,
        "the replaced table is freed while the tunnel stays open"
    );
    // The tunnel still carries bytes.
    client.write_all(b"ping").await.unwrap();
    let mut got = [0u8; 4];
    far_end.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"ping");
    drop(client);
    drop(far_end);
    tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("the tunnel ends once both sides close")
        .unwrap();
}
