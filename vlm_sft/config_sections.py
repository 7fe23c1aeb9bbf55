"""The typed sections of a run config: ``[model]``, ``[data]``, ``[train]`` and what they nest, as pydantic models.

Config is data. Every field has a docstring; validators raise with the current values and the fix instead of
rewriting a user's setting. This module holds the models only, with the constants their defaults and validators
name; reading them from TOML and the command line, and the ``--help`` text generated from them, live in
``vlm_sft/config.py``, which imports this module (never the reverse) and re-exports every name here. Import from
``vlm_sft.config``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from vlm_sft.config_base import ConfigError, Section
from vlm_sft.config_sources import RowFormat, Scoring, SourceConfig, check_source_names

TINY_MODEL = "tiny"
"""``model.name_or_path`` value that builds the offline tiny Qwen3.5 preset instead of loading a checkpoint."""
TINY_MOE_MODEL = "tiny-moe"
"""``model.name_or_path`` value for the offline tiny Qwen3.5-MoE preset (4 experts, top-2, a shared expert)."""
TINY_MODELS = (TINY_MODEL, TINY_MOE_MODEL)
"""The random-init presets (the shipped tiny processor, no checkpoint)."""
SHAPES_DATASET = "shapes"
"""``data.source`` value that selects the embedded, generated shapes dataset."""
DEFAULT_WARMUP_STEPS = 50
"""Warmup steps when neither ``train.warmup_steps`` nor ``train.warmup_fraction`` is set."""


class VLMConfig(Section):
    """Vision-language settings; present (``[model.vlm]``) whenever the data has images."""

    freeze_vision: bool = True
    """Keep the vision tower's weights fixed. The usual SFT choice; its unused parameters would otherwise decay."""


LORA_TEXT_TARGETS = (
    "q_proj", "k_proj", "v_proj", "o_proj",
    "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj",
    "gate_proj", "up_proj", "down_proj",
)  # fmt: skip
"""Every linear projection of the Qwen3.5 text model, by transformers' names (full attention, GatedDeltaNet, MLP)."""
LORA_VISION_NAMES = ("qkv", "proj", "linear_fc1", "linear_fc2")
"""The vision tower's linear names: peft matches targets by name suffix, so these would adapt the tower."""
LORA_SAVE_MODULES = ("embed_tokens", "lm_head")
"""Text-model modules that ``model.lora.modules_to_save`` may train fully beside the adapters (peft's names)."""
LORA_FUSED_GROUPS = {"in_proj_qkvz": ("in_proj_qkv", "in_proj_z"), "in_proj_ba": ("in_proj_b", "in_proj_a")}
"""GatedDeltaNet projections that serving engines (vLLM, SGLang) fuse into one matrix: adapt all of a group or none."""


class LoraSettings(Section):
    """LoRA adapters on the text model (``[model.lora]``), through peft; the base weights stay frozen."""

    r: int = Field(16, ge=1)
    """Adapter rank."""
    alpha: float = Field(32.0, gt=0)
    """Scale numerator: the adapter's update is ``alpha / r * B @ A``."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input (0 keeps a packed row exactly equal to its samples alone)."""
    target_modules: list[str] = list(LORA_TEXT_TARGETS)
    """Text-model projections to adapt, by transformers' Qwen3.5 names (default: all of them)."""
    modules_to_save: list[str] = []
    """Modules trained fully beside the adapters (``embed_tokens``, ``lm_head``), e.g. for new tokens; written to
    the adapter folder as peft's ``modules_to_save`` and kept in float32 like the adapters."""
    allow_partial_fused: bool = False
    """Accept targets that split a GatedDeltaNet fused group (``in_proj_qkv`` + ``in_proj_z``, ``in_proj_b`` +
    ``in_proj_a``): vLLM and SGLang fuse them and crash on, or silently drop, such adapters."""

    @model_validator(mode="after")
    def _check_targets(self) -> LoraSettings:
        known = set(LORA_TEXT_TARGETS)
        inside_tower = [t for t in self.target_modules if t in LORA_VISION_NAMES]
        if inside_tower:
            raise ConfigError(
                f"model.lora.target_modules {inside_tower} name vision-tower layers (peft matches by name suffix); "
                "LoRA adapts the text model only: remove them"
            )
        unknown = [t for t in self.target_modules if t not in known]
        if unknown or not self.target_modules:
            raise ConfigError(
                f"model.lora.target_modules {unknown or '[]'} match no text-model projection; "
                f"available: {', '.join(LORA_TEXT_TARGETS)}"
            )
        odd = [m for m in self.modules_to_save if m not in LORA_SAVE_MODULES]
        if odd:
            raise ConfigError(
                f"model.lora.modules_to_save {odd} are not text-model modules that can be trained fully beside the "
                f"adapters; available: {', '.join(LORA_SAVE_MODULES)} (the vision tower is never trained with LoRA)"
            )
        for fused, members in LORA_FUSED_GROUPS.items():
            chosen = [m for m in members if m in self.target_modules]
            if chosen and len(chosen) < len(members) and not self.allow_partial_fused:
                raise ConfigError(
                    f"model.lora.target_modules has {chosen} without the rest of {list(members)}, which serving "
                    f"engines fuse into {fused} (vLLM and SGLang then crash or drop the adapter): add "
                    f"{[m for m in members if m not in chosen]}, or set model.lora.allow_partial_fused = true"
                )
        return self


