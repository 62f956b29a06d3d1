//! No import cycles between the files of one crate.
//!
//! A file depends on another when its code (outside comments, strings and `#[cfg(test)]`
//! modules) names a path into it: `crate::x::..`, `super::..` or `self::..`, in a `use` tree
//! (groups included) or inline. The crate root (`lib.rs`, `main.rs`) is left out: it declares
//! the modules and re-exports their items, so it is the facade every file may use, not a
//! dependency. A cycle means two files can only be understood together; break it by moving the
//! shared items into a file both use, or by moving the code that needs both.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::Path;

use super::{code_only, is_ident, matching, read, root, rust_files};

/// The module path of a source file relative to its crate (`src/a/b.rs` and `src/a/b/mod.rs`
/// are `a::b`; `src/lib.rs`, `src/main.rs` are the root), or `None` for a file outside `src/`.
fn module_of(rel: &str) -> Option<Vec<String>> {
    let rel = rel.strip_prefix("src/")?.strip_suffix(".rs")?;
    let mut parts: Vec<String> = rel.split('/').map(str::to_owned).collect();
    if parts.len() == 1 && (parts[0] == "lib" || parts[0] == "main") {
        return Some(Vec::new());
    }
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    Some(parts)
}

/// `code` with every `#[cfg(test)] mod name { .. }` blanked: tests may use any file.
fn without_test_modules(mut code: Vec<u8>) -> Vec<u8> {
    let marker = b"#[cfg(test)]";
    let mut at = 0;
    while let Some(p) = super::find(&code, marker, at) {
        at = p + marker.len();
        let mut i = at;
        while i < code.len() && code[i].is_ascii_whitespace() {
            i += 1;
        }
        let rest = &code[i..];
        let rest = rest.strip_prefix(b"pub(crate) ").unwrap_or(rest);
        if !rest.starts_with(b"mod ") {
            continue;
        }
        let Some(open) = code[i..].iter().position(|&c| c == b'{' || c == b';') else {
            break;
        };
        if code[i + open] == b';' {
            continue; // `mod tests;` — a file of its own, not in this graph's files anyway
        }
        let end = matching(&code, i + open);
        for c in &mut code[p..end] {
            if *c != b'\n' {
                *c = b' ';
            }
        }
        at = end;
    }
    code
}

fn skip_space(code: &[u8], mut at: usize) -> usize {
    while at < code.len() && code[at].is_ascii_whitespace() {
        at += 1;
    }
    at
}

/// Every path the path or `use` tree starting at `at` names: `a::b::{c, d::{e, self}}` gives
/// `a::b::c`, `a::b::d::e` and `a::b::d`.
fn paths_at(code: &[u8], at: usize) -> Vec<Vec<String>> {
    let mut prefix = Vec::new();
    let mut at = skip_space(code, at);
    loop {
        if code.get(at) == Some(&b'{') {
            let end = matching(code, at) - 1;
            let mut out = Vec::new();
            let mut piece = at + 1;
            let mut depth = 0usize;
            for i in at + 1..=end {
                match code[i] {
                    b'{' => depth += 1,
                    b'}' if depth > 0 => depth -= 1,
                    b',' | b'}' if depth == 0 => {
                        for tail in paths_at(code, piece) {
                            let mut path = prefix.clone();
                            path.extend(tail);
                            out.push(path);
                        }
                        piece = i + 1;
                    }
                    _ => {}
                }
            }
            return out;
        }
        let end = code[at..]
            .iter()
            .position(|&c| !is_ident(c))
            .map_or(code.len(), |n| at + n);
        if end == at {
            return vec![prefix];
        }
        let ident = String::from_utf8_lossy(&code[at..end]).into_owned();
        if ident != "self" {
            prefix.push(ident);
        }
        let next = skip_space(code, end);
        if code[next..].starts_with(b"::") {
            at = skip_space(code, next + 2);
        } else {
            return vec![prefix];
        }
    }
}

