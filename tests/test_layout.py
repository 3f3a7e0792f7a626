"""The tree's rules, read from the sources (no GPU, nothing imported): imports flow one way, the
C++ knows no kernel, benchmarks/ holds the scripts that make the records."""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "oproj_jax"
BACKENDS = ("cute", "pallas", "triton")
TEST_HELPERS = ("oproj_jax.testing", "oproj_jax.torch_ref")  # the oracle, the independent PyTorch reference
# Kernel scalars, the hidden size and the cluster size: Python passes them, the C++ never names them.
KERNEL_NAMES = re.compile(r"\b(eps|out_eps|has_delta|xmoe|7168|kHidden|kCluster)\b")


def imported(path: pathlib.Path) -> set[str]:
    """Every module `path` imports (absolute or relative, at any depth): `from a.b import c`
    gives a.b and a.b.c (c may be a module)."""
    tree = ast.parse(path.read_text(), str(path))
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([base] if base else [])])
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def _modules(folder: pathlib.Path):
    return sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


def test_no_backend_imports_the_api_or_another_backend():
    for backend in BACKENDS:
        others = [f"oproj_jax.{b}" for b in BACKENDS if b != backend]
        for path in _modules(PACKAGE / backend):
            bad = {
                n for n in imported(path) if any(n == o or n.startswith(o + ".") for o in [*others, "oproj_jax.api"])
            }
            assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_no_product_module_imports_a_test_helper():
    """The package's modules other than the helpers themselves and the bench CLI (which checks
    results against the oracle) never import the oracle or the PyTorch reference."""
    for path in _modules(PACKAGE):
        rel = path.relative_to(ROOT)
        if rel.parts[1] == "bench" or ".".join(rel.with_suffix("").parts) in TEST_HELPERS:
            continue
        bad = {n for n in imported(path) if any(n == h or n.startswith(h + ".") for h in TEST_HELPERS)}
        assert not bad, f"{rel} imports {sorted(bad)}"


def test_the_cpp_names_no_kernel_scalar_hidden_size_or_cluster_size():
    sources = sorted((ROOT / "ffi").glob("*.[ch]*"))
    assert sources, "ffi/ holds the C++"
    elsewhere = [
        p
        for p in ROOT.rglob("*.c[cu]")
        if p.parent != ROOT / "ffi"
        and not any(part.startswith(".") or part == "build" for part in p.relative_to(ROOT).parts)
    ]
    assert not elsewhere, "C++ only under ffi/"
    for path in sources:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            assert not KERNEL_NAMES.search(line), f"{path.relative_to(ROOT)}:{number}: {line.strip()}"


def test_benchmarks_hold_at_most_ten_files():
    files = [p.name for p in (ROOT / "benchmarks").iterdir() if p.is_file()]
    assert len(files) <= 10, sorted(files)
