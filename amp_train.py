"""Automatic Mixed Precision (AMP) training in PyTorch, done the way the docs say.

The runnable replacement for the blog post "AMP Tensor Cores: saving memory in
PyTorch models": the post's programs, fixed, on CUDA or CPU.

    python -m pip install -r requirements.txt
    python amp_train.py --example linear                      # the post's Linear(10, 1), 100 iterations
    python amp_train.py --example resnet                      # ResNet18 on CIFAR-10, 100 epochs
    python amp_train.py --example resnet --data synthetic     # the same, offline
    python amp_train.py --help                                # every flag and its default
    torchrun --nproc_per_node=2 amp_train.py --example resnet # DistributedDataParallel, one GPU a process

Precision is chosen once (`--precision auto`: fp16 with a GradScaler on CUDA,
bf16 on the CPU; fp32 is the baseline) and passed down as `amp_dtype`.
`train_epoch` is the function to copy into your own code.
"""
import argparse
import collections
import contextlib
import datetime
import gc
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# The post's settings: SGD lr 0.01, batch 128, StepLR(10, 0.1), 100 epochs.
DEFAULT_EPOCHS = 100
DEFAULT_BATCH_SIZE = 128
DEFAULT_LR = 0.01
LR_STEP_EPOCHS = 10
LR_GAMMA = 0.1
SYNTHETIC_TRAIN_SIZE = 10_000
SYNTHETIC_TEST_SIZE = 2_000
MEMORY_STEPS = 20
MEMORY_WARMUP_STEPS = 3
OPS_SHOWN = 8  # the memory example lists this many of the ops of each dtype, the most called
# An fp16 run stops once the GradScaler has skipped a whole epoch's steps and at least this
# many in a row: 32 halvings take the scale from 2**16 to 2**-16, so the gradients are not
# merely large, they are inf/NaN. (Fewer would stop short epochs while the scaler calibrates.)
SKIPPED_IN_A_ROW_TO_STOP = 32
CHECKPOINT_FORMAT = "amp_train checkpoint 1"
# How long a process waits for its peers under torchrun (NCCL's default; long enough for one
# process per machine to download CIFAR-10 while the others wait) before it fails.
DIST_TIMEOUT = datetime.timedelta(minutes=10)
# What a checkpoint must hold, with its type; load_checkpoint refuses anything else.
CHECKPOINT_FIELDS = {"example": str, "precision": str, "args": dict, "epoch": int, "model": dict,
                     "optimizer": dict, "scaler": dict, "rng": dict}
# The flags that define a run. On --resume, those not given keep the checkpoint's values; those
# given and different are applied with a note (--epochs silently), except --data, which is refused.
RUN_FLAGS = ("precision", "epochs", "batch_size", "lr", "data", "max_steps", "clip_grad_norm",
             "accum_steps", "seed")
MAX_INT = 2**31 - 1                        # the largest count a flag accepts
MAX_FLOAT = torch.finfo(torch.float32).max  # an lr or norm beyond this overflows the fp32 weights' update
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
PRECISIONS = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": None}


class UsageError(Exception):
    """A mistake the user can fix; main() prints it as one line and exits 2."""


# ---------------------------------------------------------------- device and precision

