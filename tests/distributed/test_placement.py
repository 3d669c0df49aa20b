"""Placements and the shard simulator: no Ray needed (the core pass runs these)."""

from __future__ import annotations

import json
import subprocess
import sys
from itertools import product
from pathlib import Path

import numpy as np
import pytest

import aioexperts
import aioexperts.distributed as dist
from aioexperts.distributed import (
    Placement,
    calls_per_step,
    coactivation_placement,
    frequency_balanced_placement,
    make_placement,
    round_robin_placement,
    simulate_shards,
)
from aioexperts.testing import SyntheticSpec, write_synthetic_model
from aioexperts.traces import replay

SPEC = SyntheticSpec(n_layer=2, n_embd=256, n_ff_exp=256, n_expert=16, n_expert_used=4, leading_dense=1)


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory) -> aioexperts.ExpertLayout:
    path = tmp_path_factory.mktemp("placement") / "model.gguf"
    write_synthetic_model(path, SPEC)
    return aioexperts.build_layout(aioexperts.open_model(path))


def _trace(layout: aioexperts.ExpertLayout, n_tokens: int = 200, seed: int = 0) -> aioexperts.RoutingTrace:
    from aioexperts.traces import skewed_random_trace

    return skewed_random_trace(n_tokens, tuple(layout.layers), 16, 4, seed, zipf_exponent=1.2, locality=0.3)


def test_the_package_exports_exactly_all_and_imports_without_ray() -> None:
    public = {n for n in dir(dist) if not n.startswith("_")} - {"annotations"}
    submodules = {"placement", "runner", "shard", "simulate"}
    assert public - submodules == set(dist.__all__)
    code = "import aioexperts.distributed, sys; assert 'ray' not in sys.modules, 'imported ray'"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stderr


def test_without_ray_starting_shards_is_one_clear_error() -> None:
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "from aioexperts.distributed import expert_shard_actor\n"
        "try:\n    expert_shard_actor()\nexcept ImportError as exc:\n    print(type(exc).__name__, exc)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert run.stdout.strip() == (
        "OptionalDependencyError aioexperts.distributed needs Ray to run shards: pip install 'aioexperts[ray]'"
    )


@pytest.mark.parametrize("n_shards", [1, 2, 3, 5])
def test_every_method_places_every_expert_once(layout: aioexperts.ExpertLayout, n_shards: int) -> None:
    trace = _trace(layout)
    for method in dist.PLACEMENT_METHODS:
        placement = make_placement(method, layout, n_shards, trace, n_embd=256)
        assert placement.layers == tuple(layout.layers) and placement.n_experts == (16, 16)
        for layer in layout.layers:
            owners = placement.owner_of(layer)
            assert owners.shape == (16,) and 0 <= owners.min() and owners.max() < n_shards
        owned = [placement.experts_of(s) for s in range(n_shards)]
        for layer in layout.layers:
            assert sorted(e for o in owned for e in o[layer]) == list(range(16))
        assert placement.counts().sum() == 32


def test_round_robin_is_the_expert_modulo_shards(layout: aioexperts.ExpertLayout) -> None:
    placement = round_robin_placement(layout, 4, n_embd=256)
    assert placement.owner_of(1).tolist() == [e % 4 for e in range(16)]
    assert placement.owner_of(2).tolist() == [(e + 1) % 4 for e in range(16)]


def _served(trace: aioexperts.RoutingTrace, placement: Placement) -> np.ndarray:
    load = np.zeros(placement.n_shards)
    for i, layer in enumerate(trace.layers):
        for e in trace.ids[:, i, :].reshape(-1):
            load[placement.owner_of(layer)[e]] += 1
    return load


def test_frequency_balance_evens_the_expected_bytes(layout: aioexperts.ExpertLayout) -> None:
    trace = _trace(layout, 400)
    balanced = _served(trace, frequency_balanced_placement(layout, trace, 4, n_embd=256))
    modulo = _served(trace, round_robin_placement(layout, 4, n_embd=256))
    assert balanced.max() / balanced.mean() < modulo.max() / modulo.mean()
    assert balanced.max() / balanced.mean() < 1.1


