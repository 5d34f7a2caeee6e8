"""The specification of amp_train.py: each test's name says the one behaviour it checks, in the
module's order. CUDA cases run where a GPU is. Run: python -m pytest -q"""
import collections, contextlib, copy, faulthandler, functools, inspect, io, itertools, json
import math, multiprocessing, os, pathlib, pickle, re, signal, socket, subprocess, sys
import unittest.mock, urllib.error

import filelock
import numpy as np
import pytest
import torch
import torch._functorch.config
import torch.nn as nn

import amp_train

# torch.cuda.amp's names warn with a FutureWarning: any use of them fails a test.
pytestmark = [pytest.mark.filterwarnings("error::FutureWarning"),
              pytest.mark.filterwarnings("error::DeprecationWarning")]

HERE = pathlib.Path(__file__).parent
README = (HERE / "README.md").read_text(encoding="utf-8")
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CPU = torch.device("cpu")
FP16, BF16 = torch.float16, torch.bfloat16
MSE = nn.MSELoss()
LINEAR = ["--device", "cpu", "--example", "linear", "--precision", "fp32"]
LINEAR_FP16 = LINEAR + ["--precision", "fp16"]
# The resnet example on synthetic data, two steps an epoch; the `fast` fixture makes its
# ResNet18 a small model.
RESNET = ["--device", "cpu", "--example", "resnet", "--data", "synthetic", "--max-steps", "2",
          "--batch-size", "4", "--precision", "fp32"]
RESNET18 = amp_train.resnet18
MEMORY = ["--device", "cpu", "--example", "memory", "--model", "linear"]
# A device's measured rates, for tests that measure no device.
RATES = {"matmul_rate_flops": 1.0, "conv_rate_flops": 1.0}


def small_model(imagenet_stem=False):
    """A conv, BatchNorm and linear classifier: ResNet18's kinds of layer, in milliseconds."""
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))


@functools.lru_cache(maxsize=None)
def cached_synthetic_cifar10(sizes, seed=0, _make=amp_train.synthetic_cifar10):
    return _make(sizes, seed)


@pytest.fixture(autouse=True)
def fast(monkeypatch):
    """Synthetic data made once; ResNet18 is small_model, unless a test asks for resnet18."""
    monkeypatch.setattr(amp_train, "synthetic_cifar10", cached_synthetic_cifar10)
    monkeypatch.setattr(amp_train, "resnet18", small_model)


@pytest.fixture
def run_dir(tmp_path):
    """A folder for --run-dir runs. The two-process tests fork and kill -9, which native
    Windows has not."""
    if os.name != "posix":
        pytest.skip("needs POSIX: fork and SIGKILL")
    return tmp_path


@pytest.fixture
def resnet18(monkeypatch):
    monkeypatch.setattr(amp_train, "resnet18", RESNET18)


def ok(argv):
    assert amp_train.main(argv) == 0, argv


def printed(argv, capsys):
    """What main(argv) printed, where it ends in 0."""
    ok(argv)
    return capsys.readouterr().out


def run_bad(argv, capsys, status=2):
    """main(argv), which must end in exit `status` and one line on stderr; returns the line."""
    code, err = amp_train.main(argv), capsys.readouterr().err
    assert code == status and err.count("\n") == 1 and err.startswith("error: "), (code, err)
    return err


def batch_of(size, seed=0):
    """The linear example's fixed batch, of `size` samples."""
    return amp_train.linear_batch(size, seed)


def batches_of(sizes, seed=0):
    """The first samples of a linear batch, in batches of the given sizes."""
    inputs, targets = batch_of(sum(sizes), seed)
    return list(zip(inputs.split(sizes), targets.split(sizes)))


def linear_setup(device="cpu", amp_dtype=None, lr=0.01, optimizer=torch.optim.SGD, **kind):
    """A seeded Linear(10, 1), its optimizer, and a GradScaler enabled for fp16."""
    torch.manual_seed(0)
    model = nn.Linear(10, 1).to(device)
    scaler = torch.amp.GradScaler(torch.device(device).type, enabled=amp_dtype is FP16)
    return model, optimizer(model.parameters(), lr=lr, **kind), scaler


def train(model, loader, optimizer, scaler, amp_dtype=None, device="cpu", **kwargs):
    return amp_train.train_epoch(model, loader, optimizer, MSE, scaler, device, amp_dtype, **kwargs)


def with_inf(batch):
    """The batch with one input inf: its loss is inf, its gradients inf or NaN."""
    inputs = batch[0].clone()
    inputs[0, 0] = math.inf
    return inputs, batch[1]


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def read_metrics(path):
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines()]


def files_of(folder):
    return {p.name: p.read_bytes() for p in pathlib.Path(folder).iterdir()}


def lrs_of(out):
    return [float(x) for x in re.findall(r"\| lr ([\d.e-]+) \|", out)]


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


@contextlib.contextmanager
def held(folder):
    """The lock that a live run holds on its folder."""
    with filelock.FileLock(folder / ".lock"):
        yield


def run_readme_block(heading):
    """README's first python block under `heading`, run whole from seed 0 in a namespace of its
    own, and the same up to its training loop: a reference to train by hand."""
    block, user, reference = readme_blocks(heading)[0], {}, {}
    for code, space in (block, user), (block[:block.index("for epoch in range(3):")], reference):
        torch.manual_seed(0)
        exec(compile(code, "README.md", "exec"), space)
    return block, user, reference


def readme_blocks(heading):
    """The python blocks of README's section `heading`."""
    section = README[README.index(heading):]
    section = section[:section.find("\n## ", 1) % len(section)]
    return re.findall(r"```python\n(.*?)\n```", section, re.S)


# ---------- the part to copy

def test_readmes_copy_this_block_holds_the_modules_functions_runs_alone_and_trains_as_the_docs(
        monkeypatch, capsys):
    # A CPU without AMX: fp32, in which the docs' loop is an independent reference.
    fake_accelerator(monkeypatch, "cpu")
    fake_cpu(monkeypatch, "avx512_bf16")
    block, user, reference = run_readme_block("## Copy this")
    for function in (amp_train.to_device, amp_train.train_epoch):
        assert inspect.getsource(function) in block, f"README's {function.__name__} differs"
    assert README[:README.index("## Copy this")].count("\n") < 120, "Copy this comes late"
    for _ in range(3):
        for inputs, targets in reference["train_loader"]:
            reference["optimizer"].zero_grad()
            reference["criterion"](reference["model"](inputs), targets).backward()
            reference["optimizer"].step()
    assert user["amp_dtype"] is None and all(torch.equal(*pair) for pair in zip(
        user["model"].parameters(), reference["model"].parameters())), "not the docs' loop"
    out = capsys.readouterr().out
    assert re.fullmatch(r"(epoch \d \| train loss [\d.]+\n){3}", out), out


def test_readmes_own_loss_block_trains_each_form_as_the_docs_loop_and_measures_what_amp_buys(
        capsys):
    _, user, reference = run_readme_block("## Models that compute their own loss")
    gpt, hf, tokens = reference["gpt"], reference["hf"], reference["tokens"]
    loader = [(t[:, :-1], t[:, 1:]) for t in tokens]
    forms = [(reference["gpt_optimizer"], lambda pair: gpt(*pair)[1]),
             (reference["hf_optimizer"], lambda pair: hf(*pair).loss)]
    for _ in range(3):
        for optimizer, loss_of in forms:
            for batch in loader:
                with torch.autocast("cpu", dtype=BF16):
                    loss = loss_of(batch)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
    for name in ("gpt", "hf"):
        assert all(torch.equal(*pair) for pair in zip(user[name].parameters(), reference[
            name].parameters())), f"{name} is not trained as the docs' loop trains it"
    out = capsys.readouterr().out
    assert re.match(r"(epoch \d \| nanoGPT's form [\d.]+ \| Hugging Face's [\d.]+\n){3}", out)
    # The test pass: each model's own loss, under inference mode and autocast, over its batches.
    with torch.inference_mode(), torch.autocast("cpu", dtype=BF16):
        tested = [np.mean([loss_of(batch).item() for batch in loader]) for _, loss_of in forms]
    assert [user["gpt_tested"]["loss"], user["hf_tested"]["loss"]] == pytest.approx(tested)
    assert math.isnan(user["hf_tested"]["accuracy"]), "a model's own loss gives no logits to score"
    # measure_amp takes what train_epoch takes: here dict inputs and the model's own loss.
    measured, fp32, bf16 = user["measured"], user["measured"]["fp32"], user["measured"]["bf16"]
    assert 0.4 <= bf16["saved_bytes"] / fp32["saved_bytes"] <= 1.0, measured
    assert (measured["batch"], bf16["samples_per_second"]) == (16, pytest.approx(
        16 / bf16["median_step_seconds"])) and "the memory saved for backward; AMP is" in out


EMPTY = (torch.zeros(0, 10), torch.zeros(0, 1))


# The command line's name for a precision, "bf16", is no torch dtype.
@pytest.mark.parametrize("amp_dtype,batches,kwargs,says", [
    (FP16, [batch_of(4)], {}, r"needs an enabled torch\.amp\.GradScaler"),
    (None, [batch_of(4)], {"accum_steps": 0}, "accum_steps must be 1 or more, not 0"),
    ("bf16", [batch_of(4)], {}, "is torch.bfloat16, torch.float16 or None, not 'bf16'$"),
    (None, [batch_of(4), EMPTY], {}, "a batch of 0 samples has no mean loss")])
def test_fp16_without_an_enabled_gradscaler_no_steps_a_name_or_a_batch_of_0_samples_are_refused(
        amp_dtype, batches, kwargs, says):
    model, optimizer, scaler = linear_setup()
    with pytest.raises(ValueError, match=says):
        train(model, batches, optimizer, scaler, amp_dtype, **kwargs)


@pytest.mark.parametrize("batch,says", [
    ({"input_ids": torch.zeros(4, 10), "labels": torch.zeros(4, 1)}, "an (inputs, targets) pair, "
     "not a dict"), (torch.zeros(2, 10), "an (inputs, targets) pair, not a Tensor"),
    (((torch.zeros(4, 10), torch.zeros(4)), torch.zeros(4, 1)), "inputs is a tuple, not a tensor"),
    ((collections.UserDict(x=torch.zeros(4, 10), text=["a"] * 4), torch.zeros(4, 1)),
     "the batch's text is a list, not a tensor")],
    ids=["one dict", "a tensor", "tuple inputs", "strings in a mapping"])
def test_a_batch_that_is_not_a_pair_of_tensors_says_what_it_is_and_points_to_readme(batch, says):
    # train_epoch and evaluate check each batch through to_device.
    with pytest.raises(TypeError, match=re.escape(says) + ": see README, 'Models that compute "
                       "their own loss'$"):
        amp_train.to_device(batch, None)


