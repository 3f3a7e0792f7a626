"""The Triton backend: one set of Triton kernels launched from PyTorch and from JAX.

plan.py (the kernel configuration for each T and H, the launch parameters both launchers
pass), kernel.py (the @triton.jit kernels, no JAX, no PyTorch), torch_launch.py (the PyTorch
entry), backend.py (the registry module: the JAX launch, through library.py's FFI target or
jax_triton.triton_call). Importing this package imports nothing heavy; `import triton` in its
modules is the Triton compiler.
"""
