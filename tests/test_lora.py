"""``model.lora``: PEFT adapters on the policy (rlflow/models/lora.py): settings, training, reference, rollouts,
exports.

The oracles are independent of rlflow's code: a separately loaded base model (reference log-probs), PEFT's own
``merge_and_unload`` (merged tensors for lmdeploy, the merged export), a full forward of the PEFT model (the
engine's fused decode and the hf backend), and the untouched base checkpoint on disk (only adapters change).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from conftest import fit_args
from resume_helpers import assert_same_final_state, assert_same_run, last_checkpoint, run_args
from tiny_archs import IdTokenizer, tiny_causal_lm

from rlflow.config_error import ConfigError
from rlflow.models.lora import LoraSettings, apply_lora, linear_weights, merge_lora_tensors
from rlflow.training.module import enable_activation_checkpointing

peft = pytest.importorskip("peft", reason="LoRA needs PEFT: pip install 'rlflow[lora]'")

LORA = '--model.lora={"r": 4, "alpha": 8, "target_modules": "all-linear"}'


def random_lora(model: torch.nn.Module, **options) -> object:
    """``model`` with LoRA adapters whose B is random too (PEFT's default B is 0: the adapted model would equal the
    base one and every comparison below would pass trivially)."""
    wrapper = apply_lora(model, LoraSettings(r=4, alpha=8, options={"init_lora_weights": False, **options}))
    return wrapper.eval()


def forward_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """Log-prob of each next token from one full forward (no rlflow code)."""
    logits = model(input_ids=ids).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(2, ids[:, 1:, None]).squeeze(2)


# ----------------------------------------------------------------------------------------------- settings
def test_settings_errors_name_the_config_key():
    with pytest.raises(ConfigError, match=r"model\.lora\.r must be an integer >= 1"):
        LoraSettings(r=0)
    with pytest.raises(ConfigError, match=r"model\.lora\.dropout must be in \[0, 1\)"):
        LoraSettings(dropout=1.0)
    with pytest.raises(ConfigError, match=r"model\.lora\.options\.rank_typo is not a field of peft\.LoraConfig"):
        LoraSettings(options={"rank_typo": 3}).peft_config()
    with pytest.raises(ConfigError, match=r"model\.lora\.options\.lora_alpha: set it as model\.lora\.alpha"):
        LoraSettings(options={"lora_alpha": 3}).peft_config()
    with pytest.raises(ConfigError, match="model.lora has no option 'rank'"):
        LoraSettings.coerce({"rank": 4})
    config = LoraSettings(r=8, alpha=4, dropout=0.1, target_modules=["q_proj"], options={"use_rslora": True})
    config = config.peft_config()
    assert (config.r, config.lora_alpha, config.lora_dropout, config.use_rslora) == (8, 4, 0.1, True)
    assert set(config.target_modules) == {"q_proj"}


def test_without_peft_model_lora_says_how_to_install_it(monkeypatch, tiny_model):
    import sys

    from rlflow.training.module import GRPOModule

    monkeypatch.setitem(sys.modules, "peft", None)  # import peft raises ImportError
    with pytest.raises(ConfigError, match=r"model\.lora needs the PEFT library: pip install 'rlflow\[lora\]'"):
        GRPOModule(model_path=str(tiny_model), lora={"r": 4})
    assert GRPOModule(model_path=str(tiny_model)).lora is None  # full fine-tuning needs no PEFT


def test_unknown_target_module_is_a_config_error():
    with pytest.raises(ConfigError, match="model.lora: PEFT cannot adapt"):
        apply_lora(tiny_causal_lm("qwen3"), LoraSettings(target_modules=["no_such_proj"]))


def test_the_cli_validates_model_lora(tiny_model, tiny_data, tmp_path, capsys):
    from rlflow.cli import main

    code = main(fit_args(tiny_model, tiny_data, tmp_path, '--model.lora={"r": 4, "options": {"use_rslorax": true}}'))
    err = capsys.readouterr().err
    assert code != 0
    assert "rlflow: error: model.lora.options.use_rslorax is not a field of peft.LoraConfig" in err


# ------------------------------------------------------------------------------------ engines and merges
@torch.no_grad()
def test_merged_tensors_for_lmdeploy_equal_peft_merge_and_unload():
    model = tiny_causal_lm("llama")
    wrapper = random_lora(model, use_rslora=True)
    expected = copy.deepcopy(wrapper).merge_and_unload().state_dict()
    merged = dict(merge_lora_tensors(model, model.state_dict().items()))
    assert list(merged) == list(expected)  # the plain model's names, in its order
    for name, tensor in expected.items():
        torch.testing.assert_close(merged[name], tensor, rtol=1e-6, atol=1e-6, msg=name)
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"],
                           model.model.layers[0].self_attn.q_proj.base_layer.weight)  # the adapters moved it
    with wrapper.disable_adapter():  # adapters off: the base weights
        off = dict(merge_lora_tensors(model, model.state_dict().items()))
        down = model.model.layers[0].mlp.down_proj.base_layer.weight
        assert torch.equal(off["model.layers.0.mlp.down_proj.weight"], down)


def test_lmdeploy_push_names_are_the_base_models():
    from rlflow.rollout.lmdeploy import full_named_tensors

    model = tiny_causal_lm("qwen3")
    names = list(model.state_dict())
    random_lora(model)
    pushed = dict(full_named_tensors(model, torch.bfloat16))
    assert list(pushed) == names and all(t.dtype == torch.bfloat16 for t in pushed.values())


@torch.no_grad()
def test_dora_is_not_folded_by_the_fused_decoder():
    from rlflow.rollout.fused import FusedDecoder

    model = tiny_causal_lm("qwen3")
    random_lora(model, use_dora=True)
    assert "variant" in FusedDecoder.unsupported_reason(model)
    with pytest.raises(ValueError, match="variant"):
        linear_weights(model.model.layers[0].self_attn.q_proj)


@torch.no_grad()
@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3-dora"])
def test_engine_fused_decode_samples_from_the_adapted_model(arch):
    """LoRA deltas folded into the fused decoder's copies; DoRA (not a weight delta) through the model's forward."""
    from rlflow.rollout.base import SamplingParams
    from rlflow.rollout.engine import EngineRollout

    model = tiny_causal_lm(arch.split("-")[0])
    base = copy.deepcopy(model)
    wrapper = random_lora(model, use_dora=arch.endswith("dora"))
    engine = EngineRollout()
    engine.bind(model, IdTokenizer())
    if arch.endswith("dora"):
        assert engine.decode_path.startswith("decode through the model's forward") and "variant" in engine.decode_path
    else:
        assert engine.decode_path == "fused decode"  # the LoRA projections are folded, not a fallback
    prompts = [[5, 9, 17, 33, 2], [8, 3, 60]]
    groups = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=10), n=3)
    worst_adapted = worst_base = 0.0
    for prompt, group in zip(prompts, groups):
        for c in group:
            ids = torch.tensor([prompt + c.token_ids])
            width = len(c.token_ids)
            adapted = forward_logprobs(wrapper, ids)[0, -width:]  # a full forward of the PEFT model
            plain = forward_logprobs(base, ids)[0, -width:]
            worst_adapted = max(worst_adapted, float((torch.tensor(c.logprobs) - adapted).abs().max()))
            worst_base = max(worst_base, float((torch.tensor(c.logprobs) - plain).abs().max()))
    assert worst_adapted < 1e-4
    assert worst_base > 1e-2  # the adapters matter: the base model's log-probs are not the rollout's


@torch.no_grad()
def test_hf_backend_generates_with_the_adapters():
    from rlflow.rollout.base import SamplingParams
    from rlflow.rollout.hf import HFRollout

    model = tiny_causal_lm("qwen3")
    wrapper = random_lora(model)
    backend = HFRollout()
    backend.bind(model, IdTokenizer())
    (completion,), = backend.generate([[5, 9, 17, 33]], SamplingParams(temperature=0.0, max_tokens=8))
    ids = torch.tensor([[5, 9, 17, 33]])
    for _ in range(len(completion.token_ids)):  # greedy decoding of the adapted model, token by token
        nxt = wrapper(input_ids=ids).logits[0, -1].argmax()
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    assert completion.token_ids == ids[0, 4:].tolist()
    with wrapper.disable_adapter():
        base_next = int(model(input_ids=torch.tensor([[5, 9, 17, 33]])).logits[0, -1].argmax())
    adapted_lp = forward_logprobs(wrapper, ids)[0, -len(completion.token_ids):]
    torch.testing.assert_close(torch.tensor(completion.logprobs), adapted_lp, rtol=0, atol=1e-4)
    assert base_next != completion.token_ids[0] or completion.logprobs[0] != pytest.approx(
        float(torch.log_softmax(model(input_ids=torch.tensor([[5, 9, 17, 33]])).logits[0, -1], -1).max()))


def test_packing_check_passes_on_the_adapted_model():
    from rlflow.training.packing_support import packing_unsupported_reason

    model = tiny_causal_lm("qwen3")
    random_lora(model)
    assert packing_unsupported_reason(model) is None


# ------------------------------------------------------------------------------------ training end to end
@pytest.fixture(scope="module")
def lora_run(tiny_model, tiny_data, tmp_path_factory):
    """3 steps of ``rlflow fit`` with ``model.lora`` and a KL term (so the reference path runs), exports on."""
    from rlflow.cli import cli_main

    root = tmp_path_factory.mktemp("lora")
    args = fit_args(tiny_model, tiny_data, root, LORA, "--model.kl_coef=0.05",
                    '--data.judgers={"*": {"class_path": "resume_helpers.DigitJudger"}}', steps=3)
    cli = cli_main(args)
    return cli, Path(cli.trainer.log_dir)


@pytest.mark.slow
def test_only_adapters_train_and_are_checkpointed(lora_run, tiny_model):
    from transformers import AutoModelForCausalLM

    cli, log_dir = lora_run
    module = cli.model
    assert module.ref_model is None  # no second copy of the base model for the KL term
    assert module.peft_model.get_base_model() is module.policy
    base = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    moved = 0
    for name, p in module.policy.named_parameters():
        if "lora_" in name:
            assert p.requires_grad
            moved += "lora_B" in name and bool(p.abs().sum() > 0)  # PEFT starts B at 0: nonzero means trained
        else:
            assert not p.requires_grad
            assert torch.equal(p, base[name.replace(".base_layer", "")]), name  # the base never changes
    assert moved == len([n for n, _ in module.policy.named_parameters() if "lora_B" in n]) > 0
    optimized = {id(p) for group in module.optimizers().param_groups for p in group["params"]}
    assert optimized == {id(p) for n, p in module.policy.named_parameters() if "lora_" in n}
    ckpt = torch.load(last_checkpoint(log_dir.parent.parent), weights_only=True)
    keys = set(ckpt["state_dict"])
    assert keys and all("lora_" in k for k in keys), sorted(keys)[:5]
    assert len(ckpt["optimizer_states"][0]["state"]) == len(keys)  # AdamW moments of the adapters only
    assert "kl" in module.last_metrics


@pytest.mark.slow
@torch.no_grad()
def test_reference_logprobs_are_the_base_models(lora_run, tiny_model):
    """The reference log-probs training_step stored for the KL term (the policy with its adapters disabled) are
    those of a separately loaded base model; the adapted policy's differ from them."""
    from transformers import AutoModelForCausalLM

    from rlflow.data.experience import collate
    from rlflow.training.logprobs import completion_logprobs

    cli, _ = lora_run
    module = cli.model
    exps = module.last_rollout.experiences  # the last step's experiences, as training_step left them
    assert all(e.ref_logprobs is not None for e in exps)
    batch = collate(exps, module.pad_id)
    base = AutoModelForCausalLM.from_pretrained(tiny_model).eval()  # a separately loaded base model
    expected, _ = completion_logprobs(base, batch, module.hparams.temperature)
    adapted, _ = completion_logprobs(module.policy.eval(), batch, module.hparams.temperature)
    mask = batch["completion_mask"]
    ref = torch.zeros_like(expected)
    for i, e in enumerate(exps):
        ref[i, : len(e.ref_logprobs)] = torch.tensor(e.ref_logprobs)
    assert float((ref - expected)[mask].abs().max()) < 1e-5
    assert float((adapted - expected)[mask].abs().max()) > 1e-4  # the adapted policy differs from its reference