def test_a_batch_moves_without_waiting_from_pinned_memory_alone(monkeypatch):
    moves, to = [], torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda self, device, non_blocking: moves.append(
        non_blocking) or to(self, device))
    inputs, targets = batch_of(2)
    for pinned in (False, True):
        monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: pinned)
        for batch in (inputs, targets), ({"input": inputs}, targets):
            amp_train.to_device(batch, CPU)
    assert moves == [False] * 4 + [True] * 4, "each tensor moves, and waits unless pinned"


@pytest.mark.filterwarnings("ignore:Detected call of")  # torch's note when step 1 is skipped
def test_a_scheduler_steps_after_every_step_also_a_skipped_one():
    batches = [with_inf(batch_of(4))] + batches_of([4] * 9)
    model, optimizer, scaler = linear_setup(amp_dtype=FP16)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    train(model, batches, optimizer, scaler, FP16, scheduler=scheduler, accum_steps=2)
    assert scheduler.last_epoch == 5, "10 micro-batches are 5 steps, the first one skipped"
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.01 * 0.5 ** 5)


@pytest.mark.parametrize("device,amp_dtype", [
    ("cpu", BF16), ("cpu", None), pytest.param("cuda", FP16, marks=requires_cuda)])
def test_autocast_runs_linear_and_conv_in_the_amp_dtype_and_the_loss_in_fp32(device, amp_dtype):
    model = nn.Sequential(nn.Linear(8, 8), nn.Unflatten(1, (1, 8)), nn.Conv1d(1, 4, 3),
                          nn.Flatten()).to(device)
    seen, criterion = [], nn.CrossEntropyLoss()
    for module in model[0], model[2], criterion:
        module.register_forward_hook(lambda module, inputs, output: seen.append(output.dtype))
    scaler = torch.amp.GradScaler(device, enabled=amp_dtype is FP16)
    amp_train.train_epoch(model, [(torch.randn(2, 8), torch.tensor([0, 1]))],
                          torch.optim.SGD(model.parameters()), criterion, scaler, device, amp_dtype)
    low = amp_dtype or torch.float32
    assert seen == [low, low, torch.float32], seen
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


# An iterator is a loader with no len(), as a streaming data set is.
@pytest.mark.parametrize("wrap", [list, iter], ids=["list", "iterator"])
def test_micro_batches_of_4_4_and_2_step_as_their_whole_batch_and_a_short_last_group_alone(wrap):
    whole, whole_optimizer, _ = linear_setup()
    train(whole, batches_of([10, 10, 8], seed=3), whole_optimizer, None)
    model, optimizer, _ = linear_setup()
    steps = []
    optimizer.register_step_post_hook(lambda *_: steps.append(1))
    # A forward and backward pass whose step never came, as after a micro-batch that raised.
    MSE(model(batch_of(4)[0] * 100), batch_of(4)[1]).backward()
    stats = train(model, wrap(batches_of([4, 4, 2, 4, 4, 2, 4, 4], seed=3)), optimizer, None,
                  accum_steps=3)
    assert (len(steps), stats["samples"]) == (3, 28), (steps, stats)
    # An old gradient in the first step would leave them far apart.
    assert torch.allclose(model.weight, whole.weight, atol=1e-6, rtol=0), "more than rounding"


def test_padded_tokens_step_and_test_as_their_whole_batch_by_the_tokens_they_count():
    # 8 sequences of 6 tokens, a token a row, with padding of -100 in their labels after a random
    # length. Each half holds 4 sequences. README's block trains a model's own loss on a mapping.
    torch.manual_seed(1)
    tokens = torch.randint(0, 20, (8, 6))
    labels = tokens.masked_fill(torch.arange(6) >= torch.randint(1, 6, (8, 1)), -100)
    stepped, tested, criterion = [], [], nn.CrossEntropyLoss()
    for halves in (1, 2):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(20, 8), nn.Linear(8, 20))
        batches = list(zip(tokens.flatten().chunk(halves), labels.flatten().chunk(halves)))
        tested.append(amp_train.evaluate(model, batches, criterion, CPU, None)["loss"])
        stats = amp_train.train_epoch(model, batches, torch.optim.SGD(model.parameters(), lr=1),
                                      criterion, None, CPU, None, accum_steps=2)
        stepped.append((model[1].weight.detach(), stats["loss"]))
    # Weighted by its samples instead, the half with fewer tokens would count as much.
    assert torch.allclose(stepped[0][0], stepped[1][0], atol=1e-6, rtol=0), "not the whole batch"
    assert stepped[0][1] == pytest.approx(stepped[1][1], rel=1e-6), "not the mean over tokens"
    assert tested[0] == pytest.approx(tested[1], rel=1e-6), "evaluate's mean is not over tokens"
    assert math.isnan(amp_train.train_epoch(model, [], None, None, None, CPU, None)["loss"])


def test_float_targets_of_minus_100_count_in_training_and_testing_as_in_the_docs_loop():
    # Regression targets of -100.0 are values, not padding: MSELoss averages over each of them.
    # Counted as padding, the second half would weigh nothing.
    x, y = batch_of(8)
    y[4:] = -100.0
    halves = list(zip(x.split(4), y.split(4)))
    model, optimizer, _ = linear_setup()
    stats = train(model, halves, optimizer, None, accum_steps=2)
    tested = amp_train.evaluate(model, halves, MSE, CPU, None)
    # The docs' loop, on the whole batch.
    reference, reference_optimizer, _ = linear_setup()
    loss = MSE(reference(x), y)
    loss.backward()
    reference_optimizer.step()
    assert stats["loss"] == pytest.approx(loss.item(), rel=1e-6), (stats, loss)
    assert torch.allclose(model.weight, reference.weight, atol=1e-6), "not the whole batch"
    assert tested["loss"] == pytest.approx(MSE(reference(x), y).item(), rel=1e-6), tested


def test_each_micro_batch_reaches_the_device_just_before_its_forward_and_ddp_syncs_on_the_last(
        monkeypatch):
    class DDP(nn.Linear):
        """Records when DDP's no_sync() would hold back the all-reduce of a backward pass."""
        def no_sync(self):
            events.append("no_sync")
            return contextlib.nullcontext()
    events, real = [], amp_train.to_device
    monkeypatch.setattr(amp_train, "to_device", lambda batch, device: events.append(
        f"to {device}") or real(batch, device))
    model = DDP(10, 1)
    model.register_forward_hook(lambda *_: events.append("forward"))
    train(model, batches_of([4, 4, 2, 4]), torch.optim.SGD(model.parameters()), None, accum_steps=3)
    # to_device(batch, None) checks a batch and counts its samples: it moves nothing.
    last = ["to cpu", "forward"]
    assert events == ["to None"] * 3 + ["to cpu", "no_sync", "forward"] * 2 + last + [
        "to None"] + last, events


@pytest.mark.parametrize("amp_dtype", [None, BF16, FP16])
def test_a_fused_optimizer_trains_with_one_host_sync_an_epoch_whatever_its_steps(
        amp_dtype, monkeypatch):
    # Each read of a tensor's value on the host waits for the device.
    counts = []
    for steps in (1, 10):
        model, count = nn.Linear(10, 1), [0]
        with monkeypatch.context() as patch:
            for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
                def counting(self, *args, _original=getattr(torch.Tensor, name), **kwargs):
                    count[0] += 1
                    return _original(self, *args, **kwargs)
                patch.setattr(torch.Tensor, name, counting)
            scaler = torch.amp.GradScaler("cpu", enabled=amp_dtype is FP16)
            train(model, batches_of([4]) * steps, amp_train.make_optimizer(model, lr=0.01), scaler,
                  amp_dtype)
        counts.append(count[0])
    assert counts == [1, 1], "a host sync a step"


def test_evaluate_gives_the_mean_loss_and_accuracy_in_inference_mode_as_training_autocasts():
    model, seen = nn.Linear(3, 3, bias=False), []
    model.register_forward_hook(lambda module, inputs, output: seen.append(
        (torch.is_inference_mode_enabled(), module.training, output.dtype)))
    # It predicts the index of the largest input.
    model.weight.data = torch.eye(3) * 2
    inputs, targets = torch.eye(3).repeat(2, 1), torch.tensor([0, 1, 2, 0, 2, 1])
    result = amp_train.evaluate(model, [(inputs[:4], targets[:4]), (inputs[4:], targets[4:])],
                                nn.CrossEntropyLoss(), "cpu", BF16)
    with torch.autocast("cpu", dtype=BF16):
        loss = nn.functional.cross_entropy(model(inputs), targets).item()
    assert result == {"loss": pytest.approx(loss, rel=1e-6), "accuracy": pytest.approx(4 / 6),
                      "samples": 6}, result
    assert seen[:2] == [(True, False, BF16)] * 2, f"(inference mode, training, dtype): {seen}"


# ---------- precision and device

def fake_cpu(monkeypatch, *instructions):
    """Makes torch find these 16-bit instructions on the CPU, and no others."""
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: dict.fromkeys(instructions, True),
                        raising=False)


def fake_accelerator(monkeypatch, kind, capability=(9, 0), macos=14):
    """Makes torch find an accelerator of this kind ("cpu" for none): a CUDA GPU of this
    compute capability, or a Mac on this macOS."""
    current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: kind == "cuda")
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: kind != "cpu")
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device(kind))
    monkeypatch.setattr(torch.accelerator, "set_device_index", current.append)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: current[-1])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.backends.mps, "is_macos_or_newer", lambda major, _: macos >= major)


@pytest.mark.parametrize("row,kind,capability,macos,found,auto,not_native", [
    ("CUDA, compute capability 8.0 or newer", "cuda", (9, 0), 14, [], "bf16", []),
    ("CUDA, compute capability 7.x", "cuda", (7, 5), 14, [], "fp16", ["bf16"]),
    ("CUDA before 7.0", "cuda", (6, 1), 14, [], "fp32", ["bf16", "fp16"]),
    ("Apple silicon, macOS 14 or newer", "mps", None, 14, [], "bf16", ["fp16"]),
    ("Apple silicon, macOS 13", "mps", None, 13, [], "fp32", ["bf16", "fp16"]),
    ("Intel GPU", "xpu", None, 14, [], "bf16", []),
    ("CPU with AMX", "cpu", None, 14, ["amx_bf16", "avx512_bf16"], "bf16", ["fp16"]),
    ("CPU with other bf16 instructions", "cpu", None, 14, ["avx512_bf16"], "fp32", ["fp16"]),
    ("CPU with other bf16 instructions", "cpu", None, 14, ["bf16"], "fp32", ["fp16"]),
    ("CPU without bf16 instructions", "cpu", None, 14, ["fp16_arith"], "fp32", ["bf16"])])
