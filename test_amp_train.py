"""The specification of amp_train.py: each test's name says the one behaviour it checks, in the
module's order. CUDA cases run where a GPU is. Run: python -m pytest -q"""
import contextlib
import functools
import inspect
import io
import json
import math
import os
import pathlib
import pickle
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import zipfile

import numpy as np
import pytest
import torch
import torch.nn as nn

import amp_train

# torch.cuda.amp's names warn with a FutureWarning: any use of them fails a test.
pytestmark = [pytest.mark.filterwarnings("error::FutureWarning"),
              pytest.mark.filterwarnings("error::DeprecationWarning")]

HERE = pathlib.Path(__file__).parent
SCRIPT = str(HERE / "amp_train.py")
README = (HERE / "README.md").read_text()
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CPU = torch.device("cpu")
FP16, BF16 = torch.float16, torch.bfloat16
MSE = nn.MSELoss()
LINEAR = ["--device", "cpu", "--example", "linear"]
LINEAR_FP16 = LINEAR + ["--precision", "fp16"]
# The resnet example on synthetic data, two steps an epoch; the `fast` fixture makes its
# ResNet18 a small model.
RESNET = ["--device", "cpu", "--example", "resnet", "--data", "synthetic", "--max-steps", "2",
          "--batch-size", "4", "--precision", "fp32"]
RESNET18 = amp_train.resnet18
NOTHING_SAVED = "nothing is saved without --run-dir"


def small_model(imagenet_stem=False):
    """A conv, BatchNorm and linear classifier: ResNet18's kinds of layer, in milliseconds."""
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))


@functools.lru_cache(maxsize=None)
def cached_synthetic_cifar10(size, seed=0, train=True, _make=amp_train.synthetic_cifar10):
    return _make(size, seed, train)


@pytest.fixture(autouse=True)
def fast(monkeypatch):
    """Synthetic data made once; ResNet18 is small_model, unless a test asks for resnet18."""
    monkeypatch.setattr(amp_train, "synthetic_cifar10", cached_synthetic_cifar10)
    monkeypatch.setattr(amp_train, "resnet18", small_model)


@pytest.fixture
def resnet18(monkeypatch):
    monkeypatch.setattr(amp_train, "resnet18", RESNET18)


def ok(argv):
    assert amp_train.main(argv) == 0, argv


def run_bad(argv, capsys, status=2):
    """main(argv), which must end in exit `status` and one line on stderr; returns the line."""
    code, err = amp_train.main(argv), capsys.readouterr().err
    assert code == status and err.count("\n") == 1 and err.startswith("error: "), (code, err)
    return err


def batch_of(size, seed=0):
    """The linear example's fixed batch, of `size` samples."""
    return amp_train.linear_batch(size, seed)


def batches_of(size, total, seed=0):
    """The first `total` samples of a linear batch, in batches of `size`."""
    inputs, targets = batch_of(total, seed)
    return list(zip(inputs.split(size), targets.split(size)))


def linear_setup(device="cpu", amp_dtype=None, lr=0.01, optimizer=torch.optim.SGD, **kind):
    """A seeded Linear(10, 1), its optimizer, and a GradScaler enabled for fp16."""
    torch.manual_seed(0)
    model = nn.Linear(10, 1).to(device)
    scaler = torch.amp.GradScaler(torch.device(device).type, enabled=amp_dtype is FP16)
    return model, optimizer(model.parameters(), lr=lr, **kind), scaler


def train(model, batches, optimizer, scaler, amp_dtype=None, device="cpu", **kwargs):
    return amp_train.train_epoch(model, batches, optimizer, MSE, scaler, device, amp_dtype,
                                 **kwargs)


def docs_loop(model, batches, optimizer):
    """The torch.amp docs' loop, in fp32: an independent reference."""
    for inputs, targets in batches:
        optimizer.zero_grad()
        MSE(model(inputs), targets).backward()
        optimizer.step()


def with_inf(batch):
    """The batch with one input inf: its loss is inf, its gradients inf or NaN."""
    inputs = batch[0].clone()
    inputs[0, 0] = math.inf
    return inputs, batch[1]


def generator_of(batches):
    """The batches as a generator: a loader with no len(), as a streaming data set is."""
    yield from batches


def counting_steps(optimizer):
    """A list that grows by one each time the optimizer's step() runs."""
    steps = []
    optimizer.register_step_post_hook(lambda *_: steps.append(1))
    return steps


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def read_metrics(path):
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines()]


def files_of(folder):
    return {p.name: p.read_bytes() for p in pathlib.Path(folder).iterdir()}


def lrs_of(out):
    return [float(x) for x in re.findall(r"\| lr ([\d.e-]+) \|", out)]


