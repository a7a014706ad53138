"""The feature head (polyspec.workers.tiers.batched_feature) asked about all rows at once against the same head
asked about one row per call (tests/reference_tier.OneAtATime), each over a target of its own.

Both chains are driven through the same calls (drafts, the target's verdicts, rollbacks, rounds): greedy drafts
are the same tokens, seeded sampled drafts the same draws, and the rows agree to float32 rounding (the batched
forward's products run over other row counts: ROWS_ATOL). Then the engine: greedy chains with the batched head
equal the target's own greedy output, and a batch of B rows drafting k costs k forwards of the head, not B x k.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from family_chains import tier_specs
from polyspec.orchestrator.batch_runner import run_requests
from polyspec.orchestrator.config import parse_config
from polyspec.orchestrator.engine import Engine
from polyspec.orchestrator.tokenization import encode_prompt
from polyspec.workers.core.sampling import SamplingParams
from polyspec.workers.core.tree import Blocks, DraftTree
from polyspec.workers.tiers.batched import BatchedModelTier, batched_tiers
from polyspec.workers.tiers.batched_feature import BatchedFeatureTier
from polyspec.workers.tiers.drafters import load_feature_head
from polyspec.workers.tiers.feature_tier import FeatureTier
from polyspec.workers.tiers.tier import ModelTier
from reference_tier import OneAtATime

ROWS_ATOL = 1e-5  # float32 probabilities of the same head over other row counts
GREEDY = SamplingParams()
PARAMS = [GREEDY, SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=20), GREEDY,
          SamplingParams(temperature=1.0, top_p=0.9)]
LENGTHS = (9, 3, 14, 6, 1)  # prompt lengths, a one-token prompt among them
COUNTS = [4, 2, 5, 1, 3]  # drafted tokens per row


def chain(tiny_drafters, batched: bool):
    """(target, the head asked about all rows at once or one row per call), on a target model of their own."""
    model = AutoModelForCausalLM.from_pretrained(tiny_drafters["target"], dtype=torch.float32).eval()
    target = ModelTier("target", model, model.config.vocab_size, torch.device("cpu"))
    head, _ = load_feature_head(tiny_drafters["feature"], model, "test")
    batched_target, head_tier = batched_tiers([target, FeatureTier("feature", head, target)])
    assert isinstance(batched_target, BatchedModelTier) and isinstance(head_tier, BatchedFeatureTier)
    return batched_target, head_tier if batched else OneAtATime(head_tier)


def generators(seed: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + r) for r in range(len(PARAMS))]


def assert_same_drafts(got, expected) -> None:
    for chain, want in zip(got, expected):
        tokens, rows, want_tokens, want_rows = chain.tokens, chain.draft_rows, want.tokens, want.draft_rows
        assert tokens == want_tokens
        assert (rows is None) == (want_rows is None)
        assert rows is None or torch.allclose(rows, want_rows, atol=ROWS_ATOL), (rows - want_rows).abs().max()


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(1, 250, (n,), generator=generator).tolist() for n in LENGTHS]


def test_batched_head_drafts_what_it_drafts_one_row_at_a_time(tiny_drafters):
    """Rounds of drafts (different counts per row), the target's verdicts, a rollback of the head and of the
    target, a request leaving and another taking its slot: every draft equal, every row close."""
    chains = [chain(tiny_drafters, batched) for batched in (True, False)]
    ids = list(range(len(PARAMS)))
    contexts = prompts()
    for round_index in range(4):
        drafts = [head.draft_batch(ids, contexts, COUNTS, PARAMS, generators(10 * round_index)) for _, head in chains]
        assert_same_drafts(drafts[0], drafts[1])
        verdicts = [target.verify_batch(ids, contexts, drafted, PARAMS, generators(99))
                    for (target, _), drafted in zip(chains, drafts)]
        assert [(v.path, v.next_token) for v in verdicts[0]] == [(v.path, v.next_token) for v in verdicts[1]]
        contexts = [c + drafts[0][r].tokens[: len(v.path)] + [v.next_token] for r, (c, v) in enumerate(zip(contexts, verdicts[0]))]
        if round_index == 1:  # rollbacks: the head forgets the last 3 positions of row 2, the target those of row 0
            for target, head in chains:
                head.truncate(2, len(contexts[2]) - 3)
                target.truncate(0, len(contexts[0]) - 2)
        if round_index == 2:  # row 4 leaves; a new request with another prompt takes its slot
            for target, head in chains:
                head.release(4)
                target.release(4)
            contexts[4] = prompts()[2][:7]
    for target, head in chains:
        assert head.cached(0) <= len(contexts[0])


def test_batched_head_scores_a_cheaper_tiers_blocks_as_one_row_at_a_time(tiny_drafters):
    """The head as a middle tier: contexts run past what the target has computed (tokens the head emitted
    earlier in the target's round), blocks of different lengths, an empty one among them."""
    chains = [chain(tiny_drafters, batched) for batched in (True, False)]
    ids = list(range(len(PARAMS)))
    contexts = prompts()
    for target, _ in chains:  # the target holds the prompts (what the scheduler's prefill does)
        target.prefill(ids, contexts, 1000)
    blocks = [DraftTree.chain(tokens, None) for tokens in ([5, 6, 7], [8], [], [9, 10, 11, 12, 13, 14], [15, 16])]
    blocks = Blocks.of(blocks)
    scored = [head.score_batch(ids, contexts, blocks, PARAMS) for _, head in chains]
    for rows, want in zip(*scored):
        assert rows.shape == want.shape and torch.allclose(rows, want, atol=ROWS_ATOL)
    longer = [c + [21, 22, 23][: r % 3 + 1] for r, c in enumerate(contexts)]  # past the target's features
    scored = [head.score_batch(ids, longer, blocks, PARAMS) for _, head in chains]
    for rows, want in zip(*scored):
        assert torch.allclose(rows, want, atol=ROWS_ATOL)
    with pytest.raises(NotImplementedError, match="chains only"):
        chains[0][1].score_batch([0], [contexts[0]], Blocks.of([DraftTree([1, 2], [-1, -1], None)]), [GREEDY])


@pytest.mark.parametrize("scheme", ["specinfer", "rsd"])
def test_batched_head_trees_are_those_of_one_row_at_a_time(tiny_drafters, scheme):
    """Trees of different depths, greedy and seeded sampling, across rounds with the target's tree verdicts
    (the head drops its tree after a verdict)."""
    chains = [chain(tiny_drafters, batched) for batched in (True, False)]
    ids = list(range(len(PARAMS)))
    contexts = prompts()
    depths = [3, 1, 4, 2, 3]
    for round_index in range(3):
        trees = [head.draft_tree_batch(ids, contexts, 2, depths, PARAMS, scheme, generators(round_index)) for _, head in chains]
        for tree, want in zip(*trees):
            assert (tree.tokens, tree.parents) == (want.tokens, want.parents)
            assert (tree.draft_rows is None) == (want.draft_rows is None)
            assert tree.draft_rows is None or torch.allclose(tree.draft_rows, want.draft_rows, atol=ROWS_ATOL)
        verdicts = [target.verify_batch(ids, contexts, drafted, PARAMS, generators(50), scheme=scheme, below=head)
                    for (target, head), drafted in zip(chains, trees)]
        assert [(v.path, v.next_token) for v in verdicts[0]] == [(v.path, v.next_token) for v in verdicts[1]]
        contexts = [c + [trees[0][r].tokens[node] for node in v.path] + [v.next_token]
                    for r, (c, v) in enumerate(zip(contexts, verdicts[0]))]
    drafts = [head.draft_batch(ids, contexts, COUNTS, PARAMS, generators(7)) for _, head in chains]  # a chain after trees
    assert_same_drafts(drafts[0], drafts[1])


def test_a_batch_drafting_k_costs_k_forwards_of_the_head(tiny_drafters):
    """B rows drafting up to k tokens: one forward brings every row up to its context, then one per further
    token (rows asking fewer leave early); row by row it is one forward per row and token."""
    chains = [chain(tiny_drafters, batched) for batched in (True, False)]
    ids = list(range(len(PARAMS)))
    contexts = prompts()
    for target, _ in chains:
        target.prefill(ids, contexts, 1000)
    costs = []
    for _, head in chains:
        before = head.tier.forwards
        head.draft_batch(ids, contexts, COUNTS, PARAMS, generators(0))
        costs.append(head.tier.forwards - before)
    assert costs == [max(COUNTS), sum(COUNTS)]


@pytest.mark.parametrize("names,lengths", [(["target", "feature"], [4]), (["target", "feature", "ngram"], [4, 6])])
def test_greedy_engine_with_the_batched_head_equals_the_target_alone(tiny_drafters, names, lengths):
    """The engine's batched chain serves the head batched, and its greedy output is the target's own."""
    engine = Engine(parse_config({"tiers": tier_specs(tiny_drafters, names), "speculation": {"lengths": lengths},
                                  "batching": {"max_requests": 4, "max_batched_tokens": 64}}), batched=True)
    assert engine.batched and isinstance(engine.scheduler.tiers[1], BatchedFeatureTier)
    engine.scheduler.eos_token_ids = frozenset()
    texts = ["def add(a, b):\n    return", "import os\nimport sys\n", "for i in range(10):\n    print(i)\nfor i in",
             "x = [1, 2, 3]\ny = [", "class A:\n    def __init__(self):\n        self."]
    requests = [engine.parse_request({"prompt": text, "max_new_tokens": 16, "id": str(i)}) for i, text in enumerate(texts)]
    results = {}
    run_requests(engine, requests, lambda result: results.__setitem__(result["id"], result))
    assert engine.scheduler.tiers[1].tier.forwards > 0
    model = AutoModelForCausalLM.from_pretrained(tiny_drafters["target"], dtype=torch.float32).eval()
    for index, text in enumerate(texts):
        prompt_ids = encode_prompt(engine.tokenizer, text)
        with torch.inference_mode():
            expected = model.generate(torch.tensor([prompt_ids]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                                      pad_token_id=0)[0, len(prompt_ids):].tolist()
        assert results[str(index)]["token_ids"] == expected

