"""The consumer's protocol mode as its PTX shows it (CuTe DSL, no GPU): the fail-stop word read
before any mailbox load, set when a wait gives up, the re-arm store at system scope, NaN for
what was never read, and the xmoe rows of the launch's own T (docs/spec.md "Mailbox protocol").
Running it is left to tests/test_peer_faults_gpu.py."""

import re

import pytest

from oproj_jax.cute import build
from oproj_jax.cute import manifest as cute_manifest

pytest.importorskip("cutlass", reason="the CuTe DSL (nvidia-cutlass-dsl) builds the kernel")

from oproj_jax.cute import kernel  # noqa: E402 (needs the DSL)

KEY = dict(R=4, NB=2, has_delta=True, groups=2, xmoe_replicas=1, twoshot=False)


@pytest.fixture(scope="module")
def body():
    ptx = build.compile_variant(KEY, cute_manifest.FOLDED, with_ptx=True)["ptx"]
    start = ptx.index(".entry")
    return [line.strip() for line in ptx[start:].splitlines() if line.strip() and not line.strip().startswith("//")]


def _lines(body, pattern):
    return [i for i, line in enumerate(body) if re.search(pattern, line)]


def test_the_rearm_is_a_system_scope_store_of_the_sentinel(body):
    """The publisher on another GPU polls the slot with ld.relaxed.sys: the re-arm must be at
    least relaxed at system scope for the pair to be ordered (PTX memory model)."""
    rearms = [body[i] for i in _lines(body, r"mov\.b32 s, 0x80000000")]
    assert rearms and all("st.relaxed.sys.global.v4.b32" in line for line in rearms)
    assert not _lines(body, r"st\.global\.v4\.b32 \[[^]]*\], \{s, s, s, s\}")


def test_the_fail_stop_word_is_read_before_the_first_mailbox_load(body):
    reads = _lines(body, r"ld\.relaxed\.gpu\.global\.b32 [^,]+, \[[^]]*\+ 8\]")
    polls = _lines(body, r"ld\.volatile\.global\.v4")
    assert reads and polls and reads[0] < polls[0]


def test_a_wait_that_gives_up_sets_the_fail_stop_word_and_reads_nan(body):
    assert _lines(body, r"red\.relaxed\.gpu\.global\.or\.b32 \[[^]]*\+ 8\]")
    assert _lines(body, str(kernel.NAN_WORD)) or _lines(body, hex(kernel.NAN_WORD)), "no NaN fill"


def test_xmoe_rows_follow_the_launch_not_the_slot_capacity(body):
    assert _lines(body, r"%nctaid\.y")
