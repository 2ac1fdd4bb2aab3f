//! Embeds the pool view's explain panel when it has been built: `make explain` compiles
//! `kvoy-explain` to WebAssembly and runs `wasm-bindgen --target web` into `target/explain/`
//! (or `$KVOY_EXPLAIN_DIR`); this script writes `explain_assets.rs` into `OUT_DIR`, which
//! `src/page.rs` includes: the generated script and module, or empty ones and `BUILT = false`,
//! in which case the page says that the panel was not built and how to build it.

use std::env;
use std::error::Error;
use std::fs;
use std::path::PathBuf;

/// The files `wasm-bindgen --target web` writes for the `kvoy_explain` module.
const SCRIPT: &str = "kvoy_explain.js";
const MODULE: &str = "kvoy_explain_bg.wasm";

fn main() -> Result<(), Box<dyn Error>> {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=KVOY_EXPLAIN_DIR");
    println!("cargo:rerun-if-env-changed=CARGO_TARGET_DIR");
    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").ok_or("no CARGO_MANIFEST_DIR")?);
    let dir = match env::var_os("KVOY_EXPLAIN_DIR") {
        Some(d) => PathBuf::from(d),
        None => env::var_os("CARGO_TARGET_DIR")
            .map_or_else(|| manifest.join("../target"), PathBuf::from)
            .join("explain"),
    };
    // Cargo watches the folder for new files (a build of the panel reruns this script); a
    // path that does not exist would rerun it, and rebuild this crate, on every build.
    let _ = fs::create_dir_all(&dir);
    println!("cargo:rerun-if-changed={}", dir.display());
    let (script, module) = (dir.join(SCRIPT), dir.join(MODULE));
    let code = if script.is_file() && module.is_file() {
        format!(
            "/// Whether the explain panel was built into this binary.\n\
             pub const BUILT: bool = true;\n\
             pub const SCRIPT: &[u8] = include_bytes!({script:?});\n\
             pub const MODULE: &[u8] = include_bytes!({module:?});\n"
        )
    } else {
        "/// Whether the explain panel was built into this binary.\n\
         pub const BUILT: bool = false;\n\
         pub const SCRIPT: &[u8] = b\"\";\n\
         pub const MODULE: &[u8] = b\"\";\n"
            .to_owned()
    };
    let out = PathBuf::from(env::var_os("OUT_DIR").ok_or("no OUT_DIR")?).join("explain_assets.rs");
    fs::write(out, code)?;
    Ok(())
}
