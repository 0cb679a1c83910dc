"""The run config: every knob of `python -m jaxrl_llm.train` with its default (what the
trainer derives from it is in `derived.py`).

Experiment files in `configs/` start from `base_config()` and change what they need
(big_vision style); any key can be overridden on the command line
(`--config.algo.beta=0.0`). `algo.*` fields other than `name` are typed placeholders:
left at None they take the preset's value (`rl.preset(algo.name)`), set they override it.
`checks.validate` stops a bad config before anything is loaded or compiled.
"""

from __future__ import annotations

import dataclasses
import os

import ml_collections
from ml_collections import config_dict

from jaxrl_llm.data import config as data_config

_ALGO_TYPES = {bool: bool, int: int, float: float, str: str}


def _algo_defaults() -> ml_collections.ConfigDict:
    """`name` + one typed None placeholder per AlgoConfig field."""
    from jaxrl_llm.rl.algos import AlgoConfig

    algo = ml_collections.ConfigDict()
    algo.name = "grpo"  # grpo | dr_grpo | dapo | gspo | sapo | gmpo | rloo | reinforce_pp | ppo
    for field in dataclasses.fields(AlgoConfig):
        if field.name in ("name", "distill_coef"):  # distill_coef: teacher.weight
            continue
        default = field.default
        kind = _ALGO_TYPES.get(type(default), float)
        if field.name == "reward_weights":
            algo[field.name] = config_dict.placeholder(tuple)
        else:
            algo[field.name] = config_dict.placeholder(kind)
    return algo


def base_config() -> ml_collections.ConfigDict:
    """Every key of a run with its default, one section per concern (`config_checks` has
    one checker per section)."""
    c = ml_collections.ConfigDict()
    c.model = model_defaults()
    c.mesh = mesh_defaults()
    c.data = data_config.default_config()
    c.rollout = rollout_defaults()
    c.algo = _algo_defaults()
    c.teacher = teacher_defaults()
    c.optim = optim_defaults()
    # label -> weight | {name, weight, options}
    c.rewards = ml_collections.ConfigDict({"gsm8k": 1.0})
    c.env = env_defaults()
    c.agent = agent_defaults()
    c.train = train_defaults()
    c.eval = eval_defaults()
    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every = 50  # steps; 0 = only at the end and on SIGTERM
    c.checkpoint.keep = 3
    c.checkpoint.async_save = True
    c.logging = ml_collections.ConfigDict()
    c.logging.tensorboard = True
    c.logging.wandb = False
    c.logging.wandb_project = "jaxrl_llm"
    c.logging.run_name = ""
    return c


def teacher_defaults() -> ml_collections.ConfigDict:
    """On-policy distillation (docs/teachers_and_judges.md): a teacher scores every token
    the policy samples; each token's advantage gains weight * (log pi_T - log pi_S)."""
    t = ml_collections.ConfigDict()
    t.path = ""  # teacher model (as model.path; the student's tokenizer); "" = no teacher
    t.weight = 1.0  # w of the distillation advantage (task rewards keep their own weights)
    # Several teachers: each row's teacher is paths[row[field]] (rows whose value is not
    # there use teacher.path, which may be "" only if every row names one).
    t.field = ""  # the data row field naming a row's teacher; "" = one teacher for all
    t.paths = ml_collections.ConfigDict()  # teacher name -> model path
    return t


