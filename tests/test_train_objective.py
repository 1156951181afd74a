"""The training objective (spec training.md §1-2): corruption statistics, loss support, leakage, learning."""

import pytest
import torch

import blockpress
from blockpress.kernels import use
from blockpress.train import objective as obj
from blockpress.train.sizes import model_config

V, C = 16, 8



def tiny(seed=0):
    lm = blockpress.from_config(model_config("nano", vocab_size=V, canvas_length=C, context=16), seed=seed)
    use(lm.module, attention="eager")
    return lm


def examples(n=4, prompt=5, resp=(8, 12, 20, 3), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(5, V, (prompt + i % 2,), generator=g).tolist(),
             torch.randint(5, V, (resp[i % len(resp)],), generator=g).tolist()) for i in range(n)]


def test_corruption_rate_matches_t():
    g = torch.Generator().manual_seed(0)
    x0 = torch.randint(0, V, (4000, 64), generator=g)
    for tv in (0.1, 0.5, 0.9):
        t = torch.full((4000,), tv)
        xt, rep = obj.corrupt(x0, t, V, g)
        n = rep.numel()
        sigma = (tv * (1 - tv) / n) ** 0.5
        assert abs(rep.float().mean().item() - tv) < 5 * sigma
        # a replaced position draws uniformly over the whole vocabulary (the original included)
        changed = (xt != x0).float().mean().item()
        assert abs(changed - tv * (1 - 1 / V)) < 0.01
        assert torch.equal(xt[~rep], x0[~rep])
        assert xt[rep].bincount(minlength=V).float().div(rep.sum()).sub(1 / V).abs().max() < 0.01


def test_swap_noise_writes_tokens_of_the_same_canvas_at_kept_positions():
    """swap_rate: after the uniform draw, each kept (and not held) position takes, with prob swap_rate,
    the clean token of a random position of its own canvas; the uniform part is left as it was."""
    g0 = torch.Generator().manual_seed(0)
    B, L = 3000, 12
    x0 = torch.stack([torch.randperm(V, generator=g0)[:L] for _ in range(B)])  # distinct tokens per row
    t = torch.full((B,), 0.4)
    held = torch.zeros(B, L, dtype=torch.bool)
    held[:, :2] = True
    plain, rep0 = obj.corrupt(x0, t, V, torch.Generator().manual_seed(7), held)
    xs, rep = obj.corrupt(x0, t, V, torch.Generator().manual_seed(7), held, swap_rate=0.25)
    assert torch.equal(xs[rep0], plain[rep0]) and bool((rep0 <= rep).all())  # the uniform draws are untouched
    swapped = rep & ~rep0
    assert not (swapped & held).any() and torch.equal(xs[~rep], x0[~rep])
    kept = ~rep0 & ~held
    frac = swapped[kept].float().mean().item()
    assert abs(frac - 0.25) < 0.02, frac
    # every swapped token is one of its own canvas's clean tokens, at a random position (1/L: itself)
    rows = swapped.nonzero()[:, 0]
    assert bool((x0[rows] == xs[swapped][:, None]).any(1).all())
    same = (xs[swapped] == x0[swapped]).float().mean().item()
    assert abs(same - 1 / L) < 0.02, same
    # through collate: the config's rate reaches corrupt, and 0 keeps the plain objective's draws
    exs = [([2, 5], x0[i].tolist()) for i in range(64)]
    a = obj.collate(exs, L, V, obj.ObjectiveConfig(seed=1), step=3)
    b = obj.collate(exs, L, V, obj.ObjectiveConfig(seed=1, swap_rate=0.5), step=3)
    assert torch.equal(a.t, b.t) and torch.equal(a.canvas_noisy[a.replaced], b.canvas_noisy[a.replaced])
    assert int((b.replaced & ~a.replaced).sum()) > 0.3 * int((~a.replaced).sum())


def test_collate_per_example_t_and_determinism():
    cfg = obj.ObjectiveConfig(seed=3)
    exs = [([2, 5, 6], list(range(5, 13)))] * 400
    b = obj.collate(exs, C, V, cfg, step=7)
    assert (b.t >= cfg.eps).all() and (b.t < 1).all()
    # t is uniform: mean ~ 0.5, and each row's replaced fraction tracks its own t
    assert abs(b.t.mean().item() - 0.5) < 0.05
    frac = b.replaced.float().mean(1)
    assert torch.corrcoef(torch.stack([frac, b.t]))[0, 1] > 0.8
    assert abs(b.sc_mask.float().mean().item() - 0.5) < 0.1
    # noise depends only on (seed, step, global index): a shard equals the slice of the full batch
    shard = obj.collate(exs[100:200], C, V, cfg, step=7, first_index=100)
    assert torch.equal(shard.canvas_noisy, b.canvas_noisy[100:200])
    other = obj.collate(exs, C, V, cfg, step=8)
    assert not torch.equal(other.canvas_noisy, b.canvas_noisy)


