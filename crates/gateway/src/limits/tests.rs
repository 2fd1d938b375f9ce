//! What a connection holds while it waits for a request.

use std::sync::Arc;
use std::time::Duration;

use pingora::apps::ServerApp;
use pingora::proxy::{http_proxy, ProxyHttp, Session};
use pingora::server::configuration::ServerConf;
use pingora::upstreams::peer::HttpPeer;

use super::{LimitedApp, Limits};
use crate::metrics::Metrics;

struct Nowhere;

impl ProxyHttp for Nowhere {
    type CTX = ();

    fn new_ctx(&self) {}

    async fn upstream_peer(
        &self,
        _session: &mut Session,
        _ctx: &mut (),
    ) -> pingora::Result<Box<HttpPeer>> {
        Ok(Box::new(HttpPeer::new("127.0.0.1:9", false, String::new())))
    }
}

/// A connection's future is allocated once and kept for the connection's life, idle
/// keep-alives included, so it must not hold a request's state inline: Pingora's request
/// future alone is many KiB, and it is boxed per request instead.
#[tokio::test]
async fn a_connection_future_holds_no_request_inline() {
    let limits = Limits {
        max_connections: 10,
        max_handshakes: 2,
        idle_timeout: Duration::from_secs(60),
        header_timeout: Duration::from_secs(10),
    };
    let proxy = http_proxy(&Arc::new(ServerConf::default()), Nowhere);
    let app = Arc::new(LimitedApp::new(proxy, limits, &Metrics::new()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let _client = tokio::net::TcpStream::connect(listener.local_addr().unwrap())
        .await
        .unwrap();
    let (accepted, _) = listener.accept().await.unwrap();
    let stream = pingora::protocols::l4::stream::Stream::from(accepted);
    let (_tx, shutdown) = tokio::sync::watch::channel(false);
    let connection = app.process_new(Box::new(stream), &shutdown);
    let size = std::mem::size_of_val(&*connection);
    assert!(
        size <= 2048,
        "a connection's future is {size} bytes: a request's state is inline"
    );
}
