"""The MoE block: router, auxiliary losses, permutation and capacity, the expert implementations against each
other inside the model, the sigmoid router's bias balancing, window metrics, KV-cache decoding, training through
the trainer, and config validation."""

import json
import math

import pytest
import torch

from zero2all.config import ConfigError, ModelConfig, MoEConfig, OpsConfig, load_config
from zero2all.model.io import load_model
from zero2all.model.moe import (
    MoE,
    Router,
    balanced_bias,
    expert_capacity,
    expert_counts,
    load_balancing_loss,
    moe_layers,
    moe_window_metrics,
    permute,
    router_z_loss,
    unpermute,
    update_router_biases,
)
from zero2all.model.z2all import build_model


def cfg(**moe) -> ModelConfig:
    base = dict(n_experts=6, top_k=2, n_shared_experts=1, expert_intermediate_size=20)
    base.update(moe)
    return ModelConfig(vocab_size=80, hidden_dim=32, intermediate_size=40, n_layers=3, n_heads=4, n_kv_heads=2,
                       max_seq_len=32, ops=OpsConfig.plain(), moe=MoEConfig(**base))


def test_softmax_router_renormalises_and_matches_the_formula():
    c = cfg()
    router = Router(c)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(11, 32)
    r = router(x)
    probs = torch.softmax(x @ router.weight.T, dim=-1)
    top, idx = probs.topk(2, dim=-1)
    assert torch.equal(r.experts, idx)
    torch.testing.assert_close(r.weights, top / top.sum(-1, keepdim=True))
    c.moe.renormalize = False  # Qwen2-MoE's norm_topk_prob = false: the top-k probabilities as they are
    torch.testing.assert_close(router(x).weights, top)


def test_sigmoid_router_bias_selects_but_does_not_weight():
    router = Router(cfg(router="sigmoid"))
    torch.nn.init.normal_(router.weight)
    x = torch.randn(9, 32)
    before = router(x)
    router.expert_bias[3] = 100.0  # expert 3 is now always chosen...
    after = router(x)
    assert (after.experts == 3).any(-1).all()
    scores = torch.sigmoid(x @ router.weight.T)
    chosen = scores.gather(1, after.experts)
    torch.testing.assert_close(after.weights, chosen / chosen.sum(-1, keepdim=True))  # ...weighted by scores only
    assert not torch.equal(before.experts, after.experts)


def test_aux_losses():
    router = Router(cfg())
    torch.nn.init.normal_(router.weight)
    r = router(torch.randn(64, 32))
    f = torch.bincount(r.experts.flatten(), minlength=6).float() / r.experts.numel()
    torch.testing.assert_close(load_balancing_loss(r, 6), 6 * (f * r.probs.mean(0)).sum())
    # perfectly balanced uniform routing gives exactly 1
    uniform = type(r)(r.weights, torch.arange(12).view(6, 2) % 6, torch.zeros(6, 6), torch.full((6, 6), 1 / 6))
    assert load_balancing_loss(uniform, 6).item() == pytest.approx(1.0)
    logits = torch.randn(5, 6)
    torch.testing.assert_close(router_z_loss(logits), (torch.logsumexp(logits, -1) ** 2).mean())


