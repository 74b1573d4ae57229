#!/usr/bin/env bash
# Deploys ferry to a SageMaker real-time endpoint with the AWS CLI: pushes the image to ECR,
# creates the model (a model.tar.gz or an uncompressed S3 prefix holding a Triton model
# repository), the endpoint configuration and the endpoint, then target-tracking autoscaling on
# invocations per instance. --multi-model makes a multi-model endpoint. See sagemaker/README.md.
#
#   sagemaker/deploy.sh --region R --role ARN --model-data s3://bucket/path [options]
#   sagemaker/deploy.sh ... --dry-run     prints the commands instead of running them
set -euo pipefail

usage() {
  cat <<'USAGE'
Required:
  --region REGION            e.g. us-east-1
  --role ARN                 execution role SageMaker assumes (read access to the model data, ECR pull)
  --model-data S3_URI        s3://bucket/model.tar.gz, s3://bucket/prefix/ (uncompressed), or with
                             --multi-model the prefix holding one model.tar.gz per model
Options:
  --image LOCAL_IMAGE        image to push (default ferry:latest)
  --repository NAME          ECR repository (default ferry)
  --name NAME                model, endpoint config and endpoint name (default ferry)
  --instance-type TYPE       default ml.c6i.xlarge
  --min-instances N          default 1
  --max-instances N          default 4
  --invocations-per-instance N  target of SageMakerVariantInvocationsPerInstance per minute (default 1000)
  --default-model NAME       SAGEMAKER_TRITON_DEFAULT_MODEL_NAME, when the repository holds several
  --multi-model              a multi-model endpoint (invoke with --target-model)
  --startup-timeout SECONDS  container start-up health check timeout (default 600)
  --download-timeout SECONDS model data download timeout (default 1200)
  --dry-run                  print the commands, run nothing
USAGE
}

region="" role="" model_data="" image="ferry:latest" repository="ferry" name="ferry" instance_type="ml.c6i.xlarge"
min_instances=1 max_instances=4 target=1000 default_model="" multi_model=false startup=600 download=1200 dry_run=false
while [ $# -gt 0 ]; do
  case "$1" in
    --region) region="$2"; shift 2 ;;
    --role) role="$2"; shift 2 ;;
    --model-data) model_data="$2"; shift 2 ;;
    --image) image="$2"; shift 2 ;;
    --repository) repository="$2"; shift 2 ;;
    --name) name="$2"; shift 2 ;;
    --instance-type) instance_type="$2"; shift 2 ;;
    --min-instances) min_instances="$2"; shift 2 ;;
    --max-instances) max_instances="$2"; shift 2 ;;
    --invocations-per-instance) target="$2"; shift 2 ;;
    --default-model) default_model="$2"; shift 2 ;;
    --multi-model) multi_model=true; shift ;;
    --startup-timeout) startup="$2"; shift 2 ;;
    --download-timeout) download="$2"; shift 2 ;;
    --dry-run) dry_run=true; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown argument: $1" >&2; usage >&2; exit 2 ;;
  esac
