"""AMP training with torch.amp, as its docs describe it: the programs of the blog post
"AMP Tensor Cores: saving memory in PyTorch models", fixed, for a CUDA GPU or the CPU.

    python amp_train.py --example linear   # the post's Linear(10, 1) on one batch
    python amp_train.py --example resnet   # ResNet18 on CIFAR-10 (--data synthetic)
    python amp_train.py --example memory   # fp32 and AMP side by side
    torchrun --nproc_per_node=2 amp_train.py --example resnet   # DDP

train_epoch, first below, is the part to copy.
"""
import argparse
import contextlib
import copy
import datetime
import fcntl
import gc
import io
import itertools
import json
import math
import os
import signal
import stat
import statistics
import sys
import threading
import time
import zipfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# The post's settings: SGD lr 0.01, batch 128, StepLR(10, 0.1), 100 epochs.
EPOCHS = 100
BATCH_SIZE = 128
LR = 0.01
LR_STEP_EPOCHS = 10
LR_GAMMA = 0.1
PRECISIONS = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": None}
# The flags of a run: a resumed one keeps the checkpoint's unless given again.
RUN_FLAGS = ("epochs", "example", "precision", "batch_size", "lr", "data", "max_steps",
             "clip_grad_norm", "accum_steps", "seed")
CHECKPOINT_FORMAT = "amp_train checkpoint 5"
CHECKPOINT_FIELDS = {"format": (str,), "job": (str,),
                     "epoch": (int,), "args": (dict,), "metrics": (list,),
                     "model": (dict,), "optimizer": (dict,), "loss_scale": (float,),
                     "growth_tracker": (int,)}
MAX_CHECKPOINT_BYTES = 2**30  # ResNet18's takes 45 MB
# fp16 stops when its loss scale falls 32 halvings under 2**16: the gradients overflow
# however small the loss is made.
MIN_LOSS_SCALE = 2.0**-16
DIST_TIMEOUT = datetime.timedelta(minutes=10)  # NCCL's default
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
MEMORY_STEPS = 20
MEMORY_WARMUP_STEPS = 3
NOISY_SPREAD = 1.3  # the median timed step over the fastest, at most
PROGRESS_SECONDS = 15  # longer epochs print a progress line this often


# ---------- the part to copy

def train_epoch(model, loader, optimizer, criterion, scaler, device, amp_dtype, *,
                scheduler=None, clip_grad_norm=None, accum_steps=1, max_steps=None,
                log_seconds=float("inf")):
    """One pass over `loader`'s (inputs, targets) with AMP, as the torch.amp docs, plus
    accumulation and a skipped-step count; amp_dtype: bfloat16, float16 (with a GradScaler)
    or None. scheduler: stepped after every step, skipped or not (our choice: no sync).
    Returns {"loss", "steps", "skipped_steps", "samples", "seconds", "loss_scale"}."""
    device = torch.device(device)
    scaler = scaler or torch.amp.GradScaler(device.type, enabled=False)  # a no-op
    if amp_dtype == torch.float16 and not scaler.is_enabled():
        raise ValueError("float16 needs a torch.amp.GradScaler(device.type)")
    if accum_steps < 1:
        raise ValueError(f"accum_steps must be 1 or more, not {accum_steps}")
    model.train()
    loss_sum, skipped = torch.zeros(2, device=device)  # no .item() per step
    steps = samples = 0
    start = last_log = time.perf_counter()
    batches = iter(loader)
    while steps != max_steps and (group := list(itertools.islice(batches, accum_steps))):
        optimizer.zero_grad(set_to_none=True)  # no gradient from before this step
        for i, batch in enumerate(group):
            if not isinstance(batch, (tuple, list)):
                raise TypeError(f"{type(batch)} is no (inputs, targets) pair: see README")
            inputs, targets = (tensor.to(device, non_blocking=True) for tensor in batch)
            no_sync = getattr(model, "no_sync", contextlib.nullcontext)  # DDP's: all-reduce
            with no_sync() if i < len(group) - 1 else contextlib.nullcontext():  # at the last
                with torch.autocast(device.type, dtype=amp_dtype, enabled=bool(amp_dtype)):
                    loss = criterion(model(inputs), targets)  # forward and loss only
                scaler.scale(loss / len(group)).backward()  # small fp16 grads live
            loss_sum += loss.detach().float() * len(targets) if len(targets) else 0.0
            samples += len(targets)
        if clip_grad_norm is not None:
            scaler.unscale_(optimizer)  # clip the true gradients
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
        scaler.step(optimizer)  # skips the step if a gradient is inf/NaN
        if scaler.is_enabled():  # found_inf, read on the device: no sync
            found = scaler._found_inf_per_device(optimizer).values()
            skipped += sum(found_inf.to(device) for found_inf in found) > 0
        scaler.update()  # halves the scale after a skip, doubles it after 2000 steps
        if scheduler is not None:
            scheduler.step()
        steps += 1
        if time.perf_counter() - last_log >= log_seconds:
            last_log = time.perf_counter()  # .item() is a host sync: once a line
            print(f"  step {steps} | loss {loss_sum.item() / samples:.4f} | "
                  f"{samples / (last_log - start):.0f} samples/s", flush=True)
    loss_sum, skipped = torch.stack([loss_sum, skipped]).tolist()  # one sync
    return {"loss": loss_sum / (samples or float("nan")), "steps": steps, "samples": samples,
            "skipped_steps": int(skipped), "seconds": time.perf_counter() - start,
            "loss_scale": scaler.get_scale()}  # 1.0 when disabled


