"""Automatic Mixed Precision (AMP) training with torch.amp, as its docs describe it.

These are the three programs of the blog post "AMP Tensor Cores: saving memory in PyTorch
models", fixed. They run on a CUDA GPU, an Apple silicon Mac, an Intel GPU or a CPU. fp32 is
the baseline, and AMP trains in bf16, or in fp16 with a GradScaler.

    python amp_train.py --example linear    # the post's Linear(10, 1) on one fixed batch
    python amp_train.py --example resnet    # ResNet18 on CIFAR-10 (--data synthetic offline)
    python amp_train.py --example memory    # fp32 and AMP side by side: memory, speed, verdict
    python amp_train.py --example memory --model mobilenet_v3_small   # torchvision's models
    torchrun --nproc_per_node=2 amp_train.py --example resnet         # several GPUs, DDP

Part I is the AMP lesson. train_epoch, first below, is the part to copy. measure_amp measures
what AMP buys on a model of your own, and what fp16 risks there. Part II keeps long runs safe,
with the run folder and torchrun's processes. The command line comes last, with the errors a
user can make. A reader who came for AMP can stop where Part II begins.
"""
import argparse, contextlib, copy, functools, gc, io, itertools, json, math, os, operator
import platform, statistics, sys, tempfile, time
from collections.abc import Mapping

import filelock
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode
# A dispatch mode sees each op below autocast and autograd, with its dtypes. torch has no
# public name for it, nor for pytree, which walks an op's nested arguments, nor for the setting
# that runs a compiled backward pass outside autocast.
from torch._functorch import config as functorch_config
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.module_tracker import ModuleTracker

# The post's settings are SGD with lr 0.01, batch 128, StepLR(10, 0.1) and 100 epochs. Its
# linear program keeps its lr fixed, and so does the linear example.
EPOCHS = 100
BATCH_SIZE = 128
LR = 0.01
LR_STEP_EPOCHS = 10
LR_GAMMA = {"resnet": 0.1, "linear": 1.0}
PRECISIONS = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": None}
# The name of each AMP dtype, as the command line and the reports give it.
AMP_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
# The 16-bit precisions that CUDA's tensor cores compute, best first, by the major number of
# the compute capability. Volta (7.0) computes fp16, and Ampere (8.0) bf16 too.
CUDA_16BIT = {7: ["fp16"], 8: ["bf16", "fp16"]}
# The CPU instructions that compute in 16 bits, as torch.cpu.get_capabilities() names them on
# x86 and ARM, with their precision. A CPU without them emulates it, slower than fp32.
CPU_16BIT = {"amx_bf16": "bf16", "avx512_bf16": "bf16", "sve_bf16": "bf16", "bf16": "bf16",
             "amx_fp16": "fp16", "avx512_fp16": "fp16", "fp16_arith": "fp16"}
# How CUDA computes fp32 matmuls and convolutions: by torch's allow_tf32 flag before torch 2.9,
# and by its fp32_precision after. "none" all the way up means IEEE fp32.
FP32_MATH = {False: "ieee", True: "tf32", "none": "ieee", "ieee": "ieee", "tf32": "tf32"}
# measure_amp times steps in TIMED_ROUNDS rounds of one host sync each.
TIMED_ROUNDS = 3
# CIFAR-10's mean and standard deviation, by channel.
CIFAR10_MEAN_STD = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
# torchvision's googlenet and inception_v3 also return auxiliary logits in training. A plain
# loss cannot take those. They also warn that their default initialization will change.
TORCHVISION_OPTIONS = dict.fromkeys(("googlenet", "inception_v3"),
                                    {"aux_logits": False, "init_weights": True})
# The units of amp_report's values: the first unit's size, the factor from one unit to the
# next, the units, and the decimals.
UNITS = {"bytes": (1, 1024, ["B", "KiB", "MiB", "GiB", "TiB"], 2), "per second": (1, 1, ["/s"], 0),
         "seconds": (1e-9, 1000, ["ns", "µs", "ms", "s"], 3), "share": (0.01, 1, ["%"], 2),
         "flop": (1, 1000, ["FLOP", "kFLOP", "MFLOP", "GFLOP", "TFLOP", "PFLOP"], 1),
         "flops": (1, 1000, ["FLOP/s", "kFLOP/s", "MFLOP/s", "GFLOP/s", "TFLOP/s", "PFLOP/s"], 1)}
# amp_report's rows, in order, each with the unit that its values print in.
ROWS = {"saved_bytes": "bytes", "peak_bytes": "bytes", "compile_seconds": "seconds",
        "median_step_seconds": "seconds", "samples_per_second": "per second", "step_flop": "flop",
        "conv_flop": "flop", "achieved_flops": "flops", "matmul_rate_flops": "flops",
        "conv_rate_flops": "flops", "rated_seconds": "seconds", "rate_share": "share"}
# The share of the device's measured rates above which arithmetic bounds a step, and the one
# below which something else does: kernel launches, or memory.
ARITHMETIC_SHARE, OTHER_SHARE = 0.6, 0.3
# A progress line comes at most this often, in seconds.
PROGRESS_SECONDS = 30

# These serve Part II. A training run keeps RUN_FLAGS in its checkpoint, and a resumed run goes
# on with them.
RUN_FLAGS = ("example", "precision", "batch_size", "seed", "epochs", "lr", "clip_grad_norm",
             "accum_steps", "data", "max_steps")

# ====================================================================================
# Part I: the AMP lesson
# ====================================================================================

# ---------- the part to copy: train_epoch, its companion to_device, and evaluate

def to_device(batch, device):
    """A batch's (inputs, targets), moved to `device`. inputs are a tensor, or a mapping of
    tensors that the model takes as keyword arguments, such as Hugging Face's BatchEncoding.
    A mapping comes back as a dict. targets are a tensor with a row a sample. With device
    None nothing moves, and the batch is only checked. Any other batch is refused, such as
    one mapping of everything, or a list of strings among the inputs. So is a batch of 0
    samples, whose mean loss is NaN."""
    # One mapping of everything, as a collator makes, would unpack into two of its keys.
    if isinstance(batch, (Mapping, torch.Tensor)) or len(batch) != 2:
        raise TypeError(f"a batch is an (inputs, targets) pair, not a {type(batch).__name__}: "
                        "see README, 'Models that compute their own loss'")
    inputs, targets = batch
    named = dict(inputs) if isinstance(inputs, Mapping) else {"inputs": inputs}
    for name, x in [*named.items(), ("targets", targets)]:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"the batch's {name} is a {type(x).__name__}, not a tensor: see "
                            "README, 'Models that compute their own loss'")
    # A copy overlaps the device's work only from pinned memory. From pageable memory, MPS may
    # read the batch after it is freed (pytorch issue 189690), so such copies wait.
    named = {name: x.to(device, non_blocking=x.is_pinned()) for name, x in named.items()}
    targets = targets.to(device, non_blocking=targets.is_pinned())
    if len(targets) == 0:
        raise ValueError("a batch of 0 samples has no mean loss: let the loader skip it")
    if isinstance(inputs, Mapping):
        return named, targets
    return named["inputs"], targets