/// One dependency: the file that has it, its line, and the file it points into.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Edge {
    from: String,
    line: usize,
    to: String,
}

/// The file-to-file dependencies of one crate, from `(path relative to the crate, source)`.
fn edges(files: &[(String, String)]) -> Vec<Edge> {
    let modules: BTreeMap<Vec<String>, &str> = files
        .iter()
        .filter_map(|(rel, _)| Some((module_of(rel)?, rel.as_str())))
        .collect();
    let mut out = BTreeSet::new();
    for (rel, src) in files {
        let Some(me) = module_of(rel) else { continue };
        if me.is_empty() {
            continue;
        }
        let code = without_test_modules(code_only(src));
        for (start, base) in [
            (&b"crate::"[..], Vec::new()),
            (b"super::", me[..me.len() - 1].to_vec()),
            (b"self::", me.clone()),
        ] {
            let mut at = 0;
            while let Some(p) = super::find(&code, start, at) {
                at = p + start.len();
                if p > 0 && is_ident(code[p - 1]) {
                    continue;
                }
                // `super::super::x` is read once, from its first `super`.
                if p >= 2 && &code[p - 2..p] == b"::" {
                    continue;
                }
                let line = code[..p].iter().filter(|&&c| c == b'\n').count() + 1;
                for tail in paths_at(&code, at) {
                    let mut path = base.clone();
                    for seg in tail {
                        if seg == "super" {
                            path.pop();
                        } else {
                            path.push(seg);
                        }
                    }
                    // The longest prefix of the path that is a file of this crate.
                    let target = (0..=path.len())
                        .rev()
                        .find_map(|n| modules.get(&path[..n]).map(|f| (n, *f)));
                    if let Some((n, to)) = target {
                        if n > 0 && to != rel {
                            out.insert(Edge {
                                from: rel.clone(),
                                line,
                                to: to.to_owned(),
                            });
                        }
                    }
                }
            }
        }
    }
    out.into_iter().collect()
}

/// Every import cycle of one crate: each strongly connected set of files, described by one
/// cycle through its first file, edge by edge (`a.rs:3 -> b.rs`).
/// The files of modules declared `#[cfg(test)] mod name;` (the module's file and everything
/// under its directory): test code, which may use any file, like an inline test module.
fn test_only_files(files: &[(String, String)]) -> BTreeSet<String> {
    let mut dirs = Vec::new();
    for (rel, src) in files {
        let code = code_only(src);
        let marker = b"#[cfg(test)]";
        let mut at = 0;
        while let Some(p) = super::find(&code, marker, at) {
            at = p + marker.len();
            let rest = String::from_utf8_lossy(&code[at..]);
            let rest = rest.trim_start();
            let rest = rest.strip_prefix("pub(crate) ").unwrap_or(rest);
            let Some(decl) = rest.strip_prefix("mod ") else {
                continue;
            };
            let Some((name, _)) = decl
                .split_once(';')
                .filter(|(n, _)| !n.is_empty() && n.trim().bytes().all(is_ident))
            else {
                continue;
            };
            // `src/lib.rs`, `src/a/mod.rs`: children beside it; `src/a.rs`: in `src/a/`.
            let parent = match rel.rsplit_once('/') {
                Some((dir, "lib.rs" | "main.rs" | "mod.rs")) => dir.to_owned(),
                _ => rel.trim_end_matches(".rs").to_owned(),
            };
            dirs.push(format!("{parent}/{}", name.trim()));
        }
    }
    files
        .iter()
        .map(|(rel, _)| rel)
        .filter(|rel| {
            dirs.iter()
                .any(|d| *rel == &format!("{d}.rs") || rel.starts_with(&format!("{d}/")))
        })
        .cloned()
        .collect()
}

