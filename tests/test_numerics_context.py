"""The per-model numerics context (``kernels/numerics.py``): FP8 weight casts, amax histories and hints and the
step-fusion marks belong to one model, so two models in one process (an RL policy in FP8 with delayed scaling
and its reference in plain precision) never share them, and importing the package registers nothing on torch's
optimizers. Runs on CPU (the FP8 GEMMs as their float32 emulation)."""

import importlib
import pkgutil

import torch

from zero2all.config import OpsConfig, load_config
from zero2all.model.z2all import build_model


def tiny(precision="fp8_tensorwise", history=4, weight_cache="transposed"):
    cfg = load_config("tiny").model
    cfg.hidden_dim, cfg.intermediate_size, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads = 64, 96, 2, 4, 2
    cfg.ops = OpsConfig.plain()
    cfg.ops.fused_linear = "torch"
    cfg.ops.linear_precision = precision
    cfg.ops.fp8_amax_history = history if precision == "fp8_tensorwise" else 0
    cfg.ops.fp8_weight_cache = weight_cache
    return cfg


def batches(n=3):
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(n):
        t = torch.randint(0, 8192, (2, 16), generator=gen)
        out.append((t, t.roll(-1, 1)))
    return out


def micro_batch_losses(model, data):
    losses = []
    for tokens, targets in data:
        _, loss = model(tokens, targets)
        loss.backward()
        losses.append(loss.item())
    return losses


def test_a_second_model_does_not_change_the_first():
    """A policy with FP8 delayed scaling runs micro-batches; a reference model (another precision, other FP8
    options) is built and run between them. The policy's losses and gradients are those of a run without the
    reference, bit for bit: its recorded maxima were neither reset nor resized nor fed by the other model."""
    data = batches()
    alone = build_model(tiny(), seed=0)
    want = micro_batch_losses(alone, data)
    want_grads = [p.grad.clone() for p in alone.parameters() if p.grad is not None]

    policy = build_model(tiny(), seed=0)
    got = micro_batch_losses(policy, data[:1])
    for other in (tiny("bf16"), tiny(history=0, weight_cache="both"), tiny(history=8)):
        ref = build_model(other, seed=1)
        with torch.no_grad():
            ref(data[0][0], data[0][1])
    got += micro_batch_losses(policy, data[1:])
    assert got == want
    grads = [p.grad for p in policy.parameters() if p.grad is not None]
    assert all(torch.equal(a, b) for a, b in zip(grads, want_grads))


def test_each_model_owns_its_options_and_history():
    policy, ref = build_model(tiny(history=4), seed=0), build_model(tiny(history=8, weight_cache="both"), seed=1)
    plain = build_model(tiny("bf16"), seed=2)
    assert policy.numerics is not ref.numerics
    assert policy.numerics.amax_history.length == 4 and ref.numerics.amax_history.length == 8
    assert not policy.numerics.weight_casts.keep_forward and ref.numerics.weight_casts.keep_forward
    assert plain.numerics.amax_history.length == 0
    (tokens, targets), = batches(1)
    for model in (policy, ref):
        _, loss = model(tokens, targets)
        loss.backward()
    mine = {id(p) for p in policy.parameters()}
    theirs = {id(p) for p in ref.parameters()}
    sites = policy.numerics.amax_history._sites
    assert len(sites) == 2 * 4 * policy.cfg.n_layers            # (weight, "x") and (weight, "g") per linear
    assert all(s.ref() is not None and id(s.ref()) in mine for s in sites.values())
    assert all(id(s.ref()) in theirs for s in ref.numerics.amax_history._sites.values())
    assert all(s.buf.numel() == 5 for s in sites.values())
    assert all(s.buf.numel() == 9 for s in ref.numerics.amax_history._sites.values())
    assert policy.numerics.weight_casts._entries and ref.numerics.weight_casts._entries
    assert not plain.numerics.weight_casts._entries and not plain.numerics.amax_history._sites
    # the saturation counts too: the reference's casts never land in the policy's logging window
    assert policy.numerics.fp8_stats.read() and ref.numerics.fp8_stats.read()
    with torch.no_grad():
        ref(tokens, targets)
    assert policy.numerics.fp8_stats.read() == {} and ref.numerics.fp8_stats.read()


