#!/usr/bin/env bash
# Prepare a fresh Debian 12 machine (as root) for the sandbox tests. Idempotent.
#
#   1. apt: bubblewrap (local backend), docker.io, debootstrap (image build). (The children's seccomp
#      filter is classic BPF built with the stdlib (ctypes) in the fork server: no libseccomp needed.)
#   2. start dockerd in the background WITHOUT iptables/bridge, with its own data root
#      and socket (/run/agentrl/docker.sock): it works on machines without a network stack
#      for containers, and never touches a system docker
#   3. build the default image with `agentrl sandbox build-image` (debootstrap + docker import;
#      nothing is pulled from a registry)
#   4. write /run/agentrl/docker.env (`export DOCKER_HOST=...`); the tests read it too.
#      CI: `source /run/agentrl/docker.env` (the script also prints the export line last).
#
# Docker trouble never fails this script: the docker tests then skip with the reason.
# Env: AGENTRL_PYTHON (python with agentrl installed; default: python3), DEBIAN_MIRROR.
set -uo pipefail

RUN_DIR=/run/agentrl
SOCK="$RUN_DIR/docker.sock"
DATA_ROOT=/var/lib/agentrl-docker
ENV_FILE="$RUN_DIR/docker.env"
LOG=/var/log/agentrl-dockerd.log
PY="${AGENTRL_PYTHON:-python3}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
export DEBIAN_FRONTEND=noninteractive

log() { echo "[setup_sandboxes] $*" >&2; }

if [ "$(id -u)" != 0 ]; then
  log "must run as root"; exit 1
fi

missing() { for pkg in "$@"; do dpkg -s "$pkg" >/dev/null 2>&1 || echo "$pkg"; done; }
need=$(missing bubblewrap docker.io debootstrap)
if [ -n "$need" ]; then
  log "installing" $need
  apt-get update -qq || log "apt-get update failed"
  # bubblewrap is required (the default backend); the docker parts are optional
  apt-get install -y -qq --no-install-recommends bubblewrap || { log "cannot install bubblewrap"; exit 1; }
  # shellcheck disable=SC2086
  apt-get install -y -qq --no-install-recommends $(missing docker.io debootstrap) ca-certificates \
    || log "docker.io/debootstrap install failed: docker tests will skip"
fi
command -v bwrap >/dev/null || { log "bubblewrap missing after install"; exit 1; }
if ! command -v dockerd >/dev/null; then
  log "no dockerd: docker tests will skip"; rm -f "$ENV_FILE"; exit 0
fi

mkdir -p "$RUN_DIR" "$DATA_ROOT"
docker_ok() { DOCKER_HOST="unix://$SOCK" timeout 10 docker info >/dev/null 2>&1; }

if ! docker_ok; then
  if [ -f "$RUN_DIR/dockerd.pid" ] && kill -0 "$(cat "$RUN_DIR/dockerd.pid")" 2>/dev/null; then
    log "dockerd (pid $(cat "$RUN_DIR/dockerd.pid")) is running but not answering yet"
  else
    rm -f "$SOCK" "$RUN_DIR/dockerd.pid"
    log "starting dockerd (log: $LOG)"
    nohup dockerd --iptables=false --ip6tables=false --bridge=none \
      --data-root "$DATA_ROOT" --exec-root "$RUN_DIR/docker-exec" \
      --pidfile "$RUN_DIR/dockerd.pid" -H "unix://$SOCK" >"$LOG" 2>&1 &
  fi
  for _ in $(seq 1 60); do docker_ok && break; sleep 1; done
fi

if docker_ok; then
  echo "export DOCKER_HOST=unix://$SOCK" >"$ENV_FILE"
  log "dockerd answers at unix://$SOCK"
  # `agentrl sandbox build-image`; the module form works before the CLI entry point exists
  AGENTRL_BIN="$(dirname "$(command -v "$PY")")/agentrl"
  if [ -x "$AGENTRL_BIN" ]; then build=("$AGENTRL_BIN" sandbox build-image); else
    build=("$PY" -m agentrl.sandboxes.cli build-image); fi
  if DOCKER_HOST="unix://$SOCK" "${build[@]}" --mirror "$MIRROR" >&2; then
    log "image agentrl/python:3.11 is ready"
  else
    log "image build failed: docker tests will skip"
  fi
else
  rm -f "$ENV_FILE"
  log "dockerd did not start (see $LOG): docker tests will skip"
  tail -n 20 "$LOG" >&2 2>/dev/null || true
fi

[ -f "$ENV_FILE" ] && cat "$ENV_FILE"
exit 0
