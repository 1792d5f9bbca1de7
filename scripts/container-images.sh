#!/usr/bin/env bash
# Build the images of compose.yaml's stack without a registry (docs/deploying.md):
#
#   1. the base: Debian bookworm with python3, python3-venv and ca-certificates, made by
#      scripts/container-base.sh from Debian packages (skipped when it exists);
#   2. relay's image (Dockerfile) on that base;
#   3. a Redis image: Debian's redis-server on the same base (etc/redis/Dockerfile).
#
#   scripts/container-images.sh
#   export RELAY_BASE=localhost/relay-base:bookworm RELAY_REDIS_IMAGE=localhost/relay-redis:bookworm
#   podman-compose up -d
#
# Environment (defaults in brackets):
#   RELAY_BASE         the base image             [localhost/relay-base:bookworm]
#   RELAY_IMAGE        relay's image              [localhost/relay:latest, compose.yaml's]
#   RELAY_REDIS_IMAGE  the Redis image            [localhost/relay-redis:bookworm]
#   FRESH=1            rebuild everything: a new base, no layer cache (CI does)
#   CA_BUNDLE          a CA bundle file mounted read-only over the image's own while relay's
#                      dependencies are installed with pip, for machines that reach the
#                      package index through their own certificate chain
#                      [/etc/ssl/certs/ca-certificates.crt when it exists; empty: none]
#   CONTAINERS_CONF    podman's settings: $PWD/.ci/containers.conf on machines like CI's
#                      (runc, no default ulimits; docs/deploying.md)
#   MIRROR             the Debian mirror [http://deb.debian.org/debian]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

RELAY_BASE="${RELAY_BASE:-localhost/relay-base:bookworm}"
RELAY_IMAGE="${RELAY_IMAGE:-localhost/relay:latest}"
RELAY_REDIS_IMAGE="${RELAY_REDIS_IMAGE:-localhost/relay-redis:bookworm}"
MIRROR="${MIRROR:-http://deb.debian.org/debian}"
CA_BUNDLE="${CA_BUNDLE-/etc/ssl/certs/ca-certificates.crt}"
export MIRROR
command -v podman >/dev/null || { echo "container-images.sh: podman is required" >&2; exit 2; }

cache=()
if [[ -n "${FRESH:-}" ]]; then cache=(--no-cache); fi
ca=()
if [[ -n "$CA_BUNDLE" && -e "$CA_BUNDLE" ]]; then
    ca=(-v "$CA_BUNDLE:/etc/ssl/certs/ca-certificates.crt:ro")
fi

step() {  # step WHAT IMAGE COMMAND...: run it (its output: errors only), say how long it
          # took, and remove the image IMAGE named before if it was replaced (unless in use)
    local what="$1" image="$2" started=$SECONDS old new
    shift 2
    old="$(podman image inspect --format '{{.Id}}' "$image" 2>/dev/null || true)"
    "$@" >/dev/null
    echo "container-images.sh: $what in $((SECONDS - started))s"
    new="$(podman image inspect --format '{{.Id}}' "$image" 2>/dev/null || true)"
    if [[ -n "$old" && "$old" != "$new" ]]; then
        replaced+=("$old")
        podman rmi "$old" >/dev/null 2>&1 || true
    fi
}
replaced=()

if [[ -n "${FRESH:-}" ]] || ! podman image exists "$RELAY_BASE"; then
    step "base $RELAY_BASE" "$RELAY_BASE" "$ROOT/scripts/container-base.sh" "$RELAY_BASE"
else
    echo "container-images.sh: base $RELAY_BASE exists (FRESH=1 rebuilds it)"
fi
step "relay $RELAY_IMAGE" "$RELAY_IMAGE" podman build -q --format docker "${cache[@]}" "${ca[@]}" \
    --build-arg "BASE=$RELAY_BASE" -t "$RELAY_IMAGE" "$ROOT"
step "redis $RELAY_REDIS_IMAGE" "$RELAY_REDIS_IMAGE" podman build -q --format docker "${cache[@]}" \
    --build-arg "BASE=$RELAY_BASE" --build-arg "MIRROR=$MIRROR" \
    -t "$RELAY_REDIS_IMAGE" "$ROOT/etc/redis"
for old in "${replaced[@]}"; do  # an old base goes once the images built on it have
    podman rmi "$old" >/dev/null 2>&1 || true
done
echo "container-images.sh: built; for compose.yaml's stack:"
echo "  export RELAY_BASE=$RELAY_BASE RELAY_IMAGE=$RELAY_IMAGE RELAY_REDIS_IMAGE=$RELAY_REDIS_IMAGE"
