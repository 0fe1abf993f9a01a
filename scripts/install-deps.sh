#!/usr/bin/env bash
# Installs gradsync's build, test and demo dependencies, idempotently, for both libtorch lines:
# - Debian's archive: the toolchain, Open MPI, the libraries, Debian's libtorch 1.13.1 and python3-torch;
# - the Python package index: torch==$GRADSYNC_TORCH_VERSION (default 2.11.0) in a virtual environment at
#   $GRADSYNC_VENV (default ~/.cache/gradsync/venv-torch-VERSION), reused when it holds that version; pip's cache
#   keeps the downloads (several GB: the CUDA wheel's nvidia-* dependencies) for the next environment.
# Nothing else is downloaded.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config zlib1g-dev
  libtorch-dev            # libtorch 1.13.1 + c10d (ProcessGroupGloo, TCPStore, FileStore)
  libgloo-dev             # gloo headers that c10d's ProcessGroupGloo.hpp includes (not pulled in by libtorch-dev,
                          # not shipped by the torch wheel); the library only for 1.13 (cmake/torch_line.cmake)
  libopenmpi-dev openmpi-bin  # the mpi backend (Open MPI 4.1: mpi.h, libmpi, mpirun)
  libopenblas0-pthread    # libtorch calls libblas.so.3; reference BLAS is 10-20x slower
  libcli11-dev libfmt-dev nlohmann-json3-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  python3-torch           # 1.13's reference implementation in tests only, never linked
  python3-venv            # the virtual environment of the torch wheel
  dataset-fashion-mnist   # the lab's real data
  gnuplot-nox             # the lab's plots
  fortunes fortunes-min   # real text for the GPT (--data fortunes, the lab's tokens experiment)
)

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -gt 0 ]; then
  echo "install-deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "install-deps: all ${#PACKAGES[@]} packages present"
fi

# libtorch resolves BLAS through the libblas.so.3 alternative: make sure it is OpenBLAS.
blas=$(readlink -f /usr/lib/x86_64-linux-gnu/libblas.so.3 2>/dev/null || true)
case "$blas" in
  *openblas*) echo "install-deps: libblas.so.3 -> $blas (OpenBLAS, good)";;
  *)
    cand=$(update-alternatives --list libblas.so.3-x86_64-linux-gnu 2>/dev/null | grep openblas | head -1 || true)
    if [ -n "$cand" ]; then
      $SUDO update-alternatives --set libblas.so.3-x86_64-linux-gnu "$cand"
      echo "install-deps: switched libblas.so.3 to $cand"
    else
      echo "install-deps: WARNING libblas.so.3 -> ${blas:-none}, not OpenBLAS: training will be 10-20x slower" >&2
    fi;;
esac

# The libtorch 2.x line: the torch wheel (its C++ SDK under torch/include, torch/lib, torch/share/cmake; its Python
# is the 2.x reference). Debian's python3 makes the environment, so it does not depend on anything else on the PATH.
TORCH_VERSION="${GRADSYNC_TORCH_VERSION:-2.11.0}"
VENV="${GRADSYNC_VENV:-$HOME/.cache/gradsync/venv-torch-$TORCH_VERSION}"
have=$("$VENV/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)
if [ "$have" = "$TORCH_VERSION" ]; then
  echo "install-deps: torch $TORCH_VERSION present in $VENV"
else
  echo "install-deps: installing torch==$TORCH_VERSION into $VENV"
  /usr/bin/python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "torch==$TORCH_VERSION" numpy
  "$VENV/bin/python" -c 'import torch; print("install-deps: torch", torch.__version__, "at", torch.utils.cmake_prefix_path)'
fi
