"""`switchyard.demo_model`: the bundled demo model is an ordinary Hugging Face checkpoint,
with its chat template."""

from __future__ import annotations


def test_demo_model_is_a_normal_hf_checkpoint() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from switchyard.demo_model import DEFAULT_MODEL

    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL)
    text = tok.apply_chat_template([{"role": "user", "content": "What is 1 + 2?"}],
                                   add_generation_prompt=True, tokenize=False)
    assert text == "<|user|>What is 1 + 2?<|assistant|>"
