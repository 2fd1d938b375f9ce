//! sluice-config: the YAML configuration (SPEC §2), read into a checked [`Config`].
//!
//! This crate has one job: turn a config file into a [`Config`] every rule has passed, or into
//! errors that each name their place, `FILE:LINE:COL: PATH: message`, with PATH the YAML path
//! such as `routes[1].upstream.members[0].url`.
//!
//! Every field type checks itself while it is parsed (durations, URLs, names, addresses), so
//! serde_yaml reports the exact line and column. Rules that span several fields run afterwards
//! and find their position again by path (see `position`). Either way a mistake is placed.
//!
//! `schema` holds the serde types, `urls` the URLs taken apart and decoded, `validate` the
//! cross-field rules, `position` the YAML paths, `interpolate` the `${NAME}` read from the
//! environment and [`listen_tls`] the check of a TLS listener's files; everything is
//! re-exported here so that callers only ever name `sluice_config::X` (`crate::config::X` in
//! the gateway).
//!
//! It knows nothing of Pingora, nor of the code that serves a config: which selection policies
//! exist is the gateway's to say, through [`Rules`].

mod interpolate;
pub mod listen_tls;
mod position;
mod schema;
mod urls;
mod validate;

use std::fmt;
use std::num::NonZeroUsize;
use std::path::Path;

use serde::de::IgnoredAny;
use serde::Deserialize;
use serde_yaml::Value;

pub use position::{locate, YamlPath};
use position::{Positions, Segment};
pub use schema::*;
pub use urls::{base64, MemberUrl, ProxyUrl, RedisUrl};
pub use validate::load_ca;

/// The config sluice runs on when none is given: three local demo upstreams behind one
/// round-robin route. `sluice demo` starts those upstreams too.
pub const EMBEDDED_DEFAULT: &str = include_str!("../../../configs/default.yaml");

/// The whole configuration file, as [`Config::parse`] returns it once every rule has passed.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Proxy listeners, plain or TLS.
    pub listen: Vec<Listener>,
    /// Worker threads of the proxy service; the number of cores when absent.
    pub threads: Option<NonZeroUsize>,
    /// The admin API.
    pub admin: AdminConfig,
    /// Where shared state lives.
    pub state: StateConfig,
    /// The guard on destinations the client chooses (SPEC §7).
    pub egress: EgressConfig,
    /// The name servers (SPEC §7); the system's when empty.
    pub dns: DnsConfig,
    /// Bounds on client connections.
    pub limits: LimitsConfig,
    /// What access lines carry.
    pub log: LogConfig,
    /// Span export.
    pub tracing: TracingConfig,
    /// Who may call, and what each caller may use; absent, everyone may use everything.
    pub clients: Option<ClientsConfig>,
    /// The routes, matched as SPEC §3 says.
    pub routes: Vec<RouteConfig>,
}

fn default_listen() -> Vec<Listener> {
    vec![Listener::plain("127.0.0.1:8080".parse().unwrap())]
}

/// One configuration mistake, printed as `FILE:LINE:COL: PATH: message`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The file, as given on the command line.
    pub file: String,
    /// 1-based line; 0 when unknown.
    pub line: usize,
    /// 1-based column; 0 when unknown.
    pub column: usize,
    /// YAML path such as `routes[1].upstream.members[0].url`; `.` for the document.
    pub path: String,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}:{}: {}: ",
            self.file, self.line, self.column, self.path
        )?;
        // A message may quote the author's text (an unknown key, say).
        write_one_line(f, &self.message)
    }
}

/// Writes `text` with its line breaks escaped (`\n`, `\u{2028}`, …), so that an error about
/// text that spans lines stays one line: a line per mistake is what editors and CI annotations
/// read. What YAML and editors take for a line break: LF, CR, VT, FF, NEL, LS and PS.
pub(crate) fn write_one_line(f: &mut impl fmt::Write, text: &str) -> fmt::Result {
    for c in text.chars() {
        if matches!(
            c,
            '\n' | '\r' | '\u{0b}' | '\u{0c}' | '\u{85}' | '\u{2028}' | '\u{2029}'
        ) {
            write!(f, "{}", c.escape_default())?;
        } else {
            f.write_char(c)?;
        }
    }
    Ok(())
}

