"""AMP training with torch.amp, as its docs describe it: the programs of the blog post "AMP Tensor
Cores: saving memory in PyTorch models", fixed, for a CUDA GPU or the CPU.

    python amp_train.py --example linear   # the post's Linear(10, 1): 100 steps on one batch
    python amp_train.py --example resnet   # ResNet18 on CIFAR-10 (--data synthetic: offline)
    python amp_train.py --example memory   # fp32 and AMP side by side: memory and step time
    torchrun --nproc_per_node=2 amp_train.py --example resnet   # DDP, one GPU per process

train_epoch, first below, is the part to copy.
"""
import argparse, contextlib, copy, datetime, errno, fcntl, gc, io, itertools, json, math, os
import signal, stat, statistics, sys, time

if __name__ == "__main__":  # torch takes seconds to import: a signal meanwhile ends on one line
    def stop_while_starting(signum, frame):
        os.write(2, b"error: stopped while starting; nothing was changed\n")
        os._exit(128 + signum)
    signal.signal(signal.SIGINT, stop_while_starting)
    signal.signal(signal.SIGTERM, stop_while_starting)

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# The post's settings: SGD lr 0.01, batch 128, StepLR(10, 0.1), 100 epochs.
EPOCHS, BATCH_SIZE, LR, LR_STEP_EPOCHS, LR_GAMMA = 100, 128, 0.01, 10, 0.1
PRECISIONS = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": None}
# The flags that define a run: a resumed run keeps the checkpoint's, unless they are given again.
RUN_FLAGS = ("precision", "epochs", "batch_size", "lr", "data", "max_steps", "clip_grad_norm",
             "accum_steps", "seed")
CHECKPOINT_FORMAT = "amp_train checkpoint 3"
CHECKPOINT_FIELDS = {"example": str, "job": (str, type(None)), "epoch": int, "processes": int,
                     "args": dict, "metrics": list, "model": dict, "optimizer": dict,
                     "scaler": dict}
# fp16 stops once the scaler skipped every step of whole epochs, this many at least: 32 halvings
# take the scale from 2**16 to 2**-16, so the gradients are inf/NaN, not merely large.
SKIPPED_IN_A_ROW_TO_STOP = 32
DIST_TIMEOUT = datetime.timedelta(minutes=10)  # NCCL's default: room for a CIFAR-10 download
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
MEMORY_STEPS, MEMORY_WARMUP_STEPS = 20, 3
PROGRESS_SECONDS = 15  # longer epochs print a progress line this often


# -------------------- the part to copy

def train_epoch(model, loader, optimizer, criterion, scaler, device, amp_dtype, *,
                scheduler=None, clip_grad_norm=None, accum_steps=1, max_steps=None,
                log_seconds=None):
    """Trains `model` for one pass over `loader` with AMP; returns what it measured, as a dict.

    Needs `import contextlib, itertools, time, torch`. loader: any iterable of (inputs, targets).
    amp_dtype: torch.bfloat16 on the CPU; torch.float16 on CUDA, with a GradScaler; None: fp32.
    scheduler: stepped after every optimizer step, also one the scaler skipped (as in the
    torch.amp docs). accum_steps=K: a step per K micro-batches, with their mean gradient (a
    shorter last group: its own). max_steps counts optimizer steps. log_seconds: a progress line
    at most this often. Host syncs: one at the end (two with a scaler), one per progress line
    and, with fp16 and a plain (not fused) optimizer, one per step.
    """
    device = torch.device(device)
    if scaler is None:
        scaler = torch.amp.GradScaler(device.type, enabled=False)  # passes every call through
    model.train()
    loss_sum = torch.zeros((), device=device)  # summed on the device: no .item() per step
    skipped = torch.zeros((), device=device)
    steps = samples = 0
    start = last_log = time.perf_counter()
    batches = iter(loader)
    while steps != max_steps and (group := list(itertools.islice(batches, accum_steps))):
        for i, batch in enumerate(group):
            if not isinstance(batch, (tuple, list)) or len(batch) != 2:
                raise TypeError(f"a batch must be an (inputs, targets) pair, not {type(batch)}")
            inputs, targets = (tensor.to(device, non_blocking=True) for tensor in batch)
            # DDP all-reduces the gradients in backward: in the group's last, not under no_sync.
            sync = i == len(group) - 1 or not hasattr(model, "no_sync")
            with contextlib.nullcontext() if sync else model.no_sync():
                with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                    loss = criterion(model(inputs), targets)  # autocast: forward and loss only
                scaler.scale(loss / len(group)).backward()  # scaled: small fp16 gradients live
            loss_sum += loss.detach().float() * len(targets)
            samples += len(targets)
        if clip_grad_norm is not None:
            scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
        scaler.step(optimizer)  # skips the step if a gradient is inf/NaN
        if scaler.is_enabled():  # found_inf, left on the device: torch's public reads of it sync
            found = scaler._found_inf_per_device(optimizer).values()
            skipped += sum(found_inf.to(device) for found_inf in found) > 0
        scaler.update()  # halves the scale after a skip, doubles it after 2000 steps without one
        optimizer.zero_grad(set_to_none=True)  # frees the gradients instead of writing zeros
        if scheduler is not None:
            scheduler.step()
        steps += 1
        if log_seconds is not None and time.perf_counter() - last_log >= log_seconds:
            last_log = time.perf_counter()  # .item() is a host sync: once a line
            print(f"  step {steps} | loss {loss_sum.item() / samples:.4f} | "
                  f"{samples / (last_log - start):.0f} samples/s", flush=True)
    loss_sum, skipped = torch.stack([loss_sum, skipped]).tolist()  # the host sync at the end
    loss_scale = scaler.get_scale() if scaler.is_enabled() else None  # with a scaler, a second
    return {"loss": loss_sum / samples if samples else float("nan"), "steps": steps,
            "skipped_steps": int(skipped), "samples": samples,
            "seconds": time.perf_counter() - start, "loss_scale": loss_scale}