@pytest.mark.slow
@torch.no_grad()
def test_exports_adapter_for_peft_and_merged_model_for_transformers(lora_run, tiny_model):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cli, log_dir = lora_run
    assert (log_dir / "hf_adapter" / "adapter_config.json").exists()
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), log_dir / "hf_adapter")
    merged = AutoModelForCausalLM.from_pretrained(log_dir / "hf").eval()
    assert not any("lora" in k for k in merged.state_dict())
    ids = torch.tensor([[3, 14, 15, 9, 26, 5, 35, 8]])
    live = cli.model.policy.eval()(input_ids=ids).logits
    torch.testing.assert_close(adapted.eval()(input_ids=ids).logits, live, rtol=0, atol=1e-5)
    torch.testing.assert_close(merged(input_ids=ids).logits, live, rtol=0, atol=1e-4)
    base = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    assert float((base(input_ids=ids).logits - live).abs().max()) > 1e-4  # the adapters changed the model


@pytest.mark.slow
def test_resume_with_lora_is_exact(tiny_model, small_data, tmp_path, one_thread):
    from rlflow.cli import cli_main

    straight, chained = tmp_path / "straight", tmp_path / "chained"
    cli_main(run_args(tiny_model, small_data, straight, LORA, "--model.kl_coef=0.05", steps=3))
    cli_main(run_args(tiny_model, small_data, chained, LORA, "--model.kl_coef=0.05", steps=1))
    cli = cli_main(run_args(tiny_model, small_data, chained, LORA, "--model.kl_coef=0.05", "--ckpt_path=last",
                            steps=3))
    assert cli.trainer.global_step == 3
    assert_same_run(straight, chained, 3)
    assert_same_final_state(straight, chained, 3)  # the adapters and their AdamW moments


