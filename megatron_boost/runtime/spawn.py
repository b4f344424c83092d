"""Spawn gloo worker processes on localhost (the verification, benchmark, precision and
communication tools).

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes, initialises a gloo
process group in each, activates megatron-boost's CPU mode, runs ``fn(rank, world_size, *args)``
and returns the list of per-rank return values. An exception in any worker is re-raised in the
caller with that worker's traceback. ``fn`` must be a module-level function (picklable).
"""

from __future__ import annotations

import io
import os
import random
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


#: Its own generator: the global one is seeded by training, so processes seeded alike would
#: all try the same ports in the same order.
_PORT_RNG = random.Random()

#: How many ports below the kernel's ephemeral range a rendezvous port is drawn from.
_PORT_WINDOW = 8192


def _ephemeral_start() -> int:
    """The first port of the range the kernel assigns from (bind to port 0, outgoing
    connections)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _can_bind(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))  # all interfaces, as the rendezvous store binds
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port free now for a rendezvous store, drawn from the window just below the
    kernel's ephemeral range. A port the kernel hands out is also what it hands the next
    outgoing connection: with gloo groups of other processes connecting on the machine, such a
    port can be taken between this check and the store's bind (EADDRINUSE)."""
    low = _ephemeral_start()
    if low - _PORT_WINDOW >= 1024:
        for _ in range(64):
            port = _PORT_RNG.randrange(low - _PORT_WINDOW, low)
            if _can_bind(port):
                return port
    with socket.socket() as s:  # no room below the range (or all taken): the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue, device="cpu", backend="gloo"):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    # One thread per worker: the test machine has two cores and up to four workers.
    torch.set_num_threads(1)
    try:
        if device == "cuda":  # ranks share the GPUs round-robin (two ranks on one GPU: gloo)
            os.environ["LOCAL_RANK"] = str(rank % torch.cuda.device_count())
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        else:
            from megatron_boost.runtime.cpu_mode import use_cpu

            use_cpu(force=True)
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        # Serialised to bytes: tensors put on the queue directly are shared through file
        # descriptors that vanish when this process exits.
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # report every failure, including assertion errors
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
        except Exception:
            pass
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout: float = 300.0, retries: int = 3,
                    device: str = "cpu", backend: str = "gloo"):
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes; return results. By
    default gloo processes in CPU mode; ``device="cuda"`` gives rank k GPU k mod the GPU count
    and ``backend`` its process group (gloo takes CUDA tensors, so two ranks may share a GPU).

    The rendezvous port is picked free but released before the store binds it, so another
    process on a busy machine can take it in between (EADDRINUSE): then it starts again on a
    new port, up to ``retries`` times. A megatron-core outside the tested range stops first
    (``ValueError``, one line)."""
    from megatron_boost.compat import check_megatron_version

    check_megatron_version()
    for attempt in range(retries):
        try:
            return _run_once(fn, world_size, args, timeout, device, backend)
        except RuntimeError as err:
            if "EADDRINUSE" not in str(err) or attempt == retries - 1:
                raise


def _run_once(fn, world_size: int, args, timeout: float, device: str, backend: str):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker,
                         args=(r, world_size, port, fn, args, queue, device, backend))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world_size):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append(f"--- rank {rank} ---\n{payload}")
                break  # the others may now hang in a collective; stop waiting for them
    finally:
        for p in procs:
            p.join(timeout=5 if errors else timeout)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("distributed worker failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
