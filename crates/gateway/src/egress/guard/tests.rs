//! The guard, address by address at every boundary; the embedded forms by property.

use super::*;
use crate::config::Config;
use proptest::prelude::*;

pub(in crate::egress) fn ip(s: &str) -> IpAddr {
    s.parse()
        .unwrap_or_else(|_| panic!("{s} is not an address"))
}

/// The guard of `egress: {yaml}`, through the config parser as a user would write it.
pub(in crate::egress) fn guard(yaml: &str) -> Guard {
    let config = Config::parse("t.yaml", &format!("egress: {yaml}\nroutes: []\n"))
        .unwrap_or_else(|e| panic!("{e}"));
    Guard::from(&config.egress)
}

/// The class name `guard` denies `addr` for, or `None` if it allows it.
fn class(guard: &Guard, addr: &str) -> Option<&'static str> {
    match guard.check_ip(ip(addr)) {
        Ok(_) => None,
        Err(Denial {
            rule: Rule::Class { class, .. },
            ..
        }) => Some(class.name()),
        Err(d) => panic!("{addr}: denied by {d}, not by a class"),
    }
}

#[track_caller]
fn assert_classes(guard: &Guard, cases: &[(&str, Option<&str>)]) {
    let wrong: Vec<String> = cases
        .iter()
        .filter(|(addr, want)| class(guard, addr) != *want)
        .map(|(addr, want)| format!("{addr}: want {want:?}, got {:?}", class(guard, addr)))
        .collect();
    assert!(wrong.is_empty(), "{wrong:#?}");
}

#[test]
fn the_default_is_deny_private_and_connect_to_443_and_80() {
    let config = Config::parse("t.yaml", "routes: []\n").unwrap();
    assert_eq!(config.egress, EgressConfig::default());
    let g = Guard::from(&config.egress);
    assert_eq!(g, Guard::default());
    assert!(!g.is_off());
    assert_eq!(g.check_connect_port(443), Ok(()));
    assert_eq!(g.check_connect_port(80), Ok(()));
    assert_eq!(g.check_connect_port(22), Err(PortDenied { port: 22 }));
}

#[test]
fn every_ipv4_class_inside_and_just_outside() {
    let g = Guard::default();
    assert_classes(
        &g,
        &[
            ("0.0.0.0", Some("unspecified")),
            ("0.0.0.1", Some("this-network")),
            ("0.255.255.255", Some("this-network")),
            ("1.0.0.0", None),
            ("9.255.255.255", None),
            ("10.0.0.0", Some("private")),
            ("10.255.255.255", Some("private")),
            ("11.0.0.0", None),
            ("100.63.255.255", None),
            ("100.64.0.0", Some("cgnat")),
            ("100.100.100.200", Some("cgnat")),
            ("100.127.255.255", Some("cgnat")),
            ("100.128.0.0", None),
            ("126.255.255.255", None),
            ("127.0.0.1", Some("loopback")),
            ("127.255.255.255", Some("loopback")),
            ("128.0.0.0", None),
            ("169.253.255.255", None),
            ("169.254.0.0", Some("link-local")),
            ("169.254.169.254", Some("link-local")),
            ("169.254.255.255", Some("link-local")),
            ("169.255.0.0", None),
            ("172.15.255.255", None),
            ("172.16.0.0", Some("private")),
            ("172.31.255.255", Some("private")),
            ("172.32.0.0", None),
            ("191.255.255.255", None),
            ("192.0.0.0", Some("ietf-protocol")),
            ("192.0.0.192", Some("ietf-protocol")),
            ("192.0.1.0", None),
            ("192.0.2.0", Some("documentation")),
            ("192.0.2.255", Some("documentation")),
            ("192.0.3.0", None),
            ("192.31.196.1", None), // AS112: globally reachable
            ("192.52.193.1", None), // AMT: globally reachable
            ("192.88.98.255", None),
            ("192.88.99.1", Some("6to4-relay")),
            ("192.88.100.0", None),
            ("192.167.255.255", None),
            ("192.168.0.0", Some("private")),
            ("192.168.255.255", Some("private")),
            ("192.169.0.0", None),
            ("192.175.48.1", None), // AS112: globally reachable
            ("198.17.255.255", None),
            ("198.18.0.0", Some("benchmarking")),
            ("198.19.255.255", Some("benchmarking")),
            ("198.20.0.0", None),
            ("198.51.99.255", None),
            ("198.51.100.0", Some("documentation")),
            ("198.51.100.255", Some("documentation")),
            ("198.51.101.0", None),
            ("203.0.112.255", None),
            ("203.0.113.0", Some("documentation")),
            ("203.0.113.255", Some("documentation")),
            ("203.0.114.0", None),
            ("223.255.255.255", None),
            ("224.0.0.0", Some("multicast")),
            ("239.255.255.255", Some("multicast")),
            ("240.0.0.0", Some("reserved")),
            ("255.255.255.254", Some("reserved")),
            ("255.255.255.255", Some("broadcast")),
            ("8.8.8.8", None),
            ("1.1.1.1", None),
        ],
    );
}

