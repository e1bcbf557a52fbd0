"""
A mutation check: plant plausible bugs one at a time and make sure the tests that should catch each do.

    python tests/mutation_check.py               # every mutant; exits 1 if one is missed or no longer applies
    python tests/mutation_check.py --list        # the mutants, one line each
    python tests/mutation_check.py --only topk-keeps-k-minus-1 kto-labels-inverted

Each mutant is (name, file, exact source snippet, replacement, the pytest node ids that must catch it, a one-line
description). For each one, on a temporary copy of the repository (the files git tracks, plus new files it does
not ignore; the working tree is never edited), the snippet is replaced and only those tests run
(`pytest -x -q NODE...` in the copy). A mutant is caught when they fail. The copy is first checked unmutated:
tests that already fail there would "catch" every mutant and prove nothing.

A snippet that no longer occurs exactly once in its file is reported as stale, and the check fails: a refactor
must update the list, so it cannot rot silently (tests/test_mutation_list.py checks this in the normal suite).

Why a short hand-picked list rather than mutmut or cosmic-ray: each mutant here is a bug someone could write
(most of them shipped in a large library: the issue numbers are in each one's description), a reader can see at once what it breaks,
and the whole list runs in minutes. Generated mutants number in the thousands for this code, a full run takes
hours on two cores, and many of them are equivalent (the same behaviour: a changed constant in a log message, a
`<` for `<=` where the values never tie) and have to be triaged by hand.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    snippet: str
    replacement: str
    tests: tuple
    why: str


RL, DPO, SFT, RM, PPO = "tests/test_rl.py::", "tests/test_dpo.py::", "tests/test_sft.py::", "tests/test_rm.py::", "tests/test_ppo.py::"
UPDATE = RL + "test_update_applies_the_gradient_of_the_flags_objective"
SAMPLED = RL + "test_the_update_trains_the_distribution_sampled_from_with_its_sampler_weights"
# the wiring tests (#31, round two): a stage's main run in the test's process, one flag changed, checked against
# references written from the definitions (tests/inprocess.py)
W_PPO = "tests/test_wiring_ppo.py::test_each_flag_reaches_the_rewards_advantages_and_losses"
W_RL = "tests/test_wiring_rl.py::test_each_flag_reaches_the_update"
W_DISTILL = "tests/test_wiring_distill.py::test_each_flag_reaches_the_update"
W_DPO, W_KTO = "tests/test_wiring_dpo.py::test_dpo_flags_reach_the_loss", \
    "tests/test_wiring_dpo.py::test_kto_flags_reach_the_loss_and_the_reference_point"
W_RM = "tests/test_wiring_rm.py::test_each_flag_reaches_the_loss"
W_SFT = "tests/test_wiring_sft.py::test_sft_flags_reach_the_optimizer_and_the_data"
W_BASE = "tests/test_wiring_sft.py::test_base_train_builds_the_model_its_flags_describe"
W_LORA = "tests/test_wiring_sft.py::test_lora_flags_reach_the_adapters"
W_SAMPLE = "tests/test_wiring_sampling.py::test_sample_flags_reach_the_engine_and_the_files"
W_MISC = "tests/test_wiring_misc.py::"
PPO_RESUME = "tests/test_resume.py::test_ppo_resumes_its_critics_optimizer_and_its_adaptive_kl"

MUTANTS = [
    # sampling
    Mutant("topk-keeps-k-minus-1", "model.py",
           "logits.masked_fill(logits < kth,", "logits.masked_fill(logits <= kth,",
           ("tests/test_model.py::test_process_logits_top_k_top_p_support",
            "tests/test_engine.py::test_sampler_draws_from_the_processed_distribution"),
           "top-k drops the k-th token too: k - 1 tokens kept"),
    Mutant("sampler-ignores-temperature", "engine.py",
           "    logits = process_logits(logits, temperature, top_k, top_p)\n    peak",
           "    logits = process_logits(logits, 1.0, top_k, top_p)\n    peak",
           ("tests/test_engine.py::test_sampler_draws_from_the_processed_distribution",
            "tests/test_engine.py::test_engine_logprobs_equal_trainer_recomputation[0.7-20-None]"),
           "the engine samples at temperature 1 whatever it is asked (trl#4159)"),
    Mutant("engine-head-ignores-precision", "engine.py",
           'return head_logits(rms_norm(x, model.model.norm.weight, eps), weights["head"], weights["head_precision"])',
           'return F.linear(rms_norm(x, model.model.norm.weight, eps).float(), weights["head"].float())',
           ("tests/test_engine.py::test_each_head_precision_gives_the_engine_the_trainers_logprobs[bf16]",),
           "the engine decodes through a float32 head whatever the trainer's head precision (MiniMax-M1's mismatch)"),
    Mutant("engine-fsdp-head-from-master", "engine.py",
           "_full_weight(master.lm_head.weight).to(fsdp_param_dtype(master) or master.lm_head.weight.dtype)",
           "_full_weight(master.lm_head.weight).to(master.lm_head.weight.dtype)",
           ("tests/test_engine.py::test_fsdp_engine_samples_with_the_weights_and_dtype_the_trainer_computes_in",),
           "under --fsdp with bf16 parameters the engine's head is the float32 master, the trainer's bf16 (#51)"),
    Mutant("engine-fsdp-residual-in-compute-dtype", "engine.py",
           "self.dtype = dtype or fsdp_param_dtype(model) or compute_dtype(unwrap(model).device)",
           "self.dtype = dtype or compute_dtype(unwrap(model).device)",
           ("tests/test_engine.py::test_fsdp_engine_samples_with_the_weights_and_dtype_the_trainer_computes_in",),
           "under --fsdp the engine decodes in the compute dtype, not the dtype the trainer's forward computes in"),
    Mutant("nan-stops-one-rank-alone", "common.py",
           "        if _DIST.world_size == 1:\n            raise UserError(f\"step {step}: the loss",
           "        if True:\n            raise UserError(f\"step {step}: the loss",
           ("tests/test_dist.py::test_a_nan_on_one_rank_stops_every_rank_naming_it",),
           "a NaN loss stops only its own rank, unheard, while the others wait in a collective (#51)"),
    Mutant("engine-copies-fused-weights", "lora.py",
           "    return first.as_strided((sum(w.size(0) for w in weights), first.size(1)), first.stride())",
           "    return torch.cat(weights)",
           ("tests/test_lora.py::test_the_engine_shares_a_lora_base_instead_of_fused_copies",),
           "the engine keeps fused copies of q/k/v and gate/up beside a LoRA base it could share (9 GB at 8B, #51)"),
    Mutant("sparse-checks-never-compact", "engine.py", "or (step + 1) % self.check_every == 0):",
           "or False):", ("tests/test_engine.py::"
                          "test_compaction_into_power_of_two_buckets_and_sparse_checks_give_the_same_completions",),
           "with the host reading every 8 steps (CUDA), it never reads between: finished rows never leave the batch"),
    Mutant("bucketed-step-attends-past-the-end", "engine.py",
           "(kv_cache.doc[:, :length] == doc) & (torch.arange(length, device=end.device) <= end)",
           "(kv_cache.doc[:, :length] == doc)",
           ("tests/test_model.py::test_a_step_over_a_length_bucket_equals_the_exact_step",),
           "the captured decode step attends to its length bucket's empty positions past the new token"),
    Mutant("memory-forgets-the-prefill", "peak_memory.py", "return fused + copy + kv_cache + max(prefill, sampler)",
           "return fused + copy + kv_cache + sampler",
           ("tests/test_memory.py::test_the_engine_counts_its_prefill_or_its_sampler_whichever_is_larger",),
           "the memory estimate leaves out the engine's unchunked prefill (#51)"),
    Mutant("memory-without-fragmentation", "peak_memory.py", "FRAGMENTATION * out[\"total\"] if cuda else 0",
           "0", ("tests/test_memory.py::test_qwen3_sh_defaults_fit_80_gb_with_a_margin",
                 "tests/test_memory.py::test_the_estimate_adds_up_and_shards"),
           "the memory estimate has no margin for the CUDA caching allocator's fragmentation (#51)"),
    Mutant("gpu-check-passes-a-wrong-kernel", "benchmarks/gpu_check.py", "ok = found == [expected[name]]",
           "ok = True", ("tests/test_gpu_check.py::test_a_wrong_kernel_or_memory_over_the_estimate_fails_the_check",),
           "runs/gpu_check.sh reads each call's attention kernel but never fails on an unexpected one (#51)"),
    Mutant("gpu-check-passes-any-memory", "benchmarks/gpu_check.py", "ok = measured_gib <= bound", "ok = True",
           ("tests/test_gpu_check.py::test_a_wrong_kernel_or_memory_over_the_estimate_fails_the_check",),
           "runs/gpu_check.sh never fails a stage whose peak memory is over its estimate (#51)"),
    Mutant("cispo-lower-bound", "chat_rl.py", "ratio.clamp(max=cispo_cap) if", "ratio.clamp(1 - eps_low, cispo_cap) if",
           ("tests/test_rl.py::test_cispo_is_trls_formula_and_has_no_lower_bound",),
           "CISPO's weight gets PPO's lower bound, which MiniMax-M1 leaves out: rare tokens' weights are lifted"),
    Mutant("cispo-cap-never-reaches-the-loss", "chat_rl.py", "cispo_cap=args.cispo_cap),", "cispo_cap=5.0),",
           ("tests/test_wiring_rl.py::test_cispo_cap_reaches_the_loss",),
           "--cispo-cap parsed, the loss always capping at 5"),
    Mutant("snapshot-shares-float32-weights", "engine.py",
           "w = _full_weight(p).to(self.dtype, copy=copy)", "w = _full_weight(p).to(self.dtype)",
           ("tests/test_engine.py::test_a_snapshot_does_not_move_with_training",
            RL + "test_off_policy_and_one_step_stale_sample_with_the_same_weights"),
           "a float32 snapshot shares the embedding, norms, o_proj and down_proj with the trainer: a stale sampler "
           "is stale in half its weights, an off-policy one reads them mid-update"),
    # KV cache positions
    Mutant("decode-position-is-cache-index", "engine.py",
           "    pos = kv_cache.next_pos\n    dtype",
           "    pos = kv_cache.end.repeat(kv_cache.next_pos.size(0))\n    dtype",
           ("tests/test_engine.py::test_cached_greedy_equals_recompute_and_batch_equals_alone",
            "tests/test_engine.py::test_engine_logprobs_equal_trainer_recomputation[1.0-None-None]",
            "tests/test_model.py::test_decode_step_equals_the_cached_forward[True]"),
           "a decode step's RoPE position is the cache length, wrong for left-padded prompts (unsloth#3699)"),
    # packing boundaries
    Mutant("packed-sequences-share-a-document", "packing.py",
           "            docs[r, col:col + n] = d\n", "            docs[r, col:col + n] = 0\n",
           (DPO + "test_padded_and_packed_logp_sums_equal_unpadded_sums",),
           "pack_sequences puts every sequence of a row in one document: attention crosses them"),
    Mutant("packed-documents-one-per-row", "model.py",
           "starts[:, 1:] = doc[:, 1:] != doc[:, :-1]", "starts[:, 1:] = False",
           ("tests/test_model.py::test_packed_documents_equal_the_dense_mask",
            "tests/test_model.py::test_attention_never_crosses_documents"),
           "packed attention batches whole rows, not documents: one document sees another (transformers#46634)"),
    Mutant("sft-collate-one-document", "packing.py",
           "docs += [d] * len(x)", "docs += [0] * len(x)",
           (SFT + "test_packing_keeps_labels_positions_and_isolation",),
           "SFT packing: positions do not restart and attention crosses conversations"),
    # loss masks
    Mutant("sft-mask-off-by-one", "packing.py",
           "zip(ids[1:], mask[1:])", "zip(ids[1:], mask[:-1])",
           (SFT + "test_labels_are_exactly_the_assistant_tokens",),
           "SFT grades the token after each assistant token, not the assistant's tokens"),
    Mutant("rl-mask-trains-forced-tokens", "rollout.py",
           "m[b, start:n] = torch.tensor(c.mask, dtype=torch.float)", "m[b, start:n] = 1.0",
           (RL + "test_rollout_mask_covers_exactly_the_sampled_tokens",),
           "the RL loss mask covers forced tool-result tokens"),
    # normalizers
    Mutant("rl-normalizer-per-pass", "chat_rl.py",
           "weights=p(weights), normalizer=normalizer,", "weights=p(weights), normalizer=None,",
           (UPDATE + "[token-ppo-token-mean]",),
           "each forward pass divides by its own token count, not the minibatch's (open-instruct#1137)"),
    Mutant("seq-mean-divides-by-padded-length", "chat_rl.py",
           "per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)",
           "per_seq = (per_token * mask).sum(-1) / mask.size(-1)",
           (RL + "test_aggregations_normalize_as_documented", RL + "test_gspo_two_sequences_of_different_lengths"),
           "seq-mean-token-mean averages over the padded length, not the answer's tokens"),
    Mutant("sft-normalizer-per-micro-batch", "chat_sft.py",
           "loss = sft_loss(fwd(x, y, doc_ids=d), n_global)",
           "loss = sft_loss(fwd(x, y, doc_ids=d), float((y != IGNORE).sum()))",
           (SFT + "test_accumulation_equals_one_big_batch",),
           "SFT divides each micro-batch by its own token count (verl#5625)"),
    # advantages
    Mutant("grpo-sample-std", "chat_rl.py",
           "r.std(dim=1, unbiased=False, keepdim=True)", "r.std(dim=1, unbiased=True, keepdim=True)",
           (RL + "test_grpo_and_dr_grpo_advantages_worked_table",),
           "GRPO divides by the sample std, not the population std of the group"),
    Mutant("rloo-baseline-divides-by-g", "chat_rl.py",
           "(r.sum(dim=1, keepdim=True) - r) / (group_size - 1)", "(r.sum(dim=1, keepdim=True) - r) / group_size",
           (RL + "test_grpo_and_dr_grpo_advantages_worked_table",),
           "RLOO's leave-one-out mean divided by G instead of G - 1"),
    Mutant("scale-batch-not-applied", "chat_rl.py",
           "adv = adv / (global_mean_var(r)[1] ** 0.5 + eps)", "adv = adv",
           (RL + "test_batch_scale_divides_by_the_whole_batchs_std",),
           "--scale batch does not divide by the batch's std"),
    Mutant("gae-without-lambda", "chat_ppo.py",
           "adv_t = delta + gamma * lam * next_adv", "adv_t = delta + gamma * next_adv",
           (PPO + "test_gae_worked_table",),
           "GAE drops lambda: Monte-Carlo advantages"),
    # the policy loss and its wiring in the loop
    Mutant("rl-kl-k3-in-loss", "chat_rl.py",
           "kl = mean(kl_penalty(logp, p(ref_logp), kl_kind))", 'kl = mean(kl_penalty(logp, p(ref_logp), "k3"))',
           (UPDATE + "[token-ppo-token-mean-k2]", UPDATE + "[token-ppo-token-mean-k1]"),
           "chat_rl puts k3 into the loss whatever --kl-kind says (trl#4637)"),
    Mutant("rl-level-ignored", "chat_rl.py",
           "level=args.level, agg=args.agg", 'level="token", agg=args.agg',
           (UPDATE + "[sequence-ppo-seq-mean-token-mean]",),
           "--level sequence (GSPO) never reaches the loss"),
    Mutant("rl-agg-ignored", "chat_rl.py",
           "level=args.level, agg=args.agg", 'level=args.level, agg="token-mean"',
           (UPDATE + "[token-ppo-seq-mean-token-mean]",),
           "--agg never reaches the loss"),
    Mutant("rl-loss-type-ignored", "chat_rl.py",
           "loss_type=args.loss, max_len", 'loss_type="ppo", max_len',
           (UPDATE + "[token-cispo-token-mean]",),
           "--loss cispo never reaches the loss"),
    Mutant("gspo-ratio-not-length-normalized", "chat_rl.py",
           "seq_log_ratio = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)",
           "seq_log_ratio = (log_ratio * mask).sum(-1)",
           (RL + "test_gspo_sequence_ratio_worked_table",),
           "GSPO's sequence ratio is the product of token ratios, not their geometric mean"),
    Mutant("clip-higher-swapped", "rollout.py",
           "-advantages * ratio.clamp(1 - eps_low, 1 + eps_high)", "-advantages * ratio.clamp(1 - eps_high, 1 + eps_low)",
           (RL + "test_clip_higher_table",),
           "eps_low and eps_high swapped"),
    Mutant("k2-without-half", "rollout.py",
           "return 0.5 * log_r ** 2", "return log_r ** 2",
           (RL + "test_kl_estimator_gradients_against_the_analytic_kl",),
           "k2 without its 1/2: twice the KL gradient"),
    # the ratio snapshot
    Mutant("rl-kl-term-always-token-mean", "chat_rl.py",
           "                return aggregate(per_token, m, agg, normalizer, max_len)",
           "                return (per_token * m).sum() / mb.tokens",
           (RL + "test_the_paper_grpo_command_computes_the_papers_objective",),
           "the KL term is a token mean whatever --agg, not the paper GRPO's per-answer mean"),
    Mutant("rl-ratio-against-itself", "chat_rl.py",
           "policy_loss(logp, p(old_logp), p(advantages), m,", "policy_loss(logp, logp.detach(), p(advantages), m,",
           (UPDATE + "[token-ppo-token-mean]",),
           "the importance ratio is exp(logp - logp.detach()) = 1: no clipping ever (trl#2769)"),
    Mutant("ppo-ratio-against-itself", "chat_ppo.py",
           "log_ratio = logp - old_logp ", "log_ratio = logp - logp.detach() ",
           (PPO + "test_second_epoch_uses_the_snapshot_ratio",),
           "PPO's ratio against the current policy, not the snapshot (trl#2769)"),
    # the loop's rollouts
    Mutant("dynamic-sampling-drops-last-round", "rollout.py",
           "if last or not f]", "if not f]",
           (RL + "test_dynamic_sampling_drops_flat_groups_and_fills_the_batch",),
           "dynamic sampling drops flat groups in its last round too: the batch comes out short"),
    Mutant("flat-groups-trained", "chat_rl.py", "flat_answers(rollouts.rewards, G) & args.dynamic_sampling",
           "flat_answers(rollouts.rewards, G) & False",
           ("tests/test_wiring_rl.py::test_a_flat_group_kept_by_the_last_round_trains_nothing_and_counts_in_no_"
            "denominator[dynamic-sampling]", W_RL + "[defaults]"),
           "flat groups the last round of dynamic sampling kept train, their tokens in token-mean's denominator"),
    Mutant("seq-mean-counts-masked-answers", "rollout.py", "float((mask.sum(-1) > 0).sum())", "float(len(mask))",
           (RL + "test_an_answer_masked_whole_is_in_no_denominator",),
           "an answer masked whole still counts in the per-answer aggregations' denominators"),
    Mutant("tis-cap-ignored", "chat_rl.py",
           "args.correction, cap=args.tis_cap,", "args.correction, cap=2.0,",
           (RL + "test_loop_runs_off_policy_and_stale[stale]",),
           "chat_rl's sampler correction ignores --tis-cap"),
    # reward position
    Mutant("rm-score-one-token-early", "rewards.py",
           "return values[ends[0].to(dev), ends[1].to(dev)]", "return values[ends[0].to(dev), ends[1].to(dev) - 1]",
           (RM + "test_score_ignores_padding_side_batch_size_and_batch_mates",),
           "the reward model reads its score one token before <|im_end|>"),
    Mutant("ppo-score-at-first-answer-token", "rollout.py",
           "last = mask.size(1) - 1 - mask.flip(1).argmax(1)", "last = mask.argmax(1)",
           (PPO + "test_token_rewards_score_at_last_answer_token_and_kl_everywhere",),
           "PPO puts the answer's score at its first token, not its last"),
    Mutant("grader-weights-ignored", "rewards.py",
           "grades.total += weight * grades.parts[name]", "grades.total += grades.parts[name]",
           ("tests/test_judge.py::test_grader_weighs_and_returns_every_component",),
           "--reward verifier+0.1*format adds the format reward at weight 1"),
    # DPO family
    Mutant("kto-labels-inverted", "chat_kto.py",
           "good = torch.tensor([g for _, _, g in answers]", "good = torch.tensor([not g for _, _, g in answers]",
           (DPO + "test_kto_micro_loss_follows_each_answers_label",
            DPO + "test_a_few_steps_on_a_separable_toy_push_the_margin_the_right_way[kto]",
            DPO + "test_orpo_and_kto_train[kto]", DPO + "test_kto_reads_unpaired_answers"),
           "KTO's training loop treats good answers as bad and bad as good"),
    Mutant("orpo-nll-dropped", "chat_dpo.py",
           "loss = losses.sum() / pairs_per_step - chosen.sum() / chosen_tokens_per_step",
           "loss = losses.sum() / pairs_per_step",
           (DPO + "test_orpo_micro_loss_is_the_odds_ratio_term_plus_the_chosen_answers_nll",
            DPO + "test_orpo_and_kto_train[orpo]"),
           "ORPO's loop drops the chosen answers' NLL: only the odds-ratio term is left"),
    Mutant("dpo-reference-ignored", "chat_dpo.py",
           "chosen_logratios = policy_chosen_logps - ref_chosen_logps", "chosen_logratios = policy_chosen_logps",
           (DPO + "test_each_loss_type_at_a_hand_computed_point",),
           "DPO ignores the chosen answer's reference log-prob (trl#1962)"),
    # resume, DDP
    Mutant("resume-without-optimizer-state", "checkpoint.py",
           "    else:\n        optimizer.load_state_dict(", "    elif False:\n        optimizer.load_state_dict(",
           ("tests/test_resume.py::test_killed_run_resumes_exactly[sft-lora-dropout]",),
           "a resumed run starts AdamW afresh instead of loading its moments"),
    # round two (#31): the settings that must reach the update, the schedule, the resumed RNG
    Mutant("rl-update-ignores-temperature", "chat_rl.py",
           "    logits_settings = dict(temperature=temperature, top_k=top_k, top_p=top_p)",
           "    logits_settings = dict(temperature=1.0, top_k=top_k, top_p=top_p)",
           (SAMPLED + "[temperature_0.7]",),
           "the update's log-probs at T = 1 while the answers were sampled at 0.7: the first ratio is not 1"),
    Mutant("rl-settings-drop-top-p", "chat_rl.py",
           "grad_clip=args.grad_clip, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)",
           "grad_clip=args.grad_clip, temperature=args.temperature, top_k=args.top_k, top_p=None)",
           (SAMPLED + "[top-p_0.3]",),
           "--top-p samples the answers but never reaches update_policy"),
    Mutant("rl-sampler-weights-dropped", "chat_rl.py",
           "p(advantages), m, weights=p(weights),", "p(advantages), m, weights=None,",
           (SAMPLED + "[correction_token-tis]",),
           "the sampler correction is computed and logged, never applied to the objective"),
    Mutant("warmup-starts-at-zero", "common.py",
           "return base_lr * (step + 1) / warmup_steps", "return base_lr * step / warmup_steps",
           ("tests/test_schedule.py::test_lr_at_follows_the_formula_step_by_step",),
           "the first step trains at lr 0 and the warmup peaks one step late"),
    Mutant("sft-final-lr-ratio-ignored", "chat_sft.py",
           "lr = lr_at(step, total_steps, peak_lr, warmup_steps, args.final_lr_ratio)",
           "lr = lr_at(step, total_steps, peak_lr, warmup_steps)",
           ("tests/test_schedule.py::test_every_stage_follows_its_schedule_decay_and_clip_flags[sft]",),
           "--final-lr-ratio is parsed and printed, and the decay ends at the default 0.1 anyway"),
    Mutant("resume-without-torch-rng", "checkpoint.py",
           '    torch.set_rng_state(s["torch"])', '    torch.get_rng_state()',
           ("tests/test_resume.py::test_killed_run_resumes_exactly[sft-lora-dropout]",),
           "a resumed run draws other LoRA dropout masks than the uninterrupted one would"),
    Mutant("rslora-scale-ignored", "lora.py",
           '    if cfg.get("use_rslora"):', '    if False:',
           ("tests/test_lora.py::test_peft_loads_ours_and_we_load_peft",),
           "a PEFT rsLoRA adapter loads at alpha / r instead of alpha / sqrt(r)"),
    Mutant("llama-lora-q-unscaled", "engine.py",
           "None if qk_gain is not None else [scale, 1, 1]", "None",
           ("tests/test_lora.py::test_the_engine_samples_what_the_trainer_computes_with_random_adapters[llama]",),
           "without QK-norm the engine folds 1/sqrt(d) into W_q but not into the q adapter's B"),
    Mutant("ddp-averages-gradients", "common.py",
           "return dist.all_reduce(bucket.buffer(), async_op=True)",
           "return dist.all_reduce(bucket.buffer().div_(dist.get_world_size()), async_op=True)",
           (RL + "test_two_ranks_with_uneven_lengths_equal_one_rank[token-mean]",),
           "DDP averages gradients over ranks while the losses are already divided by the global count"),
    # round two, the loops' wiring (#31): which tensor or flag reaches the loss, a normalizer, a sign, a mask
    Mutant("ppo-kl-penalty-sign-flipped", "chat_ppo.py",
           "token_rewards(scores, old_logp, ref_logp, mask, kl_beta, args.kl_kind)",
           "token_rewards(scores, ref_logp, old_logp, mask, kl_beta, args.kl_kind)",
           (W_PPO + "[defaults]",),
           "PPO's per-token KL takes the reference for the actor: the reward pays the actor to leave the reference"),
    Mutant("ppo-adaptive-beta-not-applied", "chat_ppo.py",
           "token_rewards(scores, old_logp, ref_logp, mask, kl_beta, args.kl_kind)",
           "token_rewards(scores, old_logp, ref_logp, mask, args.kl_beta, args.kl_kind)",
           ("tests/test_wiring_ppo.py::test_the_adaptive_kl_controllers_beta_is_the_next_steps_penalty",),
           "the adaptive KL controller moves beta and logs it, and the rewards keep --kl-beta"),
    Mutant("ppo-lam-dropped", "chat_ppo.py",
           "gae(rewards, old_values, mask, gamma=args.gamma, lam=args.lam)", "gae(rewards, old_values, mask, gamma=args.gamma)",
           (W_PPO + "[lam_0.5]",), "--lam never reaches GAE: always 0.95"),
    Mutant("ppo-no-whiten-ignored", "chat_ppo.py", "        if args.whiten:\n", "        if True:\n",
           (W_PPO + "[no-whiten]",), "--no-whiten is parsed, and the advantages are whitened anyway"),
    Mutant("ppo-value-clip-ignored", "chat_ppo.py", "value_clip=args.value_clip,", "value_clip=0.2,",
           (W_PPO + "[value-clip_0.001]",), "--value-clip never reaches the value loss: always 0.2"),
    Mutant("ppo-entropy-bonus-is-a-penalty", "chat_ppo.py", "actor_loss = pg_loss - entropy_coef * entropy_loss",
           "actor_loss = pg_loss + entropy_coef * entropy_loss", (W_PPO + "[entropy-coef_0.1]",),
           "PPO's entropy term has the wrong sign: --entropy-coef narrows the policy it should keep spread"),
    Mutant("ppo-sampler-weights-dropped", "chat_ppo.py", "entropy_coef=args.entropy_coef, weights=p(weights),",
           "entropy_coef=args.entropy_coef, weights=None,", (W_PPO + "[tis-cap_0.5]",),
           "PPO computes and logs the sampler correction, and never applies it"),
    Mutant("ppo-truncated-reward-for-every-answer", "chat_ppo.py", "scores[truncated] = args.truncated_reward",
           "scores[:] = args.truncated_reward", (W_PPO + "[truncated-reward_0.5]",),
           "--truncated-reward replaces the score of every answer, not only of those cut at the limit"),
    Mutant("ppo-reference-at-temperature-1", "chat_ppo.py",
           "ref_logp = batch_logprobs(ref_model, batch, args.micro_batch_tokens, temperature=args.temperature)",
           "ref_logp = batch_logprobs(ref_model, batch, args.micro_batch_tokens)", (W_PPO + "[temperature_0.7]",),
           "the reference's log-probs at T = 1 against the actor's at --temperature: a KL that is not 0 at the start"),
    Mutant("rl-scale-not-passed-in-loop", "chat_rl.py", "group_advantages(rollouts.rewards, G, args.scale, args.estimator)",
           'group_advantages(rollouts.rewards, G, "group", args.estimator)', (W_RL + "[scale_batch]",),
           "--scale batch/none reaches group_advantages in the unit tests and never in the loop"),
    Mutant("rl-estimator-not-passed-in-loop", "chat_rl.py", "group_advantages(rollouts.rewards, G, args.scale, args.estimator)",
           'group_advantages(rollouts.rewards, G, args.scale, "grpo")', (W_RL + "[estimator_rloo]",),
           "--estimator rloo never reaches the loop"),
    Mutant("rl-overlong-penalty-ignored", "chat_rl.py", "args.overlong_buffer, args.overlong_penalty)",
           "args.overlong_buffer, 1.0)", (W_RL + "[overlong-penalty_0.5]",),
           "--overlong-penalty is parsed, and the penalty at the limit stays 1"),
    Mutant("rl-mask-truncated-ignored", "chat_rl.py", "tok.pad_id, device, args.mask_truncated)", "tok.pad_id, device)",
           (W_RL + "[mask-truncated]",), "--mask-truncated: the answers cut at the limit still give a gradient"),
    Mutant("rl-mask-eps-ignored", "chat_rl.py", "cap=args.tis_cap,\n                                     eps=args.mask_eps)",
           "cap=args.tis_cap,\n                                     eps=0.1)", (W_RL + "[correction_token-mask_mask-eps_1]",),
           "--mask-eps never reaches token-mask: always 0.1"),
    Mutant("rl-no-dynamic-sampling-ignored", "chat_rl.py", "1 + (args.max_resample if args.dynamic_sampling else 0)",
           "1 + args.max_resample", (W_RL + "[no-dynamic-sampling]",), "--no-dynamic-sampling still resamples flat groups"),
    Mutant("distill-discount-ignored", "chat_distill.py",
           "reverse_kl_advantages(teacher_logp, student_logp, mask, args.discount)",
           "reverse_kl_advantages(teacher_logp, student_logp, mask)", (W_DISTILL + "[discount_0.5]",),
           "--discount never reaches the advantages"),
    Mutant("distill-teacher-at-temperature-1", "chat_distill.py",
           "teacher_logp = batch_logprobs(teacher, batch, args.micro_batch_tokens, temperature=args.temperature)",
           "teacher_logp = batch_logprobs(teacher, batch, args.micro_batch_tokens)", (W_DISTILL + "[temperature_0.7]",),
           "the teacher grades at T = 1 the tokens the student sampled (and is scored) at --temperature"),
    Mutant("distill-clip-bounds-swapped", "chat_distill.py", "dict(eps_low=args.eps_low, eps_high=args.eps_high,",
           "dict(eps_low=args.eps_high, eps_high=args.eps_low,", (W_DISTILL + "[defaults]",),
           "distillation's --eps-low and --eps-high swapped"),
    Mutant("dpo-label-smoothing-dropped", "chat_dpo.py", "label_smoothing=args.label_smoothing, rpo_alpha=args.rpo_alpha)",
           "rpo_alpha=args.rpo_alpha)", (W_DPO + "[label-smoothing_0.2]",),
           "--label-smoothing (cDPO, robust) never reaches the loss"),
    Mutant("dpo-rpo-nll-per-pair", "chat_dpo.py", "loss = loss - rpo_alpha * chosen.sum() / chosen_tokens_per_step",
           "loss = loss - rpo_alpha * chosen.sum() / pairs_per_step", (W_DPO + "[rpo-alpha_0.5]",),
           "--rpo-alpha's NLL divided by the pairs, not the step's chosen tokens: a per-answer sum, biased to length"),
    Mutant("kto-weights-swapped", "chat_kto.py",
           "desirable_weight=args.desirable_weight,\n                                             "
           "undesirable_weight=args.undesirable_weight)",
           "desirable_weight=args.undesirable_weight,\n                                             "
           "undesirable_weight=args.desirable_weight)", (W_KTO + "[desirable-weight_2]",),
           "--desirable-weight weighs the bad answers, --undesirable-weight the good ones"),
    Mutant("kto-reference-point-from-the-answers", "chat_kto.py", "reference_of(m, items, ref, ref_model, pad, cap)[:, 1]",
           "reference_of(m, items, ref, ref_model, pad, cap)[:, 0]", (W_KTO + "[defaults]",),
           "KTO's reference point compares the mismatched partners with the answers' own reference log-probs"),
    Mutant("rm-center-coef-ignored", "chat_rm.py", "margin=margin, center_coef=args.center_coef)",
           "margin=margin)", (W_RM + "[center-coef_0.5]",),
           "--center-coef never reaches the loss: the scores drift"),
    Mutant("rm-lm-loss-per-micro-batch", "chat_rm.py", "lm_regularizer(target_logprobs, n_graded)",
           "lm_regularizer(target_logprobs, float((targets != IGNORE).sum()))", (W_RM + "[defaults]",),
           "the RM's LM regularizer divides each pass by its own tokens, not the step's (verl#5625)"),
    Mutant("sft-weight-decay-ignored", "chat_sft.py", "optimizer = make_optimizer(model, peak_lr, args.weight_decay)",
           "optimizer = make_optimizer(model, peak_lr)", (W_SFT + "[weight-decay_0.1]",),
           "--weight-decay is printed and never reaches AdamW"),
    Mutant("sft-overlong-crop-ignored", "chat_sft.py",
           "train_ex, counts = render_examples(tok, train_rows, args.seq_len, args.overlong)",
           'train_ex, counts = render_examples(tok, train_rows, args.seq_len, "drop")', (W_SFT + "[overlong_crop]",),
           "--overlong crop drops the long training conversations anyway"),
    Mutant("weight-decay-on-norms", "common.py",
           "decay = [p for p in params if p.dim() >= 2]\n    no_decay = [p for p in params if p.dim() < 2]",
           "decay = params\n    no_decay = []", (W_BASE,), "AdamW decays the norms' gains too, pulling them toward 0"),
    Mutant("grad-clip-never-clips", "common.py", 'grad_clip if grad_clip > 0 else float("inf")', 'float("inf")',
           ("tests/test_wiring_sft.py::test_optimizer_step_clips_the_gradient_to_grad_clip[1.0]",),
           "--grad-clip is parsed and the gradient is never clipped"),
    Mutant("epoch-order-repeats", "packing.py", "np.random.RandomState(seed + epoch)", "np.random.RandomState(seed)",
           (W_MISC + "test_every_epoch_is_a_new_permutation_of_all_the_rows",), "every epoch reads the rows in the same order"),
    Mutant("ranks-draw-the-same-prompts", "rollout.py", "step * 1009 + round_ * 17 + rank)", "step * 1009 + round_ * 17)",
           (W_MISC + "test_ranks_steps_rounds_and_seeds_draw_different_prompts",),
           "every rank draws the same prompts: N ranks train on one rank's data"),
    Mutant("heldout-rows-also-train", "data.py", "return rows[:-n], rows[-n:]", "return rows, rows[-n:]",
           (W_MISC + "test_data_and_eval_data_are_the_rows_each_stage_trains_and_holds_out[sft-data]",),
           "without --eval-data the held-out last 2% trains too: the held-out figures measure memorized rows"),
    Mutant("heldout-pass-at-k-without-top-p", "evaluation.py",
           "temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, use_tools=use_tools)",
           "temperature=temperature, top_k=top_k, top_p=None, seed=seed, use_tools=use_tools)",
           (W_MISC + "test_held_out_evaluation_samples_as_the_flags_say[rl-top-p_0.5]",),
           "the held-out pass@k of a run at --top-p samples without it"),
    Mutant("sample-threshold-ignored", "chat_sample.py", "args.max_per_prompt, args.threshold, tools=schemas)",
           "args.max_per_prompt, tools=schemas)", (W_SAMPLE + "[threshold_0.5]",),
           "chat_sample --threshold never reaches the keep rule: always 1"),
    Mutant("sample-top-p-not-passed", "chat_sample.py", "top_k=args.top_k, top_p=args.top_p, tool_schemas=schemas,",
           "top_k=args.top_k, top_p=None, tool_schemas=schemas,", (W_SAMPLE + "[top-p_0.5]",),
           "chat_sample --top-p never reaches the engine"),
    Mutant("eval-top-k-not-passed", "chat_eval.py", "top_k=args.top_k, top_p=args.top_p, use_tools=args.tools)",
           "top_k=None, top_p=args.top_p, use_tools=args.tools)",
           ("tests/test_wiring_sampling.py::test_eval_flags_reach_the_evaluation[top-k]",),
           "chat_eval --model --top-k never reaches the sampler"),
    Mutant("base-n-kv-head-ignored", "base_train.py", "n_kv_head=args.n_kv_head,", "n_kv_head=args.n_head,", (W_BASE,),
           "base_train's --n-kv-head is ignored: full multi-head attention, no grouped queries"),
    Mutant("base-attention-crosses-documents", "base_train.py", "loss = -fwd(x, y, doc_ids=d).sum() / n_global",
           "loss = -fwd(x, y).sum() / n_global", (W_BASE,),
           "pretraining's packed rows attend across their documents, and positions do not restart"),
    Mutant("merge-dtype-ignored", "merge.py", 'None if args.dtype == "input" else torch.float32', "None",
           (W_MISC + "test_merge_writes_the_dtype_its_flag_names[float32]",),
           "merge.py --dtype float32 writes the first folder's dtype anyway"),
    Mutant("memory-nproc-ignored", "memory.py", "kwargs = dict(world_size=own.nproc, cuda=cuda)",
           "kwargs = dict(world_size=1, cuda=cuda)", (W_MISC + "test_memory_nproc_gives_each_ranks_share",),
           "python memory.py --nproc N prints one rank's share as if it held the whole state"),
    Mutant("lora-alpha-ignored", "lora.py", "alpha=args.lora_alpha,", "alpha=None,", (W_LORA + "[lora-alpha_16]",),
           "--lora-alpha never reaches the adapters: the scale is always 2"),
    Mutant("lora-dropout-ignored", "lora.py", "dropout=args.lora_dropout,", "dropout=0.0,",
           (W_LORA + "[lora-dropout_0.25]",), "--lora-dropout never reaches the adapters"),
    Mutant("dpo-lora-checkpoint-is-a-full-model", "chat_dpo.py", '{"run_config": vars(args)}, lora=lora)',
           '{"run_config": vars(args)})', ("tests/test_lora.py::test_every_stage_saves_its_adapter_and_resumes_it[dpo]",),
           "a LoRA DPO run's checkpoints are written as full models, its adapters' keys in them: no peft or vLLM loads it"),
    Mutant("lora-resume-rebases-the-adapter", "lora.py", 'base=own["base_model_name_or_path"])',
           "base=os.path.abspath(path))", ("tests/test_lora.py::test_every_stage_saves_its_adapter_and_resumes_it[rm]",),
           "a resumed LoRA run's adapters name the checkpoint they resumed from as their base, which merges them twice"),
    Mutant("majority-is-any-right-answer", "evaluation.py", "    return scores[winner] == 1.0",
           "    return any(s == 1.0 for s in scores)",
           ("tests/test_majority.py::test_the_vote_rule_on_hand_made_cases",
            "tests/test_majority.py::test_chat_eval_data_grades_your_rows_and_counts_the_votes"),
           "maj@k counts a problem right when any sample is: pass@k under another name"),
    Mutant("rm-margin-never-reaches-the-loss", "chat_rm.py", "for p in micro], device=device) if graded else None",
           "for p in micro], device=device) if False else None",
           ("tests/test_wiring_rm.py::test_a_margin_column_reaches_the_loss",),
           "a --data row's margin is read and never reaches the reward model's loss"),
    Mutant("length-reward-pays-short-wrong-answers", "rewards.py", "out.append(lam if right else min(0.0, lam))",
           "out.append(lam)", ("tests/test_judge.py::test_kimis_length_reward_by_hand_and_through_the_grader",),
           "Kimi's length reward pays a short wrong answer: the cheapest reward is to answer at once, wrongly"),
    Mutant("pairwise-judge-asked-once", "rewards.py", "    if both_orders:\n", "    if False:\n",
           ("tests/test_judge.py::test_asking_in_both_orders_cancels_a_judges_taste_for_a_position",),
           "the pairwise judge is asked in one order only: its taste for a position decides the pair"),
    Mutant("reinforce-pp-kl-in-the-loss-too", "chat_rl.py",
           'kl_beta=0.0 if args.estimator == "reinforce++" else args.kl_beta,', "kl_beta=args.kl_beta,",
           (W_RL + "[estimator_reinforce++_kl-beta_0.1_kl-kind_k1]",),
           "REINFORCE++ pays the KL twice: in the reward, and again as a penalty in the loss"),
    Mutant("reinforce-pp-baseline-without-its-baseline", "chat_rl.py",
           'group_advantages(rollouts.rewards, G, "none", "grpo").to(device)[:, None] * mask',
           "rollouts.rewards.to(device)[:, None] * mask", (W_RL + "[estimator_reinforce++-baseline]",),
           "REINFORCE++-baseline whitens the raw rewards: no group mean subtracted"),
    Mutant("returns-to-go-only-its-own-reward", "rollout.py", "return (rewards * mask).flip(1).cumsum(1).flip(1) * mask",
           "return rewards * mask", ("tests/test_rl.py::test_reinforce_pp_advantages_by_hand_and_against_verls",),
           "REINFORCE++'s return at a token is its own reward: the answer's score reaches its last token only"),
    Mutant("top-entropy-keeps-the-certain-tokens", "rollout.py", "return ((entropy >= threshold.to(entropy.device))",
           "return ((entropy <= threshold.to(entropy.device))",
           ("tests/test_rl.py::test_high_entropy_mask_worked_example_and_trls",),
           "--top-entropy trains the lowest-entropy tokens, the opposite of the 80/20 paper"),
    Mutant("top-entropy-never-reaches-the-loss", "chat_rl.py",
           "trained = weights * high_entropy_mask(entropy, mask, args.top_entropy) if args.top_entropy < 1 else weights",
           "trained = weights", (W_RL + "[top-entropy_0.3]",),
           "--top-entropy is parsed and every token still trains"),
    Mutant("data-mixture-weights-ignored", "data.py",
           "             for row in rng.sample(rows, min(len(rows), round(size * w / total)))]",
           "             for row in rows]",
           ("tests/test_mixture.py::test_mixture_rows_keep_the_weights_and_each_files_held_out_rows",),
           "--data a.jsonl:0.7,b.jsonl:0.3 concatenates the files whole: the weights change nothing"),
    Mutant("sft-source-loss-over-every-row", "chat_sft.py",
           '[r for r in val_rows if r.get("source") == source]', "val_rows",
           ("tests/test_mixture.py::test_sft_logs_the_held_out_loss_of_each_source",),
           "val_loss/<source> is the loss of every held-out row, whatever its source"),
    Mutant("source-accuracy-counts-every-answer", "rollout.py", '(("answers", 1.0), ("correct", float(ok)),',
           '(("answers", 1.0), ("correct", 1.0),', ("tests/test_mixture.py::test_rollout_metrics_by_source",),
           "source/<name>/accuracy counts every answer right"),
    Mutant("standin-judge-never-checks-a-step", "standin_judge.py",
           "wrong = sum(ops[op](int(a), int(b)) != int(c) for a, op, b, c in steps)", "wrong = 0",
           ("tests/test_judge.py::test_the_stand_in_judges_rubric_by_hand",),
           "the stand-in judge passes every step: a wrong computation scores 10"),
    Mutant("standin-judge-unbiased-on-ties", "standin_judge.py", "VERDICT: {1 if first >= second else 2}",
           "VERDICT: {1 if first > second else 2}",
           ("tests/test_judge.py::test_the_stand_in_judges_position_bias_and_both_orders",),
           "the stand-in judge gives a tie to the answer shown second, not the first, as its docs say"),
    Mutant("dpo-pairs-judge-ignored", "preferences.py", "    if judge:\n", "    if False:\n",
           ("tests/test_dpo.py::test_judge_pairs_are_the_judges_choices_asked_in_both_orders",),
           "--pairs judge samples the pairs and labels them by the verifier: the judge is never asked"),
    Mutant("gkd-mixture-weights-swapped", "chat_distill.py", "[s + math.log(1 - beta), t + math.log(beta)]",
           "[s + math.log(beta), t + math.log(1 - beta)]",
           ("tests/test_distill.py::test_gkd_loss_equals_trls_in_value_and_gradient[0.1]",),
           "GKD's mixture weighs the student by beta and the teacher by 1 - beta: a divergence, the wrong one"),
    Mutant("gkd-grades-the-prompt", "model.py", "            return h[targets >= 0]", "            return h.flatten(0, 1)",
           ("tests/test_wiring_distill.py::test_each_flag_reaches_the_update[mode_gkd]",),
           "--mode gkd's loss runs over every position, the prompt and padding included"),
    Mutant("eval-data-ignored-without-data", "data.py", "eval_rows = held_out or rl_prompts(", "eval_rows = rl_prompts(",
           ("tests/test_wiring_misc.py::test_eval_data_alone_is_what_each_stage_holds_out[rl]",),
           "--eval-data without --data is ignored: RL evaluates the world's test problems, drawn by --seed"),
    Mutant("cpu-autocast-ignored", "common.py", "dtype = dtype or train_dtype(dev)", "dtype = dtype or compute_dtype(dev)",
           ("tests/test_cpu_autocast.py::test_bfloat16_reaches_the_loss_and_repeats_itself",
            "tests/test_cpu_autocast.py::test_the_cpu_trains_in_bfloat16_only_where_it_has_the_units_unless_told"
            "[auto-True-dtype0]"),
           "a CPU with bfloat16 units trains in float32 anyway, whatever $NANOPOST_CPU_AUTOCAST says"),
    # trust, round three (#48): the audit's six misses, re-derived where the code moved, and this round's own
    Mutant("ppo-resume-resets-adaptive-kl", "chat_ppo.py", 'state.get("kl_beta", args.kl_beta)', "args.kl_beta",
           (PPO_RESUME, "tests/test_resume.py::test_killed_run_resumes_exactly[ppo]"),
           "a resumed PPO run restarts the adaptive KL's beta from --kl-beta"),
    Mutant("ppo-resume-fresh-critic-optimizer", "chat_ppo.py",
           "        load_training_state(critic_ckpt, critic_opt, critic)", "        pass",
           (PPO_RESUME, "tests/test_resume.py::test_killed_run_resumes_exactly[ppo]"),
           "a resumed PPO run's critic starts a fresh AdamW: its moments are lost"),
    Mutant("engine-samples-with-lora-dropout", "engine.py",
           "and not any(isinstance(m.dropout, nn.Dropout) for m in adapters):", "and not any(False for m in adapters):",
           ("tests/test_lora.py::test_the_engine_samples_what_the_trainer_computes_with_random_adapters"
            "[qwen3-dropout]",),
           "the engine samples through the training model with its LoRA dropout on: another function than scored"),
    Mutant("kto-reference-point-unclamped", "chat_kto.py", "return max(0.0, partner_logratio_sum / n)",
           "return partner_logratio_sum / n",
           ("tests/test_wiring_dpo.py::test_kto_reference_point_is_clamped_at_zero_where_it_binds",),
           "KTO's reference point goes negative (the paper and TRL clamp it at 0)"),
    Mutant("preference-prompt-assistant-graded", "preferences.py", "mask = [0] * len(p) + mask[len(p):]",
           "mask = mask", (DPO + "test_a_multi_turn_prompts_earlier_assistant_turns_are_context_not_graded",),
           "a multi-turn preference prompt's earlier assistant turn is graded as part of the answer"),
    Mutant("judge-reads-a-cut-reply", "rewards.py", 'if out.finish_reason == "stop" else None', "if True else None",
           ("tests/test_judge.py::test_a_reply_cut_at_the_token_limit_is_no_verdict_even_when_it_ends_like_one",),
           "the judge reads 'VERDICT: 1' from a reply cut out of 'VERDICT: 10' at its token limit"),
    Mutant("per-prompt-scores-in-rank-order", "evaluation.py", "[merged[i] for i in range(len(rows))]",
           "list(merged.values())",
           ("tests/test_compare.py::test_per_prompt_scores_come_back_in_row_order_from_every_rank",),
           "per-prompt scores come back rank by rank: every paired comparison pairs the wrong problems"),
    Mutant("rm-lm-normalizer-one-rank", "chat_rm.py", "for t in p[3]) for p in step_pairs)",
           "for t in p[3]) for p in mine)",
           ("tests/test_wiring_rm.py::test_the_lm_normalizer_counts_the_graded_tokens_of_every_rank",),
           "the reward model's LM loss is divided by this rank's graded tokens, not the step's"),
    Mutant("overwrite-before-inputs-are-checked", "chat_sft.py", "    tok = load_tokenizer(init)\n",
           '    open_run(args, out_dir, "sft")\n    tok = load_tokenizer(init)\n',
           ("tests/test_run_dir.py::test_overwrite_replaces_the_old_run_only_once_every_input_is_checked",),
           "--overwrite deletes the old run before the new run's tokenizer is found missing"),
    Mutant("resume-takes-any-flag", "rundir.py", "    if refused:\n", "    if False:\n",
           ("tests/test_run_dir.py::test_resume_refuses_a_flag_that_changes_what_is_trained_and_says_what_else_changed",
            "tests/test_mistakes.py::test_each_mistake_gets_one_clean_line_or_the_right_behaviour"
            "[sft-resume-with-another-seq-len]"),
           "--resume with another --seq-len or --seed continues silently, as if it were the same run"),
    Mutant("rotation-deletes-a-pinned-base", "checkpoint.py", "if not live_dependents(old):", "if True:",
           ("tests/test_train_base.py::test_rotation_keeps_a_checkpoint_another_runs_adapter_is_built_on",
            "tests/test_run_dir.py::test_a_chain_of_three_lora_adapters_survives_its_first_run_going_on"),
           "a run's rotation deletes the checkpoint another run's LoRA adapter is built on"),
    Mutant("switch-on-when-set", "runs/qwen3.sh", 'if [ "${OVERWRITE:-0}" = 1 ]; then',
           'if [ -n "${OVERWRITE:-}" ]; then',
           ("tests/test_recipes.py::test_every_switch_is_on_at_1_and_off_otherwise[qwen3.sh]",),
           "OVERWRITE=0 replaces the runs (the switch tested for being set, not for its value)"),
    Mutant("generation-config-dropped", "tokenizer.py", "gen = dict(self.generation_defaults)", "gen = {}",
           ("tests/test_hf.py::test_the_input_folders_sampling_settings_survive_every_stage_and_merge",),
           "the --init folder's temperature, top-p, top-k and bos id are dropped from every checkpoint"),
    Mutant("verl-source-by-substring", "data.py", '    if source.startswith("aime"):',
           '    if source.startswith("aime") or "math" in source.lower():',
           ("tests/test_mistakes.py::test_each_mistake_gets_one_clean_line_or_the_right_behaviour"
            "[rl-data-source-by-substring]",),
           "a verl data_source holding 'math' anywhere in its name is graded as boxed math"),
    Mutant("log-ratio-unclamped", "rollout.py", "torch.exp(log_ratio.clamp(-20.0, 20.0))", "torch.exp(log_ratio)",
           (RL + "test_one_ratio_and_one_clip_fraction_for_both_surrogates",),
           "the log-ratio is not clamped before exp: a token the policy left underflows its ratio to 0"),
    Mutant("clip-fraction-counts-out-of-range", "rollout.py", "return torch.maximum(unclipped, clipped), clipped > unclipped",
           "return torch.maximum(unclipped, clipped), (ratio < 1 - eps_low) | (ratio > 1 + eps_high)",
           (RL + "test_one_ratio_and_one_clip_fraction_for_both_surrogates",),
           "clip_frac counts every ratio out of range (CleanRL's), not where the clip binds (verl's)"),
    Mutant("rl-resume-resets-idle-count", "chat_rl.py", 'idle_steps = state.get("idle_steps", 0)', "idle_steps = 0",
           ("tests/test_run_dir.py::test_rl_resume_keeps_its_idle_count_and_says_what_a_stale_sampler_loses",),
           "a resumed RL run counts its idle steps from 0: the warning comes late, or never"),
    Mutant("idle-warning-over-kept-answers", "chat_rl.py", 'max(1.0, s["groups"] * G)', 's["answers"]',
           ("tests/test_run_dir.py::test_rl_that_cannot_learn_says_so[resampled]",),
           "the idle warning's share counts every resampled round over the answers kept: '400% had no answer'"),
    Mutant("flag-ranges-unchecked", "rundir.py", "    check_flag_ranges(args)\n    if args.wandb", "    if args.wandb",
           ("tests/test_mistakes.py::test_each_mistake_gets_one_clean_line_or_the_right_behaviour[sft-negative-lr]",),
           "--lr -1 trains (away from every answer)"),
    Mutant("tokenizer-past-the-vocabulary", "checkpoint.py", "if tok.largest_id >= vocab:", "if False:",
           ("tests/test_mistakes.py::test_each_mistake_gets_one_clean_line_or_the_right_behaviour"
            "[sft-tokenizer-of-another-model]",),
           "another model's tokenizer indexes past the embedding: a traceback at the first step"),
    Mutant("reward-model-as-policy", "checkpoint.py", 'if head == "lm" and found == "scalar":', "if False:",
           ("tests/test_mistakes.py::test_each_mistake_gets_one_clean_line_or_the_right_behaviour"
            "[rl-init-reward-model]",),
           "a reward model's folder given as --init fails deep in the engine with a traceback"),
    Mutant("rl-lora-dropout-accepted", "lora.py", "if scores_samples and args.lora_dropout:", "if False:",
           ("tests/test_mistakes.py::test_each_mistake_gets_one_clean_line_or_the_right_behaviour[rl-lora-dropout]",),
           "RL trains with LoRA dropout: its old log-probs and ratios are of a random other function"),
    # the lab's exact level (#49): each experiment's one step against its hand-computed value, and labkit
    Mutant("exact-ascend-descends", "exact.py", "(-(coef.detach() * token_logprobs(model)).sum()).backward()",
           "((coef.detach() * token_logprobs(model)).sum()).backward()",
           ("tests/test_exact.py::test_ascend_is_one_step_along_the_coefficients_times_the_jacobian",),
           "exact.ascend steps against the expected update: every exact-level experiment unlearns"),
    Mutant("exact-dynamics-token-mean-without-own-length", "lab/exact_dynamics.py",
           "tokens = exact.LENGTHS[:, None].double() + (counts.double() * class_len).sum(-1)[None, :]",
           "tokens = 1.0 + (counts.double() * class_len).sum(-1)[None, :]",
           ("tests/test_lab_length_bias_exact.py::test_one_step_of_the_exact_update_against_the_hand_values",),
           "token-mean's denominator leaves out the answer's own tokens: a length bias the loss does not have"),
    Mutant("exact-dynamics-clip-of-the-snapshot", "lab/exact_dynamics.py",
           "chat_rl.policy_loss(policy_logp[y:y + 1], old_logp[y:y + 1]",
           "chat_rl.policy_loss(old_logp[y:y + 1], old_logp[y:y + 1]",
           ("tests/test_lab_clip_higher_exact.py::test_one_off_policy_step_against_the_hand_values",),
           "the clip fraction measured at the snapshot (ratio 1): it never binds, whatever eps_high"),
    Mutant("kl-placement-k1-reward-from-the-past", "lab/kl_placement.py", "to_go = k1.flip(-1).cumsum(-1).flip(-1)",
           "to_go = k1.cumsum(-1)", ("tests/test_lab_kl_placement.py::test_one_step_of_each_variant_against_the_hand_values",),
           "k1 in the reward charges a token for the KL of the tokens before it instead of after it"),
    Mutant("kl-placement-samples-not-held", "lab/kl_placement.py", "    p = logp.detach().sum(-1).exp()\n    if kind",
           "    p = logp.sum(-1).exp()\n    if kind",
           ("tests/test_lab_kl_placement.py::test_one_step_of_each_variant_against_the_hand_values",
            "tests/test_lab_kl_placement.py::test_k1_in_the_loss_moves_nothing_and_k1_in_the_reward_does"),
           "the answers' probabilities carry gradient: a loss that differentiates its own sampling distribution"),
    Mutant("kl-placement-k2-fixed-point-soft", "lab/kl_placement.py",
           'value[prefix] = float(beta * nxt.sum().log()) if rule == "optimum" else',
           'value[prefix] = float(beta * nxt.sum().log()) if rule != "k3_loss" else',
           ("tests/test_lab_kl_placement.py::test_each_closed_form_fixed_point_is_where_its_update_vanishes",),
           "per-token k2's closed-form fixed point counts the KL below each token, as pi* does: it would be pi*"),
    Mutant("goodhart-exact-reverse-kl", "lab/goodhart_exact.py", "beta * (p * (logp - start_logp)).sum()",
           "beta * (start_logp.exp() * (start_logp - logp)).sum()",
           ("tests/test_lab_goodhart_exact.py::test_one_step_of_the_exact_update_against_reinforce_summed_answer_by_answer",),
           "the penalty is KL(start || pi), not KL(pi || start)"),
    Mutant("labkit-home-path-kept", "lab/labkit.py", 'for root, name in ((home, "$NANOPOST_HOME"), (REPO, ".")):',
           'for root, name in ((REPO, "."),):',
           ("tests/test_lab_kit.py::test_the_json_records_provenance_and_no_absolute_path",),
           "an experiment's JSON keeps the absolute paths of the machine that made it"),
    Mutant("labkit-report-hash-for-exact", "lab/labkit.py", 'if level == "model" and os.path.exists(report)',
           'if os.path.exists(report)', ("tests/test_lab_kit.py::test_the_json_records_provenance_and_no_absolute_path",),
           "an exact-level experiment records the hash of a home it never read"),
    Mutant("labkit-matplotlib-unchecked", "lab/labkit.py",
           "        require_matplotlib()  # before anything runs: the figure comes at the end",
           "        pass  # before anything runs: the figure comes at the end",
           ("tests/test_lab_kit.py::test_without_matplotlib_every_lab_script_stops_at_once_saying_what_to_install"
            "[length_bias]",
            "tests/test_lab_kit.py::test_without_matplotlib_every_lab_script_stops_at_once_saying_what_to_install"
            "[goodhart]"),
           "without matplotlib the lab runs every experiment and fails at the figure (#48 item 4)"),
    Mutant("labkit-page-numbers-unchecked", "lab/labkit.py",
           "    return text.replace(\"-\", \"−\") if \"−\" in written else text",
           "    return written",
           ("tests/test_lab_pages.py::test_a_drifted_number_is_caught_and_refreshed",),
           "a page's marked numbers are compared with themselves: a page drifts from its JSON unseen"),
    # the lab's language-model level (#49): its statistics, the experiments' helpers, the knobs they turn
    Mutant("lmkit-paired-sign", "lab/lmkit.py", "d = mean_se([y - x for x, y in zip(a, b)])",
           "d = mean_se([x - y for x, y in zip(a, b)])",
           ("tests/test_lab_lmkit.py::test_mean_se_and_paired_by_hand",),
           "a paired difference the wrong way round: every page's 'b - a' reads as its opposite"),
    Mutant("lmkit-bootstrap-without-replacement", "lab/lmkit.py",
           "stat([values[rng.randrange(n)] for _ in range(n)])", "stat([values[i] for i in range(n)])",
           ("tests/test_lab_lmkit.py::test_bootstrap_covers_the_mean_and_narrows_with_more_problems",),
           "a bootstrap that never resamples: an interval of width 0"),
    Mutant("goodhart-best-of-n-off-by-one", "lab/goodhart.py", "math.comb(rank, n - 1) / math.comb(N, n)",
           "math.comb(rank, n) / math.comb(N, n)",
           ("tests/test_lab_lmkit.py::test_kl_bon_and_best_of_n_against_every_subset",),
           "best-of-n's weights of the n-th order statistic off by one: the curve is no longer best-of-n"),
    Mutant("dpo-similarity-shorter-length", "lab/dpo_likelihood.py", "1 - prev[-1] / max(len(a), len(b), 1)",
           "1 - prev[-1] / min(len(a), len(b), 1)",
           ("tests/test_lab_lmkit.py::test_similarity_is_one_minus_the_normalized_edit_distance",),
           "a pair's similarity normalized by the shorter answer: it goes negative"),
    Mutant("gsm8k-any-reads-the-last-line", "verifiers.py", "for n in _GSM8K_LINE.findall(completion)))",
           "for n in _GSM8K_LINE.findall(completion)[-1:]))",
           ("tests/test_tasks.py::test_gsm8k_any_accepts_any_matching_line",),
           "the lenient grader reads only the last '####' line: it is the strict one, nothing to hack"),
    Mutant("sampler-temperature-ignored", "chat_rl.py", '"temperature": args.sampler_temperature or args.temperature',
           '"temperature": args.temperature',
           ("tests/test_wiring_rl.py::test_sampler_temperature_samples_apart_from_the_trainer",),
           "--sampler-temperature parsed and never used: the lab's mismatch knob does nothing"),
]


def source_files(repo):
    """The files git tracks, plus untracked ones it does not ignore (new tests not committed yet)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                         capture_output=True, text=True, check=True).stdout
    return [f for f in out.split("\0") if f and os.path.isfile(os.path.join(repo, f))]


