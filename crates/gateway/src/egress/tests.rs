//! The resolver and the checked resolution of client-chosen names, against `/etc/hosts` and a
//! DNS stub on loopback.

use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::Instant;

use super::guard::tests::{guard, ip};
use super::*;
use crate::config::Config;

#[tokio::test]
async fn localhost_from_etc_hosts_is_loopback_and_denied() {
    let resolver = Resolver::from_system().expect("/etc/resolv.conf");
    let found = resolver.lookup("localhost").await.unwrap();
    assert!(found.addrs.contains(&ip("127.0.0.1")), "{found:?}");
    assert!(found.valid_until.is_some());
    match resolver
        .resolve_checked(&Guard::default(), "localhost", 443)
        .await
    {
        Err(Refusal::Denied(d)) => {
            assert_eq!(d.reason(), "loopback");
        }
        other => panic!("expected a denial, got {other:?}"),
    }
    // With the guard off the same name passes, with every address at the port asked for.
    let open = guard("{deny: []}");
    let addrs = resolver
        .resolve_checked(&open, "localhost", 8443)
        .await
        .unwrap();
    assert!(
        addrs.contains(&"127.0.0.1:8443".parse().unwrap()),
        "{addrs:?}"
    );
}

#[tokio::test]
async fn ip_literals_skip_dns() {
    // No name server and no hosts: a lookup would fail.
    let resolver = Resolver::new(&[], "");
    let g = Guard::default();
    assert_eq!(
        resolver.resolve_checked(&g, "8.8.8.8", 443).await,
        Ok(vec!["8.8.8.8:443".parse().unwrap()])
    );
    assert_eq!(
        resolver.resolve_checked(&g, "[2606:4700::1111]", 443).await,
        Ok(vec!["[2606:4700::1111]:443".parse().unwrap()])
    );
    let literal = resolver.lookup("::ffff:127.0.0.1").await.unwrap();
    assert_eq!(literal.valid_until, None);
    assert!(matches!(
        resolver
            .resolve_checked(&g, "[::ffff:127.0.0.1]", 443)
            .await,
        Err(Refusal::Denied(_))
    ));
}

#[tokio::test]
async fn one_denied_address_refuses_the_whole_name() {
    let resolver = Resolver::new(
        &[],
        "8.8.8.8 mixed.test public.test\n10.0.0.1 mixed.test\n2606:4700::1111 public.test\n",
    );
    let g = Guard::default();
    match resolver.resolve_checked(&g, "mixed.test", 443).await {
        Err(Refusal::Denied(d)) => assert_eq!(d.addr, ip("10.0.0.1")),
        other => panic!("expected a denial, got {other:?}"),
    }
    // Every address, A and AAAA, each checked and handed back for the connection.
    let mut addrs = resolver
        .resolve_checked(&g, "public.test", 443)
        .await
        .unwrap();
    addrs.sort();
    assert_eq!(
        addrs,
        vec![
            "8.8.8.8:443".parse::<SocketAddr>().unwrap(),
            "[2606:4700::1111]:443".parse().unwrap()
        ]
    );
}

/// A DNS server on loopback UDP: answers A queries for the names of `records` with their
/// address and TTL, and NXDOMAIN for anything else (AAAA queries for known names get an empty
/// answer). Counts the A queries it receives.
struct Stub {
    addr: SocketAddr,
    queries: Arc<std::sync::atomic::AtomicUsize>,
    records: Arc<std::sync::Mutex<Vec<(String, Ipv4Addr, u32)>>>,
}

impl Stub {
    async fn start(records_given: &[(&str, Ipv4Addr, u32)]) -> Stub {
        let socket = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = socket.local_addr().unwrap();
        let queries = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let records = Arc::new(std::sync::Mutex::new(Vec::new()));
        let counter = queries.clone();
        let table = records.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 512];
            while let Ok((n, from)) = socket.recv_from(&mut buf).await {
                let answer = Stub::answer(&buf[..n], &table.lock().unwrap());
                if let Some((qtype, answer)) = answer {
                    if qtype == 1 {
                        counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    }
                    let _ = socket.send_to(&answer, from).await;
                }
            }
        });
        let stub = Stub {
            addr,
            queries,
            records,
        };
        stub.set(records_given);
        stub
    }

    /// From now on, answer with `records`.
    fn set(&self, records: &[(&str, Ipv4Addr, u32)]) {
        *self.records.lock().unwrap() = records
            .iter()
            .map(|(n, a, t)| (n.to_string(), *a, *t))
            .collect();
    }

    fn answer(query: &[u8], records: &[(String, Ipv4Addr, u32)]) -> Option<(u16, Vec<u8>)> {
        // Header (12 bytes), then one question: labels, a zero, type and class.
        let mut at = 12;
        let mut labels = Vec::new();
        while *query.get(at)? != 0 {
            let len = usize::from(query[at]);
            labels.push(String::from_utf8_lossy(query.get(at + 1..at + 1 + len)?).to_lowercase());
            at += 1 + len;
        }
        let question_end = at + 5;
        let qtype = u16::from_be_bytes([*query.get(at + 1)?, *query.get(at + 2)?]);
        let name = labels.join(".");
        let known: Vec<_> = records.iter().filter(|r| r.0 == name).collect();
        let mut out = query.get(..question_end)?.to_vec();
        out[2] = 0x84 | (query[2] & 0x01); // a response, authoritative, RD copied
        out[3] = if known.is_empty() { 0x83 } else { 0x80 }; // RA; NXDOMAIN or no error
        out[6..12].copy_from_slice(&[0, 0, 0, 0, 0, 0]);
        if qtype == 1 {
            out[7] = known.len() as u8;
            for (_, addr, ttl) in known {
                out.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1]);
                out.extend_from_slice(&ttl.to_be_bytes());
                out.extend_from_slice(&[0, 4]);
                out.extend_from_slice(&addr.octets());
            }
        }
        Some((qtype, out))
    }

    /// The A queries received so far. (AAAA queries get an empty answer without an SOA record,
    /// which resolvers do not cache, so they are not counted.)
    fn queries(&self) -> usize {
        self.queries.load(std::sync::atomic::Ordering::SeqCst)
    }
}

