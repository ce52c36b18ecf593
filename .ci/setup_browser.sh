#!/usr/bin/env bash
# Install what the browser tests (pytest -m browser) need: Debian's Chromium
# and a font, driven by the `playwright` Python package from PyPI.
# Idempotent: does nothing when Chromium is already installed.
# Never runs `playwright install` (no browser download).
set -euo pipefail

if command -v chromium >/dev/null 2>&1 && dpkg -s fonts-dejavu-core >/dev/null 2>&1; then
  echo "chromium already installed: $(chromium --version 2>/dev/null || echo unknown)"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get -o DPkg::Lock::Timeout=900 update -q
$SUDO apt-get -o DPkg::Lock::Timeout=900 install -y -q --no-install-recommends chromium fonts-dejavu-core
chromium --version