def model_defaults() -> ml_collections.ConfigDict:
    m = ml_collections.ConfigDict()
    # HF model dir, .gguf file, hub name or built-in name (models.builtin.BUILTIN_MODELS:
    # quickstart, smollm2-135m-instruct)
    m.path = "quickstart"
    m.tokenizer = ""  # tokenizer dir or .gguf file; "" = model.path
    m.ref_path = ""  # reference model (as model.path); "" = the initial policy
    m.dtype = "float32"  # params: float32 | bfloat16 (the optimizer keeps a f32 master)
    m.remat = "none"  # none | full | dots | dots_no_batch
    # Attention (docs/long_context.md): auto | xla | blockwise | cudnn | pallas. auto: GPU
    # cuDNN, TPU Pallas splash, CPU the full score matrix for short sequences and
    # blockwise (memory linear in the length) for long ones. xla: the full [T, S] matrix.
    m.attention = "auto"
    m.attention_block = 512  # query / key block of blockwise and pallas (tokens)
    # False: unroll the layers (update, reference and sampler; faster on CPU, compile time
    # grows with depth, sampling holds a second copy of the layer weights). None: picked at
    # start-up (`tuning`): False on CPU up to 8 layers, else True.
    m.scan_layers = config_dict.placeholder(bool)
    # Mixture-of-experts models (docs/moe.md): how the experts run. ragged: grouped matmul
    # (`ragged_dot`; TPU / GPU). blocked: batched matmuls over blocks of one expert's rows
    # (CPU, whose ragged_dot computes every group). dense: every expert on every token.
    # gmm: the TPU Pallas grouped-matmul kernel (interpret mode elsewhere: tests only).
    # auto: gmm on TPU (ragged when XLA partitions the program), ragged on GPU, blocked on CPU.
    m.moe_impl = "auto"
    # Gated DeltaNet layers (Qwen3.5, Qwen3-Next; docs/models.md): the chunked form's
    # tokens per chunk, and how it runs: xla, or pallas (the TPU kernel; interpret mode
    # elsewhere: tests only). auto: pallas on one TPU chip (head sizes multiples of 128,
    # the chunk of 8), else xla.
    m.linear_chunk = 64
    m.linear_impl = "auto"
    m.lora = lora_defaults()
    return m


def mesh_defaults() -> ml_collections.ConfigDict:
    # -1 = the rest. expert: shards the experts of a mixture-of-experts model (and is one
    # more batch axis for everything else; docs/moe.md); 1 for a dense model.
    m = ml_collections.ConfigDict({"data": 1, "fsdp": -1, "expert": 1, "tensor": 1})
    # Context parallelism: one sequence's tokens split over this many devices in the
    # update and the reference forward (heads all-to-all; docs/sharding.md). The model's
    # attention heads must be divisible by it.
    m.context = 1
    # rollout.mode='split': the last rollout_devices devices form the rollout mesh (shape
    # `rollout`), the others the training mesh (shape data / fsdp / tensor above).
    m.rollout_devices = 0
    m.rollout = ml_collections.ConfigDict({"data": 1, "fsdp": -1, "expert": 1, "tensor": 1})
    return m


def lora_defaults() -> ml_collections.ConfigDict:
    """LoRA (docs/lora.md): only low-rank adapters train; the base weights are loaded once
    and shared by the policy, the reference (adapters off) and the sampler."""
    lora = ml_collections.ConfigDict()
    lora.rank = 0  # r; 0 = off (every weight trains)
    lora.alpha = 16.0  # the update is scaled by alpha / rank
    # Adapted projections, any of q, k, v, o, gate, up, down (all attention and MLP ones).
    lora.targets = ("q", "k", "v", "o", "gate", "up", "down")
    lora.dropout = 0.0  # dropout on the adapters' input in the update's forward (PEFT's)
    # How the sampler applies the adapters: "merged" (W + (alpha/r) A B once per step, a
    # transient weight set), "unmerged" (x W + (x A) B per token) or "auto" (docs/lora.md).
    lora.sampler = "auto"
    return lora


