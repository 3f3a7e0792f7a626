"""The consumer's L2 warm-up as its PTX shows it (CuTe DSL, no GPU): before the PDL wait, an
L2 prefetch of each row the CTA reads (the mailbox slots in one-shot variants only), only for
launches of up to WARM_L2_MAX_T tokens, and no global read at all (kernel.py, "L2 warm-up").
That the bits stay right when the kernel ahead has just written what is prefetched (the prefix it
carries) is for the multi-step tests of tests/test_contract.py on a GPU."""

import functools
import re

import pytest

from oproj_jax.cute import build
from oproj_jax.cute import manifest as cute_manifest

pytest.importorskip("cutlass", reason="the CuTe DSL (nvidia-cutlass-dsl) builds the kernel")

from oproj_jax.cute import kernel  # noqa: E402 (needs the DSL)

PREFETCH = r"@p prefetch\.global\.L2 \[[^]]+\];"


@functools.cache
def _body(key_items):
    """The PTX of a key's kernel from its .entry on (compiled once per key for the module)."""
    ptx = build.compile_variant(dict(key_items), cute_manifest.FOLDED, with_ptx=True)["ptx"]
    return ptx[ptx.index(".entry") :]


def _before_wait(key):
    body = _body(tuple(key.items()))
    return body[: body.index("griddepcontrol.wait;")]


@pytest.mark.parametrize(
    "key, rows",
    [
        # norm, query, out_norm, prefix, blocks, slots
        (cute_manifest.make_key(16, 8, True, 4, 0, False), 2 + 1 + 1 + 8 + 16),
        (cute_manifest.make_key(16, 0, False, 3, 1, False), 1 + 16),  # out_norm, slots
        (cute_manifest.make_key(16, 1, False, 1, 0, True), 2 + 1 + 1),  # twoshot: no mailbox slot
    ],
    ids=lambda v: cute_manifest.describe(v) if isinstance(v, dict) else str(v),
)
def test_every_row_is_asked_of_l2_before_the_wait_and_nothing_is_read(key, rows):
    head = _before_wait(key)
    assert len(re.findall(PREFETCH, head)) == rows
    assert not re.search(r"\bld\.(global|volatile|relaxed|acquire)|cp\.async\.cg|ld\.global\.nc", head)


def test_only_launches_of_few_tokens_warm_l2():
    head = _before_wait(cute_manifest.make_key(16, 8, True, 4, 0, False))
    tokens = re.search(r"mov\.u32 (%r\d+), %nctaid\.y;", head)
    assert tokens, "the launch's tokens are not read before the wait"
    compare = rf"setp\.\w+\.s32\s+%p\d+, {re.escape(tokens.group(1))}, {kernel.WARM_L2_MAX_T};"
    assert re.search(compare, head), f"no compare of the launch's tokens with {kernel.WARM_L2_MAX_T}"
    branch = head.index("@%p", re.search(compare, head).end())
    assert branch < re.search(PREFETCH, head).start()  # the prefetches are skipped past the bound


def test_mailbox_slots_are_asked_of_l2_only_in_ready_mode():
    """A slot's prefetch is predicated on timeout_us < 0 (param 13, cute/ABI.md): a polled slot
    may still be empty, a refused call's mailbox gone. The other rows are asked for always."""
    key = cute_manifest.make_key(16, 0, False, 3, 1, False)  # out_norm, then the 16 slots
    head = _before_wait(key)
    timeout = re.search(r"ld\.param\.b32\s+(%r\d+), \[\w+_param_13\];", head).group(1)
    ready = re.search(rf"setp\.lt\.s32\s+(%p\d+), {re.escape(timeout)}, 0;", head).group(1)
    selects = dict(re.findall(r"selp\.b32\s+(%r\d+), 1, 0, (%p\d+);", head))
    ands = {m[0]: m[1:] for m in re.findall(r"and\.pred\s+(%p\d+), (%p\d+), (%p\d+);", head)}
    gated = [
        ready in ands.get(selects.get(r), ()) for r in re.findall(r"setp\.ne\.s32 p, (%r\d+), 0; @p prefetch", head)
    ]
    assert gated == [False] + [True] * 16


def test_the_next_grid_may_launch_on_entry_or_after_the_wait_by_the_launchs_tokens():
    """Launches of up to TRIGGER_AFTER_WAIT_MAX_T tokens let the next grid launch after their PDL
    wait, larger ones on entry (kernel.py, "PDL"): one griddepcontrol.launch_dependents on each
    side of the wait, each under a branch on %nctaid.y against the bound."""
    body = _body(tuple(cute_manifest.make_key(16, 8, True, 4, 0, False).items()))
    wait = body.index("griddepcontrol.wait;")
    launches = [m.start() for m in re.finditer(r"griddepcontrol\.launch_dependents;", body)]
    assert len(launches) == 2 and launches[0] < wait < launches[1]
    tokens = re.search(r"mov\.u32 (%r\d+), %nctaid\.y;", body[:wait]).group(1)
    bound = kernel.TRIGGER_AFTER_WAIT_MAX_T
    # before the wait: skipped (branch taken) when tokens < bound + 1; after it: skipped when tokens > bound
    before = re.search(rf"setp\.lt\.s32\s+(%p\d+), {re.escape(tokens)}, {bound + 1};\s*@\1 bra", body[: launches[0]])
    # the compare may come before the wait (and the L2 warm-up's own compare before it)
    after = re.findall(rf"setp\.gt\.s32\s+(%p\d+), {re.escape(tokens)}, {bound};", body[launches[0] : launches[1]])
    assert before and after, "the trigger's place is not chosen by the launch's tokens"
    assert re.search(rf"^\s*@{after[-1]} bra", body[wait : launches[1]], re.M)
