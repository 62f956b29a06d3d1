//! Repository rules checked as tests (run by `cargo test -p xtask`, and so by `cargo xtask ci`).

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

mod import_cycles;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn read(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

/// The crates under `crates/`: (directory, package name).
fn crates() -> Vec<(PathBuf, String)> {
    let mut out: Vec<(PathBuf, String)> = fs::read_dir(root().join("crates"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("Cargo.toml").exists())
        .map(|dir| {
            let manifest = read(&dir.join("Cargo.toml"));
            let name = manifest
                .lines()
                .find_map(|l| l.strip_prefix("name = \""))
                .and_then(|l| l.strip_suffix('"'))
                .unwrap_or_else(|| panic!("{}: no package name", dir.display()))
                .to_owned();
            (dir, name)
        })
        .collect();
    out.sort();
    out
}

/// Names of the normal (not dev, not build) dependencies of a manifest.
fn normal_dependencies(manifest: &str) -> BTreeSet<String> {
    section_keys(manifest, "[dependencies]")
}

/// The keys of one `[section]` of a manifest (`name = ...` or `name.workspace = ...` lines).
fn section_keys(manifest: &str, section: &str) -> BTreeSet<String> {
    let mut inside = false;
    let mut keys = BTreeSet::new();
    for line in manifest.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            inside = line == section;
            continue;
        }
        if inside && !line.is_empty() && !line.starts_with('#') {
            let key = line.split(['=', '.', ' ']).next().unwrap().trim();
            keys.insert(key.to_owned());
        }
    }
    keys
}

/// The lines of one `[section]` of a manifest, comments and blank lines left out.
fn section_lines<'a>(manifest: &'a str, section: &str) -> Vec<&'a str> {
    let mut inside = false;
    let mut out = Vec::new();
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            inside = line == section;
        } else if inside && !line.is_empty() && !line.starts_with('#') {
            out.push(line);
        }
    }
    out
}

#[test]
fn no_library_links_a_testing_module() {
    // The lab (demo, bench) and test support may; a product crate never does.
    const MAY: [&str; 4] = [
        "kvbridge-lab",
        "kvbridge-netns",
        "kvbridge-conformance",
        "kvbridge-testkit",
    ];
    for (dir, name) in crates() {
        if name == "kvbridge-lab" || name == "kvbridge-testkit" {
            assert!(
                read(&dir.join("Cargo.toml")).contains("\npublish = false\n"),
                "{name} must say `publish = false`: it is never published"
            );
        }
        if MAY.contains(&name.as_str()) {
            continue;
        }
        let manifest = read(&dir.join("Cargo.toml"));
        for line in section_lines(&manifest, "[dependencies]") {
            assert!(
                !line.contains("\"testing\"")
                    && !line.starts_with("kvbridge-conformance")
                    && !line.starts_with("kvbridge-testkit")
                    && !line.starts_with("kvbridge-lab"),
                "{name}'s normal dependency `{line}` links a testing module, the test kit or the \
                 lab; make it a dev-dependency (only the lab may)"
            );
        }
    }
}

/// The `[features]` of a manifest, but `default`.
fn features(manifest: &str) -> BTreeSet<String> {
    let mut names = section_keys(manifest, "[features]");
    names.remove("default");
    names
}

#[test]
fn the_feature_list_without_nixl_names_every_other_feature() {
    let listed: BTreeSet<String> = crate::FEATURES_WITHOUT_NIXL
        .split(',')
        .map(str::to_owned)
        .collect();
    let mut all = BTreeSet::new();
    for (dir, name) in crates() {
        for feature in features(&read(&dir.join("Cargo.toml"))) {
            if feature != "nixl" {
                all.insert(format!("{name}/{feature}"));
            }
        }
    }
    assert_eq!(
        listed, all,
        "xtask's FEATURES_WITHOUT_NIXL must list every feature but `nixl` (package/feature)"
    );
}

#[test]
fn every_crate_has_a_codemap_section() {
    let arch = read(&root().join("docs/ARCHITECTURE.md"));
    for (_, name) in crates() {
        assert!(
            arch.contains(&format!("### {name}")),
            "docs/ARCHITECTURE.md has no `### {name}` section; add one to the code map"
        );
    }
}

/// Every library crate: what the facade re-exports and the Python package builds on.
const LIBRARY_CRATES: &[&str] = &[
    "kvbridge-auth",
    "kvbridge-sync",
    "kvbridge-memory",
    "kvbridge-control",
    "kvbridge-geometry",
    "kvbridge-handshake",
    "kvbridge-transport",
    "kvbridge-mock",
    "kvbridge-shm",
    "kvbridge-tcp",
    "kvbridge-bootstrap",
    "kvbridge-machines",
    "kvbridge-coordinator",
];

/// What the Python package builds on: every library crate, NIXL behind its `nixl` feature, and
/// the OTLP export its agents' spans leave by.
const PYTHON_CRATES: &[&str] = &[
    "kvbridge-auth",
    "kvbridge-sync",
    "kvbridge-memory",
    "kvbridge-control",
    "kvbridge-geometry",
    "kvbridge-handshake",
    "kvbridge-transport",
    "kvbridge-mock",
    "kvbridge-shm",
    "kvbridge-tcp",
    "kvbridge-bootstrap",
    "kvbridge-machines",
    "kvbridge-coordinator",
    "kvbridge-nixl",
    "kvbridge-otlp",
];

#[test]
fn crates_depend_only_on_what_the_codemap_allows() {
    // (package, kvbridge crates it may use, whether tokio is allowed) — the table in
    // docs/ARCHITECTURE.md.
    let rules: &[(&str, &[&str], bool)] = &[
        ("kvbridge-auth", &[], false),
        ("kvbridge-geometry", &[], false),
        ("kvbridge-handshake", &["kvbridge-geometry"], false),
        ("kvbridge-sync", &[], false),
        ("kvbridge-memory", &[], false),
        (
            "kvbridge-transport",
            &["kvbridge-memory", "kvbridge-sync"],
            false,
        ),
        // Test support: only dev-dependencies (and the lab's bench) link it.
        (
            "kvbridge-conformance",
            &["kvbridge-memory", "kvbridge-transport"],
            false,
        ),
        ("kvbridge-mock", &["kvbridge-transport"], true),
        (
            "kvbridge-shm",
            &["kvbridge-transport", "kvbridge-auth"],
            true,
        ),
        (
            "kvbridge-tcp",
            &["kvbridge-transport", "kvbridge-auth"],
            true,
        ),
        ("kvbridge-nixl", &["kvbridge-transport"], true),
        // The registry never depends on the agents: they depend on it.
        (
            "kvbridge-bootstrap",
            &[
                "kvbridge-auth",
                "kvbridge-control",
                "kvbridge-geometry",
                "kvbridge-handshake",
                "kvbridge-sync",
            ],
            true,
        ),
        (
            "kvbridge-control",
            &["kvbridge-auth", "kvbridge-handshake", "kvbridge-sync"],
            true,
        ),
        // The sans-IO machines: the control crate's messages (without its channel), no runtime.
        (
            "kvbridge-machines",
            &[
                "kvbridge-control",
                "kvbridge-geometry",
                "kvbridge-handshake",
                "kvbridge-transport",
            ],
            false,
        ),
        (
            "kvbridge-coordinator",
            &[
                "kvbridge-auth",
                "kvbridge-bootstrap",
                "kvbridge-control",
                "kvbridge-geometry",
                "kvbridge-handshake",
                "kvbridge-machines",
                "kvbridge-transport",
            ],
            true,
        ),
        ("kvbridge", LIBRARY_CRATES, false),
        ("kvbridge-python", PYTHON_CRATES, true),
        // The command line for people: plan, check, explain.
        (
            "kvbridge-cli",
            &["kvbridge-geometry", "kvbridge-handshake"],
            false,
        ),
        // Test support: it drives the `kvbridge-lab` binary, it links no kvbridge crate.
        ("kvbridge-netns", &[], false),
        // Span export for the lab and the Python package: OpenTelemetry only, and tokio for
        // the gRPC exporter's runtime.
        ("kvbridge-otlp", &[], true),
        // Test support below the coordinator: fill and verify need descriptors and regions only.
        (
            "kvbridge-testkit",
            &[
                "kvbridge-geometry",
                "kvbridge-handshake",
                "kvbridge-transport",
            ],
            false,
        ),
    ];
    for (dir, name) in crates() {
        let deps = normal_dependencies(&read(&dir.join("Cargo.toml")));
        let Some((_, allowed, tokio)) = rules.iter().find(|(n, ..)| *n == name) else {
            assert_eq!(
                name, "kvbridge-lab",
                "{name} has no dependency rule; add it here and to the code map"
            );
            continue;
        };
        for dep in deps.iter().filter(|d| d.starts_with("kvbridge-")) {
            assert!(
                allowed.contains(&dep.as_str()),
                "{name} depends on {dep}, which the code map does not allow"
            );
        }
        assert!(
            *tokio || !deps.contains("tokio"),
            "{name} must stay free of an async runtime, but depends on tokio"
        );
    }
}