def rollout_defaults() -> ml_collections.ConfigDict:
    r = ml_collections.ConfigDict()
    r.batch_size = 8  # B: prompts per step (global, all hosts)
    r.num_generations = 8  # G: completions per prompt
    r.max_new_tokens = 64
    r.temperature = 1.0
    r.top_k = 0
    r.top_p = 1.0
    r.stop_tokens = ("<eos>",)  # token strings; "<eos>" = the tokenizer's EOS
    # Prompts are left-padded to a bucket length, one compiled sampler / reference / update
    # per bucket: bucket_steps lengths per doubling (1: 16, 32, 64 ...; 2: 16, 24, 32, 48
    # ...; 4: 16, 20, 24, 28, 32, 40 ...; 8). More steps, less padding, more programs.
    # None: picked at start-up (`tuning`): 4 on CPU, 2 elsewhere.
    r.bucket_steps = config_dict.placeholder(int)
    # The decode loop runs in this many segments, each over a KV cache just long enough for
    # its tokens (grown in between): a token's attention reads the filled slots plus at most
    # a segment's worth, not the whole prompt + max_new_tokens cache, for that many compiled
    # loop bodies (1 = one loop). Pays off most for long generations at large batch. While
    # the cache grows the old and new one coexist: peak KV memory under 2x one full cache.
    r.cache_segments = 4  # = sampling.CACHE_SEGMENTS
    # Prefill long prompts in chunks of this many tokens (0 = the whole prompt at once):
    # peak activations of one chunk, the same cache and logits (docs/long_context.md).
    r.prefill_chunk = 0
    # sync: each step samples with the parameters it updates. overlap: the next step's
    # rollout is dispatched with the current parameters before this step's scoring and
    # update, so the devices sample while the host scores; every batch is then one policy
    # version old (`algo.off_policy` weighs it; docs/async.md). split: a rollout mesh of
    # its own (`mesh.rollout_devices`) samples and scores in a thread, up to
    # `max_staleness` versions ahead of the training mesh.
    r.mode = "sync"
    # split: a batch sampled by parameter version v trains update u only if u - v <= this
    # (the sampler waits otherwise); 0 reproduces sync.
    r.max_staleness = 1
    # split: a generation in flight when newer parameters arrive goes on with them (its KV
    # cache recomputed by them), checked every partial_chunk tokens (with env.name: before
    # each turn); each token keeps the log-prob of the version that drew it.
    r.partial = False
    r.partial_chunk = 16
    # split: N > 0 rollout worker processes sample instead of a rollout mesh here (each its
    # own JAX world: `python -m jaxrl_llm.workers.serve`, docs/workers.md), at
    # worker_addresses ("host:port,host:port", N of them; the shared secret in the
    # JAXRL_WORKER_TOKEN environment variable); the weights go to them after each update.
    # 0 = the rollout runs in this process.
    r.workers = 0
    r.worker_addresses = ""
    # A worker that sends nothing for this long while it owes an answer (stopped, its host
    # hung, its network cut) is dropped like a dead one and its steps go to the others.
    # Longer than a worker's slowest answer: its first `run` compiles the engine's programs.
    r.worker_timeout_s = 600.0
    # At start (and on resume) the trainer waits this long for its workers to answer, then
    # starts with those that did (none: an error); the others are tried again every
    # worker_retry_s and join when they answer, as workers lost in the run do.
    r.worker_start_s = 60.0
    # A worker lost in the run, or listed and not answering, is tried again this long after
    # (before a step is given out): restarted at its address, it joins and takes steps. One
    # that is still gone costs a refused connection, or up to 5 s when its host is gone.
    r.worker_retry_s = 30.0
    # TLS to the workers: the PEM file (a CA, or the workers' own self-signed certificate)
    # their certificates must chain to; the workers serve with --tls_cert and --tls_key.
    # "": plain TCP (the token and the weights in clear: a private network only).
    r.worker_tls_ca = ""
    # How the weights reach the workers: host (each sync's bytes fetched to this host and
    # sent over the worker's link; every backend) | transfer (each worker process pulls its
    # own shards from this trainer's devices through jax.experimental.transfer; the link
    # carries only the uuids; not with LoRA, TLS or a trainer of several processes; it pays
    # into workers of several processes: into one on a CPU host, 'host' is faster).
    r.worker_sync = "host"
    # static: the dense-batch sampler (`sampling.Sampler`): every row keeps its slot and its
    # KV cache until the batch's longest row stops. paged: continuous batching over a paged
    # KV cache (`sampling.PagedSampler`, docs/sampling.md#paged-engine): finished rows hand
    # their slot and pages to waiting ones and a prompt's G rows share its pages; pays off
    # when completion lengths are long-tailed. One process; in overlap and split one engine
    # session streams across steps (docs/sampling.md#streaming-into-training); with env.name
    # (sync only) a row parked on its environment gives up its slot, keeps its pages
    # (docs/sampling.md#multi-turn-on-the-engine); with agent.entry (sync only) each episode
    # is a row that keeps its KV cache between its requests (docs/agents.md#batching).
    # static is the default: measured on CPU, the engine loses where most rows run about as
    # long as the longest (a real model's own lengths) and wins where most stop far
    # earlier (docs/sampling.md, "When to pick which").
    r.engine = "static"
    r.paged = ml_collections.ConfigDict()
    r.paged.slots = 0  # sequences decoded at once; 0 = the batch's rows (B * G)
    # KV pages in the pool (the null page included); 0 = the static sampler's cache size,
    # B * G * (prompt bucket + max_new_tokens) tokens (env.max_total_tokens with env.name;
    # with agent.entry, the episodes x (data.max_prompt_len + agent.max_total_tokens))
    r.paged.pages = 0
    r.paged.page_size = 16  # tokens per page
    r.paged.chunk_steps = 16  # decode steps on device between host checks
    r.paged.prefill_chunk = 64  # prompt tokens per prefill program (a multiple of page_size)
    # Attention over the pages (docs/sampling.md#paged-engine): auto = JAX's Pallas TPU
    # paged-attention kernel for decode steps on TPU (bfloat16 model, no sliding window,
    # head_dim a multiple of 128),
    # else the portable path; pages = the portable path everywhere (never run the kernel);
    # gather = the portable reference (every layer's pages gathered first); pallas = the
    # kernel on TPU and GPU, any dtype (interpret mode on GPU: slow, for checks; the
    # trainer refuses it on CPU, where the kernel's tests call it directly).
    r.paged.attention = "auto"
    return r


