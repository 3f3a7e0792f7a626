"""mode="peer"'s protocol on the CPU: a numpy model of what the GPUs do, run under random schedules.

The model follows ffi/cute_peer.cc, cute/publish.py and the consumer kernel at
the granularity the hardware guarantees, the 16-byte fragment (four 32-bit words): ONE
mailbox [R, T, H] per rank, armed with the sentinel word 0x80000000, no step counter. Each
rank's stream runs publish(k) then consume(k) for k = 0, 1, ...:
  * publish(k) owns one (destination, fragment) pair per destination rank and fragment of its
    partial (-0.0 -> +0.0). Each scheduled action tries one pair: it loads the destination
    fragment and stores the data only if all four words are the sentinel (WAIT FOR EMPTY);
    otherwise it counts a polling round, and after `patience` rounds it gives up on the pair
    without storing (status 4). publish(k+1) starts only once consume(k) finished (the publish
    kernel's griddepcontrol.wait); consume(k) only once publish(k) finished (the consumer's).
  * consume(k) works fragment by fragment (a thread each): a polling round reloads every slot's
    fragment not yet complete and keeps the complete ones (no sentinel word); once all R are
    complete it has READ them, then re-arms them one slot at a time (separate actions). After
    `patience` rounds it gives up (status 1), keeps what it has, and still re-arms.
The kernels bound each wait in wall time (timeout_us); the model counts it in a thread's own
polling rounds (`patience`), the only clock a schedule has. A random scheduler interleaves
every rank's enabled actions; the status of a step is the OR of
the consumer's and the publish's codes, as PeerResult.status.

Checked: every consumer reads exactly the sanitized partials of its own step, and the prefix of
every rank at every step equals the oneshot reference on the original partials, bit for bit,
for groups 1..4 and R = 2, 3, 5; every mailbox ends re-armed. A rank that never publishes turns
into status 1 on every rank within patience rounds; a rank whose consumer never runs makes
its peers' next publish give up (status 4) without storing into its slot; reset() (re-arm)
makes the next steps exact again. Three deliberately broken protocols are caught by some
schedule: a publish that does not wait for empty, a consumer that re-arms before it reads, and
a publish that does not wait for its rank's previous step (no griddepcontrol.wait: two steps'
publishes of one rank overlap).

What only the GPU run covers (tests/test_peer_gpu.py): the real kernels, the memory ordering of
the hardware (PDL, peer loads and stores over NVLink, volatile polling), the handler's
allocation and record stage, and XLA's scheduling of the call.
"""

import ml_dtypes
import numpy as np
import pytest

from oproj_jax import api, configs, reference, testing

SENTINEL = np.uint32(0x80000000)
H = 64  # the model works at any H; the reference consumer too
T = 2
FRAGMENTS = T * H // 8  # 16-byte fragments per slot
EMPTY_SLOT, UNARMED = 1, 4  # oproj_jax.cute.peer.STATUS_MAILBOX, STATUS_UNARMED


def _sanitized(bits16: np.ndarray) -> np.ndarray:  # -0.0 (0x8000) -> +0.0, as the publish kernel
    out = bits16.copy()
    out[out == 0x8000] = 0
    return out


def _words(bits16: np.ndarray) -> np.ndarray:  # [.., T, H] u16 -> [.., FRAGMENTS, 4] u32
    return np.ascontiguousarray(bits16).view(np.uint32).reshape(*bits16.shape[:-2], FRAGMENTS, 4)


