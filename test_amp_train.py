"""Tests for amp_train.py: CPU by default, CUDA cases run where a GPU is. Run: python -m pytest -q"""
import contextlib
import errno
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

import numpy as np
import pytest
import torch
import torch.nn as nn

import amp_train

# Deprecated AMP names (torch.cuda.amp.*) warn with FutureWarning: make any such use fail.
pytestmark = [pytest.mark.filterwarnings("error::FutureWarning"),
              pytest.mark.filterwarnings("error::DeprecationWarning")]

HERE = pathlib.Path(__file__).parent
SCRIPT = str(HERE / "amp_train.py")
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CPU = torch.device("cpu")
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]
LINEAR = ["--device", "cpu", "--example", "linear"]
LINEAR_FP16 = LINEAR + ["--precision", "fp16"]
# fp32: bf16 convolutions are emulated, and ten times slower, on CPUs without bf16 instructions.
RESNET_TINY = ["--device", "cpu", "--example", "resnet", "--data", "synthetic", "--max-steps", "2",
               "--batch-size", "4", "--precision", "fp32"]


@pytest.fixture(autouse=True)
def synthetic_data_made_once(monkeypatch):
    """synthetic_cifar10(10_000) takes a second or more: each (size, seed, train) is made once."""
    monkeypatch.setattr(amp_train, "synthetic_cifar10", cached_synthetic_cifar10)


@functools.lru_cache(maxsize=None)
def cached_synthetic_cifar10(size, seed=0, train=True, _make=amp_train.synthetic_cifar10):
    return _make(size, seed, train)


def linear_batch(batch_size=128, seed=0):
    """The linear example's fixed batch, as amp_train makes it for --batch-size and --seed."""
    args = amp_train.parse_args(LINEAR + ["--batch-size", str(batch_size), "--seed", str(seed)])
    return next(iter(amp_train.build_example(args, CPU)[2]))


def linear_setup(device="cpu", amp_dtype=None, seed=0, lr=0.01):
    torch.manual_seed(seed)
    model = nn.Linear(10, 1).to(device)
    return model, torch.optim.SGD(model.parameters(), lr=lr), amp_train.make_scaler(torch.device(device), amp_dtype)


def fit_linear(amp_dtype, iterations):
    model, optimizer, scaler = linear_setup("cpu", amp_dtype)
    x, y = linear_batch()
    for _ in range(iterations):
        stats = amp_train.train_epoch(model, [(x, y)], optimizer, nn.MSELoss(), scaler, CPU, amp_dtype)
    return model, stats


def with_inf(x):
    bad = x.clone()
    bad[0, 0] = float("inf")  # the loss of this batch is inf, its gradients inf/NaN
    return bad


def run_bad(argv, capsys):
    code = amp_train.main(argv)
    err = capsys.readouterr().err
    assert code == 2, f"{argv} gave exit {code}: {err}"
    assert err.count("\n") == 1 and err.startswith("error: "), f"want one error line, got: {err!r}"
    return err


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def read_metrics(path):
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines()]


def epoch_lines(out):
    return re.findall(r"^epoch +\d+/\d+ .*$", out, re.M)


def files_of(folder):
    return {p.name: p.read_bytes() for p in pathlib.Path(folder).iterdir()}


def wait_for(path, timeout=60):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