def test_permutation_round_trip_and_capacity():
    experts = torch.tensor([[0, 2], [2, 1], [2, 0], [1, 2]])
    weights = torch.rand(4, 2)
    perm = permute(experts, 3)
    assert perm.counts.tolist() == [2, 2, 4]
    x = torch.randn(4, 5)
    rows = x[perm.order // 2]
    out = unpermute(rows, perm, weights)  # identity experts: each token gets back its own row times sum(weights)
    torch.testing.assert_close(out, x * weights.sum(-1, keepdim=True))
    capped = permute(experts, 3, capacity=3)
    assert capped.counts.tolist() == [2, 2, 3] and capped.order.numel() == 7
    # the last token's slot to expert 2 (its 4th assignment) is the one dropped
    out = unpermute(x[capped.order // 2], capped, weights)
    torch.testing.assert_close(out[3], x[3] * weights[3, 0])
    assert expert_capacity(4, 2, 3, 1.25) == math.ceil(1.25 * 8 / 3)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_model_logits_and_grads_equal_across_expert_implementations(impl):
    if impl == "torch" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm needs torch >= 2.8")
    c = cfg(first_dense_layers=1, aux_loss_coef=0.01, z_loss_coef=1e-3)
    ref = build_model(c, seed=1)
    c2 = cfg(first_dense_layers=1, aux_loss_coef=0.01, z_loss_coef=1e-3)
    c2.ops.grouped_gemm = impl
    other = build_model(c2, seed=1)
    other.load_state_dict(ref.state_dict())
    x = torch.randint(0, 80, (3, 13))
    _, l1 = ref(x, x)
    _, l2 = other(x, x)
    l1.backward()
    l2.backward()
    torch.testing.assert_close(l2, l1, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(ref.named_parameters(), other.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_aux_loss_is_added_to_the_training_loss_only():
    c = cfg(aux_loss_coef=0.5, z_loss_coef=0.1)
    model = build_model(c, seed=0)
    plain = build_model(cfg(), seed=0)
    x = torch.randint(0, 80, (2, 9))
    _, with_aux = model(x, x)
    _, without = plain(x, x)
    extra = sum(m.aux_loss for _, m in moe_layers(model))
    torch.testing.assert_close(with_aux, without + extra)
    model.eval()
    _, evaluated = model(x, x)
    torch.testing.assert_close(evaluated, without)  # evaluation: the language-model loss alone


def test_bias_update_moves_against_the_load_and_metrics_report_it():
    model = build_model(cfg(router="sigmoid", bias_update_rate=0.1, capacity_factor=1.0), seed=0)
    x = torch.randint(0, 80, (4, 16))
    model(x, x)
    loads = [m.step_load.clone() for _, m in moe_layers(model)]
    metrics = moe_window_metrics(model)
    update_router_biases(model)
    for (i, moe), load in zip(moe_layers(model), loads):
        expected = 0.1 * torch.sign(load.mean() - load)
        torch.testing.assert_close(moe.router.expert_bias, expected)
        assert moe.step_load.sum() == 0 and moe.load.sum() == 0
        share = load / load.sum()
        assert metrics[f"moe/layer{i}/load_max"] == pytest.approx(float(load.max() / load.mean()))
        assert metrics[f"moe/layer{i}/load_entropy"] == pytest.approx(
            float(-(share * share.clamp_min(1e-30).log()).sum() / math.log(6)), rel=1e-6)
        assert 0 <= metrics[f"moe/layer{i}/dropped"] < 1 and metrics[f"moe/layer{i}/z_loss"] > 0
    assert moe_window_metrics(model) == {}  # the window restarted


def test_kv_cache_decoding_matches_the_full_forward():
    model = build_model(cfg(first_dense_layers=1), seed=2).eval()
    tokens = torch.randint(0, 80, (2, 14))
    with torch.no_grad():
        full, _ = model(tokens)
        cache = model.new_kv_cache(2, 32)
        steps = [model(tokens[:, :5], kv_cache=cache, start_pos=0)[0]]
        for t in range(5, 14):
            steps.append(model(tokens[:, t:t + 1], kv_cache=cache, start_pos=t)[0])
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=0)


def test_trainer_logs_moe_metrics(tmp_path):
    from test_trainer import tiny_cfg

    from zero2all.train.trainer import Trainer

    c = tiny_cfg(tmp_path / "run", "model.moe.n_experts=4", "model.moe.top_k=2", "model.moe.router='sigmoid'",
                 "model.moe.expert_intermediate_size=24", "model.moe.z_loss_coef=0.001",
                 "model.ops.grouped_gemm='loop'", "train.log_every=3", "train.max_steps=6", "train.micro_batch_size=4")
    Trainer(c, show_progress=False).fit()
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["kind"] == "train"]
    logged = [r["step"] for r in train if "moe/layer0/load_max" in r]
    assert logged == [3, 6]
    r = train[-1]
    assert r["moe/layer1/load_max"] >= 1 >= r["moe/layer1/load_min"] >= 0 and 0 < r["moe/layer1/load_entropy"] <= 1
    assert r["moe/layer1/dropped"] == 0  # dropless
    model = load_model(tmp_path / "run" / "final")
    assert isinstance(model.layers[0].mlp, MoE)
    assert model.layers[0].mlp.router.expert_bias.abs().sum() > 0  # the balancing bias was saved with the model


def test_config_validation_names_the_field():
    with pytest.raises(ConfigError, match="model.moe.top_k"):
        cfg(top_k=7).validate()
    with pytest.raises(ConfigError, match="model.moe.router"):
        cfg(router="hash").validate()
    with pytest.raises(ConfigError, match="shared_expert_gate"):
        cfg(n_shared_experts=0, shared_expert_gate=True).validate()
    with pytest.raises(ConfigError, match="balance_iters=4 solves the sigmoid router"):
        cfg(balance_iters=4).validate()
    with pytest.raises(ConfigError, match="model.moe.balance_iters: must be >= 0"):
        cfg(router="sigmoid", balance_iters=-1).validate()
    # combinations are the plan's to refuse (before any process group): zero2all/distributed/plan.py
    from zero2all.distributed.plan import resolve

    with pytest.raises(ConfigError, match="parallel.ep=4 does not divide model.moe.n_experts=6"):
        resolve(load_config("tiny-moe", ["model.moe.n_experts=6", "parallel.ep=4"]), 4)
    with pytest.raises(ConfigError, match="parallel.ep=2 needs parallel.mode = fsdp"):
        resolve(load_config("tiny-moe", ["parallel.ep=2", "parallel.mode='ddp'"]), 2)
    assert load_config("tiny-moe").model.moe.enabled and not load_config("tiny").model.moe.enabled


def test_estimate_counts_match_the_model_and_the_cli_prints_them(capsys):
    from zero2all.accounting.moe import moe_estimate, moe_param_counts
    from zero2all.cli import main

    for c in (cfg(first_dense_layers=1, moe_every=2), cfg(shared_expert_gate=True), load_config("z2all-moe-1b").model):
        model = build_model(c, device="meta")
        p = moe_param_counts(c)
        assert p.total == model.num_params()
        experts = sum(m.experts.gate_up_proj.numel() + m.experts.down_proj.numel() for _, m in moe_layers(model))
        assert p.experts == experts
        k, E = c.moe.top_k, c.moe.n_experts
        assert p.active == p.total - experts + experts * k // E  # the routed share a token uses: k of E
    est = moe_estimate(load_config("z2all-moe-1b").model, gpus=8, ep=4, micro_batch_size=2, seq_len=128)
    # 16 MoE layers x 256 tokens x top-2 x 1024 x 2 bytes, 4 exchanges, 3/4 of the rows leave the GPU
    assert est["communication"]["all_to_all_bytes_per_step_per_gpu"] == 4 * 16 * 256 * 2 * 1024 * 2 * 3 / 4
    assert est["memory_per_gpu"]["experts_per_gpu"] == 4
    with pytest.raises(ConfigError, match="--ep 3"):
        moe_estimate(load_config("z2all-moe-1b").model, gpus=8, ep=3)
    main(["estimate", "--config", "z2all-moe-1b", "--gpus", "8", "--ep", "8"])
    out = capsys.readouterr().out
    assert "parameters total / active" in out and "987,661,312 / 283,018,240" in out and "all-to-all" in out


def test_generation_and_continuous_batching_with_a_moe_model():
    from standin_tokenizer import ByteTokenizer

    from zero2all.infer.generate import Generator, SamplingParams
    from zero2all.infer.scheduler import Scheduler

    c = ModelConfig(vocab_size=260, hidden_dim=32, intermediate_size=40, n_layers=2, n_heads=4, n_kv_heads=2,
                    max_seq_len=64, initializer_range=0.3, ops=OpsConfig.plain(),
                    moe=MoEConfig(n_experts=4, top_k=2, n_shared_experts=1, expert_intermediate_size=16))
    model = build_model(c, seed=0).eval()
    prompts = [[5, 9, 200], list(range(30, 41)), [7]]
    params = SamplingParams(max_new_tokens=8, temperature=0, stop_token_ids=[])

    def alone(prompt):
        seq = list(prompt)
        with torch.no_grad():
            for _ in range(8):
                seq.append(int(model(torch.tensor([seq]))[0][0, -1].argmax()))
        return seq[len(prompt):]

    want = [alone(p) for p in prompts]
    assert [o.token_ids for o in Generator(model).generate(prompts, params)] == want
    sched = Scheduler(Generator(model, ByteTokenizer()), max_batch=2, cache_len=32, max_queue=8)
    try:
        subs = [sched.submit([p], params) for p in prompts]
        got = [[e.token_id for e in sub.events()] for sub in subs]
    finally:
        sched.stop()
    assert got == want


def test_gguf_export_refuses_moe(tmp_path):
    from zero2all.model.gguf import export_gguf

    pytest.importorskip("gguf")
    with pytest.raises(ConfigError, match="GGUF export of mixture-of-experts"):
        export_gguf(None, tmp_path / "m.gguf", model=build_model(cfg(), seed=0))


def test_mfu_counts_the_active_parameters():
    from zero2all.accounting import mfu_flops_per_token
    from zero2all.accounting.moe import moe_param_counts

    c = load_config("z2all-moe-1b").model
    n_active = moe_param_counts(c).active_non_embedding
    assert n_active == 217_154_560  # attention + routers + 2 of 16 experts + LM head, 16 layers
    assert mfu_flops_per_token(c, 2048) == 6 * n_active + 6 * 16 * 1024 * 2048  # causal attention: half of s^2


def _clustered_scores(n_tokens, n_experts, seed):
    """Sigmoid scores with a low-rank structure and per-expert offsets: far from balanced under a zero bias."""
    g = torch.Generator().manual_seed(seed)
    low = torch.randn(n_tokens, 8, generator=g) @ torch.randn(8, n_experts, generator=g)
    return torch.sigmoid(0.8 * low + torch.linspace(-1.0, 1.0, n_experts) + 0.3 * torch.randn(n_experts, generator=g))


def _max_over_mean(scores, bias, k):
    counts = expert_counts((scores + bias).topk(k, dim=-1).indices, scores.shape[1]).float()
    return float(counts.max() / counts.mean())


@pytest.mark.parametrize("n_tokens,n_experts,k,seed", [(2048, 8, 2, 0), (1537, 16, 2, 1), (999, 12, 3, 2),
                                                       (4096, 64, 6, 3)])
def test_balanced_bias_balances_the_batch(n_tokens, n_experts, k, seed):
    from zero2all.model import moe as moe_module

    scores = _clustered_scores(n_tokens, n_experts, seed)
    start = 0.05 * torch.randn(n_experts, generator=torch.Generator().manual_seed(seed))
    before = _max_over_mean(scores, start, k)
    assert before > 1.4   # the case is a real test: unbalanced to begin with
    bias = balanced_bias(scores, start, k, 16)
    assert _max_over_mean(scores, bias, k) <= 1.05
    # never worse than where it started, at any number of rounds; 0 rounds return the bias itself
    for rounds in (1, 2, 3):
        assert _max_over_mean(scores, balanced_bias(scores, start, k, rounds), k) <= before
    assert balanced_bias(scores, start, k, 0) is start
    # the column selection methods give the same bias
    results = []
    for method in ("topk", "sort", "kthvalue"):
        old, moe_module.EDGE_METHOD = moe_module.EDGE_METHOD, method
        try:
            results.append(balanced_bias(scores, start, k, 4))
        finally:
            moe_module.EDGE_METHOD = old
    assert all(torch.equal(r, results[0]) for r in results)


def test_balance_iters_balances_training_batches_and_keeps_the_running_bias_learning():
    model = build_model(cfg(router="sigmoid", bias_update="error", bias_update_rate=0.05, balance_iters=16), seed=0)
    layers = moe_layers(model)
    with torch.no_grad():  # a router that strongly prefers two experts
        for _, moe in layers:
            moe.router.weight[:2] += 0.5
    x = torch.randint(0, 80, (8, 32))
    model.train()
    model(x, x)
    for _, moe in layers:
        routing_load = moe.step_load
        assert float(routing_load.max() / routing_load.mean()) <= 1.1
        base = moe.bias_load   # what the running bias alone would have chosen: unbalanced
        assert float(base.max() / base.mean()) > 1.3
        assert routing_load.sum() == base.sum()
        expected = 0.05 * ((base.mean() - base) / base.mean()).clamp(-1, 1)
        moe._expected = expected.clone()
    update_router_biases(model)
    for _, moe in layers:
        torch.testing.assert_close(moe.router.expert_bias, moe._expected)
        assert moe.bias_load.sum() == 0 and moe.step_load.sum() == 0
    # evaluation routes with the running bias alone (no per-batch solve)
    model.eval()
    flat = torch.randn(64, 32)
    router = layers[0][1].router
    routing = router(flat)
    probs = torch.sigmoid(flat @ router.weight.t())
    assert torch.equal(routing.experts, (probs + router.expert_bias).topk(2, dim=-1).indices)
    assert router.base_counts is None
