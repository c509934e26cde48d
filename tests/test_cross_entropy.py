"""cross_entropy and linear_cross_entropy against fastlm.reference.CrossEntropyLoss in float64."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fastlm.backend import interpreting
from fastlm.kernels.cross_entropy import (
    MAX_BLOCK_V,
    MAX_BLOCK_V_INTERPRETER,
    MAX_ROW_ON_CHIP,
    cross_entropy,
)
from fastlm.kernels.linear_cross_entropy import default_chunk_size, linear_cross_entropy
from fastlm.modules import CrossEntropyLoss as FusedCrossEntropyLoss
from fastlm.reference import CrossEntropyLoss
from fastlm.testing import assert_close, call_through

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IGNORE = -100
GRAD_MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}

#: 5000 spans several vocabulary blocks on a GPU too (MAX_BLOCK_V), 1337 and 1000 several in the
#: interpreter, 50 a single partial block.
VOCABS = [50, 1000, 1337, MAX_BLOCK_V + 904]


@pytest.fixture(params=["auto", "torch"])
def backend(request, monkeypatch):
    """The kernels (auto: Triton here through the interpreter) and the PyTorch fallback."""
    monkeypatch.setenv("FASTLM_BACKEND", request.param)
    return request.param


def random_targets(shape, vocab, device, ignored_fraction=0.25):
    targets = torch.randint(0, vocab, shape, device=device)
    ignored = torch.rand(shape, device=device) < ignored_fraction
    ignored.view(-1)[0] = False  # at least one counted position
    return targets.masked_fill(ignored, IGNORE)


def reference_loss_and_grads(inputs, logits_of_inputs, targets, grad_output):
    """Float64 loss of the counted positions and the gradients of grad_output * loss wrt inputs."""
    inputs64 = [t.detach().to(torch.float64).requires_grad_() for t in inputs]
    counted = (targets != IGNORE).reshape(-1)
    logits = logits_of_inputs(*inputs64)
    logits = logits.reshape(-1, logits.shape[-1])[counted]
    loss = CrossEntropyLoss()(logits, targets.reshape(-1)[counted])
    (loss * grad_output).backward()
    return loss, [t.grad for t in inputs64]


def linear_reference(x, weight, targets, grad_output=1.0):
    return reference_loss_and_grads([x, weight], lambda x, w: x @ w.T, targets, grad_output)


#: Inference mode skips the autograd keys, so matmul reaches the recorder before it becomes mm.
MATMULS = (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_, torch.ops.aten.matmul)


class OpRecorder(TorchDispatchMode):
    """Records the largest tensor an op allocates (views and in-place results are not
    allocations) and how many matmuls run."""

    def __init__(self):
        super().__init__()
        self.nbytes = 0
        self.matmuls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = call_through(self, func, args, kwargs)
        self.matmuls += func.overloadpacket in MATMULS
        if all(result.alias_info is None for result in func._schema.returns):
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.nbytes = max(self.nbytes, t.untyped_storage().nbytes())
        return out


def check_cross_entropy(logits, targets, dtype, **kwargs):
    logits = logits.detach().requires_grad_()
    grad_output = torch.rand((), device=logits.device) + 0.5
    loss = cross_entropy(logits, targets, IGNORE, **kwargs)
    assert loss.dtype == torch.float32 and loss.shape == ()
    (loss * grad_output).backward()
    ref_loss, (ref_grad,) = reference_loss_and_grads([logits], lambda x: x, targets, grad_output)
    # The loss is computed in fp32 from logits that fp32 holds exactly: fp32's bound, any dtype.
    assert_close(loss, ref_loss, torch.float32, "loss")
    assert logits.grad.dtype == dtype
    assert_close(logits.grad, ref_grad, dtype, "dlogits")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", VOCABS)
def test_cross_entropy_matches_reference(device, backend, dtype, vocab):
    logits = (2 * torch.randn(2, 5, vocab, device=device)).to(dtype)
    check_cross_entropy(logits, random_targets((2, 5), vocab, device), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("centre, spread", [(100.0, 3.0), (0.0, 100.0), (-100.0, 3.0)])
def test_cross_entropy_large_logits(device, dtype, centre, spread):
    """exp(100) overflows fp16 and exp(100) * V overflows nothing only with the running max."""
    vocab = 1337
    logits = (centre + spread * torch.randn(6, vocab, device=device)).to(dtype)
    check_cross_entropy(logits, random_targets((6,), vocab, device), dtype)


# The interpreter's NumPy warns at the log(0) and -inf - (-inf) of the rows made only of -inf.
@pytest.mark.filterwarnings(
    "ignore:divide by zero:RuntimeWarning", "ignore:invalid value:RuntimeWarning"
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy_masked_logits(device, backend, dtype):
    """-inf logits (a masked vocabulary). The first MAX_BLOCK_V logits of every row are -inf: one
    whole block on a GPU, four in the interpreter, where the online running max stays -inf and
    exp(-inf - (-inf)) would be NaN. Where PyTorch is finite, so are we, with its numbers."""
    vocab = MAX_BLOCK_V + 904
    logits = (2 * torch.randn(5, vocab, device=device)).to(dtype)
    targets = torch.randint(MAX_BLOCK_V, vocab, (5,), device=device)
    logits[:, :MAX_BLOCK_V] = float("-inf")
    logits[1] = float("-inf")  # all but the target: probability 1, loss 0, gradient 0
    logits[1, targets[1]] = 0.5
    logits[2][torch.rand(vocab, device=device) < 0.5] = float("-inf")  # scattered too
    logits[2, targets[2]] = 1.0
    logits[3] = float("-inf")  # no softmax at all, but ignored: adds nothing, zero gradient
    targets[3] = IGNORE
    check_cross_entropy(logits, targets, dtype)

    logits = logits.detach().requires_grad_()
    cross_entropy(logits, targets).backward()
    assert (logits.grad[1] == 0).all() and (logits.grad[3] == 0).all()

    # PyTorch's non-finite cases: the target's own logit -inf gives +inf (finite gradients), a
    # counted row of only -inf gives NaN.
    logits = (2 * torch.randn(2, vocab, device=device)).to(dtype)
    logits[:, :MAX_BLOCK_V] = float("-inf")
    targets = torch.tensor([3, IGNORE], device=device)
    logits64 = logits.double().requires_grad_()
    expected = F.cross_entropy(logits64, targets, ignore_index=IGNORE)
    expected.backward()
    logits.requires_grad_()
    loss = cross_entropy(logits, targets)
    loss.backward()
    assert loss.item() == expected.item() == float("inf")
    assert_close(logits.grad, logits64.grad, dtype, "dlogits")
    assert torch.isnan(
        cross_entropy(torch.full((1, vocab), float("-inf"), device=device), targets[:1])
    )


@pytest.mark.filterwarnings(
    "ignore:divide by zero:RuntimeWarning", "ignore:invalid value:RuntimeWarning"
)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", ["row_on_chip", "streamed"])
def test_gradient_in_the_forward_on_both_row_paths(device, dtype, path):
    """The forward that writes the gradient (inplace_backward) keeps a row that fits on chip and
    streams a longer one twice: both give the reference's loss and gradient, with a masked
    (-inf) stretch and an ignored row among them."""
    limit = MAX_BLOCK_V_INTERPRETER if interpreting() else MAX_ROW_ON_CHIP
    vocab = limit - 24 if path == "row_on_chip" else limit + 37
    logits = (2 * torch.randn(4, vocab, device=device)).to(dtype)
    targets = random_targets((4,), vocab, device)
    targets[1] = vocab - 1
    logits[1, : vocab // 2] = float("-inf")
    leaf = logits.requires_grad_()
    grad_output = torch.rand((), device=device) + 0.5
    loss = cross_entropy(leaf.clone(), targets, IGNORE, inplace_backward=True)  # a non-leaf
    (loss * grad_output).backward()
    ref_loss, (ref_grad,) = reference_loss_and_grads([leaf], lambda x: x, targets, grad_output)
    assert_close(loss, ref_loss, torch.float32, "loss")  # fp32 math on exact logits
    assert_close(leaf.grad, ref_grad, dtype, "dlogits")


def extreme_rows(kind, vocab, dtype, device):
    """(logits (3, vocab) of `dtype`, targets (3,)) at the ends of the dtype's range, where every
    loss is still finite in fp32 (a mean of losses near finfo(float32).max would overflow)."""
    info = torch.finfo(dtype)
    top, bottom = info.max, info.min
    targets = torch.randint(0, vocab, (3,), device=device)
    if kind == "all finfo.min":
        logits = torch.full((3, vocab), bottom, device=device)
    elif kind == "all finfo.max":
        logits = torch.full((3, vocab), top, device=device)
    elif kind == "finfo.max and finfo.min":  # targets on a top entry: loss log(number of tops)
        tops = torch.rand(3, vocab, device=device) < 0.5
        tops[torch.arange(3), targets] = True
        logits = torch.where(tops, top, bottom)
    elif kind == "+-finfo.max/8":  # targets anywhere: a loss near finfo.max/4 or near log V
        logits = torch.where(torch.rand(3, vocab, device=device) < 0.5, top / 8, bottom / 8)
    elif kind == "-inf and finfo.min":  # the finite entries carry the softmax
        logits = torch.where(torch.rand(3, vocab, device=device) < 0.5, bottom, float("-inf"))
        logits[torch.arange(3), targets] = bottom
    else:  # "one huge logit": the target is it (loss 0), or not (loss about finfo.max / 4)
        logits = 2 * torch.randn(3, vocab, device=device)
        logits[:, 7] = top / 4
        targets[0] = 7
    return logits.to(dtype), targets


EXTREMES = [
    "all finfo.min",
    "all finfo.max",
    "finfo.max and finfo.min",
    "+-finfo.max/8",
    "-inf and finfo.min",
    "one huge logit",
]


# NumPy (the interpreter) warns where finfo.min - finfo.max overflows to -inf (whose exp is 0).
@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", ["default", "inplace_backward", "no_grad", "torch"])
@pytest.mark.parametrize("row", ["row_on_chip", "streamed"])
def test_cross_entropy_at_the_ends_of_the_range(device, monkeypatch, dtype, path, row):
    """Logits at finfo.min or finfo.max (all equal: loss log V, gradient 1/V - onehot), mixed
    with each other or with -inf, or one huge logit among small ones: the loss and gradient of
    PyTorch's F.cross_entropy in float64, on every path that computes them (the kernel's forward
    and backward, the gradient written in the forward, the forward alone, the PyTorch backend)."""
    if path == "torch":
        monkeypatch.setenv("FASTLM_BACKEND", "torch")
    limit = MAX_BLOCK_V_INTERPRETER if interpreting() else MAX_ROW_ON_CHIP
    vocab = 300 if row == "row_on_chip" else limit + 37
    for kind in EXTREMES:
        logits, targets = extreme_rows(kind, vocab, dtype, device)
        logits64 = logits.double().requires_grad_()
        expected = F.cross_entropy(logits64, targets)
        expected.backward()
        leaf = logits.clone().requires_grad_()
        if path == "no_grad":
            with torch.no_grad():
                loss = cross_entropy(leaf, targets)
        else:
            # A non-leaf, so that inplace_backward may write over it.
            loss = cross_entropy(leaf * 1, targets, inplace_backward=path == "inplace_backward")
            loss.backward()
            assert_close(leaf.grad, logits64.grad, dtype, f"dlogits, {kind}")
        assert_close(loss, expected, torch.float32, f"loss, {kind}")  # fp32 math, exact logits


@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning")
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_cross_entropy_at_the_ends_of_the_range(device, backend, dtype):
    """x @ weight.T at about finfo.min in every entry of a row, at about finfo.max, and at both:
    F.cross_entropy's loss and gradients in float64."""
    vocab, root = 300, 0.99 * torch.finfo(dtype).max ** 0.5
    weight = torch.zeros(vocab, 2, device=device)
    weight[:, 0] = -root
    weight[:, 1] = torch.where(torch.rand(vocab, device=device) < 0.5, root, -root)
    x = torch.tensor([[root, 0.0], [-root, 0.0], [0.0, root]], device=device)
    targets = torch.randint(0, vocab, (3,), device=device)
    targets[2] = int(weight[:, 1].argmax())  # a top entry: loss log(number of tops)
    x, weight = x.to(dtype).requires_grad_(), weight.to(dtype).requires_grad_()
    x64, weight64 = (t.detach().double().requires_grad_() for t in (x, weight))
    expected = F.cross_entropy(x64 @ weight64.T, targets)
    expected.backward()
    loss = linear_cross_entropy(x, weight, targets, chunk_size=2)
    loss.backward()
    assert_close(loss, expected, dtype, "loss")
    assert_close(x.grad, x64.grad, dtype, "dx")
    assert_close(weight.grad, weight64.grad, dtype, "dweight")


