"""Check a GPU pack here, in an environment that has only what the GPU machine has (docs/gpu-pack.md).

No Python 3.12 runs here, so this checks a pack built for 3.11 (``pack.py --python-version 3.11``): same closure,
cp311 wheels. The environment (``build/gpu-pack-venv``, Python 3.11) gets the GPU image's distributions only
(:data:`DEVICE_IMAGE`, its package list as KINDS.md gives it): the ones in :data:`DEVICE_VERSIONS` installed at the
GPU machine's versions (torch 2.11.0+cu130 runs on CPU with .venv's CUDA 13 libraries beside it), the rest linked
from .venv. Nothing else: no SGLang, no NIXL, no pydantic. Then, with ``<pack>/env.sh``'s settings and this tree's
``src`` (plus .venv's build of the block index), it runs the stack's round trips (``pack_drive.py``), the import
pass as on CUDA, ``pytest tests/gpu`` (CPU cases) and ``benchmarks/gpu_e2e.py --quick``.

    .venv/bin/python tests/gpu/pack.py --python-version 3.11 --out build/gpu-pack-311
    .venv/bin/python tests/gpu/pack_check.py build/gpu-pack-311
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / "build" / "gpu-pack-venv"
DEVICE_VERSIONS = {"torch": "2.11.0", "torchvision": "0.26.0", "torchaudio": "2.11.0", "triton": "3.6.0",
                   "transformers": "5.17.0"}
DEVICE_IMAGE = set("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy
peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile
tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel
wrapt xarray xxhash yarl zipp""".split())


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def device_venv() -> Path:
    """build/gpu-pack-venv: Python 3.11 with the GPU image's distributions only (see the module's docstring)."""
    python = VENV / "bin" / "python"
    if (VENV / ".ready").exists():
        return python
    shutil.rmtree(VENV, ignore_errors=True)
    subprocess.run(["python3.11", "-m", "venv", str(VENV)], check=True)
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    own = set(DEVICE_VERSIONS) | {"pip", "setuptools"}
    for dist in md.distributions():  # .venv's
        name = _norm(dist.metadata["Name"])
        if name not in DEVICE_IMAGE or name in own:
            continue
        for top in {f.parts[0] for f in dist.files or [] if f.parts and f.parts[0] not in ("..", "__pycache__")}:
            source, target = Path(dist.locate_file(top)), site / top
            if source.exists() and not target.exists() and not top.endswith(".pth"):
                target.symlink_to(source)  # namespace folders (nvidia/, cuda/) come whole
    pins = [f"{d}=={v}" for d, v in DEVICE_VERSIONS.items()]
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", *pins], check=True)
    (VENV / ".ready").touch()
    return python


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pack", type=Path, help="a pack built with --python-version 3.11")
    args = parser.parse_args(argv)
    pack = args.pack.resolve()
    python = device_venv()
    src = ROOT / "build" / "gpu-pack-check" / "src"  # this tree's src with .venv's block index, as `make native` has it
    shutil.rmtree(src, ignore_errors=True)
    shutil.copytree(ROOT / "src", src, ignore=shutil.ignore_patterns("__pycache__", "_blocks*.so"))
    import sglang_kvbm._blocks as blocks

    shutil.copy(blocks.__file__, src / "sglang_kvbm")
    env_sh = (pack / "env.sh").read_text()
    env = dict(os.environ, PYTHONPATH=f"{pack / 'site'}{os.pathsep}{src}",
               CPATH=str(pack / "native" / "include"), LIBRARY_PATH=str(pack / "native" / "lib"))
    env.update(re.findall(r"^export (SGLANG_\w+)=(\S+)", env_sh, re.M))
    checks = [
        ["tests/gpu/pack_drive.py"],
        ["tests/gpu/pack_drive.py", "--imports-as-cuda"],
        ["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu"],
        ["benchmarks/gpu_e2e.py", "--quick", "--json", str(ROOT / "build" / "gpu-pack" / "check_e2e.json")],
    ]
    versions = "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)"
    print("torch, transformers, triton:", subprocess.run([str(python), "-c", versions], check=True,
                                                         capture_output=True, text=True).stdout.strip())
    failed = 0
    for check in checks:
        done = subprocess.run([str(python), *check], env=env, cwd=ROOT, capture_output=True, text=True)
        tail = (done.stdout.strip() or done.stderr.strip()).splitlines()[-1:] or [""]
        print(f"{'ok  ' if done.returncode == 0 else 'FAIL'} {' '.join(check)}: {tail[0][:160]}")
        if done.returncode:
            failed += 1
            print((done.stdout + done.stderr)[-3000:], file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