def train_epoch(model, loader, optimizer, criterion, scaler, device, amp_dtype, *,
                scheduler=None, clip_grad_norm=None, accum_steps=1):
    """One epoch of AMP training. It is the torch.amp docs' loop, with gradient accumulation.

    loader yields pairs of the inputs and the targets, as to_device takes them.
    criterion(model(inputs), targets) is the batch's mean loss, or criterion(model(**inputs),
    targets) where inputs are a dict. amp_dtype is torch.bfloat16, torch.float16, or None for
    fp32. scaler is a torch.amp.GradScaler enabled for float16. bf16 and fp32 need none, and
    may pass None.

    Three choices are ours, not the docs'. First, the gradients are zeroed before each step's
    first micro-batch, not after its step. So no gradient left from before reaches a step.
    Second, accum_steps=K takes one step for every K micro-batches. Each micro-batch's loss is
    weighted by the targets it averages over. Integer targets of -100 are padding, which
    CrossEntropyLoss and Hugging Face's losses skip, so they do not count. Float targets all
    count, as MSELoss averages over every one. So the step is the one that their whole batch
    would take, but for BatchNorm's statistics. A short group at the end of the loader takes a
    step of its own. A model that shifts its labels inside, as Hugging Face's causal language
    models do, needs the shifted ones as its targets.
    Third, a scheduler steps after every step, even one that the scaler skipped. Knowing which
    were skipped would cost a host sync a step.

    So give it a schedule by steps, such as a warm-up or OneCycleLR. Step a schedule by epochs
    yourself, once an epoch, as the examples do with the post's StepLR(10, 0.1). With a plain
    optimizer, not a fused one, torch warns "Detected call of `lr_scheduler.step()` before
    `optimizer.step()`" when fp16's first step is skipped. clip_grad_norm, unless it is None or
    0, clips the gradients' norm before each step.

    Returns {"loss", "samples"}: the mean loss per target, and how many samples it trained on.
    """
    device = torch.device(device)
    # autocast takes a torch dtype, not the command line's name for it.
    if amp_dtype not in (None, torch.bfloat16, torch.float16):
        raise ValueError(f"amp_dtype is torch.bfloat16, torch.float16 or None, not {amp_dtype!r}")
    # bf16 and fp32 need no loss scaling. A disabled GradScaler passes everything through.
    if scaler is None:
        scaler = torch.amp.GradScaler(device.type, enabled=False)
    # fp16 has 5 exponent bits. Without loss scaling, small gradients flush to zero.
    if amp_dtype == torch.float16 and not scaler.is_enabled():
        raise ValueError("float16 needs an enabled torch.amp.GradScaler(device.type)")
    if accum_steps < 1:
        raise ValueError(f"accum_steps must be 1 or more, not {accum_steps}")
    # DDP all-reduces the gradients in every backward pass. Its no_sync() holds that back, and
    # a model without DDP has nothing to hold back.
    no_sync = getattr(model, "no_sync", contextlib.nullcontext)
    model.train()
    # The loss is summed on the device. loss.item() would make the CPU wait for the GPU.
    loss_sum = torch.zeros((), device=device)
    counted, samples = 0, 0
    batches = iter(loader)
    for first in batches:
        # A step's micro-batches stay where the loader made them until their forward pass. So
        # a loader's host batches take the device's memory one at a time.
        group = [first, *itertools.islice(batches, accum_steps - 1)]
        # A gradient left from before never counts, such as one from a micro-batch that raised.
        optimizer.zero_grad(set_to_none=True)
        # to_device(batch, None) checks a batch and moves nothing. The targets that a loss
        # averages over weight it: all float targets, and the integer ones that are not -100.
        # The count is a tensor where the batch is, so it needs no host sync.
        group_targets = [to_device(batch, None)[1] for batch in group]
        counts = [(y.ne(-100) | y.is_floating_point()).sum() for y in group_targets]
        counted += sum(counts)
        # DDP all-reduces once a step, in the backward pass of its last micro-batch.
        syncs = [no_sync] * (len(group) - 1) + [contextlib.nullcontext]
        for batch, sync, count in zip(group, syncs, counts):
            inputs, targets = to_device(batch, device)
            samples += len(targets)
            with sync():
                # Autocast covers the forward pass and the loss, and no more. Backward runs
                # each op in the dtype that autocast chose for it in the forward pass.
                with torch.autocast(device.type, dtype=amp_dtype, enabled=bool(amp_dtype)):
                    outputs = model(**inputs) if isinstance(inputs, dict) else model(inputs)
                    loss = criterion(outputs, targets)
                # In fp16, scaling the loss scales every gradient with it. That lifts small
                # gradients above fp16's smallest number. The weight makes the step a mean.
                scaler.scale(loss * (count / sum(counts))).backward()
            loss_sum += loss.detach().float() * count
        # Clipping must see the true gradients. unscale_ divides them by the scale first, and
        # step() then knows not to do it again.
        if clip_grad_norm:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
        # step() skips the update when a gradient is inf or NaN. Either the scale was too
        # large, or the forward pass overflowed fp16, which no scale mends. The weights stay
        # as they were, but BatchNorm's running statistics have taken that forward pass.
        scaler.step(optimizer)
        # update() halves the scale after a skipped step, and doubles it after 2000 good
        # ones. So it stays near the largest scale that does not overflow.
        scaler.update()
        if scheduler is not None:
            scheduler.step()
    # With a fused optimizer, the epoch's one host sync. An empty loader gives a mean of NaN.
    return {"loss": (loss_sum / counted).item(), "samples": samples}


@torch.inference_mode()
def evaluate(model, loader, criterion, device, amp_dtype):
    """The mean loss and accuracy over `loader`, under autocast as in training. It takes the
    batches, models and criterions that train_epoch takes, and weights each batch's loss as it
    does. The accuracy counts the targets that the outputs' argmax over their last dimension
    hits, such as a classifier's logits or a language model's. It is NaN for a model whose
    outputs are no tensor, such as one that computes its own loss. Returns {"loss",
    "accuracy", "samples"}. An empty loader gives NaN for loss and accuracy.
    """
    device = torch.device(device)
    model.eval()
    # The loss, the targets hit and the targets counted are summed on the device, and read
    # once at the end.
    sums, samples = torch.zeros(3, device=device), 0
    for batch in loader:
        inputs, targets = to_device(batch, device)
        # As in train_epoch. A padding target of -100 is never hit.
        count = (targets.ne(-100) | targets.is_floating_point()).sum()
        with torch.autocast(device.type, dtype=amp_dtype, enabled=bool(amp_dtype)):
            outputs = model(**inputs) if isinstance(inputs, dict) else model(inputs)
            sums[0] += criterion(outputs, targets).float() * count
        # A model that computes its own loss returns no logits to hit.
        hits = torch.tensor(math.nan, device=device)
        if isinstance(outputs, torch.Tensor):
            hits = (outputs.argmax(dim=-1) == targets).sum()
        sums[1:] += torch.stack([hits, count])
        samples += len(targets)
    loss, accuracy, _ = (sums / sums[2]).tolist()
    return {"loss": loss, "accuracy": accuracy, "samples": samples}


# ---------- precision and device

