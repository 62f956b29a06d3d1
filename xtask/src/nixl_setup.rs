//! `cargo xtask nixl-setup`: everything `kvbridge-nixl` needs, fetched into `target/nixl/`.
//!
//! 1. libclang, which the build of `nixl-sys` (bindgen) needs: installed with apt when missing.
//! 2. The NIXL runtime: the `nixl-cu12` wheel from PyPI (`pip download --no-deps`), unpacked
//!    into `target/nixl/` (ignored by git; its binaries are never committed or redistributed).
//! 3. A plugin folder holding only NIXL's UCX and POSIX plugins (the other plugins of the wheel
//!    need libraries a plain host lacks).
//!
//! Each step is skipped when its result is already there, so the command is idempotent.
//! The layout it leaves is the one `kvbridge-nixl` looks for (docs/transports.md, "NIXL").

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The wheel the transport is built and tested against (its `libnixl_capi.so` exports every
/// symbol `nixl-sys` 1.5 resolves).
pub(crate) const WHEEL: &str = "nixl-cu12==1.5.1";
/// Folder of the wheel's NIXL libraries (`libnixl.so`, `libnixl_capi.so`, `plugins/`).
pub(crate) const LIB_SUBDIR: &str = ".nixl_cu12.mesonpy.libs";
/// Plugin folder made by the set-up, beside `plugins/` so the plugins' `$ORIGIN/..` run paths
/// still find NIXL's libraries.
pub(crate) const PLUGIN_SUBDIR: &str = ".nixl_cu12.mesonpy.libs/kvbridge-plugins";
const PLUGINS: [&str; 2] = ["libplugin_UCX.so", "libplugin_POSIX.so"];
/// Written last: its presence says the unpacked runtime is complete.
const STAMP: &str = "kvbridge-nixl-setup.txt";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

fn run(cmd: &mut Command) -> Result<(), String> {
    let shown = format!("{cmd:?}");
    eprintln!("xtask nixl-setup: running {shown}");
    let status = cmd
        .status()
        .map_err(|e| format!("could not run {shown}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{shown} failed with {status}"))
    }
}

/// Whether a `libclang` shared library is where bindgen (clang-sys) looks for it.
pub(crate) fn has_libclang() -> bool {
    if let Ok(dir) = std::env::var("LIBCLANG_PATH") {
        if fs::read_dir(&dir).is_ok_and(|d| {
            d.flatten()
                .any(|e| is_libclang_file(&e.file_name().to_string_lossy()))
        }) {
            return true;
        }
    }
    Command::new("ldconfig")
        .arg("-p")
        .output()
        .is_ok_and(|o| ldconfig_lists_libclang(&String::from_utf8_lossy(&o.stdout)))
}

/// Whether an `ldconfig -p` listing names a libclang that clang-sys can load.
fn ldconfig_lists_libclang(listing: &str) -> bool {
    listing
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .any(is_libclang_file)
}

/// `libclang.so`, `libclang.so.1`, `libclang-14.so`, `libclang-14.so.1`: the C API bindgen
/// loads. Not `libclang-cpp.so.14` (the C++ library, which many images ship alone) nor
/// `libclangBasic.a` and the like.
fn is_libclang_file(name: &str) -> bool {
    let Some(rest) = name.strip_prefix("libclang") else {
        return false;
    };
    if rest == ".so" || rest.starts_with(".so.") {
        return true;
    }
    // A versioned name: `-` then a version number, then `.so`.
    rest.strip_prefix('-').is_some_and(|v| {
        let (version, suffix) = v.split_at(v.find(".so").unwrap_or(v.len()));
        !version.is_empty()
            && version.chars().all(|c| c.is_ascii_digit() || c == '.')
            && (suffix == ".so" || suffix.starts_with(".so."))
    })
}

fn ensure_libclang() -> Result<(), String> {
    if has_libclang() {
        eprintln!("xtask nixl-setup: libclang found (needed to build nixl-sys)");
        return Ok(());
    }
    if Command::new("apt-get").arg("--version").output().is_err() {
        return Err(
            "libclang is missing and apt-get is not available: install libclang \
                    (e.g. `libclang-dev`) with your package manager, or set LIBCLANG_PATH"
                .to_owned(),
        );
    }
    eprintln!("xtask nixl-setup: installing libclang-dev with apt-get (needed to build nixl-sys)");
    run(Command::new("apt-get").args(["update", "-qq"]))?;
    run(Command::new("apt-get")
        .args(["install", "-y", "-qq", "libclang-dev"])
        .env("DEBIAN_FRONTEND", "noninteractive"))?;
    if has_libclang() {
        Ok(())
    } else {
        Err(
            "apt-get installed libclang-dev but no libclang.so is visible to ldconfig; \
             set LIBCLANG_PATH to the folder holding libclang.so"
                .to_owned(),
        )
    }
}

fn python() -> Result<&'static str, String> {
    for candidate in ["python3", "python"] {
        if Command::new(candidate)
            .args(["-m", "pip", "--version"])
            .output()
            .is_ok_and(|o| o.status.success())
        {
            return Ok(candidate);
        }
    }
    Err(
        "no Python with pip found (tried `python3 -m pip` and `python -m pip`); install \
         python3-pip (apt-get install python3-pip) and run `cargo xtask nixl-setup` again"
            .to_owned(),
    )
}

