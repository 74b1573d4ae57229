#!/usr/bin/env bash
# Deploys ferry to a Vertex AI endpoint with gcloud: pushes the image to Artifact Registry, uploads
# a model whose artifacts are a Triton model repository in Cloud Storage, creates an endpoint and
# deploys the model to it with autoscaling bounds. See vertex/README.md.
#
#   vertex/deploy.sh --project P --region R --model-uri gs://bucket/model_repository [options]
#   vertex/deploy.sh ... --dry-run      prints the commands instead of running them
set -euo pipefail

usage() {
  cat <<'USAGE'
Required:
  --project ID              Google Cloud project
  --region REGION           e.g. us-central1
  --model-uri GS_URI        gs://bucket/prefix holding the model repository (Vertex sets AIP_STORAGE_URI)
Options:
  --image LOCAL_IMAGE       image to push (default ferry:latest)
  --repository NAME         Artifact Registry Docker repository (default ferry)
  --name NAME               model and endpoint display name (default ferry)
  --machine-type TYPE       default n1-standard-4
  --accelerator TYPE,COUNT  e.g. nvidia-tesla-t4,1 (default none)
  --min-replicas N          default 1
  --max-replicas N          default 3
  --target-utilization PCT  CPU (or GPU duty cycle with an accelerator) to scale at (default 60)
  --scale-on METRIC=TARGET  another autoscaling metric, e.g. request-counts-per-minute=3000 (size it
                            from the throughput bench/RESULTS.md measures per replica)
  --default-model NAME      the model predict requests go to, when the repository holds several
  --grpc-port PORT          also serve KServe v2 gRPC through Vertex on PORT (the model's grpcPorts;
                            creates a dedicated endpoint, which gRPC and streamed predictions need)
  --dry-run                 print the commands, run nothing
USAGE
}

project="" region="" model_uri="" image="ferry:latest" repository="ferry" name="ferry"
machine_type="n1-standard-4" accelerator="" min_replicas=1 max_replicas=3 target=60 scale_on="" default_model="" grpc_port="" dry_run=false
while [ $# -gt 0 ]; do
  case "$1" in
    --project) project="$2"; shift 2 ;;
    --region) region="$2"; shift 2 ;;
    --model-uri) model_uri="$2"; shift 2 ;;
    --image) image="$2"; shift 2 ;;
    --repository) repository="$2"; shift 2 ;;
    --name) name="$2"; shift 2 ;;
    --machine-type) machine_type="$2"; shift 2 ;;
    --accelerator) accelerator="$2"; shift 2 ;;
    --min-replicas) min_replicas="$2"; shift 2 ;;
    --max-replicas) max_replicas="$2"; shift 2 ;;
    --target-utilization) target="$2"; shift 2 ;;
    --scale-on) scale_on="$2"; shift 2 ;;
    --default-model) default_model="$2"; shift 2 ;;
    --grpc-port) grpc_port="$2"; shift 2 ;;
    --dry-run) dry_run=true; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown argument: $1" >&2; usage >&2; exit 2 ;;
  esac
done
missing=()
[ -n "$project" ] || missing+=(--project)
[ -n "$region" ] || missing+=(--region)
[ -n "$model_uri" ] || missing+=(--model-uri)
if [ ${#missing[@]} -gt 0 ]; then
  echo "missing ${missing[*]}" >&2; usage >&2; exit 2
fi
case "$model_uri" in gs://*) ;; *) echo "--model-uri must be a gs:// URI, got '$model_uri'" >&2; exit 2 ;; esac
case "$scale_on" in ""|*=*) ;; *) echo "--scale-on takes METRIC=TARGET, got '$scale_on'" >&2; exit 2 ;; esac
if [ "$min_replicas" -gt "$max_replicas" ]; then
  echo "--min-replicas ($min_replicas) is above --max-replicas ($max_replicas)" >&2; exit 2
fi

# shellcheck source=scripts/dryrun.sh
source "$(dirname "$0")/../scripts/dryrun.sh"

