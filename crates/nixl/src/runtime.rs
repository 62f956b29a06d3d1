//! Where the NIXL runtime lives: the folder `cargo xtask nixl-setup` fills, or
//! `KVBRIDGE_NIXL_LIB_DIR`.

use std::path::{Path, PathBuf};

use crate::NixlError;

/// Environment variable naming the NIXL runtime: a folder holding `libnixl_capi.so` (a NIXL
/// install's library folder) or a folder made by `cargo xtask nixl-setup`.
pub const LIB_DIR_ENV: &str = "KVBRIDGE_NIXL_LIB_DIR";

/// The set-up folder of this source tree (`target/nixl`), where `cargo xtask nixl-setup` puts
/// the runtime.
pub const SETUP_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../target/nixl");

/// Inside a set-up folder: the wheel's NIXL library folder.
const WHEEL_LIB_SUBDIR: &str = ".nixl_cu12.mesonpy.libs";
/// Inside a library folder: the plugin folder the set-up makes (UCX and POSIX only).
const SETUP_PLUGINS: &str = "kvbridge-plugins";
const CAPI: &str = "libnixl_capi.so";

/// A NIXL runtime found on disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Runtime {
    /// The folder holding `libnixl_capi.so` and `libnixl.so`.
    pub lib_dir: PathBuf,
    /// The folder NIXL loads its backend plugins from.
    pub plugin_dir: PathBuf,
}

impl Runtime {
    /// `libnixl_capi.so`, loaded by its full path.
    pub fn capi(&self) -> PathBuf {
        self.lib_dir.join(CAPI)
    }

    /// The runtime in `dir` (a library folder or a set-up folder), if there is one.
    pub fn in_dir(dir: &Path) -> Option<Self> {
        [dir.to_path_buf(), dir.join(WHEEL_LIB_SUBDIR)]
            .into_iter()
            .find(|lib| lib.join(CAPI).is_file())
            .map(|lib_dir| {
                let setup = lib_dir.join(SETUP_PLUGINS);
                let plugin_dir = if setup.is_dir() {
                    setup
                } else {
                    lib_dir.join("plugins")
                };
                Self {
                    lib_dir,
                    plugin_dir,
                }
            })
    }

    /// The runtime named by [`LIB_DIR_ENV`], else the one in [`SETUP_DIR`]; the error names
    /// the command that installs it.
    pub fn locate() -> Result<Self, NixlError> {
        let mut looked = Vec::new();
        if let Some(dir) = std::env::var_os(LIB_DIR_ENV) {
            let dir = PathBuf::from(dir);
            if let Some(rt) = Self::in_dir(&dir) {
                return Ok(rt);
            }
            // An explicit folder that holds no runtime is a mistake: say so, do not fall back.
            return Err(NixlError::RuntimeMissing {
                looked: format!("{} (from {LIB_DIR_ENV})", dir.display()),
            });
        }
        let setup = PathBuf::from(SETUP_DIR);
        if let Some(rt) = Self::in_dir(&setup) {
            return Ok(rt);
        }
        looked.push(format!(
            "{} (the set-up folder; {LIB_DIR_ENV} is not set)",
            setup.display()
        ));
        Err(NixlError::RuntimeMissing {
            looked: looked.join(", "),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_folder_without_the_library_is_no_runtime() {
        let dir = std::env::temp_dir().join(format!("kvbridge-nixl-empty-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(Runtime::in_dir(&dir), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn set_up_and_install_layouts_are_both_found() {
        let root =
            std::env::temp_dir().join(format!("kvbridge-nixl-layout-{}", std::process::id()));
        let lib = root.join(WHEEL_LIB_SUBDIR);
        std::fs::create_dir_all(lib.join(SETUP_PLUGINS)).unwrap();
        std::fs::write(lib.join(CAPI), b"").unwrap();
        let rt = Runtime::in_dir(&root).unwrap();
        assert_eq!(rt.lib_dir, lib);
        assert_eq!(rt.plugin_dir, lib.join(SETUP_PLUGINS));
        // A plain install: the library folder itself, plugins in `plugins/`.
        std::fs::remove_dir_all(lib.join(SETUP_PLUGINS)).unwrap();
        let rt = Runtime::in_dir(&lib).unwrap();
        assert_eq!(rt.capi(), lib.join(CAPI));
        assert_eq!(rt.plugin_dir, lib.join("plugins"));
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn the_missing_runtime_error_names_the_set_up_command() {
        let text = NixlError::RuntimeMissing {
            looked: "/nowhere".to_owned(),
        }
        .to_string();
        assert!(text.contains("cargo xtask nixl-setup"), "{text}");
        assert!(text.contains(LIB_DIR_ENV), "{text}");
    }
}