fn cycles(files: &[(String, String)]) -> Vec<(BTreeSet<String>, String)> {
    let tests = test_only_files(files);
    let files: Vec<(String, String)> = files
        .iter()
        .filter(|(rel, _)| !tests.contains(rel))
        .cloned()
        .collect();
    let files = files.as_slice();
    let edges = edges(files);
    let mut next: BTreeMap<&str, Vec<&Edge>> = BTreeMap::new();
    for e in &edges {
        next.entry(e.from.as_str()).or_default().push(e);
    }
    let reaches = |from: &str| {
        let mut seen = BTreeSet::from([from.to_owned()]);
        let mut queue = VecDeque::from([from.to_owned()]);
        while let Some(f) = queue.pop_front() {
            for e in next.get(f.as_str()).into_iter().flatten() {
                if seen.insert(e.to.clone()) {
                    queue.push_back(e.to.clone());
                }
            }
        }
        seen
    };
    let reach: BTreeMap<&str, BTreeSet<String>> = files
        .iter()
        .map(|(f, _)| (f.as_str(), reaches(f)))
        .collect();
    let mut done = BTreeSet::new();
    let mut out = Vec::new();
    for (f, _) in files {
        if done.contains(f) {
            continue;
        }
        let scc: BTreeSet<String> = reach[f.as_str()]
            .iter()
            .filter(|g| reach[g.as_str()].contains(f))
            .cloned()
            .collect();
        done.extend(scc.iter().cloned());
        if scc.len() < 2 {
            continue;
        }
        // Shortest way round from the first file, breadth first inside the set.
        let first = scc.iter().next().unwrap().as_str();
        let mut via: BTreeMap<&str, &Edge> = BTreeMap::new();
        let mut queue = VecDeque::from([first]);
        let mut closing = None;
        'search: while let Some(g) = queue.pop_front() {
            for e in next.get(g).into_iter().flatten() {
                if !scc.contains(&e.to) {
                    continue;
                }
                if e.to == first {
                    closing = Some(*e);
                    break 'search;
                }
                if !via.contains_key(e.to.as_str()) {
                    via.insert(&e.to, e);
                    queue.push_back(&e.to);
                }
            }
        }
        let mut path = vec![closing.unwrap()];
        while path.last().unwrap().from != first {
            path.push(via[path.last().unwrap().from.as_str()]);
        }
        path.reverse();
        let mut text: Vec<String> = path
            .iter()
            .map(|e| format!("{}:{} -> ", e.from, e.line))
            .collect();
        text.push(first.to_owned());
        out.push((scc, text.concat()));
    }
    out
}

/// Every member of the workspace (the root manifest's `members`), with its directory relative to
/// the repository root.
fn workspace_crates() -> Vec<(String, std::path::PathBuf)> {
    let manifest = read(&root().join("Cargo.toml"));
    let list = manifest
        .split("members = [")
        .nth(1)
        .and_then(|rest| rest.split(']').next())
        .expect("the root Cargo.toml lists the workspace members");
    let mut out: Vec<_> = list
        .split(',')
        .map(|m| m.trim().trim_matches('"'))
        .filter(|m| !m.is_empty())
        .map(|m| (m.to_owned(), root().join(m)))
        .collect();
    out.sort();
    assert!(
        out.iter().any(|(m, _)| m == "crates/handshake"),
        "workspace members not found in the root Cargo.toml: {out:?}"
    );
    out
}

/// The files under a crate's `src/` with their sources. A member without `src/` (the `tests`
/// crate: one `lib.rs`, the tests are their own targets) has no file to import.
fn sources(dir: &Path) -> Vec<(String, String)> {
    let mut paths = Vec::new();
    if dir.join("src").is_dir() {
        rust_files(&dir.join("src"), &mut paths);
    }
    paths.sort();
    paths
        .iter()
        .map(|p| {
            let rel = p.strip_prefix(dir).unwrap().display().to_string();
            (rel.replace('\\', "/"), read(p))
        })
        .collect()
}