def test_auto_and_readmes_set_up_lines_follow_its_table_and_every_process_takes_rank_0s_choice(
        row, kind, capability, macos, found, auto, not_native, monkeypatch):
    fake_accelerator(monkeypatch, kind, capability, macos)
    fake_cpu(monkeypatch, *found)
    decided = []
    monkeypatch.setattr(amp_train, "from_rank_0", lambda value: decided.append(value) or value)
    chosen, notes = amp_train.choose_precision("auto", torch.device(kind))
    # The note names what the device computes in words, never as a Python list.
    assert chosen == auto and notes[0].startswith(f"note: auto trains in {auto} (README's table)"
                                                  ) and "[" not in notes[0], notes
    # A CPU whose bf16 auto passes over says how to measure it and take it.
    assert len(notes) == 1 + (row == "CPU with other bf16 instructions"), notes
    for name in ("fp32", "bf16", "fp16"):
        # A Mac refuses what it cannot train in, in one line that says what it can.
        if kind == "mps" and name in not_native:
            with pytest.raises(amp_train.UsageError, match=rf"^{name} does not train on mps here "
                               r"\(README's table\): use --precision (bf16 or )?fp32, or "
                               r"--device cpu$"):
                amp_train.choose_precision(name, torch.device(kind))
            continue
        chosen, notes = amp_train.choose_precision(name, torch.device(kind))
        assert chosen == name and notes == [f"note: {name} is not native on {kind} here, so it "
                                            "is slower than fp32"][:name in not_native], notes
    assert len(decided) == 4 - (kind == "mps") * len(not_native), "a path without rank 0's choice"
    assert f"| {row} | {auto}" in README, f"README's table has no row {row!r} for {auto}"
    # README's set-up lines follow the same table. Its loaders pin their batches for CUDA alone.
    block = readme_blocks("## Copy this")[0]
    user = {"torch": torch}
    exec(block[block.index("# Once, where"):block.index("# Your model")], user)
    assert (user["device"].type, user["amp_dtype"], user["scaler"].is_enabled(), user[
        "train_loader"].pin_memory) == (kind, amp_train.PRECISIONS[auto], auto == "fp16",
                                        kind == "cuda"), user
    # Images are channels_last but on a Mac.
    assert (amp_train.image_layout(torch.device(kind)) is torch.channels_last) != (kind == "mps")
    # The memory example measures auto's 16-bit precision, and bf16 where auto trains in fp32.
    assert amp_train.memory_precision("auto", torch.device(kind)) == auto.replace("fp32", "bf16")


def test_auto_is_torchs_accelerator_or_the_cpu_and_under_torchrun_process_k_takes_device_k(
        monkeypatch, capsys):
    fake_accelerator(monkeypatch, "cpu")
    assert amp_train.resolve_device("auto") == CPU
    assert run_bad(["--device", "mps"], capsys) == "error: torch finds no mps device here: use " \
        "--device auto or cpu\n"
    # Process 1 sets device 1, and torch's current device is what it returns.
    fake_accelerator(monkeypatch, "mps")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert amp_train.resolve_device("auto") == torch.device("mps", 1)


def test_a_cpus_16_bit_instructions_are_those_that_torch_finds_and_proc_cpuinfo_lists():
    cpuinfo = pathlib.Path("/proc/cpuinfo")
    x86 = re.findall(r"^flags\s*:(.*)$", cpuinfo.read_text() if cpuinfo.exists() else "", re.M)
    # torch 2.6 has no get_capabilities, and finds none. On x86 its names are /proc/cpuinfo's
    # flags. ARM names these otherwise, and macOS and Windows have no /proc/cpuinfo: there
    # torch's word stands.
    known = getattr(torch.cpu, "get_capabilities", dict)()
    listed = x86[0].split() if x86 else [name for name in known if known[name]]
    expected = [name for name in amp_train.CPU_16BIT if name in listed and name in known]
    assert list(amp_train.cpu_16bit()) == expected, listed


def test_a_gpus_label_reads_fp32s_precision_by_the_api_torch_has_and_never_raises(monkeypatch):
    cuda, gpu = torch.backends.cuda, torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H200")
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    label = "cuda:0 NVIDIA H200 (fp32: matmul {}, conv {}; cudnn.benchmark True)".format
    if not hasattr(cuda.matmul, "fp32_precision"):
        monkeypatch.setattr(cuda, "matmul", type("Matmul", (), {"allow_tf32": True}))
        assert amp_train.device_label(gpu) == label("tf32", "tf32")
        return
    # The new API, after which the legacy allow_tf32 raises. "none" all the way up is IEEE fp32
    # for matmuls. cuDNN's default is TF32. torch serves the setting through __getattr__, which
    # monkeypatch cannot undo, so it is restored by hand.
    before = cuda.matmul.fp32_precision
    try:
        for setting, matmul in ("tf32", "tf32"), ("none", "ieee"):
            cuda.matmul.fp32_precision = setting
            assert amp_train.device_label(gpu) == label(matmul, "tf32")
    finally:
        cuda.matmul.fp32_precision = before


# ---------- models and data

def zero_gradient_share(model):
    """The share of the weights that one 32x32 batch gives an exactly zero gradient."""
    nn.functional.cross_entropy(model(torch.randn(2, 3, 32, 32)), torch.arange(2)).backward()
    zeros = sum((p.grad == 0).sum() for p in model.parameters())
    return zeros.item() / sum(p.numel() for p in model.parameters())


def test_resnet18_has_the_cifar_stem_and_every_weight_learns_and_the_posts_stem_not(resnet18):
    torch.manual_seed(0)
    model = amp_train.build_example(amp_train.parse_args(RESNET, {}), CPU)[0]
    assert model.conv1.kernel_size == (3, 3) and isinstance(model.maxpool, nn.Identity)
    assert model.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    assert zero_gradient_share(model) < 0.01, "over 1% of the weights got no gradient"
    # The post's ImageNet stem leaves 62% of them without one.
    assert 0.60 < zero_gradient_share(RESNET18(imagenet_stem=True)) < 0.65


@pytest.mark.parametrize("name,size", [("squeezenet1_1", 224), ("inception_v3", 299),
                                       ("efficientnet_b7", 600), ("resnet18", 32),
                                       ("resnet18-imagenet", 32)])
def test_the_memory_examples_image_models_are_for_10_classes_at_their_weights_size(
        name, size, monkeypatch, resnet18):
    import torchvision
    monkeypatch.setattr(torchvision.models, "get_model", lambda name, **kwargs: kwargs)
    model, side = amp_train.image_classifier(name)
    classes = model["num_classes"] if isinstance(model, dict) else model.fc.out_features
    assert (classes, side) == (10, size), (model, side)
    # Its auxiliary logits are off: a plain loss takes the model's outputs.
    assert name != "inception_v3" or model["aux_logits"] is False, model
    stems = {"resnet18": 3, "resnet18-imagenet": 7}
    assert name not in stems or model.conv1.kernel_size[0] == stems[name], model


def write_tiny_cifar10(root, per_batch=2):
    """A CIFAR-10 folder in the real format (pickled uint8 rows); image i is all value i."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch", "batches.meta"]
    for b, name in enumerate(names):
        values = [b * per_batch + i for i in range(per_batch)]
        data = np.stack([np.full(3 * 32 * 32, v, dtype=np.uint8) for v in values])
        (folder / name).write_bytes(pickle.dumps({"data": data, "labels": [v % 10 for v in values],
                                                  "label_names": [str(i) for i in range(10)]}))


def test_cifar10_is_read_from_its_folder_and_each_process_checks_it_under_a_lock_alone(
        tmp_path, monkeypatch):
    import torchvision.datasets.cifar as cifar
    write_tiny_cifar10(tmp_path)
    locked = []

    def check_integrity(*args, **kwargs):
        # Records whether another process would wait for the lock on the folder now.
        with contextlib.suppress(filelock.Timeout):
            with filelock.FileLock(tmp_path / "download.lock").acquire(timeout=0):
                locked.append(False)
                return True
        locked.append(True)
        return True
    monkeypatch.setattr(cifar, "check_integrity", check_integrity)
    # No collective waits for the download, which might take longer than its timeout.
    monkeypatch.setattr(amp_train, "from_rank_0", None)
    args = amp_train.parse_args(["--data-root", str(tmp_path), "--batch-size", "5"], {})
    _, _, train_loader, test_loader = amp_train.build_example(args, CPU)
    assert locked[0] and not locked[-1], "the download and its check ran without the lock"
    images, labels = next(iter(test_loader))
    mean, std = torch.tensor(amp_train.CIFAR10_MEAN_STD)
    # test_batch holds images 10 and 11.
    expected = ((torch.tensor([10.0, 11.0]) / 255)[:, None] - mean) / std
    assert labels.tolist() == [0, 1] and torch.allclose(images[:, :, 5, 5], expected, atol=1e-6)
    assert sorted(int(y) for _, batch in train_loader for y in batch) == list(range(10))


def test_without_cifar10_and_offline_one_line_says_what_to_do(tmp_path, monkeypatch, capsys):
    import torchvision.datasets.cifar as cifar

    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")
    monkeypatch.setattr(cifar, "download_and_extract_archive", offline)
    assert "nor online: put cifar-10-python.tar.gz there, or use --data synthetic" in run_bad(
        ["--device", "cpu", "--data-root", str(tmp_path / "data")], capsys)


def loaded(n, batch_size, epoch=0, processes=1, monkeypatch=None, **kwargs):
    """Each process's batches of samples 0..n-1 (their targets), and its len()."""
    shares = []
    monkeypatch.setenv("WORLD_SIZE", str(processes))
    for rank in range(processes):
        monkeypatch.setenv("RANK", str(rank))
        loader = amp_train.DeviceLoader(torch.arange(n), torch.arange(n), batch_size, CPU,
                                        lambda inputs, generator: inputs, **kwargs)
        loader.epoch = epoch
        shares.append(([targets.tolist() for _, targets in loader], len(loader)))
    return shares


def test_each_process_trains_as_many_whole_batches_and_tests_all(monkeypatch):
    shares = loaded(23, 4, 5, 3, monkeypatch, shuffle=True)
    assert [(len(batches), length) for batches, length in shares] == [(1, 1)] * 3, shares
    seen = [i for batches, _ in shares for batch in batches for i in batch]
    assert len(seen) == len(set(seen)) == 12, f"4 samples each, none to two: {shares}"
    shares = loaded(23, 4, 0, 3, monkeypatch)
    assert all(sorted(i for batch in batches for i in batch) == list(range(23))
               for batches, _ in shares), shares
    # The test of the training flags shows --max-steps cutting both.
    assert [length for _, length in shares] == [6] * 3


def test_crops_and_flips_are_torchvisions():
    import torchvision.transforms.v2.functional as TF
    images = torch.randint(0, 256, (64, 3, 32, 32), dtype=torch.uint8)
    out = amp_train.random_crop_flip(images, torch.Generator().manual_seed(1))
    # Each output is some window of torchvision's padded image, flipped or not.
    windows = [{(dy, dx, flip) for dy in range(9) for dx in range(9) for flip in (0, 1) if
                torch.equal(TF.crop(TF.pad(image, [4]), dy, dx, 32, 32), augmented.flip(-1) if flip
                            else augmented)} for image, augmented in zip(images, out)]
    seen = set.union(*windows)
    assert all(windows) and [len({w[i] for w in seen}) for i in range(3)] == [9, 9, 2], windows


# ---------- the examples' epoch loop