@pytest.mark.parametrize("layout", ["column_stride", "row_slice", "transposed"])
def test_cross_entropy_strided_logits(device, backend, layout):
    vocab, dtype = 300, torch.float32
    if layout == "column_stride":
        logits = torch.randn(3, 4, 2 * vocab, device=device)[..., ::2]
    elif layout == "row_slice":
        logits = torch.randn(3, 4, vocab + 17, device=device)[..., 5 : vocab + 5]
    else:
        logits = torch.randn(4, 3, vocab, device=device).transpose(0, 1)
    targets = random_targets((3, 4), vocab, device)
    logits.requires_grad_()
    loss = cross_entropy(logits, targets, IGNORE)
    loss.backward()
    assert logits.grad.shape == logits.shape
    ref_loss, (ref_grad,) = reference_loss_and_grads([logits], lambda x: x, targets, 1.0)
    assert_close(loss, ref_loss, dtype, "loss")
    assert_close(logits.grad, ref_grad, dtype, "dlogits")


def test_ignored_rows_get_exact_zero_gradient(device, backend):
    """Kernel outputs start NaN-poisoned in the suite: every gradient entry must be written."""
    logits = torch.randn(8, 1337, device=device, requires_grad=True)
    targets = random_targets((8,), 1337, device, ignored_fraction=0.5)
    targets[1] = IGNORE
    cross_entropy(logits, targets).backward()
    assert torch.isfinite(logits.grad).all()
    assert (logits.grad[targets == IGNORE] == 0).all()
    assert (logits.grad[targets != IGNORE] != 0).any(dim=-1).all()


