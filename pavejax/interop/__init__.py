"""Interoperability with the PyTorch ecosystem: PEFT LoRA adapters and torch-named safetensors."""

from pavejax.interop.peft import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    export_lora_peft,
    export_merged_safetensors,
    import_lora_peft,
    import_merged_safetensors,
    minilm_flax_path,
    minilm_torch_name,
    minilm_torch_tensor_name,
)

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "export_lora_peft",
    "export_merged_safetensors",
    "import_lora_peft",
    "import_merged_safetensors",
    "minilm_flax_path",
    "minilm_torch_name",
    "minilm_torch_tensor_name",
]
