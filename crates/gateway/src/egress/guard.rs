//! The guard itself: which addresses and ports sluice may connect to for a client.
//!
//! # What `private` denies
//!
//! Every range of IANA's IPv4 and IPv6 special-purpose registries that is not globally
//! reachable, listed one by one in [`V4_CLASSES`] and [`V6_CLASSES`] with their RFCs, plus
//! every IPv6 address outside 2000::/3 (no global unicast is allocated there). IPv6 forms
//! that carry an IPv4 address — IPv4-mapped `::ffff:0:0/96`, IPv4-translated `::ffff:0:0:0/96`,
//! IPv4-compatible `::/96`, NAT64 `64:ff9b::/96`, 6to4 `2002::/16` and Teredo `2001::/32` — are
//! judged by the IPv4 address they carry, so `::ffff:127.0.0.1`, `64:ff9b::a9fe:a9fe` and
//! `2002:7f00:1::` are denied exactly as 127.0.0.1 and 169.254.169.254 are, while
//! `64:ff9b::808:808` (8.8.8.8 through a NAT64 gateway) is allowed as 8.8.8.8 is. The local-use
//! NAT64 prefix `64:ff9b:1::/48` (RFC 8215) is denied whole: its operator chooses where the IPv4
//! address sits (RFC 6052 allows four layouts), so it cannot be read reliably.
//!
//! Smokescreen (Stripe's egress proxy, the model here) denies every embedding form outright.
//! sluice reads through them instead, so that NAT64 on an IPv6-only host keeps working, and
//! proves by property test that each form of an IPv4 address gets that address's verdict.
//!
//! # Precedence
//!
//! `allow_cidrs` always win: an address inside one is allowed whatever `deny` says (no
//! "most specific rule" contest: Smokescreen's users found that one surprising). CIDRs match the
//! address and, for the forms above, the IPv4 address it carries: `allow_cidrs: [10.20.0.0/16]`
//! also allows `::ffff:10.20.0.1`, and `deny: [198.51.100.0/24]` also denies `2002:c633:6401::`.
//!
//! # sluice's own listeners
//!
//! Built from the whole config, the guard also refuses the proxy and admin listeners, even
//! with `deny: []` and whatever `allow_cidrs` say, as Smokescreen refuses self-connections: a
//! client could otherwise make sluice connect to itself, again and again (each hop holding a
//! connection and its memory), or reach the admin API through the proxy. A listener on
//! `0.0.0.0` or `::` is reached through every address of the host's interfaces, loopback
//! included, on its port. Unspecified addresses (`0.0.0.0/8`, `::`, and the IPv6 forms carrying
//! them) reach the host itself and are refused always, on every port. Inside a `direct`
//! tunnel the client writes the bytes, so these address checks are what stops a loop there;
//! for requests sluice forwards, its `Via` header also catches loops that no address shows
//! (through another proxy, say).

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::LazyLock;

use ipnet::IpNet;

use crate::config::{Config, DenyEntry, EgressConfig};

/// A class of addresses that `deny: [private]` refuses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Class {
    /// 0.0.0.0, `::`: "any address"; connecting to it reaches the host itself.
    Unspecified,
    /// 0.0.0.0/8: "this network".
    ThisNetwork,
    /// 127.0.0.0/8, `::1`.
    Loopback,
    /// RFC 1918: 10/8, 172.16/12, 192.168/16.
    Private,
    /// 100.64.0.0/10, carrier-grade NAT shared space (also Alibaba's metadata service).
    Cgnat,
    /// 169.254.0.0/16 (cloud metadata at 169.254.169.254), fe80::/10.
    LinkLocal,
    /// 192.0.0.0/24, IETF protocol assignments (Oracle's metadata at 192.0.0.192).
    IetfProtocol,
    /// TEST-NET-1/2/3, 2001:db8::/32, 3fff::/20.
    Documentation,
    /// 198.18.0.0/15, 2001:2::/48.
    Benchmarking,
    /// 192.88.99.0/24, the withdrawn 6to4 relay anycast.
    Relay6to4,
    /// 224.0.0.0/4, ff00::/8.
    Multicast,
    /// 255.255.255.255.
    Broadcast,
    /// 240.0.0.0/4, and IPv6 outside 2000::/3 not otherwise named.
    Reserved,
    /// 100::/64, discard-only.
    Discard,
    /// 2001:10::/28, the withdrawn ORCHID.
    Orchid,
    /// 64:ff9b:1::/48, local-use IPv4/IPv6 translation.
    LocalTranslation,
    /// 5f00::/16, segment-routing SIDs.
    Srv6,
    /// fc00::/7, unique local addresses.
    UniqueLocal,
    /// fec0::/10, the withdrawn site-local.
    SiteLocal,
}