def resolve_device(name):
    """'auto' is cuda when a GPU is visible, else cpu. Under torchrun, GPU number LOCAL_RANK, or
    the only GPU visible when the launcher gives each process its own."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda was given but no CUDA GPU is visible: use --device cpu or --device auto")
    if name == "cuda":
        count, local_rank = torch.cuda.device_count(), int(os.environ.get("LOCAL_RANK", "0"))
        if local_rank >= count and (count > 1 or "CUDA_VISIBLE_DEVICES" not in os.environ):
            raise UsageError(f"process {local_rank} has no GPU of its own: start at most "
                             f"--nproc_per_node={count} processes on this machine")
        return torch.device("cuda", min(local_rank, count - 1))
    return torch.device(name)


def resolve_precision(name, device):
    """Returns the autocast dtype, or None for plain fp32. 'auto' is fp16 on CUDA, bf16 on the CPU."""
    if name == "auto":
        name = "fp16" if device.type == "cuda" else "bf16"
    if name == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        raise UsageError("this GPU does not support bfloat16: use --precision fp16 or --precision fp32")
    return PRECISIONS[name]


def precision_name(amp_dtype):
    return {v: k for k, v in PRECISIONS.items()}[amp_dtype]


def make_scaler(device, amp_dtype):
    # Only float16 needs loss scaling: its narrow exponent flushes small gradients to zero.
    # bfloat16 has fp32's exponent range, so its scaler is a no-op pass-through.
    return torch.amp.GradScaler(device.type, enabled=amp_dtype is torch.float16)


def make_optimizer(model, lr):
    """The examples' optimizer: the post's SGD (no momentum), fused. One kernel makes the whole
    update and takes the GradScaler's inf check on the device, so scaler.step() need not wait
    for the GPU, as it does with a plain optimizer (found_inf.item())."""
    return torch.optim.SGD(model.parameters(), lr=lr, fused=True)


def amp_context(device, amp_dtype):
    """Autocast for the forward pass and loss; amp_dtype=None turns it off (fp32)."""
    return torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None)


def warn_if_cpu_fp16_convs(device, amp_dtype):
    if device.type == "cpu" and amp_dtype is torch.float16:
        print("warning: fp16 convolutions are very slow on CPUs (tens of times slower than fp32); "
              "--precision bf16 is the fast CPU choice", file=sys.stderr)


def init_distributed(device):
    """Under torchrun, joins the process group its environment describes: NCCL on CUDA, gloo
    on the CPU. Without torchrun, makes no group and the run is a plain single process."""
    if "WORLD_SIZE" in os.environ:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        # torchrun keeps one key-value store over its restarts (--max-restarts): a restarted
        # process that read the keys of the round before hung in gloo's set-up, or connected to a
        # dead peer (seen here). So each round gets keys of its own.
        store, rank, world_size = next(dist.rendezvous("env://", timeout=DIST_TIMEOUT))
        store = dist.PrefixStore(f"restart{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        # A bounded wait: a process whose peer died raises within DIST_TIMEOUT instead of hanging.
        # device_id binds NCCL to this process's GPU at once (and silences its warning at barriers).
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,
                                world_size=world_size, timeout=DIST_TIMEOUT,
                                device_id=device if device.type == "cuda" else None)


def all_reduce(values, device, op=dist.ReduceOp.SUM):
    """Sums numbers (or takes their `op`) over all processes; returns them as they are in one process."""
    if not dist.is_initialized():
        return list(values)
    total = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(total, op=op)
    return total.tolist()


def synchronize(device):
    # CUDA runs asynchronously: wait for queued kernels before reading a clock.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------- models

def build_resnet18(num_classes=10):
    """torchvision's ResNet18 with a 10-class head (the post's resnet18() had 1000 outputs), in
    channels_last (NHWC): the layout tensor cores want, and faster on CPUs too."""
    import torchvision
    return torchvision.models.resnet18(num_classes=num_classes).to(memory_format=torch.channels_last)


def build_linear(in_features=10, out_features=1):
    return nn.Linear(in_features, out_features)


# ---------------------------------------------------------------- data

class DeviceLoader:
    """Batches of (inputs, targets) from tensors held on the device: no worker processes and
    no copy from the host per batch, so a GPU never waits for its data.

    Each of `world_size` processes takes its own shard. With `shuffle`, the order and the
    randomness of `transform(inputs, generator)` depend on (seed, epoch) alone: call
    set_epoch(epoch) before each epoch, and a resumed run sees the same batches.
    """

    def __init__(self, inputs, targets, batch_size, device, transform=None, shuffle=False,
                 seed=0, rank=0, world_size=1):
        self.inputs, self.targets = inputs.to(device), targets.to(device)
        self.batch_size, self.transform, self.shuffle = batch_size, transform, shuffle
        self.seed, self.rank, self.world_size, self.epoch = seed, rank, world_size, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        n = len(self.targets)
        shard = n // self.world_size if self.shuffle else len(range(self.rank, n, self.world_size))
        return math.ceil(shard / self.batch_size)

    def __iter__(self):
        n, device = len(self.targets), self.targets.device
        # The CPU generator keeps 32 bits of its seed; seeds of nearby runs and epochs stay apart.
        seed = (self.seed * 1_000_003 + self.epoch) % 2**32
        shuffle = torch.Generator(device).manual_seed(seed)
        augment = torch.Generator(device).manual_seed((seed + 7919 * (self.rank + 1)) % 2**32)  # per process
        if self.shuffle:  # the same permutation on every process, cut into equal shards
            order = torch.randperm(n, generator=shuffle, device=device)
            order = order[self.rank:n - n % self.world_size:self.world_size]
        else:             # every sample once over all processes
            order = torch.arange(self.rank, n, self.world_size, device=device)
        for start in range(0, len(order), self.batch_size):
            index = order[start:start + self.batch_size]
            inputs = self.inputs[index]
            yield (inputs if self.transform is None else self.transform(inputs, augment)), self.targets[index]


def random_crop_flip(images, generator):
    """torchvision's RandomCrop(32, padding=4) and RandomHorizontalFlip for a batch at once: each
    image becomes a random 32x32 window of itself zero-padded by 4, mirrored with probability 1/2."""
    n, device = len(images), images.device
    padded = F.pad(images, (4, 4, 4, 4))
    dy, dx = torch.randint(0, 9, (2, n, 1), generator=generator, device=device)
    mirror = torch.rand(n, 1, generator=generator, device=device) < 0.5
    base = torch.arange(32, device=device)
    rows = (dy + base)[:, None, :, None].expand(n, 3, 32, 40)
    cols = (dx + torch.where(mirror, 31 - base, base))[:, None, None, :].expand(n, 3, 32, 32)
    return padded.gather(2, rows).gather(3, cols)


def cifar10_transform(device, augment):
    """uint8 images -> float images normalized with CIFAR-10's mean and std (after a random
    crop and flip if `augment`), channels_last: the layout tensor cores want for convolutions."""
    mean = torch.tensor(CIFAR10_MEAN, device=device).view(3, 1, 1) * 255
    std = torch.tensor(CIFAR10_STD, device=device).view(3, 1, 1) * 255

    def transform(images, generator):
        if augment:
            images = random_crop_flip(images, generator)
        return ((images.float() - mean) / std).contiguous(memory_format=torch.channels_last)
    return transform


def synthetic_cifar10(size, seed=0, train=True):
    """CIFAR-10-shaped uint8 images (size x 3 x 32 x 32) and labels that can be learned, offline.

    Each class is a fixed smooth random pattern; an image is its class's pattern plus noise.
    Seeded; train and test are different draws.
    """
    g = torch.Generator().manual_seed(seed)
    coarse = torch.randn(10, 3, 4, 4, generator=g)
    patterns = F.interpolate(coarse, size=(32, 32), mode="bilinear", align_corners=False)
    g.manual_seed(seed * 2 + (1 if train else 2))
    labels = torch.randint(0, 10, (size,), generator=g)
    images = 0.25 * patterns[labels] + torch.randn(size, 3, 32, 32, generator=g)
    return (images * 48 + 128).clamp(0, 255).to(torch.uint8), labels


def cifar10(root, train, download=True):
    """CIFAR-10's uint8 images (N x 3 x 32 x 32) and labels from torchvision; downloads into `root` when missing."""
    import torchvision
    try:
        data = torchvision.datasets.CIFAR10(root, train=train, download=download)
    except (OSError, RuntimeError) as e:  # URLError is an OSError; a corrupt folder is a RuntimeError
        raise UsageError(
            f"CIFAR-10 is not in {os.path.abspath(root)} and could not be downloaded ({e}): "
            f"put cifar-10-python.tar.gz in that folder, or run with --data synthetic") from None
    return torch.from_numpy(data.data).permute(0, 3, 1, 2).contiguous(), torch.tensor(data.targets)


def cifar10_once_per_machine(root):
    """(train, test) CIFAR-10 tensors. Under torchrun only local rank 0 of each machine may
    download (processes downloading into one folder at once overwrite each other's archive):
    global rank 0 first, in case the machines share `root`, then the other machines' local
    rank 0, each turn ended by a barrier; then the others read their files."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    local_rank, data, error = int(os.environ.get("LOCAL_RANK", "0")), None, None
    for my_turn in (rank == 0, rank != 0 and local_rank == 0):
        if my_turn:
            try:
                data = cifar10(root, train=True), cifar10(root, train=False)
            except UsageError as e:
                error = e  # raised after the barrier, so that no process waits for this one in vain
        if dist.is_initialized():
            dist.barrier()
    if error:
        raise error
    return data or (cifar10(root, train=True, download=False), cifar10(root, train=False, download=False))


def image_loaders(data, root, batch_size, device, seed=0, rank=0, world_size=1):
    """(train, test) DeviceLoaders over CIFAR-10 in `root` or, for data="synthetic", its stand-in.
    Training images are randomly cropped and flipped on the device, per batch."""
    if data == "synthetic":
        train, test = (synthetic_cifar10(size, seed, split) for size, split in
                       ((SYNTHETIC_TRAIN_SIZE, True), (SYNTHETIC_TEST_SIZE, False)))
    else:
        train, test = cifar10_once_per_machine(root)
    return (DeviceLoader(*train, batch_size, device, cifar10_transform(device, augment=True), shuffle=True,
                         seed=seed, rank=rank, world_size=world_size),
            DeviceLoader(*test, batch_size, device, cifar10_transform(device, augment=False),
                         rank=rank, world_size=world_size))


def linear_batch(batch_size=DEFAULT_BATCH_SIZE, seed=0):
    """The post's fixed batch: x of batch_size x 10 and y of batch_size x 1, seeded."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch_size, 10, generator=g), torch.randn(batch_size, 1, generator=g)