@pytest.fixture
def spy(monkeypatch):
    """Records each train_epoch call: its batches, kwargs, output dtypes, its first weight
    before, and the gradient norm that each step saw."""
    calls, real = [], amp_train.train_epoch

    def recording(model, loader, optimizer, *args, **kwargs):
        call = {"batches": [], "dtypes": set(), "norms": [], "model": model,
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


@pytest.mark.parametrize("precision,dtype", [
    ("fp32", torch.float32), ("bf16", BF16), ("fp16", FP16)])
def test_the_linear_example_trains_on_its_one_batch_at_a_fixed_lr_in_each_precision(
        precision, dtype, spy, capsys):
    out = printed(LINEAR + ["--epochs", "20", "--precision", precision], capsys)
    losses = re.findall(r"^epoch +\d+/20 \| train loss ([\d.]+)", out, re.M)
    assert len(losses) == 20 == len(spy) and float(losses[-1]) < float(losses[0]) - 0.1, losses
    assert [len(call["batches"]) for call in spy] == [1] * 20 and spy[0]["dtypes"] == {dtype}
    assert spy[0]["batches"][0][0].shape == (128, 10), "one fixed batch of the post's shape"
    # The post's linear program keeps its lr past epoch 10.
    assert lrs_of(out) == [0.01] * 20, "the linear example's lr falls"


def test_the_resnet_examples_fixed_epoch_line_shows_its_lr_fall_tenfold_every_10_epochs(
        monkeypatch, run_dir, capsys):
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    monkeypatch.setattr(amp_train, "LR_STEP_EPOCHS", 2)
    run = RESNET + ["--max-steps", "1", "--run-dir", str(run_dir)]
    ok(run + ["--epochs", "3"])
    assert torch.backends.cudnn.benchmark, "cuDNN does not time its algorithms for fixed shapes"
    # A resume recomputes the lr from the --lr it is given.
    out = printed(run + ["--epochs", "5", "--resume", "--lr", "0.5"], capsys)
    assert lrs_of(out) == pytest.approx([0.01, 0.01, 0.001, 0.05, 0.005]), out
    line = (r"^epoch 5/5 \| train loss [\d.]+ \| test loss [\d.]+ \| test acc +[\d.]+% \| "
            r"lr 0\.005 \| scale 1 \| \d+ samples/s \| [\d.]+ s$")
    assert re.search(line, out, re.M) and "| data synthetic | batch 4 |" in out, out


def test_compile_trains_a_compiled_model_says_so_and_refuses_amp_where_torch_autocasts_backward(
        spy, monkeypatch, capsys):
    # This torch compiles AMP's backward under autocast, as torch 2.6 does. dynamo compiles,
    # and eager kernels run the graph: the wiring in milliseconds.
    monkeypatch.delattr(torch._functorch.config, "backward_pass_autocast", raising=False)
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    monkeypatch.setattr(amp_train, "measure_training", None)
    for argv in LINEAR + ["--precision", "bf16"], MEMORY + ["--precision", "fp16"]:
        assert run_bad(argv + ["--compile"], capsys).endswith(
            "(it has no torch._functorch.config.backward_pass_autocast): install a newer torch, "
            "run without --compile, or use --precision fp32\n")
    assert spy == [], "it trained"
    # fp32 compiles there too. The resume of a run compiled first shows that its checkpoint's
    # keys stay plain.
    out = printed(LINEAR + ["--epochs", "2", "--compile"], capsys)
    assert "| compile True\ncompiling: the first step compiles the model\ncompiled: the first " \
        "step took " in out and out.count("compiled: ") == 1, out
    assert [hasattr(call["model"], "_orig_mod") for call in spy] == [True, True], spy


class HeadKeptInFP32(nn.Module):
    """A Linear(64, 64) body under AMP, and a Linear(64, 1) head kept in fp32, as README
    advises. Activations sit near 1, so no fp16 activation gradient comes near 65504. The
    head's weight gradient, a sum over 4,096 samples, passes 65504 at a scale of 2**16."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head = nn.Linear(64, 64), nn.Linear(64, 1)
        self.body.bias.data.fill_(1.0)
        self.head.weight.data *= 0.01

    def forward(self, x):
        h = self.body(x)
        with torch.autocast(x.device.type, enabled=False):
            return self.head(h.float())


@pytest.mark.skipif(not hasattr(torch._functorch.config, "backward_pass_autocast"),
                    reason="this torch compiles AMP's backward under autocast")
def test_compiled_amp_gives_a_part_kept_in_fp32_the_gradients_that_eager_amp_gives(monkeypatch):
    # aot_eager traces the backward pass as inductor does, and runs it with eager kernels.
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    torch.manual_seed(1)
    batch = (torch.randn(4096, 64), torch.full((4096, 1), -99.0))
    for amp_dtype in (FP16, BF16):
        gradients, scales = [], []
        for compile in (False, True):
            # A graph traced once keeps what it was traced with.
            torch._dynamo.reset()
            model = HeadKeptInFP32()
            trained = model
            if compile:
                trained = amp_train.compiled(model, CPU, amp_dtype)
            scaler = torch.amp.GradScaler("cpu", enabled=amp_dtype is FP16)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
            amp_train.train_epoch(trained, [batch], optimizer, MSE, scaler, CPU, amp_dtype)
            gradients.append(model.head.weight.grad)
            scales.append(scaler.get_scale())
        # Eager fp16 takes the step at 2**16, and so must the compiled model.
        assert scales[1] == scales[0], (amp_dtype, scales)
        difference = (gradients[1] - gradients[0]).abs().max() / gradients[0].abs().max()
        assert difference <= 1e-5, (amp_dtype, difference)


def test_progress_comes_every_30_s_at_most_from_the_second_step_on_and_a_compile_is_timed(
        monkeypatch, capsys):
    clock = [0.0]
    monkeypatch.setattr(amp_train, "time", type("Clock", (), {"perf_counter": lambda: clock[0]}))
    for compiling in (True, False):
        # 10 steps of 2 micro-batches, taken as train_epoch takes them. The first step takes
        # 40 s, and each other 7 s.
        batches = amp_train.progress(list(range(20)), 2, compiling)
        for seconds in [40] + [7] * 9:
            assert len(list(itertools.islice(batches, 2))) == 2
            clock[0] += seconds
        assert list(batches) == [], "batches left"
        lines = capsys.readouterr().out.splitlines()
        steps = ["  step 2/10 | 7.000 s a step | 56 s left",
                 "  step 7/10 | 7.000 s a step | 21 s left"]
        assert lines == ["compiling: the first step compiles the model",
                         "compiled: the first step took 40.0 s"][:2 * compiling] + steps, lines


def test_the_training_flags_set_the_batches_the_steps_the_lr_the_norm_and_the_test_batches(
        spy, capsys):
    ok(LINEAR + ["--epochs", "1", "--batch-size", "6"])
    ok(RESNET + ["--epochs", "1", "--batch-size", "6", "--max-steps", "3", "--accum-steps", "2"])
    assert {len(y) for call in spy for _, y in call["batches"]} == {6}, "not batches of 6"
    assert (len(spy[1]["batches"]), len(spy[1]["norms"])) == (6, 3), "3 steps of 2 batches"
    assert "| batch 6 | accum 2 |" in capsys.readouterr().out
    for lr in ("0.01", "0.04"):
        ok(LINEAR + ["--epochs", "1", "--lr", lr])
    moves = [(next(call["model"].parameters()) - call["weight"]).abs().sum().item()
             for call in spy[2:]]
    assert moves[1] == pytest.approx(4 * moves[0], rel=1e-4), moves
    ok(LINEAR + ["--epochs", "2", "--clip-grad-norm", "0.5"])
    norms = [norm for call in spy[2:] for norm in call["norms"]]
    assert min(norms[:2]) > 0.5 and norms[2:] == pytest.approx([0.5] * 2, rel=1e-3), norms
    args = amp_train.parse_args(RESNET + ["--max-steps", "3"], {})
    assert len(amp_train.build_example(args, CPU)[3]) == 3, "not 3 test batches"
    args = amp_train.parse_args(RESNET + ["--max-steps", "0", "--batch-size", "2000"], {})
    assert len(amp_train.build_example(args, CPU)[2]) == 5, "10,000 images in batches of 2000"


def test_the_seed_sets_the_weights_and_the_data_and_epochs_reshuffle_and_crop(spy):
    # The test of a resumed run shows that one seed gives the same weights and data again.
    for seed in ("0", "1"):
        ok(RESNET + ["--epochs", "2", "--max-steps", "1", "--seed", seed])
    first = [spy[i]["batches"][0][0] for i in (0, 2)]
    assert not torch.equal(spy[0]["weight"], spy[2]["weight"]), "the seed sets no weights"
    assert not torch.equal(*first), "the seed sets no data"
    assert not torch.equal(spy[0]["batches"][0][1], spy[1]["batches"][0][1]), "epochs alike"
    plain = amp_train.DeviceLoader(*amp_train.synthetic_cifar10((10_000,))[0], 4, CPU,
                                   amp_train.cifar10_transform(CPU, False), shuffle=True)
    assert not torch.equal(first[0], next(iter(plain))[0]), "not cropped"


@pytest.mark.parametrize("precision,says", [
    # The weights grow until fp32's loss overflows.
    ("fp32", "epoch 4: the epoch's mean train loss is inf: lower --lr, or look for inf/NaN in "
     "the data; {} holds epoch 3"),
    # In fp16 the scaler skips the steps whose gradients are inf, but the weights' fp16 copies
    # overflow already, which the check names: the Linear's weight cast by autocast.
    ("fp16", "epoch 2: the epoch's mean train loss is nan: lower --lr, or look for inf/NaN in "
     "the data; on a training batch, fp16 makes inf or NaN that reaches the loss or a weight's "
     r"gradient, first at _to_copy in Linear: keep that in fp32 \(README\), or train in bf16; {} "
     "holds epoch 1")])
def test_a_run_that_diverges_exits_1_with_one_line_and_keeps_its_last_finite_epoch(
        precision, says, run_dir, capsys):
    argv = LINEAR + ["--precision", precision, "--lr", "1e6", "--epochs", "5"]
    assert amp_train.main(argv + ["--run-dir", str(run_dir)]) == 1
    err = capsys.readouterr().err
    assert re.fullmatch(f"error: {says.format(re.escape(str(run_dir)))}\n", err), err
    assert all(math.isfinite(value) for value in load(run_dir / "checkpoint.pt")["model"][
        "weight"].flatten().tolist()), "the checkpoint holds a run gone wrong"
    epochs = [record["epoch"] for record in read_metrics(run_dir / "metrics.jsonl")]
    assert epochs[-1] == load(run_dir / "checkpoint.pt")["epoch"] + 1, "the metrics lack its end"


# ---------- the memory measurement

def test_what_autograd_saves_in_bf16_is_the_activations_and_weight_copies_counted_by_hand():
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
    with amp_train.count_saved_tensors(model) as saved:
        with torch.autocast("cpu", dtype=BF16):
            loss = model(torch.randn(64, 256)).sum()
        loss.backward()
    # The first Linear's input and the ReLU's output, which the second Linear saves too, and
    # the second's weight copy. The first's input needs no gradient, so it keeps no weight copy.
    assert saved == {"saved_bytes": 2 * (64 * 256 + 64 * 512) + 2 * 10 * 512}, saved


class Attention(nn.Module):
    """nanoGPT's attention, in brief: its scores are a matmul in no module of their own. A
    causal mask fills them with `fill`, or a mask made in fp32 is added to them first."""

    def __init__(self, scale=1.0, fill=None, mask_first=False, diagonal=1):
        super().__init__()
        self.qkv, self.proj, self.scale = nn.Linear(16, 48), nn.Linear(16, 16), scale
        self.fill, self.mask_first, self.diagonal = fill, mask_first, diagonal

    def forward(self, x):
        # The keys after each query's own, or from it on with diagonal=0.
        above = torch.ones(8, 8, dtype=torch.bool).triu(self.diagonal)
        # torch.finfo(torch.float32).min, which fp16 makes -inf.
        mask = torch.zeros(8, 8).masked_fill(above, torch.finfo(torch.float32).min)
        if self.mask_first:
            mask = mask.to(torch.float16)
        q, k, v = self.qkv(x * self.scale).chunk(3, dim=-1)
        scores = q @ k.transpose(-2, -1)
        if self.fill is not None:
            scores = scores.masked_fill(above, self.fill)
        if self.mask_first:
            scores = scores + mask
        return self.proj(scores.softmax(-1) @ v)


class SDPA(nn.Module):
    """Attention through scaled_dot_product_attention, with a mask that hides the last 2 keys:
    a boolean one, or a float one that holds `fill` there."""

    def __init__(self, fill=None):
        super().__init__()
        self.qkv, self.proj = nn.Linear(16, 48), nn.Linear(16, 16)
        self.mask = torch.arange(8) < 6
        if fill is not None:
            self.mask = torch.zeros(8).masked_fill(~self.mask, fill)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.proj(nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.mask))


class Act(nn.Linear):
    """A Linear and an activation: GPT-2's gelu_new, whose x**3 fp16 can make inf that tanh
    takes to 1; a sigmoid written by hand; or log, which fp32 makes -inf of 0."""

    def __init__(self, kind, factor):
        super().__init__(16, 16)
        self.kind = kind
        self.weight.data *= factor

    def forward(self, x):
        h = super().forward(x)
        if self.kind == "gelu_new":
            return 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))
        if self.kind == "sigmoid":
            return 1 / (1 + torch.exp(-h))
        return torch.log(torch.relu(h))


class Checkpointed(nn.Sequential):
    def forward(self, x):
        for module in self:
            x = torch.utils.checkpoint.checkpoint(module, x, use_reentrant=False)
        return x


class KeptInFP32(nn.Sequential):
    """A head kept in fp32, as README advises, whose outputs pass fp16's range. At a factor of
    1e6, its input's gradient passes fp16's range in backward too."""

    def __init__(self, factor):
        super().__init__(nn.Linear(16, 16), nn.Linear(16, 4))
        self.factor = factor

    def forward(self, x):
        x = self[0](x).mean(1)
        with torch.autocast(x.device.type, enabled=False):
            return self[1](x.float() * self.factor)


class ZeroesARowInPlace(nn.Linear):
    """Writes zeros into its output's first row through a view, before values that fp16 would
    hold only without that row."""

    def forward(self, x):
        h = super().forward(x)
        h[0] = 0
        return h * 100


class DoublesInPlace(nn.Linear):
    """Takes 16 ones to 4 outputs of 40000, and adds them to themselves in place, which fp16
    makes inf."""

    def __init__(self):
        super().__init__(16, 4, bias=False)
        nn.init.constant_(self.weight, 2500)

    def forward(self, x):
        h = super().forward(torch.ones_like(x))
        h += h
        return h


def scaled(module, factor):
    module.weight.data *= factor
    return module


def tiny_gradients(out, _):
    """A loss whose gradients, about 1e-8, are too small for fp16 but for a GradScaler."""
    return MSE(out.float(), out.detach().float() + 1e-6)


def small_loss(out, targets):
    """Cross entropy over 1000 times as many targets, of which these are the only wrong ones."""
    return nn.functional.cross_entropy(out, targets) / 1000


def classify(*body):
    """body, then a classifier of the 8 vectors of 16 for 4 classes."""
    return nn.Sequential(*body, nn.Flatten(), nn.Linear(128, 4))


# What fp16 does, by name: a model for 4 seeded sequences x of 8 vectors of 16, which cross
# entropy scores for 4 classes, or (model, inputs, criterion, targets) where those differ. A
# criterion or targets of None are as in the rest.
FP16_CASES = {
    "multi-head attention alone": lambda x: (nn.MultiheadAttention(16, 2, batch_first=True), {
        "query": x * 300, "key": x * 300, "value": x * 300}, lambda out, _: out[0].sum(), None),
    "a frozen backbone": lambda x: classify(scaled(nn.Linear(16, 16), 161027).requires_grad_(
        False)),
    "a head kept in fp32": lambda x: KeptInFP32(3e5),
    "a head kept in fp32 whose gradient passes 65504": lambda x: KeptInFP32(1e6),
    "a summed MSE loss": lambda x: (nn.Sequential(nn.Flatten(), nn.Linear(128, 1)), x,
                                    nn.MSELoss(reduction="sum"), torch.randn(4, 1) * 1e3),
    "a scaled embedding": lambda x: (classify(scaled(nn.Embedding(10, 16), 5e6), nn.LayerNorm(
        16)), torch.randint(0, 10, (4, 8)), None, None),
    "inf in the data": lambda x: (classify(Attention()), x.index_fill(2, torch.tensor([0]),
                                                                      math.inf), None, None),
    "NaN in a weight": lambda x: classify(scaled(nn.Linear(16, 16), math.nan)),
    "gradients past 65504 at 2**16": lambda x: nn.Sequential(nn.Flatten(), scaled(nn.Linear(
        128, 4), 300)),
    "a zero-initialized model": lambda x: nn.Sequential(nn.Flatten(), scaled(nn.Linear(128, 4), 0)),
    "a loss of 0": lambda x: (nn.Linear(16, 4), x, lambda out, _: out.float().sum() * 0, None),
    "a sum past 65504 in place": lambda x: nn.Sequential(DoublesInPlace(), nn.Flatten(),
                                                         nn.Linear(32, 4)),
    "a row zeroed in place": lambda x: (nn.Sequential(ZeroesARowInPlace(16, 4), nn.Flatten()),
                                        x.index_fill(0, torch.tensor([0]), 1e3), None, None),
    "scores past 65504 where the mask hides them": lambda x: classify(Attention(
        30.0, fill=-math.inf)),
    "every key of a row masked": lambda x: classify(Attention(fill=-math.inf, diagonal=0)),
    "SDPA with a boolean padding mask": lambda x: classify(SDPA()),
    "SDPA with an fp32 min mask": lambda x: classify(SDPA(torch.finfo(torch.float32).min)),
    "an fp32 min mask in fp16 before scores past 65504": lambda x: classify(Attention(
        300.0, mask_first=True)),
    "a sigmoid by hand": lambda x: classify(Act("sigmoid", 30)),
    "scores past 65504 before an fp32 min mask in fp16": lambda x: classify(Attention(300.0),
                                                                            SDPA(-3.4e38)),
    "log of 0, then BatchNorm": lambda x: classify(Act("log", 1), nn.BatchNorm1d(8)),
    "gradients too small for fp16": lambda x: (nn.Linear(16, 4), torch.randn(64, 16),
                                               tiny_gradients, None),
    "conv and BatchNorm": lambda x: (small_model(), torch.randn(8, 3, 8, 8) * 1e-3, None,
                                     torch.arange(8)),
    "gelu_new's x**3 past 65504, and a small loss": lambda x: (classify(Act("gelu_new", 30)), x,
                                                               small_loss, None),
    "dropout": lambda x: (nn.Sequential(nn.Linear(16, 64), nn.Dropout(), nn.Linear(64, 4)),
                          torch.randn(1, 16), None, torch.arange(1)),
    "checkpointed": lambda x: classify(Checkpointed(nn.Linear(16, 16), nn.GELU(), scaled(
        nn.Linear(16, 16), 100)))}
# Where fp16 makes its first inf or NaN that reaches a step, in the cases where it does.
OVERFLOWS = {"a sigmoid by hand": "exp in Sequential.0",
             "multi-head attention alone": "bmm in MultiheadAttention",
             "a frozen backbone": "addmm in Sequential.0",
             "a head kept in fp32 whose gradient passes 65504": "_to_copy in KeptInFP32",
             "a sum past 65504 in place": "add_ in Sequential.0",
             "an fp32 min mask in fp16 before scores past 65504": "bmm in Sequential.0",
             "scores past 65504 before an fp32 min mask in fp16": "bmm in Sequential.0"}
# Where fp32 meets inf or NaN too, so fp16 is not to blame.
FP32_BAD = {"inf in the data": "the batch", "NaN in a weight": "the model's '0.weight'",
            "every key of a row masked": "masked_fill in Sequential.0",
            "log of 0, then BatchNorm": "log in Sequential.0"}


def fp16_case(name):
    torch.manual_seed(0)
    x = torch.randn(4, 8, 16)
    case = FP16_CASES[name](x)
    if isinstance(case, nn.Module):
        case = case, x, None, None
    model, inputs, criterion, targets = case
    return model, (inputs, torch.arange(4) if targets is None else targets), (
        criterion or nn.CrossEntropyLoss())


def real_step(model, batch, criterion, dtype=None, scale=1):
    """A real CPU step of the model in training mode, in fp32 or in fp16 with its loss times
    `scale`: its weights' gradients, and whether they and the loss are finite. Its dropout
    masks come from seed 1."""
    copied, (inputs, targets) = copy.deepcopy(model).train(), batch
    torch.manual_seed(1)
    with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        loss = criterion(copied(**inputs) if isinstance(inputs, dict) else copied(inputs), targets)
    (loss.float() * scale).backward()
    gradients = torch.cat([p.grad.flatten() for p in copied.parameters() if p.requires_grad])
    return gradients, bool(loss.isfinite() and gradients.isfinite().all())


def real_settled_scale(model, batch, criterion, start):
    """The scale at which a real GradScaler's steps go through, as the docs' loop trains, from
    `start`. lr 0 gives every step the same gradients, and growth_interval=1 doubles the scale
    after each step that goes through, so it settles within a few steps."""
    copied = copy.deepcopy(model).train()
    optimizer = torch.optim.SGD(copied.parameters(), lr=0.0)
    scaler, scales = torch.amp.GradScaler("cpu", init_scale=start, growth_interval=1), []
    for _ in range(24):
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=FP16):
            loss = criterion(copied(batch[0]), batch[1])
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        scales.append(scaler.get_scale())
    # The last scales alternate between the one that goes through and twice it, which does not.
    return min(scales[-4:])


def zeroed(fp32, fp16):
    """The share of the nonzero values of the fp32 gradients that are zero in the fp16 ones."""
    return ((fp16 == 0) & (fp32 != 0)).sum().item() / max((fp32 != 0).sum().item(), 1)


@pytest.mark.parametrize("name", FP16_CASES)
def test_the_fp16_check_is_a_real_fp16_steps_and_names_where_its_inf_or_nan_begins(name):
    model, batch, criterion = fp16_case(name)
    overflow, bad = OVERFLOWS.get(name), FP32_BAD.get(name)
    before = copy.deepcopy(model.state_dict())
    # The check trains, as the real steps do, a model that evaluate() left in eval mode. Both
    # draw dropout masks from seed 1.
    rng = torch.manual_seed(1).get_state()
    found = amp_train.check_fp16(model.eval(), batch, criterion, "cpu")
    assert torch.equal(rng, torch.get_rng_state()), "the global RNG moved on"
    (fp32, fp32_finite), (fp16, fp16_finite) = (real_step(model, batch, criterion, dtype)
                                                for dtype in (None, FP16))
    assert (found["overflow"], found["bad"]) == (overflow, bad), found
    # fp16 is named where its real loss or gradients are inf or NaN and fp32's are not, and the
    # batch, the model or fp32 where fp32's are too.
    assert (fp32_finite, fp16_finite) == (bad is None, overflow is bad is None), found
    if found["scale"] is not None:
        scaled = real_step(model, batch, criterion, FP16, 2.0 ** found["scale"])[0]
        assert [found["zeroed"], found["zeroed_scaled"]] == pytest.approx(
            [zeroed(fp32, fp16), zeroed(fp32, scaled)], abs=0.02), found
        start = 2.0 ** min(found["scale"] + 3, 127)
        assert real_settled_scale(model, batch, criterion, start) == 2.0 ** found["scale"], found
    assert all(torch.allclose(before[k], v, rtol=0, atol=0, equal_nan=True) for k, v in
               model.state_dict().items()), "model changed"


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("step,rounds,per_round", [
    (0.001, 3, 20), (2.0, 3, 5), (4.0, 3, 2), (9.0, 3, 1), (52.0, 1, 1)])
def test_steps_are_timed_in_3_rounds_of_what_fits_in_30_s_or_once_where_a_step_is_longer(
        step, rounds, per_round, compile, monkeypatch):
    clock, trained, calls = [0.0], [], collections.Counter()

    def train_epoch(model, loader, *args):
        # A clock that each step moves on by `step` seconds, and each model's first timed step
        # by 10% more, as it allocates memory: nothing here is timed. The warm-up sizes rounds.
        trained.append(len(loader))
        calls[id(model)] += 1
        clock[0] += step * len(loader) * [1.0, 1.1][calls[id(model)] == 2]
    monkeypatch.setattr(amp_train, "train_epoch", train_epoch)
    monkeypatch.setattr(amp_train, "check_fp16", lambda *args: {})
    monkeypatch.setattr(amp_train, "device_rates", lambda *args: RATES)
    monkeypatch.setattr(amp_train, "time", type("Clock", (), {"perf_counter": lambda: clock[0]}))
    monkeypatch.setattr(amp_train, "compiled", lambda model, device, amp_dtype: model)
    measured = amp_train.measure_amp(nn.Linear(10, 1), batch_of(4), MSE, "cpu", log=len,
                                     compile=compile)
    # The counted first step, the step that compiles, timed apart, the first timed, 2 more
    # where a step fits a round's share, and the rounds.
    assert trained == ([1] * (2 + compile) + [2] * (rounds > 1) + [per_round] * rounds) * 2
    assert measured["bf16"]["median_step_seconds"] == pytest.approx(step), measured
    assert ("compile_seconds" in measured["bf16"]) == compile, measured


def test_a_steps_flops_time_at_the_devices_rates_and_share_come_from_its_counted_flops(
        monkeypatch):
    # 5 images of 3x8x8: a 3x3 conv to 8 channels of 6x6, then a Linear from 288 to 4. The first
    # layer's backward computes its weight's gradient alone, and the Linear's its input's too.
    # torch counts no FLOPs in BatchNorm and dropout, which are there to draw on the RNG and
    # update buffers.
    conv, linear = 2 * 5 * 8 * 6 * 6 * 3 * 9, 2 * 5 * 288 * 4
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Flatten(), nn.Dropout(),
                          nn.Linear(288, 4))
    batch = torch.randn(5, 3, 8, 8), torch.arange(5) % 4
    rates = {"fp32": {"matmul_rate_flops": 1e9, "conv_rate_flops": 4e9},
             "fp16": {"matmul_rate_flops": 8e9, "conv_rate_flops": 8e9}}
    monkeypatch.setattr(amp_train, "device_rates", lambda device, precision, log: rates[precision])
    monkeypatch.setattr(amp_train, "median_seconds", lambda run, *args: 0.5)
    before, rng = copy.deepcopy(model.state_dict()), torch.get_rng_state()
    measured = amp_train.measure_amp(model, batch, nn.CrossEntropyLoss(), CPU, FP16, log=len)
    # It leaves the model, its buffers and the global RNG as they were.
    assert torch.equal(rng, torch.get_rng_state()), "the global RNG moved on"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "model changed"
    # fp16's own figures and the check's stand apart in the report.
    assert "fp16 steps take" in amp_train.amp_report(measured)[-1], measured
    for precision, rate in rates.items():
        figures = measured[precision]
        rated = 2 * conv / rate["conv_rate_flops"] + 3 * linear / rate["matmul_rate_flops"]
        assert (figures["step_flop"], figures["conv_flop"]) == (2 * conv + 3 * linear, 2 * conv)
        assert figures["achieved_flops"] == (2 * conv + 3 * linear) / 0.5, figures
        assert figures.items() >= rate.items() and (figures["rated_seconds"], figures[
            "rate_share"]) == (pytest.approx(rated), pytest.approx(rated / 0.5)), figures
    with pytest.raises(ValueError, match=r"torch\.bfloat16 or torch\.float16, not 'bf16'$"):
        amp_train.measure_amp(model, batch, MSE, CPU, "bf16")


def test_the_devices_rates_are_counted_flops_a_second_of_probes_grown_to_10_ms_a_call(
        monkeypatch):
    def seconds_a_call(op, inputs, device, calls):
        # A call takes 10 ms from 2**20 values in the first input on: a 1024x1024 matrix, or
        # 16 images of 64 channels of 32x32.
        op(*inputs)
        return inputs[0].numel() * 1e-8
    monkeypatch.setattr(amp_train, "seconds_a_call", seconds_a_call)
    monkeypatch.setattr(amp_train, "median_seconds", lambda run, *args: 2.0)
    # A 3x3 convolution of 64 channels takes 32x32 images to 30x30.
    flop = {"matmul_rate_flops": 2 * 1024**3, "conv_rate_flops": 2 * 16 * 64 * 30 * 30 * 64 * 9}
    for precision in ("fp32", "bf16"):
        rates = amp_train.device_rates(CPU, precision, len)
        assert rates == {name: n / 2 for name, n in flop.items()}, rates


def test_the_memory_example_prints_its_header_notes_table_and_verdict_in_units_that_fit(
        monkeypatch, capsys):
    # A CPU without bf16 instructions, where bf16 is emulated, as on an AVX2-only one.
    fake_cpu(monkeypatch)
    out = printed(MEMORY, capsys)
    assert out.startswith("memory | torch ") and "| model linear | batch 128 | compile False\n" \
        "note: bf16 is not native on cpu here, so it is slower than fp32\n" in out, out
    # The post's Linear(10, 1) saves 6 KiB in fp32, and computes 5,120 FLOPs a step: 2,560 in its
    # forward pass and as many for its weight's gradient.
    for row in (r"saved_bytes +6\.00 KiB +3\.50 KiB +0\.58",
                r"step_flop +5\.1 kFLOP +5\.1 kFLOP +1\.00",
                r"  fp32: one took [\d.]+ [nµm]?s, so 3 rounds of 20 are timed",
                r"  the GradScaler's scale goes from 2\*\*16 to 2\*\*16, the largest power of 2 "
                r"that keeps the weights' gradients finite",
                r"matmul_rate_flops +[\d.]+ [GM]FLOP/s +[\d.]+ [GMk]FLOP/s +[\d.]+",
                r"verdict: linear, batch 128, cpu \(16-bit instructions: none\), torch .*; fp16 "
                r"keeps the loss and the weights' gradients finite"):
        assert re.search(f"^{row}$", out, re.M), (row, out)


# What the fp16 lines say: where a scale is named, here for a compiled model, and where the loss
# or a gradient is inf or NaN, here for an eager one.
FP16_LINES = [
    ({"scale": 14, "zeroed": 0.5, "zeroed_scaled": 0.01}, True,
     ["  the check ran the model eagerly, and compiled ops may overflow elsewhere",
      "  the GradScaler's scale goes from 2**16 to 2**14, the largest power of 2 that keeps the "
      "weights' gradients finite", "  fp16 makes 50.00% of the weights' nonzero gradient values "
      "zero, and 1.00% at 2**14"]),
    ({"scale": None}, False,
     ["  the loss or a weight's gradient is inf or NaN, so the GradScaler skips every step"])]
# What bounds a step, by its share of the device's measured rates and the bf16/fp32 step.
BOUNDS = [(0.8, 0.5, "arithmetic bounds them, and AMP buys what the hardware allows"),
          (0.4, 0.5, "arithmetic bounds them, with launches or memory"),
          (0.1, 0.8, "memory bounds them, and AMP's halved bytes are what it buys"),
          (0.1, 1.0, "kernel launches bound them, and --compile or a larger batch can speed them "
                     "up where AMP cannot")]


@pytest.mark.parametrize("share,step,bound", BOUNDS)
@pytest.mark.parametrize("fp16,compile,says", FP16_LINES)
def test_the_report_names_what_bounds_a_step_what_fp16_does_and_each_value_in_a_unit_that_fits(
        share, step, bound, fp16, compile, says):
    # From 5 KiB and 50 µs to 1.3 million samples and 1.5 TFLOPs a second: no exponent.
    fp32 = {"saved_bytes": 5 * 2**10, "median_step_seconds": 5e-5, "samples_per_second": 1325060.4,
            "achieved_flops": 1.5e12, "rated_seconds": 1e-5, "rate_share": 0.4}
    # The AMP column's other figures are fp32's: the verdict reads only these.
    amp = {**fp32, "saved_bytes": 3.75 * 2**10, "median_step_seconds": step * 5e-5,
           "rated_seconds": share * step * 5e-5, "rate_share": share}
    fp16 = {**fp16, "seconds": 1e-4, "verdict": "fp16 makes inf or NaN, first at bmm"}
    lines = amp_train.amp_report({"name": "m", "batch": 1, "device": "cpu", "precision": "bf16",
                                  "compile": compile, "fp32": fp32, "bf16": amp,
                                  "fp16_check": fp16})
    assert lines[-1].endswith(
        f": bf16 steps take {step:.2f}x fp32's time, where a step at the device's measured rates "
        f"would take {share * step * 5:.2f}x; they reach {share:.2%} of those rates, so {bound}; "
        "0.75x the memory saved for backward; AMP is "
        f"{['faster', 'about as fast as fp32'][step == 1.0]} here; fp16 makes inf or NaN, first "
        "at bmm"), lines[-1]
    # The AMP column's values take the same units. The memory example's rows show its ratios.
    assert lines[1] == "saved_bytes                   5.00 KiB        3.75 KiB        0.75", lines
    assert [line[:38] for line in lines[2:7]] == [
        "median_step_seconds          50.000 µs", "samples_per_second        1,325,060 /s",
        "achieved_flops             1.5 TFLOP/s", "rated_seconds                10.000 µs",
        "rate_share                     40.00 %"], lines
    assert lines[7:-1] == [
        "fp16 as autocast runs it here, checked on this batch in 0.00 s, as long as 2.0 fp32 "
        "steps:", *says, "  bf16 has fp32's range, so none of this applies to bf16"], lines


# ---------- the run folder: every write whole, the standard checkpoint, one try to read it

def test_each_write_is_fsynced_then_renamed_and_one_that_fails_or_is_stopped_changes_nothing(
        run_dir, monkeypatch, capsys):
    calls, fsync, replace = [], os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append("fsync") or fsync(fd))
    monkeypatch.setattr(os, "replace", lambda old, new: calls.append(
        f"{pathlib.Path(old).name[:5]} -> {pathlib.Path(new).name}") or replace(old, new))
    ok(LINEAR_FP16 + ["--epochs", "2", "--run-dir", str(run_dir)])
    # Before the first epoch and after each.
    assert calls == ["fsync", ".tmp- -> checkpoint.pt", "fsync",
                     ".tmp- -> metrics.jsonl"] * 3, calls
    before = files_of(run_dir)
    assert sorted(before) == [".lock", "checkpoint.pt", "metrics.jsonl"], "nothing else"
    # The standard checkpoint, which plain torch loads.
    # The resumed runs' test loads each state dict into torch's own classes.
    state = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert set(state) == {"model", "optimizer", "scaler", "scheduler", "epoch", "args",
                          "metrics", "launch"}, set(state)
    assert (state["scheduler"]["last_epoch"], state["scaler"]["scale"], len(state["metrics"]),
            state["optimizer"]["param_groups"][0]["lr"]) == (2, 65536.0, 2, 0.01), state
    for error, status in (OSError(28, "No space left on device"), 2), (KeyboardInterrupt(), 130):
        def failing(fd, error=error):
            os.write(fd, b"half a file")
            raise error
        monkeypatch.setattr(os, "fsync", failing)
        argv = LINEAR_FP16 + ["--epochs", "3", "--run-dir", str(run_dir), "--resume"]
        err = run_bad(argv, capsys, status)
        assert err.endswith(f"; {run_dir} holds epoch 2\n") and files_of(run_dir) == before, err


# A scaler whose scale grows every step from 16 (16, 32, 64...): one not restored shows.
GROWS = functools.partial(torch.amp.GradScaler, init_scale=16.0, growth_interval=1)


def adamw(model, lr):
    """An optimizer with state of its own (Adam's moments), which a resume must restore."""
    return torch.optim.AdamW(model.parameters(), lr=lr)


# The resnet example is fp32's case, and bf16 keeps no scaler state either.
@pytest.mark.parametrize("argv,optimizer,first", [
    (RESNET, None, []), (LINEAR + ["--precision", "bf16"], None, []), (LINEAR_FP16, None, []),
    (LINEAR_FP16, adamw, []), (LINEAR, None, ["--compile"])],
    ids=["resnet", "bf16", "fp16", "fp16-adamw", "fp32-compiled-first"])
def test_a_resumed_run_ends_bit_identical_to_an_uninterrupted_one(argv, optimizer, first, run_dir,
                                                                   monkeypatch, capsys):
    # Compiled by dynamo and run by eager kernels, as in the test of --compile.
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    monkeypatch.setattr(torch.amp, "GradScaler", GROWS)
    monkeypatch.setattr(amp_train, "LR_STEP_EPOCHS", 2)
    monkeypatch.setattr(amp_train, "LR_GAMMA", {"resnet": 0.1, "linear": 0.5})
    if optimizer is not None:
        monkeypatch.setattr(amp_train, "make_optimizer", optimizer)
    a, b = run_dir / "a", run_dir / "b"
    ok(argv + ["--epochs", "5", "--run-dir", str(a)])
    ok(argv + ["--epochs", "3", "--run-dir", str(b)] + first)
    # A later epoch, torn: the checkpoint's lines win.
    with open(b / "metrics.jsonl", "a") as f:
        f.write('{"epoch": 4}\n{"epo')
    ok(argv + ["--epochs", "5", "--run-dir", str(b), "--resume"])
    assert f"resumed from {b} after epoch 3" in capsys.readouterr().out
    # Bit-identical: torch.save writes the same bytes, tensors and all.
    for name in ("model", "optimizer", "scaler", "scheduler", "epoch"):
        saved = [io.BytesIO(), io.BytesIO()]
        for folder, buffer in zip((a, b), saved):
            torch.save(load(folder / "checkpoint.pt")[name], buffer)
        assert saved[0].getvalue() == saved[1].getvalue(), name
    untimed = [[{k: v for k, v in r.items() if "second" not in k} for r in read_metrics(path)]
               for path in (a / "metrics.jsonl", b / "metrics.jsonl")]
    assert untimed[0] == untimed[1]


def momentum_buffer(buffer):
    """A checkpoint edit: SGD's momentum on, with `buffer` as the weight's momentum buffer."""
    def make(path):
        state = load(path)
        state["optimizer"]["param_groups"][0]["momentum"] = 0.9
        state["optimizer"]["state"] = {0: {"momentum_buffer": buffer},
                                       1: {"momentum_buffer": torch.zeros(1)}}
        torch.save(state, path)
    return make


class CreatesAFile:
    """Unpickled, this creates a file, as a malicious checkpoint could."""
    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path("pwned"),)


@pytest.mark.parametrize("make", [
    lambda path: torch.save({"x": CreatesAFile()}, path),
    lambda path: path.write_bytes(path.read_bytes()[:200]),
    lambda path: torch.save({"model": load(path)["model"]}, path),
    lambda path: torch.save({**load(path), "model": {"weight": torch.zeros(1, 11)}}, path),
    lambda path: path.unlink() or path.mkdir(),
    momentum_buffer(torch.zeros(3)), momentum_buffer(torch.zeros(1, 1).expand(1, 10))],
    ids=["code", "truncated", "of another program", "of another model", "a folder",
         "a momentum buffer of 3 for 10 weights", "one number seen as 10"])
def test_a_file_that_is_no_checkpoint_of_this_run_ends_in_one_line_and_changes_nothing(
        make, run_dir, monkeypatch, capsys):
    run = LINEAR_FP16 + ["--run-dir", str(run_dir / "run")]
    ok(run + ["--epochs", "1"])
    make(run_dir / "run" / "checkpoint.pt")
    before = {p.name: p.lstat().st_mtime_ns for p in (run_dir / "run").iterdir()}
    monkeypatch.chdir(run_dir)
    err = run_bad(run + ["--epochs", "2", "--resume"], capsys)
    assert f"{run_dir / 'run' / 'checkpoint.pt'} is no checkpoint this run can go on" in err
    # One line, of any length that the path makes it.
    assert len(err.replace(str(run_dir), "")) < 200 and not (run_dir / "pwned").exists(), err
    assert {p.name: p.lstat().st_mtime_ns for p in (run_dir / "run").iterdir()} == before, err


# ---------- the run folder: one run owns it, and a resume goes on as the run was

def test_a_folder_in_use_or_with_a_checkpoint_is_refused_but_to_a_resume_or_a_restart(
        run_dir, monkeypatch, capsys):
    run = LINEAR + ["--run-dir", str(run_dir)]
    ok(run + ["--epochs", "2"])
    before = {p.name: p.stat().st_mtime_ns for p in run_dir.iterdir()}
    with held(run_dir):
        for argv in ([], ["--resume"]):
            assert "another run is using" in run_bad(run + ["--epochs", "3"] + argv, capsys)
    assert "holds a run: add --resume" in run_bad(run + ["--epochs", "3"], capsys)
    assert {p.name: p.stat().st_mtime_ns for p in run_dir.iterdir()} == before, "it wrote"
    # Under torchrun a launch is rank 0's agent, its workers' parent: 1, then another. The
    # refused runs let the folder go: once the live run is gone, the next one may take it.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setattr(os, "getppid", lambda: 1)
    ok(run + ["--epochs", "3", "--resume"])
    # A restart of that launch goes on from its checkpoint without --resume. Another launch's
    # run is refused.
    ok(run + ["--epochs", "4"])
    monkeypatch.setattr(os, "getppid", lambda: 2)
    assert "holds a run: add --resume" in run_bad(run + ["--epochs", "5"], capsys)


def test_a_resume_goes_on_with_the_checkpoints_flags_but_those_given_again(run_dir, capsys):
    run = ["--device", "cpu", "--run-dir", str(run_dir)]
    ok(run + ["--example", "linear", "--epochs", "3", "--lr", "0.002", "--batch-size", "16",
              "--precision", "fp32", "--clip-grad-norm", "1"])
    ok(run + ["--epochs", "4", "--resume", "--clip-grad-norm", "0"])
    capsys.readouterr()
    # The flags that a run saves are those it trains with.
    assert load(run_dir / "checkpoint.pt")["args"] == {
        "example": "linear", "precision": "fp32", "batch_size": 16, "seed": 0, "epochs": 4,
        "lr": 0.002, "clip_grad_norm": 0.0, "accum_steps": 1, "data": "cifar10", "max_steps": 0}
    # Into fp16, whose scale starts anew (fp32 saved none), and out of it: bf16 takes none.
    ok(run + ["--epochs", "5", "--resume", "--precision", "fp16"])
    out = printed(run + ["--epochs", "6", "--resume", "--precision", "bf16"], capsys)
    assert "| precision bf16 |" in out and re.findall(r"scale (\d+)", out) == ["65536", "1"], out
    # Another example's run says what the folder holds.
    argv = run + ["--resume", "--example", "resnet", "--data", "synthetic"]
    assert f"{run_dir} holds a linear run: use another --run-dir" in run_bad(argv, capsys)


# ---------- torchrun's processes

def ddp_worker(rank, argv, out_dir, port, nan_epoch):
    """One of two processes, as torchrun starts them: saves what main() did. In epoch
    `nan_epoch`, rank 1 alone ends its training with NaN BatchNorm statistics."""
    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    # torch finds a GPU, as on a GPU machine, and its backend cannot serve a CPU run.
    torch.accelerator.current_accelerator = lambda check_available=False: torch.device("cuda")
    # A process that waits for ever fails the test instead.
    faulthandler.dump_traceback_later(60, exit=True)
    # aot_eager traces the backward pass as inductor does, and runs it with eager kernels.
    torch.compile = functools.partial(torch.compile, backend="aot_eager")
    # DDP works alike on 256 images: 10,000 take seconds.
    amp_train.resnet18 = small_model
    amp_train.synthetic_cifar10 = lambda sizes, seed: cached_synthetic_cifar10((256, 256), seed)
    trained, real = [], amp_train.train_epoch

    def recording(model, *args, **kwargs):
        trained.append(real(model, *args, **kwargs))
        if rank == 1 and len(trained) == nan_epoch:
            model.module[1].running_mean.fill_(math.nan)
        return trained[-1]
    amp_train.train_epoch = recording
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = amp_train.main(argv)
    torch.save({"code": code, "left": not torch.distributed.is_initialized(), "out": out.getvalue(),
                "err": err.getvalue(), "trained": trained}, out_dir / f"rank{rank}.pt")


def run_two_processes(argv, out_dir, nan_epoch=None):
    """main(argv) in two gloo processes; returns what each did."""
    def run(port):
        # Forked from a server that imported this module, and the torch._dynamo that every
        # optimizer imports, once: not again in each process.
        multiprocessing.set_forkserver_preload([__name__, "torch._dynamo"])
        torch.multiprocessing.start_processes(ddp_worker, (argv, out_dir, port, nan_epoch), 2,
                                              start_method="forkserver")
        return [load(out_dir / f"rank{r}.pt") for r in range(2)]
    return retry_if_the_port_was_taken(run)


def test_two_processes_go_on_from_one_each_on_its_share_and_all_stop_when_rank_1_alone_fails(
        run_dir):
    run = RESNET + ["--max-steps", "1", "--run-dir", str(run_dir / "run")]
    ok(run + ["--epochs", "1"])
    # A folder that another run holds is said once, and stops every process.
    with held(run_dir / "run"):
        rank0, rank1 = run_two_processes(run + ["--epochs", "4", "--resume"], run_dir)
    assert (rank0["code"], rank1["code"], rank1["err"]) == (2, 2, ""), rank1
    assert "another run is using" in rank0["err"], rank0["err"]
    # In epoch 3, the second of this launch, rank 1 alone ends with NaN BatchNorm statistics.
    # It resumes compiled, as DDP and torch.compile train together.
    rank0, rank1 = run_two_processes(run + ["--epochs", "4", "--resume", "--compile"], run_dir,
                                     nan_epoch=2)
    assert (rank0["code"], rank1["code"], len(rank1["trained"])) == (1, 1, 2), rank0["err"]
    # Rank 1 prints nothing of its own. torch's dynamo may warn there.
    assert rank0["left"] and rank1["left"] and rank1["out"] == "" and "error" not in rank1["err"]
    # Its mean loss is finite: the statistics alone stop the run.
    assert "error: epoch 3: the model's 1.running_mean holds inf/NaN: lower --lr, or look for " \
        "inf/NaN in the data" in rank0["err"], rank0
    # The test of a run that diverges shows that the checkpoint keeps the last sound epoch.
    # Each epoch's train loss is the mean over both processes' samples, each on its own share.
    records = read_metrics(run_dir / "run" / "metrics.jsonl")
    assert [r["processes"] for r in records] == [1, 2, 2], records
    for record, *own in zip(records[1:], rank0["trained"], rank1["trained"]):
        mean = sum(s["loss"] * s["samples"] for s in own) / sum(s["samples"] for s in own)
        assert own[0]["loss"] != pytest.approx(own[1]["loss"]), own
        assert record["train_loss"] == pytest.approx(mean), (record, own)


DIES = """import os, signal, sys, time
import amp_train
real = amp_train.run_epoch
def dying(args, epoch, *rest):
    # Rank 1 dies by kill -9 in epoch 2 once epoch 1's checkpoint is written, once in all.
    if epoch == 1 and os.environ["RANK"] == "1" and not os.path.exists("died"):
        deadline = time.monotonic() + 60
        while not open("run/metrics.jsonl").read():
            assert time.monotonic() < deadline, "epoch 1's metrics never came"
            time.sleep(0.05)
        open("died", "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    return real(args, epoch, *rest)
amp_train.run_epoch = dying
sys.exit(amp_train.main(sys.argv[1:]))
"""
# README's torchrun lines: one machine by its own rendezvous (--standalone) or the static one
# (--master-port), and two agents on one machine playing two nodes, one process each.
TWO_NODES = ["--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d", "--rdzv-id=amp",
             "--rdzv-endpoint=127.0.0.1:{port}"]
LAUNCHES = {"standalone": [["--standalone", "--nproc_per_node=2"]], "two nodes": [TWO_NODES] * 2,
            "static": [["--nproc_per_node=2", "--master-port={port}"]]}


@pytest.mark.parametrize("launch", LAUNCHES)
def test_a_torchrun_restart_after_kill_9_goes_on_from_its_launchs_checkpoint(launch, run_dir):
    (run_dir / "dies.py").write_text(DIES)
    argv = ["dies.py", *LINEAR, "--epochs", "3", "--run-dir", "run"]
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": str(int(launch == "two nodes")),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}

    def run(port):
        # Each agent leads a process group of its own, which ends with it, also on a timeout.
        agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *(
            option.format(port=port) for option in options), "--max-restarts=1", *argv],
            cwd=run_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True) for options in LAUNCHES[launch]]
        try:
            return [(*agent.communicate(timeout=120), agent.returncode) for agent in agents]
        finally:
            for agent in agents:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(agent.pid, signal.SIGKILL)
    agents = retry_if_the_port_was_taken(run)
    out = "".join(agent[0] for agent in agents)
    assert [agent[2] for agent in agents] == [0] * len(agents), agents
    # One kill, one restart: two rounds began, and the second went on from epoch 1.
    assert (run_dir / "died").exists() and out.count("amp_train | example linear") == 2, out
    assert re.search(r"^resumed from run after epoch 1$", out, re.M), out
    assert [r["epoch"] for r in read_metrics(run_dir / "run" / "metrics.jsonl")] == [1, 2, 3]
    ok(LINEAR + ["--epochs", "3", "--run-dir", str(run_dir / "a")])
    restarted, alone = (load(run_dir / name / "checkpoint.pt")["model"] for name in ("run", "a"))
    assert all(torch.allclose(restarted[k], alone[k], atol=1e-6) for k in alone), restarted