@torch.inference_mode()
def evaluate(model, loader, criterion, device, amp_dtype, max_steps=None):
    """Mean loss, accuracy and samples of `loader`'s first max_steps batches, under
    autocast; NaN if no sample. Needs `import itertools, torch`."""
    device = torch.device(device)
    model.eval()
    loss_sum, correct = torch.zeros(2, device=device)
    samples = 0
    for inputs, targets in itertools.islice(loader, max_steps):
        inputs, targets = inputs.to(device), targets.to(device)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=bool(amp_dtype)):
            outputs = model(inputs)
            loss_sum += criterion(outputs, targets).float() * len(targets)
        correct += (outputs.argmax(dim=1) == targets).sum()
        samples += len(targets)
    loss_sum, correct = torch.stack([loss_sum, correct]).tolist()
    measured = samples or float("nan")
    return {"loss": loss_sum / measured, "accuracy": correct / measured, "samples": samples}


# ---------- errors and signals

class UsageError(Exception):
    """A mistake the user can fix: one line, exit 2."""
    status = 2


class GroupError(UsageError):
    """The processes could not meet: one line, exit 3."""
    status = 3


class Stopped(KeyboardInterrupt):
    """SIGINT or SIGTERM (a plain KeyboardInterrupt passes main())."""


def stop(signum, frame):
    """__main__'s handler: one stop; a second signal cannot break the cleanup."""
    ignore_signals()
    raise Stopped(signum)


def ignore_signals():
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def say(line, file=None):
    print(line, file=file, flush=True)


# ---------- device, precision, processes

def resolve_device(name):
    """cuda for 'auto' if a GPU is seen; GPU LOCAL_RANK under torchrun, made current."""
    if name == "cpu" or name == "auto" and not torch.cuda.is_available():
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UsageError("no CUDA GPU is visible: use --device cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if local_rank >= torch.cuda.device_count():  # two processes on one GPU: OOM
        raise UsageError(f"process {local_rank} has no GPU: start fewer")
    torch.cuda.set_device(local_rank)  # for what asks the current GPU
    torch.backends.cudnn.benchmark = True  # fixed shapes: time once
    return torch.device("cuda", local_rank)


def cpu_bf16():
    """The CPU's bf16 instructions: AMX, AVX512-BF16 or none (bf16 is emulated)."""
    # Private, the only names: a test checks them against /proc/cpuinfo.
    if torch.cpu._is_amx_tile_supported():
        return "AMX"
    return "AVX512-BF16" if torch.cpu._is_avx512_bf16_supported() else "none"


def device_label(device):
    return f"{device} (bf16: {cpu_bf16()})" if device.type == "cpu" else str(device)


def resolve_precision(name, device, example):
    """--precision, auto as --help says (but bf16 for memory, which compares)."""
    cuda = device.type == "cuda"
    if name == "auto":
        on_cpu = "bf16" if cpu_bf16() != "none" or example == "memory" else "fp32"
        return "fp16" if cuda else on_cpu
    if name == "bf16" and cuda and not torch.cuda.is_bf16_supported(False):
        raise UsageError("this GPU has no bfloat16: use --precision fp16")
    return name


def cpu_notes(args, device):
    """What AMP costs on this CPU, for the header."""
    notes = []
    if device.type != "cpu":
        return notes
    if args.precision == "fp16":
        notes.append("warning: fp16 is very slow on CPUs: bf16 or fp32 is faster")
    if cpu_bf16() == "none":
        notes.append("note: this CPU has no bf16 instructions (AMX, AVX512-BF16): bf16 "
                     "is emulated, slower: auto trains in fp32 (--precision bf16 forces it)")
    return notes


def make_scaler(device, amp_dtype):
    # Only float16 needs loss scaling: bfloat16 has fp32's range.
    return torch.amp.GradScaler(device.type, enabled=amp_dtype is torch.float16)


def make_optimizer(model, lr):
    """The post's SGD, fused: it takes the inf check into its kernel, so step() needs
    no sync."""
    return torch.optim.SGD(model.parameters(), lr=lr, fused=True)


def init_distributed(device):
    """Under torchrun, joins the processes' group (NCCL, or gloo on CPUs); returns
    the job's name."""
    if "WORLD_SIZE" not in os.environ:
        return os.urandom(16).hex()  # a job of its own
    store, rank, world_size = wait_for_peers()
    # torchrun's store outlives restarts: the first process names the job, restarts find
    # the name. Each round gets keys of its own (the last one's hung gloo).
    job = store.compare_set("amp_train_job", "", os.urandom(16).hex()).decode()
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"round{restart}", store)
    backend, device_id = ("nccl", device) if device.type == "cuda" else ("gloo", None)
    # Bounded waits: a process whose peer died raises.
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=DIST_TIMEOUT, device_id=device_id)
    return job


