"""Adapters from models people already have to the runtime's :class:`PipelineModel`, and back.

- :mod:`.hf`: Hugging Face causal language models (Llama, Mistral, Qwen2, Qwen3, GPT-2),
  loaded layer by layer from a ``save_pretrained`` directory and saved back to one from any
  plan (``causal_lm``, ``save_pretrained``, ``convert_checkpoint``).
- :mod:`.jobfile`: ``chameleon-job``, the job file a model needs, measured on the model.

transformers and safetensors are an optional extra (``pip install 'chameleon-elastic[hf]'``):
nothing here imports them until a function needs them, so ``import chameleon_elastic.models``
works without them, and a function that needs them says which ``pip install`` fixes it.
"""

from __future__ import annotations

__all__: list[str] = []