# ---------- errors, and the command line

@pytest.mark.parametrize("argv", [
    ["--example", "nope"], ["--epochs", "0"], ["--max-steps", "-1"], ["--clip-grad-norm", "-1"],
    ["--lr", "0", "argument --lr: must be a finite number more than 0, not 0"], ["--lr", "nan"],
    ["--lr", "inf", "must be a finite number more than 0, not inf"], ["--resume"],
    ["--accum-steps", "1" + "0" * 30], ["--seed", "4294967296", "must be from 0 to 2**32 - 1"],
    ["--example", "memory", "--precision", "fp32", "compares fp32 with AMP: use --precision bf16"],
    ["--example", "memory", "--model", "fcn_resnet50", "is not a model the memory example knows: "
     "use linear, resnet18, resnet18-imagenet, or a torchvision classification model"],
    RESNET + ["--batch-size", "10001", "more than each process's 10000 training images"],
    LINEAR + ["--run-dir", str(HERE / "no-run"), "--resume", f"nothing to resume in {HERE}"],
    LINEAR + ["--run-dir", str(HERE / "README.md"), "README.md is a file, not a folder"],
    LINEAR + ["--run-dir", str(HERE / "README.md" / "run"), "cannot use --run-dir"]])
def test_a_bad_flag_ends_in_one_line_before_any_training(argv, capsys):
    says = ""
    if " " in argv[-1]:
        says = argv.pop()
    assert says in run_bad(argv, capsys) and "epoch" not in capsys.readouterr().out