def test_all_ignored_gives_zero(device, backend):
    """F.cross_entropy gives NaN (0/0); we give 0 and zero gradients."""
    logits = torch.randn(2, 3, 77, device=device, requires_grad=True)
    targets = torch.full((2, 3), IGNORE, device=device)
    loss = cross_entropy(logits, targets)
    loss.backward()
    assert loss.item() == 0.0
    assert (logits.grad == 0).all()

    x = torch.randn(2, 3, 16, device=device, requires_grad=True)
    weight = torch.randn(77, 16, device=device, requires_grad=True)
    loss = linear_cross_entropy(x, weight, targets, chunk_size=4)
    loss.backward()
    assert loss.item() == 0.0
    assert (x.grad == 0).all() and (weight.grad == 0).all()


def test_custom_ignore_index_and_out_of_vocab_target(device, backend):
    logits = torch.randn(5, 40, device=device)
    targets = torch.randint(0, 40, (5,), device=device)
    targets[2] = 7
    loss = cross_entropy(logits, targets, ignore_index=7)
    ref = F.cross_entropy(logits.double(), targets, ignore_index=7)
    assert_close(loss, ref, torch.float32, "loss")
    assert torch.equal(FusedCrossEntropyLoss(ignore_index=7)(logits, targets), loss)
    if device == "cpu":  # on a GPU a bad target is a device-side assert, which ends the context
        targets[0] = 40  # neither in the vocabulary nor ignored
        with pytest.raises(ValueError, match=r"targets must lie in \[0, 40\)"):
            cross_entropy(logits, targets, ignore_index=7)
        with pytest.raises(ValueError, match="targets must lie"):
            linear_cross_entropy(logits, torch.randn(40, 40, device=device), targets, 7)
        targets[0] = -1
        with pytest.raises(ValueError, match="targets must lie"):
            cross_entropy(logits, targets, ignore_index=7)


