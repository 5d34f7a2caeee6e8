"""Automatic Mixed Precision (AMP) training in PyTorch as the torch.amp docs describe it: the blog post
"AMP Tensor Cores: saving memory in PyTorch models", its three programs fixed, on a CUDA GPU or the CPU.

    python amp_train.py --example linear                       # the post's Linear(10, 1), 100 iterations
    python amp_train.py --example resnet --data synthetic      # ResNet18, 100 epochs (drop --data: CIFAR-10)
    python amp_train.py --example memory                       # does AMP save memory? fp32 and AMP side by side
    torchrun --nproc_per_node=2 amp_train.py --example resnet  # DistributedDataParallel, one GPU a process

train_epoch, first below, is the part to copy. Precision is chosen once (--precision auto: fp16 with
a GradScaler on CUDA, bf16 on the CPU; fp32 is the baseline) and passed down as `amp_dtype`.
"""
import argparse, collections, contextlib, copy, datetime, errno, fcntl, gc, itertools, json, math, os, signal
import statistics, sys, time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode  # exported under no public name
from torch.utils._pytree import tree_leaves

# The post's settings: SGD lr 0.01, batch 128, StepLR(10, 0.1), 100 epochs.
EPOCHS, BATCH_SIZE, LR, LR_STEP_EPOCHS, LR_GAMMA = 100, 128, 0.01, 10, 0.1
PRECISIONS = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": None}
# The flags that define a run: a resumed run keeps the checkpoint's, unless they are given again.
RUN_FLAGS = ("precision", "epochs", "batch_size", "lr", "data", "max_steps", "clip_grad_norm", "accum_steps", "seed")
CHECKPOINT_FORMAT = "amp_train checkpoint 2"
CHECKPOINT_FIELDS = {"example": str, "args": dict, "epoch": int, "processes": int, "global_batch": int,
                     "model": dict, "optimizer": dict, "scaler": dict}
# An fp16 run stops once the GradScaler skipped a whole epoch's steps, and at least this many in a
# row: 32 halvings take the scale from 2**16 to 2**-16, so the gradients are inf/NaN, not merely large.
SKIPPED_IN_A_ROW_TO_STOP = 32
# How long a process waits for its peers under torchrun (NCCL's default; room for one CIFAR-10 download).
DIST_TIMEOUT = datetime.timedelta(minutes=10)
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
MEMORY_STEPS, MEMORY_WARMUP_STEPS, OPS_SHOWN = 20, 3, 8


# ---------------------------------------------------------------- the part to copy

def train_epoch(model, loader, optimizer, criterion, scaler, device, amp_dtype,
                clip_grad_norm=None, accum_steps=1, max_steps=None, log_every=0):
    """Trains `model` for one pass over `loader` with AMP; returns what it measured, as a dict.

    Needs `import contextlib, time, torch`. loader: any iterable of (inputs, targets), a generator too.
    amp_dtype: torch.bfloat16 on the CPU; torch.float16 on CUDA, with scaler = torch.amp.GradScaler("cuda");
    None for fp32. scaler=None: no loss scaling. accum_steps=K adds up the gradients of K micro-batches
    per optimizer step (under DDP, all-reduced once); a shorter last group steps with its own mean
    gradient. max_steps and the counts are optimizer steps. Host syncs: one at the end (two with a
    scaler), one per progress line (log_every) and, with fp16 and a plain (not fused) optimizer, the
    scaler's own in every step. Returns the mean loss per sample, steps, skipped_steps (inf/NaN
    gradients), samples, seconds and loss_scale.
    """
    device = torch.device(device)
    if scaler is None:
        scaler = torch.amp.GradScaler(device.type, enabled=False)  # every call passes straight through
    model.train()
    loss_sum = torch.zeros((), device=device)  # summed on the device: no .item() per step
    skipped = torch.zeros((), device=device)
    steps = samples = pending = 0               # pending: micro-batches since the last optimizer step
    batches, start = iter(loader), time.perf_counter()
    batch = next(batches, None)
    while batch is not None:
        pending += 1
        (inputs, targets), full = batch, pending == accum_steps
        batch = None if full and steps + 1 == max_steps else next(batches, None)  # one ahead: is this the last?
        step_now = full or batch is None
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        # DDP all-reduces the gradients in backward: only in the one before a step, not under no_sync.
        with contextlib.nullcontext() if step_now or not hasattr(model, "no_sync") else model.no_sync():
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                loss = criterion(model(inputs), targets)  # autocast covers the forward pass and loss only
            scaler.scale(loss / accum_steps).backward()   # scaled, so small fp16 gradients don't flush to 0
        loss_sum += loss.detach().float() * len(targets)
        samples += len(targets)
        if not step_now:
            continue
        if pending < accum_steps:  # a shorter last group: the mean gradient of its own micro-batches
            for parameter in model.parameters():
                if parameter.grad is not None:
                    parameter.grad.mul_(accum_steps / pending)
        if clip_grad_norm is not None:
            scaler.unscale_(optimizer)                    # clip the true gradients, not the scaled ones
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
        scaler.step(optimizer)                            # skips the step if a gradient is inf/NaN
        if scaler.is_enabled():  # found_inf, on the device: torch has no public way to read it without a sync
            skipped += sum(found.to(device) for found in scaler._found_inf_per_device(optimizer).values()) > 0
        scaler.update()                                   # halves the scale after a skip, grows it after 2000 steps
        optimizer.zero_grad(set_to_none=True)             # frees the gradients instead of writing zeros
        steps, pending = steps + 1, 0
        if log_every and steps % log_every == 0:          # a host sync, once every log_every steps
            alone = f" | rank {torch.distributed.get_rank()} alone" if torch.distributed.is_initialized() else ""
            print(f"  step {steps} | loss {loss_sum.item() / samples:.4f} | "
                  f"{samples / (time.perf_counter() - start):.0f} samples/s{alone}", flush=True)
    loss_sum, skipped = torch.stack([loss_sum, skipped]).tolist()  # the host sync: waits for the device
    return {"loss": loss_sum / samples if samples else float("nan"), "steps": steps, "skipped_steps": int(skipped),
            "samples": samples, "seconds": time.perf_counter() - start,
            "loss_scale": scaler.get_scale() if scaler.is_enabled() else None}


