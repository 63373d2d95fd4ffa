"""Code generation: IR nodes to kernels (`purinec.codegen.cpu` for the CPU target), the
kernel cache on disk (`purinec.codegen.cache`) and the `Kernel` they produce."""

from purinec.codegen.kernel import CodegenError, Kernel

__all__ = ["CodegenError", "Kernel"]