def resolve_device(name):
    """The device that --device names. "auto" is torch's accelerator where it finds one, such
    as CUDA, MPS or XPU, and the CPU elsewhere. Under torchrun, process k takes device k, by
    LOCAL_RANK. It makes that device the current one, as NCCL asks."""
    accelerator = "cpu"
    if torch.accelerator.is_available():
        accelerator = torch.accelerator.current_accelerator().type
    if name == "auto":
        name = accelerator
    if name == "cpu":
        return torch.device("cpu")
    if name != accelerator:
        raise UsageError(f"torch finds no {name} device here: use --device auto or cpu")
    torch.accelerator.set_device_index(int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device(name, torch.accelerator.current_device_index())


def cpu_16bit():
    """The CPU's 16-bit instructions that torch finds, by their names in CPU_16BIT, each with
    the precision it computes in."""
    # torch 2.6 has no get_capabilities. There a CPU shows none, and auto trains in fp32 on it.
    capabilities = getattr(torch.cpu, "get_capabilities", dict)()
    return {name: CPU_16BIT[name] for name in filter(capabilities.get, CPU_16BIT)}


def native_16bit(device):
    """The 16-bit precisions that `device` computes natively, best first, as README's table
    lists them. Any other is emulated there, and slower than fp32."""
    if device.type == "cuda":
        # Tensor cores compute fp16 from compute capability 7.0 (Volta), and bf16 from 8.0.
        return CUDA_16BIT.get(min(torch.cuda.get_device_capability(device)[0], 8), [])
    # MPS emulates neither, so its list is what trains at all: bf16 from macOS 14 on, where
    # autocast takes it. fp16 needs the GradScaler. Its kernels came to MPS in torch 2.8, and
    # MPS's fused optimizers ignored its scale and inf check until 2026 (pytorch PR 186360).
    if device.type == "mps" and torch.backends.mps.is_macos_or_newer(14, 0):
        return ["bf16"]
    if device.type == "mps":
        return []
    if device.type == "xpu":
        return ["bf16", "fp16"]
    return list(dict.fromkeys(cpu_16bit().values()))


def auto_precision(device):
    """The precision that --precision auto trains in on `device`, by README's table. bf16 needs
    no GradScaler, so it comes first. fp16 comes next, on CUDA alone. XPU's unscale_() computes
    in fp64, which Intel's Arc GPUs lack, and MPS trains no fp16 (native_16bit). A CPU takes
    bf16 where AMX computes it, which README's Measured found faster. Without AMX, bf16 was
    faster than fp32 on some CPUs and slower on others. So such a CPU stays in fp32, and
    --example memory measures it."""
    native = native_16bit(device)
    if device.type == "cuda" and native:
        return native[0]
    if "bf16" in native and (device.type != "cpu" or "amx_bf16" in cpu_16bit()):
        return "bf16"
    return "fp32"


def device_label(device):
    """The device as headers and verdicts name it. A CPU comes with its 16-bit instructions.
    A CUDA GPU comes with its name and the precision of fp32's matmuls and convolutions. That
    is "ieee", or "tf32", which is faster and coarser. AMP is measured against that fp32. It
    comes with cudnn.benchmark too, which times each convolution's algorithms once."""
    cuda, cudnn = torch.backends.cuda, torch.backends.cudnn
    if device.type == "cpu":
        return f"cpu (16-bit instructions: {' '.join(cpu_16bit()) or 'none'})"
    if device.type != "cuda":
        return str(device)
    # Before torch 2.9 allow_tf32 is the only API. After it, allow_tf32 raises once the new
    # fp32_precision has been set, so the new one is read where torch has it.
    if hasattr(cuda.matmul, "fp32_precision"):
        matmul, conv = cuda.matmul.fp32_precision, cudnn.conv.fp32_precision
    else:
        matmul, conv = cuda.matmul.allow_tf32, cudnn.allow_tf32
    return (f"{device} {torch.cuda.get_device_name(device)} (fp32: matmul {FP32_MATH[matmul]}, "
            f"conv {FP32_MATH[conv]}; cudnn.benchmark {cudnn.benchmark})")


def choose_precision(name, device):
    """The precision to train in, and the notes that say why. "auto" follows auto_precision. A
    precision that the device does not compute natively trains with a note, but on MPS, where
    it cannot train at all. Under torchrun every process takes rank 0's choice."""
    native, notes = native_16bit(device), []
    if name == "auto":
        name = auto_precision(device)
        notes = [f"note: auto trains in {name} (README's table): {device.type} computes "
                 f"{', '.join([*native, 'fp32'])} natively"]
        # Without AMX, a CPU's bf16 was faster than fp32 on some CPUs and slower on others.
        if device.type == "cpu" and "bf16" in native and name == "fp32":
            notes.append("note: auto takes a CPU's bf16 with AMX alone: --example memory measures "
                         "it here, and --precision bf16 trains in it")
    elif name not in [*native, "fp32"]:
        notes = [f"note: {name} is not native on {device.type} here, so it is slower than fp32"]
    # MPS emulates neither. It would train in fp32 or fail, under a header that says 16 bits.
    if device.type == "mps" and name not in [*native, "fp32"]:
        raise UsageError(f"{name} does not train on mps here (README's table): use "
                         f"--precision {' or '.join([*native, 'fp32'])}, or --device cpu")
    return from_rank_0((name, notes))


def make_optimizer(model, lr):
    """The post's SGD, fused. Its kernel takes the GradScaler's inf check, so that step() needs
    no host sync in fp16."""
    return torch.optim.SGD(model.parameters(), lr=lr, fused=True)


# ---------- models and data

def resnet18(imagenet_stem=False):
    """torchvision's ResNet18 for CIFAR-10's 10 classes. Its stem is CIFAR's: a 3x3 stride-1
    conv, and no max-pool. Or it is the post's ImageNet stem, which makes 32x32 images 8x8 maps."""
    # Imported here, since it takes seconds, and the linear example needs none of it.
    import torchvision
    model = torchvision.models.resnet18(num_classes=10)
    if not imagenet_stem:
        model.conv1 = nn.Conv2d(3, 64, 3, padding=1, bias=False)
        model.maxpool = nn.Identity()
    return model


def image_classifier(name):
    """The memory example's image model `name` for 10 classes, and the side of its images.
    resnet18 has the CIFAR stem, and resnet18-imagenet the post's. Both take CIFAR's 32. A
    torchvision classification model takes the smallest side that its weights' metadata
    states. That is 224 for most, and 299 for inception_v3. Nothing is downloaded."""
    if name in ("resnet18", "resnet18-imagenet"):
        return resnet18(imagenet_stem=name == "resnet18-imagenet"), 32
    from torchvision import models
    if name not in models.list_models(module=models):
        raise UsageError(f"--model {name} is not a model the memory example knows: use linear, "
                         "resnet18, resnet18-imagenet, or a torchvision classification model "
                         "such as resnet50")
    side = min(weight.transforms.keywords["crop_size"] for weight in models.get_model_weights(name))
    return models.get_model(name, num_classes=10, **TORCHVISION_OPTIONS.get(name, {})), side


class DeviceLoader:
    """Batches of inputs and targets held on the device, as in airbench. A batch costs a few
    tensor ops, and no worker process. Training batches (`shuffle`) come in an order drawn
    from the seed and the epoch. Under torchrun each process takes its share, by RANK and
    WORLD_SIZE. Every process gets as many whole batches as every other. Under DDP a process
    with one batch more would wait for good in its all-reduce. Test batches hold every sample
    once. max_batches cuts an epoch short."""

    def __init__(self, inputs, targets, batch_size, device, transform, shuffle=False, seed=0,
                 max_batches=sys.maxsize):
        self.inputs, self.targets = inputs.to(device), targets.to(device)
        self.batch_size, self.transform, self.shuffle = batch_size, transform, shuffle
        self.seed, self.max_batches, self.epoch = seed, max_batches, 0

    def __len__(self):
        # Testing: every sample once, on every process.
        batches = math.ceil(len(self.targets) / self.batch_size)
        # Training: as many whole batches for every process.
        if self.shuffle:
            batches = len(self.targets) // world_size() // self.batch_size
        return min(batches, self.max_batches)

    def __iter__(self):
        # Each seed and epoch make one 32-bit seed, since a CPU generator keeps 32 bits. Seeds
        # under 4,294 apart never share an order while the epochs stay under a million.
        seed = (self.seed * 1_000_003 + self.epoch) % 2**32
        order = torch.arange(len(self.targets))
        if self.shuffle:
            # Drawn on the CPU, where every process draws the same order. Each takes its share.
            order = torch.randperm(len(order), generator=torch.Generator().manual_seed(seed))
            order = order[rank()::world_size()]
        order = order[:len(self) * self.batch_size]
        # Each process crops its own images, so one draw of crops serves them all.
        augment = torch.Generator(self.targets.device).manual_seed(seed)
        for index in order.to(self.targets.device).split(self.batch_size):
            yield self.transform(self.inputs[index], augment), self.targets[index]


def random_crop_flip(images, generator):
    """torchvision's RandomCrop(32, padding=4) and RandomHorizontalFlip, on a whole batch."""
    n, device = len(images), images.device
    padded = nn.functional.pad(images, (4, 4, 4, 4))
    dy, dx = torch.randint(0, 9, (2, n, 1), generator=generator, device=device)
    mirror = torch.rand(n, 1, generator=generator, device=device) < 0.5
    base = torch.arange(32, device=device)
    rows = (dy + base)[:, None, :, None].expand(n, 3, 32, 40)
    cols = (dx + torch.where(mirror, 31 - base, base))[:, None, None, :]
    return padded.gather(2, rows).gather(3, cols.expand(n, 3, 32, 32))


def image_layout(device):
    """The memory layout of images and convolution weights on `device`. It is channels_last,
    the layout in which tensor cores and oneDNN compute convolutions. MPS keeps the default
    layout: there BatchNorm's backward gave wrong gradients in channels_last until 2026
    (pytorch issue 175189)."""
    if device.type == "mps":
        return torch.contiguous_format
    return torch.channels_last


def cifar10_transform(device, augment):
    """Turns uint8 images into normalized float ones, cropped and flipped if `augment`. They
    come in the device's image_layout."""
    mean, std = torch.tensor(CIFAR10_MEAN_STD, device=device).view(2, 3, 1, 1) * 255

    def transform(images, generator):
        if augment:
            images = random_crop_flip(images, generator)
        return ((images.float() - mean) / std).contiguous(memory_format=image_layout(device))
    return transform


def synthetic_cifar10(sizes, seed=0):
    """CIFAR-10-shaped sets of uint8 images and labels, one of each size in `sizes`, such as a
    training set and a test set. Each image is its class's smooth pattern, and noise."""
    generator = torch.Generator().manual_seed(seed)
    patterns = torch.randn(10, 3, 4, 4, generator=generator)
    patterns = nn.functional.interpolate(patterns, size=(32, 32), mode="bilinear")
    labels = torch.randint(0, 10, (sum(sizes),), generator=generator)
    images = 0.25 * patterns[labels] + torch.randn(len(labels), 3, 32, 32, generator=generator)
    images = (images * 48 + 128).clamp(0, 255).to(torch.uint8)
    return list(zip(images.split(sizes), labels.split(sizes)))


def cifar10(root):
    """CIFAR-10's training and test images and labels, downloaded into `root` if missing.
    Two downloads into one folder would corrupt it, so each process downloads under a lock
    on the folder. The first to take it downloads, and the others then find the files there.
    A lock waits as long as the download takes, where a collective would time out."""
    # filelock comes with torch, and locks on every system.
    import filelock, torchvision
    # Offline the download fails, and the error below says what to do.
    with contextlib.suppress(OSError, RuntimeError):
        with filelock.FileLock(os.path.join(root, "download.lock")):
            torchvision.datasets.CIFAR10(root, download=True)
    try:
        sets = [torchvision.datasets.CIFAR10(root, train=train) for train in (True, False)]
    except (OSError, RuntimeError):
        raise UsageError(f"no CIFAR-10 in {os.path.abspath(root)}, nor online: put "
                         "cifar-10-python.tar.gz there, or use --data synthetic")
    # (N, 32, 32, 3) uint8 arrays become (N, 3, 32, 32) tensors.
    return [(torch.from_numpy(s.data).permute(0, 3, 1, 2), torch.tensor(s.targets)) for s in sets]


def linear_batch(batch_size, seed):
    """The post's Linear(10, 1) problem. It is one fixed batch, seeded here."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(batch_size, 10, generator=generator)
    return inputs, torch.randn(batch_size, 1, generator=generator)


def build_example(args, device):
    """The model, loss, training and test loaders of args.example, for this process. Its
    --batch-size is each process's. The linear example trains every process on its batch."""
    if args.example == "linear":
        # Its batch is taken as it is.
        loader = DeviceLoader(*linear_batch(args.batch_size, args.seed), args.batch_size, device,
                              lambda inputs, generator: inputs)
        return nn.Linear(10, 1).to(device), nn.MSELoss(), loader, []
    train, test = synthetic_cifar10((10_000, 2_000), args.seed)
    if args.data == "cifar10":
        train, test = cifar10(args.data_root)
    # --max-steps N takes N steps an epoch, and N test batches. 0 takes all.
    steps = args.max_steps or sys.maxsize
    train_loader = DeviceLoader(*train, args.batch_size, device, cifar10_transform(device, True),
                                True, args.seed, steps * args.accum_steps)
    if len(train_loader) == 0:
        raise UsageError(f"--batch-size {args.batch_size} is more than each process's "
                         f"{len(train[1]) // world_size()} training images")
    test_loader = DeviceLoader(*test, args.batch_size, device, cifar10_transform(device, False),
                               max_batches=steps)
    model = resnet18().to(device, memory_format=image_layout(device))
    return model, nn.CrossEntropyLoss(), train_loader, test_loader


# ---------- the examples' epoch loop

def train_example(args, device, folder, state):
    """The resnet and linear examples, as imagenet's main_worker. It builds the model, then
    trains, tests, prints and saves each epoch. folder saves the run: see RunFolder, and a
    NoFolder saves nothing. state is the checkpoint to go on from, or {}. Returns 0, or 1 if
    training cannot go on."""
    raw_model, criterion, train_loader, test_loader = build_example(args, device)
    args.precision, precision_notes = choose_precision(args.precision, device)
    optimizer = make_optimizer(raw_model, args.lr)
    scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "fp16")
    # The post's StepLR(10, 0.1), stepped once an epoch. LambdaLR computes each epoch's lr from
    # --lr and the epoch, where StepLR multiplies the last one. So a resumed run that is given
    # another --lr goes on along the schedule.
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda epoch: LR_GAMMA[args.example] ** (epoch // LR_STEP_EPOCHS))
    # The objects that a checkpoint saves, by the names it saves them under.
    objects = {"model": raw_model, "optimizer": optimizer, "scaler": scaler, "scheduler": scheduler}
    metrics, notes = [], []
    if state:
        metrics = restore(state, objects, args.lr, os.path.join(args.run_dir, "checkpoint.pt"))
        notes = [f"resumed from {args.run_dir} after epoch {len(metrics)}"]
    data = args.data
    if args.example == "linear":
        data = "one batch"
    flags = {key: getattr(args, key) for key in RUN_FLAGS}
    print0(f"amp_train | example {args.example} | torch {torch.__version__} | device "
           f"{device_label(device)} | precision {args.precision} | data {data} | batch "
           f"{args.batch_size} | accum {args.accum_steps} | processes {world_size()} | epochs "
           f"{args.epochs} | compile {args.compile}", *precision_notes, *notes)
    # DDP averages the gradients in backward. So every process's scaler sees the same ones,
    # and skips the same steps.
    model, first = raw_model, len(metrics)
    if world_size() > 1:
        model = nn.parallel.DistributedDataParallel(raw_model)
    # The checkpoint saves raw_model, whose keys torch.compile's wrapper does not prefix. So a
    # run goes on with or without --compile.
    if args.compile:
        model = compiled(model, device, PRECISIONS[args.precision])
    # Saved before the first epoch, so that every write is tried before anything is trained.
    folder.save(objects, flags, metrics)
    for epoch in range(first, args.epochs):
        record = run_epoch(args, epoch, model, objects, criterion, train_loader, test_loader,
                           device, args.compile and epoch == first)
        objects["scheduler"].step()
        print0(epoch_line(record, args.epochs))
        metrics.append(json.dumps(record) + "\n")
        problem = epoch_problem(record, raw_model, train_loader, criterion, device)
        # The checkpoint keeps the last sound epoch. The metrics show this one too.
        folder.save(objects, flags, metrics, checkpoint=problem is None)
        if problem is not None:
            print0(f"error: epoch {epoch + 1}: {problem}; {folder.contents}", file=sys.stderr)
            return 1
    return 0


def run_epoch(args, epoch, model, objects, criterion, train_loader, test_loader, device,
              compiling=False):
    """Trains `model` for one epoch, and tests objects["model"]: model is that model, or DDP or
    torch.compile around it. Its first step compiles it where `compiling`. Returns the epoch's
    record. Its train loss is the mean over every process's samples."""
    optimizer, scaler = objects["optimizer"], objects["scaler"]
    amp_dtype = PRECISIONS[args.precision]
    # The order, crops and flips come from the seed and the epoch. A resumed run sees the same.
    train_loader.epoch = epoch
    start = time.perf_counter()
    batches = progress(train_loader, args.accum_steps, compiling)
    stats = train_epoch(model, batches, optimizer, criterion, scaler, device, amp_dtype,
                        clip_grad_norm=args.clip_grad_norm, accum_steps=args.accum_steps)
    seconds = time.perf_counter() - start
    # The mean train loss over every process's samples. Each process tests the whole test set
    # with its own BatchNorm statistics. Rank 0's are those printed and saved, and DDP gives
    # them to all at the next forward pass.
    sums = torch.tensor([stats["loss"] * stats["samples"], stats["samples"]], device=device)
    if dist.is_initialized():
        dist.all_reduce(sums)
    tested = evaluate(objects["model"], test_loader, criterion, device, amp_dtype)
    loss_sum, samples = sums.tolist()
    record = {"precision": args.precision, "epoch": epoch + 1, "train_loss": loss_sum / samples}
    if args.example == "resnet":
        record.update(test_loss=tested["loss"], test_accuracy=tested["accuracy"])
    # Each step that the scaler skipped halved the scale, alike on every process.
    return {**record, "lr": optimizer.param_groups[0]["lr"], "loss_scale": scaler.get_scale(),
            "seconds": seconds, "samples_per_second": samples / seconds, "processes": world_size()}


def progress(loader, accum_steps, compiling):
    """Yields loader's batches. Every PROGRESS_SECONDS at most, it prints a line with the step,
    the steps in the epoch, the time a step and the time left. Where `compiling`, a line says so
    before the first step, and one after it gives its seconds. It reads the host's clock, so
    the steps need no host sync. The first step, which compiles or picks kernels, is not
    counted in the time a step."""
    steps = math.ceil(len(loader) / accum_steps)
    if compiling:
        print0("compiling: the first step compiles the model")
    start = last = time.perf_counter()
    for index, batch in enumerate(loader):
        step, now = index // accum_steps, time.perf_counter()
        if step > 1 and now - last >= PROGRESS_SECONDS:
            each, last = (now - first) / (step - 1), now
            print0(f"  step {step}/{steps} | {each:.3f} s a step | {each * (steps - step):.0f} s "
                   "left")
        yield batch
        # train_epoch asks for the next batch once the first step is done.
        if index == accum_steps - 1:
            first = time.perf_counter()
            if compiling:
                print0(f"compiled: the first step took {first - start:.1f} s")


def epoch_problem(record, model, loader, criterion, device):
    """Why training cannot go on after this epoch, and what to try; or None. In fp16 it also
    says where fp16 overflows on a batch of `loader`, if it does."""
    tensors = model.state_dict()
    finite = torch.stack([t.isfinite().all() for t in tensors.values()]).int()
    # Every process decides alike. BatchNorm's statistics differ between processes until DDP's
    # next forward pass, and a tensor that is not finite on one of them stops all.
    if dist.is_initialized():
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    # One host sync for all the model's tensors.
    finite, problem = finite.tolist(), None
    advice = ": lower --lr, or look for inf/NaN in the data"
    # A mean loss of inf or NaN says that the epoch trained on nonsense, even where the weights
    # stayed finite. Every process has the same mean.
    if not math.isfinite(record["train_loss"]):
        problem = f"the epoch's mean train loss is {record['train_loss']}{advice}"
    # NaN weights stay NaN, as do BatchNorm statistics that a skipped inf batch updated.
    if not all(finite):
        problem = f"the model's {list(tensors)[finite.index(False)]} holds inf/NaN{advice}"
    # check_fp16 says where fp16 overflows, which no loss scale mends. It runs only now.
    if problem is not None and record["precision"] == "fp16":
        verdict = check_fp16(model, next(iter(loader)), criterion, device)["verdict"]
        problem += f"; on a training batch, {verdict}"
    return problem


def epoch_line(record, epochs):
    """The epoch's log line: fixed fields with units, greppable."""
    line = "epoch {epoch:>{width}}/{epochs} | train loss {train_loss:.4f}"
    if "test_loss" in record:
        line += " | test loss {test_loss:.4f} | test acc {test_accuracy:6.2%}"
    line += (" | lr {lr:.4g} | scale {loss_scale:g} | {samples_per_second:.0f} samples/s | "
             "{seconds:.3f} s")
    return line.format(width=len(str(epochs)), epochs=epochs, **record)


# ---------- the memory measurement: what AMP buys on a model

@contextlib.contextmanager
def count_saved_tensors(model):
    """Counts the bytes that autograd saved for backward in the block. The count is ready on
    leaving the block. It holds autocast's 16-bit copies of the weights, which do not grow
    with the batch, and the activations, which do."""
    saved = {}

    def pack(tensor):
        # By storage, so that a view counts once. The storage is kept to the end of the block,
        # so that no later tensor reuses its address.
        saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage()
        return tensor

    counts = {"saved_bytes": 0}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield counts
    # A weight itself, or a view of it, is no memory saved for backward: it is there anyway.
    for weight in model.parameters():
        saved.pop(weight.untyped_storage().data_ptr(), None)
    counts["saved_bytes"] = sum(map(torch.UntypedStorage.nbytes, saved.values()))


class FP16Check(TorchDispatchMode):
    """The passes that check_fp16 runs on a copy of `model`, and what it sees of each op in
    them, forward and backward. A pass runs in fp32, or in fp16 as autocast runs it. Then an op
    whose result autocast makes fp16 runs in fp32 here, and its result is rounded to fp16, as
    tensor cores round theirs. A CPU emulates fp16's own kernels, up to 400x slower than fp32's,
    so this costs several fp32 steps instead.

    A tracked pass keeps each op's place: the op, and the module that runs it, forward or
    backward, as torch's ModuleTracker and FlopCounterMode name it. That is the model's class
    and the module's path in named_modules(), such as "GPT.blocks.0.attn". Outside every module
    of the model and the loss, it is "Global"."""

    def __init__(self, model, batch, criterion, device):
        super().__init__()
        self.model, self.device = copy.deepcopy(model).to(device).train(), device
        (self.inputs, self.targets), self.criterion = to_device(batch, device), criterion
        self.weights = list(filter(operator.attrgetter("requires_grad"), self.model.parameters()))
        # How the pass under way runs, as run() sets it: in fp16 or in fp32, whether it is
        # tracked, and the op from which on its results are made finite.
        self.fp16, self.tracked, self.finite_from = False, False, math.inf
        # What a tracked pass keeps of each op: its place, and whether it made inf or NaN from
        # finite inputs.
        self.places, self.made = [], []
        # torch's ModuleTracker holds the names of the modules whose ops run now, each module's
        # ancestors among them.
        self.tracker = ModuleTracker()

    def run(self, fp16, tracked=False, finite_from=math.inf):
        """A forward pass, in fp16 where `fp16`, and the weights' gradients of its loss. Where
        `tracked`, it keeps which ops make inf or NaN from finite inputs, and ops from
        `finite_from` on make none: their results are made finite. Returns the loss, the
        gradients, and whether all of them are finite."""
        self.fp16, self.tracked, self.finite_from = fp16, tracked, finite_from
        self.places, self.made = [], []
        # Each pass draws the same dropout masks, and leaves the global RNG as it found it. The
        # tracker follows the modules into the backward pass of the loss.
        with same_rng(self.device), self.tracker:
            with self, torch.autocast(self.device.type, dtype=torch.float16, enabled=fp16):
                outputs = self.model(**self.inputs) if isinstance(self.inputs, dict) else (
                    self.model(self.inputs))
                loss = self.criterion(outputs, self.targets)
            gradients = self.gradients(loss, 1)
        return loss, gradients, all_finite([loss, *gradients], self.device).item()

    def gradients(self, loss, scale):
        """The weights' gradients of the loss times `scale`, computed as the pass that made the
        loss ran. Checkpointing changes none."""
        with self:
            return torch.autograd.grad(loss.float() * scale, self.weights, retain_graph=True,
                                       materialize_grads=True)

    def settling_power(self, loss):
        """The power of 2 near which a GradScaler's scale settles on the fp16 pass's loss. The
        GradScaler halves its scale after a step whose weights' gradients hold inf or NaN, and
        doubles it after 2000 steps without. So it settles at the largest power at which they
        stay finite. At 2**128, past fp32's range, the scaled loss itself is inf."""
        def overflows(power):
            return not all_finite(self.gradients(loss, 2.0**power), self.device).item()
        return first_true(range(1, 129), overflows) - 1

    def blame(self, fp16):
        """The place of the first op whose inf or NaN reaches the loss or a weight's gradient.
        Such an op makes inf or NaN from finite inputs. Where the ops up to op i keep their inf
        and NaN, and later ones make none, the loss and gradients stay finite for each i before
        that op, and not from it on. The last such op leaves the pass as it is, whose gradients
        are not finite."""
        self.run(fp16, tracked=True)
        places, origins = self.places, torch.stack(self.made).nonzero().flatten().tolist()

        def reaches(i):
            # Whether inf or NaN reach the loss or a gradient, where no op after i makes any.
            return not self.run(fp16, True, i + 1)[2]
        return places[first_true(origins, reaches)]

    def __torch_dispatch__(self, func, types, args, kwargs):
        # A view holds no new values.
        if func.is_view:
            return func(*args, **kwargs)
        # Only blame's passes follow inf and NaN op by op. They read the inputs before the op
        # runs, since an in-place op changes them.
        finite_inputs = None
        if self.tracked:
            finite_inputs = all_finite(pytree.tree_leaves((args, kwargs)), self.device)
        # In-place ops keep their tensors, so they run as they are, in fp16. So does an op
        # with no meta kernel, which rounded() needs, or with no fp32 kernel, as flash
        # attention has none.
        results = None
        with contextlib.suppress(NotImplementedError, RuntimeError):
            if self.fp16 and not func._schema.is_mutable:
                results = self.rounded(func, args, kwargs)
        if results is None:
            results = func(*args, **kwargs)
        return self.note(func, finite_inputs, results)

    def rounded(self, func, args, kwargs):
        """func's results, computed in fp32, and each rounded to the dtype that func gives it.
        A meta tensor has a shape and a dtype, and no data. func on meta tensors gives those
        dtypes, by torch's own rules, and costs nothing."""
        meta = pytree.tree_map_only(torch.Tensor, functools.partial(torch.Tensor.to, device="meta"),
                                    (args, kwargs))
        meta = pytree.tree_map_only(torch.device, lambda device: torch.device("meta"), meta)
        meta = pytree.tree_leaves(func(*meta[0], **meta[1]))
        wide = pytree.tree_map(widen, (args, kwargs))
        wide, spec = pytree.tree_flatten(func(*wide[0], **wide[1]))
        results = [x.to(m.dtype) if isinstance(m, torch.Tensor) else x for x, m in zip(wide, meta)]
        return pytree.tree_unflatten(results, spec)

    def note(self, func, finite_inputs, results):
        """Returns the op's results. A tracked pass keeps the op's place, and whether it made
        inf or NaN from finite inputs. From op `finite_from` on, it makes those results finite."""
        if not self.tracked:
            return results
        # A module's name holds those of its ancestors, so the longest is the innermost.
        module = max(self.tracker.parents - {"Global"}, key=len, default="Global")
        self.places.append(f"{func.overloadpacket.__name__} in {module}")
        tensors = list(filter(torch.is_tensor, pytree.tree_leaves(results)))
        self.made.append(finite_inputs & ~all_finite(tensors, self.device))
        if len(self.places) > self.finite_from:
            for x in filter(torch.is_floating_point, tensors):
                x.copy_(torch.where(finite_inputs, x.nan_to_num(), x))
        return results


def first_true(items, test):
    """The first of `items` for which test(item) is true, where it is true for every later item
    and for the last. Each test halves the items left, so test() runs about log2(len(items))
    times."""
    # The first true item is at low or after it, and at high or before it.
    low, high = 0, len(items) - 1
    while low < high:
        middle = (low + high) // 2
        if test(items[middle]):
            high = middle
        else:
            low = middle + 1
    return items[low]


def widen(x):
    """x, or fp32 where it is an fp16 tensor or the fp16 dtype. Every other value that an op
    takes, such as another tensor, a device or a number, stays as it is."""
    if isinstance(x, torch.Tensor) and x.dtype == torch.float16:
        return x.float()
    if x is torch.float16:
        return torch.float32
    return x


def all_finite(values, device):
    """Whether every tensor among `values` is finite, as a tensor on `device`: no host sync."""
    flags = [x.isfinite().all().to(device) for x in filter(torch.is_tensor, values)]
    return torch.stack([*flags, torch.ones((), dtype=torch.bool, device=device)]).all()


def zeroed(fp32, fp16):
    """The share of the nonzero values of the fp32 gradients that are zero in the fp16 ones."""
    nonzero = sum(map(torch.count_nonzero, fp32))
    lost = sum((g.ne(0) & h.eq(0)).sum() for g, h in zip(fp32, fp16))
    return (lost / max(nonzero, 1)).item()


def same_rng(device):
    """A block that leaves the global RNG, and `device`'s, as it found them."""
    # fork_rng keeps the global RNG, which is the CPU's, and the listed devices'. torch has no
    # CPU RNG apart from the global one to list.
    devices = []
    if device.type != "cpu":
        devices = [device]
    return torch.random.fork_rng(devices, device_type=device.type)


def check_fp16(model, batch, criterion, device):
    """What fp16 does to `model` on `batch`, judged by what a training step meets: its loss, and
    its weights' gradients, in which a GradScaler looks for inf and NaN. It runs on a copy of
    the model that trains nothing. One forward pass runs in fp32, and one in fp16 under autocast,
    as in train_epoch, through FP16Check. Both draw the same dropout masks. torch.autograd.grad
    gives each the weights' gradients of its loss. The fp16 pass also gives them at the scales
    that find where the GradScaler settles. device is a torch.device or its name. The global
    RNG is left as it was.

    Returns a dict. "overflow" names where fp16 first makes inf or NaN that reaches the loss or
    a weight's gradient, or it is None. That is an op and its module, as FP16Check names them.
    "bad" names where the fp32 pass meets inf or NaN, or it is
    None: the batch, a tensor of the model, or an op. Then fp16 is not to blame. Where the loss
    and gradients stay finite, "scale" is the power of 2 near which the GradScaler's scale
    settles, and otherwise None. "zeroed" and "zeroed_scaled" are the shares of the weights'
    nonzero fp32 gradient values that fp16 makes zero, as they are and at that scale. "verdict"
    says what to do, and "seconds" how long the check took.
    """
    device, start = torch.device(device), time.perf_counter()
    check = FP16Check(model, batch, criterion, device)
    _, fp32_gradients, fp32_finite = check.run(fp16=False)
    loss, fp16_gradients, fp16_finite = check.run(fp16=True)
    found = {"overflow": None, "bad": None, "scale": None, "zeroed_scaled": None,
             "zeroed": zeroed(fp32_gradients, fp16_gradients)}
    verdict = "fp16 keeps the loss and the weights' gradients finite"
    if not fp32_finite:
        # The model itself, not its copy, whose BatchNorm statistics took what the passes met.
        tensors = {"the batch": pytree.tree_leaves((check.inputs, check.targets))}
        tensors.update((f"the model's {name!r}", [x]) for name, x in model.state_dict().items())
        held = (name for name, values in tensors.items() if not all_finite(values, device))
        found["bad"] = next(held, None)
        # Where they are finite, an op of the fp32 pass makes the inf or NaN.
        if found["bad"] is None:
            found["bad"] = check.blame(fp16=False)
        verdict = ("the fp32 step meets inf or NaN too, so fp16 is not to blame: look at "
                   f"{found['bad']}")
    elif not fp16_finite:
        found["overflow"] = check.blame(fp16=True)
        verdict = (f"fp16 makes inf or NaN that reaches the loss or a weight's gradient, first at"
                   f" {found['overflow']}: keep that in fp32 (README), or train in bf16")
    else:
        found["scale"] = check.settling_power(loss)
        scaled = check.gradients(loss, 2.0 ** found["scale"])
        found["zeroed_scaled"] = zeroed(fp32_gradients, scaled)
    return {**found, "verdict": verdict, "seconds": time.perf_counter() - start}


def median_seconds(run, seconds, most, label, log):
    """The median seconds of a call, where run(n) makes n calls and waits for the device. The
    first call allocates memory and picks kernels, and the next two say how many calls fit in
    `seconds`. TIMED_ROUNDS rounds of at most `most` calls are timed, and the middle one counts.
    A first call longer than a round's share of `seconds` (emulated bf16, say) hides those
    costs, so one call is timed, once. log() hears how many."""
    each, rounds, calls = run(1), 1, 1
    if each <= seconds / TIMED_ROUNDS:
        each = run(2)
        rounds, calls = TIMED_ROUNDS, max(1, int(min(most, seconds / TIMED_ROUNDS / each)))
    log(f"  {label}: one took {cell(each, 'seconds')}, so {rounds} rounds of {calls} are timed")
    return statistics.median_high(map(run, [calls] * rounds))


def measure_training(model, batch, criterion, device, amp_dtype, steps, seconds, label, log,
                     compile=False):
    """Trains a copy of `model` on one batch, and measures it. Its first step runs eagerly. It
    counts what autograd saves, and the FLOPs of its matmuls and convolutions, by torch's
    FlopCounterMode. With `compile`, torch.compile compiles the copy in its next step, which is
    timed apart. median_seconds times the steps after those. Where torch keeps a peak of memory
    (CUDA, XPU), the timed steps' peak is read too. Last, device_rates measures the device's own
    rates in `label`, and the step's time at those rates is set beside the median step's."""
    model, batch = copy.deepcopy(model).to(device), to_device(batch, device)
    optimizer, trained = make_optimizer(model, LR), model
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype is torch.float16)
    memory = torch.get_device_module(device.type)

    def seconds_a_step(n):
        # n steps end in train_epoch's one host sync: the time is the device's, not the launches'.
        epoch = (trained, [batch] * n, optimizer, criterion, scaler, device, amp_dtype)
        return seconds_a_call(train_epoch, epoch, device, 1) / n
    # Every step saves the same tensors for backward, and computes the same FLOPs.
    with count_saved_tensors(model) as measured, FlopCounterMode(display=False) as flop:
        seconds_a_step(1)
    measured.update(step_flop=flop.get_total_flops(), conv_flop=sum(
        count for op, count in flop.get_flop_counts()["Global"].items() if "conv" in str(op)))
    # A copy of a compiled model is not compiled, so the copy is compiled here.
    if compile:
        log(f"  {label}: compiling")
        trained = compiled(model, device, amp_dtype)
        measured["compile_seconds"] = seconds_a_step(1)
    if hasattr(memory, "max_memory_allocated"):
        memory.reset_peak_memory_stats(device)
    median = median_seconds(seconds_a_step, seconds, steps, label, log)
    if hasattr(memory, "max_memory_allocated"):
        measured["peak_bytes"] = memory.max_memory_allocated(device)
    rates = device_rates(device, label, log)
    # A step at the device's rates: its convolutions at the convolution's, and the rest at the
    # matmul's, as fp32 convolutions can run in TF32 where matmuls do not.
    rated = (measured["conv_flop"] / rates["conv_rate_flops"]
             + (measured["step_flop"] - measured["conv_flop"]) / rates["matmul_rate_flops"])
    return {**measured, "median_step_seconds": median, "samples_per_second": len(batch[1]) / median,
            "achieved_flops": measured["step_flop"] / median, **rates, "rated_seconds": rated,
            "rate_share": rated / median}