@torch.inference_mode()
def evaluate(model, loader, criterion, device, amp_dtype, max_steps=None):
    """Mean loss per sample, accuracy (argmax == target) and samples of `loader`, under autocast. Needs
    `import itertools, torch`."""
    device = torch.device(device)
    model.eval()
    loss_sum, correct, samples = torch.zeros((), device=device), torch.zeros((), device=device), 0
    for inputs, targets in itertools.islice(loader, max_steps):
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            outputs = model(inputs)
            loss_sum += criterion(outputs, targets).float() * len(targets)
        correct += (outputs.argmax(dim=1) == targets).sum()
        samples += len(targets)
    loss_sum, correct = torch.stack([loss_sum, correct]).tolist()
    return {"loss": loss_sum / max(samples, 1), "accuracy": correct / max(samples, 1), "samples": samples}


# ---------------------------------------------------------------- device, precision, processes

class UsageError(Exception):
    """A mistake the user can fix: main() prints it as one line and exits 2."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (torchrun stopping its workers, a job scheduler): the run ends as on Ctrl-C."""

    @staticmethod
    def handler(signum, frame):
        raise Terminated()


def resolve_device(name):
    """cuda for 'auto' if a GPU is visible; under torchrun GPU LOCAL_RANK, or the one a process sees."""
    if name == "cpu" or name == "auto" and not torch.cuda.is_available():
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UsageError("--device cuda was given but no CUDA GPU is visible: use --device cpu or --device auto")
    count, local_rank = torch.cuda.device_count(), int(os.environ.get("LOCAL_RANK", "0"))
    if local_rank >= count and (count > 1 or "CUDA_VISIBLE_DEVICES" not in os.environ):
        raise UsageError(f"process {local_rank} has no GPU of its own: start at most --nproc_per_node={count}")
    return torch.device("cuda", min(local_rank, count - 1))


def resolve_precision(name, device):
    """fp16, bf16 or fp32: 'auto' is fp16 on CUDA (tensor cores, with a GradScaler), bf16 on the CPU."""
    name = ("fp16" if device.type == "cuda" else "bf16") if name == "auto" else name
    if name == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        raise UsageError("this GPU does not support bfloat16: use --precision fp16 or --precision fp32")
    return name


def make_scaler(device, amp_dtype):
    # Only float16 needs loss scaling; bfloat16 has fp32's exponent range, and a disabled scaler passes through.
    return torch.amp.GradScaler(device.type, enabled=amp_dtype is torch.float16)


def make_optimizer(model, lr):
    """The post's SGD, fused: one kernel takes the scaler's inf check too, so step() need not wait for it."""
    return torch.optim.SGD(model.parameters(), lr=lr, fused=True)


def init_distributed(device):
    """Under torchrun, joins its process group (NCCL on CUDA, gloo on the CPU); returns the job's id, or None."""
    if "WORLD_SIZE" not in os.environ and "RANK" not in os.environ:
        return None
    missing = [key for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if key not in os.environ]
    if missing:
        raise UsageError(f"{', '.join(missing)} missing: start with torchrun, or unset WORLD_SIZE and RANK")
    store, rank, world_size = next(dist.rendezvous("env://", timeout=DIST_TIMEOUT))
    # torchrun keeps one key-value store over its restarts: the first process to ask names the job, and
    # restarts find that name. Each round gets keys of its own: reading the last round's hung gloo (seen here).
    job = store.compare_set("amp_train_job", "", os.urandom(16).hex()).decode()
    store = dist.PrefixStore(f"restart{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    # A bounded wait: a process whose peer died raises within DIST_TIMEOUT instead of hanging.
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank, world_size=world_size,
                            timeout=DIST_TIMEOUT, device_id=device if device.type == "cuda" else None)
    return job


def rank_and_world():
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


# ---------------------------------------------------------------- data

class DeviceLoader:
    """Batches of (inputs, targets) made from tensors held on the device: no worker, no copy per batch.
    Each of `world_size` processes takes a shard: equal ones with `shuffle`, every sample once without.
    The order and `transform(inputs, generator)` depend on (seed, epoch) alone: call set_epoch(epoch)."""

    def __init__(self, inputs, targets, batch_size, device, transform=None, shuffle=False, seed=0, rank=0,
                 world_size=1):
        self.inputs, self.targets = inputs.to(device), targets.to(device)
        self.batch_size, self.transform, self.shuffle = batch_size, transform, shuffle
        self.seed, self.rank, self.world_size, self.epoch = seed, rank, world_size, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        n = len(self.targets)
        if self.shuffle:  # whole batches of equal shards: a last batch of one sample would break BatchNorm
            return n // self.world_size // self.batch_size
        return math.ceil(len(range(self.rank, n, self.world_size)) / self.batch_size)

    def __iter__(self):
        n, device = len(self.targets), self.targets.device
        seed = (self.seed * 1_000_003 + self.epoch) % 2**32  # a generator keeps 32 bits of its seed
        augment = torch.Generator(device).manual_seed((seed + 7919 * (self.rank + 1)) % 2**32)  # per process
        # With shuffle, one permutation for all processes (drawn on the CPU: the same on any GPU), in equal shards.
        order = (torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:n - n % self.world_size]
                 if self.shuffle else torch.arange(n))[self.rank::self.world_size].to(device)
        for start in range(0, len(self) * self.batch_size if self.shuffle else len(order), self.batch_size):
            index = order[start:start + self.batch_size]
            inputs = self.inputs[index]
            yield (inputs if self.transform is None else self.transform(inputs, augment)), self.targets[index]


