"""Model families unlike the Llama/GPT-2/BERT of the other tests: a mixture of experts (its saved set depends on the
routing), latent attention and dense-then-MoE layers (DeepSeek-V3), soft-capped attention and alternating
sliding-window layers (Gemma 2), an encoder-decoder (T5), a state-space model with no attention (Mamba), attention
and MLP side by side from one norm (Falcon), and dropout in every block (OPT: both runs draw the same masks). Each
trains under autocast bf16 on fp32 weights with gradient accumulation, under a budget that makes the plan move or
recompute, and must reach keep's losses and gradients exactly."""

import copy

import pytest
import torch
from ssdtrain_testutil import encoder_decoder

import ssdtrain

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH = 256, 64, 2


def _config(name: str):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4)
    if name == "mixtral":
        return transformers.MixtralConfig(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, **common)
    if name == "deepseek_v3":
        return transformers.DeepseekV3Config(
            num_key_value_heads=4,
            moe_intermediate_size=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            kv_lora_rank=16,
            q_lora_rank=32,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            **common,
        )
    if name == "gemma2":
        return transformers.Gemma2Config(num_key_value_heads=2, head_dim=16, attention_dropout=0.0, **common)
    if name == "mamba":
        return transformers.MambaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3)
    if name == "falcon":
        return transformers.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4)
    if name == "opt":
        del common["intermediate_size"]
        return transformers.OPTConfig(ffn_dim=128, word_embed_proj_dim=64, dropout=0.1, **common)
    raise ValueError(name)


def _train(model, steps=2, accumulation=2):
    """`steps` optimizer steps of `accumulation` micro-batches under autocast bf16: (losses, last step's grads)."""
    gen = torch.Generator().manual_seed(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    for _ in range(steps):
        for _ in range(accumulation):
            ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            (loss / accumulation).backward()
            losses.append(loss.detach())
        grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
    return losses, grads


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3", "gemma2", "t5", "mamba", "falcon", "opt"])
def test_model_families_train_as_keep_under_a_budget(name):
    if name == "deepseek_v3" and not hasattr(transformers, "DeepseekV3Config"):
        pytest.skip("this transformers predates DeepSeek-V3 (4.50)")
    torch.manual_seed(0)
    if name == "t5":
        model = encoder_decoder("t5", vocab_size=VOCAB)[0].train()
    else:
        model = transformers.AutoModelForCausalLM.from_config(_config(name)).train()
    ref = copy.deepcopy(model)
    torch.manual_seed(5)  # (the same dropout masks in both runs)
    want_losses, want_grads = _train(ref)
    torch.manual_seed(5)
    with ssdtrain.offload(model, budget=0.7, min_bytes=1024, verbose=False) as s:
        losses, got_grads = _train(model)
    assert s.planned_steps > 0
    plan = s.plan
    assert any(c != ssdtrain.Choice() for c in plan.choices), plan  # the budget made it move or recompute
    assert plan.prediction.peak <= plan.budget
    assert torch.equal(torch.stack(losses), torch.stack(want_losses))
    for got, want in zip(got_grads, want_grads, strict=True):
        assert (got is None) == (want is None)
        if got is not None:
            assert torch.equal(got, want)
