"""The weighted objective mix as one ``nn.Module``, the thing DeepSpeed wraps.

One set of weights serves every decoder, so one step trains them together: the clean causal
pass carries the AR loss and is the context of a DARL window stream, a MinerU bidirectional
noisy stream and a PA-BDM causal noisy stream, all in a single forward (see
:mod:`components.training.streams`). The DARL fine-tune adds one forward before it: the
rollout over ``[.. c, <INIT> x w]`` whose logits give OMTG its candidates; the main forward then
carries the K candidate windows after the ground-truth AR token (candidate 0 gets the DAR loss, all K
give the look-ahead reward); DTPO's log-probs come from the rollout, the drafter's own context (see
:mod:`components.training.darl` for each switch).

Loss = sum over objectives of weight_k * mean_b(sample_weight_b * loss_k,b).
"""

from __future__ import annotations

import torch
from torch import nn

from components.training import objectives as obj
from components.training.config import TrainConfig
from components.training.darl import (
    credit_weights,
    dtpo_loss,
    group_advantages,
    immediate_reward,
    lcp_length,
    lookahead_reward,
    permuted_advantages,
    pickup_slots,
    sample_candidates,
)
from components.training.data import Batch
from components.training.streams import Layout, Stream, block_stream, compose, window_stream
from models.interface import PagePrefix, TrainableMarkupLM