def random_crop_flip(images, generator):
    """torchvision's RandomCrop(32, padding=4) and RandomHorizontalFlip, for a whole batch at once."""
    n, device = len(images), images.device
    padded = F.pad(images, (4, 4, 4, 4))
    dy, dx = torch.randint(0, 9, (2, n, 1), generator=generator, device=device)
    mirror = torch.rand(n, 1, generator=generator, device=device) < 0.5
    base = torch.arange(32, device=device)
    rows = (dy + base)[:, None, :, None].expand(n, 3, 32, 40)
    cols = (dx + torch.where(mirror, 31 - base, base))[:, None, None, :].expand(n, 3, 32, 32)
    return padded.gather(2, rows).gather(3, cols)


def cifar10_transform(device, augment):
    """uint8 -> normalized float images (cropped and flipped if `augment`), channels_last for tensor cores."""
    mean = torch.tensor(CIFAR10_MEAN, device=device).view(3, 1, 1) * 255
    std = torch.tensor(CIFAR10_STD, device=device).view(3, 1, 1) * 255

    def transform(images, generator):
        images = random_crop_flip(images, generator) if augment else images
        return ((images.float() - mean) / std).contiguous(memory_format=torch.channels_last)
    return transform


def synthetic_cifar10(size, seed=0, train=True):
    """CIFAR-10-shaped uint8 images and labels to learn offline: a smooth pattern per class, plus noise."""
    g = torch.Generator().manual_seed(seed)
    patterns = F.interpolate(torch.randn(10, 3, 4, 4, generator=g), size=(32, 32), mode="bilinear")
    g.manual_seed(seed * 2 + (1 if train else 2))
    labels = torch.randint(0, 10, (size,), generator=g)
    images = 0.25 * patterns[labels] + torch.randn(size, 3, 32, 32, generator=g)
    return (images * 48 + 128).clamp(0, 255).to(torch.uint8), labels


def cifar10(root):
    """CIFAR-10's (train, test) uint8 images and labels, downloaded into `root` when missing: by one process
    per machine (two corrupt one archive), global rank 0 first (machines may share `root`), then the rest."""
    import torchvision  # here, not at the top: it takes seconds to import, and the linear example needs none
    rank, error = rank_and_world()[0], None
    for my_turn in (rank == 0, rank != 0 and os.environ.get("LOCAL_RANK", "0") == "0"):
        if my_turn:
            try:
                torchvision.datasets.CIFAR10(root, download=True)
            except (OSError, RuntimeError) as e:  # URLError is an OSError; a corrupt archive a RuntimeError
                error = e
        if dist.is_initialized():
            dist.barrier()  # each turn ends when every process got there
    try:
        sets = [torchvision.datasets.CIFAR10(root, train=train) for train in (True, False)]
    except (OSError, RuntimeError) as e:
        raise UsageError(f"CIFAR-10 is not in {os.path.abspath(root)} and could not be downloaded ({error or e}): "
                         "put cifar-10-python.tar.gz in that folder, or run with --data synthetic") from None
    return [(torch.from_numpy(s.data).permute(0, 3, 1, 2).contiguous(), torch.tensor(s.targets)) for s in sets]


def build_example(args, device, rank=0, world_size=1):
    """Model, loss, train and test loader (None for linear) of args.example, each process with its shard."""
    if args.example == "linear":  # the post's one fixed batch, seeded, shared out among the processes
        if args.batch_size < world_size:
            raise UsageError(f"--batch-size {args.batch_size} leaves some of the {world_size} processes no sample")
        g = torch.Generator().manual_seed(args.seed)
        x, y = torch.randn(args.batch_size, 10, generator=g), torch.randn(args.batch_size, 1, generator=g)
        loader = DeviceLoader(x, y, args.batch_size, device, rank=rank, world_size=world_size)
        return nn.Linear(10, 1).to(device), nn.MSELoss(), loader, None
    train, test = ((synthetic_cifar10(10_000, args.seed), synthetic_cifar10(2_000, args.seed, train=False))
                   if args.data == "synthetic" else cifar10(args.data_root))
    import torchvision
    resnet18 = torchvision.models.resnet18(num_classes=10)  # the post's had 1000 classes
    return (resnet18.to(device, memory_format=torch.channels_last), nn.CrossEntropyLoss(),
            DeviceLoader(*train, args.batch_size, device, cifar10_transform(device, augment=True), shuffle=True,
                         seed=args.seed, rank=rank, world_size=world_size),
            DeviceLoader(*test, args.batch_size, device, cifar10_transform(device, augment=False),
                         rank=rank, world_size=world_size))


# ---------------------------------------------------------------- the run folder: checkpoint and metrics

