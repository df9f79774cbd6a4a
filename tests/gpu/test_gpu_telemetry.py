"""The node's GPUs through the real NVML (regional_agent/telemetry/node.py).

On a machine with an NVIDIA driver the agent's telemetry opens NVML and reads every GPU
torch sees: memory within the device's and a temperature for each, its utilization a
ratio and its clock event reasons a set where the device reports them (a MIG instance
does not); the hardware gauges carry one series per GPU; no XID error counted.
"""

from __future__ import annotations

from pathlib import Path

import torch
from prometheus_client import CollectorRegistry

from regional_agent.telemetry.metrics import HardwareMetrics
from regional_agent.telemetry.node import NodeTelemetry, open_nvml
from tests.support.gpu import require_cuda


def test_nvml_reads_every_gpu_torch_sees(tmp_path: Path) -> None:
    require_cuda()
    reader, why = open_nvml()
    assert reader is not None, why
    gpus = reader.read()
    assert len(gpus) >= torch.cuda.device_count()
    for gpu in gpus:
        assert gpu.memory_total_bytes is not None
        assert gpu.memory_total_bytes > 0
        assert gpu.memory_used_bytes is not None
        assert 0 <= gpu.memory_used_bytes <= gpu.memory_total_bytes
        if gpu.utilization_ratio is not None:
            assert 0.0 <= gpu.utilization_ratio <= 1.0
        assert gpu.temperature_celsius is not None
    registry = CollectorRegistry()
    node, sampled = NodeTelemetry(tmp_path, node="gpu-node").sample()
    assert sampled is not None
    HardwareMetrics(registry, "eu-west").sampled("gpu-node", node, sampled)
    labels = {"region": "eu-west", "host": "gpu-node", "gpu": "0"}
    assert registry.get_sample_value("geofed_agent_gpu_memory_total_bytes", labels)
    host = {"region": "eu-west", "host": "gpu-node"}
    assert registry.get_sample_value("geofed_agent_gpus", host) == len(sampled)
    # XID events are watched on the devices that support them: none raised on a healthy GPU.
    for gpu in reader.read():
        assert gpu.xid_errors in (None, {})
    reader.close()
