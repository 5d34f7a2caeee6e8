"""Tests for amp_train.py: CPU by default, CUDA cases run where a GPU is. Run: python -m pytest -q"""
import contextlib
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
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn

import amp_train

# Deprecated AMP names (torch.cuda.amp.*) warn with FutureWarning: make any such use fail.
pytestmark = [pytest.mark.filterwarnings("error::FutureWarning"),
              pytest.mark.filterwarnings("error::DeprecationWarning")]

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CPU = torch.device("cpu")
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]
# (device, amp dtype) pairs that are fast enough to test; fp16 convs on the CPU are not.
AMP_CASES = [("cpu", torch.bfloat16),
             pytest.param("cuda", torch.float16, marks=requires_cuda),
             pytest.param("cuda", torch.bfloat16, marks=requires_cuda)]


def linear_setup(device, amp_dtype, seed=0):
    torch.manual_seed(seed)
    model = amp_train.build_linear().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    return model, optimizer, amp_train.make_scaler(device, amp_dtype)


def fit_linear(device, amp_dtype, iterations):
    model, optimizer, scaler = linear_setup(device, amp_dtype)
    x, y = (t.to(device) for t in amp_train.linear_batch())
    for _ in range(iterations):
        stats = amp_train.train_epoch(model, [(x, y)], optimizer, nn.MSELoss(), scaler, device, amp_dtype)
    return model, stats


# ---------------------------------------------------------------- what autocast and the scaler do

@pytest.mark.parametrize("device_name,amp_dtype", AMP_CASES)
def test_autocast_runs_matmul_and_conv_in_amp_dtype_and_loss_in_fp32(device_name, amp_dtype):
    device = torch.device(device_name)
    linear = nn.Linear(8, 4).to(device)
    conv = nn.Conv2d(3, 4, 3).to(device)
    with amp_train.amp_context(device, amp_dtype):
        logits = linear(torch.randn(2, 8, device=device))
        features = conv(torch.randn(2, 3, 8, 8, device=device))
        loss = nn.functional.cross_entropy(logits, torch.tensor([0, 1], device=device))
    assert logits.dtype is amp_dtype, f"Linear under autocast gave {logits.dtype}"
    assert features.dtype is amp_dtype, f"Conv2d under autocast gave {features.dtype}"
    assert loss.dtype is torch.float32, f"cross_entropy should autocast to float32, got {loss.dtype}"
    assert linear.weight.dtype is torch.float32, "autocast must leave the parameters in float32"


def test_fp32_turns_autocast_off():
    with amp_train.amp_context(CPU, None):
        out = nn.Linear(8, 4)(torch.randn(2, 8))
    assert out.dtype is torch.float32, f"amp_dtype=None should be plain fp32, got {out.dtype}"


@pytest.mark.parametrize("device_name", DEVICES)
def test_scaler_is_enabled_for_fp16_only(device_name):
    device = torch.device(device_name)
    enabled = {name: amp_train.make_scaler(device, dtype).is_enabled()
               for name, dtype in amp_train.PRECISIONS.items()}
    assert enabled == {"fp16": True, "bf16": False, "fp32": False}, enabled


def test_auto_precision_is_fp16_on_cuda_and_bf16_on_cpu():
    assert amp_train.resolve_precision("auto", CPU) is torch.bfloat16
    assert amp_train.resolve_precision("auto", torch.device("cuda")) is torch.float16
    assert amp_train.resolve_precision("fp32", CPU) is None


# ---------------------------------------------------------------- train_epoch

@pytest.mark.parametrize("precision,tolerance", [("bf16", 1e-3), ("fp16", 1e-3)])
def test_amp_training_of_the_linear_example_matches_fp32(precision, tolerance):
    # Measured on the CPU: bf16 ends 1.0e-4 from fp32's loss, fp16 1.3e-5; the tolerance is ~10x that.
    amp_dtype = amp_train.PRECISIONS[precision]
    fp32_model, fp32_stats = fit_linear(CPU, None, 100)
    amp_model, amp_stats = fit_linear(CPU, amp_dtype, 100)
    first = fit_linear(CPU, None, 1)[1].loss
    assert fp32_stats.loss < first - 0.2, f"fp32 training did not learn: {first} -> {fp32_stats.loss}"
    assert abs(amp_stats.loss - fp32_stats.loss) < tolerance, (amp_stats.loss, fp32_stats.loss)
    assert torch.allclose(amp_model.weight, fp32_model.weight, atol=3 * tolerance), \
        (amp_model.weight, fp32_model.weight)


@pytest.mark.parametrize("device_name", DEVICES)
def test_scaler_skips_an_inf_step_and_halves_the_scale(device_name):
    device = torch.device(device_name)
    x, y = (t.to(device) for t in amp_train.linear_batch(8))
    bad_x = x.clone()
    bad_x[0, 0] = float("inf")  # the loss of this batch is inf, its gradients inf/NaN

    model, optimizer, scaler = linear_setup(device, torch.float16)
    stats = amp_train.train_epoch(model, [(x, y), (bad_x, y)], optimizer, nn.MSELoss(),
                                  scaler, device, torch.float16)
    reference, ref_optimizer, ref_scaler = linear_setup(device, torch.float16)
    amp_train.train_epoch(reference, [(x, y)], ref_optimizer, nn.MSELoss(), ref_scaler, device, torch.float16)

    assert torch.equal(model.weight, reference.weight) and torch.equal(model.bias, reference.bias), \
        "the inf batch must not change the weights"
    assert (stats.steps, stats.skipped_steps) == (2, 1), stats
    assert stats.nonfinite_losses == 1, stats
    assert not np.isfinite(stats.loss), "the mean loss must show the inf, not hide it"
    assert stats.loss_scale == 2.0 ** 15, f"the scale should halve from 2**16, got {stats.loss_scale}"


@pytest.mark.parametrize("kind", [{"foreach": False}, {"foreach": True}, {"fused": True}])
@pytest.mark.parametrize("make", [
    lambda params, kind: torch.optim.SGD(params, lr=0.01, **kind),
    lambda params, kind: torch.optim.Adam(params, lr=0.01, **kind),
])
def test_skipped_steps_are_counted_for_plain_foreach_and_fused_optimizers(make, kind):
    # A fused optimizer takes the scaler's inf check into its own kernel: its step() always
    # runs, so counting step() calls would miss the skip.
    x, y = amp_train.linear_batch(8)
    bad_x = x.clone()
    bad_x[0, 0] = float("inf")
    torch.manual_seed(0)
    model = nn.Linear(10, 1)
    optimizer = make(model.parameters(), kind)
    scaler = amp_train.make_scaler(CPU, torch.float16)
    amp_train.train_epoch(model, [(x, y)], optimizer, nn.MSELoss(), scaler, CPU, torch.float16)
    before = [p.detach().clone() for p in model.parameters()]
    stats = amp_train.train_epoch(model, [(bad_x, y)], optimizer, nn.MSELoss(), scaler, CPU, torch.float16)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)), "the inf step moved the weights"
    assert (stats.steps, stats.skipped_steps, stats.loss_scale) == (1, 1, 2.0 ** 15), stats


def test_no_step_is_skipped_without_a_scaler():
    model, stats = fit_linear(CPU, torch.bfloat16, 3)
    assert (stats.steps, stats.skipped_steps, stats.loss_scale) == (1, 0, None), stats


def test_clipping_acts_on_unscaled_gradients():
    model, optimizer, scaler = linear_setup(CPU, torch.float16)
    assert scaler.get_scale() == 2.0 ** 16
    seen = []  # the gradient norm as optimizer.step() sees it
    optimizer.register_step_pre_hook(lambda *_: seen.append(
        torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()))
    x, y = amp_train.linear_batch(16)
    max_norm = 0.01  # the true norm is ~1: clipping must act
    stats = amp_train.train_epoch(model, [(x, y)], optimizer, nn.MSELoss(), scaler, CPU,
                                  torch.float16, clip_grad_norm=max_norm)
    assert stats.skipped_steps == 0 and len(seen) == 1, (stats, seen)
    assert seen[0] <= max_norm * 1.001, f"optimizer saw gradient norm {seen[0]}, max is {max_norm}"
    # Clipping the scaled gradients and unscaling afterwards would leave max_norm / 2**16.
    assert seen[0] == pytest.approx(max_norm, rel=1e-3), f"clipped to {seen[0]}, not to {max_norm}"


def test_loss_is_the_per_sample_mean_over_batches():
    model = nn.Linear(1, 1, bias=False)
    nn.init.zeros_(model.weight)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    batches = [(torch.zeros(3, 1), torch.ones(3, 1)), (torch.zeros(1, 1), torch.full((1, 1), 3.0))]
    stats = amp_train.train_epoch(model, batches, optimizer, nn.MSELoss(), amp_train.make_scaler(CPU, None),
                                  CPU, None, max_steps=5)
    assert stats.loss == pytest.approx((3 * 1 + 1 * 9) / 4), stats
    assert (stats.steps, stats.samples) == (2, 4), stats