class ModelConfig(Section):
    name_or_path: str = TINY_MODEL
    """``tiny`` / ``tiny-moe`` (offline presets), a local HF checkpoint directory, or a hub id such as
    ``Qwen/Qwen3.5-0.8B`` or ``Qwen/Qwen3.5-35B-A3B`` (dense or MoE: the checkpoint's config decides)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype. bfloat16 (CUDA only): fp32 master weights, gradients and AdamW state; layers compute in bf16
    through FSDP2 mixed precision (gradients reduced in fp32)."""
    attn_impl: Literal["auto", "flash_attn", "torch_varlen", "sdpa"] = "auto"
    """Full-attention backend; ``auto`` picks the fastest boundary-exact one available on the device."""
    linear_attn_impl: Literal["auto", "fla", "torch"] = "auto"
    """GatedDeltaNet and short-conv backend; ``fla`` needs flash-linear-attention on CUDA."""
    loss_impl: Literal["auto", "fla_fused", "chunked"] = "auto"
    """Cross-entropy backend; both avoid materializing full fp32 logits."""
    experts_impl: Literal["auto", "sorted", "grouped_mm"] = "auto"
    """MoE models: routed-expert compute; ``sorted`` (one matmul per active expert, any device) or ``grouped_mm``
    (``torch._grouped_mm``); both exact, no token ever dropped."""
    router_aux_loss_coef: float | None = Field(None, ge=0)
    """MoE models: weight of the load-balancing loss, defined on the whole optimizer step (every micro-batch and
    rank), added to the per-token mean loss; None: the checkpoint's ``router_aux_loss_coef``; 0 turns it off."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer in backward to save activation memory."""
    initializer_range: float | None = None
    """Only for ``tiny`` / ``tiny-moe``: std of the random init (0.08 learns fastest on the shapes task; see
    measured facts)."""
    hidden_size: int = 64
    """Only for ``tiny`` / ``tiny-moe``: text and vision hidden size."""
    vlm: VLMConfig | None = None
    """Vision settings; required when the dataset has images (``[model.vlm]`` in TOML)."""
    lora: LoraSettings | None = None
    """LoRA fine-tuning (``[model.lora]``): adapters on the text model, base weights frozen; None: full fine-tuning."""


class ShapesConfig(Section):
    """The embedded shapes dataset: generated deterministically, materialized once as jsonl + png files."""

    num_train: int = Field(4000, ge=1)
    """Training conversations to generate."""
    num_eval: int = Field(200, ge=0)
    """Held-out conversations (a disjoint seed stream), used for eval loss and colour accuracy."""
    seed: int = 0
    """Generator seed; the same seed gives byte-identical files."""
    image_size: int = Field(64, ge=32)
    """Side of the square images in pixels (64 gives a 4x4 patch grid = 4 image tokens)."""
    root: str = "data/shapes"
    """Folder under which the dataset is materialized (a subfolder per seed and size)."""
    video_share: float = Field(0.0, ge=0.0, le=1.0)
    """Share of conversations that are the video task (a clip whose shape changes colour halfway; asked the colour
    at the start or at the end); the other conversations stay as without it. 0: images and text only."""


