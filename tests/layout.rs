//! The layout rules of ARCHITECTURE.md, checked: no import cycle between files of `src/`, and a
//! map short enough to read whose every path exists.
//!
//! Exists because a layering that is only written down drifts. The import graph is read from
//! the source text (no compiler needed): every `crate::`, `super::` and `self::` path (with
//! `use` groups expanded), every path through a child module a file declares or a module a `use`
//! brought in, outside `#[cfg(test)]` items, is an edge to the longest module prefix that is a
//! file. Doc links count:
//! a file that links to another depends on it for its meaning. A child that imports a sibling
//! through its parent's re-exports closes a cycle (parent → sibling → … → parent) and is reported.
//!
//! Run alone with `cargo test --test layout -- --nocapture` to print the graph's size.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

type Module = Vec<String>;

/// Every `.rs` file under `src/` (but `main.rs`, the binary's own root) by module path.
fn modules(src: &Path) -> BTreeMap<Module, PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    let mut files = Vec::new();
    walk(src, &mut files);
    let mut map = BTreeMap::new();
    for p in files {
        let Ok(rel) = p.strip_prefix(src) else {
            continue;
        };
        let mut parts: Module = rel
            .with_extension("")
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        if parts == ["main"] {
            continue;
        }
        if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
            parts.pop();
        }
        map.insert(parts, p);
    }
    map
}

fn is_ident_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Splits a `use` tree (`a::{b, c::{d as e, *}}`) into its full paths.
fn expand_use(tree: &str) -> Vec<Vec<String>> {
    fn tokens(s: &str) -> Vec<String> {
        let mut out = Vec::new();
        let mut chars = s.chars().peekable();
        while let Some(&c) = chars.peek() {
            if is_ident_char(c) {
                let mut word = String::new();
                while let Some(&c) = chars.peek().filter(|c| is_ident_char(**c)) {
                    word.push(c);
                    chars.next();
                }
                out.push(word);
            } else {
                if matches!(c, '{' | '}' | ',' | '*') {
                    out.push(c.to_string());
                }
                chars.next();
            }
        }
        out
    }
    // tree := segment* ( '{' tree (',' tree)* '}' | '*' )? ('as' name)?
    fn parse(toks: &[String], pos: &mut usize, prefix: &[String], out: &mut Vec<Vec<String>>) {
        let mut path = prefix.to_vec();
        while let Some(t) = toks.get(*pos) {
            match t.as_str() {
                "{" => {
                    *pos += 1;
                    loop {
                        match toks.get(*pos).map(String::as_str) {
                            None => return,
                            Some("}") => {
                                *pos += 1;
                                return;
                            }
                            Some(",") => *pos += 1,
                            Some(_) => parse(toks, pos, &path, out),
                        }
                    }
                }
                "}" | "," => break,
                "*" => {
                    *pos += 1;
                }
                "as" => {
                    *pos += 2;
                }
                "self" if path.len() > prefix.len() || !prefix.is_empty() => {
                    *pos += 1;
                }
                word => {
                    path.push(word.to_owned());
                    *pos += 1;
                }
            }
        }
        out.push(path);
    }
    let toks = tokens(tree);
    let mut out = Vec::new();
    let mut pos = 0;
    while pos < toks.len() {
        let before = pos;
        parse(&toks, &mut pos, &[], &mut out);
        if pos == before {
            pos += 1;
        }
    }
    out
}