def open_run_dir(folder, resume, job, example):
    """Takes the run folder before any training; returns (its lock, the checkpoint to go on from or None).
    The lock (flock: the kernel lets go when the process dies) keeps a second run out. A torchrun restart
    of the job that owns the folder goes on by itself, from its checkpoint or from the start; any other
    run needs --resume for a checkpoint, and starts only where no other run's files lie."""
    checkpoint, metrics = os.path.join(folder, "checkpoint.pt"), os.path.join(folder, "metrics.jsonl")
    if resume and not os.path.isdir(folder):
        raise UsageError(f"there is no run in {folder}: run without --resume to start one")
    try:
        os.makedirs(folder, exist_ok=True)
        lock = open(os.path.join(folder, "lock"), "a+")
    except OSError as e:
        raise UsageError(f"--run-dir {folder}: {os_error(e)}: pass a folder you can write") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        for path in (checkpoint, metrics):
            if os.path.islink(path) or os.path.lexists(path) and not os.path.isfile(path):
                raise UsageError(f"{path} is not a regular file: a run folder holds this program's files only")
        lock.seek(0)
        own = job is not None and lock.read() == job  # the job that wrote this folder, restarted by torchrun
        saved, logged = os.path.exists(checkpoint), os.path.exists(metrics) and os.path.getsize(metrics) > 0
        if saved and not (resume or own):
            raise UsageError(f"{folder} holds a checkpoint: add --resume to go on with it, or pass another --run-dir")
        if logged and not saved and not own:
            raise UsageError(f"{folder} holds metrics but no checkpoint: its run stopped before it saved an epoch; "
                             f"delete {metrics} to start again there, or pass another --run-dir")
        if resume and not saved and not own:
            raise UsageError(f"there is no checkpoint in {folder}: run without --resume to start one")
        state = load_checkpoint(checkpoint, example) if saved else None
        if saved:
            open(checkpoint, "ab").close()  # each write this run will make is tried before its first epoch
        torn = cut_metrics(metrics, state["epoch"] if state else 0)  # through metrics.jsonl.tmp, as checkpoints
        lock.truncate(0)
        lock.write(job or "")  # this run owns the folder now
        lock.flush()
    except BaseException as e:
        lock.close()
        if isinstance(e, BlockingIOError):
            raise UsageError(f"another run is using {folder}: wait for it to end, or pass another --run-dir") from None
        if isinstance(e, OSError):
            raise UsageError(f"cannot write in {folder} ({os_error(e)}): pass another --run-dir") from None
        raise
    if torn:
        print(f"note: dropped {torn} unreadable line(s) of {metrics} (torn by a crash or a full disk)")
    return lock, state


def os_error(e):
    e = e.__context__ if isinstance(e.__context__, OSError) else e  # torch.save wraps a full disk in a RuntimeError
    return f"{getattr(e, 'strerror', None) or e}" + ("; free some space" if getattr(e, "errno", 0) == errno.ENOSPC
                                                      else "")


