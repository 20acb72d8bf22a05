//! Tidy checks on the files inside each crate, next to `tidy.rs`'s checks between crates:
//!
//! - **Cycles.** No import cycle of more than [`MAX_CYCLE`] files in any crate's `src/`, except
//!   the crates in [`CYCLES_PENDING`] while their cycles are being removed.
//! - **Layers.** [`layer_breaches`] fails on any import from a lower layer's folder into a
//!   higher one's (berth-server: `http` > `services` > `infra`, `workers` > `services`).
//! - **Function length.** No function in berth-server's `src/` over [`MAX_FN_LINES`] lines
//!   ([`long_functions`]), test modules aside.
//!
//! The import graph is built with a small scanner rather than a parser: one node per file (the
//! crate root `lib.rs`/`main.rs` is not a node, since every module hangs off it); test modules
//! (`#[cfg(test)] mod …`) and line comments are dropped; an edge goes from a file to the longest file prefix of each
//! `crate::`, `super::`, `self::` or child-module path it names, in `use` items (groups
//! expanded) or anywhere in the code. Each check is proven able to fail by a test on a
//! synthetic tree below.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The largest import cycle a crate may keep: three files that know each other can still be read
/// together.
const MAX_CYCLE: usize = 3;

/// Crates whose import cycles other work is removing right now (issue 29). Their cycle check is
/// skipped; empty this list when that work has landed.
const CYCLES_PENDING: &[&str] = &[];

/// berth-server's layers, each list from the top down: a file may import its own layer and the
/// layers below it, never one above. `http` and `workers` are not ordered against each other.
const SERVER_LAYERS: &[&[&str]] = &[&["http", "services", "infra"], &["workers", "services"]];

/// A module by its path from the crate root: `["routes", "tasks"]` for `routes/tasks.rs` or
/// `routes/tasks/mod.rs`; the root is `[]`.
type ModPath = Vec<String>;

/// One crate's file import graph.
#[derive(Debug, Default)]
struct ModuleGraph {
    /// Every file, by module path, with its path relative to `src/`.
    files: BTreeMap<ModPath, String>,
    /// `from -> to -> the first path in `from` that named `to``.
    edges: BTreeMap<ModPath, BTreeMap<ModPath, String>>,
}

fn show(module: &[String]) -> String {
    if module.is_empty() {
        "lib".to_string()
    } else {
        module.join("/")
    }
}

impl ModuleGraph {
    /// Reads every `.rs` file under `src` (a crate's `src/` directory).
    fn read(src: &Path) -> ModuleGraph {
        let mut graph = ModuleGraph::default();
        let mut texts = BTreeMap::new();
        for file in rust_files(src) {
            let rel = file
                .strip_prefix(src)
                .expect("a file under src")
                .to_string_lossy()
                .replace('\\', "/");
            let mut parts: ModPath = rel
                .trim_end_matches(".rs")
                .split('/')
                .map(str::to_string)
                .collect();
            if matches!(
                parts.last().map(String::as_str),
                Some("mod" | "lib" | "main")
            ) {
                parts.pop();
            }
            let text = std::fs::read_to_string(&file)
                .unwrap_or_else(|e| panic!("reading {}: {e}", file.display()));
            texts.insert(parts.clone(), text);
            graph.files.insert(parts, rel);
        }
        for (module, text) in &texts {
            let paths = named_paths(text);
            for path in paths {
                if let Some(target) = graph.resolve(module, &path) {
                    graph
                        .edges
                        .entry(module.clone())
                        .or_default()
                        .entry(target)
                        .or_insert(path);
                }
            }
        }
        graph
    }

    /// The file `path`, named in `module`, points into: its longest prefix that is a file, when
    /// that is neither `module` itself nor the crate root.
    fn resolve(&self, module: &ModPath, path: &str) -> Option<ModPath> {
        let segs: Vec<&str> = path.split("::").collect();
        let mut child = module.clone();
        child.push(segs[0].to_string());
        let (mut full, rest): (ModPath, &[&str]) = match segs[0] {
            "crate" => (Vec::new(), &segs[1..]),
            "super" | "self" => {
                let mut base = module.clone();
                let mut i = 0;
                while i < segs.len() && matches!(segs[i], "super" | "self") {
                    if segs[i] == "super" {
                        base.pop();
                    }
                    i += 1;
                }
                (base, &segs[i..])
            }
            // A path through a child module of this file, named without `self::`.
            _ if segs.len() > 1 && self.files.contains_key(&child) => (module.clone(), &segs[..]),
            _ => return None,
        };
        full.extend(rest.iter().map(|s| s.to_string()));
        let target = (0..=full.len())
            .rev()
            .map(|k| full[..k].to_vec())
            .find(|prefix| self.files.contains_key(prefix))?;
        (!target.is_empty() && !module.is_empty() && target != *module).then_some(target)
    }

