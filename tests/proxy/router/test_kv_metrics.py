"""A registered instance's KV capacity from vLLM's /metrics (``router/kv_metrics.py``)."""

from __future__ import annotations

from lmcache_p2p.proxy.router.kv_metrics import KvCapacity, parse_kv_capacity

# as vLLM 0.32's API server renders them (labels abridged where they do not matter)
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",enable_prefix_caching="False",engine="0",gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="4096",prefix_caching_hash_algo="sha256"} 1.0
"""


def test_free_blocks_are_the_unused_share_of_the_cache():
    assert parse_kv_capacity(VLLM_METRICS) == KvCapacity(blocks=4096, free_blocks=3072, block_tokens=16)


def test_a_float_usage_does_not_lose_a_block():
    text = VLLM_METRICS.replace("} 0.25", "} 0.9").replace('num_gpu_blocks="4096"', 'num_gpu_blocks="10"')
    assert parse_kv_capacity(text) == KvCapacity(blocks=10, free_blocks=1, block_tokens=16)


def test_data_parallel_engines_sum_their_blocks():
    second = "\n".join(line.replace('engine="0"', 'engine="1"').replace("} 0.25", "} 0.75")
                       for line in VLLM_METRICS.splitlines() if line.startswith("vllm:"))
    assert parse_kv_capacity(VLLM_METRICS + second + "\n") == KvCapacity(8192, 4096, 16)


def test_without_the_metrics_the_capacity_is_unknown():
    assert parse_kv_capacity("# nothing here\nprocess_cpu_seconds_total 1.0\n") is None
    assert parse_kv_capacity(VLLM_METRICS.replace("num_gpu_blocks", "num_blocks")) is None
    assert parse_kv_capacity(VLLM_METRICS.replace("} 0.25", "} NaNx")) is None