impl Class {
    /// The class's name as logs show it.
    pub fn name(self) -> &'static str {
        match self {
            Class::Unspecified => "unspecified",
            Class::ThisNetwork => "this-network",
            Class::Loopback => "loopback",
            Class::Private => "private",
            Class::Cgnat => "cgnat",
            Class::LinkLocal => "link-local",
            Class::IetfProtocol => "ietf-protocol",
            Class::Documentation => "documentation",
            Class::Benchmarking => "benchmarking",
            Class::Relay6to4 => "6to4-relay",
            Class::Multicast => "multicast",
            Class::Broadcast => "broadcast",
            Class::Reserved => "reserved",
            Class::Discard => "discard",
            Class::Orchid => "orchid",
            Class::LocalTranslation => "local-nat64",
            Class::Srv6 => "srv6-sid",
            Class::UniqueLocal => "unique-local",
            Class::SiteLocal => "site-local",
        }
    }
}

/// One denied range: where, which class, and the RFC that sets it apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Range {
    /// The range.
    pub net: IpNet,
    /// Its class.
    pub class: Class,
    /// The RFC that defines it.
    pub rfc: &'static str,
}

/// The IPv4 ranges of `private`, the first match naming the class. From IANA's IPv4
/// special-purpose address registry, every entry not globally reachable; the globally reachable
/// ones (AS112 192.31.196.0/24 and 192.175.48.0/24, AMT 192.52.193.0/24) stay allowed.
pub const V4_CLASSES: &[(&str, Class, &str)] = &[
    ("0.0.0.0/32", Class::Unspecified, "RFC 1122"),
    ("0.0.0.0/8", Class::ThisNetwork, "RFC 791"),
    ("10.0.0.0/8", Class::Private, "RFC 1918"),
    ("100.64.0.0/10", Class::Cgnat, "RFC 6598"),
    ("127.0.0.0/8", Class::Loopback, "RFC 1122"),
    ("169.254.0.0/16", Class::LinkLocal, "RFC 3927"),
    ("172.16.0.0/12", Class::Private, "RFC 1918"),
    // Whole, although 192.0.0.9 and 192.0.0.10 (PCP and TURN anycast) are global: nothing a
    // client should tunnel to, and Oracle Cloud's metadata service is 192.0.0.192.
    ("192.0.0.0/24", Class::IetfProtocol, "RFC 6890"),
    ("192.0.2.0/24", Class::Documentation, "RFC 5737"),
    ("192.88.99.0/24", Class::Relay6to4, "RFC 7526"),
    ("192.168.0.0/16", Class::Private, "RFC 1918"),
    ("198.18.0.0/15", Class::Benchmarking, "RFC 2544"),
    ("198.51.100.0/24", Class::Documentation, "RFC 5737"),
    ("203.0.113.0/24", Class::Documentation, "RFC 5737"),
    ("224.0.0.0/4", Class::Multicast, "RFC 5771"),
    ("255.255.255.255/32", Class::Broadcast, "RFC 919"),
    ("240.0.0.0/4", Class::Reserved, "RFC 1112"),
];

/// The IPv6 ranges of `private`, besides the forms that carry an IPv4 address (judged by that
/// address, see [`Embedded`]) and the catch-all "outside 2000::/3". From IANA's IPv6
/// special-purpose address registry; its globally reachable entries (2001:1::1/128,
/// 2001:1::2/128, 2001:3::/32, 2001:4:112::/48, 2001:20::/28, 2001:30::/28) stay allowed.
pub const V6_CLASSES: &[(&str, Class, &str)] = &[
    ("::/128", Class::Unspecified, "RFC 4291"),
    ("::1/128", Class::Loopback, "RFC 4291"),
    ("64:ff9b:1::/48", Class::LocalTranslation, "RFC 8215"),
    ("100::/64", Class::Discard, "RFC 6666"),
    ("2001:2::/48", Class::Benchmarking, "RFC 5180"),
    ("2001:10::/28", Class::Orchid, "RFC 4843"),
    ("2001:db8::/32", Class::Documentation, "RFC 3849"),
    ("3fff::/20", Class::Documentation, "RFC 9637"),
    ("5f00::/16", Class::Srv6, "RFC 9602"),
    ("fc00::/7", Class::UniqueLocal, "RFC 4193"),
    ("fe80::/10", Class::LinkLocal, "RFC 4291"),
    ("fec0::/10", Class::SiteLocal, "RFC 3879"),
    ("ff00::/8", Class::Multicast, "RFC 4291"),
];