#[test]
fn every_ipv6_class_inside_and_just_outside() {
    let g = Guard::default();
    assert_classes(
        &g,
        &[
            ("::", Some("unspecified")),
            ("::1", Some("loopback")),
            // ::2 is IPv4-compatible 0.0.0.2.
            ("::2", Some("this-network")),
            ("64:ff9b:1::", Some("local-nat64")),
            ("64:ff9b:1:ffff:ffff:ffff:ffff:ffff", Some("local-nat64")),
            ("64:ff9b:2::", Some("reserved")),
            ("100::", Some("discard")),
            ("100::ffff:ffff:ffff:ffff", Some("discard")),
            ("100:0:0:1::", Some("reserved")),
            ("1fff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", Some("reserved")),
            ("2000::", None),
            ("2001:1::1", None), // PCP anycast: globally reachable
            ("2001:1:ffff::", None),
            ("2001:2::", Some("benchmarking")),
            ("2001:2:0:ffff::1", Some("benchmarking")),
            ("2001:2:1::", None),
            ("2001:f:ffff::", None),
            ("2001:10::", Some("orchid")),
            ("2001:1f:ffff:ffff::", Some("orchid")),
            ("2001:20::1", None), // ORCHIDv2: globally reachable
            ("2001:db7:ffff::", None),
            ("2001:db8::", Some("documentation")),
            ("2001:db8:ffff:ffff::1", Some("documentation")),
            ("2001:db9::", None),
            ("2606:4700::1111", None),
            ("3ffe:ffff::", None),
            ("3fff::", Some("documentation")),
            ("3fff:fff:ffff::", Some("documentation")),
            ("3fff:1000::", None),
            ("3fff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", None),
            ("4000::", Some("reserved")),
            ("5eff:ffff::", Some("reserved")),
            ("5f00::", Some("srv6-sid")),
            ("5f00:ffff::", Some("srv6-sid")),
            ("5f01::", Some("reserved")),
            ("fbff:ffff::", Some("reserved")),
            ("fc00::", Some("unique-local")),
            ("fd12:3456::1", Some("unique-local")),
            (
                "fdff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
                Some("unique-local"),
            ),
            ("fe00::", Some("reserved")),
            ("fe7f:ffff::", Some("reserved")),
            ("fe80::", Some("link-local")),
            ("fe80::1", Some("link-local")),
            ("febf:ffff::", Some("link-local")),
            ("fec0::", Some("site-local")),
            ("feff:ffff::", Some("site-local")),
            ("ff00::", Some("multicast")),
            ("ff02::1", Some("multicast")),
            ("ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", Some("multicast")),
        ],
    );
}

