//! Rules that span several fields, run once every field has parsed.
//!
//! Each problem names the YAML path to blame; the caller turns the path into a line and column.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use super::position::YamlPath;
use super::schema::*;
use super::Config;

mod clients;
mod fallback;
mod leases;
mod shards;
mod sticky;
mod usage;

/// The longest quota window. A year and a day covers any calendar quota, and keeps every sum of
/// a timestamp and a window far inside the stores' u64 microseconds.
const MAX_WINDOW: Duration = Duration::from_secs(366 * 86_400);

/// The shortest quota window. The stores timestamp requests in microseconds and `/status`
/// reports windows in whole milliseconds, where a shorter window would read as 0.
const MIN_WINDOW: Duration = Duration::from_millis(1);

/// The longest timeout, check interval or cooldown: past a day the setting is a typo (`1d`
/// meant as `1s`?) rather than a plan, and the runtime adds these to instants.
const MAX_DELAY: Duration = Duration::from_secs(86_400);
/// The longest `max_wait`: a request held longer than this is better refused and retried by
/// its client, which can see the `Retry-After`.
const MAX_WAIT: Duration = Duration::from_secs(300);

/// The largest limit, and so the largest cost (a cost above the smallest limit is refused):
/// Redis scripts count in doubles, exact only up to 2^53, and the memory store adds a cost to
/// a total that is at most a limit.
const MAX_UNITS: u64 = 1 << 53;

/// Pingora's own ceiling on a request head (`MAX_HEADER_SIZE`, pingora-core 0.9.1
/// src/protocols/http/v1/common.rs:30); past it Pingora answers 400 before sluice sees the request.
const MAX_HEADER_BYTES: u32 = 1_048_575;

/// `d` in the config's own notation, in the largest unit that writes it whole: `366d`, `25h`.
fn written(d: Duration) -> String {
    let us = d.as_micros();
    for (unit, size) in [
        ("d", 86_400_000_000),
        ("h", 3_600_000_000),
        ("m", 60_000_000),
        ("s", 1_000_000),
        ("ms", 1_000),
    ] {
        // Not is_multiple_of: that needs Rust 1.87, and sluice builds on 1.85.
        if (us / size) * size == us {
            return format!("{}{unit}", us / size);
        }
    }
    format!("{us}us")
}

/// `tracing.otlp.endpoint`: an `http://` base URL with a host, and nothing a log could leak.
fn check_otlp_endpoint(endpoint: &str) -> Result<(), String> {
    let uri: http::Uri = endpoint
        .parse()
        .map_err(|_| format!("{endpoint:?} is not a URL; write it as http://HOST:PORT"))?;
    if uri.scheme_str() != Some("http") {
        return Err(format!(
            "{endpoint:?}: only http:// OTLP receivers are supported (OTLP/HTTP, protobuf); put a collector next to sluice for TLS"
        ));
    }
    match uri.authority() {
        None => Err(format!("{endpoint:?} names no host")),
        Some(a) if a.as_str().contains('@') => Err(
            "the OTLP endpoint must not carry credentials: sluice would log its URL".to_string(),
        ),
        Some(_) if uri.query().is_some() => Err(format!(
            "{endpoint:?}: a query has no place in the OTLP base URL"
        )),
        Some(_) => Ok(()),
    }
}

/// `problems` gains an entry if `d` is longer than `max`.
fn at_most(
    problems: &mut Vec<(YamlPath, String)>,
    at: YamlPath,
    d: Dur,
    max: Duration,
    what: &str,
) {
    if d.0 > max {
        problems.push((
            at,
            format!(
                "{} is too long: {what} can be at most {}",
                written(d.0),
                written(max)
            ),
        ));
    }
}