class Model:
    """R ranks' mailboxes and streams, the design unless an ablation is set:
    `wait_for_empty=False`: publish stores without looking at the destination;
    `read_after_rearm=True`: the consumer re-arms a complete fragment, then reads it;
    `publish_waits=False`: publish(k+1) may start while the rank's publish(k) still runs.
    `skip_rank`: that rank's publish has no destination (PeerOptions.skip_publish_rank);
    `frozen`: {rank: steps} - that rank stops after publishing that many steps (its consumer
    never runs again, as if its GPU hung)."""

    def __init__(
        self,
        R: int,
        *,
        patience: int,
        wait_for_empty: bool = True,
        read_after_rearm: bool = False,
        publish_waits: bool = True,
        skip_rank: int | None = None,
        frozen: dict | None = None,
    ):
        self.R, self.patience = R, patience
        self.wait_for_empty, self.read_after_rearm, self.publish_waits = wait_for_empty, read_after_rearm, publish_waits
        self.skip_rank, self.frozen = skip_rank, dict(frozen or {})
        self.mailbox = np.zeros((R, R, FRAGMENTS, 4), np.uint32)  # [owner, slot, fragment, word]
        self.reset()

    def reset(self):
        """peer.reset(): re-arm every mailbox (and forget the streams: nothing is in flight)."""
        self.mailbox[...] = SENTINEL
        self.started = [0] * self.R  # publishes started per rank
        self.publishing = [dict() for _ in range(self.R)]  # k -> {(dest, fragment): rounds}
        self.consumed = [0] * self.R  # consumers finished per rank
        self.consumer = [None] * self.R  # the consumer in progress: per fragment state
        self.blocked_tries = 0  # publish tries that found their destination not re-armed yet
        self.gave_up = []  # (who, rank, step, rounds) of every wait that gave up

    # ---- the streams -------------------------------------------------------------------------
    def _published(self, rank: int, k: int) -> bool:
        return k < self.started[rank] and k not in self.publishing[rank]

    def actions(self, steps: int, only=None):
        """(rank, kind) pairs enabled now (of the ranks in `only`, default all)."""
        out = []
        for r in range(self.R) if only is None else only:
            k, c = self.started[r], self.consumed[r]
            last_publish = min(steps, self.frozen.get(r, steps))  # frozen: publishes that many...
            last_consume = min(steps, self.frozen[r] - 1 if r in self.frozen else steps)  # ...consumes one less
            if self.publishing[r]:
                out.append((r, "publish"))
            # the design: publish(k) once consume(k-1) finished; the ablation: at any time
            if k < last_publish and (k <= c or not self.publish_waits):
                out.append((r, "start_publish"))
            if c < last_consume and self._published(r, c):  # consume(c) once publish(c) finished
                out.append((r, "consume"))
        return out

    def run(self, partials: np.ndarray, rng, steps: int, only=None):
        """partials [steps, R, T, H] bits. Returns (read [steps, R(consumer), R, T, H] bits,
        status [steps, R]): what each consumer summed at each step, and the step's status.
        `only`: schedule only these ranks (the others do nothing)."""
        data = _words(_sanitized(partials))  # [steps, R, FRAGMENTS, 4]
        read = np.zeros((steps, self.R, self.R, FRAGMENTS, 4), np.uint32)
        status = np.zeros((steps, self.R), np.int32)
        while True:
            enabled = self.actions(steps, only)
            if not enabled:
                return read.view(np.uint16).reshape(steps, self.R, self.R, T, H), status
            r, kind = enabled[rng.integers(len(enabled))]
            if kind == "start_publish":
                k = self.started[r]
                self.started[r] += 1
                dests = [] if r == self.skip_rank else range(self.R)
                pairs = {(d, f): 0 for d in dests for f in range(FRAGMENTS)}
                if pairs:
                    self.publishing[r][k] = pairs
            elif kind == "publish":
                self._publish_action(r, data, rng, status)
            else:
                self._consume_action(r, rng, read, status)

    def _publish_action(self, r, data, rng, status):
        """One try of one pending (destination, fragment) pair of one of the rank's publishes."""
        ks = sorted(self.publishing[r])
        k = ks[rng.integers(len(ks))]
        pairs = self.publishing[r][k]
        keys = list(pairs)
        dest, f = keys[rng.integers(len(keys))]
        target = self.mailbox[dest, r, f]
        if not self.wait_for_empty or (target == SENTINEL).all():
            target[...] = data[k, r, f]  # st.relaxed.sys.v4
            del pairs[(dest, f)]
        else:
            pairs[(dest, f)] += 1
            self.blocked_tries += 1
            if self.patience and pairs[(dest, f)] >= self.patience:
                status[k, r] |= UNARMED  # give up: nothing stored into a slot not re-armed
                self.gave_up.append(("publisher", r, k, pairs[(dest, f)]))
                del pairs[(dest, f)]
        if not pairs:
            del self.publishing[r][k]

    def _consume_action(self, r, rng, read, status):
        """One step of one fragment's thread of consume(k): a polling round, a re-arm, or (the
        read-after-re-arm ablation) the late read."""
        k = self.consumed[r]
        if self.consumer[r] is None:
            self.consumer[r] = [
                dict(phase="poll", latched={}, rounds=0, rearm=list(range(self.R))) for _ in range(FRAGMENTS)
            ]
        states = self.consumer[r]
        live = [f for f, s in enumerate(states) if s["phase"] != "done"]
        f = live[rng.integers(len(live))]
        s = states[f]
        if s["phase"] == "poll":
            for slot in range(self.R):
                if slot not in s["latched"]:
                    words = self.mailbox[r, slot, f].copy()  # ld.volatile.v4
                    if (words != SENTINEL).all():
                        s["latched"][slot] = words
            s["rounds"] += 1
            complete = len(s["latched"]) == self.R
            if not complete and self.patience and s["rounds"] >= self.patience:
                status[k, r] |= EMPTY_SLOT  # gives up, continues with what it has
                self.gave_up.append(("consumer", r, k, s["rounds"]))
                for slot in range(self.R):
                    s["latched"].setdefault(slot, self.mailbox[r, slot, f].copy())
                complete = True
            if complete:
                if not self.read_after_rearm:
                    for slot in range(self.R):
                        read[k, r, slot, f] = s["latched"][slot]
                s["phase"] = "rearm"
        elif s["phase"] == "rearm":
            slot = s["rearm"].pop(rng.integers(len(s["rearm"])))
            self.mailbox[r, slot, f] = SENTINEL
            if not s["rearm"]:
                s["phase"] = "late_read" if self.read_after_rearm else "done"
        else:  # late_read (ablation): whatever the slots hold now
            read[k, r, :, f] = self.mailbox[r, :, f]
            s["phase"] = "done"
        if all(s["phase"] == "done" for s in states):
            self.consumer[r] = None
            self.consumed[r] += 1