/// 10.0.0.1 as a Teredo client behind server 65.54.227.120, port 40000: the last 32 bits are
/// the client's address inverted (RFC 4380 §4).
const TEREDO_10_0_0_1: &str = "2001:0:4136:e378:8000:63bf:f5ff:fffe";

#[test]
fn mapped_and_embedded_forms_are_judged_by_their_ipv4_address() {
    let g = Guard::default();
    assert_classes(
        &g,
        &[
            ("::ffff:127.0.0.1", Some("loopback")),
            ("::ffff:7f00:1", Some("loopback")),
            ("::ffff:0:7f00:1", Some("loopback")),
            ("::127.0.0.1", Some("loopback")),
            ("64:ff9b::7f00:1", Some("loopback")),
            ("2002:7f00:0001::", Some("loopback")),
            ("2002:7f00:1:ffff:1:2:3:4", Some("loopback")),
            ("::ffff:169.254.169.254", Some("link-local")),
            ("64:ff9b::a9fe:a9fe", Some("link-local")),
            ("64:ff9b::169.254.169.254", Some("link-local")),
            ("2002:a9fe:a9fe::", Some("link-local")),
            ("::ffff:100.64.0.1", Some("cgnat")),
            ("64:ff9b::6440:1", Some("cgnat")),
            ("2002:6464:64c8::", Some("cgnat")),
            ("::ffff:10.0.0.1", Some("private")),
            ("::ffff:192.168.1.1", Some("private")),
            ("64:ff9b::ac10:1", Some("private")),
            ("2002:a00:1::", Some("private")),
            (TEREDO_10_0_0_1, Some("private")),
            ("::ffff:0.0.0.0", Some("unspecified")),
            ("::ffff:255.255.255.255", Some("broadcast")),
            // The same forms around a public address are that address.
            ("::ffff:8.8.8.8", None),
            ("::ffff:0:808:808", None),
            ("::8.8.8.8", None),
            ("64:ff9b::808:808", None),
            ("2002:808:808::1", None),
            ("2001:0:4136:e378:8000:63bf:f7f7:f7f7", None),
            // 64:ff9b::/96 only: next to it, nothing is embedded.
            ("64:ff9b:0:0:0:1::", Some("reserved")),
        ],
    );
    let d = g.check_ip(ip(TEREDO_10_0_0_1)).unwrap_err();
    assert_eq!(
        d.via,
        Some(Embedded {
            form: Form::Teredo,
            v4: Ipv4Addr::new(10, 0, 0, 1)
        })
    );
    assert_eq!(d.reason(), "private");
    assert_eq!(
        d.to_string(),
        format!("{TEREDO_10_0_0_1} carries 10.0.0.1 (Teredo), which is private (RFC 1918)")
    );
    assert_eq!(
        g.check_ip(ip("127.0.0.1")).unwrap_err().to_string(),
        "127.0.0.1 is loopback (RFC 1122)"
    );
    assert_eq!(
        g.check_ip(ip("64:ff9b::a9fe:a9fe")).unwrap_err().via,
        Some(Embedded {
            form: Form::Nat64,
            v4: Ipv4Addr::new(169, 254, 169, 254)
        })
    );
    assert_eq!(
        g.check_ip(ip("2002:7f00:0001::"))
            .unwrap_err()
            .via
            .map(|e| e.form),
        Some(Form::SixToFour)
    );
}