#[test]
fn no_import_cycles_between_the_files_of_a_crate() {
    let mut report = Vec::new();
    for (krate, dir) in workspace_crates() {
        for (files, path) in cycles(&sources(&dir)) {
            let files: Vec<&str> = files.iter().map(String::as_str).collect();
            report.push(format!(
                "{krate}: files {} import each other: {path}",
                files.join(", ")
            ));
        }
    }
    assert!(
        report.is_empty(),
        "import cycles between files of one crate (move what both need into a file both use):\n{}",
        report.join("\n")
    );
}

#[test]
fn the_import_cycle_rule_finds_cycles_through_every_kind_of_path() {
    let file = |rel: &str, src: &str| (rel.to_owned(), src.to_owned());
    let fixture = [
        file(
            "src/lib.rs",
            "mod a; mod b; mod c; pub use a::A; use crate::b::B;",
        ),
        // `a` uses `b` through a group, `b` uses `c` inline, `c` uses `a` through `super`.
        file(
            "src/a.rs",
            "use crate::{\n    b::{self, B},\n    Reexported,\n};\npub struct A;",
        ),
        file("src/b.rs", "pub struct B(crate::c::C);"),
        file(
            "src/c/mod.rs",
            "mod d;\npub struct C;\nfn f() { super::a::A; }",
        ),
        // `d` uses its parent: no cycle, `c` does not use `d` by a path.
        file("src/c/d.rs", "use super::C;"),
        // Comments, strings and test modules do not count.
        file(
            "src/e.rs",
            "// crate::a::A\nconst S: &str = \"crate::a\";\n#[cfg(test)]\nmod tests { use crate::a::A; }\nuse crate::f::F;",
        ),
        file(
            "src/f.rs",
            "#[cfg(test)]\nmod tests { use crate::e::E; }\npub struct F;",
        ),
    ];
    let found = cycles(&fixture);
    assert_eq!(found.len(), 1, "{found:?}");
    let (files, path) = &found[0];
    assert_eq!(
        files.iter().map(String::as_str).collect::<Vec<_>>(),
        ["src/a.rs", "src/b.rs", "src/c/mod.rs"]
    );
    assert_eq!(
        path,
        "src/a.rs:1 -> src/b.rs:1 -> src/c/mod.rs:3 -> src/a.rs"
    );
    // Files of a `#[cfg(test)] mod name;` (and below it) are test code: their cycles do not
    // count.
    let mut with_sim = fixture.to_vec();
    with_sim.push(file("src/g.rs", "#[cfg(test)]\nmod sim;\npub struct G;"));
    with_sim.push(file(
        "src/g/sim/mod.rs",
        "mod world;\nuse self::world::W;\npub struct S;",
    ));
    with_sim.push(file("src/g/sim/world.rs", "use super::S;\npub struct W;"));
    assert_eq!(test_only_files(&with_sim).len(), 2);
    assert_eq!(cycles(&with_sim).len(), 1, "only the a-b-c cycle");
    with_sim[7] = file("src/g.rs", "mod sim;\npub struct G;");
    assert_eq!(
        cycles(&with_sim).len(),
        2,
        "without cfg(test) the sim's cycle counts"
    );
    // Breaking one edge breaks the cycle.
    let mut fixed = fixture.clone();
    fixed[3] = file("src/c/mod.rs", "pub struct C;");
    assert!(cycles(&fixed).is_empty());
    // `super::super::` climbs twice.
    let nested = [
        file("src/lib.rs", "mod x; mod y;"),
        file("src/x/mod.rs", "mod z; use self::z::Z;"),
        file(
            "src/x/z.rs",
            "pub struct Z; fn f() { super::super::y::g(); }",
        ),
        file("src/y.rs", "pub fn g() { crate::x::h(); }"),
    ];
    let found = cycles(&nested);
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(
        found[0].1,
        "src/x/mod.rs:1 -> src/x/z.rs:1 -> src/y.rs:1 -> src/x/mod.rs"
    );
}