def test_out_of_vocab_target_in_the_kernel_is_nan(device):
    """The kernel's own defence, under the host check: a target outside the vocabulary that
    reaches it (on a GPU the device-side assert fires later) gives NaN, never a read out of
    bounds."""
    from fastlm.kernels.cross_entropy import _mean_loss

    logits = torch.randn(3, 40, device=device)
    targets = torch.tensor([1, 40, -5], device=device)
    loss, _, _ = _mean_loss(logits, targets, -100, None)
    assert torch.isnan(loss)


def test_inplace_backward(device, backend):
    hidden = torch.randn(6, 32, device=device)
    weight = torch.randn(500, 32, device=device, requires_grad=True)
    targets = random_targets((6,), 500, device)

    cross_entropy(hidden @ weight.T, targets).backward()
    expected = weight.grad.clone()
    weight.grad = None
    logits = hidden @ weight.T
    saved = logits.detach().clone()
    cross_entropy(logits, targets, inplace_backward=True).backward()
    assert torch.equal(weight.grad, expected)
    if backend == "torch":  # the PyTorch backend computes its gradient as PyTorch does
        assert torch.equal(logits.detach(), saved)
        return
    assert not torch.equal(logits.detach(), saved), "the gradient was not written into logits"

    # A node that saved logits before they were overwritten must fail at backward, not use them.
    logits = hidden @ weight.T
    other_use = logits.sin().sum()  # sin saves its input for its backward
    loss = cross_entropy(logits, targets, inplace_backward=True) + other_use
    with pytest.raises(RuntimeError, match="inplace"):
        loss.backward()

    # Rows without a unit column stride are copied first: the copy takes the gradient.
    strided = (hidden @ weight.T).repeat_interleave(2, dim=-1)[:, ::2]
    weight.grad = None
    cross_entropy(strided, targets, inplace_backward=True).backward()
    assert_close(weight.grad, expected, torch.float32, "dweight through strided logits")
    assert torch.equal(strided.detach(), saved)

    leaf = torch.randn(6, 500, device=device, requires_grad=True)
    with pytest.raises(ValueError, match="leaf"):
        cross_entropy(leaf, targets, inplace_backward=True)
    # A view of a leaf: writing the gradient would overwrite the leaf's values.
    leaf = torch.randn(6, 1000, device=device, requires_grad=True)
    with pytest.raises(ValueError, match="leaf"):
        cross_entropy(leaf[:, :500], targets, inplace_backward=True)
    # Rows that share memory: the gradient of one row would overwrite logits another still reads.
    row = (hidden[:1] @ weight.T).expand(6, 500)
    with pytest.raises(ValueError, match="share memory"):
        cross_entropy(row, targets, inplace_backward=True)