#[test]
fn allow_cidrs_are_exceptions_to_deny() {
    let g = guard("{allow_cidrs: [10.20.0.0/16, \"fd00:1::/32\", 169.254.169.254]}");
    let allowed = |s: &str| g.check_ip(ip(s));
    let net = |s: &str| s.parse::<IpNet>().unwrap();
    assert_eq!(
        allowed("10.20.1.1"),
        Ok(Allowed::AllowCidr(net("10.20.0.0/16")))
    );
    assert_eq!(
        allowed("::ffff:10.20.0.1"),
        Ok(Allowed::AllowCidr(net("10.20.0.0/16")))
    );
    assert_eq!(
        allowed("2002:a14:1::"),
        Ok(Allowed::AllowCidr(net("10.20.0.0/16")))
    );
    assert_eq!(
        allowed("fd00:1::5"),
        Ok(Allowed::AllowCidr(net("fd00:1::/32")))
    );
    assert_eq!(
        allowed("169.254.169.254"),
        Ok(Allowed::AllowCidr(net("169.254.169.254/32")))
    );
    assert_eq!(allowed("8.8.8.8"), Ok(Allowed::NotDenied));
    assert_classes(
        &g,
        &[
            ("10.19.255.255", Some("private")),
            ("10.21.0.0", Some("private")),
            ("fd00:2::", Some("unique-local")),
            ("169.254.169.253", Some("link-local")),
            ("127.0.0.1", Some("loopback")),
        ],
    );
}

#[test]
fn deny_cidrs_add_to_private_and_match_embedded_forms() {
    let g = guard("{deny: [private, 8.8.8.0/24, \"2606:4700::/32\"]}");
    let d = g.check_ip(ip("8.8.8.8")).unwrap_err();
    assert_eq!(d.rule, Rule::Cidr("8.8.8.0/24".parse().unwrap()));
    assert_eq!(d.via, None);
    assert_eq!(d.reason(), "8.8.8.0/24");
    assert_eq!(d.to_string(), "8.8.8.8 is in egress.deny 8.8.8.0/24");
    let d = g.check_ip(ip("64:ff9b::808:808")).unwrap_err();
    assert_eq!(d.rule, Rule::Cidr("8.8.8.0/24".parse().unwrap()));
    assert_eq!(d.via.map(|e| e.v4), Some(Ipv4Addr::new(8, 8, 8, 8)));
    assert!(g.check_ip(ip("2606:4700::1111")).is_err());
    assert_eq!(g.check_ip(ip("8.8.9.9")), Ok(Allowed::NotDenied));
    assert_eq!(class(&g, "10.0.0.1"), Some("private"));

    // Without `private`, only the CIDRs are denied.
    let g = guard("{deny: [198.51.100.0/24]}");
    assert!(g.check_ip(ip("198.51.100.1")).is_err());
    assert!(g.check_ip(ip("::ffff:198.51.100.1")).is_err());
    assert_eq!(g.check_ip(ip("10.0.0.1")), Ok(Allowed::NotDenied));
    assert_eq!(g.check_ip(ip("127.0.0.1")), Ok(Allowed::NotDenied));
}

#[test]
fn an_empty_deny_turns_the_address_checks_off_but_not_the_ports() {
    let g = guard("{deny: []}");
    assert!(g.is_off());
    for addr in [
        "127.0.0.1",
        "::ffff:127.0.0.1",
        "169.254.169.254",
        "::1",
        "8.8.8.8",
    ] {
        assert_eq!(g.check_ip(ip(addr)), Ok(Allowed::GuardOff), "{addr}");
    }
    assert_eq!(g.check_connect_port(22), Err(PortDenied { port: 22 }));
}

#[test]
fn connect_ports() {
    let g = guard("{connect_ports: [443, 8443]}");
    assert_eq!(g.check_connect_port(443), Ok(()));
    assert_eq!(g.check_connect_port(8443), Ok(()));
    for port in [0, 22, 80, 442, 444, 65535] {
        assert_eq!(g.check_connect_port(port), Err(PortDenied { port }));
    }
    assert_eq!(
        PortDenied { port: 22 }.to_string(),
        "port 22 is not in egress.connect_ports"
    );
    let none = guard("{connect_ports: []}");
    assert!(none.check_connect_port(443).is_err());
}

// Every IPv6 form of an IPv4 address gets that address's verdict.