def _random_partials(rng, steps: int, R: int) -> np.ndarray:
    """bf16 bits with many -0.0 and (+0.0, -0.0) pairs: words that read as the sentinel."""
    bits = rng.standard_normal((steps, R, T, H)).astype(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
    bits[rng.random(bits.shape) < 0.15] = 0x8000
    bits[rng.random(bits.shape) < 0.1] = 0x0000
    return bits


def _prefix(slots_bits: np.ndarray, x: dict, groups: int) -> np.ndarray:
    """The reference consumer (has_delta, NB=1) on a mailbox given as bits: the prefix bits."""
    mailbox = slots_bits.view(ml_dtypes.bfloat16)
    out = api.consumer(
        mailbox, x["prefix"], x["blocks"], x["norm"], x["query"], x["out_norm"], groups=groups, backend="reference"
    )
    return testing.bits(out.prefix)


@pytest.fixture(scope="module")
def weights():
    return configs.make_inputs(configs.Config(2, T, 1, H=H), seed=5)


def _run(model: Model, rng, steps: int):
    partials = _random_partials(rng, steps, model.R)
    read, status = model.run(partials, rng, steps)
    return partials, read, status


def _reads_exact(partials, read, status) -> bool:
    """Every consumer read exactly the sanitized partials of its own step, and no step failed."""
    return not status.any() and np.array_equal(read, np.broadcast_to(_sanitized(partials)[:, None], read.shape))


def _steps_exact(partials, read, status, weights, groups) -> bool:
    for k in range(partials.shape[0]):
        want = _prefix(partials[k], weights, groups)  # oneshot: the raw partials, the same order
        for consumer in range(partials.shape[1]):
            if status[k, consumer] or not np.array_equal(_prefix(read[k, consumer], weights, groups), want):
                return False
    return True


@pytest.mark.parametrize("R,groups", [(2, 1), (2, 2), (2, 4), (3, 2), (5, 3), (5, 4)])
def test_random_schedules_give_the_oneshot_bits(weights, R, groups):
    rng = np.random.default_rng(100 + 10 * R + groups)
    for trial in range(12):
        model = Model(R, patience=0)
        partials, read, status = _run(model, rng, steps=5)
        assert not status.any()
        # every consumer read exactly the sanitized partials of its step (no stale or future slot)
        np.testing.assert_array_equal(read, np.broadcast_to(_sanitized(partials)[:, None], read.shape))
        if trial < 2:  # the reference consumer on what was read: the oneshot prefix bits
            assert _steps_exact(partials, read, status, weights, groups)
        assert (model.mailbox == SENTINEL).all(), "every mailbox re-armed at the end"


def test_a_publisher_can_run_a_step_ahead_of_a_slow_consumer():
    """The schedules include a rank publishing step k+1 while a peer still consumes step k (and
    waiting there for the re-arm): the case the single mailbox has to get right."""
    rng = np.random.default_rng(21)
    blocked = 0
    for _ in range(10):
        model = Model(2, patience=0)
        partials, read, status = _run(model, rng, steps=4)
        assert _reads_exact(partials, read, status)
        blocked += model.blocked_tries
    assert blocked > 0, "no schedule made a publisher wait for a re-arm: the model does not test the wait"


def test_sanitizing_keeps_the_oneshot_bits(weights):
    """Published data has no -0.0, yet sums to the reference's bits on the raw partials (whose
    all-(-0.0) sums are -0.0 before the reference publishes them)."""
    rng = np.random.default_rng(7)
    partials = _random_partials(rng, 1, 3)[0]
    partials[:, 0, :8] = 0x8000  # every rank -0.0 at some elements
    for groups in (1, 2, 3):
        np.testing.assert_array_equal(
            _prefix(_sanitized(partials), weights, groups), _prefix(partials, weights, groups)
        )


@pytest.mark.parametrize(
    "ablation",
    [dict(wait_for_empty=False), dict(read_after_rearm=True), dict(publish_waits=False)],
    ids=["publish-without-wait-for-empty", "consumer-rearms-before-reading", "publish-without-griddepcontrol-wait"],
)
def test_the_model_catches_a_broken_protocol(weights, ablation):
    """Each ablation lets some schedule overwrite a slot before its consumer read it, read a
    re-armed or later step's slot, or swap two steps' data: a step's bits differ (or a consumer
    gives up)."""
    rng = np.random.default_rng(11)
    broken = 0
    for _ in range(40):
        model = Model(3, patience=60, **ablation)
        partials, read, status = _run(model, rng, steps=4)
        broken += not _reads_exact(partials, read, status)
        if broken >= 3:
            break
    assert broken > 0
    # and the reference consumer sees it too (not only the raw reads)
    rng = np.random.default_rng(12)
    for _ in range(40):
        partials, read, status = _run(Model(3, patience=60, **ablation), rng, steps=4)
        if not _reads_exact(partials, read, status):
            assert not _steps_exact(partials, read, status, weights, 2)
            break


def test_the_design_passes_the_ablations_schedules(weights):
    """The same seeds and sizes as the ablation test, with the design: always exact."""
    rng = np.random.default_rng(11)
    for _ in range(20):
        partials, read, status = _run(Model(3, patience=60), rng, steps=4)
        assert _reads_exact(partials, read, status)


def test_a_missing_rank_times_out_everywhere_then_reset_recovers(weights):
    rng = np.random.default_rng(3)
    model = Model(3, patience=40, skip_rank=1)
    partials = _random_partials(rng, 2, 3)
    read, status = model.run(partials, rng, steps=2)
    assert (status & EMPTY_SLOT).all(), "every rank waits for rank 1's slot and gives up"
    assert model.consumed == [2, 2, 2] and not any(model.publishing)  # bounded: nobody still polling
    model.skip_rank = None
    model.reset()  # peer.reset(): every slot re-armed
    partials, read, status = _run(model, rng, steps=3)
    assert _reads_exact(partials, read, status) and _steps_exact(partials, read, status, weights, 2)


def test_a_peer_that_never_rearms_makes_the_publish_give_up_without_storing(weights):
    """Rank 1 publishes step 0 and hangs (its consumer never runs): rank 0's step-1 publish finds
    its slot in rank 1's mailbox still holding step 0, gives up after patience rounds (status
    4) and leaves it alone; rank 0's step-1 consumer gives up too (rank 1 never published step
    1): status 1 | 4. After reset() the group is exact again."""
    rng = np.random.default_rng(8)
    model = Model(2, patience=30, frozen={1: 1})
    partials = _random_partials(rng, 2, 2)
    read, status = model.run(partials, rng, steps=2)
    assert model.consumed == [2, 0] and not model.publishing[0], "rank 0 finished both steps, bounded"
    assert status[0, 0] == 0 and status[1, 0] == UNARMED | EMPTY_SLOT
    np.testing.assert_array_equal(read[0, 0], _sanitized(partials[0]))  # step 0 was fine on rank 0
    # rank 1's slot 0 still holds rank 0's step-0 data: the step-1 publish did not overwrite it
    np.testing.assert_array_equal(model.mailbox[1, 0], _words(_sanitized(partials[0, 0])))
    # rank 0's own slot got step 1 (its own consumer re-armed it in time)... and was consumed
    assert (model.mailbox[0] == SENTINEL).all()
    model.frozen = {}
    model.reset()
    partials, read, status = _run(model, rng, steps=3)
    assert _reads_exact(partials, read, status) and _steps_exact(partials, read, status, weights, 1)


@pytest.mark.parametrize("who", ["consumer", "publisher"])
def test_the_wait_is_bounded_by_polling_rounds(who):
    """A wait that never ends gives up after exactly patience rounds of its own, whatever the
    other ranks do (here: only one rank is scheduled)."""
    patience = 7
    rng = np.random.default_rng(4)
    partials = _random_partials(rng, 1, 2)
    if who == "consumer":  # rank 0 never publishes: rank 1's consumer waits for slot 0
        model, me = Model(2, patience=patience, skip_rank=0), 1
    else:  # rank 1 holds rank 0's earlier data nobody consumes: rank 0's publish waits for the re-arm
        model, me = Model(2, patience=patience), 0
        model.mailbox[1, 0] = 0
    read, status = model.run(partials, rng, steps=1, only=[me])
    assert model.consumed[me] == 1 and not model.publishing[me]
    waits = [g for g in model.gave_up if g[0] == who]
    assert len(waits) == FRAGMENTS and all(g[1:] == (me, 0, patience) for g in waits)
    if who == "consumer":
        assert status[0, me] == EMPTY_SLOT
    else:  # its consumer waits for rank 1's slot, which never comes, too
        assert status[0, me] == UNARMED | EMPTY_SLOT
        assert (model.mailbox[1, 0] == 0).all(), "nothing stored into the slot that was never re-armed"


def test_reference_without_negative_zero_is_the_publish_rule():
    bits = np.array([0x8000, 0x0000, 0x3F80, 0xBF80, 0x8001], np.uint16)
    got = testing.bits(reference.without_negative_zero(bits.view(ml_dtypes.bfloat16)))
    np.testing.assert_array_equal(got, _sanitized(bits))
