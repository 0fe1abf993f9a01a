#!/usr/bin/env bash
# Installs gradsync's build, test and demo dependencies from Debian's archive, idempotently.
# Nothing outside Debian's archive is downloaded.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config zlib1g-dev
  libtorch-dev            # libtorch 1.13.1 + c10d (ProcessGroupGloo, TCPStore, FileStore)
  libgloo-dev             # gloo headers that c10d's ProcessGroupGloo.hpp includes (not pulled in by libtorch-dev)
  libopenmpi-dev openmpi-bin  # the mpi backend (Open MPI 4.1: mpi.h, libmpi, mpirun)
  libopenblas0-pthread    # libtorch calls libblas.so.3; reference BLAS is 10-20x slower
  libcli11-dev libfmt-dev nlohmann-json3-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  python3-torch           # reference implementation in tests only, never linked
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