@pytest.mark.skipif(os.name == "nt", reason="inductor compiles with MSVC there, not $CXX")
def test_where_torch_cannot_compile_compile_ends_in_one_line_before_any_training(tmp_path):
    # Inductor reads $CXX as it is imported, so this runs in a process of its own, with a cache
    # of its own.
    env = {**os.environ, "CXX": str(tmp_path / "no-compiler"), "TORCHINDUCTOR_CACHE_DIR": str(
        tmp_path)}
    run = subprocess.run([sys.executable, str(HERE / "amp_train.py"), *LINEAR, "--compile"],
                         env=env, capture_output=True, text=True, timeout=120)
    last = run.stderr.splitlines()[-1]
    assert run.returncode == 2 and "train loss" not in run.stdout, run
    assert run.stderr.count("error: ") == 1, run.stderr
    assert last.startswith("error: torch cannot compile for cpu here (") and last.endswith(
        "): run without --compile"), run.stderr


def test_ctrl_c_ends_in_one_line_that_says_what_was_saved(monkeypatch, capsys):
    # A run folder's Ctrl-C, which names its last checkpoint, is in the test of its writes.
    monkeypatch.setattr(amp_train, "train_epoch", unittest.mock.Mock(side_effect=KeyboardInterrupt))
    assert run_bad(MEMORY, capsys, 130) == "error: stopped by Ctrl-C; nothing was saved\n"


