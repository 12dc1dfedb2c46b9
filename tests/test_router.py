"""TopKRouter and MoEConfig against hand-written, per-token references."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from moe_ep.layers import MoEConfig, TopKRouter

HIDDEN = 32
NUM_TOKENS = 48


def make_router(seed: int = 0, **overrides) -> TopKRouter:
    settings = dict(hidden_size=HIDDEN, moe_intermediate_size=64, num_experts=16, num_experts_per_tok=4)
    settings.update(overrides)
    torch.manual_seed(seed)
    return TopKRouter(MoEConfig(**settings))


def random_tokens(seed: int = 1, num_tokens: int = NUM_TOKENS) -> torch.Tensor:
    return torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(seed))


def reference_route_token(logits: list[float], cfg: MoEConfig, bias: list[float], mask_value: float = -math.inf):
    """One token's (experts, weights) by the definitions, with plain Python lists."""
    num_experts, per_group = cfg.num_experts, cfg.num_experts // cfg.n_group
    if cfg.score_func == "sigmoid":
        scores = [1 / (1 + math.exp(-v)) for v in logits]
    elif cfg.softmax_before_topk:
        total = sum(math.exp(v) for v in logits)
        scores = [math.exp(v) / total for v in logits]
    else:
        scores = list(logits)
    choice = [s + (b if cfg.enable_expert_bias else 0.0) for s, b in zip(scores, bias)]
    if cfg.n_group > 1:
        group_score = [sum(sorted(choice[g * per_group:(g + 1) * per_group], reverse=True)[:cfg.group_score_topk])
                       for g in range(cfg.n_group)]
        kept = sorted(range(cfg.n_group), key=lambda g: -group_score[g])[:cfg.topk_group]
        choice = [c if e // per_group in kept else mask_value for e, c in enumerate(choice)]
    experts = sorted(range(num_experts), key=lambda e: -choice[e])[:cfg.num_experts_per_tok]
    weights = [scores[e] for e in experts]
    if cfg.score_func == "softmax" and not cfg.softmax_before_topk:
        total = sum(math.exp(w) for w in weights)
        weights = [math.exp(w) / total for w in weights]
    elif cfg.norm_topk_prob:
        total = sum(weights)
        weights = [w / total for w in weights]
    return experts, [w * cfg.routed_scaling_factor for w in weights]


def reference_route(router: TopKRouter, x: torch.Tensor, mask_value: float = -math.inf):
    logits = F.linear(x.float(), router.weight.detach().float()).double().tolist()
    bias = router.expert_bias.double().tolist()
    return [reference_route_token(row, router.config, bias, mask_value) for row in logits]


def by_expert(idx: torch.Tensor, weights: torch.Tensor) -> list[dict[int, float]]:
    rows = zip(idx.tolist(), weights.tolist())
    return [{e: w for e, w in zip(row_idx, row_w) if e >= 0} for row_idx, row_w in rows]


def assert_matches_reference(router: TopKRouter, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> None:
    assert idx.dtype == torch.int64 and weights.dtype == torch.float32
    assert idx.shape == weights.shape == (x.size(0), router.config.num_experts_per_tok)
    got = by_expert(idx, weights)
    for token, (experts, ref_weights) in enumerate(reference_route(router, x)):
        assert sorted(got[token]) == sorted(experts), f"token {token}"
        for e, w in zip(experts, ref_weights):
            assert got[token][e] == pytest.approx(w, rel=1e-5, abs=1e-7), f"token {token} expert {e}"


ROUTING_CASES = {
    "softmax_before": dict(score_func="softmax"),
    "softmax_before_norm_scaled": dict(score_func="softmax", norm_topk_prob=True, routed_scaling_factor=2.5),
    "softmax_after": dict(score_func="softmax", softmax_before_topk=False),
    "sigmoid": dict(score_func="sigmoid"),
    "sigmoid_norm_scaled": dict(score_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5),
    "sigmoid_groups": dict(score_func="sigmoid", norm_topk_prob=True, n_group=4, topk_group=2),
    "softmax_groups_max": dict(score_func="softmax", n_group=8, topk_group=3),
    "softmax_after_groups": dict(score_func="softmax", softmax_before_topk=False, n_group=4, topk_group=2,
                                 group_score_topk=3),
}


@pytest.mark.parametrize("case", sorted(ROUTING_CASES))
def test_routing_matches_reference(case: str) -> None:
    router = make_router(**ROUTING_CASES[case]).eval()
    x = random_tokens()
    idx, weights = router(x)
    assert_matches_reference(router, x, idx, weights)


def test_normalisation_and_scaling_change_weights_as_defined() -> None:
    x = random_tokens()
    _, plain = make_router(score_func="sigmoid").eval()(x)
    _, normed = make_router(score_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5).eval()(x)
    torch.testing.assert_close(normed.sum(-1), torch.full((x.size(0),), 2.5))
    torch.testing.assert_close(normed, 2.5 * plain / plain.sum(-1, keepdim=True))


def test_group_scores_default_to_top2_sum_for_sigmoid() -> None:
    assert MoEConfig(HIDDEN, 64, 16, 4, score_func="sigmoid", n_group=4, topk_group=2).group_score_topk == 2
    assert MoEConfig(HIDDEN, 64, 16, 4, score_func="softmax", n_group=4, topk_group=2).group_score_topk == 1


def test_negative_bias_groups_masked_with_minus_inf() -> None:
    """All choice scores negative: filling masked groups with 0 would pick experts from them."""
    router = make_router(score_func="sigmoid", n_group=4, topk_group=1, num_experts_per_tok=3,
                         enable_expert_bias=True).eval()
    router.expert_bias.copy_(-2.0 - torch.rand(16, generator=torch.Generator().manual_seed(3)))
    x = random_tokens()
    idx, weights = router(x)
    assert_matches_reference(router, x, idx, weights)
    groups = idx // 4
    assert (groups == groups[:, :1]).all(), "every expert must come from the single kept group"
    # The 0-fill variant really differs here, so this test can tell the two apart.
    wrong = [sorted(experts) for experts, _ in reference_route(router, x, mask_value=0.0)]
    assert wrong != [sorted(row) for row in idx.tolist()]


def test_bias_steers_selection_but_not_weights() -> None:
    router = make_router(score_func="sigmoid", enable_expert_bias=True).eval()
    x = random_tokens()
    router.expert_bias[5] = 10.0
    idx, weights = router(x)
    assert (idx == 5).any(-1).all()
    assert_matches_reference(router, x, idx, weights)
    scores = torch.sigmoid(F.linear(x, router.weight.detach()))
    torch.testing.assert_close(weights, scores.gather(1, idx))


def test_bias_update_from_given_counts_with_centering() -> None:
    router = make_router(enable_expert_bias=True, expert_bias_update_rate=0.01, center_expert_bias=True).train()
    counts = torch.randint(0, 50, (16,), generator=torch.Generator().manual_seed(0))
    counts[0] = counts.float().mean().round().long() + 100  # at least one strictly above the mean
    step = 0.01 * torch.sign(counts.float().mean() - counts.float())
    router.update_expert_bias(counts)
    torch.testing.assert_close(router.expert_bias, step - step.mean())
    assert router.expert_bias[0] < 0

    uncentered = make_router(enable_expert_bias=True, expert_bias_update_rate=0.01).train()
    uncentered.update_expert_bias(counts)
    uncentered.update_expert_bias(counts)
    torch.testing.assert_close(uncentered.expert_bias, 2 * step)


def test_bias_update_uses_counts_accumulated_in_forward_and_skips_eval() -> None:
    router = make_router(enable_expert_bias=True, expert_bias_update_rate=0.1).train()
    x1, x2 = random_tokens(1), random_tokens(2)
    idx1, _ = router(x1)
    idx2, _ = router(x2)
    counts = torch.bincount(torch.cat([idx1, idx2]).flatten(), minlength=16).float()
    torch.testing.assert_close(router.local_tokens_per_expert, counts)

    router.eval()
    router(random_tokens(3))
    router.update_expert_bias()
    assert router.expert_bias.abs().sum() == 0, "eval must neither count nor update"
    torch.testing.assert_close(router.local_tokens_per_expert, counts)

    router.train()
    router.update_expert_bias()
    torch.testing.assert_close(router.expert_bias, 0.1 * torch.sign(counts.mean() - counts))
    assert router.local_tokens_per_expert.abs().sum() == 0, "accumulated counts are cleared"


def _bias_update_on_rank(rank: int, world: int, local_counts: list[list[float]]) -> torch.Tensor:
    router = make_router(enable_expert_bias=True, expert_bias_update_rate=0.5, num_experts=4, num_experts_per_tok=2)
    router.train().update_expert_bias(torch.tensor(local_counts[rank]))
    return router.expert_bias.clone()


def test_bias_update_all_reduces_counts_over_the_group(dist_pool) -> None:
    # Rank-local counts would push expert 0 down on rank 0 and up on rank 1; globally it is overloaded.
    local_counts = [[9.0, 1.0, 1.0, 1.0], [4.0, 6.0, 1.0, 5.0]]
    biases = dist_pool(2).run(_bias_update_on_rank, local_counts)
    total = torch.tensor(local_counts).sum(0)
    expected = 0.5 * torch.sign(total.mean() - total)
    for bias in biases:
        torch.testing.assert_close(bias, expected)
    rank1_alone = torch.tensor(local_counts[1])
    assert not torch.equal(expected, 0.5 * torch.sign(rank1_alone.mean() - rank1_alone))


def explicit_aux_losses(logits: torch.Tensor, idx: torch.Tensor, cfg: MoEConfig, seq_len: int) -> dict:
    """The three losses written out with loops over experts and sequences."""
    num_tokens, num_experts, k = logits.size(0), cfg.num_experts, cfg.num_experts_per_tok
    if cfg.score_func == "softmax":
        probs = torch.softmax(logits, -1)
    else:
        probs = torch.sigmoid(logits)
        probs = probs / probs.sum(-1, keepdim=True)

    def balance(rows: slice) -> torch.Tensor:
        count = rows.stop - rows.start
        total = 0
        for e in range(num_experts):
            fraction = num_experts / (k * count) * (idx[rows] == e).sum()
            total = total + fraction * probs[rows, e].mean()
        return total

    sequences = [balance(slice(s, s + seq_len)) for s in range(0, num_tokens, seq_len)]
    return {
        "aux_loss": cfg.aux_loss_coeff * balance(slice(0, num_tokens)),
        "seq_aux_loss": cfg.seq_aux_loss_coeff * sum(sequences) / len(sequences),
        "z_loss": cfg.z_loss_coeff * (torch.logsumexp(logits, -1) ** 2).mean(),
    }


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_aux_losses_add_gradient_without_changing_output(score_func: str) -> None:
    coeffs = dict(aux_loss_coeff=0.3, seq_aux_loss_coeff=0.2, z_loss_coeff=0.05)
    with_aux = make_router(score_func=score_func, norm_topk_prob=True, **coeffs).train()
    without = make_router(score_func=score_func, norm_topk_prob=True).train()
    x, seq_len = random_tokens(), 12
    upstream = torch.randn(NUM_TOKENS, 4, generator=torch.Generator().manual_seed(7))

    idx, weights = with_aux(x, seq_len=seq_len)
    idx_ref, weights_ref = without(x)
    assert torch.equal(idx, idx_ref) and torch.equal(weights, weights_ref)
    (weights * upstream).sum().backward()

    logits = F.linear(x, without.weight)
    explicit = explicit_aux_losses(logits, idx_ref, with_aux.config, seq_len)
    ((weights_ref * upstream).sum() + sum(explicit.values())).backward()
    torch.testing.assert_close(with_aux.weight.grad, without.weight.grad, rtol=1e-5, atol=1e-7)
    assert set(with_aux.last_aux_losses) == set(explicit)
    for name, value in explicit.items():
        torch.testing.assert_close(with_aux.last_aux_losses[name], value.detach())
    # The aux losses do move the gradient (otherwise this test could not fail).
    plain = make_router(score_func=score_func, norm_topk_prob=True).train()
    (plain(x)[1] * upstream).sum().backward()
    assert (plain.weight.grad - with_aux.weight.grad).abs().max() > 1e-4


def test_aux_loss_scale_multiplies_injected_gradient() -> None:
    x = random_tokens()
    grads = []
    for scale in (1.0, 0.25):
        router = make_router(z_loss_coeff=0.1).train()
        router.aux_loss_scale = scale
        router(x)[1].sum().backward()
        grads.append(router.weight.grad)
    plain = make_router().train()
    plain(x)[1].sum().backward()
    injected = [grad - plain.weight.grad for grad in grads]
    torch.testing.assert_close(injected[1], 0.25 * injected[0], rtol=1e-4, atol=1e-6)


def test_no_aux_losses_in_eval() -> None:
    router = make_router(aux_loss_coeff=0.3, z_loss_coeff=0.1).eval()
    router(random_tokens())
    assert router.last_aux_losses == {}


def reference_keep(idx: torch.Tensor, weights: torch.Tensor, capacity: int, policy: str) -> torch.Tensor:
    keep = torch.zeros_like(idx, dtype=torch.bool)
    for e in range(int(idx.max()) + 1):
        slots = [(t, j) for t in range(idx.size(0)) for j in range(idx.size(1)) if idx[t, j] == e]
        if policy == "probs":
            slots.sort(key=lambda s: -float(weights[s]))
        for t, j in slots[:capacity]:
            keep[t, j] = True
    return keep


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_dropping(policy: str) -> None:
    x = random_tokens()
    router = make_router(capacity_factor=0.75, drop_policy=policy).eval()
    with torch.no_grad():
        free_idx, free_weights = make_router().eval()(x)
        idx, weights = router(x)
    capacity = math.ceil(NUM_TOKENS * 4 / 16 * 0.75)
    keep = reference_keep(free_idx, free_weights, capacity, policy)
    assert 0 < (~keep).sum() < keep.numel(), "the data must drop some but not all slots"
    assert torch.equal(idx, torch.where(keep, free_idx, -1))
    assert torch.equal(weights, torch.where(keep, free_weights, 0.0))
    load = torch.bincount(idx[idx >= 0], minlength=16)
    assert load.max() <= capacity
    metrics = router.last_metrics
    assert torch.equal(metrics["tokens_per_expert"], load)
    assert int(metrics["num_dropped"]) == int((~keep).sum())
    torch.testing.assert_close(metrics["max_over_mean_load"], load.max().float() / load.float().mean())


def test_jitter_only_in_training() -> None:
    x = random_tokens()
    plain = make_router().eval()
    jittery = make_router(input_jitter_eps=0.2)
    eval_out = jittery.eval()(x)
    assert all(torch.equal(a, b) for a, b in zip(eval_out, plain(x)))
    torch.manual_seed(11)
    train_weights = jittery.train()(x)[1]
    assert not torch.equal(train_weights, plain(x)[1])


@pytest.mark.parametrize("overrides, field", [
    (dict(n_group=3), "n_group"),
    (dict(n_group=4, topk_group=5), "topk_group"),
    (dict(n_group=4, topk_group=1, num_experts_per_tok=5), "num_experts_per_tok"),
    (dict(score_func="relu"), "score_func"),
    (dict(hidden_size=96, use_fp8_dispatch=True), "hidden_size"),
    (dict(moe_intermediate_size=96, use_fp8_experts=True), "moe_intermediate_size"),
    (dict(use_fp8_dispatch=True, use_fp8_weight_grads=True), "use_fp8_weight_grads"),
    (dict(capacity_factor=0.0), "capacity_factor"),
    (dict(drop_policy="random"), "drop_policy"),
    (dict(shared_expert_gate=True), "shared_expert_gate"),
    (dict(aux_loss_coeff=-1.0), "aux_loss_coeff"),
])
def test_config_errors_name_the_field(overrides: dict, field: str) -> None:
    settings = dict(hidden_size=128, moe_intermediate_size=128, num_experts=16, num_experts_per_tok=4)
    settings.update(overrides)
    with pytest.raises(ValueError, match=f"MoEConfig.{field}:"):
        MoEConfig(**settings)


def test_config_resolves_defaults() -> None:
    cfg = MoEConfig(128, 256, 16, 4, n_shared_experts=2, use_fp8_experts=True)
    assert cfg.shared_expert_intermediate_size == 512
    assert cfg.expert_alignment == 16
    assert MoEConfig(128, 256, 16, 4).expert_alignment == 8  # CUDA BF16 grouped GEMMs need 8-row groups


def test_gate_stays_fp32_under_autocast() -> None:
    router = TopKRouter(MoEConfig(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2))
    x = torch.randn(33, 64, generator=torch.Generator().manual_seed(4))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        idx_autocast, weights_autocast = router(x)
    idx, weights = router(x)
    assert torch.equal(idx_autocast, idx) and torch.equal(weights_autocast, weights)
