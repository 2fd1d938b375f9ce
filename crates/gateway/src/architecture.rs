//! The gateway's modules form layers: no module imports one that imports it back, directly or
//! through others. A cycle is where a change ripples both ways and a reader cannot start at
//! the bottom; this test keeps them out.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Each top-level module → the top-level modules its files name with `crate::`.
fn imports() -> BTreeMap<String, BTreeSet<String>> {
    fn walk(dir: &Path, root: &Path, out: &mut BTreeMap<String, BTreeSet<String>>) {
        for entry in std::fs::read_dir(dir).expect("read src") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                walk(&path, root, out);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path.strip_prefix(root).expect("under src");
            let first = rel.components().next().expect("a component");
            let module = first
                .as_os_str()
                .to_string_lossy()
                .trim_end_matches(".rs")
                .to_string();
            if module == "lib" || module == "main" {
                continue;
            }
            let text = std::fs::read_to_string(&path).expect("read file");
            let deps = out.entry(module.clone()).or_default();
            for line in text.lines() {
                // Comments and doc links name modules without depending on them.
                let code = line.split("//").next().unwrap_or("");
                for (i, _) in code.match_indices("crate::") {
                    let name: String = code[i + 7..]
                        .chars()
                        .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                        .collect();
                    if !name.is_empty() && name != module {
                        deps.insert(name);
                    }
                }
            }
        }
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut out = BTreeMap::new();
    walk(&root, &root, &mut out);
    out
}

#[test]
fn no_module_imports_one_that_imports_it_back() {
    let graph = imports();
    // Depth-first search with colours: grey on the stack, black done.
    fn visit<'a>(
        node: &'a str,
        graph: &'a BTreeMap<String, BTreeSet<String>>,
        stack: &mut Vec<&'a str>,
        done: &mut BTreeSet<&'a str>,
        cycles: &mut Vec<String>,
    ) {
        if done.contains(node) {
            return;
        }
        if let Some(at) = stack.iter().position(|n| *n == node) {
            let mut cycle: Vec<&str> = stack[at..].to_vec();
            cycle.push(node);
            cycles.push(cycle.join(" -> "));
            return;
        }
        stack.push(node);
        for next in graph.get(node).into_iter().flatten() {
            visit(next, graph, stack, done, cycles);
        }
        stack.pop();
        done.insert(node);
    }
    let mut cycles = Vec::new();
    let mut done = BTreeSet::new();
    for node in graph.keys() {
        visit(node, &graph, &mut Vec::new(), &mut done, &mut cycles);
    }
    assert!(cycles.is_empty(), "module import cycles: {cycles:#?}");
    // The test sees the modules it guards.
    assert!(graph.get("request").is_some_and(|d| d.contains("table")));
}