/// Global unicast IPv6 is allocated from here only (RFC 4291 §2.4, IANA's IPv6 address space).
const V6_GLOBAL_UNICAST: (u128, u8) = (0x2000 << 112, 3);

fn table(entries: &[(&str, Class, &'static str)]) -> Vec<Range> {
    entries
        .iter()
        .map(|&(net, class, rfc)| Range {
            net: net.parse().expect("a valid CIDR in the table"),
            class,
            rfc,
        })
        .collect()
}

static V4_TABLE: LazyLock<Vec<Range>> = LazyLock::new(|| table(V4_CLASSES));
static V6_TABLE: LazyLock<Vec<Range>> = LazyLock::new(|| table(V6_CLASSES));

/// An IPv6 form that carries an IPv4 address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Form {
    /// `::ffff:a.b.c.d` (RFC 4291): a dual-stack socket connects to a.b.c.d itself.
    Mapped,
    /// `::ffff:0:a.b.c.d` (RFC 2765, SIIT).
    Translated,
    /// `::a.b.c.d` (RFC 4291, deprecated).
    Compatible,
    /// `64:ff9b::a.b.c.d` (RFC 6052): a NAT64 gateway connects to a.b.c.d.
    Nat64,
    /// `2002:AABB:CCDD::/48` (RFC 3056): a 6to4 relay sends to aa.bb.cc.dd.
    SixToFour,
    /// `2001:0:SSSS:SSSS:FLAGS:PORT:CCCC:CCCC` (RFC 4380): the client's IPv4 address is the
    /// last 32 bits inverted; a Teredo relay sends to it.
    Teredo,
}

impl Form {
    fn name(self) -> &'static str {
        match self {
            Form::Mapped => "IPv4-mapped",
            Form::Translated => "IPv4-translated",
            Form::Compatible => "IPv4-compatible",
            Form::Nat64 => "NAT64",
            Form::SixToFour => "6to4",
            Form::Teredo => "Teredo",
        }
    }
}

/// The IPv4 address an IPv6 address carries, and how.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Embedded {
    /// How it is carried.
    pub form: Form,
    /// The address carried.
    pub v4: Ipv4Addr,
}

/// The IPv4 address `ip` carries, if it is one of the forms of [`Form`]. `::` and `::1` are
/// not IPv4-compatible addresses but themselves (RFC 4291).
pub fn embedded(ip: Ipv6Addr) -> Option<Embedded> {
    let bits = u128::from(ip);
    let s = ip.segments();
    let low = Ipv4Addr::from(bits as u32);
    let form = if bits >> 32 == 0xffff {
        Form::Mapped
    } else if bits >> 32 == 0xffff_0000 {
        Form::Translated
    } else if bits >> 32 == 0 {
        if bits <= 1 {
            return None;
        }
        Form::Compatible
    } else if bits >> 32 == 0x0064_ff9b_0000_0000_0000_0000 {
        Form::Nat64
    } else if s[0] == 0x2002 {
        let v4 = Ipv4Addr::from((u32::from(s[1]) << 16) | u32::from(s[2]));
        return Some(Embedded {
            form: Form::SixToFour,
            v4,
        });
    } else if s[0] == 0x2001 && s[1] == 0 {
        return Some(Embedded {
            form: Form::Teredo,
            v4: Ipv4Addr::from(!(bits as u32)),
        });
    } else {
        return None;
    };
    Some(Embedded { form, v4: low })
}

/// Why an address was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    /// It is in a class of `private`.
    Class {
        /// The class.
        class: Class,
        /// The RFC that sets the range apart.
        rfc: &'static str,
    },
    /// It is in a CIDR of `deny`.
    Cidr(IpNet),
    /// It is sluice's own listener (this one): a tunnel to it would loop through sluice.
    OwnListener(SocketAddr),
    /// It is unspecified (`0.0.0.0/8`, `::`): connecting to it reaches this host itself, so it
    /// is refused whatever `deny` and `allow_cidrs` say.
    Unspecified,
}

/// An address the guard refuses, and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Denial {
    /// The address asked about.
    pub addr: IpAddr,
    /// The IPv4 address it carries, when that is what was denied.
    pub via: Option<Embedded>,
    /// The rule that denies it.
    pub rule: Rule,
}

