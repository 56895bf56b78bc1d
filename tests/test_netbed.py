"""Emulated nodes (labkit.runtime.netbed): a job on 2 nodes x 2 ranks, links really throttled,
and nothing of the bed left behind after a normal end, a raising rank, or a SIGKILLed caller.
Needs root (network namespaces, tc): skipped with the reason elsewhere."""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from labkit.runtime import netbed

ROOT = Path(__file__).resolve().parent.parent
WHY = netbed.unavailable()
needs_bed = pytest.mark.skipif(WHY is not None, reason=WHY or "")

SLOW = "50mbit"
MESSAGE = 8 << 20  # 8 MiB: >= 1.34 s across at 50 Mbit/s, whatever the load; milliseconds inside a node


def _where():
    """A rank's namespace, pid, its bed's namespace, and the routes it sees."""
    import torch.distributed as dist
    return dict(rank=dist.get_rank(), world=dist.get_world_size(), pid=os.getpid(),
                ns=os.readlink("/proc/self/ns/net"), bed_ns=os.readlink(f"/proc/{os.getppid()}/ns/net"),
                route_self=subprocess.run(["ip", "route", "get", os.environ["MASTER_ADDR"].rsplit(".", 1)[0] + "."
                                           + str(int(os.environ["NODE_RANK"]) + 1)],
                                          capture_output=True, text=True).stdout)


def _job():
    import time as t

    import torch
    import torch.distributed as dist
    out = _where()
    rank, buf = dist.get_rank(), torch.zeros(MESSAGE, dtype=torch.uint8)
    for peer in (1, 2):  # rank 1: same node as rank 0; rank 2: the other node
        dist.barrier()
        start = t.perf_counter()
        if rank == 0:
            dist.send(buf, peer)
            dist.recv(buf[:1], peer)
        elif rank == peer:
            dist.recv(buf, 0)
            dist.send(buf[:1], 0)
        out[f"to{peer}"] = t.perf_counter() - start
    return out


def _survivors(namespaces) -> list[str]:
    """Processes still in any of ``namespaces`` (a process holding a namespace keeps it alive)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/ns/net") in namespaces:
                found.append(pid)
        except OSError:
            pass
    return found


def _assert_gone(namespaces, links_before, wait=20.0):
    deadline = time.monotonic() + wait
    while _survivors(namespaces) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _survivors(namespaces), f"processes still in the bed's namespaces: {_survivors(namespaces)}"
    assert _host_links() == links_before, f"the host's links changed: {links_before} -> {_host_links()}"
    assert subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout == NETNS_BEFORE


def _host_links():
    return sorted(line.split(":")[1].strip() for line in
                  subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout.splitlines())


NETNS_BEFORE = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout if WHY is None else ""


@needs_bed
def test_two_nodes_results_throttling_and_cleanup():
    links = _host_links()
    results = netbed.run_on_nodes(_job, 2, 2, bandwidth=SLOW, timeout=120)
    assert [r["rank"] for r in results] == [0, 1, 2, 3] and {r["world"] for r in results} == {4}
    host_ns = os.readlink("/proc/self/ns/net")
    node_ns = [r["ns"] for r in results]
    assert node_ns[0] == node_ns[1] != node_ns[2] == node_ns[3], f"ranks by node: {node_ns}"
    assert host_ns not in node_ns + [results[0]["bed_ns"]]
    assert all("dev lo" in r["route_self"] for r in results), [r["route_self"] for r in results]
    floor = MESSAGE * 8 / 50e6 * 0.8  # 50 Mbit/s, less tbf's 64 KiB bursts on two hops, with room
    inside, across = results[0]["to1"], results[0]["to2"]
    assert across > floor, f"8 MiB across nodes took {across:.3f} s, under the {floor:.2f} s a 50 Mbit/s link allows"
    assert inside < floor / 2, f"8 MiB inside a node took {inside:.3f} s, as slow as the throttled link"
    _assert_gone(set(node_ns + [results[0]["bed_ns"]]), links)


def _raises_on_3(folder):
    import torch.distributed as dist
    where = _where()
    with open(os.path.join(folder, str(where["rank"])), "w") as f:
        f.write(where["ns"] + "\n" + where["bed_ns"])
    dist.barrier()
    if dist.get_rank() == 3:
        raise ValueError("boom on purpose")
    dist.barrier()  # the others wait for rank 3, which never comes: the bed must kill them
    return _where()


@needs_bed
def test_raising_rank_is_named_and_cleaned_up(tmp_path):
    links = _host_links()
    with pytest.raises(netbed.NetbedError, match="rank 3 raised ValueError: boom on purpose") as info:
        netbed.run_on_nodes(_raises_on_3, 2, 2, str(tmp_path), timeout=120)
    assert info.value.rank == 3 and "boom on purpose" in info.value.remote_traceback
    namespaces = {line for f in tmp_path.iterdir() for line in f.read_text().split()}
    assert len(namespaces) == 3, f"2 nodes + the switch: {namespaces}"
    _assert_gone(namespaces, links)


DRIVER = textwrap.dedent("""
    import os, sys, time
    from labkit.runtime.netbed import run_on_nodes

    def rank_fn(folder):
        import torch.distributed as dist
        with open(os.path.join(folder, str(dist.get_rank())), "w") as f:
            f.write(os.readlink("/proc/self/ns/net") + "\\n" + os.readlink(f"/proc/{os.getppid()}/ns/net"))
        time.sleep(300)

    run_on_nodes(rank_fn, 2, 2, sys.argv[1], timeout=600)
""")


@needs_bed
def test_sigkill_of_the_caller_leaves_nothing(tmp_path):
    links = _host_links()
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(tmp_path)], cwd=ROOT)
    deadline = time.monotonic() + 90
    while len(list(tmp_path.iterdir())) < 4 and time.monotonic() < deadline:
        assert driver.poll() is None, "the driver exited before its ranks started"
        time.sleep(0.1)
    time.sleep(0.2)  # every rank has written both lines
    namespaces = {line for f in tmp_path.iterdir() for line in f.read_text().split()}
    assert len(namespaces) == 3, f"2 nodes + the switch: {namespaces}"
    assert _survivors(namespaces), "the ranks should be running"
    driver.kill()
    driver.wait()
    _assert_gone(namespaces, links)


def test_unavailable_says_why(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    why = netbed._probe()
    assert why is not None and "root" in why, why
    monkeypatch.setattr(netbed, "_UNAVAILABLE", [why])
    with pytest.raises(netbed.NetbedUnavailable, match="need root"):
        netbed.run_on_nodes(_job, 2, 2)
    from labkit.course.bench.ch11_compress import hierarchical_emulated_row
    line = hierarchical_emulated_row()
    assert line.startswith("hierarchical_emulated: skipped: ") and "need root" in line, line
