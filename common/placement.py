"""Where a process puts the index and the encoders: one explicit policy, logged, never a library's implicit default.

Per process (one training rank, or one evaluation / pipeline process):
- device: ``cuda:LOCAL_RANK`` when CUDA is available, else ``cpu`` (``process_device``); callers that own an
  accelerate state pass ``PartialState().device`` instead, which is the same device.
- FAISS index: on ``cpu`` the index file is memory-mapped, so every rank of a node shares one copy through the page
  cache; on ``cuda:N`` the index is copied to that one GPU with fp16 storage (``index_to_device``) — never to all
  GPUs. An index type FAISS cannot put on a GPU (HNSW) stays on the CPU, with a log line.
- Exact ranks (retrieval.exact) keep one replica of a Flat index's rows on the same device: a zero-copy view of the
  memory-mapped file on the CPU, an fp16 copy on the GPU.
- Threads: FAISS / OpenMP and torch intra-op threads = usable cores ÷ processes on this node (``configure_threads``);
  FAISS's own OpenBLAS runs kernels chosen from the CPU's flags (``common.faiss_lib``).
- Encoders load outside DeepSpeed ZeRO-3's partitioned init (``outside_zero3_init``): they are frozen, used for
  inference only, and must be whole on every rank.
"""

from __future__ import annotations

import logging
import os
import re
from contextlib import contextmanager
from dataclasses import field
from datetime import timedelta

log = logging.getLogger("refine_rl.placement")

# How long a process that finished its share of a job waits for the others at a barrier. torch's own defaults (NCCL
# 10 minutes, gloo 30) end a job whose processes finish their shares more than that apart, as a process with no
# batch left to do (a resumed run's remainder) does while the others load their models.
DIST_TIMEOUT_MINUTES = 1440


def dist_timeout_field():
    """The ``dist_timeout_minutes`` setting every multi-process CLI job has."""
    return field(
        default=DIST_TIMEOUT_MINUTES,
        metadata={"help": "how long a process that finished its share waits for the others at a barrier (minutes)"},
    )


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_world_size() -> int:
    """Processes on this node (torchrun / accelerate set LOCAL_WORLD_SIZE)."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def process_device() -> str:
    """``cuda:LOCAL_RANK`` when CUDA is available, else ``cpu`` — never a bare ``cuda``."""
    import torch

    if torch.cuda.is_available():
        return f"cuda:{local_rank() % torch.cuda.device_count()}"
    return "cpu"


def resolve_device(device: str | None) -> str:
    """An explicit device string; ``None``/``auto`` → ``process_device()``; a bare ``cuda`` gets this rank's index."""
    if device in (None, "auto"):
        return process_device()
    device = str(device)
    if re.fullmatch(r"cpu(:\d+)?", device):  # accelerate's MULTI_CPU state reports "cpu:0"
        return "cpu"
    if device == "cuda":
        import torch

        return f"cuda:{local_rank() % max(1, torch.cuda.device_count())}"  # a task may see only its own GPU
    if not re.fullmatch(r"cuda:\d+", device):
        raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or 'auto', got {device!r}")
    return device


def job_device(requested: str | None, state=None) -> str:
    """The device of a CLI job's process: ``--device`` as given (one process), else the accelerate ``state``'s own
    (``cuda:LOCAL_RANK`` under a launcher); a ``cuda:N`` with several processes is refused, since it would put every
    process on one GPU."""
    processes = state.num_processes if state is not None else 1
    if requested not in (None, "auto"):
        if str(requested).startswith("cuda:") and processes > 1:
            raise ValueError(
                f"--device {requested} with {processes} processes would put every process on one GPU: leave "
                "--device unset (or 'cuda') so each process takes its own, or run one process"
            )
        return resolve_device(requested)
    return resolve_device(str(state.device) if state is not None else None)


def process_state(device: str | None = None, timeout_minutes: int | None = DIST_TIMEOUT_MINUTES):
    """The accelerate ``PartialState`` of a CLI job (one process, or each of the processes ``accelerate launch`` /
    ``torchrun`` started): on the CPU when ``device`` says so or no GPU exists — created first with ``cpu=True``, so
    CPU processes under torchrun form one gloo group instead of each believing it is alone. ``timeout_minutes``
    bounds how long a process waits for the others at a barrier (None: torch's default)."""
    import torch
    from accelerate import PartialState

    cpu = str(device or "").startswith("cpu") or not torch.cuda.is_available()
    kwargs = {"timeout": timedelta(minutes=timeout_minutes)} if timeout_minutes else {}
    return PartialState(cpu=cpu, **kwargs)


