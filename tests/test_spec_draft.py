"""The draft-model proposer (jaxllm/spec_decode/draft_model.py) against transformers' greedy
decoding of the draft: fresh proposals, catch-up after full and partial acceptance, a catch-up
longer than one step, limits, a full cache, free(), and the refusals of a draft that does not
fit its target."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from jaxllm.config import ConfigError, EngineArgs
from jaxllm.loader.loader import hf_config
from jaxllm.models.model_config import ModelConfig
from jaxllm.sampling_params import SamplingParams
from jaxllm.sequence import PENDING, Sequence
from jaxllm.spec_decode.config import SpeculativeConfig
from jaxllm.spec_decode.draft_model import DraftModelProposer

K = 4
ARGS = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, block_size=4,
            max_model_len=128, use_tqdm_on_load=False)
# A draft smaller than the target (2 layers, hidden 64): one layer, hidden 32, other weights.
SMALL = dict(seed=7, num_hidden_layers=1, hidden_size=32, intermediate_size=48,
             num_attention_heads=2, num_key_value_heads=1)


def proposer(target: str, draft: str, **kw) -> DraftModelProposer:
    config = EngineArgs(model=target, **ARGS).create_engine_config()
    spec = SpeculativeConfig.parse({"model": draft, "num_speculative_tokens": K,
                                    **kw.pop("spec", {})})
    target_config = ModelConfig.from_hf(hf_config(target), config.model)
    return DraftModelProposer(spec, config, target_config, **kw)


_HF = {}


def hf_greedy(path: str, tokens: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of `tokens` by the model at `path` (the oracle)."""
    import torch
    from transformers import AutoModelForCausalLM

    if path not in _HF:
        _HF[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = list(tokens)
    with torch.no_grad():
        for _ in range(n):
            logits = _HF[path](torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(tokens):]


def seq(seq_id: str, n: int, seed: int) -> Sequence:
    prompt = np.random.default_rng(seed).integers(3, 500, n).tolist()
    return Sequence(seq_id, prompt, SamplingParams())


@pytest.fixture(scope="module")
def target(make_tiny_checkpoint):
    return make_tiny_checkpoint("llama", seed=3)


@pytest.fixture(scope="module")
def small(make_tiny_checkpoint):
    return make_tiny_checkpoint("llama", **SMALL)


@pytest.fixture(scope="module")
def small_proposer(target, small):
    return proposer(target, small)


def check(p, path, seqs, limits=None):
    """propose() equals the oracle's greedy continuation, cut to each row's limit."""
    limits = np.full(len(seqs), K) if limits is None else np.asarray(limits)
    drafts, counts = p.propose(seqs, K, limits)
    for s, d, c, lim in zip(seqs, drafts, counts, limits):
        want = hf_greedy(path, s.all_token_ids, K)[:lim]
        assert c == len(want), (s.seq_id, c, want)
        assert d[:c].tolist() == want and (d[c:] == -1).all(), (s.seq_id, d, want)
    return drafts


def test_target_as_its_own_draft_proposes_its_greedy_continuation(target):
    """Self-drafting: every proposal is the target's greedy token (acceptance would be 100 %),
    across rounds where all K drafts and the bonus token were accepted."""
    p = proposer(target, target)
    seqs = [seq("a", 9, 0), seq("b", 3, 1), seq("c", 14, 2)]
    for _ in range(3):
        drafts = check(p, target, seqs)
        for s, d in zip(seqs, drafts):  # the verifier accepts all and adds the bonus
            s.output_token_ids += d.tolist() + hf_greedy(target, s.all_token_ids + d.tolist(), 1)
    assert p.num_recompiles == 0


def test_smaller_draft_catches_up_after_partial_acceptance(small_proposer, small):
    p = small_proposer
    seqs = [seq("p0", 5, 3), seq("p1", 11, 4), seq("p2", 2, 5), seq("p3", 7, 6)]
    drafts = check(p, small, seqs)
    # Row 0 accepts 1 draft then a correction, row 1 none, row 2 all K plus a bonus; row 3
    # was not speculated for 3 steps (its history left the drafts 3 tokens back).
    seqs[0].output_token_ids += [int(drafts[0, 0]), (int(drafts[0, 1]) + 1) % 500]
    seqs[1].output_token_ids += [(int(drafts[1, 0]) + 1) % 500]
    seqs[2].output_token_ids += drafts[2].tolist() + [7]
    seqs[3].output_token_ids += [(int(drafts[3, 0]) + 1) % 500, 11, 12]
    first = check(p, small, seqs)
    for s in seqs:  # the same sequences from an empty (recycled) cache: same proposals
        p.free(s.seq_id)
    again, _ = p.propose(seqs, K, np.full(4, K))
    assert (again == first).all()
    assert p.num_recompiles == 0


def test_catch_up_longer_than_one_step(small_proposer, small):
    """Prompts of 70 + 50 tokens exceed max_num_batched_tokens=64: chunked steps first."""
    check(small_proposer, small, [seq("long0", 70, 6), seq("long1", 50, 7)])
    assert small_proposer.num_recompiles == 0


def test_limits_cut_each_row(small_proposer, small):
    seqs = [seq("lim0", 6, 8), seq("lim1", 6, 9), seq("lim2", 6, 10)]
    check(small_proposer, small, seqs, limits=[0, 2, K])
    # max_model_len=128: drafts stop at position 127, two after a 126-token sequence.
    near_end = seq("lim3", 126, 11)
    drafts, counts = small_proposer.propose([near_end], K, np.full(1, K))
    assert counts.tolist() == [2] and drafts[0, :2].tolist() == hf_greedy(
        small, near_end.all_token_ids, 2)


def test_free_returns_blocks(small_proposer):
    p = small_proposer
    free = p.kv.num_free_blocks
    seqs = [seq("f0", 30, 12), seq("f1", 9, 13)]
    p.propose(seqs, K, np.full(2, K))
    assert p.kv.num_free_blocks == free - (33 // 4 + 1) - 3  # ceil((len + K - 1) / 4) each
    for s in seqs:
        p.free(s.seq_id)
        p.free(s.seq_id)  # twice is harmless
    assert p.kv.num_free_blocks == free


def test_full_cache_proposes_nothing_then_evicts_idle_rows(target, small):
    """8 blocks of 4 tokens; a 20-token sequence needs 6 (20 + K - 1 tokens)."""
    p = proposer(target, small, num_blocks=8)
    a, b = seq("a", 20, 14), seq("b", 20, 15)
    drafts, counts = p.propose([a, b], K, np.full(2, K))
    assert counts.tolist() == [K, 0] and (drafts[1] == -1).all()
    check(p, small, [b])  # a is idle now: evicted for b
    check(p, small, [a])  # and b for a, whose cache is rebuilt
    assert p.num_recompiles == 0


def test_max_model_len_of_the_config_caps_speculation(target, make_tiny_checkpoint):
    short = make_tiny_checkpoint("llama", **SMALL, max_position_embeddings=64)
    p = proposer(target, short, spec={"max_model_len": 40}, target_num_blocks=20)
    assert p.kv.num_blocks == 20 + 4 * 2  # the target's, plus 3 drafts of 4 sequences
    s = seq("cap", 36, 16)
    drafts, counts = p.propose([s], K, np.full(1, K))
    assert counts.tolist() == [K]  # 36 + 4 = 40
    s.output_token_ids += [5]
    drafts, counts = p.propose([s], K, np.full(1, K))
    assert counts.tolist() == [3] and drafts[0, :3].tolist() == hf_greedy(
        short, s.all_token_ids, 3)


def test_refuses_a_draft_with_a_shorter_context(target, make_tiny_checkpoint):
    short = make_tiny_checkpoint("llama", **SMALL, max_position_embeddings=64)
    with pytest.raises(ConfigError, match=r"--speculative-config.*reaches 64 tokens.*128"):
        proposer(target, short)
    with pytest.raises(ConfigError, match=r"--speculative-config: max_model_len=100 exceeds"):
        proposer(target, short, spec={"max_model_len": 100})


def test_refuses_a_draft_with_a_larger_vocabulary(target, make_tiny_checkpoint):
    wide = make_tiny_checkpoint("llama", **SMALL, vocab_size=600)
    with pytest.raises(ConfigError, match=r"--speculative-config.*vocab_size 600 exceeds.*512"):
        proposer(target, wide)


def test_refuses_a_draft_with_another_tokenizer(target, small, tmp_path):
    other = str(tmp_path / "other")
    shutil.copytree(small, other)
    path = os.path.join(other, "tokenizer.json")
    tok = json.load(open(path))
    vocab = tok["model"]["vocab"]
    x, y = list(vocab)[100:102]  # swap two ids: same tokens, other meaning
    vocab[x], vocab[y] = vocab[y], vocab[x]
    json.dump(tok, open(path, "w"))
    with pytest.raises(ConfigError, match=r"--speculative-config.*another tokenizer"):
        proposer(target, other)


def test_refuses_unconfirmed_tokens_and_a_larger_k(small_proposer):
    s = seq("pending", 5, 17)
    s.output_token_ids.append(PENDING)
    with pytest.raises(ValueError, match="pending.*confirmed"):
        small_proposer.propose([s], K, np.full(1, K))
    with pytest.raises(ValueError, match=f"k={K + 1} exceeds num_speculative_tokens={K}"):
        small_proposer.propose([seq("big_k", 5, 18)], K + 1, np.full(1, K + 1))
