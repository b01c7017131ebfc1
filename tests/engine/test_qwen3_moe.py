"""Qwen3-MoE and Qwen3.5-MoE against transformers and PEFT 0.21.2 (fp32, CPU): top-k routing,
experts as one matrix product per expert hit, dense MLP layers between, both checkpoint
layouts of the experts, and LoRA as PEFT puts it on these models.

Tiny random models from scripts/make_reference_models.py: "qwen3_moe" (8 experts, top-2, not
renormalised; experts in layers 0 and 2, a dense MLP in layer 1) and "qwen3_5_moe" (DeltaNet
and attention layers, 8 experts top-2 and a gated shared expert in every layer).

LoRA, as PEFT 0.21.2 with transformers 5.23 resolves the targets (the tests build PEFT's own
model from the same target list and compare):
- Qwen3-MoE: gate_proj + up_proj become LoRA on the experts' fused `gate_up_proj` [E, 2I, H]
  (rank 2r, alpha 2α), down_proj on `down_proj` [E, H, I] (PEFT target_parameters, its
  ParamWrapper: A [E·r, in], B [out, E·r]); gate_proj without up_proj is refused, as PEFT
  refuses it; the dense-MLP layer gets no MLP LoRA; all-linear (or "gate") adds the router.
- Qwen3.5-MoE: PEFT maps nothing: gate_proj/up_proj/down_proj are the shared expert's Linears,
  all-linear adds shared_expert_gate; the routed experts get no LoRA.
Checked: logits, logprobs, loss and every LoRA gradient vs PEFT; PEFT loads the engine's
adapter (PEFT's own saved config and the v4-style target list) and the engine loads PEFT's;
three adapters fused x 20 training rounds vs each alone; greedy generation vs PEFT merged and
sampled logprobs vs the training forward with expert LoRA; rsLoRA's gate_up scale; merged
export (router merged, expert LoRA refused); hostile targets, ranks and shapes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from engine_harness import Engine, EngineError
from numerics import assert_close
from sampling_checks import assert_greedy_matches_generate, assert_samples_match_training_forward
from safetensors.torch import load_file, save_file
from test_fused import HYPER
from test_model import check_lora_against_peft, engine_forward, hf_logits, sequences
from test_sampler_pool import GAP, engine, load, make_adapter, one_thread, row  # noqa: F401 (fixtures)
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from transformers import AutoModelForCausalLM

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def fused_layout(src: Path, dst: Path) -> Path:
    """The same model with experts stored fused (mlp.experts.gate_up_proj [E, 2I, H],
    mlp.experts.down_proj [E, H, I]), the other layout the loader accepts."""
    shutil.copytree(src, dst)
    weights = load_file(src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    out = {k: v for k, v in weights.items() if ".mlp.experts." not in k}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts."
        if f"{p}0.gate_proj.weight" not in weights:
            continue
        e = config.get("num_experts", config.get("num_local_experts"))
        out[p + "gate_up_proj"] = torch.stack([torch.cat([weights[f"{p}{j}.gate_proj.weight"],
                                                          weights[f"{p}{j}.up_proj.weight"]]) for j in range(e)])
        out[p + "down_proj"] = torch.stack([weights[f"{p}{j}.down_proj.weight"] for j in range(e)])
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_packed_logits_match_transformers_both_layouts(engine: Engine, reference_models: Path,
                                                       tmp_path: Path) -> None:
    model_dir = reference_models / "qwen3_moe"
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    seqs = sequences(256, [1, 5, 33, 100], seed=12)
    for label, directory in [("per-expert", model_dir), ("fused", fused_layout(model_dir, tmp_path / "fused"))]:
        info = load(engine, directory)
        assert info["parameter_count"] == sum(p.numel() for p in hf.parameters())
        got = engine_forward(engine, seqs)
        reply = engine.call("forward", {"ops": [{"adapter_id": "", "datums": [{"input_tokens": s} for s in seqs[::-1]]},
                                                {"adapter_id": "", "datums": [{"input_tokens": seqs[1]}]}],
                                        "return_logits": True})
        with torch.no_grad():
            for i, s in enumerate(seqs):
                ref = hf_logits(hf, s)
                assert_close(f"qwen3_moe {label} len{len(s)} logits", got[i], ref, 1e-4, absolute=True)
                assert_close(f"qwen3_moe {label} len{len(s)} reordered",
                             reply["ops"][0]["logits"][len(seqs) - 1 - i], ref, 1e-4, absolute=True)


MLP = ["gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("targets", [ATTENTION + MLP + ["gate", "lm_head"], MLP, ["down_proj"],
                                     ["gate_proj", "up_proj", "q_proj"]])
def test_lora_logits_and_gradients_match_peft(engine: Engine, reference_models: Path, targets: list[str]) -> None:
    """The experts' LoRA (PEFT target_parameters; nested wrappers when both are targeted),
    the router's, the attention linears' and lm_head's vs PEFT built from the same list."""
    model_dir = reference_models / "qwen3_moe"
    load(engine, model_dir)
    check_lora_against_peft(engine, model_dir, "qwen3_moe", targets)


