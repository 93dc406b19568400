#!/usr/bin/env bash
# Installs the real servers and tools the tests and benchmarks start on 127.0.0.1.
# Idempotent: installs only what is missing. Needs root (CI runs as root) or sudo.
set -euo pipefail
need=()
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || need+=(nginx-light)
command -v aria2c >/dev/null 2>&1 || need+=(aria2)
command -v curl >/dev/null 2>&1 || need+=(curl)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v cmake >/dev/null 2>&1 || need+=(cmake)
command -v c++ >/dev/null 2>&1 || need+=(g++)
if [ ${#need[@]} -eq 0 ]; then
  echo "system dependencies present"
  exit 0
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
echo "installing: ${need[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
# nginx-light's package starts a system nginx on :80; the tests run their own on free ports.
if command -v systemctl >/dev/null 2>&1; then $SUDO systemctl disable --now nginx >/dev/null 2>&1 || true; fi
# Stop only that system nginx (by its pid file), never one a test started.
[ -s /run/nginx.pid ] && $SUDO /usr/sbin/nginx -s quit >/dev/null 2>&1 || true
echo "system dependencies installed"
