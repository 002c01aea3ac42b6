"""Model code shared by the attention and expert services: config, checkpoint, layer math.

`ModelConfig` (`config`: a Hugging Face `config.json` translated once; `families`: the parts
where the model families differ, routing, MLA, rotary, shared experts), `Checkpoint`
(safetensors, one tensor at a time), the layer math (`layers`), `dense` (the 8-bit dense
scheme's tensors), and `ExpertBank` (`experts`: a placement's share of every MoE layer's
experts, read tensor by tensor from the checkpoint; the expert service's, and the attention
service's own with `--dispatch-backend local`) with its per-expert metrics
(`expert_metrics`).
"""
