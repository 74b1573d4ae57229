import os
import shutil

import pytest

import models
from ferry_server import ROOT, Server

EXAMPLES = os.path.join(ROOT, "examples")


@pytest.fixture(scope="session")
def repo(tmp_path_factory):
    """One repository with a model per datatype, a few shapes of batching, and real models."""
    path = str(tmp_path_factory.mktemp("repo"))
    for dt in models.DATATYPES:
        models.identity(path, f"identity_{dt.lower()}", dt)
    models.identity(path, "identity_fp32_nobatch", "FP32", batched=False)
    models.add_mul(path, "add_mul")  # no config.pbtxt: auto-complete
    models.densenet(path)
    return path


@pytest.fixture(scope="session")
def server(repo):
    with Server(["--model-repository", repo, "--model-repository", EXAMPLES]) as s:
        yield s


@pytest.fixture
def fresh_repo(tmp_path):
    return str(tmp_path)


def copy_example(dest, name):
    shutil.copytree(os.path.join(EXAMPLES, name), os.path.join(dest, name))


def framework_python(variable, require, script, framework):
    """The Python with `framework` that `variable` names (made by scripts/`script`); without it
    the calling test module skips, or fails when `require` is set to 1 (CI sets it)."""
    python = os.environ.get(variable)
    if not python:
        if os.environ.get(require) == "1":
            raise RuntimeError(f"{require}=1 but {variable} is not set (source scripts/{script})")
        pytest.skip(f"no Python with {framework} ({variable}; scripts/{script} makes one)", allow_module_level=True)
    return python
