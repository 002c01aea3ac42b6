"""Verifying drafts against the target model: the rejection sampling of Leviathan et al.
(2023) and Chen et al. (2023), which leaves every emitted token distributed exactly as
the target model would have sampled it.

For each draft token d_i (i = 1..k), drawn by the drafter from q_i:
- accept it with probability min(1, p_i(d_i) / q_i(d_i));
- on the first rejection, emit instead a token drawn from norm(max(p_i - q_i, 0)), the
  recovered token, and stop;
- if all k are accepted, emit a bonus token drawn from p_{k+1}.

A drafter that proposes one certain token, as n-gram lookup does with q_i one-hot at d_i,
accepts with probability p_i(d_i) and recovers from p_i with d_i removed. A greedy request accepts
a draft exactly when it is the target's argmax, and emits the argmax where it is not.
"""

from __future__ import annotations

import torch


def verify(target: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None,
           greedy: bool, generator: torch.Generator | None = None) -> list[int]:
    """The tokens one sequence emits this step, 1 to k + 1 of them: the accepted drafts,
    then the recovered or bonus token.

    Args:
        target: [k + 1, V] float32, the target model's sampling distribution, with
            temperature, top-k/top-p and the rest applied, at each draft's position and the
            one after.
        drafts: the k draft token ids.
        draft_probs: [k, V] float32, the drafter's distribution each draft was drawn from;
            None where the drafts are certain (one-hot).
        greedy: accept exactly the target's argmax.
        generator: the sequence's own generator, so a seeded request draws the same tokens.
    """
    k = len(drafts)
    assert target.shape[0] == k + 1 and (draft_probs is None or draft_probs.shape[0] == k)
    if greedy:
        best = target.argmax(dim=-1).tolist()  # [k + 1]
        out = []
        for i, d in enumerate(drafts):
            out.append(best[i])
            if d != best[i]:
                return out
        return [*out, best[k]]
    uniforms = torch.rand(k, generator=generator, dtype=torch.float64).tolist()
    for i, d in enumerate(drafts):
        p = target[i]  # [V]
        q = draft_probs[i] if draft_probs is not None else None
        q_d = 1.0 if q is None else float(q[d])
        if q_d > 0 and uniforms[i] * q_d < float(p[d]):  # u < p/q, without dividing
            continue
        residual = p.clone() if q is None else (p - q).clamp_min(0)  # [V]
        if q is None:
            residual[d] = 0
        if float(residual.sum()) <= 0:  # p <= q everywhere means p == q: nothing to recover
            residual = p
        return [*drafts[:i], _draw(residual, generator)]
    return [*drafts, _draw(target[k], generator)]


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One index drawn in proportion to `weights` [V], which need not be normalised."""
    return int(torch.multinomial(weights, 1, generator=generator)[0])
