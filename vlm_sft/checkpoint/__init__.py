"""The run's model and its checkpoints, in one place.

``build`` makes the run's model from its config (a random-init preset, or a checkpoint loaded the sharded way,
parallelized for the run's mesh). Hugging Face directories come in through ``load`` (sharded, each rank reads only
its slices) and go out through ``export`` (streamed tensor by tensor, in the checkpoint's own dtype); LoRA adapter
folders are ``lora_export``'s, the resumable training state ``state``'s (DCP shards + a plain-format trainer state);
``hf_dir`` knows the files.

The model package reads and writes no files; everything that touches a checkpoint lives here. Submodules are
imported by name (``from vlm_sft.checkpoint.load import from_pretrained``), so importing the package is light.
"""