def env_defaults() -> ml_collections.ConfigDict:
    """Multi-turn environments (docs/envs.md); env.name "" = single-turn completions."""
    e = ml_collections.ConfigDict()
    # calculator | guess_number | python_tool | path/to/file.py:Class | package.module:Class
    e.name = ""
    e.options = ml_collections.ConfigDict()  # the environment's __init__ keywords
    # Model turns per trajectory: a number, or a schedule over training steps
    # "turns@step,..." (e.g. "2@0,4@100,8@300": more turns as training goes on).
    e.max_turns = config_dict.FieldReference(4, field_type=object)
    # Completion tokens of a trajectory (its turns and the observations between them): the
    # width the reference and the update see. rollout.max_new_tokens is one turn's budget.
    e.max_total_tokens = 256
    # Token strings that end a turn besides rollout.stop_tokens (a tool-call closing tag
    # that is one token, e.g. Qwen's "</tool_call>").
    e.stop_tokens = ()
    # Reward = final turn's + sum over earlier turns of discount^(turns from the end) x
    # theirs; 0 = the final reward only.
    e.turn_reward_discount = 0.0
    e.step_timeout_s = 10.0  # one reset / step call; past it the worker is killed
    e.trajectory_timeout_s = 60.0  # a trajectory's calls together
    e.workers = 0  # environment worker processes; 0 = CPU count
    # The workers split into this many lanes that step at once: with rollout.engine=paged
    # a row's step starts as its turn ends, while another step runs (docs/envs.md).
    e.lanes = 1
    e.memory_mb = 2048  # address space an environment worker may add; 0 = no cap
    return e


def agent_defaults() -> ml_collections.ConfigDict:
    """Agents through the OpenAI-compatible gateway (docs/agents.md); "" = none."""
    a = ml_collections.ConfigDict()
    # path/to/file.py:run | package.module:run: `async def run(client, example) -> float`,
    # client an openai.AsyncOpenAI on the gateway; each episode is one trajectory.
    a.entry = ""
    a.options = ml_collections.ConfigDict()  # the agent's keywords after (client, example)
    # Tokens of an episode after its prompt (its turns and the messages added between
    # them): the width the reference and the update see; a request that would pass it is
    # refused and its episode scores 0. rollout.max_new_tokens caps one response.
    a.max_total_tokens = 256
    a.timeout_s = 120.0  # one episode's own time (not its waits for the model); past it: 0
    # How long the batcher waits for more requests once one is pending, at least (a quarter
    # of the last sampler call's time when longer); every running episode having one ends
    # the wait at once.
    a.batch_wait_s = 0.05
    # The largest request body the gateway reads (413 past it), bounding what it parses and
    # renders before the token limit can be checked.
    a.max_request_bytes = 4 * 2**20
    return a