# ---------------------------------------------------------------- training and evaluation

@dataclass
class EpochStats:
    loss: float               # mean training loss per sample (inf/NaN if any step's loss was)
    steps: int                # optimizer steps attempted
    skipped_steps: int        # steps the GradScaler skipped because gradients held inf/NaN
    nonfinite_losses: int     # steps whose loss was inf/NaN (reported, never raised)
    samples: int
    seconds: float
    loss_scale: float | None  # the GradScaler's scale at the end, None when it is off


@dataclass
class EvalStats:
    loss: float
    accuracy: float           # fraction of samples whose argmax is the target
    samples: int


def train_epoch(model, loader, optimizer, criterion, scaler, device, amp_dtype,
                clip_grad_norm=None, accum_steps=1, max_steps=None, log_every=0):
    """One pass over `loader` with AMP; returns EpochStats.

    Works for any model, any sized iterable of (inputs, targets) and any loss.
    amp_dtype=None is plain fp32. With accum_steps=K, gradients of K
    micro-batches add up before each optimizer step (under DDP, all-reduced
    once per step); `max_steps` and the step counts count optimizer steps.
    The host syncs are one at the end, one every `log_every` steps when a
    progress line was asked for, and, with fp16 and a plain (not fused)
    optimizer, the scaler's own in every scaler.step().
    """
    model.train()

    def optimizer_step():
        if clip_grad_norm is not None:
            scaler.unscale_(optimizer)         # clip the true gradients, not the scaled ones
            nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
        scaler.step(optimizer)                 # unscales (unless done) and skips the step on inf/NaN
        if scaler.is_enabled():                # count skips from found_inf, on the device: no sync, and
            skipped.add_(sum(scaler._found_inf_per_device(optimizer).values()))  # right for fused optimizers
        scaler.update()                        # halves the scale after a skip, grows it after a good run
        optimizer.zero_grad(set_to_none=True)  # frees the gradients instead of writing zeros

    loss_sum = torch.zeros((), device=device)  # summed on the device: no .item() per step
    nonfinite = torch.zeros((), dtype=torch.long, device=device)
    skipped = torch.zeros((), device=device)
    steps = samples = pending = 0              # pending: micro-batches since the last optimizer step
    start = time.perf_counter()
    for index, (inputs, targets) in enumerate(loader, 1):
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        if pending == 0:  # the micro-batches of this optimizer step: K, or what is left of the loader
            group = min(accum_steps, len(loader) - index + 1)
        # DDP all-reduces the gradients in every backward: skip that (no_sync, around forward
        # and backward) for all but the last micro-batch before an optimizer step.
        last = pending + 1 == group
        with contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync():
            with amp_context(device, amp_dtype):  # autocast covers forward and loss only
                loss = criterion(model(inputs), targets)
            # Backward outside autocast, on the scaled loss so fp16 gradients don't underflow;
            # divided by the group's size so that its micro-batches give the mean gradient.
            scaler.scale(loss / group).backward()
        loss = loss.detach().float()
        loss_sum += loss * len(targets)
        nonfinite += ~torch.isfinite(loss)
        samples += len(targets)
        pending += 1
        if not last:
            continue
        optimizer_step()
        steps += 1
        pending = 0
        if log_every and steps % log_every == 0:  # a host sync, once every log_every steps
            elapsed = time.perf_counter() - start
            where = f" | rank {dist.get_rank()} alone" if dist.is_initialized() else ""
            print(f"  step {steps} | loss {loss_sum.item() / samples:.4f} | "
                  f"{samples / elapsed:.0f} samples/s{where}", flush=True)
        if steps == max_steps:
            break
    synchronize(device)
    seconds = time.perf_counter() - start
    return EpochStats(
        loss=loss_sum.item() / max(samples, 1),
        steps=steps,
        skipped_steps=int(skipped.item()),
        nonfinite_losses=int(nonfinite.item()),
        samples=samples,
        seconds=seconds,
        loss_scale=scaler.get_scale() if scaler.is_enabled() else None)


@torch.inference_mode()
def evaluate(model, loader, criterion, device, amp_dtype, max_steps=None):
    """Mean loss and accuracy over `loader`, under inference_mode and autocast."""
    model.eval()
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), dtype=torch.long, device=device)
    samples = 0
    for step, (inputs, targets) in enumerate(loader, 1):
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        with amp_context(device, amp_dtype):
            outputs = model(inputs)
            loss_sum += criterion(outputs, targets).float() * len(targets)
        correct += (outputs.argmax(dim=1) == targets).sum()
        samples += len(targets)
        if step == max_steps:
            break
    return EvalStats(loss=loss_sum.item() / max(samples, 1),
                     accuracy=correct.item() / max(samples, 1), samples=samples)


# ---------------------------------------------------------------- measuring memory and speed

def is_weight_copy(tensor, params):
    # autocast's low-precision copy of a parameter, or a view of one (Linear saves weight.t()):
    # follow single-input autograd nodes (casts, views) back to a parameter's AccumulateGrad.
    fn = tensor.grad_fn
    while fn is not None and len(fn.next_functions) == 1:
        fn = fn.next_functions[0][0]
    return hasattr(fn, "variable") and fn.variable.untyped_storage().data_ptr() in params


