"""hf_polyattn.machine: the one description of the machine that bench, training records and recipes use."""

import re

import torch

from hf_polyattn import machine


def test_summary_names_cores_device_torch_threads():
    text = machine.summary()
    assert re.fullmatch(r"\d+-core CPU \(.+\), (CUDA .+|no GPU), torch \S+, \d+ threads", text), text
    assert torch.__version__ in text
    assert (machine.gpu_name() is None) == (not torch.cuda.is_available())


def test_recipes_and_bench_name_the_cpu_alike():
    from hf_polyattn import bench

    assert machine.cpu_name()
    assert machine.describe().startswith(machine.cpu_name() + ",")
    record = machine.record()
    assert record["cpu"] == machine.cpu_name() and record["torch"] == torch.__version__ and record["gpu"] is False
    assert "load average" in record["uptime"] and set(machine.basics()) == {"torch", "machine", "cpu_count"}
    args = bench.build_parser().parse_args([])  # the CPU defaults
    assert bench.machine(args).startswith(f"CPU {machine.cpu_name()},")
