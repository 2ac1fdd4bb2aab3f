//! The built wasm filters: where they are (found one way for every test, bench and launcher),
//! their file names, and whether they are built and newer than their sources.

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

/// File name of the combined filter module.
pub const KVOY_WASM: &str = "kvoy.wasm";

/// File name of the admission filter module.
pub const ADMISSION_WASM: &str = "kvoy_admission.wasm";

/// File name of the session filter module.
pub const SESSION_WASM: &str = "kvoy_session.wasm";

/// File name of the prefix-affinity filter module.
pub const PREFIX_AFFINITY_WASM: &str = "kvoy_prefix_affinity.wasm";

/// A filter module that is not built.
#[derive(Debug, thiserror::Error)]
#[error(
    "the filter module {} is missing: build it with `make wasm` \
     (cargo build --release --target wasm32-wasip1 -p kvoy-filter -p kvoy-prefix-affinity -p kvoy-session -p kvoy-admission)",
    .0.display()
)]
pub struct MissingModule(pub PathBuf);

/// The combined module in `wasm_dir` (the separate ones checked too), or an error that says how
/// to build them.
pub fn require_filter_wasm(wasm_dir: &Path) -> Result<PathBuf, MissingModule> {
    for module in [
        KVOY_WASM,
        SESSION_WASM,
        ADMISSION_WASM,
        PREFIX_AFFINITY_WASM,
    ] {
        let path = wasm_dir.join(module);
        if !path.is_file() {
            return Err(MissingModule(path));
        }
    }
    Ok(wasm_dir.join(KVOY_WASM))
}

/// Source files (under `filters/` and `shared/`, outside `benches/` and `tests/`) newer than
/// the built module at `wasm`: when there are any, the module is stale and `make wasm` should run first. Empty if `wasm` is
/// missing or times are unavailable.
pub fn stale_sources(wasm: &Path) -> Vec<PathBuf> {
    let Ok(built) = std::fs::metadata(wasm).and_then(|m| m.modified()) else {
        return Vec::new();
    };
    let root = workspace_root();
    let mut newer = Vec::new();
    let mut dirs = vec![(root.join("filters"), 0u32), (root.join("shared"), 0u32)];
    // Bounded walk: a few levels deep, a few thousand entries at most.
    let mut budget = 5000u32;
    while let Some((dir, depth)) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            budget = budget.saturating_sub(1);
            if budget == 0 {
                return newer;
            }
            let path = entry.path();
            let Ok(meta) = entry.metadata() else { continue };
            if meta.is_dir() {
                // Benches and integration tests are not compiled into the module.
                let name = entry.file_name();
                if depth < 6 && !["target", "benches", "tests"].iter().any(|n| name == *n) {
                    dirs.push((path, depth + 1));
                }
            } else if path.extension().is_some_and(|e| e == "rs" || e == "toml")
                && meta.modified().is_ok_and(|m| m > built)
            {
                newer.push(path);
            }
        }
    }
    newer
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