#[tokio::test]
async fn a_name_that_does_not_exist_is_its_own_error() {
    let stub = Stub::start(&[]).await;
    let resolver = Resolver::new(&[stub.addr], "");
    assert_eq!(
        resolver.lookup("nowhere.test").await,
        Err(LookupError::NoAddresses {
            host: "nowhere.test".into()
        })
    );
    assert_eq!(
        resolver
            .resolve_checked(&Guard::default(), "nowhere.test", 443)
            .await,
        Err(Refusal::NoAddresses {
            host: "nowhere.test".into()
        })
    );
}

#[tokio::test]
async fn answers_are_kept_for_their_ttl_and_no_longer() {
    let stub = Stub::start(&[("short.test", Ipv4Addr::new(8, 8, 4, 4), 1)]).await;
    let resolver = Resolver::new(&[stub.addr], "");
    let before = Instant::now();
    let first = resolver.lookup("short.test").await.unwrap();
    assert_eq!(first.addrs, vec![ip("8.8.4.4")]);
    let valid_until = first.valid_until.unwrap();
    assert!(
        valid_until <= before + std::time::Duration::from_millis(1_500),
        "a 1 s TTL is kept until {:?} from now",
        valid_until - before
    );
    let asked = stub.queries();
    assert!(asked >= 1);
    // Within the TTL the cache answers.
    resolver.lookup("short.test").await.unwrap();
    assert_eq!(stub.queries(), asked, "the cache should have answered");
    // Past it, the stub is asked again.
    tokio::time::sleep_until((valid_until + std::time::Duration::from_millis(100)).into()).await;
    let again = resolver.lookup("short.test").await.unwrap();
    assert_eq!(again.addrs, vec![ip("8.8.4.4")]);
    assert!(
        stub.queries() > asked,
        "the expired answer should be asked again"
    );
}

#[tokio::test]
async fn resolve_checked_refuses_sluices_own_listener() {
    let config = Config::parse(
        "t.yaml",
        "listen: [\"127.0.0.1:8080\"]\negress: {deny: []}\nroutes: []\n",
    )
    .unwrap();
    let g = Guard::from(&config);
    let resolver = Resolver::new(&[], "127.0.0.1 me.test\n");
    assert!(matches!(
        resolver.resolve_checked(&g, "me.test", 8080).await,
        Err(Refusal::Denied(Denial {
            rule: Rule::OwnListener(_),
            ..
        }))
    ));
    assert_eq!(
        resolver.resolve_checked(&g, "me.test", 8081).await,
        Ok(vec!["127.0.0.1:8081".parse().unwrap()])
    );
}

#[tokio::test]
async fn every_answer_is_checked_however_briefly_it_lives() {
    // A name whose owner answers with a public address and a zero TTL, then rebinds it to
    // loopback: the second answer is checked as the first was, and refused.
    let stub = Stub::start(&[("rebind.test", Ipv4Addr::new(8, 8, 8, 8), 0)]).await;
    let resolver = Resolver::new(&[stub.addr], "");
    let g = Guard::default();
    assert_eq!(
        resolver.resolve_checked(&g, "rebind.test", 443).await,
        Ok(vec!["8.8.8.8:443".parse().unwrap()])
    );
    stub.set(&[("rebind.test", Ipv4Addr::LOCALHOST, 0)]);
    match resolver.resolve_checked(&g, "rebind.test", 443).await {
        Err(Refusal::Denied(d)) => assert_eq!(d.addr, ip("127.0.0.1")),
        other => panic!("expected a denial, got {other:?}"),
    }
}

/// As sluice uses it: one resolver built outside any runtime (server.rs), then asked from
/// several runtimes, each on its own thread, the way Pingora runs a service (one runtime per
/// thread). hickory spawns a lookup's I/O on the runtime that asks; the others must still be
/// answered, also once the runtime that spawned it is gone.
#[test]
fn one_resolver_serves_lookups_from_several_runtimes() {
    let stub_rt = tokio::runtime::Runtime::new().unwrap();
    // TTL 0: every lookup really asks the stub.
    let stub = stub_rt.block_on(Stub::start(&[(
        "shared.test",
        Ipv4Addr::new(8, 8, 8, 8),
        0,
    )]));
    let resolver = Resolver::new(&[stub.addr], "");
    let ask = |resolver: Resolver| {
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            for _ in 0..3 {
                let found =
                    rt.block_on(resolver.resolve_checked(&Guard::default(), "shared.test", 443));
                assert_eq!(found, Ok(vec!["8.8.8.8:443".parse().unwrap()]));
            }
            // The runtime, and whatever hickory spawned on it, ends with the thread.
        })
    };
    let (a, b) = (ask(resolver.clone()), ask(resolver.clone()));
    a.join().unwrap();
    b.join().unwrap();
    ask(resolver).join().unwrap();
    assert!(stub.queries() >= 3, "{} queries", stub.queries());
}