/// All the mistakes found in one file; at least one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

/// Rules that only the code serving a config can judge, because the config does not know that
/// code: which `upstream.selection` names exist, and what each policy asks of its route. Each
/// problem names the YAML path to blame, and comes back placed at its line and column like
/// every other config error ([`Config::load_with`], [`Config::parse_with`]).
pub trait Rules {
    /// The problems of `config`, each at its YAML path.
    fn check(&self, config: &Config) -> Vec<(YamlPath, String)>;
}

impl Config {
    /// [`Config::load`], then `rules`.
    pub fn load_with(path: &Path, rules: &dyn Rules) -> Result<(Config, Vec<u8>), ConfigErrors> {
        let (config, bytes) = Config::load(path)?;
        let text = String::from_utf8_lossy(&bytes);
        let config = config.checked(&path.display().to_string(), &text, rules)?;
        Ok((config, bytes))
    }

    /// [`Config::parse`], then `rules`.
    pub fn parse_with(file: &str, text: &str, rules: &dyn Rules) -> Result<Config, ConfigErrors> {
        Config::parse(file, text)?.checked(file, text, rules)
    }

    fn checked(self, file: &str, text: &str, rules: &dyn Rules) -> Result<Config, ConfigErrors> {
        let problems = rules.check(&self);
        if problems.is_empty() {
            return Ok(self);
        }
        Err(placed(file, text, problems))
    }

    /// Reads and validates `path`.
    pub fn load(path: &Path) -> Result<(Config, Vec<u8>), ConfigErrors> {
        let name = path.display().to_string();
        let bytes = std::fs::read(path).map_err(|e| {
            ConfigErrors(vec![ConfigError {
                file: name.clone(),
                line: 0,
                column: 0,
                path: ".".into(),
                message: format!("cannot read the file: {e}"),
            }])
        })?;
        let text = String::from_utf8_lossy(&bytes);
        let config = Config::parse(&name, &text)?;
        Ok((config, bytes))
    }

    /// Parses and validates `text`; `file` names it in error messages. `${NAME}` in its
    /// values is read from the environment (see `interpolate`).
    pub fn parse(file: &str, text: &str) -> Result<Config, ConfigErrors> {
        if !text.contains("${") {
            return Config::parse_text(file, text);
        }
        Config::parse_with_env(file, text, &|name| std::env::var(name))
    }

    /// [`Config::parse`], with `env` for the environment.
    fn parse_with_env(
        file: &str,
        text: &str,
        env: interpolate::Env<'_>,
    ) -> Result<Config, ConfigErrors> {
        let interpolated = interpolate::interpolate(text, env);
        if !interpolated.problems.is_empty() {
            return Err(ConfigErrors(
                interpolated
                    .problems
                    .into_iter()
                    .map(|p| ConfigError::at(file, Some(p.at), p.path, p.message))
                    .collect(),
            ));
        }
        Config::parse_text(file, &interpolated.text).map_err(|ConfigErrors(errors)| {
            ConfigErrors(
                errors
                    .into_iter()
                    .map(|e| interpolated.restore(text, e))
                    .collect(),
            )
        })
    }

    /// Parses and validates `text`, as it is.
    fn parse_text(file: &str, text: &str) -> Result<Config, ConfigErrors> {
        // A valid file, the common case, costs one serde_yaml pass and no bookkeeping: paths
        // and positions are worked out only once the file is known to be wrong.
        let plain = match serde_yaml::from_str::<Document<RouteConfig>>(text) {
            Ok(Document {
                listen,
                threads,
                admin,
                state,
                egress,
                dns,
                limits,
                log,
                tracing,
                clients,
                routes: Some(routes),
            }) => {
                let config = Config {
                    listen,
                    threads,
                    admin,
                    state,
                    egress,
                    dns,
                    limits,
                    log,
                    tracing,
                    clients,
                    routes,
                };
                let problems = config.validate();
                if problems.is_empty() {
                    return Ok(config);
                }
                return Err(placed(file, text, problems));
            }
            Ok(_) => None,
            Err(e) => Some(e),
        };
        Err(ConfigErrors(inside(text, diagnose(file, text, plain))))
    }
}