registry="${region}-docker.pkg.dev"
uri="${registry}/${project}/${repository}/ferry:$(date +%Y%m%d-%H%M%S)"

# 1. The image, in Artifact Registry.
if $dry_run || ! gcloud artifacts repositories describe "$repository" --project "$project" --location "$region" >/dev/null 2>&1; then
  run gcloud artifacts repositories create "$repository" --project "$project" --location "$region" \
    --repository-format docker --description "ferry model server images"
fi
run gcloud auth configure-docker "$registry" --quiet
run docker tag "$image" "$uri"
run docker push "$uri"

# 2. The model: ferry's image, serving the repository Vertex copies from --artifact-uri (Vertex
#    passes it as AIP_STORAGE_URI; ferry streams it). Vertex's own health and predict routes and
#    port 8080 are what ferry listens on.
env_vars="FERRY_LOG_FORMAT=json"
[ -n "$default_model" ] && env_vars="${env_vars},FERRY_VERTEX_AI_DEFAULT_MODEL=${default_model}"
grpc_ports=()
if [ -n "$grpc_port" ]; then
  env_vars="${env_vars},FERRY_VERTEX_AI_GRPC_PORT=${grpc_port}"
  grpc_ports=(--container-grpc-ports "$grpc_port")
fi
model_id=$(capture MODEL_ID gcloud ai models upload --project "$project" --region "$region" \
  --display-name "$name" --container-image-uri "$uri" --artifact-uri "$model_uri" \
  --container-ports 8080 "${grpc_ports[@]}" --container-env-vars "$env_vars" --format 'value(model)')
model_id="${model_id##*/}"

# 3. The endpoint, and the model deployed to it with autoscaling bounds.
if [ -n "$grpc_port" ]; then
  # A dedicated endpoint (gRPC and streamed predictions need one), through the REST API: gcloud's
  # support for the flag varies by release. The answer is an operation named after the endpoint.
  token=$(capture TOKEN gcloud auth print-access-token)
  created=$(capture "projects/${project}/locations/${region}/endpoints/ENDPOINT_ID" curl -sf -X POST \
    -H "Authorization: Bearer ${token}" -H "Content-Type: application/json" \
    "https://${region}-aiplatform.googleapis.com/v1/projects/${project}/locations/${region}/endpoints" \
    -d "{\"displayName\": \"${name}\", \"dedicatedEndpointEnabled\": true}")
  endpoint_id="${created##*/endpoints/}"
  endpoint_id="${endpoint_id%%[!0-9A-Z_]*}"
else
  endpoint_id=$(capture ENDPOINT_ID gcloud ai endpoints create --project "$project" --region "$region" \
    --display-name "$name" --format 'value(name)')
fi
endpoint_id="${endpoint_id##*/}"
deploy=(gcloud ai endpoints deploy-model "$endpoint_id" --project "$project" --region "$region"
  --model "$model_id" --display-name "$name" --machine-type "$machine_type"
  --min-replica-count "$min_replicas" --max-replica-count "$max_replicas" --traffic-split "0=100")
metric="cpu-usage=${target}"
if [ -n "$accelerator" ]; then
  deploy+=(--accelerator "type=${accelerator%,*},count=${accelerator#*,}")
  # Both, as Vertex does by default with a GPU: CPU alone would not see a busy GPU.
  metric="cpu-usage=${target},gpu-duty-cycle=${target}"
fi
deploy+=(--autoscaling-metric-specs "${scale_on:-$metric}")
run "${deploy[@]}"

# 4. Calls: Vertex's instances format, and KServe v2 through rawPredict.
here="$(cd "$(dirname "$0")" && pwd)"
echo "endpoint ${endpoint_id} serves model ${model_id}. Try:"
echo "  gcloud ai endpoints predict ${endpoint_id} --project ${project} --region ${region} --json-request ${here}/samples/instances.json"
echo "  gcloud ai endpoints raw-predict ${endpoint_id} --project ${project} --region ${region} --http-headers Content-Type=application/json --request @${here}/samples/kserve.json"