def device_rates(device, precision, log):
    """The FLOPs a second that `device` reaches in a matmul and in a convolution, in
    `precision`, as PRECISIONS names it. fp32 is computed as torch is set, and CUDA may compute
    it in TF32. FlopCounterMode counts their FLOPs as it counts a model's, and median_seconds
    times rounds of about 200 ms. These rates are what the device reaches here, not its
    datasheet's peak, so a model's steps may pass them."""
    rates = {}
    for name in ("matmul", "conv"):
        # Doubled until a call takes 10 ms, so that the arithmetic bounds it, not the launches.
        # A size's first call picks its kernel, as cuDNN times its algorithms.
        for size in (1, 2, 4, 8, 16, 32, 64):
            run = functools.partial(seconds_a_call, *probe(name, size, precision, device), device)
            run(1)
            if run(1) >= 0.01:
                break
        with FlopCounterMode(display=False) as flop:
            run(1)
        seconds = median_seconds(run, 0.6, math.inf, f"{precision} {name}", log)
        rates[f"{name}_rate_flops"] = flop.get_total_flops() / seconds
    return rates


def probe(name, size, precision, device):
    """A matmul of two square matrices of side 256 * size, or a 3x3 convolution of 64 channels
    on 16 * size images of 32x32 in the device's image_layout: the op, and its inputs, in
    `precision`. fp32 is torch's default dtype."""
    dtype = PRECISIONS[precision]
    if name == "matmul":
        matrix = torch.randn(256 * size, 256 * size, dtype=dtype, device=device)
        return torch.mm, [matrix, matrix]
    like = {"dtype": dtype, "device": device, "memory_format": image_layout(device)}
    images = torch.empty(16 * size, 64, 32, 32, **like).normal_()
    kernel = torch.empty(64, 64, 3, 3, **like).normal_()
    return nn.functional.conv2d, [images, kernel]