def script(*argv, **env):
    """amp_train.py as a user starts it, in a process of its own (its stdout buffered)."""
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}, **env}
    return subprocess.Popen([sys.executable, SCRIPT, *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def retry_if_the_port_was_taken(run):
    """run(port) on a port that was free a moment ago, and another may take first."""
    for _ in range(3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        result = run(port)
        if "EADDRINUSE" not in str(result):
            return result
    raise AssertionError(f"three ports were taken: {result}")


def readme_blocks(heading):
    """The python blocks of README's section `heading`."""
    section = README[README.index(heading):]
    section = section[:section.find("\n## ", 1) % len(section)]
    return re.findall(r"```python\n(.*?)\n```", section, re.S)


# ---------- the part to copy

def test_readmes_copy_this_block_is_to_device_and_train_epoch_verbatim():
    block = readme_blocks("## Copy this")[0]
    for function in (amp_train.to_device, amp_train.train_epoch):
        assert inspect.getsource(function) in block, f"README's {function.__name__} differs"
    assert README[:README.index("## Copy this")].count("\n") < 120, "Copy this comes late"


def test_readmes_copy_this_block_runs_as_pasted_and_trains_as_the_docs_loop():
    block = readme_blocks("## Copy this")[0]
    batches = batches_of(8, 24)
    model, optimizer, _ = linear_setup(lr=0.1)
    reference, reference_optimizer, _ = linear_setup(lr=0.1)
    # All that a user's script has; the block sets up amp_dtype and scaler.
    user = {"model": model, "optimizer": optimizer, "criterion": MSE, "device": "cpu",
            "loader": batches}
    exec(compile(block, "README.md", "exec"), user)
    user["amp_dtype"] = None
    exec(re.search(r"^#\s+(stats = train_epoch\(.*\))$", block, re.M).group(1), user)
    docs_loop(reference, batches, reference_optimizer)
    assert torch.equal(model.weight, reference.weight), (model.weight, reference.weight)
    assert user["stats"]["samples"] == 24, user["stats"]


@pytest.mark.parametrize("device,amp_dtype", [("cpu", BF16), ("cuda", FP16)])
def test_readmes_set_up_lines_pick_amp_and_say_how_to_choose_bf16_on_a_cpu(device, amp_dtype,
                                                                           monkeypatch):
    block = readme_blocks("## Copy this")[0]
    setup = block[block.index("def train_epoch"):]
    setup = setup[setup.index("\n# "):]
    assert "lscpu" in setup and "amx_bf16" in setup and "avx512_bf16" in setup, setup
    # A GradScaler for "cuda" disables itself where CUDA is not.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    user = {"torch": torch, "device": device}
    exec(setup, user)
    assert user["amp_dtype"] is amp_dtype, user
    assert user["scaler"].is_enabled() == (amp_dtype is FP16), user


def test_fp16_without_an_enabled_gradscaler_is_refused():
    model, optimizer, scaler = linear_setup()
    with pytest.raises(ValueError, match=r"needs an enabled torch\.amp\.GradScaler"):
        train(model, [batch_of(4)], optimizer, scaler, FP16)


def test_accum_steps_below_1_is_refused():
    model, optimizer, scaler = linear_setup()
    with pytest.raises(ValueError, match="accum_steps must be 1 or more, not 0"):
        train(model, [batch_of(4)], optimizer, scaler, accum_steps=0)


@pytest.mark.parametrize("batch", [
    {"input_ids": torch.zeros(4, 10), "labels": torch.zeros(4, 1)},
    {"input_ids": torch.zeros(4, 10), "mask": torch.zeros(4, 10), "labels": torch.zeros(4, 1)},
    ((torch.zeros(4, 10), torch.tensor([3, 2, 2, 1])), torch.zeros(4, 1)),
    (torch.zeros(4, 10), torch.zeros(4, 1), torch.zeros(4)),
    torch.zeros(4, 10)], ids=["dict", "dict of 3", "tuple inputs", "triple", "a tensor"])
def test_a_batch_that_is_not_a_pair_of_tensors_points_to_readme(batch):
    model, optimizer, scaler = linear_setup()
    with pytest.raises(TypeError, match=r"an \(inputs, targets\) pair of tensors.*'Other batches'"):
        train(model, [batch], optimizer, scaler)
    assert "### Other batches" in README


def test_a_gradient_left_from_before_never_reaches_a_step():
    batch = batch_of(16)
    model, optimizer, scaler = linear_setup()
    clean, clean_optimizer, clean_scaler = linear_setup()
    # A forward and backward pass whose step never came: a micro-batch that raised, say.
    MSE(model(batch[0] * 100), batch[1]).backward()
    train(model, [batch], optimizer, scaler)
    train(clean, [batch], clean_optimizer, clean_scaler)
    assert torch.equal(model.weight, clean.weight), "an old gradient reached the step"


def test_the_loss_is_the_mean_per_sample_over_batches_of_any_size():
    model = nn.Linear(1, 1, bias=False)
    nn.init.zeros_(model.weight)
    batches = [(torch.zeros(3, 1), torch.ones(3, 1)), (torch.zeros(1, 1), torch.full((1, 1), 3.))]
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    stats = train(model, batches, torch.optim.SGD(model.parameters(), lr=0.0), scaler)
    assert stats == {"loss": pytest.approx((3 * 1 + 9) / 4), "samples": 4}, stats


def test_an_empty_loader_gives_a_nan_loss_and_no_samples():
    model, optimizer, scaler = linear_setup()
    stats = train(model, [], optimizer, scaler)
    assert math.isnan(stats["loss"]) and stats["samples"] == 0, stats


@pytest.mark.filterwarnings("ignore:Detected call of")  # torch's note when step 1 is skipped
@pytest.mark.parametrize("amp_dtype", [None, FP16])
def test_a_scheduler_steps_after_every_step_also_a_skipped_one(amp_dtype):
    batches = batches_of(4, 40)
    batches[0] = with_inf(batches[0])
    model, optimizer, scaler = linear_setup(amp_dtype=amp_dtype)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    train(model, batches, optimizer, scaler, amp_dtype, scheduler=scheduler, accum_steps=2)
    assert scheduler.last_epoch == 5, "10 micro-batches are 5 steps, the first one skipped"
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.01 * 0.5 ** 5)


@pytest.mark.parametrize("device,amp_dtype", [
    ("cpu", BF16), ("cpu", None), pytest.param("cuda", FP16, marks=requires_cuda)])
def test_autocast_runs_linear_and_conv_in_the_amp_dtype_and_the_loss_in_fp32(device, amp_dtype):
    model = nn.Sequential(nn.Linear(8, 8), nn.Unflatten(1, (1, 8)), nn.Conv1d(1, 4, 3),
                          nn.Flatten()).to(device)
    seen = []
    for module in model[0], model[2]:
        module.register_forward_hook(lambda module, inputs, output: seen.append(output.dtype))

    def criterion(outputs, targets):
        seen.append(nn.functional.cross_entropy(outputs, targets))
        return seen[-1]
    scaler = torch.amp.GradScaler(torch.device(device).type, enabled=amp_dtype is FP16)
    amp_train.train_epoch(model, [(torch.randn(2, 8), torch.tensor([0, 1]))],
                          torch.optim.SGD(model.parameters()), criterion, scaler, device,
                          amp_dtype)
    low = amp_dtype or torch.float32
    assert seen[:2] == [low, low] and seen[2].dtype is torch.float32, seen
    assert model[0].weight.dtype is torch.float32, "the weights stay fp32"


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_amp_training_ends_within_1e_3_of_fp32s_loss(precision):
    # Measured: bf16 ends 1.0e-4 from fp32's loss, fp16 1.3e-5; the bound is about 10x that.
    def fit(amp_dtype):
        model, optimizer, scaler = linear_setup("cpu", amp_dtype)
        for _ in range(100):
            stats = train(model, [batch_of(128)], optimizer, scaler, amp_dtype)
        return model.weight, stats["loss"]
    (fp32, fp32_loss), (amp, amp_loss) = fit(None), fit(amp_train.PRECISIONS[precision])
    assert fp32_loss < 1.0 and abs(amp_loss - fp32_loss) < 1e-3, (fp32_loss, amp_loss)
    assert torch.allclose(amp, fp32, atol=3e-3), (amp, fp32)


def test_an_inf_step_is_skipped_and_the_scale_halves():
    model, optimizer, scaler = linear_setup("cpu", FP16)
    reference, *_ = linear_setup()
    train(model, [with_inf(batch_of(8))], optimizer, scaler, FP16)
    assert torch.equal(model.weight, reference.weight), "the inf batch moved the weights"
    assert scaler.get_scale() == 2.0**15, scaler.get_scale()


def test_clipping_acts_on_the_unscaled_gradients():
    model, optimizer, scaler = linear_setup("cpu", FP16)
    seen = []
    optimizer.register_step_pre_hook(lambda *_: seen.append(
        torch.stack([p.grad.norm() for p in model.parameters()]).norm().item()))
    train(model, [batch_of(16)], optimizer, scaler, FP16, clip_grad_norm=0.01)
    # Clipping the scaled gradients, then unscaling them, would leave 0.01 / 2**16.
    assert seen == [pytest.approx(0.01, rel=1e-3)], seen


@pytest.mark.parametrize("wrap", [list, generator_of], ids=["list", "generator"])
def test_k_accumulated_micro_batches_step_as_their_whole_batch(wrap):
    whole, whole_optimizer, whole_scaler = linear_setup()
    train(whole, batches_of(24, 48, seed=3), whole_optimizer, whole_scaler)
    model, optimizer, scaler = linear_setup()
    steps = counting_steps(optimizer)
    stats = train(model, wrap(batches_of(8, 48, seed=3)), optimizer, scaler, accum_steps=3)
    assert (len(steps), stats["samples"]) == (2, 48), (steps, stats)
    assert torch.allclose(model.weight, whole.weight, atol=1e-6, rtol=0), "more than rounding"


def test_a_short_last_group_takes_a_step_on_its_own_mean():
    # 5 micro-batches of 8 in groups of 2: 2 + 2 + 1, as batches of 16, 16 and 8.
    whole, whole_optimizer, whole_scaler = linear_setup()
    train(whole, batches_of(16, 40), whole_optimizer, whole_scaler)
    model, optimizer, scaler = linear_setup()
    steps = counting_steps(optimizer)
    train(model, batches_of(8, 40), optimizer, scaler, accum_steps=2)
    assert len(steps) == 3 and torch.allclose(model.weight, whole.weight, atol=1e-6, rtol=0)


def host_syncs(monkeypatch, steps, amp_dtype, make_optimizer):
    """How often train_epoch reads a tensor's value on the host (each read waits for the
    device), over `steps` steps."""
    model, count = nn.Linear(10, 1), [0]
    with monkeypatch.context() as patch:
        for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
            def counting(self, *args, _original=getattr(torch.Tensor, name), **kwargs):
                count[0] += 1
                return _original(self, *args, **kwargs)
            patch.setattr(torch.Tensor, name, counting)
        scaler = torch.amp.GradScaler("cpu", enabled=amp_dtype is FP16)
        train(model, batches_of(4, 4) * steps, make_optimizer(model, lr=0.01), scaler,
              amp_dtype)
    return count[0]


@pytest.mark.parametrize("amp_dtype", [None, BF16, FP16])
def test_a_fused_optimizer_trains_with_one_host_sync_an_epoch_whatever_its_steps(
        amp_dtype, monkeypatch):
    fused = amp_train.make_optimizer
    assert [host_syncs(monkeypatch, n, amp_dtype, fused) for n in (1, 10)] == [1, 1]


def test_a_plain_optimizers_fp16_step_reads_found_inf_on_the_host():
    # README says so: scaler.step() then syncs once a step.
    def plain(model, lr):
        return torch.optim.SGD(model.parameters(), lr)
    with pytest.MonkeyPatch.context() as monkeypatch:
        assert host_syncs(monkeypatch, 10, FP16, plain) == 11


def test_evaluate_gives_the_mean_loss_and_accuracy_in_inference_mode():
    model, seen = nn.Linear(3, 3, bias=False), []
    model.register_forward_hook(lambda module, inputs, output: seen.append(
        (torch.is_inference_mode_enabled(), module.training)))
    with torch.no_grad():
        # It predicts the index of the largest input.
        model.weight.copy_(torch.eye(3) * 2)
    inputs, targets = torch.eye(3).repeat(2, 1), torch.tensor([0, 1, 2, 0, 2, 1])
    batches = [(inputs[:4], targets[:4]), (inputs[4:], targets[4:])]
    result = amp_train.evaluate(model, batches, nn.CrossEntropyLoss(), "cpu", None)
    loss = nn.functional.cross_entropy(model(inputs), targets).item()
    assert result == {"loss": pytest.approx(loss), "accuracy": pytest.approx(4 / 6),
                      "samples": 6}, result
    assert seen[:2] == [(True, False)] * 2, f"(inference mode, training): {seen}"


def test_evaluate_autocasts_as_training_does():
    model, inputs, targets = nn.Linear(64, 8), torch.randn(32, 64), torch.arange(32) % 8
    ce = nn.CrossEntropyLoss()
    bf16 = amp_train.evaluate(model, [(inputs, targets)], ce, CPU, BF16)["loss"]
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        expected = ce(model(inputs), targets).item()
    assert bf16 == expected != amp_train.evaluate(model, [(inputs, targets)], ce, CPU, None)["loss"]


def test_evaluate_of_an_empty_loader_gives_nan():
    result = amp_train.evaluate(nn.Linear(3, 3), [], nn.CrossEntropyLoss(), CPU, None)
    assert math.isnan(result["loss"]) and math.isnan(result["accuracy"]), result


def test_readmes_dict_batch_adapter_trains():
    inputs, targets = batch_of(16)
    user = {"loader": [{"input_ids": inputs[i:i + 8], "labels": targets[i:i + 8]}
                       for i in (0, 8)]}
    exec(re.search(r"`(pairs = .*)`", README).group(1), user)
    model, optimizer, scaler = linear_setup()
    assert train(model, user["pairs"], optimizer, scaler)["samples"] == 16


def not_enough():
    """README's "When train_epoch is not enough": each block run in a namespace of its own."""
    blocks = readme_blocks("## When train_epoch is not enough")
    assert len(blocks) == 2, "a custom Function, two models"
    spaces = [{"torch": torch} for _ in blocks]
    for block, space in zip(blocks, spaces):
        exec(compile(block, "README.md", "exec"), space)
    return spaces


def test_readmes_custom_function_trains_under_bf16_and_fails_undecorated():
    function = not_enough()[0]["MatMul"]

    class Model(nn.Linear):
        def forward(self, x):
            # A bf16 activation and an fp32 weight meet in the Function.
            return self.function.apply(super().forward(x), self.extra)
    model = Model(10, 4)
    model.function, model.extra = function, nn.Parameter(torch.randn(4, 1))
    optimizer, scaler = torch.optim.SGD(model.parameters()), torch.amp.GradScaler("cpu", False)
    stats = train(model, [batch_of(8)], optimizer, scaler, BF16)
    assert math.isfinite(stats["loss"]) and model.extra.grad is not None
    model.function = type("Plain", (torch.autograd.Function,), {
        key: staticmethod(getattr(function, key).__wrapped__) for key in ("forward", "backward")})
    with pytest.raises(RuntimeError, match="dtype"):
        train(model, [batch_of(8)], optimizer, scaler, BF16)


def test_readmes_two_models_loop_is_the_docs_loop():
    def setup():
        torch.manual_seed(1)
        models = nn.Linear(10, 1), nn.Linear(10, 1)
        return (*models, *(torch.optim.SGD(m.parameters(), lr=0.01) for m in models),
                torch.amp.GradScaler("cpu"))
    batches = batches_of(8, 32)
    model0, model1, optimizer0, optimizer1, scaler = setup()
    not_enough()[1]["train_two_models"](model0, model1, optimizer0, optimizer1, batches, MSE,
                                        scaler, "cpu", FP16)
    ref0, ref1, optimizer0, optimizer1, scaler = setup()
    # The torch.amp examples page's loop, on "cpu".
    for input, target in batches:
        optimizer0.zero_grad()
        optimizer1.zero_grad()
        with torch.autocast(device_type="cpu", dtype=torch.float16):
            output0, output1 = ref0(input), ref1(input)
            loss0 = MSE(2 * output0 + 3 * output1, target)
            loss1 = MSE(3 * output0 - 5 * output1, target)
        scaler.scale(loss0).backward(retain_graph=True)
        scaler.scale(loss1).backward()
        scaler.unscale_(optimizer0)
        scaler.step(optimizer0)
        scaler.step(optimizer1)
        scaler.update()
    assert torch.equal(model0.weight, ref0.weight) and torch.equal(model1.weight, ref1.weight)


# ---------- precision and device

def fake_cpu(monkeypatch, bf16):
    """Makes cpu_bf16() say `bf16`: "AMX", "AVX512-BF16" or "none"."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: bf16 == "AMX")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16 != "none")


def test_cpu_bf16_reads_what_proc_cpuinfo_lists():
    flags = pathlib.Path("/proc/cpuinfo").read_text().split("\nflags")[1].split("\n")[0].split()
    expected = "AVX512-BF16" if "avx512_bf16" in flags else "none"
    assert amp_train.cpu_bf16() == ("AMX" if "amx_tile" in flags else expected), flags


@pytest.mark.parametrize("bf16,name,example,precision,note", [
    ("none", "auto", "resnet", "fp32", "note: auto trains in fp32: this CPU has no bf16"),
    ("none", "auto", "linear", "fp32", "note: auto trains in fp32"),
    ("none", "bf16", "resnet", "bf16", "note: bf16 is emulated here, slower than fp32"),
    ("none", "auto", "memory", "bf16", "note: bf16 is emulated here"),
    ("none", "fp32", "resnet", "fp32", None), ("none", "fp32", "memory", "fp32", None),
    ("AVX512-BF16", "auto", "resnet", "bf16", None), ("AMX", "auto", "linear", "bf16", None),
    ("AMX", "bf16", "memory", "bf16", None),
    ("AMX", "fp16", "resnet", "fp16", None), ("none", "fp16", "memory", "fp16", None)])
def test_auto_precision_and_the_note_that_says_what_it_costs(bf16, name, example, precision,
                                                            note, monkeypatch):
    fake_cpu(monkeypatch, bf16)
    chosen, notes = amp_train.resolve_precision(name, CPU, example)
    assert chosen == precision and len(notes) == bool(note), (chosen, notes)
    assert note is None or notes[0].startswith(note), notes


@pytest.mark.parametrize("example", ["resnet", "memory"])
def test_auto_precision_on_cuda_is_fp16_without_a_note(example):
    assert amp_train.resolve_precision("auto", torch.device("cuda"), example) == ("fp16", [])


def fake_gpus(monkeypatch, count, bf16=True):
    """Makes torch see `count` GPUs; returns the list of set_device's calls."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    current = []
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[-1])
    # is_bf16_supported() asks the current GPU, which must be this process's. A V100 or a T4
    # "supports" bf16 by emulation only, which counts as no support.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: bf16 and len(current) == 1)
    return current


def test_auto_device_is_the_cpu_where_no_gpu_is_visible(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert amp_train.resolve_device("auto") == CPU


def test_device_cuda_without_a_gpu_is_refused_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "use --device cpu" in run_bad(["--device", "cuda"], capsys)


def test_under_torchrun_process_k_takes_gpu_k_with_cudnn_benchmark(monkeypatch):
    current = fake_gpus(monkeypatch, 2)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert amp_train.resolve_device("cuda") == torch.device("cuda", 1) and current == [1]
    assert torch.backends.cudnn.benchmark, "cuDNN would not time its algorithms"
    assert amp_train.resolve_precision("bf16", torch.device("cuda", 1), "resnet")[0] == "bf16"


def test_more_processes_than_gpus_are_refused(monkeypatch, capsys):
    fake_gpus(monkeypatch, 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert "3 processes for 2 GPUs: start at most 2" in run_bad(["--device", "cuda"], capsys)


def test_bf16_on_a_gpu_without_bf16_is_refused(monkeypatch, capsys):
    fake_gpus(monkeypatch, 1, bf16=False)
    argv = ["--device", "cuda", "--precision", "bf16"]
    assert "use --precision fp16" in run_bad(argv, capsys)


# ---------- models and data

def zero_gradient_share(model):
    """The share of the weights that one 32x32 batch gives an exactly zero gradient."""
    nn.functional.cross_entropy(model(torch.randn(8, 3, 32, 32)), torch.arange(8)).backward()
    zeros = sum((p.grad == 0).sum() for p in model.parameters())
    return zeros.item() / sum(p.numel() for p in model.parameters())


def test_resnet18_has_the_cifar_stem_and_every_weight_learns(resnet18):
    torch.manual_seed(0)
    model = amp_train.build_example(amp_train.parse_args(RESNET), CPU)[0]
    assert model.conv1.kernel_size == (3, 3) and isinstance(model.maxpool, nn.Identity)
    assert model.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    assert zero_gradient_share(model) < 0.01, "over 1% of the weights got no gradient"


def test_the_posts_imagenet_stem_leaves_62_percent_of_the_weights_without_a_gradient():
    torch.manual_seed(0)
    assert 0.60 < zero_gradient_share(RESNET18(imagenet_stem=True)) < 0.65


@pytest.mark.parametrize("name,size", [("squeezenet1_1", 224), ("inception_v3", 299),
                                       ("vit_h_14", 224), ("efficientnet_b7", 600)])
def test_a_torchvision_classifier_is_built_for_10_classes_at_its_weights_size(name, size,
                                                                             monkeypatch):
    import torchvision
    built = []

    def get_model(name, **kwargs):
        built.append(kwargs)
        return name
    monkeypatch.setattr(torchvision.models, "get_model", get_model)
    assert amp_train.image_classifier(name) == (name, size)
    assert built[0]["num_classes"] == 10, built


@pytest.mark.parametrize("name,stem", [("resnet18", 3), ("resnet18-imagenet", 7)])
def test_the_memory_examples_resnet18s_take_cifar_sized_images(name, stem, resnet18):
    model, side = amp_train.image_classifier(name)
    assert (model.conv1.kernel_size[0], model.fc.out_features, side) == (stem, 10, 32)


@pytest.mark.parametrize("name", ["googlenet", "inception_v3"])
def test_torchvisions_models_with_auxiliary_logits_train_on_a_plain_loss(name):
    model, size = amp_train.image_classifier(name)
    outputs = model.train()(torch.randn(2, 3, size, size))
    assert isinstance(outputs, torch.Tensor) and outputs.shape == (2, 10), type(outputs)


def test_a_model_name_torchvision_does_not_list_ends_in_one_line_that_says_where_names_are(
        capsys):
    err = run_bad(["--device", "cpu", "--example", "memory", "--model", "resnet19"], capsys)
    assert "torchvision.models.list_models()" in err, err


def write_tiny_cifar10(root, per_batch=2):
    """A CIFAR-10 folder in the real format (pickled uint8 rows); image i is all value i."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for b, name in enumerate([f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]):
        values = [b * per_batch + i for i in range(per_batch)]
        data = np.stack([np.full(3 * 32 * 32, v, dtype=np.uint8) for v in values])
        with open(folder / name, "wb") as f:
            pickle.dump({"data": data, "labels": [v % 10 for v in values]}, f)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"class{i}" for i in range(10)]}, f)


def test_cifar10_is_read_from_its_folder_in_torchvisions_format(tmp_path, monkeypatch):
    import torchvision.datasets.cifar as cifar
    write_tiny_cifar10(tmp_path)
    monkeypatch.setattr(cifar, "check_integrity", lambda *a, **k: True)
    args = amp_train.parse_args(["--data-root", str(tmp_path), "--batch-size", "5"])
    _, _, train_loader, test_loader = amp_train.build_example(args, CPU)
    images, labels = next(iter(test_loader))
    mean, std = torch.tensor(amp_train.CIFAR10_MEAN), torch.tensor(amp_train.CIFAR10_STD)
    # test_batch holds images 10 and 11.
    expected = ((torch.tensor([10.0, 11.0]) / 255)[:, None] - mean) / std
    assert labels.tolist() == [0, 1] and torch.allclose(images[:, :, 5, 5], expected, atol=1e-6)
    assert sorted(int(y) for _, batch in train_loader for y in batch) == list(range(10))


def test_without_cifar10_and_offline_one_line_says_what_to_do(tmp_path, monkeypatch, capsys):
    import torchvision.datasets.cifar as cifar

    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")
    monkeypatch.setattr(cifar, "download_and_extract_archive", offline)
    err = run_bad(["--device", "cpu", "--data-root", str(tmp_path / "data")], capsys)
    assert "nor online: put cifar-10-python.tar.gz there, or use --data synthetic" in err, err


def loaded(n, batch_size, epoch=0, processes=1, monkeypatch=None, **kwargs):
    """Each process's batches of samples 0..n-1 (their targets), and its len()."""
    shares = []
    for rank in range(processes):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(processes))
        loader = amp_train.DeviceLoader(torch.arange(n), torch.arange(n), batch_size, CPU,
                                        **kwargs)
        loader.epoch = epoch
        shares.append(([targets.tolist() for _, targets in loader], len(loader)))
    return shares


def test_training_shares_are_as_many_whole_batches_for_every_process(monkeypatch):
    shares = loaded(23, 4, 5, 3, monkeypatch, shuffle=True)
    assert [len(batches) for batches, _ in shares] == [length for _, length in shares] == [1] * 3
    assert {len(batch) for batches, _ in shares for batch in batches} == {4}
    seen = [i for batches, _ in shares for batch in batches for i in batch]
    assert len(seen) == len(set(seen)), f"a sample went to two processes: {shares}"


def test_every_process_tests_every_sample_once(monkeypatch):
    shares = loaded(23, 4, 0, 3, monkeypatch)
    assert all(sorted(i for batch in batches for i in batch) == list(range(23))
               for batches, _ in shares), shares
    assert [len(batches) for batches, _ in shares] == [length for _, length in shares] == [6] * 3


def test_the_training_order_is_drawn_from_the_seed_and_the_epoch(monkeypatch):
    def order(**kwargs):
        return loaded(32, 8, monkeypatch=monkeypatch, shuffle=True, **kwargs)[0][0]
    assert order(epoch=1) == order(epoch=1), "the same (seed, epoch), another order"
    assert order(epoch=1) != order(epoch=2) and order(seed=1) != order(seed=2)


def test_max_batches_cuts_an_epoch_short(monkeypatch):
    assert loaded(32, 4, monkeypatch=monkeypatch, shuffle=True, max_batches=3)[0][1] == 3
    assert len(loaded(32, 4, monkeypatch=monkeypatch, max_batches=2)[0][0]) == 2


def test_a_batch_larger_than_a_processs_training_images_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    args = amp_train.parse_args(RESNET + ["--batch-size", "2048"])
    with pytest.raises(amp_train.UsageError, match="more than each process's 1250 training"):
        amp_train.build_example(args, CPU)


def test_crops_and_flips_are_torchvisions_and_every_process_draws_its_own(monkeypatch):
    import torchvision.transforms.v2.functional as TF
    images = torch.randint(0, 256, (64, 3, 32, 32), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(0))
    out = amp_train.random_crop_flip(images, torch.Generator().manual_seed(1))
    flips = {False: lambda image: image, True: TF.horizontal_flip}
    windows = []
    # Each output is some window of torchvision's padded image, flipped or not.
    for image, augmented in zip(images, out):
        padded = TF.pad(image, [4])
        windows.append(next(((dy, dx, flip) for dy in range(9) for dx in range(9)
                             for flip in flips
                             if torch.equal(flips[flip](TF.crop(padded, dy, dx, 32, 32)),
                                            augmented)), None))
    assert None not in windows, f"image {windows.index(None)} is no window of its own"
    assert {dy for dy, _, _ in windows} == set(range(9)) == {dx for _, dx, _ in windows}
    assert {flip for _, _, flip in windows} == {False, True}, windows
    augment = amp_train.cifar10_transform(CPU, True)
    crops = []
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        loader = amp_train.DeviceLoader(images[:1].repeat(16, 1, 1, 1), torch.zeros(16), 8,
                                        CPU, augment, True)
        crops.append(next(iter(loader))[0])
    assert not torch.equal(*crops), "two processes cropped alike"


# ---------- the examples' epoch loop

@pytest.fixture
def spy(monkeypatch):
    """Records each train_epoch call: its batches, kwargs, output dtypes, its first weight
    before, and the gradient norm that each step saw."""
    calls, real = [], amp_train.train_epoch

    def recording(model, loader, optimizer, *args, **kwargs):
        call = {"batches": [], "kwargs": kwargs, "dtypes": set(), "norms": [], "model": model,
                "weight": next(model.parameters()).detach().clone()}
        hooks = [model.register_forward_hook(lambda m, i, out: call["dtypes"].add(out.dtype)),
                 optimizer.register_step_pre_hook(lambda *_: call["norms"].append(
                     torch.stack([p.grad.norm() for p in model.parameters()]).norm().item()))]

        def recorded():
            for inputs, targets in loader:
                call["batches"].append((inputs.clone(), targets.clone()))
                yield inputs, targets
        call["stats"] = real(model, recorded(), optimizer, *args, **kwargs)
        for hook in hooks:
            hook.remove()
        calls.append(call)
        return call["stats"]
    monkeypatch.setattr(amp_train, "train_epoch", recording)
    return calls


@pytest.mark.parametrize("precision,dtype,scale", [
    ("fp32", torch.float32, "1"), ("bf16", BF16, "1"), ("fp16", FP16, "65536")])
def test_the_linear_example_trains_on_its_one_batch_in_each_precision(precision, dtype, scale,
                                                                      spy, capsys):
    ok(LINEAR + ["--epochs", "20", "--precision", precision])
    out = capsys.readouterr().out
    losses = re.findall(r"^epoch +\d+/20 \| train loss ([\d.]+)", out, re.M)
    assert len(losses) == 20 == len(spy) and float(losses[-1]) < float(losses[0]) - 0.1, losses
    assert [len(call["batches"]) for call in spy] == [1] * 20, "one fixed batch"
    assert spy[0]["batches"][0][0].shape == (128, 10) and spy[0]["dtypes"] == {dtype}
    assert f"| precision {precision} |" in out and f"| scale {scale} |" in out, out


def test_the_resnet_example_prints_a_fixed_epoch_line_with_units(capsys):
    ok(RESNET + ["--epochs", "2", "--lr", "0.05"])
    out = capsys.readouterr().out
    line = (r"^epoch 2/2 \| train loss [\d.]+ \| test loss [\d.]+ \| test acc +[\d.]+% \| "
            r"lr 0\.05 \| scale 1 \| skipped 0 \| \d+ samples/s \| [\d.]+ s$")
    assert re.search(line, out, re.M) and "| data synthetic | batch 4 |" in out, out


def test_a_long_epoch_prints_how_far_it_got(monkeypatch, capsys):
    assert 0 < amp_train.PROGRESS_SECONDS <= 15, "silent for over 15 s"
    monkeypatch.setattr(amp_train, "PROGRESS_SECONDS", 0)
    ok(RESNET + ["--epochs", "1", "--max-steps", "3"])
    lines = re.findall(r"^  epoch 1: batch (\d)/3 \| [\d.]+ s each$", capsys.readouterr().out,
                       re.M)
    assert lines == ["1", "2", "3"], lines


def test_batch_size_sets_every_batch_of_both_examples(spy):
    for argv in (LINEAR, RESNET):
        ok(argv + ["--epochs", "1", "--batch-size", "6"])
    assert len(spy) == 2 and {len(y) for call in spy for _, y in call["batches"]} == {6}


def test_lr_sets_the_step_size(spy):
    for lr in ("0.01", "0.04"):
        ok(LINEAR + ["--epochs", "1", "--precision", "fp32", "--lr", lr])
    moves = [(next(call["model"].parameters()) - call["weight"]).abs().sum().item()
             for call in spy]
    assert moves[1] == pytest.approx(4 * moves[0], rel=1e-4), moves


def test_max_steps_and_accum_steps_set_the_steps_and_test_batches(spy, monkeypatch, capsys):
    tested, evaluate = [], amp_train.evaluate

    def counting(model, loader, *args):
        tested.append(len(loader))
        return evaluate(model, loader, *args)
    monkeypatch.setattr(amp_train, "evaluate", counting)
    ok(RESNET + ["--epochs", "1", "--max-steps", "3", "--accum-steps", "2"])
    assert (len(spy[0]["batches"]), len(spy[0]["norms"]), tested) == (6, 3, [3])
    assert "| batch 4 | accum 2 |" in capsys.readouterr().out


def test_max_steps_0_trains_whole_epochs(spy):
    ok(RESNET + ["--epochs", "1", "--max-steps", "0", "--batch-size", "2000"])
    assert len(spy[0]["batches"]) == 5, "10,000 synthetic images in batches of 2000"


@pytest.mark.parametrize("clip,norms", [("0", None), ("0.5", 0.5)])
def test_clip_grad_norm_clips_each_step_and_0_is_off(clip, norms, spy):
    ok(LINEAR + ["--epochs", "3", "--precision", "bf16", "--clip-grad-norm", clip])
    seen = [norm for call in spy for norm in call["norms"]]
    if norms is None:
        assert min(seen) > 0.5, "the norm is about 1 unclipped"
    else:
        assert seen == pytest.approx([norms] * 3, rel=1e-3), seen


def test_the_seed_sets_the_weights_and_the_data_and_epochs_reshuffle(spy):
    for seed in ("0", "0", "1"):
        ok(RESNET + ["--epochs", "2", "--max-steps", "1", "--seed", seed])
    first = [spy[i]["batches"][0][0] for i in (0, 2, 4)]
    assert torch.equal(spy[0]["weight"], spy[2]["weight"]) and torch.equal(first[0], first[1])
    assert not torch.equal(spy[0]["weight"], spy[4]["weight"]) and not torch.equal(*first[::2])
    assert not torch.equal(spy[0]["batches"][0][1], spy[1]["batches"][0][1]), "epochs alike"


def test_training_images_are_cropped_and_flipped(spy):
    ok(RESNET + ["--epochs", "1", "--max-steps", "1"])
    plain = amp_train.DeviceLoader(*amp_train.synthetic_cifar10(10_000), 4, CPU,
                                   amp_train.cifar10_transform(CPU, False), shuffle=True)
    assert not torch.equal(spy[0]["batches"][0][0], next(iter(plain))[0]), "not cropped"


def test_the_lr_falls_tenfold_every_10_epochs_and_a_resume_recomputes_it(monkeypatch, tmp_path,
                                                                         capsys):
    monkeypatch.setattr(amp_train, "LR_STEP_EPOCHS", 2)
    run = RESNET + ["--max-steps", "1", "--run-dir", str(tmp_path)]
    ok(run + ["--epochs", "3"])
    ok(run + ["--epochs", "5", "--resume", "--lr", "0.5"])
    assert lrs_of(capsys.readouterr().out) == pytest.approx([0.01, 0.01, 0.001, 0.05, 0.005])
    assert load(tmp_path / "checkpoint.pt")["args"]["lr"] == 0.5, "the lr now in use"


def test_the_linear_examples_lr_never_falls(capsys):
    ok(LINEAR + ["--epochs", "12"])
    assert lrs_of(capsys.readouterr().out) == [0.01] * 12


def test_a_run_whose_weights_turn_nan_stops_and_keeps_its_last_sound_epoch(tmp_path, capsys):
    argv = LINEAR + ["--precision", "fp32", "--lr", "1e20", "--epochs", "5", "--run-dir"]
    assert amp_train.main(argv + [str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert re.fullmatch(rf"error: epoch 2: the model's \w+ holds inf/NaN; "
                        rf"{re.escape(str(tmp_path))} holds epoch 1; lower --lr\n", err), err
    assert "Infinity" not in (tmp_path / "metrics.jsonl").read_text(), "JSON has no inf"
    assert [r["train_loss"] for r in read_metrics(tmp_path / "metrics.jsonl")][1:] == [None]
    assert load(tmp_path / "checkpoint.pt")["epoch"] == 1


def test_an_epoch_with_a_nan_loss_and_sound_weights_is_saved_and_training_goes_on(
        tmp_path, monkeypatch):
    evaluate, calls = amp_train.evaluate, []

    def nan_once(*args):
        calls.append(1)
        return {**evaluate(*args), "loss": math.nan if len(calls) == 1 else 1.0}
    monkeypatch.setattr(amp_train, "evaluate", nan_once)
    ok(RESNET + ["--epochs", "2", "--run-dir", str(tmp_path)])
    assert [r["test_loss"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [None, 1.0]
    assert load(tmp_path / "checkpoint.pt")["epoch"] == 2


def test_nan_batchnorm_statistics_stop_the_run(monkeypatch, tmp_path, capsys):
    # The scaler skips the inf batch's step, but its forward pass put inf/NaN into
    # BatchNorm's running statistics: that epoch is not saved, and the run cannot go on.
    calls, train_epoch = [], amp_train.train_epoch

    def second_epoch_has_an_inf_batch(model, loader, *args, **kwargs):
        calls.append(1)
        images, labels = next(iter(loader))
        batch = [(torch.full_like(images, math.inf), labels)]
        return train_epoch(model, batch if len(calls) == 2 else loader, *args, **kwargs)
    monkeypatch.setattr(amp_train, "train_epoch", second_epoch_has_an_inf_batch)
    argv = RESNET + ["--batch-size", "2", "--epochs", "3", "--precision", "fp16", "--run-dir"]
    assert amp_train.main(argv + [str(tmp_path)]) == 1
    assert f"epoch 2: the model's 1.running_mean holds inf/NaN; {tmp_path} holds epoch 1" in (
        capsys.readouterr().err)


def test_a_loss_scale_that_collapses_stops_the_run(monkeypatch, capsys):
    class Eager(amp_train.SkipCountingScaler):
        def __init__(self, device_type, enabled):
            super().__init__(device_type, enabled=enabled, growth_interval=1)
    monkeypatch.setattr(amp_train, "SkipCountingScaler", Eager)
    assert amp_train.main(LINEAR_FP16 + ["--epochs", "100", "--lr", "1e38"]) == 1
    err = capsys.readouterr().err
    assert re.search(r"epoch \d+: the loss scale fell to 7\.6\d*e-06: inf/NaN gradients", err)


@pytest.mark.parametrize("kind", [{"foreach": False}, {"foreach": True}, {"fused": True}])
@pytest.mark.parametrize("make", [torch.optim.SGD, torch.optim.Adam])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_the_skip_counting_scaler_counts_a_skipped_step_once(make, kind, device, monkeypatch):
    # It reads the private _found_inf_per_device: this pins what that gives for each kind of
    # optimizer, and for a model on two devices (each finding the inf).
    model, optimizer, _ = linear_setup(device, optimizer=make, **kind)
    scaler = amp_train.SkipCountingScaler(device)
    found = scaler._found_inf_per_device
    monkeypatch.setattr(scaler, "_found_inf_per_device",
                        lambda opt: dict(enumerate(list(found(opt).values()) * 2)))
    batches = [batch_of(8), with_inf(batch_of(8)), batch_of(8)]
    train(model, batches, optimizer, scaler, FP16, device)
    assert int(scaler.skipped_steps) == 1 and scaler.get_scale() == 2.0**15, scaler.skipped_steps


def test_the_skip_counting_scaler_counts_nothing_when_disabled():
    model, optimizer, _ = linear_setup()
    scaler = amp_train.SkipCountingScaler("cpu", enabled=False)
    train(model, [with_inf(batch_of(8))], optimizer, scaler)
    assert scaler.skipped_steps == 0


def test_the_fp16_epoch_line_counts_the_skipped_steps(monkeypatch, capsys):
    real = amp_train.train_epoch

    def inf_first(model, loader, *args, **kwargs):
        return real(model, [with_inf(batch) for batch in loader], *args, **kwargs)
    monkeypatch.setattr(amp_train, "train_epoch", inf_first)
    ok(LINEAR_FP16 + ["--epochs", "2"])
    assert re.findall(r"skipped (\d+)", capsys.readouterr().out) == ["1", "1"]


# ---------- the memory measurement

@pytest.mark.parametrize("amp_dtype,activation_bytes,weight_copy_bytes", [
    # The input x, 8 floats; the weight itself is not counted.
    (None, 2 * 4 * 4, 0),
    # bf16 copies of x and of the weight.
    (BF16, 2 * 4 * 2, 3 * 4 * 2)])
def test_count_saved_tensors_tells_activations_from_autocasts_weight_copies(
        amp_dtype, activation_bytes, weight_copy_bytes):
    model = nn.Linear(4, 3, bias=False)
    with amp_train.count_saved_tensors(model) as saved:
        with torch.autocast("cpu", dtype=amp_dtype, enabled=amp_dtype is not None):
            model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert saved == {"activation_bytes": activation_bytes, "weight_copy_bytes": weight_copy_bytes}


class PackedGRU(nn.Module):
    """Token ids (their length last) to 10 classes: an embedding, then a bidirectional GRU on
    packed sequences, as a new user's model may be."""

    def __init__(self):
        super().__init__()
        self.embedding, self.gru = nn.Embedding(100, 32), nn.GRU(32, 16, bidirectional=True)
        self.head = nn.Linear(32, 10)

    def forward(self, inputs):
        tokens, lengths = inputs[:, :-1], inputs[:, -1]
        packed = nn.utils.rnn.pack_padded_sequence(self.embedding(tokens), lengths,
                                                   batch_first=True, enforce_sorted=False)
        return self.head(torch.cat(list(self.gru(packed)[1]), dim=1))


def test_an_activation_that_began_at_a_weight_is_no_weight_copy():
    # The packed embedding output is an activation whose autograd history starts at
    # embedding.weight: fp32 makes no weight copies, whatever the model.
    torch.manual_seed(0)
    inputs = torch.randint(1, 100, (16, 21))
    inputs[:, -1] = torch.randint(5, 21, (16,))
    model = PackedGRU()
    with amp_train.count_saved_tensors(model) as saved:
        nn.functional.cross_entropy(model(inputs), torch.arange(16) % 10).backward()
    assert saved["weight_copy_bytes"] == 0 < saved["activation_bytes"], saved


def test_bf16_saves_half_the_activations_of_fp32():
    batch = torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,))
    fp32, bf16 = (amp_train.measure_training(small_model(), batch, nn.CrossEntropyLoss(), CPU,
                                             dtype, 3, "test", print) for dtype in (None, BF16))
    assert bf16["activation_bytes"] / fp32["activation_bytes"] < 0.6, (bf16, fp32)
    assert fp32["weight_copy_bytes"] == 0 < bf16["weight_copy_bytes"] and "peak_bytes" not in bf16
    assert 0 < bf16["fastest_step_seconds"] <= bf16["median_step_seconds"]
    assert bf16["samples_per_second"] == pytest.approx(8 / bf16["median_step_seconds"])


def test_measure_amp_takes_a_device_name_and_logs_when_each_precision_starts():
    heard = []
    measured = amp_train.measure_amp(nn.Linear(10, 1), batch_of(16), MSE, "cpu", "bf16", 2,
                                     "mine", heard.append)
    assert heard == ["measuring fp32: 3 + 2 steps", "measuring bf16: 3 + 2 steps"], heard
    assert (measured["name"], measured["batch"], measured["precision"]) == ("mine", 16, "bf16")
    assert set(measured["fp32"]) == set(measured["bf16"]) >= {"samples_per_second"}


def test_readmes_own_model_block_runs_as_shown_and_prints_the_table_and_verdict(capsys,
                                                                                monkeypatch):
    block = readme_blocks("## What AMP buys on your model")[0]
    assert len(block.splitlines()) <= 5, block
    monkeypatch.setattr(amp_train, "measure_amp",
                        functools.partial(amp_train.measure_amp, steps=2))
    exec(compile(block, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert re.search(r"^samples_per_second +[\d.]+ /s +[\d.]+ /s +[\d.]+$", out, re.M), out
    assert re.search(r"^verdict: .*: bf16 steps take [\d.]+x fp32's time", out, re.M), out


def test_slow_steps_print_how_many_of_how_many_are_done(monkeypatch):
    monkeypatch.setattr(amp_train, "PROGRESS_SECONDS", 0)
    heard = []
    amp_train.measure_amp(nn.Linear(10, 1), batch_of(16), MSE, CPU, "bf16", 2, "m", heard.append)
    steps = [line for line in heard if line.startswith("  bf16: step")]
    assert [re.fullmatch(r"  bf16: step (\d)/5 \| [\d.]+ s each", line).group(1)
            for line in steps] == ["1", "2", "3", "4", "5"], heard


def test_the_memory_example_prints_its_header_table_and_verdict(capsys):
    ok(["--device", "cpu", "--example", "memory", "--model", "linear", "--steps", "2"])
    out = capsys.readouterr().out
    assert out.startswith("memory | torch ") and "| model linear | batch 128\n" in out, out
    for row in (r" +fp32 +bf16 +bf16/fp32", r"activation_bytes +[\d.]+ MiB +[\d.]+ MiB +0\.\d\d",
                r"weight_copy_bytes +0\.00 MiB +[\d.]+ MiB +n/a",
                r"samples_per_second +[\d.]+ /s +[\d.]+ /s +[\d.]+",
                r"fastest_step_seconds +[\d.]+ ms +[\d.]+ ms +[\d.]+",
                r"verdict: linear, batch 128, cpu \(bf16: .*\), torch .*: bf16 steps take "
                r"[\d.]+x fp32's time, 0\.\d\dx its activation memory; AMP is (not )?faster here"):
        assert re.search(f"^{row}$", out, re.M), (row, out)


@pytest.mark.parametrize("fp32,amp,noisy,verdict", [
    ((1, 1.2), (.5, .6), False, "faster"), ((1, 1.2), (.5, .7), True, "faster"),
    ((1, 1.4), (.5, .6), True, "faster"), ((1, 1.2), (1.3, 1.4), False, "not faster")])
def test_the_verdict_and_a_warning_when_the_median_step_is_far_from_the_fastest(fp32, amp, noisy,
                                                                              verdict):
    fp32, amp = ({"activation_bytes": 1, "median_step_seconds": median,
                  "fastest_step_seconds": low}
                 for low, median in (fp32, amp))
    lines = amp_train.amp_report({"name": "m", "batch": 1, "device": "cpu", "precision": "bf16",
                                  "fp32": fp32, "bf16": amp})
    assert lines[-1 - noisy].endswith(f"; AMP is {verdict} here"), lines
    assert lines[-1].startswith("warning: noisy timings") == noisy, lines


@pytest.mark.parametrize("model,stem", [("linear", None), ("resnet18", 3),
                                        ("resnet18-imagenet", 7)])
def test_the_memory_examples_own_models_keep_their_meaning(model, stem, monkeypatch, resnet18):
    built = []

    def measure(model, batch, *args):
        built.append((model, batch))
        return {label: {"activation_bytes": 1, "median_step_seconds": 1,
                        "fastest_step_seconds": 1} for label in ("fp32", "bf16")} | {
            "name": "m", "batch": 1, "device": "cpu", "precision": "bf16"}
    monkeypatch.setattr(amp_train, "measure_amp", measure)
    ok(["--device", "cpu", "--example", "memory", "--model", model, "--precision", "bf16"])
    (built_model, (inputs, _)), = built
    conv1 = getattr(built_model, "conv1", None)
    assert (conv1 and conv1.kernel_size[0]) == stem, built_model
    assert inputs.shape[1:] == ((10,) if stem is None else (3, 32, 32)), inputs.shape


def test_the_memory_example_measures_a_torchvision_model_at_its_size(capsys):
    ok(["--device", "cpu", "--example", "memory", "--model", "squeezenet1_1", "--batch-size",
        "2", "--steps", "1", "--precision", "bf16"])
    out = capsys.readouterr().out
    assert "| model squeezenet1_1 | batch 2" in out and "verdict: squeezenet1_1, batch 2" in out


def test_a_batch_of_one_on_1x1_maps_asks_for_a_larger_batch(capsys, resnet18):
    argv = ["--device", "cpu", "--example", "memory", "--model", "resnet18-imagenet",
            "--batch-size", "1"]
    assert "raise --batch-size" in run_bad(argv, capsys)


# ---------- the run folder

class Grows(amp_train.SkipCountingScaler):
    """A scaler whose scale grows every step from 16 (16, 32, 64...): one not restored shows."""

    def __init__(self, device_type, enabled):
        super().__init__(device_type, 16.0, growth_interval=1, enabled=enabled)


def untimed(path):
    return [{k: v for k, v in r.items() if "second" not in k} for r in read_metrics(path)]


@pytest.mark.parametrize("example,epochs,split", [(RESNET, 3, 2), (LINEAR_FP16, 6, 3)])
def test_a_resumed_run_ends_bit_identical_to_an_uninterrupted_one(example, epochs, split,
                                                                   tmp_path, capsys,
                                                                   monkeypatch):
    monkeypatch.setattr(amp_train, "SkipCountingScaler", Grows)
    a, b = tmp_path / "a", tmp_path / "b"
    ok(example + ["--epochs", str(epochs), "--run-dir", str(a)])
    ok(example + ["--epochs", str(split), "--run-dir", str(b)])
    # A later epoch, torn, foreign: the checkpoint's lines win.
    with open(b / "metrics.jsonl", "a") as f:
        f.write('{"example": "linear", "epoch": 3}\n{"example": "lin\n[1, 2]\n{"epoch": NaN}\n')
    ok(example + ["--epochs", str(epochs), "--run-dir", str(b), "--resume"])
    assert f"resumed from {b} after epoch {split}" in capsys.readouterr().out
    a_state, b_state = load(a / "checkpoint.pt"), load(b / "checkpoint.pt")
    assert a_state["loss_scale"] == (1024.0 if example is LINEAR_FP16 else 1.0), a_state
    for key in ("epoch", "loss_scale", "growth_tracker"):
        assert a_state[key] == b_state[key], key
    assert all(torch.equal(a_state["model"][k], b_state["model"][k]) for k in a_state["model"])
    assert untimed(a / "metrics.jsonl") == untimed(b / "metrics.jsonl")


def test_each_write_is_fsynced_then_renamed_before_the_first_epoch_and_after_each(tmp_path,
                                                                                monkeypatch):
    calls, fsync, replace = [], os.fsync, os.replace

    def fsyncing(fd):
        calls.append("fsync")
        fsync(fd)

    def renaming(source, target):
        calls.append(pathlib.Path(target).name)
        replace(source, target)
    monkeypatch.setattr(os, "fsync", fsyncing)
    monkeypatch.setattr(os, "replace", renaming)
    ok(LINEAR_FP16 + ["--epochs", "2", "--run-dir", str(tmp_path)])
    assert calls == ["fsync", "checkpoint.pt", "fsync", "metrics.jsonl"] * 3, calls
    assert sorted(files_of(tmp_path)) == ["checkpoint.pt", "metrics.jsonl"], "nothing else"
    state = load(tmp_path / "checkpoint.pt")
    assert (state["epoch"], state["loss_scale"], state["args"]["precision"]) == (2, 65536.0, "fp16")


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"),
                                   OSError(1, "Operation not permitted")])
def test_a_write_that_fails_ends_in_one_line_and_changes_no_file(error, tmp_path, monkeypatch,
                                                                 capsys):
    ok(LINEAR_FP16 + ["--epochs", "1", "--run-dir", str(tmp_path)])
    before = files_of(tmp_path)
    real = os.fsync

    def disk_full(fd):
        os.write(fd, b"half a file")
        raise error
    monkeypatch.setattr(os, "fsync", disk_full)
    argv = LINEAR_FP16 + ["--epochs", "3", "--run-dir", str(tmp_path), "--resume"]
    err = run_bad(argv, capsys)
    assert error.strerror in err and err.endswith(f"{tmp_path} holds epoch 1\n"), err
    assert "epoch 2/3" not in capsys.readouterr().out, "it failed before training"
    monkeypatch.setattr(os, "fsync", real)
    assert files_of(tmp_path) == before and not list(tmp_path.glob("*.tmp")), "a file changed"


def saved_state(tmp_path):
    """The checkpoint of a one-epoch fp16 linear run, as save() wrote it."""
    ok(LINEAR_FP16 + ["--epochs", "1", "--run-dir", str(tmp_path)])
    return load(tmp_path / "checkpoint.pt")


def edited(state, edits):
    """`state` with each key set to its value ("args/lr" sets args' lr; None removes it)."""
    for key, value in edits.items():
        where, _, key = key.rpartition("/")
        target = state[where] if where else state
        target[key] = value
        if value is None:
            target.pop(key)
    return state


def nested(depth, reused=1):
    """Lists nested `depth` deep; reused=2 makes [[x, x], [x, x]]: 2**depth in a few bytes."""
    return functools.reduce(lambda inner, _: [inner] * reused, range(depth), [])


class CreatesAFile:
    """Unpickled, this creates a file, as a malicious checkpoint could."""
    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path("pwned"),)


# One string of 600,000 characters, twice: 1.2 MB of metrics in a 0.6 MB file.
LONG_LINE = '{"x": "' + "x" * 600_000 + '"}\n'
# Each way to make a checkpoint's fields wrong, and the words of the line that refuses it.
BAD_FIELDS = [
    ({"format": "amp_train checkpoint 5"}, "damaged, or of another version"),
    ({"format": None}, "KeyError: 'format'"),
    ({"job": 7}, "damaged"),
    ({"epoch": 0}, "damaged"), ({"epoch": True}, "damaged"), ({"epoch": math.inf}, "damaged"),
    ({"metrics": ["garbage"]}, "damaged"),
    ({"metrics": ["x\n"]}, "JSONDecodeError"),
    ({"metrics": ['{"a": 1}\n{"b": 2}\n']}, "damaged"),
    ({"metrics": ["[1, 2]\n"]}, "damaged"),
    ({"metrics": ['{"\u00e9": 1}\n']}, "damaged"),
    ({"metrics": ["\ud800\n"]}, "damaged"),
    ({"metrics": [1]}, "TypeError"),
    ({"metrics": nested(400)}, "AttributeError"),
    ({"metrics": ["[" * 100_000 + "]" * 100_000 + "\n"]}, "RecursionError"),
    ({"metrics": [LONG_LINE, LONG_LINE], "epoch": 2}, "damaged"),
    ({"args": {"lr": nested(60, 2)}}, "damaged"),
    ({"loss_scale": "65536"}, "TypeError"), ({"loss_scale": 1e-300}, "damaged"),
    ({"loss_scale": math.nan}, "damaged"),
    ({"growth_tracker": 2000}, "damaged"), ({"growth_tracker": -1}, "damaged"),
    ({"model": None}, "KeyError: 'model'"),
    ({"model/weight": torch.full((1, 10), math.nan)}, "damaged"),
    ({"model/weight": torch.zeros(1, 10, dtype=torch.float64)}, "damaged"),
    ({"model/weight": torch.zeros(1, 10, dtype=torch.complex64)}, "damaged"),
    ({"model": dict.fromkeys(map(str, range(99)), torch.zeros(10**4))}, "damaged")]


@pytest.mark.parametrize("edits,says", BAD_FIELDS,
                         ids=[f"{i}-{'+'.join(edits)}" for i, (edits, _) in enumerate(BAD_FIELDS)])
def test_a_checkpoint_with_a_bad_field_is_refused_by_the_run_folder(edits, says, tmp_path,
                                                                    monkeypatch):
    torch.save(edited(saved_state(tmp_path), edits), tmp_path / "checkpoint.pt")
    monkeypatch.setattr(amp_train, "MAX_CHECKPOINT_BYTES", 2**20)
    before = files_of(tmp_path)
    with pytest.raises(amp_train.UsageError, match=re.escape(says)):
        amp_train.RunFolder(str(tmp_path), True, "job")
    assert files_of(tmp_path) == before


# Checkpoints of sound layout whose flags or weights this run refuses, and the line's words.
UNFIT = [({"args/lr": -1.0}, "the checkpoint's flags are refused"),
         ({"args/precision": "fp8"}, "the checkpoint's flags are refused"),
         ({"args": {"lr": 0.01}}, "the checkpoint's flags are refused"),
         ({"args/example": "nope"}, "the checkpoint's flags are refused"),
         ({"model": {"weight": torch.zeros(3)}}, "does not fit"),
         ({"model": {"weight": torch.zeros(1, 10), 3: torch.zeros(1)}}, "does not fit")]


@pytest.mark.parametrize("edits,says", UNFIT, ids=[str(says) for _, says in UNFIT])
def test_a_checkpoint_that_does_not_fit_the_run_ends_in_one_line_and_changes_nothing(
        edits, says, tmp_path, capsys):
    torch.save(edited(saved_state(tmp_path), edits), tmp_path / "checkpoint.pt")
    before = files_of(tmp_path)
    capsys.readouterr()
    err = run_bad(LINEAR_FP16 + ["--epochs", "2", "--run-dir", str(tmp_path), "--resume"], capsys)
    assert says in err and files_of(tmp_path) == before, err


def zip_bomb(path):
    """10 MB of zeros, deflated: the test allows 1 MB."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as f:
        f.writestr("archive/data/0", bytes(10 * 2**20))


@pytest.mark.parametrize("make,says", [
    (lambda path: torch.save({"x": CreatesAFile()}, path), "UnpicklingError"),
    (lambda path: path.write_bytes(path.read_bytes()[:200]), "BadZipFile"),
    (lambda path: torch.save(load(path), path, _use_new_zipfile_serialization=False),
     "BadZipFile"),
    (zip_bomb, "unpacks to too much"),
    (lambda path: path.write_bytes(bytes(2**20 + 1)), "is no file this program wrote")],
    ids=["code", "truncated", "old format", "zip bomb", "too large"])
def test_a_checkpoint_file_that_is_no_checkpoint_is_refused_and_runs_no_code(make, says,
                                                                             tmp_path,
                                                                             monkeypatch):
    saved_state(tmp_path)
    monkeypatch.chdir(tmp_path)
    make(tmp_path / "checkpoint.pt")
    monkeypatch.setattr(amp_train, "MAX_CHECKPOINT_BYTES", 2**20)
    with pytest.raises(amp_train.UsageError, match=says):
        amp_train.RunFolder(str(tmp_path), True, "job")
    assert not (tmp_path / "pwned").exists()
    # A refused folder is not held: another run may take it at once.
    os.close(amp_train.lock_folder(str(tmp_path), True))


def test_a_checkpoint_of_another_job_needs_resume_and_a_restart_of_its_job_does_not(tmp_path):
    saved_state(tmp_path)
    job = load(tmp_path / "checkpoint.pt")["job"]
    with pytest.raises(amp_train.UsageError, match="holds a checkpoint: add --resume"):
        amp_train.RunFolder(str(tmp_path), False, "another job")
    folder = amp_train.RunFolder(str(tmp_path), False, job)
    assert folder.state["epoch"] == 1
    folder.close()


def kinds_of_thing():
    """Each kind of thing that can stand where the run folder expects a file: make(path)."""
    def link_to_a_file(path):
        (path.parent / "precious.txt").write_text("work")
        path.symlink_to(path.parent / "precious.txt")

    def socket_at(path):
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(path))
    return {"folder": os.mkdir, "fifo": os.mkfifo, "link": link_to_a_file,
            "dangling link": lambda path: path.symlink_to(path.parent / "nowhere"),
            "socket": socket_at}


@pytest.mark.parametrize("kind", sorted(kinds_of_thing()))
@pytest.mark.parametrize("name,resume", [("checkpoint.pt", False), ("checkpoint.pt", True),
                                         ("metrics.jsonl", False)])
def test_what_stands_at_the_folders_names_is_refused_in_one_line_and_kept(name, resume, kind,
                                                                           tmp_path, capsys):
    if resume:
        saved_state(tmp_path)
        (tmp_path / name).unlink()
    kinds_of_thing()[kind](tmp_path / name)
    before = {p.name: p.lstat().st_mode for p in tmp_path.iterdir()}
    argv = LINEAR + ["--epochs", "2", "--run-dir", str(tmp_path)] + ["--resume"] * resume
    err = run_bad(argv, capsys)
    assert f"{tmp_path / name}" in err and "remove it" in err, err
    assert "epoch 1/2" not in capsys.readouterr().out
    assert {p.name: p.lstat().st_mode for p in tmp_path.iterdir()} == before, "it changed"
    assert kind != "link" or (tmp_path / "precious.txt").read_text() == "work"


@pytest.mark.parametrize("kind", sorted(kinds_of_thing()))
@pytest.mark.parametrize("name", ["checkpoint.pt.tmp", "metrics.jsonl.tmp"])
def test_what_stands_at_a_tmp_name_is_replaced_or_refused_never_written_through(name, kind,
                                                                                tmp_path,
                                                                                capsys):
    kinds_of_thing()[kind](tmp_path / name)
    code = amp_train.main(LINEAR + ["--epochs", "1", "--run-dir", str(tmp_path)])
    err = capsys.readouterr().err
    if kind == "folder":
        # A folder is not removed: one line names it, before any training.
        assert code == 2 and "could not write" in err and name in err, err
        assert err.endswith(f"{tmp_path} holds {['nothing', 'epoch 0'][name[0] == 'm']}\n")
    else:
        assert code == 0 and load(tmp_path / "checkpoint.pt")["epoch"] == 1, err
        assert not (tmp_path / name).exists() and not (tmp_path / name).is_symlink()
    assert kind != "link" or (tmp_path / "precious.txt").read_text() == "work"


def test_a_link_that_appears_at_the_tmp_name_after_it_was_cleared_is_not_written_through(
        tmp_path, monkeypatch):
    (tmp_path / "precious.txt").write_text("work")
    (tmp_path / "metrics.jsonl.tmp").symlink_to(tmp_path / "precious.txt")
    # The link came back between the unlink and the open: a race.
    monkeypatch.setattr(os, "unlink", lambda path: None)
    with pytest.raises(FileExistsError):
        amp_train.replace_file(str(tmp_path / "metrics.jsonl"), b"lines")
    assert (tmp_path / "precious.txt").read_text() == "work", "a link was written through"


def test_a_second_run_on_a_live_runs_folder_is_refused_and_writes_nothing(tmp_path, capsys):
    import fcntl
    run = LINEAR + ["--run-dir", str(tmp_path)]
    ok(run + ["--epochs", "2"])
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    # The lock a live run holds: flock on the folder.
    live = os.open(tmp_path, os.O_RDONLY)
    descriptors = len(os.listdir("/proc/self/fd"))
    try:
        fcntl.flock(live, fcntl.LOCK_EX)
        for argv in ([], ["--resume"]):
            assert "another run is using" in run_bad(run + ["--epochs", "3"] + argv, capsys)
    finally:
        os.close(live)
    assert len(os.listdir("/proc/self/fd")) == descriptors - 1, "a refused run kept its lock's"
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == before, "it wrote"
    # The refused runs let the folder go: once the live run is gone, the next one may take it.
    ok(run + ["--epochs", "3", "--resume"])


def test_a_new_run_never_overwrites_a_checkpoint(tmp_path, capsys):
    run = LINEAR + ["--run-dir", str(tmp_path)]
    ok(run + ["--epochs", "2"])
    before = files_of(tmp_path)
    assert "add --resume" in run_bad(run + ["--epochs", "3"], capsys)
    assert files_of(tmp_path) == before


def test_a_resume_with_nothing_to_do_writes_nothing(tmp_path, capsys):
    run = LINEAR + ["--run-dir", str(tmp_path)]
    ok(run + ["--epochs", "2"])
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    ok(run + ["--epochs", "2", "--resume"])
    assert "nothing to do: the checkpoint has 2 epochs" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == before


def test_a_resume_into_a_folder_that_is_not_there_creates_nothing(tmp_path, capsys):
    typo = tmp_path / "typo"
    assert "No such file" in run_bad(LINEAR + ["--run-dir", str(typo), "--resume"], capsys)
    assert not typo.exists()


def test_metrics_without_a_checkpoint_are_kept_and_named(tmp_path, capsys):
    run = LINEAR + ["--run-dir", str(tmp_path)]
    ok(run + ["--epochs", "2"])
    (tmp_path / "checkpoint.pt").unlink()
    err = run_bad(run + ["--epochs", "2"], capsys)
    assert err.endswith(f"no checkpoint: delete {tmp_path / 'metrics.jsonl'}\n"), err
    assert "run without --resume" in run_bad(run + ["--resume"], capsys)
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 2, "the metrics changed"


def test_a_resume_keeps_the_checkpoints_flags_and_example(tmp_path, capsys):
    ok(LINEAR + ["--run-dir", str(tmp_path), "--epochs", "3", "--lr", "5e-324",
                 "--batch-size", "16", "--precision", "fp32", "--clip-grad-norm", "1",
                 "--max-steps", "5"])
    ok(["--device", "cpu", "--run-dir", str(tmp_path), "--epochs", "4", "--resume"])
    out = capsys.readouterr().out
    assert "note:" not in out and "| lr 4.941e-324 |" in out, out
    assert "example linear" in out and "precision fp32" in out and "batch 16" in out, out
    saved = load(tmp_path / "checkpoint.pt")["args"]
    assert (saved["batch_size"], saved["clip_grad_norm"], saved["max_steps"]) == (16, 1.0, 5)


def test_a_flag_given_again_on_resume_replaces_the_checkpoints_with_a_note(tmp_path, capsys):
    run = LINEAR + ["--run-dir", str(tmp_path)]
    ok(run + ["--epochs", "3", "--clip-grad-norm", "1", "--max-steps", "5"])
    ok(run + ["--epochs", "4", "--resume", "--clip-grad-norm", "0", "--max-steps", "0",
              "--lr", "0.05"])
    out = capsys.readouterr().out
    assert "note: --clip-grad-norm 0.0 replaces the checkpoint's 1.0" in out, out
    assert "note: --lr 0.05 replaces the checkpoint's 0.01" in out and lrs_of(out)[-1] == 0.05
    saved = load(tmp_path / "checkpoint.pt")["args"]
    assert (saved["clip_grad_norm"], saved["max_steps"]) == (0.0, 0), "a limit can go"


def test_another_data_set_on_resume_is_refused(tmp_path, capsys):
    run = RESNET + ["--max-steps", "1", "--run-dir", str(tmp_path)]
    ok(run + ["--epochs", "1"])
    before = files_of(tmp_path)
    err = run_bad(run + ["--epochs", "2", "--resume", "--data", "cifar10"], capsys)
    assert "trained on --data synthetic" in err and files_of(tmp_path) == before, err


@pytest.mark.parametrize("first,then", [("fp16", "bf16"), ("bf16", "fp16"), ("fp16", "fp32")])
def test_a_run_resumes_in_another_precision(first, then, tmp_path, capsys):
    run = LINEAR + ["--run-dir", str(tmp_path)]
    ok(run + ["--precision", first, "--epochs", "2"])
    ok(run + ["--precision", then, "--epochs", "4", "--resume"])
    out = capsys.readouterr().out
    assert f"note: --precision {then} replaces the checkpoint's {first}" in out, out
    assert re.findall(r"scale (\d+)", out)[2:] == ["65536" if then == "fp16" else "1"] * 2, out


def test_a_folder_whose_name_is_not_utf8_trains_and_resumes_under_a_strict_utf8_stdout(tmp_path):
    folder = os.path.join(os.fsencode(tmp_path), b"run-\xff\n")
    argv = [*LINEAR, "--epochs", "1", "--run-dir", os.fsdecode(folder)]
    for extra in ([], ["--epochs", "2", "--resume"]):
        done = subprocess.run([sys.executable, SCRIPT, *argv, *extra], capture_output=True,
                              env={**os.environ, "PYTHONIOENCODING": "utf-8"})
        assert done.returncode == 0 and done.stderr == b"", done.stderr
    out = done.stdout.decode()
    assert re.search(r"^resumed from .*run-\\udcff\\x0a after epoch 1$", out, re.M), out
    assert load(os.fsdecode(os.path.join(folder, b"checkpoint.pt")))["epoch"] == 2


# ---------- torchrun's processes

def torchrun_env(port, rank=0):
    return {"WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1"}


def test_world_size_without_torchruns_other_variables_is_refused(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert "use torchrun" in run_bad(LINEAR, capsys)


def test_a_port_in_use_ends_in_one_line_and_exit_3(monkeypatch, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        for key, value in torchrun_env(taken.getsockname()[1]).items():
            monkeypatch.setenv(key, value)
        assert "EADDRINUSE" in run_bad(LINEAR, capsys, status=3)


def test_a_peer_that_never_comes_ends_in_one_line_and_exit_3(monkeypatch, capsys):
    monkeypatch.setattr(amp_train, "DIST_TIMEOUT", amp_train.datetime.timedelta(seconds=1))

    def alone(port):
        for key, value in torchrun_env(port).items():
            monkeypatch.setenv(key, value)
        return run_bad(LINEAR, capsys, status=3)
    assert "1/2 clients joined" in retry_if_the_port_was_taken(alone)


@pytest.mark.parametrize("run_id,same_store", [("none", True), ("a-uuid", False)])
def test_every_round_of_one_launch_names_the_same_job_and_another_launch_another(
        run_id, same_store, monkeypatch):
    calls, dist = [], torch.distributed
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: calls.append((a, k)))
    for key, value in {**torchrun_env(1, rank=1), "TORCHELASTIC_RUN_ID": run_id,
                       "TORCHELASTIC_RESTART_COUNT": "0"}.items():
        monkeypatch.setenv(key, value)

    def job(store, device=CPU):
        monkeypatch.setattr(dist, "rendezvous", lambda url, timeout: iter([(store, 1, 2)]))
        return amp_train.join_processes(device)
    store = dist.HashStore()
    first = job(store, torch.device("cuda", 1))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    # A static rendezvous keeps its store for all rounds; c10d may give each round its own.
    if not same_store:
        store = dist.HashStore()
    assert job(store) == first, "a restart found another name"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id.replace("a-uuid", "another-uuid"))
    assert job(dist.HashStore()) != first, "another launch took this one's name"
    timeout = amp_train.DIST_TIMEOUT
    assert [(a, k["device_id"], k["rank"], k["world_size"], k["timeout"]) for a, k in calls[:2]] \
        == [(("nccl",), torch.device("cuda", 1), 1, 2, timeout), (("gloo",), None, 1, 2, timeout)]
    calls[1][1]["store"].set("key", "value")
    assert store.get("round3/key") == b"value", "a round read the last round's keys"


def ddp_worker(rank, argv, out_dir, port):
    """One of two processes, as torchrun starts them: saves what main() did."""
    os.environ.update(torchrun_env(port, rank))
    torch.set_num_threads(1)
    # DDP works alike on 256 images: 10,000 take seconds.
    amp_train.resnet18 = small_model
    amp_train.synthetic_cifar10 = lambda size, seed, train=True: cached_synthetic_cifar10(
        min(size, 256), seed, train)
    built, trained = recording("build_example"), recording("train_epoch")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = amp_train.main(argv)
    torch.save({"code": code, "left": not torch.distributed.is_initialized(),
                "out": out.getvalue(), "err": err.getvalue(), "trained": trained,
                "state": built[0][0].state_dict() if built else {}}, out_dir / f"rank{rank}.pt")


def recording(name):
    """Wraps amp_train's function `name`; returns the list of what its calls return."""
    results, real = [], getattr(amp_train, name)

    def wrapper(*args, **kwargs):
        results.append(real(*args, **kwargs))
        return results[-1]
    setattr(amp_train, name, wrapper)
    return results


def run_two_processes(argv, out_dir):
    """main(argv) in two gloo processes; returns what each did."""
    def run(port):
        torch.multiprocessing.spawn(ddp_worker, args=(argv, out_dir, port), nprocs=2)
        return [load(out_dir / f"rank{r}.pt") for r in range(2)]
    return retry_if_the_port_was_taken(run)


def test_two_processes_train_alike_and_rank_0_alone_prints(tmp_path):
    run = RESNET + ["--epochs", "2", "--max-steps", "1", "--run-dir", str(tmp_path / "run")]
    rank0, rank1 = run_two_processes(run, tmp_path)
    assert rank0["code"] == rank1["code"] == 0 and rank0["left"] and rank1["left"], rank0["err"]
    assert rank1["out"] == rank1["err"] == "", "rank 1 printed"
    assert "| processes 2 |" in rank0["out"] and "epoch 2/2" in rank0["out"], rank0["out"]
    # The weights, and the BatchNorm statistics that all test with.
    for name, tensor in rank0["state"].items():
        assert torch.equal(tensor, rank1["state"][name]), f"{name} differs between ranks"
    # Each epoch's train loss is the mean over both processes' samples, each on its own share.
    for epoch, record in enumerate(read_metrics(tmp_path / "run" / "metrics.jsonl")):
        own = [rank["trained"][epoch] for rank in (rank0, rank1)]
        mean = sum(s["loss"] * s["samples"] for s in own) / sum(s["samples"] for s in own)
        assert own[0]["loss"] != pytest.approx(own[1]["loss"]), own
        assert record["train_loss"] == pytest.approx(mean), (record, own)


def test_a_mistake_every_process_finds_is_said_once(tmp_path):
    rank0, rank1 = run_two_processes(RESNET + ["--batch-size", "300"], tmp_path)
    assert rank0["code"] == rank1["code"] == 2, (rank0, rank1)
    assert rank0["err"].count("\n") == 1 and "more than each process's 128" in rank0["err"]
    assert rank1["out"] == rank1["err"] == "", "rank 1 said it again"


def test_a_folder_another_run_holds_is_said_once_under_torchrun(tmp_path):
    import fcntl
    (tmp_path / "run").mkdir()
    live = os.open(tmp_path / "run", os.O_RDONLY)
    try:
        fcntl.flock(live, fcntl.LOCK_EX)
        argv = LINEAR + ["--run-dir", str(tmp_path / "run")]
        rank0, rank1 = run_two_processes(argv, tmp_path)
    finally:
        os.close(live)
    assert rank0["code"] == rank1["code"] == 2 and "another run is using" in rank0["err"]
    assert rank1["err"] == "", rank1["err"]


def test_the_memory_example_under_torchrun_says_in_one_line_that_it_measures_one_process(
        monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    err = run_bad(["--device", "cpu", "--example", "memory"], capsys)
    assert "run it without torchrun" in err, err


def group_worker(rank, out_dir, port):
    """Trains a linear model in a 2-process gloo group on micro-batches of 4, K = 4: a
    group of 4 and a short one of 2; saves what it saw."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    os.environ.update(torchrun_env(port, rank))
    torch.distributed.init_process_group("gloo")
    model, optimizer, scaler = linear_setup(lr=0.1)
    ddp, all_reduces = nn.parallel.DistributedDataParallel(model), []

    def counting(state, bucket):
        all_reduces.append(1)
        return allreduce_hook(None, bucket)
    ddp.register_comm_hook(None, counting)
    train(ddp, generator_of(batches_of(4, 24, seed=rank)), optimizer, scaler, accum_steps=4)
    torch.save((len(all_reduces), model.weight), out_dir / f"result{rank}.pt")
    torch.distributed.destroy_process_group()


def test_ddp_all_reduces_once_a_step_and_accumulates_as_one_process_on_both_shares(tmp_path):
    def run(port):
        try:
            torch.multiprocessing.spawn(group_worker, args=(tmp_path, port), nprocs=2)
        except torch.multiprocessing.ProcessRaisedException as e:
            return e
        return [load(tmp_path / f"result{r}.pt") for r in range(2)]
    ranks = retry_if_the_port_was_taken(run)
    # One process on both ranks' batches: steps of 8 micro-batches, then of 4.
    r0, r1 = batches_of(4, 24, seed=0), batches_of(4, 24, seed=1)
    model, optimizer, scaler = linear_setup(lr=0.1)
    train(model, r0[:4] + r1[:4], optimizer, scaler, accum_steps=8)
    train(model, r0[4:] + r1[4:], optimizer, scaler, accum_steps=4)
    for all_reduces, weight in ranks:
        assert all_reduces == 2 and torch.allclose(weight, model.weight, atol=1e-6)


def test_a_checkpoint_resumes_under_another_process_count(tmp_path):
    run = LINEAR + ["--precision", "fp32", "--run-dir", str(tmp_path / "run")]
    ok(run + ["--epochs", "1"])
    rank0, _ = run_two_processes(run + ["--epochs", "2", "--resume"], tmp_path)
    assert rank0["code"] == 0 and "| batch 128 | accum 1 | processes 2 |" in rank0["out"]
    ok(run + ["--epochs", "3", "--resume"])
    ok(LINEAR + ["--precision", "fp32", "--epochs", "3", "--run-dir", str(tmp_path / "alone")])
    mixed, alone = (read_metrics(tmp_path / name / "metrics.jsonl") for name in ("run", "alone"))
    assert [r["processes"] for r in mixed] == [1, 2, 1], mixed
    assert [r["train_loss"] for r in mixed] == pytest.approx([r["train_loss"] for r in alone])


DIES = """import os, signal, sys
sys.path.insert(0, {here!r})
import amp_train
calls, real = [], amp_train.{name}
def dying(*args, **kwargs):
    calls.append(args[0])
    if {when}:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*args, **kwargs)
amp_train.{name} = dying
if __name__ == "__main__":
    signal.signal(signal.SIGINT, amp_train.stop)
    signal.signal(signal.SIGTERM, amp_train.stop)
    status = amp_train.main(sys.argv[1:])
    amp_train.ignore_signals()
    with open(os.path.join(os.path.dirname(__file__), f"exit{{os.environ.get('RANK')}}"), "w") as f:
        f.write(str(status))
    sys.exit(status)
"""


def test_a_peer_killed_mid_run_ends_the_survivor_in_one_line_naming_what_is_saved(tmp_path):
    dies = tmp_path / "dies.py"
    dies.write_text(DIES.format(here=str(HERE), name="train_epoch", when="len(calls) == 3"))
    argv = [*LINEAR, "--epochs", "1000", "--run-dir", str(tmp_path / "run")]

    def run(port):
        survivor = script(*argv, **torchrun_env(port))
        dying = subprocess.run([sys.executable, dies, *argv], capture_output=True, timeout=120,
                               env={**os.environ, **torchrun_env(port, 1)})
        return survivor.communicate(timeout=120)[1], survivor.returncode, dying.returncode
    err, status, died = retry_if_the_port_was_taken(run)
    assert (died, status) == (-signal.SIGKILL, 3), (died, status, err)
    assert re.fullmatch(rf"error: the process group failed \(.*Connection.*\); "
                        rf"{re.escape(str(tmp_path / 'run'))} holds epoch 2\n", err), err


def torchrun(tmp_path, *argv, script=SCRIPT, max_restarts=0, rendezvous=("--standalone",),
             **env):
    """torchrun with two CPU processes, as a user starts it."""
    command = [sys.executable, "-m", "torch.distributed.run", *rendezvous, "--nproc_per_node=2",
               f"--max-restarts={max_restarts}", script, "--device", "cpu", *argv]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               cwd=tmp_path, start_new_session=True, env={**os.environ, **env})
    try:
        out, err = process.communicate(timeout=120)
        return subprocess.CompletedProcess(command, process.returncode, out, err)
    except subprocess.TimeoutExpired:
        # torchrun and its workers: none may outlive the test.
        os.killpg(process.pid, signal.SIGKILL)
        raise


# torchrun's SIGTERM to a survivor may come at any moment: here, as its last line is formed.
SIGTERM_IN_HOLDS = """real_holds = amp_train.RunFolder.holds
def holds(self):
    os.kill(os.getpid(), signal.SIGTERM)
    return real_holds(self)
amp_train.RunFolder.holds = holds
"""


def test_under_torchrun_a_dead_peer_ends_the_survivor_in_one_line_and_exit_3_or_143(tmp_path):
    (tmp_path / "dies.py").write_text(DIES.format(
        here=str(HERE), name="train_epoch", when="os.environ['RANK'] == '1' and len(calls) == 3"
    ).replace("if __name__", SIGTERM_IN_HOLDS + "if __name__"))
    done = torchrun(tmp_path, *LINEAR[2:], "--epochs", "100000", "--run-dir", "run",
                    script=str(tmp_path / "dies.py"))
    # torchrun's agent prints a traceback of its own; the survivor prints one line, no more.
    assert 'amp_train.py", line' not in done.stderr and 'dies.py", line' not in done.stderr
    errors = re.findall(r"^error: .*$", done.stderr, re.M)
    assert len(errors) == 1 and ("the process group failed" in errors[0]
                                 or "stopped by SIGTERM" in errors[0]), done.stderr
    # torch 2.6's torchrun does not report the survivor it stopped: it says its own status.
    assert (tmp_path / "exit0").read_text() in ("3", "143"), done.stderr


def test_torchrun_restarts_go_on_from_their_jobs_checkpoint_and_a_new_job_takes_nothing(
        tmp_path):
    # kill -9 in round 0, after epoch 1's metrics, before its checkpoint: round 1 goes on
    # from its job's checkpoint of epoch 0 without --resume, and rewrites the metrics.
    (tmp_path / "dies.py").write_text(DIES.format(here=str(HERE), name="replace_file", when=(
        "os.environ['TORCHELASTIC_RESTART_COUNT'] == '0' and len(calls) == 3")))
    argv = ["--example", "linear", "--precision", "fp32", "--epochs", "4", "--run-dir", "run"]
    done = torchrun(tmp_path, *argv, script=str(tmp_path / "dies.py"), max_restarts=1)
    assert done.returncode == 0 and done.stderr.count("exitcode: -9") == 1, done.stderr
    assert len(re.findall(r"^epoch 1/4 ", done.stdout, re.M)) == 2, done.stdout
    assert re.search(r"^resumed from run after epoch 0$", done.stdout, re.M), done.stdout
    assert [r["epoch"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3, 4]
    ok(LINEAR + ["--precision", "fp32", "--epochs", "4", "--run-dir", str(tmp_path / "a")])
    restarted, alone = (load(tmp_path / name / "checkpoint.pt")["model"] for name in ("run", "a"))
    assert all(torch.allclose(restarted[k], alone[k], atol=1e-6) for k in alone), restarted
    # A static rendezvous names every job "none": the name comes from torchrun's store.
    before = files_of(tmp_path / "run")
    second = retry_if_the_port_was_taken(lambda port: torchrun(
        tmp_path, *argv[:-3], "6", "--run-dir", "run", rendezvous=("--master-port", str(port))))
    assert second.stderr.count("holds a checkpoint: add --resume") == 1, second.stderr
    assert re.search(r"exitcode *: 2 ", second.stderr), second.stderr
    assert 'amp_train.py", line' not in second.stderr, "a worker ended in a traceback"
    assert files_of(tmp_path / "run") == before, "the other job's files changed"


def test_a_restart_goes_on_when_each_round_has_a_rendezvous_store_of_its_own(tmp_path):
    (tmp_path / "dies.py").write_text(DIES.format(here=str(HERE), name="replace_file", when=(
        "os.environ['TORCHELASTIC_RESTART_COUNT'] == '0' and len(calls) == 5")))
    argv = ["--example", "linear", "--precision", "fp32", "--epochs", "3", "--run-dir", "run"]
    done = torchrun(tmp_path, *argv, script=str(tmp_path / "dies.py"), max_restarts=1,
                    TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    assert done.returncode == 0 and "add --resume" not in done.stderr, done.stderr
    assert [r["epoch"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3]


# ---------- errors and signals, and the command line

@pytest.mark.parametrize("argv", [
    ["--example", "nope"], ["--precision", "fp8"], ["--epochs", "0"], ["--batch-size", "0"],
    ["--max-steps", "-1"], ["--epochs", str(2**31)], ["--lr", "0"], ["--lr", "nan"],
    ["--lr", "1e39", "is not in [5e-324, 3.4028234663852886e+38]"], ["--clip-grad-norm", "-1"],
    ["--accum-steps", "1" + "0" * 30], ["--seed", "4294967296", "is not in [0, 4294967295]"],
    ["--no-such-flag"], ["--example", "memory", "--steps", "0"],
    ["--example", "memory", "--run-dir", "x"], ["--device", "cpu", "--resume"],
    ["--example", "memory", "--precision", "fp32"],
    ["--run-dir", "", "--device", "cpu", "--example", "linear", "No such file"],
    RESNET + ["--batch-size", "10001"]])
def test_a_bad_flag_ends_in_one_line_before_any_training(argv, capsys):
    says = ""
    if " " in argv[-1]:
        says = argv.pop()
    assert says in run_bad(argv, capsys) and "epoch" not in capsys.readouterr().out


def test_the_help_gives_every_flag_a_text_and_its_true_default(capsys):
    with pytest.raises(SystemExit):
        amp_train.parse_args(["--help"])
    # Each flag's entry: its line, and the deeper-indented lines that go on with its help.
    entries = re.split(r"\n(?=  -)", capsys.readouterr().out.split("options:\n")[1])
    lines = [re.fullmatch(r"\s*(?:-h, )?(--[a-z-]+)(?: \S+)?\s+(.*)", " ".join(entry.split()))
             .groups() for entry in entries]
    helps, defaults = dict(lines), vars(amp_train.parse_args([]))
    assert sorted(key[2:].replace("-", "_") for key in helps) == sorted(["help", *defaults])
    for flag, help in lines:
        default = defaults.get(flag[2:].replace("-", "_"))
        shown = {None: "none"}.get(default, default)
        assert flag in ("--help", "--resume") or help.endswith(f"(default: {shown})"), help
        assert "None" not in help and "False" not in help, help
    assert "0: off" in helps["--max-steps"] and "0: off" in helps["--clip-grad-norm"], helps


@pytest.mark.parametrize("error", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
    RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 4e10 bytes")])
def test_out_of_memory_ends_in_one_line_that_says_lower_the_batch(error, monkeypatch, capsys):
    def build(*args):
        raise error
    monkeypatch.setattr(amp_train, "build_example", build)
    assert "lower --batch-size" in run_bad(LINEAR, capsys)


def test_under_torchrun_a_process_says_its_own_out_of_memory_but_not_a_shared_mistake(
        monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")

    def build(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    monkeypatch.setattr(amp_train, "build_example", build)
    assert "lower --batch-size" in run_bad(LINEAR, capsys)
    assert amp_train.main(LINEAR + ["--batch-size", "0"]) == 2
    assert capsys.readouterr().err == "", "rank 1 said what rank 0 says"


@pytest.mark.parametrize("error", [ZeroDivisionError, KeyboardInterrupt, RuntimeError])
def test_a_bug_or_a_plain_keyboardinterrupt_passes_main_with_its_traceback(error, monkeypatch):
    def build(*args):
        raise error("a bug")
    monkeypatch.setattr(amp_train, "build_example", build)
    with pytest.raises(error):
        amp_train.main(LINEAR)


def first_epoch_line(run):
    """Reads the run's stdout until its first epoch line: training is under way."""
    for line in run.stdout:
        if line.startswith("epoch "):
            return line
    raise AssertionError(run.stderr.read())


def test_ctrl_c_and_sigterm_end_a_run_in_one_line_naming_the_epoch_saved(tmp_path):
    signals = {"SIGTERM": [signal.SIGTERM], "SIGINT": [signal.SIGINT] * 4}
    runs = {name: script(*LINEAR, "--epochs", "100000", "--run-dir", str(tmp_path / name))
            for name in signals}
    for name, run in runs.items():
        first_epoch_line(run)
        # More signals, a few ms apart, land in the cleanup: they change nothing.
        for signum in signals[name]:
            run.send_signal(signum)
            time.sleep(0.003)
    for name, run in runs.items():
        # communicate() would skip the lines read.
        out, err = run.stdout.read(), run.stderr.read()
        run.wait(timeout=60)
        saved = load(tmp_path / name / "checkpoint.pt")["epoch"]
        assert err == f"error: stopped by {name}; {tmp_path / name} holds epoch {saved}\n", err
        assert run.returncode == 128 + signals[name][0], run.returncode
        bad = [x for x in out.splitlines() if not re.fullmatch(r"epoch +\d+/100000 \|.* s", x)]
        assert not bad and not list((tmp_path / name).glob("*.tmp")), bad


def test_ctrl_c_during_the_memory_example_says_what_it_stopped():
    run = script("--device", "cpu", "--example", "memory", "--model", "linear", "--steps",
                 "100000000")
    assert run.stdout.readline().startswith("memory | ")
    run.stdout.readline()
    time.sleep(0.5)
    run.send_signal(signal.SIGINT)
    out, err = run.communicate(timeout=60)
    assert err == "error: stopped by SIGINT; the memory example stopped before its report\n"
    assert run.returncode == 130, run.returncode


def test_a_signal_as_the_error_line_is_said_changes_neither_the_line_nor_the_exit_status(
        tmp_path):
    # As torchrun's SIGTERM does, sent to the survivors of a dead peer.
    (tmp_path / "late.py").write_text(DIES.format(
        here=str(HERE), name="say", when="args[0].startswith('error:')").replace(
        "signal.SIGKILL", "signal.SIGTERM"))
    done = subprocess.run([sys.executable, tmp_path / "late.py", *LINEAR, "--batch-size", "0"],
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (2, "error: argument --batch-size: 0 is not in "
                                                 "[1, 2147483647] (see --help)\n"), done.stderr


def test_a_stop_that_code_swallowed_is_raised_again_at_the_next_step(tmp_path):
    # As pybind11 turns a KeyboardInterrupt in triton's import, on torch's first zero_grad(),
    # into an ImportError that torch takes for "no triton". The run must still stop.
    (tmp_path / "swallows.py").write_text(DIES.format(
        here=str(HERE), name="train_epoch", when="len(calls) == 2").replace(
        "os.kill(os.getpid(), signal.SIGKILL)", """try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except KeyboardInterrupt:
            pass""").replace("import os,", "import os, time,"))
    done = subprocess.run([sys.executable, tmp_path / "swallows.py", *LINEAR, "--run-dir",
                           tmp_path / "run"], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (
        130, f"error: stopped by SIGINT; {tmp_path / 'run'} holds epoch 1\n"), done.stderr


def test_a_signal_in_importlibs_own_code_stops_the_run_at_its_first_step(tmp_path):
    # A Stopped raised there would be printed as "Exception ignored" and dropped: the handler
    # leaves it to the next step. The sleep returns to the handler in importlib's frame.
    (tmp_path / "importing.py").write_text(f"""import os, signal, sys, time
sys.path.insert(0, {str(HERE)!r})
import amp_train
signal.signal(signal.SIGINT, amp_train.stop)
exec(compile("os.kill(os.getpid(), signal.SIGINT); time.sleep(0.5)",
             "<frozen importlib._bootstrap>", "exec"))
sys.exit(amp_train.main({LINEAR!r}))
""")
    done = subprocess.run([sys.executable, tmp_path / "importing.py"], capture_output=True,
                          text=True, timeout=60)
    assert (done.returncode, done.stderr) == (130, f"error: stopped by SIGINT; {NOTHING_SAVED}\n")
    assert "epoch " not in done.stdout, done.stdout


def test_a_sigterm_after_the_last_epoch_changes_nothing():
    # An atexit hook stands in for torch's teardown, slow after main() returns.
    teardown = "lambda: print('teardown', file=sys.stderr, flush=True) or time.sleep(2)"
    run = subprocess.Popen([sys.executable, "-c", f"import atexit, runpy, sys, time; atexit."
                            f"register({teardown}); sys.argv = [{SCRIPT!r}, *{LINEAR!r}]; "
                            "runpy.run_path(sys.argv[0], run_name='__main__')"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert run.stderr.readline() == "teardown\n"
    run.send_signal(signal.SIGTERM)
    out, err = run.communicate(timeout=60)
    assert (run.returncode, err) == (0, "") and "epoch 100/100" in out, (run.returncode, err)


def test_say_writes_one_printable_line_whatever_a_name_holds(capsys):
    amp_train.say("resumed from run-\udcff\n\x1b[31m after epoch 1")
    assert capsys.readouterr().out == "resumed from run-\\udcff\\x0a\\x1b[31m after epoch 1\n"


@requires_cuda
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_cuda_trains_and_measures_its_peak_memory(precision, capsys, resnet18):
    argv = ["--device", "cuda", "--precision", precision, "--batch-size", "16"]
    ok(argv + ["--data", "synthetic", "--epochs", "1", "--max-steps", "3"])
    out = capsys.readouterr().out
    assert f"device cuda:0 | precision {precision}" in out and "epoch 1/1 " in out, out
    ok(argv + ["--example", "memory", "--steps", "2"])
    out = capsys.readouterr().out
    peak = re.search(r"^peak_bytes +([\d.]+) MiB +([\d.]+) MiB +0\.\d\d$", out, re.M)
    assert peak and 0 < float(peak.group(2)) < float(peak.group(1)), out
    assert re.search(r"^reserved_bytes .* MiB", out, re.M), out
