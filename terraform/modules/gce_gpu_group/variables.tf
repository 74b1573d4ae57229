variable "project" {
  description = "Google Cloud project for the instance group, its bucket and service account."
  type        = string
}

variable "region" {
  description = "Region of the regional managed instance group (instances spread over its zones)."
  type        = string
}

variable "name" {
  description = "Name of the instance group and the resources around it."
  type        = string
  default     = "ferry-gpu"
}

variable "image_uri" {
  description = "ferry's GPU image (container/build.sh --gpu) in Artifact Registry, for example us-central1-docker.pkg.dev/PROJECT/ferry/ferry-gpu:TAG."
  type        = string
}

variable "artifact_repository" {
  description = "Name of the Artifact Registry repository holding the image (in var.region); instances may read only it."
  type        = string
}

variable "model_bucket" {
  description = "Name of the bucket created for the Triton model repository."
  type        = string
}

variable "model_prefix" {
  description = "Folder of the model repository inside the bucket."
  type        = string
  default     = "model_repository"
}

variable "machine_type" {
  description = "Machine type of each instance."
  type        = string
  default     = "g2-standard-8"
}

variable "accelerator_type" {
  description = "GPU type attached to each instance."
  type        = string
  default     = "nvidia-l4"
}

variable "accelerator_count" {
  description = "GPUs per instance."
  type        = number
  default     = 1
}

variable "min_replicas" {
  description = "Fewest instances."
  type        = number
  default     = 1
}

variable "max_replicas" {
  description = "Most instances the autoscaler adds."
  type        = number
  default     = 4
}

variable "target_inference_load" {
  description = "Requests queued or executing per instance (ferry_inference_load) the autoscaler keeps instances at."
  type        = number
  default     = 8
}

variable "network" {
  description = "VPC network of the instances."
  type        = string
  default     = "default"
}

variable "subnetwork" {
  description = "Subnetwork of the instances; empty for the network's default in the region."
  type        = string
  default     = ""
}
