"""Hugging Face interop: `convert.py from_hf` / `to_hf` between HF checkpoint
directories and runs of ours (`convert.py`); the registry of architectures
(`mappings.py`), one module per family (`gpt2.py`, `llama.py`, `bert.py`,
`t5.py`, `bart.py`) over the shared tensor tables (`tables.py`)."""
