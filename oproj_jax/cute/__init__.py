"""Our CuTe-DSL port of the original CuTe-DSL consumer kernel for PyTorch/vLLM, built ahead of
time into sm_90a and sm_100a cubins (cute/manifest.py ARCHS).

kernel.py (the kernel), primitives.py (PTX helpers), build.py (cubins + manifest.json),
manifest.py (find a variant), cache.py (compile a variant that is not prebuilt on first use).
Importing this package imports nothing heavy: the CuTe DSL is loaded only by kernel.py/build.py,
on the machine that builds the cubins or when a variant is compiled on first use.
"""