@torch.inference_mode()
def evaluate(model, loader, criterion, device, amp_dtype, max_steps=None):
    """Mean loss per sample, accuracy (argmax == target) and samples of `loader`'s first
    max_steps batches, under autocast. Needs `import itertools, torch`."""
    device = torch.device(device)
    model.eval()
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), device=device)
    samples = 0
    for batch in itertools.islice(loader, max_steps):
        inputs, targets = (tensor.to(device, non_blocking=True) for tensor in batch)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            outputs = model(inputs)
            loss_sum += criterion(outputs, targets).float() * len(targets)
        correct += (outputs.argmax(dim=1) == targets).sum()
        samples += len(targets)
    loss_sum, correct = torch.stack([loss_sum, correct]).tolist()
    return {"loss": loss_sum / max(samples, 1), "accuracy": correct / max(samples, 1),
            "samples": samples}


# -------------------- device, precision, processes

class UsageError(Exception):
    """A mistake the user can fix: main() prints it as one line and exits 2."""


class Stopped(KeyboardInterrupt):
    """SIGINT or SIGTERM, from the handler __main__ installs (a plain KeyboardInterrupt, as
    under pytest, passes main())."""

    @staticmethod
    def handler(signum, frame):
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # one stop: a second signal cannot break
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the cleanup or the last line
        raise Stopped(signum)


def say(line, file=None):
    """Prints a line in one write, flushed; control characters and bad bytes in a file name are
    escaped."""
    line = "".join(c if c.isprintable() else repr(c)[1:-1] for c in line)
    print(line + "\n", end="", file=file, flush=True)


def resolve_device(name):
    """cuda for 'auto' if a GPU is visible; under torchrun GPU LOCAL_RANK, or the one it sees."""
    if name == "cpu" or name == "auto" and not torch.cuda.is_available():
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UsageError("--device cuda was given but no CUDA GPU is visible: use --device cpu")
    count = torch.cuda.device_count()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    own_gpu = "CUDA_VISIBLE_DEVICES" in os.environ and "TORCHELASTIC_RUN_ID" not in os.environ
    if local_rank >= count and (count > 1 or not own_gpu):  # torchrun shows each process all GPUs
        raise UsageError(f"process {local_rank} has no GPU of its own: "
                         f"start at most --nproc_per_node={count}")
    return torch.device("cuda", min(local_rank, count - 1))


def cpu_bf16():
    """The CPU's bf16 instructions: AMX, AVX512-BF16 or none (then bf16 is emulated, and slow)."""
    # torch names these privately only; a test checks them against /proc/cpuinfo.
    if torch.cpu._is_amx_tile_supported():
        return "AMX"
    return "AVX512-BF16" if torch.cpu._is_avx512_bf16_supported() else "none"


def device_label(device):
    return f"{device} (bf16: {cpu_bf16()})" if device.type == "cpu" else str(device)


def resolve_precision(name, device):
    """fp16, bf16 or fp32: 'auto' is fp16 on CUDA (with a GradScaler), bf16 on the CPU."""
    cuda = device.type == "cuda"
    if name == "auto":
        name = "fp16" if cuda else "bf16"
    if name == "bf16" and cuda and not torch.cuda.is_bf16_supported(including_emulation=False):
        raise UsageError("this GPU does not support bfloat16: use --precision fp16 or fp32")
    return name


def warn_if_slow(args, device):
    """Warns, on rank 0, when ResNet18 will train slowly in this precision on this CPU."""
    if device.type != "cpu" or "linear" in (args.example, args.model) or rank_and_world()[0]:
        return
    if args.precision == "fp16":
        say("warning: fp16 convolutions are very slow on CPUs: --precision bf16 (with AMX or "
            "AVX512-BF16) or fp32 is faster", sys.stderr)
    if args.precision == "bf16" and cpu_bf16() == "none":
        say("warning: this CPU has no bf16 instructions (AMX, AVX512-BF16): bf16 is emulated, "
            "slower than fp32 here", sys.stderr)


def make_scaler(device, amp_dtype):
    # Only float16 needs loss scaling: bfloat16 has fp32's range. Disabled, it passes through.
    return torch.amp.GradScaler(device.type, enabled=amp_dtype is torch.float16)


def make_optimizer(model, lr):
    """The post's SGD, fused: its kernel takes the scaler's inf check, so step() need not wait."""
    return torch.optim.SGD(model.parameters(), lr=lr, fused=True)


def init_distributed(device):
    """Under torchrun, joins its process group (NCCL, or gloo on CPUs); returns the job's name."""
    if "WORLD_SIZE" not in os.environ and "RANK" not in os.environ:
        return None
    try:
        store, rank, world_size = next(dist.rendezvous("env://", timeout=DIST_TIMEOUT))
    except ValueError as e:  # MASTER_ADDR, MASTER_PORT or RANK is missing
        raise UsageError(f"{e}: start with torchrun, or unset WORLD_SIZE and RANK") from None
    # torchrun keeps its store over restarts: the first process names the job, restarts find
    # the name. Each round gets keys of its own (the last round's hung gloo).
    job = store.compare_set("amp_train_job", "", os.urandom(16).hex()).decode()
    store = dist.PrefixStore(f"round{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    # A bounded wait: a process whose peer died raises instead of hanging.
    backend, device_id = ("nccl", device) if device.type == "cuda" else ("gloo", None)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=DIST_TIMEOUT, device_id=device_id)
    return job


