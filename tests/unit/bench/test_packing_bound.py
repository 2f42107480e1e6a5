"""The packing replay's offline bound and loss report: MIG geometry as NVIDIA's placement table
has it, device names read back to the memory slices they hold, and the first-fit replay
following the publication's slice order."""

from __future__ import annotations

from bench.packing_bound import first_fit, packable, publication_order, run
from bench.packing_churn import Request
from bench.packing_lost import explain, fits, held_slices


def test_partitions_pack_only_where_placements_allow() -> None:
    assert packable(["whole"] * 8)
    assert not packable(["whole"] * 9)
    # A 4g starts only at slice 0; a 1g.10gb never takes slice 7: 3 of them beside each 4g.
    assert packable(["4g.40gb"] * 8 + ["1g.10gb"] * 24)
    assert not packable(["4g.40gb"] * 8 + ["1g.10gb"] * 25)
    # Two 3g fill a GPU (slices 0-3 and 4-7); a 7g then needs a GPU of its own.
    assert packable(["3g.40gb"] * 14 + ["7g.80gb"])
    assert not packable(["3g.40gb"] * 15 + ["7g.80gb"])


def test_device_names_read_back_to_their_slices() -> None:
    assert held_slices("gpu-3-mig-3g40gb-4") == (3, {4, 5, 6, 7})
    assert held_slices("gpu-0-mig-1g10gb-6") == (0, {6})
    assert held_slices("gpu-7") == (7, set(range(8)))
    assert fits("4g.40gb", {4, 5})
    assert not fits("4g.40gb", {2})
    assert fits("3g.40gb", {2})  # slices 4-7 are free
    assert not fits("whole", {7})


def test_first_fit_follows_the_slice_order() -> None:
    order = publication_order("flexgpu")
    # Small partitions are published from the top slice down, GPU 0 first.
    assert next((g, s) for kind, g, s in order if kind == "1g.10gb") == (0, 6)
    # One 1g on GPU 0 and eight whole-GPU requests: seven wholes fit, the last one waits.
    requests = [Request(0, "1g.10gb", 0, 5)] + [Request(i, "whole", 0, 5) for i in range(1, 9)]
    lifetimes = {r.ident: r.lifetime for r in requests}
    placed = run(requests, 2, first_fit(order, lifetimes), False)
    assert sorted(placed) == list(range(8))
    # Once the 1g is gone (lifetime 1), the last whole GPU request takes its GPU.
    requests[0] = Request(0, "1g.10gb", 0, 1)
    lifetimes[0] = 1
    placed = run(requests, 2, first_fit(order, lifetimes), False)
    assert placed[8] == 1


def test_a_lost_request_shows_who_took_the_gpu_cleared_for_it() -> None:
    rule = ["flexgpu-0", "gpu-0-mig-1g10gb-6", "pack-flexgpu/r0"]
    lines = [
        {"steps": 2, "requests": [[0, "whole", 0, 5], [1, "7g.80gb", 0, 1], [2, "whole", 1, 5]]},
        {"step": 0, "allocations": {"flexgpu": {"r1": ["gpu-0-mig-7g80gb-0"]}}, "clearing": [rule]},
        {"step": 1, "allocations": {"flexgpu": {"r2": ["gpu-0"]}}, "clearing": [rule]},
    ]
    out = explain(lines, "flexgpu")
    assert out[0] == "r0 whole arrived step 1 (lifetime 5):"
    # GPU 0 held and cleared for r0; the other seven empty (only back-off kept r0 off them).
    assert out[1].startswith("  step  1: ########C ........ ")
    assert out[1].endswith("placement free on GPU [1, 2, 3, 4, 5, 6, 7]")
    assert any(line.startswith("  clearing chose GPU 0") for line in out)
    assert out[-1] == "  step 2: r2 (whole, arrived step 2) took GPU 0"
    assert not any(line.startswith("r2 ") for line in out)  # placed: not lost
