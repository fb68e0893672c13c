#!/usr/bin/env bash
# Installs what dkfac needs on Debian 12 (bookworm). Safe to re-run.
#  - Debian packages for the C++ side (compilers, CMake, CLI11, nlohmann-json, GoogleTest, gloo's headers,
#    gnuplot, Open MPI's mpirun, Fashion-MNIST); nothing is installed when all are present.
#  - A virtual environment (.venv, or $DKFAC_VENV) with the pinned torch from PyPI and the Python tools
#    (scripts/requirements.txt); reused when it already holds them.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(
  build-essential cmake ninja-build ccache pkg-config zlib1g-dev
  libgtest-dev libbenchmark-dev libcli11-dev nlohmann-json3-dev libspdlog-dev libgloo-dev
  dataset-fashion-mnist gnuplot-nox procps iproute2 openmpi-bin
  clang libclang-rt-14-dev
  python3 python3-venv python3-dev
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]} == 0)); then
  echo "setup: all ${#packages[@]} Debian packages already installed"
else
  sudo=""
  if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
  echo "setup: installing ${missing[*]}"
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

venv=${DKFAC_VENV:-.venv}
requirements=scripts/requirements.txt
stamp=$venv/.dkfac-requirements
if [[ -x $venv/bin/python ]] && cmp -s "$requirements" "$stamp" && "$venv/bin/python" -c "import torch" 2>/dev/null; then
  echo "setup: $venv already has $(grep -v '^#' "$requirements" | tr '\n' ' ')"
  exit 0
fi
python=${DKFAC_BASE_PYTHON:-python3}
echo "setup: creating $venv with $($python --version) and installing $requirements (torch from PyPI: about 2.7 GB)"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q -r "$requirements"
cp "$requirements" "$stamp"
"$venv/bin/python" -c "import torch; print('setup:', '$venv', 'has torch', torch.__version__)"
