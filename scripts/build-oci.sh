#!/usr/bin/env bash
# Packs kvoy's wasm filters as OCI images, in one OCI image layout directory (oci-layout,
# index.json, blobs/sha256/), in the "compat" variant of the Wasm image specification that
# Istio (WasmPlugin, and EnvoyFilter `oci://` code through the istio-agent) and Envoy Gateway
# (EnvoyExtensionPolicy `code.type: Image`) pull:
#   - one layer, application/vnd.oci.image.layer.v1.tar+gzip, holding the module as
#     `plugin.wasm` at its root;
#   - a standard image config (application/vnd.oci.image.config.v1+json), architecture wasm,
#     os wasip1, whose rootfs.diff_ids is the digest of the uncompressed layer;
#   - the manifest annotation module.wasm.image/variant=compat.
# The output is reproducible: file times, owners and gzip headers are fixed.
#
# usage: scripts/build-oci.sh [-o OUT_DIR] [-v VERSION] [MODULE.wasm ...]
#   MODULE.wasm  default: kvoy, kvoy_session, kvoy_admission and kvoy_prefix_affinity .wasm from
#                $KVOY_WASM_DIR, else ${CARGO_TARGET_DIR:-target}/wasm32-wasip1/release (`make wasm`)
#   -o OUT_DIR   default: target/oci/kvoy (replaced if it is an OCI layout already)
#   -v VERSION   org.opencontainers.image.version (default: the workspace version)
# Each image's ref name in index.json is the module name with `-` for `_` (kvoy-prefix-affinity).
# Push with any OCI tool, e.g.
#   skopeo copy oci:target/oci/kvoy:kvoy-prefix-affinity docker://REGISTRY/kvoy/kvoy-prefix-affinity:0.1.0
# and pin the manifest digest printed here (WasmPlugin `sha256`, EnvoyExtensionPolicy
# `image.sha256`, or REGISTRY/...@sha256:DIGEST).
# Needs only bash, coreutils (sha256sum, stat, od), tar and gzip.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${root}/target/oci/kvoy"
version="$(sed -n 's/^version = "\(.*\)"/\1/p' "${root}/Cargo.toml" | head -n 1)"
version="${version:-0.0.0}"

die() { printf 'build-oci: %s\n' "$*" >&2; exit 1; }

while getopts ":o:v:h" opt; do
    case "${opt}" in
        o) out="${OPTARG}" ;;
        v) version="${OPTARG}" ;;
        h) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        :) die "-${OPTARG} needs a value" ;;
        *) die "unknown option -${OPTARG} (-h for help)" ;;
    esac
done
shift $((OPTIND - 1))

modules=("$@")
if [ "${#modules[@]}" -eq 0 ]; then
    wasm_dir="${KVOY_WASM_DIR:-${CARGO_TARGET_DIR:-${root}/target}/wasm32-wasip1/release}"
    for name in kvoy kvoy_session kvoy_admission kvoy_prefix_affinity; do
        modules+=("${wasm_dir}/${name}.wasm")
    done
fi

for module in "${modules[@]}"; do
    [ -f "${module}" ] || die "${module}: no such file (build the filters with \`make wasm\`)"
    magic="$(od -An -tx1 -N4 "${module}" | tr -d ' \n')"
    [ "${magic}" = "0061736d" ] || die "${module}: not a wasm module (no \\0asm header)"
    base="$(basename "${module}" .wasm)"
    [[ "${base}" =~ ^[a-z0-9]+([._-][a-z0-9]+)*$ ]] \
        || die "${module}: the name must be lowercase letters, digits and . _ - separators"
done

# Never delete a directory that is not an OCI layout (or empty).
if [ -e "${out}" ]; then
    if [ -f "${out}/oci-layout" ] || [ -z "$(ls -A "${out}")" ]; then
        rm -rf "${out}"
    else
        die "${out} exists and is not an OCI layout; not replacing it"
    fi
fi
mkdir -p "${out}/blobs/sha256"
work="$(mktemp -d)"
trap 'rm -rf "${work}"' EXIT

sha() { sha256sum "$1" | cut -d' ' -f1; }
size() { stat -c %s "$1"; }

# Stores FILE as a blob; prints its hex digest.
store() {
    local digest
    digest="$(sha "$1")"
    cp "$1" "${out}/blobs/sha256/${digest}"
    printf '%s' "${digest}"
}

manifests=""
summary=""
for module in "${modules[@]}"; do
    base="$(basename "${module}" .wasm)"
    ref="${base//_/-}"
    rm -rf "${work:?}"/*
    mkdir "${work}/root"
    cp "${module}" "${work}/root/plugin.wasm"
    chmod 0644 "${work}/root/plugin.wasm"
    tar -C "${work}/root" --format=ustar --sort=name --owner=0 --group=0 --numeric-owner \
        --mtime='@0' -cf "${work}/layer.tar" plugin.wasm
    gzip -9 -n -c "${work}/layer.tar" > "${work}/layer.tar.gz"
    diff_id="$(sha "${work}/layer.tar")"
    layer="$(store "${work}/layer.tar.gz")"
    layer_size="$(size "${work}/layer.tar.gz")"

    printf '{"architecture":"wasm","os":"wasip1","config":{},"rootfs":{"type":"layers","diff_ids":["sha256:%s"]}}' \
        "${diff_id}" > "${work}/config.json"
    config="$(store "${work}/config.json")"
    config_size="$(size "${work}/config.json")"

    printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:%s","size":%s},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip","digest":"sha256:%s","size":%s,"annotations":{"org.opencontainers.image.title":"plugin.wasm"}}],"annotations":{"module.wasm.image/variant":"compat","org.opencontainers.image.title":"%s","org.opencontainers.image.version":"%s"}}' \
        "${config}" "${config_size}" "${layer}" "${layer_size}" "${ref}" "${version}" \
        > "${work}/manifest.json"
    manifest="$(store "${work}/manifest.json")"
    manifest_size="$(size "${work}/manifest.json")"

    [ -z "${manifests}" ] || manifests+=","
    manifests+="$(printf '{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:%s","size":%s,"annotations":{"org.opencontainers.image.ref.name":"%s"}}' \
        "${manifest}" "${manifest_size}" "${ref}")"
    summary+="$(printf '%-22s manifest sha256:%s  module sha256:%s' "${ref}" "${manifest}" "$(sha "${module}")")"$'\n'
done

printf '{"imageLayoutVersion":"1.0.0"}' > "${out}/oci-layout"
printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[%s]}' \
    "${manifests}" > "${out}/index.json"

printf 'build-oci: OCI image layout in %s (version %s)\n%s' "${out}" "${version}" "${summary}"
