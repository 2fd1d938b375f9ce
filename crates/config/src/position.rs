//! YAML paths, and the line and column of the node each path names.
//!
//! serde_yaml keeps no positions once a document is parsed, and only an error carries one. The
//! old way round that re-parsed the whole document once per error, so a file with n mistakes
//! cost n parses: a 1,000-route file with every name duplicated took 19.5 s to reject.
//! [`Positions`] instead reads the document's events once with libyaml (the parser serde_yaml
//! itself runs on, so the marks are exactly the ones its errors carry) and indexes every node
//! by its path. It is built only when a config is already known to be wrong.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;
use std::mem::MaybeUninit;

/// A path into the YAML document.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct YamlPath(pub(super) Vec<Segment>);

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Segment {
    Key(Cow<'static, str>),
    Index(usize),
}

impl YamlPath {
    /// The document itself.
    pub fn root() -> YamlPath {
        YamlPath(Vec::new())
    }
    /// Descends into a mapping key.
    pub fn key(mut self, key: &'static str) -> YamlPath {
        self.0.push(Segment::Key(key.into()));
        self
    }
    /// Descends into a mapping key chosen by the config's author (a usage unit's name).
    pub fn key_named(mut self, key: &str) -> YamlPath {
        self.0.push(Segment::Key(Cow::Owned(key.to_string())));
        self
    }
    /// Descends into a sequence element.
    pub fn index(mut self, i: usize) -> YamlPath {
        self.0.push(Segment::Index(i));
        self
    }
    /// The enclosing node; the root is its own parent.
    fn parent(&self) -> YamlPath {
        let mut up = self.clone();
        up.0.pop();
        up
    }
}

impl fmt::Display for YamlPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str(".");
        }
        for (i, s) in self.0.iter().enumerate() {
            match s {
                Segment::Key(k) => {
                    if i > 0 {
                        f.write_str(".")?;
                    }
                    // A key is the author's text, and a complex key (`? …`) may span lines.
                    crate::write_one_line(f, k)?;
                }
                Segment::Index(n) => write!(f, "[{n}]")?,
            }
        }
        Ok(())
    }
}

/// Finds the line and column of the node at `path`.
///
/// Each call reads the whole document: to place many paths, build [`Positions`] once.
pub fn locate(text: &str, path: &YamlPath) -> Option<(usize, usize)> {
    Positions::of(text).value(path)
}

/// A 1-based line and column.
type At = (usize, usize);

#[derive(Debug, Clone)]
struct Node {
    /// Where the mapping key that leads to the node is written, when there is one.
    key: Option<At>,
    /// Where the node itself starts.
    value: At,
    /// A scalar's text, exactly as written (less quotes and escapes).
    text: Option<Box<str>>,
}

/// Every node of a document, by the display form of its path.
#[derive(Debug, Default)]
pub(super) struct Positions {
    nodes: HashMap<String, Node>,
}

impl Positions {
    /// Indexes `text`. A syntax error ends the walk; the nodes before it stay indexed, which is
    /// what lets a syntax error be shown at the node it broke.
    pub(super) fn of(text: &str) -> Positions {
        let mut walk = Walk::default();
        for_each_event(text, |event, at| {
            walk.event(&event, at);
        });
        Positions { nodes: walk.nodes }
    }

    /// Where the node at `path` starts.
    pub(super) fn value(&self, path: &YamlPath) -> Option<At> {
        self.nodes.get(&path.to_string()).map(|n| n.value)
    }

    /// The text of the scalar at `path`, as written: `007` stays `007`, where a YAML value
    /// would hold the number 7.
    pub(super) fn text(&self, path: &YamlPath) -> Option<&str> {
        self.nodes.get(&path.to_string())?.text.as_deref()
    }

    /// Where the key that leads to `path` is written (for a mistake in the key itself).
    pub(super) fn key(&self, path: &YamlPath) -> Option<At> {
        self.nodes.get(&path.to_string()).and_then(|n| n.key)
    }

    /// The position of `path`, or of its nearest ancestor that exists (a missing field is
    /// best shown at the mapping that lacks it).
    pub(super) fn nearest(&self, path: &YamlPath) -> Option<At> {
        let mut path = path.clone();
        loop {
            if let Some(at) = self.value(&path) {
                return Some(at);
            }
            if path.0.is_empty() {
                return None;
            }
            path = path.parent();
        }
    }
}

/// What the walks need of one libyaml event.
pub(super) enum Event {
    Scalar(Scalar),
    /// An alias (`*name`): a node without children.
    Alias,
    SequenceStart,
    MappingStart,
    End,
    DocumentEnd,
}

/// A scalar event: its value, and where and how it is written (for `interpolate`, which
/// rewrites scalars in place).
pub(super) struct Scalar {
    /// The value, less quotes and escapes.
    pub(super) value: String,
    /// The bytes of the text it covers: from its anchor or tag, when it has one, to the end of
    /// the scalar (a closing quote included; for a block scalar, its trailing line breaks).
    pub(super) span: std::ops::Range<usize>,
    /// How it is written.
    pub(super) style: Style,
    /// Whether an anchor (`&a`) or an explicit tag (`!!str`) comes before it.
    pub(super) decorated: bool,
}

