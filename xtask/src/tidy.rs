//! Repository rules checked as tests (run by `cargo test -p xtask`, and so by `cargo xtask ci`).

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

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
    let mut in_deps = false;
    let mut deps = BTreeSet::new();
    for line in manifest.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            in_deps = line == "[dependencies]";
            continue;
        }
        if in_deps && !line.is_empty() && !line.starts_with('#') {
            let name = line.split(['=', '.', ' ']).next().unwrap().trim();
            deps.insert(name.to_owned());
        }
    }
    deps
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

#[test]
fn crates_depend_only_on_what_the_codemap_allows() {
    // (package, kvbridge crates it may use, whether tokio is allowed) — the table in
    // docs/ARCHITECTURE.md.
    let rules: &[(&str, &[&str], bool)] = &[
        ("kvbridge-geometry", &[], false),
        ("kvbridge-handshake", &["kvbridge-geometry"], false),
        ("kvbridge-transport", &[], false),
        ("kvbridge-mock", &["kvbridge-transport"], true),
        ("kvbridge-shm", &["kvbridge-transport"], true),
        ("kvbridge-tcp", &["kvbridge-transport"], true),
        (
            "kvbridge-coordinator",
            &[
                "kvbridge-geometry",
                "kvbridge-handshake",
                "kvbridge-transport",
            ],
            true,
        ),
        (
            "kvbridge",
            &[
                "kvbridge-geometry",
                "kvbridge-handshake",
                "kvbridge-transport",
                "kvbridge-mock",
                "kvbridge-shm",
                "kvbridge-tcp",
                "kvbridge-coordinator",
            ],
            false,
        ),
    ];
    for (dir, name) in crates() {
        let deps = normal_dependencies(&read(&dir.join("Cargo.toml")));
        let Some((_, allowed, tokio)) = rules.iter().find(|(n, ..)| *n == name) else {
            assert_eq!(
                name, "kvbridge-cli",
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

#[test]
fn unsafe_code_lives_only_in_the_two_memory_modules() {
    let allowed = [
        root().join("crates/transport/src/memory.rs"),
        root().join("crates/shm/src/map.rs"),
    ];
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
                "{} contains `{marker}`; unsafe code belongs in the registered-memory module or the shm mapping layer",
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
