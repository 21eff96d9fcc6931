#!/usr/bin/env bash
# Builds the Dockerfile and runs the image, on the CPU: container registries cannot be reached
# from CI, so the base is a Debian bookworm made here with debootstrap, and the wheels (the CPU
# torch among them) are downloaded on the host for the image's Python and served to the build on
# 127.0.0.1. The container serves the default model; the check asks /health and a completion,
# waits for Docker's HEALTHCHECK to say healthy, checks the server's uid (10001) and that every
# C++ CPU kernel loads as built, then `docker stop`s it (SIGTERM) and wants exit code 0 within
# STOP_BOUND seconds. dockerd is started by hand with everything under one folder, no bridge and
# no iptables changes, and stopped by its pid at the end, where the folder is removed.
#
# What this cannot prove (no GPU, no CUDA base here): the CUDA torch, flash-attn, Triton's
# launcher build on a GPU, `--gpus all`. See docs/deployment.md, "Docker, compose, Grafana, Kubernetes".
#
# Usage: .ci/docker_check.sh (as root, after `make install`: it reads .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=$ROOT/.venv/bin/python
STOP_BOUND=${STOP_BOUND:-30}
WHEEL_PORT=${WHEEL_PORT:-18765}
IMAGE=pagedserve-ci:cpu
BASE=pagedserve-ci/debian:bookworm
NAME=pagedserve-ci-$$

W=$(mktemp -d /tmp/pagedserve-docker.XXXXXX)
START=$(date +%s)
say() { echo "docker check: $* ($(($(date +%s) - START)) s)"; }
fail() {
    echo "docker check FAILED: $*" >&2
    exit 1
}

DOCKERD_PID=""
WHEELS_PID=""
cleanup() {
    set +e
    if [ -n "$DOCKERD_PID" ]; then
        docker logs "$NAME" >"$W/container.log" 2>&1 && tail -n 30 "$W/container.log"
        docker rm -f "$NAME" >/dev/null 2>&1
        docker system prune -af >/dev/null 2>&1
        kill "$DOCKERD_PID"
        wait "$DOCKERD_PID" 2>/dev/null
    fi
    [ -n "$WHEELS_PID" ] && kill "$WHEELS_PID" && wait "$WHEELS_PID" 2>/dev/null
    # Overlay mounts dockerd may have left under the folder, before removing it.
    grep -o " $W/[^ ]*" /proc/mounts | sort -r | xargs -r -n1 umount -l
    rm -rf "$W"
}
trap cleanup EXIT

# 1. Tools: Debian's docker.io (daemon and client) and debootstrap.
if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        docker.io debootstrap >/dev/null
fi
say "tools installed"

# 2. The daemon: its own data, exec root and socket under $W; no bridge, so no iptables rules and
# no forwarding (containers use the host's network or none).
dockerd --data-root "$W/root" --exec-root "$W/exec" --pidfile "$W/dockerd.pid" \
    -H "unix://$W/docker.sock" --bridge=none --iptables=false --ip-forward=false \
    --ip-masq=false >"$W/dockerd.log" 2>&1 &
DOCKERD_PID=$!
export DOCKER_HOST="unix://$W/docker.sock"
for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
docker info >/dev/null 2>&1 || { tail "$W/dockerd.log"; fail "dockerd did not start"; }
say "dockerd up"

# 3. The base: a minimal bookworm from the mirror apt uses, imported as an image.
MIRROR=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null ||
    true)
debootstrap --variant=minbase bookworm "$W/rootfs" "${MIRROR:-http://deb.debian.org/debian}" \
    >"$W/debootstrap.log" 2>&1 || { tail "$W/debootstrap.log"; fail "debootstrap"; }
