"""Install mesh_tensorflow. TensorFlow comes from an extra, so users keep the TF build they have:
pip install -e '.[cpu]' (tensorflow-cpu) or '.[gpu]' (tensorflow with CUDA), plus '[test]' for tests
and '[docs]' for the API reference."""

from setuptools import find_packages, setup

# torch is pinned exactly: that CPU wheel is what CI installs; other specs pull a CUDA build.
HF = ["torch==2.13.0", "transformers>=5.0,<6", "sentencepiece"]

setup(
    name="mesh-tensorflow",
    version="0.2.0",
    description="Mesh TensorFlow: named-dimension model parallelism, reborn for TensorFlow 2.16+",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    packages=find_packages(include=["mesh_tensorflow", "mesh_tensorflow.*"]),
    package_data={"mesh_tensorflow.transformer": ["gin/*.gin", "gin/*/*.gin"]},
    python_requires=">=3.9",
    install_requires=["numpy", "absl-py", "gin-config", "safetensors"],
    extras_require={
        "cpu": ["tensorflow-cpu>=2.16"],
        "gpu": ["tensorflow[and-cuda]>=2.16"],
        # The tests also draw the explainer's and example's pictures.
        "test": ["pytest", "pytest-xdist", "hypothesis", "mock", "scipy", "ruff", "matplotlib"],
        # Tests of mesh_tensorflow.transformer.convert against Hugging Face's own T5 (they skip without).
        "hf": HF,
        # What t5 0.9.4 and seqio 0.0.20 import, to fine-tune with T5's own MtfModel. They and
        # tensorflow-text go in with --no-deps, which an extra cannot say (t5 would pull the original
        # mesh-tensorflow, tensorflow-text a second TensorFlow): docs/converting.md. The test suite
        # keeps them out of .venv, in .t5deps/ (scripts/setup_t5.sh), since they bring jax.
        "t5": HF + ["clu", "flax", "jax", "pyglove", "tensorflow-datasets", "editdistance", "sacrebleu",
                    "scikit-learn", "rouge-score", "pandas", "babel", "immutabledict", "nltk", "tensorboard"],
        # The Transformer example's loss-curve picture (it runs without, saying so).
        "examples": ["matplotlib"],
        # mtf.explain's tiling and communication pictures (it explains in text without).
        "plot": ["matplotlib"],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