def script(*argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE):
    """amp_train.py as a user starts it, in a process of its own (its stdout buffered, as usual)."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONUNBUFFERED"}
    return subprocess.Popen([sys.executable, SCRIPT, *argv], stdout=stdout, stderr=stderr, text=True, env=env)


# ---------------------------------------------------------------- the copy unit, as pasted

def readme_copy_block():
    text = (HERE / "README.md").read_text()
    section = text[text.index("## Copy this"):]
    return section[section.index("```python\n") + 10:section.index("\n```", section.index("```python"))] + "\n"


def generator_of(batches):
    yield from batches  # no len(): a streaming data set


def test_the_readme_block_is_train_epoch_verbatim():
    block, source = readme_copy_block(), inspect.getsource(amp_train.train_epoch)
    assert source in block, "the README's Copy this block and amp_train.train_epoch have drifted apart"
    readme = (HERE / "README.md").read_text()
    assert readme[:readme.index("## Copy this")].count("\n") < 80, "Copy this must start in README's first 80 lines"


def test_the_readme_block_runs_as_pasted_trains_nothing_by_itself_and_its_call_line_works(capsys):
    torch.manual_seed(0)
    model = nn.Linear(10, 1)
    x, y = linear_batch(32)
    user = {"torch": torch, "model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
            "loader": generator_of(zip(x.split(8), y.split(8))), "criterion": nn.MSELoss(), "device": "cpu"}
    before = model.weight.detach().clone()
    block = readme_copy_block()
    exec(compile(block, "README.md", "exec"), user)
    assert user["amp_dtype"] is torch.bfloat16, "on the CPU the block must pick bf16"
    assert torch.equal(model.weight, before), "pasted with the setup lines, the block must not train an epoch"
    call = re.search(r"^#\s+(stats = train_epoch\(.*\))$", block, re.M)
    assert call, "the block must show the line that calls train_epoch, as a comment"
    exec(call.group(1), user)
    assert user["stats"]["steps"] == 4 and user["stats"]["samples"] == 32, user["stats"]
    assert not torch.equal(model.weight, before), "the block's call line did not train"
    # The pasted function in the other two precisions: fp16 with a scaler, fp32 with none.
    for amp_dtype, scaler in ((torch.float16, torch.amp.GradScaler("cpu")), (None, None)):
        stats = user["train_epoch"](model, generator_of(zip(x.split(8), y.split(8))), user["optimizer"],
                                    nn.MSELoss(), scaler, "cpu", amp_dtype)
        assert stats["steps"] == 4 and math.isfinite(stats["loss"]), (amp_dtype, stats)
        assert (stats["loss_scale"] is None) == (scaler is None), stats


def test_the_readme_adapter_for_dict_batches_works():
    readme = (HERE / "README.md").read_text()
    adapter = re.search(r"^ *(pairs = .*)$", readme, re.M)
    assert adapter, "README must show the adapter for dict batches"
    x, y = linear_batch(16)
    namespace = {"loader": [{"input": x[:8], "label": y[:8]}, {"input": x[8:], "label": y[8:]}]}
    exec(adapter.group(1).replace('"input_ids"', '"input"').replace('"labels"', '"label"'), namespace)
    model, optimizer, _ = linear_setup()
    stats = amp_train.train_epoch(model, namespace["pairs"], optimizer, nn.MSELoss(), None, CPU, None)
    assert stats["samples"] == 16, stats


def test_train_epoch_pastes_alone_and_matches_the_docs_loop():
    # Only the imports its docstring names, a generator, a string device and no scaler (fp32).
    needs = re.search(r"Needs `(import [^`]+)`", amp_train.train_epoch.__doc__).group(1)
    pasted = {}
    exec(needs + "\n" + inspect.getsource(amp_train.train_epoch), pasted)
    x, y = linear_batch(24, seed=2)
    model, optimizer, _ = linear_setup(lr=0.1)
    stats = pasted["train_epoch"](model, generator_of(zip(x.split(8), y.split(8))), optimizer, nn.MSELoss(),
                                  None, "cpu", None)
    reference, ref_optimizer, _ = linear_setup(lr=0.1)
    for inputs, targets in zip(x.split(8), y.split(8)):  # the docs' fp32 loop
        nn.MSELoss()(reference(inputs), targets).backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad(set_to_none=True)
    assert torch.allclose(model.weight, reference.weight, atol=1e-7, rtol=0), (model.weight, reference.weight)
    assert (stats["steps"], stats["skipped_steps"], stats["loss_scale"]) == (3, 0, None), stats


@pytest.mark.filterwarnings("ignore:Detected call of")  # torch's note when a first fp16 step is skipped
@pytest.mark.parametrize("amp_dtype", [None, torch.float16])
def test_a_per_step_scheduler_steps_once_per_optimizer_step_skipped_or_not(amp_dtype):
    x, y = linear_batch(40)
    batches = list(zip(x.split(4), y.split(4)))  # 10 micro-batches: 5 optimizer steps of 2
    if amp_dtype is torch.float16:
        batches[0] = (with_inf(batches[0][0]), batches[0][1])  # the first step is skipped
    model, optimizer, scaler = linear_setup(amp_dtype=amp_dtype)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    stats = amp_train.train_epoch(model, batches, optimizer, nn.MSELoss(), scaler, CPU, amp_dtype,
                                  scheduler=scheduler, accum_steps=2)
    assert scheduler.last_epoch == 5 == stats["steps"], (scheduler.last_epoch, stats)
    assert (stats["skipped_steps"] > 0) == (amp_dtype is torch.float16), stats
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.01 * 0.5 ** 5)


@pytest.mark.parametrize("batch", [{"input": torch.zeros(2, 10), "label": torch.zeros(2, 1)},
                                   (torch.zeros(2, 10), torch.zeros(2, 1), torch.zeros(2)), torch.zeros(2, 10)])
def test_a_batch_that_is_not_an_inputs_targets_pair_fails_at_once_saying_so(batch):
    model, optimizer, _ = linear_setup()
    with pytest.raises(TypeError, match=r"^a batch must be an \(inputs, targets\) pair, not <class '[\w.]+'>$"):
        amp_train.train_epoch(model, [batch], optimizer, nn.MSELoss(), None, CPU, None)


# ---------------------------------------------------------------- what autocast and the scaler do

class Probe(nn.Module):
    """A Linear and a Conv1d that record the dtypes of their outputs and of the weight."""
    def __init__(self):
        super().__init__()
        self.linear, self.conv, self.seen = nn.Linear(8, 4), nn.Conv1d(1, 4, 3, padding=1), []

    def forward(self, x):
        a, b = self.linear(x), self.conv(x[:, None, :]).mean(2)
        self.seen.append((a.dtype, b.dtype, self.linear.weight.dtype))
        return a + b


@pytest.mark.parametrize("device_name,amp_dtype", [("cpu", torch.bfloat16), ("cpu", None),
                                                   pytest.param("cuda", torch.float16, marks=requires_cuda)])
def test_autocast_runs_matmul_and_conv_in_amp_dtype_and_the_loss_in_fp32(device_name, amp_dtype):
    model, losses = Probe().to(device_name), []
    def criterion(outputs, targets):
        losses.append(nn.functional.cross_entropy(outputs, targets))
        return losses[-1]
    batch = (torch.randn(2, 8), torch.tensor([0, 1]))
    amp_train.train_epoch(model, [batch], torch.optim.SGD(model.parameters(), lr=0.1), criterion,
                          amp_train.make_scaler(torch.device(device_name), amp_dtype), device_name, amp_dtype)
    low = amp_dtype or torch.float32
    assert model.seen == [(low, low, torch.float32)], f"(linear, conv, weight) dtypes: {model.seen}"
    assert losses[0].dtype is torch.float32, f"cross_entropy should autocast to float32, got {losses[0].dtype}"


@pytest.mark.parametrize("device_name", DEVICES)
def test_the_scaler_is_enabled_for_fp16_only(device_name):
    enabled = {name: amp_train.make_scaler(torch.device(device_name), dtype).is_enabled()
               for name, dtype in amp_train.PRECISIONS.items()}
    assert enabled == {"fp16": True, "bf16": False, "fp32": False}, enabled


def test_auto_precision_is_fp16_on_cuda_and_bf16_on_the_cpu():
    assert amp_train.resolve_precision("auto", CPU) == "bf16"
    assert amp_train.resolve_precision("auto", torch.device("cuda")) == "fp16"


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_amp_training_of_the_linear_example_matches_fp32(precision):
    # Measured on the CPU: bf16 ends 1.0e-4 from fp32's loss, fp16 1.3e-5; the tolerance is ~10x that.
    fp32_model, fp32_stats = fit_linear(None, 100)
    amp_model, amp_stats = fit_linear(amp_train.PRECISIONS[precision], 100)
    assert fp32_stats["loss"] < fit_linear(None, 1)[1]["loss"] - 0.2, "fp32 training did not learn"
    assert abs(amp_stats["loss"] - fp32_stats["loss"]) < 1e-3, (amp_stats, fp32_stats)
    assert torch.allclose(amp_model.weight, fp32_model.weight, atol=3e-3), (amp_model.weight, fp32_model.weight)


@pytest.mark.parametrize("device_name", DEVICES)
def test_the_scaler_skips_an_inf_step_and_halves_the_scale(device_name):
    x, y = linear_batch(8)
    model, optimizer, scaler = linear_setup(device_name, torch.float16)
    stats = amp_train.train_epoch(model, [(x, y), (with_inf(x), y)], optimizer, nn.MSELoss(), scaler,
                                  device_name, torch.float16)
    reference, ref_optimizer, ref_scaler = linear_setup(device_name, torch.float16)
    amp_train.train_epoch(reference, [(x, y)], ref_optimizer, nn.MSELoss(), ref_scaler, device_name, torch.float16)
    assert torch.equal(model.weight, reference.weight), "the inf batch must not change the weights"
    assert (stats["steps"], stats["skipped_steps"]) == (2, 1), stats
    assert not math.isfinite(stats["loss"]), "the mean loss must show the inf, not hide it"
    assert stats["loss_scale"] == 2.0 ** 15, f"the scale should halve from 2**16, got {stats['loss_scale']}"


@pytest.mark.parametrize("kind", [{"foreach": False}, {"foreach": True}, {"fused": True}])
@pytest.mark.parametrize("make", [torch.optim.SGD, torch.optim.Adam])
def test_skipped_steps_are_counted_for_plain_foreach_and_fused_optimizers(make, kind):
    # A fused optimizer takes the inf check into its kernel: its step() always runs, so counting
    # step() calls would miss the skip. This pins the private _found_inf_per_device's result.
    x, y = linear_batch(8)
    model, _, scaler = linear_setup("cpu", torch.float16)
    optimizer = make(model.parameters(), lr=0.01, **kind)
    amp_train.train_epoch(model, [(x, y)], optimizer, nn.MSELoss(), scaler, CPU, torch.float16)
    before = [p.detach().clone() for p in model.parameters()]
    stats = amp_train.train_epoch(model, [(with_inf(x), y), (x, y)], optimizer, nn.MSELoss(), scaler, "cpu",
                                  torch.float16)
    assert (stats["steps"], stats["skipped_steps"], stats["loss_scale"]) == (2, 1, 2.0 ** 15), stats
    assert not any(torch.equal(p, b) for p, b in zip(model.parameters(), before)), "the good step did not move"


def test_a_skip_seen_on_several_devices_counts_once(monkeypatch):
    # Parameters on two GPUs give found_inf once per device: one skipped step, not two.
    x, y = linear_batch(8)
    model, optimizer, scaler = linear_setup("cpu", torch.float16)
    found_inf = scaler._found_inf_per_device
    monkeypatch.setattr(scaler, "_found_inf_per_device", lambda opt: dict(enumerate(list(found_inf(opt).values()) * 2)))
    stats = amp_train.train_epoch(model, [(with_inf(x), y), (x, y)], optimizer, nn.MSELoss(), scaler, CPU,
                                  torch.float16)
    assert (stats["steps"], stats["skipped_steps"]) == (2, 1), stats


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_skipped_steps_are_counted_when_the_parameters_sit_on_two_gpus():
    class TwoGPUs(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(10, 4).to("cuda:0"), nn.Linear(4, 1).to("cuda:1")
        def forward(self, x):
            return self.b(self.a(x).to("cuda:1")).to("cuda:0")
    model = TwoGPUs()
    x, y = linear_batch(8)
    stats = amp_train.train_epoch(model, [(with_inf(x), y), (x, y)], torch.optim.SGD(model.parameters(), lr=0.01),
                                  nn.MSELoss(), torch.amp.GradScaler("cuda"), "cuda:0", torch.float16)
    assert (stats["steps"], stats["skipped_steps"]) == (2, 1), stats


def test_clipping_acts_on_unscaled_gradients():
    model, optimizer, scaler = linear_setup("cpu", torch.float16)
    seen = []  # the gradient norm as optimizer.step() sees it
    optimizer.register_step_pre_hook(lambda *_: seen.append(
        torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()))
    x, y = linear_batch(16)
    stats = amp_train.train_epoch(model, [(x, y)], optimizer, nn.MSELoss(), scaler, CPU, torch.float16,
                                  clip_grad_norm=0.01)  # the true norm is ~1: clipping must act
    assert stats["skipped_steps"] == 0 and len(seen) == 1, (stats, seen)
    # Clipping the scaled gradients and unscaling afterwards would leave 0.01 / 2**16.
    assert seen[0] == pytest.approx(0.01, rel=1e-3), f"clipped to {seen[0]}, not to 0.01"


def test_the_loss_is_the_per_sample_mean_over_batches_and_max_steps_counts_steps():
    model = nn.Linear(1, 1, bias=False)
    nn.init.zeros_(model.weight)
    batches = [(torch.zeros(3, 1), torch.ones(3, 1)), (torch.zeros(1, 1), torch.full((1, 1), 3.0))]
    stats = amp_train.train_epoch(model, batches, torch.optim.SGD(model.parameters(), lr=0.0), nn.MSELoss(),
                                  None, CPU, None)
    assert stats["loss"] == pytest.approx((3 * 1 + 1 * 9) / 4) and (stats["steps"], stats["samples"]) == (2, 4)
    x, y = linear_batch(4)
    model, optimizer, _ = linear_setup()
    stats = amp_train.train_epoch(model, [(x, y)] * 10, optimizer, nn.MSELoss(), None, CPU, None, max_steps=3)
    assert (stats["steps"], stats["samples"]) == (3, 12), stats


def test_max_steps_takes_no_batch_it_does_not_train_on_and_an_empty_loader_gives_nan():
    # An endless stream cut into epochs by max_steps: every batch is trained on, in order, once.
    x, y = linear_batch(24)
    stream, seen = iter(zip(x.split(4), y.split(4))), []
    model, optimizer, _ = linear_setup()
    model.register_forward_hook(lambda module, inputs, output: seen.append(inputs[0][0, 0].item()))
    for _ in range(3):
        stats = amp_train.train_epoch(model, stream, optimizer, nn.MSELoss(), None, CPU, None, max_steps=2)
        assert stats["steps"] == 2, stats
    assert seen == x[::4, 0].tolist(), "a batch was skipped or seen twice"
    empty = amp_train.train_epoch(model, stream, optimizer, nn.MSELoss(), None, CPU, None)
    assert empty["steps"] == empty["samples"] == 0 and math.isnan(empty["loss"]), "no data is no loss of 0"


def test_evaluate_counts_correct_predictions_under_inference_mode():
    seen = []
    class Identity(nn.Linear):
        def forward(self, x):
            seen.append((torch.is_inference_mode_enabled(), self.training))
            return super().forward(x)
    model = Identity(3, 3, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.eye(3))               # predicts the index of the largest input
    inputs, targets = torch.eye(3).repeat(2, 1), torch.tensor([0, 1, 2, 0, 2, 1])  # 4 of 6 right
    result = amp_train.evaluate(model, [(inputs[:4], targets[:4]), (inputs[4:], targets[4:])],
                                nn.CrossEntropyLoss(), "cpu", torch.bfloat16)
    assert result["accuracy"] == pytest.approx(4 / 6) and result["samples"] == 6, result
    assert seen == [(True, False)] * 2, f"(inference mode, training) in forward: {seen}"


def test_evaluate_loss_is_the_per_sample_mean_over_unequal_batches_and_max_steps_limits_batches():
    torch.manual_seed(0)
    logits, targets = torch.randn(5, 4) * 3, torch.tensor([0, 1, 2, 3, 0])
    batches = [(logits[:4], targets[:4]), (logits[4:], targets[4:])]
    result = amp_train.evaluate(nn.Identity(), batches, nn.CrossEntropyLoss(), CPU, None)
    expected = nn.functional.cross_entropy(logits, targets).item()  # the mean over all 5 samples
    assert result["loss"] == pytest.approx(expected, rel=1e-6), (result, expected)
    assert amp_train.evaluate(nn.Identity(), batches, nn.CrossEntropyLoss(), CPU, None, max_steps=1)["samples"] == 4


# ---------------------------------------------------------------- gradient accumulation

def test_accumulating_k_micro_batches_equals_one_batch_of_k_times_the_size():
    x, y = linear_batch(32, seed=3)
    big, big_optimizer, _ = linear_setup()
    amp_train.train_epoch(big, [(x, y)], big_optimizer, nn.MSELoss(), None, CPU, None)
    small, small_optimizer, _ = linear_setup()
    stats = amp_train.train_epoch(small, list(zip(x.split(8), y.split(8))), small_optimizer, nn.MSELoss(), None,
                                  CPU, None, accum_steps=4)
    assert (stats["steps"], stats["samples"]) == (1, 32), stats
    # Measured difference: float32 rounding only (~1e-9); the tolerance leaves room for other CPUs.
    assert torch.allclose(small.weight, big.weight, atol=1e-6, rtol=0), (small.weight - big.weight).abs().max()


@pytest.mark.parametrize("wrap", [list, generator_of], ids=["list", "generator"])
def test_a_shorter_last_group_steps_with_its_own_mean_gradient_and_no_gradient_survives(wrap):
    x, y = linear_batch(12, seed=5)
    model, optimizer, _ = linear_setup()
    stats = amp_train.train_epoch(model, wrap(zip(x.split(4), y.split(4))), optimizer, nn.MSELoss(), None, CPU,
                                  None, accum_steps=2)  # 3 micro-batches: a group of 2, then one of 1
    reference, ref_optimizer, _ = linear_setup()
    for inputs, targets in [(x[:8], y[:8]), (x[8:], y[8:])]:  # the docs' loop, batched as the groups are
        nn.MSELoss()(reference(inputs), targets).backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad(set_to_none=True)
    assert stats["steps"] == 2, stats
    assert torch.allclose(model.weight, reference.weight, atol=1e-6, rtol=0), (model.weight, reference.weight)
    assert all(p.grad is None for p in model.parameters()), "a gradient survived the epoch"


def test_accumulation_counts_optimizer_steps_and_skips_in_fp16():
    x, y = linear_batch(8)
    model, optimizer, scaler = linear_setup("cpu", torch.float16)
    batches = [(x, y), (with_inf(x), y), (x, y), (x, y), (x, y)]  # groups of 2: [good, bad] [good, good] [good]
    stats = amp_train.train_epoch(model, batches, optimizer, nn.MSELoss(), scaler, CPU, torch.float16, accum_steps=2)
    assert (stats["steps"], stats["skipped_steps"], stats["samples"]) == (3, 1, 40), stats
    limited = amp_train.train_epoch(model, batches, optimizer, nn.MSELoss(), scaler, CPU, torch.float16,
                                    accum_steps=2, max_steps=1)
    assert (limited["steps"], limited["samples"]) == (1, 16), limited


# ---------------------------------------------------------------- progress lines and host syncs

def test_train_epoch_prints_a_progress_line_once_log_seconds_have_passed(capsys):
    x, y = linear_batch(4)
    model, optimizer, _ = linear_setup()
    amp_train.train_epoch(model, [(x, y)] * 3, optimizer, nn.MSELoss(), None, CPU, None, log_seconds=0)
    amp_train.train_epoch(model, [(x, y)] * 3, optimizer, nn.MSELoss(), None, CPU, None, log_seconds=3600)
    out = capsys.readouterr().out
    assert re.findall(r"^  step (\d+) \| loss [\d.]+ \| \d+ samples/s$", out, re.M) == ["1", "2", "3"], out


SYNC_METHODS = ("item", "tolist", "__bool__", "__float__", "__int__")


def syncs_in_an_epoch(monkeypatch, batches, amp_dtype, make_optimizer, log_seconds=None):
    """Counts the Python-visible reads of a tensor's value (each waits for the device) in one epoch."""
    model = nn.Linear(10, 1)
    optimizer, scaler = make_optimizer(model), amp_train.make_scaler(CPU, amp_dtype)
    x, y = linear_batch(4)
    count = [0]
    with monkeypatch.context() as patch:
        for name in SYNC_METHODS:
            def counting(self, *args, _original=getattr(torch.Tensor, name), **kwargs):
                count[0] += 1
                return _original(self, *args, **kwargs)
            patch.setattr(torch.Tensor, name, counting)
        with contextlib.redirect_stdout(io.StringIO()):
            amp_train.train_epoch(model, [(x, y)] * batches, optimizer, nn.MSELoss(), scaler, CPU, amp_dtype,
                                  log_seconds=log_seconds)
    return count[0]


@pytest.mark.parametrize("precision,documented", [("fp32", 1), ("bf16", 1), ("fp16", 2)])
def test_train_epoch_makes_the_host_syncs_its_docstring_counts(precision, documented, monkeypatch):
    # "one at the end (two with a scaler)", with the examples' fused optimizer: none per step.
    make = lambda model: amp_train.make_optimizer(model, 0.01)  # noqa: E731
    counts = [syncs_in_an_epoch(monkeypatch, n, amp_train.PRECISIONS[precision], make) for n in (1, 10)]
    assert counts == [documented, documented], f"host syncs in epochs of 1 and 10 steps: {counts}"
    assert "one at the end (two with a" in amp_train.train_epoch.__doc__
    with_lines = syncs_in_an_epoch(monkeypatch, 10, amp_train.PRECISIONS[precision], make, log_seconds=0)
    assert with_lines == documented + 10, "one more per progress line"


def test_the_sync_counter_sees_the_plain_optimizers_sync_under_fp16(monkeypatch):
    # Proof that the counter works: scaler.step() with a plain optimizer reads found_inf every step.
    sgd = lambda model: torch.optim.SGD(model.parameters(), lr=0.01)  # noqa: E731
    one, ten = (syncs_in_an_epoch(monkeypatch, n, torch.float16, sgd) for n in (1, 10))
    assert ten == one + 9, (one, ten)


# ---------------------------------------------------------------- measuring memory

def small_conv_net():
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1),
                         nn.ReLU(), nn.Flatten(), nn.Linear(16 * 8 * 8, 10))


