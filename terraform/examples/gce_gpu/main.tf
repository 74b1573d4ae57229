# GPU VMs running ferry behind an autoscaler on its queue signal.
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
  description = "Region with the GPU type available."
  type        = string
  default     = "us-central1"
}

variable "image_uri" {
  description = "ferry's image in Artifact Registry."
  type        = string
}

module "ferry" {
  source                = "../../modules/gce_gpu_group"
  project               = var.project
  region                = var.region
  image_uri             = var.image_uri
  artifact_repository   = "ferry"
  model_bucket          = "${var.project}-ferry-gpu-models"
  machine_type          = "g2-standard-8"
  accelerator_type      = "nvidia-l4"
  min_replicas          = 1
  max_replicas          = 4
  target_inference_load = 8
}

output "instance_group" {
  description = "Add it as a backend of a load balancer."
  value       = module.ferry.instance_group
}

output "model_repository_uri" {
  description = "Upload the model repository here; instances poll it."
  value       = module.ferry.model_repository_uri
}