@contextlib.contextmanager
def count_saved_tensors(model):
    """Bytes autograd saves for backward inside the block; the yielded dict is filled on exit.

    'activation_bytes': what the forward pass keeps for backward; this grows with
    the batch and is what autocast halves. 'weight_copy_bytes': autocast's
    low-precision copies of the weights (0 in fp32); their size is fixed.
    'activation_bytes_by_dtype' splits the first by dtype: what does not halve.
    The parameters themselves exist anyway and are not counted. Works on any
    device; a storage saved twice counts once.
    """
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}  # data_ptr -> (bytes, is a weight copy, dtype)

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = (storage.nbytes(), is_weight_copy(tensor, params), dtype_name(tensor))
        return tensor

    counts = {}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield counts
    by_dtype = collections.Counter()
    for n, copy, dtype in storages.values():
        if not copy:
            by_dtype[dtype] += n
    counts["activation_bytes"] = sum(by_dtype.values())
    counts["weight_copy_bytes"] = sum(n for n, copy, _ in storages.values() if copy)
    counts["activation_bytes_by_dtype"] = dict(by_dtype.most_common())


def dtype_name(tensor):
    return str(tensor.dtype).removeprefix("torch.")


class CountOps(TorchDispatchMode):
    """Counts the aten ops that run inside the block (forward, backward and optimizer step)
    by the dtype they computed in, that of their first floating output (or input, for ops
    that write in place and return nothing): {dtype: Counter({op name: calls})}. Views,
    which compute nothing, are not counted."""

    def __init__(self):
        super().__init__()
        self.counts = collections.defaultdict(collections.Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        floating = [t for t in tree_leaves((out, args, kwargs)) if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if floating and not func.is_view and func.overloadpacket.__name__ != "_local_scalar_dense":  # not .item()
            self.counts[dtype_name(floating[0])][func.overloadpacket.__name__] += 1
        return out


def measure_training(build_model, batch, criterion, device, amp_dtype,
                     steps=MEMORY_STEPS, warmup=MEMORY_WARMUP_STEPS, seed=0, lr=DEFAULT_LR):
    """Trains a fresh, seeded model on one fixed batch with train_epoch and returns what it measured.

    `warmup` untimed steps, one step whose saved tensors are counted, then
    `steps` timed steps, over which the CUDA peak memory is taken.
    """
    torch.manual_seed(seed)
    model = build_model().to(device)
    optimizer = make_optimizer(model, lr)
    scaler = make_scaler(device, amp_dtype)

    def step():  # train_epoch synchronizes before it reads the clock
        return train_epoch(model, [batch], optimizer, criterion, scaler, device, amp_dtype)

    for _ in range(warmup):
        step()
    with count_saved_tensors(model) as saved, CountOps() as ops:
        step()
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()  # so the reserved peak is this run's, not the cache of the run before
        torch.cuda.reset_peak_memory_stats(device)
    timed = [step() for _ in range(steps)]
    return {
        "activation_bytes": saved["activation_bytes"],
        "weight_copy_bytes": saved["weight_copy_bytes"],
        "activation_bytes_by_dtype": saved["activation_bytes_by_dtype"],
        "ops": {dtype: {"calls": sum(ops.values()), "top": dict(ops.most_common(OPS_SHOWN))}
                for dtype, ops in sorted(ops.counts.items(), key=lambda item: -sum(item[1].values()))},
        "peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        # Reserved memory is what the caching allocator holds, and what runs out.
        "reserved_bytes": torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None,
        "step_seconds": statistics.median(s.seconds for s in timed),
        "final_loss": timed[-1].loss,
    }


# ---------------------------------------------------------------- checkpoints

def checkpoint_state(args, amp_dtype, epochs_done, model, optimizer, scheduler, scaler, device):
    """Everything a resumed run needs to continue as if it never stopped: tensors and plain types only."""
    return {
        "format": CHECKPOINT_FORMAT, "example": args.example, "precision": precision_name(amp_dtype),
        "args": dict(vars(args)), "epoch": epochs_done,
        "model": model.state_dict(), "optimizer": optimizer.state_dict(),
        "scheduler": None if scheduler is None else scheduler.state_dict(),
        "scaler": scaler.state_dict(),  # the loss scale and growth tracker; {} when the scaler is off
        "rng": {"cpu": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None},
        "torchrun_job": os.environ.get("TORCHELASTIC_RUN_ID"),  # see torchrun_restart
    }


def save_checkpoint(path, state):
    """Writes to a temporary file beside `path`, then renames it into place: a crash while
    writing leaves the last good checkpoint whole."""
    tmp = f"{path}.tmp"
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)  # atomic when both names are on one file system
    except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise UsageError(f"could not write the checkpoint {path} ({str(e).splitlines()[0]}); the last one "
                         "is intact: free some space, or pass another --checkpoint and --resume") from None


def check_new_file(path, flag, resuming):
    """Refuses, before any training, a `flag` PATH that could not be written later, or that
    exists although the run does not resume (nothing already saved is overwritten)."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path} is a folder: pass a file path")
    if os.path.exists(path) and not resuming:
        raise UsageError(f"{path} already exists: add --resume to continue its run, or pass another {flag}")
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise UsageError(f"{flag} {path}: the folder {folder} does not exist or is not writable: "
                         f"create it, or pass another {flag}")


def load_checkpoint(path, example):
    """Reads a checkpoint of `example`; a missing, damaged or foreign file is a UsageError."""
    if not os.path.isfile(path):
        raise UsageError(f"there is no checkpoint at {path}: run without --resume to start one")
    try:
        # weights_only: a checkpoint from elsewhere is untrusted input, and this never runs pickled code.
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated, not a torch file, or holding more than tensors and plain types
        raise UsageError(f"{path} is not a readable checkpoint ({type(e).__name__}): "
                         "pass another --checkpoint, or start again without --resume") from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise UsageError(f"{path} was not written by amp_train.py: pass one of its checkpoints to --resume")
    for key, kind in CHECKPOINT_FIELDS.items():
        if not isinstance(state.get(key), kind) or isinstance(state[key], bool):  # True is no epoch count
            raise UsageError(f"{path} is damaged: its {key!r} is missing or not a {kind.__name__}: "
                             "pass another --checkpoint, or start again without --resume")
    if state["epoch"] < 0 or state["precision"] not in PRECISIONS:
        raise UsageError(f"{path} is damaged: epoch {state['epoch']}, precision {state['precision']!r}: "
                         "pass another --checkpoint, or start again without --resume")
    if state["example"] != example:
        raise UsageError(f"{path} is a checkpoint of the {state['example']} example, not {example}: "
                         f"pass --example {state['example']} or another --checkpoint")
    return state


def append_metrics(path, record):
    """Appends one epoch's record to the metrics file as a JSON line (inf/NaN as null)."""
    try:
        with open(path, "a") as f:
            f.write(json.dumps({key: None if isinstance(value, float) and not math.isfinite(value) else value
                                for key, value in record.items()}) + "\n")
    except OSError as e:
        raise metrics_error(path, e) from None


def keep_metrics(path, epochs):
    """Keeps the metrics file's lines up to epoch `epochs` (those the checkpoint holds), atomically."""
    if not os.path.exists(path):
        return
    try:
        with open(path) as f:
            lines = [line for line in f if json.loads(line)["epoch"] <= epochs]
    except (ValueError, KeyError, TypeError) as e:
        raise UsageError(f"{path} is not a metrics file of amp_train.py ({type(e).__name__}): "
                         "pass another --metrics") from None
    try:
        with open(f"{path}.tmp", "w") as f:
            f.writelines(lines)
        os.replace(f"{path}.tmp", path)
    except OSError as e:
        raise metrics_error(path, e) from None


def metrics_error(path, error):
    return UsageError(f"could not write the metrics file {path} ({error}): free some space, or pass another --metrics")


def torchrun_restart(path):
    """True when torchrun restarted this worker (after another one died, with --max-restarts)
    and a checkpoint exists at `path`: if this same torchrun job (its --rdzv-id) wrote it, the
    run continues from it, as with --resume. A first launch never resumes by itself."""
    return bool(path) and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and os.path.isfile(path)


def resume_args(args, given, state):
    """Fills the RUN_FLAGS not given on the command line from the checkpoint's run, in place;
    returns a note for each given flag that changes the run."""
    saved = [f"--{key.replace('_', '-')}={state['args'][key]}" for key in RUN_FLAGS
             if state["args"].get(key) is not None]
    try:  # the checkpoint's values pass the same checks as the command line's
        saved = parse_args(saved)[0]
    except UsageError as e:
        raise UsageError(f"{args.checkpoint} holds flags this program refuses ({e})") from None
    notes = []
    for key in RUN_FLAGS:
        value, before = getattr(args, key), getattr(saved, key)
        if key not in given:
            setattr(args, key, before)
        elif value != before and key == "data":
            raise UsageError(f"{args.checkpoint} was trained on --data {before}: resume it on the same data")
        elif value != before and key != "epochs":
            notes.append(f"note: --{key.replace('_', '-')} {value} replaces the checkpoint's {before}")
    return notes


def restore_checkpoint(state, model, optimizer, scheduler, scaler, device, amp_dtype, lr):
    """Loads a checkpoint's states in place; returns (epochs done, notes for the user)."""
    notes = []
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if scheduler is not None:
            scheduler.load_state_dict(state["scheduler"])
        for group in optimizer.param_groups:  # a new --lr rescales the schedule, which goes on from here
            group["lr"] *= lr / group.get("initial_lr", group["lr"])
            if "initial_lr" in group:
                group["initial_lr"] = lr
        if scheduler is not None:
            scheduler.base_lrs = [lr] * len(optimizer.param_groups)
        # The scaler's state matters only where a scaler runs: fp16 to bf16/fp32 drops it,
        # and a bf16/fp32 checkpoint gives fp16 a fresh scale.
        if scaler.is_enabled() and state["scaler"]:
            scaler.load_state_dict(state["scaler"])
        elif scaler.is_enabled():
            notes.append(f"note: the checkpoint was saved in {state['precision']} without a GradScaler; "
                         "fp16 starts from a fresh loss scale")
        elif state["scaler"]:
            notes.append(f"note: the checkpoint's GradScaler state is not used: "
                         f"{precision_name(amp_dtype)} runs without a scaler")
        torch.set_rng_state(state["rng"]["cpu"])
        if device.type == "cuda" and state["rng"]["cuda"] is not None:
            torch.cuda.set_rng_state(state["rng"]["cuda"], device)
        return int(state["epoch"]), notes
    except (KeyError, RuntimeError, ValueError, TypeError) as e:
        raise UsageError(f"the checkpoint does not fit this run ({type(e).__name__}: {e}): "
                         "pass a --checkpoint of this example") from None


# ---------------------------------------------------------------- the examples

def build_example(args, device, rank=0, world_size=1):
    """Model, criterion, train loader and test loader (None for linear) for args.example.

    Each of `world_size` processes gets its own shard of the data, --batch-size per step.
    """
    if args.example == "linear":
        # One fixed batch, as in the post: each "epoch" is one iteration over it.
        # Under torchrun each process gets a batch of its own.
        x, y = linear_batch(args.batch_size * world_size, args.seed)
        loader = DeviceLoader(x, y, args.batch_size, device, rank=rank, world_size=world_size)
        return build_linear().to(device), nn.MSELoss(), loader, None
    train, test = image_loaders(args.data, args.data_root, args.batch_size, device, args.seed, rank, world_size)
    return build_resnet18().to(device), nn.CrossEntropyLoss(), train, test


def nonfinite_tensor(model):
    """The name of a parameter or buffer of `model` holding inf/NaN, or None (one host sync)."""
    tensors = {name: t for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_floating_point()}
    finite = torch.stack([torch.isfinite(t).all() for t in tensors.values()]).tolist()
    return next((name for name, ok in zip(tensors, finite) if not ok), None)


def stop_reason(stats, train_loss, amp_dtype, skipped_in_a_row, bad_tensor):
    """Why training cannot go on after this epoch, or None. Skipped fp16 steps are the
    scaler doing its job, until it has skipped everything for a long while."""
    if skipped_in_a_row >= max(stats.steps, SKIPPED_IN_A_ROW_TO_STOP):
        return f"the GradScaler skipped all of the last {skipped_in_a_row} steps (inf/NaN gradients)"
    if amp_dtype is not torch.float16 and not math.isfinite(train_loss):
        return f"the mean training loss is {train_loss} under {precision_name(amp_dtype)}"
    if bad_tensor:  # NaN weights, or BatchNorm statistics of an inf batch, stay NaN for good
        return f"the model's {bad_tensor} holds inf/NaN"
    return None


def unsaved_reason(record):
    """Why this epoch must not replace the last checkpoint, or None."""
    for name, key in (("training", "train_loss"), ("test", "test_loss")):
        if not math.isfinite(record.get(key, 0.0)):
            return f"its mean {name} loss is {record[key]}"
    return None


def epoch_record(args, amp_dtype, epoch, lr, stats, model, test_loader, criterion, device):
    """An epoch's metrics, summed over all processes: what its log line and the metrics file show."""
    loss_sum, samples = all_reduce([stats.loss * stats.samples, stats.samples], device)
    record = {"example": args.example, "precision": precision_name(amp_dtype), "epoch": epoch + 1,
              "train_loss": loss_sum / max(samples, 1)}
    if test_loader is not None:
        ev = evaluate(model, test_loader, criterion, device, amp_dtype, max_steps=args.max_steps)
        ev_loss, correct, ev_samples = all_reduce([ev.loss * ev.samples, ev.accuracy * ev.samples, ev.samples],
                                                      device)
        record.update(test_loss=ev_loss / ev_samples, test_accuracy=correct / ev_samples)
    return {**record, "lr": lr, "loss_scale": stats.loss_scale, "skipped_steps": stats.skipped_steps,
            "samples_per_second": samples / max(stats.seconds, 1e-9), "seconds": stats.seconds,
            "processes": dist.get_world_size() if dist.is_initialized() else 1}


def epoch_line(record, epochs, unit):
    """The log line of an epoch's metrics record."""
    line = f"epoch {record['epoch']:>{len(str(epochs))}}/{epochs} | train loss {record['train_loss']:.4f}"
    if "test_loss" in record:
        line += f" | test loss {record['test_loss']:.4f} | test acc {100 * record['test_accuracy']:5.2f}%"
    scale = "off" if record["loss_scale"] is None else f"{record['loss_scale']:g}"
    return (f"{line} | lr {record['lr']:.4g} | scale {scale} | skipped {record['skipped_steps']} | "
            f"{record['samples_per_second']:.0f} {unit}/s | {record['seconds']:.3f} s")


def run_training(args, device, amp_dtype, state=None, notes=()):
    """The resnet and linear examples: train, evaluate, print one line per epoch, checkpoint.

    `state` is a loaded checkpoint to resume from. Returns the exit status: 0, or 1 when
    training stopped on inf/NaN. Under torchrun the model is wrapped in
    DistributedDataParallel; AMP needs nothing else. Only rank 0 prints and saves.
    """
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    log = print if rank == 0 else (lambda *args, **kwargs: None)
    torch.manual_seed(args.seed)
    if args.example == "resnet":
        warn_if_cpu_fp16_convs(device, amp_dtype)
    model, criterion, train_loader, test_loader = build_example(args, device, rank, world_size)
    optimizer = make_optimizer(model, args.lr)
    scheduler = (torch.optim.lr_scheduler.StepLR(optimizer, step_size=LR_STEP_EPOCHS, gamma=LR_GAMMA)
                 if args.example == "resnet" else None)
    scaler = make_scaler(device, amp_dtype)
    start_epoch, notes = 0, list(notes)
    if state is not None:
        start_epoch, more = restore_checkpoint(state, model, optimizer, scheduler, scaler, device, amp_dtype,
                                               args.lr)
        notes += more + [f"resumed from {args.checkpoint} after epoch {start_epoch}"]
    if world_size > 1:  # every process must go on from the same epoch: machines that share no disk would not
        lowest, highest = all_reduce([-start_epoch, start_epoch], device, op=dist.ReduceOp.MAX)
        if -lowest != highest:
            raise UsageError(f"the processes found {args.checkpoint} at epochs {int(-lowest)} to {int(highest)}: "
                             "put the checkpoint on a file system that every machine shares")
    saved_epoch = start_epoch if state is not None else None  # the epoch the checkpoint holds
    # DDP averages the gradients across processes during backward. The GradScaler then sees
    # the same gradients on every process, so all of them skip the same steps. Checkpoints
    # hold the unwrapped `model`, so they resume with or without torchrun.
    trained = model
    if world_size > 1:
        trained = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)

    micro_batches = min(len(train_loader), (args.max_steps or len(train_loader)) * args.accum_steps)
    steps_per_epoch = math.ceil(micro_batches / args.accum_steps)
    data = "fixed batch" if args.example == "linear" else args.data
    model_name = "linear(10->1)" if args.example == "linear" else "resnet18"
    accumulated = f" x {args.accum_steps} accumulated" if args.accum_steps > 1 else ""
    log(f"amp_train | example {args.example} | torch {torch.__version__} | device {device} | "
        f"precision {precision_name(amp_dtype)} | scaler {'on' if scaler.is_enabled() else 'off'} | "
        f"model {model_name} | data {data} | batch {args.batch_size}{accumulated} | "
        f"processes {world_size} | global batch {args.batch_size * args.accum_steps * world_size} | "
        f"epochs {args.epochs} | steps/epoch {steps_per_epoch}", flush=True)
    for note in notes:
        log(note, flush=True)
    if start_epoch >= args.epochs:
        log(f"nothing to do: the checkpoint has {start_epoch} epochs; raise --epochs to train on")
        return 0

    if args.metrics and rank == 0:
        keep_metrics(args.metrics, start_epoch)  # the file matches the checkpoint, then grows with it
    log_every = 50 if steps_per_epoch >= 100 and rank == 0 else 0
    unit = "samples" if args.example == "linear" else "img"
    skipped_in_a_row = 0
    for epoch in range(start_epoch, args.epochs):
        train_loader.set_epoch(epoch)  # the order and augmentation depend on (seed, epoch) alone
        lr = optimizer.param_groups[0]["lr"]
        stats = train_epoch(trained, train_loader, optimizer, criterion, scaler, device, amp_dtype,
                            clip_grad_norm=args.clip_grad_norm, accum_steps=args.accum_steps,
                            max_steps=args.max_steps, log_every=log_every)
        for buffer in model.buffers() if world_size > 1 else []:
            # Each process updated BatchNorm's running statistics from its own batches: all
            # take rank 0's, so that every process evaluates (and checks) the model it saves.
            dist.broadcast(buffer, src=0)
        record = epoch_record(args, amp_dtype, epoch, lr, stats, model, test_loader, criterion, device)
        log(epoch_line(record, args.epochs, unit), flush=True)
        if args.metrics and rank == 0:
            append_metrics(args.metrics, record)

        all_skipped = stats.skipped_steps == stats.steps
        skipped_in_a_row = skipped_in_a_row + stats.steps if all_skipped else 0
        problem = stop_reason(stats, record["train_loss"], amp_dtype, skipped_in_a_row, nonfinite_tensor(model))
        unsaved = problem or unsaved_reason(record)
        kept = (f"{args.checkpoint} holds epoch {saved_epoch}" if saved_epoch is not None
                else f"nothing was saved to {args.checkpoint}")
        if problem:
            log(f"error: epoch {epoch + 1}: {problem}; {kept + '; ' if args.checkpoint else ''}"
                "try a lower --lr or --clip-grad-norm (with --resume)", file=sys.stderr)
            return 1
        if scheduler is not None and not all_skipped:
            scheduler.step()  # once per epoch, and only after an epoch in which the optimizer stepped
        if args.checkpoint and unsaved:
            log(f"note: epoch {epoch + 1} is not saved, {unsaved}; {kept}", flush=True)
        elif args.checkpoint:
            if rank == 0:
                save_checkpoint(args.checkpoint, checkpoint_state(
                    args, amp_dtype, epoch + 1, model, optimizer, scheduler, scaler, device))
            saved_epoch = epoch + 1
    return 0