/// What is wrong with `state.redis.tls`: settings for URLs that do not use TLS, or a CA file
/// the client could not load at startup. URLs are never quoted (they may carry a password).
fn redis_tls_problems(redis: &RedisConfig, tls: &RedisTlsConfig) -> Vec<(YamlPath, String)> {
    let mut problems = Vec::new();
    let at = YamlPath::root().key("state").key("redis").key("tls");
    let plain = match (&redis.url, &redis.cluster) {
        (Some(url), _) if !url.is_tls() => Some("state.redis.url is redis://"),
        (None, Some(nodes)) if nodes.iter().any(|n| !n.is_tls()) => {
            Some("a state.redis.cluster node is redis://")
        }
        _ => None,
    };
    if let Some(which) = plain {
        problems.push((
            at.clone(),
            format!("tls applies to rediss:// (TLS) URLs only, and {which}; use rediss://"),
        ));
    }
    if let Some(path) = &tls.ca {
        if let Err(why) = load_ca(path) {
            problems.push((at.key("ca"), format!("CA file {}: {why}", path.display())));
        }
    }
    problems
}

/// Reads the PEM CA file at `path` as the Redis client will at startup, and returns its bytes:
/// at least one certificate, each one a usable trust anchor.
pub fn load_ca(path: &std::path::Path) -> Result<Vec<u8>, String> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::CertificateDer;
    let pem = std::fs::read(path).map_err(|e| format!("cannot be read: {e}"))?;
    let certificates = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("is not valid PEM: {e}"))?;
    if certificates.is_empty() {
        return Err("holds no PEM certificate (-----BEGIN CERTIFICATE-----)".to_string());
    }
    // The client's own check, so that `run` cannot refuse what `check` passed.
    redis::Client::build_with_tls(
        "rediss://127.0.0.1",
        redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(pem.clone()),
        },
    )
    .map_err(|e| {
        let why = e.to_string();
        format!(
            "is not usable as a CA: {}",
            why.trim_end_matches(" - InvalidClientConfig")
        )
    })?;
    Ok(pem)
}

