"""The copy-engine link's slot arithmetic and its protocol, on the CPU: a model of every
rank's streams (main, and a copy and a release stream a link) fed the link calls that
ring_attention and ring_attention_backward make, run to completion, checking that no transfer
lands in a slot its receiver still needs, no block changes while read, and the ring never
waits on itself (fagen.ring_link's invariant)."""

from collections import defaultdict

import pytest

from fagen import ring_link
from fagen.ring_link import ARRIVED, RELEASED, SELF_TEST, SLOTS, Block, release_due, slot_offset


def test_slots_alternate_and_stay_clear_of_the_flags():
    nbytes = 1000  # not a multiple of 256: the second slot starts at the next 256 bytes
    assert slot_offset(1, nbytes) != slot_offset(2, nbytes)
    assert slot_offset(1, nbytes) == slot_offset(3, nbytes)
    assert {slot_offset(t, nbytes) % 256 for t in range(4)} == {0}
    assert min(slot_offset(t, nbytes) for t in range(2)) >= SLOTS >= max(ARRIVED, RELEASED, SELF_TEST) + 8
    assert len({ARRIVED // 128, RELEASED // 128, SELF_TEST // 128}) == 3  # each word on its own line
    assert abs(slot_offset(1, nbytes) - slot_offset(2, nbytes)) >= nbytes


def test_block_bytes():
    assert Block((2, 1, 4, 96, 128), "bfloat16").nbytes == 2 * 4 * 96 * 128 * 2
    assert Block((2, 3, 1, 8, 64), "float32").nbytes == 2 * 3 * 8 * 64 * 4


def test_a_transport_outside_the_list_is_refused():
    with pytest.raises(ValueError, match=r"transport='nvshmem'.*'auto', 'copy_engine', 'nccl'"):
        ring_link.link(None, "kv", None, Block((1,), "float16"), transport="nvshmem")


class LinkModel:
    """One rank's CopyEngineLink (and its _PeerSlots) as ops on streams: pass_on, arrival,
    release and join append what the real methods enqueue, in the same order. A send takes the
    stream current at the call (`on`) for its copy's start, its arrival and the release it makes."""

    def __init__(self, name, rank, world, streams, wait_for_copy=True):
        self.name, self.rank, self.world, self.streams = name, rank, world, streams
        self.sent, self.held, self.forwarded, self.sent_on = 0, None, {}, {}
        self.copied = {}  # a bundle's transfer -> its copy's last op (send_bundle's arrived waits for it)
        self.reads = defaultdict(int)  # share buffer -> the copies queued so far that read it
        self.wait_for_copy = wait_for_copy
        streams[(rank, "copy " + name)], streams[(rank, "releases " + name)] = [], []

    def stream(self, name):
        return self.streams[(self.rank, name)]

    def send(self, as_received, on="main"):  # CopyEngineLink.send / send_own -> _PeerSlots.pass_on
        copy, r = self.stream("copy " + self.name), self.rank
        self.sent += 1
        t = self.sent
        self.sent_on[t] = on
        if as_received and self.held is not None:
            copy.append(("wait", r, self.name, "arrived", self.held))
        else:
            copy.append(("after", r, on, len(self.stream(on))))
        if release_due(t) > 0:
            copy.append(("wait", r, self.name, "released", release_due(t)))
        copy.append(("land", (r + 1) % self.world, self.name, t, self.held))
        copy.append(("write", (r + 1) % self.world, self.name, "arrived", t, r))
        if self.held is not None:
            self.forwarded[self.held] = len(copy)
        return t

    def write_share(self, buf, on="main"):  # a step's dK/dV kernel writes share buffer `buf`
        self.stream(on).append(("write_share", self.rank, buf, self.reads[buf]))

    def send_bundle(self, buf, on="main"):  # CopyEngineLink.send_bundle: the bundle held and share `buf`
        t = self.send(False, on)
        copy = self.stream("copy " + self.name)
        copy.insert(len(copy) - 2, ("read_share", self.rank, buf))  # with the bundle's, before the flag
        self.reads[buf] += 1
        if self.held is not None:
            self.forwarded[self.held] = len(copy)
        self.copied[t] = len(copy)
        return t

    def arrived(self, t):  # the function send returned
        on = self.sent_on[t]
        if t in self.copied and self.wait_for_copy:  # send_bundle's: the share's copy is done first
            self.stream(on).append(("after", self.rank, "copy " + self.name, self.copied.pop(t)))
        if self.held is not None:
            self._release(self.held, on)
        self.stream(on).append(("wait", self.rank, self.name, "arrived", t))
        self.held = t

    def use(self, on="main"):  # a stream reads (or adds into) the block held
        self.stream(on).append(("use", self.rank, self.name, self.held))

    def finish(self, on="main"):
        if self.held is not None:
            self._release(self.held, on)
        self.held = None
        self.stream(on).append(("after", self.rank, "copy " + self.name, len(self.stream("copy " + self.name))))

    def _release(self, t, on):
        rel = self.stream("releases " + self.name)
        rel.append(("after", self.rank, on, len(self.stream(on))))
        if t in self.forwarded:
            rel.append(("after", self.rank, "copy " + self.name, self.forwarded.pop(t)))
        rel.append(("write", (self.rank - 1) % self.world, self.name, "released", t, self.rank))


def forward_call(kv, world):
    """ring_attention's order of link calls on one rank."""
    for i in range(world):
        arrived = kv.send(as_received=i > 0) if i + 1 < world else None  # send_own first
        kv.use()
        if arrived is not None:
            kv.arrived(arrived)
    kv.finish()


def backward_call(kv, dkv, world):
    """ring_attention_backward's order of link calls on one rank: from step 1 the step's kernel
    writes its share (two buffers, alternating), the dK/dV bundle so far arrives and leaves with
    the share (send_bundle: after main's work); the bundle of the rank's own block comes home
    after the own block's second launch, and the gradient sum reads it."""
    pending = None
    for i in range(world):
        kv_arrived = kv.send(as_received=i > 0) if i + 1 < world else None
        kv.use()  # the step's dK/dV kernel reads K/V ...
        if i > 0:
            dkv.write_share(i % 2)  # ... and writes its share
            if pending is not None:
                dkv.arrived(pending)
            pending = dkv.send_bundle(i % 2)  # the bundle so far and the step's share
        if kv_arrived is not None:
            kv.arrived(kv_arrived)
    if pending is not None:
        dkv.arrived(pending)
        dkv.use()  # the gradient sum reads the bundle home
    kv.finish()
    dkv.finish()


def simulate(world: int, program, wait_for_copy=True) -> None:
    """Every rank runs `program(links, world)` through the models; then the streams run: an op
    runs when its stream reaches it and, for a wait, the flag holds the value, for an `after`,
    the other stream has run so many ops. Asserts every landing finds its slot released, every
    forwarding copy reads the block it means to, no block changes under main's use of it, no
    share is written again before the copy queued to read it has, and every op runs (no
    deadlock)."""
    streams = {}
    for r in range(world):
        streams[(r, "main")] = []
        program({name: LinkModel(name, r, world, streams, wait_for_copy) for name in ("kv", "dkv")}, world)
    reads_done = defaultdict(int)  # (rank, share buffer) -> copies that have read it
    flags = defaultdict(int)  # (rank, link, flag) -> value
    done = {key: 0 for key in streams}
    in_slot = defaultdict(int)  # (rank, link, slot) -> the transfer that landed there last
    released = defaultdict(int)  # (rank, link) -> the last transfer it let go of
    progress = True
    while progress:
        progress = False
        for key, ops in streams.items():
            while done[key] < len(ops):
                op = ops[done[key]]
                if op[0] == "wait" and flags[op[1:4]] < op[4]:
                    break
                if op[0] == "after" and done[(op[1], op[2])] < op[3]:
                    break
                if op[0] == "land":
                    _, rank, link, t, source = op
                    sender = (rank - 1) % world
                    assert source is None or in_slot[(sender, link, source % 2)] == source, "forwarded the wrong block"
                    assert in_slot[(rank, link, t % 2)] <= released[(rank, link)], \
                        f"{link} transfer {t} lands on a block rank {rank} still needs"
                    in_slot[(rank, link, t % 2)] = t
                if op[0] == "read_share":
                    reads_done[op[1:3]] += 1
                if op[0] == "write_share":
                    _, rank, buf, queued = op
                    assert reads_done[(rank, buf)] >= queued, f"rank {rank}'s share {buf} is written before its copy read it"
                if op[0] == "use":
                    _, rank, link, held = op
                    assert held is None or in_slot[(rank, link, held % 2)] == held, "a block changed under main"
                if op[0] == "write":
                    _, rank, link, flag, value, writer = op
                    if flag == "released":
                        released[(writer, link)] = max(released[(writer, link)], value)
                    flags[(rank, link, flag)] = max(flags[(rank, link, flag)], value)
                done[key] += 1
                progress = True
    assert all(done[key] == len(ops) for key, ops in streams.items()), "the ring waits on itself"


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_forward_calls(world):
    simulate(world, lambda links, w: [forward_call(links["kv"], w) for _ in range(3)])


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_training_steps(world):
    """Forward then backward, three times: the backward's two links on one main stream, its
    K/V link the forward's (same block size: the same slots, the count carrying on)."""
    def steps(links, w):
        for _ in range(3):
            forward_call(links["kv"], w)
            backward_call(links["kv"], links["dkv"], w)
    simulate(world, steps)


@pytest.mark.parametrize("world", [8])
def test_a_share_waits_for_its_copy(world):
    """Without send_bundle's wait for the copy of the share it sent, a step's kernel may write the
    share buffer two steps on before that copy has read it: the model catches it (its streams
    run in one fixed order, which at 8 ranks lets a main stream get two steps ahead of its copy)."""
    def steps(links, w):
        for _ in range(3):
            forward_call(links["kv"], w)
            backward_call(links["kv"], links["dkv"], w)
    with pytest.raises(AssertionError, match="written before its copy read it"):
        simulate(world, steps, wait_for_copy=False)
