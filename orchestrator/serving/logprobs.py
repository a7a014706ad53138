"""Log-probabilities of committed tokens, for the OpenAI API (`logprobs`, `top_logprobs`) and gRPC `Generate`.

They are the target's own: one forward of a copy of the target over prompt + completion
after the choice is done, warped as the request sampled (temperature, top-k, top-p: the
distribution the lossless chain's tokens follow; a structured-output request's rows restricted by its
grammar, as the chain's were). A greedy request (temperature 0) has a
one-hot warp, whose log-probabilities say nothing, so it reports the target's distribution
at temperature 1 with the request's top-k / top-p.

Why a copy: the chain's tiers belong to the request loop's thread (their KV caches, and
CPU tiers' weights repacked for polyspec's own forward), so this scorer loads the target
once more, on first use, with `from_pretrained` (a safetensors folder's weights are
memory-mapped, so on a CPU the two share the page cache), and runs its plain forward under
a lock of its own, on a request thread, never in the event loop.
"""

from __future__ import annotations

import dataclasses
import threading

MAX_TOP_LOGPROBS = 20  # chat's top_logprobs; completions' logprobs allows at most 5


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the `top` likeliest tokens under the warp, likeliest first


class TargetScorer:
    def __init__(self, target_config) -> None:
        self.target_config = target_config
        self._model = None
        self._lock = threading.Lock()

    def score(self, prompt_ids: list[int], token_ids: list[int], params, top: int, grammar=None) -> list[TokenLogprob]:
        """Each of `token_ids` (the completion after `prompt_ids`) with its log-probability and the `top` alternatives.
        `grammar`: a structured-output request's fresh GrammarState: each row restricted as the chain's were."""
        if not token_ids:
            return []
        import torch

        from polyspec.workers.core.grammar import restrict_rows
        from polyspec.workers.core.sampling import SamplingParams, warp_logits
        from polyspec.workers.tiers.loading import load_model

        if params.greedy:  # the argmax's one-hot warp has no information: the model's own distribution
            params = SamplingParams(temperature=1.0, top_p=params.top_p, top_k=params.top_k)
        with self._lock, torch.no_grad():
            if self._model is None:  # loaded at the first score
                self._model = load_model(self.target_config)
            model = self._model
            device = next(model.parameters()).device
            ids = torch.tensor([list(prompt_ids) + list(token_ids)], dtype=torch.long, device=device)  # [1, P + N]
            # rows at positions P-1 .. P+N-2 predict the N completion tokens
            logits = model(input_ids=ids, logits_to_keep=len(token_ids) + 1).logits[0, :-1]  # [N, V]
            vocab = min(logits.shape[-1], model.config.vocab_size)
            contexts = [list(prompt_ids) + list(token_ids[:j]) for j in range(len(token_ids))]  # before each token
            logits = restrict_rows(logits[:, :vocab], grammar, contexts)
            log_probs = torch.log(warp_logits(logits, params))  # [N, V] float32, -inf outside the warp (and the grammar)
            chosen = log_probs.gather(1, torch.tensor(token_ids, device=log_probs.device)[:, None])[:, 0]  # [N]
            best = torch.topk(log_probs, min(top, vocab), dim=-1) if top else None
        scored = []
        for row, (token, logprob) in enumerate(zip(token_ids, chosen.tolist())):
            alternatives = () if best is None else tuple(
                (int(i), float(v)) for i, v in zip(best.indices[row].tolist(), best.values[row].tolist()) if v != float("-inf"))
            scored.append(TokenLogprob(int(token), float(logprob), alternatives))
        return scored
