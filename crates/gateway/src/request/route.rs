//! Routing, the first step of every request and every CONNECT tunnel: whether the request came
//! back to this instance, what it addresses (its target, read once by [`crate::target`]), and
//! the route that takes it, or the gateway's own answer when none may. Both kinds go through
//! here, so a rule added here holds for both.

use std::sync::Arc;

use http::{HeaderMap, HeaderValue, Method, Version};

use crate::config::MemberKind;
use crate::problem::Problem;
use crate::table::{Route, Table};
use crate::target::{self, Scheme, Target};

/// What the routing step reads of a request head.
pub(crate) struct Head<'a> {
    pub(crate) method: &'a Method,
    pub(crate) version: Version,
    /// The request target as received: an absolute URI, an origin-form path, or a CONNECT
    /// authority.
    pub(crate) raw_target: &'a [u8],
    /// `Host`, or HTTP/2's `:authority`.
    pub(crate) host: Option<&'a [u8]>,
    pub(crate) headers: &'a HeaderMap,
}

/// The gateway's answer to a request it cannot route. Boxed where it is returned: a refusal is
/// rare, and the request path's `Result` stays small.
pub(crate) struct Refused<'a> {
    /// What the request addresses, when it could be read (the log names it).
    pub(crate) target: Option<Target<'a>>,
    pub(crate) problem: Problem,
    /// The route it was refused on, when one matched (the answer and the log name it).
    pub(crate) route: Option<Arc<Route>>,
    /// `Allow`, for a 405 (RFC 9110 §15.5.6).
    pub(crate) allow: Option<HeaderValue>,
}

impl<'a> Refused<'a> {
    fn plain(problem: Problem) -> Box<Refused<'a>> {
        Box::new(Refused {
            target: None,
            problem,
            route: None,
            allow: None,
        })
    }

    fn on(route: &Arc<Route>, problem: Problem, allow: Option<HeaderValue>) -> Box<Refused<'a>> {
        Box::new(Refused {
            target: None,
            problem,
            route: Some(route.clone()),
            allow,
        })
    }
}

/// The target of `head` and the route of `table` that takes it.
pub(crate) fn route<'a>(
    table: &Table,
    head: &Head<'a>,
) -> Result<(Target<'a>, Arc<Route>), Box<Refused<'a>>> {
    // A request that carries this instance's own Via left here and came back (a member or a
    // proxy chain that leads to sluice): another hop would only go round again.
    if crate::headers::is_own_loop(head.headers) {
        return Err(Refused::plain(Problem::loop_detected()));
    }
    let target = target::parse(head.method, head.version, head.raw_target, head.host)
        .map_err(|reject| Refused::plain(Problem::bad_target(reject)))?;
    let route = if head.method == Method::CONNECT {
        tunnel_route(table, &target)
    } else {
        request_route(table, head.method, &target)
    };
    match route {
        Ok(route) => Ok((target, route)),
        Err(refused) => Err(Box::new(Refused {
            target: Some(target),
            ..*refused
        })),
    }
}

/// The route of a plain request: by host, path and method.
fn request_route(
    table: &Table,
    method: &Method,
    target: &Target<'_>,
) -> Result<Arc<Route>, Box<Refused<'static>>> {
    let Some(route) = table
        .router
        .find_normalized(&target.host, &target.path, method.as_str())
        .cloned()
    else {
        return Err(Refused::plain(Problem::no_route()));
    };
    // A direct member reaches an https:// target with TLS itself; a proxy would get it in
    // cleartext.
    let tls_to_target = |m: &crate::table::Member| m.url.tls || m.kind == MemberKind::Direct;
    if target.scheme == Some(Scheme::Https) && !route.members.iter().all(tls_to_target) {
        return Err(Refused::on(&route, Problem::cleartext_https(), None));
    }
    let port = match target.scheme {
        Some(Scheme::Https) => 443,
        _ => 80,
    };
    literal_allowed(table, &route, target, port)?;
    Ok(route)
}

/// A destination the client wrote as an address, on a route whose members reach the client's
/// target, passes the egress guard here, before anything is charged or contacted, whatever
/// the member kind (SPEC §7: a CONNECT "to a denied address is refused before anything is
/// contacted"). A `direct` member would check it again after its lookup; a `proxy` member
/// would otherwise carry the client to any address the proxy can reach: sluice's own admin
/// port through a proxy beside it, a metadata service. A name is left to the proxy, which may
/// resolve it differently than this host can (split DNS is one reason to have a proxy).
fn literal_allowed(
    table: &Table,
    route: &Arc<Route>,
    target: &Target<'_>,
    default_port: u16,
) -> Result<(), Box<Refused<'static>>> {
    match literal_denied(table, route, target, default_port) {
        None => Ok(()),
        Some(problem) => Err(Refused::on(route, problem, None)),
    }
}