    /// Strongly connected components (Tarjan), each sorted, largest first.
    fn components(&self) -> Vec<Vec<ModPath>> {
        let nodes: Vec<&ModPath> = self.files.keys().collect();
        let index_of: BTreeMap<&ModPath, usize> =
            nodes.iter().enumerate().map(|(i, m)| (*m, i)).collect();
        let successors: Vec<Vec<usize>> = nodes
            .iter()
            .map(|m| {
                self.edges
                    .get(*m)
                    .into_iter()
                    .flat_map(|to| to.keys())
                    .filter_map(|t| index_of.get(t).copied())
                    .collect()
            })
            .collect();
        let mut tarjan = Tarjan::new(nodes.len());
        for v in 0..nodes.len() {
            if tarjan.index[v].is_none() {
                tarjan.visit(v, &successors);
            }
        }
        let mut out: Vec<Vec<ModPath>> = tarjan
            .components
            .into_iter()
            .map(|c| {
                let mut c: Vec<ModPath> = c.into_iter().map(|i| nodes[i].clone()).collect();
                c.sort();
                c
            })
            .collect();
        out.sort_by(|a, b| b.len().cmp(&a.len()).then_with(|| a.cmp(b)));
        out
    }

    /// One line per cycle of more than `max` files, naming the files and the edges inside it.
    fn cycles_over(&self, max: usize) -> Vec<String> {
        self.components()
            .into_iter()
            .filter(|c| c.len() > max)
            .map(|c| {
                let members: BTreeSet<&ModPath> = c.iter().collect();
                let inner: Vec<String> = c
                    .iter()
                    .flat_map(|from| {
                        let members = &members;
                        self.edges
                            .get(from)
                            .into_iter()
                            .flatten()
                            .filter(move |(to, _)| members.contains(to))
                            .map(move |(to, via)| format!("{} -> {} ({via})", show(from), show(to)))
                    })
                    .collect();
                format!(
                    "{} files in one import cycle: {}\n      {}",
                    c.len(),
                    c.iter().map(|m| show(m)).collect::<Vec<_>>().join(", "),
                    inner.join("\n      ")
                )
            })
            .collect()
    }
}

/// Tarjan's algorithm, iterative so a deep graph cannot overflow the stack.
struct Tarjan {
    index: Vec<Option<usize>>,
    low: Vec<usize>,
    on_stack: Vec<bool>,
    stack: Vec<usize>,
    next: usize,
    components: Vec<Vec<usize>>,
}

impl Tarjan {
    fn new(n: usize) -> Tarjan {
        Tarjan {
            index: vec![None; n],
            low: vec![0; n],
            on_stack: vec![false; n],
            stack: Vec::new(),
            next: 0,
            components: Vec::new(),
        }
    }

    fn visit(&mut self, root: usize, successors: &[Vec<usize>]) {
        // (node, how many of its successors were looked at)
        let mut work = vec![(root, 0usize)];
        self.open(root);
        while let Some(top) = work.last_mut() {
            let v = top.0;
            if let Some(&w) = successors[v].get(top.1) {
                top.1 += 1;
                match self.index[w] {
                    None => {
                        self.open(w);
                        work.push((w, 0));
                    }
                    Some(iw) if self.on_stack[w] => self.low[v] = self.low[v].min(iw),
                    Some(_) => {}
                }
                continue;
            }
            work.pop();
            if let Some(&(parent, _)) = work.last() {
                self.low[parent] = self.low[parent].min(self.low[v]);
            }
            if Some(self.low[v]) == self.index[v] {
                let mut component = Vec::new();
                loop {
                    let w = self.stack.pop().expect("v is on the stack");
                    self.on_stack[w] = false;
                    component.push(w);
                    if w == v {
                        break;
                    }
                }
                self.components.push(component);
            }
        }
    }