# --------------------------------------------------------------------------------------------- FSDP2 (gloo)
@pytest.mark.slow
def test_lora_under_fsdp2_on_two_gloo_ranks_resumes_and_exports(tiny_model, tiny_data, tmp_path):
    from peft import PeftModel
    from test_distributed import SEEDED, read_metrics, run_two_ranks
    from transformers import AutoModelForCausalLM

    root = tmp_path / "run"
    args = fit_args(tiny_model, tiny_data, root, *SEEDED, LORA, "--trainer.strategy=fsdp", "--model.lr=1e-3",
                    "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
                    "--trainer.callbacks.every_n_train_steps=1", "--trainer.callbacks.save_top_k=-1", steps=3)
    args = [a.replace("--trainer.devices=1", "--trainer.devices=2") for a in args]
    run_two_ranks(args, tmp_path)
    log_dir = root / "lightning_logs" / "version_0"
    straight = read_metrics(log_dir)
    ckpt = log_dir / "checkpoints" / "epoch=0-step=2.ckpt"
    assert ckpt.is_dir() and len(list(ckpt.glob("*.distcp"))) == 2
    from torch.distributed.checkpoint import FileSystemReader

    saved = [k for k in FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata if k.startswith("state_dict")]
    assert saved and all("lora_" in k for k in saved), saved[:5]  # the sharded checkpoint holds the adapters only
    resumed_root = tmp_path / "resumed"
    run_two_ranks([a.replace(str(root), str(resumed_root)) for a in args] + [f"--ckpt_path={ckpt}"], tmp_path)
    resumed = read_metrics(resumed_root / "lightning_logs" / "version_0")
    assert [r["step"] for r in resumed] == [2.0]
    for key in ("reward", "loss", "grad_norm", "kl", "num_tokens"):  # step 3 of both runs
        assert resumed[0][key] == straight[2][key], key
    assert straight[2]["kl"] > 0  # the adapters moved the policy away from its reference
    # both exports, written by rank 0 from the gathered full weights
    for out in (log_dir, resumed_root / "lightning_logs" / "version_0"):
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), out / "hf_adapter")
        merged = AutoModelForCausalLM.from_pretrained(out / "hf")
        ids = torch.tensor([[3, 14, 15, 9, 26, 5]])
        with torch.no_grad():
            torch.testing.assert_close(merged.eval()(input_ids=ids).logits, adapted.eval()(input_ids=ids).logits,
                                       rtol=0, atol=1e-4)
    final_a = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), log_dir / "hf_adapter")
    final_b = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model),
                                        resumed_root / "lightning_logs" / "version_0" / "hf_adapter")
    for (name, a), b in zip(final_a.named_parameters(), final_b.parameters()):
        assert torch.equal(a, b), name  # the resumed run ends with the straight run's adapters