def memory_setup(model_name, batch_size, device, seed):
    """(model builder, criterion, training loader) for the memory example: the linear example's
    fixed batch, or the synthetic stand-in through the resnet example's training pipeline."""
    if model_name == "linear":
        return build_linear, nn.MSELoss(), DeviceLoader(*linear_batch(batch_size, seed), batch_size, device)
    loader = DeviceLoader(*synthetic_cifar10(SYNTHETIC_TRAIN_SIZE, seed), batch_size, device,
                          cifar10_transform(device, augment=True), shuffle=True, seed=seed)
    return build_resnet18, nn.CrossEntropyLoss(), loader


def measure_loader(loader, device):
    """Samples per second that `loader` delivers over one epoch, after one warm-up batch."""
    next(iter(loader))
    synchronize(device)
    start = time.perf_counter()
    samples = sum(len(targets) for _, targets in loader)
    synchronize(device)
    return samples / (time.perf_counter() - start)


def tf32_state(device):
    """Whether fp32 convolutions and matmuls may use TF32 tensor cores (None off CUDA)."""
    if device.type != "cuda":
        return None
    conv, matmul = torch.backends.cudnn.conv, torch.backends.cuda.matmul
    if hasattr(conv, "fp32_precision"):  # torch >= 2.9, where reading the legacy flags can raise
        return {"cudnn_conv": conv.fp32_precision == "tf32", "matmul": matmul.fp32_precision == "tf32"}
    return {"cudnn_conv": torch.backends.cudnn.allow_tf32, "matmul": matmul.allow_tf32}


