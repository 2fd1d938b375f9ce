//! The module graph of a crate, read from its source, and the cycles in it.
//!
//! A cycle is where a change ripples both ways and a reader cannot start at the bottom. Each
//! crate of the workspace runs [`assert_no_cycles`] on its own `src/` in a unit test; cargo
//! already refuses cycles between crates.
//!
//! **What an edge is.** Each file is a module: `a/b.rs` and `a/b/mod.rs` are `a::b`, `lib.rs`
//! and `main.rs` the crate root. A file depends on every module it names through `crate::`,
//! `super::` or `self::` paths (`use` groups included), or through a bare path that starts with
//! one of its own child modules. A path resolves to the deepest module it names: `crate::a::b::T`
//! is `a::b` when `a/b.rs` exists, else `a`.
//!
//! **What is not an edge.** A module naming one of its own ancestors: children use the types
//! their parent declares (`use super::Ctx`) and the parent calls its children, which is how a
//! Rust module owns its parts, not a tangle. Comments are not code, so a doc link is no edge.
//!
//! It reads text, not the compiler's resolution: a path the scan cannot follow (a macro that
//! builds one, a glob re-export followed through another module) is missed, never invented.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module path: `["request", "admit"]`; the crate root is empty.
type ModPath = Vec<String>;

/// Every module of the crate under `src` → the modules it depends on (ancestors left out).
pub fn module_graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files: BTreeMap<ModPath, PathBuf> = BTreeMap::new();
    collect(src, src, &mut files);
    let modules: BTreeSet<ModPath> = files.keys().cloned().collect();
    let mut graph = BTreeMap::new();
    for (module, file) in &files {
        let text = std::fs::read_to_string(file).unwrap_or_default();
        let mut deps = BTreeSet::new();
        for path in referenced_paths(&code_only(&text), module, &modules) {
            let target = resolve(&path, &modules);
            let is_ancestor = target.len() <= module.len() && module[..target.len()] == target[..];
            if !is_ancestor {
                deps.insert(name(&target));
            }
        }
        graph.insert(name(module), deps);
    }
    graph
}

/// The cycles of `graph`, each as `a -> b -> a`. Empty when there is none.
pub fn cycles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<String> {
    fn visit<'a>(
        node: &'a str,
        graph: &'a BTreeMap<String, BTreeSet<String>>,
        stack: &mut Vec<&'a str>,
        done: &mut BTreeSet<&'a str>,
        found: &mut Vec<String>,
    ) {
        if done.contains(node) {
            return;
        }
        if let Some(at) = stack.iter().position(|n| *n == node) {
            let mut cycle = stack[at..].to_vec();
            cycle.push(node);
            found.push(cycle.join(" -> "));
            return;
        }
        stack.push(node);
        for next in graph.get(node).into_iter().flatten() {
            visit(next, graph, stack, done, found);
        }
        stack.pop();
        done.insert(node);
    }
    let mut found = Vec::new();
    let mut done = BTreeSet::new();
    for node in graph.keys() {
        visit(node, graph, &mut Vec::new(), &mut done, &mut found);
    }
    found
}

/// Panics, naming each cycle and the files in it, if the crate under `src` has one.
pub fn assert_no_cycles(src: &Path) {
    let graph = module_graph(src);
    assert!(
        graph.len() > 1,
        "no modules found under {}: the check would check nothing",
        src.display()
    );
    let found = cycles(&graph);
    assert!(
        found.is_empty(),
        "module cycles in {}: {found:#?}",
        src.display()
    );
}

fn name(module: &[String]) -> String {
    if module.is_empty() {
        "crate".into()
    } else {
        module.join("::")
    }
}

fn collect(dir: &Path, root: &Path, out: &mut BTreeMap<ModPath, PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            collect(&path, root, out);
            continue;
        }
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let rel = path.strip_prefix(root).expect("under src");
        let mut parts: ModPath = rel
            .iter()
            .map(|c| c.to_string_lossy().trim_end_matches(".rs").to_string())
            .collect();
        if matches!(parts.last().map(String::as_str), Some("mod")) {
            parts.pop();
        }
        if parts.len() == 1 && (parts[0] == "lib" || parts[0] == "main") {
            parts.clear();
        }
        // A crate with both lib.rs and main.rs: both are roots; main only uses the library.
        out.entry(parts).or_insert(path);
    }
}