impl Config {
    /// Rules that span several fields. Each problem names the YAML path to blame.
    pub(super) fn validate(&self) -> Vec<(YamlPath, String)> {
        let mut problems = Vec::new();
        if self.listen.is_empty() {
            problems.push((
                YamlPath::root().key("listen"),
                "at least one listen address is required".to_string(),
            ));
        }
        let admin_at = YamlPath::root().key("admin").key("listen");
        if self.admin.listen.0.port() == 0 {
            problems.push((
                admin_at.clone(),
                "port 0 would listen on a random port; give the port to listen on".to_string(),
            ));
        }
        if let Some(otlp) = &self.tracing.otlp {
            let at = YamlPath::root().key("tracing").key("otlp");
            if let Err(why) = check_otlp_endpoint(&otlp.endpoint) {
                problems.push((at.clone().key("endpoint"), why));
            }
            if !(0.0..=1.0).contains(&otlp.sample_ratio) {
                problems.push((
                    at.key("sample_ratio"),
                    format!(
                        "{} is not a share: give a number from 0 (none) to 1 (every new trace)",
                        otlp.sample_ratio
                    ),
                ));
            }
        }
        let mut seen = HashMap::new();
        for (i, listener) in self.listen.iter().enumerate() {
            let at = YamlPath::root().key("listen").index(i);
            let addr = ListenAddr(listener.addr);
            if let Some(tls) = &listener.tls {
                if let Err(e) = crate::listen_tls::load(&tls.cert, &tls.key) {
                    let tls_at = at.clone().key("tls");
                    let blamed = match e.blame {
                        crate::listen_tls::Blame::Cert => tls_at.key("cert"),
                        crate::listen_tls::Blame::Key => tls_at.key("key"),
                        crate::listen_tls::Blame::Pair => tls_at,
                        crate::listen_tls::Blame::ClientCa => tls_at.key("client_ca"),
                    };
                    problems.push((blamed, e.message));
                }
                if let Some(ca) = &tls.client_ca {
                    if let Err(e) = crate::listen_tls::load_client_ca(ca) {
                        problems.push((at.clone().key("tls").key("client_ca"), e.message));
                    }
                }
            }
            if addr.0.port() == 0 {
                problems.push((
                    at.clone(),
                    "port 0 would listen on a random port; give the port to listen on".to_string(),
                ));
            } else if addr.0 == self.admin.listen.0 {
                problems.push((
                    admin_at.clone(),
                    format!(
                        "{} is also listen[{i}]: the admin API needs an address of its own",
                        addr.0
                    ),
                ));
            }
            if let Some(first) = seen.insert(addr.0, i) {
                problems.push((at, format!("{} is already listen[{first}]", addr.0)));
            }
        }
        if let Some(var) = &self.admin.token_env {
            if var.is_empty() {
                problems.push((
                    YamlPath::root().key("admin").key("token_env"),
                    "token_env must name an environment variable".to_string(),
                ));
            }
        }

        let limits_at = YamlPath::root().key("limits");
        for (d, key) in [
            (self.limits.idle_timeout, "idle_timeout"),
            (self.limits.header_timeout, "header_timeout"),
        ] {
            at_most(
                &mut problems,
                limits_at.clone().key(key),
                d,
                MAX_DELAY,
                "a timeout",
            );
        }
        if self.limits.max_header_bytes.get() > MAX_HEADER_BYTES {
            problems.push((
                limits_at.key("max_header_bytes"),
                format!(
                    "{} is too large: Pingora reads at most {MAX_HEADER_BYTES} bytes of request head",
                    self.limits.max_header_bytes
                ),
            ));
        }

        let redis = self.state.redis.as_ref();
        let url = redis.and_then(|r| r.url.as_ref());
        let cluster = redis.and_then(|r| r.cluster.as_ref());
        if self.state.backend == StateBackend::Redis && url.is_none() && cluster.is_none() {
            problems.push((
                YamlPath::root().key("state").key("backend"),
                "backend: redis needs state.redis.url or state.redis.cluster".to_string(),
            ));
        }
        if url.is_some() && cluster.is_some() {
            problems.push((
                YamlPath::root().key("state").key("redis").key("cluster"),
                "give either url (one Redis) or cluster (Redis Cluster nodes), not both"
                    .to_string(),
            ));
        }
        if let Some(nodes) = cluster {
            let at = YamlPath::root().key("state").key("redis").key("cluster");
            if nodes.is_empty() {
                problems.push((at, "cluster needs at least one node".to_string()));
            } else if let Err(e) =
                redis::cluster::ClusterClient::new(nodes.iter().map(|n| n.0.as_str()))
            {
                // What the client checks across nodes (one password, one database...), so
                // that `run` cannot fail on what `check` passed. Its messages name no URL.
                let why = e.to_string();
                let why = why.trim_end_matches(" - InvalidClientConfig");
                problems.push((
                    at,
                    format!("these nodes cannot form one cluster client: {why}"),
                ));
            }
        }
        if let Some(redis) = redis {
            let at = YamlPath::root().key("state").key("redis").key("timeout");
            at_most(
                &mut problems,
                at,
                redis.timeout,
                MAX_DELAY,
                "a Redis timeout",
            );
            if let Some(tls) = &redis.tls {
                problems.extend(redis_tls_problems(redis, tls));
            }
        }

        // allow_cidrs always win over deny (the gateway's egress guard), so a deny CIDR inside an allowed one
        // would do nothing; say so rather than let the reader believe it denies.
        for (i, entry) in self.egress.deny.iter().enumerate() {
            let DenyEntry::Cidr(denied) = entry else {
                continue;
            };
            if let Some(j) = self
                .egress
                .allow_cidrs
                .iter()
                .position(|allowed| allowed.0.contains(&denied.0))
            {
                problems.push((
                    YamlPath::root().key("egress").key("deny").index(i),
                    format!(
                        "{} is inside allow_cidrs[{j}] ({}), and allow_cidrs win over deny, so this entry denies nothing",
                        denied.0, self.egress.allow_cidrs[j].0
                    ),
                ));
            }
        }

        let mut names: HashMap<&str, usize> = HashMap::new();
        let mut claims: HashMap<(HostPattern, &str, Vec<MethodName>), usize> = HashMap::new();
        for (i, route) in self.routes.iter().enumerate() {
            let at = YamlPath::root().key("routes").index(i);
            if route.matcher.hosts.is_empty() {
                problems.push((
                    at.clone().key("match").key("hosts"),
                    "hosts is empty, so the route could never match; leave it out, or write [\"*\"], to match any host".to_string(),
                ));
            }
            // Name the first holder: with n copies of a name, every message then points at
            // the same route.
            if let Some(&first) = names.get(route.name.0.as_str()) {
                problems.push((
                    at.clone().key("name"),
                    format!(
                        "duplicate route name {:?}: routes[{first}] already has it",
                        route.name.0
                    ),
                ));
            } else {
                names.insert(&route.name.0, i);
            }
            let mut methods = route.matcher.methods.clone();
            methods.sort();
            methods.dedup();
            for host in &route.matcher.hosts {
                let key = (
                    host.clone(),
                    route.matcher.path_prefix.0.as_str(),
                    methods.clone(),
                );
                if let Some(&first) = claims.get(&key) {
                    problems.push((
                        at.clone().key("match"),
                        format!(
                            "routes[{first}] ({}) has the same host, path_prefix and methods, so this route could never match",
                            self.routes[first].name.0
                        ),
                    ));
                    break;
                }
                claims.insert(key, i);
            }

            let up = &route.upstream;
            let up_at = at.clone().key("upstream");
            for (d, key, what) in [
                (up.connect_timeout, "connect_timeout", "a timeout"),
                (up.read_timeout, "read_timeout", "a timeout"),
                (up.write_timeout, "write_timeout", "a timeout"),
            ] {
                at_most(&mut problems, up_at.clone().key(key), d, MAX_DELAY, what);
            }
            let cooldown_at = up_at.clone().key("passive").key("cooldown");
            at_most(
                &mut problems,
                cooldown_at,
                up.passive.cooldown,
                MAX_DELAY,
                "a cooldown",
            );
            if let Some(check) = &up.health_check {
                let check_at = up_at.clone().key("health_check");
                at_most(
                    &mut problems,
                    check_at.clone().key("interval"),
                    check.interval,
                    MAX_DELAY,
                    "an interval",
                );
                at_most(
                    &mut problems,
                    check_at.key("timeout"),
                    check.timeout,
                    MAX_DELAY,
                    "a timeout",
                );
            }
            // One member however its URL is spelled: `HTTP://A`, `http://a` and `http://a:80`
            // reach the same place. Two members may share an address only as two named
            // identities (two API keys on one API).
            let mut members: HashMap<(bool, &str, u16), usize> = HashMap::new();
            let mut names: HashMap<&str, usize> = HashMap::new();
            for (j, member) in up.members.iter().enumerate() {
                let member_at = up_at.clone().key("members").index(j);
                // Unnamed members clash by address, below, with the clearer message.
                let named_clash = names.get(&*member.name).copied().filter(|&first| {
                    member.named || up.members.get(first).is_some_and(|m| m.named)
                });
                if let Some(first) = named_clash {
                    let at = if member.named {
                        member_at.clone().key("name")
                    } else {
                        member_at.clone()
                    };
                    problems.push((
                        at,
                        format!(
                            "duplicate member name {:?}: members[{first}] has it; names identify members in logs, metrics and the store, give each a distinct name",
                            &*member.name
                        ),
                    ));
                    continue;
                }
                names.entry(&member.name).or_insert(j);
                // A member's headers are its credentials for its own origin. A `direct` or
                // `proxy` member goes wherever the client points, and inside a CONNECT nothing
                // can be added at all, so a key set there would follow the client's choice of
                // host and port, in cleartext.
                if member.kind.reaches_target() && !member.headers.0.is_empty() {
                    problems.push((
                        member_at.clone().key("headers"),
                        format!(
                            "headers are sent only to an origin member's own url; a {} member reaches the destination the client chooses, so its headers (a key) would go there too",
                            if member.kind == MemberKind::Direct { "direct" } else { "proxy" }
                        ),
                    ));
                }
                if let Some(quota) = &member.quota {
                    let at = member_at.clone().key("quota");
                    if quota.windows.is_empty() {
                        problems.push((
                            at.clone().key("windows"),
                            "a member quota needs at least one window".to_string(),
                        ));
                    }
                    check_windows(&mut problems, &at, &quota.windows);
                }
                let u = &member.url;
                let key = (u.tls, u.host.as_str(), u.port);
                let both_named =
                    |first: usize| member.named && up.members.get(first).is_some_and(|m| m.named);
                if let Some(&first) = members.get(&key).filter(|&&f| !both_named(f)) {
                    let key = match member.kind {
                        MemberKind::Origin => member_at.clone().key("url"),
                        MemberKind::Proxy { .. } => member_at.clone().key("proxy"),
                        MemberKind::Direct => member_at.clone().key("direct"),
                    };
                    problems.push((
                        key,
                        format!(
                            "duplicate member {:?} in this pool: members[{first}] is the same (two members on one address need a name each)",
                            u.url
                        ),
                    ));
                } else {
                    members.insert(key, j);
                }
            }
            // Origins stand in for the target; proxy and direct members reach the target the
            // client named. One pool cannot mean both.
            let origin = up.members.iter().position(|m| m.kind == MemberKind::Origin);
            let egress = up.members.iter().position(|m| m.kind.reaches_target());
            if let (Some(o), Some(e)) = (origin, egress) {
                problems.push((
                    up_at.clone().key("members").index(o.max(e)),
                    format!(
                        "a pool holds origins (url) only, or proxy and direct members only: members[{}] is {}",
                        o.min(e),
                        if o < e { "an origin (url)" } else { "a proxy or direct member" }
                    ),
                ));
            }
            if let Some(cooldown) = &up.cooldown {
                let at = up_at.clone().key("cooldown");
                // A `direct` member stands for every destination a client may name: one
                // destination's 429 (any server a client points it at) would cool it for all.
                if let Some(d) = up.members.iter().position(|m| m.kind == MemberKind::Direct) {
                    problems.push((
                        at.clone(),
                        format!(
                            "a cooldown cools a member for every request, and members[{d}] is `direct`: one destination's 429 would stop the route for every destination; set cooldown on origin or proxy members only"
                        ),
                    ));
                }
                if cooldown.on_status.is_empty() {
                    problems.push((
                        at.clone().key("on_status"),
                        "on_status needs at least one status, e.g. [429]".to_string(),
                    ));
                }
                for (j, status) in cooldown.on_status.iter().enumerate() {
                    if !(400..=599).contains(status) {
                        problems.push((
                            at.clone().key("on_status").index(j),
                            format!("{status} is not an error status (400 to 599)"),
                        ));
                    }
                }
                at_most(
                    &mut problems,
                    at.clone().key("max"),
                    cooldown.max,
                    MAX_DELAY,
                    "max",
                );
                if cooldown.default.0 > cooldown.max.0 {
                    problems.push((
                        at.clone().key("default"),
                        format!(
                            "default {} is longer than max {}",
                            written(cooldown.default.0),
                            written(cooldown.max.0)
                        ),
                    ));
                }
            }
            if let Some(quota) = &route.quota {
                let at = at.clone().key("quota");
                let member_windows = up.members.iter().any(|m| m.quota.is_some());
                let waits = !quota.max_wait.0.is_zero();
                // A client's max_in_flight caps its requests on every route.
                let client_caps = self
                    .clients
                    .as_ref()
                    .is_some_and(|c| c.list.iter().any(|c| c.max_in_flight.is_some()));
                let caps =
                    up.max_in_flight.is_some() || route.max_in_flight.is_some() || client_caps;
                // Units for members' or clients' windows are defined on the route's quota, which
                // may then have no window of its own.
                if quota.windows.is_empty()
                    && quota.usage.is_none()
                    && !(waits && (member_windows || up.cooldown.is_some() || caps))
                {
                    problems.push((
                        at.clone().key("windows"),
                        "a quota needs at least one window (a route may give none only to set max_wait for its members' quotas, cooldowns or max_in_flight, or usage units for their windows)".to_string(),
                    ));
                }
                at_most(
                    &mut problems,
                    at.clone().key("max_wait"),
                    quota.max_wait,
                    MAX_WAIT,
                    "max_wait",
                );
                check_windows(&mut problems, &at, &quota.windows);
                // `cost` charges the windows that count requests only.
                let smallest = quota
                    .windows
                    .iter()
                    .filter(|w| w.unit == WindowUnit::Requests)
                    .map(|w| w.limit.get())
                    .min();
                if let Some(smallest) = smallest {
                    let too_costly = |cost: u64| {
                        format!(
                            "cost {cost} exceeds the smallest window limit {smallest}: no such request could ever pass"
                        )
                    };
                    if quota.cost.default.get() > smallest {
                        problems.push((
                            at.clone().key("cost").key("default"),
                            too_costly(quota.cost.default.get()),
                        ));
                    }
                    for (j, rule) in quota.cost.rules.iter().enumerate() {
                        if rule.cost.get() > smallest {
                            problems.push((
                                at.clone().key("cost").key("rules").index(j).key("cost"),
                                too_costly(rule.cost.get()),
                            ));
                        }
                    }
                }
            }
            if let Some(check) = &up.health_check {
                let check_at = at.clone().key("upstream").key("health_check");
                if check.kind != CheckKind::Http && check.path.is_some() {
                    problems.push((
                        check_at.clone().key("path"),
                        "path applies to kind: http only".to_string(),
                    ));
                }
                match (&check.target, check.kind) {
                    (Some(_), kind) if kind != CheckKind::Connect => problems.push((
                        check_at.clone().key("target"),
                        "target applies to kind: connect only".to_string(),
                    )),
                    (None, CheckKind::Connect) => problems.push((
                        check_at.clone().key("kind"),
                        "kind: connect needs a target (host:port the proxy is asked to reach)"
                            .to_string(),
                    )),
                    (Some(target), _) if !is_host_port(target) => problems.push((
                        check_at.clone().key("target"),
                        format!("{target:?} is not host:port"),
                    )),
                    _ => {}
                }
                if check.kind == CheckKind::Connect {
                    if let Some(j) = up
                        .members
                        .iter()
                        .position(|m| !matches!(m.kind, MemberKind::Proxy { .. }))
                    {
                        problems.push((
                            at.clone().key("upstream").key("members").index(j),
                            "kind: connect checks forward proxies: every member of the pool must be a proxy member".to_string(),
                        ));
                    }
                }
            }
        }
        problems.extend(clients::problems(self));
        problems.extend(usage::problems(self));
        problems.extend(fallback::problems(self));
        problems.extend(leases::problems(self));
        problems.extend(sticky::problems(self));
        problems.extend(shards::problems(self));
        problems
    }
}

