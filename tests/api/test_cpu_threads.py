"""DeployConfig.cpu_threads: 'auto' reads affinity, cgroup quota and load; VideoGenerator applies it on CPU."""

from __future__ import annotations

import argparse

import pytest
import torch

from omniloop.api.generator import VideoGenerator
from omniloop.api.schema_flags import add_schema_flags, collect
from omniloop.cpu_threads import CpuBudget, apply_cpu_threads, cgroup_quota, read_budget
from omniloop.deploy import DeployConfig


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("budget, threads", [
    (CpuBudget(current=2, affinity=2, quota=None, machine=2, load=0.1), 2),  # idle box: all its cores
    (CpuBudget(current=2, affinity=2, quota=None, machine=2, load=1.3), 1),  # one core busy: one thread
    (CpuBudget(current=2, affinity=2, quota=None, machine=2, load=15.0), 1),  # overloaded: never below 1
    (CpuBudget(current=16, affinity=4, quota=None, machine=16, load=0.0), 4),  # pinned to 4 cores
    (CpuBudget(current=16, affinity=16, quota=2.5, machine=16, load=0.0), 3),  # a 2.5-core quota
    (CpuBudget(current=1, affinity=8, quota=None, machine=8, load=0.0), 1),  # OMP_NUM_THREADS=1 is kept
    (CpuBudget(current=8, affinity=8, quota=None, machine=8, load=None), 8),  # no load average
])
def test_auto_takes_the_smallest_limit(budget, threads):
    assert budget.threads == threads


def test_cgroup_quota_v2_v1_and_unlimited(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_quota(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_quota(tmp_path) is None
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("200000")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000")
    assert cgroup_quota(tmp_path) == 2.0
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1")
    assert cgroup_quota(tmp_path) is None
    assert cgroup_quota(tmp_path / "missing") is None


def test_this_machine_budget_is_sane():
    budget = read_budget()
    assert 1 <= budget.threads <= budget.current and budget.affinity >= 1


def test_deploy_config_values_and_errors():
    assert DeployConfig().cpu_threads == "auto"
    assert DeployConfig(cpu_threads=3).cpu_threads == 3
    assert DeployConfig(cpu_threads="2").cpu_threads == 2
    for bad in (0, -1, "many", 1.5, True):
        with pytest.raises(ValueError, match="cpu_threads"):
            DeployConfig(cpu_threads=bad)


def test_cli_flag_takes_a_number_or_auto():
    p = argparse.ArgumentParser()
    names = add_schema_flags(p, DeployConfig, skip={"plugins", "limits"})
    assert collect(p.parse_args(["--cpu-threads", "auto"]), names) == {"cpu_threads": "auto"}
    assert DeployConfig(**collect(p.parse_args(["--cpu-threads", "1"]), names)).cpu_threads == 1
    with pytest.raises(SystemExit):
        p.parse_args(["--cpu-threads", "lots"])


def test_video_generator_applies_it_on_cpu(wan_t2v_dir, restore_threads):
    torch.set_num_threads(2)
    VideoGenerator.from_pretrained(wan_t2v_dir, device="cpu", dtype="float32", cpu_threads=1)
    assert torch.get_num_threads() == 1
    VideoGenerator.from_pretrained(wan_t2v_dir, device="cpu", dtype="float32")  # auto never raises the count
    assert torch.get_num_threads() == 1
    assert apply_cpu_threads(2) == 2 and torch.get_num_threads() == 2