@pytest.mark.parametrize("amp_dtype,activation_bytes,weight_copy_bytes", [
    (None, 2 * 4 * 4, 0),                        # x, 8 floats; the weight is not counted
    (torch.bfloat16, 2 * 4 * 2, 3 * 4 * 2),      # bf16 copies of x and of the weight
])
def test_count_saved_tensors_counts_activations_and_weight_copies(amp_dtype, activation_bytes, weight_copy_bytes):
    model = nn.Linear(4, 3, bias=False)
    with amp_train.count_saved_tensors(model) as saved:
        with torch.autocast("cpu", dtype=amp_dtype, enabled=amp_dtype is not None):
            model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert saved == {"activation_bytes": activation_bytes, "weight_copy_bytes": weight_copy_bytes}, saved


def test_autocast_halves_the_activation_memory_of_a_conv_net():
    torch.manual_seed(0)
    batch = (torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,)))
    fp32, bf16 = (amp_train.measure_training(small_conv_net(), batch, nn.CrossEntropyLoss(), CPU, dtype, steps=3,
                                             warmup=1) for dtype in (None, torch.bfloat16))
    assert bf16["activation_bytes"] / fp32["activation_bytes"] < 0.6, (bf16, fp32)
    assert fp32["weight_copy_bytes"] == 0 and bf16["weight_copy_bytes"] > 0, (fp32, bf16)
    assert fp32["peak_bytes"] is None, "no peak memory number on the CPU"
    assert 0 < bf16["step_seconds_min"] <= bf16["step_seconds"] <= bf16["step_seconds_max"], bf16


def test_the_memory_example_prints_fp32_and_amp_side_by_side_with_the_spread_of_step_times(spy, capsys):
    argv = ["--device", "cpu", "--example", "memory", "--model", "resnet18-imagenet", "--batch-size", "2",
            "--steps", "2"]
    assert amp_train.main(argv) == 0
    out = capsys.readouterr().out
    assert re.search(r"^activation_bytes +[\d.]+ [KM]iB +[\d.]+ [KM]iB +0\.\d\d$", out, re.M), out
    assert re.search(r"^weight_copy_bytes +0\.00 KiB +[\d.]+ MiB +n/a$", out, re.M), out
    assert re.search(r"^peak_bytes +n/a +n/a +n/a$", out, re.M), out
    for key in ("step_seconds", "step_seconds_min", "step_seconds_max"):
        assert re.search(rf"^{key} +[\d.]+ ms +[\d.]+ ms +[\d.]+$", out, re.M), out
    assert re.search(r"^ +fp32 +bf16 +bf16/fp32$", out, re.M), out
    assert "device cpu (bf16: " in out and "model resnet18-imagenet | batch 2 | 3 warm-up + 2 timed steps" in out
    assert len(spy) == 2 * (amp_train.MEMORY_WARMUP_STEPS + 1 + 2), "3 warm-up, 1 counted, 2 timed, in each dtype"
    assert {next(iter(call["dtypes"])) for call in spy} == {torch.float32, torch.bfloat16}


@pytest.mark.parametrize("model,linear", [("linear", True), ("resnet18", False), ("resnet18-imagenet", False)])
def test_the_memory_example_builds_the_model_it_names(model, linear, monkeypatch):
    built = []
    monkeypatch.setattr(amp_train, "measure_training", lambda model, *args, **kwargs: built.append(model) or {})
    args = amp_train.parse_args(["--example", "memory", "--model", model, "--batch-size", "2", "--precision", "bf16"])
    result = amp_train.run_memory(args, CPU)
    assert (result["model"], result["batch_size"], result["precision"], len(built)) == (model, 2, "bf16", 2)
    if linear:
        assert isinstance(built[0], nn.Linear)
    else:
        assert built[0].conv1.kernel_size == ((7, 7) if model.endswith("imagenet") else (3, 3))


# ---------------------------------------------------------------- the model

def zero_gradient_share(model):
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    nn.functional.cross_entropy(model(x), y).backward()
    zeros = sum((p.grad == 0).sum().item() for p in model.parameters())
    return zeros / sum(p.numel() for p in model.parameters())


def test_the_resnet_example_has_the_cifar_stem_and_every_weight_learns():
    torch.manual_seed(0)
    model = amp_train.build_example(amp_train.parse_args(RESNET_TINY), CPU)[0]
    assert zero_gradient_share(model) < 0.01, "more than 1% of the weights got no gradient from a 32x32 batch"
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1) and isinstance(model.maxpool, nn.Identity)
    # The post's ImageNet stem: README's figure (62% of the weights without a gradient).
    assert 0.60 < zero_gradient_share(amp_train.resnet18(imagenet_stem=True)) < 0.65


def test_channels_last_resnet_matches_the_contiguous_one():
    torch.manual_seed(0)
    channels_last = amp_train.build_example(amp_train.parse_args(RESNET_TINY), CPU)[0]
    contiguous = amp_train.resnet18()
    contiguous.load_state_dict(channels_last.state_dict())
    assert channels_last.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    x, y = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    outputs = [model(x) for model in (channels_last, contiguous)]
    assert torch.allclose(outputs[0], outputs[1], atol=1e-4), (outputs[0] - outputs[1]).abs().max()
    for model, output in zip((channels_last, contiguous), outputs):
        nn.functional.cross_entropy(output, y).backward()
    a, b = (torch.cat([p.grad.flatten() for p in model.parameters()]) for model in (channels_last, contiguous))
    # fp32 sums in another order, and a ReLU input near 0 may flip: measured here, up to 0.6% of the
    # gradient's norm at batches of 2 to 8 (4e-6 without a flip). A wrong layout differs wholly.
    assert ((a - b).norm() / b.norm()).item() < 0.02, ((a - b).norm() / b.norm()).item()


# ---------------------------------------------------------------- data

def test_synthetic_data_is_seeded_and_split():
    images, labels = amp_train.synthetic_cifar10(20, seed=1)
    assert images.shape == (20, 3, 32, 32) and images.dtype is torch.uint8 and 0 <= labels.min() < labels.max() < 10
    assert torch.equal(images, amp_train.synthetic_cifar10(20, seed=1)[0]), "the same seed must give the same images"
    assert not torch.equal(images, amp_train.synthetic_cifar10(20, seed=1, train=False)[0]), "train and test differ"


def write_tiny_cifar10(root, per_batch=2):
    """A CIFAR-10 folder in the real format (pickled uint8 rows); image i is filled with the value i."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for b, name in enumerate(names):
        values = [b * per_batch + i for i in range(per_batch)]
        data = np.stack([np.full(3 * 32 * 32, v, dtype=np.uint8) for v in values])
        with open(folder / name, "wb") as f:
            pickle.dump({"data": data, "labels": [v % 10 for v in values]}, f)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"class{i}" for i in range(10)]}, f)


def test_cifar10_is_read_in_its_real_format_and_normalized(tmp_path, monkeypatch):
    import torchvision.datasets.cifar
    write_tiny_cifar10(tmp_path)
    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda *a, **k: True)  # our md5s differ
    args = amp_train.parse_args(["--data-root", str(tmp_path), "--batch-size", "5"])
    _, _, train, test = amp_train.build_example(args, CPU)
    images, labels = next(iter(test))
    mean, std = torch.tensor(amp_train.CIFAR10_MEAN), torch.tensor(amp_train.CIFAR10_STD)
    expected = ((torch.tensor([10.0, 11.0]) / 255)[:, None] - mean) / std   # test_batch holds values 10, 11
    assert labels.tolist() == [0, 1] and torch.allclose(images[:, :, 5, 5], expected, atol=1e-6), images[:, :, 5, 5]
    assert sorted(int(label) for _, batch in train for label in batch) == list(range(10))


def epoch_batches(loader, epoch):
    loader.set_epoch(epoch)
    return [(inputs.clone(), targets.clone()) for inputs, targets in loader]


def test_the_order_depends_on_seed_and_epoch_only():
    def order(seed, epoch):
        loader = amp_train.DeviceLoader(torch.arange(32), torch.arange(32), 8, CPU, shuffle=True, seed=seed)
        return torch.cat([targets for _, targets in epoch_batches(loader, epoch)]).tolist()
    assert sorted(order(0, 1)) == list(range(32)), "an epoch must see every sample once"
    assert order(0, 1) == order(0, 1) and order(0, 1) != order(0, 2) and order(0, 1) != order(1, 1)


def test_training_batches_are_whole_and_the_order_the_same_on_any_device():
    loader = amp_train.DeviceLoader(torch.arange(10), torch.arange(10), 3, CPU, shuffle=True)
    assert [len(targets) for _, targets in loader] == [3, 3, 3] == [3] * len(loader), "a batch of 1 breaks BatchNorm"
    if torch.cuda.is_available():
        on_gpu = amp_train.DeviceLoader(torch.arange(10), torch.arange(10), 3, "cuda", shuffle=True)
        assert [t.tolist() for _, t in on_gpu] == [t.tolist() for _, t in loader], "the GPU drew another order"


@pytest.mark.parametrize("batch_size", ["1", "5"])
def test_the_linear_example_refuses_a_batch_that_does_not_share_out_evenly(batch_size):
    args = amp_train.parse_args(LINEAR + ["--batch-size", batch_size])
    with pytest.raises(amp_train.UsageError, match="does not share out evenly among 2 processes"):
        amp_train.build_example(args, CPU, rank=1, world_size=2)


def test_a_batch_that_gives_some_process_no_whole_batch_is_refused_before_training(capsys):
    args = amp_train.parse_args(RESNET_TINY + ["--batch-size", "2048"])
    with pytest.raises(amp_train.UsageError, match="more than each process's 1250 training images"):
        amp_train.build_example(args, CPU, rank=7, world_size=8)
    err = run_bad(RESNET_TINY + ["--batch-size", "10001"], capsys)
    assert "--batch-size 10001 is more than each process's 10000 training images: lower it" in err, err
    assert "epoch" not in capsys.readouterr().out
    run_bad(["--device", "cpu", "--example", "memory", "--batch-size", "20000"], capsys)


def test_each_process_draws_crops_of_its_own():
    image = torch.randint(0, 256, (1, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    batches = [next(iter(amp_train.DeviceLoader(image.repeat(16, 1, 1, 1), torch.zeros(16), 8, CPU,
                                                amp_train.cifar10_transform(CPU, augment=True), shuffle=True,
                                                rank=rank, world_size=2)))[0] for rank in range(2)]
    assert not torch.equal(batches[0], batches[1]), "both processes cropped and flipped their batch alike"


@pytest.mark.parametrize("shuffle", [True, False])
def test_processes_get_disjoint_shards(shuffle):
    n, world, shards = 23, 3, []
    for rank in range(world):
        loader = amp_train.DeviceLoader(torch.arange(n), torch.arange(n), 4, CPU, shuffle=shuffle, rank=rank,
                                        world_size=world)
        shards.append(torch.cat([targets for _, targets in epoch_batches(loader, 5)]).tolist())
        assert len(loader) == math.ceil(len(shards[-1]) / 4), "len() must count the batches"
    seen = [i for shard in shards for i in shard]
    assert len(seen) == len(set(seen)), f"a sample went to two processes: {shards}"
    if shuffle:  # equal shards, so that every process takes as many steps, in whole batches (7 // 4)
        assert {len(shard) for shard in shards} == {4}, shards
    else:        # evaluation: every sample exactly once
        assert sorted(seen) == list(range(n)), shards


def test_every_augmented_image_is_a_window_of_the_padded_image_possibly_mirrored():
    import torchvision.transforms.v2.functional as TF
    images = torch.randint(0, 256, (64, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    out = amp_train.random_crop_flip(images, torch.Generator().manual_seed(1))
    windows = []
    for image, augmented in zip(images, out):  # torchvision's pad, crop and flip, by brute force
        padded, flip = TF.pad(image, [4]), {False: lambda t: t, True: TF.horizontal_flip}
        windows.append(next(((dy, dx, m) for dy in range(9) for dx in range(9) for m in (False, True)
                             if torch.equal(flip[m](TF.crop(padded, dy, dx, 32, 32)), augmented)), None))
    assert None not in windows, f"image {windows.index(None)} is no window of its padded image"
    assert len({(dy, dx) for dy, dx, _ in windows}) > 20 and {m for _, _, m in windows} == {False, True}, windows
    assert {dy for dy, _, _ in windows} == set(range(9)) == {dx for _, dx, _ in windows}, windows


# ---------------------------------------------------------------- every flag, through main()

@pytest.fixture
def spy(monkeypatch):
    """Records what main() hands train_epoch each epoch: the batches, the keyword arguments, the
    model's output dtypes, and each optimizer step with the gradient norm it saw."""
    calls, real = [], amp_train.train_epoch

    def recording(model, loader, optimizer, criterion, scaler, device, amp_dtype, **kwargs):
        call = {"batches": [], "kwargs": kwargs, "forwards": 0, "norms": [], "dtypes": set(), "optimizer": optimizer,
                "weight": next(model.parameters()).detach().clone()}
        def batches():
            for inputs, targets in loader:
                call["batches"].append((inputs.clone(), targets.clone()))
                yield inputs, targets
        def forward_hook(module, inputs, output):
            call["forwards"] += 1
            call["dtypes"].add(output.dtype)
        def step_hook(*_):
            norms = torch.stack([p.grad.norm() for p in model.parameters()])
            call["norms"].append(torch.linalg.vector_norm(norms).item())
        hooks = [model.register_forward_hook(forward_hook), optimizer.register_step_pre_hook(step_hook)]
        call["stats"] = real(model, batches(), optimizer, criterion, scaler, device, amp_dtype, **kwargs)
        for hook in hooks:
            hook.remove()
        calls.append(call)
        return call["stats"]
    monkeypatch.setattr(amp_train, "train_epoch", recording)
    return calls