/// The refusal of [`literal_allowed`], for a route the request is routed or falls back to.
pub(crate) fn literal_denied(
    table: &Table,
    route: &Route,
    target: &Target<'_>,
    default_port: u16,
) -> Option<Problem> {
    if !route.members.iter().any(|m| m.kind.reaches_target()) {
        return None;
    }
    let ip = target.host.parse::<std::net::IpAddr>().ok()?;
    let addr = std::net::SocketAddr::new(ip, target.port.unwrap_or(default_port));
    let denial = table.guard.check_addr(addr).err()?;
    Some(Problem::destination_denied(crate::egress::describe(
        &target.host,
        &denial,
    )))
}

/// The route of a CONNECT: by the target's host, with the path `/` (so a route's
/// `path_prefix` other than `/` never takes tunnels), among routes whose `methods` allow
/// CONNECT; then the route must be able to carry a tunnel, and the target's port must be in
/// `egress.connect_ports`, all before anything is charged, looked up or contacted.
fn tunnel_route(table: &Table, target: &Target<'_>) -> Result<Arc<Route>, Box<Refused<'static>>> {
    let Some(route) = table
        .router
        .find_normalized(&target.host, "/", "CONNECT")
        .cloned()
    else {
        return Err(match table.router.find_any_method(&target.host, "/") {
            Some(r) => Refused::on(
                r,
                Problem::method_not_allowed("this route's methods do not include CONNECT"),
                methods_of(r),
            ),
            None => Refused::plain(Problem::no_route()),
        });
    };
    if let Some(reason) = connect_refusal(&route) {
        let allow = methods_of(&route);
        return Err(Refused::on(
            &route,
            Problem::connect_not_supported(reason),
            allow,
        ));
    }
    // egress.connect_ports, for every CONNECT whatever its member kind (SPEC §7).
    if let Err(denied) = table.guard.check_connect_port(target.port.unwrap_or(443)) {
        return Err(Refused::on(
            &route,
            Problem::destination_denied(denied.to_string()),
            None,
        ));
    }
    literal_allowed(table, &route, target, 443)?;
    Ok(route)
}

/// Why a CONNECT cannot be served on `route`, if it cannot (SPEC §7). Inside a tunnel sluice
/// sees no request, so a route that must see each one cannot carry a tunnel:
/// - origin members stand in for the client's target: a tunnel to one would carry TLS for a
///   name the member does not serve (or plain HTTP that the client takes for TLS), and their
///   `headers` (a key) cannot be added to bytes sluice does not write;
/// - a `client_token` header identifies each request, and a tunnel shows none;
/// - cost rules by path charge each request by what it asks for; a tunnel is charged once;
/// - a window in a usage unit settles each request from its answer, which a tunnel hides: the
///   tunnel's one reservation would stand for any number of unread, unmetered answers.
fn connect_refusal(route: &Route) -> Option<&'static str> {
    let origins =
        !route.members.is_empty() && route.members.iter().all(|m| m.kind == MemberKind::Origin);
    if origins {
        return Some("this route's members are origin servers, which sluice must send each request to itself; CONNECT tunnels need a direct or proxy member. Send the request to sluice as plain http://, or in gateway form");
    }
    if route.config.client_token.is_some() {
        return Some("this route identifies clients by a request header (client_token), which a tunnel would hide; send the requests to sluice in gateway form");
    }
    let by_path = route
        .config
        .quota
        .as_ref()
        .is_some_and(|q| q.cost.rules.iter().any(|r| r.path_prefix.0 != "/"));
    if by_path {
        return Some("this route charges requests by path, which a tunnel would hide; send the requests to sluice as plain http://, or in gateway form");
    }
    if meters_usage(&route.config) {
        return Some("this route meters usage (such as tokens or spend) from each answer, which a tunnel would hide; send the requests to sluice as plain http://, or in gateway form");
    }
    None
}

/// Whether the route, or one of its members, has a window in a usage unit (or the route
/// defines usage units at all), so that each answer must be read to settle what it used.
pub(crate) fn meters_usage(route: &crate::config::RouteConfig) -> bool {
    let in_unit = |w: &crate::config::WindowConfig| w.unit != crate::config::WindowUnit::Requests;
    let quota = route.quota.as_ref();
    quota.is_some_and(|q| q.usage.is_some() || q.windows.iter().any(in_unit))
        || route
            .upstream
            .members
            .iter()
            .filter_map(|m| m.quota.as_ref())
            .any(|q| q.windows.iter().any(in_unit))
}

/// `Allow` for a route that lists no methods, where a CONNECT cannot be served.
pub(crate) const EVERY_METHOD_BUT_CONNECT: &str = "GET, HEAD, POST, PUT, DELETE, PATCH, OPTIONS";

/// `Allow` for a route that takes no CONNECT: the methods it lists, or, when it lists none,
/// every method but CONNECT.
fn methods_of(route: &Route) -> Option<HeaderValue> {
    let methods = &route.config.matcher.methods;
    if methods.is_empty() {
        return Some(HeaderValue::from_static(EVERY_METHOD_BUT_CONNECT));
    }
    let listed: Vec<&str> = methods
        .iter()
        .map(|m| m.0.as_str())
        .filter(|m| *m != "CONNECT")
        .collect();
    HeaderValue::from_str(&listed.join(", ")).ok()
}
