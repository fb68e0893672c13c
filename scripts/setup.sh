#!/usr/bin/env bash
# Installs every system package dkfac needs on Debian 12 (bookworm). Safe to re-run.
set -euo pipefail

packages=(
  build-essential cmake ninja-build ccache pkg-config
  libtorch-dev libgloo-dev libopenblas0-pthread zlib1g-dev
  libgtest-dev libbenchmark-dev libcli11-dev nlohmann-json3-dev libspdlog-dev
  dataset-fashion-mnist gnuplot-nox procps python3 iproute2
  clang libclang-rt-14-dev
  python3-torch python3-torchvision python3-pytest pybind11-dev python3-dev openmpi-bin
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if ((${#missing[@]} == 0)); then
  echo "setup: all ${#packages[@]} packages already installed"
  exit 0
fi

sudo=""
if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
echo "setup: installing ${missing[*]}"
$sudo apt-get update -q
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
