//! The URLs of a config, each checked and split as it is parsed: Redis's (`state.redis`), a
//! member's (`url:`) and a forward proxy's (`proxy:`, whose credentials become a
//! `Proxy-Authorization` value). Kept apart from the schema: this is where a URL's text is
//! taken apart and decoded (percent-escapes with `percent-encoding`, base64 with `base64`), and
//! where a password is kept out of every message ([`redact`]).

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use percent_encoding::percent_decode_str;
use serde::de::{self, Deserializer};
use serde::Deserialize;

/// A `redis://` or `rediss://` (TLS) URL.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisUrl(pub String);

// The URL may hold Redis's password, and a config is debug-printed (a panic, a trace line).
impl std::fmt::Debug for RedisUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("RedisUrl").field(&redact(&self.0)).finish()
    }
}

impl<'de> Deserialize<'de> for RedisUrl {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        RedisUrl::parse(&String::deserialize(d)?).map_err(de::Error::custom)
    }
}

impl RedisUrl {
    /// Checks `s` with the Redis client's own parser, so that whatever passes here is what the
    /// client accepts at startup (`redis://host/x` used to pass here and panic at `run`).
    pub(crate) fn parse(s: &str) -> Result<RedisUrl, String> {
        use redis::IntoConnectionInfo;
        let shown = redact(s);
        let scheme = s
            .split_once("://")
            .map(|(scheme, _)| scheme.to_ascii_lowercase());
        match scheme.as_deref() {
            Some("redis" | "rediss") => {}
            _ => {
                return Err(format!(
                    "invalid redis url {shown:?}: expected redis://host:port/db"
                ))
            }
        }
        let url = redis::parse_redis_url(s)
            .ok_or_else(|| format!("invalid redis url {shown:?}: expected redis://host:port/db"))?;
        if url.host_str().is_none_or(str::is_empty) {
            return Err(format!("invalid redis url {shown:?}: no host"));
        }
        url.into_connection_info().map_err(|e| {
            let why = e.to_string();
            let why = why.trim_end_matches(" - InvalidClientConfig");
            format!("invalid redis url {shown:?}: {why}")
        })?;
        Ok(RedisUrl(s.to_string()))
    }

    /// Whether the URL asks for TLS (`rediss://`).
    pub fn is_tls(&self) -> bool {
        self.0
            .get(..9)
            .is_some_and(|scheme| scheme.eq_ignore_ascii_case("rediss://"))
    }
}

/// `url` with any user name and password replaced by `***`, for error messages: a config
/// mistake is printed, logged and shown in `/status`, and must not leak a password.
///
/// A password may hold `/`, `?` or `#` (base64 ones often do), and then the authority cannot
/// be told from the path: `http://u:pa/ss@host` is refused as written, and its error must not
/// quote it. So when the authority up to the first of them holds no `@` but the rest does,
/// everything up to the last `@` is hidden. A path with an `@` in it is hidden too: in an
/// error message, hiding too much costs nothing.
pub(crate) fn redact(url: &str) -> String {
    let start = url.find("://").map_or(0, |i| i + 3);
    let end = url[start..]
        .find(['/', '?', '#'])
        .map_or(url.len(), |i| start + i);
    let at = url[start..end]
        .rfind('@')
        .or_else(|| url[start..].rfind('@'));
    match at {
        Some(at) => format!("{}***{}", &url[..start], &url[start + at..]),
        None => url.to_string(),
    }
}

/// A member URL, checked and split.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MemberUrl {
    /// The URL as written, with scheme and host in lowercase and no trailing slash; the
    /// member's identity.
    pub url: String,
    /// True for https.
    pub tls: bool,
    /// Host name or IP address, without brackets.
    pub host: String,
    /// Port, explicit or the scheme's default.
    pub port: u16,
}

impl MemberUrl {
    /// The identity of a `direct` member: it has no address of its own.
    pub fn direct() -> MemberUrl {
        MemberUrl {
            url: "direct".into(),
            tls: false,
            host: String::new(),
            port: 0,
        }
    }

    /// `host:port` as it goes in a Host header (brackets around IPv6 literals).
    pub fn authority(&self) -> String {
        let default_port = if self.tls { 443 } else { 80 };
        let host = if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        if self.port == default_port {
            host
        } else {
            format!("{host}:{}", self.port)
        }
    }