@pytest.mark.parametrize("grad_mode", GRAD_MODES)
@pytest.mark.parametrize("inplace_backward", [False, True])
def test_cross_entropy_without_grad_mode(device, backend, grad_mode, inplace_backward):
    """Under no_grad / inference_mode no gradient is computed although logits require grad
    (autograd.Function's needs_input_grad does not see grad mode): no (N, V) buffer is allocated,
    and inplace_backward leaves the logits, a non-leaf or a leaf, as they were."""
    hidden = torch.randn(6, 32, device=device)
    weight = torch.randn(500, 32, device=device, requires_grad=True)
    targets = random_targets((6,), 500, device)
    logits = hidden @ weight.T
    saved = logits.detach().clone()
    expected = F.cross_entropy(saved.double(), targets, ignore_index=IGNORE)
    for tensor in [logits, saved.clone().requires_grad_()]:
        with GRAD_MODES[grad_mode](), OpRecorder() as recorder:
            loss = cross_entropy(tensor, targets, inplace_backward=inplace_backward)
        assert torch.equal(tensor.detach(), saved), (
            "logits were overwritten with no gradient to compute"
        )
        if backend == "auto":  # the kernels' promise; the PyTorch backend makes fp32 copies
            assert recorder.nbytes < saved.numel() * saved.element_size(), (
                "a gradient buffer was allocated"
            )
        assert not loss.requires_grad
        assert_close(loss, expected, torch.float32, "loss")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk_size", [7, 16, None])
def test_linear_cross_entropy_matches_reference(device, backend, dtype, chunk_size):
    """38 tokens: chunks of 7 and 16 leave a partial last chunk; None is one chunk here."""
    n_features, vocab = 24, 1100
    x = torch.randn(2, 19, n_features, device=device).to(dtype).requires_grad_()
    weight = (
        (torch.randn(vocab, n_features, device=device) / n_features**0.5).to(dtype).requires_grad_()
    )
    targets = random_targets((2, 19), vocab, device)
    grad_output = torch.rand((), device=device) + 0.5
    loss = linear_cross_entropy(x, weight, targets, IGNORE, chunk_size)
    (loss * grad_output).backward()
    ref_loss, (ref_dx, ref_dweight) = linear_reference(x, weight, targets, grad_output)
    assert loss.dtype == torch.float32
    assert x.grad.dtype == dtype and weight.grad.dtype == dtype
    assert_close(loss, ref_loss, dtype, "loss")
    assert_close(x.grad, ref_dx, dtype, "dx")
    assert_close(weight.grad, ref_dweight, dtype, "dweight")


@pytest.mark.parametrize("grad_mode", ["enabled", *GRAD_MODES])
def test_linear_cross_entropy_frozen_inputs(device, backend, grad_mode):
    """Only the gradients asked for are computed: besides each chunk's logits, one matmul per
    chunk for each input that requires grad, and none under no_grad / inference_mode (which
    autograd.Function's needs_input_grad does not see), where no fp32 (V, C) dweight exists
    either."""
    n_tokens, n_features, vocab, chunk_size = 10, 8, 90, 3
    n_chunks = 4
    grad_context = GRAD_MODES.get(grad_mode, contextlib.nullcontext)
    x_values = torch.randn(n_tokens, n_features, device=device)
    weight_values = torch.randn(vocab, n_features, device=device)
    targets = random_targets((n_tokens,), vocab, device)
    ref_loss, (ref_dx, ref_dweight) = linear_reference(x_values, weight_values, targets)
    for need_dx, need_dweight in [(False, True), (True, False), (True, True)]:
        x = x_values.clone().requires_grad_(need_dx)
        weight = weight_values.clone().requires_grad_(need_dweight)
        with grad_context(), OpRecorder() as recorder:
            loss = linear_cross_entropy(x, weight, targets, chunk_size=chunk_size)
        assert_close(loss, ref_loss, torch.float32, "loss")
        kernels = backend == "auto"  # the chunking is the kernels' path; PyTorch's is one matmul
        if grad_mode != "enabled":
            assert not loss.requires_grad
            if kernels:
                assert recorder.matmuls == n_chunks, "a gradient was computed under " + grad_mode
                assert recorder.nbytes <= chunk_size * vocab * 4, "a gradient buffer was allocated"
            continue
        if kernels:
            assert recorder.matmuls == n_chunks * (1 + need_dx + need_dweight)
        loss.backward()
        if need_dx:
            assert_close(x.grad, ref_dx, torch.float32, "dx")
        if need_dweight:
            assert_close(weight.grad, ref_dweight, torch.float32, "dweight")


