#!/usr/bin/env bash
# Completes a bundle folder (deploy/bundle.sh) for the CPU image: te_server is
# linked against CUDA's libraries even when it serves on the CPU, and a plain
# Debian base has none of them. The small ones come from this machine's CUDA
# toolkit as they are (libcudart, 0.7 MB; libcudnn.so.9, cuDNN's 0.1 MB loader,
# which opens its engines only when a GPU graph is built). libcublasLt.so.13
# (541 MB) is replaced by a stub with the same soname and symbol version whose
# every entry answers CUBLAS_STATUS_NOT_SUPPORTED: the CPU backend never calls
# it, and the CUDA backend cannot open in an image without a GPU and driver.
#
#   deploy/container/cpu_cuda_libs.sh BUNDLE_DIR
#
# The stub's symbols are read from the bundled te_server, so a new cuBLASLt
# call in the server needs no change here. Needs gcc and binutils (nm).
set -euo pipefail
bundle="$1"
server="$bundle/te_server"
[ -x "$server" ] || { echo "cpu_cuda_libs: no $server" >&2; exit 1; }
cuda_lib="${CUDA_PATH:-/usr/local/cuda}/lib64"

for lib in libcudart.so.13 libcudnn.so.9; do
  cp -L "$cuda_lib/$lib" "$bundle/$lib"
  chmod u+w "$bundle/$lib"
  strip --strip-unneeded "$bundle/$lib" 2>/dev/null || true
done

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
symbols=$(nm -D --undefined-only "$server" | awk '$2 ~ /@libcublasLt\.so\.13$/ {sub(/@.*/, "", $2); print $2}' | sort -u)
[ -n "$symbols" ] || { echo "cpu_cuda_libs: te_server uses no cuBLASLt symbol" >&2; exit 1; }
{
  echo '/* cuBLASLt stub for the CPU image (deploy/container/cpu_cuda_libs.sh). */'
  for s in $symbols; do
    case "$s" in
      cublasLtGetStatusString|cublasLtGetStatusName)
        echo "const char* $s(int s) { (void)s; return \"cuBLASLt is not in the CPU image\"; }" ;;
      *) echo "int $s(void) { return 15; /* CUBLAS_STATUS_NOT_SUPPORTED */ }" ;;
    esac
  done
} >"$work/stub.c"
{ echo 'libcublasLt.so.13 { global:'; for s in $symbols; do echo "  $s;"; done; echo '  local: *; };'; } >"$work/stub.map"
gcc -shared -fPIC -O2 -o "$bundle/libcublasLt.so.13" -Wl,-soname,libcublasLt.so.13 \
  -Wl,--version-script="$work/stub.map" "$work/stub.c"
echo "cpu_cuda_libs: $bundle has libcudart, libcudnn's loader and a $(echo "$symbols" | wc -w)-symbol cuBLASLt stub" >&2