/// The workspace's packages (every member of the root manifest, `tests/` and `xtask/`
/// included): package name -> manifest text.
fn workspace_manifests() -> BTreeMap<String, String> {
    let root_manifest = read(&root().join("Cargo.toml"));
    let start = root_manifest
        .find("members = [")
        .expect("the workspace lists its members");
    let list = &root_manifest[start..start + root_manifest[start..].find(']').unwrap()];
    list.split('"')
        .skip(1)
        .step_by(2)
        .map(|member| {
            let manifest = read(&root().join(member).join("Cargo.toml"));
            let name = manifest
                .lines()
                .find_map(|l| l.strip_prefix("name = \""))
                .and_then(|l| l.strip_suffix('"'))
                .unwrap_or_else(|| panic!("{member}: no package name"))
                .to_owned();
            (name, manifest)
        })
        .collect()
}

/// Every dependency a manifest names, with its section: normal, dev and build dependencies,
/// target-specific ones, `[dependencies.name]` tables and renamed packages alike.
fn dependency_names(manifest: &str) -> BTreeSet<(String, String)> {
    let mut out = BTreeSet::new();
    let mut section = String::new();
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            section = line.trim_matches(['[', ']']).to_owned();
            // `[dev-dependencies.kvbridge-lab]`
            if let Some((kind, name)) = section.rsplit_once("dependencies.") {
                out.insert((format!("{kind}dependencies"), name.to_owned()));
            }
            continue;
        }
        if !section.ends_with("dependencies") || line.is_empty() || line.starts_with('#') {
            continue;
        }
        let key = line.split(['=', '.', ' ']).next().unwrap().trim();
        // `lab = { package = "kvbridge-lab", .. }`
        let package = line
            .split("package = \"")
            .nth(1)
            .and_then(|rest| rest.split('"').next());
        out.insert((section.clone(), package.unwrap_or(key).to_owned()));
    }
    out
}

/// The arrows that run up to `top`: a package `top` depends on (through normal and build
/// dependencies, transitively) that itself names `top` in any dependency section, dev
/// included. Each as `package: section`.
fn upward_arrows(manifests: &BTreeMap<String, String>, top: &str) -> Vec<String> {
    let below = |name: &str| -> Vec<String> {
        dependency_names(&manifests[name])
            .into_iter()
            .filter(|(section, dep)| {
                !section.contains("dev-dependencies") && manifests.contains_key(dep.as_str())
            })
            .map(|(_, dep)| dep)
            .collect()
    };
    let mut reached = BTreeSet::new();
    let mut queue = below(top);
    while let Some(name) = queue.pop() {
        if reached.insert(name.clone()) {
            queue.extend(below(&name));
        }
    }
    let mut out = Vec::new();
    for name in reached.iter().filter(|n| n.as_str() != top) {
        for (section, dep) in dependency_names(&manifests[name.as_str()]) {
            if dep == top {
                out.push(format!("{name}: [{section}]"));
            }
        }
    }
    out
}

#[test]
fn nothing_the_lab_depends_on_depends_on_the_lab() {
    // The lab stands above every library crate: what it builds on tests itself with the test
    // kit and the conformance crate, below it, never with the lab (not even as a
    // dev-dependency). `tests/` and the lab's own test support are above or beside it.
    let arrows = upward_arrows(&workspace_manifests(), "kvbridge-lab");
    assert!(
        arrows.is_empty(),
        "these crates are below the lab but depend on it; use kvbridge-testkit (fill and \
         verify) or move the code that needs the lab into the lab:\n{}",
        arrows.join("\n")
    );
}