    fn open(&mut self, v: usize) {
        self.index[v] = Some(self.next);
        self.low[v] = self.next;
        self.next += 1;
        self.stack.push(v);
        self.on_stack[v] = true;
    }
}

/// Every `.rs` file under `dir`, sorted.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(d) = pending.pop() {
        let entries =
            std::fs::read_dir(&d).unwrap_or_else(|e| panic!("reading {}: {e}", d.display()));
        for entry in entries {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                pending.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

fn is_word(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// The paths a file's text names: each `use` item's paths with its groups expanded, then every
/// `text` without its test modules: each `#[cfg(test)] mod name { … }` block and each
/// `#[cfg(test)] mod name;` declaration. Other `#[cfg(test)]` items stay: a test helper in
/// production code is still a dependency.
fn without_test_modules(text: &str) -> String {
    const MARK: &str = "#[cfg(test)]";
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(MARK) {
        out.push_str(&rest[..at]);
        let after = rest[at + MARK.len()..].trim_start();
        let is_mod = after.starts_with("mod ") || after.starts_with("pub mod ");
        let (Some(semi), true) = (after.find(';'), is_mod) else {
            out.push_str(MARK);
            rest = &rest[at + MARK.len()..];
            continue;
        };
        let brace = after.find('{').filter(|&b| b < semi);
        rest = match brace {
            None => &after[semi + 1..],
            Some(open) => {
                let mut depth = 0usize;
                let mut end = after.len();
                for (i, c) in after[open..].char_indices() {
                    match c {
                        '{' => depth += 1,
                        '}' => {
                            depth -= 1;
                            if depth == 0 {
                                end = open + i + 1;
                                break;
                            }
                        }
                        _ => {}
                    }
                }
                &after[end..]
            }
        };
    }
    out.push_str(rest);
    out
}

/// `a::b…` path anywhere in the code (after the `#[cfg(test)]` cut and without line comments).
fn named_paths(text: &str) -> Vec<String> {
    let code = strip_line_comments(&without_test_modules(text));
    let mut paths = Vec::new();
    for body in use_bodies(&code) {
        expand_use("", &body.replace('\n', " "), &mut paths);
    }
    paths.extend(qualified_paths(&code));
    paths
}

/// The text with every `//` to the end of its line removed (strings are not special).
fn strip_line_comments(code: &str) -> String {
    let mut out = String::with_capacity(code.len());
    let mut rest = code;
    while let Some(i) = rest.find("//") {
        out.push_str(&rest[..i]);
        rest = &rest[i..];
        rest = &rest[rest.find('\n').unwrap_or(rest.len())..];
    }
    out.push_str(rest);
    out
}

/// The body of every `use BODY;`: `use` as a whole word, whitespace, then up to the next `;`.
fn use_bodies(code: &str) -> Vec<String> {
    let chars: Vec<char> = code.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i + 3 < chars.len() {
        let starts = chars[i..i + 3] == ['u', 's', 'e']
            && (i == 0 || !is_word(chars[i - 1]))
            && chars[i + 3].is_whitespace();
        if starts {
            let body_start = i + 4;
            if let Some(len) = chars[body_start..].iter().position(|c| *c == ';') {
                // `use`, whitespace, then at least one character before the `;`.
                if len > 0 {
                    out.push(chars[body_start..body_start + len].iter().collect());
                    i = body_start + len + 1;
                    continue;
                }
            }
        }
        i += 1;
    }
    out
}

/// Expands one `use` body's groups into its paths (`a::{b, c::{d}}` gives `a::b`, `a::c::d`),
/// each without its `as` rename.
fn expand_use(prefix: &str, item: &str, out: &mut Vec<String>) {
    let item = item.trim();
    let Some(open) = item.find('{') else {
        let full = format!("{prefix}{item}");
        out.push(full.split(" as ").next().unwrap_or("").trim().to_string());
        return;
    };
    let head = &item[..open];
    let close = item.rfind('}').filter(|c| *c > open).unwrap_or(item.len());
    let inner = &item[open + 1..close];
    let mut depth = 0i32;
    let mut current = String::new();
    let mut items = Vec::new();
    for c in inner.chars() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            _ => {}
        }
        if c == ',' && depth == 0 {
            items.push(std::mem::take(&mut current));
        } else {
            current.push(c);
        }
    }
    items.push(current);
    let prefix = format!("{prefix}{head}");
    for it in items.iter().filter(|it| !it.trim().is_empty()) {
        expand_use(&prefix, it, out);
    }
}

