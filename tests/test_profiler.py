"""ModuleProfiler: the module call tree of a run, with calls per frame and wall-time shares."""

from __future__ import annotations

import pytest
import torch
from omskills.profiling import profiler as profiler_module
from omskills.profiling.profiler import ModuleProfiler
from torch import nn

# Time here is a clock that moves only when a test module "works", so the arithmetic of the
# profile is checked exactly; a real sleep stretches by whole scheduler slices on a busy machine.
TOLERANCE_S = 1e-9


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


clock = FakeClock()


@pytest.fixture(autouse=True, scope="module")
def fake_time():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(profiler_module, "time", clock)
        yield


class Sleeper(nn.Module):
    def __init__(self, seconds: float, width: int = 2):
        super().__init__()
        self.seconds = seconds
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        clock.sleep(self.seconds)
        return x


class Block(nn.Module):
    """Own work 5 ms, then a (20 ms) once and b (10 ms) twice."""

    def __init__(self):
        super().__init__()
        self.a = Sleeper(0.02)
        self.b = Sleeper(0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        clock.sleep(0.005)
        return self.b(self.b(self.a(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()
        self.head = Sleeper(0.01, width=3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


class Recursive(nn.Module):
    """Calls itself `depth` times: 10 ms of own work per level."""

    def forward(self, x: torch.Tensor, depth: int) -> torch.Tensor:
        clock.sleep(0.01)
        return self(x, depth - 1) if depth else x


def run_frames(net: nn.Module, frames: int, control_plane_s: float = 0.0):
    x = torch.zeros(2)
    with ModuleProfiler(net) as profiler:
        profiler.mark_prompt()
        for _ in range(frames):
            net(x)
            clock.sleep(control_plane_s)  # Python between module calls (the control plane)
            profiler.mark_frame()
    return profiler.report()


@pytest.fixture(scope="module")
def net_report():
    return run_frames(Net(), frames=3, control_plane_s=0.01)


def test_counts_calls_per_module_per_frame_and_per_prompt(net_report):
    b = net_report.node("block.b")
    assert (b.calls, b.calls_per_frame, b.calls_per_prompt, b.frames_called) == (6, 2.0, 6.0, 3)
    assert net_report.node("").calls == 3
    assert (net_report.frames, net_report.prompts) == (3, 1)


def test_records_class_parameters_and_dynamic_parent(net_report):
    block = net_report.node("block")
    assert block.module_class == "Block" and block.parent == ""
    assert block.params_own == 0 and block.params_total == 2 * (2 * 2 + 2)
    assert net_report.node("head.linear") is None  # never called: not a node
    assert net_report.node("").parent is None and net_report.node("").depth == 0


def test_exclusive_time_is_inclusive_minus_direct_children(net_report):
    block = net_report.node("block")
    children = net_report.node("block.a").inclusive_s + net_report.node("block.b").inclusive_s
    assert block.exclusive_s == pytest.approx(block.inclusive_s - children, abs=1e-9)
    assert block.exclusive_s == pytest.approx(3 * 0.005, abs=TOLERANCE_S)
    assert net_report.node("block.b").exclusive_s == pytest.approx(6 * 0.01, abs=TOLERANCE_S)


def test_shares_add_up_to_at_most_the_whole_run(net_report):
    assert sum(n.exclusive_share for n in net_report.nodes) <= 1.0
    top_level = [n for n in net_report.nodes if n.parent is None]
    assert sum(n.share for n in top_level) <= 1.0
    # 3 x 10 ms of control plane outside any module is part of the run, not of any module.
    assert net_report.control_plane_seconds == pytest.approx(0.03, abs=TOLERANCE_S)
    assert net_report.node("").share == pytest.approx(net_report.module_seconds / net_report.total_seconds)


def test_a_module_calling_itself_is_not_counted_twice():
    with ModuleProfiler(Recursive()) as profiler:
        profiler.root(torch.zeros(1), 2)
    node = profiler.report().node("")
    assert node.calls == 3
    assert node.inclusive_s == pytest.approx(0.03, abs=TOLERANCE_S)
    assert node.exclusive_s == pytest.approx(0.03, abs=TOLERANCE_S)
    assert node.share <= 1.0


class Failing(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        clock.sleep(0.01)
        raise ValueError("boom")


class Guarded(nn.Module):
    """Calls a child that raises, catches it, and goes on."""

    def __init__(self):
        super().__init__()
        self.failing = Failing()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:
            self.failing(x)
        except ValueError:
            pass
        clock.sleep(0.01)
        return x


def test_a_forward_that_raises_still_closes_its_timing():
    with ModuleProfiler(Guarded()) as profiler:
        profiler.root(torch.zeros(1))
    report = profiler.report()
    assert report.node("failing").calls == 1
    assert report.node("").exclusive_s == pytest.approx(0.01, abs=TOLERANCE_S)


def test_hooks_are_removed_on_exit_even_after_an_error():
    net = Net()
    with pytest.raises(RuntimeError, match="driver failed"):
        with ModuleProfiler(net):
            net(torch.zeros(2))
            raise RuntimeError("driver failed")
    for module in net.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks


class Chain(nn.Module):
    """A deep chain: only the heavy first child matters."""

    def __init__(self, depth: int):
        super().__init__()
        self.inner = Chain(depth - 1) if depth else None
        self.heavy = Sleeper(0.03) if depth == 6 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.heavy is not None:
            self.heavy(x)
        return self.inner(x) if self.inner is not None else x


def test_small_deep_nodes_are_dropped_but_totals_stay_right():
    with ModuleProfiler(Chain(6), min_share=0.05, kept_depth=3) as profiler:
        profiler.root(torch.zeros(1))
    report = profiler.report()
    assert report.node("inner.inner.inner") is not None  # depth 3: always kept
    assert report.node("inner.inner.inner.inner.inner") is None  # depth 5, tiny share: dropped
    assert report.node("heavy") is not None
    assert report.dropped_nodes == 3
    kept = sum(n.exclusive_s for n in report.nodes)
    assert kept + report.dropped_exclusive_s == pytest.approx(report.module_seconds, abs=1e-9)
    assert all(n.parent is None or report.node(n.parent) is not None for n in report.nodes)


def test_seeds_of_a_fast_model_come_from_warm_passes_and_a_slow_model_is_profiled_once():
    from omskills.profiling.discovery import (
        COLD_PASS_LIMIT_SECONDS,
        MIN_TIMED_SECONDS,
        MIN_WARM_PASSES,
        discovery_profile,
    )

    net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    passes = []

    threads_seen = []

    def fast(profiler):
        clock.sleep(0.125)  # a binary fraction: the sum is exact
        passes.append(net(torch.randn(1, 8)))
        threads_seen.append(torch.get_num_threads())
        profiler.mark_frame()
        return len(passes)

    threads = torch.get_num_threads()
    profile, first = discovery_profile(net, fast)
    assert first == 1  # the first pass's result is what the caller gets back
    warm = max(MIN_WARM_PASSES, round(MIN_TIMED_SECONDS / 0.125))
    assert len(passes) == 1 + warm and f"median of {warm} warm passes on one thread" in profile.notes[0]
    # Warm passes time shares on one thread (no barrier waits for a descheduled thread); the
    # first pass runs as the process is set, and so does everything after the profile.
    assert threads_seen == [threads] + [1] * warm and torch.get_num_threads() == threads
    assert profile.frames == 1 and profile.total_seconds == pytest.approx(0.125)  # one (median) pass

    slow_passes = []

    def slow(profiler):
        clock.sleep(COLD_PASS_LIMIT_SECONDS)  # a pass this slow is its own measurement
        slow_passes.append(net(torch.randn(1, 8)))
        profiler.mark_frame()

    profile, _ = discovery_profile(net, slow)
    assert len(slow_passes) == 1 and profile.frames == 1 and not profile.notes


def test_a_pass_slowed_by_another_process_does_not_move_the_shares():
    from omskills.profiling.discovery import discovery_profile

    net = Net()  # block 45 ms (of which b 20 ms), head 10 ms per pass
    passes = [0]

    def run(profiler):
        passes[0] += 1
        if passes[0] == 3:
            clock.sleep(1.0)  # the second warm pass loses a second outside every module...
        net(torch.zeros(2))
        if passes[0] == 4:
            net.head(torch.zeros(2))  # ...and the third spends twice as long in the head
        profiler.mark_frame()

    profile, _ = discovery_profile(net, run)
    assert profile.total_seconds == pytest.approx(0.055)
    assert profile.node("head").share == pytest.approx(0.01 / 0.055)
    assert profile.node("block.b").share == pytest.approx(0.02 / 0.055)


def test_a_model_too_fast_to_time_stops_at_the_pass_limit():
    from omskills.profiling.discovery import MAX_PASSES, discovery_profile

    net = nn.Linear(2, 2)
    passes = []

    def instant(profiler):
        passes.append(net(torch.zeros(2)))
        profiler.mark_frame()

    profile, _ = discovery_profile(net, instant)
    assert len(passes) == 1 + MAX_PASSES and profile.node("").calls == 1


def test_seeds_are_the_heaviest_subtrees_of_the_model_however_long_the_drivers_own_python_runs():
    from omskills.profiling.auto_seeds import seeds_from_profile

    # 55 ms in the model and 5 s in the driver's own Python (decoding, waiting for the CPU) per step.
    profile = run_frames(Net(), frames=2, control_plane_s=5.0)
    assert profile.node("block").share < 0.01  # of the main path
    seeds = seeds_from_profile(profile)
    assert [s.module_path for s in seeds] == ["block", "head", "block.a", "block.b"]  # shallow first, heaviest first
    assert seeds[0].description.startswith("Block, 81.8% of the model's time (0.9% of the main path)")


class Glue(nn.Module):
    """A second of its own work around a weighted child that takes 1 ms."""

    def __init__(self):
        super().__init__()
        self.small = Sleeper(0.001)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        clock.sleep(1.0)
        return self.small(x)


def test_a_model_whose_time_is_in_no_weighted_subtree_gives_no_seed_and_says_what_it_measured():
    from omskills.profiling.auto_seeds import seeds_from_profile, why_no_seeds

    profile = run_frames(Glue(), frames=1)
    assert seeds_from_profile(profile) == []
    assert why_no_seeds(profile) == (
        "a pass of the main path took 1001.00 ms, 1001.00 ms of it in the model's modules; the heaviest subtrees "
        "with parameters within 3 calls of the root, as shares of the model's time (a seed needs 2%): small 0.1%"
    )


def test_a_subtree_the_user_names_for_deployment_is_a_seed_however_small_its_measured_share():
    from omskills.profiling.auto_seeds import seeds_from_profile

    profile = run_frames(Glue(), frames=1)  # small: 0.1% of the model's time, far below a seed's 2%
    seeds = seeds_from_profile(profile, named=["small", "nothing_by_that_name"])
    assert [s.module_path for s in seeds] == ["small"] and seeds[0].description.startswith(
        "Sleeper, 0.1% of the model's time"
    )


class Stack(nn.Module):
    """A decoder as transformers writes one: blocks in a ModuleList (never called itself), each
    block's feed-forward inside a layer list of its own."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Module() for _ in range(2)])
        for block in self.blocks:
            block.layer = nn.ModuleList([Sleeper(0.01), Sleeper(0.03)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            for layer in block.layer:
                x = layer(x)
        return x


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.decoder = Stack()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(x)


def test_seed_depth_counts_calls_not_the_dots_of_containers_never_called():
    from omskills.profiling.auto_seeds import call_depths, seeds_from_profile

    profile = run_frames(Outer(), frames=1)
    assert call_depths(profile)["decoder.blocks.1.layer.1"] == 2  # five dots, two calls below the root
    assert {s.module_path for s in seeds_from_profile(profile)} == {
        "decoder",
        "decoder.blocks.0.layer.0",
        "decoder.blocks.0.layer.1",
        "decoder.blocks.1.layer.0",
        "decoder.blocks.1.layer.1",
    }