def test_layout_aligns_context_and_selects_one_canvas():
    cfg = obj.ObjectiveConfig(seed=1)
    exs = examples(8)
    b = obj.collate(exs, C, V, cfg, step=0)
    T = b.ctx_len
    for i, (p, r) in enumerate(exs):
        row = b.input_ids[i][b.valid[i]].tolist()
        canv = obj.split_canvases(r, C, 1)
        assert row == p + [tok for c in canv for tok in c]  # EOS-filled response, nothing dropped
        # the clean copy of the selected canvas starts exactly at T in every row
        assert b.input_ids[i, T:T + C].tolist() == b.canvas_clean[i].tolist()
        assert b.canvas_clean[i].tolist() in canv
        # AR targets: response tokens only (ar_scope="response")
        lft = int(b.valid[i].long().argmax())
        assert not b.ar_target[i, :lft + len(p)].any() and b.ar_target[i, lft + len(p):lft + len(row)].all()


def _ar_reference(logits, batch):
    """The AR loss from every position's logits [B,S,V]: mean over rows of the mean CE at ar_target positions."""
    B, S, V = logits.shape
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), batch.input_ids[:, 1:].reshape(-1),
                                           reduction="none").view(B, S - 1)
    m = batch.ar_target[:, 1:].float()
    return ((ce * m).sum(1) / m.sum(1)).mean()


def _loss_grads(lm, batch, cfg):
    """The objective with the AR loss over every position's logits (the reference): -> (loss, their gradient)."""
    lm.module.zero_grad()
    h, cache = obj.encoder_pass(lm.module, batch)
    logits = lm.module.lm_logits(h)
    logits.retain_grad()
    loss = cfg.ar_weight * _ar_reference(logits, batch) + \
        obj.diffusion_loss(obj.decoder_logits(lm.module, batch, cache), batch)
    loss.backward()
    return loss, logits.grad


@pytest.mark.parametrize("scope", ["response", "all"])
def test_ar_loss_from_the_scored_positions_equals_all_positions(scope):
    """ar_loss makes logits only from the first scored position on: the loss and the encoder's gradients are those
    of the loss over every position's logits."""
    lm = tiny()
    cfg = obj.ObjectiveConfig(seed=0, ar_scope=scope)
    exs = [(list(range(5, 15)), [7] * 8), (list(range(6, 12)), [9] * 12)]
    b = obj.collate(exs, C, V, cfg, step=0)
    assert (b.ar_from > 1) == (scope == "response") and b.ar_target[:, b.ar_from].any() and \
        not b.ar_target[:, :b.ar_from].any()
    out = []
    for fn in (lambda h: obj.ar_loss(lm.module, h, b), lambda h: _ar_reference(lm.module.lm_logits(h), b)):
        lm.module.zero_grad()
        loss = fn(obj.encoder_pass(lm.module, b)[0])
        loss.backward()
        out.append((loss.detach(), torch.cat([p.grad.flatten() for p in lm.module.parameters() if p.grad is not None])))
    assert torch.allclose(out[0][0], out[1][0], atol=1e-6) and torch.allclose(out[0][1], out[1][1], atol=1e-6)


def test_prompt_positions_get_no_loss():
    lm = tiny()
    exs = [(list(range(5, 15)), [7] * 8), (list(range(6, 16)), [9] * 8)]
    cfg = obj.ObjectiveConfig(seed=0)
    b = obj.collate(exs, C, V, cfg, step=0)
    P = 10
    _, g = _loss_grads(lm, b, cfg)
    # logits at j predict token j+1: positions 0..P-2 predict prompt tokens -> no gradient at all
    assert g[:, :P - 1].abs().max() == 0
    assert g[:, P - 1:].abs().max() > 0
    # the loss does not depend on the prompt tokens' own next-token predictions: change what a prompt
    # position "should" predict (its label) without changing the model input -> same loss
    relabel = obj.TrainBatch(**vars(b))
    relabel.ar_target = b.ar_target.clone()
    loss1 = obj.ar_loss(lm.module, obj.encoder_pass(lm.module, b)[0], b)
    labels = b.input_ids.clone()
    labels[:, 1:P] = (labels[:, 1:P] + 3) % V
    logits = lm.module.lm_logits(obj.encoder_pass(lm.module, b)[0])
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1),
                                           reduction="none").view(2, -1)
    m = b.ar_target[:, 1:].float()
    assert torch.allclose(((ce * m).sum(1) / m.sum(1)).mean(), loss1)
    # "all" scope (G-SFT) does score prompt tokens: the check above can fail
    b_all = obj.collate(exs, C, V, obj.ObjectiveConfig(seed=0, ar_scope="all"), step=0)
    _, g_all = _loss_grads(lm, b_all, cfg)
    assert g_all[:, :P - 1].abs().max() > 0