/// `problems`, each at its YAML path, as errors placed at their line and column in `text`:
/// validation's and the rules of the code that serves the config alike.
fn placed(file: &str, text: &str, problems: Vec<(YamlPath, String)>) -> ConfigErrors {
    let positions = Positions::of(text);
    ConfigErrors(inside(
        text,
        problems
            .into_iter()
            .map(|(path, message)| {
                let at = positions.nearest(&path);
                ConfigError::at(file, at, path.to_string(), message)
            })
            .collect(),
    ))
}

/// Moves every position past the last line of `text` to the end of that line. libyaml's scanner
/// starts a new line before the end of a stream that lacks a final line break, so a mistake
/// found at the very end of such a file (`routes:\n  - { name:`) would name a line the file does
/// not have, where an editor cannot jump.
fn inside(text: &str, mut errors: Vec<ConfigError>) -> Vec<ConfigError> {
    // The last line and its width in characters, counting line breaks as YAML does (libyaml's
    // marks count the same way): CRLF, CR, LF, NEL, LS and PS.
    let (mut last, mut width) = (1, 0);
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\r' | '\n' | '\u{85}' | '\u{2028}' | '\u{2029}' => {
                if c == '\r' && chars.peek() == Some(&'\n') {
                    chars.next();
                }
                (last, width) = (last + 1, 0);
            }
            _ => width += 1,
        }
    }
    for e in &mut errors {
        if e.line > last {
            (e.line, e.column) = (last, width + 1);
        }
    }
    errors
}

/// The file as serde reads it. `routes` is optional here only so that a file without it can be
/// told apart from `routes: []`: a truncated file read in the middle of a write must not be
/// taken for a config with no routes. `R` lets the same shape read routes as values, one by
/// one, when looking for every mistake.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename = "Config", bound = "R: Deserialize<'de>")]
struct Document<R> {
    #[serde(default = "default_listen")]
    listen: Vec<Listener>,
    #[serde(default)]
    threads: Option<NonZeroUsize>,
    #[serde(default)]
    admin: AdminConfig,
    #[serde(default)]
    state: StateConfig,
    #[serde(default)]
    egress: EgressConfig,
    #[serde(default)]
    dns: DnsConfig,
    #[serde(default)]
    limits: LimitsConfig,
    #[serde(default)]
    log: LogConfig,
    #[serde(default)]
    tracing: TracingConfig,
    #[serde(default)]
    clients: Option<ClientsConfig>,
    #[serde(default)]
    routes: Option<Vec<R>>,
}

const ROUTES_REQUIRED: &str =
    "write `routes: []` to run with no routes; a config without them is refused so that a truncated file is never taken for an empty one";