def rank_and_world():
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


# -------------------- models and data

def resnet18(imagenet_stem=False):
    """torchvision's ResNet18 for 10 classes, with the CIFAR stem (a 3x3 stride-1 conv, no
    max-pool); the post's ImageNet stem shrinks 32x32 images to 8x8 before layer1."""
    import torchvision  # here, not at the top: it takes seconds, and the linear example needs none
    model = torchvision.models.resnet18(num_classes=10)  # the post's had 1000 classes
    if not imagenet_stem:
        model.conv1 = nn.Conv2d(3, 64, 3, padding=1, bias=False)
        model.maxpool = nn.Identity()
    return model


class DeviceLoader:
    """(inputs, targets) batches of tensors held on the device: no worker, no copy per batch.
    Each process takes a shard: with `shuffle`, equal ones of whole batches (BatchNorm breaks on
    one sample); else every sample once. Order and crops depend on (seed, epoch) alone."""

    def __init__(self, inputs, targets, batch_size, device, transform=None, shuffle=False, seed=0,
                 rank=0, world_size=1):
        self.inputs, self.targets = inputs.to(device), targets.to(device)
        self.batch_size, self.transform, self.shuffle = batch_size, transform, shuffle
        self.seed, self.rank, self.world_size, self.epoch = seed, rank, world_size, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        if self.shuffle:
            return len(self.targets) // self.world_size // self.batch_size
        return math.ceil(len(self.targets[self.rank::self.world_size]) / self.batch_size)

    def __iter__(self):
        n, device = len(self.targets), self.targets.device
        seed = (self.seed * 1_000_003 + self.epoch) % 2**32  # a generator keeps 32 bits
        augment = torch.Generator(device).manual_seed((seed + 7919 * (self.rank + 1)) % 2**32)
        order = torch.arange(n)
        if self.shuffle:  # one permutation for all processes, drawn on the CPU: any GPU agrees
            order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
            order = order[:len(self) * self.batch_size * self.world_size]
        order = order[self.rank::self.world_size].to(device)
        for start in range(0, len(order), self.batch_size):
            index = order[start:start + self.batch_size]
            inputs = self.inputs[index]
            if self.transform is not None:
                inputs = self.transform(inputs, augment)
            yield inputs, self.targets[index]


def random_crop_flip(images, generator):
    """torchvision's RandomCrop(32, padding=4) and RandomHorizontalFlip, for a batch at once."""
    n, device = len(images), images.device
    padded = F.pad(images, (4, 4, 4, 4))
    dy, dx = torch.randint(0, 9, (2, n, 1), generator=generator, device=device)
    mirror = torch.rand(n, 1, generator=generator, device=device) < 0.5
    base = torch.arange(32, device=device)
    rows = (dy + base)[:, None, :, None].expand(n, 3, 32, 40)
    cols = (dx + torch.where(mirror, 31 - base, base))[:, None, None, :].expand(n, 3, 32, 32)
    return padded.gather(2, rows).gather(3, cols)


def cifar10_transform(device, augment):
    """uint8 -> normalized float images, cropped and flipped if `augment`, channels_last (the
    layout tensor cores and oneDNN convolve in)."""
    mean = torch.tensor(CIFAR10_MEAN, device=device).view(3, 1, 1) * 255
    std = torch.tensor(CIFAR10_STD, device=device).view(3, 1, 1) * 255

    def transform(images, generator):
        images = random_crop_flip(images, generator) if augment else images
        return ((images.float() - mean) / std).contiguous(memory_format=torch.channels_last)
    return transform


def synthetic_cifar10(size, seed=0, train=True):
    """CIFAR-10-shaped uint8 images and labels to learn offline: a smooth pattern per class."""
    g = torch.Generator().manual_seed(seed)
    patterns = F.interpolate(torch.randn(10, 3, 4, 4, generator=g), size=(32, 32), mode="bilinear")
    g.manual_seed(seed * 2 + (1 if train else 2))
    labels = torch.randint(0, 10, (size,), generator=g)
    images = 0.25 * patterns[labels] + torch.randn(size, 3, 32, 32, generator=g)
    return (images * 48 + 128).clamp(0, 255).to(torch.uint8), labels


def cifar10(root):
    """CIFAR-10's (train, test) uint8 images and labels, downloaded into `root` if missing by one
    process per machine (two corrupt an archive): rank 0 first, as machines may share `root`."""
    import torchvision
    rank, error = rank_and_world()[0], None
    for my_turn in (rank == 0, rank != 0 and os.environ.get("LOCAL_RANK", "0") == "0"):
        if my_turn:
            try:
                torchvision.datasets.CIFAR10(root, download=True)
            except (OSError, RuntimeError) as e:
                error = e
        if dist.is_initialized():
            dist.barrier()  # each turn ends when every process got there
    try:
        sets = [torchvision.datasets.CIFAR10(root, train=train) for train in (True, False)]
    except (OSError, RuntimeError) as e:
        raise UsageError(f"CIFAR-10 is not in {os.path.abspath(root)} and could not be downloaded "
                         f"({error or e}): put cifar-10-python.tar.gz there, "
                         "or run with --data synthetic") from None
    return [(torch.from_numpy(s.data).permute(0, 3, 1, 2).contiguous(), torch.tensor(s.targets))
            for s in sets]


