"""The models and settings benchmarks/throughput.py measures: the rows of each preset's table
(`PRESETS`), the rows measured against one another (`AGAINST`) and the model each preset
compares with the plain step (`COMPARE`). Settings are `TransformerConfig` fields, plus
``optimizer`` (the row's, not the model's).
"""

# name -> rows of (label, transformer settings, batch, length, microbatches)
REFERENCE = dict(vocab_size=8192, d_model=256, d_ff=1024, num_heads=4, d_kv=64, num_layers=2)
# configs/models/lm_1b.gin: the ~1B decoder for one GPU (943.8M parameters).
ONE_B = dict(vocab_size=32768, d_model=2048, d_ff=8192, num_heads=16, d_kv=128, num_layers=16,
             activation_dtype="bfloat16", remat_policy="dots", attention="auto", max_length=2048)
FLASH_1B = {**ONE_B, "attention": "flash"}  # (a kernel that refuses the model is an error)
MASKED_1B = {**FLASH_1B, "flash_kernel": "cudnn"}  # cuDNN given the packed mask, whatever the rows
# Llama-style blocks (configs/models/llama_tiny.gin, llama_1b.gin): SwiGLU, rotary positions,
# grouped-query attention; trained with AdamW ("optimizer" is the row's, not the model's).
LLAMA = dict(mlp_activations=("silu", "linear"), position_encoding="rotary", optimizer="adamw")
LLAMA_TINY = dict(vocab_size=2048, d_model=128, d_ff=384, num_heads=8, num_kv_heads=2, d_kv=16,
                  num_layers=2, **LLAMA)
LLAMA_1B = {**FLASH_1B, "d_ff": 5504, "num_kv_heads": 4, **LLAMA}
LLAMA_1B_ROW = "llama_1b (SwiGLU, RoPE, 4 of 16 kv heads), packed, 'auto'"
PRESETS = {
    "cpu": [
        ("reference", {}, 16, 128, 1),
        ("reference, bfloat16", {"activation_dtype": "bfloat16"}, 16, 128, 1),
        ("reference, remat dots", {"remat_policy": "dots"}, 16, 128, 1),
        ("reference, scanned layers", {"scan_layers": True}, 16, 128, 1),
        ("reference, 4 microbatches", {}, 16, 128, 4),
        ("paper LM size -1 / 8 (d_model 128, 6 layers)",
         dict(vocab_size=8192, d_model=128, d_ff=512, num_heads=4, d_kv=32, num_layers=6),
         16, 256, 1),
        ("llama_tiny (SwiGLU, RoPE, 2 of 8 kv heads)", LLAMA_TINY, 16, 128, 1),
        ("llama_tiny fp8 (tensorwise)", {**LLAMA_TINY, "quantization": "fp8"}, 16, 128, 1),
    ],
    "gpu": [
        ("1B, packed, flash 'auto'", FLASH_1B, 16, 2048, 1),
        ("1B, packed, flash 'cudnn' (masked)", MASKED_1B, 16, 2048, 1),
        ("1B, packed, flash 'auto'", FLASH_1B, 4, 2048, 1),
        ("1B, packed, flash 'cudnn' (masked)", MASKED_1B, 4, 2048, 1),
        ("1B, packed, flash 'triton'", {**FLASH_1B, "flash_kernel": "triton"}, 16, 2048, 1),
        ("1B, packed, flash 'auto', scanned layers", {**FLASH_1B, "scan_layers": True}, 16, 2048, 1),
        (LLAMA_1B_ROW, LLAMA_1B, 16, 2048, 1),
        ("llama_1b fp8 (tensorwise), packed, 'auto'", {**LLAMA_1B, "quantization": "fp8"},
         16, 2048, 1),
    ],
}
# A row -> (the row it is measured against, the name of the ratio of their tokens/s, which
# follows the table).
AGAINST = {"llama_1b fp8 (tensorwise), packed, 'auto'": (LLAMA_1B_ROW, "llama_1b fp8/bf16"),
           "llama_tiny fp8 (tensorwise)": ("llama_tiny (SwiGLU, RoPE, 2 of 8 kv heads)",
                                           "llama_tiny fp8/bf16")}
# What each preset compares with the plain implementation: the model and whether the plain
# side is the fast GPU baseline (bf16, cuDNN is_causal attention, remat dots; rows unpacked).
COMPARE = {"cpu": (REFERENCE, False), "gpu": (ONE_B, True)}