/// Downloads the wheel and unpacks its native libraries into `dir`.
fn fetch_runtime(dir: &Path) -> Result<(), String> {
    let download = dir.join("download");
    fs::create_dir_all(&download)
        .map_err(|e| format!("cannot create {}: {e}", download.display()))?;
    let py = python()?;
    // The wheel is tagged for one CPython; its native libraries do not depend on it, so the tag
    // is pinned and the host's Python version does not matter. A download cut off half way is
    // tried again, a bounded number of times, before the set-up gives up.
    let pip_download = || {
        run(Command::new(py)
            .args([
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "--python-version",
                "3.11",
                "--implementation",
                "cp",
                "--platform",
                "manylinux_2_28_x86_64",
                "--disable-pip-version-check",
                "-d",
            ])
            .arg(&download)
            .arg(WHEEL))
    };
    let mut outcome = pip_download();
    for pause_s in [15, 45] {
        let Err(e) = &outcome else { break };
        eprintln!("xtask nixl-setup: {e}; trying again in {pause_s} s");
        std::thread::sleep(std::time::Duration::from_secs(pause_s));
        outcome = pip_download();
    }
    outcome?;
    let wheel = fs::read_dir(&download)
        .map_err(|e| format!("cannot read {}: {e}", download.display()))?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| format!("pip left no .whl in {}", download.display()))?;
    // Only the native libraries (and the licence files) are unpacked, not the Python modules.
    let script = "import sys, zipfile\n\
                  z = zipfile.ZipFile(sys.argv[1])\n\
                  keep = [n for n in z.namelist() if n.startswith(('.nixl_cu12.mesonpy.libs/', \
                  'nixl_cu12.libs/')) or '.dist-info/' in n]\n\
                  z.extractall(sys.argv[2], keep)\n\
                  print(len(keep), 'files')\n";
    run(Command::new(py).args(["-c", script]).arg(&wheel).arg(dir))?;
    fs::remove_dir_all(&download).map_err(|e| format!("cannot remove {}: {e}", download.display()))
}

fn make_plugin_dir(dir: &Path) -> Result<(), String> {
    let plugins = dir.join(PLUGIN_SUBDIR);
    fs::create_dir_all(&plugins)
        .map_err(|e| format!("cannot create {}: {e}", plugins.display()))?;
    for name in PLUGINS {
        let from = dir.join(LIB_SUBDIR).join("plugins").join(name);
        let to = plugins.join(name);
        if to.exists() {
            continue;
        }
        // A hard link costs no space; a copy where the file system refuses one.
        fs::hard_link(&from, &to)
            .or_else(|_| fs::copy(&from, &to).map(drop))
            .map_err(|e| {
                format!(
                    "cannot place {} in {}: {e}",
                    from.display(),
                    plugins.display()
                )
            })?;
    }
    Ok(())
}

/// Runs the set-up into `dir` (default `target/nixl` of the workspace).
pub(crate) fn nixl_setup(dir: Option<&str>) -> Result<(), String> {
    let dir = dir.map_or_else(|| root().join("target").join("nixl"), PathBuf::from);
    ensure_libclang()?;
    let stamp = dir.join(STAMP);
    if fs::read_to_string(&stamp).is_ok_and(|s| s.lines().next() == Some(WHEEL)) {
        eprintln!(
            "xtask nixl-setup: NIXL runtime already in {}",
            dir.display()
        );
    } else {
        eprintln!("xtask nixl-setup: fetching {WHEEL} into {}", dir.display());
        fetch_runtime(&dir)?;
    }
    make_plugin_dir(&dir)?;
    let capi = dir.join(LIB_SUBDIR).join("libnixl_capi.so");
    if !capi.exists() {
        return Err(format!(
            "{} is missing after unpacking {WHEEL}; remove {} and run `cargo xtask nixl-setup` again",
            capi.display(),
            dir.display()
        ));
    }
    fs::write(&stamp, format!("{WHEEL}\n"))
        .map_err(|e| format!("cannot write {}: {e}", stamp.display()))?;
    eprintln!(
        "xtask nixl-setup: ready: kvbridge-nixl finds the runtime in {} (or set \
         KVBRIDGE_NIXL_LIB_DIR to another set-up folder); build it with `--features nixl`",
        dir.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpp_library_alone_is_not_libclang() {
        // What a fresh image of the CI kind lists: only the C++ library.
        let fresh = "4 libs found in cache `/etc/ld.so.cache'\n\
            \tlibclang-cpp.so.14 (libc6,x86-64) => /lib/x86_64-linux-gnu/libclang-cpp.so.14\n\
            \tlibclangBasic.a (libc6,x86-64) => /usr/lib/llvm-14/lib/libclangBasic.a\n";
        assert!(!ldconfig_lists_libclang(fresh));
        for name in [
            "libclang-cpp.so.14",
            "libclang-cpp.so",
            "libclangBasic.a",
            "libclang",
        ] {
            assert!(!is_libclang_file(name), "{name} is not the C API");
        }
    }

    #[test]
    fn libclang_is_found_under_each_of_its_names() {
        let installed = "\tlibclang-cpp.so.14 (libc6,x86-64) => /lib/x86_64-linux-gnu/libclang-cpp.so.14\n\
            \tlibclang-14.so.1 (libc6,x86-64) => /lib/x86_64-linux-gnu/libclang-14.so.1\n";
        assert!(ldconfig_lists_libclang(installed));
        for name in [
            "libclang.so",
            "libclang.so.1",
            "libclang-14.so",
            "libclang-14.so.1",
            "libclang-14.0.6.so",
            "libclang-14.so.14.0.6",
        ] {
            assert!(is_libclang_file(name), "{name} is libclang");
        }
    }
}
