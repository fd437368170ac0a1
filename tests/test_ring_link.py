"""The copy-engine link's slot arithmetic and its protocol, on the CPU: a model of every
rank's two streams run to completion, checking that no transfer lands in a slot its receiver
still needs and that the ring never waits on itself (fagen.ring_link's invariant)."""

import pytest

from fagen import ring_link
from fagen.ring_link import ARRIVED, RELEASED, SLOTS, Block, release_due, slot_offset


def test_slots_alternate_and_stay_clear_of_the_flags():
    nbytes = 1000  # not a multiple of 256: the second slot starts at the next 256 bytes
    assert slot_offset(1, nbytes) != slot_offset(2, nbytes)
    assert slot_offset(1, nbytes) == slot_offset(3, nbytes)
    assert {slot_offset(t, nbytes) % 256 for t in range(4)} == {0}
    assert min(slot_offset(t, nbytes) for t in range(2)) >= SLOTS > max(ARRIVED, RELEASED) + 8
    assert abs(slot_offset(1, nbytes) - slot_offset(2, nbytes)) >= nbytes


def test_block_bytes():
    assert Block((2, 1, 4, 96, 128), "bfloat16").nbytes == 2 * 4 * 96 * 128 * 2
    assert Block((2, 3, 1, 8, 64), "float32").nbytes == 2 * 3 * 8 * 64 * 4


def test_a_transport_outside_the_list_is_refused():
    with pytest.raises(ValueError, match=r"transport='nvshmem'.*'auto', 'copy_engine', 'nccl'"):
        ring_link.link(None, "kv", None, Block((1,), "float16"), transport="nvshmem")


def simulate(world: int, calls: int, steps: int, forwards_as_received) -> None:
    """Run the ring's ops (as ring_attention issues them on each rank, through CopyEngineLink)
    through a model of the streams: each rank has a main, a copy and a release stream whose
    ops run in order; a wait blocks its stream until the flag holds the value, an `after`
    until another stream has run so many ops. Asserts every landing finds its slot released,
    no block changes under the compute that reads it, and every op runs (no deadlock).
    forwards_as_received(i): step i's send passes on the block received (K/V), or sends one
    this rank wrote (dK/dV: a send every step, the last one home); None: no send."""
    streams = {}  # (rank, name) -> list of ops
    for r in range(world):
        main, copy, rel, sent, held, forwarded = [], [], [], 0, None, {}

        def release(t):
            rel.append(("after", r, "main", len(main)))
            if t in forwarded:
                rel.append(("after", r, "copy", forwarded.pop(t)))
            rel.append(("write", (r - 1) % world, "released", t, r))

        for _ in range(calls):
            for i in range(steps):
                as_received = forwards_as_received(i)
                t = None
                if as_received is not None:
                    sent += 1
                    t = sent
                    if as_received and held is not None:  # leaves as soon as it landed here
                        copy.append(("wait", r, "arrived", held))
                    else:  # after what main wrote into it
                        copy.append(("after", r, "main", len(main)))
                    if release_due(t) > 0:
                        copy.append(("wait", r, "released", release_due(t)))
                    copy.append(("land", (r + 1) % world, t, held))  # the peer copy reads `held` here
                    copy.append(("write", (r + 1) % world, "arrived", t))
                    if held is not None:  # the copy read this rank's slot: its release waits for it
                        forwarded[held] = len(copy)
                main.append(("use", r, held))  # the compute reads (and for dK/dV writes) the held slot
                if t is not None:  # arrived(): release the slot held before, wait for the new one
                    if held is not None:
                        release(held)
                    main.append(("wait", r, "arrived", t))
                    held = t
            if held is not None:  # finish()
                release(held)
                held = None
        streams[(r, "main")], streams[(r, "copy")], streams[(r, "releases")] = main, copy, rel
    flags = {(r, f): 0 for r in range(world) for f in ("arrived", "released")}
    done = {key: 0 for key in streams}
    in_use = {}  # (rank, slot) -> the transfer that landed there last
    released = {r: 0 for r in range(world)}  # the last transfer each rank has let go of
    progress = True
    while progress:
        progress = False
        for key, ops in streams.items():
            while done[key] < len(ops):
                op = ops[done[key]]
                if op[0] == "wait" and flags[(op[1], op[2])] < op[3]:
                    break
                if op[0] == "after" and done[(op[1], op[2])] < op[3]:
                    break
                if op[0] == "land":
                    _, rank, t, source = op
                    sender = (rank - 1) % world
                    assert source is None or in_use[(sender, source % 2)] == source, "forwarded a block not there"
                    assert in_use.get((rank, t % 2), 0) <= released[rank], f"transfer {t} lands on a block rank {rank} needs"
                    in_use[(rank, t % 2)] = t
                if op[0] == "use":
                    assert op[2] is None or in_use[(op[1], op[2] % 2)] == op[2], "the block changed under the compute"
                if op[0] == "write":
                    if op[2] == "released":
                        released[op[4]] = max(released[op[4]], op[3])
                    flags[(op[1], op[2])] = max(flags[(op[1], op[2])], op[3])
                done[key] += 1
                progress = True
    assert all(done[key] == len(ops) for key, ops in streams.items()), "the ring waits on itself"


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_forward_ring_protocol(world):
    simulate(world, calls=3, steps=world, forwards_as_received=lambda i: (i > 0) if i + 1 < world else None)


@pytest.mark.parametrize("world", [2, 4])
def test_dkv_ring_protocol(world):  # the backward's dK/dV: a send every step, the last one home
    simulate(world, calls=3, steps=world, forwards_as_received=lambda i: False)