/// Every mistake that stops `text` from deserializing, not just the first.
///
/// serde stops at the first error, so the file is read as a YAML value, then the top level and
/// each route are deserialized on their own (see [`from_value`]): a file with ten broken routes
/// gets ten lines. Cross-field rules only run once everything deserializes (see
/// [`Config::parse`]). Errors come top level first, then route by route.
fn diagnose(file: &str, text: &str, plain: Option<serde_yaml::Error>) -> Vec<ConfigError> {
    let positions = Positions::of(text);
    let root = YamlPath::root();
    let traced =
        serde_path_to_error::deserialize::<_, Value>(serde_yaml::Deserializer::from_str(text));
    let mut value = match traced {
        Ok(value) => value,
        // Not YAML: nothing past the syntax error can be read.
        Err(e) => return vec![from_serde(file, &positions, &root, &e)],
    };
    if value.is_null() {
        return vec![ConfigError::at(
            file,
            Some((1, 1)),
            ".".into(),
            format!("the file is empty; {ROUTES_REQUIRED}"),
        )];
    }
    let found = match &value {
        Value::Mapping(_) => None,
        Value::Bool(_) => Some("a boolean"),
        Value::Number(_) => Some("a number"),
        Value::String(_) => Some("a string"),
        Value::Sequence(_) => Some("a sequence"),
        Value::Null => Some("nothing"),
        Value::Tagged(_) => Some("a tagged value"),
    };
    if let Some(found) = found {
        return vec![ConfigError::at(
            file,
            positions.value(&root),
            ".".into(),
            format!("expected a mapping of settings such as `routes:`, found {found}"),
        )];
    }
    let mut errors = Vec::new();
    let routes = value.as_mapping_mut().and_then(|m| m.remove("routes"));
    if let Err(e) = from_value::<Document<IgnoredAny>>(&value, &root, &positions) {
        errors.push(from_serde(file, &positions, &root, &e));
    }
    let at_routes = root.clone().key("routes");
    match routes {
        None => errors.push(ConfigError::at(
            file,
            positions.value(&root),
            ".".into(),
            format!("no routes key; {ROUTES_REQUIRED}"),
        )),
        Some(Value::Null) => errors.push(ConfigError::at(
            file,
            positions.value(&at_routes),
            at_routes.to_string(),
            format!("routes is empty; {ROUTES_REQUIRED}"),
        )),
        Some(Value::Sequence(items)) => {
            for (i, item) in items.iter().enumerate() {
                let at = at_routes.clone().index(i);
                if let Err(e) = from_value::<RouteConfig>(item, &at, &positions) {
                    errors.push(from_serde(file, &positions, &at, &e));
                }
            }
        }
        Some(other) => {
            if let Err(e) = serde_path_to_error::deserialize::<_, Vec<IgnoredAny>>(&other) {
                errors.push(from_serde(file, &positions, &at_routes, &e));
            }
        }
    }
    if errors.is_empty() {
        // The value-by-value reading accepted what the plain one refused; report the plain
        // error rather than none.
        if let Some(plain) = plain {
            let at = plain.location().map(|l| (l.line(), l.column()));
            errors.push(ConfigError::at(
                file,
                at,
                ".".into(),
                hide_strings(&plain.to_string()),
            ));
        }
    }
    errors
}

type TracedError = serde_path_to_error::Error<serde_yaml::Error>;

/// Deserializes `value`, the node at `at`, as the plain reading of the text would.
///
/// The two readings differ in one way: the text reader hands a field that wants a string the
/// scalar as written, so `name: 007` is the name "007", while a YAML value already holds the
/// number 7 there. Each such refusal is answered by putting the written text back, from
/// `positions`, and trying again; so only real mistakes are reported, and a route named 007
/// is not renamed 7.
fn from_value<T: serde::de::DeserializeOwned>(
    value: &Value,
    at: &YamlPath,
    positions: &Positions,
) -> Result<T, TracedError> {
    let mut value = std::borrow::Cow::Borrowed(value);
    loop {
        let e = match serde_path_to_error::deserialize::<_, T>(&*value) {
            Ok(t) => return Ok(t),
            Err(e) => e,
        };
        if !e.inner().to_string().ends_with("expected a string") {
            return Err(e);
        }
        let mut path = at.clone();
        let mut node = value.to_mut();
        for segment in e.path().iter() {
            let next = match segment {
                serde_path_to_error::Segment::Seq { index } => {
                    path = path.index(*index);
                    node.get_mut(*index)
                }
                serde_path_to_error::Segment::Map { key } => {
                    path.0.push(Segment::Key(key.clone().into()));
                    node.get_mut(key.as_str())
                }
                _ => None,
            };
            match next {
                Some(next) => node = next,
                None => return Err(e),
            }
        }
        match (&*node, positions.text(&path)) {
            (Value::Number(_) | Value::Bool(_) | Value::Null, Some(text)) => {
                *node = Value::String(text.to_string());
            }
            _ => return Err(e),
        }
    }
}

