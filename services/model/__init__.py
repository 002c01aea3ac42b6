"""Model code shared by the attention and expert services: config, checkpoint, layer math.

- `ModelConfig`, in `config`, is a Hugging Face `config.json` translated once. `families`
  holds the parts where the model families differ: routing, MLA, rotary, shared experts.
- `Checkpoint` reads safetensors, one tensor at a time.
- `layers` holds the layer math.
- `dense` describes the 8-bit dense scheme's tensors.
- `ExpertBank`, in `experts`, is a placement's share of every MoE layer's experts, read
  tensor by tensor from the checkpoint. The expert service holds one, and so does the
  attention service with `--dispatch-backend local`. `expert_metrics` holds its per-expert
  metrics.
"""