def test_decoder_never_sees_its_clean_canvas():
    lm = tiny()
    cfg = obj.ObjectiveConfig(seed=2, sc_prob=1.0)
    exs = [([2, 5, 6, 7], [5 + (i * 7 + k) % 11 for i in range(3 * C)]) for k in range(6)]  # three canvases each
    b = obj.collate(exs, C, V, cfg, step=0)
    assert len(set(b.valid.long().argmax(1).tolist())) > 1  # rows selected different canvases

    def dec_logits(batch):
        with torch.no_grad():
            _, cache = obj.encoder_pass(lm.module, batch)
            return obj.decoder_logits(lm.module, batch, cache)

    ref = dec_logits(b)
    T = b.ctx_len
    leak = obj.TrainBatch(**vars(b))
    leak.input_ids = b.input_ids.clone()
    leak.input_ids[:, T:] = (leak.input_ids[:, T:] + 5) % V  # the clean selected canvas and later ones
    assert torch.equal(dec_logits(leak), ref)
    # ... while the context (prompt / earlier canvases) does matter: the check can fail
    ctx = obj.TrainBatch(**vars(b))
    ctx.input_ids = b.input_ids.clone()
    ctx.input_ids[:, T - 1] = (ctx.input_ids[:, T - 1] + 5) % V
    assert not torch.allclose(dec_logits(ctx), ref)


def test_context_only_encoder_matches_full_encoder():
    """ar_weight=0 encodes only the context [0, T): same decoder loss and gradients as encoding the whole
    clean rows and cropping (causal attention), so skipping the clean canvases changes nothing but time."""
    lm = tiny()
    exs = [([2, 5, 6, 7][: 2 + k % 3], [5 + (i * 7 + k) % 11 for i in range(2 * C + k)]) for k in range(5)]
    full_cfg = obj.ObjectiveConfig(seed=4, sc_prob=0.5, ar_weight=1.0)
    ctx_cfg = obj.ObjectiveConfig(seed=4, sc_prob=0.5, ar_weight=0.0)
    b = obj.collate(exs, C, V, full_cfg, step=0)
    assert b.ctx_len < b.input_ids.shape[1] and not bool(b.valid.all())  # padded rows, canvases after T

    def grads(cfg, weight):
        lm.module.zero_grad()
        loss, stats = obj.compute_loss(lm.module, b, cfg)
        (loss if weight else stats_loss(lm, b)).backward()
        return stats["diff"], [p.grad.clone() for p in lm.module.parameters() if p.grad is not None]

    def stats_loss(lm, b):  # the diffusion term alone, through the full encoder
        _, cache = obj.encoder_pass(lm.module, b)
        return obj.diffusion_loss(obj.decoder_logits(lm.module, b, cache), b)

    d_full, g_full = grads(full_cfg, weight=False)
    d_ctx, g_ctx = grads(ctx_cfg, weight=True)
    assert abs(d_full - d_ctx) < 1e-5
    assert len(g_full) == len(g_ctx) and all(torch.allclose(a, c, atol=1e-5) for a, c in zip(g_full, g_ctx))


def test_self_conditioning_off_is_zero_embedding():
    lm = tiny()
    m = lm.module
    canvas = torch.randint(0, V, (2, C))
    sc = torch.randn(2, C, V)
    off = m.decoder_input(canvas, sc, torch.tensor([False, False]))
    plain = torch.nn.functional.rms_norm(m.embed(canvas) + m.self_conditioning(torch.zeros(2, C, m.text.hidden_size)),
                                         (m.text.hidden_size,), eps=m.text.rms_norm_eps)
    assert torch.allclose(off, plain, atol=1e-5)
    on = m.decoder_input(canvas, sc, torch.tensor([True, False]))
    assert not torch.allclose(on[0], off[0]) and torch.allclose(on[1], off[1])