#[test]
fn the_upward_arrow_rule_catches_a_dev_dependency_on_the_lab() {
    let manifests = |coordinator_dev: &str| -> BTreeMap<String, String> {
        [
            (
                "lab",
                "[package]\nname = \"lab\"\n\n[dependencies]\ncoordinator.workspace = true\n\
                 testkit.workspace = true\n\n[dev-dependencies]\nnetns.workspace = true\n",
            ),
            (
                "coordinator",
                &format!(
                    "[package]\nname = \"coordinator\"\n\n[dependencies]\n\
                     machines = {{ workspace = true }}\n\n{coordinator_dev}"
                ),
            ),
            ("machines", "[package]\nname = \"machines\"\n"),
            ("testkit", "[package]\nname = \"testkit\"\n"),
            // Above the lab: may use it.
            (
                "tests",
                "[package]\nname = \"tests\"\n\n[dev-dependencies]\nlab.workspace = true\n",
            ),
            // Beside it (the lab's dev-dependency): not what the lab builds on.
            (
                "netns",
                "[package]\nname = \"netns\"\n\n[dev-dependencies]\nlab.workspace = true\n",
            ),
        ]
        .into_iter()
        .map(|(n, m)| (n.to_owned(), m.to_owned()))
        .collect()
    };
    let fine = manifests("[dev-dependencies]\ntestkit.workspace = true\n");
    assert_eq!(upward_arrows(&fine, "lab"), Vec::<String>::new());
    for (dev, section) in [
        (
            "[dev-dependencies]\nlab.workspace = true\n",
            "dev-dependencies",
        ),
        (
            "[dev-dependencies.lab]\nworkspace = true\n",
            "dev-dependencies",
        ),
        (
            "[target.'cfg(unix)'.dev-dependencies]\nfill = { package = \"lab\", path = \"../lab\" }\n",
            "target.'cfg(unix)'.dev-dependencies",
        ),
    ] {
        assert_eq!(
            upward_arrows(&manifests(dev), "lab"),
            [format!("coordinator: [{section}]")],
            "{dev}"
        );
    }
    // Transitively: machines is below the lab through the coordinator.
    let mut deep = fine.clone();
    deep.insert(
        "machines".to_owned(),
        "[package]\nname = \"machines\"\n\n[dev-dependencies]\nlab.workspace = true\n".to_owned(),
    );
    assert_eq!(
        upward_arrows(&deep, "lab"),
        ["machines: [dev-dependencies]"]
    );
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            if path.file_name().is_some_and(|n| n != "target") {
                rust_files(&path, out);
            }
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The files that may hold `unsafe` code (docs/ARCHITECTURE.md, "Cross-cutting", names each).
const UNSAFE_FILES: [&str; 5] = [
    "crates/memory/src/lib.rs",
    "crates/shm/src/map.rs",
    // Python memory (numpy buffers, caller pointers) wrapped as foreign regions.
    "crates/python/src/memory.rs",
    // The NIXL C API and the memory handed to it.
    "crates/nixl/src/ffi.rs",
    // The calls into kvbridge-nixl's C++ stride shim (NIXL stride descriptors).
    "crates/nixl/src/stride.rs",
];

/// The text of `docs/ARCHITECTURE.md` under the heading `heading`, up to the next heading of
/// the same or a higher level.
fn architecture_section(heading: &str) -> String {
    let doc = read(&root().join("docs/ARCHITECTURE.md"));
    let level = heading.chars().take_while(|&c| c == '#').count();
    let start = doc
        .find(&format!("\n{heading}\n"))
        .unwrap_or_else(|| panic!("docs/ARCHITECTURE.md has no `{heading}` section"));
    let body = &doc[start + heading.len() + 2..];
    let end = body
        .match_indices("\n#")
        .find(|(at, _)| body[at + 1..].chars().take_while(|&c| c == '#').count() <= level)
        .map_or(body.len(), |(at, _)| at);
    body[..end].to_owned()
}

#[test]
fn the_architecture_names_every_file_with_unsafe_code() {
    let section = architecture_section("## Cross-cutting");
    for file in UNSAFE_FILES {
        assert!(
            section.contains(&format!("`{file}`")),
            "docs/ARCHITECTURE.md's Cross-cutting section must name `{file}` where it lists the \
             files that hold unsafe code"
        );
    }
}

#[test]
fn the_architecture_lists_every_module_of_the_facade() {
    let facade = read(&root().join("crates/kvbridge/src/lib.rs"));
    let section = architecture_section("### kvbridge");
    let modules: Vec<&str> = facade
        .lines()
        .filter_map(|l| l.trim().strip_prefix("pub use kvbridge_"))
        .filter_map(|l| l.split(" as ").nth(1))
        .map(|m| m.trim_end_matches(';'))
        .collect();
    assert!(modules.len() >= 10, "facade modules found: {modules:?}");
    for module in modules {
        assert!(
            section.contains(&format!("`::{module}`"))
                || section.contains(&format!("`kvbridge::{module}`")),
            "docs/ARCHITECTURE.md's kvbridge section must list the facade module `{module}` in \
             its API Boundary"
        );
    }
}

#[test]
fn unsafe_code_lives_only_in_the_memory_and_ffi_modules() {
    let allowed = UNSAFE_FILES.map(|f| root().join(f));
    let mut files = Vec::new();
    for dir in ["crates", "examples", "tests", "xtask"] {
        rust_files(&root().join(dir), &mut files);
    }
    let this_file = root().join("xtask/src/tidy.rs");
    let markers = ["unsafe {", "unsafe fn", "unsafe impl", "allow(unsafe_code)"];
    for file in files
        .iter()
        .filter(|f| !allowed.contains(f) && **f != this_file)
    {
        let text = read(file);
        for marker in markers {
            assert!(
                !text.contains(marker),
                "{} contains `{marker}`; unsafe code belongs in the registered-memory module, the shm mapping layer, the Python memory wrapper (crates/python/src/memory.rs), the NIXL loader (crates/nixl/src/ffi.rs) or the NIXL stride shim's calls (crates/nixl/src/stride.rs)",
                file.display()
            );
        }
    }
}

#[test]
fn readme_has_two_setup_commands_and_ci_runs_the_test_one() {
    let readme = read(&root().join("README.md"));
    let setup = readme
        .split("## Set-up")
        .nth(1)
        .and_then(|s| s.split("\n## ").next())
        .expect("README.md has a `## Set-up` section");
    let commands: Vec<&str> = setup
        .split("```sh\n")
        .skip(1)
        .map(|block| block.split("```").next().unwrap().trim())
        .collect();
    assert_eq!(
        commands.len(),
        2,
        "the set-up is exactly two commands, found {commands:?}"
    );
    assert_eq!(
        commands[1], "bash .ci/run",
        "the second set-up command runs the tests"
    );
    let ci = read(&root().join(".ci/run"));
    assert!(
        ci.lines().any(|l| l.trim() == "cargo xtask ci"),
        ".ci/run must run `cargo xtask ci`"
    );
}

// ---------------------------------------------------------------------------------------------
// No re-entrant locking: a std mutex guard never escapes into calls that take the same lock.

/// `src` with the contents of comments, string and char literals blanked (offsets kept), so
/// braces and names inside them do not count.
fn code_only(src: &str) -> Vec<u8> {
    let b = src.as_bytes();
    let mut out = b.to_vec();
    let mut i = 0;
    let blank = |out: &mut Vec<u8>, from: usize, to: usize| {
        for c in &mut out[from..to] {
            if *c != b'\n' {
                *c = b' ';
            }
        }
    };
    while i < b.len() {
        match b[i] {
            b'/' if b.get(i + 1) == Some(&b'/') => {
                let end = b[i..]
                    .iter()
                    .position(|&c| c == b'\n')
                    .map_or(b.len(), |p| i + p);
                blank(&mut out, i, end);
                i = end;
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                let end = src[i + 2..].find("*/").map_or(b.len(), |p| i + 2 + p + 2);
                blank(&mut out, i, end);
                i = end;
            }
            b'r' if (b.get(i + 1) == Some(&b'"') || b.get(i + 1) == Some(&b'#'))
                && (i == 0 || !is_ident(b[i - 1])) =>
            {
                let hashes = b[i + 1..].iter().take_while(|&&c| c == b'#').count();
                if b.get(i + 1 + hashes) != Some(&b'"') {
                    i += 1;
                    continue;
                }
                let close = format!("\"{}", "#".repeat(hashes));
                let start = i + 2 + hashes;
                let end = src[start..].find(&close).map_or(b.len(), |p| start + p);
                blank(&mut out, start, end);
                i = end + close.len();
            }
            b'"' => {
                let mut j = i + 1;
                while j < b.len() && b[j] != b'"' {
                    j += if b[j] == b'\\' { 2 } else { 1 };
                }
                blank(&mut out, i + 1, j.min(b.len()));
                i = j + 1;
            }
            // A char literal ('x', '\n', '{'), not a lifetime ('a).
            b'\'' => {
                let j = if b.get(i + 1) == Some(&b'\\') {
                    b[i + 2..]
                        .iter()
                        .position(|&c| c == b'\'')
                        .map(|p| i + 2 + p)
                } else if b.get(i + 2) == Some(&b'\'') {
                    Some(i + 2)
                } else {
                    None
                };
                match j {
                    Some(j) => {
                        blank(&mut out, i + 1, j);
                        i = j + 1;
                    }
                    None => i += 1,
                }
            }
            _ => i += 1,
        }
    }
    out
}

fn is_ident(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

/// The offset just past the bracket matching the one at `open`.
fn matching(code: &[u8], open: usize) -> usize {
    let mut depth = 0usize;
    for (i, &c) in code.iter().enumerate().skip(open) {
        match c {
            b'(' | b'[' | b'{' => depth += 1,
            b')' | b']' | b'}' => {
                depth -= 1;
                if depth == 0 {
                    return i + 1;
                }
            }
            _ => {}
        }
    }
    code.len()
}

/// Every `fn` with a body: (name, body range).
fn functions(code: &[u8]) -> Vec<(String, std::ops::Range<usize>)> {
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(p) = find(code, b"fn ", i) {
        i = p + 3;
        if p > 0 && is_ident(code[p - 1]) {
            continue;
        }
        let name_end = code[i..]
            .iter()
            .position(|&c| !is_ident(c))
            .map_or(code.len(), |n| i + n);
        let name = String::from_utf8_lossy(&code[i..name_end]).into_owned();
        // The body starts at the first `{` outside brackets; a `;` first means no body.
        let mut j = name_end;
        let mut depth = 0i32;
        while j < code.len() {
            match code[j] {
                b'(' | b'[' | b'<' => depth += 1,
                b')' | b']' => depth -= 1,
                b'>' if code[j - 1] != b'-' => depth -= 1,
                b'{' if depth <= 0 => break,
                b';' if depth <= 0 => break,
                _ => {}
            }
            j += 1;
        }
        if j < code.len() && code[j] == b'{' && !name.is_empty() {
            out.push((name, j..matching(code, j)));
        }
    }
    out
}

fn find(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    hay.get(from..)?
        .windows(needle.len())
        .position(|w| w == needle)
        .map(|p| from + p)
}

/// Offsets of calls to `name` (`name(`, not part of a longer identifier) within `range`,
/// each with its receiver's root (`self` in `self.inner.name(`; empty for a bare call).
fn calls<'a>(
    code: &'a [u8],
    name: &str,
    range: std::ops::Range<usize>,
) -> impl Iterator<Item = (usize, String)> + 'a {
    let n = name.len();
    let name = name.as_bytes().to_vec();
    range.clone().filter_map(move |i| {
        if i + n > range.end || code[i..i + n] != name[..] {
            return None;
        }
        if i > 0 && is_ident(code[i - 1]) {
            return None;
        }
        let mut k = i + n;
        while k < code.len() && code[k] == b' ' {
            k += 1;
        }
        if code.get(k) != Some(&b'(') {
            return None;
        }
        // A definition is not a call.
        if i >= 3 && &code[i - 3..i] == b"fn " {
            return None;
        }
        // Walk back over `recv.field.` to the receiver's root.
        let mut s = i;
        while s > 0 && (code[s - 1] == b'.' || is_ident(code[s - 1]) || code[s - 1] == b':') {
            s -= 1;
        }
        let chain = String::from_utf8_lossy(&code[s..i]).into_owned();
        Some((i, chain))
    })
}

