"""The launcher's cores and memory under a container's limits (impala_rep.plan): cgroup v2 and
v1 trees written under tmp_path, as /sys/fs/cgroup and /proc/self/cgroup show them."""

import os

from impala_rep import plan


def tree(root, files):
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)


def test_cgroup_v2_quota_and_memory_limit_along_the_path(tmp_path):
    root, proc = str(tmp_path / "fs"), str(tmp_path / "cgroup")
    tree(root, {
        "cgroup.controllers": "cpu memory",
        "cpu.max": "max 100000",
        "kube/cpu.max": "400000 100000",          # 4 cores for the pod
        "kube/job/cpu.max": "250000 100000",      # 2.5 for this container
        "kube/job/memory.max": str(8 << 30),
        "kube/job/memory.current": str(3 << 30),
        "kube/job/memory.stat": f"anon 123\ninactive_file {1 << 30}\n",
        "kube/memory.max": "max",
    })
    tree(str(tmp_path), {"cgroup": "0::/kube/job\n"})
    assert plan._cgroup_dirs("cpu", root, proc) == [os.path.join(root, "kube/job"), os.path.join(root, "kube"), root]
    assert plan.cgroup_cpu_limit(root, proc) == 2.5
    assert plan.cgroup_memory_available_mb(root, proc) == 6 * 1024  # 8 GiB less (3 less 1 inactive)


def test_cgroup_v1_and_a_container_that_sees_its_own_cgroup_as_the_root(tmp_path):
    root, proc = str(tmp_path / "fs"), str(tmp_path / "cgroup")
    # /proc/self/cgroup names the host's path, which the container's mount does not show
    tree(root, {
        "cpu/cpu.cfs_quota_us": "150000",
        "cpu/cpu.cfs_period_us": "100000",
        "memory/memory.limit_in_bytes": str(2 << 30),
        "memory/memory.usage_in_bytes": str(1 << 29),
        "memory/memory.stat": "total_inactive_file 0\n",
    })
    tree(str(tmp_path), {"cgroup": "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n1:name=systemd:/\n"})
    assert plan.cgroup_cpu_limit(root, proc) == 1.5
    assert plan.cgroup_memory_available_mb(root, proc) == 2048 - 512


def test_no_limits_and_no_cgroups_leave_the_host_figures(tmp_path, monkeypatch):
    root, proc = str(tmp_path / "fs"), str(tmp_path / "cgroup")
    tree(root, {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000",
                "memory/memory.limit_in_bytes": "9223372036854771712", "memory/memory.usage_in_bytes": "5"})
    tree(str(tmp_path), {"cgroup": "4:memory:/\n3:cpu:/\n"})
    assert plan.cgroup_cpu_limit(root, proc) is None and plan.cgroup_memory_available_mb(root, proc) is None
    assert plan.cgroup_cpu_limit(root, str(tmp_path / "missing")) is None
    # available_cores takes the quota rounded up, never more than the affinity allows
    affinity = len(os.sched_getaffinity(0))
    monkeypatch.setattr(plan, "cgroup_cpu_limit", lambda: 0.2)
    assert plan.available_cores() == 1
    monkeypatch.setattr(plan, "cgroup_cpu_limit", lambda: 1000.0)
    assert plan.available_cores() == affinity
    monkeypatch.setattr(plan, "cgroup_memory_available_mb", lambda: 100)
    assert plan.available_memory_mb() == 100
