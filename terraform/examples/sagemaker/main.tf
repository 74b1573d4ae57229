# A SageMaker endpoint with autoscaling, serving the model repository in the bucket this creates.
#   terraform init && terraform apply -var image_uri=ACCOUNT.dkr.ecr.REGION.amazonaws.com/ferry:TAG
terraform {
  required_version = ">= 1.5"
  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.0"
    }
  }
}

provider "aws" {
  region = var.region
}

variable "region" {
  description = "AWS region."
  type        = string
  default     = "us-east-1"
}

variable "image_uri" {
  description = "ferry's image in ECR."
  type        = string
}

variable "ecr_repository" {
  description = "Name of the ECR repository holding the image."
  type        = string
  default     = "ferry"
}

data "aws_caller_identity" "current" {}

data "aws_ecr_repository" "ferry" {
  name = var.ecr_repository
}

module "ferry" {
  source             = "../../modules/sagemaker_endpoint"
  image_uri          = var.image_uri
  ecr_repository_arn = data.aws_ecr_repository.ferry.arn
  model_bucket       = "ferry-models-${data.aws_caller_identity.current.account_id}-${var.region}"
  model_key          = "model_repository/"
  instance_type      = "ml.c6i.xlarge"
  min_instances      = 1
  max_instances      = 4
}

output "endpoint_name" {
  description = "The endpoint to invoke."
  value       = module.ferry.endpoint_name
}

output "model_data_uri" {
  description = "Upload the model repository here before apply creates the endpoint."
  value       = module.ferry.model_data_uri
}