def build_example(args, device, rank=0, world_size=1, imagenet_stem=False):
    """Model, loss, train and test loader (None for linear) of args.example, for one process."""
    if args.example == "linear":  # the post's one fixed batch, seeded, shared out evenly
        if args.batch_size % world_size:  # else DDP's mean of the processes' means is skewed
            raise UsageError(f"--batch-size {args.batch_size} does not share out evenly among "
                             f"{world_size} processes")
        g = torch.Generator().manual_seed(args.seed)
        x = torch.randn(args.batch_size, 10, generator=g)
        y = torch.randn(args.batch_size, 1, generator=g)
        loader = DeviceLoader(x, y, args.batch_size, device, rank=rank, world_size=world_size)
        return nn.Linear(10, 1).to(device), nn.MSELoss(), loader, None
    if args.data == "synthetic":
        train = synthetic_cifar10(10_000, args.seed)
        test = synthetic_cifar10(2_000, args.seed, train=False)
    else:
        train, test = cifar10(args.data_root)
    train_loader = DeviceLoader(*train, args.batch_size, device, cifar10_transform(device, True),
                                shuffle=True, seed=args.seed, rank=rank, world_size=world_size)
    if len(train_loader) == 0:
        raise UsageError(f"--batch-size {args.batch_size} is more than each process's "
                         f"{len(train[1]) // world_size} training images: lower it")
    test_loader = DeviceLoader(*test, args.batch_size, device, cifar10_transform(device, False),
                               rank=rank, world_size=world_size)
    model = resnet18(imagenet_stem).to(device, memory_format=torch.channels_last)
    return model, nn.CrossEntropyLoss(), train_loader, test_loader


# -------------------- the run folder

def open_run_dir(folder, resume, job, example):
    """Takes the run folder, locked (the kernel lets go when the process dies): returns the lock
    and the checkpoint to go on from, or None."""
    if resume and not os.path.isdir(folder):
        raise UsageError(f"there is no run in {folder}: run without --resume to start one")
    try:
        os.makedirs(folder, exist_ok=True)
        lock = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock)
        raise UsageError(f"another run is using {folder}: wait for it to end, "
                         "or pass another --run-dir") from None
    except OSError as e:
        raise UsageError(f"--run-dir {folder}: {os_error(e)}: pass one you can write") from None
    try:
        state = load_checkpoint(folder)
        metrics = os.path.join(folder, "metrics.jsonl")
        if state is not None and state["example"] != example:
            raise UsageError(f"{folder} holds a run of the {state['example']} example: "
                             f"pass --example {state['example']}")
        owned = state is not None and job is not None and state["job"] == job  # torchrun restarted
        if state is not None and not (resume or owned):
            raise UsageError(f"{folder} holds a checkpoint: add --resume to go on with it, "
                             "or pass another --run-dir")
        if state is None and read_file(metrics):
            raise UsageError(f"{folder} holds metrics but no checkpoint: delete {metrics} to "
                             "start again there, or pass another --run-dir")
        if state is None and resume:
            raise UsageError(f"there is no checkpoint in {folder}: run without --resume")
        return lock, state
    except BaseException:
        os.close(lock)
        raise


def read_file(path):
    """The bytes of the regular file at `path`, or None; a link, folder or FIFO is a UsageError
    (and O_NOFOLLOW, O_NONBLOCK: no link is followed, no FIFO can block)."""
    if not os.path.lexists(path):
        return None
    if not stat.S_ISREG(os.lstat(path).st_mode):
        raise UsageError(f"{path} is not a regular file: pass another --run-dir")
    with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK), "rb") as f:
        return f.read()


def replace_file(path, write):
    """Writes a file whole or not at all: write(f) into PATH.tmp, made anew (no link followed),
    flushed to the disk, then renamed over PATH."""
    tmp = f"{path}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        with open(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(fd)  # on the disk before the rename: a power loss leaves the old or the new
        os.replace(tmp, path)
    except BaseException as e:  # a full disk, Ctrl-C: no half-written PATH.tmp stays behind
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)  # in an append-only folder this fails, and its error names the file
        if isinstance(e, RuntimeError) and e.__context__ is not None:
            raise e.__context__ from None  # torch.save wraps what stopped it: a signal, a full disk
        raise


@contextlib.contextmanager
def writing(folder):
    """Turns a failed write in the run folder into one line: its cause, what the folder holds."""
    try:
        yield
    except (OSError, RuntimeError) as e:  # torch.save reports some failures as a RuntimeError
        raise UsageError(f"could not write in {folder} ({os_error(e)}); {holds(folder)}") from None


def os_error(e):
    text = getattr(e, "strerror", None) or str(e)
    if getattr(e, "filename", None):
        text += f": {e.filename}"
    return text + ("; free some space" if getattr(e, "errno", 0) == errno.ENOSPC else "")


def load_checkpoint(folder):
    """The folder's checkpoint, or None; a damaged or foreign one is a UsageError."""
    path = os.path.join(folder, "checkpoint.pt")
    data = read_file(path)
    if data is None:
        return None
    try:
        # weights_only: a checkpoint is untrusted input, and loading it never runs pickled code.
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        fits = state["format"] == CHECKPOINT_FORMAT and all(
            isinstance(state[key], kind) and type(state[key]) is not bool
            for key, kind in CHECKPOINT_FIELDS.items())
        fits = fits and state["example"] in ("resnet", "linear") and all_finite(state)
    except Exception as e:  # truncated, not a torch file, not tensors and plain types, too deep
        raise UsageError(f"{path} is not a readable checkpoint of amp_train.py "
                         f"({type(e).__name__}): start again in another --run-dir") from None
    if not fits:
        raise UsageError(f"{path} is damaged, or of another version of amp_train.py: "
                         "start again in another --run-dir")
    return state


