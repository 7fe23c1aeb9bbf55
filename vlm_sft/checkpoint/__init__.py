"""Checkpoints, in one place: Hugging Face directories in (``load``: sharded, each rank reads only its slices) and out
(``export``: streamed tensor by tensor, in the checkpoint's own dtype), LoRA adapter folders (``lora_export``), and
the resumable training state (``state``: DCP shards + a plain-format trainer state). ``hf_dir`` knows the files.

The model package reads and writes no files; everything that touches a checkpoint lives here. Submodules are
imported by name (``from vlm_sft.checkpoint.load import from_pretrained``), so importing the package is light.
"""
