"""KV capacity from the engines' own metrics, and the learned index's model of each LRU."""

from __future__ import annotations

from preheat.engine.core.scheduler import Scheduler
from preheat.engine.metrics import EngineMetrics
from preheat.router.kvcapacity import capacity_from_metrics, capacity_from_props
from preheat.router.kvindex import CAPACITY_SLACK, CapacityIndex
from preheat.router.policies import Instance, PolicyParams, PrefixAwarePolicy, RouteRequest
from preheat.timing import get_profile

SALT = b"0123456789abcdef-kv-capacity"


def test_the_simulated_engine_exports_cache_config_info_like_vllm() -> None:
    """The engine's /metrics text carries vllm:cache_config_info with block_size and
    num_gpu_blocks labels, and the router reads block_size x num_gpu_blocks from it."""
    sched = Scheduler(get_profile("tiny"), kv_blocks=600)
    text = EngineMetrics(sched, "m").render().decode()
    assert 'vllm:cache_config_info{block_size="16"' in text
    assert 'num_gpu_blocks="600"' in text
    assert capacity_from_metrics(text) == 600 * 16


def test_capacity_parsing_refuses_what_it_cannot_trust() -> None:
    """No metric, missing or non-numeric labels give None; llama.cpp props give
    context per slot x slots."""
    assert capacity_from_metrics("vllm:num_requests_running 1\n") is None
    assert capacity_from_metrics('vllm:cache_config_info{block_size="16"} 1\n') is None
    assert (
        capacity_from_metrics('vllm:cache_config_info{block_size="x",num_gpu_blocks="4"} 1') is None
    )
    props = {"default_generation_settings": {"n_ctx": 4096}, "total_slots": 4}
    assert capacity_from_props(props) == 16384
    assert capacity_from_props({"default_generation_settings": {}}) is None
    assert capacity_from_props([1, 2]) is None


def test_an_instance_forgets_what_its_engine_certainly_evicted() -> None:
    """Past capacity x slack tokens, the oldest blocks leave the instance's holders
    (oldest first; the root block of a prompt goes last); other instances keep theirs."""
    idx = CapacityIndex(max_entries=10_000, max_holders=4)
    idx.set_capacity("a", 1000)
    idx.record([1, 2], "a", [300, 300])
    idx.record([1, 2], "b", [300, 300])
    assert idx.depths([1, 2]) == {"a": 2, "b": 2}
    idx.record([7, 8], "a", [300, 300], tail_tokens=100)
    # 600 + 700 = 1300 > 1250: block 2 (the deepest of the older prompt) is dropped.
    assert idx.used("a") <= 1000 * CAPACITY_SLACK
    assert idx.depths([1, 2]) == {"a": 1, "b": 2}
    idx.record([9], "a", [600])
    assert idx.depths([1, 2]) == {"b": 2}
    assert idx.depths([7, 8]) == {"a": 2}
    assert idx.evicted_blocks == 2
    # A smaller capacity applies at once; forgetting the capacity stops the model.
    idx.set_capacity("a", 500)
    assert idx.used("a") <= 500 * CAPACITY_SLACK
    idx.forget("a")
    assert "a" not in idx.depths([7, 8]) and idx.used("a") == 0


def test_the_policy_stops_counting_an_evicted_document_as_held() -> None:
    """After an instance was sent more prompt than its KV cache holds, a document it
    served long ago is no longer an affinity match there."""
    p = PrefixAwarePolicy(PolicyParams(prefix_length=16384), salt=SALT)
    fleet = [Instance(f"http://127.0.0.1:{9100 + i}") for i in range(2)]
    # The router learns capacities before it routes (the first health round).
    for inst in fleet:
        p.set_capacity(inst.id, 2000)
    doc = "the first document " * 300
    first = p.choose(RouteRequest("r0", text=doc + " q0"), fleet)
    p.on_sent(RouteRequest("r0", text=doc + " q0"), first)
    again = p.choose(RouteRequest("r1", text=doc + " q1"), fleet)
    assert again.instance is first.instance and again.matched_blocks > 0
    for i in range(6):  # 6 x ~1,400 tokens of other documents, all on that instance
        other = RouteRequest(f"o{i}", text=f"other document {i} " * 300)
        c = p.choose(other, [first.instance])
        p.on_sent(other, c)
    late = p.choose(RouteRequest("r2", text=doc + " q2"), fleet)
    assert late.matched_blocks == 0
    assert p.index.used(first.instance.id) <= 2000 * CAPACITY_SLACK