/// Whether a call (its receiver chain, e.g. `self.` or `c.machine.`) is on the file's own
/// object or a bare function: `self.f()`, `self.inner.f()`, `inner.f()`, `me.f()`,
/// `Self::f()`, `f()`. A method of a field (`self.metrics.f()`) or of another value, or a chain
/// that starts on an earlier line or after `?` (`.f()`), is not.
fn is_own(chain: &str) -> bool {
    matches!(
        chain,
        "" | "self." | "self.inner." | "inner." | "me." | "Self::"
    )
}

/// The argument ranges of `spawn(..)` calls: code there runs on a task of its own, later,
/// not under a lock its spawner holds.
fn spawned(code: &[u8]) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut at = 0;
    while let Some(p) = find(code, b"spawn(", at) {
        at = p + 1;
        if p > 0 && is_ident(code[p - 1]) {
            continue;
        }
        let open = p + 5;
        out.push(open..matching(code, open));
    }
    out
}

/// Where a std mutex is taken: `.lock()` not followed by `.await` (an async mutex, made to be
/// held across awaits), and calls of the poison-ignoring helper `lock(&..)` /
/// `sync::lock(&..)` (not its definition).
fn lock_sites(code: &[u8]) -> Vec<usize> {
    let mut sites = Vec::new();
    let mut at = 0;
    while let Some(p) = find(code, b".lock()", at) {
        at = p + 1;
        let rest = String::from_utf8_lossy(&code[p + 7..(p + 40).min(code.len())]).into_owned();
        if !rest.trim_start().starts_with(".await") {
            sites.push(p);
        }
    }
    at = 0;
    while let Some(p) = find(code, b"lock(&", at) {
        at = p + 1;
        let before = String::from_utf8_lossy(&code[p.saturating_sub(3)..p]).into_owned();
        let helper = p == 0 || !is_ident(code[p - 1]) || before.ends_with("::");
        if helper && !before.ends_with("fn ") && !before.ends_with('.') {
            sites.push(p);
        }
    }
    sites.sort_unstable();
    sites
}

/// Re-entrant locking problems in one source file: (offset, message).
///
/// 1. A std `Mutex::lock()` is taken only inside a `with_*` helper that hands the guarded
///    state to a closure (so no guard is returned to a caller that could call on with it).
/// 2. Inside the closure passed to such a helper, nothing calls back into a function of the
///    file that takes a lock (directly or through other functions), through `self`, `inner`,
///    `me`, `Self::` or as a free function: that would take the same lock again.
fn reentrant_locking(src: &str) -> Vec<(usize, String)> {
    let code = code_only(src);
    let fns = functions(&code);
    let enclosing = |at: usize| {
        fns.iter()
            .filter(|(_, r)| r.contains(&at))
            .min_by_key(|(_, r)| r.len())
            .map(|(n, _)| n.as_str())
    };
    let mut problems = Vec::new();
    let mut lockers = BTreeSet::new();
    let mut direct = BTreeSet::new();
    for p in lock_sites(&code) {
        if let Some(name) = enclosing(p) {
            direct.insert(name.to_owned());
        }
        match enclosing(p) {
            Some(name) if name.starts_with("with_") => {
                lockers.insert(name.to_owned());
            }
            other => problems.push((
                p,
                format!(
                    "a lock taken in `{}`: take a std mutex only in a `with_*` helper that passes \
                     the state to a closure",
                    other.unwrap_or("<no function>")
                ),
            )),
        }
    }
    // Functions that take a lock, directly or by calling one that does (to a fixed point).
    let spawns = spawned(&code);
    let not_spawned = |p: usize| !spawns.iter().any(|r| r.contains(&p));
    let mut taking: BTreeSet<String> = direct;
    loop {
        let before = taking.len();
        for (name, body) in &fns {
            if !taking.contains(name)
                && taking.iter().any(|t| {
                    calls(&code, t, body.clone()).any(|(p, chain)| is_own(&chain) && not_spawned(p))
                })
            {
                taking.insert(name.clone());
            }
        }
        if taking.len() == before {
            break;
        }
    }
    for helper in &lockers {
        for (call, _) in calls(&code, helper, 0..code.len()).collect::<Vec<_>>() {
            let open = call + code[call..].iter().position(|&c| c == b'(').unwrap();
            let args = open..matching(&code, open);
            for t in &taking {
                for (p, chain) in calls(&code, t, args.clone()) {
                    if is_own(&chain) && not_spawned(p) {
                        problems.push((
                            p,
                            format!(
                                "`{t}` takes a lock and is called inside the closure given to \
                                 `{helper}`, which holds one: return what is needed from the \
                                 closure and call `{t}` after it"
                            ),
                        ));
                    }
                }
            }
        }
    }
    problems.sort();
    problems.dedup();
    problems
}

/// The files of `src` grouped into the units the locking rule reads as one: a module split into
/// files (`src/a.rs` or `src/a/mod.rs`, and everything under `src/a/`) is one unit, since its
/// `with_*` helper sits in one of its files and the code calling it in the others; any other
/// file is a unit of its own.
fn module_units(src: &Path) -> BTreeMap<PathBuf, Vec<PathBuf>> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut units: BTreeMap<PathBuf, Vec<PathBuf>> = BTreeMap::new();
    for file in files {
        let rel = file.strip_prefix(src).unwrap();
        let first = rel.components().next().unwrap().as_os_str();
        let dir = src.join(first);
        let key = if dir.is_dir() {
            dir
        } else {
            let stem = dir.with_extension("");
            if stem.is_dir() { stem } else { file.clone() }
        };
        units.entry(key).or_default().push(file);
    }
    for unit in units.values_mut() {
        unit.sort_by_key(|p| p.display().to_string());
    }
    units
}