def test_cache_invalidation_is_registered_on_the_trainers_optimizer_only():
    model = build_model(tiny(), seed=0)
    (tokens, targets), = batches(1)
    _, loss = model(tokens, targets)
    loss.backward()
    assert model.numerics.weight_casts._entries
    other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    other.step()                                # an optimizer the context was not attached to: no effect
    assert model.numerics.weight_casts._entries
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.numerics.attach(opt)
    opt.step()
    assert not model.numerics.weight_casts._entries


def test_importing_the_package_registers_no_global_optimizer_hook():
    import zero2all
    import zero2all.kernels

    for info in pkgutil.walk_packages(zero2all.__path__, "zero2all."):
        if info.name.startswith(("zero2all.kernels", "zero2all.model", "zero2all.train")):
            importlib.import_module(info.name)
    from torch.optim import optimizer

    assert not optimizer._global_optimizer_pre_hooks
    assert not optimizer._global_optimizer_post_hooks


def test_new_embeddings_keeps_its_rows_undecayed_without_marking_the_parameters(tmp_path):
    """``train.trainable = new_embeddings``: the embedding and the LM head get no weight decay (their old rows
    must stay bit for bit), decided by the optimizer from the setting, not by an attribute on the parameters."""
    import json

    from zero2all.config import load_config
    from zero2all.train.optim import build_optimizer
    from zero2all.train.trainable import apply_trainable

    (tmp_path / "z2all.json").write_text(json.dumps({"resize": {"old_vocab": 100}}))
    cfg = load_config("tiny")
    cfg.model.hidden_dim, cfg.model.intermediate_size, cfg.model.n_layers = 32, 48, 1
    cfg.model.n_heads, cfg.model.n_kv_heads, cfg.model.tie_word_embeddings = 2, 1, False
    cfg.train.trainable, cfg.train.weight_decay = "new_embeddings", 0.1
    model = build_model(cfg.model, seed=0)
    apply_trainable(model, "new_embeddings", str(tmp_path))
    assert not any(vars(p) for p in model.parameters())            # nothing hung on the parameters
    for optimizer in ("adamw", "muon"):
        cfg.train.optimizer = optimizer
        groups = build_optimizer(model, cfg.train, torch.device("cpu")).param_groups
        names = {n: g["weight_decay"] for g in groups for n in g["names"]}
        assert names == {"embed_tokens.weight": 0.0, "lm_head.weight": 0.0}, (optimizer, names)


def test_the_rl_reference_copy_gets_a_context_of_its_own():
    """RL's frozen reference is a deep copy of the policy: the copy gets a fresh context with the same options
    (its own handle, no shared cache or history), and running it leaves the policy's recorded maxima as they were."""
    from zero2all.train.rl import frozen_reference

    data = batches()
    policy = build_model(tiny(), seed=0)
    micro_batch_losses(policy, data[:1])
    sites = {k: (s.n, s.buf.clone()) for k, s in policy.numerics.amax_history._sites.items()}
    reference = frozen_reference(policy)
    nx, rx = policy.numerics, reference.numerics
    assert rx is not nx and rx.handle != nx.handle and rx.options == nx.options
    assert all(block.numerics is rx for block in reference.layers)
    assert not rx.weight_casts._entries and not rx.amax_history._sites
    with torch.no_grad():
        reference(*data[1])
    assert rx.amax_history._sites
    assert {k: s.n for k, s in nx.amax_history._sites.items()} == {k: n for k, (n, _) in sites.items()}
    assert all(torch.equal(nx.amax_history._sites[k].buf, buf) for k, (_, buf) in sites.items())