@pytest.mark.parametrize("rollout", [0.0, 1.0], ids=["spec", "rollout"])
def test_loss_decreases_on_a_fixed_batch(rollout):
    """The loss falls on a fixed batch, with the spec objective and with every example learning from a
    rollout canvas (which pass 2 really reads: its loss differs from the plain objective's)."""
    torch.manual_seed(0)
    lm = tiny()
    lm.module.train()
    cfg = obj.ObjectiveConfig(seed=0, rollout=rollout)
    b = obj.collate(examples(8), C, V, cfg, step=0)
    if rollout:
        plain = obj.collate(examples(8), C, V, obj.ObjectiveConfig(seed=0), step=0)
        with torch.no_grad():
            assert obj.compute_loss(lm.module, b, cfg)[1]["diff"] != obj.compute_loss(lm.module, plain, cfg)[1]["diff"]
    opt = torch.optim.AdamW(lm.module.parameters(), lr=3e-3)
    losses = []
    for _ in range(25):
        loss, stats = obj.compute_loss(lm.module, b, cfg)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(stats["loss"])
    assert losses[-1] < 0.6 * losses[0], losses


def test_gradient_checkpointing_gives_same_gradients():
    lm = tiny()
    cfg = obj.ObjectiveConfig(seed=0)
    b = obj.collate(examples(4), C, V, cfg, step=0)
    grads = []
    for gc in (False, True):
        lm.module.gradient_checkpointing = gc
        lm.module.zero_grad()
        obj.compute_loss(lm.module, b, cfg)[0].backward()
        grads.append(torch.cat([p.grad.flatten() for p in lm.module.parameters() if p.grad is not None]))
    lm.module.gradient_checkpointing = False
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


