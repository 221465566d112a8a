"""Growing the NUMA node vLLM CPU checks the KV pool against (edge_core/node_memory.py), on a fake VM."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge_core.errors import StageError
from edge_core.runtime.numa import NO_NUMA, NOT_NEEDED, PREFAULTED, prepare_node, read_node

GIB = 1 << 30
MIB = 1 << 20


class FakeHotplugVM:
    """A fake /proc + /sys whose node 0 behaves like this project's VM.

    Touched pages come from the node's free memory down to ``floor``, then
    from its page cache, then — when the VM ``grows`` — from memory that comes
    online on the node (its total grows); otherwise from outside the node.
    Released pages return as free memory on whichever node held them, except
    ``first_release_shortfall`` bytes the first time. Measured on the VM:
    touching 11 GiB grew node 0 from 11.59 to 16.09 GiB and right after
    release the node held 1.4 GiB less than reclaimable + touched predicted
    (MemFree then crept up by ~0.6 GiB over 30 s).
    """

    def __init__(self, root: Path, host_tree, *, total: int, free: int, host_total: int, host_available: int,
                 cache: int = 0, floor: int = 4 * GIB, grows: bool = True, first_release_shortfall: int = 0):
        self.root = host_tree(mem_total=host_total, mem_available=host_available,
                              nodes=[{"total": total, "free": free, "cpus": 2}], cores=2)
        self.total, self.free, self.cache, self.floor = total, free, cache, floor
        self.host_total, self.host_available = host_total, host_available
        self.grows = grows
        self.shortfall = first_release_shortfall
        self.held = self.held_on_node = 0
        self.touch_calls = 0
        self._write()

    def _write(self) -> None:
        kb = lambda value: value // 1024  # noqa: E731
        node = self.root / "sys/devices/system/node/node0/meminfo"
        node.write_text(f"Node 0 MemTotal: {kb(self.total)} kB\nNode 0 MemFree: {kb(self.free)} kB\n"
                        f"Node 0 Active(file): {kb(self.cache)} kB\nNode 0 Inactive(file): 0 kB\n"
                        "Node 0 SReclaimable: 0 kB\n")
        (self.root / "proc/meminfo").write_text(
            f"MemTotal: {kb(self.host_total)} kB\nMemFree: {kb(self.host_available)} kB\n"
            f"MemAvailable: {kb(self.host_available)} kB\n")

    # the toucher interface prepare_node uses
    def touch(self, nbytes: int) -> None:
        self.touch_calls += 1
        self.held += nbytes
        self.host_available -= nbytes
        from_free = min(nbytes, max(self.free - self.floor, 0))
        self.free -= from_free
        rest = nbytes - from_free
        from_cache = min(rest, self.cache)
        self.cache -= from_cache
        rest -= from_cache
        on_node = from_free + from_cache
        if self.grows:
            self.total += rest
            on_node += rest
        self.held_on_node += on_node
        self._write()

    def release(self) -> None:
        self.free += self.held_on_node - (self.shortfall if self.held_on_node else 0)
        if self.held_on_node:
            self.shortfall = 0
        self.host_available += self.held
        self.held = self.held_on_node = 0
        self._write()


def test_a_node_with_room_is_left_alone(host_tree):
    vm = FakeHotplugVM(Path(), host_tree, total=16 * GIB, free=15 * GIB, host_total=24 * GIB,
                       host_available=22 * GIB)
    prep = prepare_node(kv_bytes=4 * GIB, required_bytes=5 * GIB, target_bytes=7 * GIB, root=vm.root,
                        node_id=0, toucher=vm)
    assert prep.action == NOT_NEEDED and prep.touched_bytes == 0 and vm.touch_calls == 0
    assert prep.after.reclaimable_bytes == 15 * GIB


def test_a_short_node_is_grown_until_it_holds_the_target(host_tree):
    # node 0 reads 9.46 GiB of a 23.5 GiB VM (the measured idle state) and the pool needs 10 GiB
    vm = FakeHotplugVM(Path(), host_tree, total=int(9.46 * GIB), free=int(6.56 * GIB), cache=GIB,
                       host_total=int(23.5 * GIB), host_available=22 * GIB,
                       first_release_shortfall=int(1.4 * GIB))
    seen = []
    prep = prepare_node(kv_bytes=10 * GIB, required_bytes=10 * GIB + 640 * MIB, target_bytes=12 * GIB,
                        root=vm.root, node_id=0, toucher=vm, chunk_bytes=256 * MIB,
                        progress=lambda touched, short: seen.append(touched))
    assert prep.action == PREFAULTED
    assert prep.after.reclaimable_bytes >= 12 * GIB
    assert prep.after.total_bytes > prep.before.total_bytes
    assert prep.touched_bytes == sum(256 * MIB for _ in seen) and seen == sorted(seen)
    # the first round aims above the target by the expected release shortfall: one round does
    assert prep.rounds == 1 and len(prep.round_log) == 1
    assert vm.held == 0, "every touched page is released"
    assert prep.to_dict()["before"]["unattributed_bytes"] > 0


def test_a_round_that_falls_short_teaches_the_next_one(host_tree):
    vm = FakeHotplugVM(Path(), host_tree, total=int(9.46 * GIB), free=int(7.56 * GIB),
                       host_total=int(23.5 * GIB), host_available=22 * GIB,
                       first_release_shortfall=int(1.4 * GIB))
    prep = prepare_node(kv_bytes=10 * GIB, required_bytes=10 * GIB, target_bytes=12 * GIB, root=vm.root,
                        node_id=0, toucher=vm, chunk_bytes=256 * MIB, release_shortfall_bytes=0)
    first, second = prep.round_log
    assert first["reclaimable_bytes"] < 12 * GIB <= first["expected_bytes"], "round one fell short"
    assert second["expected_bytes"] >= 12 * GIB + (first["expected_bytes"] - first["reclaimable_bytes"])
    assert prep.after.reclaimable_bytes >= 12 * GIB and prep.rounds == 2


def test_no_memory_left_to_bring_online_fails_before_loading(host_tree):
    # the node already holds all the host's memory: nothing can come online
    vm = FakeHotplugVM(Path(), host_tree, total=24 * GIB, free=6 * GIB, host_total=24 * GIB,
                       host_available=6 * GIB)
    with pytest.raises(StageError) as err:
        prepare_node(kv_bytes=10 * GIB, required_bytes=10 * GIB, target_bytes=12 * GIB, root=vm.root,
                     node_id=0, toucher=vm)
    message = str(err.value)
    assert "NUMA node 0" in message and "Nothing was loaded" in message and "--max-model-len" in message
    assert vm.touch_calls == 0


def test_a_node_that_does_not_grow_stops_after_one_round(host_tree):
    vm = FakeHotplugVM(Path(), host_tree, total=10 * GIB, free=8 * GIB, host_total=24 * GIB,
                       host_available=20 * GIB, grows=False)
    with pytest.raises(StageError, match="did not grow the node"):
        prepare_node(kv_bytes=10 * GIB, required_bytes=10 * GIB, target_bytes=11 * GIB, root=vm.root,
                     node_id=0, toucher=vm, chunk_bytes=512 * MIB)
    assert vm.held == 0


def test_touching_stops_at_the_host_floor(host_tree):
    # only 2 GiB available on the host: touching may not push it below the 1 GiB floor
    vm = FakeHotplugVM(Path(), host_tree, total=8 * GIB, free=int(1.5 * GIB), host_total=24 * GIB,
                       host_available=2 * GIB, floor=0)
    with pytest.raises(StageError):
        prepare_node(kv_bytes=4 * GIB, required_bytes=4 * GIB, target_bytes=5 * GIB, root=vm.root, node_id=0,
                     toucher=vm, chunk_bytes=256 * MIB)
    assert vm.touch_calls * 256 * MIB <= 1 * GIB


def test_enough_for_the_check_but_short_of_the_target_passes_with_a_note(host_tree):
    vm = FakeHotplugVM(Path(), host_tree, total=24 * GIB, free=11 * GIB, host_total=24 * GIB,
                       host_available=11 * GIB)
    prep = prepare_node(kv_bytes=10 * GIB, required_bytes=10 * GIB, target_bytes=12 * GIB, root=vm.root,
                        node_id=0, toucher=vm)
    assert prep.action == NOT_NEEDED and "cannot grow" in prep.note


def test_read_node_reads_the_named_node(host_tree):
    root = host_tree(nodes=[{"total": 8 * GIB, "free": 6 * GIB, "cpus": 4},
                            {"total": 8 * GIB, "free": 7 * GIB, "cpus": 4}], cores=8)
    assert read_node(1, root).reclaimable_bytes == 7 * GIB
    assert read_node(5, root) is None


def test_no_numa_information_is_reported_not_guessed(host_tree):
    root = host_tree(nodes=[])
    prep = prepare_node(kv_bytes=GIB, required_bytes=GIB, target_bytes=2 * GIB, root=root, node_id=None)
    assert prep.action == NO_NUMA and prep.node_id is None