/// Every `word::word…` run of two or more segments that does not follow `:` or a word
/// character.
fn qualified_paths(code: &str) -> Vec<String> {
    let chars: Vec<char> = code.chars().collect();
    let word_end = |mut j: usize| {
        while j < chars.len() && is_word(chars[j]) {
            j += 1;
        }
        j
    };
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let free = i == 0 || !(is_word(chars[i - 1]) || chars[i - 1] == ':');
        if !(is_word(chars[i]) && free) {
            i += 1;
            continue;
        }
        let mut end = word_end(i);
        let mut segments = 1;
        while end + 2 < chars.len()
            && chars[end] == ':'
            && chars[end + 1] == ':'
            && is_word(chars[end + 2])
        {
            end = word_end(end + 2);
            segments += 1;
        }
        if segments > 1 {
            out.push(chars[i..end].iter().collect());
        }
        i = end;
    }
    out
}

/// Where the layers of `chains` stand: `above[a]` holds every layer `a` is over, directly or
/// through others.
fn layer_order(chains: &[&[&str]]) -> BTreeMap<String, BTreeSet<String>> {
    let mut above: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for chain in chains {
        for (i, upper) in chain.iter().enumerate() {
            let entry = above.entry(upper.to_string()).or_default();
            entry.extend(chain[i + 1..].iter().map(|l| l.to_string()));
        }
    }
    // Close transitively: a small fixed point over a handful of layers.
    loop {
        let mut grew = false;
        let snapshot = above.clone();
        for below in above.values_mut() {
            let more: BTreeSet<String> = below
                .iter()
                .flat_map(|b| snapshot.get(b).into_iter().flatten().cloned())
                .collect();
            let before = below.len();
            below.extend(more);
            grew |= below.len() != before;
        }
        if !grew {
            return above;
        }
    }
}

/// The layer folder (`http`, or a nested prefix such as `app/services`) `module` lives under:
/// the longest layer whose segments start its path.
fn layer_of<'a>(
    module: &[String],
    layers: &'a BTreeMap<String, BTreeSet<String>>,
) -> Option<&'a str> {
    layers
        .keys()
        .filter(|layer| {
            let segs: Vec<&str> = layer.split('/').collect();
            module.len() >= segs.len() && module.iter().zip(&segs).all(|(m, s)| m == s)
        })
        .max_by_key(|layer| layer.split('/').count())
        .map(String::as_str)
}

/// Every import from a file in a lower layer into a file in a higher one, as
/// `from.rs -> to.rs (path)`, plus every layer that holds no file (a renamed or misspelt folder
/// would make the rule pass by checking nothing). Files outside every layer (the crate root and
/// shared leaves such as `error.rs`) are not constrained.
fn layer_breaches(graph: &ModuleGraph, chains: &[&[&str]]) -> Vec<String> {
    let order = layer_order(chains);
    let mut found = Vec::new();
    for layer in order.keys() {
        if !graph
            .files
            .keys()
            .any(|m| layer_of(m, &order) == Some(layer.as_str()))
        {
            found.push(format!("layer {layer} holds no file"));
        }
    }
    for (from, targets) in &graph.edges {
        let Some(from_layer) = layer_of(from, &order) else {
            continue;
        };
        for (to, via) in targets {
            let Some(to_layer) = layer_of(to, &order) else {
                continue;
            };
            if order[to_layer].contains(from_layer) {
                found.push(format!(
                    "{} -> {} ({via}): {from_layer} may not import {to_layer}, which is above it",
                    graph.files[from], graph.files[to]
                ));
            }
        }
    }
    found
}

fn workspace_crates() -> Vec<(String, PathBuf)> {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut out: Vec<(String, PathBuf)> = std::fs::read_dir(&crates)
        .expect("reading crates/")
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.join("src").is_dir())
        .map(|p| {
            let name = p
                .file_name()
                .expect("a crate directory")
                .to_string_lossy()
                .to_string();
            (name, p.join("src"))
        })
        .collect();
    out.sort();
    out
}

/// The longest function berth-server may hold: one a person can still read in one go.
const MAX_FN_LINES: usize = 120;

/// Where code is, for [`long_functions`]: outside any literal or comment, or inside one.
#[derive(Clone, Copy, PartialEq)]
enum Lexed {
    Code,
    LineComment,
    BlockComment,
    Str,
    RawStr(usize),
}