def test_example_linear_runs_the_post_program_and_learns(spy, capsys):
    assert amp_train.main(LINEAR + ["--epochs", "20"]) == 0
    out = capsys.readouterr().out
    losses = [float(x) for x in re.findall(r"^epoch +\d+/20 \| train loss ([\d.]+)", out, re.M)]
    assert len(losses) == 20 == len(spy) and losses[-1] < losses[0] - 0.1, losses
    assert "example linear" in out and "precision bf16 | scaler off" in out and " step " not in out, out
    assert [len(c["batches"]) for c in spy] == [1] * 20 and spy[0]["batches"][0][0].shape == (128, 10)


def test_example_resnet_trains_and_evaluates_every_epoch_and_prints_progress_on_time(spy, capsys):
    assert amp_train.main(RESNET_TINY + ["--epochs", "2", "--lr", "0.05"]) == 0
    out = capsys.readouterr().out
    line = (r"^epoch 2/2 \| train loss [\d.]+ \| test loss [\d.]+ \| test acc +[\d.]+% \| lr 0\.05 \| "
            r"scale off \| skipped 0 \| \d+ samples/s \| [\d.]+ s$")
    assert re.search(line, out, re.M) and "| data synthetic | batch 4 |" in out, out
    # A CPU user sees a progress line within about 30 s of the header, however long an epoch is.
    assert [c["kwargs"]["log_seconds"] for c in spy] == [amp_train.PROGRESS_SECONDS] * 2
    assert 0 < amp_train.PROGRESS_SECONDS <= 25


@pytest.mark.parametrize("precision,dtype,scale", [("fp32", torch.float32, "off"), ("bf16", torch.bfloat16, "off"),
                                                   ("fp16", torch.float16, "65536")])
def test_precision_sets_the_dtype_autocast_computes_in(precision, dtype, scale, spy, capsys):
    assert amp_train.main(LINEAR + ["--epochs", "1", "--precision", precision]) == 0
    assert spy[0]["dtypes"] == {dtype}, spy[0]["dtypes"]
    assert f"| scale {scale} |" in capsys.readouterr().out


def test_device_cpu_is_used_and_cuda_without_a_gpu_exits_2(monkeypatch, spy, capsys):
    assert amp_train.main(LINEAR + ["--epochs", "1"]) == 0 and "device cpu" in capsys.readouterr().out
    assert spy[0]["batches"][0][0].device.type == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "--device cpu" in run_bad(["--example", "linear", "--device", "cuda"], capsys)


def test_device_cuda_takes_gpu_0_and_turns_on_cudnn_benchmark(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    seen = {}
    monkeypatch.setattr(amp_train, "run_training", lambda args, device, *rest: seen.update(
        device=device, benchmark=torch.backends.cudnn.benchmark, precision=args.precision) or 0)
    assert amp_train.main(["--example", "linear", "--device", "cuda"]) == 0
    assert seen == {"device": torch.device("cuda", 0), "benchmark": True, "precision": "fp16"}, seen


def test_epochs_sets_the_number_of_epochs(spy, capsys):
    assert amp_train.main(LINEAR + ["--epochs", "3"]) == 0
    assert len(spy) == 3 and len(epoch_lines(capsys.readouterr().out)) == 3


@pytest.mark.parametrize("example", [RESNET_TINY, LINEAR])
def test_batch_size_sets_the_batches(example, spy, capsys):
    assert amp_train.main(example + ["--epochs", "1", "--batch-size", "6"]) == 0
    assert {len(targets) for _, targets in spy[0]["batches"]} == {6}, [len(t) for _, t in spy[0]["batches"]]


def test_lr_sets_the_size_of_the_step(spy, capsys):
    moves = []
    for lr in ("0.01", "0.04"):
        assert amp_train.main(LINEAR + ["--epochs", "1", "--precision", "fp32", "--lr", lr]) == 0
        moves.append((spy[-1]["optimizer"].param_groups[0]["params"][0] - spy[-1]["weight"]).abs().sum().item())
    assert moves[1] == pytest.approx(4 * moves[0], rel=1e-4), moves


def test_data_and_data_root_choose_what_resnet_trains_on(tmp_path, monkeypatch, spy, capsys):
    import torchvision.datasets.cifar
    write_tiny_cifar10(tmp_path / "cifar", per_batch=4)  # each image one value all over
    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda *a, **k: True)  # our md5s differ
    argv = RESNET_TINY[:4] + ["--precision", "fp32", "--epochs", "1", "--batch-size", "4", "--max-steps", "2"]
    assert amp_train.main(argv + ["--data-root", str(tmp_path / "cifar")]) == 0
    assert "data cifar10" in capsys.readouterr().out
    images = torch.cat([x for x, _ in spy[0]["batches"]])
    crops_of_flat_images = (images == images.amax((2, 3), keepdim=True)) | (images == images.amin((2, 3), keepdim=True))
    assert crops_of_flat_images.all(), "these are not the images of --data-root (flat, but for the crops' zero padding)"
    assert amp_train.main(argv + ["--data", "synthetic", "--data-root", str(tmp_path / "cifar")]) == 0
    assert "data synthetic" in capsys.readouterr().out
    images = torch.cat([x for x, _ in spy[1]["batches"]])
    assert not ((images == images.amax((2, 3), keepdim=True)) | (images == images.amin((2, 3), keepdim=True))).all()


def test_missing_cifar10_exits_2_and_says_what_to_do(tmp_path, monkeypatch, capsys):
    import torchvision.datasets.cifar
    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")
    monkeypatch.setattr(torchvision.datasets.cifar, "download_and_extract_archive", offline)
    err = run_bad(["--device", "cpu", "--example", "resnet", "--data-root", str(tmp_path / "data")], capsys)
    assert str(tmp_path / "data") in err and "cifar-10-python.tar.gz" in err and "--data synthetic" in err, err
    assert "no network" in err, "the cause of the failed download must be named"


def test_max_steps_ends_each_epoch_and_its_evaluation(monkeypatch, spy, capsys):
    evaluated, evaluate = [], amp_train.evaluate
    monkeypatch.setattr(amp_train, "evaluate", lambda model, loader, *args: evaluated.append(args[-1]) or evaluate(
        model, loader, *args))
    assert amp_train.main(RESNET_TINY + ["--epochs", "2", "--max-steps", "3"]) == 0
    assert [c["stats"]["steps"] for c in spy] == [3, 3] and evaluated == [3, 3], (spy, evaluated)
    assert "steps/epoch 3" in capsys.readouterr().out
    assert amp_train.main(LINEAR + ["--epochs", "1", "--max-steps", "0"]) == 0, "0: no limit"
    assert spy[-1]["kwargs"]["max_steps"] is None


def test_clip_grad_norm_caps_the_norm_the_optimizer_sees(spy, capsys):
    argv = LINEAR + ["--epochs", "3", "--precision", "bf16"]
    assert amp_train.main(argv) == 0
    assert min(n for c in spy for n in c["norms"]) > 0.5, "without clipping the norm is ~1 here"
    assert amp_train.main(argv + ["--clip-grad-norm", "0.5"]) == 0
    assert [n for c in spy[3:] for n in c["norms"]] == pytest.approx([0.5] * 3, rel=1e-3), spy[3:]
    assert amp_train.main(argv + ["--clip-grad-norm", "0"]) == 0, "0: no clipping"
    assert spy[-1]["kwargs"]["clip_grad_norm"] is None


def test_accum_steps_steps_the_optimizer_once_per_k_micro_batches(spy, capsys):
    assert amp_train.main(RESNET_TINY + ["--epochs", "1", "--accum-steps", "3"]) == 0
    assert (spy[0]["forwards"], len(spy[0]["norms"])) == (6, 2), "2 optimizer steps of 3 micro-batches each"
    assert "batch 4 x 3 accumulated | processes 1 | global batch 12" in capsys.readouterr().out


def test_seed_sets_the_weights_and_the_data(spy, capsys):
    for seed in ("0", "0", "1"):
        assert amp_train.main(RESNET_TINY + ["--epochs", "1", "--max-steps", "1", "--seed", seed]) == 0
    assert torch.equal(spy[0]["weight"], spy[1]["weight"]), "the same seed must give the same weights"
    assert not torch.equal(spy[0]["weight"], spy[2]["weight"]), "another seed must give other weights"
    assert torch.equal(spy[0]["batches"][0][0], spy[1]["batches"][0][0])
    assert not torch.equal(spy[0]["batches"][0][0], spy[2]["batches"][0][0]), "another seed must give other batches"


def test_each_epoch_reshuffles_and_recrops(spy, capsys):
    assert amp_train.main(RESNET_TINY + ["--epochs", "2", "--max-steps", "1"]) == 0
    (x1, y1), (x2, y2) = spy[0]["batches"][0], spy[1]["batches"][0]
    assert not torch.equal(y1, y2), "two epochs saw the same order"
    images, labels = amp_train.synthetic_cifar10(10_000)
    loader = amp_train.DeviceLoader(images, labels, 4, CPU, amp_train.cifar10_transform(CPU, augment=False),
                                    shuffle=True)
    plain = [next(iter(epoch_batches(loader, epoch)))[0] for epoch in (0, 1)]
    assert not torch.equal(x1, plain[0]) and not torch.equal(x2, plain[1]), "the training images were not cropped"


def test_the_lr_falls_tenfold_every_lr_step_epochs_for_resnet_and_stays_for_linear(monkeypatch, capsys):
    monkeypatch.setattr(amp_train, "LR_STEP_EPOCHS", 2)
    assert amp_train.main(RESNET_TINY + ["--epochs", "5", "--max-steps", "1"]) == 0
    lrs = [float(x) for x in re.findall(r"\| lr ([\d.e-]+) \|", capsys.readouterr().out)]
    assert lrs == pytest.approx([0.01, 0.01, 0.001, 0.001, 0.0001]), lrs
    assert amp_train.main(LINEAR + ["--epochs", "3"]) == 0
    assert re.findall(r"\| lr ([\d.e-]+) \|", capsys.readouterr().out) == ["0.01"] * 3, "the post's linear has no schedule"


# ---------------------------------------------------------------- the CPU's bf16, and the warnings

def test_the_cpus_bf16_support_is_what_proc_cpuinfo_says():
    if not os.path.exists("/proc/cpuinfo"):
        pytest.skip("no /proc/cpuinfo to compare with")
    flags = set(re.search(r"^flags\s*:(.*)$", pathlib.Path("/proc/cpuinfo").read_text(), re.M).group(1).split())
    expected = "AMX" if "amx_tile" in flags else "AVX512-BF16" if "avx512_bf16" in flags else "none"
    assert amp_train.cpu_bf16() == expected, (amp_train.cpu_bf16(), sorted(f for f in flags if "bf16" in f or "amx" in f))


def no_training(monkeypatch):
    stats = {"loss": 1.0, "steps": 1, "skipped_steps": 0, "samples": 1, "seconds": 1.0, "loss_scale": None}
    monkeypatch.setattr(amp_train, "train_epoch", lambda *args, **kwargs: stats)
    monkeypatch.setattr(amp_train, "evaluate", lambda *args: {"loss": 1.0, "accuracy": 0.0, "samples": 1})


@pytest.mark.parametrize("support,warns", [("none", True), ("AVX512-BF16", False), ("AMX", False)])
def test_the_header_names_the_cpus_bf16_and_bf16_without_it_warns_once(support, warns, monkeypatch, capsys):
    monkeypatch.setattr(amp_train, "cpu_bf16", lambda: support)
    no_training(monkeypatch)
    assert amp_train.main(RESNET_TINY + ["--precision", "bf16", "--epochs", "2"]) == 0
    captured = capsys.readouterr()
    assert f"| device cpu (bf16: {support}) | precision bf16 |" in captured.out, captured.out
    assert captured.err.count("warning: this CPU has no bf16 instructions") == warns, captured.err
    for quiet in (["--precision", "fp32"], ["--example", "linear", "--precision", "bf16"]) if warns else ():
        assert amp_train.main(RESNET_TINY + quiet) == 0 and "warning" not in capsys.readouterr().err


def test_fp16_on_the_cpu_warns_for_convolutions_also_when_a_checkpoints_flags_ask_for_it(tmp_path, capsys):
    run = RESNET_TINY + ["--epochs", "1", "--max-steps", "1", "--run-dir", str(tmp_path)]
    assert amp_train.main(run) == 0 and "warning" not in capsys.readouterr().err
    state = load(tmp_path / "checkpoint.pt")
    state["args"]["precision"] = "fp16"  # as a checkpoint of a CUDA run has it
    torch.save(state, tmp_path / "checkpoint.pt")
    assert amp_train.main(RESNET_TINY[:4] + ["--run-dir", str(tmp_path), "--resume", "--epochs", "1"]) == 0
    captured = capsys.readouterr()
    assert "warning: fp16 convolutions are very slow on CPUs" in captured.err and "nothing to do" in captured.out


