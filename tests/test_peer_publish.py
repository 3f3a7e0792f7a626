"""The publish kernel of mode="peer" (oproj_jax/cute/publish.py), compiled here (CuTe DSL, no GPU):
its ABI and the ordering rules read off its PTX (wait for empty before every store, nothing
before griddepcontrol.wait, one status report per launch). Running it is left to
tests/test_peer_gpu.py.
"""

import re
import tempfile

import pytest

from oproj_jax import abi
from oproj_jax.cute import build
from oproj_jax.cute import manifest as cute_manifest

pytest.importorskip("cutlass", reason="the CuTe DSL (nvidia-cutlass-dsl) builds the kernel")


@pytest.fixture(scope="module")
def ptx():
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    from oproj_jax.cute import publish

    args = publish.compile_args()
    with tempfile.TemporaryDirectory() as dump:
        compiled = cute.compile(
            publish.Publish().launch,
            *args,
            make_fake_stream(),
            options=f"--gpu-arch {build.ARCH} --keep-ptx --dump-dir {dump}",
        )
        return compiled.artifacts.PTX


def test_entry_follows_the_abi():

    entry = build.compile_publish()
    assert entry["cubin"] == cute_manifest.PUBLISH_CUBIN and entry["block"] == [128, 1, 1]
    assert entry["params"] == [".u64"] * 17 + [".u32", ".u64", ".u32", ".u32", ".u64"]
    assert entry["params"] == abi.ptx(abi.PUBLISH)  # what peer.py checks the manifest for
    # the status bits are distinct, so the peer mode's OR of the two kernels' words keeps each
    bits = [abi.STATUS_MAILBOX, abi.STATUS_RECV, abi.STATUS_UNARMED, abi.STATUS_REFUSED, abi.STATUS_CLOSED]
    assert sum(bits) == 31 and all(b & (b - 1) == 0 for b in bits)
    assert entry["cubin_bytes"][:4] == b"\x7fELF" and entry["entry"].encode() in entry["cubin_bytes"]


def _body(ptx: str) -> list[str]:
    start = ptx.index(".entry")
    return [line.strip() for line in ptx[start:].splitlines() if line.strip() and not line.strip().startswith("//")]


def _memory(line: str) -> bool:
    return bool(
        re.match(r"(ld|st|atom|red)\.(global|relaxed|volatile|weak)", line)
        or re.search(r"\b(ld|st|atom|red)\.[a-z.:0-9]*global", line)
    )


def test_nothing_is_loaded_or_stored_before_griddepcontrol_wait(ptx):
    body = _body(ptx)
    wait = next(i for i, line in enumerate(body) if line.startswith("griddepcontrol.wait"))
    memory = [i for i, line in enumerate(body) if _memory(line)]
    assert memory and min(memory) > wait
    launch = next(i for i, line in enumerate(body) if line.startswith("griddepcontrol.launch_dependents"))
    assert launch < wait


def test_every_store_waits_for_an_empty_fragment(ptx):
    """16 destinations: one relaxed.sys v4 poll each, and each data store is predicated on all
    four words of that same address being the sentinel (the owner's re-arm)."""
    body = _body(ptx)
    polls = [line for line in body if "ld.relaxed.sys.global.v4.b32" in line]
    stores = [line for line in body if re.search(r"\bst\.[a-z.]*v4", line)]
    assert len(polls) == 16 and len(stores) == 16
    assert all("st.relaxed.sys.global.v4.b32" in s for s in stores)
    poll_addresses = [
        re.search(r"ld\.relaxed\.sys\.global\.v4\.b32 \{[^}]*\}, \[(%rd\d+)\]", p).group(1) for p in polls
    ]
    for line in stores:
        address = re.search(r"@p st\.relaxed\.sys\.global\.v4\.b32 \[(%rd\d+)\]", line).group(1)
        assert address in poll_addresses, "a store to an address that was not polled"
        checks = re.findall(r"setp\.eq\.and\.u32 p, %r\d+, 0x80000000, p;", line)
        assert len(checks) == 4 and line.index(checks[-1]) < line.index("@p st."), line
    # the sanitize rule: each of the 4 words, both halves tested for -0.0
    assert ptx.count("and.b32 t, %r") >= 8


def test_one_status_report_per_launch(ptx):
    """The CTA's outcomes are reduced with barriers; thread 0 ORs its CTA's code into the
    accumulator (control + 12), then counts the CTA with one acq_rel 64-bit atomic; only the CTA
    that completes the count reads the accumulator, stores flags[2] and zeroes both words."""
    body = _body(ptx)
    barriers = [i for i, line in enumerate(body) if "barrier.red.or.pred" in line]
    (atomic,) = [i for i, line in enumerate(body) if "atom." in line]
    assert len(barriers) == 2 and max(barriers) < atomic and "atom.acq_rel.gpu.global.add.u64" in body[atomic]
    report = body[atomic]
    assert "@bad red.relaxed.gpu.global.or.b32 [%rd" in report and report.index("red.relaxed") < report.index("atom.")
    assert "%nctaid.x" in report and "@last ld.relaxed.gpu.global.b32 all, [%rd" in report
    assert "@last st.relaxed.gpu.global.b32 [%rd" in report and "+ 8], all;" in report
    assert "@last st.relaxed.gpu.global.u64" in report


def test_the_fail_stop_word_refuses_and_is_set_on_giving_up(ptx):
    """The fail-stop word (control + 8) is read before the first poll (a refused launch
    publishes nothing) and in the polling loop (another wave gave up: stop), and a thread that
    gives up ORs STATUS_UNARMED into it."""
    body = _body(ptx)
    reads = [i for i, line in enumerate(body) if "ld.relaxed.gpu.global.b32" in line and "+ 8]" in line]
    polls = [i for i, line in enumerate(body) if "ld.relaxed.sys.global.v4" in line]
    assert len(reads) >= 2 and reads[0] < min(polls) and any(r > min(polls) for r in reads)
    sets = [line for line in body if "red.relaxed.gpu.global.or.b32" in line and "+ 8]" in line]
    assert sets
