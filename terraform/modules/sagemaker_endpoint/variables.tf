variable "name" {
  description = "Name of the model, endpoint configuration, endpoint and role."
  type        = string
  default     = "ferry"
}

variable "image_uri" {
  description = "ferry's image in ECR (sagemaker/deploy.sh pushes one), for example 123456789012.dkr.ecr.us-east-1.amazonaws.com/ferry:TAG."
  type        = string
}

variable "ecr_repository_arn" {
  description = "ARN of the ECR repository holding the image; the execution role may pull from it only."
  type        = string
}

variable "model_bucket" {
  description = "Name of the bucket created for the model data."
  type        = string
}

variable "model_key" {
  description = "Key of model.tar.gz in the bucket, or a prefix ending in / for an uncompressed model repository (multi-model: the prefix holding one tarball per model)."
  type        = string
  default     = "model_repository/"
}

variable "multi_model" {
  description = "A multi-model endpoint: models are loaded on demand from model_key by the TargetModel of each request."
  type        = bool
  default     = false
}

variable "instance_type" {
  description = "Instance type of each endpoint instance."
  type        = string
  default     = "ml.c6i.xlarge"
}

variable "min_instances" {
  description = "Fewest instances (also the initial count)."
  type        = number
  default     = 1
}

variable "max_instances" {
  description = "Most instances autoscaling adds."
  type        = number
  default     = 4
}

variable "invocations_per_instance" {
  description = "Target of SageMakerVariantInvocationsPerInstance (invocations per instance per minute) that autoscaling tracks."
  type        = number
  default     = 1000
}

variable "default_model" {
  description = "SAGEMAKER_TRITON_DEFAULT_MODEL_NAME: the model invocations go to when the repository holds several."
  type        = string
  default     = ""
}

variable "startup_timeout_seconds" {
  description = "How long SageMaker waits for /ping to answer 200 after the container starts."
  type        = number
  default     = 600
}

variable "download_timeout_seconds" {
  description = "How long SageMaker may take to download the model data to the instance."
  type        = number
  default     = 1200
}