/// A scalar's style.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Style {
    Plain,
    SingleQuoted,
    DoubleQuoted,
    /// `|`
    Literal,
    /// `>`
    Folded,
}

enum Frame {
    Sequence {
        path: String,
        next: usize,
    },
    Mapping {
        path: String,
        /// The key just read, waiting for its value; `None` while a key is expected.
        key: Option<(Option<String>, At)>,
    },
    /// A node whose path cannot be written (under a non-scalar key): its children are skipped.
    Unnamed,
}

/// Follows the events of a document, naming each node by its path.
#[derive(Default)]
pub(super) struct Walk {
    stack: Vec<Frame>,
    nodes: HashMap<String, Node>,
    done: bool,
}

impl Walk {
    /// Takes the next event, which starts at `at`, and returns the path of the node it starts
    /// (for a mapping key, the path of the value it leads to), when it has one.
    pub(super) fn event(&mut self, event: &Event, at: At) -> Option<String> {
        if self.done {
            return None;
        }
        let is_container = match event {
            Event::End => {
                self.stack.pop();
                return None;
            }
            Event::DocumentEnd => {
                // serde_yaml refuses a second document, so only the first one matters.
                self.done = true;
                return None;
            }
            Event::Scalar(_) | Event::Alias => false,
            Event::SequenceStart | Event::MappingStart => true,
        };
        // Name the new node after its place in the enclosing one.
        let placed: Option<(String, Option<At>)> = match self.stack.last_mut() {
            None => Some((".".to_string(), None)),
            Some(Frame::Unnamed) => None,
            Some(Frame::Sequence { path, next }) => {
                let p = format!("{}[{next}]", if path == "." { "" } else { path });
                *next += 1;
                Some((p, None))
            }
            Some(Frame::Mapping { path, key }) => match key.take() {
                None => {
                    // This node is a key.
                    let name = match event {
                        Event::Scalar(s) => Some(s.value.clone()),
                        _ => None,
                    };
                    let named = name.as_ref().map(|name| {
                        if path == "." {
                            name.clone()
                        } else {
                            format!("{path}.{name}")
                        }
                    });
                    *key = Some((name, at));
                    if is_container {
                        // A complex key: skip what it holds.
                        self.stack.push(Frame::Unnamed);
                    }
                    return named;
                }
                Some((None, _)) => None,
                Some((Some(name), key_at)) => {
                    let p = if path == "." {
                        name
                    } else {
                        format!("{path}.{name}")
                    };
                    Some((p, Some(key_at)))
                }
            },
        };
        let frame = match placed {
            Some((path, key)) => {
                let text = match event {
                    Event::Scalar(s) => Some(s.value.as_str().into()),
                    _ => None,
                };
                self.nodes.entry(path.clone()).or_insert(Node {
                    key,
                    value: at,
                    text,
                });
                match event {
                    Event::SequenceStart => Frame::Sequence {
                        path: path.clone(),
                        next: 0,
                    },
                    Event::MappingStart => Frame::Mapping {
                        path: path.clone(),
                        key: None,
                    },
                    _ => return Some(path),
                }
            }
            None if is_container => Frame::Unnamed,
            None => return None,
        };
        let path = match &frame {
            Frame::Sequence { path, .. } | Frame::Mapping { path, .. } => Some(path.clone()),
            Frame::Unnamed => None,
        };
        self.stack.push(frame);
        path
    }
}