def seconds_a_call(op, inputs, device, calls):
    """The seconds that a call of op(*inputs) takes on `device`, over `calls` calls."""
    start = time.perf_counter()
    for _ in range(calls):
        op(*inputs)
    torch.get_device_module(device.type).synchronize()
    return (time.perf_counter() - start) / calls


def compiled(model, device, amp_dtype):
    """torch.compile(model), set to train in amp_dtype as eager AMP does. torch.compile traces a
    model's backward pass at its first forward pass. Through torch 2.14 it then runs that
    backward under the forward's autocast by default. So a part kept in fp32 would get 16-bit
    weight gradients, and fp16's overflow there would skip steps. This sets the backward pass
    outside autocast, as in eager mode, for this whole process: torch reads the setting at every
    trace. A torch without that setting compiles fp32 alone, and bf16 or fp16 end in a
    UsageError. So does a torch that cannot compile for `device` here."""
    if hasattr(functorch_config, "backward_pass_autocast"):
        functorch_config.backward_pass_autocast = "off"
    elif amp_dtype is not None:
        raise UsageError(f"torch {torch.__version__} compiles AMP's backward pass under "
                         "autocast, unlike eager AMP (it has no torch._functorch.config."
                         "backward_pass_autocast): install a newer torch, run without "
                         "--compile, or use --precision fp32")
    # Inductor fails at the first call of what it compiled, not at torch.compile, so a tiny
    # compile is called at once: a CPU without a C++ compiler fails there, for example.
    try:
        torch.compile(nn.GELU())(torch.ones(2, device=device))
    except Exception as e:
        raise UsageError(f"torch cannot compile for {device.type} here ({type(e).__name__}): "
                         "run without --compile")
    return torch.compile(model)


