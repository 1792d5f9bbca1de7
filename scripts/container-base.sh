#!/usr/bin/env bash
# Build a container base image without a registry: mmdebstrap makes a Debian bookworm
# root file system with python3, python3-venv and ca-certificates from the Debian
# packages, and `podman import` turns it into an image (docs/deploying.md):
#
#   scripts/container-base.sh [IMAGE]        # default localhost/relay-base:bookworm
#   podman build --format docker --build-arg BASE=localhost/relay-base:bookworm -t relay .
#
# Environment: MIRROR (default http://deb.debian.org/debian), CONTAINERS_CONF (podman's
# settings; .ci/containers.conf on machines where crun or the default ulimits fail).
# Needs root (or a user namespace mmdebstrap can use), mmdebstrap and podman.
set -euo pipefail

IMAGE="${1:-localhost/relay-base:bookworm}"
MIRROR="${MIRROR:-http://deb.debian.org/debian}"
command -v mmdebstrap >/dev/null || { echo "container-base.sh: mmdebstrap is required" >&2; exit 2; }
command -v podman >/dev/null || { echo "container-base.sh: podman is required" >&2; exit 2; }

WORK="$(mktemp -d "${TMPDIR:-/tmp}/relay-base.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

# minbase + the three packages; no documentation, no apt lists (smaller image).
mmdebstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
    bookworm "$WORK/rootfs.tar" "$MIRROR"

podman import --change 'CMD ["/bin/bash"]' "$WORK/rootfs.tar" "$IMAGE" >/dev/null
echo "built $IMAGE"
