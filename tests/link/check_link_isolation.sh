#!/usr/bin/env bash
# Asserts the process split of docs/architecture.md from the binaries' dynamic dependencies:
# the coordinator never loads LibTorch, the engine never loads Protobuf or gRPC (the torch
# wheel carries its own protobuf; two in one address space is the clash we avoid).
set -euo pipefail
server="$1"; engine="$2"
fail=0
server_deps=$(ldd "$server")
engine_deps=$(ldd "$engine")
if grep -qE 'libtorch|libc10' <<<"$server_deps"; then
  echo "FAIL: $server links LibTorch:"; grep -E 'libtorch|libc10' <<<"$server_deps"; fail=1
fi
if grep -qE 'libprotobuf|libgrpc' <<<"$engine_deps"; then
  echo "FAIL: $engine links Protobuf/gRPC:"; grep -E 'libprotobuf|libgrpc' <<<"$engine_deps"; fail=1
fi
# And each does link what it is for, so the check cannot pass on a broken build.
grep -q 'libgrpc++' <<<"$server_deps" || { echo "FAIL: $server does not link gRPC"; fail=1; }
grep -q 'libtorch_cpu' <<<"$engine_deps" || { echo "FAIL: $engine does not link libtorch_cpu"; fail=1; }
grep -q 'not found' <<<"$engine_deps$server_deps" && { echo "FAIL: unresolved libraries"; fail=1; }
[ "$fail" = 0 ] && echo "link isolation OK: server has no torch, engine has no protobuf/grpc"
exit "$fail"