/// Runs libyaml's parser over `text` and hands each event, with where it starts, to `f`.
///
/// This is the only unsafe code in the crate. It mirrors serde_yaml's own wrapper
/// (`serde_yaml::libyaml::parser`): the parser lives in a box because libyaml keeps a pointer
/// to it, `text` outlives it, every event is deleted after it is read, and the parser is
/// deleted by a guard even if `f` panics.
#[allow(unsafe_code)]
pub(super) fn for_each_event(text: &str, mut f: impl FnMut(Event, At)) {
    struct Parser(Box<MaybeUninit<unsafe_libyaml::yaml_parser_t>>);
    impl Drop for Parser {
        fn drop(&mut self) {
            // SAFETY: only built after yaml_parser_initialize succeeded.
            unsafe { unsafe_libyaml::yaml_parser_delete(self.0.as_mut_ptr()) }
        }
    }

    let mut boxed = Box::new(MaybeUninit::<unsafe_libyaml::yaml_parser_t>::uninit());
    // SAFETY: libyaml initializes the struct it is given; on failure nothing is to be freed.
    if unsafe { unsafe_libyaml::yaml_parser_initialize(boxed.as_mut_ptr()) }.fail {
        return;
    }
    let mut parser = Parser(boxed);
    let p = parser.0.as_mut_ptr();
    // SAFETY: `p` is initialized and boxed (it never moves); `text` outlives `parser`, which
    // is dropped at the end of this function.
    unsafe {
        unsafe_libyaml::yaml_parser_set_encoding(p, unsafe_libyaml::YAML_UTF8_ENCODING);
        unsafe_libyaml::yaml_parser_set_input_string(p, text.as_ptr(), text.len() as u64);
    }
    loop {
        let mut raw = MaybeUninit::<unsafe_libyaml::yaml_event_t>::uninit();
        // SAFETY: `p` is a live parser; on success libyaml has filled `raw`, which is read
        // before yaml_event_delete frees what it points to, and never after.
        let (event, at) = unsafe {
            // After a failure nothing is parsed again: libyaml's state is then undefined.
            if unsafe_libyaml::yaml_parser_parse(p, raw.as_mut_ptr()).fail {
                return;
            }
            let e = raw.as_mut_ptr();
            let mark = (*e).start_mark;
            let at = (mark.line as usize + 1, mark.column as usize + 1);
            let event = match (*e).type_ {
                unsafe_libyaml::YAML_SCALAR_EVENT => {
                    let s = (*e).data.scalar;
                    // from_raw_parts needs a non-null pointer even for an empty slice.
                    let bytes = if s.value.is_null() {
                        &[][..]
                    } else {
                        std::slice::from_raw_parts(s.value, s.length as usize)
                    };
                    let style = match s.style {
                        unsafe_libyaml::YAML_SINGLE_QUOTED_SCALAR_STYLE => Style::SingleQuoted,
                        unsafe_libyaml::YAML_DOUBLE_QUOTED_SCALAR_STYLE => Style::DoubleQuoted,
                        unsafe_libyaml::YAML_LITERAL_SCALAR_STYLE => Style::Literal,
                        unsafe_libyaml::YAML_FOLDED_SCALAR_STYLE => Style::Folded,
                        _ => Style::Plain,
                    };
                    // The marks' `index` counts bytes (unsafe-libyaml's SKIP adds each
                    // character's width), so the span indexes `text` directly.
                    let span = mark.index as usize..(*e).end_mark.index as usize;
                    Some(Event::Scalar(Scalar {
                        value: String::from_utf8_lossy(bytes).into_owned(),
                        span,
                        style,
                        decorated: !s.anchor.is_null() || !s.tag.is_null(),
                    }))
                }
                unsafe_libyaml::YAML_ALIAS_EVENT => Some(Event::Alias),
                unsafe_libyaml::YAML_SEQUENCE_START_EVENT => Some(Event::SequenceStart),
                unsafe_libyaml::YAML_MAPPING_START_EVENT => Some(Event::MappingStart),
                unsafe_libyaml::YAML_SEQUENCE_END_EVENT
                | unsafe_libyaml::YAML_MAPPING_END_EVENT => Some(Event::End),
                unsafe_libyaml::YAML_DOCUMENT_END_EVENT | unsafe_libyaml::YAML_STREAM_END_EVENT => {
                    Some(Event::DocumentEnd)
                }
                _ => None,
            };
            let stream_end = (*e).type_ == unsafe_libyaml::YAML_STREAM_END_EVENT;
            unsafe_libyaml::yaml_event_delete(e);
            if stream_end {
                if let Some(event) = event {
                    f(event, at);
                }
                return;
            }
            (event, at)
        };
        if let Some(event) = event {
            f(event, at);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_and_flow_nodes_keys_and_sequences() {
        let text = "listen: [\"a\", \"b\"]\nroutes:\n  - name: x\n    upstream: {retries: 2}\n";
        let p = Positions::of(text);
        let at = |s: &str| p.nodes.get(s).map(|n| (n.key, n.value));
        assert_eq!(at("."), Some((None, (1, 1))));
        assert_eq!(at("listen"), Some((Some((1, 1)), (1, 9))));
        assert_eq!(at("listen[1]"), Some((None, (1, 15))));
        assert_eq!(at("routes"), Some((Some((2, 1)), (3, 3))));
        assert_eq!(at("routes[0].name"), Some((Some((3, 5)), (3, 11))));
        assert_eq!(
            at("routes[0].upstream.retries"),
            Some((Some((4, 16)), (4, 25)))
        );
    }

    #[test]
    fn a_syntax_error_keeps_the_nodes_before_it() {
        let p = Positions::of("a: 1\nb: [1, 2\nc: 3\n");
        assert_eq!(p.value(&YamlPath::root().key("a")), Some((1, 4)));
        assert_eq!(p.value(&YamlPath::root().key("b")), Some((2, 4)));
    }

    #[test]
    fn complex_keys_are_skipped_and_nearest_walks_up() {
        let p = Positions::of("? [k]\n: {x: 1}\nz: {y: 2}\n");
        assert_eq!(p.value(&YamlPath::root().key("z")), Some((3, 4)));
        assert_eq!(p.nodes.len(), 3, "{:?}", p.nodes);
        let missing = YamlPath::root().key("z").key("nope");
        assert_eq!(p.nearest(&missing), Some((3, 4)));
    }
}