/// `text` with every string, char and comment blanked out (newlines kept, so line numbers hold),
/// for counting braces: `"{"` or a `'}'` must not open or close a body.
fn code_only(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut state = Lexed::Code;
    let mut i = 0;
    let blank = |c: char| if c == '\n' { '\n' } else { ' ' };
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        match state {
            Lexed::Code => match c {
                '/' if next == Some('/') => state = Lexed::LineComment,
                '/' if next == Some('*') => state = Lexed::BlockComment,
                '"' => state = Lexed::Str,
                'r' if next == Some('#') || (next == Some('"') && !prev_ident(&chars, i)) => {
                    let hashes = chars[i + 1..].iter().take_while(|&&h| h == '#').count();
                    if chars.get(i + 1 + hashes) == Some(&'"') {
                        state = Lexed::RawStr(hashes);
                        out.push(' ');
                        for _ in 0..=hashes {
                            out.push(' ');
                        }
                        i += hashes + 2;
                        continue;
                    }
                }
                '\'' => {
                    // A char literal ('x', '\n', '\u{..}'), not a lifetime ('a).
                    let end = if next == Some('\\') {
                        chars[i + 2..]
                            .iter()
                            .position(|&q| q == '\'')
                            .map(|p| i + 2 + p)
                    } else if chars.get(i + 2) == Some(&'\'') {
                        Some(i + 2)
                    } else {
                        None
                    };
                    if let Some(end) = end {
                        for _ in i..=end {
                            out.push(' ');
                        }
                        i = end + 1;
                        continue;
                    }
                }
                _ => {}
            },
            Lexed::LineComment if c == '\n' => state = Lexed::Code,
            Lexed::BlockComment if c == '*' && next == Some('/') => {
                out.push_str("  ");
                i += 2;
                state = Lexed::Code;
                continue;
            }
            Lexed::Str if c == '\\' => {
                out.push(' ');
                out.push(next.map_or(' ', blank));
                i += 2;
                continue;
            }
            Lexed::Str if c == '"' => {
                out.push(' ');
                i += 1;
                state = Lexed::Code;
                continue;
            }
            Lexed::RawStr(hashes)
                if c == '"' && chars[i + 1..].iter().take(hashes).all(|&h| h == '#') =>
            {
                for _ in 0..=hashes {
                    out.push(' ');
                }
                i += hashes + 1;
                state = Lexed::Code;
                continue;
            }
            _ => {}
        }
        out.push(if state == Lexed::Code { c } else { blank(c) });
        i += 1;
    }
    out
}

fn prev_ident(chars: &[char], i: usize) -> bool {
    i > 0 && (chars[i - 1].is_alphanumeric() || chars[i - 1] == '_')
}

/// Every function of `text` longer than `max` lines: `(line, name, lines)`, from its `fn` line to
/// its closing brace.
fn long_functions(text: &str, max: usize) -> Vec<(usize, String, usize)> {
    let code = code_only(&without_test_modules(text));
    let bytes = code.as_bytes();
    let line_at = |at: usize| code[..at].matches('\n').count() + 1;
    let mut found = Vec::new();
    let mut from = 0;
    while let Some(at) = code[from..].find("fn ").map(|p| from + p) {
        from = at + 3;
        if at > 0 && (bytes[at - 1].is_ascii_alphanumeric() || bytes[at - 1] == b'_') {
            continue;
        }
        let name: String = code[at + 3..]
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if name.is_empty() {
            continue;
        }
        let Some(open) = code[at..].find(['{', ';']).map(|p| at + p) else {
            continue;
        };
        if bytes[open] == b';' {
            continue;
        }
        let mut depth = 0usize;
        let mut close = None;
        for (p, b) in bytes.iter().enumerate().skip(open) {
            match b {
                b'{' => depth += 1,
                b'}' => {
                    depth -= 1;
                    if depth == 0 {
                        close = Some(p);
                        break;
                    }
                }
                _ => {}
            }
        }
        let Some(close) = close else { continue };
        let lines = line_at(close) - line_at(at) + 1;
        if lines > max {
            found.push((line_at(at), name, lines));
        }
    }
    found
}