def test_linear_cross_entropy_under_autocast(device):
    """Under autocast the logits are computed in the autocast dtype, the gradients keep fp32."""
    x = torch.randn(12, 16, device=device, requires_grad=True)
    weight = (torch.randn(200, 16, device=device) / 4).requires_grad_()
    targets = random_targets((12,), 200, device)
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        loss = linear_cross_entropy(x, weight, targets, chunk_size=5)
    loss.backward()
    assert x.grad.dtype == torch.float32 and weight.grad.dtype == torch.float32
    ref_loss, (ref_dx, ref_dweight) = linear_reference(x, weight, targets)
    assert_close(loss, ref_loss, torch.bfloat16, "loss")
    assert_close(x.grad, ref_dx, torch.bfloat16, "dx")
    assert_close(weight.grad, ref_dweight, torch.bfloat16, "dweight")


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_linear_cross_entropy_fp32_weight(device, backend, half):
    """Half-precision x with fp32 master weights: logits in x's dtype, the weight's gradient
    accumulated and returned in fp32 (no rounding to the half dtype and cast back), dx in x's."""
    x = torch.randn(37, 16, device=device).to(half).requires_grad_()
    weight = (torch.randn(300, 16, device=device) / 4).requires_grad_()
    targets = random_targets((37,), 300, device)
    loss = linear_cross_entropy(x, weight, targets, chunk_size=8)
    loss.backward()
    assert x.grad.dtype == half and weight.grad.dtype == torch.float32
    ref_loss, (ref_dx, ref_dweight) = linear_reference(x, weight.to(half), targets)
    assert_close(loss, ref_loss, half, "loss")
    assert_close(x.grad, ref_dx, half, "dx")
    assert_close(weight.grad, ref_dweight, half, "dweight")


@pytest.mark.parametrize("backend_name", ["auto", "torch"])
@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_linear_cross_entropy_fp32_weight_is_accumulated_in_fp32(
    device, monkeypatch, gemms, backend_name, half
):
    """The fp32 weight's gradient is accumulated in fp32, not in the half dtype, which the
    half-precision bound above cannot tell: most entries are not half numbers (a half accumulator
    or a final round trip makes them all so). The PyTorch backend computes the whole product in
    one GEMM: where the device has no GEMM with an fp32 result from half inputs (the CPU as it
    is), that product is autocast's, rounded to the half dtype and cast
    (`fastlm.kernels.linear`)."""
    monkeypatch.setenv("FASTLM_BACKEND", backend_name)
    x = torch.randn(37, 16, device=device).to(half).requires_grad_()
    weight = (torch.randn(300, 16, device=device) / 4).requires_grad_()
    linear_cross_entropy(x, weight, random_targets((37,), 300, device), chunk_size=8).backward()
    in_half = (weight.grad == weight.grad.to(half).float()).float().mean().item()
    if backend_name == "torch" and not gemms:
        assert in_half == 1.0, "without the fp32-result GEMM the product is autocast's"
    else:
        assert in_half < 0.5, f"{in_half:.0%} of the fp32 dweight is {half} numbers"


def test_linear_cross_entropy_never_holds_all_logits(device):
    n_tokens, n_features, vocab, chunk_size = 64, 8, 400, 12
    x = torch.randn(n_tokens, n_features, device=device, requires_grad=True)
    weight = torch.randn(vocab, n_features, device=device, requires_grad=True)
    targets = random_targets((n_tokens,), vocab, device)
    fp32 = 4

    with OpRecorder() as unfused:  # the tracker sees the logits of the plain computation
        F.cross_entropy(x @ weight.T, targets).backward()
    assert unfused.nbytes >= n_tokens * vocab * fp32

    with OpRecorder() as fused:
        linear_cross_entropy(x, weight, targets, chunk_size=chunk_size).backward()
    largest_allowed = max(chunk_size * vocab, vocab * n_features, n_tokens * n_features) * fp32
    assert fused.nbytes <= largest_allowed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_allocations(device, dtype):
    """What each backward allocates: cross_entropy one tensor of the logits' size (the gradient)
    and nothing larger (the logits and lse were saved); with inplace_backward nothing of that
    size (the gradient is scaled where the forward wrote it); linear_cross_entropy nothing of
    the logits' size, only dx and the weight's gradient."""
    n_tokens, n_features, vocab = 32, 8, 1337
    hidden = torch.randn(n_tokens, n_features, device=device).to(dtype)
    weight = torch.randn(vocab, n_features, device=device).to(dtype).requires_grad_()
    targets = random_targets((n_tokens,), vocab, device)
    weight_bytes = vocab * n_features * dtype.itemsize
    logits_bytes = n_tokens * vocab * dtype.itemsize

    loss = cross_entropy(hidden @ weight.T, targets)
    with OpRecorder() as recorder:
        loss.backward()
    assert recorder.nbytes == logits_bytes

    loss = cross_entropy(hidden @ weight.T, targets, inplace_backward=True)
    with OpRecorder() as recorder:
        loss.backward()
    assert recorder.nbytes <= weight_bytes  # the matmul's dweight only

    x = hidden.clone().requires_grad_()
    loss = linear_cross_entropy(x, weight, targets, chunk_size=10)
    with OpRecorder() as recorder:
        loss.backward()
    assert recorder.nbytes <= vocab * n_features * 4  # the fp32 dweight scaled, then rounded


