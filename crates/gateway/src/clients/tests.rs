//! Identification in SPEC §9's order, its failures, and authorization, on a table built from a
//! real config.

use std::net::IpAddr;

use http::{HeaderMap, HeaderName, HeaderValue};

use super::*;
use crate::config::Config;

const BILLING: &str = "billing-token-0123456789";
const BATCH: &str = "batch-token-0123456789ab";

fn clients(extra: &str) -> Clients {
    let yaml = format!(
        "routes:
  - name: openai
    upstream: {{}}
  - name: stripe
    match: {{ hosts: [\"*.stripe.com\"] }}
    upstream: {{ members: [{{ direct: true }}] }}
clients:
{extra}  list:
    - name: billing
      tokens: [\"{BILLING}\"]
      certs: [\"spiffe://corp.example/ns/billing/sa/api\", \"billing.corp.example\"]
      routes: [openai, stripe]
      destinations: [\"*.stripe.com\", \"api.github.com:443\"]
    - name: batch
      tokens: [\"{BATCH}\"]
      cidrs: [\"10.1.0.0/16\"]
      routes: [\"*\"]
    - name: office
      cidrs: [\"192.168.0.0/24\"]
      routes: [openai]
    - name: anonymous
      routes: [openai]
"
    );
    let config = Config::parse("t.yaml", &yaml).unwrap_or_else(|e| panic!("{e}"));
    Clients::new(config.clients.as_ref().unwrap())
}

fn headers(pairs: &[(&str, &[u8])]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (name, value) in pairs {
        h.append(
            HeaderName::from_bytes(name.as_bytes()).unwrap(),
            HeaderValue::from_bytes(value).unwrap(),
        );
    }
    h
}

fn basic(user_token: &str) -> Vec<u8> {
    format!("Basic {}", STANDARD.encode(user_token)).into_bytes()
}

fn ip(s: &str) -> Option<IpAddr> {
    Some(s.parse().unwrap())
}

/// The client `identify` names, or why it did not.
fn who(
    clients: &Clients,
    h: &HeaderMap,
    token_header: Option<&str>,
    addr: Option<IpAddr>,
) -> String {
    who_with(clients, None, h, token_header, addr)
}

fn who_with(
    clients: &Clients,
    certs: Option<&[String]>,
    h: &HeaderMap,
    token_header: Option<&str>,
    addr: Option<IpAddr>,
) -> String {
    let name = token_header.map(|n| HeaderName::from_bytes(n.as_bytes()).unwrap());
    let p = Presented {
        cert_names: certs,
        headers: h,
        client_token: name.as_ref(),
        addr,
    };
    match clients.identify(&p) {
        Identity::Known(c) => c.name.to_string(),
        Identity::Unknown => "?".into(),
        Identity::Failed(f) => format!("failed: {}", f.as_str()),
    }
}

#[test]
fn proxy_authorization_basic_and_bearer_identify() {
    let c = clients("");
    let h = headers(&[("proxy-authorization", &basic(&format!("billing:{BILLING}")))]);
    assert_eq!(who(&c, &h, None, ip("127.0.0.1")), "billing");
    // The name may be left out, as `http://:token@sluice` sends it.
    let h = headers(&[("proxy-authorization", &basic(&format!(":{BILLING}")))]);
    assert_eq!(who(&c, &h, None, ip("127.0.0.1")), "billing");
    let h = headers(&[(
        "proxy-authorization",
        format!("bearer  {BILLING} ").as_bytes(),
    )]);
    assert_eq!(who(&c, &h, None, ip("127.0.0.1")), "billing");
}

#[test]
fn a_failing_credential_never_falls_back() {
    let c = clients("");
    // From the office network, which alone would identify `office`.
    let office = ip("192.168.0.7");
    assert_eq!(who(&c, &HeaderMap::new(), None, office), "office");
    for (value, reason) in [
        (basic("billing:wrong-token-0123456789"), "bad_basic"),
        (basic(&format!("batch:{BILLING}")), "bad_basic"),
        (format!("Bearer {BILLING}x").into_bytes(), "bad_token"),
        (b"Basic !!!not-base64!!!".to_vec(), "malformed"),
        (basic("no-colon-here-at-all"), "malformed"),
        (b"Basic /w==".to_vec(), "malformed"), // 0xff: not UTF-8
        (b"Digest abc".to_vec(), "malformed"),
        (b"Basic".to_vec(), "malformed"),
        (basic(&"a".repeat(10 * 1024)), "malformed"),
    ] {
        let h = headers(&[("proxy-authorization", &value)]);
        assert_eq!(
            who(&c, &h, None, office),
            format!("failed: {reason}"),
            "{}",
            String::from_utf8_lossy(&value[..value.len().min(40)])
        );
        // Nor to anonymous: authorization refuses the failure, whatever `unknown` says.
        let failed = c.identify(&Presented {
            cert_names: None,
            headers: &h,
            client_token: None,
            addr: office,
        });
        let d = c.authorize(
            failed,
            &Asked {
                route: "openai",
                target: None,
            },
        );
        assert!(d.client.is_none());
        assert!(matches!(d.refusal, Some(Refusal::AuthRequired(Some(_)))));
    }
    // Two Proxy-Authorization headers: which one counts would be a guess.
    let good = basic(&format!("billing:{BILLING}"));
    let h = headers(&[
        ("proxy-authorization", &good),
        ("proxy-authorization", &good),
    ]);
    assert_eq!(who(&c, &h, None, office), "failed: malformed");
}

#[test]
fn the_route_client_token_header_identifies_in_gateway_form() {
    let c = clients("");
    for value in [format!("Bearer {BILLING}"), BILLING.to_string()] {
        let h = headers(&[("authorization", value.as_bytes())]);
        assert_eq!(who(&c, &h, Some("authorization"), None), "billing");
        // Only on a route that names the header.
        assert_eq!(who(&c, &h, None, None), "?");
    }
    let h = headers(&[("authorization", b"Bearer sk-provider-key-000000000")]);
    assert_eq!(
        who(&c, &h, Some("authorization"), ip("192.168.0.7")),
        "failed: bad_token"
    );
    // Proxy-Authorization comes first.
    let h = headers(&[
        ("authorization", BILLING.as_bytes()),
        ("proxy-authorization", format!("Bearer {BATCH}").as_bytes()),
    ]);
    assert_eq!(who(&c, &h, Some("authorization"), ip("10.1.2.3")), "batch");
}

#[test]
fn a_certificate_comes_first_and_a_name_no_client_lists_fails() {
    let c = clients("");
    let h = headers(&[("proxy-authorization", format!("Bearer {BATCH}").as_bytes())]);
    let uri = ["spiffe://corp.example/ns/billing/sa/api".to_string()];
    assert_eq!(who_with(&c, Some(&uri), &h, None, None), "billing");
    // Names as the listener hands them on: a DNS name in any case is the same name.
    let dns = ["other.example", "Billing.Corp.Example"].map(crate::listen_tls::canonical_name);
    assert_eq!(who_with(&c, Some(&dns), &h, None, None), "billing");
    // A SPIFFE ID's path keeps its case: another workload's ID is not this client's.
    let upper = [crate::listen_tls::canonical_name(
        "SPIFFE://Corp.Example/ns/BILLING/sa/api",
    )];
    assert_eq!(
        who_with(&c, Some(&upper), &h, None, ip("192.168.0.7")),
        "failed: unknown_cert"
    );
    let stranger = ["spiffe://corp.example/ns/x/sa/y".to_string()];
    assert_eq!(
        who_with(&c, Some(&stranger), &h, None, ip("192.168.0.7")),
        "failed: unknown_cert"
    );
}

#[test]
fn a_client_with_cidrs_and_tokens_must_connect_from_them() {
    let c = clients("");
    let h = headers(&[("proxy-authorization", format!("Bearer {BATCH}").as_bytes())]);
    assert_eq!(who(&c, &h, None, ip("10.1.200.1")), "batch");
    // An IPv4 caller on a dual-stack listener arrives IPv4-mapped: the same address.
    assert_eq!(who(&c, &h, None, ip("::ffff:10.1.200.1")), "batch");
    assert_eq!(who(&c, &h, None, ip("10.2.0.1")), "failed: wrong_address");
    assert_eq!(
        who(&c, &h, None, ip("::ffff:10.2.0.1")),
        "failed: wrong_address"
    );
    assert_eq!(who(&c, &h, None, None), "failed: wrong_address");
    // Its cidrs do not identify it alone: it is no address-only client.
    assert_eq!(who(&c, &HeaderMap::new(), None, ip("10.1.200.1")), "?");
}

#[test]
fn address_only_clients_by_cidr_and_ipv4_mapped_peers() {
    let c = clients("");
    assert_eq!(
        who(&c, &HeaderMap::new(), None, ip("192.168.0.200")),
        "office"
    );
    assert_eq!(
        who(&c, &HeaderMap::new(), None, ip("::ffff:192.168.0.1")),
        "office"
    );
    assert_eq!(who(&c, &HeaderMap::new(), None, ip("192.168.1.1")), "?");
}

#[test]
fn authorization_routes_destinations_and_unknown_callers() {
    let asked = |route, target| Asked { route, target };
    let billing = || {
        let c = clients("");
        let Some(Identity::Known(b)) = Some(c.identify(&Presented {
            cert_names: None,
            headers: &headers(&[(
                "proxy-authorization",
                format!("Bearer {BILLING}").as_bytes(),
            )]),
            client_token: None,
            addr: None,
        })) else {
            panic!()
        };
        (c, b)
    };
    let (c, b) = billing();
    let decide = |route, target| {
        c.authorize(Identity::Known(b.clone()), &asked(route, target))
            .refusal
    };
    assert_eq!(decide("openai", None), None);
    assert_eq!(decide("other", None), Some(Refusal::RouteDenied));
    assert_eq!(decide("stripe", Some(("api.stripe.com", 443))), None);
    assert_eq!(decide("stripe", Some(("a.b.stripe.com", 8443))), None);
    assert_eq!(
        decide("stripe", Some(("stripe.com", 443))),
        Some(Refusal::DestinationDenied),
        "*.stripe.com is not stripe.com"
    );
    assert_eq!(
        decide("stripe", Some(("evilstripe.com", 443))),
        Some(Refusal::DestinationDenied)
    );
    assert_eq!(decide("stripe", Some(("api.github.com", 443))), None);
    assert_eq!(
        decide("stripe", Some(("api.github.com", 80))),
        Some(Refusal::DestinationDenied)
    );

    // unknown: deny (the default) refuses the unidentified; anonymous takes them in, with the
    // anonymous client's grants.
    let d = c.authorize(Identity::Unknown, &asked("openai", None));
    assert_eq!(d.refusal, Some(Refusal::AuthRequired(None)));
    let c = clients("  unknown: anonymous\n");
    let d = c.authorize(Identity::Unknown, &asked("openai", None));
    assert_eq!(
        (d.client.unwrap().name.as_ref(), d.refusal),
        ("anonymous", None)
    );
    let d = c.authorize(Identity::Unknown, &asked("stripe", None));
    assert_eq!(d.refusal, Some(Refusal::RouteDenied));
}

#[test]
fn tokens_are_found_by_digest_whatever_their_length() {
    let c = clients("");
    assert!(c.by_token(BILLING.as_bytes()).is_some());
    assert!(c
        .by_token(BATCH.as_bytes())
        .is_some_and(|b| &*b.name == "batch"));
    // A prefix, an extension, an empty and a huge token: none matches, none panics.
    for t in [
        &BILLING[..20],
        &format!("{BILLING}0"),
        "",
        &"x".repeat(100_000),
    ] {
        assert!(c.by_token(t.as_bytes()).is_none(), "{}", t.len());
    }
    // The table keeps digests only.
    assert!(!format!("{c:?}").contains(BILLING));
    assert!(!format!("{:?}", c.list[0]).contains(BILLING));
}
