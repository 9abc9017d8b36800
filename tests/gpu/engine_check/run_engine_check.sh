#!/usr/bin/env bash
# The engine's device check on a machine with an NVIDIA GPU, without
# TensorFlow or Bazel: builds tests/gpu/engine_check/engine_check.cc with the
# engine's sources against the machine's CUDA (nvcc's toolkit), the headers
# and library of the Python package nvidia-nccl-cu13, and an Open MPI carried
# in the working tree (Debian packages unpacked; fetch them here, where apt
# works, with `tests/gpu/engine_check/run_engine_check.sh --fetch-mpi`, and
# name .mpi in the device tool's `carry`), then runs:
#
#   1. np 1: every collective and fusion on NCCL;
#   2. np 2 sharing the GPU: NCCL refuses two ranks on one GPU, so host
#      staging (the log must say so once);
#   3. np 1 --bench: engine allreduce against raw ncclAllReduce and cudaMemcpy
#      from 4 MB to 1 GB.
#
# Everything, build included, under TOTAL_TIMEOUT seconds (default 480).
# Logs go to $OUT (default build/engine-check).  Exit status 0 when every
# stage passed.
set -uo pipefail
cd "$(dirname "$0")/../../.."
ROOT=$PWD
MPI_DIR=$ROOT/.mpi
MPI_DEBS="libopenmpi3 libopenmpi-dev openmpi-bin openmpi-common libpmix2
  libhwloc15 libevent-core-2.1-7 libevent-pthreads-2.1-7 libfabric1
  libibverbs1 librdmacm1 libnl-3-200 libnl-route-3-200 libpsm2-2
  libpsm-infinipath1 libnuma1 libmunge2 libucx0 libxnvctrl0 libltdl7"

if [ "${1:-}" = "--fetch-mpi" ]; then
  mkdir -p "$MPI_DIR" && cd "$MPI_DIR" || exit 1
  # shellcheck disable=SC2086
  apt-get download $MPI_DEBS || exit 1
  grep -qx '/.mpi/' "$ROOT/.git/info/exclude" 2>/dev/null ||
    echo '/.mpi/' >>"$ROOT/.git/info/exclude"
  du -sh "$MPI_DIR"
  exit 0
fi

OUT=${OUT:-$ROOT/build/engine-check}
mkdir -p "$OUT"
TOTAL_TIMEOUT=${TOTAL_TIMEOUT:-480}
deadline=$((SECONDS + TOTAL_TIMEOUT))
left() { echo $((deadline - SECONDS)); }
summary=$OUT/summary.txt
: >"$summary"
note() { echo "$*" | tee -a "$summary"; }

# ---- toolchain -------------------------------------------------------------
CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}
PY=${PYTHON:-python3}
NCCL_HOME=$("$PY" -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__) if nvidia.nccl.__file__ else list(nvidia.nccl.__path__)[0])')
if [ ! -f "$NCCL_HOME/include/nccl.h" ]; then
  note "no nccl.h under $NCCL_HOME (pip package nvidia-nccl-cu13)"; exit 1
fi
if [ -d "$MPI_DIR" ] && ls "$MPI_DIR"/*.deb >/dev/null 2>&1; then
  mkdir -p "$MPI_DIR/root"
  for f in "$MPI_DIR"/*.deb; do dpkg -x "$f" "$MPI_DIR/root"; done
  MPI_PREFIX=$MPI_DIR/root/usr
  export OPAL_PREFIX=$MPI_PREFIX
  export PATH=$MPI_PREFIX/bin:$PATH
  export LD_LIBRARY_PATH=$MPI_PREFIX/lib/x86_64-linux-gnu:$MPI_PREFIX/lib/x86_64-linux-gnu/openmpi/lib:${LD_LIBRARY_PATH:-}
  MPI_INC=$MPI_PREFIX/lib/x86_64-linux-gnu/openmpi/include
  MPI_LIB="-L$MPI_PREFIX/lib/x86_64-linux-gnu/openmpi/lib -L$MPI_PREFIX/lib/x86_64-linux-gnu -lmpi"
else
  MPI_INC=$(mpicc --showme:incdirs 2>/dev/null | cut -d' ' -f1)
  MPI_LIB=$(mpicc --showme:link 2>/dev/null)
fi
export LD_LIBRARY_PATH=$NCCL_HOME/lib:$CUDA_HOME/lib64:${LD_LIBRARY_PATH:-}
[ -e "$NCCL_HOME/lib/libnccl.so" ] || ln -sf libnccl.so.2 "$NCCL_HOME/lib/libnccl.so" 2>/dev/null ||
  { mkdir -p build/nccl-lib && ln -sf "$NCCL_HOME/lib/libnccl.so.2" build/nccl-lib/libnccl.so; }
note "CUDA $CUDA_HOME; NCCL $NCCL_HOME; MPI include $MPI_INC"

# ---- build (the engine's sources from cc/sources.bzl) -------------------------
sources=$("$PY" - <<'PY'
import ast
lists = {n.targets[0].id: ast.literal_eval(n.value)
         for n in ast.parse(open("cc/sources.bzl").read()).body
         if isinstance(n, ast.Assign)}
wanted = {"COMMON_SRCS": "cc/common", "COMMON_MPI_SRCS": "cc/common",
          "COMMON_CUDA_SRCS": "cc/common", "CUDA_STREAM_SRCS": "cc/device",
          "ENGINE_CONFIG_SRCS": "cc/engine", "ENGINE_SRCS": "cc/engine",
          "PLANE_SRCS": "cc/transport", "MPI_TRANSPORT_SRCS": "cc/transport",
          "NCCL_PLANE_SRCS": "cc/transport"}
print(" ".join(f"{d}/{f}" for name, d in wanted.items() for f in lists[name]
               if f.endswith(".cc")))
PY
)
BIN=build/engine-check/engine_check
mkdir -p "$(dirname "$BIN")"
note "=== build"
# shellcheck disable=SC2086
if ! timeout "$(left)" g++ -std=c++17 -O2 -pthread -DGOOGLE_CUDA=1 \
    -DMPISTRATEGY_ENGINE_CHECK_CUDA=1 -DOMPI_SKIP_MPICXX=1 -I. \
    -isystem "$CUDA_HOME/include" -isystem "$NCCL_HOME/include" \
    -isystem "$MPI_INC" $sources tests/gpu/engine_check/engine_check.cc \
    -o "$BIN" -L"$NCCL_HOME/lib" -Lbuild/nccl-lib -L"$CUDA_HOME/lib64" \
    -lnccl -lcudart $MPI_LIB >"$OUT/build.log" 2>&1; then
  note "build FAILED (see build.log)"; tail -20 "$OUT/build.log"; exit 1
fi
note "build ok"

# ---- run -------------------------------------------------------------------
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
MPIRUN=(mpirun --oversubscribe --bind-to none -x LD_LIBRARY_PATH -x PATH)
status=0
stage() {  # name, np, args...
  local name=$1 np=$2; shift 2
  note "=== $name (np $np $*)"
  if timeout "$(left)" "${MPIRUN[@]}" -np "$np" "$BIN" "$@" >"$OUT/$name.log" 2>&1; then
    note "$name ok"
  else
    note "$name FAILED"; status=1
  fi
  tail -25 "$OUT/$name.log"
}
stage np1 1
stage np2-staging 2
if ! grep -q "NCCL cannot be used" "$OUT/np2-staging.log"; then
  note "np2-staging: the log does not say that NCCL fell back to staging"
  status=1
fi
stage bench 1 --bench
grep -A8 "engine GB/s" "$OUT/bench.log" >>"$summary"
exit $status