def replace_file(path, write):
    """Writes a file whole or not at all: write(f) into PATH.tmp, flushed to the disk, renamed over PATH."""
    try:
        with open(f"{path}.tmp", "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # on the disk before the rename: a power loss leaves the old file or the new
        os.replace(f"{path}.tmp", path)
    except BaseException:  # a full disk, Ctrl-C: no half-written PATH.tmp stays behind
        with contextlib.suppress(OSError):
            os.remove(f"{path}.tmp")
        raise


def cut_metrics(path, epochs):
    """Keeps the metrics lines of epochs 1 to `epochs`; returns how many unreadable lines it dropped."""
    kept, torn = [], 0
    with open(path, "ab+") as f:  # created when missing
        f.seek(0)
        for line in f:
            try:
                if json.loads(line)["epoch"] <= epochs:
                    kept.append(line.rstrip(b"\n") + b"\n")
            except (ValueError, KeyError, TypeError):
                torn += 1
    replace_file(path, lambda f: f.writelines(kept))
    return torn


def load_checkpoint(path, example):
    """A checkpoint of `example` written by this program; a damaged or foreign file is a UsageError."""
    try:
        # weights_only: a checkpoint from elsewhere is untrusted input, and this never runs pickled code.
        state = torch.load(path, map_location="cpu", weights_only=True)
        fits = state["format"] == CHECKPOINT_FORMAT and all(
            isinstance(state[key], kind) and type(state[key]) is not bool for key, kind in CHECKPOINT_FIELDS.items())
    except Exception as e:  # truncated, not a torch file, holding more than tensors and plain types, a field missing
        raise UsageError(f"{path} is not a readable checkpoint of amp_train.py ({type(e).__name__}): "
                         "start again in another --run-dir") from None
    if not fits or state["epoch"] < 0 or state["processes"] < 1:
        raise UsageError(f"{path} is damaged, or of another version of amp_train.py: start again in another --run-dir")
    if state["example"] != example:
        raise UsageError(f"{path} is a checkpoint of the {state['example']} example: pass --example {state['example']}")
    return state


def resume_args(argv, state, device):
    """The checkpoint's run flags, but those given again; a note for each given one that changes the run."""
    saved = state["args"]
    before = [f"--{key.replace('_', '-')}={saved[key]}" for key in RUN_FLAGS if saved.get(key) is not None]
    try:  # the checkpoint's values pass the command line's checks
        parse_args(before)
    except UsageError as e:
        raise UsageError(f"the checkpoint holds flags this program refuses ({e})") from None
    args = parse_args(before + argv)
    args.precision = resolve_precision(args.precision, device)
    notes = []
    for key in RUN_FLAGS:
        value, old = getattr(args, key), saved.get(key)
        if value == old or key == "epochs" or key == "data" and args.example == "linear":
            continue
        if key == "data":
            raise UsageError(f"the checkpoint was trained on --data {old}: resume it on the same data")
        notes.append(f"note: --{key.replace('_', '-')} {value} replaces the checkpoint's {old}")
    return args, notes


def restore(state, model, optimizer, scheduler, scaler, lr):
    """Loads a checkpoint's states in place, with `lr` as the schedule's new base."""
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if scheduler is not None:
            scheduler.load_state_dict(state["scheduler"])
            scheduler.base_lrs = [lr] * len(optimizer.param_groups)
        for group in optimizer.param_groups:  # a new --lr rescales the schedule, which goes on from here
            group["lr"] *= lr / group.get("initial_lr", group["lr"])
            if "initial_lr" in group:
                group["initial_lr"] = lr
        if scaler.is_enabled() and state["scaler"]:  # only fp16 to fp16 has a loss scale to keep
            scaler.load_state_dict(state["scaler"])
    except (KeyError, RuntimeError, ValueError, TypeError) as e:
        raise UsageError(f"the checkpoint does not fit this run ({' '.join(str(e).split())}): "
                         "start again in another --run-dir") from None


def write_epoch(args, record, state):
    """Appends the epoch's metrics line (inf and NaN as null), then saves its checkpoint `state`, if any."""
    line = json.dumps({key: None if isinstance(value, float) and not math.isfinite(value) else value
                       for key, value in record.items()})
    try:
        with open(os.path.join(args.run_dir, "metrics.jsonl"), "a") as f:
            f.write(line + "\n")
        if state is not None:
            replace_file(os.path.join(args.run_dir, "checkpoint.pt"), lambda f: torch.save(state, f))
    except (OSError, RuntimeError) as e:  # torch.save reports some write failures as a RuntimeError
        raise UsageError(f"could not write in {args.run_dir} ({os_error(e)}); {kept(args)}") from None


def kept(args):
    """What the run folder holds, as read from it: the last words of a run that stops."""
    path = os.path.join(args.run_dir, "checkpoint.pt") if getattr(args, "run_dir", None) else None
    if path is None or not os.path.exists(path):
        return f"nothing was saved in {args.run_dir}" if path else "nothing is saved without --run-dir"
    return f"{args.run_dir} holds epoch {torch.load(path, mmap=True, weights_only=True)['epoch']}"


# ---------------------------------------------------------------- the training examples

def epoch_problem(record, steps, skipped_in_a_row, model):
    """Why this epoch must not be saved, and whether the run must stop: (reason, stop), or (None, False).
    Skipped fp16 steps are the scaler doing its job, until it has skipped everything for a long while."""
    tensors = {name: t for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_floating_point()}
    finite = torch.stack([torch.isfinite(t).all() for t in tensors.values()]).tolist()  # one host sync
    bad = next((name for name, ok in zip(tensors, finite) if not ok), None)
    if skipped_in_a_row >= max(steps, SKIPPED_IN_A_ROW_TO_STOP):
        return f"the GradScaler skipped all of the last {skipped_in_a_row} steps (inf/NaN gradients)", True
    if not math.isfinite(record["train_loss"]) and record["precision"] != "fp16":
        return f"the mean training loss is {record['train_loss']} under {record['precision']}", True
    if bad:  # NaN weights, or BatchNorm statistics of an inf batch, stay NaN for good
        return f"the model's {bad} holds inf/NaN", True
    for name, loss in (("training", record["train_loss"]), ("test", record.get("test_loss", 0.0))):
        if not math.isfinite(loss):  # in fp16 the scaler skipped that step, and the run goes on
            return f"its mean {name} loss is {loss}", False
    return None, False


def epoch_record(args, epoch, lr, stats, model, test_loader, criterion, device, world_size):
    """An epoch's metrics, summed over all processes: what its log line and the metrics file show."""
    ev = evaluate(model, test_loader, criterion, device, PRECISIONS[args.precision], args.max_steps) \
        if test_loader is not None else {"loss": 0.0, "accuracy": 0.0, "samples": 0}
    sums = torch.tensor([stats["loss"] * stats["samples"], stats["samples"], ev["loss"] * ev["samples"],
                         ev["accuracy"] * ev["samples"], ev["samples"]], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(sums)
    loss_sum, samples, test_loss_sum, correct, test_samples = sums.tolist()
    record = {"example": args.example, "precision": args.precision, "epoch": epoch + 1,
              "train_loss": loss_sum / max(samples, 1)}
    if test_loader is not None:
        record.update(test_loss=test_loss_sum / test_samples, test_accuracy=correct / test_samples)
    return {**record, "lr": lr, "loss_scale": stats["loss_scale"], "skipped_steps": stats["skipped_steps"],
            "samples_per_second": samples / max(stats["seconds"], 1e-9), "seconds": stats["seconds"],
            "processes": world_size}


def epoch_line(record, epochs):
    line = f"epoch {record['epoch']:>{len(str(epochs))}}/{epochs} | train loss {record['train_loss']:.4f}"
    if "test_loss" in record:
        line += f" | test loss {record['test_loss']:.4f} | test acc {100 * record['test_accuracy']:5.2f}%"
    scale = "off" if record["loss_scale"] is None else f"{record['loss_scale']:g}"
    unit = "samples" if record["example"] == "linear" else "img"
    return (f"{line} | lr {record['lr']:.4g} | scale {scale} | skipped {record['skipped_steps']} | "
            f"{record['samples_per_second']:.0f} {unit}/s | {record['seconds']:.3f} s")


def run_training(args, device, state=None, notes=()):
    """The resnet and linear examples: train, evaluate, print and (with --run-dir) save each epoch. Returns 0,
    or 1 when training stopped on inf/NaN. Under torchrun DDP wraps the model; rank 0 alone writes."""
    rank, world_size = rank_and_world()
    log = print if rank == 0 else (lambda *a, **k: None)
    amp_dtype, linear = PRECISIONS[args.precision], args.example == "linear"
    torch.manual_seed(args.seed)
    model, criterion, train_loader, test_loader = build_example(args, device, rank, world_size)
    optimizer = make_optimizer(model, args.lr)
    scheduler = None if linear else torch.optim.lr_scheduler.StepLR(optimizer, LR_STEP_EPOCHS, LR_GAMMA)
    scaler = make_scaler(device, amp_dtype)
    notes, start_epoch = list(notes), 0
    # The linear example's one fixed batch is shared out among the processes; resnet's batch is per process.
    batch = args.batch_size if linear else args.batch_size * args.accum_steps * world_size
    if state is not None:
        restore(state, model, optimizer, scheduler, scaler, args.lr)
        start_epoch = state["epoch"]
        if state["processes"] != world_size:
            notes.append(f"note: {world_size} processes replace the checkpoint's {state['processes']}: "
                         f"global batch {batch}, was {state['global_batch']}")
        notes.append(f"resumed from {args.run_dir} after epoch {start_epoch}")
    trained = model  # checkpoints hold the unwrapped model, so they resume with or without torchrun
    if world_size > 1:  # DDP averages the gradients in backward: every process's scaler sees the same ones
        trained = nn.parallel.DistributedDataParallel(model)  # on the model's one device
    steps_per_epoch = math.ceil(min(len(train_loader), (args.max_steps or len(train_loader)) * args.accum_steps)
                                / args.accum_steps)
    accumulated = f" x {args.accum_steps} accumulated" if args.accum_steps > 1 else ""
    log(f"amp_train | example {args.example} | torch {torch.__version__} | device {device} | precision "
        f"{args.precision} | scaler {'on' if scaler.is_enabled() else 'off'} | model "
        f"{'linear(10->1)' if linear else 'resnet18'} | data {'fixed batch' if linear else args.data} | batch "
        f"{-(-args.batch_size // world_size) if linear else args.batch_size}{accumulated} | processes "
        f"{world_size} | global batch {batch} | epochs {args.epochs} | steps/epoch {steps_per_epoch}", flush=True)
    for note in notes:
        log(note, flush=True)
    if start_epoch >= args.epochs:
        log(f"nothing to do: the checkpoint has {start_epoch} epochs; raise --epochs to train on")
        return 0
    log_every = 50 if steps_per_epoch >= 100 and rank == 0 else 0
    skipped_in_a_row = 0
    for epoch in range(start_epoch, args.epochs):
        train_loader.set_epoch(epoch)  # the order and the crops depend on (seed, epoch) alone
        lr = optimizer.param_groups[0]["lr"]
        stats = train_epoch(trained, train_loader, optimizer, criterion, scaler, device, amp_dtype,
                            args.clip_grad_norm, args.accum_steps, args.max_steps, log_every)
        for buffer in model.buffers() if world_size > 1 else ():
            dist.broadcast(buffer, src=0)  # BatchNorm's statistics: all evaluate (and save) rank 0's model
        record = epoch_record(args, epoch, lr, stats, model, test_loader, criterion, device, world_size)
        log(epoch_line(record, args.epochs), flush=True)
        skipped_in_a_row = skipped_in_a_row + stats["steps"] if stats["skipped_steps"] == stats["steps"] else 0
        problem, stop = epoch_problem(record, stats["steps"], skipped_in_a_row, model)
        if scheduler is not None and stats["skipped_steps"] < stats["steps"]:
            scheduler.step()  # once per epoch, and only after an epoch in which the optimizer stepped
        if args.run_dir and rank == 0:  # all a resumed run needs to go on as if it never stopped
            write_epoch(args, record, None if problem else {
                "format": CHECKPOINT_FORMAT, "example": args.example, "epoch": epoch + 1, "processes": world_size,
                "global_batch": batch, "args": {key: getattr(args, key) for key in RUN_FLAGS},
                "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler and scheduler.state_dict(), "scaler": scaler.state_dict()})  # {} when off
        if stop:
            log(f"error: epoch {epoch + 1}: {problem}; {kept(args)}; try a lower --lr or --clip-grad-norm",
                file=sys.stderr)
            return 1
        if problem:
            log(f"note: epoch {epoch + 1} is not saved, {problem}; {kept(args)}", flush=True)
    return 0


# ---------------------------------------------------------------- the memory example

@contextlib.contextmanager
def count_saved_tensors(model):
    """Bytes that autograd saves for backward inside the block, filled in on exit: activations (they grow
    with the batch; autocast halves them), by dtype, and autocast's weight copies (0 in fp32). The
    parameters exist anyway and are not counted; a storage saved twice counts once."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}  # data_ptr -> (bytes, its dtype or "copy")

    def pack(tensor):
        storage, fn = tensor.untyped_storage(), tensor.grad_fn
        while fn is not None and len(fn.next_functions) == 1:  # casts and views (Linear saves weight.t())...
            fn = fn.next_functions[0][0]
        copy = hasattr(fn, "variable") and fn.variable.untyped_storage().data_ptr() in params  # ...of a weight
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes(), "copy" if copy else str(tensor.dtype)[6:]
        return tensor

    counts, by_kind = {}, collections.Counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield counts
    for n, kind in storages.values():
        by_kind[kind] += n
    counts["weight_copy_bytes"] = by_kind.pop("copy", 0)
    counts["activation_bytes"] = sum(by_kind.values())
    counts["activation_bytes_by_dtype"] = dict(by_kind.most_common())


class CountOps(TorchDispatchMode):
    """Counts the aten ops run inside the block, but views, by the dtype they computed in (that of their
    first floating output, or input for ops in place): {dtype: Counter({op: calls})}."""

    def __init__(self):
        super().__init__()
        self.counts = collections.defaultdict(collections.Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        floating = [t for t in tree_leaves((out, args, kwargs)) if torch.is_tensor(t) and t.is_floating_point()]
        if floating and not func.is_view:
            self.counts[str(floating[0].dtype)[6:]][func.overloadpacket.__name__] += 1
        return out


def measure_training(model, batch, criterion, device, amp_dtype, steps=MEMORY_STEPS,
                     warmup=MEMORY_WARMUP_STEPS, lr=LR):
    """Trains a copy of `model` on one batch: `warmup` steps, one whose saved tensors and ops are counted,
    then `steps` timed ones, over which the CUDA peak memory is taken. Returns what it measured."""
    model = copy.deepcopy(model)
    optimizer, scaler = make_optimizer(model, lr), make_scaler(device, amp_dtype)
    for _ in range(warmup):
        train_epoch(model, [batch], optimizer, criterion, scaler, device, amp_dtype)
    inputs, targets = batch
    with count_saved_tensors(model) as saved, CountOps() as ops:  # the docs' AMP step alone
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            loss = criterion(model(inputs), targets)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()  # so the reserved peak is this run's, not the cache of the run before
        torch.cuda.reset_peak_memory_stats(device)
    timed = [train_epoch(model, [batch], optimizer, criterion, scaler, device, amp_dtype) for _ in range(steps)]
    seconds = [s["seconds"] for s in timed]
    return {**saved,
            "ops": {dtype: {"calls": sum(ops.values()), "top": dict(ops.most_common(OPS_SHOWN))}
                    for dtype, ops in sorted(ops.counts.items(), key=lambda item: -sum(item[1].values()))},
            "peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
            # Reserved memory is what the caching allocator holds, and what runs out.
            "reserved_bytes": torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None,
            "step_seconds": statistics.median(seconds), "step_seconds_min": min(seconds),
            "step_seconds_max": max(seconds), "final_loss": timed[-1]["loss"]}


def run_memory(args, device):
    """The post's "saves memory" claim, measured: the same model and batch in fp32 and in AMP."""
    if dist.is_initialized():
        raise UsageError("--example memory measures one process: run it with python, not torchrun")
    if args.precision == "fp32":
        raise UsageError("--example memory compares fp32 with AMP: use --precision fp16, bf16 or auto")
    example = argparse.Namespace(**{**vars(args), "example": "linear" if args.model == "linear" else "resnet",
                                    "data": "synthetic"})
    torch.manual_seed(args.seed)
    model, criterion, loader, _ = build_example(example, device)
    batch = next(iter(loader))
    runs = {name: measure_training(model, batch, criterion, device, PRECISIONS[precision], args.steps, lr=args.lr)
            for name, precision in (("fp32", "fp32"), ("amp", args.precision))}
    runs["ratio"] = {key: runs["amp"][key] / value if runs["amp"][key] is not None and value else None
                     for key, value in runs["fp32"].items() if not isinstance(value, dict)}
    conv, matmul = torch.backends.cudnn.conv, torch.backends.cuda.matmul  # may fp32 use TF32 tensor cores?
    tf32 = {"cudnn_conv": conv.fp32_precision == "tf32", "matmul": matmul.fp32_precision == "tf32"}
    result = {"device": str(device), "model": args.model, "batch_size": args.batch_size,
              "precision": args.precision, "steps": args.steps, "warmup_steps": MEMORY_WARMUP_STEPS,
              "torch": torch.__version__, "tf32": tf32 if device.type == "cuda" else None, **runs}
    print(json.dumps(result, indent=2) if args.json else memory_table(result), flush=True)
    return 0


def memory_table(r):
    amp, fp32, ratio, name = r["amp"], r["fp32"], r["ratio"], r["precision"]
    size = lambda n: "n/a" if n is None else f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.2f} KiB"  # noqa
    tf32 = "n/a" if r["tf32"] is None else "on" if r["tf32"]["cudnn_conv"] else "off"
    lines = [f"memory | torch {r['torch']} | device {r['device']} | model {r['model']} | batch {r['batch_size']} | "
             f"{r['warmup_steps']} warm-up + {r['steps']} timed steps | tf32 for fp32 convs {tf32}",
             f"{'':<22}{'fp32':>14}{name:>14}{name + '/fp32':>12}"]
    for label, key in (("activation memory", "activation_bytes"), ("weight copies", "weight_copy_bytes"),
                       ("peak device memory", "peak_bytes"), ("peak reserved memory", "reserved_bytes"),
                       ("step time median", "step_seconds"), ("step time min", "step_seconds_min"),
                       ("step time max", "step_seconds_max"), ("final loss", "final_loss")):
        show = size if "bytes" in key else (lambda t: f"{1000 * t:.2f} ms") if "seconds" in key else "{:.4f}".format
        lines.append(f"{label:<22}{show(fp32[key]):>14}{show(amp[key]):>14}"
                     f"{'n/a' if ratio[key] is None else f'{ratio[key]:.2f}':>12}")
    lines.append(f"ops in one {name} training step (aten calls, by the dtype they computed in; the most called):")
    for dtype, ops in amp["ops"].items():
        lines.append(f"  {dtype:<9}{ops['calls']:>5} calls: " + ", ".join(f"{op} x{n}" for op, n in ops["top"].items()))
    lines.append(f"{name} activations by dtype: " + ", ".join(
        f"{dtype} {size(n)}" for dtype, n in amp["activation_bytes_by_dtype"].items()))
    return "\n".join(lines)


# ---------------------------------------------------------------- command line

class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2 through main(), not usage text and sys.exit
        raise UsageError(f"{message} (see --help)")


def number(kind, low, high):
    """An argparse type: a `kind` from `low` (ints) or above it (floats), up to `high`."""
    def parse(text):
        value = kind(text)  # a ValueError reads "invalid int value: 'x'"
        if not low <= value <= high or kind is float and value == low:  # NaN fails too
            raise argparse.ArgumentTypeError(f"{text} is not in {'(' if kind is float else '['}{low}, {high:.4g}]")
        return value
    parse.__name__ = kind.__name__
    return parse


def parse_args(argv):
    count, positive = number(int, 1, 2**31 - 1), number(float, 0, torch.finfo(torch.float32).max)
    p = ArgumentParser(description="AMP training: the blog post's programs, fixed.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--example", choices=["resnet", "linear", "memory"], default="resnet", help="the program to run")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: cuda if a GPU is visible")
    p.add_argument("--precision", choices=["auto", *PRECISIONS], default="auto",
                   help="auto: fp16 (with a GradScaler) on CUDA, bf16 on the CPU; fp32 turns AMP off")
    p.add_argument("--epochs", type=count, default=EPOCHS, help="for linear: iterations over its fixed batch")
    p.add_argument("--batch-size", type=count, default=BATCH_SIZE,
                   help="per step and process; for linear, the fixed batch, shared out among the processes")
    p.add_argument("--lr", type=positive, default=LR, help="SGD's learning rate")
    p.add_argument("--data", choices=["cifar10", "synthetic"], default="cifar10", help="resnet: synthetic is offline")
    p.add_argument("--data-root", default="./data", help="the folder of CIFAR-10")
    p.add_argument("--max-steps", type=count, help="end each epoch after this many optimizer steps (and test batches)")
    p.add_argument("--clip-grad-norm", type=positive, help="clip the gradients to this norm, after unscaling")
    p.add_argument("--accum-steps", type=count, default=1, help="micro-batches that add up to one optimizer step")
    p.add_argument("--run-dir", metavar="DIR", help="append metrics to DIR/metrics.jsonl, save DIR/checkpoint.pt")
    p.add_argument("--resume", action="store_true", help="go on with the run in --run-dir, up to --epochs")
    p.add_argument("--model", choices=["resnet18", "linear"], default="resnet18", help="memory: the model")
    p.add_argument("--steps", type=count, default=MEMORY_STEPS, help="memory: timed steps, after 3 warm-up ones")
    p.add_argument("--json", action="store_true", help="memory: one JSON object instead of the table")
    p.add_argument("--seed", type=number(int, 0, 2**32 - 1), default=0, help="of the weights, data, order and crops")
    return p.parse_args(argv)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args, lock = None, None
    try:
        args = parse_args(argv)
        if args.resume and not args.run_dir or args.run_dir and args.example == "memory":
            raise UsageError("--resume needs --run-dir DIR, and --run-dir is for the resnet and linear examples")
        device = resolve_device(args.device)
        if device.type == "cuda":  # this process's GPU, for what asks for the current one (its bf16 support, NCCL)
            torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = device.type == "cuda"  # fixed shapes: let cuDNN time its kernels once
        args.precision = resolve_precision(args.precision, device)
        if device.type == "cpu" and args.precision == "fp16" and "linear" not in (args.example, args.model):
            print("warning: fp16 convolutions are very slow on CPUs (tens to hundreds of times slower than fp32); "
                  "--precision bf16 is the fast CPU choice", file=sys.stderr)
        job = init_distributed(device)
        if args.example == "memory":
            return run_memory(args, device)
        state = [None]  # rank 0 takes the run folder and hands its checkpoint (or its error) to the others
        if args.run_dir and rank_and_world()[0] == 0:
            try:
                lock, state[0] = open_run_dir(args.run_dir, args.resume, job, args.example)
            except UsageError as e:
                state[0] = e
        if args.run_dir and dist.is_initialized():
            dist.broadcast_object_list(state, src=0)
        if isinstance(state[0], UsageError):
            raise state[0]
        notes = []
        if state[0] is not None:
            args, notes = resume_args(argv, state[0], device)
        status = run_training(args, device, state[0], notes)
        if dist.is_initialized():
            dist.barrier()  # let every process finish its last collective before any leaves
        return status
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM: one line, and what the run folder holds
        if rank_and_world()[0] == 0:
            print(f"error: {'terminated' if isinstance(e, Terminated) else 'interrupted'}; {kept(args)}",
                  file=sys.stderr)
        return 143 if isinstance(e, Terminated) else 130
    except RuntimeError as e:  # CUDA's OutOfMemoryError is a RuntimeError, as is the CPU allocator's
        if not isinstance(e, torch.OutOfMemoryError) and "can't allocate memory" not in str(e):
            raise
        print(f"error: out of memory at --batch-size {args.batch_size}: lower it "
              "(--accum-steps K keeps the batch of an optimizer step)", file=sys.stderr)
        return 2
    finally:
        if lock is not None:
            lock.close()
        if dist.is_initialized():  # DDP holds the group in reference cycles: gloo aborted at exit without gc
            gc.collect()
            dist.destroy_process_group()


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, Terminated.handler)
    sys.stdout.reconfigure(errors="backslashreplace")  # a file name that is not UTF-8 prints, escaped
    sys.exit(main())