impl ConfigError {
    fn at(file: &str, at: Option<(usize, usize)>, path: String, message: String) -> ConfigError {
        let (line, column) = at.unwrap_or((0, 0));
        ConfigError {
            file: file.to_string(),
            line,
            column,
            path,
            message,
        }
    }
}

/// `message` without the text of the strings serde quotes in it: `invalid type: string "…",
/// expected a sequence` becomes `invalid type: string, expected a sequence`. The string is the
/// value as written, and a value in the wrong place may be a secret (a token where a list of
/// them belongs, an API key where a map of headers does); the error, which `check` prints, a
/// reload logs and `/status` shows, names its line, column and path, which is enough to find
/// it. (Values read from `${NAME}` are scrubbed by name elsewhere, wherever they appear.)
fn hide_strings(message: &str) -> String {
    const QUOTED: &str = "string \"";
    let mut out = String::with_capacity(message.len());
    let mut rest = message;
    while let Some(at) = rest.find(QUOTED) {
        out.push_str(&rest[..at]);
        out.push_str("string");
        // serde quotes with Rust's escapes: the string ends at the first quote not escaped.
        let quoted = &rest[at + QUOTED.len()..];
        let mut escaped = false;
        let end = quoted.char_indices().find_map(|(i, c)| match c {
            '\\' if !escaped => {
                escaped = true;
                None
            }
            '"' if !escaped => Some(i + 1),
            _ => {
                escaped = false;
                None
            }
        });
        match end {
            Some(end) => rest = &quoted[end..],
            // No closing quote: the rest is the string's.
            None => return out,
        }
    }
    out.push_str(rest);
    out
}

/// Turns a serde error met under `prefix` into our format. serde_yaml puts its own (sometimes
/// shorter) path and the position inside the message, so both are cut out, and the position
/// is looked up by path instead: errors raised by our field types are otherwise stamped with
/// the enclosing mapping, and errors from a YAML value carry no position at all.
fn from_serde(
    file: &str,
    positions: &Positions,
    prefix: &YamlPath,
    e: &TracedError,
) -> ConfigError {
    let own = e.inner().location().map(|l| (l.line(), l.column()));
    let mut message = e.inner().to_string();
    if let Some((line, column)) = own {
        let position = format!(" at line {line} column {column}");
        if let Some(at) = message.find(&position) {
            message.replace_range(at..at + position.len(), "");
        }
    }
    let mut message = hide_strings(&message);
    let relative = e.path().to_string();
    if let Some((head, rest)) = message.split_once(": ") {
        if !head.is_empty() && relative.starts_with(head) {
            message = rest.to_string();
        }
    }
    let mut path = prefix.clone();
    path.0.extend(e.path().iter().filter_map(|s| match s {
        serde_path_to_error::Segment::Seq { index } => Some(Segment::Index(*index)),
        serde_path_to_error::Segment::Map { key } => Some(Segment::Key(key.clone().into())),
        _ => None,
    }));
    // An unknown key is best shown at the key itself.
    let at = if message.starts_with("unknown field") {
        positions.key(&path)
    } else {
        positions.value(&path)
    };
    let at = at.or(own).or_else(|| positions.nearest(&path));
    ConfigError::at(file, at, path.to_string(), message)
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod proptests;

#[cfg(test)]
mod tests_key_pools;

#[cfg(test)]
mod tests_clients;

#[cfg(test)]
mod tests_usage;

#[cfg(test)]
mod tests_fallback;

/// No module of this crate depends on one that depends on it back, at any depth
/// (`sluice_testkit::architecture`).
#[cfg(test)]
#[test]
fn no_module_cycles() {
    sluice_testkit::architecture::assert_no_cycles(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
    );
}