done
missing=()
[ -n "$region" ] || missing+=(--region)
[ -n "$role" ] || missing+=(--role)
[ -n "$model_data" ] || missing+=(--model-data)
if [ ${#missing[@]} -gt 0 ]; then
  echo "missing ${missing[*]}" >&2; usage >&2; exit 2
fi
case "$model_data" in s3://*) ;; *) echo "--model-data must be an s3:// URI, got '$model_data'" >&2; exit 2 ;; esac
if [ "$min_instances" -gt "$max_instances" ]; then
  echo "--min-instances ($min_instances) is above --max-instances ($max_instances)" >&2; exit 2
fi

# shellcheck source=scripts/dryrun.sh
source "$(dirname "$0")/../scripts/dryrun.sh"

account=$(capture 123456789012 aws sts get-caller-identity --query Account --output text)
registry="${account}.dkr.ecr.${region}.amazonaws.com"
uri="${registry}/${repository}:$(date +%Y%m%d-%H%M%S)"

# 1. The image, in ECR.
if $dry_run || ! aws ecr describe-repositories --region "$region" --repository-names "$repository" >/dev/null 2>&1; then
  run aws ecr create-repository --region "$region" --repository-name "$repository"
fi
if $dry_run; then
  echo "+ aws ecr get-login-password --region $region | docker login --username AWS --password-stdin $registry"
else
  aws ecr get-login-password --region "$region" | docker login --username AWS --password-stdin "$registry"
fi
run docker tag "$image" "$uri"
run docker push "$uri"

# 2. The model. SageMaker runs `docker run IMAGE serve` with the model data in /opt/ml/model
#    (or, multi-model, loads models through ferry's /models API from /opt/ml/models).
environment="{\"FERRY_LOG_FORMAT\":\"json\""
[ -n "$default_model" ] && environment="${environment},\"SAGEMAKER_TRITON_DEFAULT_MODEL_NAME\":\"${default_model}\""
environment="${environment}}"
if $multi_model; then
  container="{\"Image\":\"${uri}\",\"Mode\":\"MultiModel\",\"ModelDataUrl\":\"${model_data}\",\"Environment\":${environment}}"
elif [[ "$model_data" == *.tar.gz ]]; then
  container="{\"Image\":\"${uri}\",\"ModelDataUrl\":\"${model_data}\",\"Environment\":${environment}}"
else
  # An uncompressed prefix: SageMaker copies the objects as they are (no tarball to build).
  container="{\"Image\":\"${uri}\",\"ModelDataSource\":{\"S3DataSource\":{\"S3Uri\":\"${model_data%/}/\",\"S3DataType\":\"S3Prefix\",\"CompressionType\":\"None\"}},\"Environment\":${environment}}"
fi
run aws sagemaker create-model --region "$region" --model-name "$name" --execution-role-arn "$role" \
  --primary-container "$container"

# 3. Endpoint configuration and endpoint.
variant="{\"VariantName\":\"AllTraffic\",\"ModelName\":\"${name}\",\"InstanceType\":\"${instance_type}\",\"InitialInstanceCount\":${min_instances},\"ContainerStartupHealthCheckTimeoutInSeconds\":${startup}"
$multi_model || variant="${variant},\"ModelDataDownloadTimeoutInSeconds\":${download}"
variant="${variant}}"
run aws sagemaker create-endpoint-config --region "$region" --endpoint-config-name "$name" \
  --production-variants "[${variant}]"
run aws sagemaker create-endpoint --region "$region" --endpoint-name "$name" --endpoint-config-name "$name"
run aws sagemaker wait endpoint-in-service --region "$region" --endpoint-name "$name"

# 4. Autoscaling: track invocations per instance between the bounds.
resource="endpoint/${name}/variant/AllTraffic"
run aws application-autoscaling register-scalable-target --region "$region" --service-namespace sagemaker \
  --resource-id "$resource" --scalable-dimension sagemaker:variant:DesiredInstanceCount \
  --min-capacity "$min_instances" --max-capacity "$max_instances"
run aws application-autoscaling put-scaling-policy --region "$region" --service-namespace sagemaker \
  --resource-id "$resource" --scalable-dimension sagemaker:variant:DesiredInstanceCount \
  --policy-name "${name}-invocations" --policy-type TargetTrackingScaling \
  --target-tracking-scaling-policy-configuration \
  "{\"TargetValue\":${target},\"PredefinedMetricSpecification\":{\"PredefinedMetricType\":\"SageMakerVariantInvocationsPerInstance\"},\"ScaleInCooldown\":300,\"ScaleOutCooldown\":60}"

here="$(cd "$(dirname "$0")" && pwd)"
target_model=""
$multi_model && target_model=" --target-model simple.tar.gz"
echo "endpoint ${name} is in service. Try:"
echo "  aws sagemaker-runtime invoke-endpoint --region ${region} --endpoint-name ${name}${target_model} --content-type application/json --body fileb://${here}/samples/kserve.json /dev/stdout"
echo "  aws sagemaker-runtime invoke-endpoint --region ${region} --endpoint-name ${name}${target_model} --content-type application/json --body fileb://${here}/samples/instances.json /dev/stdout"
