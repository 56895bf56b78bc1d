"""Emulated nodes: run a gloo job whose ranks sit on "nodes" joined by throttled links.

    results = run_on_nodes(fn, nodes, ranks_per_node, *args, bandwidth="1gbit", latency_us=0)

Each node is a Linux network namespace; node i has one interface, ``eth0``, with the address
10.200.0.(i+1)/24, joined by a veth pair to a bridge in a "switch" namespace. Both ends of
each pair are shaped with ``tc`` (``tbf`` at ``bandwidth``; with ``latency_us`` > 0, ``netem``
adds that one-way delay on the node's side, where the kernel has ``sch_netem``). The ranks of a
node share its namespace: gloo binds them to the node's address (``GLOO_SOCKET_IFNAME=eth0``),
and a connection to one's own node address is routed over the namespace's loopback, so
traffic inside a node is fast and traffic between nodes crosses two shaped veth ends. The
rendezvous store listens on rank 0's node, 10.200.0.1. Ranks are node-major: rank = node * L +
local, as ``labkit.compress.NodeGroups`` lays them out.

Nothing touches the host's network: the whole bed is a child process (the "bed") that first
moves into a new network namespace of its own (the switch), and every address, link and
route lives in namespaces it made. Node namespaces are unnamed, held by one small process
each; the kernel frees a namespace with its last process, so when the bed dies (the job ended,
a rank raised, a timeout, or the caller was SIGKILLed: the bed and every process under it have
PR_SET_PDEATHSIG), its namespaces, veths and addresses go with it.

The bed imports torch and unpickles the job once, then forks the ranks (each joins its node's
namespace before it touches the network). ``fn`` is shipped by value (cloudpickle), as
``labkit.launch`` does; a rank that raises makes
``NetbedError`` naming it (the others are killed); a job past ``timeout`` raises
``TimeoutError``. What ranks print goes to the caller's stderr. It needs root, Linux, and
``ip``/``tc`` (iproute2): ``unavailable()`` says in one sentence why not, and
``run_on_nodes`` raises ``NetbedUnavailable`` with it.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import select
import shutil
import signal
import subprocess
import sys
import time
import traceback

import cloudpickle

CLONE_NEWNET = 0x40000000
SUBNET = "10.200.0"           # only ever inside the namespaces the bed made
PORT = 29500                  # the store's port: the namespace is ours, nothing can clash
_LIBC = ctypes.CDLL(None, use_errno=True)


class NetbedUnavailable(RuntimeError):
    """This machine cannot make emulated nodes (not root, no namespaces, no ``ip``/``tc``)."""


class NetbedError(RuntimeError):
    """A rank raised or died; ``rank`` and its ``remote_traceback``."""

    def __init__(self, rank: int, message: str, remote_traceback: str = ""):
        self.rank, self.remote_traceback = rank, remote_traceback
        super().__init__(f"rank {rank} {message}" + (f"\n--- remote traceback (rank {rank}) ---\n"
                                                     f"{remote_traceback.rstrip()}" if remote_traceback else ""))


def node_address(node: int) -> str:
    return f"{SUBNET}.{node + 1}"


def _pdeathsig(parent: int) -> None:
    _LIBC.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:      # it died before prctl took effect
        os._exit(1)


def _enter(ns_path: str | None, parent: int):
    """A preexec_fn: die with the parent, then join the network namespace ``ns_path`` (None:
    a new one)."""
    def preexec():
        _pdeathsig(parent)
        if ns_path is None:
            ok = _LIBC.unshare(CLONE_NEWNET) == 0
        else:
            fd = os.open(ns_path, os.O_RDONLY)
            ok = _LIBC.setns(fd, CLONE_NEWNET) == 0
        if not ok:
            os._exit(1)
    return preexec


_UNAVAILABLE: list = []


def unavailable() -> str | None:
    """Why emulated nodes cannot run here (one sentence), or None."""
    if not _UNAVAILABLE:
        _UNAVAILABLE.append(_probe())
    return _UNAVAILABLE[0]


def _probe() -> str | None:
    if not sys.platform.startswith("linux"):
        return "emulated nodes need Linux network namespaces"
    if os.geteuid() != 0:
        return "emulated nodes need root (network namespaces and tc); CI runs them as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"emulated nodes need the `{tool}` tool (apt-get install iproute2)"
    probe = subprocess.run(["ip", "link", "show", "lo"], preexec_fn=_enter(None, os.getpid()),
                           capture_output=True)
    if probe.returncode != 0:
        return "this machine refuses to make a network namespace (unshare(CLONE_NEWNET) failed)"
    return None


def netem_available() -> bool:
    """Whether the kernel can delay packets (``sch_netem``); without it ``latency_us`` must be 0."""
    return _bed_request(dict(probe_netem=True), timeout=30)


def run_on_nodes(fn, nodes: int, ranks_per_node: int, *args, bandwidth: str = "1gbit",
                 latency_us: float = 0, timeout: float = 120, nice: int = 0, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on ``nodes x ranks_per_node`` gloo ranks, on emulated nodes
    joined by links of ``bandwidth`` (a tc rate: "1gbit", "100mbit") and ``latency_us`` of
    one-way delay; return the results in rank order. ``nice`` < 0 raises the ranks' CPU
    priority (set before gloo starts its threads, so they inherit it): on a shared, loaded
    machine a node's ranks then wake when their message arrives, as on a node of their own,
    instead of queueing behind other processes' CPU hogs."""
    for name, value in (("nodes", nodes), ("ranks_per_node", ranks_per_node)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"run_on_nodes: {name} must be a positive integer, got {value!r}")
    if nodes > 250:
        raise ValueError(f"run_on_nodes: at most 250 nodes (one /24), got {nodes}")
    if latency_us < 0:
        raise ValueError(f"run_on_nodes: latency_us must be >= 0, got {latency_us}")
    job = cloudpickle.dumps((fn, args, kwargs))
    return _bed_request(dict(nodes=nodes, ranks_per_node=ranks_per_node, bandwidth=bandwidth,
                             latency_us=latency_us, timeout=timeout, job=job, path=sys.path,
                             cwd=os.getcwd(), nice=nice), timeout)