# ---------------------------------------------------------------- errors a user can cause

@pytest.mark.parametrize("argv", [
    ["--example", "nope"], ["--precision", "fp8"], ["--device", "tpu"], ["--data", "imagenet"],
    ["--epochs", "0"], ["--epochs", "-3"], ["--batch-size", "0"], ["--max-steps", "-1"], ["--epochs", str(2**31)],
    ["--lr", "0"], ["--lr", "-0.1"], ["--lr", "nan"], ["--lr", "abc"], ["--lr", "1e300"], ["--lr", "inf"],
    ["--clip-grad-norm", "-1"], ["--accum-steps", "1" + "0" * 30], ["--seed", "18446744073709551616"],
    ["--seed", "-1"], ["--no-such-flag"], ["--example", "memory", "--steps", "0"],
    ["--device", "cpu", "--example", "memory", "--precision", "fp32"],
    ["--device", "cpu", "--example", "memory", "--model", "vgg"], ["--example", "memory", "--run-dir", "x"],
    ["--device", "cpu", "--example", "linear", "--resume"], ["--device", "cpu", "--run-dir", ""],
])
def test_bad_flags_exit_2_with_one_line(argv, capsys):
    run_bad(argv, capsys)


def test_an_empty_run_dir_as_an_unset_variable_gives_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert "--run-dir takes a folder" in run_bad(LINEAR + ["--run-dir", ""], capsys)
    assert not list(tmp_path.iterdir())


def test_a_bound_is_printed_exactly(capsys):
    assert "4294967296 is not in [0, 4294967295]" in run_bad(["--seed", "4294967296"], capsys)
    assert "is not in [5e-324, 3.4028234663852886e+38]" in run_bad(["--lr", "1e39"], capsys)


@pytest.mark.parametrize("error", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
    RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                 "you tried to allocate 40000000000 bytes. Error code 12 (Cannot allocate memory)"),
])
def test_out_of_memory_exits_2_and_names_the_batch_size(error, monkeypatch, capsys):
    def too_big(*args, **kwargs):
        raise error
    monkeypatch.setattr(amp_train, "build_example", too_big)
    assert "out of memory at --batch-size 1000000000" in run_bad(LINEAR + ["--batch-size", "1000000000"], capsys)
    monkeypatch.setattr(amp_train, "build_example", lambda *a: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):
        amp_train.main(LINEAR)


def test_ctrl_c_under_pytest_stops_the_suite_not_just_main(monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(amp_train, "train_epoch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        amp_train.main(LINEAR)


def test_bf16_on_a_gpu_without_it_exits_2(monkeypatch, capsys):
    # A V100 or T4 "supports" bf16 by emulation only: that must count as no support.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    assert "--precision fp16" in run_bad(["--example", "linear", "--device", "cuda", "--precision", "bf16"], capsys)


def test_bf16_support_is_asked_of_this_processs_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    current = []  # is_bf16_supported() asks the current GPU: it must be this process's by then
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: current == [
        torch.device("cuda", 1)])
    monkeypatch.setattr(amp_train, "run_training", lambda args, device, *rest: 0)
    assert amp_train.main(["--example", "linear", "--device", "cuda", "--precision", "bf16"]) == 0


def test_world_size_without_the_rest_of_torchruns_environment_exits_2(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    for key in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    assert "start with torchrun" in run_bad(LINEAR, capsys)


# ---------------------------------------------------------------- the run folder: checkpoints, resume, metrics

def scaler_that_grows_every_step(device, amp_dtype):
    # The scale doubles after every good step and halves on overflow: it moves from 2**16 at once.
    return torch.amp.GradScaler(device.type, enabled=amp_dtype is torch.float16, growth_interval=1)


def assert_same_state(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where} keys differ"
        for key in a:
            assert_same_state(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where} lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{where}/{i}")
    else:
        assert a == b, f"{where}: {a} != {b}"


def without_times(records):
    return [{k: v for k, v in r.items() if k not in ("seconds", "samples_per_second")} for r in records]


@pytest.mark.parametrize("example,epochs,split", [(RESNET_TINY, 3, 2), (LINEAR_FP16, 6, 3)])
def test_resume_gives_bit_identical_weights(example, epochs, split, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(amp_train, "make_scaler", scaler_that_grows_every_step)
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    assert amp_train.main(example + ["--epochs", str(epochs), "--run-dir", straight]) == 0
    assert amp_train.main(example + ["--epochs", str(split), "--run-dir", resumed]) == 0
    if example is LINEAR_FP16:
        assert load(f"{resumed}/checkpoint.pt")["scaler"]["scale"] != 65536.0, "the scale must have moved"
    assert amp_train.main(example + ["--epochs", str(epochs), "--run-dir", resumed, "--resume"]) == 0
    assert f"resumed from {resumed} after epoch {split}" in capsys.readouterr().out
    a, b = load(f"{straight}/checkpoint.pt"), load(f"{resumed}/checkpoint.pt")
    for key in ("epoch", "model", "optimizer", "scaler"):
        assert_same_state(a[key], b[key], key)
    assert without_times(read_metrics(f"{straight}/metrics.jsonl")) == without_times(
        read_metrics(f"{resumed}/metrics.jsonl"))


def test_the_checkpoint_loads_with_weights_only_and_every_write_goes_through_a_synced_tmp(tmp_path, monkeypatch):
    calls, fsync, replace = [], os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append("fsync") or fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: calls.append(f"replace {pathlib.Path(b).name}") or replace(a, b))
    assert amp_train.main(LINEAR_FP16 + ["--epochs", "2", "--run-dir", str(tmp_path)]) == 0
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)  # raises on anything but tensors and plain types
    assert state["epoch"] == 2 and state["scaler"]["scale"] == 65536.0 and state["args"]["precision"] == "fp16"
    # Before the first epoch (epoch 0), then after each: the metrics, then the checkpoint.
    assert calls == ["fsync", "replace metrics.jsonl", "fsync", "replace checkpoint.pt"] * 3, calls
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt", "metrics.jsonl"], "and no lock file"


def inside_a_runtime_error(error):
    """What torch.save raised on a full tmpfs: the OSError, then a RuntimeError from its zip writer's exit."""
    try:
        raise error
    except BaseException:
        try:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 15904128 vs 15904024")
        except RuntimeError as wrapped:
            return wrapped


@pytest.mark.parametrize("error,says", [
    (OSError(errno.ENOSPC, "No space left on device"), "; free some space"),
    (inside_a_runtime_error(OSError(errno.ENOSPC, "No space left on device")), "No space left on device; free some"),
    (OSError(errno.EPERM, "Operation not permitted"), "not permitted);")])
def test_a_failed_save_leaves_the_last_checkpoint_intact_and_names_the_cause(error, says, tmp_path, monkeypatch,
                                                                              capsys):
    assert amp_train.main(LINEAR_FP16 + ["--epochs", "1", "--run-dir", str(tmp_path)]) == 0
    before, full = files_of(tmp_path), "No space" in str(error) + str(error.__context__)
    def disk_full(obj, f):
        f.write(b"half a checkpoint")
        raise error
    monkeypatch.setattr(amp_train.torch, "save", disk_full)
    err = run_bad(LINEAR_FP16 + ["--epochs", "3", "--run-dir", str(tmp_path), "--resume"], capsys)
    assert says in err and f"{tmp_path} holds epoch 1" in err, err
    assert ("free some space" in err) == full, err
    assert "epoch 2/3" not in capsys.readouterr().out, "the failure must come before training"
    assert files_of(tmp_path)["checkpoint.pt"] == before["checkpoint.pt"], "the last good checkpoint was changed"
    assert not list(tmp_path.glob("*.tmp")), "the half-written temporary file was left behind"


def test_a_signal_inside_torch_save_ends_the_run_as_a_signal_does(tmp_path, monkeypatch, capsys):
    assert amp_train.main(LINEAR_FP16 + ["--epochs", "1", "--run-dir", str(tmp_path)]) == 0
    before = files_of(tmp_path)
    def terminated_mid_save(obj, f):  # as torch.save on SIGTERM: its zip writer's exit wraps the signal
        f.write(b"half a checkpoint")
        raise inside_a_runtime_error(amp_train.Stopped(signal.SIGTERM))
    monkeypatch.setattr(amp_train.torch, "save", terminated_mid_save)
    assert amp_train.main(LINEAR_FP16 + ["--epochs", "3", "--run-dir", str(tmp_path), "--resume"]) == 143
    assert capsys.readouterr().err == f"error: terminated; {tmp_path} holds epoch 1\n"
    assert files_of(tmp_path) == before and not list(tmp_path.glob("*.tmp"))


def test_an_interrupted_write_leaves_the_old_file_and_no_tmp(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("old\n")
    def interrupted(f):
        f.write(b"new, half")
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        amp_train.replace_file(str(path), interrupted)
    assert path.read_text() == "old\n" and not list(tmp_path.glob("*.tmp"))


def a_linear_run(path):
    assert amp_train.main(LINEAR_FP16 + ["--epochs", "1", "--run-dir", str(path.parent)]) == 0


def truncate(path):
    a_linear_run(path)
    path.write_bytes(path.read_bytes()[:200])


def edited(**fields):
    """Makes a real checkpoint, then sets (or, with None, removes) some of its fields; a field
    named like "args__seed" sets a key of a dict field."""
    def make(path):
        a_linear_run(path)
        state = load(path)
        for key, value in fields.items():
            where, key = (state[key.split("__")[0]], key.split("__")[1]) if "__" in key else (state, key)
            where.pop(key) if value is None else where.__setitem__(key, value)
        torch.save(state, path)
    return make


def deeply_nested_metrics(path):
    a_linear_run(path)
    state = load(path)
    state["metrics"] = functools.reduce(lambda inner, _: [inner], range(3000), [])  # loads, but no walk ends
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)  # for torch.save's pickler
    try:
        torch.save(state, path)
    finally:
        sys.setrecursionlimit(limit)


class CreatesAFile:
    """Unpickling this creates the file: what a malicious checkpoint could do."""
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.path),)


@pytest.mark.parametrize("make,argv,says", [
    (lambda path: torch.save({"format": amp_train.CHECKPOINT_FORMAT}, path), LINEAR_FP16, "not a readable checkpoint"),
    (edited(epoch=float("inf")), LINEAR_FP16, "is damaged"),
    (edited(epoch=-5), LINEAR_FP16, "is damaged"),
    (edited(epoch=True), LINEAR_FP16, "is damaged"),
    (edited(model=None), LINEAR_FP16, "not a readable checkpoint"),
    (edited(args={"lr": 0.01}), LINEAR_FP16, "holds flags this program refuses"),
    (edited(args__lr=-1.0), LINEAR_FP16, "is damaged"),
    (edited(args__lr=0.0), LINEAR_FP16, "holds flags this program refuses"),
    (edited(args__precision=None), LINEAR_FP16, "holds flags this program refuses"),
    (edited(example="memory"), LINEAR_FP16, "is damaged"),
    (edited(metrics="1, 2"), LINEAR_FP16, "is damaged"),
    (edited(model={"weight": torch.zeros(3)}), LINEAR_FP16, "does not fit this run"),
    (edited(model={"weight": torch.full((1, 10), float("nan")), "bias": torch.zeros(1)}), LINEAR_FP16, "is damaged"),
    # Momentum for a weight of 10 elements, in 3: loading it once corrupted memory (SIGABRT).
    (edited(optimizer={0: {"momentum_buffer": torch.zeros(3)}}), LINEAR_FP16, "does not fit this run"),
    (edited(optimizer={0: "x"}), LINEAR_FP16, "does not fit this run"),
    (deeply_nested_metrics, LINEAR_FP16, "RecursionError"),
    (edited(scaler__scale=-1.0), LINEAR_FP16, "is damaged"),
    (lambda path: torch.save({"format": amp_train.CHECKPOINT_FORMAT, "x": CreatesAFile(f"{path}.pwned")}, path),
     LINEAR_FP16, "not a readable checkpoint"),
    (truncate, LINEAR_FP16, "not a readable checkpoint"),
    (lambda path: torch.save({"weights": torch.zeros(3)}, path), LINEAR_FP16, "not a readable checkpoint"),
    (a_linear_run, RESNET_TINY, "holds a run of the linear example: pass --example linear"),
])
def test_bad_checkpoints_exit_2_and_nothing_is_touched(make, argv, says, tmp_path, capsys):
    make(tmp_path / "checkpoint.pt")
    capsys.readouterr()
    before = files_of(tmp_path)
    err = run_bad(argv + ["--epochs", "2", "--run-dir", str(tmp_path), "--resume"], capsys)
    assert says in err, err
    assert files_of(tmp_path) == before, "a file of the run folder was changed"
    assert not os.path.exists(tmp_path / "checkpoint.pt.pwned"), "loading the checkpoint ran pickled code"