@pytest.mark.parametrize("error", [ZeroDivisionError, RuntimeError, ValueError])
def test_a_bug_passes_main_with_its_traceback(error, monkeypatch):
    monkeypatch.setattr(amp_train, "build_example", unittest.mock.Mock(side_effect=error))
    with pytest.raises(error):
        amp_train.main(LINEAR)


@requires_cuda
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_cuda_trains_and_measures_its_peak_memory(precision, capsys, resnet18):
    argv = ["--device", "cuda", "--precision", precision, "--batch-size", "16"]
    out = printed(argv + ["--data", "synthetic", "--epochs", "1", "--max-steps", "3"], capsys)
    assert f"| precision {precision} |" in out, out
    out = printed(argv + ["--example", "memory"], capsys)
    assert re.search(r"^peak_bytes +[\d,.]+ MiB +[\d,.]+ MiB +[\d.]+$", out, re.M), out


@requires_cuda
@pytest.mark.parametrize("amp_dtype", [BF16, FP16])
def test_a_cuda_step_makes_no_host_sync_but_the_epochs_one(amp_dtype):
    model = nn.Linear(10, 1).to("cuda")
    optimizer = amp_train.make_optimizer(model, 0.01)
    scaler = torch.amp.GradScaler("cuda", enabled=amp_dtype is FP16)
    batches = [(inputs.to("cuda"), targets.to("cuda")) for inputs, targets in batches_of([4] * 6)]
    # The first step allocates memory and picks kernels.
    train(model, batches[:1], optimizer, scaler, amp_dtype, "cuda")

    def strict(batches):
        # Any host sync raises while the loader has batches left; the epoch's one comes after.
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield from batches
        finally:
            torch.cuda.set_sync_debug_mode("default")
    stats = train(model, strict(batches), optimizer, scaler, amp_dtype, "cuda", clip_grad_norm=1.0,
                  accum_steps=2)
    assert stats["samples"] == 24, stats