def _bed_request(request: dict, timeout: float):
    why = unavailable()
    if why:
        raise NetbedUnavailable(why)
    bed = subprocess.Popen([sys.executable, "-m", "labkit.runtime.netbed"], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, preexec_fn=_enter(None, os.getpid()),
                           # TORCH_CPP_LOG_LEVEL: the store on rank 0 warns once per rank that it cannot
                           # resolve a namespace's address to a hostname (c10d, "err=-3"): noise
                           env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path),
                                    TORCH_CPP_LOG_LEVEL=os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR")))
    try:
        out, _ = bed.communicate(pickle.dumps(request), timeout=timeout + 30)
    finally:
        if bed.poll() is None:  # our own timeout or Ctrl-C: the bed, and all it holds, goes
            bed.kill()
            bed.wait()
    if not out:
        raise RuntimeError(f"the emulated-node bed died (exit status {bed.returncode}) without a result")
    status, value = pickle.loads(out)
    if status == "ok":
        return value
    if status == "timeout":
        raise TimeoutError(value)
    if status == "setup":
        raise NetbedUnavailable(value)
    raise NetbedError(*value)


# ----------------------------------------------------------------------------- the bed's side

def _run(cmd: str, ns: str | None = None) -> str:
    """Run ``cmd`` (ip/tc) in the bed's namespace, or in ``ns`` (a /proc/PID/ns/net path)."""
    done = subprocess.run(cmd.split(), capture_output=True, text=True,
                          preexec_fn=_enter(ns, os.getpid()) if ns else None)
    if done.returncode != 0:
        raise RuntimeError(f"`{cmd}` failed: {done.stderr.strip()}")
    return done.stdout


def _sysctl(key: str, value: str, ns: str) -> None:
    """Set ``key`` in the network namespace ``ns`` (per-namespace keys only), if ``sysctl`` is here."""
    if shutil.which("sysctl"):
        _run(f"sysctl -q -w {key}={value}", ns)


def _shape(dev: str, ns: str | None, bandwidth: str, latency_us: float) -> None:
    # burst: 64 KiB (a GSO packet; 16 KiB made tbf wait on late timers on a loaded machine); ~50 ms of queue
    _run(f"tc qdisc add dev {dev} root handle 1: tbf rate {bandwidth} burst 64kb latency 50ms", ns)
    if latency_us > 0:
        _run(f"tc qdisc add dev {dev} parent 1:1 handle 10: netem delay {latency_us:g}us limit 10000", ns)


def _trace(what: str, t0=time.monotonic()) -> None:
    if os.environ.get("LABKIT_NETBED_TRACE"):
        sys.stderr.write(f"netbed: {time.monotonic() - t0:.2f} s: {what}\n")