def test_hyperparameters_come_from_the_flags_never_from_the_checkpoint(tmp_path, capsys):
    assert amp_train.main(RESNET_TINY + ["--epochs", "1", "--max-steps", "1", "--run-dir", str(tmp_path)]) == 0
    state = load(tmp_path / "checkpoint.pt")
    state["optimizer_param_groups"] = [{"lr": 0.0, "momentum": 0.9}]  # extra keys are ignored too
    state["scheduler"] = {"step_size": 0, "last_epoch": "1"}
    torch.save(state, tmp_path / "checkpoint.pt")
    assert amp_train.main(RESNET_TINY + ["--epochs", "2", "--max-steps", "1", "--run-dir", str(tmp_path),
                                         "--resume"]) == 0
    assert re.search(r"^epoch 2/2 .*\| lr 0\.01 \|", capsys.readouterr().out, re.M)


def test_a_denormal_lr_then_a_new_lr_trains_at_the_new_lr(tmp_path, capsys):
    run = LINEAR + ["--run-dir", str(tmp_path)]
    assert amp_train.main(run + ["--epochs", "1", "--lr", "5e-324"]) == 0
    assert amp_train.main(run + ["--epochs", "2", "--lr", "0.01", "--resume"]) == 0
    out = capsys.readouterr().out
    assert "note: --lr 0.01 replaces the checkpoint's 5e-324" in out and re.search(r"^epoch 2/2 .*\| lr 0\.01 \|",
                                                                                    out, re.M), out


def test_a_checkpoint_in_torchs_old_format_resumes_and_the_stop_line_reads_it(tmp_path, capsys):
    a_linear_run(tmp_path / "checkpoint.pt")
    torch.save(load(tmp_path / "checkpoint.pt"), tmp_path / "checkpoint.pt", _use_new_zipfile_serialization=False)
    assert f"{tmp_path} holds epoch 1" == amp_train.holds(str(tmp_path))
    assert amp_train.main(LINEAR_FP16 + ["--epochs", "2", "--run-dir", str(tmp_path), "--resume"]) == 0


def fifo(path):
    os.mkfifo(path)


def folder(path):
    path.mkdir()


def symlink_to_precious(path):
    (path.parent / "precious.txt").write_text("someone's work")
    path.symlink_to(path.parent / "precious.txt")


@pytest.mark.parametrize("name,make,says", [
    ("metrics.jsonl", fifo, "is not a regular file"),
    ("checkpoint.pt", fifo, "is not a regular file"),
    ("checkpoint.pt", symlink_to_precious, "is not a regular file"),
    ("checkpoint.pt.tmp", folder, "Is a directory"),
    ("metrics.jsonl.tmp", folder, "Is a directory"),
])
def test_what_stands_in_a_run_folder_is_refused_before_training_and_kept(name, make, says, tmp_path, capsys):
    make(tmp_path / name)
    before = {p.name: p.lstat().st_mode for p in tmp_path.iterdir()}
    err = run_bad(LINEAR + ["--epochs", "1", "--run-dir", str(tmp_path)], capsys)
    assert says in err and "epoch 1/1" not in capsys.readouterr().out, err
    assert {p.name: p.lstat().st_mode for p in tmp_path.iterdir() if p.name in before} == before
    assert not (tmp_path / "checkpoint.pt").is_file() or name != "checkpoint.pt.tmp", "saved before the error"
    assert not (tmp_path / "precious.txt").exists() or (tmp_path / "precious.txt").read_text() == "someone's work"


@pytest.mark.parametrize("name,make", [(name, make) for name in ("lock", "checkpoint.pt.tmp", "metrics.jsonl.tmp")
                                       for make in (symlink_to_precious, fifo)])
def test_links_and_fifos_named_like_this_programs_files_are_never_written_through_nor_hang(name, make, tmp_path,
                                                                                          capsys):
    make(tmp_path / name)  # a FIFO opened for writing would block for good
    for argv in ([], ["--resume"]):
        assert amp_train.main(LINEAR + ["--epochs", str(1 + len(argv)), "--run-dir", str(tmp_path), *argv]) == 0
    if make is symlink_to_precious:
        assert (tmp_path / "precious.txt").read_text() == "someone's work", "a link's target was written"
    assert load(tmp_path / "checkpoint.pt")["epoch"] == 2 and (tmp_path / "checkpoint.pt").is_file()
    assert not (tmp_path / "checkpoint.pt").is_symlink() and not (tmp_path / "metrics.jsonl").is_symlink()


def test_a_link_that_appears_at_the_tmp_name_after_it_was_cleared_is_not_written_through(tmp_path, monkeypatch):
    symlink_to_precious(tmp_path / "metrics.jsonl.tmp")
    monkeypatch.setattr(amp_train.os, "unlink", lambda path: None)  # the link came back: a race
    with pytest.raises(FileExistsError):
        amp_train.replace_file(str(tmp_path / "metrics.jsonl"), lambda f: f.write(b"lines"))
    assert (tmp_path / "precious.txt").read_text() == "someone's work"


def test_a_folder_named_lock_changes_nothing(tmp_path, capsys):
    (tmp_path / "lock").mkdir()
    assert amp_train.main(LINEAR + ["--epochs", "1", "--run-dir", str(tmp_path)]) == 0


@pytest.mark.parametrize("where,make,says", [
    ("file", lambda folder: folder.write_text(""), "File exists"),
    ("x" * 300, None, "File name too long"),
])
def test_a_run_folder_that_cannot_be_made_is_refused_before_training(where, make, says, tmp_path, capsys):
    path = tmp_path / where
    if make:
        make(path)
    err = run_bad(LINEAR + ["--epochs", "1", "--run-dir", str(path)], capsys)
    assert says in err and "epoch 1/1" not in capsys.readouterr().out, err


def test_an_immutable_checkpoint_is_refused_before_training(tmp_path, capsys):
    assert amp_train.main(LINEAR + ["--epochs", "1", "--run-dir", str(tmp_path)]) == 0
    if subprocess.run(["chattr", "+i", str(tmp_path / "checkpoint.pt")], capture_output=True).returncode:
        pytest.skip("this file system takes no immutable flag (chattr)")
    try:
        err = run_bad(LINEAR + ["--epochs", "2", "--run-dir", str(tmp_path), "--resume"], capsys)
        assert "Operation not permitted" in err and "epoch 2/2" not in capsys.readouterr().out, err
    finally:
        subprocess.run(["chattr", "-i", str(tmp_path / "checkpoint.pt")])


def test_in_an_append_only_folder_the_error_names_the_tmp_it_cannot_remove(tmp_path, capsys):
    assert amp_train.main(LINEAR + ["--epochs", "1", "--run-dir", str(tmp_path)]) == 0
    if subprocess.run(["chattr", "+a", str(tmp_path)], capture_output=True).returncode:
        pytest.skip("this file system takes no append-only flag (chattr)")
    try:
        err = run_bad(LINEAR + ["--epochs", "2", "--run-dir", str(tmp_path), "--resume"], capsys)
        assert f"{tmp_path}/metrics.jsonl.tmp" in err and "epoch 2/2" not in capsys.readouterr().out, err
        assert amp_train.main(LINEAR + ["--epochs", "1", "--run-dir", str(tmp_path), "--resume"]) == 0
        assert "nothing to do" in capsys.readouterr().out
        assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt", "metrics.jsonl", "metrics.jsonl.tmp"]
    finally:
        subprocess.run(["chattr", "-a", str(tmp_path)])


def test_a_resume_with_nothing_to_do_writes_nothing(tmp_path, capsys):
    assert amp_train.main(LINEAR + ["--epochs", "2", "--run-dir", str(tmp_path)]) == 0
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    assert amp_train.main(LINEAR + ["--epochs", "2", "--run-dir", str(tmp_path), "--resume"]) == 0
    assert "nothing to do: the checkpoint has 2 epochs" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == before


def test_a_second_run_on_a_live_runs_folder_refuses_and_touches_nothing(tmp_path, capsys):
    assert amp_train.main(LINEAR + ["--epochs", "1", "--run-dir", str(tmp_path)]) == 0
    before = files_of(tmp_path)
    live = os.open(tmp_path, os.O_RDONLY)  # the lock a live run holds: flock on the folder itself
    try:
        import fcntl
        fcntl.flock(live, fcntl.LOCK_EX)
        for argv in ([], ["--resume"]):
            assert "another run is using" in run_bad(LINEAR + ["--run-dir", str(tmp_path), *argv], capsys)
    finally:
        os.close(live)  # as the kernel does when the live run dies
    assert files_of(tmp_path) == before and sorted(before) == ["checkpoint.pt", "metrics.jsonl"], "no lock file"
    assert amp_train.main(LINEAR + ["--epochs", "2", "--run-dir", str(tmp_path), "--resume"]) == 0


def test_a_folder_with_metrics_but_no_checkpoint_is_refused_and_the_command_it_names_works(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"epoch": 1, "train_loss": 1.0}\n')  # someone's, or a lost run's
    for argv in ([], ["--resume"]):
        err = run_bad(LINEAR + ["--epochs", "2", "--run-dir", str(tmp_path), *argv], capsys)
        assert f"delete {tmp_path / 'metrics.jsonl'} to start again" in err and "add --resume" not in err, err
    assert (tmp_path / "metrics.jsonl").read_text() == '{"epoch": 1, "train_loss": 1.0}\n'
    (tmp_path / "metrics.jsonl").unlink()
    assert amp_train.main(LINEAR + ["--epochs", "2", "--run-dir", str(tmp_path)]) == 0, "the command it names works"


def test_resume_without_a_checkpoint_is_an_error_and_creates_nothing(tmp_path, capsys):
    assert "run without --resume" in run_bad(LINEAR + ["--run-dir", str(tmp_path / "typo"), "--resume"], capsys)
    assert not (tmp_path / "typo").exists(), "a mistyped path must not become a run folder"
    assert "run without --resume" in run_bad(LINEAR + ["--run-dir", str(tmp_path), "--resume"], capsys)


def test_an_existing_checkpoint_is_not_overwritten_without_resume(tmp_path, capsys):
    assert amp_train.main(LINEAR + ["--epochs", "1", "--run-dir", str(tmp_path)]) == 0
    before = files_of(tmp_path)
    assert "add --resume" in run_bad(LINEAR + ["--epochs", "2", "--run-dir", str(tmp_path)], capsys)
    assert files_of(tmp_path) == before


def test_resume_writes_the_metrics_from_the_checkpoint_whatever_the_file_holds(tmp_path, capsys):
    straight = tmp_path / "straight"
    assert amp_train.main(LINEAR_FP16 + ["--epochs", "4", "--run-dir", str(straight)]) == 0
    run = LINEAR_FP16 + ["--run-dir", str(tmp_path / "run")]
    assert amp_train.main(run + ["--epochs", "2"]) == 0
    with open(tmp_path / "run" / "metrics.jsonl", "a") as f:  # a later epoch, torn, foreign, too deep, bad epochs
        f.write('{"example": "linear", "epoch": 3, "train_loss": 9.0}\n{"example": "lin\n[1, 2]\n' + "[" * 1100
                + "]" * 1100 + '\n{"epoch": 1e308}\n{"epoch": NaN}\n')
        f.write("\n".join(['{"epoch": 3}'] * 2).encode("utf-16").decode("latin-1") + "\n")
    assert amp_train.main(run + ["--epochs", "4", "--resume"]) == 0
    assert without_times(read_metrics(tmp_path / "run" / "metrics.jsonl")) == without_times(
        read_metrics(straight / "metrics.jsonl"))


def test_a_diverged_epoch_is_recorded_with_null_for_inf_and_the_run_stops(tmp_path, capsys):
    argv = LINEAR + ["--precision", "fp32", "--lr", "1e20", "--epochs", "5", "--run-dir", str(tmp_path)]
    assert amp_train.main(argv) == 1
    err = capsys.readouterr().err
    assert re.search(rf"^error: epoch 2: the model's \w+ holds inf/NaN; {re.escape(str(tmp_path))} holds epoch 1; "
                     r"try a lower --lr or --clip-grad-norm$", err, re.M), err
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "Infinity" not in text and "NaN" not in text, "the file must be standard JSON"
    assert [r["train_loss"] is None for r in read_metrics(tmp_path / "metrics.jsonl")] == [False, True]
    assert load(tmp_path / "checkpoint.pt")["epoch"] == 1


def test_a_failed_metrics_write_exits_2(tmp_path, monkeypatch, capsys):
    writes, write_metrics = [], amp_train.write_metrics
    def full_disk_at_epoch_1(folder, lines):
        writes.append(len(lines))
        if lines:
            raise OSError(errno.ENOSPC, "No space left on device")
        write_metrics(folder, lines)
    monkeypatch.setattr(amp_train, "write_metrics", full_disk_at_epoch_1)
    err = run_bad(LINEAR_FP16 + ["--epochs", "2", "--run-dir", str(tmp_path)], capsys)
    assert "could not write in" in err and "No space left" in err and "free some space" in err, err
    assert f"{tmp_path} holds epoch 0" in err and writes == [0, 1], (err, writes)