def optim_defaults() -> ml_collections.ConfigDict:
    o = ml_collections.ConfigDict()
    o.learning_rate = 1e-6
    o.schedule = "constant"  # constant | cosine | linear (after warmup)
    o.warmup_steps = 0
    o.end_lr_ratio = 0.0  # cosine / linear decay to learning_rate * this
    o.weight_decay = 0.0
    o.b1 = 0.9
    o.b2 = 0.999
    o.eps = 1e-8
    # Storage dtype of Adam's first moment: float32 | bfloat16 (2 bytes per parameter
    # less; computed in float32 either way). The second moment stays float32: with
    # b2 = 0.999 its decay is below bfloat16's rounding step and would never happen.
    o.mu_dtype = "float32"
    o.max_grad_norm = 1.0
    # Gradient accumulation per optimizer step (memory; the result does not depend on it).
    # None: picked at start-up (`tuning`): on CPU from a memory budget, else 1.
    o.micro_batches = config_dict.placeholder(int)
    o.mini_batches = 1  # optimizer steps per pass over a rollout batch
    # Sequence packing (docs/packing.md): auto | on | off. The update's and the reference's
    # forwards over whole rows pack each micro-batch's rows into fewer sequences (no
    # padding computed; the same numbers). auto: when the rows are on one device.
    o.packing = "auto"
    # Packed sequences per micro-batch row, in (0, 1]; a micro-batch whose rows do not
    # fit in that many runs padded (both forms are compiled into the one program).
    o.packing_capacity = 0.625
    o.critic_learning_rate = 1e-5  # PPO
    return o


def train_defaults() -> ml_collections.ConfigDict:
    t = ml_collections.ConfigDict()
    t.num_steps = 100
    t.seed = 0
    t.log_every = 1
    t.print_samples_every = 10  # 0 = never
    t.num_printed_samples = 2
    t.skip_nonfinite = False  # False: a NaN/inf loss or gradient stops the run
    # Sequence chunk of the chunked log-prob computation. None: picked at start-up
    # (`tuning`): 32 on CPU, else 128.
    t.logprob_chunk = config_dict.placeholder(int)
    t.verifier_workers = 0  # 0 = CPU count
    t.verifier_timeout_s = 10.0
    # Address space a verifier worker may take beyond what loading the verifiers took
    # (MiB); a reward that needs more fails for its sample, not the run. 0 = no cap.
    t.verifier_memory_mb = 2048
    # A step fails when some verifier errs on more than this fraction of its calls (one
    # warning line naming the first error); max_failed_steps such steps in a row stop the
    # run with that error (0 = never stop).
    t.max_verifier_error_rate = 0.5
    t.max_failed_steps = 3
    t.transfer_guard = True  # jax.transfer_guard("disallow") around the step body
    # When the host allocator's free pages go back to the system
    # (`parallel.allocator.release_free_memory`): "compiles" after new compiles and around
    # evaluations; "phases" also before every rollout and every update, so that one
    # phase's temporaries are resident at a time (a lower peak for a page fault per page
    # of each phase's block every step: the laptop configs of real models).
    t.release_memory = "compiles"
    # Resume even when the config changes what the run means (model, data, algorithm,
    # optimizer, batch, G, rewards, seed); the differences are listed either way.
    t.allow_config_change = False
    # XLA's persistent compilation cache: a rerun, a resume or another run of the same
    # programs loads them instead of compiling (process-wide while the run lasts); the
    # measured matmul peak (MFU) is kept there too. "" = off.
    t.compilation_cache_dir = default_compilation_cache_dir()
    return t


def default_compilation_cache_dir() -> str:
    """$XDG_CACHE_HOME/jaxrl_llm/xla (default ~/.cache/jaxrl_llm/xla)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxrl_llm", "xla")


def eval_defaults() -> ml_collections.ConfigDict:
    e = ml_collections.ConfigDict()
    e.every = 0  # steps; 0 = never (the final step is always evaluated when > 0)
    e.at_start = True  # with eval.every > 0: also evaluate the initial policy (step 0)
    e.split = "test"  # TFDS split of the held-out prompts
    e.path = ""  # held-out JSONL file when data.source="jsonl"
    e.num_prompts = 64
    e.pass_k = 8
    e.temperature = 1.0
    e.correct_reward = ""  # reward label that decides pass@k; "" = the first one
    return e