/// An IPv4 address, half of the time inside one of the denied classes, so that both verdicts
/// are well exercised.
fn any_v4() -> impl Strategy<Value = Ipv4Addr> {
    let in_class = (0..V4_CLASSES.len(), any::<u32>()).prop_map(|(i, bits)| {
        let net: ipnet::Ipv4Net = V4_CLASSES[i].0.parse().unwrap();
        Ipv4Addr::from(u32::from(net.network()) | (bits & u32::from(net.hostmask())))
    });
    prop_oneof![any::<u32>().prop_map(Ipv4Addr::from), in_class]
}

/// Every IPv6 form that carries `v4`, the free bits (Teredo server, flags and port; 6to4
/// subnet and interface) taken from `noise`.
fn forms(v4: Ipv4Addr, noise: u128) -> Vec<(Form, Ipv6Addr)> {
    let a = u128::from(u32::from(v4));
    let mut forms = vec![
        (Form::Mapped, Ipv6Addr::from((0xffff << 32) | a)),
        (Form::Translated, Ipv6Addr::from((0xffff_0000 << 32) | a)),
        (Form::Nat64, Ipv6Addr::from((0x0064_ff9b << 96) | a)),
        (
            Form::SixToFour,
            Ipv6Addr::from((0x2002 << 112) | (a << 80) | (noise & ((1 << 80) - 1))),
        ),
        (
            Form::Teredo,
            Ipv6Addr::from(
                (0x2001_0000 << 96)
                    | (noise & (((1 << 64) - 1) << 32))
                    | u128::from(!u32::from(v4)),
            ),
        ),
    ];
    // ::0.0.0.0 and ::0.0.0.1 are :: and ::1, not IPv4-compatible addresses.
    if a > 1 {
        forms.push((Form::Compatible, Ipv6Addr::from(a)));
    }
    forms
}

/// The verdict without the address itself, which differs between forms by construction.
fn verdict(g: &Guard, ip: IpAddr) -> Result<Allowed, Rule> {
    g.check_ip(ip).map_err(|d| d.rule)
}

proptest! {
    #[test]
    fn every_form_of_an_ipv4_address_gets_its_verdict(v4 in any_v4(), noise in any::<u128>()) {
        let guards = [
            Guard::default(),
            guard("{deny: [private, 8.0.0.0/8], allow_cidrs: [10.20.0.0/16, 127.0.0.0/24]}"),
            guard("{deny: [203.0.113.0/24]}"),
            guard("{deny: []}"),
        ];
        for g in &guards {
            let want = verdict(g, IpAddr::V4(v4));
            for (form, v6) in forms(v4, noise) {
                prop_assert_eq!(embedded(v6), Some(Embedded { form, v4 }), "{}", v6);
                prop_assert_eq!(verdict(g, IpAddr::V6(v6)), want, "{} ({:?}) of {}", v6, form, v4);
            }
        }
    }

    #[test]
    fn local_use_nat64_is_denied_whatever_it_carries(bits in any::<u128>()) {
        let v6 = Ipv6Addr::from((0x0064_ff9b_0001u128 << 80) | (bits & ((1 << 80) - 1)));
        prop_assert_eq!(class(&Guard::default(), &v6.to_string()), Some("local-nat64"));
    }

    #[test]
    fn outside_2000_3_only_named_classes_and_embeddings_are_not_reserved(bits in any::<u128>()) {
        let v6 = Ipv6Addr::from(bits);
        let allowed = Guard::default().check_ip(IpAddr::V6(v6)).is_ok();
        let global_unicast = bits >> 125 == 1;
        // Outside 2000::/3, only an embedded public IPv4 address is allowed.
        prop_assert!(!allowed || global_unicast || embedded(v6).is_some(), "{}", v6);
    }
}