def test_flags_not_given_on_resume_keep_the_checkpoints_values_and_0_clears_a_limit(tmp_path, capsys):
    run = LINEAR + ["--run-dir", str(tmp_path)]
    assert amp_train.main(run + ["--epochs", "3", "--lr", "0.05", "--batch-size", "16", "--precision", "fp32",
                                 "--clip-grad-norm", "1", "--max-steps", "5"]) == 0
    assert amp_train.main(run + ["--epochs", "4", "--resume", "--data", "synthetic"]) == 0
    out = capsys.readouterr().out
    assert "note:" not in out and "precision fp32" in out.split("resumed from")[0].splitlines()[-1], out
    assert re.search(r"^epoch 4/4 .*\| lr 0\.05 \|", out, re.M), out
    saved = load(tmp_path / "checkpoint.pt")["args"]
    assert (saved["batch_size"], saved["clip_grad_norm"], saved["max_steps"], saved["epochs"]) == (16, 1.0, 5, 4)
    assert amp_train.main(run + ["--epochs", "5", "--resume", "--clip-grad-norm", "0", "--max-steps", "0"]) == 0
    out = capsys.readouterr().out
    assert "note: --clip-grad-norm 0.0 replaces the checkpoint's 1.0" in out, out
    saved = load(tmp_path / "checkpoint.pt")["args"]
    assert (saved["clip_grad_norm"], saved["max_steps"]) == (0.0, 0), "README's resume example: a limit can go"
    assert amp_train.main(run + ["--resume"]) == 0 and "nothing to do" in capsys.readouterr().out