class ObjectiveMix(nn.Module):
    """``forward(batch, generator) -> (loss, metrics)``; ``.model`` is the page-to-markup model."""

    def __init__(self, model: TrainableMarkupLM, config: TrainConfig):
        super().__init__()
        self.model = model
        self.weights = config.active_objectives
        self.dar_config, self.darl_config = config.dar, config.darl
        self.block_length = config.block_diffusion.block_length
        self.pabdm_block_length, self.tau = config.pabdm.block_length, config.pabdm.tau
        self.ids = model.special_ids
        self.vocab_size = model.vocab_size
        self.register_buffer("draft_ids", model.draft_token_ids(), persistent=False)
        # What the decoders never emit (every special but eos, and padded vocabulary rows), the
        # candidates and rewards never use either.
        banned = torch.ones(self.vocab_size, dtype=torch.bool)
        banned[self.draft_ids] = False
        banned[self.ids["eos"]] = False
        self.register_buffer("banned", banned, persistent=False)
        # A dict here makes each DARL step leave its DTPO internals in it (benchmarks.dtpo_diagnosis).
        self.record: dict[str, torch.Tensor] | None = None

    # ----- helpers ------------------------------------------------------------------------
    def _logits(self, layout: Layout, prefix: PagePrefix) -> torch.Tensor:
        out = self.model(
            input_ids=layout.input_ids, attention_mask=layout.attention_mask, position_ids=layout.position_ids, prefix=prefix
        )
        return out["logits"]

    def _ban(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.float().masked_fill(self.banned, float("-inf"))

    def _rollout_slot_logits(self, batch: Batch, prefix: PagePrefix, plan: obj.WindowPlan) -> torch.Tensor:
        """Logits predicting each window slot from ``[.. c, <INIT> x w]`` (B, w, V)."""
        inits = torch.full((batch.tokens.shape[0], plan.window), self.ids["init"], device=batch.tokens.device)
        layout = compose(batch.tokens, [window_stream("rollout", inits, plan.offsets)], prefix.length)
        logits = self._logits(layout, prefix)
        return obj.slot_logits(layout.clean_logits(logits), layout.stream_logits(logits, "rollout"), plan)

    def _drafts(
        self, batch: Batch, prefix: PagePrefix, plan: obj.WindowPlan, slot_truth: torch.Tensor, generator: torch.Generator
    ) -> torch.Tensor:
        mode = self.dar_config.draft
        if mode == "gt":
            return slot_truth.clamp_min(0)
        if mode == "corrupt":
            return obj.corrupt_drafts(slot_truth, self.dar_config.corrupt_prob, self.draft_ids, generator)
        with torch.no_grad():
            return self._ban(self._rollout_slot_logits(batch, prefix, plan)).argmax(dim=-1)

    def _dtpo_record(
        self, clean: torch.Tensor, cand_plan: obj.WindowPlan, lengths: torch.Tensor, tokens: torch.Tensor,
        truth: torch.Tensor, token_logp: torch.Tensor, credit: torch.Tensor, advantages: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        """DTPO's inputs beside the clean pass's log-probs of the same candidate tokens, and which
        credited tokens have a ground-truth context (every earlier candidate token right): where
        those two log-probs are equal, DTPO moves the AR distribution, i.e. the verifier."""
        index = cand_plan.slot_index()  # (B, w) token index of each candidate slot
        in_sequence = index < lengths[:, None]
        positions = (index - 1).clamp_max(clean.shape[1] - 1)
        clean_logp = self._ban(obj.gather_rows(clean, positions)).log_softmax(-1).detach()  # (B, w, V)
        k = tokens.shape[1]
        clean_token_logp = clean_logp[:, None].expand(-1, k, -1, -1).gather(-1, tokens[..., None]).squeeze(-1)
        pickup = cand_plan.pickup_mask()[:, None, :].expand_as(tokens)
        correct = lcp_length(tokens, truth[:, None, :].expand_as(tokens), pickup)  # (B, K)
        slots = torch.arange(tokens.shape[-1], device=tokens.device)
        ground_truth_context = (credit > 0) & (slots[None, None, :] <= correct[..., None]) & in_sequence[:, None, :]
        return {"policy_logp": token_logp.detach(), "clean_logp": clean_token_logp, "credit": credit.detach(),
                "advantages": advantages.detach(), "candidates": tokens.detach(), "n_pickup": cand_plan.n_pickup,
                "ground_truth_context": ground_truth_context}

    # ----- the step -----------------------------------------------------------------------
    def forward(self, batch: Batch, generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        tokens, lengths = batch.tokens, batch.lengths
        prefix = self.model.encode_pages(batch.pages)
        n_prefix = prefix.length
        streams: list[Stream] = []
        terms: dict[str, torch.Tensor] = {}
        metrics: dict[str, torch.Tensor] = {}

        plan = truth = slot_truth = None
        if "dar" in self.weights or "darl" in self.weights:
            window = self.dar_config.window
            plan = obj.sample_window_plan(lengths, window, generator)
            truth = obj.extended_targets(tokens, lengths, batch.ends_with_eos, self.ids["eos"], tokens.shape[1] + window + 2)
            slot_truth = obj.gather_rows(truth, plan.slot_index())
        if "dar" in self.weights:
            drafts = self._drafts(batch, prefix, plan, slot_truth, generator)
            streams.append(window_stream("dar", obj.window_inputs(plan, drafts, self.ids["init"]), plan.offsets))
        if "darl" in self.weights:
            cfg = self.darl_config
            # The rollout keeps its graph only when DTPO's log-probs come from it (the default).
            with torch.set_grad_enabled(torch.is_grad_enabled() and cfg.policy_context == "init"):
                rollout = self._ban(self._rollout_slot_logits(batch, prefix, plan))
            # ar_slot=skip: the candidates are the tokens after the exact AR token x_{c+1}, and their
            # windows follow the prefix advanced by it (plan shifted by one).
            skip = cfg.ar_slot == "skip"
            cand_plan = obj.WindowPlan(plan.offsets + 1, plan.n_pickup, plan.window) if skip else plan
            cand_truth = obj.gather_rows(truth, cand_plan.slot_index())
            drafter = torch.cat([rollout[:, 1:], rollout[:, -1:]], dim=1) if skip else rollout
            candidates = sample_candidates(
                drafter, plan.n_pickup, cfg.candidates, cfg.temperature, self.ids["init"], cfg.max_retries, generator
            )
            safe = torch.where(plan.pickup_mask()[:, None, :], candidates, drafter.argmax(dim=-1)[:, None, :])
            for k in range(cfg.candidates):
                streams.append(window_stream(f"candidate{k}", candidates[:, k], cand_plan.offsets))
            if cfg.draft_alignment == "left":  # the authors' DAR input: drafts one slot left, no x_{c+1}
                streams.append(window_stream("dar_left", candidates[:, 0], plan.offsets))
        if "block_diffusion" in self.weights:
            truth_b = obj.block_truth(tokens, lengths, batch.ends_with_eos, self.ids["eos"], self.block_length)
            mineru = obj.mineru_noisy_block(truth_b, self.block_length, self.ids["mask"], generator)
            streams.append(block_stream("mineru", mineru.input_ids, self.block_length, "bidirectional"))
        if "pabdm_csl" in self.weights:
            truth_p = obj.block_truth(tokens, lengths, batch.ends_with_eos, self.ids["eos"], self.pabdm_block_length)
            pabdm = obj.pabdm_noisy_block(truth_p, self.pabdm_block_length, self.ids["mask"], generator)
            streams.append(block_stream("pabdm", pabdm.input_ids, self.pabdm_block_length, "causal"))

        layout = compose(tokens, streams, n_prefix)
        logits = self._logits(layout, prefix)
        clean = layout.clean_logits(logits)

        if "ar" in self.weights:
            terms["ar"] = obj.ar_loss(clean, tokens, lengths)
        if "dar" in self.weights:
            terms["dar"] = obj.dar_loss(clean, layout.stream_logits(logits, "dar"), truth, plan)
        if "darl" in self.weights:
            cfg = self.darl_config
            if cfg.draft_alignment == "left":
                dar = obj.dar_loss(clean, layout.stream_logits(logits, "dar_left"), truth, plan)
            else:
                dar = obj.dar_loss(clean, layout.stream_logits(logits, "candidate0"), truth, cand_plan)
            # (B, K, w, V) each window's outputs with candidate k as its drafts: what SDB verifies.
            outputs = torch.stack([self._ban(layout.stream_logits(logits, f"candidate{k}"))
                                   for k in range(cfg.candidates)], dim=1)
            # The same re-indexed by slot: slot 0 from the committed token's clean output.
            candidate_logits = torch.cat([self._ban(obj.gather_rows(clean, cand_plan.offsets[:, None]))[:, None]
                                         .expand(-1, cfg.candidates, -1, -1), outputs[:, :, :-1]], dim=2)
            with torch.no_grad():
                r1 = immediate_reward(candidates, cand_truth, plan.n_pickup, cfg.reward)
                if cfg.lookahead_slots == "window":
                    next_truth = obj.gather_rows(truth, cand_plan.slot_index() + 1)
                    r2 = lookahead_reward(outputs.argmax(-1), next_truth, plan.n_pickup, cfg.reward, "window")
                else:
                    r2 = lookahead_reward(candidate_logits.argmax(-1), cand_truth, plan.n_pickup, cfg.reward, "init")
                rewards = r1 + r2 if cfg.lookahead else r1
                advantages = group_advantages(rewards, cfg.advantage_eps)
                if cfg.permute_advantages:
                    advantages = permuted_advantages(advantages, generator)
            policy = candidate_logits if cfg.policy_context == "candidate" else drafter[:, None]
            token_logp = policy.log_softmax(dim=-1).expand(-1, cfg.candidates, -1, -1).gather(
                -1, safe[..., None]).squeeze(-1)
            credit = credit_weights(candidates, cand_truth, plan.n_pickup, cfg.credit)
            dtpo = dtpo_loss(token_logp, advantages, credit)
            if self.record is not None:
                self.record.update(self._dtpo_record(clean, cand_plan, lengths, safe, cand_truth, token_logp, credit,
                                                     advantages))
            terms["darl"] = dar + cfg.dtpo_coef * dtpo
            has_pickup = (plan.n_pickup > 0).float()
            n_with = has_pickup.sum().clamp_min(1)
            metrics["darl_dar"] = dar.detach().mean()
            metrics["darl_dtpo"] = dtpo.detach().mean()
            metrics["reward_r1"] = (r1.mean(dim=1) * has_pickup).sum() / n_with
            metrics["reward_r2"] = (r2.mean(dim=1) * has_pickup).sum() / n_with
            metrics["reward_greedy"] = (rewards[:, 0] * has_pickup).sum() / n_with
            # What shows DTPO acting: groups whose candidates all scored alike give it nothing to
            # learn from, and the advantage-weighted log-likelihood of the credited candidate
            # tokens (the value whose gradient DTPO follows; the logged DTPO loss is ~0 by construction).
            flat = (rewards.max(dim=1).values - rewards.min(dim=1).values) < 1e-6
            metrics["dtpo_zero_advantage"] = (flat.float() * has_pickup).sum() / n_with
            metrics["reward_mean"] = (rewards.mean(dim=1) * has_pickup).sum() / n_with
            metrics["reward_std"] = (rewards.std(dim=1) * has_pickup).sum() / n_with
            mean_logp = (token_logp.detach() * credit).sum(-1)
            metrics["dtpo_objective"] = ((advantages * mean_logp).mean(dim=1) * has_pickup).sum() / n_with
            # What SDB would accept from the greedy candidate: its correct prefix, in tokens.
            greedy_prefix = lcp_length(candidates[:, 0], cand_truth, pickup_slots(plan.n_pickup, candidates.shape[-1]))
            metrics["greedy_accepted"] = (greedy_prefix.float() * has_pickup).sum() / n_with
        if "block_diffusion" in self.weights:
            terms["block_diffusion"] = obj.masked_diffusion_loss(layout.stream_logits(logits, "mineru"), mineru)
        if "pabdm_csl" in self.weights:
            loss, kept = obj.pabdm_csl_loss(layout.stream_logits(logits, "pabdm"), pabdm, self.tau)
            terms["pabdm_csl"] = loss
            metrics["csl_kept"] = kept.mean()

        weights = batch.weights.float()
        total = sum(self.weights[name] * (weights * term).mean() for name, term in terms.items())
        for name, term in terms.items():
            metrics[f"loss_{name}"] = term.detach().mean()
        metrics["sample_weight"] = batch.weights.float().mean()
        return total, metrics