class DataConfig(RowFormat, Scoring):
    """The data of a run. The fields it shares with every ``[[data.sources]]`` table (``format`` and the column / key
    / role mapping) apply to ``source`` and ``eval_source`` (``subset`` to ``eval_source`` when it names the same
    dataset, e.g. its ``test`` split); a mixture sets them per table."""

    source: str = SHAPES_DATASET
    """``shapes``, a local jsonl / json / parquet file, a folder of them (a local snapshot of a hub dataset too), or a
    hub dataset id."""
    split: str = "train"
    """Split to read for hub datasets and files loaded through ``datasets``."""
    eval_source: str | None = None
    """Held-out data for eval; for ``shapes`` the generator's eval split is used when this is unset."""
    shapes: ShapesConfig = ShapesConfig()
    """Settings of the embedded shapes dataset."""
    seq_len: int = Field(1024, ge=8)
    """Longest sample kept, in tokens; longer ones are truncated image-safely (or skipped, see ``truncation``)."""
    pack_len: int = Field(2048, ge=8)
    """Tokens per packed row; every row is padded to exactly this length."""
    packing: Literal["bfd", "cat", "stack"] = "bfd"
    """``bfd`` best-fit-decreasing packing, ``cat`` sequential packing, ``stack`` padded batches (baseline)."""
    stack_batch_size: int = Field(32, ge=1)
    """Rows per micro-batch with ``packing = "stack"`` (packed modes put one row per micro-batch)."""
    shuffle: bool = True
    """Visit the training rows in a seeded random order each epoch (False: file order)."""
    bfd_buffer: int = Field(512, ge=1)
    """Look-ahead buffer (samples) of the ``bfd`` packer."""
    max_image_patches_per_pack: int | None = None
    """Cap on vision patches per pack, bounding the vision tower's memory per step; None: no cap."""
    truncation: Literal["drop", "truncate"] = "drop"
    """When truncation cuts the final trainable turn's closing token: ``drop`` the sample or ``truncate`` it."""
    loss_on: Literal["all_assistant", "last_assistant", "stable_prefix"] = "all_assistant"
    """Which assistant turns are trained: ``all_assistant`` every turn as the template renders it (history turns
    before the last user query without their reasoning, as Qwen3.5's template renders them), ``last_assistant`` the
    last one, ``stable_prefix`` only turns a server's generation prompt leads into (the conversation up to the turn,
    rendered with ``add_generation_prompt``, is a prefix of the whole rendering: the final reply and the tool-calling
    turns after the last user query)."""
    enable_thinking: bool = False
    """The thinking mode the run trains for: the default of ``enable_thinking`` in the saved checkpoints' chat
    template (so a server's default prompt is the one training showed), the eval's generation prompts, and where
    each reply's tokens start. false: the generation prompt closes an empty think block, for data without
    ``reasoning_content`` (most SFT data; the default run). true: the prompt opens the think block, for reasoning
    data. A run warns when the data's last turns disagree with it (docs/serving.md)."""
    special_text: Literal["escape", "drop", "error"] = "escape"
    """What to do with special-token strings (e.g. ``<|image_pad|>``) typed in user text."""
    image_root: str | None = None
    """Folder that relative image paths (and relative ``image_url``s) resolve against and that every image must lie
    in; None: the data file's folder (for a hub dataset: no local images allowed outside ``allowed_image_roots``)."""
    allowed_image_roots: list[str] = []
    """Further folders images may be read from (absolute paths, symlink targets). Anything else is skipped as
    ``image_outside_root`` without being opened."""
    video_fps: float | None = Field(None, gt=0)
    """Frames sampled per second of video (transformers' ``fps``); None: the checkpoint's video processor config
    (2 for Qwen3.5). A clip samples at least ``video_min_frames`` and at most ``video_max_frames`` frames."""
    video_min_frames: int | None = Field(None, ge=1)
    """Fewest frames sampled from a video (``min_frames``; 4 for Qwen3.5); None: the checkpoint's."""
    video_max_frames: int | None = Field(None, ge=1)
    """Most frames sampled from a video (``max_frames``; 768 for Qwen3.5); None: the checkpoint's."""
    video_max_pixels: int | None = Field(None, ge=1)
    """Pixel budget of a whole sampled video, frames x height x width after resizing (the video processor's
    ``size.longest_edge``; 786432 for Qwen3.5, i.e. 768 tokens); None: the checkpoint's."""
    video_min_pixels: int | None = Field(None, ge=1)
    """Smallest total pixels a sampled video is resized to (``size.shortest_edge``); None: the checkpoint's."""
    video_max_frame_tokens: int | None = Field(None, ge=1)
    """Per-frame cap in merged tokens (transformers' ``cap_pixels_per_frame`` with ``max_video_tokens``, as
    qwen-vl-utils caps frames), so a short clip cannot spend the whole budget on a few huge frames; None: no cap, as
    transformers 5.25 does by default."""
    max_skip_fraction: float = Field(0.05, ge=0, le=1)
    """Stop the run (with the skip report) when more than this fraction of the samples seen so far were skipped,
    checked once ``skip_check_after`` samples were seen (or a whole pass, if shorter). 1 disables the check."""
    skip_check_after: int = Field(200, ge=1)
    """Samples each data stream (``streams_per_micro_batch``) must see before ``max_skip_fraction`` is enforced."""
    num_workers: int | None = Field(None, ge=0)
    """Processes per rank that render and pack the rank's data streams, dealt to them in turn (0: in the training
    process). It must divide ``streams_per_micro_batch x train.micro_batches`` (otherwise the largest divisor below
    it is used, and logged). None: one per spare core (at least 1 when the machine has a core beside each rank, at
    most 8). The packs and their order are the same for any number (``tests/test_data_order.py``)."""
    streams_per_micro_batch: int = Field(1, ge=1)
    """The training data is cut into ``G = B x this`` streams, each packed on its own, with ``B`` the global batch
    (processes / train.cp_size x train.micro_batches); global micro-batch ``i`` is the next pack of stream ``i % G``.
    The packs of a step then depend on the global batch only, never on the number of processes or workers, and a
    checkpoint resumes on any number of processes with the same global batch. Changing it changes the data order (a
    resume refuses it). A rank reads ``this x train.micro_batches`` streams, which bounds its useful data workers
    (the GPU configs set 8: one H200 on the 0.8B model needs about 8 workers); each holds its own ``bfd_buffer``.
    Keep each stream's share of an epoch well above ``bfd_buffer``: a stream whose whole epoch fits its buffer packs
    it longest-first, so its steps run from long to short samples (the default run's 4000 samples over 8 streams
    reached 37% held-out colour accuracy instead of 86% at one stream). Streaming sources read each stream's own
    files when their number is a multiple of ``G`` (otherwise every stream reads every file)."""
    prefetch_packs: int = Field(8, ge=1)
    """Packs each worker prepares ahead of the training step (absorbs the ``bfd`` packer's refill bursts)."""
    streaming: bool = False
    """Read ``source`` as a ``datasets`` IterableDataset (parquet / jsonl shards or a hub id) instead of preparing it
    on local disk; rows are visited in shard order (no global shuffle)."""
    sources: list[SourceConfig] = []
    """A weighted mixture (``[[data.sources]]`` tables) instead of the one ``source``: each training sample comes from
    a source drawn by weight (docs/data.md). Empty: ``source`` alone."""
    eval_sources: list[SourceConfig] = []
    """Held-out sources (``[[data.eval_sources]]``), each scored on its own too (``eval_loss/<name>``); empty:
    ``eval_source``."""

    @model_validator(mode="after")
    def _check_sources(self) -> DataConfig:
        for field, one in (("sources", "source"), ("eval_sources", "eval_source")):
            tables = getattr(self, field)
            # A value other than the default: the default beside tables is what a saved config.json holds.
            if tables and getattr(self, one) != type(self).model_fields[one].default:
                raise ConfigError(
                    f"data.{one} and [[data.{field}]] are both set; keep one: a single {one}, or one "
                    f"[[data.{field}]] table per source"
                )
            check_source_names(field, tables)
        scored = [s.label for s in self.sources if s.metric is not None]
        if scored:
            raise ConfigError(
                f"[[data.sources]] {scored[0]!r} sets metric: scores are of held-out data; give it a "
                "[[data.eval_sources]] table of its own"
            )
        fields = {**RowFormat.model_fields, **Scoring.model_fields}
        changed = [name for name, f in fields.items() if getattr(self, name) != f.default]
        if changed and (self.sources or self.eval_sources):
            raise ConfigError(
                f"data.{changed[0]} is set beside [[data.sources]] / [[data.eval_sources]] tables, where it would "
                f"apply to nothing: set {changed[0]} = ... in each table it is meant for"
            )
        return self

    @property
    def uses_shapes(self) -> bool:
        """Whether the training data is (or mixes in) the generated shapes dataset."""
        return SHAPES_DATASET in ([s.source for s in self.sources] if self.sources else [self.source])