/// `text` without comments and string literals, which name modules without depending on
/// them. Lines keep their places.
fn code_only(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b == b'/' && bytes.get(i + 1) == Some(&b'/') {
            while i < bytes.len() && bytes[i] != b'\n' {
                i += 1;
            }
            continue;
        }
        if b == b'/' && bytes.get(i + 1) == Some(&b'*') {
            i += 2;
            while i + 1 < bytes.len() && !(bytes[i] == b'*' && bytes[i + 1] == b'/') {
                i += 1;
            }
            i += 2;
            continue;
        }
        if b == b'"' {
            // A string literal (raw strings with `#` delimiters are rare in paths' neighbourhood;
            // their text at worst adds no edge, since it must still match a path).
            i += 1;
            while i < bytes.len() && bytes[i] != b'"' {
                if bytes[i] == b'\\' {
                    i += 1;
                }
                i += 1;
            }
            i += 1;
            out.push(' ');
            continue;
        }
        out.push(b as char);
        i += 1;
    }
    out
}

/// Every path the code names that starts at `crate`, `super`, `self` or a child module of
/// `module`, as absolute module-path segments (items included; [`resolve`] trims them).
fn referenced_paths(code: &str, module: &[String], modules: &BTreeSet<ModPath>) -> Vec<ModPath> {
    let children: BTreeSet<&str> = modules
        .iter()
        .filter(|m| m.len() == module.len() + 1 && m[..module.len()] == *module)
        .map(|m| m[module.len()].as_str())
        .collect();
    let bytes = code.as_bytes();
    let is_ident = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
    let mut found = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if !is_ident(bytes[i]) || (i > 0 && (is_ident(bytes[i - 1]) || bytes[i - 1] == b':')) {
            i += 1;
            continue;
        }
        let start = i;
        while i < bytes.len() && is_ident(bytes[i]) {
            i += 1;
        }
        let word = &code[start..i];
        if !code[i..].starts_with("::") {
            continue;
        }
        let base: Option<ModPath> = match word {
            "crate" => Some(Vec::new()),
            "self" => Some(module.to_vec()),
            "super" => {
                let mut base = module.to_vec();
                base.pop();
                // `super::super::`…
                let mut j = i + 2;
                while code[j..].starts_with("super::") {
                    base.pop();
                    j += 7;
                }
                i = j - 2;
                Some(base)
            }
            w if children.contains(w) => {
                let mut base = module.to_vec();
                base.push(w.to_string());
                Some(base)
            }
            _ => None,
        };
        let Some(base) = base else { continue };
        for tail in path_tails(&code[i + 2..]) {
            let mut path = base.clone();
            path.extend(tail);
            found.push(path);
        }
    }
    found
}

/// The segments after a `prefix::`: one chain (`a::b::C`), or each member of a `{…}` group
/// (`{a, b::{c, d}}`), nested groups flattened.
fn path_tails(rest: &str) -> Vec<Vec<String>> {
    let rest = rest.trim_start();
    if let Some(group) = rest.strip_prefix('{') {
        let mut depth = 1;
        let mut end = group.len();
        for (k, c) in group.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = k;
                        break;
                    }
                }
                _ => {}
            }
        }
        let inner = &group[..end];
        let mut items = Vec::new();
        let mut depth = 0;
        let mut from = 0;
        for (k, c) in inner.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    items.push(&inner[from..k]);
                    from = k + 1;
                }
                _ => {}
            }
        }
        items.push(&inner[from..]);
        let mut out = Vec::new();
        for item in items {
            let item = item.trim();
            if item.is_empty() {
                continue;
            }
            let (head, tail) = chain(item);
            if let Some(after) = tail.strip_prefix("::") {
                for t in path_tails(after) {
                    let mut p = head.clone();
                    p.extend(t);
                    out.push(p);
                }
            } else {
                out.push(head);
            }
        }
        return out;
    }
    vec![chain(rest).0]
}