def measure_amp(model, batch, criterion, device, amp_dtype=torch.bfloat16, steps=20, seconds=30,
                name="model", log=print, compile=False):
    """What AMP buys on `model`, measured side by side. Copies of it train on one batch of
    inputs and targets, in fp32 and with amp_dtype, compiled by `compiled` with `compile`.
    amp_dtype is torch.bfloat16 or torch.float16, as train_epoch takes it. Each precision takes
    up to 3 warm-up steps. Then its steps are timed in 3 rounds of at most `steps` steps, as
    many as fit in `seconds`. log() hears when each precision starts, and how many steps it
    times.

    Returns a dict with "fp32" and "bf16" or "fp16". Each holds the bytes that autograd saved
    for backward, the activations and autocast's weight copies. Each holds the median step's
    time, the samples per second, and on CUDA and XPU the peak memory. Each holds the FLOPs a
    step, all and the convolutions', and the FLOPs a second that the steps achieved. Each holds
    the device's own rates in a matmul and a convolution, measured by device_rates.
    "rated_seconds" is the time a step would take at those rates, and "rate_share" is that
    time's share of the median step's. "fp16_check" holds what check_fp16 found. The labels
    that amp_report prints come too. The global RNG is left as it was.
    """
    if amp_dtype not in AMP_NAMES:
        raise ValueError(f"amp_dtype is torch.bfloat16 or torch.float16, not {amp_dtype!r}")
    precision, device = AMP_NAMES[amp_dtype], torch.device(device)
    measured = {"name": name, "batch": len(batch[1]), "device": device_label(device),
                "precision": precision, "compile": compile}
    # torch.compile traces nothing yet, so a torch that cannot compile AMP says so before
    # anything is measured.
    if compile:
        compiled(model, device, amp_dtype)
    # Dropout draws from the global RNG. The caller's next draws are those it would have had.
    with same_rng(device):
        for label in ("fp32", precision):
            log(f"measuring {label}")
            measured[label] = measure_training(model, batch, criterion, device, PRECISIONS[label],
                                               steps, seconds, label, log, compile)
        log("checking fp16")
        measured["fp16_check"] = check_fp16(model, batch, criterion, device)
    return measured