#[test]
fn no_function_in_the_server_is_over_120_lines() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../berth-server/src");
    let mut found = Vec::new();
    for file in rust_files(&src) {
        let text = std::fs::read_to_string(&file).expect("read");
        for (line, name, lines) in long_functions(&text, MAX_FN_LINES) {
            found.push(format!("{}:{line} {name}: {lines} lines", file.display()));
        }
    }
    assert!(
        found.is_empty(),
        "functions over {MAX_FN_LINES} lines; split them:\n  {}",
        found.join("\n  ")
    );
}

#[test]
fn a_long_function_is_found_and_literals_do_not_fool_the_count() {
    let body = "    let x = 1;\n".repeat(5);
    let text = format!(
        "fn short() {{\n{body}}}\n\
         fn tricky() {{\n    let s = \"}}\\\n}}\";\n    let c = '}}';\n    let r = r#\"}}\"#;\n\
         // }}\n{body}{body}}}\n\
         fn decl();\n\
         #[cfg(test)]\nmod tests {{\n    fn long_test() {{\n{body}{body}{body}    }}\n}}\n"
    );
    let found = long_functions(&text, 8);
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].1, "tricky");
    assert_eq!(found[0].2, 17, "{found:?}");
}

#[test]
fn no_crate_has_an_import_cycle_of_more_than_three_files() {
    let crates = workspace_crates();
    assert!(
        crates.iter().any(|(name, _)| name == "berth-proto"),
        "the workspace's crates were not found: {crates:?}"
    );
    let mut found = Vec::new();
    for (name, src) in &crates {
        if CYCLES_PENDING.contains(&name.as_str()) {
            continue;
        }
        for cycle in ModuleGraph::read(src).cycles_over(MAX_CYCLE) {
            found.push(format!("{name}: {cycle}"));
        }
    }
    assert!(
        found.is_empty(),
        "import cycles of more than {MAX_CYCLE} files (move the shared item to the module that \
         owns it, or to a small new one):\n  {}",
        found.join("\n  ")
    );
}

#[test]
fn berth_server_keeps_its_layers() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../berth-server/src");
    let found = layer_breaches(&ModuleGraph::read(&src), SERVER_LAYERS);
    assert!(
        found.is_empty(),
        "berth-server calls upward (http and workers call services, services call the store \
         and infra; nothing calls up):\n  {}",
        found.join("\n  ")
    );
}

// ---------------------------------------------------------------------------------------------
// The checks on synthetic trees: each can fail.
// ---------------------------------------------------------------------------------------------

/// A crate `src/` in a temp dir with `files` (path relative to `src/`, text).
fn tree(files: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("a temp dir");
    for (path, text) in files {
        let path = dir.path().join(path);
        std::fs::create_dir_all(path.parent().expect("a parent")).expect("mkdir");
        std::fs::write(path, text).expect("write");
    }
    dir
}

fn module(path: &str) -> ModPath {
    path.split('/').map(str::to_string).collect()
}

#[test]
fn a_cycle_of_four_files_is_found_and_one_of_three_is_allowed() {
    let dir = tree(&[
        (
            "lib.rs",
            "pub mod a; pub mod b; pub mod c; pub mod d; pub mod x; pub mod y; pub mod z;",
        ),
        // a -> b -> c -> d -> a, through a group, a child module path, super:: and a bare path.
        ("a.rs", "use crate::{b::{Thing, other as o}, x};\n"),
        ("b.rs", "fn f() { crate::c::call(); }\n"),
        (
            "c/mod.rs",
            "pub mod inner;\npub fn call() { inner::go(); }\n",
        ),
        ("c/inner.rs", "pub fn go() { super::super::d::D; }\n"),
        (
            "d.rs",
            "pub struct D; fn g() { self::h(); crate::a::f(); }\nfn h() {}\n",
        ),
        // x -> y -> z -> x: three files, allowed.
        ("x.rs", "use crate::y::Y;"),
        ("y.rs", "use crate::z::Z;"),
        ("z.rs", "use crate::x::X;"),
    ]);
    let graph = ModuleGraph::read(dir.path());
    let cycles = graph.cycles_over(MAX_CYCLE);
    assert_eq!(cycles.len(), 1, "{cycles:#?}");
    assert!(
        cycles[0].starts_with("5 files in one import cycle: a, b, c, c/inner, d"),
        "{cycles:#?}"
    );
    assert!(cycles[0].contains("d -> a (crate::a::f)"), "{cycles:#?}");
    let all: Vec<usize> = graph.components().iter().map(Vec::len).collect();
    assert_eq!(
        &all[..2],
        &[5, 3],
        "the three-file cycle is a component too"
    );
}