impl Denial {
    /// A short name of the rule for logs and metrics: the class (`loopback`, `cgnat`...) or the
    /// CIDR of `deny`.
    pub fn reason(&self) -> String {
        match self.rule {
            Rule::Class { class, .. } => class.name().to_string(),
            Rule::Cidr(net) => net.to_string(),
            Rule::OwnListener(_) => "own-listener".to_string(),
            Rule::Unspecified => "unspecified".to_string(),
        }
    }
}

impl fmt::Display for Denial {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.addr)?;
        if let Some(e) = self.via {
            write!(f, " carries {} ({})", e.v4, e.form.name())?;
            write!(f, ", which")?;
        }
        match self.rule {
            Rule::Class { class, rfc } => write!(f, " is {} ({rfc})", class.name()),
            Rule::Cidr(net) => write!(f, " is in egress.deny {net}"),
            Rule::OwnListener(own) => write!(
                f,
                " port {} is sluice's own listener {own}: a tunnel to it would loop",
                own.port()
            ),
            Rule::Unspecified => write!(
                f,
                " is unspecified: it reaches this host itself, and is never allowed"
            ),
        }
    }
}

impl std::error::Error for Denial {}

/// Why an address was allowed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Allowed {
    /// `deny` is empty: the address checks are off.
    GuardOff,
    /// It is inside this CIDR of `allow_cidrs`.
    AllowCidr(IpNet),
    /// Nothing in `deny` matches it.
    NotDenied,
}

/// A CONNECT to a port outside `connect_ports`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortDenied {
    /// The port asked for.
    pub port: u16,
}

impl fmt::Display for PortDenied {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "port {} is not in egress.connect_ports", self.port)
    }
}

impl std::error::Error for PortDenied {}

/// The egress guard, built from the `egress:` config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Guard {
    /// `deny` holds `private`.
    private: bool,
    /// The CIDRs of `deny`.
    deny: Vec<IpNet>,
    /// `allow_cidrs`.
    allow: Vec<IpNet>,
    /// `connect_ports`.
    connect_ports: Vec<u16>,
    /// sluice's own listeners, which no client may make it connect to.
    own: Vec<SocketAddr>,
}

impl Default for Guard {
    /// The default config: `deny: [private]`, no exceptions, CONNECT to port 443 only.
    fn default() -> Self {
        Guard::from(&EgressConfig::default())
    }
}

impl From<&EgressConfig> for Guard {
    fn from(config: &EgressConfig) -> Self {
        let mut guard = Guard {
            private: false,
            deny: Vec::new(),
            allow: config.allow_cidrs.iter().map(|c| c.0).collect(),
            connect_ports: config.connect_ports.iter().map(|p| p.get()).collect(),
            own: Vec::new(),
        };
        for entry in &config.deny {
            match entry {
                DenyEntry::Private => guard.private = true,
                DenyEntry::Cidr(c) => guard.deny.push(c.0),
            }
        }
        guard
    }
}

impl From<&Config> for Guard {
    /// The guard of `egress`, which also knows the proxy and admin listeners as sluice's own.
    fn from(config: &Config) -> Self {
        let listeners = config.listen.iter().map(|l| l.addr);
        Guard::from(&config.egress).with_own_listeners(listeners.chain([config.admin.listen.0]))
    }
}

impl Guard {
    /// The same guard, refusing also to connect to `listeners`, sluice's own addresses: a
    /// client could otherwise make sluice connect to itself, again and again. A listener on
    /// `0.0.0.0` or `::` counts as every loopback address on its port.
    pub fn with_own_listeners(mut self, listeners: impl IntoIterator<Item = SocketAddr>) -> Self {
        self.own.extend(listeners);
        self
    }

    /// True when `deny` is empty, so that every address is allowed (ports are still checked).
    pub fn is_off(&self) -> bool {
        !self.private && self.deny.is_empty()
    }

    /// May sluice connect to `ip` for a client? Allowed with the reason, or the [`Denial`].
    pub fn check_ip(&self, ip: IpAddr) -> Result<Allowed, Denial> {
        if self.is_off() {
            return Ok(Allowed::GuardOff);
        }
        let via = match ip {
            IpAddr::V4(_) => None,
            IpAddr::V6(v6) => embedded(v6),
        };
        let carried = via.map(|e| IpAddr::V4(e.v4));
        let matches = |net: &IpNet| net.contains(&ip) || carried.is_some_and(|c| net.contains(&c));
        if let Some(net) = self.allow.iter().find(|n| matches(n)) {
            return Ok(Allowed::AllowCidr(*net));
        }
        if let Some(net) = self.deny.iter().find(|n| matches(n)) {
            let via = via.filter(|_| !net.contains(&ip));
            return Err(Denial {
                addr: ip,
                via,
                rule: Rule::Cidr(*net),
            });
        }
        if self.private {
            let (judged, via) = match via {
                Some(e) => (IpAddr::V4(e.v4), Some(e)),
                None => (ip, None),
            };
            if let Some(range) = class_of(judged) {
                return Err(Denial {
                    addr: ip,
                    via,
                    rule: Rule::Class {
                        class: range.class,
                        rfc: range.rfc,
                    },
                });
            }
        }
        Ok(Allowed::NotDenied)
    }