/// The paths a file's text names: `use` trees expanded, plus every `crate::`/`super::`/`self::`
/// path and every path through one of `children` written inline.
fn named_paths(text: &str, children: &BTreeSet<String>) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    // `use` items start a line (after `pub`, `pub(crate)`…); prose that says "use" does not.
    let mut offset = 0;
    for line in text.split_inclusive('\n') {
        let start = offset;
        offset += line.len();
        let trimmed = line.trim_start();
        let item = match trimmed.strip_prefix("pub") {
            Some(r) if r.starts_with('(') => r.find(')').map_or(r, |e| &r[e + 1..]),
            Some(r) => r,
            None => trimmed,
        }
        .trim_start();
        if let Some(tree) = item.strip_prefix("use ") {
            let at = start + (line.len() - tree.len());
            if let Some(end) = text[at..].find(';') {
                out.extend(expand_use(&text[at..at + end]));
            }
        }
    }
    // Names a `use` brought in, by their last segment, for paths written through them.
    let aliases: BTreeMap<String, Vec<String>> = out
        .iter()
        .filter(|p| {
            matches!(
                p.first().map(String::as_str),
                Some("crate" | "super" | "self")
            )
        })
        .filter_map(|p| Some((p.last()?.clone(), p.clone())))
        .collect();
    let chars: Vec<char> = text.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        if !is_ident_char(chars[i])
            || (i > 0 && (is_ident_char(chars[i - 1]) || chars[i - 1] == ':'))
        {
            i += 1;
            continue;
        }
        let mut path = Vec::new();
        let mut j = i;
        loop {
            let start = j;
            while j < chars.len() && is_ident_char(chars[j]) {
                j += 1;
            }
            path.push(chars[start..j].iter().collect::<String>());
            if chars.get(j) == Some(&':')
                && chars.get(j + 1) == Some(&':')
                && chars.get(j + 2).is_some_and(|c| is_ident_char(*c))
            {
                j += 2;
            } else {
                break;
            }
        }
        let first = path[0].as_str();
        if path.len() > 1 {
            if matches!(first, "crate" | "super" | "self") || children.contains(first) {
                out.push(path);
            } else if let Some(imported) = aliases.get(first) {
                // `use crate::node; … node::watchers::f()` names `node/watchers.rs`.
                out.push(imported.iter().chain(&path[1..]).cloned().collect());
            }
        }
        i = j.max(i + 1);
    }
    out
}

/// The module a path names, from a file at module `at` (`dir_mod`: a `mod.rs`/`lib.rs`).
fn absolute(path: &[String], at: &Module, children: &BTreeSet<String>) -> Option<Module> {
    let first = path.first()?.as_str();
    let mut base: Module = match first {
        "crate" => Vec::new(),
        "self" => at.clone(),
        "super" => at.clone(),
        c if children.contains(c) => at.clone(),
        _ => return None,
    };
    let mut rest = match first {
        "crate" | "self" => &path[1..],
        _ => path,
    };
    while rest.first().map(String::as_str) == Some("super") {
        base.pop()?;
        rest = &rest[1..];
    }
    base.extend(rest.iter().cloned());
    Some(base)
}