/// The rules every list of windows follows, a route's or a member's.
fn check_windows(problems: &mut Vec<(YamlPath, String)>, at: &YamlPath, windows: &[WindowConfig]) {
    let mut window_names = HashSet::new();
    for (j, w) in windows.iter().enumerate() {
        let window_at = at.clone().key("windows").index(j);
        match w.window {
            WindowSpan::Sliding(length) => {
                if length.0 < MIN_WINDOW {
                    problems.push((
                        window_at.clone().key("window"),
                        format!(
                            "window {} is shorter than 1ms: requests are timestamped in microseconds and windows reported in whole milliseconds, where this one would be 0",
                            written(length.0)
                        ),
                    ));
                }
                at_most(
                    problems,
                    window_at.clone().key("window"),
                    length,
                    MAX_WINDOW,
                    "a window",
                );
                if w.tz.is_some() {
                    problems.push((
                        window_at.clone().key("tz"),
                        "tz applies to calendar windows only (calendar_day, calendar_week, calendar_month); a sliding window has no boundaries".to_string(),
                    ));
                }
            }
            WindowSpan::Calendar(_) => {}
        }
        usage::check_unit_limit(problems, &window_at, w);
        if w.limit.get() > MAX_UNITS {
            problems.push((
                window_at.clone().key("limit"),
                format!("limit {} is too large: at most 2^53 ({MAX_UNITS}), as Redis scripts count in doubles", w.limit),
            ));
        }
        if !window_names.insert(&w.name.0) {
            problems.push((
                window_at.key("name"),
                format!("duplicate window name {:?}", w.name.0),
            ));
        }
    }
}

/// `host:port` as a CONNECT target: a host name or IP (IPv6 in brackets) and a nonzero port.
fn is_host_port(target: &str) -> bool {
    let Some((host, port)) = target.rsplit_once(':') else {
        return false;
    };
    let host_ok = if let Some(v6) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        v6.parse::<std::net::Ipv6Addr>().is_ok()
    } else {
        !host.is_empty()
            && host
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-' || b == b'_')
    };
    host_ok && port.parse::<u16>().is_ok_and(|p| p != 0)
}