    /// May sluice connect to `addr` for a client? [`Guard::check_ip`], and never, even with
    /// `deny: []` and whatever `allow_cidrs` say, an unspecified address or one of sluice's own
    /// listeners: a loop is never wanted. A listener on `0.0.0.0` or `::` is reached through
    /// every address of the host's own interfaces, loopback included.
    pub fn check_addr(&self, addr: SocketAddr) -> Result<Allowed, Denial> {
        let ip = addr.ip();
        let embedded = match ip {
            IpAddr::V6(v6) => embedded(v6),
            IpAddr::V4(_) => None,
        };
        let carried = embedded.map(|e| IpAddr::V4(e.v4));
        // `0.0.0.0`, `0.x.y.z` and `::` connect to the host itself on Linux: to whatever
        // listens on the port, sluice included.
        if let Some(unspecified) = [Some(ip), carried]
            .into_iter()
            .flatten()
            .find(|ip| is_unspecified(*ip))
        {
            return Err(Denial {
                addr: ip,
                via: embedded.filter(|_| unspecified != ip),
                rule: Rule::Unspecified,
            });
        }
        // The host's addresses are read only when the port is a wildcard listener's, and then
        // afresh (interfaces come and go): no cost on any other destination.
        let mut host_addrs: Option<Vec<IpAddr>> = None;
        let mut is_host = |ip: IpAddr| {
            ip.is_loopback() || host_addrs.get_or_insert_with(host_addresses).contains(&ip)
        };
        let mut reaches = |own: &SocketAddr| {
            own.port() == addr.port()
                && [Some(ip), carried]
                    .into_iter()
                    .flatten()
                    .any(|ip| ip == own.ip() || (own.ip().is_unspecified() && is_host(ip)))
        };
        if let Some(own) = self.own.iter().find(|own| reaches(own)) {
            return Err(Denial {
                addr: ip,
                via: None,
                rule: Rule::OwnListener(*own),
            });
        }
        self.check_ip(ip)
    }

    /// May a CONNECT target `port`?
    pub fn check_connect_port(&self, port: u16) -> Result<(), PortDenied> {
        if self.connect_ports.contains(&port) {
            Ok(())
        } else {
            Err(PortDenied { port })
        }
    }
}

/// `0.0.0.0/8` ("this network", which Linux connects to the host itself) and `::`.
fn is_unspecified(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.octets()[0] == 0,
        IpAddr::V6(v6) => v6.is_unspecified(),
    }
}

/// Every address of the host's own interfaces, as the kernel lists them now. An empty list if
/// they cannot be read: loopback and unspecified are refused apart, without it.
fn host_addresses() -> Vec<IpAddr> {
    let Ok(interfaces) = nix::ifaddrs::getifaddrs() else {
        return Vec::new();
    };
    interfaces
        .filter_map(|i| i.address)
        .filter_map(|a| {
            if let Some(v4) = a.as_sockaddr_in() {
                Some(IpAddr::V4(v4.ip()))
            } else {
                a.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip()))
            }
        })
        .collect()
}

/// The class of `private` that `ip` falls in, not looking through embedding forms.
fn class_of(ip: IpAddr) -> Option<Range> {
    match ip {
        IpAddr::V4(_) => V4_TABLE.iter().find(|r| r.net.contains(&ip)).copied(),
        IpAddr::V6(v6) => V6_TABLE
            .iter()
            .find(|r| r.net.contains(&ip))
            .copied()
            .or_else(|| {
                let (prefix, len) = V6_GLOBAL_UNICAST;
                let outside = (u128::from(v6) ^ prefix) >> (128 - len) != 0;
                outside.then(|| Range {
                    net: IpNet::new(ip, 128).expect("a /128"),
                    class: Class::Reserved,
                    rfc: "RFC 4291",
                })
            }),
    }
}

#[cfg(test)]
pub(super) mod tests;