def peft_all_linear_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft = get_peft_model(base, LoraConfig(r=2, lora_alpha=4, target_modules="all-linear"))
    return {k.replace(".default", ""): tuple(p.shape) for k, p in peft.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("variant", ["qwen3_moe", "qwen3_5_moe"])
def test_all_linear_is_what_peft_wraps(engine: Engine, reference_models: Path, variant: str) -> None:
    """all-linear: the same tensors, shapes and order as PEFT's "all-linear" (Qwen3-MoE: the
    attention linears, the experts and the router, no dense-MLP layer; Qwen3.5-MoE: DeltaNet,
    attention, the shared expert and its gate, no routed expert, no router)."""
    model_dir = reference_models / variant
    load(engine, model_dir)
    engine.call("create_adapter", {"adapter_id": "all", "rank": 2, "targets": ["all-linear"]})
    ours = engine.call("get_adapter_state", {"adapter_id": "all"})["weights"]
    ref = peft_all_linear_shapes(model_dir)
    assert {k: tuple(v.shape) for k, v in ours.items()} == ref
    print(f"{variant} all-linear: {len(ref)} tensors as PEFT wraps them")


def test_hostile_targets_ranks_and_shapes(engine: Engine, reference_models: Path) -> None:
    model_dir = reference_models / "qwen3_moe"
    engine.call("load_model", {"model_dir": str(model_dir), "dtype": "float32", "max_lora_rank": 8})
    with pytest.raises(EngineError, match="unknown LoRA target module 'w1'"):
        engine.call("create_adapter", {"adapter_id": "x", "rank": 2, "targets": ["q_proj", "w1"]})
    with pytest.raises(EngineError, match="none of the LoRA target modules .in_proj_qkv. is in"):
        engine.call("create_adapter", {"adapter_id": "x", "rank": 2, "targets": ["in_proj_qkv"]})
    # PEFT: "Cannot convert PEFT target(s) up_proj without also targeting gate_proj".
    with pytest.raises(EngineError, match="up_proj without gate_proj.*gate_up_proj"):
        engine.call("create_adapter", {"adapter_id": "x", "rank": 2, "targets": ["q_proj", "up_proj"]})
    with pytest.raises(EngineError, match="ParamWrapper .* lora_dropout"):
        engine.call("create_adapter", {"adapter_id": "x", "rank": 2, "dropout": 0.1, "targets": MLP})
    with pytest.raises(EngineError, match="LoRA rank 9 exceeds this server's max_lora_rank of 8"):
        engine.call("create_adapter", {"adapter_id": "x", "rank": 9, "targets": MLP})
    engine.call("create_adapter", {"adapter_id": "x", "rank": 2, "targets": MLP})
    weights = engine.call("get_adapter_state", {"adapter_id": "x"})["weights"]
    key = "base_model.model.model.layers.2.mlp.experts.base_layer.lora_B.weight"
    assert tuple(weights[key].shape) == (64, 2 * 2 * 8)
    for bad in [torch.zeros(64, 2 * 8), torch.zeros(2 * 2 * 8, 64)]:  # PEFT's rank r, and transposed
        with pytest.raises(EngineError, match=f"weight '{key}' has shape .*the adapter's is .64, 32."):
            engine.call("set_adapter_state", {"adapter_id": "x", "weights": {key: bad}})
    with pytest.raises(EngineError, match="adapter has no weight '.*layers.1.mlp.experts.lora_A.weight'"):
        engine.call("set_adapter_state", {"adapter_id": "x", "weights": {
            "base_model.model.model.layers.1.mlp.experts.lora_A.weight": torch.zeros(16, 32)}})

    q35 = reference_models / "qwen3_5_moe"
    load(engine, q35)
    with pytest.raises(EngineError, match="router of Qwen3_5MoeForCausalLM is not a Linear"):
        engine.call("create_adapter", {"adapter_id": "y", "rank": 2, "targets": ["q_proj", "gate"]})


ADAPTERS = {"a": 2, "b": 4, "c": 8}


def op(adapter: str, round_: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(ord(adapter) * 1000 + round_)
    datums = []
    for n in (5 + ord(adapter) % 3, 23):
        tokens = torch.randint(0, 256, (n,), generator=g)
        datums.append({"input_tokens": tokens, "target_tokens": torch.roll(tokens, -1),
                       "inputs": {"weights": torch.rand(n, generator=g)}})
    return {"adapter_id": adapter, "datums": datums, "loss": {"name": "cross_entropy"}}


def test_fused_training_equals_solo_training(reference_models: Path) -> None:
    """Three adapters fused for 20 forward_backward + optim_step rounds end where each ends
    alone: every op is routed and its experts computed on its own rows."""
    model_dir = reference_models / "qwen3_moe"

    def create(e: Engine, a: str) -> None:
        e.call("create_adapter", {"adapter_id": a, "rank": ADAPTERS[a], "alpha": 16.0, "seed": ord(a),
                                  "targets": ["all-linear"]})

    with Engine() as fused:
        load(fused, model_dir)
        for a in ADAPTERS:
            create(fused, a)
        for r in range(20):
            fused.call("forward_backward", {"ops": [op(a, r) for a in ADAPTERS]})
            for a in ADAPTERS:
                fused.call("optim_step", {"adapter_id": a, "hyper": HYPER})
        fused_state = {a: fused.call("get_adapter_state", {"adapter_id": a})["weights"] for a in ADAPTERS}
    for a in ADAPTERS:
        with Engine() as solo:
            load(solo, model_dir)
            create(solo, a)
            for r in range(20):
                solo.call("forward_backward", {"ops": [op(a, r)]})
                solo.call("optim_step", {"adapter_id": a, "hyper": HYPER})
            solo_state = solo.call("get_adapter_state", {"adapter_id": a})["weights"]
        worst = max(float((fused_state[a][k] - w).abs().max()) for k, w in solo_state.items())
        print(f"adapter {a}: {len(solo_state)} tensors, max|fused - solo| = {worst:.3e}")
        assert worst <= 1e-6


def test_greedy_matches_transformers_generate(engine: Engine, reference_models: Path) -> None:
    """16 prompts x 4 adapters (+ base) x 32 greedy tokens in one batch vs transformers generate
    (PEFT merged): attention, lm_head, and expert + router LoRA, rows of different adapters
    routed to the same experts in one step."""
    model_dir = reference_models / "qwen3_moe"
    load(engine, model_dir)
    refs = {"": AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(),
            "a": make_adapter(engine, model_dir, "a", 4, ATTENTION, seed=11),
            "b": make_adapter(engine, model_dir, "b", 2, ["q_proj", "o_proj", "lm_head"], seed=12),
            "e": make_adapter(engine, model_dir, "e", 4, MLP + ["gate"], seed=13),
            "f": make_adapter(engine, model_dir, "f", 2, ["v_proj", "down_proj"], seed=14)}
    prompts = sequences(256, [1 + (5 * i) % 23 for i in range(16)], seed=22)
    cases = [(a, p) for p in prompts for a in refs]
    assert_greedy_matches_generate(engine, refs, cases, max_tokens=32, gap=GAP, label="qwen3_moe")


# ---- Qwen3.5-MoE: the Qwen3.5 hybrid layers with experts + a gated shared expert everywhere ----

DELTANET = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]


def test_qwen3_5_moe_packed_logits_match_transformers(engine: Engine, reference_models: Path,
                                                      tmp_path: Path) -> None:
    model_dir = reference_models / "qwen3_5_moe"
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    seqs = sequences(256, [1, 5, 65, 100], seed=13)  # across the delta rule's 64-token chunks
    for label, directory in [("per-expert", model_dir), ("fused", fused_layout(model_dir, tmp_path / "fused"))]:
        info = load(engine, directory)
        assert info["parameter_count"] == sum(p.numel() for p in hf.parameters())
        got = engine_forward(engine, seqs)
        reply = engine.call("forward", {"ops": [{"adapter_id": "", "datums": [{"input_tokens": s} for s in seqs[::-1]]},
                                                {"adapter_id": "", "datums": [{"input_tokens": seqs[1]}]}],
                                        "return_logits": True})
        with torch.no_grad():
            for i, s in enumerate(seqs):
                ref = hf_logits(hf, s)
                assert_close(f"qwen3_5_moe {label} len{len(s)} logits", got[i], ref, 1e-4, absolute=True)
                assert_close(f"qwen3_5_moe {label} len{len(s)} reordered",
                             reply["ops"][0]["logits"][len(seqs) - 1 - i], ref, 1e-4, absolute=True)


def test_qwen3_5_moe_lora_matches_peft_and_fuses_exactly(reference_models: Path) -> None:
    """DeltaNet + attention + shared expert (gate/up/down_proj, shared_expert_gate) + lm_head
    LoRA vs PEFT (logits, logprobs, loss, gradients), then 3 all-linear adapters fused x 20
    rounds vs each alone."""
    model_dir = reference_models / "qwen3_5_moe"
    # Two adapters: LoRA on the DeltaNet decay input (in_proj_a) is itself only ~1e-5 exact in
    # fp32 (test_qwen3_5.py), so the shared expert is held without it.
    for targets in (DELTANET + ATTENTION + ["lm_head"], ATTENTION + MLP + ["shared_expert_gate", "lm_head"]):
        with Engine() as engine:
            load(engine, model_dir)
            check_lora_against_peft(engine, model_dir, "qwen3_5_moe", targets)

    def create(e: Engine, a: str) -> None:
        e.call("create_adapter", {"adapter_id": a, "rank": ADAPTERS[a], "alpha": 16.0, "seed": ord(a),
                                  "targets": ["all-linear"]})

    with Engine() as fused:
        load(fused, model_dir)
        for a in ADAPTERS:
            create(fused, a)
        for r in range(20):
            fused.call("forward_backward", {"ops": [op(a, r) for a in ADAPTERS]})
            for a in ADAPTERS:
                fused.call("optim_step", {"adapter_id": a, "hyper": HYPER})
        fused_state = {a: fused.call("get_adapter_state", {"adapter_id": a})["weights"] for a in ADAPTERS}
    for a in ADAPTERS:
        with Engine() as solo:
            load(solo, model_dir)
            create(solo, a)
            for r in range(20):
                solo.call("forward_backward", {"ops": [op(a, r)]})
                solo.call("optim_step", {"adapter_id": a, "hyper": HYPER})
            solo_state = solo.call("get_adapter_state", {"adapter_id": a})["weights"]
        worst = max(float((fused_state[a][k] - w).abs().max()) for k, w in solo_state.items())
        print(f"qwen3_5_moe adapter {a}: {len(solo_state)} tensors, max|fused - solo| = {worst:.3e}")
        assert worst <= 1e-6


def test_qwen3_5_moe_greedy_matches_transformers_generate(engine: Engine, reference_models: Path) -> None:
    model_dir = reference_models / "qwen3_5_moe"
    load(engine, model_dir)
    refs = {"": AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(),
            "a": make_adapter(engine, model_dir, "a", 4, DELTANET + ATTENTION, seed=11),
            "s": make_adapter(engine, model_dir, "s", 2, MLP + ["shared_expert_gate"], seed=12),
            "t": make_adapter(engine, model_dir, "t", 4, ["q_proj", "o_proj", "lm_head"], seed=13),
            "u": make_adapter(engine, model_dir, "u", 2, ["in_proj_qkv", "out_proj", "down_proj"], seed=14)}
    prompts = sequences(256, [1 + (5 * i) % 23 for i in range(15)] + [70], seed=23)
    cases = [(a, p) for p in prompts for a in refs]
    assert_greedy_matches_generate(engine, refs, cases, max_tokens=32, gap=GAP, label="qwen3_5_moe")


PEFT_TARGETS = {"qwen3_moe": ATTENTION + MLP + ["gate"],
                "qwen3_5_moe": DELTANET + ATTENTION + MLP + ["shared_expert_gate"]}


@pytest.mark.parametrize("variant", ["qwen3_moe", "qwen3_5_moe"])
def test_adapter_files_round_trip_with_peft(engine: Engine, reference_models: Path, tmp_path: Path,
                                            variant: str) -> None:
    """PEFT loads the engine's (trained) adapter and gives its logits, with the config PEFT
    itself writes (Qwen3-MoE: target_parameters, the gate_up rank/alpha patterns) and with
    the plain target list (PEFT converts it on load); the engine loads a PEFT-made adapter
    and gives PEFT's logits. Same tensor names and shapes both ways."""
    model_dir = reference_models / variant
    load(engine, model_dir)
    targets = PEFT_TARGETS[variant]
    rank, alpha = 4, 8.0
    seqs = sequences(256, [9, 30], seed=41)

    # PEFT-made, random A and B, saved by PEFT, loaded by the engine.
    torch.manual_seed(0)
    made = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                          LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets)).eval()
    with torch.no_grad():
        for name, p in made.named_parameters():
            if "lora_" in name:
                p.copy_(0.1 * torch.randn_like(p))
    peft_dir = tmp_path / "peft"
    made.save_pretrained(peft_dir)
    peft_config = json.loads((peft_dir / "adapter_config.json").read_text())
    print(f"{variant}: PEFT writes target_modules={peft_config['target_modules']} "
          f"target_parameters={peft_config['target_parameters']} rank_pattern={peft_config['rank_pattern']} "
          f"alpha_pattern={peft_config['alpha_pattern']}")
    peft_weights = load_file(peft_dir / "adapter_model.safetensors")
    engine.call("create_adapter", {"adapter_id": "p", "rank": rank, "alpha": alpha, "targets": targets})
    engine.call("set_adapter_state", {"adapter_id": "p", "weights": peft_weights})
    ours = engine.call("get_adapter_state", {"adapter_id": "p"})["weights"]
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in peft_weights.items()}
    got = engine_forward(engine, seqs, "p")
    with torch.no_grad():
        for i, q in enumerate(seqs):
            assert_close(f"{variant} PEFT-made adapter seq{i} logits", got[i], hf_logits(made, q), 1e-4, absolute=True)

    # Engine-made, trained a few steps (B no longer zero), loaded by PEFT.
    engine.call("create_adapter", {"adapter_id": "t", "rank": rank, "alpha": alpha, "seed": 5, "targets": targets})
    for r in range(3):
        engine.call("forward_backward", {"ops": [op("t", r)]})
        engine.call("optim_step", {"adapter_id": "t", "hyper": HYPER})
    trained = engine.call("get_adapter_state", {"adapter_id": "t"})["weights"]
    assert all(float(v.abs().max()) > 0 for k, v in trained.items() if "lora_B" in k)
    got = engine_forward(engine, seqs, "t")
    for label, config in [("PEFT's config", peft_config), ("target list", dict(peft_config, target_modules=targets,
                                                                                target_parameters=None,
                                                                                rank_pattern={}, alpha_pattern={}))]:
        d = tmp_path / label.replace(" ", "_").replace("'", "")
        d.mkdir()
        (d / "adapter_config.json").write_text(json.dumps(config))
        save_file(trained, d / "adapter_model.safetensors", metadata={"format": "pt"})
        loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                           d).eval()
        params = {k.replace(".default", ""): p for k, p in loaded.named_parameters() if "lora_" in k}
        assert set(params) == set(trained), set(params) ^ set(trained)
        assert all(torch.equal(params[k], v) for k, v in trained.items())
        with torch.no_grad():
            for i, q in enumerate(seqs):
                assert_close(f"{variant} PEFT loads ours ({label}) seq{i} logits", hf_logits(loaded, q), got[i],
                             1e-4, absolute=True)