class Processes:
    """This process's place among the processes of a job: rank, count, and a barrier (a no-op for one process, or
    without an accelerate ``state``)."""

    def __init__(self, state=None):
        self.state = state
        self.rank = state.process_index if state is not None else 0
        self.count = state.num_processes if state is not None else 1

    def barrier(self, what: str) -> None:
        """Wait for every process; past the process group's timeout (``ddp_timeout`` / ``timeout_minutes``), an error
        naming ``what`` was awaited instead of a wait without end (``what``: the step the others finish before it,
        said after "after")."""
        if self.state is None or self.count < 2:
            return
        try:
            self.state.wait_for_everyone()
        except RuntimeError as e:  # gloo and NCCL report an expired wait as a RuntimeError naming the timeout
            if "timed out" not in str(e).lower() and "timeout" not in str(e).lower():
                raise
            raise TimeoutError(
                f"process {self.rank}/{self.count}: the other processes did not arrive at the barrier "
                f"after {what} within the collective timeout: {str(e).strip()[:300]}"
            ) from e

    def raise_everywhere(self, error: Exception | None) -> None:
        """Call on every process after a step process 0 took alone (after a barrier): process 0's ``error`` (None when
        it succeeded) is raised on every process, so none goes on to a collective process 0 never reaches."""
        import torch.distributed as dist

        if self.count < 2 or not (dist.is_available() and dist.is_initialized()):
            if error is not None:
                raise error
            return
        from accelerate.utils import broadcast_object_list

        said = broadcast_object_list([None if error is None else (type(error).__name__, str(error))], from_process=0)
        if said[0] is None:
            return
        if error is not None:
            raise error
        kind = {k.__name__: k for k in (ValueError, FileNotFoundError, TimeoutError)}.get(said[0][0], RuntimeError)
        raise kind(f"process 0: {said[0][1]}")


def decode_workers(setting: int | None) -> int:
    """DataLoader processes decoding images for this process: ``setting``, or usable cores ÷ processes on this node."""
    return threads_per_process() if setting is None else setting


def gpu_ordinal(device: str) -> int | None:
    return int(device.split(":", 1)[1]) if device.startswith("cuda:") else None


def threads_per_process(cores: int | None = None, processes: int | None = None) -> int:
    return max(1, (cores or usable_cores()) // (processes or local_world_size()))


def configure_threads(threads: int | None = None) -> int:
    """Set FAISS's OpenMP threads (and torch's intra-op threads) to cores ÷ local processes; returns the count."""
    import torch

    from common.faiss_lib import faiss

    n = threads or threads_per_process()
    faiss.omp_set_num_threads(n)
    torch.set_num_threads(n)
    return n


def index_to_device(index, device: str):
    """A FAISS index for ``device``: unchanged on ``cpu``; one replica with fp16 storage on ``cuda:N``; a type that
    cannot live on a GPU stays on the CPU (logged). Returns (index, where it is: "cpu" or "cuda:N")."""
    from common.faiss_lib import faiss

    ordinal = gpu_ordinal(device)
    if ordinal is None:
        return index, "cpu"
    if not hasattr(faiss, "index_cpu_to_gpu") or faiss.get_num_gpus() == 0:
        log.warning(
            "index: device %s asked for, but this FAISS build has no GPU support (faiss-cpu); the index "
            "stays on the CPU",
            device,
        )
        return index, "cpu"
    kind = type(faiss.downcast_index(index)).__name__
    if "HNSW" in kind:
        log.warning("index: %s cannot live on a GPU in FAISS; it stays on the CPU (memory-mapped)", kind)
        return index, "cpu"
    options = faiss.GpuClonerOptions()
    options.useFloat16 = True
    try:
        return faiss.index_cpu_to_gpu(faiss.StandardGpuResources(), ordinal, index, options), device
    except RuntimeError as e:
        log.warning(
            "index: %s cannot be copied to %s (%s); it stays on the CPU", kind, device, str(e).strip().splitlines()[-1]
        )
        return index, "cpu"


@contextmanager
def outside_zero3_init():
    """Load models whole on this rank, even inside a DeepSpeed ZeRO-3 run with ``zero3_init_flag: true`` (and run
    ``generate()`` on one process alone: under the registration it syncs every step with the others).

    transformers partitions every ``from_pretrained`` while a ZeRO-3 DeepSpeed config is registered; the retrieval
    encoders are frozen inference models that are not part of the DeepSpeed engine, so a partitioned encoder would
    hold empty parameters and its forward would fail. The registration is lifted for the block and restored after.
    """
    try:
        from transformers.integrations import deepspeed as hf_ds
    except ImportError:
        yield
        return
    ref = hf_ds._hf_deepspeed_config_weak_ref
    config = ref() if ref is not None else None
    hf_ds.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        if config is not None:
            hf_ds.set_hf_deepspeed_config(config)


DTYPE_NAMES = {
    "auto": "auto",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "float32": "float32",
    "fp32": "float32",
}


def resolve_dtype(name: str | None, device: str = "cpu"):
    """A torch dtype from a config's name: ``None``/"auto" → bf16 on GPU, fp32 on CPU; otherwise one of DTYPE_NAMES."""
    import torch

    if name in (None, "auto"):
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {name!r}")
    return getattr(torch, DTYPE_NAMES[name])


def dtype_name(dtype) -> str:
    """A torch dtype as logs and records name it: ``bfloat16`` for ``torch.bfloat16``."""
    return str(dtype).replace("torch.", "")


def per_device_batch(total: int, processes: int, accumulation: int, name: str) -> int:
    """The per-process batch that makes ``total`` examples per optimizer step over ``processes`` × ``accumulation``."""
    if accumulation <= 0:
        raise ValueError(f"gradient_accumulation_steps must be positive, got {accumulation}")
    if total <= 0 or total % (processes * accumulation):
        raise ValueError(
            f"{name} ({total}) must be a positive multiple of processes ({processes}) × "
            f"gradient_accumulation_steps ({accumulation}) = {processes * accumulation}"
        )
    return total // (processes * accumulation)