#[test]
fn test_code_comments_and_the_crate_root_make_no_edge() {
    let dir = tree(&[
        (
            "lib.rs",
            "pub mod a; pub mod b; use crate::a::A; use crate::b::B;",
        ),
        (
            "a.rs",
            "// crate::b::B in a comment\n/// [`crate::b::B`] in a doc\nuse crate::Root;\n\
             #[cfg(test)]\nmod tests { use crate::b::B; }\n",
        ),
        ("b.rs", "use crate::a::A;"),
    ]);
    let graph = ModuleGraph::read(dir.path());
    assert_eq!(graph.edges.get(&module("a")), None, "{:?}", graph.edges);
    assert!(graph.edges[&module("b")].contains_key(&module("a")));
    assert!(graph.cycles_over(1).is_empty());
}

#[test]
fn code_after_a_test_module_still_counts() {
    let dir = tree(&[
        ("lib.rs", "pub mod a; pub mod b;"),
        (
            "a.rs",
            "#[cfg(test)]\nmod a_tests;\n#[cfg(test)]\nmod tests { use crate::x; }\n\
             use crate::b::B;\n",
        ),
        ("b.rs", "use crate::a::A;"),
    ]);
    let graph = ModuleGraph::read(dir.path());
    assert!(
        graph.edges[&module("a")].contains_key(&module("b")),
        "{:?}",
        graph.edges
    );
    assert_eq!(graph.cycles_over(1).len(), 1);
}

#[test]
fn a_breach_of_the_layers_is_named_with_its_path() {
    let dir = tree(&[
        (
            "lib.rs",
            "mod http; mod services; mod workers; mod infra; mod error;",
        ),
        ("http/mod.rs", "pub mod routes;"),
        (
            "http/routes.rs",
            "use crate::services::tasks::create; use crate::error::E;",
        ),
        // Upward: services into http, and infra into services (two layers up, transitively).
        (
            "services/tasks.rs",
            "pub fn create() { crate::http::routes::seal(); }",
        ),
        ("infra/config.rs", "use crate::services::tasks;"),
        // Sideways is not a breach: workers and http are not ordered.
        (
            "workers/drift.rs",
            "use crate::http::routes::seal; use crate::services::tasks;",
        ),
        ("error.rs", "use crate::http::routes::R;"),
    ]);
    let graph = ModuleGraph::read(dir.path());
    let found = layer_breaches(&graph, SERVER_LAYERS);
    assert_eq!(
        found,
        [
            "infra/config.rs -> services/tasks.rs (crate::services::tasks): infra may not import \
             services, which is above it",
            "services/tasks.rs -> http/routes.rs (crate::http::routes::seal): services may not \
             import http, which is above it",
        ],
        "{found:#?}"
    );
}

#[test]
fn a_layer_with_no_file_fails() {
    let dir = tree(&[
        ("lib.rs", ""),
        ("http/routes.rs", ""),
        ("services/tasks.rs", ""),
    ]);
    let found = layer_breaches(&ModuleGraph::read(dir.path()), SERVER_LAYERS);
    assert_eq!(
        found,
        ["layer infra holds no file", "layer workers holds no file"],
        "{found:#?}"
    );
}

#[test]
fn a_clean_layered_tree_passes_both_checks() {
    let dir = tree(&[
        ("lib.rs", "mod http; mod services; mod workers; mod infra;"),
        (
            "http/routes.rs",
            "use crate::services::tasks::create; use crate::infra::clock;",
        ),
        (
            "services/tasks.rs",
            "use crate::infra::{clock::now, config::Config};",
        ),
        ("services/deploy.rs", "use super::tasks::create;"),
        ("workers/drift.rs", "use crate::services::{deploy, tasks};"),
        ("infra/clock.rs", "pub fn now() {}"),
        ("infra/config.rs", "use super::clock::now;"),
    ]);
    let graph = ModuleGraph::read(dir.path());
    assert!(
        graph.cycles_over(1).is_empty(),
        "{:?}",
        graph.cycles_over(1)
    );
    assert_eq!(layer_breaches(&graph, SERVER_LAYERS), Vec::<String>::new());
    assert!(graph.edges[&module("services/deploy")].contains_key(&module("services/tasks")));
}
