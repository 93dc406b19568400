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
# images (preheat.testing.registry): a real registry and a real OCI client
command -v skopeo >/dev/null 2>&1 || need+=(skopeo)
[ -x /usr/bin/docker-registry ] || need+=(docker-registry)
command -v ctr >/dev/null 2>&1 && command -v containerd >/dev/null 2>&1 || need+=(containerd) # ctr pulls through the node mirror (tests start their own containerd)
command -v c++ >/dev/null 2>&1 || need+=(g++)
command -v pypy3 >/dev/null 2>&1 || need+=(pypy3) # tests/unit/test_sim_pypy.py: the simulator on PyPy (benchmarks/pypy.py)
# Kubernetes test cluster (scripts/build-kube.sh, preheat.testing.kube): Go 1.19 builds
# kube-apiserver/-controller-manager/-scheduler 1.20.2 from Debian's source package;
# reflect2 v1.0.2 replaces the vendored v1.0.1 that crashes under Go >= 1.18; etcd 3.4 and
# openssl run the cluster; dpkg-dev unpacks the source package; make and rsync build it.
command -v go >/dev/null 2>&1 || [ -x /usr/lib/go/bin/go ] || need+=(golang-go)
command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
command -v openssl >/dev/null 2>&1 || need+=(openssl)
command -v dpkg-source >/dev/null 2>&1 || need+=(dpkg-dev)
command -v make >/dev/null 2>&1 || need+=(make)
command -v rsync >/dev/null 2>&1 || need+=(rsync) # the Kubernetes Makefile copies generators with it
[ -d /usr/share/gocode/src/github.com/modern-go/reflect2 ] || need+=(golang-github-modern-go-reflect2-dev)
# `apt-get source kubernetes` needs deb-src entries: a copy of the deb822 sources file
# with `Types: deb-src` (written once; apt-get update below then fetches the source index).
DEBSRC=/etc/apt/sources.list.d/preheat-deb-src.sources
if [ -f /etc/apt/sources.list.d/debian.sources ] && [ ! -f "$DEBSRC" ] \
  && ! grep -rqs '^Types:.*deb-src' /etc/apt/sources.list.d/ /etc/apt/sources.list; then
  need+=(deb-src)
fi
if [ ${#need[@]} -eq 0 ]; then
  echo "system dependencies present"
  exit 0
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
echo "installing: ${need[*]}"
pkgs=()
for p in "${need[@]}"; do
  if [ "$p" = deb-src ]; then
    sed 's/^Types: deb$/Types: deb-src/' /etc/apt/sources.list.d/debian.sources | $SUDO tee "$DEBSRC" >/dev/null
  else
    pkgs+=("$p")
  fi
done
$SUDO apt-get update -qq
if [ ${#pkgs[@]} -gt 0 ]; then
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null
fi
# etcd-server's package may start a system etcd on :2379; the tests run their own on free ports.
if command -v systemctl >/dev/null 2>&1; then $SUDO systemctl disable --now etcd >/dev/null 2>&1 || true; fi
# nginx-light's package starts a system nginx on :80; the tests run their own on free ports.
if command -v systemctl >/dev/null 2>&1; then $SUDO systemctl disable --now nginx >/dev/null 2>&1 || true; fi
# Stop only that system nginx (by its pid file), never one a test started.
[ -s /run/nginx.pid ] && $SUDO /usr/sbin/nginx -s quit >/dev/null 2>&1 || true
echo "system dependencies installed"
