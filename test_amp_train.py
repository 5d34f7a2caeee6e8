"""Tests of amp_train.py, in the module's order; CUDA cases run where a GPU is.
Run: python -m pytest -q"""
import contextlib, functools, inspect, io, json, math, os, pathlib, pickle, re, signal, socket
import subprocess, sys, time, urllib.error, zipfile

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
README = (HERE / "README.md").read_text()
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CPU = torch.device("cpu")
FP16, BF16 = torch.float16, torch.bfloat16
MSE = nn.MSELoss()
LINEAR = ["--device", "cpu", "--example", "linear"]
LINEAR_FP16 = LINEAR + ["--precision", "fp16"]
# The resnet example's flags and data, with small_model() for ResNet18 (see `fast`).
RESNET = ["--device", "cpu", "--example", "resnet", "--data", "synthetic", "--max-steps", "2",
          "--batch-size", "4", "--precision", "fp32"]
RESNET18 = amp_train.resnet18
NOTHING = "nothing is saved without --run-dir"


def small_model(imagenet_stem=False):
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))


@pytest.fixture(autouse=True)
def fast(monkeypatch):
    """Synthetic data made once; ResNet18 is small_model unless a test asks for resnet18."""
    monkeypatch.setattr(amp_train, "synthetic_cifar10", cached_synthetic_cifar10)
    monkeypatch.setattr(amp_train, "resnet18", small_model)


@pytest.fixture
def resnet18(monkeypatch):
    monkeypatch.setattr(amp_train, "resnet18", RESNET18)


@functools.lru_cache(maxsize=None)
def cached_synthetic_cifar10(size, seed=0, train=True, _make=amp_train.synthetic_cifar10):
    return _make(size, seed, train)


def ok(argv):
    assert amp_train.main(argv) == 0, argv


def linear_batch(batch_size=128, seed=0):
    """The linear example's fixed batch, as amp_train makes it."""
    args = amp_train.parse_args(LINEAR + ["--batch-size", str(batch_size), "--seed", str(seed)])
    return next(iter(amp_train.build_example(args, CPU)[2]))


def split(batch_size, size, seed=0):
    return list(zip(*(t.split(size) for t in linear_batch(batch_size, seed))))


def linear_setup(device="cpu", amp_dtype=None, lr=0.01):
    torch.manual_seed(0)
    model = nn.Linear(10, 1).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    return model, optimizer, amp_train.make_scaler(torch.device(device), amp_dtype)


def train(model, batches, optimizer, scaler=None, amp_dtype=None, device="cpu", **kwargs):
    return amp_train.train_epoch(model, batches, optimizer, MSE, scaler, device, amp_dtype,
                                 **kwargs)


def docs_loop(model, batches, optimizer):
    """The torch.amp docs' loop, in fp32."""
    for inputs, targets in batches:
        optimizer.zero_grad()
        MSE(model(inputs), targets).backward()
        optimizer.step()


def with_inf(batch):
    x = batch[0].clone()
    x[0, 0] = math.inf  # the loss of this batch is inf, its gradients inf/NaN
    return x, batch[1]


def raising(error):
    return lambda *args, **kwargs: (_ for _ in ()).throw(error)


def generator_of(batches):
    yield from batches  # no len(): a streaming data set


def run_bad(argv, capsys, status=2):
    code, err = amp_train.main(argv), capsys.readouterr().err
    assert code == status and err.count("\n") == 1 and err.startswith("error: "), (code, err)
    return err


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def read_metrics(path):
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines()]


def files_of(folder):
    return {p.name: p.read_bytes() for p in pathlib.Path(folder).iterdir()}


def lrs_of(out):
    return [float(x) for x in re.findall(r"\| lr ([\d.e-]+) \|", out)]