/// The identifiers of a `a::b::C` chain at the start of `s`, and what follows it.
fn chain(s: &str) -> (Vec<String>, &str) {
    let mut segments = Vec::new();
    let mut rest = s;
    loop {
        let len = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        if len == 0 {
            break;
        }
        segments.push(rest[..len].to_string());
        rest = &rest[len..];
        match rest.strip_prefix("::") {
            Some(r) if r.starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_') => rest = r,
            _ => break,
        }
    }
    (segments, rest)
}

/// The deepest module `path` names (`self` inside a group names the group's base).
fn resolve(path: &[String], modules: &BTreeSet<ModPath>) -> ModPath {
    let path: ModPath = path.iter().filter(|s| *s != "self").cloned().collect();
    (0..=path.len())
        .rev()
        .map(|n| path[..n].to_vec())
        .find(|p| modules.contains(p))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree(files: &[(&str, &str)]) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        for (path, text) in files {
            let file = src.join(path);
            std::fs::create_dir_all(file.parent().unwrap()).unwrap();
            std::fs::write(file, text).unwrap();
        }
        (dir, src)
    }

    const PARENT_AND_CHILDREN: [(&str, &str); 4] = [
        ("lib.rs", "mod request;\npub use request::Gateway;\n"),
        (
            "request/mod.rs",
            "mod admit;\nmod answer;\npub struct Gateway;\nfn f() { admit::admit(); }\n",
        ),
        (
            "request/admit.rs",
            "use super::{answer, Gateway};\npub fn admit() { answer::problem(); }\n",
        ),
        (
            "request/answer.rs",
            "use super::Gateway;\n// super::admit::warn is only a comment\npub fn problem() {}\n",
        ),
    ];

    #[test]
    fn parents_and_children_are_no_cycle() {
        let (_dir, src) = tree(&PARENT_AND_CHILDREN);
        let graph = module_graph(&src);
        assert_eq!(
            graph["request::admit"],
            BTreeSet::from(["request::answer".to_string()])
        );
        assert!(graph["request::answer"].is_empty(), "{graph:?}");
        assert!(graph["request"].contains("request::admit"));
        assert_eq!(cycles(&graph), Vec::<String>::new());
        assert_no_cycles(&src);
    }

    /// The check can fail: a deliberate cycle between two siblings two levels down, through
    /// a `use` group, is found and named.
    #[test]
    fn a_cycle_between_siblings_at_any_depth_is_found() {
        let mut files = PARENT_AND_CHILDREN.to_vec();
        files[3] = (
            "request/answer.rs",
            "use super::{admit::{self}, Gateway};\npub fn problem() { admit::admit(); }\n",
        );
        let (_dir, src) = tree(&files);
        let found = cycles(&module_graph(&src));
        assert_eq!(
            found,
            ["request::admit -> request::answer -> request::admit"]
        );
        let caught = std::panic::catch_unwind(|| assert_no_cycles(&src));
        assert!(caught.is_err(), "assert_no_cycles let a cycle through");
    }

    #[test]
    fn crate_paths_resolve_to_the_deepest_module() {
        let (_dir, src) = tree(&[
            ("lib.rs", "mod a;\nmod b;\n"),
            ("a/mod.rs", "mod deep;\n"),
            ("a/deep.rs", "pub fn f() { crate::b::g(); }\n"),
            (
                "b.rs",
                "use crate::{a::deep::f as h, a};\npub fn g() { let _ = \"crate::a::deep\"; }\n",
            ),
        ]);
        let graph = module_graph(&src);
        assert_eq!(graph["a::deep"], BTreeSet::from(["b".to_string()]));
        assert_eq!(
            graph["b"],
            BTreeSet::from(["a".to_string(), "a::deep".to_string()])
        );
        assert_eq!(cycles(&graph), ["a::deep -> b -> a::deep"]);
    }
}