    pub(crate) fn parse(s: &str) -> Result<MemberUrl, String> {
        let shown = redact(s);
        let uri: http::Uri = s
            .parse()
            .map_err(|e| format!("invalid member url {shown:?}: {e}"))?;
        let scheme = uri.scheme_str().map(str::to_ascii_lowercase);
        let tls = match scheme.as_deref() {
            Some("http") => false,
            Some("https") => true,
            Some(other) => {
                return Err(format!(
                    "invalid member url {shown:?}: scheme {other:?} is not http or https"
                ))
            }
            None => {
                return Err(format!(
                "invalid member url {shown:?}: expected http://host[:port] or https://host[:port]"
            ))
            }
        };
        let authority = uri.authority().map_or("", |a| a.as_str());
        if authority.contains('@') {
            // The URL is the member's name in logs, metrics and /status, so credentials in it
            // would be published; sluice does not send them anyway.
            return Err(format!(
                "invalid member url {shown:?}: credentials in a member url are never sent; set them in the member's headers, e.g. headers: {{Authorization: \"Bearer ${{API_KEY}}\"}}"
            ));
        }
        let host = uri
            .host()
            .filter(|h| !h.is_empty())
            .ok_or_else(|| format!("invalid member url {shown:?}: no host"))?;
        if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
            return Err(format!(
                "invalid member url {shown:?}: a member is scheme://host[:port], without a path"
            ));
        }
        let port = uri.port_u16().unwrap_or(if tls { 443 } else { 80 });
        // Scheme and host are case-insensitive, so `HTTP://A` and `http://a` are one member:
        // the identity (and the least_used key in the store) is spelled in lowercase. The
        // port is kept as written, so an existing member keeps its identity.
        let host = host.to_ascii_lowercase();
        let url = match uri.port() {
            Some(p) => format!("{}://{host}:{}", scheme.unwrap_or_default(), p.as_str()),
            None => format!("{}://{host}", scheme.unwrap_or_default()),
        };
        Ok(MemberUrl {
            url,
            tls,
            host: host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_string(),
            port,
        })
    }
}

impl<'de> Deserialize<'de> for MemberUrl {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        MemberUrl::parse(&s).map_err(de::Error::custom)
    }
}

/// `proxy:` — `http://[user[:password]@]host:port`, checked and split. The credentials only
/// ever leave as a `Proxy-Authorization` header value; the URL kept is without them.
#[derive(Clone, PartialEq)]
pub struct ProxyUrl {
    /// The proxy's identity and address, without credentials.
    pub url: MemberUrl,
    /// `Basic base64(user:password)`, when the URL has credentials.
    pub authorization: Option<http::HeaderValue>,
}

impl std::fmt::Debug for ProxyUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyUrl")
            .field("url", &self.url.url)
            .field("credentials", &self.authorization.is_some())
            .finish()
    }
}

impl ProxyUrl {
    pub(crate) fn parse(s: &str) -> Result<ProxyUrl, String> {
        let shown = redact(s);
        let Some(rest) = s
            .strip_prefix("http://")
            .or_else(|| s.strip_prefix("HTTP://"))
        else {
            return Err(format!(
                "invalid proxy url {shown:?}: expected http://[user:password@]host:port (an https:// proxy is not supported yet)"
            ));
        };
        let (userinfo, hostport) = match rest.rfind('@') {
            Some(at) => (Some(&rest[..at]), &rest[at + 1..]),
            None => (None, rest),
        };
        let hostport = hostport.strip_suffix('/').unwrap_or(hostport);
        let url = MemberUrl::parse(&format!("http://{hostport}")).map_err(|_| {
            format!("invalid proxy url {shown:?}: expected http://[user:password@]host:port")
        })?;
        if hostport
            .parse::<http::uri::Authority>()
            .map_or(true, |a| a.port().is_none())
        {
            return Err(format!(
                "invalid proxy url {shown:?}: give the proxy's port, e.g. http://host:3128"
            ));
        }
        let authorization = match userinfo {
            None => None,
            Some(info) => {
                let (user, password) = info.split_once(':').unwrap_or((info, ""));
                // Userinfo is percent-encoded (RFC 3986 §3.2.1); a bad escape stays as written.
                let decode = |s| percent_decode_str(s).decode_utf8_lossy();
                let token = base64(format!("{}:{}", decode(user), decode(password)).as_bytes());
                let mut value = http::HeaderValue::from_str(&format!("Basic {token}"))
                    .map_err(|_| format!("invalid proxy url {shown:?}: bad credentials"))?;
                value.set_sensitive(true);
                Some(value)
            }
        };
        Ok(ProxyUrl { url, authorization })
    }
}

impl<'de> Deserialize<'de> for ProxyUrl {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        ProxyUrl::parse(&s).map_err(de::Error::custom)
    }
}

/// Standard base64 with padding (RFC 4648 §4), for `Proxy-Authorization: Basic` (and the
/// gateway's short digests of quota keys).
pub fn base64(input: &[u8]) -> String {
    STANDARD.encode(input)
}