def _bed(request: dict) -> tuple:
    caller = os.getppid()
    _trace("bed started")
    if request.get("probe_netem"):
        _run("ip link add name p0 type veth peer name p1")
        try:
            _run("tc qdisc add dev p0 root netem delay 1us")
            return "ok", True
        except RuntimeError:
            return "ok", False
    nodes, per_node = request["nodes"], request["ranks_per_node"]
    holders = []
    try:
        _run("ip link set dev lo up")
        _run("ip link add name br0 type bridge")
        _run("ip link set dev br0 up")
        for node in range(nodes):  # a process holds each node's namespace while the job runs
            holder = subprocess.Popen([sys.executable, "-c", "import os; os.read(0, 1)"], stdin=subprocess.PIPE,
                                      preexec_fn=_enter(None, os.getpid()))
            holders.append(holder)
            ns = f"/proc/{holder.pid}/ns/net"
            _run(f"ip link add name n{node} type veth peer name eth0 netns {holder.pid}")
            _run(f"ip link set dev n{node} master br0 up")
            _run(f"ip addr add {node_address(node)}/24 dev eth0", ns)
            _run("ip link set dev eth0 up", ns)
            _run("ip link set dev lo up", ns)
            # TCP keeps its window between a collective's messages (a node's own setting, this
            # namespace's only): by default it shrinks it after ~200 ms idle, and every message
            # after a pause would start slow, by an amount that depends on the queue at that moment
            _sysctl("net.ipv4.tcp_slow_start_after_idle", "0", ns)
            _shape("eth0", ns, request["bandwidth"], request["latency_us"])
            _shape(f"n{node}", None, request["bandwidth"], 0)
    except RuntimeError as e:
        return "setup", f"could not build the emulated nodes: {e}"
    _trace("nodes built")
    sys.path[:] = request["path"]
    os.chdir(request["cwd"])
    try:  # torch and the job's modules are imported once, here; the ranks are forked from us
        import torch.distributed  # noqa: F401
        fn, args, kwargs = cloudpickle.loads(request["job"])
    except Exception as e:  # noqa: BLE001
        return "error", (0, f"could not load the job: {type(e).__name__}: {e}", traceback.format_exc())
    _trace("job loaded")
    world = nodes * per_node
    outputs, pids = {}, []
    for rank in range(world):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            _rank(rank, world, per_node, f"/proc/{holders[rank // per_node].pid}/ns/net", write, fn, args, kwargs,
                  request.get("nice", 0))
        os.close(write)
        outputs[read], pids = (rank, b""), pids + [pid]
    results = {}
    deadline = time.monotonic() + request["timeout"]
    try:
        while outputs:
            if os.getppid() != caller:
                return "gone", None
            left = deadline - time.monotonic()
            if left <= 0:
                late = sorted(r for r, _ in outputs.values())
                return "timeout", f"ranks {late} did not finish within {request['timeout']:g} s on the emulated nodes"
            ready, _, _ = select.select(list(outputs), [], [], min(left, 0.5))
            for fd in ready:
                rank, data = outputs[fd]
                chunk = os.read(fd, 1 << 20)
                if chunk:
                    outputs[fd] = (rank, data + chunk)
                    continue
                del outputs[fd]
                if not data:
                    _, code = os.waitpid(pids[rank], 0)
                    return "error", (rank, f"died (wait status {code}) before returning a result")
                status, value = pickle.loads(data)
                if status != "ok":
                    return "error", (rank, value[0], value[1])
                results[rank] = value
        return "ok", [results[r] for r in range(world)]
    finally:
        for pid in pids:  # the ranks still running (the others waiting on a failed one) go now
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass


def _rank(rank: int, world: int, per_node: int, ns: str, result_fd: int, fn, args, kwargs, nice: int = 0) -> None:
    """A forked rank: die with the bed, join the node's namespace, run ``fn``, report, exit."""
    try:
        _enter(ns, os.getppid())()
        if nice:
            os.nice(nice)  # this thread; gloo's threads, made below, inherit it
        os.dup2(2, 1)  # what the rank prints goes to stderr
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % per_node),
                          NODE_RANK=str(rank // per_node), MASTER_ADDR=node_address(0), MASTER_PORT=str(PORT),
                          GLOO_SOCKET_IFNAME="eth0")
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"tcp://{node_address(0)}:{PORT}", rank=rank, world_size=world)
        out = ("ok", fn(*args, **kwargs))
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - every failure is reported, named by rank
        out = ("error", (f"raised {type(e).__name__}: {e}", traceback.format_exc()))
    with os.fdopen(result_fd, "wb") as result:
        result.write(cloudpickle.dumps(out))
    os._exit(0)


def _main() -> None:
    request = pickle.load(sys.stdin.buffer)
    result = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    try:
        out = _bed(request)
    except Exception:  # noqa: BLE001
        out = ("setup", f"the emulated-node bed failed: {traceback.format_exc()}")
    result.write(pickle.dumps(out))
    result.close()
    os._exit(0)  # the holders and ranks die with us (PR_SET_PDEATHSIG), and the namespaces with them


if __name__ == "__main__":
    _main()