def wait_for_peers():
    """env:// rendezvous: (store, rank, world size), in a helper thread: it waits in
    C++, where no signal reaches Python."""
    met = []  # what the rendezvous returned or raised

    def meet():
        try:
            met.append(next(dist.rendezvous("env://", timeout=DIST_TIMEOUT)))
        except Exception as e:
            met.append(e)
    thread = threading.Thread(target=meet, daemon=True)
    thread.start()
    thread.join()  # a signal's handler raises here
    if isinstance(met[0], ValueError):  # MASTER_ADDR, MASTER_PORT or RANK is missing
        raise UsageError(f"{met[0]}: use torchrun, or unset WORLD_SIZE")
    if isinstance(met[0], Exception):  # a port in use, a timeout: torch names it
        cause = str(met[0]).splitlines()[0]
        raise GroupError(f"the processes could not meet ({cause})")
    return met[0]


def rank_and_world():
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


# ---------- models and data

def resnet18(imagenet_stem=False):
    """torchvision's ResNet18 for 10 classes, with the CIFAR stem (3x3 stride-1 conv,
    no max-pool), or the post's, which makes 32x32 images 8x8."""
    import torchvision  # here: it takes seconds; linear needs none
    model = torchvision.models.resnet18(num_classes=10)  # the post's had 1000 classes
    if not imagenet_stem:
        model.conv1 = nn.Conv2d(3, 64, 3, padding=1, bias=False)
        model.maxpool = nn.Identity()
    return model


class DeviceLoader:
    """Batches of tensors held on the device. A process's shard: with `shuffle`, whole
    batches (BatchNorm needs 2+), as many as others'; else each sample once."""

    def __init__(self, inputs, targets, batch_size, device, transform=lambda x, _: x,
                 shuffle=False, seed=0, rank=0, world_size=1):
        self.inputs, self.targets = inputs.to(device), targets.to(device)
        self.batch_size, self.transform, self.shuffle = batch_size, transform, shuffle
        self.seed, self.rank, self.world_size, self.epoch = seed, rank, world_size, 0

    def __len__(self):
        if self.shuffle:
            return len(self.targets) // self.world_size // self.batch_size
        return math.ceil(len(self.targets[self.rank::self.world_size]) / self.batch_size)

    def __iter__(self):
        n, device = len(self.targets), self.targets.device
        seed = (self.seed * 1_000_003 + self.epoch) % 2**32  # a generator keeps 32 bits
        augment = torch.Generator(device)
        augment.manual_seed((seed + 7919 * (self.rank + 1)) % 2**32)
        order = torch.arange(n)
        if self.shuffle:  # one order for all, drawn on the CPU: GPUs agree
            order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
            order = order[:len(self) * self.batch_size * self.world_size]
        order = order[self.rank::self.world_size].to(device)
        for start in range(0, len(order), self.batch_size):
            index = order[start:start + self.batch_size]
            yield self.transform(self.inputs[index], augment), self.targets[index]


def random_crop_flip(images, generator):
    """torchvision's RandomCrop(32, padding=4) and RandomHorizontalFlip, batched."""
    n, device = len(images), images.device
    padded = F.pad(images, (4, 4, 4, 4))
    dy, dx = torch.randint(0, 9, (2, n, 1), generator=generator, device=device)
    mirror = torch.rand(n, 1, generator=generator, device=device) < 0.5
    base = torch.arange(32, device=device)
    rows = (dy + base)[:, None, :, None].expand(n, 3, 32, 40)
    cols = (dx + torch.where(mirror, 31 - base, base))[:, None, None, :]
    return padded.gather(2, rows).gather(3, cols.expand(n, 3, 32, 32))


def cifar10_transform(device, augment):
    """uint8 -> normalized float images, cropped and flipped if `augment`, channels_last
    (tensor cores' and oneDNN's layout)."""
    mean = torch.tensor(CIFAR10_MEAN, device=device).view(3, 1, 1) * 255
    std = torch.tensor(CIFAR10_STD, device=device).view(3, 1, 1) * 255

    def transform(images, generator):
        if augment:
            images = random_crop_flip(images, generator)
        images = (images.float() - mean) / std
        return images.contiguous(memory_format=torch.channels_last)
    return transform


def synthetic_cifar10(size, seed=0, train=True):
    """CIFAR-10-shaped uint8 images and labels: a smooth pattern a class, and noise."""
    g = torch.Generator().manual_seed(seed)
    patterns = torch.randn(10, 3, 4, 4, generator=g)
    patterns = F.interpolate(patterns, size=(32, 32), mode="bilinear")
    g.manual_seed(seed * 2 + (1 if train else 2))
    labels = torch.randint(0, 10, (size,), generator=g)
    images = 0.25 * patterns[labels] + torch.randn(size, 3, 32, 32, generator=g)
    return (images * 48 + 128).clamp(0, 255).to(torch.uint8), labels


def cifar10(root):
    """CIFAR-10's (train, test) images and labels, downloaded if missing by rank 0
    alone (two downloads corrupt it)."""
    import torchvision
    if rank_and_world()[0] == 0:
        with contextlib.suppress(OSError, RuntimeError):  # offline: see below
            torchvision.datasets.CIFAR10(root, download=True)
    if dist.is_initialized():
        dist.barrier()
    try:
        train = torchvision.datasets.CIFAR10(root, train=True)
        test = torchvision.datasets.CIFAR10(root, train=False)
    except (OSError, RuntimeError):
        raise UsageError(f"no CIFAR-10 in {os.path.abspath(root)}, nor online: put "
                         "cifar-10-python.tar.gz there, or use --data synthetic") from None
    return images_and_labels(train), images_and_labels(test)