def run_memory(args, device, amp_dtype):
    """The post's "saves memory" claim, measured: the same model and batch in fp32 and in AMP."""
    if dist.is_initialized():
        raise UsageError("--example memory measures one process: run it with python, not torchrun")
    if amp_dtype is None:
        raise UsageError("--example memory compares fp32 with AMP: use --precision fp16, bf16 or auto")
    if args.model == "resnet18":
        warn_if_cpu_fp16_convs(device, amp_dtype)
    build_model, criterion, loader = memory_setup(args.model, args.batch_size, device, args.seed)
    batch = next(iter(loader))
    runs = {name: measure_training(build_model, batch, criterion, device, dtype, args.steps,
                                   seed=args.seed, lr=args.lr)
            for name, dtype in (("fp32", None), ("amp", amp_dtype))}
    runs["ratio"] = {key: (runs["amp"][key] / value if runs["amp"][key] is not None and value else None)
                     for key, value in runs["fp32"].items() if not isinstance(value, dict)}
    result = {"device": str(device), "model": args.model, "batch_size": args.batch_size,
              "precision": precision_name(amp_dtype), "steps": args.steps,
              "warmup_steps": MEMORY_WARMUP_STEPS, "torch": torch.__version__, "tf32": tf32_state(device),
              "loader_samples_per_second": measure_loader(loader, device), **runs}
    print(json.dumps(result, indent=2) if args.json else memory_report(result), flush=True)
    return 0


