"""allatt_jax: layer-wise attention-head pruning of All-attention Transformer LMs in JAX."""
import setuptools

setuptools.setup(
    name="allatt_jax",
    version="0.1.0",
    description=("Train All-attention Transformer language models and prune their "
                 "attention heads layer by layer with trainable L0 gates."),
    # configs/ is installed as allatt_jax/configs, so that `--config=demo.py` finds a
    # shipped config from any folder (allatt_jax/cli.py).
    packages=[*setuptools.find_packages(include=["allatt_jax", "allatt_jax.*"]),
              "allatt_jax.configs"],
    package_dir={"allatt_jax.configs": "configs"},
    package_data={"allatt_jax": ["corpus/*.xz", "corpus/*.md", "data/checksums.tsv"]},
    entry_points={"console_scripts": [
        "allatt-jax = allatt_jax.__main__:main",
        "allatt-train = allatt_jax.__main__:train",
        "allatt-evaluate = allatt_jax.__main__:evaluate",
        "allatt-score = allatt_jax.__main__:score",
        "allatt-sample = allatt_jax.__main__:sample",
        "allatt-export = allatt_jax.__main__:export",
    ]},
    # jax 0.10 needs Python >= 3.11 and numpy >= 2.0; jax 0.11 and 0.12 Python >= 3.12
    # and numpy >= 2.1 and 2.2: pip installs jax 0.10.x on Python 3.11. CI tests 0.10
    # (Python 3.11) and 0.11 (the lent GPUs'); the README says how 0.12 was tested.
    python_requires=">=3.11",
    install_requires=[
        "jax>=0.10,<0.13",
        "flax>=0.12,<0.14",
        "optax>=0.2.5,<0.3",
        "orbax-checkpoint>=0.11,<0.13",
        "tensorflow-datasets>=4.9.8,<5",
        "tensorflow-cpu>=2.18,<3",
        "ml_collections>=1.0,<2",
        "clu>=0.0.12",
        "tensorboard>=2.18",
        "absl-py>=2.1",
        "numpy>=2.0",
        "matplotlib>=3.8",
    ],
    extras_require={
        "test": ["pytest>=8", "pytest-xdist>=3.8", "nbclient>=0.10", "nbformat>=5.10", "ipykernel>=6.29"],
        "tpu": ["jax[tpu]>=0.10,<0.13"],
        # jax[cuda12] also runs on newer drivers (its last wheels: jax 0.12.0.1). cuda13
        # takes jax's CUDA 13 wheels: jax 0.11 or 0.12, as the lent GPUs run (0.11.2),
        # need Python >= 3.12; on 3.11 pip installs jax 0.10.x with them.
        "cuda": ["jax[cuda12]>=0.10,<0.13"],
        "cuda13": ["jax[cuda13]>=0.10,<0.13"],
        # Pallas' Triton kernels compiled for sm_90a without a GPU
        # (allatt_jax/perf/gpu_compile.py, tests/test_perf_gpu_compile.py; CI).
        "gpu-compile": ["triton>=3.9,<3.10; platform_system == 'Linux'"],
    },
)