def stale(mutant, repo=REPO):
    """Why a mutant cannot be applied (its snippet missing or ambiguous), or None."""
    path = os.path.join(repo, mutant.file)
    if not os.path.isfile(path):
        return f"{mutant.file} does not exist"
    with open(path, encoding="utf-8") as f:
        n = f.read().count(mutant.snippet)
    return None if n == 1 else f"the snippet occurs {n} times in {mutant.file}, not once"


def run_tests(copy, tests, timeout):
    """(outcome, seconds, output tail) of `pytest -x -q TESTS` in the copy: "pass", "fail" (a test failed or
    timed out), or "error" (pytest could not run them: a node id that does not exist)."""
    t0 = time.time()
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    try:
        r = subprocess.run(cmd, cwd=copy, capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    except subprocess.TimeoutExpired:
        return "fail", time.time() - t0, "timed out"
    outcome = {0: "pass", 1: "fail"}.get(r.returncode, "error")  # 4: a node id not found; 5: nothing collected
    return outcome, time.time() - t0, (r.stdout + r.stderr)[-2000:]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", action="store_true", help="print the mutants and exit")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutants")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per mutant's tests")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the tests")
    args = ap.parse_args()
    mutants = MUTANTS
    if args.only:
        unknown = set(args.only) - {m.name for m in MUTANTS}
        if unknown:
            sys.exit(f"unknown mutant(s): {', '.join(sorted(unknown))}")
        mutants = [m for m in MUTANTS if m.name in args.only]
    if args.list:
        for m in mutants:
            print(f"{m.name:36s} {m.file:12s} {m.why}")
        return 0

    problems = [(m, why) for m in mutants if (why := stale(m))]
    for m, why in problems:
        print(f"STALE  {m.name}: {why}")
    mutants = [m for m in mutants if m not in {p[0] for p in problems}]

    t_start = time.time()
    results = []
    with tempfile.TemporaryDirectory(prefix="nanopost-mutants-") as tmp:
        copy = os.path.join(tmp, "repo")
        for f in source_files(REPO):
            os.makedirs(os.path.dirname(os.path.join(copy, f)) or copy, exist_ok=True)
            shutil.copy2(os.path.join(REPO, f), os.path.join(copy, f))
        if not args.no_baseline:
            every = sorted({t for m in mutants for t in m.tests})
            outcome, secs, out = run_tests(copy, every, args.timeout * 2)
            print(f"baseline: {len(every)} tests on the unmutated copy: {outcome} ({secs:.0f} s)")
            if outcome != "pass":
                print(out)
                return 1
        for m in mutants:
            path = os.path.join(copy, m.file)
            with open(path, encoding="utf-8") as f:
                original = f.read()
            with open(path, "w", encoding="utf-8") as f:
                f.write(original.replace(m.snippet, m.replacement))
            try:
                outcome, secs, out = run_tests(copy, list(m.tests), args.timeout)
            finally:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(original)
            verdict = {"fail": "caught", "pass": "MISSED", "error": "ERROR"}[outcome]
            results.append((m, verdict))
            print(f"{verdict:6s}  {secs:5.1f} s  {m.name:36s} {m.why}", flush=True)
            if verdict == "ERROR":
                print(out)

    missed = [m for m, v in results if v != "caught"]
    print(f"\n{len(results) - len(missed)} of {len(results)} mutants caught, {len(missed)} missed or in error, "
          f"{len(problems)} stale; {time.time() - t_start:.0f} s")
    return 1 if missed or problems else 0


if __name__ == "__main__":
    sys.exit(main())