/// [`reentrant_locking`] over several files read as one unit: (file, line, message).
fn reentrant_locking_in(files: &[(String, String)]) -> Vec<(String, usize, String)> {
    let mut joined = String::new();
    let mut starts = Vec::new();
    for (name, text) in files {
        starts.push((joined.len(), name.as_str(), text.as_str()));
        joined.push_str(text);
        joined.push('\n');
    }
    reentrant_locking(&joined)
        .into_iter()
        .map(|(at, message)| {
            let &(start, name, text) = starts.iter().rev().find(|(s, ..)| *s <= at).unwrap();
            let line = text[..at - start].matches('\n').count() + 1;
            (name.to_owned(), line, message)
        })
        .collect()
}

#[test]
fn coordinator_state_locks_are_never_taken_twice() {
    let mut report = Vec::new();
    for krate in ["coordinator", "bootstrap", "control"] {
        let src = root().join("crates").join(krate).join("src");
        for unit in module_units(&src).into_values() {
            let files: Vec<(String, String)> = unit
                .iter()
                .map(|f| (f.display().to_string(), read(f)))
                .collect();
            for (file, line, message) in reentrant_locking_in(&files) {
                report.push(format!("{file}:{line}: {message}"));
            }
        }
    }
    assert!(report.is_empty(), "{}", report.join("\n"));
}

#[test]
fn a_module_split_into_files_is_one_unit_of_the_locking_rule() {
    // The helper in one file, the re-entrant call in another: only the unit sees both.
    let helper = "impl Inner {\n    fn with_core<R>(&self, f: impl FnOnce(&mut Core) -> R) -> R {\n\
                  \x20       f(&mut lock(&self.core))\n    }\n\n\
                  \x20   fn step(&self) { self.with_core(|c| c.n += 1); }\n}\n";
    let caller = "impl Inner {\n    fn fine(&self) { self.step(); }\n\n\
                  \x20   fn twice(&self) {\n        self.with_core(|_| self.step());\n    }\n}\n";
    let files = [
        ("a/step.rs".to_owned(), helper.to_owned()),
        ("a/rooms.rs".to_owned(), caller.to_owned()),
    ];
    assert!(
        reentrant_locking(caller).is_empty(),
        "alone, the caller's file shows nothing"
    );
    let found = reentrant_locking_in(&files);
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!((found[0].0.as_str(), found[0].1), ("a/rooms.rs", 5));
    assert!(found[0].2.contains("`step` takes a lock"), "{}", found[0].2);

    // The units: `src/a.rs` with `src/a/*`, `src/a/mod.rs` with its siblings, the rest alone.
    let dir = std::env::temp_dir().join(format!("kvbridge-tidy-units-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    for f in [
        "lib.rs", "a.rs", "a/x.rs", "b/mod.rs", "b/y.rs", "b/z/w.rs", "c.rs",
    ] {
        let path = dir.join(f);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, "").unwrap();
    }
    let units = module_units(&dir);
    let names = |files: &[PathBuf]| -> Vec<String> {
        files
            .iter()
            .map(|f| f.strip_prefix(&dir).unwrap().display().to_string())
            .collect()
    };
    let got: Vec<Vec<String>> = units.values().map(|u| names(u)).collect();
    fs::remove_dir_all(&dir).unwrap();
    assert_eq!(
        got,
        [
            vec!["a.rs", "a/x.rs"],
            vec!["b/mod.rs", "b/y.rs", "b/z/w.rs"],
            vec!["c.rs"],
            vec!["lib.rs"],
        ]
    );
}

#[test]
fn the_reentrant_locking_rule_catches_the_old_patterns() {
    // A helper returning the guard, used by a caller that calls on while holding it: the
    // pattern that deadlocked the prefill's registration path.
    let returns_guard = r#"
        impl Inner {
            fn lock(&self) -> MutexGuard<'_, State> { self.state.lock().unwrap() }
            fn reply(&self) { self.lock().peers.insert(1, 2); }
            fn on_register(&self) {
                match self.lock().peers.get(&1) { Some(_) => return self.reply(), None => {} }
            }
        }
    "#;
    let found: Vec<String> = reentrant_locking(returns_guard)
        .into_iter()
        .map(|(_, m)| m)
        .collect();
    assert_eq!(found.len(), 3, "{found:?}");
    for f in ["lock", "reply", "on_register"] {
        assert!(
            found
                .iter()
                .any(|m| m.contains(&format!("a lock taken in `{f}`"))),
            "{found:?}"
        );
    }
    // The same call made inside the closure of the state helper.
    let nested = r#"
        impl Inner {
            fn with_state<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
                let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
                f(&mut st)
            }
            fn reply(&self) { self.with_state(|st| st.peers.insert(1, 2)); }
            fn on_register(&self) {
                self.with_state(|st| if st.peers.contains_key(&1) { self.reply() });
            }
            fn fine(&self) {
                let known = self.with_state(|st| st.peers.get(&1).copied());
                if known.is_some() { self.reply() }
                let s = "self.reply() in a string";
                self.with_state(|st| st.peers.remove(&1)); // self.reply() in a comment
            }
        }
        async fn waits(m: &tokio::sync::Mutex<u8>) { let _g = m.lock().await; }
    "#;
    let found = reentrant_locking(nested);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(
        found[0]
            .1
            .contains("`reply` takes a lock and is called inside"),
        "{found:?}"
    );
    assert_eq!(&nested[found[0].0..found[0].0 + 5], "reply");
    // The poison-ignoring helper counts as taking the lock, wherever it is called.
    let helper = r#"
        use kvbridge_transport::sync;
        fn lock(m: &Mutex<u8>) -> MutexGuard<'_, u8> { m.lock().unwrap() }
        impl Inner {
            fn with_state<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
                f(&mut sync::lock(&self.state))
            }
            fn peek(&self) -> u8 { *sync::lock(&self.other) }
            fn bare(&self) -> u8 { *lock(&self.other) }
            fn nested(&self) { self.with_state(|_| self.peek()); }
        }
    "#;
    let found: Vec<String> = reentrant_locking(helper)
        .into_iter()
        .map(|(_, m)| m)
        .collect();
    for f in ["lock", "peek", "bare"] {
        assert!(
            found
                .iter()
                .any(|m| m.contains(&format!("a lock taken in `{f}`"))),
            "{found:?}"
        );
    }
    assert!(
        found
            .iter()
            .any(|m| m.contains("`peek` takes a lock and is called inside")),
        "{found:?}"
    );
    assert_eq!(found.len(), 4, "{found:?}");
}

// ---------------------------------------------------------------------------------------------
// Function length: library code has no function over `MAX_FN_LINES` lines unless the comment
// or doc comment directly above it says `Long because: <reason>`.

/// The most lines (from the line of `fn` to the closing brace) a library function may span.
const MAX_FN_LINES: usize = 100;

/// `code` (from [`code_only`]) with every item under `#[cfg(test)]` blanked, and the names of
/// the modules declared `#[cfg(test)] mod name;` (their files are test code too).
fn without_test_items(code: &[u8]) -> (Vec<u8>, Vec<String>) {
    let mut out = code.to_vec();
    let mut test_modules = Vec::new();
    let mut from = 0;
    while let Some(at) = find(code, b"#[cfg(test)]", from) {
        from = at + 1;
        let rest = &code[at..];
        let Some(end) = rest.iter().position(|&c| c == b'{' || c == b';') else {
            break;
        };
        let item = &code[at..at + end];
        let close = if code[at + end] == b'{' {
            matching(code, at + end)
        } else {
            let decl = String::from_utf8_lossy(item);
            if let Some(name) = decl.split_whitespace().skip_while(|w| *w != "mod").nth(1) {
                test_modules.push(name.to_owned());
            }
            at + end + 1
        };
        for c in &mut out[at..close] {
            if *c != b'\n' {
                *c = b' ';
            }
        }
    }
    (out, test_modules)
}

