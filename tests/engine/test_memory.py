"""The `auto` memory budget of a decoder (engine.runtime.memory): a device share less the weights and a reserve, or
on CPU what the container (else the host) leaves, less a reserve."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.runtime import memory
from engine.runtime.memory import HostMemory, device_memory_budget, memory_budget_for

GIB = 2**30


def test_the_budget_is_the_share_less_the_weights_and_a_tenth_reserve() -> None:
    assert memory_budget_for(4 * GIB, GIB) == 4 * GIB - GIB - int(0.4 * GIB)


def test_a_small_share_keeps_at_least_256_mib_in_reserve() -> None:
    assert memory_budget_for(GIB, GIB // 2) == GIB - GIB // 2 - (256 << 20)


def test_a_share_the_weights_fill_is_refused_with_the_sizes() -> None:
    with pytest.raises(ValueError, match=r"share of 1.00 GiB holds 0.90 GiB in use"):
        memory_budget_for(GIB, int(0.9 * GIB))


MEMINFO = "MemTotal:       16777216 kB\nMemFree:         1048576 kB\nMemAvailable:   12582912 kB\n"  # 16 GiB, 4 in use


def _host_files(tmp_path: Path, proc_self_cgroup: str, cgroups: dict[str, dict[str, str]]) -> HostMemory:
    """A host with the given /proc/self/cgroup and cgroup files (directory under the mount -> file -> text)."""
    (tmp_path / "meminfo").write_text(MEMINFO)
    (tmp_path / "cgroup").write_text(proc_self_cgroup)
    for directory, files in cgroups.items():
        (tmp_path / "fs" / directory).mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (tmp_path / "fs" / directory / name).write_text(text)
    return HostMemory(cgroup_root=tmp_path / "fs", proc_self_cgroup=tmp_path / "cgroup", meminfo=tmp_path / "meminfo")


def test_on_cpu_a_v2_container_limit_binds_with_its_working_set(tmp_path: Path) -> None:
    host = _host_files(
        tmp_path,
        "0::/pod/replica\n",
        {
            "pod": {"memory.max": str(8 * GIB), "memory.current": str(3 * GIB), "memory.stat": "inactive_file 0\n"},
            "pod/replica": {"memory.max": "max", "memory.current": str(GIB), "memory.stat": "inactive_file 0\n"},
        },
    )
    assert host.limit_and_use() == (8 * GIB, 3 * GIB)  # the parent's limit binds, with the parent's use


def test_on_cpu_a_v1_limit_counts_usage_less_the_inactive_file_cache(tmp_path: Path) -> None:
    stat = f"cache {GIB}\ntotal_inactive_file {GIB}\n"
    files = {"memory.limit_in_bytes": str(6 * GIB), "memory.usage_in_bytes": str(3 * GIB), "memory.stat": stat}
    host = _host_files(tmp_path, "4:memory:/\n1:cpu:/\n", {"memory": files})
    assert host.limit_and_use() == (6 * GIB, 2 * GIB)


def test_on_cpu_with_no_limit_below_the_host_the_host_memory_is_used(tmp_path: Path) -> None:
    unlimited = {"memory.limit_in_bytes": str(2**63 - 4096), "memory.usage_in_bytes": "0", "memory.stat": ""}
    host = _host_files(tmp_path, "4:memory:/job\n", {"memory/job": unlimited})
    assert host.limit_and_use() == (16 * GIB, 4 * GIB)


def test_on_cpu_nothing_readable_means_no_byte_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = HostMemory(tmp_path / "none", tmp_path / "none", tmp_path / "none")
    assert missing.limit_and_use() is None
    monkeypatch.setattr(memory, "host_memory", missing.limit_and_use)
    assert device_memory_budget(torch.device("cpu"), None) is None


def test_on_cpu_auto_is_what_is_left_less_a_reserve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "host_memory", lambda: (8 * GIB, 3 * GIB))
    assert device_memory_budget(torch.device("cpu"), 0.5) == memory_budget_for(8 * GIB, 3 * GIB)
    monkeypatch.setattr(memory, "host_memory", lambda: (4 * GIB, int(3.8 * GIB)))
    with pytest.raises(ValueError, match=r"may use of 4.00 GiB holds 3.80 GiB in use"):
        device_memory_budget(torch.device("cpu"), None)


@pytest.mark.parametrize(("share", "expected_share_bytes"), [(0.25, 4 * GIB), (None, 16 * GIB), (1.0, 16 * GIB)])
def test_on_cuda_auto_takes_the_replicas_fraction_of_the_card(
    monkeypatch: pytest.MonkeyPatch, share: float | None, expected_share_bytes: int
) -> None:
    # no GPU here: the card's size and the allocated weights are what CUDA would report
    card = SimpleNamespace(total_memory=16 * GIB)
    monkeypatch.setattr(memory.torch.cuda, "get_device_properties", lambda device: card)
    monkeypatch.setattr(memory.torch.cuda, "memory_allocated", lambda device: GIB)
    budget = device_memory_budget(torch.device("cuda", 0), share)
    assert budget == memory_budget_for(expected_share_bytes, GIB)