def memory_report(r):
    """The memory example's table and its closing sentence, from run_memory's result."""
    amp, fp32, ratio, name = r["amp"], r["fp32"], r["ratio"], r["precision"]
    mib = lambda n: "n/a" if n is None else f"{n / 2**20:.2f} MiB"
    rows = [("activation memory", "activation_bytes", mib), ("weight copies", "weight_copy_bytes", mib),
            ("peak device memory", "peak_bytes", mib), ("peak reserved memory", "reserved_bytes", mib),
            ("median step time", "step_seconds", lambda t: f"{1000 * t:.2f} ms"),
            ("final loss", "final_loss", lambda x: f"{x:.4f}")]
    tf32 = "n/a" if r["tf32"] is None else ("on" if r["tf32"]["cudnn_conv"] else "off") + " for fp32 convs"
    lines = [f"memory | torch {r['torch']} | device {r['device']} | model {r['model']} | "
             f"batch {r['batch_size']} | {r['warmup_steps']} warm-up + {r['steps']} timed steps | tf32 {tf32}",
             f"{'':<20}{'fp32':>14}{name:>14}{name + '/fp32':>12}"]
    for label, key, fmt in rows:
        x = ratio[key]
        lines.append(f"{label:<20}{fmt(fp32[key]):>14}{fmt(amp[key]):>14}{'n/a' if x is None else f'{x:.2f}':>12}")
    loader = f"{r['loader_samples_per_second']:.0f}"
    lines.append(f"{'loader samples/s':<20}{loader:>14}{loader:>14}{'n/a':>12}")
    lines.append(f"ops in one {name} training step (aten calls, by the dtype they computed in; the most called):")
    for dtype, ops in amp["ops"].items():
        top = ", ".join(f"{op} x{calls}" for op, calls in ops["top"].items())
        lines.append(f"  {dtype:<9}{ops['calls']:>5} calls: {top}")
    if fp32["activation_bytes"] < 2**20:
        lines.append(f"The activations here are {fp32['activation_bytes']} bytes in fp32 and "
                     f"{amp['activation_bytes']} in {name}: a model this small has nothing to save. "
                     f"AMP saves memory where activations are large: wide layers, images, big batches.")
    else:
        saved = (fp32["activation_bytes"] - amp["activation_bytes"]) / 2**20
        lines.append(f"{name} autocast kept {ratio['activation_bytes']:.2f}x the activation memory of fp32 "
                     f"({saved:.1f} MiB less at batch {r['batch_size']}), at the cost of "
                     f"{mib(amp['weight_copy_bytes'])} of {name} weight copies. Activations grow with the "
                     f"batch and the copies do not, so larger batches save more.")
        parts = ", ".join(f"{mib(n)} {dtype}" for dtype, n in amp["activation_bytes_by_dtype"].items())
        lines.append(f"Of the {name} run's activations, {parts}: only the low-precision part is halved "
                     "(autocast keeps the float32 ops above in fp32; int64 tensors are indices).")
        if ratio["peak_bytes"] is not None:
            lines.append(f"Peak device memory was {ratio['peak_bytes']:.2f}x that of fp32.")
        lines.append(f"A step took {ratio['step_seconds']:.2f}x the time of fp32"
                     + (f" (a CPU has no tensor cores: {name} saves memory here, not time)."
                        if r["device"] == "cpu" and ratio["step_seconds"] > 1 else "."))
    trained = r["batch_size"] / amp["step_seconds"]
    limit = "the loader" if r["loader_samples_per_second"] < trained else f"the {name} step, not the loader,"
    lines.append(f"The training data pipeline delivers {r['loader_samples_per_second']:.0f} samples/s and the "
                 f"{name} step trains {trained:.0f} samples/s: {limit} limits throughput.")
    return "\n".join(lines)