/// `text` without its `#[cfg(test)]` items (a test module, a test-only helper): tests may import
/// anything. An item ends at its first `;` or at the brace that closes its first `{`.
fn without_test_items(text: &str) -> String {
    const ATTR: &str = "#[cfg(test)]";
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(ATTR) {
        out.push_str(&rest[..at]);
        let item = &rest[at + ATTR.len()..];
        let mut depth = 0usize;
        let mut end = item.len();
        for (k, c) in item.char_indices() {
            match c {
                ';' if depth == 0 => {
                    end = k + 1;
                    break;
                }
                '{' => depth += 1,
                '}' => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        end = k + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        rest = &item[end..];
    }
    out.push_str(rest);
    out
}

/// The file-level import graph of `src/`: file → files it names.
fn import_graph(src: &Path) -> BTreeMap<Module, BTreeSet<Module>> {
    let files = modules(src);
    let mut graph = BTreeMap::new();
    for (module, path) in &files {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let text = without_test_items(&text);
        // Child modules declared by this file (`mod x;`), named relative to it.
        let children: BTreeSet<String> = files
            .keys()
            .filter(|m| m.len() == module.len() + 1 && m.starts_with(module))
            .filter_map(|m| m.last().cloned())
            .collect();
        let mut edges = BTreeSet::new();
        for p in named_paths(&text, &children) {
            let Some(full) = absolute(&p, module, &children) else {
                continue;
            };
            let target = (0..=full.len())
                .rev()
                .map(|k| full[..k].to_vec())
                .find(|m| files.contains_key(m));
            if let Some(t) = target {
                if !t.is_empty() && &t != module {
                    edges.insert(t);
                }
            }
        }
        graph.insert(module.clone(), edges);
    }
    graph
}

/// Strongly connected components with more than one file (Tarjan).
fn cycles(graph: &BTreeMap<Module, BTreeSet<Module>>) -> Vec<Vec<Module>> {
    struct Tarjan<'a> {
        graph: &'a BTreeMap<Module, BTreeSet<Module>>,
        index: BTreeMap<&'a Module, usize>,
        low: BTreeMap<&'a Module, usize>,
        stack: Vec<&'a Module>,
        on_stack: BTreeSet<&'a Module>,
        out: Vec<Vec<Module>>,
    }
    impl<'a> Tarjan<'a> {
        fn visit(&mut self, v: &'a Module) {
            let n = self.index.len();
            self.index.insert(v, n);
            self.low.insert(v, n);
            self.stack.push(v);
            self.on_stack.insert(v);
            for w in self.graph.get(v).into_iter().flatten() {
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let lw = self.low[w];
                    let lv = self.low.get_mut(v).expect("visited");
                    *lv = (*lv).min(lw);
                } else if self.on_stack.contains(w) {
                    let iw = self.index[w];
                    let lv = self.low.get_mut(v).expect("visited");
                    *lv = (*lv).min(iw);
                }
            }
            if self.low[v] == self.index[v] {
                let mut comp = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on_stack.remove(w);
                    comp.push(w.clone());
                    if w == v {
                        break;
                    }
                }
                if comp.len() > 1 {
                    comp.sort();
                    self.out.push(comp);
                }
            }
        }
    }
    let mut t = Tarjan {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in graph.keys() {
        if !t.index.contains_key(v) {
            t.visit(v);
        }
    }
    t.out
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn no_file_of_src_imports_itself_through_others() {
    // The graph maps files to modules by their paths; `#[path]` would break that mapping.
    for path in modules(&root().join("src")).values() {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let path_attr =
            text.contains("#[path") || (text.contains("cfg_attr") && text.contains("path ="));
        assert!(
            !path_attr,
            "{} uses #[path]: name files after their modules",
            path.display()
        );
    }
    // Paths through re-exports at the crate root would name `lib.rs`, which is no layer's file.
    let lib = std::fs::read_to_string(root().join("src/lib.rs")).unwrap_or_default();
    assert!(
        !lib.lines().any(|l| l.trim_start().starts_with("pub use")),
        "src/lib.rs re-exports: name items by their module path instead"
    );
    let graph = import_graph(&root().join("src"));
    let edges: usize = graph.values().map(BTreeSet::len).sum();
    println!("{} files, {edges} import edges", graph.len());
    assert!(graph.len() > 50, "src/ not found or nearly empty");
    let found = cycles(&graph);
    let shown: Vec<String> = found
        .iter()
        .map(|c| {
            c.iter()
                .map(|m| m.join("/"))
                .collect::<Vec<_>>()
                .join(" ↔ ")
        })
        .collect();
    assert!(found.is_empty(), "import cycles:\n{}", shown.join("\n"));
}

/// The layers of `src/`, bottom up: a file may import its own layer and the ones before it in
/// this list, never one after it (ARCHITECTURE.md, "Layers").
const LAYERS: [&str; 11] = [
    "shutdown",
    "core",
    "engine_sim",
    "kv_events",
    "tokenize",
    "replica",
    "mesh",
    "replicas",
    "node",
    "proxy",
    "bench",
];

#[test]
fn layers_import_only_downwards() {
    let graph = import_graph(&root().join("src"));
    let layer = |m: &Module| {
        m.first()
            .and_then(|top| LAYERS.iter().position(|l| l == top))
    };
    let mut upward = Vec::new();
    for (from, tos) in graph.iter().filter(|(m, _)| !m.is_empty()) {
        let Some(lf) = layer(from) else {
            upward.push(format!("{} is in no layer of LAYERS", from.join("/")));
            continue;
        };
        for to in tos {
            if layer(to).is_some_and(|lt| lt > lf) {
                upward.push(format!("{} imports {}", from.join("/"), to.join("/")));
            }
        }
    }
    assert!(
        upward.is_empty(),
        "imports against the layers:\n{}",
        upward.join("\n")
    );
}

#[test]
fn the_checker_sees_cycles_and_use_groups() {
    let children = BTreeSet::from(["child".to_owned()]);
    let paths = named_paths(
        "use crate::a::{b::{C, D as E}, f};\nuse super::g;\nfn x() { child::h(); crate::i::J::k(); }",
        &children,
    );
    let has = |p: &[&str]| paths.iter().any(|q| q == p);
    assert!(has(&["crate", "a", "b", "C"]));
    assert!(has(&["crate", "a", "b", "D"]));
    assert!(has(&["crate", "a", "f"]));
    assert!(has(&["super", "g"]));
    assert!(has(&["child", "h"]));
    assert!(has(&["crate", "i", "J", "k"]));
    let through_import = named_paths(
        "use crate::node;\nfn f() { node::watchers::g(); }",
        &BTreeSet::new(),
    );
    assert!(through_import
        .iter()
        .any(|q| q == &["crate", "node", "watchers", "g"]));
    let stripped = without_test_items(
        "use crate::a;\n#[cfg(test)]\nfn h() { if x { crate::b::c(); } }\n#[cfg(test)]\nuse crate::d;\nuse crate::e;",
    );
    assert!(stripped.contains("crate::a") && stripped.contains("crate::e"));
    assert!(!stripped.contains("crate::b") && !stripped.contains("crate::d"));
    let m = |s: &str| s.split('/').map(str::to_owned).collect::<Module>();
    let graph = BTreeMap::from([
        (m("a"), BTreeSet::from([m("b")])),
        (m("b"), BTreeSet::from([m("c")])),
        (m("c"), BTreeSet::from([m("a")])),
        (m("d"), BTreeSet::from([m("a")])),
    ]);
    assert_eq!(cycles(&graph), vec![vec![m("a"), m("b"), m("c")]]);
}

/// Paths ARCHITECTURE.md names in backticks or links, written from the repository root.
fn named_repo_paths(text: &str) -> Vec<String> {
    const ROOTS: [&str; 10] = [
        "src/",
        "tests/",
        "docs/",
        "benches/",
        "examples/",
        "scripts/",
        "config/",
        "data/",
        "deploy/",
        ".ci/",
    ];
    let mut out = Vec::new();
    for (i, piece) in text.split('`').enumerate() {
        if i % 2 == 1 {
            out.push(piece.to_owned());
        }
    }
    for piece in text.split("](").skip(1) {
        if let Some(end) = piece.find(')') {
            out.push(piece[..end].to_owned());
        }
    }
    out.into_iter()
        .map(|p| p.trim().trim_end_matches(&[',', '.', ':'][..]).to_owned())
        .filter(|p| !p.contains(' ') && !p.contains("://"))
        .filter(|p| ROOTS.iter().any(|r| p.starts_with(r)) || p.ends_with(".md"))
        .collect()
}

#[test]
fn the_architecture_map_is_short_and_names_only_real_paths() {
    let text = std::fs::read_to_string(root().join("ARCHITECTURE.md")).unwrap_or_default();
    let lines = text.lines().count();
    assert!(
        (50..=300).contains(&lines),
        "ARCHITECTURE.md has {lines} lines; the map is meant to be read in 15 minutes (≤ 300)"
    );
    // Its layer sections are `### name — path`, in the order `LAYERS` enforces.
    let headings: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("### "))
        .filter_map(|l| l.split(" — ").next())
        .collect();
    assert_eq!(
        headings, LAYERS,
        "ARCHITECTURE.md's layer sections differ from LAYERS"
    );
    let named = named_repo_paths(&text);
    assert!(named.len() > 20, "the map names too few paths: {named:?}");
    let missing: Vec<&String> = named.iter().filter(|p| !root().join(p).exists()).collect();
    assert!(
        missing.is_empty(),
        "ARCHITECTURE.md names missing paths: {missing:?}"
    );
}
