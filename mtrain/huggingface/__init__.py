"""Hugging Face model folders: the families mtrain's models can be (`families`), their
safetensors weights (`tensors`) and tokenizers (`vocabulary`). The modes that use them are
``--mode=import`` and ``--mode=export`` (`mtrain.modes.convert`)."""