def test_coactivation_cuts_the_calls_per_token(layout: aioexperts.ExpertLayout) -> None:
    """A trace where experts come in fixed groups of four: grouped on one shard, a token calls one shard
    per layer; round-robin spreads every group over all four shards."""
    rng = np.random.default_rng(1)
    groups = rng.permutation(16).reshape(4, 4)
    chosen = np.stack([rng.permutation(300) % 4 for _ in range(2)], axis=1)  # each group as often
    ids = groups[chosen]  # (tokens, layers, k)
    trace = aioexperts.RoutingTrace(ids, tuple(layout.layers), 16)
    clustered = coactivation_placement(layout, trace, 4, n_embd=256)
    assert calls_per_step(trace, clustered).max() == 1
    assert calls_per_step(trace, round_robin_placement(layout, 4, n_embd=256)).mean() > 2


def test_a_placement_round_trips_through_its_file(layout: aioexperts.ExpertLayout, tmp_path: Path) -> None:
    placement = coactivation_placement(layout, _trace(layout), 3, n_embd=256, metadata={"model": "m"})
    path = tmp_path / "placement.json"
    placement.save(path)
    data = json.loads(path.read_text())
    assert data["format"] == dist.PLACEMENT_FORMAT and data["method"] == "coactivation"
    again = Placement.load(path)
    assert again == placement and again.metadata == {"model": "m"}
    again.check_model(layout, 256)


def test_saving_into_a_missing_folder_names_the_users_path(layout: aioexperts.ExpertLayout, tmp_path: Path) -> None:
    """Not the temporary ``PATH.tmp-PID`` written beside it (as ``RoutingTrace.save``)."""
    target = tmp_path / "no-such-dir" / "placement.json"
    with pytest.raises(FileNotFoundError) as info:
        round_robin_placement(layout, 2, n_embd=256).save(target)
    assert info.value.filename == str(target) and not (tmp_path / "no-such-dir").exists()


def test_a_placement_of_another_model_is_refused(layout: aioexperts.ExpertLayout, tmp_path: Path) -> None:
    placement = round_robin_placement(layout, 2, n_embd=256)
    other_path = tmp_path / "other.gguf"
    write_synthetic_model(other_path, SyntheticSpec(n_layer=3, n_embd=256, n_ff_exp=256, n_expert=8, n_expert_used=2))
    other = aioexperts.build_layout(aioexperts.open_model(other_path))
    with pytest.raises(aioexperts.PlacementError, match="MoE layers"):
        placement.check_model(other, 256)  # layers 0..2, not 1..2
    fewer = Placement(2, (1, 2), (16, 8), 256, (placement.owners[0], np.zeros(8, dtype=np.int32)))
    with pytest.raises(aioexperts.PlacementError, match="layer 2 8 experts, the model has 16"):
        fewer.check_model(layout, 256)
    with pytest.raises(aioexperts.PlacementError, match="n_embd=256, the model has n_embd=512"):
        placement.check_model(layout, 512)
    assert issubclass(aioexperts.PlacementError, aioexperts.ConfigError)
    with pytest.raises(aioexperts.PlacementError):
        simulate_shards(
            aioexperts.RoutingTrace(np.zeros((1, 3, 2), np.int16), (0, 1, 2), 8), placement, slots_per_shard=4
        )


@pytest.mark.parametrize(
    "text",
    [
        "[]",
        '{"format": "aioexperts-placement/2"}',
        '{"format": "aioexperts-placement/1", "n_shards": 2, "n_embd": 256, "layers": [1], "n_experts": [2]}',
        '{"format": "aioexperts-placement/1", "n_shards": 2, "n_embd": 256, "layers": [1], "n_experts": [2], '
        '"owners": [[0, 2]]}',
        '{"format": "aioexperts-placement/1", "n_shards": 2, "n_embd": 256, "layers": [1], "n_experts": [2], '
        '"owners": [[0, "1"]]}',
        '{"format": "aioexperts-placement/1", "n_shards": 2, "n_embd": 256, "layers": [1], "n_experts": [3], '
        '"owners": [[0, 1]]}',
        "{not json",
    ],
)
def test_a_broken_placement_file_is_a_format_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(aioexperts.FormatError, match="bad.json"):
        Placement.load(path)


def test_bad_arguments_are_config_errors(layout: aioexperts.ExpertLayout) -> None:
    with pytest.raises(aioexperts.ConfigError):
        round_robin_placement(layout, 0)
    with pytest.raises(aioexperts.ConfigError, match="from a routing trace"):
        make_placement("frequency", layout, 2)
    with pytest.raises(aioexperts.ConfigError, match="unknown placement"):
        make_placement("random", layout, 2)
    with pytest.raises(aioexperts.ConfigError, match="slack"):
        coactivation_placement(layout, _trace(layout), 2, slack=-1)