def all_finite(state):
    """False if a number in `state` is negative, inf or NaN, or a tensor holds inf/NaN."""
    if isinstance(state, dict):
        return all(all_finite(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return all(all_finite(value) for value in state)
    if isinstance(state, (int, float)):
        return 0 <= state < math.inf
    return not torch.is_tensor(state) or not state.is_floating_point() or state.isfinite().all()


def resume_args(argv, state, device):
    """The checkpoint's flags, replaced by those given again; a note for each change."""
    try:  # the checkpoint's flags pass the command line's checks, or the file is refused
        saved = [f"--{key.replace('_', '-')}={state['args'][key]}" for key in RUN_FLAGS]
        before = parse_args(saved)
    except (KeyError, UsageError) as e:
        raise UsageError(f"the checkpoint holds flags this program refuses ({e}): "
                         "start again in another --run-dir") from None
    args = parse_args(saved + argv)
    args.precision = resolve_precision(args.precision, device)
    notes = []
    for key in RUN_FLAGS:
        value, old = getattr(args, key), getattr(before, key)
        if value == old or key == "epochs" or key == "data" and args.example == "linear":
            continue
        if key == "data":
            raise UsageError(f"the checkpoint was trained on --data {old}: resume on the same data")
        notes.append(f"note: --{key.replace('_', '-')} {value} replaces the checkpoint's {old}")
    return args, notes


def restore(state, model, optimizer, scaler):
    """Loads a checkpoint's trained state in place, checked against the model: weights, the
    optimizer's per-parameter state, the loss scale. Hyperparameters come from the flags."""
    shapes = dict(enumerate(p.shape for p in model.parameters()))
    try:
        model.load_state_dict(state["model"])  # another key or shape raises
        for index, buffers in state["optimizer"].items():  # SGD's and Adam's are shaped as it
            if any(torch.is_tensor(t) and t.shape != shapes[index] and key != "step"
                   for key, t in buffers.items()):
                raise ValueError(f"optimizer state that does not fit parameter {index}")
        groups = optimizer.state_dict()["param_groups"]  # this run's lr, momentum
        optimizer.load_state_dict({"state": state["optimizer"], "param_groups": groups})
        if scaler.is_enabled() and state["scaler"]:  # only fp16 to fp16 has a loss scale to keep
            scaler.load_state_dict(state["scaler"])
    except (AttributeError, KeyError, RuntimeError, ValueError, TypeError) as e:
        raise UsageError(f"the checkpoint does not fit this run ({' '.join(str(e).split())}): "
                         "start again in another --run-dir") from None


def write_metrics(folder, lines):
    """Writes metrics.jsonl whole, from a checkpoint's lines and those since: never read back."""
    text = "".join(map(str, lines))
    replace_file(os.path.join(folder, "metrics.jsonl"), lambda f: f.write(text.encode()))


def holds(folder):
    """What the run folder holds, read from it: the last words of a run that stops."""
    if folder is None:
        return "nothing is saved without --run-dir"
    try:
        state = load_checkpoint(folder)
    except (OSError, UsageError):
        return f"{folder}'s checkpoint cannot be read"
    return f"{folder} holds epoch {state['epoch']}" if state else f"nothing was saved in {folder}"


# -------------------- the training examples

def epoch_problem(record, skipped_in_a_row, model):
    """Why this epoch must not be saved, and whether the run must stop: (reason, stop), or (None,
    False). A skipped fp16 step is the scaler at work, unless it skips all."""
    tensors = {name: t for name, t in [*model.named_parameters(), *model.named_buffers()]
               if t.is_floating_point()}
    finite = torch.stack([t.isfinite().all() for t in tensors.values()]).tolist()  # one sync
    bad = next((name for name, ok in zip(tensors, finite) if not ok), None)
    if bad:  # NaN weights, or BatchNorm statistics of an inf batch, stay NaN for good
        return f"the model's {bad} holds inf/NaN", True
    if skipped_in_a_row >= SKIPPED_IN_A_ROW_TO_STOP:
        return f"the GradScaler skipped all of the last {skipped_in_a_row} steps (inf/NaN)", True
    for name in ("train", "test"):
        loss = record.get(f"{name}_loss", 0.0)
        if not math.isfinite(loss):  # in fp16 the scaler skipped that step: the run goes on
            stop = name == "train" and record["loss_scale"] is None
            return f"its mean {name} loss is {loss} under {record['precision']}", stop
    return None, False


def epoch_record(args, epoch, lr, stats, model, test_loader, criterion, device, world_size):
    """An epoch's metrics, summed over all processes."""
    tested = {"loss": 0.0, "accuracy": 0.0, "samples": 0}
    if test_loader is not None:
        tested = evaluate(model, test_loader, criterion, device, PRECISIONS[args.precision],
                          args.max_steps or None)
    sums = torch.tensor([stats["loss"] * stats["samples"], stats["samples"],
                         tested["loss"] * tested["samples"], tested["accuracy"] * tested["samples"],
                         tested["samples"]], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(sums)
    loss_sum, samples, test_loss_sum, correct, test_samples = sums.tolist()
    record = {"example": args.example, "precision": args.precision, "epoch": epoch + 1,
              "train_loss": loss_sum / max(samples, 1)}
    if test_loader is not None:
        record.update(test_loss=test_loss_sum / test_samples, test_accuracy=correct / test_samples)
    return {**record, "lr": lr, "loss_scale": stats["loss_scale"],
            "skipped_steps": stats["skipped_steps"], "seconds": stats["seconds"],
            "samples_per_second": samples / max(stats["seconds"], 1e-9), "processes": world_size}


def epoch_line(record, epochs):
    line = f"epoch {record['epoch']:>{len(str(epochs))}}/{epochs}"
    line += f" | train loss {record['train_loss']:.4f}"
    if "test_loss" in record:
        line += f" | test loss {record['test_loss']:.4f}"
        line += f" | test acc {100 * record['test_accuracy']:5.2f}%"
    scale = "off" if record["loss_scale"] is None else f"{record['loss_scale']:g}"
    return (f"{line} | lr {record['lr']:.4g} | scale {scale} | skipped {record['skipped_steps']} | "
            f"{record['samples_per_second']:.0f} samples/s | {record['seconds']:.3f} s")


def run_training(args, device, state=None, notes=(), job=None):
    """The resnet and linear examples: train, evaluate, print and (with --run-dir) save each
    epoch; returns 0, or 1 if training stopped on inf/NaN. Rank 0 alone prints and writes."""
    rank, world_size = rank_and_world()
    log = say if rank == 0 else lambda line, file=None: None
    amp_dtype, linear = PRECISIONS[args.precision], args.example == "linear"
    torch.manual_seed(args.seed)
    model, criterion, train_loader, test_loader = build_example(args, device, rank, world_size)
    optimizer = make_optimizer(model, args.lr)
    scaler = make_scaler(device, amp_dtype)
    # The linear example's one fixed batch is shared out; resnet's batch is per process.
    local_batch = args.batch_size // world_size if linear else args.batch_size
    global_batch = args.batch_size if linear else args.batch_size * args.accum_steps * world_size
    start_epoch, notes, metrics = 0, list(notes), []  # metrics: the metrics file's lines
    if state is not None:
        restore(state, model, optimizer, scaler)
        start_epoch, metrics = state["epoch"], state["metrics"]
        if state["processes"] != world_size:
            notes.append(f"note: {world_size} processes replace the checkpoint's "
                         f"{state['processes']}: global batch {global_batch}")
        notes.append(f"resumed from {args.run_dir} after epoch {start_epoch}")
    warn_if_slow(args, device)
    # DDP averages the gradients in backward, so every process's scaler sees the same ones.
    ddp_model = nn.parallel.DistributedDataParallel(model) if world_size > 1 else model
    steps_per_epoch = math.ceil(len(train_loader) / args.accum_steps)
    if args.max_steps:
        steps_per_epoch = min(steps_per_epoch, args.max_steps)
    accumulated = f" x {args.accum_steps} accumulated" if args.accum_steps > 1 else ""
    data = "one batch" if linear else args.data
    log(f"amp_train | example {args.example} | torch {torch.__version__} | device "
        f"{device_label(device)} | precision {args.precision} | scaler "
        f"{'on' if scaler.is_enabled() else 'off'} | data {data} | batch {local_batch}{accumulated}"
        f" | processes {world_size} | global batch {global_batch} | epochs {args.epochs} | "
        f"steps/epoch {steps_per_epoch}")
    for note in notes:
        log(note)
    if start_epoch >= args.epochs:
        log(f"nothing to do: the checkpoint has {start_epoch} epochs; raise --epochs to train on")
        return 0

    def save(epoch):  # all a resumed run needs to go on as if it never stopped
        state = {"format": CHECKPOINT_FORMAT, "example": args.example, "epoch": epoch, "job": job,
                 "processes": world_size, "args": {key: getattr(args, key) for key in RUN_FLAGS},
                 "metrics": metrics, "model": model.state_dict(),
                 "optimizer": optimizer.state_dict()["state"], "scaler": scaler.state_dict()}
        replace_file(os.path.join(args.run_dir, "checkpoint.pt"), lambda f: torch.save(state, f))
    if args.run_dir is not None and rank == 0:  # each write is tried before the first epoch
        with writing(args.run_dir):
            write_metrics(args.run_dir, metrics)
            save(start_epoch)
    skipped_in_a_row = 0
    for epoch in range(start_epoch, args.epochs):
        train_loader.set_epoch(epoch)  # the order and the crops depend on (seed, epoch) alone
        decays = 0 if linear else epoch // LR_STEP_EPOCHS  # the post's StepLR(10, 0.1), resnet's
        for group in optimizer.param_groups:
            group["lr"] = args.lr * LR_GAMMA ** decays
        stats = train_epoch(ddp_model, train_loader, optimizer, criterion, scaler, device,
                            amp_dtype, clip_grad_norm=args.clip_grad_norm or None,
                            accum_steps=args.accum_steps, max_steps=args.max_steps or None,
                            log_seconds=PROGRESS_SECONDS if rank == 0 else None)
        for buffer in model.buffers() if world_size > 1 else ():
            dist.broadcast(buffer, src=0)  # BatchNorm's statistics: all evaluate rank 0's model
        record = epoch_record(args, epoch, optimizer.param_groups[0]["lr"], stats, model,
                              test_loader, criterion, device, world_size)
        log(epoch_line(record, args.epochs))
        finite = {key: None if isinstance(x, float) and not math.isfinite(x) else x  # JSON's null
                  for key, x in record.items()}
        metrics.append(json.dumps(finite) + "\n")
        all_skipped = stats["skipped_steps"] == stats["steps"]
        skipped_in_a_row = skipped_in_a_row + stats["steps"] if all_skipped else 0
        problem, stop = epoch_problem(record, skipped_in_a_row, model)
        if args.run_dir is not None and rank == 0:
            with writing(args.run_dir):
                write_metrics(args.run_dir, metrics)
                if problem is None:
                    save(epoch + 1)
        if stop:
            log(f"error: epoch {epoch + 1}: {problem}; {holds(args.run_dir)}; "
                "try a lower --lr or --clip-grad-norm", sys.stderr)
            return 1
        if problem:
            log(f"note: epoch {epoch + 1} is not saved, {problem}; {holds(args.run_dir)}")
    return 0


# -------------------- the memory example

@contextlib.contextmanager
def count_saved_tensors(model):
    """Bytes that autograd saves for backward inside the block, filled in on exit: activations
    (they grow with the batch; autocast halves them) and autocast's copies of the weights."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}  # data_ptr -> (bytes, a copy of a weight?)

    def pack(tensor):
        fn = tensor.grad_fn
        while fn is not None and len(fn.next_functions) == 1:  # casts and views (weight.t())
            fn = fn.next_functions[0][0]
        origin = getattr(fn, "variable", None)  # the leaf they began from
        copy = origin is not None and origin.untyped_storage().data_ptr() in weights
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes(), copy
        return tensor

    counts = {}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield counts
    counts["activation_bytes"] = sum(n for n, copy in saved.values() if not copy)
    counts["weight_copy_bytes"] = sum(n for n, copy in saved.values() if copy)


def measure_training(model, batch, criterion, device, amp_dtype, steps=MEMORY_STEPS,
                     warmup=MEMORY_WARMUP_STEPS, lr=LR):
    """Trains a copy of `model` on one batch: `warmup` steps, one whose saved tensors are
    counted, then `steps` timed ones and their CUDA peak memory."""
    model = copy.deepcopy(model)
    optimizer, scaler = make_optimizer(model, lr), make_scaler(device, amp_dtype)

    def step():
        return train_epoch(model, [batch], optimizer, criterion, scaler, device, amp_dtype)
    for _ in range(warmup):
        step()
    with count_saved_tensors(model) as saved:
        step()
    cuda = device.type == "cuda"
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()  # so that the reserved peak is this run's alone
        torch.cuda.reset_peak_memory_stats(device)
    timed = [step() for _ in range(steps)]
    seconds = [stats["seconds"] for stats in timed]
    peaks = (None, None)
    if cuda:  # reserved memory is what the caching allocator holds, and what runs out
        peaks = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    return {**saved, "peak_bytes": peaks[0], "reserved_bytes": peaks[1],
            "step_seconds": statistics.median(seconds), "step_seconds_min": min(seconds),
            "step_seconds_max": max(seconds), "final_loss": timed[-1]["loss"]}


def run_memory(args, device):
    """The post's claims, measured: one model and batch in fp32 and in AMP, side by side."""
    if dist.is_initialized():
        raise UsageError("--example memory measures one process: run it with python, not torchrun")
    if args.precision == "fp32":
        raise UsageError("--example memory compares fp32 with AMP: use --precision fp16 or bf16")
    example = argparse.Namespace(**{**vars(args), "data": "synthetic",
                                    "example": "linear" if args.model == "linear" else "resnet"})
    torch.manual_seed(args.seed)
    model, criterion, loader, _ = build_example(example, device,
                                                imagenet_stem=args.model == "resnet18-imagenet")
    batch = next(iter(loader))
    warn_if_slow(args, device)
    runs = {name: measure_training(model, batch, criterion, device, PRECISIONS[precision],
                                   args.steps, lr=args.lr)
            for name, precision in (("fp32", "fp32"), ("amp", args.precision))}
    runs["ratio"] = {key: runs["amp"][key] / fp32 if runs["amp"][key] is not None and fp32 else None
                     for key, fp32 in runs["fp32"].items()}
    return {"device": device_label(device), "model": args.model, "batch_size": args.batch_size,
            "precision": args.precision, "steps": args.steps, "torch": torch.__version__, **runs}


def memory_table(r):
    def cell(key, x):
        if x is None:
            return "n/a"
        if key.endswith("bytes"):
            return f"{x / 2**20:.2f} MiB" if x >= 2**20 else f"{x / 2**10:.2f} KiB"
        return f"{1000 * x:.2f} ms" if "seconds" in key else f"{x:.4f}"
    name = r["precision"]
    lines = [f"memory | torch {r['torch']} | device {r['device']} | model {r['model']} | batch "
             f"{r['batch_size']} | {MEMORY_WARMUP_STEPS} warm-up + {r['steps']} timed steps",
             f"{'':<18}{'fp32':>14}{name:>14}{name + '/fp32':>12}"]
    for key, ratio in r["ratio"].items():
        shown_ratio = "n/a" if ratio is None else f"{ratio:.2f}"
        lines.append(f"{key:<18}{cell(key, r['fp32'][key]):>14}{cell(key, r['amp'][key]):>14}"
                     f"{shown_ratio:>12}")
    return "\n".join(lines)


# -------------------- command line

class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2 through main(), not usage text and sys.exit
        raise UsageError(f"{message} (see --help)")


def number(kind, low, high):
    """An argparse type: a `kind` from `low` to `high`, both included."""
    def parse(text):
        value = kind(text)  # a ValueError reads "invalid int value: 'x'"
        if not low <= value <= high:  # NaN fails too
            raise argparse.ArgumentTypeError(f"{text} is not in [{low!r}, {high!r}]")
        return value
    parse.__name__ = kind.__name__
    return parse


def parse_args(argv):
    largest = torch.finfo(torch.float32).max
    count, limit = number(int, 1, 2**31 - 1), number(int, 0, 2**31 - 1)
    p = ArgumentParser(description="AMP training: the blog post's programs, fixed.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = p.add_argument
    add("--example", choices=["resnet", "linear", "memory"], default="resnet", help="the program")
    add("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: cuda if visible")
    add("--precision", choices=["auto", *PRECISIONS], default="auto",
        help="auto: fp16 (with a GradScaler) on CUDA, bf16 on the CPU; fp32: no AMP")
    add("--epochs", type=count, default=EPOCHS, help="linear: iterations over its one batch")
    add("--batch-size", type=count, default=BATCH_SIZE,
        help="per step and process; for linear, its one batch, shared out")
    add("--lr", type=number(float, math.ulp(0.0), largest), default=LR, help="SGD's learning rate")
    add("--data", choices=["cifar10", "synthetic"], default="cifar10", help="synthetic: offline")
    add("--data-root", default="./data", help="the folder of CIFAR-10")
    add("--max-steps", type=limit, default=0,
        help="end each epoch after this many optimizer steps (and test batches); 0: no limit")
    add("--clip-grad-norm", type=number(float, 0.0, largest), default=0.0,
        help="clip the gradients to this norm, after unscaling; 0: no clipping")
    add("--accum-steps", type=count, default=1, help="micro-batches per optimizer step")
    add("--run-dir", metavar="DIR", help="save DIR/checkpoint.pt and DIR/metrics.jsonl")
    add("--resume", action="store_true", help="go on with the run in --run-dir, up to --epochs")
    add("--model", choices=["resnet18", "resnet18-imagenet", "linear"], default="resnet18",
        help="memory's model; resnet18-imagenet has the post's stem")
    add("--steps", type=count, default=MEMORY_STEPS, help="memory: timed steps, after 3 warm-up")
    add("--seed", type=number(int, 0, 2**32 - 1), default=0, help="of weights, data and crops")
    return p.parse_args(argv)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    run_dir = lock = None
    try:
        args = parse_args(argv)
        if args.run_dir == "" or args.run_dir is not None and args.example == "memory":
            raise UsageError("--run-dir takes a folder, for the resnet and linear examples")
        if args.resume and args.run_dir is None:
            raise UsageError("--resume needs --run-dir DIR")
        device = resolve_device(args.device)
        if device.type == "cuda":  # this process's GPU, for what asks the current one (NCCL, bf16)
            torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = device.type == "cuda"  # fixed shapes: time kernels once
        args.precision = resolve_precision(args.precision, device)
        job = init_distributed(device)
        rank = rank_and_world()[0]
        run_dir, state = args.run_dir, [None]  # rank 0 takes the folder, hands out its checkpoint
        if run_dir is not None and rank == 0:
            try:
                lock, state[0] = open_run_dir(run_dir, args.resume, job, args.example)
            except UsageError as e:
                state[0] = e
        if run_dir is not None and dist.is_initialized():
            dist.broadcast_object_list(state, src=0)
        if isinstance(state[0], UsageError):
            raise state[0]
        notes = []
        if state[0] is not None:
            args, notes = resume_args(argv, state[0], device)
        if args.example == "memory":
            print(memory_table(run_memory(args, device)), flush=True)
            return 0
        status = run_training(args, device, state[0], notes, job)
        if dist.is_initialized():
            dist.barrier()  # every process finishes its last collective before any leaves
        return status
    except UsageError as e:
        say(f"error: {e}", sys.stderr)
        return 2
    except Stopped as e:  # Ctrl-C or SIGTERM: one line, and what the run folder holds
        if rank_and_world()[0] == 0:
            word = "interrupted" if e.args[0] == signal.SIGINT else "terminated"
            say(f"error: {word}; {holds(run_dir)}", sys.stderr)
        return 128 + e.args[0]
    except RuntimeError as e:
        if isinstance(e, torch.OutOfMemoryError) or "can't allocate memory" in str(e):
            say(f"error: out of memory at --batch-size {args.batch_size}: lower it "
                "(--accum-steps K keeps the batch of an optimizer step)", sys.stderr)
            return 2
        if not dist.is_initialized() or not (isinstance(e, dist.DistError) or "gloo" in str(e)):
            raise
        # Mostly a peer that died or hung (gloo raises plain RuntimeErrors): torchrun restarts
        where = f"; {holds(run_dir)}" if rank_and_world()[0] == 0 else ""
        say(f"error: the process group failed ({str(e).splitlines()[0][:200]}){where}", sys.stderr)
        return 3
    except OSError as e:  # stdout closed by its reader (| head) or full (> /dev/full)
        with contextlib.suppress(Exception):  # what stdout still holds goes nowhere at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        say(f"error: {os_error(e)}; {holds(run_dir)}", sys.stderr)
        return 2
    finally:
        if lock is not None:
            os.close(lock)
        if dist.is_initialized():  # DDP holds the group in reference cycles: gloo aborted at exit
            gc.collect()
            dist.destroy_process_group()


if __name__ == "__main__":
    signal.signal(signal.SIGINT, Stopped.handler)  # from here on a signal ends main() on one line
    signal.signal(signal.SIGTERM, Stopped.handler)
    sys.exit(main())
