"""compress.fp16: cast each bucket to 16 bits, divide by N first, all-reduce, cast back
(the overview and the task list: ``labkit/compress/__init__.py``).
"""

import torch
import torch.distributed as dist


def compress_hook(dtype: torch.dtype, process_group, bucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket.buffer()`` over ``process_group`` (None: the world) in ``dtype``.

    Cast the buffer to ``dtype`` and divide it by the group size (in that order: the division
    must happen before the sum, or N large fp16 values overflow), start an asynchronous
    all-reduce of the copy, and return its future chained (``.then``) with a function that
    copies the result back into the buffer (casting back) and returns the buffer.
    """
    # BEGIN SOLUTION compress.fp16: cast to dtype and divide by N, async all-reduce, .then(copy back into the buffer, return it)
    buffer = bucket.buffer()
    compressed = buffer.to(dtype).div_(dist.get_world_size(process_group))
    future = dist.all_reduce(compressed, group=process_group, async_op=True).get_future()

    def decompress(done):
        buffer.copy_(done.value()[0])
        return buffer

    return future.then(decompress)
    # END SOLUTION


def fp16_compress_hook(process_group, bucket) -> torch.futures.Future[torch.Tensor]:
    return compress_hook(torch.float16, process_group, bucket)


def bf16_compress_hook(process_group, bucket) -> torch.futures.Future[torch.Tensor]:
    # DDP.register_comm_hook refuses a hook of this name unless the backend is NCCL (or XCCL),
    # though gloo sums bf16 fine: on gloo, register a wrapper with another name.
    return compress_hook(torch.bfloat16, process_group, bucket)
