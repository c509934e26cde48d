"""Mixture-of-experts models: fastlm.Transformer's MoE layers (on `fastlm.moe_experts`) against
fastlm.reference's (a loop over experts) in float64, forward and backward, with both routers,
shared experts, dense-first layers and an expert that gets no token; the reference's parts
against their definitions (the seed's SwiGLU experts, the auxiliary losses, the bias rule);
bad options."""

import pytest
import torch
from conftest import TINY_MODEL

import fastlm
from fastlm import reference as R
from fastlm.testing import assert_close

MOE = dict(num_experts=5, experts_per_token=2, moe_d_ff=24, num_shared_experts=1)


@pytest.mark.parametrize("router", R.ROUTERS)
def test_matches_reference_forward_and_backward(device, router):
    """fp32 fastlm model against the float64 reference holding the same weights: logits, the
    auxiliary loss and every parameter's gradient of (sum of logits * g + auxiliary loss).
    Layer 0 is dense (first_dense_layers), layer 1 a mixture; expert 0 never chosen: with the
    sigmoid router its selection bias is pushed down, with softmax the router's rows are made
    collinear, expert 0's logit always between the others' (the top two: 1, 2 or 3, 4)."""
    options = dict(**MOE, first_dense_layers=1, router=router, normalize_top_k=router == "sigmoid")
    model = fastlm.Transformer(**TINY_MODEL, **options, device=device)
    with torch.no_grad():
        layer = model.blocks[1].ffe
        if router == "sigmoid":
            layer.router.selection_bias.copy_(torch.tensor([-10.0, 0.1, 0, -0.1, 0.2]))
        else:
            # collinear rows: logits a_e * (u . x), a_0 = 0 never among the top two
            u = torch.randn(TINY_MODEL["d_model"], device=device) / TINY_MODEL["d_model"] ** 0.5
            a = torch.tensor([0.0, 1.0, 2.0, -1.0, -2.5], device=device)
            layer.router.weight.copy_(a[:, None] * u)
    ref = R.Transformer(**TINY_MODEL, **options, device=device, dtype=torch.float64)
    ref.load_state_dict(model.state_dict(), strict=True)
    tokens = torch.randint(0, TINY_MODEL["vocab_size"], (2, 13), device=device)
    logits, expected = model(tokens), ref(tokens)
    assert_close(logits, expected, torch.float32, "logits")
    aux, ref_aux = model.auxiliary_loss(), ref.auxiliary_loss()
    assert_close(aux, ref_aux, torch.float32, "auxiliary loss")
    loads = layer.router.load, ref.blocks[1].ffe.router.load
    assert torch.equal(*loads) and loads[0][0] == 0 and loads[0].sum() == 2 * 13 * 2
    g = torch.randn_like(expected)
    ((logits * g.float()).sum() + aux).backward()
    ((expected * g).sum() + ref_aux).backward()
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert_close(p.grad, ref_params[name].grad, torch.float32, f"grad of {name}")
    assert not layer.experts.gate_up.grad[0].any() and not layer.experts.down.grad[0].any()


def test_stacked_experts_are_the_seed_swiglu_experts(device):
    """reference.StackedExperts with the weights of E seed SwiGlu FFNs (reference.MoeExperts)
    gives their output, float64."""
    T, D, F, E, k = 9, 16, 8, 3, 2
    seed = R.MoeExperts(E, D, F, device=device, dtype=torch.float64)
    stacked = R.StackedExperts(E, D, F, device=device, dtype=torch.float64)
    with torch.no_grad():
        stacked.gate_up.copy_(seed.stacked()[0])
        stacked.down.copy_(seed.stacked()[1])
    x = torch.randn(T, D, device=device, dtype=torch.float64)
    ids = torch.rand(T, E, device=device).argsort(dim=1)[:, :k]
    weights = torch.rand(T, k, device=device, dtype=torch.float64)
    torch.testing.assert_close(stacked(x, ids, weights), seed(x, ids, weights), rtol=0, atol=1e-12)


def test_router_and_losses_by_hand(device):
    """Two tokens, three experts, k = 1, float64: the softmax router's choice and weights, the
    balance loss E sum_e f_e P_e and the z-loss, written out; the sigmoid router chooses by the
    biased scores and weights by the unbiased ones."""
    layer = R.MoeLayer(2, 3, 1, 4, router="softmax", normalize_top_k=False, dtype=torch.float64)
    layer.to(device)
    with torch.no_grad():
        layer.router.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]))
    x = torch.tensor([[2.0, 0.0], [0.0, 1.0]], device=device, dtype=torch.float64)
    layer(x)
    logits = x  # W picks the coordinates; the third logit is 0
    logits = torch.cat((logits, torch.zeros(2, 1, device=device, dtype=torch.float64)), 1)
    probs = logits.exp() / logits.exp().sum(1, keepdim=True)
    share = torch.tensor([0.5, 0.5, 0.0], device=device, dtype=torch.float64)  # 1 token each
    balance = 3 * (share * probs.mean(0)).sum()
    z = (logits.exp().sum(1).log() ** 2).mean()
    assert torch.allclose(layer.losses["balance"], balance) and torch.allclose(layer.losses["z"], z)
    ids, weights, _ = layer.router(x)
    assert ids.flatten().tolist() == [0, 1]
    assert torch.allclose(weights.flatten(), probs[[0, 1], [0, 1]])
    sigmoid = R.Router(2, 3, 1, "sigmoid", normalize_top_k=False, dtype=torch.float64).to(device)
    with torch.no_grad():
        sigmoid.weight.copy_(layer.router.weight)
        sigmoid.selection_bias.copy_(torch.tensor([0.0, 0.0, 2.0]))
    ids, weights, _ = sigmoid(x)
    assert ids.flatten().tolist() == [2, 2]  # sigmoid(0) + 2 beats sigmoid(2), sigmoid(1)
    assert torch.allclose(weights, torch.full_like(weights, 0.5))  # sigmoid(0), unbiased


def test_bias_update_steps_toward_balance(device):
    """b_e += rate * sign(mean load - load_e) from the counts of the step, which are reset; the
    softmax router has no bias."""
    model = R.Transformer(**TINY_MODEL, num_experts=4, experts_per_token=1, router="sigmoid",
                          router_bias_rate=0.25, device=device)  # fmt: skip
    routers = [layer.router for layer in model.moe_layers()]
    routers[0].load.copy_(torch.tensor([3.0, 1.0, 0.0, 4.0]))
    routers[1].load.copy_(torch.tensor([2.0, 2.0, 2.0, 2.0]))
    stats = model.update_router_bias()
    assert routers[0].selection_bias.tolist() == [-0.25, 0.25, 0.25, -0.25]
    assert routers[1].selection_bias.tolist() == [0.0] * 4
    assert all(not r.load.any() for r in routers) and stats["load_max_over_mean"] == 2.0


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(num_experts=2, experts_per_token=3), "experts_per_token"),
        (dict(num_experts=4, router="top1"), "router"),
        (dict(num_experts=4, first_dense_layers=2), "first_dense_layers"),
        (dict(num_experts=-1), "num_experts"),
        (dict(num_experts=4, aux_loss_coef=float("nan")), "aux_loss_coef"),
    ],
)
def test_bad_options(options, match):
    for cls in (R.Transformer, fastlm.Transformer):
        with pytest.raises(ValueError, match=match):
            cls(**TINY_MODEL, **options)
