"""The Triton backend: one set of Triton kernels launched from PyTorch and from JAX.

plan.py (the kernel variants, the rule that picks one by T, the launch parameters both
launchers pass), kernel.py (the @triton.jit kernels, no JAX, no PyTorch), torch_launch.py (the
PyTorch entry), backend.py (the registry module: jax_triton.triton_call). Importing this
package imports nothing heavy; `import triton` in its modules is the Triton compiler.
"""