def test_max_steps_stops_the_epoch():
    x, y = amp_train.linear_batch(4)
    model, optimizer, scaler = linear_setup(CPU, None)
    stats = amp_train.train_epoch(model, [(x, y)] * 10, optimizer, nn.MSELoss(), scaler, CPU, None, max_steps=3)
    assert (stats.steps, stats.samples) == (3, 12), stats


def test_evaluate_counts_correct_predictions():
    model = nn.Linear(3, 3, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.eye(3))  # predicts the index of the largest input
    inputs = torch.eye(3).repeat(2, 1)                 # predictions 0, 1, 2, 0, 1, 2
    targets = torch.tensor([0, 1, 2, 0, 2, 1])         # 4 of 6 right
    result = amp_train.evaluate(model, [(inputs[:4], targets[:4]), (inputs[4:], targets[4:])],
                                nn.CrossEntropyLoss(), CPU, torch.bfloat16)
    assert result.accuracy == pytest.approx(4 / 6), result
    assert result.samples == 6 and np.isfinite(result.loss), result
    assert not model.training, "evaluate must put the model in eval mode"


def test_evaluate_runs_under_inference_mode():
    seen = []
    class Probe(nn.Linear):
        def forward(self, x):
            out = super().forward(x)
            seen.append((torch.is_inference_mode_enabled(), out.requires_grad))
            return out
    amp_train.evaluate(Probe(3, 3), [(torch.randn(4, 3), torch.zeros(4, dtype=torch.long))],
                       nn.CrossEntropyLoss(), CPU, None)
    assert seen == [(True, False)], f"(inference mode on, output requires grad): {seen}"


def test_evaluate_loss_is_the_per_sample_mean_over_unequal_batches():
    torch.manual_seed(0)
    logits, targets = torch.randn(5, 4) * 3, torch.tensor([0, 1, 2, 3, 0])
    batches = [(logits[:4], targets[:4]), (logits[4:], targets[4:])]  # sizes 4 and 1, different losses
    result = amp_train.evaluate(nn.Identity(), batches, nn.CrossEntropyLoss(), CPU, None)
    expected = nn.functional.cross_entropy(logits, targets).item()  # the mean over all 5 samples
    assert result.loss == pytest.approx(expected, rel=1e-6), (result.loss, expected)


# ---------------------------------------------------------------- measuring memory

def small_conv_net():
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1),
                         nn.ReLU(), nn.Flatten(), nn.Linear(16 * 8 * 8, 10))


@pytest.mark.parametrize("amp_dtype,activation_bytes,weight_copy_bytes,by_dtype", [
    (None, 2 * 4 * 4, 0, {"float32": 32}),                              # x, 8 floats; the weight is not counted
    (torch.bfloat16, 2 * 4 * 2, 3 * 4 * 2, {"bfloat16": 16}),           # bf16 copies of x and of the weight
])
def test_count_saved_tensors_counts_activations_and_weight_copies(amp_dtype, activation_bytes, weight_copy_bytes,
                                                                  by_dtype):
    model = nn.Linear(4, 3, bias=False)
    with amp_train.count_saved_tensors(model) as saved:
        with amp_train.amp_context(CPU, amp_dtype):
            model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert saved == {"activation_bytes": activation_bytes, "weight_copy_bytes": weight_copy_bytes,
                     "activation_bytes_by_dtype": by_dtype}, saved


def ops_of_one_step(model, batch, criterion, amp_dtype):
    optimizer = amp_train.make_optimizer(model, 0.01)
    scaler = amp_train.make_scaler(CPU, amp_dtype)
    with amp_train.CountOps() as ops:
        amp_train.train_epoch(model, [batch], optimizer, criterion, scaler, CPU, amp_dtype)
    return ops.counts


@pytest.mark.parametrize("model,batch,criterion,low,kept", [
    (nn.Linear(10, 1), amp_train.linear_batch(8), nn.MSELoss(), {"addmm", "mm"}, {"mse_loss", "mse_loss_backward"}),
    (amp_train.build_resnet18(), (torch.randn(2, 3, 32, 32), torch.tensor([0, 1])), nn.CrossEntropyLoss(),
     {"convolution", "convolution_backward", "addmm", "mm"}, {"_log_softmax", "nll_loss_forward", "nll_loss_backward"}),
])
def test_the_op_count_shows_matmuls_in_bf16_and_the_loss_in_fp32(model, batch, criterion, low, kept):
    counts = ops_of_one_step(model, batch, criterion, torch.bfloat16)
    assert low <= set(counts["bfloat16"]), f"not all of {low} ran in bf16: {dict(counts)}"
    assert kept <= set(counts["float32"]), f"not all of {kept} ran in fp32: {dict(counts)}"
    assert not low & set(counts["float32"]) and not kept & set(counts["bfloat16"]), dict(counts)
    assert counts["bfloat16"]["_to_copy"] > 0, "the casts that make the weight copies must be counted"
    assert counts["float32"]["_fused_sgd_"] == 1, "the optimizer's update runs in fp32 on fp32 weights"
    if "convolution" in low:
        assert counts["bfloat16"]["convolution"] == 20, "ResNet18 has 20 convolutions"


def test_the_op_count_of_an_fp32_step_has_nothing_in_low_precision():
    counts = ops_of_one_step(nn.Linear(10, 1), amp_train.linear_batch(8), nn.MSELoss(), None)
    assert set(counts) == {"float32"} and counts["float32"]["addmm"] == 1, dict(counts)


def test_autocast_halves_the_activation_memory_of_a_conv_net():
    torch.manual_seed(0)
    batch = (torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,)))
    fp32, bf16 = (amp_train.measure_training(small_conv_net, batch, nn.CrossEntropyLoss(), CPU, dtype,
                                             steps=2, warmup=1) for dtype in (None, torch.bfloat16))
    ratio = bf16["activation_bytes"] / fp32["activation_bytes"]
    assert ratio < 0.6, f"bf16/fp32 activation bytes {ratio:.3f}: {bf16} vs {fp32}"
    assert fp32["weight_copy_bytes"] == 0 and bf16["weight_copy_bytes"] > 0, (fp32, bf16)
    assert fp32["peak_bytes"] is None and bf16["peak_bytes"] is None, "no peak memory number on the CPU"
    assert fp32["step_seconds"] > 0 and abs(bf16["final_loss"] - fp32["final_loss"]) < 0.05, (fp32, bf16)


def test_memory_example_json_has_the_documented_keys(capsys):
    argv = ["--device", "cpu", "--example", "memory", "--model", "linear", "--steps", "2", "--json"]
    assert amp_train.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert {"device", "model", "batch_size", "precision", "fp32", "amp", "ratio"} <= set(result), result
    assert (result["device"], result["model"], result["batch_size"], result["precision"]) == \
        ("cpu", "linear", 128, "bf16"), result
    for run in ("fp32", "amp"):
        assert isinstance(result[run]["activation_bytes"], int) and result[run]["activation_bytes"] > 0
        assert result[run]["peak_bytes"] is None, "peak memory is CUDA only: null on the CPU"
        assert isinstance(result[run]["step_seconds"], float) and isinstance(result[run]["final_loss"], float)
    assert result[run]["reserved_bytes"] is None, "reserved memory is CUDA only: null on the CPU"
    assert set(result["ratio"]) == {k for k, v in result["fp32"].items() if not isinstance(v, dict)}, result["ratio"]
    assert result["amp"]["ops"]["bfloat16"]["top"]["addmm"] == 1, result["amp"]["ops"]
    assert all(set(ops) == {"calls", "top"} for ops in result["amp"]["ops"].values()), result["amp"]["ops"]
    assert result["loader_samples_per_second"] > 0, result
    assert result["ratio"]["peak_bytes"] is None and 0 < result["ratio"]["activation_bytes"] < 1, result["ratio"]