def test_checkpointing_keeps_less_of_the_encoder_pass():
    """The encoder's feed-forward halves are recomputed in backward: its pass saves fewer bytes for backward."""
    lm = tiny()
    cfg = obj.ObjectiveConfig(seed=0)
    b = obj.collate(examples(4), C, V, cfg, step=0)
    saved = []
    for gc in (False, True):
        lm.module.gradient_checkpointing = gc
        n = [0]

        def pack(t):
            n[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            obj.encoder_pass(lm.module, b)
        saved.append(n[0])
    lm.module.gradient_checkpointing = False
    assert saved[1] < 0.7 * saved[0], saved


@pytest.mark.parametrize("ar_weight", [1.0, 0.0])
def test_two_backwards_give_the_gradients_of_one(ar_weight):
    """compute_loss(split=True): the decoder's backward, then the encoder's (what FSDP2 runs), sums to the
    gradients of loss.backward() up to fp32 summation order, with the encoder's AR loss on or off."""
    lm = tiny()
    cfg = obj.ObjectiveConfig(seed=0, ar_weight=ar_weight)
    b = obj.collate(examples(4), C, V, cfg, step=0)
    grads = []
    for split in (False, True):
        lm.module.zero_grad()
        loss, stats, *two = obj.compute_loss(lm.module, b, cfg, split=split)
        if split:
            two[0].decoder()
            assert lm.module.layers[0].self_attn.q_proj.weight.grad is not None  # the decoder's share, made first
            two[0].encoder()
        else:
            loss.backward()
        grads.append({n: p.grad.clone() for n, p in lm.module.named_parameters() if p.grad is not None})
    assert set(grads[0]) == set(grads[1])
    for n in grads[0]:
        assert torch.allclose(grads[0][n], grads[1][n], atol=1e-6, rtol=1e-5), n


@pytest.mark.parametrize("bad", [dict(eps=1.0), dict(sc_prob=2.0), dict(ar_scope="prompt"), dict(swap_rate=-0.1),
                                 dict(swap_rate=1.5), dict(rollout=-0.5), dict(rollout=2.0),
                                 # the loss weights: nan / inf poison every step, a negative one un-trains its loss
                                 dict(ar_weight=float("nan")), dict(ar_weight=float("inf")), dict(ar_weight=-1.0),
                                 dict(diffusion_weight=float("nan")), dict(diffusion_weight=-0.5),
                                 dict(ar_weight=0.0, diffusion_weight=0.0)])
def test_objective_config_validates(bad):
    with pytest.raises(ValueError):
        obj.ObjectiveConfig(**bad)


def test_held_positions_stay_clean_unscored_and_leave_the_draws_alone():
    """Infill training: held canvas positions are never corrupted and get no loss; the other
    positions draw exactly the noise they would draw without any held position."""
    cfg = obj.ObjectiveConfig(seed=5)
    g = torch.Generator().manual_seed(1)
    exs = [([2, 5], torch.randint(5, V, (C,), generator=g).tolist()) for _ in range(64)]
    held = [[j % 3 == 0 for j in range(C)] for _ in exs]
    free = obj.collate(exs, C, V, cfg, step=2)
    with_held = obj.collate([(p, r, h) for (p, r), h in zip(exs, held)], C, V, cfg, step=2)
    mask = torch.tensor(held)
    assert free.scored is None and torch.equal(with_held.scored, ~mask)
    assert not with_held.replaced[mask].any() and free.replaced[mask].any()
    assert torch.equal(with_held.canvas_noisy[mask], with_held.canvas_clean[mask])
    assert torch.equal(with_held.canvas_noisy[~mask], free.canvas_noisy[~mask])
    assert torch.equal(with_held.t, free.t) and torch.equal(with_held.sc_mask, free.sc_mask)
    # the loss reads only scored positions: garbage logits at held positions change nothing
    logits = torch.randn(64, C, V, generator=g)
    spoiled = logits.clone()
    spoiled[mask] = torch.randn(int(mask.sum()), V, generator=g) * 50
    assert torch.allclose(obj.diffusion_loss(logits, with_held), obj.diffusion_loss(spoiled, with_held))
    assert not torch.allclose(obj.diffusion_loss(logits, free), obj.diffusion_loss(spoiled, free))
    with pytest.raises(ValueError, match="held has 3 flags for 8 response tokens"):
        obj.collate([([2], exs[0][1], [True] * 3)], C, V, cfg, step=0)


def test_held_flags_follow_the_selected_canvas():
    """A response of several canvases: the flags of the canvas the example trains are the ones applied."""
    cfg = obj.ObjectiveConfig(seed=0)
    resp = list(range(5, 5 + 2 * C))
    held = [j >= C for j in range(2 * C)]  # only the second canvas is held
    seen = set()
    for k in range(12):
        b = obj.collate([([2], resp, held)], C, V, cfg, step=k)
        second = b.canvas_clean[0, 0].item() == resp[C]
        seen.add(second)
        if second:  # canvas 1: every position held, clean, unscored
            assert not b.scored.any() and torch.equal(b.canvas_noisy, b.canvas_clean)
        else:  # canvas 0: nothing held (scored None = every position)
            assert b.scored is None
    assert seen == {True, False}


def _rollout_batch(B=6, rollout=1.0, seed=2, held=False):
    g = torch.Generator().manual_seed(seed)
    exs = [([2, 5], torch.randint(5, V, (C,), generator=g).tolist()) for _ in range(B)]
    if held:
        exs = [(p, r, [j < 2 for j in range(C)]) for p, r in exs]
    return obj.collate(exs, C, V, obj.ObjectiveConfig(seed=seed, rollout=rollout), step=1)


def test_rollout_draws_come_last_and_zero_draws_nothing():
    """rollout > 0 leaves every other draw of the batch as the plain objective makes it; rollout 0 adds
    nothing; the coin follows the rate; the draws depend only on (seed, step, global example index)."""
    plain = _rollout_batch(rollout=0.0)
    assert plain.rollout is None
    on = _rollout_batch(rollout=0.5, B=400)
    ref = _rollout_batch(rollout=0.0, B=400)
    for k in ("canvas_noisy", "canvas_clean", "replaced", "t", "sc_mask", "input_ids"):
        assert torch.equal(getattr(on, k), getattr(ref, k)), k
    r = on.rollout
    assert abs(r.coin.float().mean().item() - 0.5) < 0.08
    assert bool(((r.tau >= 0.4) & (r.tau < 0.8)).all()) and bool(((r.bound >= 1e-2) & (r.bound < 1e2)).all())
    assert r.u.shape == (400, C) and r.noise.shape == (400, C) and int(r.noise.max()) < V
    exs = [([2, 5], list(range(5, 5 + C)))] * 20
    cfg = obj.ObjectiveConfig(seed=3, rollout=0.5)
    full = obj.collate(exs, C, V, cfg, step=4)
    shard = obj.collate(exs[10:], C, V, cfg, step=4, first_index=10)
    assert torch.equal(shard.rollout.u, full.rollout.u[10:]) and torch.equal(shard.rollout.noise, full.rollout.noise[10:])


def test_rollout_step_is_one_sampler_step():
    """Accepted positions (entropy bound, sampling.entropy_bound_accept on z / tau) hold an inverse-CDF
    sample of softmax(z / tau), the others the drawn noise; rows with the coin off are untouched;
    rollout rows get z / tau as self-conditioning and always have it on; held positions stay clean."""
    from blockpress.sampling import entropy_bound_accept, token_entropy

    b = _rollout_batch(B=6, held=True)
    r = b.rollout
    r.coin[:] = torch.tensor([True, True, True, False, True, False])
    r.bound[:] = torch.tensor([1e-2, 1e2, 0.5, 0.5, 1e-2, 1e2])
    b.sc_mask[:] = False
    z_raw = torch.randn(6, C, V, generator=torch.Generator().manual_seed(0)) * 3
    z_raw[:, 3, :] = -30.0
    z_raw[:, 3, 7] = 30.0  # a certain position: always accepted, always token 7
    canvas, sc, sc_mask = obj.rollout_step(z_raw, b)
    z = z_raw / r.tau[:, None, None]
    acc = entropy_bound_accept(token_entropy(z), r.bound[:, None])
    cdf = torch.softmax(z, -1).cumsum(-1)
    held = ~b.scored
    for i in range(6):
        if not r.coin[i]:
            assert torch.equal(canvas[i], b.canvas_noisy[i]) and torch.equal(sc[i], z_raw[i]) and not sc_mask[i]
            continue
        assert sc_mask[i] and torch.allclose(sc[i], z[i])
        for j in range(C):
            if held[i, j]:
                assert canvas[i, j] == b.canvas_clean[i, j]
            elif acc[i, j]:
                y = int(canvas[i, j])
                assert (y == 0 or cdf[i, j, y - 1] < r.u[i, j]) and r.u[i, j] <= cdf[i, j, y]
            else:
                assert canvas[i, j] == r.noise[i, j]
        assert canvas[i, 3] == 7
    assert int(acc[1, 2:].sum()) == C - 2  # bound 1e2: the whole canvas is accepted
    assert int(acc[0].sum()) < C  # bound 1e-2 on random logits: few positions


def test_rollout_samples_follow_the_model_distribution():
    """The inverse-CDF draw is a categorical sample of softmax(z / tau): frequencies over many rows."""
    n = 4000
    b = _rollout_batch(B=n, seed=9)
    b.rollout.bound[:] = 1e9  # accept everything: the canvas is the sample
    probs = torch.softmax(torch.tensor([2.0, 1.0, 0.0, -1.0] + [-30.0] * (V - 4)), -1)
    b.rollout.tau[:] = 1.0
    z_raw = probs.log().expand(n, C, V).clone()
    canvas, _, _ = obj.rollout_step(z_raw, b)
    freq = canvas.flatten().bincount(minlength=V).float() / canvas.numel()
    assert torch.allclose(freq[:4], probs[:4], atol=0.01), (freq[:4], probs[:4])


def test_acc_text_leaves_out_the_eos_fill():
    """acc and acc_replaced count the EOS fill after a short response, which a decoder that only ever writes EOS
    gets right; acc_text scores the re-drawn positions of the response itself (the chat model's logs read
    0.85 acc_replaced while its answers were all wrong)."""
    lm = tiny()
    exs = examples(n=8, resp=(3, 2))  # 2-3 response tokens (ids >= 5) on an 8-token canvas: the rest is fill
    cfg = obj.ObjectiveConfig(ar_weight=0, eps=0.999)  # t ~ U[0.999, 1): every position re-drawn
    b = obj.collate(exs, C, V, cfg, step=0, eos_id=1)
    n = torch.tensor([len(r) for _, r in exs])
    assert torch.equal(b.fill, torch.arange(C)[None, :] >= n[:, None])
    for target, text in ((torch.full_like(b.canvas_clean, 1), 0.0), (b.canvas_clean, 1.0)):
        logits = torch.nn.functional.one_hot(target, V).float() * 10
        lm.module.decode = lambda *a, logits=logits, **k: logits
        _, stats = obj.compute_loss(lm.module, b, cfg)
        assert stats["acc_text"] == text
    assert stats["acc_replaced"] == 1.0
    lm.module.decode = lambda *a, **k: torch.nn.functional.one_hot(torch.full_like(b.canvas_clean, 1), V).float()
    assert obj.compute_loss(lm.module, b, cfg)[1]["acc_replaced"] > 0.5  # the fill alone
