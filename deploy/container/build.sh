#!/usr/bin/env bash
# Build the orchestrator image with podman, from nothing but Debian and PyPI.
#
#   deploy/container/build.sh [TAG]            (default orchestrator:dev)
#
# BASE_IMAGE=... picks another base (a CUDA PyTorch image, a Neuron DLC) instead of the
# Debian one made here, with TORCH_SPEC= (empty) to keep its torch; WHEELS=DIR mounts a --find-links directory (torch's CPU wheel);
# CACHE=DIR keeps the Debian base as a `podman save` archive between runs.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
tag="${1:-orchestrator:dev}"
export CONTAINERS_CONF="${CONTAINERS_CONF:-$here/containers.conf}"
cache="${CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/orchestrator-container}"
base="${BASE_IMAGE:-}"
t0=$(date +%s)

if [ -z "$base" ]; then
  base="localhost/orchestrator-base:bookworm"
  if ! podman image exists "$base"; then
    if [ -f "$cache/base.tar" ]; then
      podman load -q -i "$cache/base.tar" >/dev/null
    else
      mkdir -p "$cache"
      # A minimal Debian with Python 3.11 (torch 2.13's CPU wheel is cp311).
      mmdebstrap --quiet --variant=minbase --format=tar \
        --include=python3,python3-venv,ca-certificates,procps \
        bookworm - http://deb.debian.org/debian | podman import -q - "$base" >/dev/null
      podman save -q -o "$cache/base.tar.part" "$base" && mv "$cache/base.tar.part" "$cache/base.tar"
    fi
  fi
  echo "base ready after $(( $(date +%s) - t0 )) s"
fi

wheels="${WHEELS:-}"
if [ -z "$wheels" ]; then  # where pip finds torch here (pip config's find-links), if any
  wheels="$(pip config get global.find-links 2>/dev/null || true)"
fi
mounts=()
if [ -n "$wheels" ] && [ -d "$wheels" ]; then
  mounts+=(--volume "$wheels:/wheels:ro")
fi
# pip in the build verifies PyPI's certificates against the host's bundle (a proxy's CA).
mounts+=(--volume "/etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/host-ca.crt:ro")

args=(--build-arg "BASE_IMAGE=$base")
if [ -n "${TORCH_SPEC+set}" ]; then args+=(--build-arg "TORCH_SPEC=$TORCH_SPEC"); fi
podman build --network=host "${args[@]}" "${mounts[@]}" \
  -f "$here/Dockerfile" -t "$tag" "$repo"
echo "image $tag built in $(( $(date +%s) - t0 )) s"