def test_memory_example_table_for_resnet(capsys):
    assert amp_train.main(["--device", "cpu", "--example", "memory", "--batch-size", "4", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^activation memory +[\d.]+ MiB +[\d.]+ MiB +0\.\d\d$", out, re.M), out
    assert re.search(r"^peak device memory +n/a +n/a +n/a$", out, re.M), out
    assert re.search(r"^loader samples/s +(\d+) +\1 +n/a$", out, re.M), out
    assert re.search(r"^  bfloat16 +\d+ calls: .*convolution x20", out, re.M), out
    assert re.search(r"^  float32 +\d+ calls: ", out, re.M), out
    assert re.search(r"Of the bf16 run's activations, [\d.]+ MiB bfloat16, [\d.]+ MiB int64", out), out
    assert "bf16 autocast kept 0." in out and "model resnet18 | batch 4" in out, out
    assert re.search(r"the (bf16 step, not the loader,|loader) limits throughput", out), out


def test_memory_example_says_the_linear_model_has_nothing_to_save(capsys):
    assert amp_train.main(["--device", "cpu", "--example", "memory", "--model", "linear", "--steps", "1"]) == 0
    assert "a model this small has nothing to save" in capsys.readouterr().out


# ---------------------------------------------------------------- data

def test_synthetic_data_is_seeded_and_split():
    images, labels = amp_train.synthetic_cifar10(20, seed=1)
    again, _ = amp_train.synthetic_cifar10(20, seed=1)
    test, _ = amp_train.synthetic_cifar10(20, seed=1, train=False)
    assert images.shape == (20, 3, 32, 32) and images.dtype is torch.uint8, (images.shape, images.dtype)
    assert labels.shape == (20,) and 0 <= labels.min() and labels.max() < 10, labels
    assert torch.equal(images, again), "the same seed must give the same images"
    assert not torch.equal(images, test), "train and test must differ"


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


def test_cifar10_loaders_read_the_real_format(tmp_path, monkeypatch):
    import torchvision.datasets.cifar
    write_tiny_cifar10(tmp_path)
    # Our files cannot match torchvision's md5 sums: patch only that check.
    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda *a, **k: True)
    train, test = amp_train.image_loaders("cifar10", str(tmp_path), batch_size=4, device=CPU)
    assert (len(train.targets), len(test.targets)) == (10, 2)
    images, labels = next(iter(test))
    assert images.shape == (2, 3, 32, 32) and labels.tolist() == [0, 1]
    mean, std = torch.tensor(amp_train.CIFAR10_MEAN), torch.tensor(amp_train.CIFAR10_STD)
    expected = ((torch.tensor([10.0, 11.0]) / 255)[:, None] - mean) / std   # test_batch holds values 10, 11
    assert torch.allclose(images[:, :, 5, 5], expected, atol=1e-6), images[:, :, 5, 5]
    seen = sorted(int(label) for _, batch in train for label in batch)
    assert seen == sorted(v % 10 for v in range(10)), seen


def epoch_batches(loader, epoch):
    loader.set_epoch(epoch)
    return [(inputs.clone(), targets.clone()) for inputs, targets in loader]


def test_train_order_depends_on_seed_and_epoch_only():
    def order(seed, epoch):
        loader = amp_train.DeviceLoader(torch.arange(32), torch.arange(32), 8, CPU, shuffle=True, seed=seed)
        return torch.cat([targets for _, targets in epoch_batches(loader, epoch)]).tolist()
    assert sorted(order(0, 1)) == list(range(32)), "an epoch must see every sample once"
    assert order(0, 1) == order(0, 1), "same seed and epoch must give the same order"
    assert order(0, 1) != order(0, 2), "each epoch must be shuffled anew"
    assert order(0, 1) != order(1, 1), "the seed must change the order"


def test_same_seed_and_epoch_give_the_same_augmented_batches():
    images, labels = amp_train.synthetic_cifar10(64, seed=0)
    def batches(seed, epoch):
        loader = amp_train.DeviceLoader(images, labels, 16, CPU, amp_train.cifar10_transform(CPU, augment=True),
                                        shuffle=True, seed=seed)
        return epoch_batches(loader, epoch)
    first, again, later = batches(0, 3), batches(0, 3), batches(0, 4)
    assert len(first) == 4 and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                                   for a, b in zip(first, again)), "the same (seed, epoch) must repeat exactly"
    assert not torch.equal(first[0][0], later[0][0]), "another epoch must give other batches"
    assert first[0][0].is_contiguous(memory_format=torch.channels_last), "inputs go to the conv net as NHWC"


