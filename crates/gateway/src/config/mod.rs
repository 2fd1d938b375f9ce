//! The YAML configuration (SPEC §2): types, defaults and validation.
//!
//! Every field type checks itself while it is parsed (durations, URLs, names, addresses), so
//! serde_yaml reports the exact line and column. Rules that span several fields run afterwards
//! and find their position again with [`locate`]. Either way a mistake reads
//! `FILE:LINE:COL: PATH: message`, with PATH the YAML path such as
//! `routes[1].upstream.members[0].url`.
//!
//! `schema` holds the serde types, `validate` the cross-field rules and `position` the YAML
//! paths; everything is re-exported here so that callers only ever name `crate::config::X`.

mod position;
mod schema;
mod validate;

use std::fmt;
use std::num::NonZeroUsize;
use std::path::Path;

use serde::Deserialize;

use position::Segment;
pub use position::{locate, YamlPath};
pub use schema::*;

/// The config sluice runs on when none is given: three local demo upstreams behind one
/// round-robin route. `sluice demo` starts those upstreams too.
pub const EMBEDDED_DEFAULT: &str = include_str!("../../../../configs/default.yaml");

/// The whole configuration file.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Proxy listeners.
    #[serde(default = "default_listen")]
    pub listen: Vec<ListenAddr>,
    /// Worker threads of the proxy service; the number of cores when absent.
    #[serde(default)]
    pub threads: Option<NonZeroUsize>,
    /// The admin API.
    #[serde(default)]
    pub admin: AdminConfig,
    /// Where shared state lives.
    #[serde(default)]
    pub state: StateConfig,
    /// The routes, matched as SPEC §3 says.
    #[serde(default)]
    pub routes: Vec<RouteConfig>,
}

fn default_listen() -> Vec<ListenAddr> {
    vec![ListenAddr("127.0.0.1:8080".parse().unwrap())]
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
            "{}:{}:{}: {}: {}",
            self.file, self.line, self.column, self.path, self.message
        )
    }
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

impl Config {
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

    /// Parses and validates `text`; `file` names it in error messages.
    pub fn parse(file: &str, text: &str) -> Result<Config, ConfigErrors> {
        // Tracking the YAML path of every node doubles the cost of parsing a large file, and
        // only an error needs it: parse plainly, and again with paths when that fails.
        let config: Config = match serde_yaml::from_str(text) {
            Ok(config) => config,
            Err(plain) => {
                let traced = serde_path_to_error::deserialize::<_, Config>(
                    serde_yaml::Deserializer::from_str(text),
                );
                let error = match traced {
                    Err(e) => from_serde(file, text, &e),
                    // The same text fails the same way; should it not, report the plain error.
                    Ok(_) => {
                        let (line, column) =
                            plain.location().map_or((0, 0), |l| (l.line(), l.column()));
                        ConfigError {
                            file: file.to_string(),
                            line,
                            column,
                            path: ".".into(),
                            message: plain.to_string(),
                        }
                    }
                };
                return Err(ConfigErrors(vec![error]));
            }
        };
        let problems = config.validate();
        if problems.is_empty() {
            return Ok(config);
        }
        Err(ConfigErrors(
            problems
                .into_iter()
                .map(|(path, message)| {
                    let (line, column) = locate(text, &path).unwrap_or((0, 0));
                    ConfigError {
                        file: file.to_string(),
                        line,
                        column,
                        path: path.to_string(),
                        message,
                    }
                })
                .collect(),
        ))
    }
}

/// Turns a serde error into our format. serde_yaml puts its own (sometimes shorter) path and
/// the position inside the message, so both are cut out. Errors raised by our field types are
/// stamped with the position of the enclosing mapping, so those are located again by path.
fn from_serde(
    file: &str,
    text: &str,
    e: &serde_path_to_error::Error<serde_yaml::Error>,
) -> ConfigError {
    let (mut line, mut column) = e
        .inner()
        .location()
        .map(|l| (l.line(), l.column()))
        .unwrap_or((0, 0));
    let mut message = e.inner().to_string();
    let position = format!(" at line {line} column {column}");
    if let Some(at) = message.find(&position) {
        message.replace_range(at..at + position.len(), "");
    }
    let path = e.path().to_string();
    if let Some((head, rest)) = message.split_once(": ") {
        if !head.is_empty() && path.starts_with(head) {
            message = rest.to_string();
        }
    }
    // An unknown key is best shown at the key itself, which is where serde_yaml points.
    if !message.starts_with("unknown field") {
        let yaml_path = YamlPath(
            e.path()
                .iter()
                .filter_map(|s| match s {
                    serde_path_to_error::Segment::Seq { index } => Some(Segment::Index(*index)),
                    serde_path_to_error::Segment::Map { key } => {
                        Some(Segment::Key(key.clone().into()))
                    }
                    _ => None,
                })
                .collect(),
        );
        if let Some(at) = locate(text, &yaml_path) {
            (line, column) = at;
        }
    }
    ConfigError {
        file: file.to_string(),
        line,
        column,
        path: if path.is_empty() || path == "?" {
            ".".into()
        } else {
            path
        },
        message,
    }
}
