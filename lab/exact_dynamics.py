"""
The exact level of the lab: chat_rl.py's update, in expectation over every group of G answers a snapshot can
sample, on exact.py's enumerable world (15 answers of the project's GPT over {a, b, end}). Shared by
lab/exact_gradient.py, lab/length_bias_exact.py and lab/clip_higher_exact.py. It calls chat_rl's own
group_advantages and policy_loss (a stage; so this lives in lab/, above the stages, not beside exact.py).

    settings = stage_settings(["--agg", "seq-mean-token-mean", "--group-size", "8"])   # chat_rl's flags
    coef, clip_frac = expected_update(policy_logp, old_logp, rewards=R, **settings)
    exact.ascend(optimizer, policy, coef)                                              # one optimizer step

An expected update is the limit of a batch of infinitely many groups, each drawn from the snapshot that
sampled (old_logp), trained at the current policy (policy_logp): what chat_rl.update_policy's optimizer steps
do on average. Several optimizer steps on one batch are several calls with the same old_logp.
"""
import torch

import chat_rl
import exact


def stage_settings(flags) -> dict:
    """expected_update's settings from chat_rl.py's flags, as its main makes them (--max-new-tokens is the
    world's MAX_LEN, 3). Example: ["--scale", "none", "--group-size", "4"] -> {"group_size": 4, "scale": "none",
    "estimator": "grpo", "loss_settings": {"eps_low": 0.2, "eps_high": 0.28, "agg": "token-mean", "max_len": 3,
    ...}}."""
    args = chat_rl.parser.parse_args([*flags, "--max-new-tokens", str(exact.MAX_LEN)])
    return dict(group_size=args.group_size, scale=args.scale, estimator=args.estimator,
                loss_settings=chat_rl.update_settings(args)["loss_settings"])


def expected_update(policy_logp, old_logp, *, rewards, group_size, scale, estimator, loss_settings):
    """E over groups of G iid answers from the snapshot (old_logp, (15, MAX_LEN)) of the update chat_rl hands
    the optimizer, minus d loss / d (each answer token's log-prob at policy_logp), exactly, as coefficients
    (15, MAX_LEN) (exact.ascend takes them); and the clip fraction such a batch logs, E[tokens where the clip
    binds] / E[tokens] (chat_rl.policy_loss's clip_frac, verl's definition, over a batch of many groups).

    How: the loss is a sum over answers, answer i's term scaled by |A_i| / N (N: the group's tokens for
    token-mean, G otherwise), its shape fixed by the sign of A_i; A_i depends on the others only through their
    rewards, N through their lengths. So E g = G sum_y p_old(y) sum_sign E[|A_1| / N; sign | y_1 = y] * (the
    loss gradient of y alone at A = sign, N = 1), the inner expectation a sum over the counts of the other
    G - 1 answers in each (reward, length) class (exact.group_distribution), never a sample.
    Example (tests/test_lab_length_bias_exact.py): every token at 1/3, R = 1 on "a end" and "a b end", G = 2,
    --scale none, seq-mean-token-mean: coefficient p(y) (R(y) - J) / (2 |y|), J = 4/27: "end" -2/81."""
    G = group_size
    p_old = old_logp.sum(-1).exp()
    keys = sorted({(float(r), int(n)) for r, n in zip(rewards, exact.LENGTHS)})
    class_of = torch.tensor([keys.index((float(r), int(n))) for r, n in zip(rewards, exact.LENGTHS)])
    class_reward = torch.tensor([r for r, _ in keys], dtype=torch.float64)
    class_len = torch.tensor([n for _, n in keys], dtype=torch.float64)
    counts, prob = exact.group_distribution(torch.zeros(len(keys), dtype=torch.float64).index_add_(0, class_of, p_old),
                                            G - 1)
    S, Y = len(counts), len(exact.ANSWERS)
    others = class_reward[torch.repeat_interleave(torch.arange(len(keys)).repeat(S), counts.reshape(-1))].view(S, G - 1)
    group_rewards = torch.cat([rewards.double()[:, None, None].expand(-1, S, 1), others.expand(Y, -1, -1)], -1)
    adv = chat_rl.group_advantages(group_rewards.reshape(-1), G, scale=scale, estimator=estimator)
    first = adv.view(Y, S, G)[..., 0].double()  # the advantage of answer y in each way the others can fall
    tokens = exact.LENGTHS[:, None].double() + (counts.double() * class_len).sum(-1)[None, :]
    N = tokens if loss_settings["agg"] == "token-mean" else torch.full_like(tokens, float(G))
    coef = torch.zeros(Y, exact.MAX_LEN, dtype=torch.float64)
    clipped = 0.0  # expected tokens where the clip binds, per answer drawn
    for sign in (1.0, -1.0):
        weight = (prob * (sign * first).clamp(min=0) / N).sum(-1)  # E[|A_1| / N; this sign | y_1 = y]
        signs = torch.full((Y,), sign, dtype=torch.float64)
        leaf = policy_logp.clone().requires_grad_()
        loss, _ = chat_rl.policy_loss(leaf, old_logp, signs, exact.EVERY.mask, normalizer=1.0, **loss_settings)
        (d_logp,) = torch.autograd.grad(loss, leaf)  # row y: the loss gradient of y alone (rows are separate)
        coef -= G * (p_old * weight)[:, None] * d_logp
        # the tokens where the clip binds: answers y come with this sign at the rate p_old(y) P(sign | y), and
        # policy_loss's own clip_frac of y alone, times its tokens, counts where it binds on y
        rate = p_old * (prob * (sign * first > 0)).sum(-1)
        for y in torch.nonzero(rate).view(-1).tolist():
            _, stats = chat_rl.policy_loss(policy_logp[y:y + 1], old_logp[y:y + 1], signs[y:y + 1],
                                           exact.EVERY.mask[y:y + 1], **loss_settings)
            clipped += float(rate[y]) * stats["clip_frac"] * int(exact.LENGTHS[y])
    return coef, clipped / float((p_old * exact.LENGTHS).sum())