def test_each_process_draws_crops_of_its_own():
    image = torch.randint(0, 256, (1, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    images, labels = image.repeat(16, 1, 1, 1), torch.zeros(16, dtype=torch.long)  # one image, 16 times
    batches = []
    for rank in range(2):
        loader = amp_train.DeviceLoader(images, labels, 8, CPU, amp_train.cifar10_transform(CPU, augment=True),
                                        shuffle=True, rank=rank, world_size=2)
        batches.append(next(iter(loader))[0])
    assert not torch.equal(batches[0], batches[1]), "both processes cropped and flipped their batch alike"


@pytest.mark.parametrize("shuffle", [True, False])
def test_processes_get_disjoint_shards(shuffle):
    n, world = 23, 3
    shards = []
    for rank in range(world):
        loader = amp_train.DeviceLoader(torch.arange(n), torch.arange(n), 4, CPU, shuffle=shuffle,
                                        rank=rank, world_size=world)
        loader.set_epoch(5)
        shards.append(torch.cat([targets for _, targets in loader]).tolist())
        assert len(loader) == math.ceil(len(shards[-1]) / 4), "len() must count the batches"
    seen = [i for shard in shards for i in shard]
    assert len(seen) == len(set(seen)), f"a sample went to two processes: {shards}"
    if shuffle:  # equal shards, so that every process takes as many steps; 23 % 3 samples wait
        assert {len(shard) for shard in shards} == {n // world}, shards
    else:        # evaluation: every sample exactly once
        assert sorted(seen) == list(range(n)), shards


def find_window(padded, out):
    """The (dy, dx, mirrored) whose 32x32 window of `padded`, mirrored or not, equals `out`, or None."""
    import torchvision.transforms.v2.functional as TF
    for dy in range(9):
        for dx in range(9):
            window = TF.crop(padded, dy, dx, 32, 32)
            for mirrored in (False, True):
                if torch.equal(TF.horizontal_flip(window) if mirrored else window, out):
                    return dy, dx, mirrored
    return None


def test_every_augmented_image_is_a_window_of_the_padded_image_possibly_mirrored():
    import torchvision.transforms.v2.functional as TF
    images = torch.randint(0, 256, (64, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    out = amp_train.random_crop_flip(images, torch.Generator().manual_seed(1))
    assert out.shape == images.shape and out.dtype is torch.uint8, (out.shape, out.dtype)
    windows = [find_window(TF.pad(image, [4]), augmented) for image, augmented in zip(images, out)]
    assert None not in windows, f"image {windows.index(None)} is no window of its padded image"
    offsets = {(dy, dx) for dy, dx, _ in windows}
    assert len(offsets) > 20, f"the offsets must differ per sample: {sorted(offsets)}"
    assert {m for _, _, m in windows} == {False, True}, "some images must be mirrored, some not"
    assert {dy for dy, _, _ in windows} == set(range(9)) and {dx for _, dx, _ in windows} == set(range(9)), \
        "every offset from 0 to 8 must be possible"


# ---------------------------------------------------------------- no host sync per step

SYNC_METHODS = ("item", "tolist", "__bool__", "__float__", "__int__")


@contextlib.contextmanager
def count_host_syncs(monkeypatch):
    """Counts the Python-visible reads of a tensor's value (each waits for the device)."""
    count = [0]
    with monkeypatch.context() as patch:
        for name in SYNC_METHODS:
            def counting(self, *args, _original=getattr(torch.Tensor, name), **kwargs):
                count[0] += 1
                return _original(self, *args, **kwargs)
            patch.setattr(torch.Tensor, name, counting)
        yield count


def syncs_in_an_epoch(monkeypatch, batches, amp_dtype, make_optimizer):
    model = nn.Linear(10, 1)
    optimizer = make_optimizer(model)
    scaler = amp_train.make_scaler(CPU, amp_dtype)
    x, y = amp_train.linear_batch(4)
    with count_host_syncs(monkeypatch) as count:
        amp_train.train_epoch(model, [(x, y)] * batches, optimizer, nn.MSELoss(), scaler, CPU, amp_dtype)
    return count[0]


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_train_epoch_makes_no_host_sync_per_step(precision, monkeypatch):
    amp_dtype = amp_train.PRECISIONS[precision]
    sgd = lambda model: torch.optim.SGD(model.parameters(), lr=0.01)
    one, ten = (syncs_in_an_epoch(monkeypatch, n, amp_dtype, sgd) for n in (1, 10))
    assert one == ten, f"{one} host syncs in an epoch of 1 step, {ten} in one of 10"


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_the_examples_optimizer_makes_no_host_sync_per_step(precision, monkeypatch):
    make_optimizer = lambda model: amp_train.make_optimizer(model, 0.01)
    amp_dtype = amp_train.PRECISIONS[precision]
    one, ten = (syncs_in_an_epoch(monkeypatch, n, amp_dtype, make_optimizer) for n in (1, 10))
    assert one == ten, f"{one} host syncs in an epoch of 1 step, {ten} in one of 10"


def test_the_sync_counter_sees_the_plain_optimizers_sync_under_fp16(monkeypatch):
    # Proof that the counter works: scaler.step() with a plain optimizer reads found_inf every step.
    sgd = lambda model: torch.optim.SGD(model.parameters(), lr=0.01)
    one, ten = (syncs_in_an_epoch(monkeypatch, n, torch.float16, sgd) for n in (1, 10))
    assert ten > one, (one, ten)


# ---------------------------------------------------------------- the command line

def test_linear_example_runs_and_learns(capsys):
    assert amp_train.main(["--example", "linear", "--epochs", "20", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    losses = [float(x) for x in re.findall(r"^epoch +\d+/20 \| train loss ([\d.]+)", out, re.M)]
    assert len(losses) == 20, out
    assert losses[-1] < losses[0], f"loss did not fall: {losses}"
    assert "precision bf16 | scaler off" in out, out


def test_linear_example_in_fp16_uses_the_scaler(capsys):
    assert amp_train.main(["--device", "cpu", "--example", "linear", "--epochs", "2", "--precision", "fp16"]) == 0
    out = capsys.readouterr().out
    assert "scaler on" in out and "scale 65536 | skipped 0" in out, out


def test_resnet_example_runs_on_synthetic_data(capsys):
    argv = ["--device", "cpu", "--example", "resnet", "--data", "synthetic", "--epochs", "2", "--max-steps", "2",
            "--batch-size", "4", "--clip-grad-norm", "5"]
    assert amp_train.main(argv) == 0
    out = capsys.readouterr().out
    line = (r"^epoch 2/2 \| train loss [\d.]+ \| test loss [\d.]+ \| test acc +[\d.]+% \| lr 0\.01 \| "
            r"scale off \| skipped 0 \| \d+ img/s \| [\d.]+ s$")
    assert re.search(line, out, re.M), out
    assert "model resnet18 | data synthetic | batch 4" in out, out


def test_resnet_in_fp16_on_cpu_warns_and_runs(capsys):
    argv = ["--device", "cpu", "--example", "resnet", "--data", "synthetic", "--epochs", "1", "--max-steps", "1",
            "--batch-size", "2", "--precision", "fp16", "--device", "cpu"]
    assert amp_train.main(argv) == 0
    captured = capsys.readouterr()
    assert "fp16 convolutions are very slow on CPUs" in captured.err, captured.err
    assert "scale 65536" in captured.out or "scale 32768" in captured.out, captured.out


def run_bad(argv, capsys):
    code = amp_train.main(argv)
    err = capsys.readouterr().err
    assert code == 2, f"{argv} gave exit {code}: {err}"
    assert err.count("\n") == 1 and err.startswith("error: "), f"want one error line, got: {err!r}"
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("argv", [
    ["--example", "nope"], ["--precision", "fp8"], ["--device", "tpu"], ["--data", "imagenet"],
    ["--epochs", "0"], ["--epochs", "-3"], ["--batch-size", "0"], ["--max-steps", "0"],
    ["--lr", "0"], ["--lr", "-0.1"], ["--lr", "nan"], ["--lr", "abc"], ["--clip-grad-norm", "0"],
    ["--no-such-flag"], ["--device", "cpu", "--example", "memory", "--precision", "fp32"],
    ["--example", "memory", "--steps", "0"],
    ["--device", "cpu", "--example", "memory", "--model", "vgg"],
    ["--seed", "18446744073709551616"], ["--seed", "-1"], ["--accum-steps", "1" + "0" * 30],
    ["--lr", "1e300"], ["--lr", "inf"], ["--epochs", str(2**31)],
    ["--example", "memory", "--checkpoint", "x.pt"],
])
def test_bad_flags_exit_2_with_one_line(argv, capsys):
    run_bad(argv, capsys)


@pytest.mark.parametrize("error", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
    RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                 "you tried to allocate 40000000000 bytes. Error code 12 (Cannot allocate memory)"),
])
def test_out_of_memory_exits_2_and_names_the_batch_size(error, monkeypatch, capsys):
    def too_big(*args, **kwargs):
        raise error
    monkeypatch.setattr(amp_train, "build_example", too_big)
    err = run_bad(["--device", "cpu", "--example", "linear", "--batch-size", "1000000000"], capsys)
    assert "out of memory at --batch-size 1000000000" in err, err


def test_other_runtime_errors_are_not_called_out_of_memory(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("a bug")
    monkeypatch.setattr(amp_train, "build_example", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        amp_train.main(["--device", "cpu", "--example", "linear"])


def test_cuda_without_a_gpu_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "--device cpu" in run_bad(["--example", "linear", "--device", "cuda"], capsys)


def test_bf16_on_a_gpu_without_it_exits_2(monkeypatch, capsys):
    # A V100 or T4 "supports" bf16 by emulation only: that must count as no support.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    argv = ["--example", "linear", "--device", "cuda", "--precision", "bf16"]
    assert "--precision fp16" in run_bad(argv, capsys)


def test_cuda_turns_on_cudnn_benchmark(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    seen = {}
    monkeypatch.setattr(amp_train, "run_training", lambda args, device, *rest: seen.update(
        device=device, benchmark=torch.backends.cudnn.benchmark) or 0)
    assert amp_train.main(["--example", "linear", "--device", "cuda"]) == 0
    assert seen == {"device": torch.device("cuda", 0), "benchmark": True}, seen


def test_tf32_state_reads_the_new_api_without_raising():
    # Reading the legacy allow_tf32 flags raises once the fp32_precision API has set them.
    if not hasattr(torch.backends, "fp32_precision"):
        pytest.skip("this torch has no fp32_precision API")
    leaves = (torch.backends.cudnn.conv, torch.backends.cuda.matmul)
    saved = [torch.backends.fp32_precision] + [leaf.fp32_precision for leaf in leaves]
    try:
        torch.backends.fp32_precision = "tf32"
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        assert amp_train.tf32_state(torch.device("cuda")) == {"cudnn_conv": True, "matmul": False}
    finally:
        torch.backends.fp32_precision = saved[0]
        for leaf, value in zip(leaves, saved[1:]):
            leaf.fp32_precision = value
    assert amp_train.tf32_state(CPU) is None


def test_channels_last_resnet_matches_the_contiguous_one():
    torch.manual_seed(0)
    channels_last = amp_train.build_resnet18()
    contiguous = amp_train.build_resnet18().to(memory_format=torch.contiguous_format)
    contiguous.load_state_dict(channels_last.state_dict())
    assert channels_last.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    assert contiguous.conv1.weight.is_contiguous()
    x, y = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    for model in (channels_last, contiguous):
        nn.functional.cross_entropy(model(x), y).backward()
    assert torch.allclose(channels_last(x), contiguous(x), atol=1e-4), "outputs differ"
    for (name, a), b in zip(channels_last.named_parameters(), contiguous.parameters()):
        # fp32 sums in another order; measured here: at most 1.8e-4 of the gradient's norm.
        error = ((a.grad - b.grad).norm() / b.grad.norm()).item()
        assert error < 1e-3, f"{name}'s gradient differs by {error:.2e} of its norm"


def test_missing_cifar10_exits_2_and_says_what_to_do(tmp_path, monkeypatch, capsys):
    import torchvision.datasets.cifar
    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")
    monkeypatch.setattr(torchvision.datasets.cifar, "download_and_extract_archive", offline)
    err = run_bad(["--device", "cpu", "--example", "resnet", "--data-root", str(tmp_path / "data")], capsys)
    assert str(tmp_path / "data") in err and "cifar-10-python.tar.gz" in err and "--data synthetic" in err, err


# ---------------------------------------------------------------- gradient accumulation

def test_accumulating_k_micro_batches_equals_one_batch_of_k_times_the_size():
    x, y = amp_train.linear_batch(32, seed=3)
    big, big_opt, scaler = linear_setup(CPU, None)
    amp_train.train_epoch(big, [(x, y)], big_opt, nn.MSELoss(), scaler, CPU, None)
    small, small_opt, scaler = linear_setup(CPU, None)
    micro = list(zip(x.split(8), y.split(8)))
    stats = amp_train.train_epoch(small, micro, small_opt, nn.MSELoss(), scaler, CPU, None, accum_steps=4)
    assert (stats.steps, stats.samples) == (1, 32), stats
    assert not torch.equal(small.weight, linear_setup(CPU, None)[0].weight), "no step was taken"
    # Measured difference: float32 rounding only (~1e-9); the tolerance leaves room for other CPUs.
    assert torch.allclose(small.weight, big.weight, atol=1e-6, rtol=0), (small.weight - big.weight).abs().max()
    assert torch.allclose(small.bias, big.bias, atol=1e-6, rtol=0), (small.bias - big.bias).abs().max()


def test_accumulation_counts_optimizer_steps_and_steps_on_a_short_last_group():
    x, y = amp_train.linear_batch(8)
    bad_x = x.clone()
    bad_x[0, 0] = float("inf")
    model, optimizer, scaler = linear_setup(CPU, torch.float16)
    batches = [(x, y), (bad_x, y), (x, y), (x, y), (x, y)]  # groups of 2: [good, bad] [good, good] [good]
    stats = amp_train.train_epoch(model, batches, optimizer, nn.MSELoss(), scaler, CPU, torch.float16,
                                  accum_steps=2)
    assert (stats.steps, stats.skipped_steps, stats.samples) == (3, 1, 40), stats
    limited = amp_train.train_epoch(model, batches, optimizer, nn.MSELoss(), scaler, CPU, torch.float16,
                                    accum_steps=2, max_steps=1)
    assert (limited.steps, limited.samples) == (1, 16), limited


def test_a_shorter_last_group_steps_with_the_mean_gradient_of_its_micro_batches():
    x, y = amp_train.linear_batch(12, seed=5)
    micro = list(zip(x.split(4), y.split(4)))  # 3 micro-batches, K = 2: a group of 2, then one of 1
    model, optimizer, scaler = linear_setup(CPU, None)
    amp_train.train_epoch(model, micro, optimizer, nn.MSELoss(), scaler, CPU, None, accum_steps=2)
    # The reference: the docs' loop over the same samples, batched as the groups are.
    reference, ref_optimizer, _ = linear_setup(CPU, None)
    for inputs, targets in [(x[:8], y[:8]), (x[8:], y[8:])]:
        nn.MSELoss()(reference(inputs), targets).backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad(set_to_none=True)
    assert torch.allclose(model.weight, reference.weight, atol=1e-6, rtol=0), (model.weight, reference.weight)
    one, _, _ = linear_setup(CPU, None)
    single_step = amp_train.train_epoch(one, micro[:1], torch.optim.SGD(one.parameters(), lr=0.01), nn.MSELoss(),
                                        scaler, CPU, None, accum_steps=4)  # the linear example with K = 4
    assert single_step.steps == 1 and not torch.equal(one.weight, linear_setup(CPU, None)[0].weight)


def test_resnet_example_with_accumulation(capsys):
    argv = ["--device", "cpu", "--example", "resnet", "--data", "synthetic", "--epochs", "1", "--max-steps", "2",
            "--batch-size", "2", "--accum-steps", "2"]
    assert amp_train.main(argv) == 0
    out = capsys.readouterr().out
    assert "batch 2 x 2 accumulated" in out and "steps/epoch 2" in out, out


# ---------------------------------------------------------------- checkpoints and resume

RESNET_TINY = ["--device", "cpu", "--example", "resnet", "--data", "synthetic", "--max-steps", "2",
               "--batch-size", "4"]
LINEAR_FP16 = ["--device", "cpu", "--example", "linear", "--precision", "fp16"]


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


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


def scaler_that_grows_every_step(device, amp_dtype):
    # The scale doubles after every good step and halves on overflow: it moves from 2**16 at once.
    return torch.amp.GradScaler(device.type, enabled=amp_dtype is torch.float16, growth_interval=1)


@pytest.mark.parametrize("example,epochs,split", [(RESNET_TINY, 3, 2), (LINEAR_FP16, 6, 3)])
def test_resume_gives_bit_identical_weights(example, epochs, split, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(amp_train, "make_scaler", scaler_that_grows_every_step)
    straight, resumed = str(tmp_path / "straight.pt"), str(tmp_path / "resumed.pt")
    assert amp_train.main(example + ["--epochs", str(epochs), "--checkpoint", straight]) == 0
    assert amp_train.main(example + ["--epochs", str(split), "--checkpoint", resumed]) == 0
    assert load(resumed)["epoch"] == split
    if example is LINEAR_FP16:
        scale = load(resumed)["scaler"]["scale"]
        assert scale != 65536.0, "the scale must have moved, so that resuming without it would differ"
    assert amp_train.main(example + ["--epochs", str(epochs), "--checkpoint", resumed, "--resume"]) == 0
    assert f"resumed from {resumed} after epoch {split}" in capsys.readouterr().out
    a, b = load(straight), load(resumed)
    assert a["epoch"] == b["epoch"] == epochs
    for key in ("model", "optimizer", "scheduler", "scaler", "rng"):
        assert_same_state(a[key], b[key], key)


def test_checkpoint_loads_with_weights_only_and_holds_what_resume_needs(tmp_path):
    path = tmp_path / "run.pt"
    assert amp_train.main(LINEAR_FP16 + ["--epochs", "2", "--checkpoint", str(path)]) == 0
    state = torch.load(path, weights_only=True)  # raises if anything but tensors and plain types is inside
    assert {"model", "optimizer", "scheduler", "scaler", "epoch", "rng", "args", "precision"} <= set(state)
    assert state["scaler"]["scale"] == 65536.0 and state["precision"] == "fp16", state["scaler"]
    assert isinstance(state["rng"]["cpu"], torch.Tensor)
    assert not (tmp_path / "run.pt.tmp").exists(), "the temporary file must be renamed into place"


@pytest.mark.parametrize("error", [
    OSError(28, "No space left on device"),
    RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file "
                 "data/0: file write failed"),  # what torch.save raised on a full tmpfs
])
def test_a_failed_save_leaves_the_last_checkpoint_intact(error, tmp_path, monkeypatch, capsys):
    path = tmp_path / "run.pt"
    assert amp_train.main(LINEAR_FP16 + ["--epochs", "1", "--checkpoint", str(path)]) == 0
    before = path.read_bytes()
    def disk_full(obj, f):
        with open(f, "wb") as out:
            out.write(b"half a checkpoint")
        raise error
    monkeypatch.setattr(amp_train.torch, "save", disk_full)
    err = run_bad(LINEAR_FP16 + ["--epochs", "3", "--checkpoint", str(path), "--resume"], capsys)
    assert "the last one is intact" in err, err
    assert path.read_bytes() == before, "the last good checkpoint was changed"
    assert not (tmp_path / "run.pt.tmp").exists(), "the half-written temporary file was left behind"


def write_foreign(path):
    torch.save({"weights": torch.zeros(3)}, path)


def truncate(path):
    assert amp_train.main(LINEAR_FP16 + ["--epochs", "1", "--checkpoint", str(path)]) == 0
    path.write_bytes(path.read_bytes()[:200])


def other_example(path):
    assert amp_train.main(LINEAR_FP16 + ["--epochs", "1", "--checkpoint", str(path)]) == 0


def edited(**fields):
    """Makes a real checkpoint, then sets (or, with None, removes) some of its fields."""
    def make(path):
        other_example(path)
        state = load(path)
        for key, value in fields.items():
            state.pop(key) if value is None else state.__setitem__(key, value)
        torch.save(state, path)
    return make


def only_the_format_key(path):
    torch.save({"format": amp_train.CHECKPOINT_FORMAT}, path)


class CreatesAFile:
    """Unpickling this creates the file: what a malicious checkpoint could do."""
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.path),)


def pickled_code(path):
    torch.save({"format": amp_train.CHECKPOINT_FORMAT, "payload": CreatesAFile(f"{path}.pwned")}, path)


@pytest.mark.parametrize("make,argv,says", [
    (None, RESNET_TINY + ["--epochs", "2", "--resume"], "no checkpoint at"),
    (only_the_format_key, LINEAR_FP16 + ["--epochs", "2", "--resume"], "is damaged: its 'example' is missing"),
    (edited(epoch=float("inf")), LINEAR_FP16 + ["--epochs", "2", "--resume"], "its 'epoch' is missing or not a"),
    (edited(epoch=-5), LINEAR_FP16 + ["--epochs", "2", "--resume"], "is damaged: epoch -5"),
    (edited(epoch=True), LINEAR_FP16 + ["--epochs", "2", "--resume"], "its 'epoch' is missing or not a"),
    (edited(model=None), LINEAR_FP16 + ["--epochs", "2", "--resume"], "its 'model' is missing"),
    (edited(args={"lr": -1.0}), LINEAR_FP16 + ["--epochs", "2", "--resume"], "holds flags this program refuses"),
    (pickled_code, LINEAR_FP16 + ["--epochs", "2", "--resume"], "not a readable checkpoint"),
    (truncate, LINEAR_FP16 + ["--epochs", "2", "--resume"], "not a readable checkpoint"),
    (write_foreign, LINEAR_FP16 + ["--epochs", "2", "--resume"], "not written by amp_train.py"),
    (other_example, RESNET_TINY + ["--epochs", "2", "--resume"], "checkpoint of the linear example"),
    (other_example, LINEAR_FP16 + ["--epochs", "2"], "already exists: add --resume"),
])
def test_bad_checkpoints_exit_2_and_are_not_touched(make, argv, says, tmp_path, capsys):
    path = tmp_path / "run.pt"
    if make:
        make(path)
        capsys.readouterr()
    before = path.read_bytes() if path.exists() else None
    err = run_bad(argv + ["--checkpoint", str(path)], capsys)
    assert says in err, err
    assert (path.read_bytes() if path.exists() else None) == before, "the checkpoint file was changed"
    assert not os.path.exists(f"{path}.pwned"), "loading the checkpoint ran pickled code"


@pytest.mark.parametrize("where,says", [("no/such/dir/x.pt", "does not exist or is not writable"),
                                         (".", "is a folder")])
def test_an_unwritable_checkpoint_path_is_refused_before_training(where, says, tmp_path, capsys):
    err = run_bad(LINEAR_FP16 + ["--epochs", "1", "--checkpoint", str(tmp_path / where)], capsys)
    assert says in err, err
    assert "epoch 1/1" not in capsys.readouterr().out, "it trained before refusing"


def test_resume_needs_a_checkpoint_path(capsys):
    assert "--resume needs --checkpoint" in run_bad(["--device", "cpu", "--example", "linear", "--resume"], capsys)


@pytest.mark.parametrize("first,then,note", [
    ("fp16", "bf16", "GradScaler state is not used: bf16 runs without a scaler"),
    ("fp16", "fp32", "GradScaler state is not used: fp32 runs without a scaler"),
    ("bf16", "fp16", "saved in bf16 without a GradScaler; fp16 starts from a fresh loss scale"),
])
def test_resume_in_another_precision(first, then, note, tmp_path, capsys):
    path = str(tmp_path / "run.pt")
    linear = ["--device", "cpu", "--example", "linear", "--checkpoint", path]
    assert amp_train.main(linear + ["--precision", first, "--epochs", "2"]) == 0
    assert amp_train.main(linear + ["--precision", then, "--epochs", "4", "--resume"]) == 0
    out = capsys.readouterr().out
    assert note in out and "epoch 4/4" in out, out
    assert load(path)["precision"] == then


def epoch_lrs(out):
    return {int(e): float(lr) for e, lr in re.findall(r"^epoch +(\d+)/\d+ .*\| lr ([\d.e+-]+) \|", out, re.M)}


def test_a_new_lr_on_resume_is_applied_and_the_schedule_goes_on(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(amp_train, "LR_STEP_EPOCHS", 1)  # StepLR(1, 0.1): the lr falls tenfold every epoch
    path = str(tmp_path / "run.pt")
    argv = RESNET_TINY + ["--max-steps", "1", "--checkpoint", path]
    assert amp_train.main(argv + ["--epochs", "2"]) == 0
    assert amp_train.main(argv + ["--epochs", "3", "--resume", "--lr", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "note: --lr 0.5 replaces the checkpoint's 0.01" in out, out
    lrs = epoch_lrs(out)
    assert lrs[1] == pytest.approx(0.01) and lrs[2] == pytest.approx(0.001), lrs
    assert lrs[3] == pytest.approx(0.5 * 0.1 ** 2), f"StepLR from 0.5 gives 0.005 at epoch 3, not {lrs[3]}"
    assert load(path)["args"]["lr"] == 0.5, "the checkpoint must record the lr now in use"


def test_flags_not_given_on_resume_keep_the_checkpoints_values(tmp_path, capsys):
    path = str(tmp_path / "run.pt")
    linear = ["--device", "cpu", "--example", "linear", "--checkpoint", path]
    assert amp_train.main(linear + ["--epochs", "3", "--lr", "0.05", "--batch-size", "16", "--precision", "fp32",
                                    "--clip-grad-norm", "1"]) == 0
    assert amp_train.main(linear + ["--epochs", "4", "--resume"]) == 0
    out = capsys.readouterr().out
    assert "note:" not in out, out
    resumed = out[out.index("resumed from"):]
    starts = [line for line in out.splitlines() if line.startswith("amp_train |")]
    assert "precision fp32" in starts[1], starts
    assert epoch_lrs(resumed) == {4: 0.05}, resumed
    saved = load(path)["args"]
    assert (saved["batch_size"], saved["clip_grad_norm"], saved["epochs"]) == (16, 1.0, 4), saved
    assert amp_train.main(linear + ["--resume"]) == 0, "no --epochs: the checkpoint's 4, already done"
    assert "nothing to do" in capsys.readouterr().out


def test_changed_flags_on_resume_are_noted_or_refused(tmp_path, capsys):
    path = str(tmp_path / "run.pt")
    assert amp_train.main(RESNET_TINY + ["--max-steps", "1", "--epochs", "1", "--checkpoint", path]) == 0
    argv = RESNET_TINY + ["--max-steps", "1", "--epochs", "2", "--checkpoint", path, "--resume"]
    assert amp_train.main(argv + ["--clip-grad-norm", "1", "--batch-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "note: --clip-grad-norm 1.0 replaces the checkpoint's None" in out, out
    assert "note: --batch-size 2 replaces the checkpoint's 4" in out, out
    before = pathlib.Path(path).read_bytes()
    err = run_bad(argv + ["--epochs", "3", "--data", "cifar10"], capsys)
    assert "trained on --data synthetic" in err, err
    assert pathlib.Path(path).read_bytes() == before


def test_resume_when_already_done_does_nothing(tmp_path, capsys):
    path = str(tmp_path / "run.pt")
    assert amp_train.main(LINEAR_FP16 + ["--epochs", "2", "--checkpoint", path]) == 0
    assert amp_train.main(LINEAR_FP16 + ["--epochs", "2", "--checkpoint", path, "--resume"]) == 0
    assert "nothing to do" in capsys.readouterr().out


# ---------------------------------------------------------------- the metrics file

METRIC_FIELDS = {"example", "precision", "epoch", "train_loss", "lr", "loss_scale", "skipped_steps",
                 "samples_per_second", "seconds", "processes"}


def read_metrics(path):
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines()]


@pytest.mark.parametrize("example,fields", [(RESNET_TINY, METRIC_FIELDS | {"test_loss", "test_accuracy"}),
                                            (LINEAR_FP16, METRIC_FIELDS)])
def test_the_metrics_file_has_a_line_per_epoch(example, fields, tmp_path, capsys):
    path = tmp_path / "m.jsonl"
    assert amp_train.main(example + ["--epochs", "2", "--metrics", str(path)]) == 0
    out = capsys.readouterr().out
    records = read_metrics(path)
    assert [r["epoch"] for r in records] == [1, 2], records
    for record in records:
        assert set(record) == fields, set(record) ^ fields
        assert record["processes"] == 1 and record["example"] in ("resnet", "linear"), record
        assert f"train loss {record['train_loss']:.4f}" in out, (record, out)


def test_a_resumed_run_appends_to_the_metrics_file_as_far_as_its_checkpoint(tmp_path, capsys):
    straight = tmp_path / "straight.jsonl"
    assert amp_train.main(LINEAR_FP16 + ["--epochs", "4", "--metrics", str(straight)]) == 0
    checkpoint, metrics = tmp_path / "run.pt", tmp_path / "m.jsonl"
    run = LINEAR_FP16 + ["--checkpoint", str(checkpoint), "--metrics", str(metrics)]
    assert amp_train.main(run + ["--epochs", "2"]) == 0
    epoch_2 = checkpoint.read_bytes()
    assert amp_train.main(run + ["--epochs", "3", "--resume"]) == 0
    checkpoint.write_bytes(epoch_2)  # as if the run died after writing epoch 3's line, before its checkpoint
    assert amp_train.main(run + ["--epochs", "4", "--resume"]) == 0
    resumed = read_metrics(metrics)
    assert [r["epoch"] for r in resumed] == [1, 2, 3, 4], "an epoch past the checkpoint must not stay twice"
    assert [r["train_loss"] for r in resumed] == [r["train_loss"] for r in read_metrics(straight)]
    err = run_bad(LINEAR_FP16 + ["--epochs", "5", "--metrics", str(metrics)], capsys)
    assert "already exists: add --resume" in err, err


def test_a_diverged_epoch_is_recorded_with_null_for_inf(tmp_path, capsys):
    path = tmp_path / "m.jsonl"
    argv = ["--device", "cpu", "--example", "linear", "--precision", "fp32", "--lr", "1e20", "--epochs", "5",
            "--metrics", str(path)]
    assert amp_train.main(argv) == 1
    lines = path.read_text().splitlines()
    assert "Infinity" not in path.read_text() and "NaN" not in path.read_text(), "the file must be standard JSON"
    assert [json.loads(line)["train_loss"] is None for line in lines] == [False, True], lines


def test_a_failed_metrics_write_exits_2(tmp_path, monkeypatch, capsys):
    def full_disk(path, mode="r", *args, **kwargs):
        if str(path).endswith(".jsonl") and "a" in mode:
            raise OSError(28, "No space left on device")
        return open(path, mode, *args, **kwargs)
    monkeypatch.setattr(amp_train, "open", full_disk, raising=False)
    err = run_bad(LINEAR_FP16 + ["--epochs", "2", "--metrics", str(tmp_path / "m.jsonl")], capsys)
    assert "could not write the metrics file" in err and "No space left" in err, err


# ---------------------------------------------------------------- inf and NaN in the examples

def scaler_that_always_overflows(device, amp_dtype):
    # An infinite loss scale makes every scaled gradient inf, so every step is skipped.
    return torch.amp.GradScaler(device.type, init_scale=float("inf"))


def assert_finite_checkpoint(path, epoch):
    state = load(path)
    assert state["epoch"] == epoch, f"the checkpoint holds epoch {state['epoch']}, not {epoch}"
    for name, tensor in state["model"].items():
        assert not tensor.is_floating_point() or torch.isfinite(tensor).all(), f"{name} holds inf/NaN"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_diverged_run_stops_and_keeps_the_last_finite_epoch(precision, tmp_path, capsys):
    path = tmp_path / "run.pt"
    argv = ["--device", "cpu", "--example", "linear", "--precision", precision, "--lr", "1e20", "--epochs", "5",
            "--checkpoint", str(path)]
    assert amp_train.main(argv) == 1, "a diverged run must exit non-zero"
    err = capsys.readouterr().err
    assert f"error: epoch 2: the mean training loss is inf under {precision}; {path} holds epoch 1" in err, err
    assert "--lr" in err, err
    assert_finite_checkpoint(path, 1)


def test_epochs_with_a_nan_test_loss_are_not_saved(tmp_path, capsys):
    # The case: the test loss is NaN from epoch 1 on, while the training loss is still finite.
    path = tmp_path / "d.pt"
    argv = RESNET_TINY + ["--max-steps", "1", "--batch-size", "8", "--epochs", "5", "--lr", "1e6",
                          "--precision", "fp32", "--checkpoint", str(path)]
    assert amp_train.main(argv) == 1
    captured = capsys.readouterr()
    assert f"note: epoch 1 is not saved, its mean test loss is nan; nothing was saved to {path}" in captured.out
    assert f"; nothing was saved to {path}; try a lower --lr" in captured.err, captured.err
    assert not path.exists(), "an epoch with a NaN test loss was saved"


def test_fp16_stops_when_an_inf_batch_leaves_nan_in_batchnorm(monkeypatch, tmp_path, capsys):
    # The scaler skips the inf batch's step, but its forward pass already put inf/NaN into
    # BatchNorm's running statistics: that epoch must not be saved, and the run cannot go on.
    calls = []
    train_epoch = amp_train.train_epoch
    def second_epoch_has_an_inf_batch(model, loader, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            images, labels = next(iter(loader))
            loader = [(torch.full_like(images, float("inf")), labels)]
        return train_epoch(model, loader, *args, **kwargs)
    monkeypatch.setattr(amp_train, "train_epoch", second_epoch_has_an_inf_batch)
    path = tmp_path / "run.pt"
    argv = RESNET_TINY + ["--max-steps", "1", "--batch-size", "2", "--epochs", "3", "--precision", "fp16",
                          "--checkpoint", str(path)]
    assert amp_train.main(argv) == 1
    err = capsys.readouterr().err
    assert re.search(rf"error: epoch 2: the model's \S+ holds inf/NaN; {re.escape(str(path))} holds epoch 1", err), err
    assert_finite_checkpoint(path, 1)


def test_a_run_whose_scaler_skips_everything_stops(monkeypatch, capsys):
    monkeypatch.setattr(amp_train, "make_scaler", scaler_that_always_overflows)
    assert amp_train.main(["--device", "cpu", "--example", "linear", "--epochs", "100"]) == 1
    captured = capsys.readouterr()
    assert "error: epoch 32: the GradScaler skipped all of the last 32 steps" in captured.err, captured.err
    assert re.search(r"^epoch +32/100", captured.out, re.M) and "33/100" not in captured.out, captured.out


def test_an_epoch_whose_steps_were_all_skipped_stops_resnet(monkeypatch, capsys):
    monkeypatch.setattr(amp_train, "make_scaler", scaler_that_always_overflows)
    argv = ["--device", "cpu", "--example", "resnet", "--data", "synthetic", "--epochs", "3", "--max-steps", "33",
            "--batch-size", "2"]
    assert amp_train.main(argv) == 1
    assert "error: epoch 1: the GradScaler skipped all of the last 33 steps" in capsys.readouterr().err


def test_skipped_steps_do_not_step_the_lr_scheduler_early(monkeypatch, capsys):
    # Every step of these short epochs is skipped: stepping StepLR anyway would warn
    # "Detected call of lr_scheduler.step() before optimizer.step()".
    monkeypatch.setattr(amp_train, "make_scaler", scaler_that_always_overflows)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert amp_train.main(RESNET_TINY + ["--epochs", "2"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^epoch 2/2 .*\| skipped 2 \|", out, re.M), out
    messages = [str(w.message) for w in caught if "lr_scheduler.step()" in str(w.message)]
    assert not messages, messages


# ---------------------------------------------------------------- several processes (DDP, gloo on the CPU)

def ddp_worker(rank, argv, out_dir, port, setup):
    """One process of a 2-process run, set up as torchrun would; saves its log, exit code, weights
    and the buffers it evaluated with. `setup(out_dir)`, if given, runs first (to mock)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # as torchrun sets OMP_NUM_THREADS=1: 2 processes on 2 cores, same sums
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
    return [dict(torch.load(out_dir / f"rank{r}.pt", weights_only=True),
                 out=(out_dir / f"rank{r}.out").read_text(), err=(out_dir / f"rank{r}.err").read_text())
            for r in range(2)]


def group_worker(rank, function, out_dir, port):
    """Runs function(rank) in a 2-process gloo group; saves what it returns."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo")
    try:
        torch.save(function(rank), out_dir / f"result{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def in_two_processes(function, out_dir):
    torch.multiprocessing.spawn(group_worker, args=(function, out_dir, free_port()), nprocs=2)
    return [torch.load(out_dir / f"result{r}.pt", weights_only=True) for r in range(2)]


def micro_batches(rank):
    x, y = amp_train.linear_batch(24, seed=rank)
    return list(zip(x.split(4), y.split(4)))  # 6 micro-batches: with K = 4, a group of 4 and a short one of 2


def accumulate_under_ddp(rank):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    torch.manual_seed(0)
    model = nn.Linear(10, 1)
    ddp = nn.parallel.DistributedDataParallel(model)
    all_reduces = [0]
    def counting(state, bucket):
        all_reduces[0] += 1
        return allreduce_hook(None, bucket)
    ddp.register_comm_hook(None, counting)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        stats = amp_train.train_epoch(ddp, micro_batches(rank), optimizer, nn.MSELoss(),
                                      amp_train.make_scaler(CPU, None), CPU, None, accum_steps=4, log_every=1)
    return {"all_reduces": all_reduces[0], "steps": stats.steps, "log": out.getvalue(),
            "weight": model.weight.detach(), "bias": model.bias.detach()}


def test_accumulation_under_ddp_all_reduces_once_per_step(tmp_path):
    ranks = in_two_processes(accumulate_under_ddp, tmp_path)
    # The reference: one process, each step's micro-batches of both ranks accumulated (K = 8).
    r0, r1 = micro_batches(0), micro_batches(1)
    torch.manual_seed(0)
    model = nn.Linear(10, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp_train.train_epoch(model, r0[:4] + r1[:4] + r0[4:] + r1[4:], optimizer, nn.MSELoss(),
                          amp_train.make_scaler(CPU, None), CPU, None, accum_steps=8)
    for rank, result in enumerate(ranks):
        assert result["steps"] == 2, result
        assert result["all_reduces"] == 2, f"rank {rank}: {result['all_reduces']} all-reduces for 2 steps"
        for key in ("weight", "bias"):
            assert torch.allclose(result[key], getattr(model, key), atol=1e-6, rtol=0), \
                (rank, key, result[key], getattr(model, key))
        assert re.search(rf"^  step 1 \| loss [\d.]+ \| \d+ samples/s \| rank {rank} alone$", result["log"], re.M), \
            result["log"]


@pytest.mark.parametrize("argv", [
    ["--device", "cpu", "--example", "linear", "--epochs", "3", "--precision", "fp16"],
    ["--device", "cpu", "--example", "resnet", "--data", "synthetic", "--epochs", "1", "--max-steps", "2",
     "--batch-size", "4"],
])
def test_two_processes_train_in_step_and_only_rank_0_logs(argv, tmp_path):
    rank0, rank1 = run_two_processes(argv, tmp_path)
    assert rank0["code"] == rank1["code"] == 0, (rank0["err"], rank1["err"])
    assert rank0["group_left"] and rank1["group_left"], "the process group must be destroyed at the end"
    assert "processes 2 | global batch" in rank0["out"] and re.search(r"^epoch +1/", rank0["out"], re.M)
    assert rank1["out"] == "" and rank1["err"] == "", f"rank 1 must not log: {rank1['out']!r} {rank1['err']!r}"
    assert rank0["parameters"].keys() == rank1["parameters"].keys() and rank0["parameters"]
    for name, weight in rank0["parameters"].items():
        assert torch.equal(weight, rank1["parameters"][name]), f"{name} differs between the ranks"
    for name, buffer in (rank0["evaluated"] or [{}])[0].items():  # BatchNorm's running statistics
        assert torch.equal(buffer, rank1["evaluated"][0][name]), f"the ranks evaluated with different {name}"
    assert "resnet" not in argv or len(rank0["evaluated"][0]) == 40, rank0["evaluated"]


def test_only_rank_0_writes_metrics(tmp_path):
    path = tmp_path / "m.jsonl"
    ranks = run_two_processes(["--device", "cpu", "--example", "linear", "--epochs", "3", "--metrics", str(path)],
                              tmp_path)
    assert [r["code"] for r in ranks] == [0, 0], [r["err"] for r in ranks]
    records = read_metrics(path)
    assert [(r["epoch"], r["processes"]) for r in records] == [(1, 2), (2, 2), (3, 2)], records


def test_checkpoints_move_between_one_and_two_processes(tmp_path):
    path = str(tmp_path / "run.pt")
    linear = ["--device", "cpu", "--example", "linear", "--checkpoint", path]
    assert amp_train.main(linear + ["--epochs", "1"]) == 0
    rank0, rank1 = run_two_processes(linear + ["--epochs", "2", "--resume"], tmp_path)
    assert rank0["code"] == rank1["code"] == 0, (rank0["err"], rank1["err"])
    assert f"resumed from {path} after epoch 1" in rank0["out"], rank0["out"]
    saved = load(path)
    assert saved["epoch"] == 2 and set(saved["model"]) == {"weight", "bias"}, "save the unwrapped module"
    assert amp_train.main(linear + ["--epochs", "3", "--resume"]) == 0
    assert load(path)["epoch"] == 3


def test_an_error_under_two_processes_exits_2_and_leaves_the_group(tmp_path):
    path = tmp_path / "run.pt"
    write_foreign(path)
    argv = ["--device", "cpu", "--example", "linear", "--checkpoint", str(path), "--resume"]
    ranks = run_two_processes(argv, tmp_path)
    for rank in ranks:
        assert rank["code"] == 2 and "not written by amp_train.py" in rank["err"], rank
        assert rank["group_left"], "the process group must be destroyed on errors too"


def mock_cifar10_download(out_dir):
    """Downloading writes the tiny CIFAR-10 folder, slowly, and leaves a line in calls.txt."""
    import time
    import torchvision.datasets.cifar as cifar
    def download(url, download_root, **kwargs):
        with open(out_dir / "calls.txt", "a") as calls:
            calls.write(f"{os.environ['RANK']}\n")
        time.sleep(1)  # a process that did not wait would find nothing yet
        write_tiny_cifar10(pathlib.Path(download_root), per_batch=4)
    cifar.download_and_extract_archive = download
    cifar.check_integrity = lambda path, md5=None: os.path.isfile(path)  # our files cannot match the md5 sums


def two_machines_sharing_the_data_root(out_dir):
    os.environ["LOCAL_RANK"] = "0"  # each process the first of its own machine
    mock_cifar10_download(out_dir)


@pytest.mark.parametrize("setup", [mock_cifar10_download, two_machines_sharing_the_data_root])
def test_only_one_process_per_machine_downloads_cifar10(setup, tmp_path):
    argv = ["--device", "cpu", "--example", "resnet", "--data-root", str(tmp_path / "data"), "--epochs", "1",
            "--batch-size", "4"]
    rank0, rank1 = run_two_processes(argv, tmp_path, setup=setup)
    assert rank0["code"] == rank1["code"] == 0, (rank0["err"], rank1["err"])
    assert (tmp_path / "calls.txt").read_text() == "0\n", "only local rank 0 may download"
    assert re.search(r"^epoch 1/1 ", rank0["out"], re.M), rank0["out"]


def rank_1_finds_an_older_checkpoint(out_dir):
    """As on machines that share no disk: rank 1 reads another checkpoint than rank 0."""
    load_checkpoint = amp_train.load_checkpoint
    def older(*args, **kwargs):
        state = load_checkpoint(*args, **kwargs)
        return {**state, "epoch": state["epoch"] - 1} if os.environ["RANK"] == "1" else state
    amp_train.load_checkpoint = older


def test_processes_that_would_resume_from_different_epochs_refuse(tmp_path):
    path = tmp_path / "run.pt"
    linear = ["--device", "cpu", "--example", "linear", "--checkpoint", str(path)]
    assert amp_train.main(linear + ["--epochs", "2"]) == 0
    ranks = run_two_processes(linear + ["--epochs", "4", "--resume"], tmp_path, setup=rank_1_finds_an_older_checkpoint)
    for rank in ranks:
        assert rank["code"] == 2 and "at epochs 1 to 2: put the checkpoint on a file system" in rank["err"], rank
    assert load(path)["epoch"] == 2


def test_one_visible_gpu_per_process_is_used(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert amp_train.resolve_device("cuda") == torch.device("cuda", 0), "no torchrun: the first GPU, by index"
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(amp_train.UsageError, match="no GPU of its own"):
        amp_train.resolve_device("cuda")  # 4 processes would share the machine's one GPU
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")  # a launcher that gives each process its own GPU
    assert amp_train.resolve_device("cuda") == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(amp_train.UsageError, match="no GPU of its own"):
        amp_train.resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert amp_train.resolve_device("cuda") == torch.device("cuda", 3)


def test_nccl_gets_the_device_and_every_group_a_timeout_and_keys_of_its_round(monkeypatch):
    calls, store = [], torch.distributed.HashStore()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.distributed, "rendezvous", lambda url, timeout: iter([(store, 1, 2)]))
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda *a, **k: calls.append((a, k)))
    amp_train.init_distributed(torch.device("cuda", 1))
    amp_train.init_distributed(CPU)
    timeout = amp_train.DIST_TIMEOUT
    assert [(a, k["timeout"], k["device_id"], k["rank"], k["world_size"]) for a, k in calls] == [
        (("nccl",), timeout, torch.device("cuda", 1), 1, 2), (("gloo",), timeout, None, 1, 2)], calls
    assert timeout.total_seconds() <= 600, "a lost peer must end the run within 10 minutes"
    calls[0][1]["store"].set("key", "value")
    assert store.get("restart3/key") == b"value", "a restarted round must not read the keys of the round before"


def torchrun(tmp_path, *argv, max_restarts=0, kill_after=None):
    """Runs amp_train.py under torchrun with 2 CPU processes; with kill_after=PATH, SIGKILLs one
    worker as soon as PATH appears. Returns the finished process."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               f"--max-restarts={max_restarts}", str(pathlib.Path(amp_train.__file__)), "--device", "cpu", *argv]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                               start_new_session=True)
    if kill_after:
        deadline = time.monotonic() + 60
        while not os.path.exists(kill_after) and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        workers = pathlib.Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()
        os.kill(int(workers[-1]), signal.SIGKILL)
    try:
        out, err = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # torchrun and its workers: leave nothing running
        raise
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def last_epoch_line(out):
    line = re.findall(r"^epoch .*$", out, re.M)[-1]
    return line.rsplit(" | ", 2)[0]  # without the img/s and seconds


def test_a_killed_worker_is_restarted_by_torchrun_and_the_run_resumes(tmp_path):
    argv = ["--example", "resnet", "--data", "synthetic", "--max-steps", "2", "--batch-size", "8", "--epochs", "10"]
    done = torchrun(tmp_path, *argv, "--checkpoint", "run.pt", max_restarts=2, kill_after=tmp_path / "run.pt")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "exitcode: -9" in done.stderr, "no worker was killed: " + done.stderr
    assert re.search(r"^resumed from run.pt after epoch \d+$", done.stdout, re.M), done.stdout
    uninterrupted = run_two_processes(["--device", "cpu", *argv], tmp_path)[0]
    assert last_epoch_line(done.stdout) == last_epoch_line(uninterrupted["out"]), (done.stdout, uninterrupted["out"])


def test_a_restart_never_resumes_a_checkpoint_of_another_run(tmp_path, capsys):
    path = tmp_path / "run.pt"
    assert amp_train.main(["--device", "cpu", "--example", "linear", "--epochs", "1", "--checkpoint", str(path)]) == 0
    before = path.read_bytes()
    done = torchrun(tmp_path, "--example", "linear", "--epochs", "2", "--checkpoint", "run.pt", max_restarts=1)
    assert done.returncode != 0, done.stdout
    assert done.stderr.count("already exists: add --resume") == 4, done.stderr  # 2 processes, 2 rounds
    assert 'amp_train.py", line' not in done.stderr, "a worker ended in a traceback: " + done.stderr
    assert path.read_bytes() == before, "the other run's checkpoint was changed"


def test_torchrun_launches_the_linear_example(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(pathlib.Path(amp_train.__file__)), "--device", "cpu", "--example", "linear", "--epochs", "2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("amp_train | example linear") == 1, done.stdout
    assert "processes 2 | global batch 256" in done.stdout, done.stdout
    assert len(re.findall(r"^epoch 2/2 ", done.stdout, re.M)) == 1, done.stdout


# ---------------------------------------------------------------- CUDA only

@requires_cuda
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_cuda_resnet_example_runs(precision, capsys):
    argv = ["--example", "resnet", "--data", "synthetic", "--epochs", "1", "--max-steps", "3",
            "--batch-size", "16", "--device", "cuda", "--precision", precision]
    assert amp_train.main(argv) == 0
    out = capsys.readouterr().out
    assert f"device cuda:0 | precision {precision}" in out and re.search(r"^epoch 1/1 ", out, re.M), out


@requires_cuda
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_cuda_memory_example_measures_peak_memory(precision, capsys):
    argv = ["--example", "memory", "--device", "cuda", "--precision", precision,
            "--batch-size", "64", "--steps", "2", "--json"]
    assert amp_train.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["fp32"]["peak_bytes"] > 0 and result["amp"]["peak_bytes"] > 0, result
    assert result["ratio"]["peak_bytes"] < 1, f"AMP peak memory should be below fp32's: {result['ratio']}"
    assert result["amp"]["reserved_bytes"] >= result["amp"]["peak_bytes"], result["amp"]
    assert result["ratio"]["activation_bytes"] < 0.6, result["ratio"]
    assert result["tf32"] is not None, "on CUDA the TF32 state must be reported"