def script(*argv, **env):
    """amp_train.py as a user starts it, in a process of its own (stdout buffered)."""
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}, **env}
    return subprocess.Popen([sys.executable, SCRIPT, *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def retry_if_the_port_was_taken(run):
    """run(port) on a port free a moment ago: another process may take it first."""
    for _ in range(3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        result = run(port)
        if "EADDRINUSE" not in str(result):
            return result
    raise AssertionError(f"three ports were taken: {result}")


# ---------- the part to copy

def readme_blocks(heading):
    section = README[README.index(heading):]
    section = section[:section.find("\n## ", 1) % len(section)]
    return re.findall(r"```python\n(.*?)\n```", section, re.S)


def test_readme_block_is_train_epoch_pastes_alone_and_is_the_docs_loop():
    block = readme_blocks("## Copy this")[0]
    assert inspect.getsource(amp_train.train_epoch) in block, "README and the module differ"
    assert README[:README.index("## Copy this")].count("\n") < 120, "Copy this comes late"
    batches, (model, optimizer, _), (reference, ref_optimizer, _) = split(24, 8, 2), *[
        linear_setup(lr=0.1) for _ in range(2)]
    user = {"model": model, "optimizer": optimizer, "criterion": MSE, "device": "cpu",
            "loader": generator_of(batches)}  # all a user's script has
    exec(compile(block, "README.md", "exec"), user)
    assert user["amp_dtype"] is BF16 and torch.equal(model.weight, reference.weight), "trained"
    user["amp_dtype"] = None  # fp32, as the docs' loop
    exec(re.search(r"^#\s+(stats = train_epoch\(.*\))$", block, re.M).group(1), user)
    docs_loop(reference, batches, ref_optimizer)
    assert torch.equal(model.weight, reference.weight), (model.weight, reference.weight)
    stats = user["stats"]
    assert (stats["steps"], stats["skipped_steps"], stats["loss_scale"]) == (3, 0, 1.0), stats
    doc = amp_train.train_epoch.__doc__  # the keys; the scheduler is our choice
    assert all(f'"{key}"' in doc for key in stats) and "(our choice: no sync)" in doc, doc


def test_mistakes_and_leftovers_are_refused_or_ignored():
    (x, y), (model, optimizer, _), (clean, clean_optimizer, _) = linear_batch(16), *[
        linear_setup() for _ in range(2)]
    for scaler in (None, torch.amp.GradScaler("cpu", enabled=False)):
        with pytest.raises(ValueError, match=r"torch\.amp\.GradScaler"):  # fp16
            train(model, [(x, y)], optimizer, scaler, FP16)
    with pytest.raises(ValueError, match="accum_steps"):
        train(model, [(x, y)], optimizer, accum_steps=0)
    for batch in ({"input": x, "label": y}, x):
        with pytest.raises(TypeError, match=r"is no \(inputs, targets\) pair: see README"):
            train(model, [batch], optimizer)
    MSE(model(x * 100), y).backward()  # a micro-batch that raised, retried smaller
    stats = train(model, [(x, y), (x[:0], y[:0])], optimizer)  # an empty batch: no sample
    clean_stats = train(clean, [(x, y)], clean_optimizer)
    assert torch.equal(model.weight, clean.weight), "an old gradient reached a step"
    assert (stats["samples"], stats["loss"]) == (16, clean_stats["loss"]), stats


@pytest.mark.filterwarnings("ignore:Detected call of")  # torch's note when step 1 is skipped
@pytest.mark.parametrize("amp_dtype", [None, FP16])
def test_a_scheduler_steps_every_step(amp_dtype):
    batches = split(40, 4)  # 10 micro-batches: 5 steps of 2
    batches[0] = with_inf(batches[0])  # fp16 skips step 1
    model, optimizer, scaler = linear_setup(amp_dtype=amp_dtype)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    stats = train(model, batches, optimizer, scaler, amp_dtype, scheduler=scheduler,
                  accum_steps=2)
    assert scheduler.last_epoch == 5 == stats["steps"], (scheduler.last_epoch, stats)
    assert (stats["skipped_steps"] > 0) == (amp_dtype is FP16), stats
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.01 * 0.5 ** 5)


@pytest.mark.parametrize("device,amp_dtype", [
    ("cpu", BF16), ("cpu", None), pytest.param("cuda", FP16, marks=requires_cuda)])
def test_autocast_dtypes(device, amp_dtype):
    model, seen = nn.Sequential(nn.Linear(8, 8), nn.Unflatten(1, (1, 8)), nn.Conv1d(1, 4, 3),
                                nn.Flatten()).to(device), []
    for module in model[0], model[2]:
        module.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    criterion = lambda *a: seen.append(nn.functional.cross_entropy(*a)) or seen[-1]  # noqa: E731
    amp_train.train_epoch(model, [(torch.randn(2, 8), torch.tensor([0, 1]))],
                          torch.optim.SGD(model.parameters()), criterion,
                          amp_train.make_scaler(torch.device(device), amp_dtype), device, amp_dtype)
    low = amp_dtype or torch.float32
    assert seen[:2] == [low, low] and seen[2].dtype is torch.float32, seen
    assert model[0].weight.dtype is torch.float32, "the model stays fp32"


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_amp_matches_fp32(precision):
    # Measured: bf16 ends 1.0e-4 from fp32's loss, fp16 1.3e-5; the tolerance is ~10x.
    def fit(amp_dtype):
        model, optimizer, scaler = linear_setup("cpu", amp_dtype)
        for _ in range(100):
            stats = train(model, [linear_batch()], optimizer, scaler, amp_dtype)
        return model.weight, stats["loss"]
    (fp32, fp32_loss), (amp, amp_loss) = fit(None), fit(amp_train.PRECISIONS[precision])
    assert fp32_loss < 1.0 and abs(amp_loss - fp32_loss) < 1e-3, (fp32_loss, amp_loss)
    assert torch.allclose(amp, fp32, atol=3e-3), (amp, fp32)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
@pytest.mark.parametrize("kind", [{"foreach": False}, {"foreach": True}, {"fused": True}])
@pytest.mark.parametrize("make", [torch.optim.SGD, torch.optim.Adam])
def test_an_inf_step_is_skipped_and_counted(make, kind, device, monkeypatch):
    # A fused optimizer's kernel takes the inf check, so its step() always runs: this pins what
    # the private _found_inf_per_device gives, also for a model on two GPUs (found twice).
    (model, _, scaler), (reference, *_) = linear_setup(device, FP16), linear_setup(device)
    found = scaler._found_inf_per_device
    monkeypatch.setattr(scaler, "_found_inf_per_device",
                        lambda opt: dict(enumerate(list(found(opt).values()) * 2)))
    stats = train(model, [with_inf(linear_batch(8))], make(model.parameters(), lr=0.01, **kind),
                  scaler, FP16, device)
    assert torch.equal(model.weight, reference.weight), "the inf batch moved the weights"
    assert (stats["steps"], stats["skipped_steps"], stats["loss_scale"]) == (1, 1, 2.0**15)
    assert not math.isfinite(stats["loss"]), "the mean loss shows the inf"


def test_clipping_acts_on_unscaled_gradients():
    model, optimizer, scaler = linear_setup("cpu", FP16)
    seen = []  # the gradient norm as optimizer.step() sees it
    optimizer.register_step_pre_hook(lambda *_: seen.append(
        torch.stack([p.grad.norm() for p in model.parameters()]).norm().item()))
    stats = train(model, [linear_batch(16)], optimizer, scaler, FP16, clip_grad_norm=0.01)
    # Clipping the scaled gradients, then unscaling, would leave 0.01 / 2**16.
    assert stats["skipped_steps"] == 0 and seen == [pytest.approx(0.01, rel=1e-3)], seen


def test_loss_mean_and_max_steps():
    model = nn.Linear(1, 1, bias=False)
    nn.init.zeros_(model.weight)
    batches = [(torch.zeros(3, 1), torch.ones(3, 1)), (torch.zeros(1, 1), torch.full((1, 1), 3.))]
    stats = train(model, batches, torch.optim.SGD(model.parameters(), lr=0.0))
    assert stats["loss"] == pytest.approx((3 * 1 + 9) / 4) and stats["samples"] == 4, stats
    (x, y), seen, (model, optimizer, _) = linear_batch(24), [], linear_setup()
    stream = iter(zip(x.split(4), y.split(4)))
    model.register_forward_hook(lambda module, inputs, output: seen.append(inputs[0][0, 0]))
    for _ in range(3):  # max_steps counts optimizer steps
        assert train(model, stream, optimizer, max_steps=1, accum_steps=2)["steps"] == 1
    assert torch.stack(seen).tolist() == x[::4, 0].tolist(), "a batch skipped or seen twice"
    empty = train(model, stream, optimizer)
    assert empty["steps"] == empty["samples"] == 0 and math.isnan(empty["loss"]), empty


@pytest.mark.parametrize("wrap", [list, generator_of], ids=["list", "generator"])
def test_accumulation(wrap):
    big, big_optimizer, _ = linear_setup()
    train(big, split(32, 24, seed=3), big_optimizer)  # a batch of 24, then 8
    small, small_optimizer, _ = linear_setup()
    stats = train(small, wrap(split(32, 8, seed=3)), small_optimizer, accum_steps=3)
    assert (stats["steps"], stats["samples"]) == (2, 32), stats
    assert torch.allclose(small.weight, big.weight, atol=1e-6, rtol=0), "more than rounding"
    batch = linear_batch(8)
    model, optimizer, scaler = linear_setup("cpu", FP16)
    stats = train(model, [batch, with_inf(batch), batch, batch, batch], optimizer, scaler, FP16,
                  accum_steps=2)  # groups of 2, 2, 1: the first skipped
    assert (stats["steps"], stats["skipped_steps"], stats["samples"]) == (3, 1, 40), stats


def syncs(monkeypatch, steps, amp_dtype, optimizer, log_seconds=math.inf):
    """Counts the Python reads of a tensor's value (each waits for the device)."""
    model, count = nn.Linear(10, 1), [0]
    with monkeypatch.context() as patch:
        for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
            def counting(self, *args, _original=getattr(torch.Tensor, name), **kwargs):
                count[0] += 1
                return _original(self, *args, **kwargs)
            patch.setattr(torch.Tensor, name, counting)
        train(model, split(4, 4) * steps, optimizer(model, lr=0.01),
              amp_train.make_scaler(CPU, amp_dtype), amp_dtype, log_seconds=log_seconds)
    return count[0]


@pytest.mark.parametrize("amp_dtype,count", [(None, 1), (BF16, 1), (FP16, 2)])
def test_no_host_sync_per_step_and_progress_lines(amp_dtype, count, monkeypatch, capsys):
    # One at the end, and get_scale() with a scaler; the examples' fused SGD: none a step.
    fused = amp_train.make_optimizer
    assert [syncs(monkeypatch, n, amp_dtype, fused) for n in (1, 10)] == [count, count]
    assert syncs(monkeypatch, 10, amp_dtype, fused, log_seconds=0) == count + 10, "one a line"
    # With a plain SGD, scaler.step() reads found_inf every step.
    plain = lambda model, lr: torch.optim.SGD(model.parameters(), lr)  # noqa: E731
    assert syncs(monkeypatch, 10, FP16, plain) == 12
    capsys.readouterr()
    model, optimizer, _ = linear_setup()
    train(model, split(4, 4) * 3, optimizer, log_seconds=0)
    lines = re.findall(r"^  step (\d) \| loss [\d.]+ \| \d+ samples/s$", capsys.readouterr().out,
                       re.M)
    assert lines == ["1", "2", "3"], "a line once log_seconds have passed"


def test_evaluate():
    seen, ce, model = [], nn.CrossEntropyLoss(), nn.Linear(3, 3, bias=False)
    model.register_forward_hook(lambda m, i, o: seen.append((torch.is_inference_mode_enabled(),
                                                             m.training)))
    with torch.no_grad():
        model.weight.copy_(torch.eye(3) * 2)  # predicts the index of the largest input
    inputs, targets = torch.eye(3).repeat(2, 1), torch.tensor([0, 1, 2, 0, 2, 1])  # 4 of 6
    batches = [(inputs[:4], targets[:4]), (inputs[4:], targets[4:])]
    result = amp_train.evaluate(model, batches, ce, "cpu", None)
    assert result["accuracy"] == pytest.approx(4 / 6) and result["samples"] == 6, result
    assert result["loss"] == pytest.approx(ce(model(inputs), targets).item()), result
    assert seen[:2] == [(True, False)] * 2, f"(inference mode, training): {seen}"
    assert amp_train.evaluate(model, batches, ce, CPU, None, 1)["samples"] == 4, "max_steps"
    empty = amp_train.evaluate(model, [], ce, CPU, None)
    assert math.isnan(empty["loss"]) and math.isnan(empty["accuracy"]), empty
    model, x, y = nn.Linear(64, 8), torch.randn(32, 64), torch.arange(32) % 8
    fp32, bf16 = (amp_train.evaluate(model, [(x, y)], ce, CPU, t)["loss"] for t in (None, BF16))
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        assert bf16 == ce(model(x), y).item() != fp32, "evaluate must autocast"


def test_readmes_dict_batch_adapter():
    x, y = linear_batch(16)
    user = {"loader": [{"input_ids": x[i:i + 8], "labels": y[i:i + 8]} for i in (0, 8)]}
    exec(re.search(r"`(pairs = .*)`", README).group(1), user)
    assert train(nn.Linear(10, 1), user["pairs"], linear_setup()[1])["samples"] == 16


def not_enough():
    """README's "When train_epoch is not enough": each block run in a namespace of its own."""
    blocks = readme_blocks("## When train_epoch is not enough")
    assert len(blocks) == 3, "a custom Function, a gradient penalty, two models"
    spaces = [{"torch": torch} for _ in blocks]
    for block, space in zip(blocks, spaces):
        exec(compile(block, "README.md", "exec"), space)
    return spaces


def test_readmes_custom_function():
    function, optimizer = not_enough()[0]["MatMul"], torch.optim.SGD(nn.Linear(1, 1).parameters())

    class Model(nn.Linear):
        def forward(self, x):  # a bf16 activation and an fp32 weight meet in the Function
            return self.function.apply(super().forward(x), self.extra)
    model = Model(10, 4)
    model.function, model.extra = function, nn.Parameter(torch.randn(4, 1))
    stats = train(model, [linear_batch(8)], optimizer, amp_dtype=BF16)
    assert stats["steps"] == 1 and math.isfinite(stats["loss"]) and model.extra.grad is not None
    model.function = type("Plain", (torch.autograd.Function,), {  # undecorated
        key: staticmethod(getattr(function, key).__wrapped__) for key in ("forward", "backward")})
    with pytest.raises(RuntimeError, match="dtype"):
        train(model, [linear_batch(8)], optimizer, amp_dtype=BF16)


def test_readmes_gradient_penalty():
    batches = split(32, 8)
    model, optimizer, scaler = linear_setup("cpu", FP16)
    not_enough()[1]["train_epoch_with_penalty"](model, batches, optimizer, MSE, scaler, "cpu", FP16)
    reference, optimizer, scaler = linear_setup("cpu", FP16)
    for input, target in batches:  # the torch.amp examples page's loop, on "cpu"
        optimizer.zero_grad()
        with torch.autocast(device_type="cpu", dtype=torch.float16):
            loss = MSE(reference(input), target)
        scaled_grad_params = torch.autograd.grad(outputs=scaler.scale(loss),
                                                 inputs=reference.parameters(), create_graph=True)
        grad_params = [p * (1. / scaler.get_scale()) for p in scaled_grad_params]
        with torch.autocast(device_type="cpu", dtype=torch.float16):
            grad_norm = 0
            for grad in grad_params:
                grad_norm += grad.pow(2).sum()
            loss = loss + grad_norm.sqrt()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    assert torch.equal(model.weight, reference.weight), (model.weight, reference.weight)
    assert not torch.equal(model.weight, linear_setup()[0].weight), "it did not train"


def test_readmes_two_models():
    def setup():
        torch.manual_seed(1)
        models = nn.Linear(10, 1), nn.Linear(10, 1)
        return (*models, *(torch.optim.SGD(m.parameters(), lr=0.01) for m in models),
                torch.amp.GradScaler("cpu"))
    (model0, model1, optimizer0, optimizer1, scaler), batches = setup(), split(32, 8)
    not_enough()[2]["train_two_models"](model0, model1, optimizer0, optimizer1, batches, MSE,
                                        scaler, "cpu", FP16)
    ref0, ref1, optimizer0, optimizer1, scaler = setup()
    for input, target in batches:  # the torch.amp examples page's loop, on "cpu"
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


# ---------- device, precision, processes

def fake_cpu(monkeypatch, amx, avx512_bf16):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)


@pytest.mark.parametrize("amx,avx512,example,precision", [
    (0, 0, "linear", "fp32"), (0, 0, "resnet", "fp32"), (0, 0, "memory", "bf16"),
    (0, 1, "resnet", "bf16"), (1, 1, "linear", "bf16")])
def test_auto_uses_amp_where_it_gains(amx, avx512, example, precision, monkeypatch):
    flags = pathlib.Path("/proc/cpuinfo").read_text().split("\nflags")[1].split("\n")[0].split()
    expected = "AVX512-BF16" if "avx512_bf16" in flags else "none"
    assert amp_train.cpu_bf16() == ("AMX" if "amx_tile" in flags else expected), flags
    fake_cpu(monkeypatch, amx, avx512)
    assert amp_train.resolve_precision("auto", CPU, example) == precision
    assert amp_train.resolve_precision("auto", torch.device("cuda"), example) == "fp16"
    assert amp_train.resolve_precision("bf16", CPU, example) == "bf16", "bf16 can be forced"


@pytest.mark.parametrize("bf16,precision,says", [
    ("none", "auto", "note: this CPU has no bf16 instructions (AMX, AVX512-BF16)"),
    ("none", "bf16", "note: this CPU has no bf16"), ("AVX512-BF16", "auto", ""),
    ("AMX", "fp16", "warning: fp16 is very slow on CPUs")])
def test_header_says_what_amp_costs(bf16, precision, says, monkeypatch, capsys):
    fake_cpu(monkeypatch, bf16 == "AMX", bf16 != "none")
    ok(RESNET + ["--precision", precision, "--epochs", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert f"| device cpu (bf16: {bf16}) | precision " in lines[0], lines[0]
    assert len(lines) == 2 + bool(says) and lines[1].startswith(says or "epoch 1/1"), lines
    assert precision != "auto" or not says or "--precision bf16 forces it" in lines[1], lines


def fake_gpus(monkeypatch, count, bf16=True):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    current = []  # is_bf16_supported() asks the current GPU: it must be this process's
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    # A V100 or T4 "supports" bf16 by emulation only: that counts as no support.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: bf16 and len(current) == 1)
    return current


def test_device_choice(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert amp_train.resolve_device("auto") == CPU
    cuda = ["--example", "linear", "--device", "cuda", "--precision", "bf16"]
    assert "--device cpu" in run_bad(cuda, capsys), "no GPU"
    current, seen = fake_gpus(monkeypatch, 2), {}
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(amp_train, "run_training", lambda args, device, *rest: seen.update(
        device=device, benchmark=torch.backends.cudnn.benchmark, precision=args.precision) or 0)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    ok(cuda)
    assert seen == {"device": torch.device("cuda", 1), "benchmark": True, "precision": "bf16"}
    assert current == [1], current
    monkeypatch.setenv("LOCAL_RANK", "2")  # three processes would share two GPUs
    assert "has no GPU" in run_bad(cuda, capsys)
    fake_gpus(monkeypatch, 1, bf16=False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert "--precision fp16" in run_bad(cuda, capsys), "a GPU without bf16"


def torchrun_env(port, rank=0):
    return {"WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}


def test_processes_that_cannot_meet(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert "use torchrun" in run_bad(LINEAR, capsys), "RANK, MASTER_ADDR, MASTER_PORT missing"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        for key, value in torchrun_env(taken.getsockname()[1]).items():
            monkeypatch.setenv(key, value)
        assert "EADDRINUSE" in run_bad(LINEAR, capsys, status=3)
    monkeypatch.setattr(amp_train, "DIST_TIMEOUT", amp_train.datetime.timedelta(seconds=1))

    def alone(port):  # rank 1 never comes
        monkeypatch.setenv("MASTER_PORT", str(port))
        return run_bad(LINEAR, capsys, status=3)
    assert "1/2 clients joined" in retry_if_the_port_was_taken(alone)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_processes_meet(signum):
    def run(port):
        waiting = script(*LINEAR, **torchrun_env(port))  # rank 1 never comes
        for _ in range(600):  # until rank 0 waits for it
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        time.sleep(0.5)
        started = time.monotonic()
        waiting.send_signal(signum)
        err = waiting.communicate(timeout=30)[1]
        return waiting.returncode, err, time.monotonic() - started
    status, err, seconds = retry_if_the_port_was_taken(run)
    stop = f"error: stopped by {signal.Signals(signum).name}; {NOTHING}\n"
    assert (status, err) == (128 + signum, stop) and seconds < 5, (status, err, seconds)


def test_job_name_and_round_keys(monkeypatch):
    calls, dist = [], torch.distributed
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: calls.append((a, k)))
    for key, value in {**torchrun_env(1, rank=1), "TORCHELASTIC_RESTART_COUNT": "0"}.items():
        monkeypatch.setenv(key, value)

    def job(store, device=CPU):
        monkeypatch.setattr(dist, "rendezvous", lambda url, timeout: iter([(store, 1, 2)]))
        return amp_train.init_distributed(device)
    store = dist.HashStore()
    first = job(store, torch.device("cuda", 1))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    assert job(store) == first != job(dist.HashStore()), "a restart finds its job's name"
    timeout = amp_train.DIST_TIMEOUT
    assert [(a, k["device_id"], k["rank"], k["world_size"], k["timeout"]) for a, k in calls[:2]] \
        == [(("nccl",), torch.device("cuda", 1), 1, 2, timeout), (("gloo",), None, 1, 2, timeout)]
    calls[1][1]["store"].set("key", "value")
    assert store.get("round3/key") == b"value", "a round read the last round's keys"


def ddp_worker(rank, argv, out_dir, port):
    """One of two processes, as torchrun starts them: saves what main() did."""
    os.environ.update(torchrun_env(port, rank))
    torch.set_num_threads(1)
    amp_train.resnet18 = small_model  # DDP works alike on 256 images: 10,000 take seconds
    amp_train.synthetic_cifar10 = lambda size, seed, train=True: cached_synthetic_cifar10(
        256, seed, train)
    built, build_example = [], amp_train.build_example
    amp_train.build_example = lambda *a, **k: built.append(build_example(*a, **k)) or built[-1]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = amp_train.main(argv)
    torch.save({"code": code, "left": not torch.distributed.is_initialized(), "out": out.getvalue(),
                "err": err.getvalue(), "state": built[0][0].state_dict() if built else {}},
               out_dir / f"rank{rank}.pt")


def run_two_processes(argv, out_dir):
    def run(port):
        torch.multiprocessing.spawn(ddp_worker, args=(argv, out_dir, port), nprocs=2)
        return [load(out_dir / f"rank{r}.pt") for r in range(2)]
    rank0, rank1 = retry_if_the_port_was_taken(run)
    assert rank0["code"] == rank1["code"] == 0 and rank0["left"] and rank1["left"], rank0["err"]
    assert rank1["out"] == rank1["err"] == "", "rank 1 logged"
    for name, tensor in rank0["state"].items():  # weights, and BatchNorm's statistics tested
        assert torch.equal(tensor, rank1["state"][name]), f"{name} differs between ranks"
    return rank0


def group_worker(rank, out_dir, port):
    """Trains on micro-batches of 4 in a 2-process gloo group, K = 4: a group of 4 and a
    short one of 2; saves what it saw."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    os.environ.update(torchrun_env(port, rank))
    torch.distributed.init_process_group("gloo")
    model, optimizer, _ = linear_setup(lr=0.1)
    ddp, all_reduces = nn.parallel.DistributedDataParallel(model), []
    ddp.register_comm_hook(None, lambda _, bucket: all_reduces.append(1) or allreduce_hook(
        None, bucket))
    stats = train(ddp, generator_of(split(24, 4, seed=rank)), optimizer, accum_steps=4)
    torch.save((len(all_reduces), stats["steps"], model.weight), out_dir / f"result{rank}.pt")
    torch.distributed.destroy_process_group()


def test_ddp_accumulation(tmp_path):
    def run(port):
        try:
            torch.multiprocessing.spawn(group_worker, args=(tmp_path, port), nprocs=2)
        except torch.multiprocessing.ProcessRaisedException as e:
            return e
        return [load(tmp_path / f"result{r}.pt") for r in range(2)]
    ranks = retry_if_the_port_was_taken(run)
    r0, r1 = split(24, 4, seed=0), split(24, 4, seed=1)  # one process: both ranks' batches
    model, optimizer, _ = linear_setup(lr=0.1)
    train(model, r0[:4] + r1[:4], optimizer, accum_steps=8)
    train(model, r0[4:] + r1[4:], optimizer, accum_steps=4)
    for all_reduces, steps, weight in ranks:
        assert (all_reduces, steps) == (2, 2) and torch.allclose(weight, model.weight, atol=1e-6)


def test_resume_on_another_process_count(tmp_path):
    run = LINEAR + ["--precision", "fp32", "--run-dir", str(tmp_path / "run")]
    ok(run + ["--epochs", "1"])
    out = run_two_processes(run + ["--epochs", "2", "--resume"], tmp_path)["out"]
    assert "| batch 128 | accum 1 | processes 2 |" in out, "linear's batch is shared out"
    ok(run + ["--epochs", "3", "--resume"])
    ok(LINEAR + ["--precision", "fp32", "--epochs", "3", "--run-dir", str(tmp_path / "alone")])
    mixed, alone = (read_metrics(tmp_path / name / "metrics.jsonl") for name in ("run", "alone"))
    assert [r["processes"] for r in mixed] == [1, 2, 1], mixed
    assert [r["train_loss"] for r in mixed] == pytest.approx([r["train_loss"] for r in alone])
    run = RESNET + ["--max-steps", "1", "--run-dir", str(tmp_path / "resnet")]
    ok(run + ["--epochs", "1"])
    rank0 = run_two_processes(run + ["--epochs", "2", "--resume"], tmp_path)
    assert "1.running_mean" in rank0["state"] and "epoch 2/2" in rank0["out"], rank0


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
sys.exit(amp_train.main(sys.argv[1:]))
"""


def test_a_dead_peer_ends_the_survivor(tmp_path):
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


def torchrun(tmp_path, *argv, script=SCRIPT, max_restarts=0, rendezvous=("--standalone",)):
    command = [sys.executable, "-m", "torch.distributed.run", *rendezvous, "--nproc_per_node=2",
               f"--max-restarts={max_restarts}", script, "--device", "cpu", *argv]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, cwd=tmp_path, start_new_session=True)
    try:
        out, err = process.communicate(timeout=120)
        return subprocess.CompletedProcess(command, process.returncode, out, err)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # torchrun and its workers: leave none
        raise


def test_torchrun_restarts_go_on_and_a_new_job_takes_nothing(tmp_path):
    # kill -9 in round 0, after epoch 1's metrics, before its checkpoint: round 1 goes on,
    # without --resume, from its job's checkpoint of epoch 0, the metrics rewritten.
    (tmp_path / "dies.py").write_text(DIES.format(here=str(HERE), name="replace_file", when=(
        "os.environ['TORCHELASTIC_RESTART_COUNT'] == '0' and len(calls) == 4")))
    argv = ["--example", "linear", "--precision", "fp32", "--epochs", "4", "--run-dir", "run"]
    done = torchrun(tmp_path, *argv, script=str(tmp_path / "dies.py"), max_restarts=1)
    assert done.returncode == 0 and done.stderr.count("exitcode: -9") == 1, done.stderr
    assert len(re.findall(r"^epoch 1/4 ", done.stdout, re.M)) == 2, done.stdout
    assert re.search(r"^resumed from run after epoch 0$", done.stdout, re.M), done.stdout
    assert [r["epoch"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3, 4]
    ok(LINEAR + ["--precision", "fp32", "--epochs", "4", "--run-dir", str(tmp_path / "a")])
    restarted, alone = (load(tmp_path / name / "checkpoint.pt")["model"] for name in ("run", "a"))
    assert all(torch.allclose(restarted[k], alone[k], atol=1e-6) for k in alone), restarted
    # Static rendezvous names every job "none": the name comes from torchrun's store.
    before = files_of(tmp_path / "run")
    second = retry_if_the_port_was_taken(lambda port: torchrun(
        tmp_path, *argv[:-3], "6", "--run-dir", "run", rendezvous=("--master-port", str(port))))
    assert second.stderr.count("holds a checkpoint: add --resume") == 2, second.stderr
    assert re.search(r"exitcode *: 2 ", second.stderr), second.stderr
    assert 'amp_train.py", line' not in second.stderr, "a worker ended in a traceback"
    assert files_of(tmp_path / "run") == before, "the other job's files changed"


# ---------- models and data

def zero_gradient_share(model):
    nn.functional.cross_entropy(model(torch.randn(8, 3, 32, 32)), torch.arange(8)).backward()
    zeros = sum((p.grad == 0).sum() for p in model.parameters())
    return zeros.item() / sum(p.numel() for p in model.parameters())


def test_resnet18_cifar_stem(resnet18):
    torch.manual_seed(0)
    model = amp_train.build_example(amp_train.parse_args(RESNET), CPU)[0]
    assert model.conv1.kernel_size == (3, 3) and isinstance(model.maxpool, nn.Identity)
    assert model.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    assert zero_gradient_share(model) < 0.01, "over 1% of the weights got no gradient"
    # The post's ImageNet stem: README's 62% of the weights without a gradient.
    assert 0.60 < zero_gradient_share(amp_train.resnet18(imagenet_stem=True)) < 0.65


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


def test_cifar10(tmp_path, monkeypatch, spy, capsys):
    import torchvision.datasets.cifar as cifar
    write_tiny_cifar10(tmp_path)
    monkeypatch.setattr(cifar, "check_integrity", lambda *a, **k: True)
    args = amp_train.parse_args(["--data-root", str(tmp_path), "--batch-size", "5"])
    _, _, train_loader, test_loader = amp_train.build_example(args, CPU)
    images, labels = next(iter(test_loader))
    mean, std = torch.tensor(amp_train.CIFAR10_MEAN), torch.tensor(amp_train.CIFAR10_STD)
    expected = ((torch.tensor([10.0, 11.0]) / 255)[:, None] - mean) / std  # test_batch: 10, 11
    assert labels.tolist() == [0, 1] and torch.allclose(images[:, :, 5, 5], expected, atol=1e-6)
    assert sorted(int(y) for _, batch in train_loader for y in batch) == list(range(10))
    ok(RESNET[:4] + ["--epochs", "1", "--batch-size", "2", "--data-root", str(tmp_path)])
    assert "data cifar10" in capsys.readouterr().out
    images = torch.cat([x for x, _ in spy[0]["batches"]])  # flat, but the crops' padding
    flat = (images == images.amax((2, 3), True)) | (images == images.amin((2, 3), True))
    assert flat.all(), "these are not the images of --data-root"
    monkeypatch.setattr(cifar, "download_and_extract_archive",
                        raising(urllib.error.URLError("no network")))
    err = run_bad(["--device", "cpu", "--data-root", str(tmp_path / "data")], capsys)
    assert "nor online: put cifar-10-python.tar.gz there, or use --data synthetic" in err, err


def shuffled(n, batch_size, epoch=0, **kwargs):
    loader = amp_train.DeviceLoader(torch.arange(n), torch.arange(n), batch_size, CPU, **kwargs)
    loader.epoch = epoch
    return [targets.tolist() for _, targets in loader], len(loader)


@pytest.mark.parametrize("shuffle", [True, False])
def test_order_and_shards(shuffle):
    shards = [shuffled(23, 4, 5, shuffle=shuffle, rank=r, world_size=3) for r in range(3)]
    assert all(len(batches) == length for batches, length in shards), "len() counts batches"
    seen = [i for batches, _ in shards for batch in batches for i in batch]
    assert len(seen) == len(set(seen)), f"a sample went to two processes: {shards}"
    if shuffle:  # equal shards of whole batches (BatchNorm needs 2+): as many steps each
        assert {len(batches) * len(batches[0]) for batches, _ in shards} == {4}, shards
    else:  # testing: every sample once
        assert sorted(seen) == list(range(23)), shards
    order = functools.partial(shuffled, 32, 8, shuffle=shuffle)
    assert order(1)[0] == order(1)[0] and (order(1) != order(2)) == shuffle, "(seed, epoch)"
    assert (order(1, seed=0) != order(1, seed=1)) == shuffle, "another seed, another order"


def test_batches_that_cannot_be():
    args = amp_train.parse_args(LINEAR + ["--batch-size", "5"])
    with pytest.raises(amp_train.UsageError, match="does not share out evenly among 2"):
        amp_train.build_example(args, CPU, rank=1, world_size=2)
    args = amp_train.parse_args(RESNET + ["--batch-size", "2048"])
    with pytest.raises(amp_train.UsageError, match="more than each process's 1250 training"):
        amp_train.build_example(args, CPU, rank=7, world_size=8)


def test_crops_and_flips():
    import torchvision.transforms.v2.functional as TF
    images = torch.randint(0, 256, (64, 3, 32, 32), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(0))
    out = amp_train.random_crop_flip(images, torch.Generator().manual_seed(1))
    windows = []
    for image, augmented in zip(images, out):  # torchvision's pad, crop and flip
        padded, flip = TF.pad(image, [4]), {False: lambda t: t, True: TF.horizontal_flip}
        windows.append(next(((dy, dx, m) for dy in range(9) for dx in range(9) for m in flip
                             if torch.equal(flip[m](TF.crop(padded, dy, dx, 32, 32)), augmented)),
                            None))
    assert None not in windows, f"image {windows.index(None)} is no window of its own"
    assert {dy for dy, _, _ in windows} == set(range(9)) == {dx for _, dx, _ in windows}
    assert {m for _, _, m in windows} == {False, True}, windows
    augment = amp_train.cifar10_transform(CPU, True)
    crops = [next(iter(amp_train.DeviceLoader(images[:1].repeat(16, 1, 1, 1), torch.zeros(16), 8,
                                              CPU, augment, True, rank=r, world_size=2)))[0]
             for r in (0, 1)]
    assert not torch.equal(*crops), "two processes cropped alike"


# ---------- the run folder

def grows(device, amp_dtype):  # 16, 32, 64...: a scale not restored shows
    return torch.amp.GradScaler(device.type, 16.0, growth_interval=1, enabled=amp_dtype is FP16)


def untimed(path):
    return [{k: v for k, v in r.items() if "second" not in k} for r in read_metrics(path)]


@pytest.mark.parametrize("example,epochs,split", [(RESNET, 3, 2), (LINEAR_FP16, 6, 3)])
def test_resume_is_bit_identical(example, epochs, split, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(amp_train, "make_scaler", grows)
    a, b = tmp_path / "a", tmp_path / "b"
    ok(example + ["--epochs", str(epochs), "--run-dir", str(a)])
    ok(example + ["--epochs", str(split), "--run-dir", str(b)])
    with open(b / "metrics.jsonl", "a") as f:  # a later epoch, torn, foreign: the checkpoint's win
        f.write('{"example": "linear", "epoch": 3}\n{"example": "lin\n[1, 2]\n{"epoch": NaN}\n')
    ok(example + ["--epochs", str(epochs), "--run-dir", str(b), "--resume"])
    assert f"resumed from {b} after epoch {split}" in capsys.readouterr().out
    a_state, b_state = load(a / "checkpoint.pt"), load(b / "checkpoint.pt")
    assert a_state["loss_scale"] == (1024.0 if example is LINEAR_FP16 else 1.0), a_state
    for key in ("epoch", "optimizer", "loss_scale", "growth_tracker"):
        assert a_state[key] == b_state[key], key
    assert all(torch.equal(a_state["model"][k], b_state["model"][k]) for k in a_state["model"])
    assert untimed(a / "metrics.jsonl") == untimed(b / "metrics.jsonl")


def test_checkpoint_writes(tmp_path, monkeypatch):
    calls, fsync, replace = [], os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append("fsync") or fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: calls.append(b[-3:]) or replace(a, b))
    ok(LINEAR_FP16 + ["--epochs", "2", "--run-dir", str(tmp_path)])
    state = load(tmp_path / "checkpoint.pt")  # raises on all but tensors and plain types
    assert (state["epoch"], state["loss_scale"], state["args"]["precision"]) == (2, 65536.0, "fp16")
    assert calls == ["fsync", "onl", "fsync", ".pt"] * 3, "before epoch 1, then after each"
    assert sorted(files_of(tmp_path)) == ["checkpoint.pt", "metrics.jsonl"], "nothing else"


def wrapped(error):
    """What torch.save raised on a full tmpfs: the error, in its zip writer's RuntimeError."""
    outer = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos")
    outer.__context__ = error
    return outer


@pytest.mark.parametrize("error,status,says", [
    (OSError(28, "No space left on device"), 2, "No space left on device"),
    (wrapped(OSError(28, "No space left on device")), 2, "No space left on device"),
    (OSError(1, "Operation not permitted"), 2, "not permitted"), (KeyboardInterrupt(), 0, ""),
    (wrapped(amp_train.Stopped(signal.SIGTERM)), 143, "stopped by SIGTERM")])
def test_a_failed_save(error, status, says, tmp_path, monkeypatch, capsys):
    ok(LINEAR_FP16 + ["--epochs", "1", "--run-dir", str(tmp_path)])
    before = files_of(tmp_path)

    def disk_full(obj, f):
        f.write(b"half a checkpoint")
        raise error
    monkeypatch.setattr(amp_train.torch, "save", disk_full)
    argv = LINEAR_FP16 + ["--epochs", "3", "--run-dir", str(tmp_path), "--resume"]
    with pytest.raises(KeyboardInterrupt) if status == 0 else contextlib.nullcontext():
        err = run_bad(argv, capsys, status)  # a plain KeyboardInterrupt (pytest's) passes
        assert says in err and err.endswith(f"{tmp_path} holds epoch 1\n"), err
        assert "epoch 2/3" not in capsys.readouterr().out, "it failed before training"
    assert files_of(tmp_path) == before and not list(tmp_path.glob("*.tmp")), "a file changed"


def edited(**fields):
    """A linear run's checkpoint with fields set (None removes); "args__seed" sets args'."""
    def make(path):
        ok(LINEAR_FP16 + ["--epochs", "1", "--run-dir", str(path.parent)])
        state = load(path)
        for key, value in fields.items():
            where, _, key = key.rpartition("__")
            where = state[where] if where else state
            where.pop(key) if value is None else where.__setitem__(key, value)
        torch.save(state, path, **state.pop("save", {}))
    return make


def nested(depth, reused=1):  # reused: [[x, x], [x, x]]: 2**depth in a few bytes
    return functools.reduce(lambda inner, _: [inner] * reused, range(depth), [])


def zip_bomb(path):  # 10 MB of zeros, deflated; the test allows 1 MB
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as f:
        f.writestr("archive/data/0", bytes(10 * 2**20))


class CreatesAFile:
    """Unpickled, this creates a file, as a malicious checkpoint could."""
    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path("pwned"),)


def weight(value, dtype=torch.float32):
    return {"model": {"weight": torch.full((1, 10), value, dtype=dtype), "bias": torch.zeros(1)}}


DAMAGED = [  # each makes one this program never wrote
    {"metrics": nested(400)}, {"metrics": [nested(60, 2)]}, {"args__lr": nested(60, 2)},
    {"metrics": ["\ud800\n"]}, {"metrics": ["x" * 600_000] * 2, "epoch": 2},
    {"model": dict.fromkeys(map(str, range(99)), torch.zeros(10**4))}, {"format": "4"},
    {"epoch": math.inf}, {"epoch": 0}, {"epoch": True}, {"loss_scale": "65536"},
    {"loss_scale": 1e-300}, {"growth_tracker": 2000}, weight(math.nan),
    weight(0.0, torch.float64), weight(math.inf, torch.complex64)]


@pytest.mark.parametrize("make,says", [
    (lambda path: torch.save({"x": CreatesAFile()}, path), "UnpicklingError"),
    (lambda path: (edited()(path), path.write_bytes(path.read_bytes()[:200])), "BadZipFile"),
    (edited(save={"_use_new_zipfile_serialization": False}), "BadZipFile"),
    (zip_bomb, "unpacks to too much"), (lambda path: path.write_bytes(bytes(2**20 + 1)), "no file"),
    *((edited(**fields), "not a checkpoint") for fields in DAMAGED),
    (edited(model=None), "KeyError"),
    (edited(args__lr=-1), "refused"), (edited(args={"lr": 0.01}), "flags are refused"),
    (edited(model={"weight": torch.zeros(3)}), "not fit"),
    # Momentum of 3 for a weight of 10: loading it once corrupted memory (SIGABRT).
    (edited(optimizer={0: {"momentum_buffer": torch.zeros(3)}}), "not fit"),
    (edited(optimizer={0: "x"}), "TypeError"),
    (edited(optimizer={"a": {"momentum_buffer": torch.zeros(1)}}), "not fit")])
def test_a_bad_checkpoint(make, says, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    make(tmp_path / "checkpoint.pt")
    monkeypatch.setattr(amp_train, "MAX_CHECKPOINT_BYTES", 2**20)
    capsys.readouterr()
    before = files_of(tmp_path)
    err = run_bad(LINEAR_FP16 + ["--epochs", "2", "--run-dir", str(tmp_path), "--resume"], capsys)
    assert says in err and files_of(tmp_path) == before, err  # and no pwned file


def link(path):
    (path.parent / "precious.txt").write_text("work")
    path.symlink_to(path.parent / "precious.txt")


@pytest.mark.parametrize("name,make,says", [
    ("metrics.jsonl", os.mkfifo, "no file this program wrote"), ("checkpoint.pt", os.mkfifo, "no"),
    ("checkpoint.pt", link, "cannot read"), ("checkpoint.pt.tmp", os.mkdir, "directory"),
    ("metrics.jsonl.tmp", os.mkdir, "directory"),
    ("file", pathlib.Path.touch, "File exists"), ("x" * 300, None, "too long")])
def test_what_stands_in_the_folder(name, make, says, tmp_path, capsys):
    folder = tmp_path / name if make in (pathlib.Path.touch, None) else tmp_path
    if make:
        make(tmp_path / name)
    before = {p.name: p.lstat().st_mode for p in tmp_path.iterdir()}
    err = run_bad(LINEAR + ["--epochs", "1", "--run-dir", str(folder)], capsys)
    assert says in err and "epoch 1/1" not in capsys.readouterr().out, err
    assert {p.name: p.lstat().st_mode for p in tmp_path.iterdir() if p.name in before} == before
    assert make is not link or (tmp_path / "precious.txt").read_text() == "work"


@pytest.mark.parametrize("name", ["checkpoint.pt.tmp", "metrics.jsonl.tmp"])
@pytest.mark.parametrize("make", [link, os.mkfifo])
def test_links_and_fifos_at_tmp_names(name, make, tmp_path, monkeypatch):
    make(tmp_path / name)  # a FIFO opened for writing would block for good
    for argv in ([], ["--resume"]):
        ok(LINEAR + ["--epochs", str(1 + len(argv)), "--run-dir", str(tmp_path), *argv])
    assert make is os.mkfifo or (tmp_path / "precious.txt").read_text() == "work"
    assert load(tmp_path / "checkpoint.pt")["epoch"] == 2
    assert not any(p.is_symlink() for p in tmp_path.iterdir()), "a link is still there"
    link(tmp_path / "metrics.jsonl.tmp")
    monkeypatch.setattr(os, "unlink", lambda path: None)  # the link came back: a race
    with pytest.raises(FileExistsError):
        amp_train.replace_file(str(tmp_path / "metrics.jsonl"), lambda f: f.write(b"lines"))
    assert (tmp_path / "precious.txt").read_text() == "work", "a link was written through"


def test_one_run_owns_its_folder(tmp_path, capsys):
    import fcntl
    run = LINEAR + ["--run-dir", str(tmp_path)]
    ok(run + ["--epochs", "2"])
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    ok(run + ["--epochs", "2", "--resume"])
    assert "nothing to do: the checkpoint has 2 epochs" in capsys.readouterr().out
    assert "add --resume" in run_bad(run + ["--epochs", "3"], capsys), "it would overwrite"
    live = os.open(tmp_path, os.O_RDONLY)  # the lock a live run holds: flock on the folder
    try:
        fcntl.flock(live, fcntl.LOCK_EX)
        for argv in ([], ["--resume"]):
            assert "another run is using" in run_bad(run + argv, capsys)
    finally:
        os.close(live)  # as the kernel does when the live run dies
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == before, "it wrote"
    typo = LINEAR + ["--run-dir", str(tmp_path / "typo"), "--resume"]
    assert "No such file" in run_bad(typo, capsys) and not (tmp_path / "typo").exists()
    (tmp_path / "checkpoint.pt").unlink()  # metrics, someone's or a lost run's, stay
    err = run_bad(run + ["--epochs", "2"], capsys)
    assert err.endswith(f"no checkpoint: delete {tmp_path / 'metrics.jsonl'}\n"), err
    assert "run without --resume" in run_bad(run + ["--resume"], capsys)
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 2, "the metrics changed"


def test_flags_on_resume(tmp_path, capsys):
    run = LINEAR + ["--run-dir", str(tmp_path)]
    ok(run + ["--epochs", "3", "--lr", "5e-324", "--batch-size", "16", "--precision", "fp32",
              "--clip-grad-norm", "1", "--max-steps", "5"])
    ok(run[:2] + run[4:] + ["--epochs", "4", "--resume"])  # and the example
    out = capsys.readouterr().out
    assert "note:" not in out and "| lr 4.941e-324 |" in out, out
    assert "example linear" in out and "precision fp32" in out, out
    saved = load(tmp_path / "checkpoint.pt")["args"]
    assert (saved["batch_size"], saved["clip_grad_norm"], saved["max_steps"]) == (16, 1.0, 5)
    ok(run + ["--epochs", "5", "--resume", "--clip-grad-norm", "0", "--max-steps", "0",
              "--lr", "0.05"])
    out = capsys.readouterr().out
    assert "note: --clip-grad-norm 0.0 replaces the checkpoint's 1.0" in out, out
    assert "note: --lr 0.05 replaces the checkpoint's 5e-324" in out and lrs_of(out)[-1] == 0.05
    saved = load(tmp_path / "checkpoint.pt")["args"]
    assert (saved["clip_grad_norm"], saved["max_steps"]) == (0.0, 0), "a limit can go"
    run = RESNET + ["--max-steps", "1", "--run-dir", str(tmp_path / "resnet")]
    ok(run + ["--epochs", "1"])
    ok(run + ["--epochs", "2", "--resume", "--batch-size", "2", "--precision", "fp32"])
    out = capsys.readouterr().out
    assert "note: --batch-size 2 replaces the checkpoint's 4" in out and "--precision" not in out
    before = files_of(tmp_path / "resnet")
    err = run_bad(run + ["--epochs", "3", "--resume", "--data", "cifar10"], capsys)
    assert "trained on --data synthetic" in err and files_of(tmp_path / "resnet") == before, err


@pytest.mark.parametrize("first,then", [("fp16", "bf16"), ("bf16", "fp16"), ("fp16", "fp32")])
def test_resume_in_another_precision(first, then, tmp_path, capsys):
    run = LINEAR + ["--run-dir", str(tmp_path)]
    ok(run + ["--precision", first, "--epochs", "2"])
    ok(run + ["--precision", then, "--epochs", "4", "--resume"])
    out = capsys.readouterr().out
    assert f"note: --precision {then} replaces the checkpoint's {first}" in out, out
    assert re.findall(r"scale (\d+)", out)[2:] == ["65536" if then == "fp16" else "1"] * 2, out


# ---------- the training examples

@pytest.fixture
def spy(monkeypatch):
    """Records each train_epoch call: its batches, kwargs, output dtypes, first weight
    before, and the gradient norm each step saw."""
    calls, real = [], amp_train.train_epoch

    def recording(model, loader, optimizer, *args, **kwargs):
        call = {"batches": [], "kwargs": kwargs, "dtypes": set(), "norms": [], "model": model,
                "weight": next(model.parameters()).detach().clone()}
        hooks = [model.register_forward_hook(lambda m, i, out: call["dtypes"].add(out.dtype)),
                 optimizer.register_step_pre_hook(lambda *_: call["norms"].append(
                     torch.stack([p.grad.norm() for p in model.parameters()]).norm().item()))]
        loader = (call["batches"].append((x.clone(), y.clone())) or (x, y) for x, y in loader)
        call["stats"] = real(model, loader, optimizer, *args, **kwargs)
        for hook in hooks:
            hook.remove()
        calls.append(call)
        return call["stats"]
    monkeypatch.setattr(amp_train, "train_epoch", recording)
    return calls


@pytest.mark.parametrize("precision,dtype,scale", [
    ("fp32", torch.float32, "1"), ("bf16", BF16, "1"), ("fp16", FP16, "65536")])
def test_example_linear_and_precision(precision, dtype, scale, spy, capsys):
    ok(LINEAR + ["--epochs", "20", "--precision", precision])
    out = capsys.readouterr().out
    losses = re.findall(r"^epoch +\d+/20 \| train loss ([\d.]+)", out, re.M)
    assert len(losses) == 20 == len(spy) and float(losses[-1]) < float(losses[0]) - 0.1, losses
    assert [len(c["batches"]) for c in spy] == [1] * 20, "one fixed batch"
    assert spy[0]["batches"][0][0].shape == (128, 10) and spy[0]["dtypes"] == {dtype}
    assert f"| scale {scale} |" in out, out


def test_example_resnet(spy, capsys):
    ok(RESNET + ["--epochs", "2", "--lr", "0.05"])
    out = capsys.readouterr().out
    line = (r"^epoch 2/2 \| train loss [\d.]+ \| test loss [\d.]+ \| test acc +[\d.]+% \| "
            r"lr 0\.05 \| scale 1 \| skipped 0 \| \d+ samples/s \| [\d.]+ s$")
    assert re.search(line, out, re.M) and "| data synthetic | batch 4 |" in out, out
    assert [c["kwargs"]["log_seconds"] for c in spy] == [amp_train.PROGRESS_SECONDS] * 2
    assert 0 < amp_train.PROGRESS_SECONDS <= 25, "a line within 30 s"


def test_training_flags(monkeypatch, spy, capsys):
    for argv in (LINEAR, RESNET):
        ok(argv + ["--epochs", "3", "--batch-size", "6"])
    assert len(spy) == 6 and {len(y) for c in spy for _, y in c["batches"]} == {6}
    for lr in ("0.01", "0.04"):
        ok(LINEAR + ["--epochs", "1", "--precision", "fp32", "--lr", lr])
    moves = [(next(c["model"].parameters()) - c["weight"]).abs().sum().item() for c in spy[-2:]]
    assert moves[1] == pytest.approx(4 * moves[0], rel=1e-4), moves
    tested, evaluate = [], amp_train.evaluate
    monkeypatch.setattr(amp_train, "evaluate", lambda *a: tested.append(a[-1]) or evaluate(*a))
    ok(RESNET + ["--epochs", "1", "--max-steps", "3", "--accum-steps", "2"])
    assert (len(spy[-1]["batches"]), len(spy[-1]["norms"]), tested) == (6, 3, [3]), "steps"
    assert "| batch 4 | accum 2 |" in capsys.readouterr().out
    ok(LINEAR + ["--epochs", "1", "--max-steps", "0"])
    assert spy[-1]["kwargs"]["max_steps"] is None, "0: no limit"
    for clip in ("0", "0.5"):
        ok(LINEAR + ["--epochs", "3", "--precision", "bf16", "--clip-grad-norm", clip])
    assert min(spy[-4]["norms"]) > 0.5, "the norm is ~1 unclipped"
    assert [n for c in spy[-3:] for n in c["norms"]] == pytest.approx([0.5] * 3, rel=1e-3)


def test_seed_flag_and_reshuffles(spy, capsys):
    for seed in ("0", "0", "1"):
        ok(RESNET + ["--epochs", "2", "--max-steps", "1", "--seed", seed])
    first = [spy[i]["batches"][0][0] for i in (0, 2, 4)]
    assert torch.equal(spy[0]["weight"], spy[2]["weight"]) and torch.equal(first[0], first[1])
    assert not torch.equal(spy[0]["weight"], spy[4]["weight"]) and not torch.equal(*first[::2])
    assert not torch.equal(spy[0]["batches"][0][1], spy[1]["batches"][0][1]), "epochs alike"
    plain = amp_train.DeviceLoader(*amp_train.synthetic_cifar10(10_000), 4, CPU,
                                   amp_train.cifar10_transform(CPU, False), shuffle=True)
    assert not torch.equal(first[0], next(iter(plain))[0]), "not cropped"


def test_lr_schedule(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(amp_train, "LR_STEP_EPOCHS", 2)
    run = RESNET + ["--max-steps", "1", "--run-dir", str(tmp_path)]
    ok(run + ["--epochs", "3"])
    ok(run + ["--epochs", "5", "--resume", "--lr", "0.5"])
    assert lrs_of(capsys.readouterr().out) == pytest.approx([0.01, 0.01, 0.001, 0.05, 0.005])
    assert load(tmp_path / "checkpoint.pt")["args"]["lr"] == 0.5, "the lr now in use"
    ok(LINEAR + ["--epochs", "3"])
    assert lrs_of(capsys.readouterr().out) == [0.01] * 3, "the post's linear has no schedule"


def test_a_diverged_run_stops(tmp_path, capsys):
    argv = LINEAR + ["--precision", "fp32", "--lr", "1e20", "--epochs", "5", "--run-dir"]
    assert amp_train.main(argv + [str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert re.fullmatch(rf"error: epoch 2: the model's \w+ holds inf/NaN; "
                        rf"{re.escape(str(tmp_path))} holds epoch 1; lower --lr\n", err), err
    assert "Infinity" not in (tmp_path / "metrics.jsonl").read_text(), "JSON has no inf"
    assert [r["train_loss"] for r in read_metrics(tmp_path / "metrics.jsonl")][1:] == [None]
    assert load(tmp_path / "checkpoint.pt")["epoch"] == 1


def test_a_nan_test_loss_is_not_saved(tmp_path, monkeypatch, capsys):
    evaluate, calls = amp_train.evaluate, []
    monkeypatch.setattr(amp_train, "evaluate", lambda *args: calls.append(1) or {
        **evaluate(*args), "loss": math.nan if len(calls) == 1 else 1.0})
    ok(RESNET + ["--epochs", "2", "--run-dir", str(tmp_path)])
    assert f"epoch 1 is not saved, its mean train or test loss is inf/NaN; {tmp_path} holds " \
           "epoch 0" in capsys.readouterr().out
    assert load(tmp_path / "checkpoint.pt")["epoch"] == 2


def test_nan_batchnorm_statistics_stop(monkeypatch, tmp_path, capsys):
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


def test_a_scale_that_collapses_stops(monkeypatch, capsys):
    monkeypatch.setattr(amp_train, "make_scaler", lambda device, dtype: torch.amp.GradScaler(
        device.type, growth_interval=1))
    assert amp_train.main(LINEAR_FP16 + ["--epochs", "100", "--lr", "1e38"]) == 1
    err = capsys.readouterr().err
    assert re.search(r"epoch \d+: the loss scale fell to 7\.6\d*e-06: inf/NaN gradients", err)


# ---------- the memory example

@pytest.mark.parametrize("amp_dtype,activation_bytes,weight_copy_bytes", [
    (None, 2 * 4 * 4, 0),            # x, 8 floats; the weight is not counted
    (BF16, 2 * 4 * 2, 3 * 4 * 2)])   # bf16 copies of x and of the weight
def test_count_saved_tensors(amp_dtype, activation_bytes, weight_copy_bytes):
    model = nn.Linear(4, 3, bias=False)
    with amp_train.count_saved_tensors(model) as saved:
        with torch.autocast("cpu", dtype=amp_dtype, enabled=amp_dtype is not None):
            model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert saved == {"activation_bytes": activation_bytes, "weight_copy_bytes": weight_copy_bytes}


def test_autocast_halves_activations():
    batch = (torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,)))
    fp32, bf16 = (amp_train.measure_training(small_model(), batch, nn.CrossEntropyLoss(), CPU,
                                             dtype, steps=3) for dtype in (None, BF16))
    assert bf16["activation_bytes"] / fp32["activation_bytes"] < 0.6, (bf16, fp32)
    assert fp32["weight_copy_bytes"] == 0 < bf16["weight_copy_bytes"] and "peak_bytes" not in bf16
    assert 0 < bf16["step_seconds_min"] <= bf16["step_seconds"] <= bf16["step_seconds_max"]


def test_memory_example(monkeypatch, capsys):
    seen, measure = [], amp_train.measure_training
    monkeypatch.setattr(amp_train, "measure_training", lambda *args: seen.append(
        capsys.readouterr().out) or measure(*args))  # what was printed before each
    ok(["--device", "cpu", "--example", "memory", "--model", "linear", "--steps", "2"])
    out = capsys.readouterr().out
    assert seen[0].startswith("memory | torch ") and "| model linear | batch 128" in seen[0]
    assert [s.splitlines()[-1] for s in seen] == [f"measuring {p}: 3 + 2 steps"
                                                  for p in ("fp32", "bf16")], seen
    for row in (r" +fp32 +bf16 +bf16/fp32", r"activation_bytes +[\d.]+ KiB +[\d.]+ KiB +0\.\d\d",
                r"weight_copy_bytes +0\.00 KiB +[\d.]+ KiB +n/a",
                r"step_seconds_max +[\d.]+ ms +[\d.]+ ms +[\d.]+",
                r"verdict: linear, batch 128, cpu \(bf16: .*\), torch .*: bf16 steps take "
                r"[\d.]+x fp32's time, 0\.\d\dx its activation memory; AMP is (not )?faster here"):
        assert re.search(f"^{row}$", out, re.M), (row, out)


@pytest.mark.parametrize("fp32,amp,noisy,verdict", [
    ((1, 1.2), (.5, .6), False, "faster"), ((1, 1.2), (.5, .7), True, "faster"),
    ((1, 1.4), (.5, .6), True, "faster"), ((1, 1.2), (1.3, 1.4), False, "not faster")])
def test_verdict_and_noisy_timings(fp32, amp, noisy, verdict):
    fp32, amp = ({"activation_bytes": 1, "step_seconds": median, "step_seconds_min": low,
                  "step_seconds_max": 9} for low, median in (fp32, amp))
    args = amp_train.parse_args(["--example", "memory", "--precision", "bf16"])
    lines = list(amp_train.memory_report(args, CPU, fp32, amp))
    assert lines[-1 - noisy].endswith(f"; AMP is {verdict} here"), lines
    assert lines[-1].startswith("warning: noisy timings") == noisy, lines


@pytest.mark.parametrize("model,stem", [("linear", None), ("resnet18", 3),
                                        ("resnet18-imagenet", 7)])
def test_memory_models(model, stem, monkeypatch, resnet18, capsys):
    if stem == 7:  # 1x1 maps and a batch of one: BatchNorm cannot train
        argv = ["--device", "cpu", "--example", "memory", "--model", model, "--batch-size", "1"]
        assert "raise --batch-size" in run_bad(argv, capsys)
    built = []
    monkeypatch.setattr(amp_train, "measure_training", lambda model, *a: built.append(model) or {
        "activation_bytes": 1, "step_seconds": 1, "step_seconds_min": 1, "step_seconds_max": 1})
    args = amp_train.parse_args(["--example", "memory", "--model", model, "--precision", "bf16"])
    list(amp_train.run_memory(args, CPU))
    conv1 = getattr(built[0], "conv1", None)
    assert len(built) == 2 and (conv1 and conv1.kernel_size[0]) == stem, built[0]


# ---------- the command line

@pytest.mark.parametrize("argv", [
    ["--example", "nope"], ["--precision", "fp8"], ["--epochs", "0"], ["--batch-size", "0"],
    ["--max-steps", "-1"], ["--epochs", str(2**31)], ["--lr", "0"], ["--lr", "nan"],
    ["--lr", "1e39", "is not in [5e-324, 3.4028234663852886e+38]"], ["--clip-grad-norm", "-1"],
    ["--accum-steps", "1" + "0" * 30], ["--seed", "4294967296", "is not in [0, 4294967295]"],
    ["--no-such-flag"], ["--example", "memory", "--steps", "0"],
    ["--device", "cpu", "--example", "memory", "--precision", "fp32"],
    ["--example", "memory", "--run-dir", "x"], ["--device", "cpu", "--resume"],
    RESNET + ["--batch-size", "10001"]])
def test_bad_flags(argv, capsys):
    says = argv.pop() if " " in argv[-1] else ""  # the bound, exactly
    assert says in run_bad(argv, capsys) and "epoch" not in capsys.readouterr().out


@pytest.mark.parametrize("error", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
    RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 4e10 bytes")])
def test_out_of_memory(error, monkeypatch, capsys):
    monkeypatch.setattr(amp_train, "build_example", raising(error))
    assert "lower --batch-size" in run_bad(LINEAR, capsys)
    for other in (ZeroDivisionError, KeyboardInterrupt):  # a plain KeyboardInterrupt passes
        monkeypatch.setattr(amp_train, "build_example", raising(other()))
        with pytest.raises(other):
            amp_train.main(LINEAR)


def test_a_signal_while_reporting(monkeypatch, capsys):
    say = amp_train.say

    def interrupted(line, file=None):
        if "stopped by" not in line:  # torchrun stops the workers on such paths
            raise amp_train.Stopped(signal.SIGTERM)
        say(line, file)
    monkeypatch.setattr(amp_train, "say", interrupted)
    assert amp_train.main(["--epochs", "0"]) == 143
    assert capsys.readouterr().err == f"error: stopped by SIGTERM; {NOTHING}\n"


def test_ctrl_c_and_sigterm(tmp_path):
    signals = {"SIGTERM": [signal.SIGTERM], "SIGINT": [signal.SIGINT] * 4}
    runs = {name: script(*LINEAR, "--epochs", "100000", "--run-dir", str(tmp_path / name))
            for name in signals}
    for name, run in runs.items():
        run.stdout.readline()  # the header: the handlers are in place
        run.stdout.readline()
        for signum in signals[name]:  # more signals, a few ms apart, land in the cleanup
            run.send_signal(signum)
            time.sleep(0.003)
    for name, run in runs.items():
        out, err = run.stdout.read(), run.stderr.read()  # communicate() skips the read lines
        run.wait(timeout=60)
        saved = load(tmp_path / name / "checkpoint.pt")["epoch"]
        assert err == f"error: stopped by {name}; {tmp_path / name} holds epoch {saved}\n", err
        assert run.returncode == 128 + signals[name][0], run.returncode
        bad = [x for x in out.splitlines() if not re.fullmatch(r"epoch +\d+/100000 \|.* s", x)]
        assert not bad and not list((tmp_path / name).glob("*.tmp")), bad


def test_a_sigterm_after_the_last_epoch():
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


@requires_cuda
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_cuda(precision, capsys, resnet18):
    argv = ["--device", "cuda", "--precision", precision, "--batch-size", "16"]
    ok(argv + ["--data", "synthetic", "--epochs", "1", "--max-steps", "3"])
    out = capsys.readouterr().out
    assert f"device cuda:0 | precision {precision}" in out and "epoch 1/1 " in out, out
    ok(argv + ["--example", "memory", "--steps", "2"])
    out = capsys.readouterr().out
    peak = re.search(r"^peak_bytes +([\d.]+) MiB +([\d.]+) MiB +0\.\d\d$", out, re.M)
    assert peak and 0 < float(peak.group(2)) < float(peak.group(1)), out
    assert re.search(r"^reserved_bytes .* MiB", out, re.M), out