def amp_report(measured):
    """measure_amp's result as lines. fp32 and AMP stand side by side, with their ratio. What
    fp16 does follows. The last line is a verdict to paste into a bug report."""
    name = measured["precision"]
    fp32, amp, checked = measured["fp32"], measured[name], measured["fp16_check"]
    lines, ratios = [f"{'':<22}{'fp32':>16}{name:>16}{name + '/fp32':>12}"], {}
    for key in filter(fp32.__contains__, ROWS):
        # A figure that is 0 in fp32, such as the convolutions' FLOPs of a model with none, has
        # no ratio.
        ratios[key] = math.nan
        if fp32[key]:
            ratios[key] = amp[key] / fp32[key]
        lines.append(f"{key:<22}{cell(fp32[key], ROWS[key]):>16}{cell(amp[key], ROWS[key]):>16}"
                     f"{ratios[key]:>12.2f}")
    step, share = ratios["median_step_seconds"], amp["rate_share"]
    # Within 5% of fp32's time, the two are as fast as each other: a shared machine's steps
    # vary that much.
    speed = "about as fast as fp32"
    if step < 0.95:
        speed = "faster"
    elif step >= 1.05:
        speed = "slower"
    # Steps that reach most of the device's measured rates are bound by its arithmetic. Far
    # below them, launches bound the steps where AMP's fewer bytes do not speed them up, and
    # memory where they do.
    if share >= ARITHMETIC_SHARE:
        bound = "arithmetic bounds them, and AMP buys what the hardware allows"
    elif share >= OTHER_SHARE:
        bound = "arithmetic bounds them, with launches or memory"
    elif speed == "faster":
        bound = "memory bounds them, and AMP's halved bytes are what it buys"
    else:
        bound = ("kernel launches bound them, and --compile or a larger batch can speed them up "
                 "where AMP cannot")
    return lines + fp16_lines(measured) + [
        f"verdict: {measured['name']}, batch {measured['batch']}, {measured['device']}, torch "
        f"{torch.__version__}: {name} steps take {step:.2f}x fp32's time, where a step at the "
        f"device's measured rates would take {ratios['rated_seconds']:.2f}x; they reach "
        f"{share:.2%} of those rates, so {bound}; {ratios['saved_bytes']:.2f}x the memory saved "
        f"for backward; AMP is {speed} here; {checked['verdict']}"]


def fp16_lines(measured):
    """amp_report's lines on what check_fp16 found, in measure_amp's result `measured`."""
    checked, seconds = measured["fp16_check"], measured["fp16_check"]["seconds"]
    lines = [f"fp16 as autocast runs it here, checked on this batch in {seconds:.2f} s, as long "
             f"as {seconds / measured['fp32']['median_step_seconds']:.1f} fp32 steps:"]
    # The check runs the model eagerly. A compiled model fuses ops, and may keep values in fp32
    # between them, so its overflows may differ (pytorch issue 183607).
    if measured["compile"]:
        lines.append("  the check ran the model eagerly, and compiled ops may overflow elsewhere")
    if checked["scale"] is None:
        lines.append("  the loss or a weight's gradient is inf or NaN, so the GradScaler skips "
                     "every step")
    else:
        lines += [f"  the GradScaler's scale goes from 2**16 to 2**{checked['scale']}, the largest "
                  "power of 2 that keeps the weights' gradients finite",
                  f"  fp16 makes {checked['zeroed']:.2%} of the weights' nonzero gradient values "
                  f"zero, and {checked['zeroed_scaled']:.2%} at 2**{checked['scale']}"]
    return lines + ["  bf16 has fp32's range, so none of this applies to bf16"]


def cell(value, unit):
    """A value of amp_report's table in the largest of UNITS[unit] that it reaches, with the
    decimals that the unit needs and no exponent."""
    first, factor, names, decimals = UNITS[unit]
    value, power = value / first, 0
    while value >= factor and power < len(names) - 1:
        value, power = value / factor, power + 1
    return f"{value:,.{decimals}f} {names[power]}"


def memory_precision(name, device):
    """The precision that the memory example sets beside fp32, by its --precision `name`. Its
    "auto" is the 16-bit precision that --precision auto trains in, and bf16 where that is fp32:
    whether AMP pays is what it measures."""
    if name == "fp32":
        raise UsageError("--example memory compares fp32 with AMP: use --precision bf16 or fp16")
    if name == "auto" and auto_precision(device) == "fp16":
        return "fp16"
    if name == "auto":
        return "bf16"
    return name


def run_memory(args, device):
    """The memory example. measure_amp measures --model on a batch of random data. The model is
    the post's Linear(10, 1) problem, or an image model from image_classifier. An image model
    is in the device's image_layout. Returns 0."""
    precision, precision_notes = choose_precision(memory_precision(args.precision, device), device)
    model, criterion = nn.Linear(10, 1), nn.MSELoss()
    batch = linear_batch(args.batch_size, args.seed)
    if args.model != "linear":
        model, side = image_classifier(args.model)
        model, criterion = model.to(memory_format=image_layout(device)), nn.CrossEntropyLoss()
        batch = torch.randn(args.batch_size, 3, side, side), torch.randint(0, 10, [args.batch_size])
    print0(f"memory | torch {torch.__version__} | device {device_label(device)} | model "
           f"{args.model} | batch {args.batch_size} | compile {args.compile}", *precision_notes)
    print0(*amp_report(measure_amp(model, batch, criterion, device, PRECISIONS[precision],
                                   name=args.model, log=print0, compile=args.compile)))
    return 0


# ====================================================================================
# Part II: keeping long runs safe
# ====================================================================================

# ---------- the run folder

class RunFolder:
    """--run-dir DIR: one training run's DIR/checkpoint.pt and DIR/metrics.jsonl.

    One run owns the folder. It holds a lock on DIR/.lock, which the system frees when the
    process dies. Every write is whole: a fresh file, flushed to the disk, is renamed
    over the old one. So kill -9 or a full disk at any moment leaves the last checkpoint. A run
    without --resume never overwrites a checkpoint. A torchrun restart of the launch that
    wrote it is the one exception.

    The checkpoint is the standard one, as the AMP recipe and torchvision's reference scripts
    save it. It holds the state dicts of the model, the optimizer, the GradScaler and the lr
    scheduler. The epoch, the flags and the metrics lines come beside them. torch.load(path,
    weights_only=True) reads it anywhere.
    """

    def __init__(self, path, resume):
        self.path, self.launch, self.state = path, launch(), {}
        # What the folder holds. A run that stops says so in its last line.
        self.contents = f"{path} holds no checkpoint"
        self.checkpoint = os.path.join(path, "checkpoint.pt")
        if os.path.isfile(path):
            raise UsageError(f"--run-dir {path} is a file, not a folder: name a folder")
        if resume and not os.path.exists(self.checkpoint):
            raise UsageError(f"nothing to resume in {path}: run without --resume")
        # filelock comes with torch. Its lock is the system's, on Linux, macOS and Windows, and
        # timeout=0 tries it once.
        self.lock = filelock.FileLock(os.path.join(path, ".lock"), timeout=0)
        # A folder that cannot be used is let go at once: on_error releases the lock.
        with contextlib.ExitStack() as on_error:
            try:
                os.makedirs(path, exist_ok=True)
                on_error.enter_context(self.lock)
            except filelock.Timeout:
                raise UsageError(f"another run is using {path}: wait, or use another --run-dir")
            # A folder that cannot be made or written to, say.
            except OSError as e:
                raise UsageError(f"cannot use --run-dir {path} ({e.strerror}): name a folder "
                                 "you can write to")
            # The checkpoint this run goes on from, if there is one and it may.
            if os.path.exists(self.checkpoint):
                # weights_only unpickles tensors and plain containers, never code.
                with checkpoint_at(self.checkpoint):
                    self.state = torch.load(self.checkpoint, map_location="cpu", weights_only=True)
                    self.contents = f"{path} holds epoch {self.state['epoch']}"
                    saved_launch = self.state["launch"]
                # A torchrun restart goes on from its own launch's checkpoint without --resume.
                if not resume and saved_launch != self.launch:
                    raise UsageError(f"{path} holds a run: add --resume, or use another --run-dir")
            # The folder is this run's: the lock stays until close().
            on_error.pop_all()

    def save(self, objects, flags, metrics, checkpoint=True):
        """Writes the checkpoint of epoch len(metrics), if `checkpoint`, then the metrics file.
        That holds a line of JSON an epoch, and a resumed run writes it anew from the
        checkpoint's lines. objects are the model, optimizer, scaler and scheduler by name."""
        state = {name: part.state_dict() for name, part in objects.items()}
        state.update(epoch=len(metrics), args=flags, metrics=metrics, launch=self.launch)
        # Serialized in memory first, so that a full disk meets a plain write.
        buffer = io.BytesIO()
        torch.save(state, buffer)
        try:
            if checkpoint:
                replace_file(self.checkpoint, buffer.getvalue())
                self.contents = f"{self.path} holds epoch {len(metrics)}"
            replace_file(os.path.join(self.path, "metrics.jsonl"), "".join(metrics).encode())
        except OSError as e:
            raise UsageError(f"could not write in {self.path} ({e.strerror}); {self.contents}")

    def close(self):
        self.lock.release()


class NoFolder:
    """Stands in for a RunFolder where nothing is saved. That is without --run-dir, and on
    every process but rank 0, which alone writes."""

    contents = "nothing was saved"

    def save(self, *args, **kwargs):
        pass

    def close(self):
        pass


