//! Trusted proxies: `X-Forwarded-For`'s last untrusted hop, and PROXY headers v1 and v2.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use tokio::io::AsyncWriteExt;

use super::{parse_proxy_header, read_proxy_header, ProxyHeader, TrustedProxies, MAX_PROXY_HEADER};
use crate::config::Cidr;

fn cidrs(cidrs: &[&str]) -> Vec<Cidr> {
    cidrs.iter().map(|c| Cidr(c.parse().unwrap())).collect()
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn client(t: &[Cidr], peer: &str, xff: &[&str]) -> IpAddr {
    TrustedProxies(t).client_ip(ip(peer), xff.iter().map(|v| v.as_bytes()))
}

#[test]
fn an_untrusted_peer_is_the_client_whatever_it_forwards() {
    let t = cidrs(&["10.9.0.0/24"]);
    assert_eq!(client(&t, "192.0.2.1", &["203.0.113.9"]), ip("192.0.2.1"));
    assert_eq!(client(&[], "10.9.0.1", &["203.0.113.9"]), ip("10.9.0.1"));
}

#[test]
fn a_trusted_peer_names_the_last_untrusted_hop() {
    let t = cidrs(&["10.9.0.0/24", "2001:db8:9::/48"]);
    // The client wrote 1.1.1.1 itself; the load balancer appended the address it saw.
    assert_eq!(
        client(&t, "10.9.0.1", &["1.1.1.1, 203.0.113.9"]),
        ip("203.0.113.9")
    );
    // Trusted hops to the right are skipped, across header lines too.
    assert_eq!(
        client(&t, "10.9.0.1", &["1.1.1.1, 203.0.113.9", "10.9.0.7"]),
        ip("203.0.113.9")
    );
    assert_eq!(
        client(&t, "10.9.0.1", &["[2001:db8::5]:443, 2001:db8:9::1"]),
        ip("2001:db8::5")
    );
    assert_eq!(
        client(&t, "10.9.0.1", &["203.0.113.9:5555"]),
        ip("203.0.113.9")
    );
    // A dual-stack listener reports an IPv4 peer as IPv4-mapped IPv6.
    assert_eq!(
        client(&t, "::ffff:10.9.0.1", &["203.0.113.9"]),
        ip("203.0.113.9")
    );
}

#[test]
fn without_an_untrusted_hop_the_leftmost_trusted_one_is_the_client() {
    let t = cidrs(&["10.9.0.0/24"]);
    assert_eq!(client(&t, "10.9.0.1", &[]), ip("10.9.0.1"));
    assert_eq!(
        client(&t, "10.9.0.1", &["10.9.0.3, 10.9.0.2"]),
        ip("10.9.0.3")
    );
    // Garbage stops the walk: nothing left of it can be told from what the client wrote.
    assert_eq!(
        client(&t, "10.9.0.1", &["203.0.113.9, nonsense, 10.9.0.2"]),
        ip("10.9.0.2")
    );
    assert_eq!(client(&t, "10.9.0.1", &["1.1.1.1, "]), ip("10.9.0.1"));
}

fn v2(addresses: ppp::v2::Addresses, command: ppp::v2::Command) -> Vec<u8> {
    ppp::v2::Builder::with_addresses(
        ppp::v2::Version::Two | command,
        ppp::v2::Protocol::Stream,
        addresses,
    )
    .build()
    .unwrap()
}

fn addrs(src: &str, dst: &str) -> ppp::v2::Addresses {
    let src: SocketAddr = src.parse().unwrap();
    let dst: SocketAddr = dst.parse().unwrap();
    (src, dst).into()
}

#[test]
fn v1_headers_name_the_client_and_leave_what_follows() {
    let mut bytes = b"PROXY TCP4 203.0.113.9 10.9.0.1 40000 8080\r\nGET / HTTP/1.1\r\n".to_vec();
    let (header, used) = parse_proxy_header(&bytes).unwrap();
    assert_eq!(
        header,
        ProxyHeader::Client("203.0.113.9:40000".parse().unwrap())
    );
    assert_eq!(&bytes.split_off(used), b"GET / HTTP/1.1\r\n");

    let bytes = b"PROXY TCP6 2001:db8::5 2001:db8::1 40000 8080\r\n";
    assert_eq!(
        parse_proxy_header(bytes).unwrap().0,
        ProxyHeader::Client("[2001:db8::5]:40000".parse().unwrap())
    );
    let bytes = b"PROXY UNKNOWN\r\n";
    assert_eq!(
        parse_proxy_header(bytes).unwrap(),
        (ProxyHeader::Unaddressed, bytes.len())
    );
}

#[test]
fn v2_headers_name_the_client_and_local_ones_do_not() {
    let mut bytes = v2(
        addrs("203.0.113.9:40000", "10.9.0.1:8080"),
        ppp::v2::Command::Proxy,
    );
    let len = bytes.len();
    bytes.extend_from_slice(b"\x16\x03\x01");
    let (header, used) = parse_proxy_header(&bytes).unwrap();
    assert_eq!(
        header,
        ProxyHeader::Client("203.0.113.9:40000".parse().unwrap())
    );
    assert_eq!(used, len);

    let bytes = v2(
        addrs("[2001:db8::5]:1", "[2001:db8::1]:2"),
        ppp::v2::Command::Proxy,
    );
    assert_eq!(
        parse_proxy_header(&bytes).unwrap().0,
        ProxyHeader::Client("[2001:db8::5]:1".parse().unwrap())
    );
    let local = v2(ppp::v2::Addresses::Unspecified, ppp::v2::Command::Local);
    assert_eq!(
        parse_proxy_header(&local).unwrap(),
        (ProxyHeader::Unaddressed, local.len())
    );
}

#[test]
fn partial_headers_wait_and_other_traffic_is_no_header() {
    let v1 = b"PROXY TCP4 203.0.113.9 10.9.0.1 40000 8080\r\n";
    for n in 1..v1.len() {
        assert_eq!(parse_proxy_header(&v1[..n]), None, "{n} bytes of v1");
    }
    let v2 = v2(
        addrs("203.0.113.9:40000", "10.9.0.1:8080"),
        ppp::v2::Command::Proxy,
    );
    for n in 1..v2.len() {
        assert_eq!(parse_proxy_header(&v2[..n]), None, "{n} bytes of v2");
    }
    for other in [
        &b"GET / HTTP/1.1\r\n"[..],
        b"POST",
        b"CONNECT a:443",
        b"\x16\x03\x01",
        b"\r\nX",
    ] {
        assert_eq!(parse_proxy_header(other), Some((ProxyHeader::Absent, 0)));
    }
}

#[test]
fn malformed_and_oversized_headers_are_invalid() {
    for bad in [
        &b"PROXY TCP4 nonsense 10.9.0.1 1 2\r\n"[..],
        b"PROXY TCP9 1.2.3.4 1.2.3.4 1 2\r\n",
        b"PROXY TCP4 1.2.3.4 1.2.3.4 99999 2\r\n",
        b"PROXY \xff\xfe\r\n",
    ] {
        assert_eq!(
            parse_proxy_header(bad),
            Some((ProxyHeader::Invalid, 0)),
            "{bad:?}"
        );
    }
    // A v1 line with no end, past its 107 bytes.
    let long = [b"PROXY TCP4 ".as_slice(), &[b'1'; 200]].concat();
    assert_eq!(parse_proxy_header(&long), Some((ProxyHeader::Invalid, 0)));
    // A v2 header announcing more than the bound is refused before it is read.
    let mut big = ppp::v2::PROTOCOL_PREFIX.to_vec();
    big.extend_from_slice(&[0x21, 0x11]);
    big.extend_from_slice(&(MAX_PROXY_HEADER as u16).to_be_bytes());
    assert_eq!(parse_proxy_header(&big), Some((ProxyHeader::Invalid, 0)));
}

#[tokio::test]
async fn a_header_sent_in_pieces_is_read_whole_and_the_rest_kept() {
    let (mut lb, mut gw) = tokio::io::duplex(64);
    let writer = tokio::spawn(async move {
        for piece in [
            &b"PROX"[..],
            b"Y TCP4 203.0.113.9 10.9.0.1 4",
            b"0000 8080\r\nGET / HTTP/1.1\r\n",
        ] {
            lb.write_all(piece).await.unwrap();
            lb.flush().await.unwrap();
            tokio::task::yield_now().await;
        }
        lb
    });
    let (header, rest) = read_proxy_header(&mut gw, Duration::from_secs(30)).await;
    assert_eq!(
        header,
        ProxyHeader::Client("203.0.113.9:40000".parse().unwrap())
    );
    let _lb = writer.await.unwrap();
    // What the read took past the header is handed back, however the pieces fell.
    let mut all = rest;
    if all.len() < 16 {
        let mut more = vec![0; 16 - all.len()];
        tokio::io::AsyncReadExt::read_exact(&mut gw, &mut more)
            .await
            .unwrap();
        all.extend(more);
    }
    assert_eq!(all, b"GET / HTTP/1.1\r\n");
}

#[tokio::test]
async fn traffic_without_a_header_is_handed_back_whole() {
    let (mut lb, mut gw) = tokio::io::duplex(64);
    lb.write_all(b"GET / HTTP/1.1\r\n").await.unwrap();
    let (header, rest) = read_proxy_header(&mut gw, Duration::from_secs(30)).await;
    assert_eq!(header, ProxyHeader::Absent);
    assert_eq!(rest, b"GET / HTTP/1.1\r\n");
}

#[tokio::test]
async fn a_peer_that_leaves_or_stalls_mid_header_gets_nothing() {
    let (mut lb, mut gw) = tokio::io::duplex(64);
    lb.write_all(b"PROXY TCP4 ").await.unwrap();
    drop(lb);
    assert_eq!(
        read_proxy_header(&mut gw, Duration::from_secs(30)).await,
        (ProxyHeader::Left, Vec::new())
    );
    // Nothing more ever comes: the time bound ends the read.
    let (mut lb, mut gw) = tokio::io::duplex(64);
    lb.write_all(b"PROXY TCP4 ").await.unwrap();
    assert_eq!(
        read_proxy_header(&mut gw, Duration::from_millis(50)).await,
        (ProxyHeader::Late, Vec::new())
    );
    drop(lb);
    let (_lb, mut gw) = tokio::io::duplex(64);
    assert_eq!(
        read_proxy_header(&mut gw, Duration::from_millis(50)).await,
        (ProxyHeader::Idle, Vec::new())
    );
}
