# A Vertex AI endpoint serving the model repository uploaded to the bucket this creates.
#   terraform init && terraform apply -var project=my-project -var image_uri=REGION-docker.pkg.dev/...
terraform {
  required_version = ">= 1.5"
  required_providers {
    google = {
      source  = "hashicorp/google"
      version = ">= 5.0"
    }
  }
}

provider "google" {
  project = var.project
  region  = var.region
}

variable "project" {
  description = "Google Cloud project."
  type        = string
}

variable "region" {
  description = "Vertex AI region."
  type        = string
  default     = "us-central1"
}

variable "image_uri" {
  description = "ferry's image in Artifact Registry."
  type        = string
}

module "ferry" {
  source       = "../../modules/vertex_endpoint"
  project      = var.project
  region       = var.region
  image_uri    = var.image_uri
  model_bucket = "${var.project}-ferry-models"
  min_replicas = 1
  max_replicas = 3
}

output "endpoint_id" {
  description = "The endpoint to call."
  value       = module.ferry.endpoint_id
}

output "model_repository_uri" {
  description = "Upload the model repository here (before apply deploys it)."
  value       = module.ferry.model_repository_uri
}
