# SageMaker: the model bucket, an execution role that may only read it and pull ferry's image,
# the model, the endpoint configuration and endpoint, and target-tracking autoscaling on
# invocations per instance.

data "aws_partition" "current" {}

resource "aws_s3_bucket" "models" {
  bucket = var.model_bucket
}

resource "aws_s3_bucket_public_access_block" "models" {
  bucket                  = aws_s3_bucket.models.id
  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

data "aws_iam_policy_document" "assume" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["sagemaker.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "execution" {
  name               = "${var.name}-sagemaker-execution"
  assume_role_policy = data.aws_iam_policy_document.assume.json
}

# Least privilege: read the model bucket, pull the one image repository, write its own logs and
# metrics.
data "aws_iam_policy_document" "execution" {
  statement {
    sid       = "ReadModels"
    actions   = ["s3:GetObject"]
    resources = ["${aws_s3_bucket.models.arn}/*"]
  }
  statement {
    sid       = "ListModels"
    actions   = ["s3:ListBucket", "s3:GetBucketLocation"]
    resources = [aws_s3_bucket.models.arn]
  }
  statement {
    sid       = "PullImage"
    actions   = ["ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer", "ecr:BatchCheckLayerAvailability"]
    resources = [var.ecr_repository_arn]
  }
  statement {
    sid       = "EcrLogin"
    actions   = ["ecr:GetAuthorizationToken"]
    resources = ["*"]
  }
  statement {
    sid       = "Logs"
    actions   = ["logs:CreateLogGroup", "logs:CreateLogStream", "logs:PutLogEvents", "logs:DescribeLogStreams"]
    resources = ["arn:${data.aws_partition.current.partition}:logs:*:*:log-group:/aws/sagemaker/*"]
  }
  statement {
    sid       = "Metrics"
    actions   = ["cloudwatch:PutMetricData"]
    resources = ["*"]
  }
}

resource "aws_iam_role_policy" "execution" {
  name   = "${var.name}-sagemaker-execution"
  role   = aws_iam_role.execution.id
  policy = data.aws_iam_policy_document.execution.json
}

locals {
  model_uri  = "s3://${aws_s3_bucket.models.bucket}/${var.model_key}"
  compressed = endswith(var.model_key, ".tar.gz")
  environment = merge(
    { FERRY_LOG_FORMAT = "json" },
    var.default_model == "" ? {} : { SAGEMAKER_TRITON_DEFAULT_MODEL_NAME = var.default_model },
  )
}

resource "aws_sagemaker_model" "ferry" {
  name               = var.name
  execution_role_arn = aws_iam_role.execution.arn

  primary_container {
    image          = var.image_uri
    mode           = var.multi_model ? "MultiModel" : "SingleModel"
    model_data_url = var.multi_model || local.compressed ? local.model_uri : null
    environment    = local.environment

    # An uncompressed model repository: SageMaker copies the prefix as it is.
    dynamic "model_data_source" {
      for_each = var.multi_model || local.compressed ? [] : [local.model_uri]
      content {
        s3_data_source {
          s3_uri           = model_data_source.value
          s3_data_type     = "S3Prefix"
          compression_type = "None"
        }
      }
    }
  }

  depends_on = [aws_iam_role_policy.execution]
}

resource "aws_sagemaker_endpoint_configuration" "ferry" {
  name = var.name

  production_variants {
    variant_name                                      = "AllTraffic"
    model_name                                        = aws_sagemaker_model.ferry.name
    instance_type                                     = var.instance_type
    initial_instance_count                            = var.min_instances
    container_startup_health_check_timeout_in_seconds = var.startup_timeout_seconds
    model_data_download_timeout_in_seconds            = var.multi_model ? null : var.download_timeout_seconds
  }
}

resource "aws_sagemaker_endpoint" "ferry" {
  name                 = var.name
  endpoint_config_name = aws_sagemaker_endpoint_configuration.ferry.name
}

resource "aws_appautoscaling_target" "ferry" {
  service_namespace  = "sagemaker"
  resource_id        = "endpoint/${aws_sagemaker_endpoint.ferry.name}/variant/AllTraffic"
  scalable_dimension = "sagemaker:variant:DesiredInstanceCount"
  min_capacity       = var.min_instances
  max_capacity       = var.max_instances
}

resource "aws_appautoscaling_policy" "invocations" {
  name               = "${var.name}-invocations-per-instance"
  policy_type        = "TargetTrackingScaling"
  service_namespace  = aws_appautoscaling_target.ferry.service_namespace
  resource_id        = aws_appautoscaling_target.ferry.resource_id
  scalable_dimension = aws_appautoscaling_target.ferry.scalable_dimension

  target_tracking_scaling_policy_configuration {
    target_value       = var.invocations_per_instance
    scale_in_cooldown  = 300
    scale_out_cooldown = 60
    predefined_metric_specification {
      predefined_metric_type = "SageMakerVariantInvocationsPerInstance"
    }
  }
}