rm -rf "$W"/rootfs/var/cache/apt/archives/*.deb "$W"/rootfs/var/lib/apt/lists/*
tar -C "$W/rootfs" -c . | docker import - "$BASE" >/dev/null
rm -rf "$W/rootfs"
say "base image imported"

# 4. Wheels for the image's interpreter (bookworm: Python 3.11.2), served to the build over
# loopback. pip's --python-version does not reach markers on the full version: redis needs
# async-timeout below 3.11.3, which a resolution here (a later 3.11) leaves out, so it is named.
"$PY" - >"$W/requirements.txt" <<'EOF'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
pins = ["torch==2.13.0", "pip==25.2", "setuptools==80.9.0", "async-timeout>=4.0.3"]
print("\n".join(pins + project["dependencies"]))
EOF
"$PY" -m pip download -q --only-binary=:all: --python-version 3.11.2 --implementation cp \
    -d "$W/wheels" -r "$W/requirements.txt" 2>"$W/download.log" ||
    { tail "$W/download.log"; fail "pip download"; }
"$PY" -m http.server --bind 127.0.0.1 --directory "$W/wheels" "$WHEEL_PORT" \
    >"$W/wheels.log" 2>&1 &
WHEELS_PID=$!
say "wheels downloaded ($(du -sh "$W/wheels" | cut -f1))"

# 5. The same Dockerfile as on a GPU node, on the Debian base with the CPU torch; flash-attn 4
# (CUDA only) left out. The legacy builder (no buildx in Debian's client); --network host: with
# no bridge a RUN step has no network otherwise.
BUILD_START=$(date +%s)
docker build -q --network host -t "$IMAGE" \
    --build-arg BASE_IMAGE="$BASE" \
    --build-arg FLASH_ATTN4_VERSION= \
    --build-arg PIP_NO_INDEX=1 \
    --build-arg PIP_FIND_LINKS="http://127.0.0.1:$WHEEL_PORT/" \
    . >"$W/build.log" 2>&1 || { tail -n 40 "$W/build.log"; fail "docker build"; }
say "image built in $(($(date +%s) - BUILD_START)) s, $(docker image inspect -f '{{.Size}}' "$IMAGE" | numfmt --to=iec)"
# The build stage's layers are no longer needed: give the disk back before running.
docker image prune -f >/dev/null

# 6. Run it on the default model (read-only, readable by the image's uid), with no network:
# every request goes through `docker exec` into the container's own loopback.
MODEL=$("$PY" -c 'from config.engine_config import default_cache_dir
from engine.loading.default_model import default_model_dir
print(default_model_dir(default_cache_dir()))')
chmod -R a+rX "$MODEL"
RUN_START=$(date +%s)
docker run -d --name "$NAME" --network none -e PAGEDSERVE_DEVICE=cpu \
    -v "$MODEL:/models/model:ro" "$IMAGE" >/dev/null
api() { docker exec "$NAME" curl -fsS --max-time 60 "$@"; }
for _ in $(seq 300); do
    api http://127.0.0.1:8000/health >/dev/null 2>&1 && break
    [ "$(docker inspect -f '{{.State.Running}}' "$NAME")" = true ] || fail "the server exited"
    sleep 1
done
api http://127.0.0.1:8000/health >/dev/null || fail "/health did not answer within 300 s"
say "/health answered $(($(date +%s) - RUN_START)) s after docker run"

SERVED=$(api http://127.0.0.1:8000/v1/models | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
COMPLETION=$(api -H 'Content-Type: application/json' http://127.0.0.1:8000/v1/completions \
    -d "{\"model\": \"$SERVED\", \"prompt\": \"The capital of France is\", \"max_tokens\": 8, \"temperature\": 0}")
TEXT=$(printf '%s' "$COMPLETION" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["choices"][0]["text"])')
[ -n "${TEXT// /}" ] || fail "empty completion: $COMPLETION"
say "completion: '$TEXT'"

# The server's uid, and the kernels: every one built in the image loads (none compiled, none
# refused) in the server's own Python.
[ "$(docker exec "$NAME" awk '/^Uid:/ {print $2}' /proc/1/status)" = 10001 ] ||
    fail "the server does not run as uid 10001"
docker exec "$NAME" python -c '
from kernels.cpu import extension, layer_stack, bf16_linear  # loads all five
assert sorted(extension._loaded) == sorted(extension.targets.KERNELS), extension._unavailable
assert all("site-packages" in m.__file__ for m in extension._loaded.values())
' || fail "a C++ CPU kernel did not load in the image"
if docker logs "$NAME" 2>&1 | grep -q "unavailable, torch ops run instead"; then
    fail "the server fell back from a CPU kernel: $(docker logs "$NAME" 2>&1 | grep unavailable)"
fi

for _ in $(seq 60); do
    [ "$(docker inspect -f '{{.State.Health.Status}}' "$NAME")" = healthy ] && break
    sleep 1
done
[ "$(docker inspect -f '{{.State.Health.Status}}' "$NAME")" = healthy ] ||
    fail "HEALTHCHECK says $(docker inspect -f '{{.State.Health.Status}}' "$NAME")"
say "healthy, uid 10001, kernels loaded"

# 7. SIGTERM: the server drains and exits 0 before Docker's kill.
STOP_START=$(date +%s)
docker stop -t "$STOP_BOUND" "$NAME" >/dev/null
STOP_SECONDS=$(($(date +%s) - STOP_START))
CODE=$(docker inspect -f '{{.State.ExitCode}}' "$NAME")
[ "$CODE" = 0 ] && [ "$STOP_SECONDS" -lt "$STOP_BOUND" ] ||
    fail "docker stop: exit code $CODE after $STOP_SECONDS s (bound $STOP_BOUND s)"
say "stopped cleanly in $STOP_SECONDS s; total"