def test_second_backward(device):
    """A graph through cross_entropy or linear_cross_entropy can be backpropagated through twice
    (retain_graph=True) with the same result; with inplace_backward=True the first backward
    scaled the gradient in place, so a second one raises instead of scaling it twice."""
    logits = torch.randn(4, 300, device=device, requires_grad=True)
    x = torch.randn(4, 16, device=device, requires_grad=True)
    weight = torch.randn(300, 16, device=device, requires_grad=True)
    targets = random_targets((4,), 300, device)
    for inputs, loss in [
        ([logits], cross_entropy(logits, targets)),
        ([x, weight], linear_cross_entropy(x, weight, targets, chunk_size=3)),
    ]:
        grads = torch.autograd.grad(loss, inputs, retain_graph=True)
        _, ref_grads = reference_loss_and_grads(
            inputs, (lambda t: t) if len(inputs) == 1 else (lambda x, w: x @ w.T), targets, 1.0
        )
        for grad, ref_grad in zip(grads, ref_grads):
            assert_close(grad, ref_grad, torch.float32, "gradient of the first backward")
        for grad, again in zip(grads, torch.autograd.grad(loss, inputs)):
            assert torch.equal(grad, again)
    loss = cross_entropy(logits * 1.0, targets, inplace_backward=True)
    torch.autograd.grad(loss, logits, retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        torch.autograd.grad(loss, logits)


@pytest.mark.parametrize("inplace_backward", [False, True])
def test_second_derivatives_raise(device, inplace_backward):
    """The kernels' backward is not differentiable: a second derivative raises instead of
    silently dropping the second-order terms (the PyTorch backend differentiates twice)."""
    targets = random_targets((4,), 300, device)
    leaf = torch.randn(4, 300, device=device, requires_grad=True)
    logits = leaf * 1.0  # inplace_backward takes a non-leaf
    with pytest.raises(RuntimeError, match="second derivatives"):
        loss = cross_entropy(logits, targets, inplace_backward=inplace_backward)
        (grad,) = torch.autograd.grad(loss, leaf, create_graph=True)
        grad.pow(2).sum().backward()
    x = torch.randn(4, 16, device=device, requires_grad=True)
    weight = torch.randn(300, 16, device=device, requires_grad=True)
    with pytest.raises(RuntimeError, match="second derivatives"):
        (grad,) = torch.autograd.grad(
            linear_cross_entropy(x, weight, targets), x, create_graph=True
        )
        grad.pow(2).sum().backward()


def test_default_chunk_size():
    rows = default_chunk_size(16384, 32000, torch.bfloat16)
    assert rows * 32000 * 2 <= 128 * 2**20 and rows >= 1024
    assert default_chunk_size(10, 32000, torch.float32) == 10
    assert default_chunk_size(5000, 2**25, torch.float32) == 1  # never 0 for a huge vocabulary
    assert default_chunk_size(0, 50, torch.float32) == 1


def test_deterministic(device, backend):
    """Two backwards give bitwise-equal gradients. Under Triton's interpreter this cannot fail
    (NumPy runs every launch, atomics included, in one order): it is a GPU check, and
    tools/gpu_check runs the whole suite on CUDA."""
    logits = torch.randn(9, 1337, device=device, dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(21, 16, device=device, requires_grad=True)
    weight = torch.randn(300, 16, device=device, requires_grad=True)
    targets = random_targets((9,), 1337, device)
    token_targets = random_targets((21,), 300, device)
    runs = []
    for _ in range(2):
        loss = cross_entropy(logits, targets)
        fused = linear_cross_entropy(x, weight, token_targets, chunk_size=8)
        grads = torch.autograd.grad(loss + fused, [logits, x, weight])
        runs.append([loss, fused, *grads])
    for first, second in zip(*runs):
        assert torch.equal(first, second)


def test_bad_inputs(device):
    logits = torch.randn(2, 3, 10, device=device)
    targets = torch.randint(0, 10, (2, 3), device=device)
    with pytest.raises(ValueError, match="targets"):
        cross_entropy(logits, targets[:, :2])
    with pytest.raises(TypeError, match="targets"):
        cross_entropy(logits, targets.float())
    with pytest.raises(TypeError, match="logits"):
        cross_entropy(logits.long(), targets)
    with pytest.raises(ValueError, match="logits"):
        cross_entropy(logits[..., :0], targets)
    with pytest.raises(ValueError, match="targets"):
        cross_entropy(logits, targets.to("meta"))
    with pytest.raises(TypeError, match="ignore_index"):
        cross_entropy(logits, targets, ignore_index=-100.0)

    x = torch.randn(2, 3, 8, device=device)
    weight = torch.randn(10, 8, device=device)
    with pytest.raises(ValueError, match="weight"):
        linear_cross_entropy(x, weight[:, :7], targets)
    with pytest.raises(ValueError, match="weight"):
        linear_cross_entropy(x, weight[0], targets)
    with pytest.raises(TypeError, match="weight"):
        linear_cross_entropy(x, weight.half(), targets)
    with pytest.raises(TypeError, match="x"):
        linear_cross_entropy(x.long(), weight, targets)
    with pytest.raises(ValueError, match="targets"):
        linear_cross_entropy(x, weight, targets.view(-1))
    with pytest.raises(TypeError, match="targets"):
        linear_cross_entropy(x, weight, targets.to(torch.int16))
    with pytest.raises(ValueError, match="chunk_size"):
        linear_cross_entropy(x, weight, targets, chunk_size=0)


@settings(
    max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    leading=st.lists(st.integers(1, 6), min_size=0, max_size=2),
    vocab=st.integers(1, 1500),
    n_features=st.integers(1, 40),
    chunk_size=st.integers(1, 9),
    dtype=st.sampled_from(DTYPES),
    ignored_fraction=st.sampled_from([0.0, 0.3, 0.9]),
    seed=st.integers(0, 2**31 - 1),
)
def test_fuzz(device, leading, vocab, n_features, chunk_size, dtype, ignored_fraction, seed):
    torch.manual_seed(seed)  # drawn by Hypothesis, so a failing example replays and shrinks
    targets = random_targets(tuple(leading), vocab, device, ignored_fraction)
    logits = (3 * torch.randn(*leading, vocab, device=device)).to(dtype)
    check_cross_entropy(logits, targets, dtype)

    x = torch.randn(*leading, n_features, device=device).to(dtype).requires_grad_()
    weight = (
        (torch.randn(vocab, n_features, device=device) / n_features**0.5).to(dtype).requires_grad_()
    )
    loss = linear_cross_entropy(x, weight, targets, chunk_size=chunk_size)
    loss.backward()
    ref_loss, (ref_dx, ref_dweight) = linear_reference(x, weight, targets)
    assert_close(loss, ref_loss, dtype, "loss")
    assert_close(x.grad, ref_dx, dtype, "dx")
    assert_close(weight.grad, ref_dweight, dtype, "dweight")


@pytest.mark.cuda
def test_linear_cross_entropy_peak_memory_cuda():
    """At 16k tokens and vocab 32000 in bf16 the logits alone take 1 GiB; the fused loss's extra
    peak must stay a fraction of that (one 128 MiB chunk plus the logits' gradient in place)."""
    n_tokens, n_features, vocab = 16384, 768, 32000
    x = torch.randn(n_tokens, n_features, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(vocab, n_features, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, vocab, (n_tokens,), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    linear_cross_entropy(x, weight, targets).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    logits_bytes = n_tokens * vocab * 2
    assert extra < 0.5 * logits_bytes, f"extra peak {extra / 2**20:.0f} MiB"


@pytest.mark.cuda
def test_compiles_without_graph_breaks():
    """The Triton launches trace under torch.compile (fullgraph) and give the eager numbers."""
    x = torch.randn(2, 300, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(5000, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    targets = random_targets((2, 300), 5000, "cuda")

    def losses(x, weight, targets):
        return linear_cross_entropy(x, weight, targets, chunk_size=128) + cross_entropy(
            x @ weight.T, targets
        )

    compiled = torch.compile(losses, fullgraph=True)
    loss = compiled(x, weight, targets)
    grads = torch.autograd.grad(loss, [x, weight])
    eager_loss = losses(x, weight, targets)
    eager_grads = torch.autograd.grad(eager_loss, [x, weight])
    assert_close(loss, eager_loss, torch.bfloat16, "compiled loss")
    for grad, eager_grad in zip(grads, eager_grads):
        assert_close(grad, eager_grad, torch.bfloat16, "compiled gradient")
