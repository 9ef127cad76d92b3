#!/usr/bin/env bash
# The packages that the GPU machines (no network) lack, bundled in git-ignored folders of the
# repository, copied to the GPU host with the tree:
#   bash benchmarks/wheels.sh tokamax      # CPU machine with network: ./.whl, the tokamax baseline
#                                          # (tokamax 0.0.17, its dependencies, jax-triton 0.3.1)
#   bash benchmarks/wheels.sh sonicmoe     # CPU machine with network: ./.sonic, SonicMoE
#                                          # 0.1.2.post1 (quack-kernels, the CUTLASS DSL
#                                          # re-packed as tar.xz: 54 MB)
#   source benchmarks/wheels.sh install    # GPU machine, repository root: installs what .whl and
#                                          # .sonic hold under /tmp/site and exports PYTHONPATH
# The GPU host's Python already has jax 0.11.2, flax, optax, absl-py, torch 2.11, triton 3.6 and
# cuda-bindings. With .sonic, `install` also restores SonicMoE's compiled-kernel caches from
# .sonic/cache/sonic_cache.tgz (without them a fresh machine compiles for minutes) and defines
# `save_sonic_cache DIR`, which writes them to DIR/sonic_cache.tgz: copy that file to .sonic/cache/
# for the next run. gpu_bench.sh, sonic_same_gpu.sh, pretrain_gpu.sh and tools/ncu_compare.sh source
# it.

_wheels_download() {  # FOLDER PACKAGE==VERSION...: wheels for the GPU host's Python 3.12
  local dir="$1" py=python3
  shift
  PYENV_VERSION=3.12.1 python3 --version >/dev/null 2>&1 && py="env PYENV_VERSION=3.12.1 python3"
  for p in "$@"; do
    $py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d "$dir" "$p" || return 1
  done
}

case "${1:-}" in
  tokamax)
    (set -euo pipefail
     _wheels_download .whl tokamax==0.0.17 einshape==1.0 immutabledict==4.3.1 pydantic==2.14.3 \
       pydantic_core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 qwix==0.1.8 \
       tensorboardX==2.6.5 jax-triton==0.3.1
     du -sh .whl) ;;
  sonicmoe)
    (set -euo pipefail
     tmp=$(mktemp -d)
     trap 'rm -rf "$tmp"' EXIT
     _wheels_download "$tmp" sonic-moe==0.1.2.post1 quack-kernels==0.4.1 \
       apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 nvidia-cutlass-dsl==4.4.2 \
       nvidia-cutlass-dsl-libs-base==4.4.2
     mkdir -p .sonic "$tmp/x"
     (cd "$tmp/x" && for w in "$tmp"/nvidia_cutlass_dsl*.whl; do unzip -q -o "$w"; done)
     tar cf - -C "$tmp/x" . | xz -9 -T0 > .sonic/cdsl.tar.xz
     cp "$tmp"/sonic_moe-*.whl "$tmp"/quack_kernels-*.whl "$tmp"/apache_tvm_ffi-*.whl \
       "$tmp"/torch_c_dlpack_ext-*.whl .sonic/
     du -sh .sonic) ;;
  install)
    mkdir -p /tmp/site
    if ls .whl/*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site \
        .whl/*.whl
      # tokamax imports xprof only for its own profiler: a stub instead of 30 MB of wheels.
      mkdir -p /tmp/site/xprof/cli
      touch /tmp/site/xprof/__init__.py /tmp/site/xprof/cli/__init__.py
      echo 'get_kernel_stats_tool = None' > /tmp/site/xprof/cli/tools.py
    fi
    if [ -f .sonic/cdsl.tar.xz ]; then
      tar xJf .sonic/cdsl.tar.xz -C /tmp/site
      python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site \
        .sonic/*.whl
      export PYTHONPATH="/tmp/site/nvidia_cutlass_dsl/python_packages${PYTHONPATH:+:$PYTHONPATH}"
      # SonicMoE's kernel caches live in /tmp/$USER (quack_cache, cutlass_python_cache).
      mkdir -p "/tmp/${USER:-root}"
      [ -f .sonic/cache/sonic_cache.tgz ] && tar xzf .sonic/cache/sonic_cache.tgz \
        -C "/tmp/${USER:-root}"
    fi
    export PYTHONPATH="/tmp/site:${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
    save_sonic_cache() {
      tar czf "$1/sonic_cache.tgz" -C "/tmp/${USER:-root}" quack_cache cutlass_python_cache \
        2>/dev/null
    } ;;
  *)
    echo "usage: bash benchmarks/wheels.sh tokamax|sonicmoe;" \
      "source benchmarks/wheels.sh install" >&2
    return 2 2>/dev/null || exit 2 ;;
esac