def images_and_labels(dataset):
    images = torch.from_numpy(dataset.data).permute(0, 3, 1, 2).contiguous()
    return images, torch.tensor(dataset.targets)


def build_example(args, device, rank=0, world_size=1, imagenet_stem=False):
    """Model, loss, train and test loader of args.example, for one process."""
    if args.example == "linear":  # the post's one fixed batch, seeded, shared out
        if args.batch_size % world_size:  # else DDP's mean of means is skewed
            raise UsageError(f"--batch-size {args.batch_size} does not share out evenly "
                             f"among {world_size} processes")
        g = torch.Generator().manual_seed(args.seed)
        x = torch.randn(args.batch_size, 10, generator=g)
        y = torch.randn(args.batch_size, 1, generator=g)
        loader = DeviceLoader(x, y, args.batch_size, device, rank=rank, world_size=world_size)
        return nn.Linear(10, 1).to(device), nn.MSELoss(), loader, []  # no test set
    if args.data == "synthetic":
        train = synthetic_cifar10(10_000, args.seed)
        test = synthetic_cifar10(2_000, args.seed, train=False)
    else:
        train, test = cifar10(args.data_root)
    shards = {"rank": rank, "world_size": world_size}
    augment = cifar10_transform(device, True)
    train_loader = DeviceLoader(*train, args.batch_size, device, augment, True, args.seed, **shards)
    if len(train_loader) == 0:
        raise UsageError(f"--batch-size {args.batch_size} is more than each process's "
                         f"{len(train[1]) // world_size} training images")
    test_loader = DeviceLoader(*test, args.batch_size, device, cifar10_transform(device, False),
                               **shards)
    model = resnet18(imagenet_stem).to(device, memory_format=torch.channels_last)
    return model, nn.CrossEntropyLoss(), train_loader, test_loader


# ---------- the run folder

