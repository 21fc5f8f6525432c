"""The stage policy and the model contract, serially.

The policy is checked against the ZeRO paper's table written out here (which
state each stage partitions), and against the formulas' own byte counts: a
class the policy holds as a shard is exactly a class whose bytes the
accounting divides by the group size.
"""
import pytest

from ringzero.runtime import accounting
from ringzero.runtime.policy import StagePolicy

# the paper's table: P_os (optimizer), P_os+g (and gradients), P_os+g+p (and params)
PAPER = {"0": set(), "1": {"master", "adam_m", "adam_v"},
         "2": {"grads", "master", "adam_m", "adam_v"},
         "3": {"params", "grads", "master", "adam_m", "adam_v"},
         "hybrid": {"params", "grads", "master", "adam_m", "adam_v"}}


@pytest.mark.parametrize("stage", list(PAPER))
def test_policy_matches_the_paper(stage):
    p = StagePolicy.of(stage)
    assert set(p.sharded) == PAPER[stage]
    assert p.full_params == (stage in ("0", "1", "2"))
    assert p.gather_params == (stage in ("3", "hybrid"))
    assert p.full_grads == (stage in ("0", "1"))
    assert p.grad_bucket == (stage in ("2", "3", "hybrid"))
    assert p.full_optimizer == (stage == "0") == p.all_reduce_grads
    assert p.all_gather_after_update == (stage in ("1", "2"))
    assert p.hybrid == (stage == "hybrid")
    assert p.ranks_per_node(4) == (4 if stage == "hybrid" else None)


@pytest.mark.parametrize("stage", list(PAPER))
def test_policy_agrees_with_the_formulas(stage):
    p = StagePolicy.of(stage)
    psi, nd = 1024, 8
    rpn = p.ranks_per_node(4)
    group = rpn or nd
    by = accounting.model_state_bytes(stage, psi, nd, rpn)
    per = {"params": 2, "grads": 2, "master": 4, "adam_m": 4, "adam_v": 4}
    cls = {"params": "params_fp16", "grads": "grads_fp16", "master": "master_fp32",
           "adam_m": "adam_m_fp32", "adam_v": "adam_v_fp32"}
    for b in per:
        want = per[b] * psi // (1 if p.is_full(b) else group)
        assert by[cls[b]] == want, (b, by[cls[b]], want)


def test_policy_is_frozen_and_parses_fsdp_names():
    p = StagePolicy.of("FULL_SHARD")
    assert p == StagePolicy.of(3) and p.stage == "3"
    with pytest.raises(AttributeError):
        p.stage = "2"
    with pytest.raises(ValueError, match="unknown stage"):
        StagePolicy.of("4")


def test_models_follow_the_contract():
    from ringzero.nn.contract import ShardableModel
    from ringzero.nn.gpt import GPT, GPTConfig
    from ringzero.nn.mlp import MLP
    gpt = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab=11))
    mlp = MLP((4, 8, 3))
    for m in (gpt, mlp):
        assert isinstance(m, ShardableModel)
        assert m.last == len(m.units) - 1
    # the defaults of UnitModel, and GPT's own answer for its embedding
    assert [mlp.backward_reads_params(u) for u in range(len(mlp.units))] == [True, True]
    assert [gpt.backward_reads_params(u) for u in range(len(gpt.units))] == [False, True, True]
    assert not isinstance(object(), ShardableModel)