@pytest.mark.parametrize("variant", ["qwen3_moe", "qwen3_5_moe"])
def test_sampled_logprobs_with_expert_lora_match_training_forward(engine: Engine, reference_models: Path,
                                                                  variant: str) -> None:
    """Rows of two MLP-LoRA adapters and the base sampled together (one routing per step):
    sampled-token and prompt logprobs equal the training forward over prompt + tokens."""
    model_dir = reference_models / variant
    load(engine, model_dir)
    make_adapter(engine, None, "m", 4, PEFT_TARGETS[variant], seed=21)
    make_adapter(engine, None, "n", 2, MLP, seed=22)
    prompts = sequences(256, [6, 13, 1, 9, 20], seed=31)
    adapters = ["m", "n", "", "m", "n"]
    rows = [row(a, p, temperature=1.0, top_k=40, top_p=0.9, seed=7 + i, num_samples=2, max_tokens=10,
                want_prompt_logprobs=True) for i, (a, p) in enumerate(zip(adapters, prompts))]
    reply = engine.call("sample", {"rows": rows})
    worst = assert_samples_match_training_forward(engine, reply["rows"], adapters, prompts, max_tokens=10)
    print(f"{variant}: largest logprob difference {worst:.3e}")


def test_merged_export_merges_the_router_and_refuses_expert_lora(reference_models: Path, tmp_path: Path) -> None:
    """Merged export: a router LoRA (2-D) merges as PEFT's merge_and_unload does; LoRA on the
    experts (3-D target_parameters) is refused by name (UNIMPLEMENTED), nothing written."""
    from test_export import run_export
    model_dir = reference_models / "qwen3_moe"
    for targets in (["q_proj", "gate"], MLP):
        torch.manual_seed(1)
        peft = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                              LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
        adapter_dir = tmp_path / "-".join(targets)
        peft.save_pretrained(adapter_dir)
        code, reply, _ = run_export(model_dir, adapter_dir, tmp_path / "exports", adapter_dir.name)
        if targets == MLP:
            assert code == 1 and reply["code"] == 12 and "LoRA on the MoE experts" in reply["message"], reply
            assert not (tmp_path / "exports" / adapter_dir.name).exists()
            continue
        assert code == 0, reply
        merged = dict(peft.merge_and_unload().state_dict())
        got = load_file(Path(reply["path"]) / "model.safetensors")
        changed = [k for k in got if k.endswith(("mlp.gate.weight", "q_proj.weight"))]
        assert len(changed) == 2 * 3 - 1  # q_proj in 3 layers, the router in the 2 MoE layers
        base = load_file(model_dir / "model.safetensors")
        assert all(float((got[k] - base[k]).abs().max()) > 1e-3 for k in changed)  # the LoRA is in
        worst = max(float((got[k] - merged[k]).abs().max()) for k in changed)
        print(f"router + q_proj export vs PEFT merge_and_unload: max |dW| = {worst:.3e} over {len(changed)} tensors")
        assert worst <= 1e-6


def test_rslora_scales_gate_up_as_peft(engine: Engine, reference_models: Path) -> None:
    """With rsLoRA PEFT scales gate_up_proj by alpha_pattern / sqrt(rank_pattern) = 2α/√(2r),
    the other targets by α/√r: the engine's logits equal PEFT's."""
    from test_model import random_lora_state
    model_dir = reference_models / "qwen3_moe"
    load(engine, model_dir)
    targets = ["q_proj"] + MLP + ["gate"]
    engine.call("create_adapter", {"adapter_id": "rs", "rank": 4, "alpha": 8.0, "use_rslora": True, "targets": targets})
    weights = random_lora_state(engine, "rs", seed=9)
    engine.call("set_adapter_state", {"adapter_id": "rs", "weights": weights})
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                          LoraConfig(r=4, lora_alpha=8.0, use_rslora=True, target_modules=targets)).eval()
    assert not set_peft_model_state_dict(peft, weights).unexpected_keys
    seqs = sequences(256, [9, 30], seed=43)
    got = engine_forward(engine, seqs, "rs")
    with torch.no_grad():
        for i, q in enumerate(seqs):
            assert_close(f"rslora seq{i} logits", got[i], hf_logits(peft, q), 1e-5)