/// Whether the comment lines directly above line `line` (0-based; attributes skipped) give
/// a `Long because:` reason.
fn has_long_reason(lines: &[&str], line: usize) -> bool {
    lines[..line]
        .iter()
        .rev()
        .map(|l| l.trim())
        .take_while(|l| l.starts_with("//") || l.starts_with("#["))
        .any(|l| l.starts_with("//") && l.contains("Long because:"))
}

/// The functions of `src` longer than `MAX_FN_LINES` without a reason: (name, first line
/// (1-based), lines), outside `#[cfg(test)]` items.
fn long_functions(src: &str) -> (Vec<(String, usize, usize)>, Vec<String>) {
    let (code, test_modules) = without_test_items(&code_only(src));
    let lines: Vec<&str> = src.lines().collect();
    let line_of = |at: usize| code[..at].iter().filter(|&&c| c == b'\n').count();
    let mut out = Vec::new();
    for (name, body) in functions(&code) {
        // The line of `fn`: the last `fn ` before the body.
        let start = code[..body.start]
            .windows(3)
            .rposition(|w| w == b"fn ")
            .unwrap_or(body.start);
        let (first, last) = (line_of(start), line_of(body.end.saturating_sub(1)));
        let len = last - first + 1;
        // The signature may start on lines above `fn` (attributes, `pub async`), all code.
        if len > MAX_FN_LINES && !has_long_reason(&lines, first) {
            out.push((name, first + 1, len));
        }
    }
    (out, test_modules)
}

/// Every long function without a reason in library code: `crates/*/src`, test modules aside.
fn long_library_functions() -> Vec<(String, String, usize, usize)> {
    let mut files = Vec::new();
    for (dir, _) in crates() {
        rust_files(&dir.join("src"), &mut files);
    }
    files.sort();
    let mut results = Vec::new();
    let mut test_files = BTreeSet::new();
    for file in &files {
        let (long, test_modules) = long_functions(&read(file));
        // A child module `m` of `a/b.rs` lives in `a/b/m.rs`; of `a/mod.rs` or `a/lib.rs` in `a/m.rs`.
        let stem = file.file_stem().unwrap().to_string_lossy().into_owned();
        let dir = if ["mod", "lib", "main"].contains(&stem.as_str()) {
            file.parent().unwrap().to_path_buf()
        } else {
            file.parent().unwrap().join(&stem)
        };
        for m in test_modules {
            test_files.insert(dir.join(format!("{m}.rs")));
            test_files.insert(dir.join(&m).join("mod.rs"));
        }
        results.push((file.clone(), long));
    }
    let mut out = Vec::new();
    for (file, long) in results {
        if test_files.contains(&file) {
            continue;
        }
        let rel = file
            .strip_prefix(root())
            .unwrap()
            .to_string_lossy()
            .into_owned();
        for (name, line, len) in long {
            out.push((rel.clone(), name, line, len));
        }
    }
    out
}

#[test]
fn library_functions_are_short_or_say_why() {
    let long = long_library_functions();
    let report: Vec<String> = long
        .iter()
        .map(|(file, name, line, len)| {
            format!(
                "{file}:{line}: `{name}` is {len} lines (over {MAX_FN_LINES}); split it into named \
                 pieces, or write `Long because: <reason>` in the comment directly above it"
            )
        })
        .collect();
    assert!(report.is_empty(), "{}", report.join("\n"));
}

#[test]
fn the_function_length_rule_catches_long_functions_and_accepts_reasons() {
    let body = |n: usize| "    let x = 1;\n".repeat(n);
    let fixture = format!(
        "fn short() {{\n{short}}}\n\n\
         /// Docs.\n#[inline]\npub async fn long_one(a: u8) -> u8 {{\n{long}    a\n}}\n\n\
         /// Long because: one match arm per frame type.\n#[allow(clippy::too_many_lines)]\n\
         fn long_with_reason() {{\n{long}}}\n\n\
         // Long because: a reason in a plain comment counts too.\nfn also_fine() {{\n{long}}}\n\n\
         /// Long because: this reason is not directly above the next function.\nconst X: u8 = 1;\n\
         fn reason_not_adjacent() {{\n{long}}}\n\n\
         fn exactly_the_limit() {{\n{limit}}}\n\n\
         fn braces_in_strings() {{\n    let s = \"}}}}\";\n{long}}}\n\n\
         #[cfg(test)]\nmod tests {{\n    fn long_test_helper() {{\n{long}    }}\n}}\n\n\
         #[cfg(test)]\nmod more_tests;\n",
        short = body(3),
        long = body(MAX_FN_LINES),
        limit = body(MAX_FN_LINES - 2),
    );
    let (long, test_modules) = long_functions(&fixture);
    let names: Vec<&str> = long.iter().map(|(n, ..)| n.as_str()).collect();
    assert_eq!(
        names,
        ["long_one", "reason_not_adjacent", "braces_in_strings"],
        "{long:?}"
    );
    assert_eq!(test_modules, ["more_tests"]);
    // `long_one` spans its `fn` line to its closing brace: 100 body lines, `a` and two more.
    assert_eq!(long[0].2, MAX_FN_LINES + 3);
    let line = fixture
        .lines()
        .position(|l| l.contains("fn long_one"))
        .unwrap();
    assert_eq!(long[0].1, line + 1);
}

// ---------------------------------------------------------------------------------------------
// The room machines are sans-IO: events and explicit instants in, actions out.

/// What the library files of `crates/machines/src/` never name: a runtime, a clock
/// read, threads, sockets, files or tracing spans (the drivers own all of that; a machine may
/// emit log events, which carry no state of their own).
const ROOM_FORBIDDEN: &[&str] = &[
    "tokio",
    "Instant::now",
    "SystemTime",
    "Span",
    "span!",
    "instrument",
    "std::thread",
    "std::net",
    "std::fs",
    "async ",
    ".await",
];

fn sans_io_violations(src: &str) -> Vec<(usize, &'static str)> {
    let code = code_only(src);
    let mut found = Vec::new();
    for word in ROOM_FORBIDDEN {
        let mut at = 0;
        while let Some(p) = find(&code, word.as_bytes(), at) {
            at = p + 1;
            found.push((p, *word));
        }
    }
    found.sort_unstable();
    found
}

#[test]
fn the_room_machines_do_no_io_and_read_no_clock() {
    let mut files = Vec::new();
    rust_files(&root().join("crates/machines/src"), &mut files);
    assert!(!files.is_empty(), "crates/machines/src has no files");
    let mut report = Vec::new();
    for file in files {
        let name = file.file_name().unwrap().to_string_lossy();
        if name == "tests.rs" {
            continue; // tests pick their base instant from the clock
        }
        let text = read(&file);
        for (at, word) in sans_io_violations(&text) {
            let line = text[..at].matches('\n').count() + 1;
            report.push(format!(
                "{}:{line}: `{word}` in a room machine: take the instant as an argument and \
                 return an action for the driver (which owns runtime, clock, spans and I/O)",
                file.display()
            ));
        }
    }
    assert!(report.is_empty(), "{}", report.join("\n"));
}

#[test]
fn the_sans_io_rule_sees_clocks_and_runtimes_but_not_comments() {
    let src = "// tokio in a comment\nfn f(now: Instant) { let s = \"tokio\"; }\n\
               fn g() { let t = Instant::now(); tokio::spawn(async {}); }\n\
               fn h() { let _s = tracing::info_span!(\"room\"); tracing::info!(\"fine\"); }\n";
    let words: Vec<&str> = sans_io_violations(src)
        .into_iter()
        .map(|(_, w)| w)
        .collect();
    assert_eq!(
        words,
        ["Instant::now", "tokio", "async ", "span!"],
        "{words:?}"
    );
}

// No blocking wait on an async runtime's worker thread: the TCP, loopback and NIXL transports
// run their I/O and copies on the caller's tokio runtime (the shm transport copies on its own
// thread, the coordinator gathers in `spawn_blocking`), so they touch registered memory only
// through the accessors that never wait for a conflicting claim (`try_*`, `recv_vectored`,
// `send_vectored`) and wait on tokio's timers.

