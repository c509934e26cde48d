"""cross_entropy and linear_cross_entropy with their options (soft cap, label smoothing, z-loss,
reduction, accuracy) against float64 math, whose own semantics are checked against PyTorch's."""

import pytest
import torch

from fastlm.kernels import cross_entropy, linear_cross_entropy
from fastlm.kernels.cross_entropy_options import cross_entropy_options_ref
from fastlm.testing import assert_close

OPTIONS = [
    dict(softcap=3.0),
    dict(label_smoothing=0.1, z_loss=1e-2, reduction="sum"),
    dict(reduction="none", softcap=5.0),
    dict(softcap=5.0, label_smoothing=0.2, z_loss=1e-3, return_accuracy=True),
]
IDS = ["softcap", "smoothing-z_loss-sum", "none-softcap", "all"]


def _targets(n, vocab):
    """Random targets, row n // 3 ignored (-100) when there are other rows to count."""
    targets = torch.randint(0, vocab, (n,))
    if n > 1:
        targets[n // 3] = -100
    return targets


def _expected(logits, targets, options, grad_out):
    """(loss, accuracy, d logits) in float64."""
    leaf = logits.detach().double().requires_grad_()
    math = {k: v for k, v in options.items() if k in ("softcap", "label_smoothing", "z_loss")}
    rows, correct = cross_entropy_options_ref(leaf, targets, **math)
    counted = (targets != -100).sum().clamp_min(1)
    reduction = options.get("reduction", "mean")
    loss = {"none": rows, "sum": rows.sum(), "mean": rows.sum() / counted}[reduction]
    loss.backward(grad_out.double())
    return loss.detach(), correct.sum() / counted, leaf.grad


def _call(function, *args, options):
    out = function(*args, **options)
    return out if options.get("return_accuracy") else (out, None)


CASES = [pytest.param(13, 1100, options, torch.float32, id=i) for options, i in zip(OPTIONS, IDS)]
CASES += [
    pytest.param(13, 1100, OPTIONS[-1], torch.bfloat16, id="all-bf16"),
    pytest.param(1, 7, OPTIONS[-1], torch.float32, id="all-one-row"),
]


@pytest.mark.parametrize("n, vocab, options, dtype", CASES)
def test_cross_entropy_options(n, vocab, options, dtype, device):
    """Vocabularies of two blocks (the interpreter's block is 1024) and of one, an ignored row
    (one row, counted, in the one-row case). The loss is computed in fp32 from logits that fp32
    holds exactly, so it meets fp32's bound whatever the logits' dtype."""
    logits = (3 * torch.randn(n, vocab, device=device)).to(dtype).requires_grad_()
    targets = _targets(n, vocab).to(device)
    loss, accuracy = _call(cross_entropy, logits, targets, options=options)
    grad_out = torch.randn_like(loss, dtype=torch.float32)
    loss.backward(grad_out)
    expected, expected_accuracy, d_logits = _expected(logits, targets, options, grad_out)
    assert loss.dtype == torch.float32 and loss.shape == expected.shape
    assert expected.abs().sum() > 0, "the loss is 0: no row is counted"
    assert_close(loss, expected, torch.float32, "loss")
    assert_close(logits.grad, d_logits, dtype, "d logits")
    if n > 1:
        assert logits.grad[n // 3].abs().sum() == 0  # the ignored row
    if accuracy is not None:
        assert accuracy == pytest.approx(float(expected_accuracy))


@pytest.mark.parametrize("options", OPTIONS, ids=IDS)
def test_linear_cross_entropy_options(options, device):
    """Each reduction (the options' math is test_cross_entropy_options'), in chunks of 5 tokens
    (the last short); the weight's gradient summed over chunks."""
    n, features, vocab = 13, 48, 1100
    x = torch.randn(n, features, device=device, requires_grad=True)
    weight = (0.3 * torch.randn(vocab, features, device=device)).requires_grad_()
    targets = _targets(n, vocab).to(device)
    loss, accuracy = _call(linear_cross_entropy, x, weight, targets, -100, 5, options=options)
    grad_out = torch.randn_like(loss)
    loss.backward(grad_out)
    x64, w64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    expected, expected_accuracy, _ = _expected(x64 @ w64.T, targets, options, grad_out)
    logits = x64 @ w64.T
    math = {k: v for k, v in options.items() if k in ("softcap", "label_smoothing", "z_loss")}
    rows, _ = cross_entropy_options_ref(logits, targets, **math)
    counted = (targets != -100).sum()
    reduction = options.get("reduction", "mean")
    {"none": rows, "sum": rows.sum(), "mean": rows.sum() / counted}[reduction].backward(
        grad_out.double()
    )
    assert_close(loss, expected, torch.float32, "loss")
    assert_close(x.grad, x64.grad, torch.float32, "dx")
    assert_close(weight.grad, w64.grad, torch.float32, "dweight")
    if accuracy is not None:
        assert accuracy == pytest.approx(float(expected_accuracy))


def test_reference_is_pytorchs_math():
    """The float64 reference the kernels are held to: label smoothing and reduction "none" as
    F.cross_entropy; the soft cap and the z-loss as written out."""
    logits = 4 * torch.randn(9, 30, dtype=torch.float64)
    targets = torch.randint(0, 30, (9,))
    targets[2] = -100
    counted = targets != -100
    rows, _ = cross_entropy_options_ref(logits, targets, label_smoothing=0.3)
    smoothed = torch.nn.functional.cross_entropy(logits, targets, label_smoothing=0.3)
    torch.testing.assert_close(rows.sum() / counted.sum(), smoothed)
    plain = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
    torch.testing.assert_close(cross_entropy_options_ref(logits, targets)[0], plain)
    capped = 2.0 * torch.tanh(logits / 2.0)
    rows, _ = cross_entropy_options_ref(logits, targets, softcap=2.0, z_loss=0.5)
    lse = torch.logsumexp(capped, -1)
    by_hand = torch.nn.functional.cross_entropy(capped, targets, reduction="none")
    torch.testing.assert_close(rows, torch.where(counted, by_hand + 0.5 * lse**2, 0.0))


def test_accuracy_counts_argmax_hits_first_of_ties(device):
    """Rows whose largest logit is the target count; of equal maxima the first is the argmax
    (torch.argmax's rule); ignored rows count in neither part. Across vocabulary blocks too."""
    vocab = 1300
    logits = torch.randn(6, vocab, device=device)
    targets = torch.tensor([5, 1100, 7, 9, 0, 3], device=device)
    logits[0, 5] = 10.0  # hit
    logits[1, 1100] = 10.0  # hit, in the second block
    logits[2, 3] = logits[2, 7] = 10.0  # a tie: the first (3) is the argmax: a miss
    logits[3, 9] = logits[3, 1200] = 10.0  # a tie across blocks: 9 first: a hit
    targets[4] = -100
    logits[5, 4] = 10.0  # miss
    _, accuracy = cross_entropy(logits, targets, return_accuracy=True)
    assert accuracy == pytest.approx(3 / 5)


def test_huge_logits_keep_their_log_v(device):
    """Every logit at finfo.max: the loss is log V (a rounded lse would give 0)."""
    logits = torch.full((3, 50), torch.finfo(torch.float32).max, device=device)
    targets = torch.tensor([1, 2, 3], device=device)
    loss = cross_entropy(logits, targets, reduction="none")
    assert_close(loss, torch.full((3,), float(torch.log(torch.tensor(50.0)))), torch.float32)


def test_bad_options_are_named(device):
    logits, targets = torch.randn(3, 8, device=device), torch.tensor([1, 2, 3], device=device)
    with pytest.raises(ValueError, match="reduction must be 'mean', 'sum' or 'none'"):
        cross_entropy(logits, targets, reduction="avg")
    with pytest.raises(ValueError, match=r"label_smoothing must be a finite number in \[0, 1\]"):
        cross_entropy(logits, targets, label_smoothing=1.5)
    with pytest.raises(ValueError, match=r"softcap must be a finite number in \[0, 1e6\]"):
        linear_cross_entropy(logits, torch.randn(5, 8, device=device), targets, softcap=-1.0)
    with pytest.raises(
        TypeError, match=r"z_loss must be a real number \(int or float\), got NoneType"
    ):
        cross_entropy(logits, targets, z_loss=None)
    with pytest.raises(TypeError, match="return_accuracy must be a bool"):
        cross_entropy(logits, targets, return_accuracy=1)


def test_torch_backend_gives_the_same_numbers(monkeypatch, device):
    logits = torch.randn(5, 40, device=device)
    targets = torch.randint(0, 40, (5,), device=device)
    options = dict(softcap=4.0, label_smoothing=0.1, z_loss=1e-2, reduction="none")
    results = []
    for backend in ("auto", "torch"):
        monkeypatch.setenv("FASTLM_BACKEND", backend)
        leaf = logits.clone().requires_grad_()
        loss = cross_entropy(leaf, targets, **options)
        loss.sum().backward()
        results.append((loss.detach(), leaf.grad))
    for kernel, torch_path in zip(*results):
        torch.testing.assert_close(kernel, torch_path)