def open_run_dir(folder, resume, job, run):
    """Locks the folder into run["lock"] (freed when the process dies); returns the
    checkpoint to go on from, or None."""
    try:
        if not resume:
            os.makedirs(folder, exist_ok=True)
        run["lock"] = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(run["lock"], fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise UsageError(f"another run is using {folder}") from None
    except OSError as e:
        raise UsageError(f"cannot use --run-dir {folder} ({e})") from None
    return checkpoint_to_resume(folder, resume, job)


def checkpoint_to_resume(folder, resume, job):
    """The folder's checkpoint if this run may go on from it, or None."""
    state = load_checkpoint(folder)
    if state is None:
        metrics = os.path.join(folder, "metrics.jsonl")
        if resume:
            raise UsageError(f"no checkpoint in {folder}: run without --resume")
        if read_file(metrics):
            raise UsageError(f"{folder} holds metrics, no checkpoint: delete {metrics}")
        return None
    if not (resume or state["job"] == job):  # or torchrun restarted this job
        raise UsageError(f"{folder} holds a checkpoint: add --resume")
    return state


def read_file(path):
    """The regular file's bytes, or None. No link followed, no FIFO waited on, no
    huge file read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:  # a link: ELOOP
        raise UsageError(f"cannot read {path} ({e})") from None
    with open(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_CHECKPOINT_BYTES:
            raise UsageError(f"{path} is no file this program wrote: remove it")
        return f.read()


def replace_file(path, write):
    """Writes a file whole or not at all: write(f) into PATH.tmp, made anew (no link
    followed), flushed to the disk, renamed over PATH."""
    tmp = f"{path}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    try:  # a signal may come as soon as the file exists
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with open(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(fd)  # on the disk before the rename: old or new survives
        os.replace(tmp, path)
    except BaseException as e:  # a full disk, Ctrl-C: no half-written file stays
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, RuntimeError) and e.__context__ is not None:
            raise e.__context__ from None  # torch.save wraps a signal
        raise


@contextlib.contextmanager
def writing(folder):
    """Turns a failed write in the run folder into one line: why, what it holds."""
    try:
        yield
    except (OSError, RuntimeError) as e:  # torch.save's too
        raise UsageError(f"could not write in {folder} ({e}); {holds(folder)}") from None


def load_checkpoint(folder):
    """The folder's checkpoint, or None; a damaged or foreign one is refused."""
    path = os.path.join(folder, "checkpoint.pt")
    data = read_file(path)
    if data is None:
        return None
    try:
        # Untrusted input: a zip states its size, and weights_only runs no code
        records = zipfile.ZipFile(io.BytesIO(data)).infolist()
        if sum(record.file_size for record in records) > MAX_CHECKPOINT_BYTES:
            raise ValueError("it unpacks to too much")
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        check_checkpoint(state)
    except Exception as e:  # not a zip, truncated, foreign types
        raise UsageError(f"{path} is not a checkpoint of this amp_train.py "
                         f"({type(e).__name__}: {str(e)[:80]})") from None
    return state


def check_checkpoint(state):
    """Raises unless `state` has save_run's layout, known good. A crafted file can
    nest or reuse an object, so only that layout is walked, and what it adds up to."""
    typed = all(type(state[key]) in kinds for key, kinds in CHECKPOINT_FIELDS.items())
    buffers = itertools.chain(*map(dict.values, state["optimizer"].values()))
    tensors = [*state["model"].values(), *buffers]
    if not (typed and state["format"] == CHECKPOINT_FORMAT
            and len(state["metrics"]) == state["epoch"]  # one line an epoch
            and all(map(str.isascii, state["metrics"]))  # as json.dumps writes
            and sum(map(len, state["metrics"])) <= MAX_CHECKPOINT_BYTES
            and {*map(type, state["args"].values())} <= {int, float, str}  # for parse_args
            and MIN_LOSS_SCALE <= state["loss_scale"] <= 2.0**127  # finite in float32
            and 0 <= state["growth_tracker"] < 2000  # else it never grows the scale
            and sum(t.numel() for t in tensors) <= MAX_CHECKPOINT_BYTES // 4
            and all(map(known_good, tensors))):
        raise ValueError("it is damaged, or of another version")


def known_good(tensor):
    """A finite float32 tensor or an int64 one: the model's dtypes."""
    finite = tensor.dtype == torch.float32 and bool(tensor.isfinite().all())
    return finite or tensor.dtype == torch.int64


def resume_args(argv, state, device):
    """The checkpoint's flags, replaced by those given again, with a note each."""
    saved = [f"--{key.replace('_', '-')}={state['args'].get(key)}" for key in RUN_FLAGS]
    try:  # they pass the command line's checks
        before = parse_args(saved)
    except UsageError as e:
        raise UsageError(f"the checkpoint's flags are refused ({e})") from None
    args = parse_args(saved + argv)
    args.precision = resolve_precision(args.precision, device, args.example)
    # RUN_FLAGS[1:]: all but --epochs, which a resume raises
    changed = [key for key in RUN_FLAGS[1:] if getattr(args, key) != getattr(before, key)]
    if "data" in changed:
        raise UsageError(f"the checkpoint was trained on --data {before.data}")
    notes = [f"note: --{key.replace('_', '-')} {getattr(args, key)} replaces the "
             f"checkpoint's {getattr(before, key)}" for key in changed]
    return args, notes + [f"resumed from {args.run_dir} after epoch {state['epoch']}"]


def restore(state, model, optimizer, scaler):
    """Loads a checkpoint in place, checked against the model: weights, optimizer
    state, loss scale; hyperparameters are the flags'."""
    params = list(model.parameters())
    try:
        model.load_state_dict(state["model"])  # another key or shape raises
        for index, buffers in state["optimizer"].items():  # another shape breaks memory
            if any(t.shape != params[index].shape for t in buffers.values()):
                raise ValueError(f"optimizer state that does not fit parameter {index}")
        groups = optimizer.state_dict()["param_groups"]  # this run's lr, momentum
        optimizer.load_state_dict({"state": state["optimizer"], "param_groups": groups})
    except Exception as e:  # another key, shape or type
        raise UsageError(f"the checkpoint does not fit ({' '.join(str(e).split())})") from None
    if state["args"]["precision"] == "fp16":  # a disabled scaler takes nothing
        scaler.load_state_dict({**scaler.state_dict(), "scale": state["loss_scale"],
                                "_growth_tracker": state["growth_tracker"]})


def save_run(args, job, metrics, model, optimizer, scaler, checkpoint=True):
    """With --run-dir, on rank 0: the metrics file, whole (never read back), and the
    checkpoint of epoch len(metrics)."""
    if args.run_dir is None or rank_and_world()[0] != 0:
        return
    state = {"format": CHECKPOINT_FORMAT, "job": job,
             "epoch": len(metrics),
             "args": {key: getattr(args, key) for key in RUN_FLAGS},
             "metrics": metrics, "model": dict(model.state_dict()),
             "optimizer": optimizer.state_dict()["state"],
             "loss_scale": scaler.get_scale(),  # 1.0 without fp16
             "growth_tracker": scaler.state_dict().get("_growth_tracker", 0)}
    text = "".join(metrics).encode()
    with writing(args.run_dir):
        replace_file(os.path.join(args.run_dir, "metrics.jsonl"), lambda f: f.write(text))
        if checkpoint:
            path = os.path.join(args.run_dir, "checkpoint.pt")
            replace_file(path, lambda f: torch.save(state, f))


def holds(folder):
    """What the run folder holds, read from it: a stopped run's last words."""
    if folder is None:
        return "nothing is saved without --run-dir"
    try:
        state = load_checkpoint(folder)
    except UsageError:
        return f"{folder}'s checkpoint cannot be read"
    return f"{folder} holds epoch {state['epoch']}" if state else f"{folder} holds nothing"


# ---------- the training examples

def run_training(args, device, job, state, notes):
    """The resnet and linear examples: train, test, print, save each epoch; returns
    0, or 1 if training diverged. Rank 0 alone prints and writes."""
    rank, world_size = rank_and_world()
    log = say if rank == 0 else lambda line, file=None: None
    amp_dtype = PRECISIONS[args.precision]
    max_steps = args.max_steps or None  # 0: no limit
    torch.manual_seed(args.seed)
    model, criterion, train_loader, test_loader = build_example(args, device, rank, world_size)
    optimizer, scaler = make_optimizer(model, args.lr), make_scaler(device, amp_dtype)
    metrics = []  # the metrics file's lines, one an epoch
    if state is not None:
        restore(state, model, optimizer, scaler)
        metrics = state["metrics"]
    log("\n".join([header(args, device, scaler), *notes, *cpu_notes(args, device)]))
    if len(metrics) >= args.epochs:
        log(f"nothing to do: the checkpoint has {len(metrics)} epochs")
        return 0
    # DDP averages the gradients in backward: every process's scaler sees the same.
    ddp_model = nn.parallel.DistributedDataParallel(model) if world_size > 1 else model
    save_run(args, job, metrics, model, optimizer, scaler)  # each write tried first
    for epoch in range(len(metrics), args.epochs):
        set_lr(optimizer, args, epoch)
        train_loader.epoch = epoch  # order and crops depend on (seed, epoch)
        stats = train_epoch(ddp_model, train_loader, optimizer, criterion, scaler, device,
                            amp_dtype, clip_grad_norm=args.clip_grad_norm or None,
                            accum_steps=args.accum_steps, max_steps=max_steps,
                            log_seconds=PROGRESS_SECONDS if rank == 0 else math.inf)
        if world_size > 1:  # BatchNorm's statistics: all test rank 0's
            for buffer in model.buffers():
                dist.broadcast(buffer, src=0)
        tested = evaluate(model, test_loader, criterion, device, amp_dtype, max_steps)
        record = epoch_record(args, epoch, optimizer, stats, tested, device)
        log(epoch_line(record, args.epochs))
        metrics.append(json_line(record))
        problem, stop_run = epoch_problem(record, model)
        save_run(args, job, metrics, model, optimizer, scaler, checkpoint=not problem)
        if stop_run:
            log(f"error: epoch {epoch + 1}: {problem}; {holds(args.run_dir)}; lower --lr",
                sys.stderr)
            return 1
        if problem:
            log(f"note: epoch {epoch + 1} is not saved, {problem}; {holds(args.run_dir)}")
    return 0


def header(args, device, scaler):
    scaling = "on" if scaler.is_enabled() else "off"
    data = "one batch" if args.example == "linear" else args.data
    return (f"amp_train | example {args.example} | torch {torch.__version__} | device "
            f"{device_label(device)} | precision {args.precision} | scaler {scaling} | "
            f"data {data} | batch {args.batch_size} | accum {args.accum_steps} | processes "
            f"{rank_and_world()[1]} | epochs {args.epochs}")


def set_lr(optimizer, args, epoch):
    """The post's StepLR(10, 0.1) from --lr for resnet; linear's stays."""
    decays = 0 if args.example == "linear" else epoch // LR_STEP_EPOCHS
    for group in optimizer.param_groups:
        group["lr"] = args.lr * LR_GAMMA ** decays


def epoch_record(args, epoch, optimizer, stats, tested, device):
    """An epoch's metrics, summed over all processes."""
    sums = [stats["loss"] * stats["samples"], stats["samples"], tested["samples"],
            tested["loss"] * tested["samples"], tested["accuracy"] * tested["samples"]]
    sums = torch.tensor(sums, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(sums)
    loss_sum, samples, test_samples, test_loss_sum, correct = sums.tolist()
    record = {"example": args.example, "precision": args.precision, "epoch": epoch + 1,
              "train_loss": loss_sum / max(samples, 1)}
    if args.example == "resnet":
        record.update(test_loss=test_loss_sum / test_samples,
                      test_accuracy=correct / test_samples)
    return {**record, "lr": optimizer.param_groups[0]["lr"],
            "loss_scale": stats["loss_scale"], "skipped_steps": stats["skipped_steps"],
            "seconds": stats["seconds"], "samples_per_second": samples / stats["seconds"],
            "processes": rank_and_world()[1]}


def json_line(record):
    """The record as a line of JSON, with null for inf and NaN, which JSON lacks."""
    text = json.dumps(record).replace("-Infinity", "null")  # no key holds these words
    return text.replace("Infinity", "null").replace("NaN", "null") + "\n"


def epoch_problem(record, model):
    """(Why this epoch is not saved, whether the run must stop), or (None, False)."""
    tensors = model.state_dict()
    finite = torch.stack([t.isfinite().all() for t in tensors.values()]).tolist()  # a sync
    if not all(finite):  # NaN weights or BatchNorm statistics stay
        return f"the model's {list(tensors)[finite.index(False)]} holds inf/NaN", True
    if record["loss_scale"] < MIN_LOSS_SCALE:
        return f"the loss scale fell to {record['loss_scale']:g}: inf/NaN gradients", True
    losses = record["train_loss"], record.get("test_loss", 0.0)
    if not math.isfinite(sum(losses)):  # in fp16, the scaler skipped that step
        return "its mean train or test loss is inf/NaN", False
    return None, False


def epoch_line(record, epochs):
    line = f"epoch {record['epoch']:>{len(str(epochs))}}/{epochs}"
    line += f" | train loss {record['train_loss']:.4f}"
    if "test_loss" in record:
        line += f" | test loss {record['test_loss']:.4f}"
        line += f" | test acc {100 * record['test_accuracy']:5.2f}%"
    return (f"{line} | lr {record['lr']:.4g} | scale {record['loss_scale']:g} | skipped "
            f"{record['skipped_steps']} | {record['samples_per_second']:.0f} samples/s | "
            f"{record['seconds']:.3f} s")


# ---------- the memory example

@contextlib.contextmanager
def count_saved_tensors(model):
    """Bytes saved for backward in the block (on exit): activations, which grow with
    the batch, and autocast's weight copies."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weight_ids = set(map(id, model.parameters()))
    saved = {}  # data_ptr -> (bytes, a copy of a weight?)

    def pack(tensor):
        fn = tensor.grad_fn
        while len(getattr(fn, "next_functions", ())) == 1:  # casts, views (weight.t())
            fn = fn.next_functions[0][0]
        copied = id(getattr(fn, "variable", None)) in weight_ids  # began at a weight
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes(), copied
        return tensor

    counts = {"activation_bytes": 0, "weight_copy_bytes": 0}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield counts
    for nbytes, copied in saved.values():
        counts["weight_copy_bytes" if copied else "activation_bytes"] += nbytes


def measure_training(model, batch, criterion, device, amp_dtype, steps=MEMORY_STEPS, lr=LR):
    """Trains a copy of `model` on one batch: warm-up, a step whose saved tensors are
    counted, `steps` timed ones (and CUDA's peak memory)."""
    model = copy.deepcopy(model)
    optimizer, scaler = make_optimizer(model, lr), make_scaler(device, amp_dtype)

    def step():
        return train_epoch(model, [batch], optimizer, criterion, scaler, device, amp_dtype)
    for _ in range(MEMORY_WARMUP_STEPS):
        step()
    with count_saved_tensors(model) as measured:
        step()
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()  # the reserved peak: this run's alone
        torch.cuda.reset_peak_memory_stats(device)
    seconds = [step()["seconds"] for _ in range(steps)]
    if device.type == "cuda":  # reserved: what the allocator holds, and runs out of
        measured["peak_bytes"] = torch.cuda.max_memory_allocated(device)
        measured["reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    return {**measured, "step_seconds": statistics.median(seconds),
            "step_seconds_min": min(seconds), "step_seconds_max": max(seconds)}


def run_memory(args, device):
    """The post's claims measured: a model and batch in fp32 and AMP. Yields a line as
    each starts, then the report."""
    if args.precision == "fp32":
        raise UsageError("--example memory compares fp32 with fp16 or bf16")
    example = argparse.Namespace(**{**vars(args), "data": "synthetic"})
    example.example = "linear" if args.model == "linear" else "resnet"
    torch.manual_seed(args.seed)
    model, criterion, loader, _ = build_example(
        example, device, imagenet_stem=args.model == "resnet18-imagenet")
    batch = next(iter(loader))
    runs = {}
    for precision in ("fp32", args.precision):
        yield f"measuring {precision}: {MEMORY_WARMUP_STEPS} + {args.steps} steps"
        try:
            runs[precision] = measure_training(model, batch, criterion, device,
                                               PRECISIONS[precision], args.steps, args.lr)
        except ValueError as e:  # BatchNorm of 1x1 maps and a batch of one
            raise UsageError(f"{e}: raise --batch-size") from None
    yield from memory_report(args, device, runs["fp32"], runs[args.precision])


def memory_report(args, device, fp32, amp):
    """The memory example's table, verdict, and a warning if times vary."""
    def cell(key, x):
        if key.endswith("bytes"):
            return f"{x / 2**20:.2f} MiB" if x >= 2**20 else f"{x / 2**10:.2f} KiB"
        return f"{1000 * x:.2f} ms"
    name = args.precision
    yield f"{'':<18}{'fp32':>14}{name:>14}{name + '/fp32':>12}"
    for key in fp32:
        ratio = f"{amp[key] / fp32[key]:.2f}" if fp32[key] else "n/a"
        yield f"{key:<18}{cell(key, fp32[key]):>14}{cell(key, amp[key]):>14}{ratio:>12}"
    step = amp["step_seconds"] / fp32["step_seconds"]
    memory = amp["activation_bytes"] / fp32["activation_bytes"]
    faster = "faster" if step < 1 else "not faster"
    yield (f"verdict: {args.model}, batch {args.batch_size}, {device_label(device)}, "
           f"torch {torch.__version__}: {name} steps take {step:.2f}x fp32's time, "
           f"{memory:.2f}x its activation memory; AMP is {faster} here")
    # One slow step is common on a shared machine; a slow median moves the verdict
    spread = max(run["step_seconds"] / run["step_seconds_min"] for run in (fp32, amp))
    if spread > NOISY_SPREAD:
        yield (f"warning: noisy timings (the median step took {spread:.1f}x the "
               "fastest): rerun when nothing else runs")


# ---------- command line

class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2, through main()
        raise UsageError(f"{message} (see --help)")


def number(kind, low, high):
    """An argparse type: a `kind` in [low, high]."""
    def parse(text):
        value = kind(text)  # or "invalid int value: 'x'"
        if not low <= value <= high:  # NaN too
            raise argparse.ArgumentTypeError(f"{text} is not in [{low!r}, {high!r}]")
        return value
    parse.__name__ = kind.__name__
    return parse


def parse_args(argv):
    largest = torch.finfo(torch.float32).max
    count, limit = number(int, 1, 2**31 - 1), number(int, 0, 2**31 - 1)
    p = ArgumentParser(description="The blog post's programs, fixed.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = p.add_argument
    add("--example", choices=["resnet", "linear", "memory"], default="resnet")
    add("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: cuda if seen")
    add("--precision", choices=["auto", *PRECISIONS], default="auto",
        help="auto: fp16 on CUDA; on a CPU bf16 if it has bf16 instructions, else fp32")
    add("--epochs", type=count, default=EPOCHS, help="linear: steps on its batch")
    add("--batch-size", type=count, default=BATCH_SIZE, help="a process's")
    add("--lr", type=number(float, math.ulp(0.0), largest), default=LR)
    add("--data", choices=["cifar10", "synthetic"], default="cifar10")
    add("--data-root", default="./data", help="CIFAR-10's folder")
    add("--max-steps", type=limit, default=0, help="steps (and test batches) an epoch")
    add("--clip-grad-norm", type=number(float, 0.0, largest), default=0.0,
        help="clip the gradients to this norm")
    add("--accum-steps", type=count, default=1, help="micro-batches a step")
    add("--run-dir", metavar="DIR", help="save DIR/checkpoint.pt, DIR/metrics.jsonl")
    add("--resume", action="store_true", help="go on with the run in --run-dir")
    add("--model", choices=["resnet18", "resnet18-imagenet", "linear"], default="resnet18",
        help="memory's; resnet18-imagenet has the post's stem")
    add("--steps", type=count, default=MEMORY_STEPS, help="memory's timed steps")
    add("--seed", type=number(int, 0, 2**32 - 1), default=0)
    args = p.parse_args(argv)
    if args.run_dir is not None and args.example == "memory":
        raise UsageError("--run-dir is for the resnet and linear examples")
    if args.resume and args.run_dir is None:
        raise UsageError("--resume needs --run-dir DIR")
    return args


def main(argv):
    """The command line; returns the exit status. A signal ends in one line."""
    run = {"dir": None, "lock": None}  # the run folder, once taken
    try:
        return report_errors(argv, run)
    except Stopped as e:  # Ctrl-C or SIGTERM, also while an error is reported
        if rank_and_world()[0] == 0:
            name = signal.Signals(e.args[0]).name
            say(f"error: stopped by {name}; {holds(run['dir'])}", sys.stderr)
        return 128 + e.args[0]
    finally:
        if run["lock"] is not None:
            os.close(run["lock"])
        if dist.is_initialized():  # DDP's cycles hold the group: gloo aborted
            gc.collect()
            dist.destroy_process_group()


def report_errors(argv, run):
    """run_example(), a user's error as one line and an exit status."""
    try:
        return run_example(argv, run)
    except UsageError as e:
        say(f"error: {e}", sys.stderr)
        return e.status
    except RuntimeError as e:
        if isinstance(e, torch.OutOfMemoryError) or "can't allocate memory" in str(e):
            say("error: out of memory: lower --batch-size", sys.stderr)
            return 2
        if not dist.is_initialized():
            raise
        # Mostly a peer that died (gloo's are plain RuntimeErrors): torchrun restarts
        where = f"; {holds(run['dir'])}" if rank_and_world()[0] == 0 else ""
        say(f"error: the process group failed ({str(e).splitlines()[0][:200]}){where}",
            sys.stderr)
        return 3


def run_example(argv, run):
    """Sets up device, processes and run folder; runs the example."""
    args = parse_args(argv)
    device = resolve_device(args.device)
    args.precision = resolve_precision(args.precision, device, args.example)
    job = init_distributed(device)
    run["dir"] = args.run_dir
    state, notes = None, []
    if args.run_dir is not None:
        state = take_run_dir(args, job, run)
    if state is not None:
        args, notes = resume_args(argv, state, device)
    if args.example != "memory":
        status = run_training(args, device, job, state, notes)
        if dist.is_initialized():
            dist.barrier()  # all end their last collective before any leaves
        return status
    say(f"memory | torch {torch.__version__} | device {device_label(device)} | "
        f"model {args.model} | batch {args.batch_size}")
    for line in itertools.chain(cpu_notes(args, device), run_memory(args, device)):
        say(line)
    return 0


def take_run_dir(args, job, run):
    """Rank 0 takes the run folder; all get its checkpoint, or error."""
    state = [None]
    if rank_and_world()[0] == 0:
        try:
            state[0] = open_run_dir(args.run_dir, args.resume, job, run)
        except UsageError as e:
            state[0] = e
    if dist.is_initialized():
        dist.broadcast_object_list(state, src=0)
    if isinstance(state[0], UsageError):
        raise state[0]
    return state[0]


if __name__ == "__main__":
    signal.signal(signal.SIGINT, stop)  # a signal ends main() in one line
    signal.signal(signal.SIGTERM, stop)
    status = main(sys.argv[1:])
    ignore_signals()  # the run is over; torch's teardown takes a while
    sys.exit(status)