def replace_file(path, data):
    """Writes `data` to `path` whole or not at all. It goes into a new file beside it, flushed
    to the disk and renamed over `path`. mkstemp names the new file, so no link or file that
    stood there is written through."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    # From the moment the file exists, a full disk or Ctrl-C must not leave it behind.
    try:
        with open(fd, "wb") as f:
            f.write(data)
            f.flush()
            # On the disk before the rename: after a crash, the old file or the new survives.
            os.fsync(fd)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


@contextlib.contextmanager
def checkpoint_at(path):
    """Ends in one line any error in reading or applying the checkpoint at `path`. The file may
    be another program's, truncated, a folder, or a checkpoint of another model. Nothing has
    been written yet when the error comes."""
    try:
        yield
    except Exception as e:
        raise UsageError(f"{path} is no checkpoint this run can go on from "
                         f"({type(e).__name__}): move it away, or use another --run-dir")


def restore(state, objects, lr, path):
    """Loads the checkpoint's state dicts into objects, in place. Returns its metrics lines."""
    with checkpoint_at(path):
        for name, part in objects.items():
            # A disabled GradScaler, as in bf16 and fp32, saves {}. fp16 then starts a new scale.
            if state[name]:
                part.load_state_dict(state[name])
        # load_state_dict checks no shapes, but a fused optimizer walks each state tensor as
        # it walks its parameter. One of another shape or layout would make it write past its
        # memory. Each stands for its parameter but "step", the count of steps.
        for param, optimizer_state in objects["optimizer"].state.items():
            for key, value in optimizer_state.items():
                fits = (value.shape, value.stride()) == (param.shape, param.stride())
                if key != "step" and not fits:
                    raise ValueError(f"the optimizer's {key} does not fit its parameter")
        # The lr follows the flags' --lr, which a resume may change, along the schedule.
        scheduler, group = objects["scheduler"], objects["optimizer"].param_groups[0]
        scheduler.base_lrs = [lr]
        group["lr"] = lr * scheduler.lr_lambdas[0](scheduler.last_epoch)
        return list(state["metrics"])


def open_run_folder(args):
    """Rank 0 takes --run-dir. Every process gets its folder and the checkpoint to go on from,
    or {}. The other processes save nothing, so theirs is a NoFolder."""
    folder, checkpoint_or_error = NoFolder(), {}
    if args.run_dir is not None and rank() == 0:
        try:
            folder = RunFolder(args.run_dir, args.resume)
            checkpoint_or_error = folder.state
        except UsageError as e:
            checkpoint_or_error = e
    # Every process goes on from rank 0's checkpoint, or stops with its error.
    checkpoint_or_error = from_rank_0(checkpoint_or_error)
    if isinstance(checkpoint_or_error, UsageError):
        raise checkpoint_or_error
    return folder, checkpoint_or_error


# ---------- torchrun's processes

def rank():
    """This process's rank under torchrun; 0 without it."""
    return int(os.environ.get("RANK", "0"))


def world_size():
    """How many processes torchrun started; 1 without it."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def from_rank_0(value):
    """Rank 0's `value`, on every process: torchrun's processes act on one decision."""
    values = [value]
    if dist.is_initialized():
        dist.broadcast_object_list(values, src=0)
    return values[0]


def launch():
    """The name of the launch that started this process. Under torchrun it is the host and
    process id of the torchrun agent, which restarts the workers, so the name holds for every
    restart of the launch. A run without torchrun is a launch of its own. Its name is its host,
    process id and start time."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return f"{platform.node()}:{os.getpid()}:{time.time()}"
    return f"{platform.node()}:{os.getppid()}"


def join_processes(device):
    """Under torchrun, joins the other processes through its rendezvous, with the backend of
    `device`."""
    if world_size() <= 1:
        return
    store, process_rank, processes = next(dist.rendezvous("env://"))
    # torchrun may keep one store for every restart. Then each restart takes keys of its own,
    # or gloo would connect to processes that are gone. Agents on several machines count
    # restarts apart (pytorch issue 135712). So README's line for several machines gives each
    # restart a store of its own.
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        store = dist.PrefixStore(f"restart{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)
    # device_id binds NCCL to this process's GPU. torch 2.6 takes it for CUDA alone.
    device_id = None
    if device.type == "cuda":
        device_id = device
    # The device's own backend: gloo for a CPU, NCCL for CUDA, XCCL for XPU. Without one, torch
    # takes the backend of the accelerator it finds, which cannot serve a CPU run.
    dist.init_process_group(dist.get_default_backend_for_device(device), store=store,
                            rank=process_rank, world_size=processes, device_id=device_id)


# ====================================================================================
# The command line
# ====================================================================================

class UsageError(Exception):
    """A mistake the user can fix. The run ends in one line that says what to do, with exit 2."""


def print0(*lines, file=None):
    """Prints each line; under torchrun, rank 0 alone does."""
    if rank() == 0:
        print(*lines, sep="\n", file=file, flush=True)


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):
        # One line and exit 2, through main(), instead of argparse's usage and exit.
        raise UsageError(f"{message} (see --help)")


def number(kind, low, high, bounds):
    """An argparse type: a `kind` from low to high, which `bounds` says in words."""
    def parse(text):
        # kind("x") raises, and argparse says "invalid int value: 'x'".
        value = kind(text)
        # NaN is in no range.
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be {bounds}, not {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


def make_parser():
    """The command line's flags, each with its help and default."""
    count = number(int, 1, sys.maxsize, "1 or more")
    positive = number(float, math.ulp(0.0), sys.float_info.max, "a finite number more than 0")
    p = ArgumentParser(description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = p.add_argument
    add("--example", default="resnet", choices=["resnet", "linear", "memory"], help="resnet: "
        "ResNet18 on CIFAR-10; linear: the post's Linear(10, 1); memory: fp32 and AMP side by side")
    add("--device", default="auto", choices=["auto", "cpu", "cuda", "mps", "xpu"],
        help="auto: torch's accelerator if it finds one, else cpu")
    add("--precision", default="auto", choices=["auto", *PRECISIONS],
        help="auto: bf16 where the device computes it natively, fp16 on CUDA GPUs of compute "
        "capability 7.x, fp32 elsewhere (README's table). A CPU takes bf16 where it has AMX")
    add("--epochs", default=EPOCHS, type=count, help="a linear epoch is one step")
    add("--batch-size", default=BATCH_SIZE, type=count, help="the batch size per process")
    add("--lr", default=LR, type=positive, help="SGD's; resnet's falls tenfold every 10 epochs")
    add("--data", default="cifar10", choices=["cifar10", "synthetic"],
        help="resnet's; synthetic: 10,000 learnable images, made offline")
    add("--data-root", default="./data", help="resnet's: CIFAR-10's folder")
    add("--max-steps", default=0, type=number(int, 0, sys.maxsize, "0 or more"),
        help="resnet's steps an epoch, and test batches; 0: off")
    add("--clip-grad-norm", default=0.0, type=number(float, 0, math.inf, "0 or more"),
        help="the gradients' largest norm; 0: off")
    add("--accum-steps", default=1, type=count, help="micro-batches per optimizer step")
    add("--compile", action="store_true", help="torch.compile the model that trains, in every "
        "example; the first step compiles it")
    add("--run-dir", metavar="DIR", help="save DIR/checkpoint.pt and DIR/metrics.jsonl each epoch")
    add("--resume", action="store_true",
        help="go on with --run-dir's run, with its flags unless given again")
    add("--model", default="resnet18", help="memory's: linear, resnet18 (the CIFAR stem, at "
        "32x32), resnet18-imagenet (the post's stem), or one of torchvision's classification "
        "models, at the size its weights state")
    add("--seed", default=0, type=number(int, 0, 2**32 - 1, "from 0 to 2**32 - 1"),
        help="seeds the weights, the data and its order")
    return p


def parse_args(argv, state):
    """The flags, checked. Any mistake ends in one line and exit 2, through main(). A resumed
    run goes on with the flags of its checkpoint, `state`, which is {} for none. They are the
    defaults, so a flag given again replaces the checkpoint's. A flag that an example does not
    use is ignored, as --help says."""
    saved = state.get("args", {})
    parser = make_parser()
    parser.set_defaults(**saved)
    args = parser.parse_args(argv)
    if args.resume and args.run_dir is None:
        raise UsageError("--resume needs --run-dir DIR")
    if saved.get("example", args.example) != args.example:
        raise UsageError(f"{args.run_dir} holds a {saved['example']} run: use another --run-dir")
    return args


def main(argv):
    """The command line. It runs an example, and returns its exit status. A mistake and Ctrl-C
    each end in one line. A bug keeps its traceback, and so does running out of memory."""
    folder = NoFolder()
    try:
        args = parse_args(argv, {})
        device = resolve_device(args.device)
        # The examples' batches keep their shape, but for a smaller last test batch. So cuDNN
        # may time each convolution's algorithms once, and keep the fastest, for fp32 and AMP.
        torch.backends.cudnn.benchmark = True
        # torchrun's processes meet first. Rank 0 opens the folder, and all go on from its
        # checkpoint.
        join_processes(device)
        folder, state = open_run_folder(args)
        args = parse_args(argv, state)
        # --seed seeds the weights, the data and its order, alike on every process.
        torch.manual_seed(args.seed)
        if args.example == "memory":
            return run_memory(args, device)
        status = train_example(args, device, folder, state)
        # Every process ends its last collective before any leaves the group.
        if dist.is_initialized():
            dist.barrier()
        return status
    except UsageError as e:
        print0(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print0(f"error: stopped by Ctrl-C; {folder.contents}", file=sys.stderr)
        return 130
    finally:
        folder.close()
        if dist.is_initialized():
            # DDP's reference cycles keep the group alive, and gloo aborts if they outlive it.
            gc.collect()
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