def test_simulated_calls_per_token_equal_a_brute_force_count(layout: aioexperts.ExpertLayout) -> None:
    """Per (token, layer): the distinct owners of its active experts, counted in plain Python."""
    trace = _trace(layout, 40, seed=5)
    ids = trace.ids.copy()
    ids[3, 0, 1:] = -1  # fewer active slots, and a step with none
    ids[7, 1, :] = -1
    trace = aioexperts.RoutingTrace(ids, trace.layers, trace.n_experts)
    for n_shards, method in product((1, 2, 3, 8), dist.PLACEMENT_METHODS):
        placement = make_placement(method, layout, n_shards, trace, n_embd=256)
        brute = 0
        for t in range(trace.n_tokens):
            for i, layer in enumerate(trace.layers):
                brute += len({int(placement.owner_of(layer)[e]) for e in trace.ids[t, i] if e >= 0})
        sim = simulate_shards(trace, placement, slots_per_shard=8, call_ms=2.0, submit_us=100.0)
        assert sim.calls_per_token == pytest.approx(brute / trace.n_tokens)
        steps = calls_per_step(trace, placement)
        assert int(steps.sum()) == brute
        added = sum(2.0 + (c - 1) * 0.1 for c in steps.reshape(-1) if c > 0)
        assert sim.added_ms_per_token == pytest.approx(added / trace.n_tokens)
        assert sim.added_ms_per_layer == pytest.approx(added / (trace.n_tokens * trace.n_layers))


def test_simulated_load_and_hit_rates_match_their_definitions(layout: aioexperts.ExpertLayout) -> None:
    trace = _trace(layout, 120, seed=2)
    placement = round_robin_placement(layout, 2, n_embd=256)
    sizes = [np.full(16, 1000, dtype=np.int64), np.full(16, 1000, dtype=np.int64)]
    sim = simulate_shards(trace, placement, sizes, slots_per_shard=6)
    served = _served(trace, placement) * 1000
    assert sim.served_bytes == tuple(int(v) for v in served)
    assert sim.load_imbalance == pytest.approx(served.max() / served.mean())
    for s in range(2):  # each shard's own replay: the sub-trace of its experts through a 6-slot LRU
        masked = trace.ids.copy()
        for i, layer in enumerate(trace.layers):
            masked[:, i][placement.owner_of(layer)[trace.ids[:, i]] != s] = -1
        want = replay(aioexperts.RoutingTrace(masked, trace.layers, 16), 6, ("lru",), bytes_per_expert=1000)["lru"]
        assert sim.hit_rates[s] == pytest.approx(want.hit_rate)
        assert sim.read_bytes[s] == want.bytes_read
    one = simulate_shards(trace, round_robin_placement(layout, 1, n_embd=256), sizes, slots_per_shard=6)
    assert one.load_imbalance == 1.0 and one.calls_per_token <= trace.n_layers


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", [("trio", {})], ids=["trio"])
async def test_the_sharded_runner_refuses_what_cannot_work_before_any_call(
    tmp_path: Path, anyio_backend: object
) -> None:
    """No Ray needed: the wrong number of shards, a placement of another model, and trio are refused."""
    path = tmp_path / "model.gguf"
    write_synthetic_model(path, SPEC)
    async with aioexperts.open(path, slots=4) as store:
        placement = round_robin_placement(store.layout, 2, n_embd=256)
        with pytest.raises(aioexperts.PlacementError, match="2 shards, 3 shard handles"):
            dist.ShardedRunner(store, [object()] * 3, placement)
        other = Placement(2, (0, 1), (16, 16), 256, placement.owners)
        with pytest.raises(aioexperts.PlacementError, match="MoE layers"):
            dist.ShardedRunner(store, [object()] * 2, other)
        with pytest.raises(aioexperts.ConfigError, match="call_timeout"):
            dist.ShardedRunner(store, [object()] * 2, placement, call_timeout=0)
        runner = dist.ShardedRunner(store, [object()] * 2, placement)
        with pytest.raises(aioexperts.ConfigError, match="asyncio"):
            await runner.moe(1, np.ones((1, 256), dtype=np.float32))
