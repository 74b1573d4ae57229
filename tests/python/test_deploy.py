"""The deployment kit: the scripts pass shellcheck and print in --dry-run exactly the commands
the guides describe; the Terraform modules parse, document and use every variable, declare their
providers, set each resource's required arguments, and their examples call them correctly."""
import glob
import json
import os
import re
import shlex
import shutil
import subprocess

import hcl2
import pytest

from ferry_server import ROOT

SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "container", "*.sh")) + glob.glob(os.path.join(ROOT, "scripts", "*.sh"))
                 + glob.glob(os.path.join(ROOT, "bench", "*.sh")) + [os.path.join(ROOT, "vertex", "deploy.sh"),
                                                                   os.path.join(ROOT, "sagemaker", "deploy.sh")])


@pytest.fixture(scope="module")
def shellcheck():
    """shellcheck from PATH, else Debian's package unpacked into .work (no root needed)."""
    found = shutil.which("shellcheck")
    if found:
        return found
    root = os.path.join(ROOT, ".work", "shellcheck")
    binary = os.path.join(root, "usr", "bin", "shellcheck")
    if not os.path.exists(binary):
        debs = os.path.join(root, "debs")
        os.makedirs(debs, exist_ok=True)
        subprocess.run(["apt-get", "download", "-q", "shellcheck"], cwd=debs, check=True, capture_output=True)
        for deb in glob.glob(os.path.join(debs, "*.deb")):
            subprocess.run(["dpkg", "-x", deb, root], check=True)
    return binary


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: os.path.relpath(p, ROOT))
def test_scripts_pass_shellcheck(shellcheck, script):
    r = subprocess.run([shellcheck, "-x", "-S", "warning", script], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def dry_run(script, *args):
    r = subprocess.run(["bash", os.path.join(ROOT, script), *args, "--dry-run"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    commands = [shlex.split(line[2:]) for line in (r.stdout + r.stderr).splitlines() if line.startswith("+ ")]
    return commands, r.stdout


def find(commands, *prefix):
    hits = [c for c in commands if c[:len(prefix)] == list(prefix)]
    assert hits, f"no command starting {' '.join(prefix)} in {commands}"
    return hits[0]


def flag(command, name):
    return command[command.index(name) + 1]


def test_vertex_dry_run_prints_push_upload_and_deploy():
    commands, out = dry_run("vertex/deploy.sh", "--project", "proj", "--region", "europe-west4", "--model-uri",
                            "gs://models/repo", "--accelerator", "nvidia-tesla-t4,1", "--min-replicas", "2",
                            "--max-replicas", "5", "--default-model", "densenet")
    push = find(commands, "docker", "push")
    assert push[2].startswith("europe-west4-docker.pkg.dev/proj/ferry/ferry:")
    upload = find(commands, "gcloud", "ai", "models", "upload")
    assert flag(upload, "--container-image-uri") == push[2]
    assert flag(upload, "--artifact-uri") == "gs://models/repo"
    assert flag(upload, "--container-ports") == "8080"
    assert "FERRY_VERTEX_AI_DEFAULT_MODEL=densenet" in flag(upload, "--container-env-vars")
    deploy = find(commands, "gcloud", "ai", "endpoints", "deploy-model")
    assert (flag(deploy, "--min-replica-count"), flag(deploy, "--max-replica-count")) == ("2", "5")
    assert flag(deploy, "--accelerator") == "type=nvidia-tesla-t4,count=1"
    assert flag(deploy, "--autoscaling-metric-specs") == "cpu-usage=60,gpu-duty-cycle=60"
    find(commands, "gcloud", "ai", "endpoints", "create")
    commands, _ = dry_run("vertex/deploy.sh", "--project", "p", "--region", "r", "--model-uri", "gs://m/r",
                          "--scale-on", "request-counts-per-minute=3000")
    deploy = find(commands, "gcloud", "ai", "endpoints", "deploy-model")
    assert flag(deploy, "--autoscaling-metric-specs") == "request-counts-per-minute=3000"
    assert "gcloud ai endpoints predict" in out and "raw-predict" in out


def test_sagemaker_dry_run_prints_every_step():
    commands, out = dry_run("sagemaker/deploy.sh", "--region", "us-west-2", "--role", "arn:aws:iam::1:role/x",
                            "--model-data", "s3://b/repo/", "--min-instances", "2", "--max-instances", "6")
    push = find(commands, "docker", "push")
    assert push[2].startswith("123456789012.dkr.ecr.us-west-2.amazonaws.com/ferry:")
    model = find(commands, "aws", "sagemaker", "create-model")
    container = json.loads(flag(model, "--primary-container"))
    assert container["Image"] == push[2]
    assert container["ModelDataSource"]["S3DataSource"] == {"S3Uri": "s3://b/repo/", "S3DataType": "S3Prefix",
                                                            "CompressionType": "None"}
    config = find(commands, "aws", "sagemaker", "create-endpoint-config")
    variant = json.loads(flag(config, "--production-variants"))[0]
    assert variant["InitialInstanceCount"] == 2 and variant["ContainerStartupHealthCheckTimeoutInSeconds"] == 600
    assert variant["ModelDataDownloadTimeoutInSeconds"] == 1200
    target = find(commands, "aws", "application-autoscaling", "register-scalable-target")
    assert (flag(target, "--min-capacity"), flag(target, "--max-capacity")) == ("2", "6")
    policy = find(commands, "aws", "application-autoscaling", "put-scaling-policy")
    spec = json.loads(flag(policy, "--target-tracking-scaling-policy-configuration"))
    assert spec["PredefinedMetricSpecification"]["PredefinedMetricType"] == "SageMakerVariantInvocationsPerInstance"
    assert "invoke-endpoint" in out
    # A tarball, and a multi-model endpoint.
    commands, _ = dry_run("sagemaker/deploy.sh", "--region", "us-west-2", "--role", "r", "--model-data", "s3://b/m.tar.gz")
    assert json.loads(flag(find(commands, "aws", "sagemaker", "create-model"), "--primary-container"))["ModelDataUrl"] == "s3://b/m.tar.gz"
    commands, out = dry_run("sagemaker/deploy.sh", "--region", "us-west-2", "--role", "r", "--model-data", "s3://b/mme/",
                            "--multi-model")
    assert json.loads(flag(find(commands, "aws", "sagemaker", "create-model"), "--primary-container"))["Mode"] == "MultiModel"
    assert "--target-model" in out


@pytest.mark.parametrize("script,args,says", [
    ("vertex/deploy.sh", ["--region", "r"], "missing --project --model-uri"),
    ("vertex/deploy.sh", ["--project", "p", "--region", "r", "--model-uri", "s3://x"], "must be a gs:// URI"),
    ("vertex/deploy.sh", ["--project", "p", "--region", "r", "--model-uri", "gs://x", "--min-replicas", "4",
                          "--max-replicas", "2"], "above --max-replicas"),
    ("vertex/deploy.sh", ["--project", "p", "--region", "r", "--model-uri", "gs://x", "--scale-on", "3000"],
     "--scale-on takes METRIC=TARGET"),
    ("sagemaker/deploy.sh", ["--region", "r"], "missing --role --model-data"),
    ("sagemaker/deploy.sh", ["--region", "r", "--role", "x", "--model-data", "gs://x"], "must be an s3:// URI"),
    ("sagemaker/deploy.sh", ["--bogus"], "unknown argument: --bogus"),
])
def test_scripts_refuse_bad_arguments(script, args, says):
    r = subprocess.run(["bash", os.path.join(ROOT, script), *args, "--dry-run"], capture_output=True, text=True)
    assert r.returncode == 2 and says in r.stderr, r.stderr


# Terraform ------------------------------------------------------------------------------------

TERRAFORM = os.path.join(ROOT, "terraform")
MODULES = sorted(glob.glob(os.path.join(TERRAFORM, "modules", "*")))
EXAMPLES = sorted(glob.glob(os.path.join(TERRAFORM, "examples", "*")))

# Arguments each resource type requires (from the providers' documentation); a resource type
# missing here fails the test, so the table grows with the modules.
REQUIRED = {
    "google_storage_bucket": {"name", "location"},
    "google_service_account": {"account_id"},
    "google_storage_bucket_iam_member": {"bucket", "role", "member"},
    "google_vertex_ai_endpoint": {"display_name", "location"},
    "google_artifact_registry_repository_iam_member": {"repository", "role", "member"},
    "google_project_iam_member": {"project", "role", "member"},
    "google_compute_instance_template": {"machine_type", "disk"},
    "google_compute_health_check": {"name"},
    "google_compute_firewall": {"name", "network"},
    "google_compute_region_instance_group_manager": {"name", "base_instance_name", "version"},
    "google_compute_region_autoscaler": {"name", "target", "autoscaling_policy"},
    "terraform_data": set(),
    "aws_s3_bucket": set(),
    "aws_s3_bucket_public_access_block": {"bucket"},
    "aws_iam_role": {"assume_role_policy"},
    "aws_iam_role_policy": {"role", "policy"},
    "aws_sagemaker_model": {"execution_role_arn"},
    "aws_sagemaker_endpoint_configuration": {"production_variants"},
    "aws_sagemaker_endpoint": {"endpoint_config_name"},
    "aws_appautoscaling_target": {"max_capacity", "min_capacity", "resource_id", "scalable_dimension",
                                  "service_namespace"},
    "aws_appautoscaling_policy": {"name", "resource_id", "scalable_dimension", "service_namespace"},
}
PROVIDER_ARGS = {"google": {"project", "region"}, "aws": {"region"}}


def unq(s):
    return s[1:-1] if isinstance(s, str) and len(s) >= 2 and s[0] == s[-1] == '"' else s


def parse_dir(path):
    """{block kind: [(labels..., body)]} over every .tf file, with the raw text."""
    blocks, text = {}, ""
    for tf in sorted(glob.glob(os.path.join(path, "*.tf"))):
        raw = open(tf).read()
        text += raw
        with open(tf) as f:
            doc = hcl2.load(f)
        for kind, items in doc.items():
            for item in items:
                blocks.setdefault(kind, []).append(item)
    return blocks, text


def labelled(items, depth):
    """Flattens [{label: {label: body}}] into [(labels, body)]."""
    out = []
    for item in items:
        stack = [((), item)]
        while stack:
            labels, node = stack.pop()
            if len(labels) == depth:
                out.append((labels, node))
                continue
            for k, v in node.items():
                if k != "__is_block__":
                    stack.append((labels + (unq(k),), v))
    return out


def variables(path):
    blocks, _ = parse_dir(path)
    return {labels[0]: body for labels, body in labelled(blocks.get("variable", []), 1)}


@pytest.mark.parametrize("module", MODULES, ids=os.path.basename)
def test_modules_use_and_document_every_variable(module):
    blocks, _ = parse_dir(module)
    declared = variables(module)
    assert declared, "a module without variables"
    body = "".join(open(f).read() for f in glob.glob(os.path.join(module, "*.tf*")) if not f.endswith("variables.tf"))
    for name, v in declared.items():
        assert unq(v.get("description", "")).strip(), f"variable {name} has no description"
        assert "type" in v, f"variable {name} has no type"
        assert re.search(rf"\bvar\.{name}\b", body), f"variable {name} is never used"
    outputs = labelled(blocks.get("output", []), 1)
    assert outputs, "a module without outputs"
    for (name,), o in outputs:
        assert unq(o.get("description", "")).strip() and "value" in o, f"output {name}"


@pytest.mark.parametrize("path", MODULES + EXAMPLES, ids=lambda p: os.path.relpath(p, TERRAFORM))
def test_providers_and_required_arguments(path):
    blocks, _ = parse_dir(path)
    required = {}
    for t in blocks.get("terraform", []):
        assert unq(t.get("required_version", "")).startswith(">=")
        for rp in t.get("required_providers", []):
            for name, spec in rp.items():
                if name != "__is_block__":
                    required[name] = spec
    resources = labelled(blocks.get("resource", []), 2)
    data = labelled(blocks.get("data", []), 2)
    for (kind, name), body in resources + data:
        provider = kind.split("_")[0]
        if provider != "terraform":
            assert provider in required, f"{kind}.{name}: provider {provider} is not in required_providers"
            assert unq(required[provider]["source"]) == f"hashicorp/{provider}" and unq(required[provider]["version"])
    for (kind, name), body in resources:
        assert kind in REQUIRED, f"resource type {kind} is not in the REQUIRED table of this test"
        missing = REQUIRED[kind] - set(body)
        assert not missing, f"{kind}.{name} lacks {missing}"
    for (name,), body in labelled(blocks.get("provider", []), 1):
        missing = PROVIDER_ARGS.get(name, set()) - set(body)
        assert not missing, f"provider {name} lacks {missing}"


@pytest.mark.parametrize("example", EXAMPLES, ids=os.path.basename)
def test_examples_call_their_module_with_what_it_needs(example):
    blocks, _ = parse_dir(example)
    calls = labelled(blocks.get("module", []), 1)
    assert calls, "an example without a module"
    for (name,), call in calls:
        source = os.path.normpath(os.path.join(example, unq(call["source"])))
        assert os.path.isdir(source), f"module {name}: {source} does not exist"
        declared = variables(source)
        given = {k for k in call if k not in ("source", "__is_block__")}
        assert not given - set(declared), f"module {name}: unknown arguments {given - set(declared)}"
        needed = {k for k, v in declared.items() if "default" not in v}
        assert not needed - given, f"module {name}: missing required {needed - given}"
    assert labelled(blocks.get("provider", []), 1), "an example configures its provider"


def test_vertex_dry_run_with_a_grpc_port_makes_a_dedicated_endpoint():
    commands, _ = dry_run("vertex/deploy.sh", "--project", "p", "--region", "r", "--model-uri", "gs://m/r",
                          "--grpc-port", "8500")
    upload = find(commands, "gcloud", "ai", "models", "upload")
    assert flag(upload, "--container-grpc-ports") == "8500"
    assert "FERRY_VERTEX_AI_GRPC_PORT=8500" in flag(upload, "--container-env-vars")
    create = find(commands, "curl")
    assert any("dedicatedEndpointEnabled" in part for part in create)
    deploy = find(commands, "gcloud", "ai", "endpoints", "deploy-model")
    assert deploy[4] == "ENDPOINT_ID"