def test_changed_flags_on_resume_are_noted_or_refused(tmp_path, capsys):
    run = RESNET_TINY + ["--max-steps", "1", "--run-dir", str(tmp_path)]
    assert amp_train.main(run + ["--epochs", "1"]) == 0
    assert amp_train.main(run + ["--epochs", "2", "--resume", "--clip-grad-norm", "1", "--batch-size", "2",
                                 "--precision", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "note: --clip-grad-norm 1.0 replaces the checkpoint's 0.0" in out, out
    assert "note: --batch-size 2 replaces the checkpoint's 4" in out and "--precision" not in out, out
    before = files_of(tmp_path)
    assert "trained on --data synthetic" in run_bad(run + ["--epochs", "3", "--resume", "--data", "cifar10"], capsys)
    assert files_of(tmp_path) == before


def test_a_checkpoints_flags_are_compared_as_the_command_line_reads_them(tmp_path, capsys):
    edited(args__seed="0", args__lr="0.01")(tmp_path / "checkpoint.pt")  # strings, as a crafted file may hold
    assert amp_train.main(LINEAR_FP16 + ["--epochs", "2", "--seed", "0", "--run-dir", str(tmp_path), "--resume"]) == 0
    assert "note:" not in capsys.readouterr().out


@pytest.mark.parametrize("first,then", [("fp16", "bf16"), ("bf16", "fp16"), ("fp16", "fp32")])
def test_resume_in_another_precision(first, then, tmp_path, capsys):
    run = LINEAR + ["--run-dir", str(tmp_path)]
    assert amp_train.main(run + ["--precision", first, "--epochs", "2"]) == 0
    assert amp_train.main(run + ["--precision", then, "--epochs", "4", "--resume"]) == 0
    out = capsys.readouterr().out
    assert f"note: --precision {then} replaces the checkpoint's {first}" in out and "epoch 4/4" in out, out
    assert load(tmp_path / "checkpoint.pt")["args"]["precision"] == then


def test_a_new_lr_on_resume_is_applied_and_the_schedule_goes_on(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(amp_train, "LR_STEP_EPOCHS", 1)  # the lr falls tenfold every epoch
    run = RESNET_TINY + ["--max-steps", "1", "--run-dir", str(tmp_path)]
    assert amp_train.main(run + ["--epochs", "2"]) == 0
    assert amp_train.main(run + ["--epochs", "3", "--resume", "--lr", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "note: --lr 0.5 replaces the checkpoint's 0.01" in out, out
    lrs = [float(x) for x in re.findall(r"\| lr ([\d.e-]+) \|", out)]
    assert lrs == pytest.approx([0.01, 0.001, 0.5 * 0.1 ** 2]), f"the schedule from 0.5 gives 0.005 at epoch 3: {lrs}"
    assert load(tmp_path / "checkpoint.pt")["args"]["lr"] == 0.5, "the checkpoint must record the lr now in use"


# ---------------------------------------------------------------- inf and NaN in the examples

def scaler_that_always_overflows(device, amp_dtype):
    # An infinite loss scale makes every scaled gradient inf, so every step is skipped.
    return torch.amp.GradScaler(device.type, init_scale=float("inf"))


def test_epochs_with_a_nan_test_loss_are_not_saved(tmp_path, capsys):
    argv = RESNET_TINY + ["--max-steps", "1", "--batch-size", "8", "--epochs", "5", "--lr", "1e6",
                          "--run-dir", str(tmp_path)]
    assert amp_train.main(argv) == 1
    captured = capsys.readouterr()
    assert f"note: epoch 1 is not saved, its mean test loss is nan under fp32; {tmp_path} holds epoch 0" in captured.out
    assert load(tmp_path / "checkpoint.pt")["epoch"] == 0, "an epoch with a NaN test loss was saved"


def test_fp16_stops_when_an_inf_batch_leaves_nan_in_batchnorm(monkeypatch, tmp_path, capsys):
    # The scaler skips the inf batch's step, but its forward pass already put inf/NaN into
    # BatchNorm's running statistics: that epoch must not be saved, and the run cannot go on.
    calls, train_epoch = [], amp_train.train_epoch
    def second_epoch_has_an_inf_batch(model, loader, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            images, labels = next(iter(loader))
            loader = [(torch.full_like(images, float("inf")), labels)]
        return train_epoch(model, loader, *args, **kwargs)
    monkeypatch.setattr(amp_train, "train_epoch", second_epoch_has_an_inf_batch)
    monkeypatch.setattr(amp_train, "warn_if_slow", lambda *args: None)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 30 * 30, 10))
    monkeypatch.setattr(amp_train, "resnet18", lambda imagenet_stem: model)  # fp16 convolutions are slow on CPUs
    argv = RESNET_TINY + ["--max-steps", "1", "--batch-size", "2", "--epochs", "3", "--precision", "fp16",
                          "--run-dir", str(tmp_path)]
    assert amp_train.main(argv) == 1
    err = capsys.readouterr().err
    assert re.search(rf"error: epoch 2: the model's \S+ holds inf/NaN; {re.escape(str(tmp_path))} holds epoch 1", err)
    assert load(tmp_path / "checkpoint.pt")["epoch"] == 1


def test_a_run_whose_scaler_skips_everything_stops(monkeypatch, capsys):
    monkeypatch.setattr(amp_train, "make_scaler", scaler_that_always_overflows)
    assert amp_train.main(LINEAR + ["--epochs", "100"]) == 1
    captured = capsys.readouterr()
    assert "error: epoch 32: the GradScaler skipped all of the last 32 steps" in captured.err, captured.err
    assert re.search(r"^epoch +32/100", captured.out, re.M) and "33/100" not in captured.out


# ---------------------------------------------------------------- the process: signals and its output

def test_ctrl_c_sigterm_and_two_quick_signals_end_with_one_line_naming_the_saved_epoch(tmp_path):
    signals = {"term": [signal.SIGTERM], "int": [signal.SIGINT] * 4}
    runs = {name: script(*LINEAR, "--epochs", "100000", "--run-dir", str(tmp_path / name), stderr=subprocess.STDOUT)
            for name in signals}
    for name, run in runs.items():
        wait_for(tmp_path / name / "checkpoint.pt", timeout=120)
        time.sleep(0.3)
        for signum in signals[name]:  # more signals, a few ms apart, land in the cleanup
            run.send_signal(signum)
            time.sleep(0.003)
    for name, run in runs.items():
        lines = run.communicate(timeout=60)[0].splitlines()
        word, status = ("terminated", 143) if name == "term" else ("interrupted", 130)
        saved = load(tmp_path / name / "checkpoint.pt")["epoch"]
        assert run.returncode == status and lines[-1] == f"error: {word}; {tmp_path / name} holds epoch {saved}", (
            name, run.returncode, lines[-3:])
        # The epoch lines are whole: no error line glued to one, no "Exception ignored" after it.
        assert all(re.fullmatch(r"epoch +\d+/100000 \|.* s", line) for line in lines[1:-1]), (name, lines[-3:])
        assert not list((tmp_path / name).glob("*.tmp")), "a temporary file was left behind"


@pytest.mark.parametrize("signum,status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_while_torch_imports_ends_in_one_line(signum, status):
    run = script(*LINEAR)
    time.sleep(0.3)  # importing torch takes seconds
    run.send_signal(signum)
    out, err = run.communicate(timeout=60)
    assert run.returncode == status and err == "error: stopped while starting; nothing was changed\n", err


def test_a_closed_pipe_or_a_full_disk_on_stdout_ends_in_one_line_and_a_closed_stdout_changes_nothing(
        tmp_path, monkeypatch, capsys):
    to_head = script(*LINEAR, "--epochs", "100000", "--run-dir", str(tmp_path / "a"))
    with open("/dev/full", "w") as full:
        to_full = script(*LINEAR, "--epochs", "2", stdout=full)
    first = [to_head.stdout.readline() for _ in range(2)]
    to_head.stdout.close()  # as `| head -2` does
    err = to_head.stderr.read()
    to_head.wait(timeout=60)
    assert first[1].startswith("epoch") and to_head.returncode == 2, (first, err)
    assert re.fullmatch(rf"error: Broken pipe; {re.escape(str(tmp_path / 'a'))} holds epoch \d+\n", err), err
    err = to_full.communicate(timeout=60)[1]
    assert to_full.returncode == 2 and err == "error: No space left on device; free some space; " \
                                              "nothing is saved without --run-dir\n", err
    monkeypatch.setattr(sys, "stdout", None)  # as `>&-` leaves it
    assert amp_train.main(LINEAR + ["--epochs", "2", "--run-dir", str(tmp_path / "b")]) == 0
    assert load(tmp_path / "b" / "checkpoint.pt")["epoch"] == 2 and capsys.readouterr().err == ""


def test_a_file_name_that_is_not_utf8_or_holds_a_newline_prints_on_one_line(tmp_path, capsys):
    folder = os.fsdecode(os.path.join(os.fsencode(tmp_path), b"run\xff"))  # as Python reads it from argv
    assert amp_train.main(LINEAR + ["--epochs", "1", "--run-dir", folder]) == 0
    assert amp_train.main(LINEAR + ["--epochs", "2", "--resume", "--run-dir", folder]) == 0
    out = capsys.readouterr().out  # capsys, like a UTF-8 terminal, takes no undecodable byte
    assert "resumed from " in out and "run\\udcff after epoch 1" in out, out
    err = run_bad(LINEAR + ["--run-dir", str(tmp_path / "two\nlines"), "--resume"], capsys)
    assert "two\\nlines" in err, err


def test_a_peer_that_dies_ends_the_survivor_in_one_line(tmp_path):
    dies = tmp_path / "dies.py"
    dies.write_text(f"""import os, signal, sys
sys.path.insert(0, {str(HERE)!r})
import amp_train
calls, real = [], amp_train.train_epoch
def dying(*args, **kwargs):
    calls.append(1)
    if len(calls) == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*args, **kwargs)
amp_train.train_epoch = dying
sys.exit(amp_train.main())
""")
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "OMP_NUM_THREADS": "1"}
    argv = [*LINEAR, "--epochs", "1000", "--run-dir", str(tmp_path / "run")]
    survivor = subprocess.Popen([sys.executable, SCRIPT, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, env={**env, "RANK": "0", "LOCAL_RANK": "0"})
    dying_peer = subprocess.run([sys.executable, str(dies), *argv], capture_output=True,
                                env={**env, "RANK": "1", "LOCAL_RANK": "1"}, timeout=120)
    err = survivor.communicate(timeout=120)[1]
    assert dying_peer.returncode == -signal.SIGKILL and survivor.returncode == 3, (survivor.returncode, err)
    assert re.fullmatch(rf"error: the process group failed \(.*Connection.*\); "
                        rf"{re.escape(str(tmp_path / 'run'))} holds epoch 2\n", err), err


# ---------------------------------------------------------------- several processes (DDP, gloo on the CPU)

def ddp_worker(rank, argv, out_dir, port, setup):
    """One process of a 2-process run, set up as torchrun would; saves its log, exit code, weights
    and the buffers it evaluated with. `setup(out_dir)`, if given, runs first (to mock)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)  # as torchrun sets OMP_NUM_THREADS=1: 2 processes on 2 cores
    if setup:
        setup(out_dir)
    built, evaluated = {}, []
    build_example, evaluate = amp_train.build_example, amp_train.evaluate
    def recording(*args, **kwargs):
        built["parts"] = build_example(*args, **kwargs)
        return built["parts"]
    def evaluate_recording(model, *args, **kwargs):
        evaluated.append({k: v.clone() for k, v in model.state_dict().items() if "running" in k})
        return evaluate(model, *args, **kwargs)
    amp_train.build_example, amp_train.evaluate = recording, evaluate_recording
    with open(out_dir / f"rank{rank}.out", "w") as out, open(out_dir / f"rank{rank}.err", "w") as err, \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = amp_train.main(argv)
    parameters = dict(built["parts"][0].named_parameters()) if "parts" in built else {}
    torch.save({"code": code, "group_left": not torch.distributed.is_initialized(), "evaluated": evaluated,
                "parameters": {k: v.detach() for k, v in parameters.items()}}, out_dir / f"rank{rank}.pt")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_processes(argv, out_dir, setup=None):
    torch.multiprocessing.spawn(ddp_worker, args=(argv, out_dir, free_port(), setup), nprocs=2)
    return [dict(torch.load(out_dir / f"rank{r}.pt", weights_only=True), out=(out_dir / f"rank{r}.out").read_text(),
                 err=(out_dir / f"rank{r}.err").read_text()) for r in range(2)]


def group_worker(rank, function, out_dir, port):
    """Runs function(rank) in a 2-process gloo group; saves what it returns."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo")
    try:
        torch.save(function(rank), out_dir / f"result{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def micro_batches(rank):
    x, y = linear_batch(24, seed=rank)
    return list(zip(x.split(4), y.split(4)))  # 6 micro-batches: with K = 4, a group of 4 and a short one of 2


def accumulate_under_ddp(rank):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    model, optimizer, _ = linear_setup(lr=0.1)
    ddp = nn.parallel.DistributedDataParallel(model)
    all_reduces = [0]
    def counting(state, bucket):
        all_reduces[0] += 1
        return allreduce_hook(None, bucket)
    ddp.register_comm_hook(None, counting)
    stats = amp_train.train_epoch(ddp, generator_of(micro_batches(rank)), optimizer, nn.MSELoss(), None, CPU,
                                  None, accum_steps=4)
    return {"all_reduces": all_reduces[0], "steps": stats["steps"], "weight": model.weight.detach(),
            "bias": model.bias.detach()}


def test_accumulation_under_ddp_all_reduces_once_per_step(tmp_path):
    torch.multiprocessing.spawn(group_worker, args=(accumulate_under_ddp, tmp_path, free_port()), nprocs=2)
    ranks = [torch.load(tmp_path / f"result{r}.pt", weights_only=True) for r in range(2)]
    # The reference: one process, each step's micro-batches of both ranks accumulated.
    r0, r1 = micro_batches(0), micro_batches(1)
    model, optimizer, _ = linear_setup(lr=0.1)
    amp_train.train_epoch(model, r0[:4] + r1[:4], optimizer, nn.MSELoss(), None, CPU, None, accum_steps=8)
    amp_train.train_epoch(model, r0[4:] + r1[4:], optimizer, nn.MSELoss(), None, CPU, None, accum_steps=4)
    for rank, result in enumerate(ranks):
        assert (result["steps"], result["all_reduces"]) == (2, 2), f"rank {rank}: {result}"
        for key in ("weight", "bias"):
            assert torch.allclose(result[key], getattr(model, key), atol=1e-6, rtol=0), (rank, key, result[key])


def assert_in_step(rank0, rank1):
    assert rank0["code"] == rank1["code"] == 0, (rank0["err"], rank1["err"])
    assert rank0["group_left"] and rank1["group_left"], "the process group must be destroyed at the end"
    assert rank1["out"] == rank1["err"] == "", f"rank 1 must not log: {rank1['out']!r} {rank1['err']!r}"
    for name, weight in rank0["parameters"].items():
        assert torch.equal(weight, rank1["parameters"][name]), f"{name} differs between the ranks"


def test_the_linear_example_resumes_on_another_process_count_with_the_same_data(tmp_path, capsys):
    run = LINEAR + ["--precision", "fp32", "--run-dir", str(tmp_path / "run")]
    assert amp_train.main(run + ["--epochs", "1"]) == 0
    rank0, rank1 = run_two_processes(run + ["--epochs", "2", "--resume"], tmp_path)
    assert_in_step(rank0, rank1)
    assert "batch 64 | processes 2 | global batch 128" in rank0["out"], rank0["out"]
    assert "note: 2 processes replace the checkpoint's 1: global batch 128" in rank0["out"], rank0["out"]
    assert amp_train.main(run + ["--epochs", "3", "--resume"]) == 0
    assert amp_train.main(LINEAR + ["--precision", "fp32", "--epochs", "3", "--run-dir", str(tmp_path / "alone")]) == 0
    mixed, alone = (read_metrics(tmp_path / name / "metrics.jsonl") for name in ("run", "alone"))
    assert [r["processes"] for r in mixed] == [1, 2, 1], mixed
    assert [r["train_loss"] for r in mixed] == pytest.approx([r["train_loss"] for r in alone], abs=1e-6), (mixed, alone)


def small_synthetic_cifar10(out_dir):
    """10,000 images take seconds to make in each process; DDP works alike on 256."""
    make = amp_train.synthetic_cifar10
    amp_train.synthetic_cifar10 = lambda size, seed=0, train=True: make(256, seed, train)


def test_resnet_on_two_processes_evaluates_one_model_and_notes_the_new_global_batch(tmp_path, capsys):
    run = RESNET_TINY + ["--max-steps", "1", "--run-dir", str(tmp_path / "run")]
    assert amp_train.main(run + ["--epochs", "1"]) == 0
    rank0, rank1 = run_two_processes(run + ["--epochs", "2", "--resume"], tmp_path, setup=small_synthetic_cifar10)
    assert_in_step(rank0, rank1)
    assert "note: 2 processes replace the checkpoint's 1: global batch 8" in rank0["out"], rank0["out"]
    assert len(rank0["evaluated"][0]) == 40, "ResNet18's BatchNorm buffers"
    for name, buffer in rank0["evaluated"][0].items():  # BatchNorm's running statistics
        assert torch.equal(buffer, rank1["evaluated"][0][name]), f"the ranks evaluated with different {name}"


def cifar10_on_two_machines_sharing_the_data_root(rank):
    """Both processes are the first of their machine; downloading writes the tiny CIFAR-10
    folder, slowly, and leaves the rank in calls.txt."""
    import torchvision.datasets.cifar as cifar
    root = pathlib.Path(os.environ["DATA_ROOT"])
    def download(url, download_root, **kwargs):
        with open(root / "calls.txt", "a") as calls:
            calls.write(f"{rank}\n")
        time.sleep(1)  # a process that did not wait would find nothing yet
        write_tiny_cifar10(pathlib.Path(download_root), per_batch=4)
    cifar.download_and_extract_archive = download
    cifar.check_integrity = lambda path, md5=None: os.path.isfile(path)  # our files cannot match the md5 sums
    os.environ["LOCAL_RANK"] = "0"
    return len(amp_train.cifar10(str(root / "data"))[0][1])


def test_two_machines_that_share_the_data_root_download_cifar10_once(tmp_path, monkeypatch):
    # Without global rank 0's turn first, both would download into the one folder.
    monkeypatch.setenv("DATA_ROOT", str(tmp_path))
    torch.multiprocessing.spawn(group_worker, args=(cifar10_on_two_machines_sharing_the_data_root, tmp_path,
                                                    free_port()), nprocs=2)
    assert [torch.load(tmp_path / f"result{r}.pt") for r in range(2)] == [20, 20], "both read the 20 images"
    assert (tmp_path / "calls.txt").read_text() == "0\n", "only global rank 0 may download"


def test_one_visible_gpu_per_process_is_used(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(amp_train.UsageError, match="no GPU of its own"):
        amp_train.resolve_device("cuda")  # 4 processes would share the machine's one GPU
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")  # a launcher that gives each process its own GPU
    assert amp_train.resolve_device("cuda") == torch.device("cuda", 0)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")  # torchrun shows each process every GPU
    with pytest.raises(amp_train.UsageError, match="no GPU of its own"):
        amp_train.resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert amp_train.resolve_device("cuda") == torch.device("cuda", 3)


def test_nccl_gets_the_device_every_round_keys_of_its_own_and_every_restart_the_jobs_name(monkeypatch):
    calls, store = [], torch.distributed.HashStore()
    for key, value in (("WORLD_SIZE", "2"), ("RANK", "1"), ("MASTER_ADDR", "x"), ("MASTER_PORT", "1")):
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.distributed, "rendezvous", lambda url, timeout: iter([(store, 1, 2)]))
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    job = amp_train.init_distributed(torch.device("cuda", 1))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    assert amp_train.init_distributed(CPU) == job, "a restart of the same job (the same store) must find its name"
    assert [(a, k["device_id"], k["rank"], k["world_size"], k["timeout"]) for a, k in calls] == [
        (("nccl",), torch.device("cuda", 1), 1, 2, amp_train.DIST_TIMEOUT), (("gloo",), None, 1, 2,
                                                                              amp_train.DIST_TIMEOUT)], calls
    assert amp_train.DIST_TIMEOUT.total_seconds() <= 600, "a lost peer must end the run within 10 minutes"
    calls[1][1]["store"].set("key", "value")
    assert store.get("round3/key") == b"value", "a restarted round must not read the keys of the round before"
    monkeypatch.setattr(torch.distributed, "rendezvous", lambda url, timeout: iter([(torch.distributed.HashStore(), 1,
                                                                                     2)]))
    assert amp_train.init_distributed(CPU) != job, "another job (another store) must get another name"


# ---------------------------------------------------------------- torchrun, and its restarts

DIES = """import os, signal, sys
sys.path.insert(0, {here!r})
import amp_train
saves, real = [], amp_train.replace_file
def dying(path, write):  # as kill -9 would: in round 0, after the metrics of epoch 1, before its checkpoint
    saves.append(path) if path.endswith("checkpoint.pt") else None
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and len(saves) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    real(path, write)
amp_train.replace_file = dying
sys.exit(amp_train.main())
"""


def torchrun(tmp_path, *argv, script=SCRIPT, max_restarts=0, rendezvous=("--standalone",)):
    command = [sys.executable, "-m", "torch.distributed.run", *rendezvous, "--nproc_per_node=2",
               f"--max-restarts={max_restarts}", script, "--device", "cpu", *argv]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                               start_new_session=True)
    try:
        out, err = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # torchrun and its workers: leave nothing running
        raise
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def test_torchrun_restarts_go_on_from_the_jobs_own_checkpoint(tmp_path):
    # Round 0 dies between the metrics and the checkpoint of epoch 1: round 1 goes on, without
    # --resume, from the checkpoint its job saved before the first epoch, the metrics rewritten.
    (tmp_path / "dies.py").write_text(DIES.format(here=str(HERE)))
    argv = ["--example", "linear", "--precision", "fp32", "--epochs", "4", "--run-dir", "run"]
    done = torchrun(tmp_path, *argv, script=str(tmp_path / "dies.py"), max_restarts=1)
    assert done.returncode == 0 and done.stderr.count("exitcode: -9") == 1, done.stdout + done.stderr
    assert "processes 2 | global batch 128" in done.stdout and len(re.findall(r"^epoch 1/4 ", done.stdout, re.M)) == 2
    assert re.search(r"^resumed from run after epoch 0$", done.stdout, re.M), done.stdout
    assert [r["epoch"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3, 4]
    assert amp_train.main(LINEAR + ["--precision", "fp32", "--epochs", "4", "--run-dir", str(tmp_path / "alone")]) == 0
    restarted, alone = load(tmp_path / "run" / "checkpoint.pt"), load(tmp_path / "alone" / "checkpoint.pt")
    for name, weight in alone["model"].items():
        assert torch.allclose(restarted["model"][name], weight, atol=1e-6), name


def test_a_job_under_static_rendezvous_never_takes_another_runs_checkpoint_and_each_rank_says_so(tmp_path):
    # Static rendezvous names every job "none": the job's name comes from torchrun's store instead (a
    # restart finds the same name, another job another: test_nccl_gets_the_device_every_round_...).
    assert amp_train.main(LINEAR + ["--epochs", "3", "--run-dir", str(tmp_path / "run")]) == 0
    before = files_of(tmp_path / "run")
    second = torchrun(tmp_path, "--example", "linear", "--epochs", "6", "--lr", "0.05", "--run-dir", "run",
                      rendezvous=("--master-port", str(free_port())))
    assert second.returncode != 0 and second.stderr.count("holds a checkpoint: add --resume") == 2, second.stderr
    assert re.search(r"exitcode *: 2 ", second.stderr), "exit 2, as torchrun reports the first failure: " + second.stderr
    assert 'amp_train.py", line' not in second.stderr, "a worker ended in a traceback: " + second.stderr
    assert files_of(tmp_path / "run") == before, "the other run's files were changed"


# ---------------------------------------------------------------- CUDA only

@requires_cuda
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_cuda_resnet_example_runs(precision, capsys):
    argv = ["--example", "resnet", "--data", "synthetic", "--epochs", "1", "--max-steps", "3", "--batch-size", "16",
            "--device", "cuda", "--precision", precision]
    assert amp_train.main(argv) == 0
    out = capsys.readouterr().out
    assert f"device cuda:0 | precision {precision}" in out and re.search(r"^epoch 1/1 ", out, re.M), out


@requires_cuda
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_cuda_memory_example_measures_peak_memory(precision):
    args = amp_train.parse_args(["--example", "memory", "--precision", precision, "--batch-size", "64", "--steps", "2"])
    result = amp_train.run_memory(args, torch.device("cuda", 0))
    assert 0 < result["amp"]["peak_bytes"] < result["fp32"]["peak_bytes"], result
    assert result["amp"]["reserved_bytes"] >= result["amp"]["peak_bytes"], result["amp"]
    assert result["ratio"]["activation_bytes"] < 0.6, result