# ---------------------------------------------------------------- command line

class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2 through main(), not usage + traceback
        raise UsageError(f"{message} (see --help)")


def number(kind, low, high):
    """An argparse type: a `kind` above `low` (floats) or from `low` (ints), up to `high`."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not ((low < value) if kind is float else (low <= value)) or not value <= high:  # nan too
            low_text, high_text = (f"above {low}", f"{high:g}") if kind is float else (f"at least {low}", high)
            raise argparse.ArgumentTypeError(f"must be {low_text} and at most {high_text}, got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


COUNT = number(int, 1, MAX_INT)
POSITIVE = number(float, 0, MAX_FLOAT)


def parse_args(argv):
    p = ArgumentParser(description="AMP training examples: the blog post's programs, fixed.")
    p.add_argument("--example", choices=["linear", "memory", "resnet"], default="resnet",
                   help="resnet: ResNet18 on CIFAR-10; linear: Linear(10, 1) on one fixed batch; "
                        "memory: AMP vs fp32 memory and speed (default: %(default)s)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto picks cuda when a GPU is visible, else cpu (default: %(default)s)")
    p.add_argument("--precision", choices=["auto", *PRECISIONS], default="auto",
                   help="auto is fp16 (with a GradScaler) on CUDA and bf16 on the CPU; "
                        "fp32 turns AMP off (default: %(default)s)")
    p.add_argument("--epochs", type=COUNT, default=DEFAULT_EPOCHS,
                   help="epochs; for linear, iterations over the fixed batch (default: %(default)s)")
    p.add_argument("--batch-size", type=COUNT, default=DEFAULT_BATCH_SIZE,
                   help="samples per step (default: %(default)s)")
    p.add_argument("--lr", type=POSITIVE, default=DEFAULT_LR,
                   help="SGD learning rate (default: %(default)s)")
    p.add_argument("--data", choices=["cifar10", "synthetic"], default="cifar10",
                   help="resnet data: real CIFAR-10, downloaded into --data-root when missing, "
                        "or a learnable offline stand-in (default: %(default)s)")
    p.add_argument("--data-root", default="./data",
                   help="folder that holds or receives CIFAR-10 (default: %(default)s)")
    p.add_argument("--max-steps", type=COUNT, default=None,
                   help="stop each epoch after this many optimizer steps and evaluate on as many "
                        "test batches, for short runs (default: whole epochs)")
    p.add_argument("--clip-grad-norm", type=POSITIVE, default=None,
                   help="clip gradients to this total norm, after unscaling (default: no clipping)")
    p.add_argument("--accum-steps", type=COUNT, default=1,
                   help="accumulate gradients over this many micro-batches of --batch-size "
                        "per optimizer step (default: %(default)s)")
    p.add_argument("--checkpoint", default=None, metavar="PATH",
                   help="save a checkpoint here after every epoch, atomically (default: none)")
    p.add_argument("--metrics", default=None, metavar="PATH",
                   help="append one JSON line of metrics per epoch here (default: none)")
    p.add_argument("--resume", action="store_true",
                   help="continue from --checkpoint up to --epochs")
    p.add_argument("--model", choices=["resnet18", "linear"], default="resnet18",
                   help="memory only: the model to measure (default: %(default)s)")
    p.add_argument("--steps", type=COUNT, default=MEMORY_STEPS,
                   help=f"memory only: timed steps per precision, after {MEMORY_WARMUP_STEPS} "
                        "warm-up steps (default: %(default)s)")
    p.add_argument("--json", action="store_true",
                   help="memory only: print one JSON object instead of the table")
    p.add_argument("--seed", type=number(int, 0, 2**32 - 1), default=0,
                   help="seed for weights, data and shuffling (default: %(default)s)")
    args = p.parse_args(argv)
    # Which flags were given, not defaulted: parse again with every default None.
    p.set_defaults(**{key: None for key in vars(args)})
    given = {key for key, value in vars(p.parse_args(argv)).items() if value is not None}
    return args, given


def main(argv=None):
    args = None
    try:
        args, given = parse_args(argv)
        if args.resume and not args.checkpoint:
            raise UsageError("--resume needs --checkpoint PATH: the checkpoint to continue from")
        if args.example == "memory" and (args.checkpoint or args.metrics):
            raise UsageError("--checkpoint and --metrics are for the resnet and linear examples, not memory")
        restart = torchrun_restart(args.checkpoint)
        state = load_checkpoint(args.checkpoint, args.example) if args.resume or restart else None
        if state and not args.resume and state.get("torchrun_job") != os.environ.get("TORCHELASTIC_RUN_ID"):
            state = None  # another run's checkpoint: refused below, as on the first launch
        notes = resume_args(args, given, state) if state else []
        for flag, path in (("--checkpoint", args.checkpoint), ("--metrics", args.metrics)):
            if path:  # checked before any process group is joined or epoch trained
                check_new_file(path, flag, resuming=state is not None)
        device = resolve_device(args.device)
        # The shapes repeat every step: let cuDNN time its convolution algorithms once and keep the fastest.
        torch.backends.cudnn.benchmark = device.type == "cuda"
        amp_dtype = resolve_precision(args.precision, device)
        init_distributed(device)
        if args.example == "memory":
            status = run_memory(args, device, amp_dtype)
        else:
            status = run_training(args, device, amp_dtype, state, notes)
        if dist.is_initialized():
            dist.barrier()  # let every process finish its last collective before any leaves
        return status
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # CUDA's OutOfMemoryError is a RuntimeError, as is the CPU allocator's
        if not isinstance(e, torch.OutOfMemoryError) and "can't allocate memory" not in str(e):
            raise
        print(f"error: out of memory at --batch-size {args.batch_size}: lower it "
              "(--accum-steps K keeps the batch of an optimizer step)", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            # DDP's reducer holds the process group inside reference cycles: collect it first,
            # or gloo's threads die at interpreter exit and abort the process (seen here).
            gc.collect()
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
