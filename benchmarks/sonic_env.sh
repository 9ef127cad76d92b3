# Sourced by the scripts that run SonicMoE on a device machine (sonic_same_gpu.sh,
# sonic_kernels_same_gpu.sh): installs the bundle carried in .sonic (../shared/bench/sonic-wheels.sh)
# under /tmp/site, restores the CuTe DSL caches of an earlier call (.sonic/cache/sonic_cache.tgz: a
# cold SonicMoE call compiles for minutes), and defines
#   out                    the output folder ($OUT, else bench_out), created
#   filter                 a grep -E pattern for the log lines of absl and of warnings
#   sonic_python ARGS...   python3 with the bundle importable (timeout: $sonic_s seconds, 330)
#   save_sonic_cache DIR   writes the updated caches to DIR/sonic_cache.tgz for the next call
#   thiek_flags "C1 C2"    --thiek=C1 --thiek=C2 for configurations T,d,n,E,K
# Run from the repository root.
out="${OUT:-bench_out}"
filter='^[IWE][0-9]{4}|Warning|warn'
mkdir -p "$out" /tmp/site /tmp/root
tar xJf .sonic/cdsl.tar.xz -C /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .sonic/*.whl
[ -f .sonic/cache/sonic_cache.tgz ] && tar xzf .sonic/cache/sonic_cache.tgz -C /tmp/root
sonic_python() {
  PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/python_packages:$PWD PYTHONUNBUFFERED=1 \
    timeout "${sonic_s:-330}" python3 "$@"
}
save_sonic_cache() {
  tar czf "$1/sonic_cache.tgz" -C /tmp/root quack_cache cutlass_python_cache 2>/dev/null
}
thiek_flags() {
  for c in $1; do printf -- ' --thiek=%s' "$c"; done
}
