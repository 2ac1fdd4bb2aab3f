//! Where the built wasm filters are, found one way for every test, bench and launcher.

use std::path::{Path, PathBuf};

/// Overrides the directory the built filters are looked up in.
pub const WASM_DIR_ENV: &str = "KVOY_WASM_DIR";

/// The workspace's root directory (the kit's parent), as it was at build time.
pub fn workspace_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().unwrap_or(manifest).to_path_buf()
}

/// The workspace's target directory: `$CARGO_TARGET_DIR` (a relative one is taken from the
/// workspace root, where `make` runs cargo), else `<workspace>/target`.
pub fn target_dir() -> PathBuf {
    let root = workspace_root();
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => root.join(dir),
        None => root.join("target"),
    }
}

/// The directory of the release wasm filters (`make wasm`): `$KVOY_WASM_DIR`, else
/// `<target dir>/wasm32-wasip1/release`.
pub fn wasm_dir() -> PathBuf {
    match std::env::var_os(WASM_DIR_ENV) {
        Some(dir) => PathBuf::from(dir),
        None => target_dir().join("wasm32-wasip1").join("release"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_root_holds_the_workspace_manifest() {
        assert!(workspace_root().join("Cargo.toml").is_file());
        assert!(workspace_root().join("testkit").is_dir());
    }

    #[test]
    fn the_wasm_dir_ends_in_the_release_target() {
        if std::env::var_os(WASM_DIR_ENV).is_none() {
            assert!(wasm_dir().ends_with("wasm32-wasip1/release"));
        }
    }
}
