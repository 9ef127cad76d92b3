"""Hopper (sm90) Pallas Mosaic GPU kernels: one grouped GEMM core, one file per GEMM role."""