# ------------------------------------------------------------------------------------------ the 1-GPU recipe
def test_single_gpu_lora_recipe_resolves_and_its_memory_arithmetic_holds(tiny_model):
    """The recipe parses (model.lora typed and validated), and the parameter counts its comments' memory
    arithmetic rests on are those of a Qwen3-8B-shaped model (built on the meta device) under its LoRA settings."""
    import subprocess
    import sys

    import yaml
    from conftest import ROOT
    from transformers import Qwen3Config, Qwen3ForCausalLM

    recipe = ROOT / "configs" / "grpo_gsm8k_qwen3_8b_lora_1gpu.yaml"
    out = subprocess.run([sys.executable, "-m", "rlflow", "fit", "--config", str(recipe),
                          f"--model.model_path={tiny_model}", "--print_config"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    cfg = yaml.safe_load(out.stdout)
    lora = cfg["model"]["lora"]
    assert (lora["r"], lora["alpha"], lora["target_modules"]) == (32, 64.0, "all-linear")
    assert (cfg["trainer"]["devices"], cfg["trainer"]["precision"], cfg["model"]["dtype"]) == (1, "bf16-mixed",
                                                                                               "bfloat16")
    config = Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == 8.19  # "8.19B parameters"
    apply_lora(model, LoraSettings(r=lora["r"], alpha=lora["alpha"], target_modules=lora["target_modules"]))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trainable == 32 * 75_776 * 36 and round(trainable / 1e6, 1) == 87.3  # "87.3M parameters"


def test_adapters_are_float32_over_a_bfloat16_base():
    """The recipe's bf16 base keeps fp32 adapters (PEFT's autocast_adapter_dtype), so plain AdamW loses nothing."""
    model = tiny_causal_lm("qwen3").to(torch.bfloat16)
    apply_lora(model, LoraSettings(r=4))
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert all(d == torch.float32 for n, d in dtypes.items() if "lora_" in n)
    assert all(d == torch.bfloat16 for n, d in dtypes.items() if "lora_" not in n)


def test_gradient_checkpointing_keeps_the_adapters_gradients():
    """The recipe's gradient checkpointing with a frozen base: the adapters' gradients equal those without it
    (reentrant checkpointing would drop them, as no input of a checkpointed layer requires grad)."""
    grads = []
    for checkpointing in (False, True):
        model = tiny_causal_lm("qwen3")
        if checkpointing:
            enable_activation_checkpointing(model)  # as model.gradient_checkpointing does
        random_lora(model)
        model.train()
        ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
        forward_logprobs(model, ids).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, grad in grads[0].items():
        assert grads[1][name] is not None, name
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-6, msg=name)