/// Registered-memory accessors that may wait up to `CLAIM_WAIT` for a conflicting claim.
const WAITING_ACCESSORS: &[&str] = &[
    ".borrow(",
    ".borrow_mut(",
    ".read_at(",
    ".write_at(",
    ".fill(",
    ".copy_to(",
    ".with_raw_range(",
    ".with_raw_copy(",
    ".gather_to(",
];

/// The calls of [`WAITING_ACCESSORS`] in `src`'s code outside test items, as (line, call).
fn waiting_calls(src: &str) -> Vec<(usize, &'static str)> {
    let (code, _) = without_test_items(&code_only(src));
    let mut found = Vec::new();
    for call in WAITING_ACCESSORS {
        let mut from = 0;
        while let Some(at) = find(&code, call.as_bytes(), from) {
            let line = code[..at].iter().filter(|&&c| c == b'\n').count() + 1;
            found.push((line, *call));
            from = at + 1;
        }
    }
    found
}

#[test]
fn transports_on_the_runtime_never_wait_for_a_claim() {
    let mut files = Vec::new();
    for dir in ["crates/tcp/src", "crates/mock/src", "crates/nixl/src"] {
        rust_files(&root().join(dir), &mut files);
    }
    let mut offenders = Vec::new();
    for file in files {
        for (line, call) in waiting_calls(&read(&file)) {
            offenders.push(format!("{}:{line}: `{call}`", file.display()));
        }
    }
    assert!(
        offenders.is_empty(),
        "these transports run on tokio's worker threads, where a claim must never wait; use \
         the `try_` accessor (and retry on a tokio timer) instead of:\n{}",
        offenders.join("\n")
    );
}

#[test]
fn the_waiting_accessor_rule_catches_a_waiting_borrow() {
    let src = "fn read(r: &MemoryRegion) { let s = r.borrow_mut(0, 8); let t = r.try_borrow_mut(0, 8); }\n\
               // r.write_at(0, b\"x\") in a comment does not count\n\
               #[cfg(test)]\nmod tests { fn t(r: &MemoryRegion) { r.write_at(0, b\"x\").unwrap(); } }\n";
    assert_eq!(waiting_calls(src), [(1, ".borrow_mut(")]);
}

// ---------------------------------------------------------------------------------------------
// kvbridge-control's data is usable without tokio: the runtime, async-trait and everything
// built on them sit behind its default feature `channel`, so sans-IO machines (driven from
// Python or a C ABI) can depend on the crate with `default-features = false`.

/// The dependencies of kvbridge-control that only the `channel` feature may bring in.
const CHANNEL_ONLY_DEPS: [&str; 2] = ["tokio", "async-trait"];

/// What the code outside the `channel` feature never names (as a path's first segment).
const CHANNEL_ONLY_NAMES: [&str; 2] = ["tokio", "async_trait"];

/// Problems with a manifest of kvbridge-control: a dependency of [`CHANNEL_ONLY_DEPS`] among
/// its normal dependencies that is not optional, or that the `channel` feature does not enable.
fn channel_dependency_problems(manifest: &str) -> Vec<String> {
    let channel = section_lines(manifest, "[features]")
        .into_iter()
        .find(|l| l.split(['=', ' ']).next() == Some("channel"))
        .unwrap_or("");
    let mut problems = Vec::new();
    for line in section_lines(manifest, "[dependencies]") {
        let key = line.split(['=', '.', ' ']).next().unwrap().trim();
        if !CHANNEL_ONLY_DEPS.contains(&key) {
            continue;
        }
        if !line.replace(' ', "").contains("optional=true") {
            problems.push(format!(
                "`{line}`: {key} must stay an optional dependency (`optional = true`)"
            ));
        }
        if !channel.contains(&format!("\"dep:{key}\"")) {
            problems.push(format!(
                "the `channel` feature must enable {key} (`\"dep:{key}\"`)"
            ));
        }
    }
    problems
}

/// `code` (from [`code_only`] of `src`, same offsets) with every item under a `#[cfg(..)]` that
/// needs the `channel` feature blanked, and the names of the modules so declared (`mod name;`).
fn without_channel_items(src: &str, code: &[u8]) -> (Vec<u8>, Vec<String>) {
    let mut out = code.to_vec();
    let mut gated = Vec::new();
    let mut from = 0;
    while let Some(at) = find(code, b"#[cfg(", from) {
        from = at + 1;
        let attr_end = matching(code, at + 1);
        let attr = &src[at..attr_end];
        if !attr.contains("feature = \"channel\"") || attr.contains("not(") {
            continue;
        }
        let Some(end) = code[attr_end..]
            .iter()
            .position(|&c| c == b'{' || c == b';')
            .map(|p| attr_end + p)
        else {
            break;
        };
        let close = if code[end] == b'{' {
            matching(code, end)
        } else {
            let decl = String::from_utf8_lossy(&code[attr_end..end]).into_owned();
            if let Some(name) = decl.split_whitespace().skip_while(|w| *w != "mod").nth(1) {
                gated.push(name.to_owned());
            }
            end + 1
        };
        for c in &mut out[at..close] {
            if *c != b'\n' {
                *c = b' ';
            }
        }
    }
    (out, gated)
}

/// Where `code` names one of [`CHANNEL_ONLY_NAMES`] (not as part of a longer identifier).
fn channel_names(code: &[u8]) -> Vec<(usize, &'static str)> {
    let mut found = Vec::new();
    for name in CHANNEL_ONLY_NAMES {
        let mut from = 0;
        while let Some(at) = find(code, name.as_bytes(), from) {
            from = at + 1;
            let before = at > 0 && is_ident(code[at - 1]);
            let after = code.get(at + name.len()).is_some_and(|&c| is_ident(c));
            if !before && !after {
                found.push((at, name));
            }
        }
    }
    found.sort_unstable();
    found
}