#[test]
fn sluice_never_connects_to_its_own_listeners() {
    let config = Config::parse(
        "t.yaml",
        "listen: [\"127.0.0.1:8080\", \"0.0.0.0:3128\"]\nadmin: {listen: \"[::1]:9901\"}\negress: {deny: [], connect_ports: [443, 8080, 3128, 9901]}\nroutes: []\n",
    )
    .unwrap();
    let g = Guard::from(&config);
    let own = |s: &str| match g.check_addr(s.parse().unwrap()) {
        Err(Denial {
            rule: Rule::OwnListener(l),
            ..
        }) => Some(l.to_string()),
        Ok(_) => None,
        Err(d) => panic!("{s}: {d}"),
    };
    // Even with the address checks off.
    assert_eq!(own("127.0.0.1:8080").as_deref(), Some("127.0.0.1:8080"));
    assert_eq!(
        own("[::ffff:127.0.0.1]:8080").as_deref(),
        Some("127.0.0.1:8080")
    );
    assert_eq!(own("127.0.0.1:8081"), None);
    assert_eq!(own("127.0.0.2:8080"), None);
    // A wildcard listener is every loopback address on its port.
    assert_eq!(own("127.0.0.1:3128").as_deref(), Some("0.0.0.0:3128"));
    assert_eq!(own("127.9.9.9:3128").as_deref(), Some("0.0.0.0:3128"));
    assert_eq!(own("[::1]:3128").as_deref(), Some("0.0.0.0:3128"));
    assert_eq!(own("8.8.8.8:3128"), None);
    // ...and every address of the host's own interfaces, on its port only. Nothing is
    // contacted: this asks the guard, which reads the interface list from the kernel.
    for host in super::host_addresses() {
        let addr = std::net::SocketAddr::new(host, 3128);
        assert_eq!(
            own(&addr.to_string()).as_deref(),
            Some("0.0.0.0:3128"),
            "{addr}"
        );
        let other = std::net::SocketAddr::new(host, 3129);
        if !host.is_loopback() {
            assert!(g.check_addr(other).is_ok(), "{other}");
        }
    }
    // The admin listener too.
    assert_eq!(own("[::1]:9901").as_deref(), Some("[::1]:9901"));
    assert_eq!(own("127.0.0.1:9901"), None);

    // allow_cidrs do not open them either, and the message says why.
    let config = Config::parse(
        "t.yaml",
        "listen: [\"10.1.2.3:8080\"]\negress: {allow_cidrs: [10.0.0.0/8]}\nroutes: []\n",
    )
    .unwrap();
    let g = Guard::from(&config);
    let d = g.check_addr("10.1.2.3:8080".parse().unwrap()).unwrap_err();
    assert_eq!(d.reason(), "own-listener");
    assert_eq!(
        d.to_string(),
        "10.1.2.3 port 8080 is sluice's own listener 10.1.2.3:8080: a tunnel to it would loop"
    );
    assert!(g.check_addr("10.1.2.3:443".parse().unwrap()).is_ok());
}

#[test]
fn unspecified_addresses_are_refused_whatever_the_config_says() {
    for egress in [
        "{deny: []}",
        "{allow_cidrs: [0.0.0.0/8, \"::/0\"]}",
        "{deny: [], allow_cidrs: [0.0.0.0/0]}",
    ] {
        let g = guard(egress);
        for addr in [
            "0.0.0.0:80",
            "0.255.1.2:443",
            "[::]:80",
            "[::ffff:0.0.0.0]:80",
            "[::ffff:0.1.2.3]:443",
            "[64:ff9b::]:80",
        ] {
            let d = g
                .check_addr(addr.parse().unwrap())
                .expect_err(&format!("{egress}: {addr}"));
            assert_eq!(d.rule, Rule::Unspecified, "{egress}: {addr}");
            assert_eq!(d.reason(), "unspecified");
        }
        assert!(g.check_addr("8.8.8.8:443".parse().unwrap()).is_ok());
    }
    let d = guard("{deny: []}")
        .check_addr("[::ffff:0.0.0.0]:80".parse().unwrap())
        .unwrap_err();
    assert_eq!(
        d.to_string(),
        "::ffff:0.0.0.0 carries 0.0.0.0 (IPv4-mapped), which is unspecified: it reaches this host itself, and is never allowed"
    );
}