class TrainConfig(Section):
    seed: int = 0
    """Seed for init, data order and dropout."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``auto``: CUDA when available, else CPU."""
    cpu_threads: int | None = Field(None, ge=1)
    """CPU runs: intra-op threads of each training process (``torch.set_num_threads``). None: one per core left to
    the process (its cores / the training processes on the machine, less its data workers), or ``OMP_NUM_THREADS``
    when set and no launcher started the process; launchers set that variable on their own (``accelerate launch``
    sets 1), so under a launcher it is replaced, and logged. Rules and measurements: ``vlm_sft/cpu_threads.py``."""
    max_steps: int | None = Field(300, ge=1)
    """Optimizer steps to run; None to run ``epochs`` instead."""
    epochs: float | None = None
    """Passes over the data when ``max_steps`` is None."""
    micro_batches: int = Field(1, ge=1)
    """Micro-batches per optimizer step on each rank (gradient accumulation)."""
    cp_size: int = Field(1, ge=1)
    """Context parallelism: groups of this many consecutive ranks split each packed row (Ulysses: every rank holds
    1/cp_size of the tokens; attention and GatedDeltaNet heads are split across the group). Data parallelism is
    world_size / cp_size. Needs data.pack_len divisible by it, and head counts it splits (checked at start)."""
    ep_size: int = Field(1, ge=1)
    """Expert parallelism (Qwen3.5-MoE): groups of this many consecutive ranks split every MoE layer's routed experts
    (each group rank owns num_experts / ep_size of them, FSDP2-sharded over the ranks that own the same ones: no
    copies) and send each token to its experts' ranks and back (two
    all-to-alls per MoE layer; no token dropped). Needs an MoE model, num_experts divisible by it, and world_size a
    multiple of it (checked at start); not combined with train.cp_size > 1."""
    collective_timeout_s: float | None = Field(None, gt=0)
    """Seconds a rank waits in a collective for its peers before the run stops with a timeout error: a rank that
    hangs (or dies without closing its connections, on NCCL) stops the run within this bound. A rank that raises
    stops its peers within about a second whatever this is (``vlm_sft/parallel/failure.py``). None: 600 on the CPU,
    1800 on GPUs (room for a large checkpoint's save or load between two collectives)."""
    grad_sync: Literal["step", "micro_batch"] = "step"
    """When sharded gradients are reduce-scattered: once per ``step`` (after the last micro-batch: 1/micro_batches
    of the traffic, but each rank holds the whole model's unsharded fp32 gradient during the step, 4 bytes per
    parameter) or after every ``micro_batch`` (sharded gradients only: for models whose full gradient does not fit
    one GPU). The update is the same either way."""
    lr: float = Field(1e-3, ge=0)
    """Peak learning rate. 0 changes no weight (AdamW's decay is scaled by it too): a run that checks the pipeline,
    e.g. that the export reproduces the input checkpoint bit for bit."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """Floor of the cosine (``cosine``, and ``wsd``'s decay) as a fraction of ``lr``."""
    schedule: Literal["cosine", "constant", "wsd"] = "cosine"
    """Learning-rate shape after warmup: ``cosine`` to the floor over the rest of the run, ``constant``, or ``wsd``
    (warmup-stable-decay): the peak until the last ``decay_fraction`` of the run, then a cosine to the floor."""
    decay_fraction: float = Field(0.2, gt=0, le=1)
    """``schedule = "wsd"``: the final fraction of the run's optimizer steps over which the lr decays."""
    warmup_steps: int | None = Field(None, ge=0)
    """Linear warmup steps (None: ``warmup_fraction``, or 50 when that is unset too). A count >= the run's steps is
    cut to a tenth of the run, with a warning: the run's length is only known when the schedule is built."""
    warmup_fraction: float | None = Field(None, ge=0, lt=1)
    """Linear warmup as a fraction of the run's optimizer steps (rounded), so shorter runs keep the same shape.
    Exclusive with ``warmup_steps``; a command-line override of either replaces the config file's other."""
    weight_decay: float = Field(0.01, ge=0)
    """AdamW decay, never applied to norms, biases and embeddings."""
    betas: tuple[float, float] = (0.9, 0.98)
    """AdamW betas."""
    optimizer_impl: Literal["fused", "foreach"] = "fused"
    """How torch's AdamW runs its step; the update is the same to float rounding. ``fused``: one kernel per
    device updates every tensor in place, with no step temporaries (torchtitan's default). ``foreach``: a
    sequence of multi-tensor ops that allocates one fp32 copy of the trainable shard per step (4 bytes per
    trainable parameter / world_size beyond the AdamW state; 17 GB per GPU for Qwen3.5-35B-A3B on 8). Measured:
    ``bench/bench_optimizer.py``."""
    optimizer_offload: bool = False
    """Keep AdamW's state (exp_avg, exp_avg_sq: 8 bytes per trainable parameter / world_size) in host memory between
    steps, on the device only during the step, when activations and gathered layers are freed: the training peak
    drops to the larger of the forward / backward peak and the step's (``python -m vlm_sft.checks.memory_plan``). It
    costs host memory (the state, pinned) and two copies of it over PCIe per step; the update is the same, bit for
    bit. For Qwen3.5-35B-A3B on 8 x 80 GB (docs/memory.md)."""
    grad_clip: float | None = Field(1.0, gt=0)
    """Max global gradient norm; None disables clipping."""
    max_nonfinite_steps: int = Field(3, ge=1)
    """A step whose loss or gradient norm is NaN or inf (on any rank) is skipped: no update, counted as
    ``nonfinite_steps`` in metrics.jsonl, its batches logged. This many skipped in a row stop the run (exit code 3,
    naming the first bad step) before anything is saved; 1 stops at the first (``vlm_sft/trainer/nonfinite.py``)."""
    output_dir: str = "outputs/debug"
    """Run folder: metrics.jsonl, checkpoints, final/."""
    save_every: int | None = Field(None, ge=1)
    """Steps between resumable checkpoints; None: only the final one."""
    keep_last: int = Field(2, ge=1)
    """Resumable checkpoints kept."""
    resume: str | None = None
    """``latest`` or a checkpoint path to continue from."""
    log_every: int = Field(10, ge=1)
    """Steps between metrics lines."""
    eval_every: int | None = Field(None, ge=1)
    """Steps between evals; None: eval at the end only."""
    eval_generate: int = Field(64, ge=0)
    """Held-out prompts (a fixed, seeded choice; all of them when there are fewer) the model answers by greedy
    generation at every eval, on the decode cache, prompted exactly as a server prompts the saved checkpoint; replies
    in ``samples.jsonl``, exact-match accuracy as ``eval_gen_acc_*`` in metrics.jsonl. 0: teacher-forced eval only."""
    eval_generate_max_tokens: int = Field(32, ge=1)
    """Longest generated reply in eval, in tokens (a reply also ends at the end-of-turn token)."""
    report_to: list[Literal["none", "tensorboard", "wandb", "mlflow", "trackio"]] = ["none"]
    """Experiment trackers beside metrics.jsonl, through accelerate's tracker classes: ``tensorboard`` (event files
    in ``<output_dir>/tensorboard``), ``wandb``, ``mlflow``, ``trackio``; ``["none"]`` (or ``[]``) for none. One name
    alone may be given as a string (``--train.report_to wandb``). Each needs its package (``pip install tensorboard``,
    or the extra: ``pip install -e ".[tensorboard]"``), checked at start. Rank 0 logs every number of each
    metrics.jsonl record at its step, the run config once, and generated samples as a table; a resumed run continues
    the same tracker run (its id is in the checkpoint)."""
    run_name: str | None = None
    """The run's name in the trackers (wandb / trackio / mlflow run name); None: the output_dir's folder name."""
    project: str = "vlm-sft"
    """wandb and trackio project, mlflow experiment (``MLFLOW_EXPERIMENT_NAME`` in the environment takes precedence,
    as accelerate reads it)."""
    merge_lora: bool = True
    """LoRA runs: also write ``final/`` as merged full weights (beside ``final/adapter/``); false: the adapter only."""
    check_packing: bool = False
    """Run the packing self-check (packed vs per-sample logits and gradients) before training."""
    plot: bool = True
    """Draw ``<output_dir>/run.png`` when the run finishes (about 1.5 s on a CPU; ``python -m vlm_sft.plot
    <output_dir>`` draws it at any time, also mid-run)."""
    log_all_ranks: bool = False
    """Print INFO log lines on every rank (prefixed with the rank), not only on rank 0; other ranks always print
    warnings and errors."""

    @field_validator("report_to", mode="before")
    @classmethod
    def _one_tracker_as_string(cls, value: Any) -> Any:
        """``--train.report_to wandb`` (a string) is the list of that one name; ``none`` (parsed as None) is none."""
        if value is None:
            return ["none"]
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check_report_to(self) -> TrainConfig:
        names = self.report_to
        if "none" in names and len(names) > 1:
            others = [n for n in names if n != "none"]
            raise ConfigError(
                f"train.report_to = {names}: 'none' turns the trackers off and cannot be listed with {others}; "
                f"set train.report_to = {others} (or ['none'] for no tracker)"
            )
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ConfigError(f"train.report_to = {names} lists {repeated} more than once; list each tracker once")
        return self

    @model_validator(mode="after")
    def _check_warmup(self) -> TrainConfig:
        if self.warmup_steps is not None and self.warmup_fraction is not None:
            raise ConfigError(
                f"train.warmup_steps ({self.warmup_steps}) and train.warmup_fraction ({self.warmup_fraction}) are "
                "both set; keep one (on the command line: --train.warmup_steps none or --train.warmup_fraction none)"
            )
        return self


class RunConfig(Section):
    """The whole run: ``[model]``, ``[data]``, ``[train]``."""

    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()

    @model_validator(mode="after")
    def _check_compatible(self) -> RunConfig:
        d, m, t = self.data, self.model, self.train
        if d.seq_len > d.pack_len:
            raise ConfigError(
                f"data.seq_len ({d.seq_len}) > data.pack_len ({d.pack_len}): a kept sample could never fit a pack; "
                f"set data.pack_len >= {d.seq_len} or lower data.seq_len"
            )
        if d.uses_shapes and m.vlm is None:
            raise ConfigError(
                "the shapes dataset has images but [model.vlm] is missing; add a [model.vlm] section "
                "(or --model.vlm.freeze_vision true)"
            )
        if m.dtype == "bfloat16" and t.device == "cpu":
            raise ConfigError(
                "model.dtype = 'bfloat16' with train.device = 'cpu': bf16 on CPU is slow and inexact here; "
                "set model.dtype = 'float32' for CPU runs"
            )
        if t.max_steps is None and t.epochs is None:
            raise ConfigError("set train.max_steps or train.epochs (both are unset)")
        if t.max_steps is not None and t.epochs is not None:
            raise ConfigError(
                f"train.max_steps ({t.max_steps}) and train.epochs ({t.epochs}) are both set; unset one of them"
            )
        if m.lora is not None and m.vlm is not None and not m.vlm.freeze_vision:
            raise ConfigError(
                "[model.lora] with model.vlm.freeze_vision = false: a LoRA run keeps the vision tower frozen (it is "
                "trained fully or not at all, never half-adapted); set model.vlm.freeze_vision = true, or remove "
                "[model.lora] for a full fine-tune"
            )
        if m.name_or_path not in TINY_MODELS and m.initializer_range is not None:
            raise ConfigError(
                f"model.initializer_range only applies to the tiny preset, not to {m.name_or_path!r}; remove it"
            )
        if t.cp_size > 1 and (d.packing == "stack" or d.pack_len % t.cp_size):
            raise ConfigError(
                f"train.cp_size = {t.cp_size} splits every packed row evenly over its ranks: use data.packing 'bfd' or "
                f"'cat' (got {d.packing!r}) with data.pack_len a multiple of {t.cp_size} (got {d.pack_len})"
            )
        if t.ep_size > 1 and t.cp_size > 1:
            raise ConfigError(
                f"train.ep_size = {t.ep_size} with train.cp_size = {t.cp_size}: expert parallelism and context "
                "parallelism are not combined yet; set one of them to 1"
            )
        streamed = [s.label for s in d.sources if (d.streaming if s.streaming is None else s.streaming)]
        if t.epochs is not None and streamed:
            raise ConfigError(
                f"train.epochs = {t.epochs} with the streamed source(s) {streamed} in [[data.sources]]: a mixture's "
                "epoch is the rows of all its sources, unknown for a streamed one; set train.max_steps instead"
            )
        if d.packing == "stack" and d.max_image_patches_per_pack is not None:
            raise ConfigError(
                "data.max_image_patches_per_pack applies to packed rows; with data.packing = 'stack' every "
                "multimodal sample has its own row. Unset it or choose packing 'bfd' / 'cat'"
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")