/// Where kvbridge-control's code outside the `channel` feature names tokio or async-trait:
/// `lib` is the crate root, `module` gives a file module's source by name (`None`: no such
/// file). Returns `(file, line, name)`; comments, strings and gated items do not count, a
/// module's `#[cfg(test)]` items do (the dev-dependency would hide them from the compiler).
fn ungated_channel_names(
    lib: &str,
    module: impl Fn(&str) -> Option<String>,
) -> Vec<(String, usize, &'static str)> {
    let line = |text: &str, at: usize| text[..at].matches('\n').count() + 1;
    let (code, _) = without_channel_items(lib, &code_only(lib));
    let mut found: Vec<(String, usize, &'static str)> = channel_names(&code)
        .into_iter()
        .map(|(at, name)| ("lib.rs".to_owned(), line(lib, at), name))
        .collect();
    // The file modules the root declares outside the feature: `mod name;`.
    let mut from = 0;
    while let Some(at) = find(&code, b"mod ", from) {
        from = at + 1;
        if at > 0 && is_ident(code[at - 1]) {
            continue;
        }
        let rest = String::from_utf8_lossy(&code[at + 4..]).into_owned();
        let name: String = rest.chars().take_while(|&c| is_ident(c as u8)).collect();
        if !rest[name.len()..].trim_start().starts_with(';') {
            continue; // an inline module: its code is the root's, checked above
        }
        let file = format!("{name}.rs");
        let text = module(&name)
            .unwrap_or_else(|| panic!("kvbridge-control declares `mod {name};` but has no {file}"));
        for (at, word) in channel_names(&code_only(&text)) {
            found.push((file.clone(), line(&text, at), word));
        }
    }
    found.sort();
    found.dedup();
    found
}

#[test]
fn the_control_crate_keeps_tokio_behind_its_channel_feature() {
    let dir = root().join("crates/control");
    let problems = channel_dependency_problems(&read(&dir.join("Cargo.toml")));
    assert!(
        problems.is_empty(),
        "crates/control/Cargo.toml: {}; sans-IO machines depend on kvbridge-control without \
         its default features and must not get a runtime",
        problems.join("; ")
    );
    let src = dir.join("src");
    let module = |name: &str| {
        [
            src.join(format!("{name}.rs")),
            src.join(name).join("mod.rs"),
        ]
        .into_iter()
        .find(|p| p.exists())
        .map(|p| read(&p))
    };
    let report: Vec<String> = ungated_channel_names(&read(&src.join("lib.rs")), module)
        .into_iter()
        .map(|(file, line, name)| {
            format!(
                "crates/control/src/{file}:{line}: `{name}` outside the `channel` feature; put \
                 the code (or its module in lib.rs) under `#[cfg(feature = \"channel\")]`"
            )
        })
        .collect();
    assert!(report.is_empty(), "{}", report.join("\n"));
}

#[test]
fn the_channel_feature_rule_catches_a_required_runtime_and_an_ungated_module() {
    let good = "[features]\ndefault = [\"channel\"]\n\
                channel = [\"dep:async-trait\", \"dep:tokio\"]\n\n[dependencies]\n\
                async-trait = { workspace = true, optional = true }\nserde.workspace = true\n\
                tokio = { workspace = true, optional = true, features = [\"rt\"] }\n\n\
                [dev-dependencies]\ntokio = { workspace = true, features = [\"macros\"] }\n";
    assert_eq!(channel_dependency_problems(good), Vec::<String>::new());
    let required = good.replace(
        "tokio = { workspace = true, optional = true, features",
        "tokio = { workspace = true, features",
    );
    let found = channel_dependency_problems(&required);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(
        found[0].contains("tokio must stay an optional"),
        "{found:?}"
    );
    let dotted = good.replace(
        "async-trait = { workspace = true, optional = true }",
        "async-trait.workspace = true",
    );
    assert_eq!(channel_dependency_problems(&dotted).len(), 1);
    let not_enabled = good.replace(", \"dep:tokio\"", "");
    let found = channel_dependency_problems(&not_enabled);
    assert!(
        found.len() == 1 && found[0].contains("`channel` feature must enable tokio"),
        "{found:?}"
    );

    let lib = "//! Uses tokio with the feature.\n\
               #[cfg(feature = \"channel\")]\n#[cfg_attr(docsrs, doc(cfg(feature = \"channel\")))]\n\
               pub mod channel;\n\
               #[cfg(all(test, feature = \"channel\"))]\nmod fuzz;\n\
               mod messages;\nmod state;\n\
               #[cfg(feature = \"channel\")]\npub use channel::{A, B};\n\
               #[cfg(not(feature = \"channel\"))]\nuse tokio::sync::Mutex;\n\
               mod inline { fn f() {} }\n";
    let module = |name: &str| match name {
        "messages" => Some("// tokio in a comment\nfn f() { let s = \"tokio\"; }\n".to_owned()),
        "state" => Some(
            "fn f() {}\n#[cfg(test)]\nmod tests {\n    #[tokio::test]\n    async fn t() {}\n}\n\
             #[async_trait::async_trait]\nimpl X for Y {}\nfn tokio_free() {}\n"
                .to_owned(),
        ),
        _ => None, // the gated modules are never read
    };
    let found = ungated_channel_names(lib, module);
    assert_eq!(
        found,
        [
            ("lib.rs".to_owned(), 12, "tokio"),
            ("state.rs".to_owned(), 4, "tokio"),
            ("state.rs".to_owned(), 7, "async_trait"),
        ],
        "{found:?}"
    );
}

/// The async runtimes a sans-IO crate must not reach.
const RUNTIMES: [&str; 3] = ["tokio", "async-std", "smol"];

/// The dependencies of `manifest` that a build reaches: every normal dependency that is not
/// optional, and with `defaults` the optional ones its default features turn on. Each with
/// whether its own default features stay on.
fn reached_dependencies(manifest: &str, defaults: bool) -> Vec<(String, bool)> {
    let mut on: BTreeSet<String> = BTreeSet::new();
    if defaults {
        let features: BTreeMap<String, Vec<String>> = section_lines(manifest, "[features]")
            .into_iter()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| {
                let items = v
                    .trim()
                    .trim_matches(['[', ']'])
                    .split(',')
                    .map(|i| i.trim().trim_matches('"').to_owned())
                    .filter(|i| !i.is_empty())
                    .collect();
                (k.trim().to_owned(), items)
            })
            .collect();
        let mut todo = vec!["default".to_owned()];
        while let Some(f) = todo.pop() {
            for item in features.get(&f).into_iter().flatten() {
                let dep = item.strip_prefix("dep:").unwrap_or(item);
                let dep = dep.split('/').next().unwrap_or(dep).to_owned();
                if features.contains_key(item) && on.insert(format!("feature:{item}")) {
                    todo.push(item.clone());
                }
                on.insert(dep);
            }
        }
    }
    section_lines(manifest, "[dependencies]")
        .into_iter()
        .filter_map(|line| {
            let name = line.split(['=', '.', ' ']).next()?.trim().to_owned();
            let optional = line.contains("optional = true");
            let keeps_defaults = !line.contains("default-features = false");
            (!optional || on.contains(&name)).then_some((name, keeps_defaults))
        })
        .collect()
}

/// The paths from `root` to an async runtime through the workspace's manifests (`manifests`:
/// crate name to manifest text); empty when none is reached.
fn runtime_paths(root: &str, manifests: &BTreeMap<String, String>) -> Vec<String> {
    let mut found = Vec::new();
    let mut seen = BTreeSet::new();
    let mut todo = vec![(root.to_owned(), true, root.to_owned())];
    while let Some((name, defaults, path)) = todo.pop() {
        if !seen.insert((name.clone(), defaults)) {
            continue;
        }
        let Some(manifest) = manifests.get(&name) else {
            continue;
        };
        for (dep, keeps_defaults) in reached_dependencies(manifest, defaults) {
            let to = format!("{path} -> {dep}");
            if RUNTIMES.contains(&dep.as_str()) {
                found.push(to);
            } else if manifests.contains_key(&dep) {
                todo.push((dep, keeps_defaults, to));
            }
        }
    }
    found
}

#[test]
fn the_machines_reach_no_async_runtime() {
    let manifests: BTreeMap<String, String> = crates()
        .into_iter()
        .map(|(dir, name)| (name, read(&dir.join("Cargo.toml"))))
        .collect();
    let paths = runtime_paths("kvbridge-machines", &manifests);
    assert!(
        paths.is_empty(),
        "kvbridge-machines must build without an async runtime (Python and C engines drive \
         the machines from their own loops), but reaches one: {}",
        paths.join("; ")
    );
}

#[test]
fn the_runtime_rule_follows_default_features_and_sees_through_them() {
    let manifests: BTreeMap<String, String> = [
        ("m", "[dependencies]\nc = { path = \"../c\" }\n"),
        (
            "c",
            "[features]\ndefault = [\"channel\"]\nchannel = [\"dep:tokio\"]\n\n\
             [dependencies]\ntokio = { workspace = true, optional = true }\n",
        ),
        (
            "m2",
            "[dependencies]\nc = { path = \"../c\", default-features = false }\n",
        ),
        ("m3", "[dependencies]\nd.workspace = true\n"),
        ("d", "[dependencies]\ntokio.workspace = true\n"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    assert_eq!(runtime_paths("m", &manifests), ["m -> c -> tokio"]);
    assert!(runtime_paths("m2", &manifests).is_empty());
    assert_eq!(runtime_paths("m3", &manifests), ["m3 -> d -> tokio"]);
}
